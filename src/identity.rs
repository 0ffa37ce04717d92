//! Who a request counts against: the identity string hashed into its bucket key.
//!
//! Identities are `global`, `ip:<address>`, `header:<lower-case name>:<value>`, `jwt:<sub>`
//! and `tenant:<tenant>` (an API key of the key file). The kind is part of the string, so two kinds never share a bucket. Raw
//! identities never leave this module except hashed.

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use pingora_http::RequestHeader;

use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, Validation};

use crate::config::{ApiKeysConfig, IdentitySource, JwtConfig, TierFrom};
use crate::remote_jwks::{verify_keys, JwksCache, VerifyKey};

/// Longest header value accepted as an identity, in bytes.
pub const MAX_HEADER_IDENTITY_BYTES: usize = 1024;

/// Longest `Authorization` header accepted, in bytes; larger tokens are refused unparsed.
pub const MAX_AUTHORIZATION_BYTES: usize = 8192;

/// Longest `sub` accepted, in bytes.
pub const MAX_SUBJECT_BYTES: usize = 256;

/// Verifies bearer tokens: the signature with the key the token's `alg` and `kid` pick (HS*
/// with the shared secret; RS*, PS*, ES* and EdDSA with the JWKS keys of that type), `exp`
/// (required), `nbf` (when present), `iss` and `aud` when configured, and the identity claim
/// (a string of 1 to 256 bytes). `alg: none`, every algorithm not configured, and a key of
/// the wrong type (an RSA key offered as an HMAC secret, say) are refused.
pub struct JwtVerifier {
    /// Each configured algorithm with its validation (made once: a token is checked against
    /// its own `alg` only).
    validations: Vec<(Algorithm, Validation)>,
    secret: Option<DecodingKey>,
    /// Public keys: `kid`, the `alg` the JWKS pins (if any), the key; from `jwks_path`.
    keys: Vec<VerifyKey>,
    /// With `jwks_url`: the fetched keys, and the URL they must come from.
    remote: Option<(Arc<JwksCache>, String)>,
    identity_claim: String,
    /// `iss` is configured: it must be one string.
    issuer: bool,
    /// `required_claims`: each claim must hold one of its values.
    required_claims: Vec<(String, Vec<String>)>,
    /// [`JwtVerifier::note_refused`] said its line (once a config generation).
    kidless_said: std::sync::atomic::AtomicBool,
    /// The second (of the Unix clock) of [`JwtVerifier::note_refused`]'s last signature
    /// checks, and how many it made in it: at most [`KIDLESS_CHECKS_A_SECOND`].
    kidless_checks: std::sync::Mutex<(u64, u32)>,
}

/// Signature checks a second [`JwtVerifier::note_refused`] makes at most: made-up kids on
/// tokens no key signed cost a flood of them no more than this.
const KIDLESS_CHECKS_A_SECOND: u32 = 10;

impl JwtVerifier {
    /// `None` when the config holds nothing to verify with (no route uses jwt). `remote`:
    /// the fetched keys, with `jwks_url`.
    pub fn new(config: &JwtConfig, remote: Option<&Arc<JwksCache>>) -> Option<Self> {
        crate::signatures::install();
        let algorithms: Vec<Algorithm> = config
            .algorithms
            .iter()
            .filter_map(|a| a.parse().ok())
            .collect();
        let secret = config
            .secret
            .as_ref()
            .and_then(|s| DecodingKey::from_secret(&s.0).ok());
        let keys = config.jwks.as_deref().map(verify_keys).unwrap_or_default();
        let remote = config
            .jwks_url
            .clone()
            .zip(remote)
            .map(|(url, cache)| (Arc::clone(cache), url));
        if secret.is_none() && keys.is_empty() && remote.is_none() {
            return None;
        }
        let mut validation = Validation::new(*algorithms.first()?);
        validation.leeway = config.leeway_secs;
        validation.validate_exp = true;
        // RFC 7519: a token is good only before `exp` (plus the leeway); the library takes it
        // at `exp` itself too, a second late. Asking it to refuse tokens one second earlier
        // moves its bound onto `exp`.
        validation.reject_tokens_expiring_in_less_than = 1;
        validation.validate_nbf = true;
        if !config.issuer.is_empty() {
            validation.set_issuer(&config.issuer);
        }
        validation.validate_aud = !config.audiences.is_empty();
        if validation.validate_aud {
            validation.set_audience(&config.audiences);
        }
        let mut required = vec!["exp"];
        if !config.issuer.is_empty() {
            required.push("iss");
        }
        if validation.validate_aud {
            required.push("aud");
        }
        validation.set_required_spec_claims(&required);
        let validations = algorithms
            .iter()
            .map(|alg| {
                let mut v = validation.clone();
                v.algorithms = vec![*alg];
                (*alg, v)
            })
            .collect();
        Some(Self {
            validations,
            secret,
            keys,
            remote,
            identity_claim: config.identity_claim.clone(),
            issuer: !config.issuer.is_empty(),
            required_claims: config.required_claims.clone(),
            kidless_said: std::sync::atomic::AtomicBool::new(false),
            kidless_checks: std::sync::Mutex::new((0, 0)),
        })
    }

    /// A token was refused for good (after the refresh an unknown kid asks for): when it
    /// named a kid no key has while keys of its type (and pinned to its `alg`, if at all)
    /// have none, and one of those keys signed it, says so once a config generation, at
    /// INFO. Such keys verify only tokens without a kid (the token's kid picks the key), so a
    /// provider that publishes its set without kids and stamps one on its tokens has every
    /// token refused, and nothing else would say why. Nothing of the token is said.
    pub fn note_refused(&self, token: &str) {
        use std::sync::atomic::Ordering;
        if self.kidless_said.load(Ordering::Relaxed) {
            return;
        }
        let fetched = self.remote.as_ref().map(|(r, url)| r.keys(url));
        let keys = fetched.as_ref().map_or(&self.keys, |f| &f.keys);
        // A set whose keys all have a kid (the usual one) costs a refused token nothing more.
        if keys.iter().all(|(kid, _, _)| kid.is_some()) {
            return;
        }
        let Ok(header) = jsonwebtoken::decode_header(token) else {
            return;
        };
        let Some(want) = header.kid else {
            return;
        };
        let alg = header.alg;
        if keys.iter().any(|(kid, _, _)| kid.as_ref() == Some(&want))
            || !self.validations.iter().any(|(a, _)| *a == alg)
        {
            return;
        }
        // Said only when a key without a kid signed it: the provider's own token, then, not a
        // client's made-up kid (which would use the one saying up and leave the operator's
        // tokens unexplained until the next reload). The signature alone is checked, and at
        // most a few times a second.
        let second = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if let Ok(mut checks) = self.kidless_checks.lock() {
            if checks.0 != second {
                *checks = (second, 0);
            }
            if checks.1 >= KIDLESS_CHECKS_A_SECOND {
                return;
            }
            checks.1 += 1;
        }
        let mut signature_only = jsonwebtoken::Validation::new(alg);
        signature_only.required_spec_claims.clear();
        signature_only.validate_exp = false;
        signature_only.validate_nbf = false;
        signature_only.validate_aud = false;
        let signed_by_a_kidless_key = keys.iter().any(|(kid, pinned, key)| {
            kid.is_none()
                && pinned.is_none_or(|p| p == alg)
                && key.family() == alg.family()
                && jsonwebtoken::decode::<serde::de::IgnoredAny>(token, key, &signature_only)
                    .is_ok()
        });
        if signed_by_a_kidless_key && !self.kidless_said.swap(true, Ordering::Relaxed) {
            tracing::info!("a bearer token signed by a JWKS key that has no kid was refused for naming a kid no key has: keys without a kid verify only tokens without one; if the identity provider stamps a kid on its tokens, its JWKS must carry them (said once until the next reload)");
        }
    }

    /// The verified identity claim of a bearer token.
    pub fn subject(&self, token: &str) -> Option<String> {
        self.subject_and(token, None).ok().map(|(id, _)| id)
    }

    /// With `jwks_url`: a token named a `kid` the fetched keys do not have. Waits for the
    /// refresh this asks for (see [`JwksCache::unknown_kid`]); the token is then verified
    /// again, and refused if its `kid` is still unknown.
    pub async fn unknown_kid(&self) {
        if let Some((remote, _)) = &self.remote {
            remote.unknown_kid().await;
        }
    }

    /// The verified identity claim of a bearer token, and the string claim `also` of the same
    /// token when asked for (`None` when the token has no such string claim).
    /// [`IdentityError::UnknownKid`]: the fetched keys have no key of the token's `kid`.
    pub fn subject_and(
        &self,
        token: &str,
        also: Option<&str>,
    ) -> Result<(String, Option<String>), IdentityError> {
        self.verified(token, also).map_err(|why| match why {
            Refusal::UnknownKid => IdentityError::UnknownKid,
            _ => IdentityError::InvalidToken,
        })
    }

    /// Why a token is refused, in words for a DEBUG line (none of the token's content);
    /// `None` when it is not.
    pub fn refusal(&self, token: &str) -> Option<&'static str> {
        self.verified(token, None).err().map(Refusal::words)
    }

    fn verified(
        &self,
        token: &str,
        also: Option<&str>,
    ) -> Result<(String, Option<String>), Refusal> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| Refusal::Unreadable)?;
        let alg = header.alg;
        let (_, validation) = (self.validations.iter())
            .find(|(a, _)| *a == alg)
            .ok_or(Refusal::AlgorithmNotAccepted)?;
        let verify = |key: &DecodingKey| {
            jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
                token, key, validation,
            )
            .map_err(|e| Refusal::Claims(claims_refusal(e.kind())))
        };
        let claims = if alg.family() == AlgorithmFamily::Hmac {
            // The shared secret has no kid; a kid that names a key of the JWKS names a key of
            // another type, which an HMAC token does not match (as an ES256 token on an RSA
            // key is refused).
            if let Some(kid) = &header.kid {
                let fetched = self.remote.as_ref().map(|(r, url)| r.keys(url));
                let keys = fetched.as_ref().map_or(&self.keys, |f| &f.keys);
                if keys.iter().any(|(k, _, _)| k.as_ref() == Some(kid)) {
                    return Err(Refusal::HmacKidOfAKey);
                }
            }
            verify(self.secret.as_ref().ok_or(Refusal::NoKey)?)?
        } else {
            // The token's kid picks the key; without one, every key of its type is tried. A key
            // of another type is never tried (the library refuses the pairing too).
            let fetched = self.remote.as_ref().map(|(r, url)| r.keys(url));
            let keys = fetched.as_ref().map_or(&self.keys, |f| &f.keys);
            let usable = |(kid, pinned, key): &&VerifyKey| {
                header.kid.as_ref().is_none_or(|k| kid.as_ref() == Some(k))
                    && pinned.is_none_or(|p| p == alg)
                    && key.family() == alg.family()
            };
            if let (Some(_), Some(want)) = (&self.remote, &header.kid) {
                // A kid a key has, of another type than the token's, is no rotation: refused
                // below without a fetch (it asked for one, as an unknown kid does).
                if !keys.iter().any(|(kid, _, _)| kid.as_ref() == Some(want)) {
                    // A kid the keys do not have: the provider may have rotated. The caller
                    // asks for a refresh and tries again ([`Self::unknown_kid`]).
                    return Err(Refusal::UnknownKid);
                }
            }
            let mut refused = Refusal::NoKey;
            let mut found = None;
            for (_, _, key) in keys.iter().filter(usable) {
                match verify(key) {
                    Ok(claims) => {
                        found = Some(claims);
                        break;
                    }
                    // A key that is not the token's says only that its signature does
                    // not verify: any other reason is the one to tell.
                    Err(why) if refused == Refusal::NoKey || refused == NOT_VERIFIED => {
                        refused = why
                    }
                    Err(_) => {}
                }
            }
            found.ok_or(refused)?
        };
        // `iss` is one string (RFC 7519, 4.1.1): the library also takes a list holding it.
        if self.issuer && !claims.claims.get("iss").is_some_and(|v| v.is_string()) {
            return Err(Refusal::Claims("iss is not one string"));
        }
        // A claim's value, or one of a list claim's (`groups`, say), among those required: a
        // string as written (compared without a copy), a number or a boolean as its text.
        for (name, values) in &self.required_claims {
            let holds = |v: &serde_json::Value| match v {
                serde_json::Value::String(s) => values.iter().any(|w| w == s),
                serde_json::Value::Bool(b) => {
                    let b = if *b { "true" } else { "false" };
                    values.iter().any(|w| w == b)
                }
                other => claim_text(other).is_some_and(|t| values.contains(&t)),
            };
            let held = match claims.claims.get(name) {
                Some(serde_json::Value::Array(list)) => list.iter().any(holds),
                Some(v) => holds(v),
                None => false,
            };
            if !held {
                return Err(Refusal::Claims(
                    "a claim of auth.jwt.required_claims is missing or holds none of its values",
                ));
            }
        }
        let id = (claims.claims.get(&self.identity_claim))
            .and_then(claim_text)
            .filter(|id| !id.is_empty() && id.len() <= MAX_SUBJECT_BYTES)
            .ok_or(Refusal::IdentityClaim)?;
        let extra = also
            .and_then(|c| claims.claims.get(c))
            .and_then(claim_text)
            .filter(|v| v.len() <= MAX_SUBJECT_BYTES);
        Ok((id, extra))
    }
}

/// A claim naming a caller or a tier: a string as written, or an integer as its decimal
/// digits (identity providers write numeric user and organisation ids either way, and
/// `4217` and `"4217"` are one caller). Anything else (a fraction, a boolean, a list) names
/// nothing.
fn claim_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        _ => None,
    }
}

/// A signature that does not verify with the key tried.
const NOT_VERIFIED_WORDS: &str = "its signature does not verify";
const NOT_VERIFIED: Refusal = Refusal::Claims(NOT_VERIFIED_WORDS);

/// Why a bearer token is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Unreadable,
    AlgorithmNotAccepted,
    HmacKidOfAKey,
    /// No key (or secret) of the token's type, or none with its `kid`.
    NoKey,
    UnknownKid,
    /// The signature, or a claim the library checks, in words.
    Claims(&'static str),
    IdentityClaim,
}

impl Refusal {
    fn words(self) -> &'static str {
        match self {
            Refusal::Unreadable => "not a JWT: its header cannot be read",
            Refusal::AlgorithmNotAccepted => "its alg is not in auth.jwt.algorithms",
            Refusal::HmacKidOfAKey => "an HMAC token whose kid names a key of the JWKS",
            Refusal::NoKey => "no key of its alg (and kid) to verify it with",
            Refusal::UnknownKid => "its kid is not among the fetched keys",
            Refusal::Claims(why) => why,
            Refusal::IdentityClaim => {
                "the identity claim is missing, not a string or an integer, empty or over 256 bytes"
            }
        }
    }
}

/// The library's refusal in words.
fn claims_refusal(kind: &jsonwebtoken::errors::ErrorKind) -> &'static str {
    use jsonwebtoken::errors::ErrorKind as K;
    match kind {
        K::InvalidSignature => NOT_VERIFIED_WORDS,
        K::ExpiredSignature => "expired (exp, with the leeway)",
        K::ImmatureSignature => "not yet valid (nbf, with the leeway)",
        K::InvalidAudience => "its aud is not among auth.jwt.audiences",
        K::InvalidIssuer => "its iss is not (one of) auth.jwt.issuer",
        K::MissingRequiredClaim(_) => "a required claim is missing (exp; iss, aud when set)",
        K::InvalidAlgorithm => "its alg does not fit the key",
        _ => "malformed (its claims cannot be read)",
    }
}

/// A field value without the spaces and tabs around it (RFC 9110, 5.5): HTTP/1's parser
/// leaves them out, HTTP/2 carries them as the client sent them (a malformed field the `h2`
/// library lets through), and an upstream reading HTTP/1.1 never sees them. Hashed with
/// them, `abc ` was a new bucket for the caller `abc` each time.
fn without_ows(value: &[u8]) -> &[u8] {
    let start = value.iter().position(|b| !matches!(b, b' ' | b'\t'));
    let end = value.iter().rposition(|b| !matches!(b, b' ' | b'\t'));
    match (start, end) {
        (Some(start), Some(end)) => &value[start..=end],
        _ => &[],
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

/// The token of an `Authorization: Bearer <token>` value: the scheme in any case, the token
/// without the spaces around it; `None` for another scheme or no token. The admin listener
/// reads its token the same way.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let space = value.iter().position(|b| *b == b' ')?;
    let (scheme, token) = (&value[..space], value[space + 1..].trim_ascii());
    (scheme.eq_ignore_ascii_case(b"bearer") && !token.is_empty()).then_some(token)
}

/// A route's bearer token: [`bearer_token`], of visible ASCII.
fn bearer(value: &http::HeaderValue) -> Option<&str> {
    if value.len() > MAX_AUTHORIZATION_BYTES {
        return None;
    }
    let token = bearer_token(without_ows(value.as_bytes()))?;
    token
        .iter()
        .all(|b| b.is_ascii_graphic())
        .then(|| std::str::from_utf8(token).ok())
        .flatten()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityError {
    /// The header is absent, empty, too long or not visible ASCII.
    MissingHeader,
    /// No valid bearer token (absent, malformed, forged, expired, oversized).
    InvalidToken,
    /// The peer is not an IP socket.
    NoPeerAddress,
    /// A bearer token whose `kid` the fetched JWKS does not have (with `jwks_url`): the keys
    /// are refreshed and the token verified again ([`JwtVerifier::unknown_kid`]); 401 when
    /// it is still unknown.
    UnknownKid,
    /// The identity header (or `Authorization`) is sent more than once.
    AmbiguousHeader,
    /// No key, or one the key file does not list.
    UnknownApiKey,
    /// Behind a trusted proxy, the `X-Forwarded-For` entry that names the client is not an
    /// address: the request is refused (400) rather than charged to the proxy's bucket.
    UnusableForwardedFor,
}

/// Why [`identify`] refused a request with `error`, in words for a DEBUG line: never the
/// header's value, the key or the token.
/// [`JwtVerifier::note_refused`] for the request's bearer token, if it has one.
pub fn note_refused(req: &RequestHeader, jwt: &JwtVerifier) {
    if let Some(token) = single(req, http::header::AUTHORIZATION)
        .ok()
        .flatten()
        .and_then(bearer)
    {
        jwt.note_refused(token);
    }
}

pub fn refusal(
    req: &RequestHeader,
    jwt: Option<&JwtVerifier>,
    error: IdentityError,
) -> &'static str {
    match error {
        IdentityError::AmbiguousHeader => {
            "its identity header (or Authorization) is sent more than once"
        }
        IdentityError::MissingHeader => {
            "its identity header is absent, empty, over 1024 bytes or not UTF-8"
        }
        IdentityError::NoPeerAddress => "its peer has no IP address",
        IdentityError::UnknownApiKey => "no API key, or one the key file does not list",
        IdentityError::UnusableForwardedFor => {
            "the X-Forwarded-For entry that names the client is not an address"
        }
        IdentityError::UnknownKid => {
            "its kid is not among the fetched keys (fetched again at most every 10 s)"
        }
        IdentityError::InvalidToken => {
            let Ok(Some(authorization)) = single(req, http::header::AUTHORIZATION) else {
                return "no Authorization header";
            };
            match (bearer(authorization), jwt) {
                (None, _) => {
                    "Authorization is not Bearer and a token of visible ASCII, up to 8 KiB"
                }
                (Some(_), None) => "no [auth.jwt] to verify it with",
                (Some(token), Some(jwt)) => jwt.refusal(token).unwrap_or("refused"),
            }
        }
    }
}

/// A `client_ip` identity as it is keyed with `[server] ipv6_identity_prefix`: an IPv6
/// address as its network of `prefix` bits (`ip:2001:db8:1:1::/64`: a client holding a /64,
/// as a home line or a cloud instance does, is one caller, not 2^64), an IPv4 one (an
/// IPv4-mapped one too: written as IPv4 already) and a prefix of 128 as they are.
pub fn ipv6_grouped(identity: String, prefix: u8) -> String {
    if prefix >= 128 {
        return identity;
    }
    let network = (identity.strip_prefix("ip:"))
        .and_then(|a| a.parse::<std::net::Ipv6Addr>().ok())
        .and_then(|a| ipnet::Ipv6Net::new(a, prefix).ok());
    match network {
        Some(net) => format!("ip:{}", net.trunc()),
        None => identity,
    }
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
    identify_with_tier(source, req, peer, trusted_proxies, jwt, api_keys, None).map(|(id, _)| id)
}

/// [`identify`], and the caller's tier as `tier_from` names its source: the key file's
/// `tier`, or a string claim of the token (`None` when the caller has none).
pub fn identify_with_tier(
    source: &IdentitySource,
    req: &RequestHeader,
    peer: Option<IpAddr>,
    trusted_proxies: &[IpNet],
    jwt: Option<&JwtVerifier>,
    api_keys: Option<&ApiKeysConfig>,
    tier_from: Option<&TierFrom>,
) -> Result<(String, Option<String>), IdentityError> {
    let plain = |id: String| Ok((id, None));
    match source {
        IdentitySource::Global => plain("global".to_owned()),
        IdentitySource::Header(name) => {
            // HTTP/2 carries the host in its authority, not in a `Host` field: the host as
            // received, so a caller is the same one over every protocol.
            let host;
            let sent = if name == "host" {
                host = crate::proxy::forwarded::received_host(req);
                host.as_deref()
            } else {
                single(req, name.as_str())?.map(|v| without_ows(v.as_bytes()))
            };
            let value = sent
                .filter(|v| !v.is_empty() && v.len() <= MAX_HEADER_IDENTITY_BYTES)
                .and_then(|v| std::str::from_utf8(v).ok())
                .filter(|v| !v.trim().is_empty())
                .ok_or(IdentityError::MissingHeader)?;
            plain(format!("header:{name}:{value}"))
        }
        IdentitySource::ClientIp => {
            let peer = peer.ok_or(IdentityError::NoPeerAddress)?;
            plain(format!("ip:{}", client_ip(req, peer, trusted_proxies)?))
        }
        IdentitySource::ApiKey => {
            let keys = api_keys.ok_or(IdentityError::UnknownApiKey)?;
            let key = single(req, keys.header.as_str())?
                .map(|v| without_ows(v.as_bytes()))
                .filter(|v| !v.is_empty() && v.len() <= MAX_HEADER_IDENTITY_BYTES)
                .ok_or(IdentityError::UnknownApiKey)?;
            let owner = keys.keys.owner(key).ok_or(IdentityError::UnknownApiKey)?;
            let tier = match tier_from {
                Some(TierFrom::ApiKey) => owner.tier.as_deref().map(str::to_owned),
                _ => None,
            };
            Ok((format!("tenant:{}", owner.tenant), tier))
        }
        IdentitySource::Jwt => {
            let verifier = jwt.ok_or(IdentityError::InvalidToken)?;
            let authorization = single(req, http::header::AUTHORIZATION)?;
            let token = authorization
                .and_then(bearer)
                .ok_or(IdentityError::InvalidToken)?;
            let claim = match tier_from {
                Some(TierFrom::Claim(c)) => Some(c.as_str()),
                _ => None,
            };
            let (sub, tier) = verifier.subject_and(token, claim)?;
            Ok((format!("jwt:{sub}"), tier))
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

/// An `X-Forwarded-For` entry's address: an address alone, or with the port some proxies
/// (Azure's Application Gateway) write after it, `1.2.3.4:5678` or `[2001:db8::1]:5678`, or
/// an IPv6 address in the brackets without a port (`[2001:db8::1]`, as `Forwarded` writes it).
fn forwarded_address(entry: &str) -> Option<IpAddr> {
    if let Some(v6) = entry.strip_prefix('[').and_then(|e| e.strip_suffix(']')) {
        return v6.parse::<std::net::Ipv6Addr>().ok().map(IpAddr::V6);
    }
    entry
        .parse::<IpAddr>()
        .ok()
        .or_else(|| entry.parse::<std::net::SocketAddr>().ok().map(|a| a.ip()))
}

/// Whether a connection can come from `ip`: not the unspecified address (`0.0.0.0`, `::`),
/// IPv4's broadcast nor a multicast group, which a proxy writes only when it knows no
/// client (or is told by one). Taken as a client, each would be one bucket that every such
/// request shares, so an entry holding one is as unusable as one holding no address.
fn can_be_a_peer(ip: IpAddr) -> bool {
    !(ip.is_unspecified() || ip.is_multicast() || ip == IpAddr::V4(std::net::Ipv4Addr::BROADCAST))
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
    let sent = !fields.is_empty();
    let mut leftmost = None;
    for value in fields.into_iter().rev() {
        // Entries are decoded one at a time: bytes left of the client never matter.
        let entries = value
            .as_bytes()
            .rsplit(|b| *b == b',')
            .map(<[u8]>::trim_ascii)
            .filter(|e| !e.is_empty());
        for entry in entries {
            let ip = std::str::from_utf8(entry)
                .ok()
                .and_then(forwarded_address)
                .map(canonical)
                .filter(|ip| can_be_a_peer(*ip))
                .ok_or(IdentityError::UnusableForwardedFor)?;
            if !is_trusted(ip, trusted) {
                return Ok(ip);
            }
            leftmost = Some(ip);
        }
    }
    match leftmost {
        // Every entry trusted: the left-most is where the chain starts (as nginx's
        // `real_ip_recursive` takes it).
        Some(ip) => Ok(ip),
        // The trusted peer forwarded for someone and named no one (`X-Forwarded-For: ` or
        // `,`): that client is unknown, and is not the peer, whose bucket others share.
        None if sent => Err(IdentityError::UnusableForwardedFor),
        None => Ok(peer),
    }
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
        // With the port some proxies write after the address (Azure's Application Gateway).
        for with_port in [
            "1.2.3.4:5678",
            "1.2.3.4:5678, 10.0.0.5:443",
            "[::ffff:1.2.3.4]:80",
        ] {
            assert_eq!(
                client_ip(&req(&[with_port], &[]), proxy, &trusted),
                Ok(ip("1.2.3.4")),
                "{with_port}"
            );
        }
        for v6 in ["[2001:db8::1]:443", "[2001:db8::1]", "2001:db8::1"] {
            assert_eq!(
                client_ip(&req(&[v6], &[]), proxy, &trusted),
                Ok(ip("2001:db8::1")),
                "{v6}"
            );
        }
        for unusable in [
            "1.2.3.4, not-an-ip",
            "1.2.3.4, not-an-ip, 10.0.0.5",
            "1.2.3.4:99999",
            "2001:db8::1:80:x",
            "[1.2.3.4]",
            "[2001:db8::1",
            "[2001:db8::1]]",
            // A header that names no one: not the proxy's bucket either.
            "",
            " , ,",
            // Addresses no connection comes from: one shared bucket each, were they taken.
            "0.0.0.0",
            "::",
            "[::]:80",
            "255.255.255.255",
            "224.0.0.1",
            "ff02::1",
            "::ffff:0.0.0.0",
        ] {
            assert_eq!(
                client_ip(&req(&[unusable], &[]), proxy, &trusted),
                Err(IdentityError::UnusableForwardedFor),
                "{unusable}"
            );
        }
        let bytes = |raw: &[u8]| {
            let mut r = req(&[], &[]);
            r.append_header(
                "x-forwarded-for",
                http::HeaderValue::from_bytes(raw).unwrap(),
            )
            .unwrap();
            client_ip(&r, proxy, &trusted)
        };
        assert_eq!(
            bytes(b"1.2.3.4\xff"),
            Err(IdentityError::UnusableForwardedFor)
        );
        assert_eq!(
            bytes(b"\xff\x80, 1.2.3.4"),
            Ok(ip("1.2.3.4")),
            "non-ASCII left of the client"
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

    /// HTTP/2 carries `Authorization` with the spaces a client put before it (HTTP/1 drops
    /// them): a bearer token is read the same both ways (it was refused over HTTP/2).
    #[test]
    fn a_bearer_value_with_spaces_around_it_is_read_as_without() {
        for value in [
            " Bearer abc",
            "\tBearer abc",
            " \t Bearer abc \t ",
            "Bearer abc\t",
        ] {
            let v = http::HeaderValue::from_str(value).unwrap();
            assert_eq!(bearer(&v), Some("abc"), "{value:?}");
        }
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
        // As HTTP/2 carries a value: the spaces and tabs around it are no part of it (each
        // was a bucket of its own); inside it they are.
        for padded in ["abc ", " abc", "\tabc  ", " \t abc\t"] {
            let r = req(&[], &[("X-API-Key", padded)]);
            assert_eq!(
                identify(&src, &r, None, &[], None, None).unwrap(),
                "header:x-api-key:abc",
                "{padded:?}"
            );
        }
        let inner = req(&[], &[("X-API-Key", " a b ")]);
        assert_eq!(
            identify(&src, &inner, None, &[], None, None).unwrap(),
            "header:x-api-key:a b"
        );
        for blank in [" ", "\t \t"] {
            let r = req(&[], &[("X-API-Key", blank)]);
            assert_eq!(
                identify(&src, &r, None, &[], None, None),
                Err(IdentityError::MissingHeader)
            );
        }
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

        fn config(algs: &[&str]) -> JwtConfig {
            JwtConfig {
                secret_env: "X".into(),
                algorithms: algs.iter().map(|a| a.to_string()).collect(),
                secret: Some(Secret(Arc::from(SECRET))),
                jwks: None,
                jwks_path: None,
                jwks_url: None,
                jwks_refresh: std::time::Duration::from_secs(300),
                issuer: Vec::new(),
                audiences: Vec::new(),
                required_claims: Vec::new(),
                leeway_secs: 30,
                identity_claim: "sub".into(),
            }
        }

        fn verifier(algs: &[&str]) -> JwtVerifier {
            JwtVerifier::new(&config(algs), None).unwrap()
        }

        fn fixture(name: &str) -> Vec<u8> {
            std::fs::read(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures/jwt")
                    .join(name),
            )
            .unwrap()
        }

        /// A verifier over the fixture JWKS (keys rsa-1 pinned to RS256, rsa-2, ec-1, ed-1).
        fn jwks_verifier(algs: &[&str], adjust: impl FnOnce(&mut JwtConfig)) -> JwtVerifier {
            let set: jsonwebtoken::jwk::JwkSet =
                serde_json::from_slice(&fixture("jwks.json")).unwrap();
            let mut c = config(algs);
            c.secret = None;
            c.jwks = Some(Arc::new(set));
            adjust(&mut c);
            JwtVerifier::new(&c, None).unwrap()
        }

        fn signed(
            alg: Algorithm,
            kid: Option<&str>,
            key: &EncodingKey,
            claims: serde_json::Value,
        ) -> String {
            let mut header = Header::new(alg);
            header.kid = kid.map(str::to_owned);
            encode(&header, &claims, key).unwrap()
        }

        fn id_of(v: &JwtVerifier, token: &str) -> Option<String> {
            v.subject(token)
        }

        /// The token's kid picks the key (contract section 12): a key published without a
        /// kid verifies tokens without one, and never a token that names a kid, however
        /// well its signature would verify (`check` warns of such keys).
        #[test]
        fn a_key_without_a_kid_verifies_only_tokens_without_one() {
            let mut set: serde_json::Value = serde_json::from_slice(&fixture("jwks.json")).unwrap();
            for key in set["keys"].as_array_mut().unwrap() {
                if key["kid"] == "ec-1" {
                    key.as_object_mut().unwrap().remove("kid");
                }
            }
            let mut c = config(&["ES256"]);
            c.secret = None;
            c.jwks = Some(Arc::new(serde_json::from_value(set).unwrap()));
            let v = JwtVerifier::new(&c, None).unwrap();
            let claims = serde_json::json!({"sub": "tenant-1", "exp": now() + 60});
            let ec = EncodingKey::from_ec_der(&fixture("ec.der"));
            let es = |kid| id_of(&v, &signed(Algorithm::ES256, kid, &ec, claims.clone()));
            assert_eq!(es(None).as_deref(), Some("tenant-1"));
            assert_eq!(es(Some("ec-1")), None, "no key has that kid now");
            assert_eq!(es(Some("whatever")), None, "an unknown kid");
        }

        #[test]
        fn jwks_keys_verify_their_own_algorithms_picked_by_kid() {
            let v = jwks_verifier(&["RS256", "RS384", "PS256", "ES256", "EdDSA"], |_| {});
            let claims = serde_json::json!({"sub": "tenant-1", "exp": now() + 60});
            let rsa1 = EncodingKey::from_rsa_der(&fixture("rsa.der"));
            let rsa2 = EncodingKey::from_rsa_der(&fixture("rsa2.der"));
            let ec = EncodingKey::from_ec_der(&fixture("ec.der"));
            let ed = EncodingKey::from_ed_der(&fixture("ed.der"));
            let other = EncodingKey::from_rsa_der(&fixture("other-rsa.der"));
            let ok = |t: String| assert_eq!(id_of(&v, &t).as_deref(), Some("tenant-1"));
            ok(signed(
                Algorithm::RS256,
                Some("rsa-1"),
                &rsa1,
                claims.clone(),
            ));
            ok(signed(Algorithm::RS256, None, &rsa1, claims.clone()));
            ok(signed(
                Algorithm::RS384,
                Some("rsa-2"),
                &rsa2,
                claims.clone(),
            ));
            ok(signed(Algorithm::PS256, None, &rsa2, claims.clone()));
            ok(signed(Algorithm::ES256, Some("ec-1"), &ec, claims.clone()));
            ok(signed(Algorithm::EdDSA, Some("ed-1"), &ed, claims.clone()));
            let refused = |t: String, why: &str| assert_eq!(id_of(&v, &t), None, "{why}");
            refused(
                signed(Algorithm::RS256, Some("rsa-2"), &rsa1, claims.clone()),
                "the kid names another key",
            );
            refused(
                signed(Algorithm::RS384, Some("rsa-1"), &rsa1, claims.clone()),
                "rsa-1 is pinned to RS256",
            );
            refused(
                signed(Algorithm::RS256, Some("rsa-1"), &other, claims.clone()),
                "a key not in the set",
            );
            refused(
                signed(Algorithm::RS256, None, &other, claims.clone()),
                "no key of the set verifies it",
            );
            refused(
                signed(Algorithm::RS256, Some("nobody"), &rsa1, claims.clone()),
                "an unknown kid",
            );
            refused(
                signed(Algorithm::RS512, Some("rsa-1"), &rsa1, claims.clone()),
                "RS512 is not configured",
            );
            refused(
                signed(Algorithm::ES256, Some("rsa-1"), &ec, claims.clone()),
                "an EC token on an RSA key",
            );
            // The HS-with-a-public-key confusion: an HMAC over the token keyed with a public
            // key's bytes verifies nothing, HS256 not being configured nor a JWKS type.
            let n = serde_json::from_slice::<serde_json::Value>(&fixture("jwks.json")).unwrap()
                ["keys"][0]["n"]
                .as_str()
                .unwrap()
                .to_owned();
            refused(
                signed(
                    Algorithm::HS256,
                    Some("rsa-1"),
                    &EncodingKey::from_secret(n.as_bytes()).unwrap(),
                    claims,
                ),
                "alg confusion",
            );
        }

        /// With a shared secret beside a JWKS, an HMAC token's `kid` that names a key of the
        /// set names a key of another type: refused, as an ES256 token on an RSA key is. A
        /// kid the set does not have names nothing and the secret verifies it.
        #[test]
        fn an_hmac_token_whose_kid_names_a_jwks_key_is_refused() {
            let v = jwks_verifier(&["HS256", "RS256"], |c| {
                c.secret = Some(Secret(Arc::from(SECRET)));
            });
            let claims = serde_json::json!({"sub": "tenant-1", "exp": now() + 60});
            let secret = EncodingKey::from_secret(SECRET).unwrap();
            let hs = |kid: Option<&str>| {
                id_of(&v, &signed(Algorithm::HS256, kid, &secret, claims.clone()))
            };
            assert_eq!(hs(None).as_deref(), Some("tenant-1"));
            assert_eq!(hs(Some("hmac-key-7")).as_deref(), Some("tenant-1"));
            assert_eq!(hs(Some("rsa-1")), None, "an RSA key's kid");
            assert_eq!(hs(Some("ec-1")), None, "an EC key's kid");
        }

        #[test]
        fn issuer_audience_leeway_and_the_identity_claim() {
            let v = jwks_verifier(&["RS256"], |c| {
                c.issuer = vec!["https://idp.example/".into()];
                c.audiences = vec!["pdftalk-api".into(), "other".into()];
                c.identity_claim = "org_id".into();
            });
            let key = EncodingKey::from_rsa_der(&fixture("rsa.der"));
            let t = |claims: serde_json::Value| {
                id_of(&v, &signed(Algorithm::RS256, Some("rsa-1"), &key, claims))
            };
            let exp = now() + 60;
            let good = serde_json::json!({"org_id": "org-7", "iss": "https://idp.example/", "aud": ["x", "pdftalk-api"], "exp": exp});
            assert_eq!(t(good.clone()).as_deref(), Some("org-7"));
            // A numeric id is its digits: one caller however the provider writes it.
            for id in [serde_json::json!(4217), serde_json::json!("4217")] {
                let mut numeric = good.clone();
                numeric["org_id"] = id;
                assert_eq!(t(numeric).as_deref(), Some("4217"));
            }
            assert_eq!(t(serde_json::json!({"org_id": "org-7", "iss": "https://idp.example/", "aud": "pdftalk-api", "exp": exp})).as_deref(), Some("org-7"), "aud as one string");
            for (field, value) in [
                ("iss", serde_json::json!("https://evil.example/")),
                // One string, not a list that holds it beside another.
                (
                    "iss",
                    serde_json::json!(["https://evil.example/", "https://idp.example/"]),
                ),
                ("aud", serde_json::json!("another-service")),
                ("org_id", serde_json::json!(7.5)),
                ("org_id", serde_json::json!(true)),
                ("org_id", serde_json::json!(["org-7"])),
                ("org_id", serde_json::json!("")),
            ] {
                let mut bad = good.clone();
                bad[field] = value;
                assert_eq!(t(bad.clone()), None, "{bad}");
            }
            for missing in ["iss", "aud", "org_id", "exp"] {
                let mut bad = good.clone();
                bad.as_object_mut().unwrap().remove(missing);
                assert_eq!(t(bad), None, "without {missing}");
            }
            let mut late = good.clone();
            late["exp"] = serde_json::json!(now() - 20);
            assert_eq!(
                t(late.clone()).as_deref(),
                Some("org-7"),
                "within the 30 s leeway"
            );
            late["exp"] = serde_json::json!(now() - 30);
            assert_eq!(
                t(late.clone()),
                None,
                "at the leeway's end: only a time before exp is good (RFC 7519)"
            );
            late["exp"] = serde_json::json!(now() - 40);
            assert_eq!(t(late), None, "past the leeway");
        }

        /// Providers that issue under two names (Entra's v1 and v2 issuers, Google's with and
        /// without `https://`), and Cognito's access tokens, which carry no `aud` but a
        /// `client_id` and `token_use`: what `required_claims` checks instead.
        #[test]
        fn several_issuers_and_required_claims() {
            let v = jwks_verifier(&["RS256"], |c| {
                c.issuer = vec![
                    "https://sts.windows.net/t-1/".into(),
                    "https://login.microsoftonline.com/t-1/v2.0".into(),
                ];
                c.required_claims = vec![
                    ("token_use".into(), vec!["access".into()]),
                    ("client_id".into(), vec!["app-a".into(), "app-b".into()]),
                ];
            });
            let key = EncodingKey::from_rsa_der(&fixture("rsa.der"));
            let t = |claims: serde_json::Value| {
                id_of(&v, &signed(Algorithm::RS256, Some("rsa-1"), &key, claims))
            };
            let good = serde_json::json!({"sub": "u-1", "iss": "https://sts.windows.net/t-1/", "token_use": "access", "client_id": "app-b", "exp": now() + 60});
            assert_eq!(t(good.clone()).as_deref(), Some("u-1"));
            let mut v2 = good.clone();
            v2["iss"] = serde_json::json!("https://login.microsoftonline.com/t-1/v2.0");
            assert_eq!(t(v2).as_deref(), Some("u-1"), "the other issuer");
            // A list claim holding one of the values is taken, as `aud` is.
            let mut listed = good.clone();
            listed["client_id"] = serde_json::json!(["other", "app-a"]);
            assert_eq!(t(listed).as_deref(), Some("u-1"));
            for (field, value) in [
                ("iss", serde_json::json!("https://sts.windows.net/t-2/")),
                // Cognito's ID token of the same pool: refused where access ones are asked.
                ("token_use", serde_json::json!("id")),
                ("client_id", serde_json::json!("app-c")),
                ("client_id", serde_json::json!(["app-c"])),
                ("client_id", serde_json::json!({"app-a": true})),
            ] {
                let mut bad = good.clone();
                bad[field] = value;
                assert_eq!(t(bad.clone()), None, "{bad}");
            }
            let mut missing = good.clone();
            missing.as_object_mut().unwrap().remove("token_use");
            assert_eq!(t(missing), None, "without token_use");
            // A boolean claim, required as `email_verified = true`.
            let v = jwks_verifier(&["RS256"], |c| {
                c.required_claims = vec![("email_verified".into(), vec!["true".into()])];
            });
            let t = |verified: serde_json::Value| {
                let claims = serde_json::json!({"sub": "u-1", "email_verified": verified, "exp": now() + 60});
                id_of(&v, &signed(Algorithm::RS256, Some("rsa-1"), &key, claims))
            };
            assert_eq!(t(serde_json::json!(true)).as_deref(), Some("u-1"));
            assert_eq!(t(serde_json::json!(false)), None);
            assert_eq!(t(serde_json::json!(1)), None);
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

        /// A refused request's DEBUG line says why, in words: never the token.
        #[test]
        fn a_refusal_says_why() {
            let v = verifier(&["HS256"]);
            let why = |authorization: Option<&str>| {
                let mut r = RequestHeader::build("GET", b"/x", None).unwrap();
                if let Some(a) = authorization {
                    r.insert_header("authorization", a).unwrap();
                }
                let e = identify(&IdentitySource::Jwt, &r, None, &[], Some(&v), None)
                    .expect_err("refused");
                refusal(&r, Some(&v), e)
            };
            let signed = |alg, key: &[u8], claims| format!("Bearer {}", token(alg, key, claims));
            assert_eq!(why(None), "no Authorization header");
            assert_eq!(
                why(Some("Basic dXNlcjpwdw==")),
                "Authorization is not Bearer and a token of visible ASCII, up to 8 KiB"
            );
            assert_eq!(
                why(Some("Bearer not.a.jwt")),
                "not a JWT: its header cannot be read"
            );
            let valid = serde_json::json!({"sub": "t", "exp": now() + 60});
            assert_eq!(
                why(Some(&signed(Algorithm::HS512, SECRET, valid.clone()))),
                "its alg is not in auth.jwt.algorithms"
            );
            assert_eq!(
                why(Some(&signed(
                    Algorithm::HS256,
                    b"another secret, as long as it",
                    valid
                ))),
                "its signature does not verify"
            );
            let expired = serde_json::json!({"sub": "t", "exp": now() - 600});
            assert_eq!(
                why(Some(&signed(Algorithm::HS256, SECRET, expired))),
                "expired (exp, with the leeway)"
            );
            let no_sub = serde_json::json!({"exp": now() + 60});
            assert_eq!(
                why(Some(&signed(Algorithm::HS256, SECRET, no_sub))),
                "the identity claim is missing, not a string or an integer, empty or over 256 bytes"
            );
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
