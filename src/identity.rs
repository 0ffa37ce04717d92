//! Who a request counts against: the identity string hashed into its bucket key.
//!
//! Identities are `global`, `ip:<address>`, `header:<lower-case name>:<value>`, `jwt:<sub>`
//! and `tenant:<tenant>` (an API key of the key file). The kind is part of the string, so two kinds never share a bucket. Raw
//! identities never leave this module except hashed.

use std::net::IpAddr;

use ipnet::IpNet;
use pingora_http::RequestHeader;

use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

use crate::config::{ApiKeysConfig, IdentitySource, JwtConfig};

/// Longest header value accepted as an identity, in bytes.
pub const MAX_HEADER_IDENTITY_BYTES: usize = 1024;

/// Longest `Authorization` header accepted, in bytes; larger tokens are refused unparsed.
pub const MAX_AUTHORIZATION_BYTES: usize = 8192;

/// Clock skew tolerated on `exp` and `nbf`, in seconds.
pub const JWT_LEEWAY_SECS: u64 = 30;

/// Longest `sub` accepted, in bytes.
pub const MAX_SUBJECT_BYTES: usize = 256;

/// Verifies HS* bearer tokens: signature, `exp` (required), `nbf` (when present) and `sub`
/// (required, non-empty). `alg: none` and every algorithm not configured are refused.
pub struct JwtVerifier {
    key: DecodingKey,
    validation: Validation,
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
}

impl JwtVerifier {
    /// `None` when the config holds no secret (no route uses jwt).
    pub fn new(config: &JwtConfig) -> Option<Self> {
        let secret = config.secret.as_ref()?;
        let key = DecodingKey::from_secret(&secret.0).ok()?;
        let algorithms: Vec<Algorithm> = config
            .algorithms
            .iter()
            .filter_map(|a| match a.as_str() {
                "HS256" => Some(Algorithm::HS256),
                "HS384" => Some(Algorithm::HS384),
                "HS512" => Some(Algorithm::HS512),
                _ => None,
            })
            .collect();
        let mut validation = Validation::new(*algorithms.first()?);
        validation.algorithms = algorithms;
        validation.leeway = JWT_LEEWAY_SECS;
        validation.validate_exp = true;
        validation.validate_nbf = true;
        validation.validate_aud = false;
        validation.set_required_spec_claims(&["exp", "sub"]);
        Some(Self { key, validation })
    }

    /// The verified subject of a bearer token.
    pub fn subject(&self, token: &str) -> Option<String> {
        let data = jsonwebtoken::decode::<Claims>(token, &self.key, &self.validation).ok()?;
        let sub = data.claims.sub;
        (!sub.is_empty() && sub.len() <= MAX_SUBJECT_BYTES).then_some(sub)
    }
}

/// The one value of header `name`: `Err` when the request carries the field more than once
/// (a client could then be charged for one value while the backend reads another).
fn single(
    req: &RequestHeader,
    name: impl http::header::AsHeaderName,
) -> Result<Option<&http::HeaderValue>, IdentityError> {
    let mut values = req.headers.get_all(name).into_iter();
    let first = values.next();
    match values.next() {
        Some(_) => Err(IdentityError::AmbiguousHeader),
        None => Ok(first),
    }
}

/// The token of `Authorization: Bearer <token>`.
fn bearer(value: &http::HeaderValue) -> Option<&str> {
    if value.len() > MAX_AUTHORIZATION_BYTES {
        return None;
    }
    let text = value.to_str().ok()?;
    let (scheme, token) = text.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityError {
    /// The header is absent, empty, too long or not visible ASCII.
    MissingHeader,
    /// No valid bearer token (absent, malformed, forged, expired, oversized).
    InvalidToken,
    /// The peer is not an IP socket.
    NoPeerAddress,
    /// The identity header (or `Authorization`) is sent more than once.
    AmbiguousHeader,
    /// No key, or one the key file does not list.
    UnknownApiKey,
    /// Behind a trusted proxy, the `X-Forwarded-For` entry that names the client is not an
    /// address: the request is refused (400) rather than charged to the proxy's bucket.
    UnusableForwardedFor,
}

/// The identity string of a request, before hashing.
pub fn identify(
    source: &IdentitySource,
    req: &RequestHeader,
    peer: Option<IpAddr>,
    trusted_proxies: &[IpNet],
    jwt: Option<&JwtVerifier>,
    api_keys: Option<&ApiKeysConfig>,
) -> Result<String, IdentityError> {
    match source {
        IdentitySource::Global => Ok("global".to_owned()),
        IdentitySource::Header(name) => {
            let value = single(req, name.as_str())?
                .map(|v| v.as_bytes())
                .filter(|v| !v.is_empty() && v.len() <= MAX_HEADER_IDENTITY_BYTES)
                .and_then(|v| std::str::from_utf8(v).ok())
                .filter(|v| !v.trim().is_empty())
                .ok_or(IdentityError::MissingHeader)?;
            Ok(format!("header:{name}:{value}"))
        }
        IdentitySource::ClientIp => {
            let peer = peer.ok_or(IdentityError::NoPeerAddress)?;
            Ok(format!("ip:{}", client_ip(req, peer, trusted_proxies)?))
        }
        IdentitySource::ApiKey => {
            let keys = api_keys.ok_or(IdentityError::UnknownApiKey)?;
            let key = single(req, keys.header.as_str())?
                .map(|v| v.as_bytes())
                .filter(|v| !v.is_empty() && v.len() <= MAX_HEADER_IDENTITY_BYTES)
                .ok_or(IdentityError::UnknownApiKey)?;
            let owner = keys.keys.owner(key).ok_or(IdentityError::UnknownApiKey)?;
            Ok(format!("tenant:{}", owner.tenant))
        }
        IdentitySource::Jwt => {
            let verifier = jwt.ok_or(IdentityError::InvalidToken)?;
            let authorization = single(req, http::header::AUTHORIZATION)?;
            let token = authorization
                .and_then(bearer)
                .ok_or(IdentityError::InvalidToken)?;
            let sub = verifier.subject(token).ok_or(IdentityError::InvalidToken)?;
            Ok(format!("jwt:{sub}"))
        }
    }
}

/// Whether `ip` is in `trusted_proxies`.
pub fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
    let ip = canonical(ip);
    trusted.iter().any(|net| net.contains(&ip))
}

/// IPv4-mapped IPv6 peers count as their IPv4 address.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The client's address: the socket peer, or, when the peer is a trusted proxy, the
/// `X-Forwarded-For` entry that names the client.
///
/// The header is read from the right, every field of it in order, since each proxy appends
/// the address it saw: trusted addresses are skipped, and the first untrusted entry is the
/// client. Entries to its left are the client's own words and never matter. When that entry
/// is not an address the request is unusable ([`IdentityError::UnusableForwardedFor`]):
/// falling back to the peer would charge the proxy's bucket, which every client behind it
/// shares. When every entry is trusted, the left-most is the client (a caller inside the
/// trusted network); with no entry at all, the peer is.
pub fn client_ip(
    req: &RequestHeader,
    peer: IpAddr,
    trusted: &[IpNet],
) -> Result<IpAddr, IdentityError> {
    let peer = canonical(peer);
    if !is_trusted(peer, trusted) {
        return Ok(peer);
    }
    let fields: Vec<&http::HeaderValue> = req.headers.get_all("x-forwarded-for").iter().collect();
    let mut leftmost = None;
    for value in fields.into_iter().rev() {
        let text = value
            .to_str()
            .map_err(|_| IdentityError::UnusableForwardedFor)?;
        for entry in text.rsplit(',').map(str::trim).filter(|e| !e.is_empty()) {
            let ip = canonical(
                entry
                    .parse::<IpAddr>()
                    .map_err(|_| IdentityError::UnusableForwardedFor)?,
            );
            if !is_trusted(ip, trusted) {
                return Ok(ip);
            }
            leftmost = Some(ip);
        }
    }
    Ok(leftmost.unwrap_or(peer))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(xff: &[&str], headers: &[(&str, &str)]) -> RequestHeader {
        let mut r = RequestHeader::build("GET", b"/", None).unwrap();
        for v in xff {
            r.append_header("x-forwarded-for", *v).unwrap();
        }
        for (k, v) in headers {
            r.append_header(k.to_string(), *v).unwrap();
        }
        r
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn untrusted_peer_ignores_forwarded_for() {
        let trusted = vec!["10.0.0.0/8".parse().unwrap()];
        assert_eq!(
            client_ip(&req(&["1.2.3.4"], &[]), ip("8.8.8.8"), &trusted),
            Ok(ip("8.8.8.8"))
        );
        assert_eq!(
            client_ip(&req(&["garbage"], &[]), ip("8.8.8.8"), &trusted),
            Ok(ip("8.8.8.8")),
            "an untrusted peer's header is never read"
        );
    }

    #[test]
    fn trusted_peer_yields_rightmost_untrusted_hop() {
        let trusted = vec!["10.0.0.0/8".parse().unwrap()];
        let proxy = ip("10.0.0.1");
        let r = req(&["6.6.6.6, 1.2.3.4", "10.1.1.1"], &[]);
        assert_eq!(client_ip(&r, proxy, &trusted), Ok(ip("1.2.3.4")));
        let r = req(&["6.6.6.6", "1.2.3.4, 10.1.1.1"], &[]);
        assert_eq!(
            client_ip(&r, proxy, &trusted),
            Ok(ip("1.2.3.4")),
            "fields are read last first"
        );
        assert_eq!(
            client_ip(&req(&[], &[]), proxy, &trusted),
            Ok(proxy),
            "no header: the peer"
        );
        assert_eq!(
            client_ip(&req(&["10.0.0.7, 10.2.2.2"], &[]), proxy, &trusted),
            Ok(ip("10.0.0.7")),
            "all trusted: the left-most"
        );
        assert_eq!(
            client_ip(&req(&["::ffff:1.2.3.4,, "], &[]), proxy, &trusted),
            Ok(ip("1.2.3.4")),
            "empty list elements are skipped; mapped addresses count as IPv4"
        );
    }

    #[test]
    fn garbage_left_of_the_client_is_ignored_and_in_its_place_refused() {
        let trusted = vec!["10.0.0.0/8".parse().unwrap()];
        let proxy = ip("10.0.0.1");
        for left in ["x, 1.2.3.4", "not-an-ip, 9.9.9.9, 1.2.3.4, 10.0.0.5"] {
            assert_eq!(
                client_ip(&req(&[left], &[]), proxy, &trusted),
                Ok(ip("1.2.3.4")),
                "{left}"
            );
        }
        assert_eq!(
            client_ip(&req(&["x", "1.2.3.4"], &[]), proxy, &trusted),
            Ok(ip("1.2.3.4")),
            "an earlier field is to the left"
        );
        for unusable in [
            "1.2.3.4, not-an-ip",
            "1.2.3.4, not-an-ip, 10.0.0.5",
            "1.2.3.4:80",
        ] {
            assert_eq!(
                client_ip(&req(&[unusable], &[]), proxy, &trusted),
                Err(IdentityError::UnusableForwardedFor),
                "{unusable}"
            );
        }
        let mut r = req(&[], &[]);
        r.append_header(
            "x-forwarded-for",
            http::HeaderValue::from_bytes(b"1.2.3.4\xff").unwrap(),
        )
        .unwrap();
        assert_eq!(
            client_ip(&r, proxy, &trusted),
            Err(IdentityError::UnusableForwardedFor)
        );
        let src = IdentitySource::ClientIp;
        assert_eq!(
            identify(
                &src,
                &req(&["1.2.3.4, x"], &[]),
                Some(proxy),
                &trusted,
                None,
                None
            ),
            Err(IdentityError::UnusableForwardedFor)
        );
    }

    #[test]
    fn an_identity_header_sent_twice_is_refused() {
        let src = IdentitySource::Header("x-api-key".into());
        let twice = req(&[], &[("X-API-Key", "a"), ("x-api-key", "b")]);
        assert_eq!(
            identify(&src, &twice, None, &[], None, None),
            Err(IdentityError::AmbiguousHeader)
        );
        let twice = req(&[], &[("X-API-Key", "a"), ("X-API-Key", "a")]);
        assert_eq!(
            identify(&src, &twice, None, &[], None, None),
            Err(IdentityError::AmbiguousHeader),
            "even with the same value"
        );
    }

    #[test]
    fn header_identity_needs_a_non_empty_value_and_keeps_kinds_apart() {
        let src = IdentitySource::Header("x-api-key".into());
        let r = req(&[], &[("X-API-Key", "abc")]);
        assert_eq!(
            identify(&src, &r, None, &[], None, None).unwrap(),
            "header:x-api-key:abc"
        );
        let empty = req(&[], &[("X-API-Key", "")]);
        assert_eq!(
            identify(&src, &empty, None, &[], None, None),
            Err(IdentityError::MissingHeader)
        );
        let long = "k".repeat(MAX_HEADER_IDENTITY_BYTES + 1);
        let r = req(&[], &[("X-API-Key", long.as_str())]);
        assert_eq!(
            identify(&src, &r, None, &[], None, None),
            Err(IdentityError::MissingHeader)
        );
        let ipid = identify(
            &IdentitySource::ClientIp,
            &req(&[], &[]),
            Some(ip("::ffff:1.2.3.4")),
            &[],
            None,
            None,
        );
        assert_eq!(ipid.unwrap(), "ip:1.2.3.4");
    }

    mod jwt {
        use super::*;
        use crate::config::Secret;
        use base64::engine::general_purpose::URL_SAFE_NO_PAD;
        use base64::Engine;
        use jsonwebtoken::{encode, EncodingKey, Header};
        use std::sync::Arc;

        const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

        fn verifier(algs: &[&str]) -> JwtVerifier {
            JwtVerifier::new(&JwtConfig {
                secret_env: "X".into(),
                algorithms: algs.iter().map(|a| a.to_string()).collect(),
                secret: Some(Secret(Arc::from(SECRET))),
            })
            .unwrap()
        }

        fn now() -> u64 {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
        }

        fn token(alg: Algorithm, key: &[u8], claims: serde_json::Value) -> String {
            encode(
                &Header::new(alg),
                &claims,
                &EncodingKey::from_secret(key).unwrap(),
            )
            .unwrap()
        }

        fn bearer_req(value: &str) -> RequestHeader {
            req(&[], &[("Authorization", value)])
        }

        fn subject_of(v: &JwtVerifier, authorization: &str) -> Result<String, IdentityError> {
            identify(
                &IdentitySource::Jwt,
                &bearer_req(authorization),
                None,
                &[],
                Some(v),
                None,
            )
        }

        #[test]
        fn a_valid_token_yields_its_subject() {
            let v = verifier(&["HS256", "HS512"]);
            let t = token(
                Algorithm::HS256,
                SECRET,
                serde_json::json!({"sub": "tenant-7", "exp": now() + 60}),
            );
            assert_eq!(
                subject_of(&v, &format!("Bearer {t}")).unwrap(),
                "jwt:tenant-7"
            );
            assert_eq!(
                subject_of(&v, &format!("bearer  {t}")).unwrap(),
                "jwt:tenant-7"
            );
            let t = token(
                Algorithm::HS512,
                SECRET,
                serde_json::json!({"sub": "t", "exp": now() + 60}),
            );
            assert_eq!(subject_of(&v, &format!("Bearer {t}")).unwrap(), "jwt:t");
        }

        #[test]
        fn two_authorization_fields_are_refused() {
            let v = verifier(&["HS256"]);
            let t = token(
                Algorithm::HS256,
                SECRET,
                serde_json::json!({"sub": "tenant-7", "exp": now() + 60}),
            );
            let bearer = format!("Bearer {t}");
            let twice = req(
                &[],
                &[("Authorization", &bearer), ("Authorization", &bearer)],
            );
            assert_eq!(
                identify(&IdentitySource::Jwt, &twice, None, &[], Some(&v), None),
                Err(IdentityError::AmbiguousHeader)
            );
        }

        #[test]
        fn forged_and_malformed_tokens_are_refused() {
            let v = verifier(&["HS256"]);
            let exp = now() + 60;
            let none_header = URL_SAFE_NO_PAD.encode(br#"{"alg":"none","typ":"JWT"}"#);
            let payload = URL_SAFE_NO_PAD.encode(format!(r#"{{"sub":"x","exp":{exp}}}"#));
            let cases = [
                (
                    "bad signature",
                    token(
                        Algorithm::HS256,
                        b"another-secret-another-secret-xx",
                        serde_json::json!({"sub": "x", "exp": exp}),
                    ),
                ),
                ("alg none", format!("{none_header}.{payload}.")),
                (
                    "unlisted HS384",
                    token(
                        Algorithm::HS384,
                        SECRET,
                        serde_json::json!({"sub": "x", "exp": exp}),
                    ),
                ),
                (
                    "expired",
                    token(
                        Algorithm::HS256,
                        SECRET,
                        serde_json::json!({"sub": "x", "exp": now() - 3600}),
                    ),
                ),
                (
                    "not yet valid",
                    token(
                        Algorithm::HS256,
                        SECRET,
                        serde_json::json!({"sub": "x", "exp": exp, "nbf": now() + 3600}),
                    ),
                ),
                (
                    "no sub",
                    token(Algorithm::HS256, SECRET, serde_json::json!({"exp": exp})),
                ),
                (
                    "empty sub",
                    token(
                        Algorithm::HS256,
                        SECRET,
                        serde_json::json!({"sub": "", "exp": exp}),
                    ),
                ),
                (
                    "no exp",
                    token(Algorithm::HS256, SECRET, serde_json::json!({"sub": "x"})),
                ),
                ("garbage", "not.a.token".to_owned()),
                ("huge", "a".repeat(100 * 1024)),
            ];
            for (what, t) in cases {
                assert_eq!(
                    subject_of(&v, &format!("Bearer {t}")),
                    Err(IdentityError::InvalidToken),
                    "{what}"
                );
            }
            let good = token(
                Algorithm::HS256,
                SECRET,
                serde_json::json!({"sub": "x", "exp": exp}),
            );
            assert_eq!(
                subject_of(&v, &format!("Basic {good}")),
                Err(IdentityError::InvalidToken),
                "wrong scheme"
            );
            assert_eq!(
                subject_of(&v, "Bearer"),
                Err(IdentityError::InvalidToken),
                "no token"
            );
            let none = identify(
                &IdentitySource::Jwt,
                &req(&[], &[]),
                None,
                &[],
                Some(&v),
                None,
            );
            assert_eq!(none, Err(IdentityError::InvalidToken), "no header");
        }

        /// HS256 by hand, so a token can be signed with an empty key (the JWT crate refuses
        /// to build such a key, which is the point of the test).
        fn hs256_with_empty_key(header: &str, payload: &str) -> String {
            use sha2::{Digest, Sha256};
            let signing_input = format!("{header}.{payload}");
            let (mut inner, mut outer) = (Sha256::new(), Sha256::new());
            inner.update([0x36u8; 64]);
            inner.update(signing_input.as_bytes());
            outer.update([0x5cu8; 64]);
            outer.update(inner.finalize());
            format!(
                "{signing_input}.{}",
                URL_SAFE_NO_PAD.encode(outer.finalize())
            )
        }

        #[test]
        fn a_token_signed_with_an_empty_key_is_refused() {
            let v = verifier(&["HS256"]);
            let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
            let payload = URL_SAFE_NO_PAD.encode(format!(r#"{{"sub":"x","exp":{}}}"#, now() + 60));
            let forged = hs256_with_empty_key(&header, &payload);
            assert_eq!(
                subject_of(&v, &format!("Bearer {forged}")),
                Err(IdentityError::InvalidToken)
            );
        }

        #[test]
        fn leeway_covers_small_clock_skew() {
            let v = verifier(&["HS256"]);
            let t = token(
                Algorithm::HS256,
                SECRET,
                serde_json::json!({"sub": "x", "exp": now() - 5}),
            );
            assert!(subject_of(&v, &format!("Bearer {t}")).is_ok());
        }
    }
}
