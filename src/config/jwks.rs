//! The JWKS file of `[auth.jwt] jwks_path`: the identity provider's public keys, read at load
//! and on every reload. A key that cannot verify anything, or a symmetric or private key
//! (which would let whoever reads the file mint tokens), is a config error naming the file and
//! the key.

use std::path::Path;

use jsonwebtoken::jwk::{AlgorithmParameters, JwkSet};
use jsonwebtoken::DecodingKey;

use super::error::ConfigError;

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
    let source = std::fs::read_to_string(path)
        .map_err(|e| vec![error(None, None, format!("cannot read the JWKS file: {e}"))])?;
    let set: JwkSet = serde_json::from_str(&source).map_err(|e| {
        vec![error(
            Some((e.line(), e.column())),
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
        if private.get(i).copied().unwrap_or(false) {
            errors.push(error(None, Some(label), "holds a private key (\"d\"): a JWKS of public keys must not, as anyone reading the file could sign tokens; publish the public key only".into()));
            continue;
        }
        if matches!(jwk.algorithm, AlgorithmParameters::OctetKey(_)) {
            errors.push(error(None, Some(label), "a symmetric key (kty \"oct\") does not belong in a JWKS of public keys: anyone reading the file could sign tokens; HS* algorithms use auth.jwt.secret_env".into()));
            continue;
        }
        // After the private and symmetric checks: such a key is an error whatever it is
        // marked for.
        if let Some(why) = crate::remote_jwks::not_for_signing(jwk) {
            warnings.push(error(
                None,
                Some(label),
                format!("left out: {why}; no token is verified with it"),
            ));
            continue;
        }
        let why = match DecodingKey::from_jwk(jwk) {
            Err(e) => Some(e.to_string()),
            Ok(key) => crate::remote_jwks::unusable(jwk, &key),
        };
        if let Some(why) = why {
            errors.push(error(
                None,
                Some(label),
                format!(
                    "cannot be used to verify tokens ({why}); auth.jwt.algorithms is [{}]",
                    algorithms.join(", ")
                ),
            ));
        }
    }
    if errors.is_empty() && crate::remote_jwks::verify_keys(&set).is_empty() {
        errors.push(error(None, None, "the JWKS holds no key that verifies signatures (every key is marked \"use\": \"enc\", or pinned to an algorithm that signs nothing)".into()));
    }
    if errors.is_empty() {
        Ok((set, warnings))
    } else {
        Err(errors)
    }
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
    }
}
