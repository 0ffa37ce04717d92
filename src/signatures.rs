//! JWT signatures verified with ring, the cryptography the TLS listeners already use, in place
//! of `jsonwebtoken`'s pure-Rust backend: a token is verified on each request it comes with,
//! so the verification is most of what a JWT route costs, and a flood of tokens with bad
//! signatures costs the gateway what each one's check does. Measured (`cargo bench --bench
//! hot_path jwt_verify`, docs/benchmarks.md "JWT signatures"): RS256 24 us against 81, ES256
//! 55 against 293, ES384 776 against 888. Ed25519 stays the crate's (35 us against ring's
//! 48), as do signing (the tests' tokens) and the JWK utilities.
//!
//! [`install`] makes it the process's provider, before the first token is verified.

use jsonwebtoken::crypto::{CryptoProvider, JwtVerifier};
use jsonwebtoken::signature::{Error, Verifier};
use jsonwebtoken::{Algorithm, DecodingKey, DecodingKeyKind};
use ring::signature as sig;

/// Installs the provider once for the process, before anything of `jsonwebtoken` runs (the
/// command line does it first; the JWT verifier again): the crate settles on its own
/// provider at its first use, and refuses another after.
pub fn install() {
    static PROVIDER: std::sync::OnceLock<&'static CryptoProvider> = std::sync::OnceLock::new();
    PROVIDER.get_or_init(|| {
        let crate_own = &jsonwebtoken::crypto::rust_crypto::DEFAULT_PROVIDER;
        let provider: &'static CryptoProvider = Box::leak(Box::new(CryptoProvider {
            signer_factory: crate_own.signer_factory,
            verifier_factory: verifier,
            key_utils: crate_own.key_utils.clone(),
        }));
        if provider.install_default().is_err() {
            // Verified all the same, by the crate's own code: slower, not wrong.
            tracing::debug!("jsonwebtoken's provider was settled before ring's could be installed");
        }
        provider
    });
}

/// The verifier of `algorithm` for `key`: the key's bytes (a JWK's RSA modulus and exponent,
/// an EC point, an Ed25519 key, an HMAC secret) are checked against the signature by ring.
fn verifier(
    algorithm: &Algorithm,
    key: &DecodingKey,
) -> jsonwebtoken::errors::Result<Box<dyn JwtVerifier>> {
    use jsonwebtoken::errors::ErrorKind;
    // Ed25519 is the one the crate's own verifier does faster (35 us against ring's 48).
    if *algorithm == Algorithm::EdDSA {
        return (jsonwebtoken::crypto::rust_crypto::DEFAULT_PROVIDER.verifier_factory)(
            algorithm, key,
        );
    }
    let kind = match (algorithm.family(), key.family()) {
        (wanted, had) if wanted != had => return Err(ErrorKind::InvalidKeyFormat.into()),
        _ => key.kind().clone(),
    };
    Ok(Box::new(RingVerifier {
        algorithm: *algorithm,
        key: kind,
    }))
}

struct RingVerifier {
    algorithm: Algorithm,
    key: DecodingKeyKind,
}

impl RingVerifier {
    fn check(&self, message: &[u8], signature: &[u8]) -> Result<(), ring::error::Unspecified> {
        use Algorithm as A;
        let rsa: &'static sig::RsaParameters = match self.algorithm {
            A::HS256 | A::HS384 | A::HS512 => {
                let hash = match self.algorithm {
                    A::HS256 => ring::hmac::HMAC_SHA256,
                    A::HS384 => ring::hmac::HMAC_SHA384,
                    _ => ring::hmac::HMAC_SHA512,
                };
                let DecodingKeyKind::SecretOrDer(secret) = &self.key else {
                    return Err(ring::error::Unspecified);
                };
                return ring::hmac::verify(&ring::hmac::Key::new(hash, secret), message, signature);
            }
            A::ES256 | A::ES384 => {
                let curve: &'static dyn sig::VerificationAlgorithm = match self.algorithm {
                    A::ES256 => &sig::ECDSA_P256_SHA256_FIXED,
                    _ => &sig::ECDSA_P384_SHA384_FIXED,
                };
                let DecodingKeyKind::SecretOrDer(point) = &self.key else {
                    return Err(ring::error::Unspecified);
                };
                return sig::UnparsedPublicKey::new(curve, point).verify(message, signature);
            }
            A::RS256 => &sig::RSA_PKCS1_2048_8192_SHA256,
            A::RS384 => &sig::RSA_PKCS1_2048_8192_SHA384,
            A::RS512 => &sig::RSA_PKCS1_2048_8192_SHA512,
            A::PS256 => &sig::RSA_PSS_2048_8192_SHA256,
            A::PS384 => &sig::RSA_PSS_2048_8192_SHA384,
            A::PS512 => &sig::RSA_PSS_2048_8192_SHA512,
            // An algorithm the crate adds later verifies nothing here.
            _ => return Err(ring::error::Unspecified),
        };
        match &self.key {
            // ring refuses a modulus or exponent written with leading zero bytes, which some
            // identity providers publish (Java's `BigInteger.toByteArray()` gives a 257-byte
            // modulus); the number is the same without them.
            DecodingKeyKind::RsaModulusExponent { n, e } => sig::RsaPublicKeyComponents {
                n: unpadded(n),
                e: unpadded(e),
            }
            .verify(rsa, message, signature),
            // A PKCS#1 `RSAPublicKey` in DER.
            DecodingKeyKind::SecretOrDer(der) => {
                sig::UnparsedPublicKey::new(rsa, der).verify(message, signature)
            }
        }
    }
}

/// A big-endian number without its leading zero bytes.
fn unpadded(number: &[u8]) -> &[u8] {
    let zeros = number.iter().take_while(|b| **b == 0).count();
    &number[zeros..]
}

impl Verifier<Vec<u8>> for RingVerifier {
    fn verify(&self, message: &[u8], signature: &Vec<u8>) -> Result<(), Error> {
        self.check(message, signature).map_err(|_| Error::new())
    }
}

impl JwtVerifier for RingVerifier {
    fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header};

    /// Tokens the crate signs verify here, and a flipped signature byte does not, for each
    /// family; a key of another family is refused.
    #[test]
    fn the_crates_tokens_verify_and_a_changed_one_does_not() {
        install();
        let claims = serde_json::json!({ "sub": "a", "exp": 4_000_000_000u64 });
        let ec = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let ed = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let cases = [
            (
                Algorithm::HS256,
                EncodingKey::from_secret(b"0123456789abcdef0123456789abcdef").unwrap(),
                DecodingKey::from_secret(b"0123456789abcdef0123456789abcdef").unwrap(),
            ),
            (
                Algorithm::ES256,
                EncodingKey::from_ec_der(&ec.serialize_der()),
                DecodingKey::from_ec_der(ec.public_key_raw()),
            ),
            (
                Algorithm::EdDSA,
                EncodingKey::from_ed_der(&ed.serialize_der()),
                DecodingKey::from_ed_der(ed.public_key_raw()),
            ),
        ];
        for (alg, signing, checking) in cases {
            let token = jsonwebtoken::encode(&Header::new(alg), &claims, &signing).unwrap();
            let validation = jsonwebtoken::Validation::new(alg);
            let ok = jsonwebtoken::decode::<serde_json::Value>(&token, &checking, &validation);
            assert!(ok.is_ok(), "{alg:?}: {ok:?}");
            let (rest, signature) = token.rsplit_once('.').unwrap();
            let mut bytes =
                jsonwebtoken::crypto::verify(signature, rest.as_bytes(), &checking, alg);
            assert_eq!(bytes.as_ref().ok(), Some(&true), "{alg:?}");
            let mut flipped = signature.as_bytes().to_vec();
            flipped[3] = if flipped[3] == b'A' { b'B' } else { b'A' };
            bytes = jsonwebtoken::crypto::verify(
                std::str::from_utf8(&flipped).unwrap(),
                rest.as_bytes(),
                &checking,
                alg,
            );
            assert_eq!(bytes.ok(), Some(false), "{alg:?}");
        }
        let hmac = DecodingKey::from_secret(b"0123456789abcdef0123456789abcdef").unwrap();
        assert!(jsonwebtoken::crypto::verify("AAAA", b"x.y", &hmac, Algorithm::RS256).is_err());
    }

    /// RS256 and PS256 through ring, called directly (not through the process's provider,
    /// which another test may have settled first), with the tests' RSA key as its JWK gives it
    /// and with its modulus written with a leading zero byte, as some identity providers
    /// publish it: the same number, verified the same.
    #[test]
    fn rsa_tokens_verify_with_their_modulus_padded_or_not() {
        use jsonwebtoken::jwk::JwkSet;
        let fixture = |name: &str| {
            std::fs::read(format!(
                "{}/tests/fixtures/jwt/{name}",
                env!("CARGO_MANIFEST_DIR")
            ))
            .unwrap()
        };
        let set: JwkSet = serde_json::from_slice(&fixture("jwks.json")).unwrap();
        let key = DecodingKey::from_jwk(set.find("rsa-1").unwrap()).unwrap();
        let DecodingKeyKind::RsaModulusExponent { n, e } = key.kind() else {
            panic!("an RSA JWK gives its components");
        };
        let padded = DecodingKey::from_rsa_raw_components(&[&[0u8][..], n].concat(), &[0, 1, 0, 1]);
        assert_eq!(e, &[1, 0, 1]);
        let signing = EncodingKey::from_rsa_der(&fixture("rsa.der"));
        let claims = serde_json::json!({ "sub": "a" });
        for alg in [Algorithm::RS256, Algorithm::PS256] {
            let token = jsonwebtoken::encode(&Header::new(alg), &claims, &signing).unwrap();
            let (message, signature) = token.rsplit_once('.').unwrap();
            let signature = base64::Engine::decode(
                &base64::engine::general_purpose::URL_SAFE_NO_PAD,
                signature,
            )
            .unwrap();
            for k in [&key, &padded] {
                let v = verifier(&alg, k).unwrap();
                assert!(v.verify(message.as_bytes(), &signature).is_ok(), "{alg:?}");
                let mut bad = signature.clone();
                bad[10] ^= 1;
                assert!(v.verify(message.as_bytes(), &bad).is_err(), "{alg:?}");
            }
        }
    }
}
