//! The JWT path on arbitrary bearer tokens, with an HS256 secret and the test JWKS of
//! `tests/fixtures/jwt` configured: never a panic, and no input forged without a key is ever
//! accepted.

#![no_main]

use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use sentinel_gateway::config::{JwtConfig, Secret};
use sentinel_gateway::identity::JwtVerifier;

fn verifier() -> &'static JwtVerifier {
    static V: OnceLock<JwtVerifier> = OnceLock::new();
    V.get_or_init(|| {
        let jwks = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/jwt/jwks.json"
        ))
        .expect("the test JWKS");
        JwtVerifier::new(&JwtConfig {
            secret_env: "X".into(),
            algorithms: ["HS256", "RS256", "PS256", "ES256", "EdDSA"]
                .map(String::from)
                .to_vec(),
            secret: Some(Secret(Arc::from(&b"0123456789abcdef0123456789abcdef"[..]))),
            jwks: Some(Arc::new(serde_json::from_slice(&jwks).expect("a JWKS"))),
            jwks_path: None,
            jwks_url: None,
            jwks_refresh: std::time::Duration::from_secs(300),
            issuer: None,
            audiences: Vec::new(),
            leeway_secs: 30,
            identity_claim: "sub".into(),
        }, None)
        .expect("a verifier")
    })
}

fuzz_target!(|data: &[u8]| {
    let token = String::from_utf8_lossy(data);
    assert_eq!(verifier().subject(&token), None, "a token no key signed was accepted");
});
