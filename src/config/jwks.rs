//! The JWKS file of `[auth.jwt] jwks_path`: the identity provider's public keys, read at load
//! and on every reload. A key that cannot verify anything, or a symmetric or private key
//! (which would let whoever reads the file mint tokens), is a config error naming the file and
//! the key.

use std::path::Path;

use jsonwebtoken::jwk::JwkSet;

use super::error::ConfigError;
use crate::remote_jwks::{classify, Verdict};

/// Reads and checks a JWKS file; `algorithms` are the configured ones (for messages). With the
/// set, a warning for each key left out as not for signing (an encryption key).
pub fn load(
    path: &Path,
    algorithms: &[String],
) -> Result<(JwkSet, Vec<ConfigError>), Vec<ConfigError>> {
    let error = |position, key: Option<String>, message: String| ConfigError {
        file: path.to_path_buf(),
        position,
        route: key,
        message,
    };
    let source = super::read_named_text(path).map_err(|e| match e {
        super::NotRead::NotUtf8(at) => vec![error(
            Some(at),
            None,
            "the JWKS file is not UTF-8 here: JSON is UTF-8 (re-save it so)".into(),
        )],
        super::NotRead::Io(e) => vec![error(None, None, format!("cannot read the JWKS file: {e}"))],
    })?;
    let set: JwkSet = serde_json::from_str(&source).map_err(|e| {
        vec![error(
            // serde_json counts a column 0 at a line's start (the file's end after a newline).
            Some((e.line(), e.column().max(1))),
            None,
            format!("not a JWKS ({e}): expected {{\"keys\": [...]}} of JSON Web Keys"),
        )]
    })?;
    if set.keys.is_empty() {
        return Err(vec![error(None, None, "the JWKS holds no keys".into())]);
    }
    let private = crate::remote_jwks::private_keys(source.as_bytes());
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        let label = match &jwk.common.key_id {
            Some(kid) => format!("keys[{i}] (kid \"{kid}\")"),
            None => format!("keys[{i}]"),
        };
        match classify(jwk, private.get(i).copied().unwrap_or(false)) {
            Verdict::Private => errors.push(error(None, Some(label), "holds a private key (\"d\"): a JWKS of public keys must not, as anyone reading the file could sign tokens; publish the public key only".into())),
            Verdict::Symmetric => errors.push(error(None, Some(label), "a symmetric key (kty \"oct\") does not belong in a JWKS of public keys: anyone reading the file could sign tokens; HS* algorithms use auth.jwt.secret_env or secret_file".into())),
            Verdict::NotForSigning(why) => warnings.push(error(
                None,
                Some(label),
                format!("left out: {why}; no token is verified with it"),
            )),
            Verdict::Unusable(why) => errors.push(error(
                None,
                Some(label),
                format!(
                    "cannot be used to verify tokens ({why}); auth.jwt.algorithms is [{}]",
                    algorithms.join(", ")
                ),
            )),
            Verdict::Verifies(_) => {}
        }
    }
    let keys = crate::remote_jwks::verify_keys(&set);
    if errors.is_empty() && keys.is_empty() {
        errors.push(error(None, None, "the JWKS holds no key that verifies signatures (every key is marked \"use\": \"enc\", or pinned to an algorithm that signs nothing)".into()));
    }
    if errors.is_empty() {
        warnings.extend(
            not_as_meant(&set, &keys, algorithms)
                .into_iter()
                .map(|(key, message)| error(None, key, message)),
        );
        Ok((set, warnings))
    } else {
        Err(errors)
    }
}

/// What loads but perhaps not as meant: an asymmetric algorithm of `auth.jwt.algorithms` no
/// key of the set verifies (its tokens all get 401), a key pinned to an algorithm that is
/// not listed (it verifies no token), two keys of one `kid`. Each with the key it is about.
fn not_as_meant(
    set: &JwkSet,
    keys: &[crate::remote_jwks::VerifyKey],
    algorithms: &[String],
) -> Vec<(Option<String>, String)> {
    let mut said = Vec::new();
    let listed: Vec<jsonwebtoken::Algorithm> =
        algorithms.iter().filter_map(|a| a.parse().ok()).collect();
    for alg in listed
        .iter()
        .filter(|a| a.family() != jsonwebtoken::AlgorithmFamily::Hmac)
    {
        let verified = keys.iter().any(|(_, pinned, key)| {
            pinned.is_none_or(|p| p == *alg) && key.family() == alg.family()
        });
        if !verified {
            said.push((None, format!("auth.jwt.algorithms lists {alg:?} but no key of the JWKS verifies it: {alg:?} tokens get 401")));
        }
    }
    let mut kids = std::collections::HashMap::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        let kid = jwk.common.key_id.as_deref();
        let label = match kid {
            Some(kid) => format!("keys[{i}] (kid \"{kid}\")"),
            None => format!("keys[{i}]"),
        };
        if let Some(first) = kid.and_then(|kid| kids.insert(kid, i)) {
            said.push((
                Some(label.clone()),
                format!("has the kid of keys[{first}]: a token naming it is tried against both"),
            ));
        }
        let pinned = jwk
            .common
            .key_algorithm
            .and_then(|a| a.to_string().parse::<jsonwebtoken::Algorithm>().ok());
        if let Some(p) = pinned.filter(|p| !listed.contains(p)) {
            said.push((Some(label), format!("is pinned to {p:?}, which auth.jwt.algorithms does not list: no token is verified with it")));
        }
    }
    said
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test keys' JWKS (`tests/fixtures/jwt/jwks.json`).
    fn fixture() -> serde_json::Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jwt/jwks.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn check(json: &str) -> Result<JwkSet, Vec<String>> {
        checked(json).map(|(set, _)| set)
    }

    /// The set and its warnings, or the errors; each as `check` prints it.
    fn checked(json: &str) -> Result<(JwkSet, Vec<String>), Vec<String>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jwks.json");
        std::fs::write(&path, json).unwrap();
        let said = |list: Vec<ConfigError>| -> Vec<String> {
            list.iter()
                .map(|e| {
                    e.to_string()
                        .replace(&path.display().to_string(), "jwks.json")
                })
                .collect()
        };
        load(&path, &["RS256".into()])
            .map(|(set, warnings)| (set, said(warnings)))
            .map_err(said)
    }

    #[test]
    fn the_fixture_set_loads_and_bad_files_are_named() {
        let fixture = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jwt/jwks.json"),
        )
        .unwrap();
        assert_eq!(check(&fixture).unwrap().keys.len(), 4);
        let errors =
            check("{\"keys\": [\n  {\"kty\": \"oct\", \"kid\": \"s\", \"k\": \"c2VjcmV0\"}\n]}")
                .unwrap_err();
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].starts_with("jwks.json: keys[0] (kid \"s\"): a symmetric key"),
            "{errors:?}"
        );
        // A key that came with its private half, as a key generator writes it.
        let mut with_private: serde_json::Value = serde_json::from_str(&fixture).unwrap();
        with_private["keys"][0]["d"] = "c2VjcmV0".into();
        let errors = check(&with_private.to_string()).unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("jwks.json: keys[0]")
                && errors[0].contains("holds a private key"),
            "{errors:?}"
        );
        let errors = check("{\"keys\": [}").unwrap_err();
        assert!(
            errors[0].starts_with("jwks.json:1:11: not a JWKS"),
            "{errors:?}"
        );
        let errors = check("{\"keys\": []}").unwrap_err();
        assert_eq!(errors, vec!["jwks.json: the JWKS holds no keys".to_owned()]);
        // Keys the library would load and never verify with.
        for (jwk, why) in [
            (
                r#"{"kty":"EC","crv":"P-256","kid":"e","x":"AAAA","y":"AAAA"}"#,
                "its point is not on its curve",
            ),
            (
                r#"{"kty":"RSA","kid":"r","n":"AQAB","e":"AQAB"}"#,
                "an RSA modulus of 17 bits",
            ),
            (
                r#"{"kty":"OKP","crv":"Ed25519","kid":"o","x":"AAAA"}"#,
                "an Ed25519 key is 32 bytes",
            ),
            // Keys of no kind the library reads, said in the key's own terms.
            (
                r#"{"kty":"OKP","crv":"Ed448","kid":"o","x":"AAAA"}"#,
                "an \"OKP\" key on curve \"Ed448\"",
            ),
            (
                r#"{"kty":"RSA","kid":"r","x5c":["MIIB"]}"#,
                "an \"RSA\" key without its public parameters \"n\" and \"e\" (a key given only as a certificate chain",
            ),
            (
                r#"{"kty":"PQC","kid":"p","x":"AAAA"}"#,
                "kty \"PQC\" is not a kind of key",
            ),
        ] {
            let errors = check(&format!("{{\"keys\": [{jwk}]}}")).unwrap_err();
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert!(
                errors[0].contains("cannot be used to verify tokens") && errors[0].contains(why),
                "{errors:?}"
            );
        }
    }

    #[test]
    fn a_key_pinned_to_an_algorithm_of_another_kind_is_named() {
        let fixture = fixture();
        let key = |kid: &str| {
            fixture["keys"]
                .as_array()
                .unwrap()
                .iter()
                .find(|k| k["kid"] == kid)
                .unwrap()
                .clone()
        };
        // Pins that fit load; every other signing pin is the key's error; an encryption pin
        // is not (the key is left out, as a key marked "use": "enc" is).
        for (kid, alg, fits) in [
            ("rsa-2", "PS384", true),
            ("ec-1", "ES256", true),
            ("ed-1", "EdDSA", true),
            ("rsa-2", "ES256", false),
            ("rsa-2", "HS256", false),
            ("ec-1", "ES384", false),
            ("ec-1", "RS256", false),
            ("ed-1", "ES256", false),
        ] {
            let mut pinned = key(kid);
            pinned["alg"] = alg.into();
            let set = serde_json::json!({"keys": [pinned, key("rsa-1")]}).to_string();
            match check(&set) {
                Ok(_) => assert!(fits, "{kid} pinned to {alg} was accepted"),
                Err(errors) => {
                    assert!(!fits, "{kid} pinned to {alg}: {errors:?}");
                    assert_eq!(errors.len(), 1, "{errors:?}");
                    assert!(
                        errors[0].starts_with(&format!("jwks.json: keys[0] (kid \"{kid}\")"))
                            && errors[0].contains(&format!("pinned to \"alg\": \"{alg}\"")),
                        "{errors:?}"
                    );
                }
            }
        }
    }

    /// Keys an identity provider publishes beside its signing keys load, left out with a
    /// warning each; a key that could only forge is an error.
    /// A set that loads but perhaps not as meant is warned of: an algorithm no key
    /// verifies, a `kid` given twice, a key pinned to an algorithm not listed.
    #[test]
    fn a_set_that_loads_but_not_as_meant_is_warned_of() {
        let fixture = fixture();
        let rsa = fixture["keys"][0].clone();
        let mut twin = fixture["keys"][1].clone();
        twin["kid"] = "rsa-1".into();
        let mut pinned = fixture["keys"][1].clone();
        pinned["kid"] = "ps".into();
        pinned["alg"] = "PS512".into();
        // Without a kid too.
        let mut unnamed = pinned.clone();
        unnamed.as_object_mut().unwrap().remove("kid");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("jwks.json");
        let set = serde_json::json!({"keys": [rsa, twin, pinned, unnamed]});
        std::fs::write(&path, set.to_string()).unwrap();
        let (_, warnings) = load(&path, &["RS256".into(), "ES256".into()]).unwrap();
        let said: Vec<String> = (warnings.iter())
            .map(|w| {
                w.to_string()
                    .replace(&path.display().to_string(), "jwks.json")
            })
            .collect();
        assert_eq!(
            said,
            [
                "jwks.json: auth.jwt.algorithms lists ES256 but no key of the JWKS verifies it: ES256 tokens get 401",
                "jwks.json: keys[1] (kid \"rsa-1\"): has the kid of keys[0]: a token naming it is tried against both",
                "jwks.json: keys[2] (kid \"ps\"): is pinned to PS512, which auth.jwt.algorithms does not list: no token is verified with it",
                "jwks.json: keys[3]: is pinned to PS512, which auth.jwt.algorithms does not list: no token is verified with it",
            ]
        );
    }

    #[test]
    fn keys_not_for_signing_are_left_out_with_a_warning() {
        let fixture = fixture();
        let rsa = fixture["keys"][0].clone();
        let with = |field: &str, value: serde_json::Value| {
            let mut key = rsa.clone();
            key[field] = value;
            key["kid"] = "x".into();
            key
        };
        for (key, why) in [
            (with("use", "enc".into()), r#"it is marked "use": "enc""#),
            (
                with("alg", "RSA-OAEP".into()),
                r#"it is pinned to an encryption "alg""#,
            ),
            (
                with("alg", "XX999".into()),
                r#"it is pinned to an "alg" this gateway does not know"#,
            ),
            (
                with("key_ops", serde_json::json!(["encrypt"])),
                r#"its "key_ops" do not include "verify""#,
            ),
        ] {
            let set = serde_json::json!({"keys": [key, rsa]}).to_string();
            let (set, warnings) = checked(&set).unwrap();
            assert_eq!(
                warnings,
                [format!(
                    "jwks.json: keys[0] (kid \"x\"): left out: {why}; no token is verified with it"
                )]
            );
            assert_eq!(crate::remote_jwks::verify_keys(&set).len(), 1);
        }
        // A private key is an error whatever it is marked for.
        let mut private = with("use", "enc".into());
        private["d"] = "c2VjcmV0".into();
        let errors = check(&serde_json::json!({"keys": [private, rsa]}).to_string()).unwrap_err();
        assert!(errors[0].contains("holds a private key"), "{errors:?}");
        let verifying = with("key_ops", serde_json::json!(["verify"]));
        let (_, warnings) = checked(&serde_json::json!({"keys": [verifying]}).to_string()).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        // An exponent of one: every message is its own signature.
        let errors =
            check(&serde_json::json!({"keys": [with("e", "AQ".into())]}).to_string()).unwrap_err();
        assert!(errors[0].contains("an RSA exponent of one"), "{errors:?}");
        // Even (2), or past 2^33 - 1 (2^40 + 1): no verifier takes it, said at load.
        for e in ["Ag", "AQAAAAAB"] {
            let errors =
                check(&serde_json::json!({"keys": [with("e", e.into())]}).to_string()).unwrap_err();
            assert!(
                errors[0].contains("an RSA exponent that is even, below 3 or past 2^33 - 1"),
                "{e}: {errors:?}"
            );
        }
        // Its modulus and exponent written with leading zero bytes: the same key, loaded.
        let n = rsa["n"].as_str().unwrap();
        let padded_n = {
            use base64::Engine;
            let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
            let mut bytes = vec![0u8];
            bytes.extend(engine.decode(n).unwrap());
            engine.encode(bytes)
        };
        let mut padded = rsa.clone();
        padded["n"] = padded_n.into();
        padded["e"] = "AAEAAQ".into();
        let (_, warnings) = checked(&serde_json::json!({"keys": [padded]}).to_string()).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
    }
}
