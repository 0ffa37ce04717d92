//! A JWKS fetched from the identity provider (`[auth.jwt] jwks_url`): at start, every
//! `jwks_refresh_seconds`, and soon after a token names a `kid` the keys do not have (at most
//! once per 10 s). The keys live in a [`JwksCache`] the JWT verifier reads on every token;
//! a fetch that fails keeps the last good keys. A token with an unknown `kid` asks for a
//! refresh and waits for it (at most the fetch's own timeout), then is verified again: a
//! provider's new key is accepted on its first token, and a `kid` still unknown after the
//! refresh is 401. Within 10 s of a refresh, an unknown `kid` is refused at once: no token
//! can make the gateway fetch more often, and only requests with an unknown `kid` ever
//! wait for the identity provider.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use jsonwebtoken::jwk::JwkSet;
use prometheus::IntCounter;
use tokio::sync::{watch, Notify};

/// The fewest seconds between two refreshes asked for by unknown `kid`s.
pub const UNKNOWN_KID_REFRESH_GAP: Duration = Duration::from_secs(10);

/// The longest a fetch may take, and the largest JWKS accepted.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_JWKS_BYTES: usize = 1 << 20;

/// A public key ready to verify with: its `kid`, the `alg` the JWKS pins (if any), the key.
pub type VerifyKey = (
    Option<String>,
    Option<jsonwebtoken::Algorithm>,
    jsonwebtoken::DecodingKey,
);

/// The family of keys a JWKS key is; `None` for kinds that verify no configured algorithm.
fn jwk_family(jwk: &jsonwebtoken::jwk::Jwk) -> Option<jsonwebtoken::AlgorithmFamily> {
    use jsonwebtoken::jwk::AlgorithmParameters as P;
    use jsonwebtoken::AlgorithmFamily as F;
    match &jwk.algorithm {
        P::RSA(_) => Some(F::Rsa),
        P::EllipticCurve(_) => Some(F::Ec),
        P::OctetKeyPair(_) => Some(F::Ed),
        _ => None,
    }
}

/// Why a public key cannot verify any signature, if it cannot: an elliptic-curve or
/// Edwards point that is not on its curve, an RSA modulus shorter than 2048 bits (RFC 7518,
/// 3.3) or an exponent of zero. The library would take such a key and refuse every token
/// signed for it, saying nothing.
pub fn unusable(jwk: &jsonwebtoken::jwk::Jwk, key: &jsonwebtoken::DecodingKey) -> Option<String> {
    use jsonwebtoken::jwk::{AlgorithmParameters as P, EllipticCurve as C};
    use jsonwebtoken::{Algorithm as A, DecodingKeyKind};
    // A key pinned to a signing algorithm of another kind of key (an RSA key marked ES256,
    // a P-256 key marked ES384) would be offered only tokens of that algorithm, which it
    // cannot verify. A pin that signs nothing (an encryption algorithm) is left to
    // `verify_keys`, which leaves such keys out.
    let pinned = jwk
        .common
        .key_algorithm
        .and_then(|a| a.to_string().parse::<A>().ok());
    if let Some(pinned) = pinned {
        let fits = match (&jwk.algorithm, pinned) {
            (P::RSA(_), A::RS256 | A::RS384 | A::RS512 | A::PS256 | A::PS384 | A::PS512) => true,
            (P::EllipticCurve(p), A::ES256) => p.curve == C::P256,
            (P::EllipticCurve(p), A::ES384) => p.curve == C::P384,
            (P::OctetKeyPair(_), A::EdDSA) => true,
            _ => false,
        };
        if !fits {
            let kind = match &jwk.algorithm {
                P::RSA(_) => "an RSA key".to_owned(),
                P::EllipticCurve(p) => format!("an EC key of curve {:?}", p.curve),
                P::OctetKeyPair(p) => format!("an OKP key of curve {:?}", p.curve),
                _ => "a key of another kind".to_owned(),
            };
            return Some(format!(
                "it is pinned to \"alg\": \"{pinned:?}\", which {kind} cannot verify"
            ));
        }
    }
    if let DecodingKeyKind::RsaModulusExponent { n, e } = key.kind() {
        let significant = n.iter().skip_while(|b| **b == 0).count();
        let bits = significant * 8
            - n.iter()
                .find(|b| **b != 0)
                .map_or(0, |b| b.leading_zeros() as usize);
        if bits < 2048 {
            return Some(format!(
                "an RSA modulus of {bits} bits: RS* and PS* keys have 2048 bits or more (RFC 7518, 3.3)"
            ));
        }
        // What the verifier (ring) takes: up to 8192 bits, an odd exponent of 3 to 2^33 - 1.
        if bits > 8192 {
            return Some(format!(
                "an RSA modulus of {bits} bits: keys of more than 8192 bits are not verified"
            ));
        }
        let leading = e.iter().take_while(|b| **b == 0).count();
        let e = &e[leading..];
        match e {
            [] => return Some("an RSA exponent of zero".to_owned()),
            [1] => {
                return Some(
                    "an RSA exponent of one (every message would be its own signature)".to_owned(),
                )
            }
            _ => {}
        }
        let odd = e.last().is_some_and(|b| b % 2 == 1);
        let too_large = e.len() > 5 || (e.len() == 5 && e[0] > 1);
        if !odd || too_large {
            return Some(
                "an RSA exponent that is even, below 3 or past 2^33 - 1: such a key verifies nothing here (65537 is the usual one)"
                    .to_owned(),
            );
        }
        return None;
    }
    let alg = match &jwk.algorithm {
        P::EllipticCurve(p) if p.curve == C::P256 => A::ES256,
        P::EllipticCurve(p) if p.curve == C::P384 => A::ES384,
        P::EllipticCurve(p) => {
            return Some(format!(
                "curve {:?} verifies no supported algorithm (ES256 is P-256, ES384 P-384)",
                p.curve
            ))
        }
        P::OctetKeyPair(_) => A::EdDSA,
        _ => return None,
    };
    // The library slices an Ed25519 key to 32 bytes unchecked, and would panic on a
    // shorter one in the middle of a request.
    if alg == A::EdDSA && key.try_get_as_bytes().map_or(true, |k| k.len() != 32) {
        return Some("an Ed25519 key is 32 bytes".to_owned());
    }
    // The crate's own verifier reads the point when it is made: only a key that is not a
    // point of its curve errs (the verifier requests use, ring's, reads it at each check).
    (jsonwebtoken::crypto::rust_crypto::DEFAULT_PROVIDER.verifier_factory)(&alg, key)
        .err()
        .map(|_| "its point is not on its curve (a public key must be one)".to_owned())
}

/// Why a JWK is not for verifying signatures, if it is not: a key marked for encryption
/// (`"use": "enc"`), whose `key_ops` do not include `verify` (RFC 7517, 4.3), or pinned to an
/// algorithm that signs nothing (`RSA-OAEP`) or that is unknown. Identity providers publish
/// such keys beside their signing keys: they are left out, never an error.
pub fn not_for_signing(jwk: &jsonwebtoken::jwk::Jwk) -> Option<String> {
    use jsonwebtoken::jwk::{KeyOperations, PublicKeyUse};
    if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
        return Some("it is marked \"use\": \"enc\"".to_owned());
    }
    if let Some(ops) = &jwk.common.key_operations {
        if !ops.contains(&KeyOperations::Verify) {
            return Some("its \"key_ops\" do not include \"verify\"".to_owned());
        }
    }
    use jsonwebtoken::jwk::KeyAlgorithm as K;
    match jwk.common.key_algorithm? {
        K::UNKNOWN_ALGORITHM => {
            Some("it is pinned to an \"alg\" this gateway does not know".to_owned())
        }
        K::RSA1_5 | K::RSA_OAEP | K::RSA_OAEP_256 => {
            Some("it is pinned to an encryption \"alg\"".to_owned())
        }
        _ => None,
    }
}

/// Which keys of the JWKS `source` (by position) came with their private half (RFC 7518,
/// 6.2.2 and 6.3.2; RFC 8037), which the parsed set does not keep: looked for in the JSON.
pub fn private_keys(source: &[u8]) -> Vec<bool> {
    serde_json::from_slice::<serde_json::Value>(source)
        .ok()
        .and_then(|v| v.get("keys")?.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .map(|k| {
            ["d", "p", "q", "dp", "dq", "qi"]
                .iter()
                .any(|m| k.get(m).is_some())
        })
        .collect()
}

/// The keys of a JWKS that can verify a signature: a key [`not_for_signing`], of a kind that
/// signs nothing configured, or [`unusable`], verifies nothing.
pub fn verify_keys(set: &JwkSet) -> Vec<VerifyKey> {
    verify_keys_noting(set, &[], &mut LeftOut::default())
}

/// The keys of a fetched set that verify no token, each as its `kid` (or `-`) and why.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LeftOut {
    /// Keys that would sign but cannot be trusted or used: a symmetric or private key
    /// published, a point off its curve, a short modulus, a kind or `alg` nothing verifies.
    pub unusable: Vec<String>,
    /// Keys a provider publishes beside its signing keys: for encryption, or whose
    /// `key_ops` leave out `verify`.
    pub beside: Vec<String>,
}

/// What one key of a JWKS is to the gateway: the file's check and a fetched set's both read
/// keys by it, so they leave out the same keys for the same reasons.
pub enum Verdict {
    /// Published with its private half (`private` of [`classify`]).
    Private,
    /// A symmetric (`oct`) key: a secret published.
    Symmetric,
    /// Published for something else ([`not_for_signing`]): why.
    NotForSigning(String),
    /// Would sign but verifies nothing: why.
    Unusable(String),
    Verifies(VerifyKey),
}

/// The [`Verdict`] on `jwk`; `private`: it came with its private half ([`private_keys`]).
pub fn classify(jwk: &jsonwebtoken::jwk::Jwk, private: bool) -> Verdict {
    if private {
        return Verdict::Private;
    }
    if matches!(
        jwk.algorithm,
        jsonwebtoken::jwk::AlgorithmParameters::OctetKey(_)
    ) {
        return Verdict::Symmetric;
    }
    if let Some(why) = not_for_signing(jwk) {
        return Verdict::NotForSigning(why);
    }
    if jwk_family(jwk).is_none() {
        return Verdict::Unusable(unknown_kind(jwk));
    }
    let pinned = match jwk.common.key_algorithm {
        Some(a) => match a.to_string().parse::<jsonwebtoken::Algorithm>() {
            Ok(a) => Some(a),
            Err(_) => {
                return Verdict::Unusable(format!(
                    "it is pinned to \"alg\": \"{a}\", which signs nothing this gateway verifies"
                ))
            }
        },
        None => None,
    };
    let key = match jsonwebtoken::DecodingKey::from_jwk(jwk) {
        Ok(key) => key,
        Err(e) => return Verdict::Unusable(e.to_string()),
    };
    match unusable(jwk, &key) {
        Some(why) => Verdict::Unusable(why),
        None => Verdict::Verifies((jwk.common.key_id.clone(), pinned, key)),
    }
}

/// Why a key of no family the library reads verifies nothing, in the key's own terms: a
/// curve EdDSA does not sign with (Ed448, X25519), a key given only as a certificate chain
/// (`x5c`, without `n` and `e`), a `kty` no signing algorithm takes.
fn unknown_kind(jwk: &jsonwebtoken::jwk::Jwk) -> String {
    let jsonwebtoken::jwk::AlgorithmParameters::Other(other) = &jwk.algorithm else {
        return "a kind of key no accepted algorithm verifies".into();
    };
    let field = |name: &str| other.fields.get(name).and_then(|v| v.as_str());
    match (field("kty"), field("crv")) {
        (Some(kty @ ("OKP" | "EC")), Some(crv)) => {
            format!("an \"{kty}\" key on curve \"{crv}\", which no accepted algorithm verifies (EdDSA: Ed25519; ES256: P-256; ES384: P-384)")
        }
        (Some(kty @ ("RSA" | "EC" | "OKP")), _) => {
            let public = match kty {
                "RSA" => "\"n\" and \"e\"",
                "EC" => "\"crv\", \"x\" and \"y\"",
                _ => "\"crv\" and \"x\"",
            };
            let chain = if other.fields.contains_key("x5c") || jwk.common.x509_chain.is_some() {
                " (a key given only as a certificate chain, \"x5c\", is not read)"
            } else {
                ""
            };
            format!("an \"{kty}\" key without its public parameters {public}{chain}")
        }
        (Some(kty), _) => {
            format!("kty \"{kty}\" is not a kind of key any accepted algorithm verifies")
        }
        (None, _) => "a key without \"kty\"".into(),
    }
}

/// Keys left out as a log line names them: the first [`NAMED_AT_MOST`], then how many more
/// (a provider's set may hold thousands).
struct Named<'a>(&'a [String]);

/// How many keys left out a log line names.
const NAMED_AT_MOST: usize = 10;

impl std::fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, key) in self.0.iter().take(NAMED_AT_MOST).enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            f.write_str(key)?;
        }
        match self.0.len().saturating_sub(NAMED_AT_MOST) {
            0 => Ok(()),
            more => write!(f, "; and {more} more"),
        }
    }
}

/// [`verify_keys`], and in `left_out` each key left out: its `kid` (or `-`, and at most 64
/// characters of it) and why (`private` says which came with their private half).
fn verify_keys_noting(set: &JwkSet, private: &[bool], noted: &mut LeftOut) -> Vec<VerifyKey> {
    const PUBLISHED: &str =
        "published to anyone who can fetch the JWKS: tokens it signs prove nothing";
    let mut keys = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        let kid = jwk.common.key_id.as_deref().unwrap_or("-");
        let kid = match kid.char_indices().nth(64) {
            Some((end, _)) => &kid[..end],
            None => kid,
        };
        match classify(jwk, private.get(i).copied().unwrap_or(false)) {
            Verdict::Private => {
                (noted.unusable).push(format!("{kid}: it holds its private key, {PUBLISHED}"))
            }
            Verdict::Symmetric => {
                (noted.unusable).push(format!("{kid}: a symmetric key (kty \"oct\"), {PUBLISHED}"))
            }
            Verdict::NotForSigning(why) => noted.beside.push(format!("{kid}: {why}")),
            Verdict::Unusable(why) => noted.unusable.push(format!("{kid}: {why}")),
            Verdict::Verifies(key) => keys.push(key),
        }
    }
    keys
}

/// Keys of the remote JWKS and the URL they were fetched from.
#[derive(Default)]
pub struct Fetched {
    pub url: String,
    pub keys: Vec<VerifyKey>,
}

/// The process's copy of the remote JWKS, kept across reloads that keep its URL.
pub struct JwksCache {
    keys: ArcSwap<Fetched>,
    wake: Notify,
    /// A reload moved `jwks_url`: a fetch under way from the old one is let go.
    moved: Notify,
    started: Instant,
    /// Milliseconds since `started` of the last refresh an unknown kid asked for.
    last_asked_ms: AtomicU64,
    /// An unknown kid's refresh is asked for and not yet done.
    asked: AtomicBool,
    /// A fetch is under way: an unknown kid waits for it rather than asking for another.
    fetching: AtomicBool,
    /// Fetches done (whatever their result), for the requests that wait for one.
    fetched: watch::Sender<u64>,
    /// The keys the last fetch left out as unusable.
    left_out: std::sync::Mutex<LeftOut>,
}

impl Default for JwksCache {
    fn default() -> Self {
        Self {
            keys: ArcSwap::from_pointee(Fetched::default()),
            wake: Notify::new(),
            moved: Notify::new(),
            started: Instant::now(),
            last_asked_ms: AtomicU64::new(0),
            asked: AtomicBool::new(false),
            fetching: AtomicBool::new(false),
            fetched: watch::Sender::new(0),
            left_out: std::sync::Mutex::new(LeftOut::default()),
        }
    }
}

impl JwksCache {
    /// The keys of the last good fetch from `url` (none before the first). Keys fetched
    /// from another URL (before a reload moved `jwks_url`) verify nothing: an operator who
    /// moves off an identity provider stops trusting it at once, as a restart would.
    pub fn keys(&self, url: &str) -> Arc<Fetched> {
        let fetched = self.keys.load_full();
        if fetched.url == url {
            fetched
        } else {
            Arc::default()
        }
    }

    /// A token named a `kid` the keys do not have: fetch again now, unless that was asked
    /// for less than 10 s ago, and wait until the fetch asked for is done (at most the
    /// fetch's timeout). Returns at once when no fetch is under way: the keys are as fresh
    /// as a token may make them.
    pub async fn unknown_kid(&self) {
        let mut done = self.fetched.subscribe();
        let now = self.started.elapsed().as_millis() as u64 + 1;
        let last = self.last_asked_ms.load(Ordering::Relaxed);
        let gap = UNKNOWN_KID_REFRESH_GAP.as_millis() as u64;
        if (last == 0 || now >= last + gap)
            && self
                .last_asked_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.asked.store(true, Ordering::SeqCst);
            if !self.fetching.load(Ordering::SeqCst) {
                self.wake.notify_one();
            }
        }
        if self.asked.load(Ordering::SeqCst) {
            let _ =
                tokio::time::timeout(FETCH_TIMEOUT + Duration::from_secs(1), done.changed()).await;
        }
    }

    /// Logs the keys a fetch left out, all of them once each time the keys left out change: at
    /// WARN those that would sign but cannot be used, at INFO those published for something
    /// else.
    pub fn note_left_out(&self, url: &str, left_out: LeftOut) {
        let mut before = self.left_out.lock().unwrap_or_else(|p| p.into_inner());
        if *before != left_out {
            if !left_out.unusable.is_empty() {
                tracing::warn!(url = %shown(url), left_out = %Named(&left_out.unusable), "the JWKS holds keys that cannot verify a signature; tokens signed for them get 401");
            }
            if !left_out.beside.is_empty() {
                tracing::info!(url = %shown(url), left_out = %Named(&left_out.beside), "the JWKS holds keys not for signing; no token is verified with them");
            }
        }
        *before = left_out;
    }

    /// A fetch is done, whatever its result: the requests waiting for it go on.
    fn fetch_done(&self) {
        self.asked.store(false, Ordering::SeqCst);
        self.fetched.send_modify(|n| *n += 1);
    }

    /// Keys fetched from `url`.
    pub fn install(&self, url: &str, keys: Vec<VerifyKey>) {
        self.keys.store(Arc::new(Fetched {
            url: url.to_owned(),
            keys,
        }));
    }

    /// A reload changed the URL or the period: fetch now (and wait the new period after);
    /// a fetch under way from a URL the config no longer names is let go, so the new one is
    /// asked at once.
    pub fn refresh_now(&self) {
        self.wake.notify_one();
        self.moved.notify_one();
    }
}

/// `sentinel_jwks_refresh_total` by result.
#[derive(Clone)]
pub struct RefreshCounters {
    pub success: IntCounter,
    pub failure: IntCounter,
}

/// An HTTP client for the identity provider: the system's roots, rustls with ring.
pub fn http_client() -> reqwest::Client {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring supports the default versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .timeout(FETCH_TIMEOUT)
        // Named, as a provider's firewall may ask of every client (some refuse a fetch
        // without a `User-Agent`), and so its logs say who fetches.
        .user_agent(concat!("sentinel-gateway/", env!("CARGO_PKG_VERSION")))
        .no_proxy()
        // A redirect is followed only where `jwks_url` itself may point.
        .redirect(reqwest::redirect::Policy::custom(|attempt| {
            // From https, only to https: a redirect may not drop the provider's TLS.
            let from_https = attempt
                .previous()
                .first()
                .is_some_and(|u| u.scheme() == "https");
            if attempt.previous().len() > 3 {
                attempt.error("more than 3 redirects")
            } else if usable_url(attempt.url())
                && !(from_https && attempt.url().scheme() != "https")
            {
                attempt.follow()
            } else {
                attempt.error(
                    "redirected to a URL that is neither https nor http to a loopback address",
                )
            }
        }))
        .build()
        .expect("an HTTP client")
}

/// Where a JWKS may be fetched from: https, or http to a loopback address.
pub fn usable_url(url: &reqwest::Url) -> bool {
    match url.scheme() {
        "https" => url.host().is_some(),
        "http" => url.host_str().is_some_and(|host| {
            host.eq_ignore_ascii_case("localhost")
                || host
                    .trim_start_matches('[')
                    .trim_end_matches(']')
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        }),
        _ => false,
    }
}

/// `url` as a log line may show it: its password and every query value hidden
/// ([`redact_url_and_query`]).
///
/// [`redact_url_and_query`]: crate::config::redact_url_and_query
pub fn shown(url: &str) -> String {
    crate::config::redact_url_and_query(url).into_owned()
}

/// An error and the errors under it, `a: b: c`: a failed fetch says why (refused, a
/// certificate's name, TLS to a plain port), not only that it failed.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut under = e.source();
    while let Some(cause) = under {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        under = cause.source();
    }
    text
}

/// One fetch: the JWKS at `url`, parsed: the keys that verify, and the ones left out
/// ([`LeftOut`]).
pub async fn fetch(
    client: &reqwest::Client,
    url: &str,
) -> Result<(Vec<VerifyKey>, LeftOut), String> {
    let mut response = client
        .get(url)
        .header("accept", "application/json")
        .send()
        .await
        .map_err(|e| format!("cannot fetch it: {}", with_causes(&e.without_url())))?;
    if !response.status().is_success() {
        return Err(format!("answered {}", response.status()));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| format!("cannot read it: {}", with_causes(&e.without_url())))?
    {
        body.extend_from_slice(&chunk);
        if body.len() > MAX_JWKS_BYTES {
            return Err(format!("is larger than {MAX_JWKS_BYTES} bytes"));
        }
    }
    let set: JwkSet = serde_json::from_slice(&body).map_err(|e| format!("is not a JWKS: {e}"))?;
    let mut left_out = LeftOut::default();
    let keys = verify_keys_noting(&set, &private_keys(&body), &mut left_out);
    if keys.is_empty() {
        // Each key left out is named here too, as beside keys that verify.
        let named: Vec<String> = (left_out.unusable.iter())
            .chain(&left_out.beside)
            .cloned()
            .collect();
        return Err(match named.is_empty() {
            true => "holds no key that verifies signatures".into(),
            false => format!(
                "holds no key that verifies signatures; left out: {}",
                Named(&named)
            ),
        });
    }
    Ok((keys, left_out))
}

/// Keeps `cache` filled from the URL `target` returns (read again before every fetch, so a
/// reload's new URL is followed); runs for the life of the process. `at_start`: the fetch
/// made at start succeeded (`Some(Ok(()))`: the next is a period away) or failed for the
/// reason given and was logged (tried again at once; logged again once it succeeds, or
/// fails for another reason).
pub async fn keep_fresh(
    cache: Arc<JwksCache>,
    target: impl Fn() -> Option<(String, Duration)>,
    counters: RefreshCounters,
    at_start: Option<Result<(), String>>,
) {
    let client = http_client();
    // The start's fetch, made or failed, counts as the last: the next is a period away (30 s
    // at most after a failure; a token with a `kid` the keys lack asks for one sooner).
    let mut skip = at_start.is_some();
    // The reason of the outage going on, as last logged: a fetch failing for another reason
    // is logged again (an operator looking at the provider needs today's reason).
    let mut failing: Option<String> = at_start.and_then(Result::err);
    loop {
        let Some((url, every)) = target() else {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = cache.wake.notified() => {}
            }
            continue;
        };
        if std::mem::take(&mut skip) {
            tokio::select! {
                _ = tokio::time::sleep(wait_after(&failing, every)) => {}
                _ = cache.wake.notified() => {}
            }
            continue;
        }
        cache.fetching.store(true, Ordering::SeqCst);
        let fetched = {
            let fetching = fetch(&client, &url);
            tokio::pin!(fetching);
            loop {
                tokio::select! {
                    fetched = &mut fetching => break Some(fetched),
                    _ = cache.moved.notified() => {
                        if target().is_none_or(|(now, _)| now != url) {
                            break None;
                        }
                    }
                }
            }
        };
        cache.fetching.store(false, Ordering::SeqCst);
        let Some(fetched) = fetched else {
            // Its keys would verify nothing: the new URL is fetched at once (the reload's
            // wake-up, still pending, is taken here so it does not ask twice).
            let _ = tokio::time::timeout(Duration::ZERO, cache.wake.notified()).await;
            continue;
        };
        match fetched {
            Ok((keys, left_out)) => {
                cache.note_left_out(&url, left_out);
                counters.success.inc();
                if failing.take().is_some() {
                    tracing::info!(keys = keys.len(), "the JWKS is fetched again");
                }
                cache.install(&url, keys);
            }
            Err(e) => {
                counters.failure.inc();
                let reason = e.to_string();
                // Said already: this reason, or (empty) the outage, at start, without the
                // fetch's own words (it timed out there).
                let said = failing
                    .as_ref()
                    .is_some_and(|r| r.is_empty() || *r == reason);
                if !said {
                    let none = cache.keys(&url).keys.is_empty();
                    let url = shown(&url);
                    if none {
                        tracing::warn!(%url, error = %e, "cannot fetch the JWKS; tokens get 401 until it is fetched");
                    } else {
                        tracing::warn!(%url, error = %e, "cannot refresh the JWKS; the last good keys stay in use");
                    }
                }
                failing = Some(reason);
            }
        }
        cache.fetch_done();
        tokio::select! {
            _ = tokio::time::sleep(wait_after(&failing, every)) => {}
            _ = cache.wake.notified() => {}
        }
    }
}

/// The wait before the next fetch: the refresh period, or at most 30 s after a failure.
fn wait_after(failing: &Option<String>, every: Duration) -> Duration {
    if failing.is_some() {
        every.min(Duration::from_secs(30))
    } else {
        every
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_line_names_ten_keys_left_out_and_counts_the_rest() {
        let keys: Vec<String> = (0..12).map(|i| format!("k{i}: a symmetric key")).collect();
        let shown = Named(&keys).to_string();
        assert!(shown.starts_with("k0: a symmetric key; k1: "), "{shown}");
        assert!(
            shown.ends_with("k9: a symmetric key; and 2 more"),
            "{shown}"
        );
        assert_eq!(Named(&keys[..1]).to_string(), "k0: a symmetric key");
    }

    #[test]
    fn a_jwks_url_is_shown_without_its_secrets() {
        assert_eq!(
            shown("https://u:pw@idp.example/jwks?client_secret=s3&v=2&sig"),
            "https://u:***@idp.example/jwks?client_secret=***&v=***&***"
        );
        assert_eq!(
            shown("https://idp.example/jwks"),
            "https://idp.example/jwks"
        );
    }

    #[test]
    fn a_jwks_is_fetched_over_https_or_from_loopback() {
        let usable = |u: &str| usable_url(&reqwest::Url::parse(u).unwrap());
        for good in [
            "https://idp.example/j",
            "http://127.0.0.1:8/j",
            "http://[::1]:8/j",
            "http://LOCALHOST/j",
        ] {
            assert!(usable(good), "{good}");
        }
        for bad in [
            "http://idp.example/j",
            "http://10.0.0.1/j",
            "ftp://127.0.0.1/j",
        ] {
            assert!(!usable(bad), "{bad}");
        }
    }
}
