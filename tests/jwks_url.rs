//! `[auth.jwt] jwks_url` against the binary: the JWKS of a real HTTP server on loopback is
//! fetched at start, fetched again when a token names an unknown `kid` (a key
//! rotation), and kept when the provider stops answering; `sentinel_jwks_refresh_total`
//! counts both outcomes.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::config::{quoted, GatewayConfig, Route};
use common::{client, wait_until, Redis, Upstream};
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/jwt")
        .join(name)
}

/// The fixture JWKS with only the keys named.
fn jwks_with(kids: &[&str]) -> String {
    let all: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("jwks.json")).unwrap()).unwrap();
    let keys: Vec<_> = all["keys"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|k| kids.contains(&k["kid"].as_str().unwrap_or("")))
        .cloned()
        .collect();
    serde_json::json!({ "keys": keys }).to_string()
}

/// An identity provider on loopback: answers every request with `body` (or with it as the
/// whole answer when it starts with `HTTP/1.1 `), or 503 when it is `None`; counts the
/// requests.
struct Provider {
    port: u16,
    body: Arc<Mutex<Option<String>>>,
    hits: Arc<Mutex<u32>>,
    /// The last request's head, as it came.
    last: Arc<Mutex<String>>,
}

impl Provider {
    async fn start(body: String) -> Provider {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let body = Arc::new(Mutex::new(Some(body)));
        let hits = Arc::new(Mutex::new(0));
        let last = Arc::new(Mutex::new(String::new()));
        let (served, counted, heard) = (Arc::clone(&body), Arc::clone(&hits), Arc::clone(&last));
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let (served, counted) = (Arc::clone(&served), Arc::clone(&counted));
                let heard = Arc::clone(&heard);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    *heard.lock().unwrap() = String::from_utf8_lossy(&buf[..n]).into_owned();
                    *counted.lock().unwrap() += 1;
                    let answer = match served.lock().unwrap().clone() {
                        // A whole answer of its own (a redirect).
                        Some(b) if b.starts_with("HTTP/1.1 ") => b,
                        Some(b) => format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{b}",
                            b.len()
                        ),
                        None => "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into(),
                    };
                    let _ = socket.write_all(answer.as_bytes()).await;
                });
            }
        });
        Provider {
            port,
            body,
            hits,
            last,
        }
    }

    fn last_request(&self) -> String {
        self.last.lock().unwrap().clone()
    }

    fn hits(&self) -> u32 {
        *self.hits.lock().unwrap()
    }
}

fn token(kid: &str, key_file: &str) -> String {
    signed(Some(kid), key_file)
}

/// An RS256 token for `user-1`, with `kid` when given, signed with `key_file`'s key.
fn signed(kid: Option<&str>, key_file: &str) -> String {
    let der = std::fs::read(fixture(key_file)).unwrap();
    let mut header = Header::new(Algorithm::RS256);
    header.kid = kid.map(str::to_owned);
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 300;
    encode(
        &header,
        &serde_json::json!({"sub": "user-1", "exp": exp}),
        &EncodingKey::from_rsa_der(&der),
    )
    .unwrap()
}

/// A gateway whose `/api` route is limited by the JWT's subject, with `jwt` as its
/// `[auth.jwt]` section.
fn start(redis: &Redis, up: &Upstream, jwt: &str) -> common::Gateway {
    GatewayConfig::new(&redis.url())
        .section(&format!("[auth.jwt]\n{jwt}\n"))
        .upstream("app", &[up.addr()])
        .route(
            Route::new("j.api")
                .prefix("/api")
                .identity("jwt")
                .token_bucket(100_000_000, 0),
        )
        .start()
}

/// [`start`] with `provider`'s JWKS at `jwks_url` (refreshed hourly) and these `algorithms`.
fn start_on(
    redis: &Redis,
    up: &Upstream,
    provider: &Provider,
    algorithms: &str,
) -> common::Gateway {
    let url = format!("http://127.0.0.1:{}/.well-known/jwks.json", provider.port);
    let jwt = format!(
        "algorithms = [{algorithms}]\njwks_url = {}\njwks_refresh_seconds = 3600",
        quoted(&url)
    );
    start(redis, up, &jwt)
}

async fn status(gw: &common::Gateway, token: &str) -> u16 {
    client()
        .get(gw.url("/api"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jwks_is_fetched_refreshed_on_an_unknown_kid_and_kept_when_the_provider_fails() {
    let provider = Provider::start(jwks_with(&["rsa-1"])).await;
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = start_on(&redis, &up, &provider, r#""RS256""#);
    // Fetched at start, once: the first token verifies.
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(provider.hits(), 1, "fetched once at start");
    // Named as itself (a provider's firewall may refuse a client that is not).
    let head = provider.last_request().to_ascii_lowercase();
    assert!(
        head.contains(&format!(
            "\r\nuser-agent: sentinel-gateway/{}\r\n",
            env!("CARGO_PKG_VERSION")
        )),
        "{head}"
    );
    assert_eq!(
        gw.metric("sentinel_jwks_refresh_total{result=\"success\"}"),
        1.0
    );

    // The provider rotates to rsa-2. The first token with the new kid asks for a refresh,
    // waits for it, and verifies with the key it fetched (contract section 12: an unknown
    // kid is 401 only after a refresh).
    *provider.body.lock().unwrap() = Some(jwks_with(&["rsa-1", "rsa-2"]));
    let rotated = token("rsa-2", "rsa2.der");
    let before = provider.hits();
    let started = std::time::Instant::now();
    assert_eq!(status(&gw, &rotated).await, 200);
    assert_eq!(
        provider.hits(),
        before + 1,
        "one refresh for the unknown kid"
    );

    // Unknown kids ask for at most one refresh per 10 s: within them, refused at once.
    let stranger = token("nobody", "other-rsa.der");
    for _ in 0..5 {
        let asked = std::time::Instant::now();
        assert_eq!(status(&gw, &stranger).await, 401);
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "no wait for the provider"
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(provider.hits(), before + 1);

    // The provider fails: the keys in hand stay in use, and the failure is counted. (An
    // unknown kid asks again once 10 s have passed since the last ask.)
    *provider.body.lock().unwrap() = None;
    let wait = Duration::from_millis(10_500).saturating_sub(started.elapsed());
    tokio::time::sleep(wait).await;
    assert_eq!(status(&gw, &stranger).await, 401);
    wait_until(Duration::from_secs(5), "the failed refresh", || {
        gw.metric("sentinel_jwks_refresh_total{result=\"failure\"}") >= 1.0
    });
    assert_eq!(status(&gw, &rotated).await, 200);
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 200);
}

/// A token whose `kid` names a key of another type (an RS256 token naming the EC key) is
/// refused without asking the provider: a rotation brings new kids, not a kid's new type
/// (it asked, as for an unknown kid).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kid_of_a_key_of_another_type_is_refused_without_a_fetch() {
    let provider = Provider::start(jwks_with(&["rsa-1", "ec-1"])).await;
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = start_on(&redis, &up, &provider, r#""RS256", "ES256""#);
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 200);
    assert_eq!(status(&gw, &token("ec-1", "rsa.der")).await, 401);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(provider.hits(), 1, "fetched at start only");
}

/// A reload that names another identity provider, or another period, is followed at once:
/// the new URL is fetched when the new config is live (not at the old period's end, and not
/// from the old URL), and the new period counts from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_fetches_a_new_jwks_url_at_once_and_keeps_the_new_period() {
    let old = Provider::start(jwks_with(&["rsa-1"])).await;
    let new = Provider::start(jwks_with(&["rsa-2"])).await;
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let jwt = |provider: &Provider, every: u64| {
        format!(
            "algorithms = [\"RS256\"]\njwks_url = {}\njwks_refresh_seconds = {every}",
            quoted(&format!(
                "http://127.0.0.1:{}/.well-known/jwks.json",
                provider.port
            ))
        )
    };
    let gw = start(&redis, &up, &jwt(&old, 3600));
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 200);
    let old_hits = old.hits();

    let config = std::fs::read_to_string(&gw.config_path).unwrap();
    gw.rewrite_config(&config.replace(&jwt(&old, 3600), &jwt(&new, 3600)));
    assert_eq!(gw.reload(), 200, "{}", gw.logs());
    wait_until(Duration::from_secs(3), "the new provider's fetch", || {
        new.hits() >= 1
    });
    assert_eq!(old.hits(), old_hits, "the old URL is not asked again");
    // The new provider's key verifies without a token having to ask for it.
    assert_eq!(status(&gw, &token("rsa-2", "rsa2.der")).await, 200);

    // A shorter period (the shortest, 10 s): fetched at once, then after 10 s, not after
    // the old hour.
    gw.rewrite_config(&config.replace(&jwt(&old, 3600), &jwt(&new, 10)));
    let before = new.hits();
    assert_eq!(gw.reload(), 200, "{}", gw.logs());
    wait_until(Duration::from_secs(3), "the fetch at the reload", || {
        new.hits() > before
    });
    wait_until(
        Duration::from_secs(14),
        "the fetch at the new period",
        || new.hits() > before + 1,
    );
}

/// A reload that moves `jwks_url` to another provider stops trusting the old one's keys at
/// once, as a restart would (an operator moving off a compromised provider): while the new
/// one cannot be fetched, tokens get 401 and the WARN says so. A secret in the URL's query
/// (a presigned URL, `client_secret=`) is never logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_another_provider_stops_trusting_the_old_ones_keys() {
    let old = Provider::start(jwks_with(&["rsa-1"])).await;
    let new = Provider::start(jwks_with(&["rsa-1"])).await;
    *new.body.lock().unwrap() = None;
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let jwt = |provider: &Provider| {
        format!(
            "algorithms = [\"RS256\"]\njwks_url = {}\njwks_refresh_seconds = 3600",
            quoted(&format!(
                "http://127.0.0.1:{}/jwks.json?client_secret=hush-hush",
                provider.port
            ))
        )
    };
    let gw = start(&redis, &up, &jwt(&old));
    let signed = token("rsa-1", "rsa.der");
    assert_eq!(status(&gw, &signed).await, 200);
    assert_eq!(gw.metric("sentinel_jwks_keys"), 1.0);

    let config = std::fs::read_to_string(&gw.config_path).unwrap();
    gw.rewrite_config(&config.replace(&jwt(&old), &jwt(&new)));
    assert_eq!(gw.reload(), 200, "{}", gw.logs());
    wait_until(Duration::from_secs(3), "the new provider's fetch", || {
        new.hits() >= 1
    });
    assert_eq!(status(&gw, &signed).await, 401, "the old provider's key");
    // No key verifies now: what an alert on a gateway that refuses every token reads.
    assert_eq!(gw.metric("sentinel_jwks_keys"), 0.0);
    wait_until(Duration::from_secs(3), "the WARN", || {
        gw.logs()
            .contains("cannot fetch the JWKS; tokens get 401 until it is fetched")
    });
    let logs = gw.logs();
    assert!(!logs.contains("hush-hush"), "{logs}");
    assert!(logs.contains("client_secret=***"), "{logs}");
}

/// A provider that takes connections and never answers (its listener, held by the caller),
/// and the `[auth.jwt]` section that names it.
fn hanging_provider() -> (std::net::TcpListener, String) {
    let hanging = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!(
        "http://127.0.0.1:{}/.well-known/jwks.json",
        hanging.local_addr().unwrap().port()
    );
    let section = format!(
        "[auth.jwt]\nalgorithms = [\"RS256\"]\njwks_url = {}\n",
        quoted(&url)
    );
    (hanging, section)
}

/// While the start waits for the JWKS (a provider that takes connections and never
/// answers: up to 5 s), the admin answers as a starting gateway's: `/readyz` 503 starting,
/// `/healthz` 200, and every other path 503 `{"detail":"starting"}`. (The admin proper
/// served `/metrics` and `/limits` then, and took a reload before the gateway was ready.)
#[test]
fn while_the_start_waits_for_the_jwks_the_admin_answers_as_starting() {
    let (hanging, section) = hanging_provider();
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let [port, admin] = common::free_ports();
    let config = GatewayConfig::new(&redis.url())
        .section(&section)
        .upstream("app", &[up.addr()])
        .route(
            Route::new("j.api")
                .prefix("/api")
                .identity("jwt")
                .unlimited(),
        )
        .render(port, admin);
    let starting = std::thread::spawn(move || common::Gateway::start_with(port, admin, &config));
    let at = |path: &str| common::blocking_get(&format!("http://127.0.0.1:{admin}{path}"));
    let mut seen = Vec::new();
    let still_starting =
        || at("/readyz").is_some_and(|(s, b)| s == 503 && b.contains(r#""starting":true"#));
    while !starting.is_finished() {
        let answers: Vec<_> = ["/metrics", "/limits/j.api?identity=global", "/reload"]
            .into_iter()
            .filter_map(|path| at(path).map(|answer| (path, answer)))
            .collect();
        // Kept when the gateway was still starting after them.
        if still_starting() {
            seen.extend(answers);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let gw = starting.join().unwrap();
    assert!(seen.len() >= 3, "{seen:?}");
    for (path, (status, body)) in &seen {
        assert_eq!(
            (*status, body.as_str()),
            (503, r#"{"detail":"starting"}"#),
            "{path}"
        );
    }
    assert_eq!(gw.metric("sentinel_config_generation"), 1.0);
    drop(hanging);
}

/// With `watch_config`, a change to the file made while the start waits for the JWKS is
/// loaded once the gateway is ready, by the watch, and not before: the start's own load is
/// generation 1 when `/readyz` first says ready, and the change is generation 2 after.
#[test]
fn a_change_during_the_starts_jwks_fetch_is_loaded_after_it() {
    let (hanging, section) = hanging_provider();
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let [port, admin] = common::free_ports();
    let text = GatewayConfig::new(&redis.url())
        .server("watch_config", "true")
        .section(&section)
        .upstream("app", &[up.addr()])
        .route(Route::new("j.open").prefix("/open").unlimited())
        .render(port, admin);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, &text).unwrap();
    let _gw = common::Proc::gateway(&path, None);
    let at = |path: &str| common::blocking_get(&format!("http://127.0.0.1:{admin}{path}"));
    wait_until(Duration::from_secs(10), "the starting admin", || {
        at("/readyz").is_some_and(|(s, b)| s == 503 && b.contains(r#""starting":true"#))
    });
    let added = text.replace("/open", "/moved");
    assert_ne!(added, text);
    std::fs::write(&path, added).unwrap();
    wait_until(Duration::from_secs(20), "ready", || {
        at("/readyz").is_some_and(|(s, _)| s == 200)
    });
    let generation = || {
        at("/metrics").and_then(|(_, body)| {
            body.lines()
                .find_map(|l| l.strip_prefix("sentinel_config_generation "))
                .and_then(|v| v.trim().parse::<f64>().ok())
        })
    };
    // The watch looks every 0.5 s and loads a change seen twice: a second at least.
    assert_eq!(generation(), Some(1.0), "not loaded while starting");
    wait_until(Duration::from_secs(10), "the change loaded", || {
        generation() == Some(2.0)
    });
    let get = |p: &str| {
        let head = format!("GET {p} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        common::raw_request(port, head.as_bytes())
    };
    assert_eq!((get("/moved/x"), get("/open/x")), (Some(200), Some(404)));
    drop(hanging);
}

/// A reload that moves `jwks_url` while a fetch from the old URL hangs lets that fetch go:
/// the new provider is asked at once, and its tokens verify within moments, not after the
/// hanging fetch's 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_off_a_hanging_provider_fetches_the_new_one_at_once() {
    let first = Provider::start(jwks_with(&["rsa-1"])).await;
    let next = Provider::start(jwks_with(&["rsa-1"])).await;
    // Connections are taken (the listen queue) and never answered.
    let hanging = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let jwt = |port: u16| {
        format!(
            "algorithms = [\"RS256\"]\njwks_url = \"http://127.0.0.1:{port}/jwks.json\"\njwks_refresh_seconds = 3600"
        )
    };
    let gw = start(&redis, &up, &jwt(first.port));
    let signed = token("rsa-1", "rsa.der");
    assert_eq!(status(&gw, &signed).await, 200);
    let config = std::fs::read_to_string(&gw.config_path).unwrap();
    let hanging_port = hanging.local_addr().unwrap().port();
    gw.rewrite_config(&config.replace(&jwt(first.port), &jwt(hanging_port)));
    assert_eq!(gw.reload(), 200, "{}", gw.logs());
    std::thread::sleep(Duration::from_millis(300));
    gw.rewrite_config(&config.replace(&jwt(first.port), &jwt(next.port)));
    let moved = std::time::Instant::now();
    assert_eq!(gw.reload(), 200, "{}", gw.logs());
    assert_eq!(status(&gw, &signed).await, 200);
    // Without letting the hanging fetch go: its 5 s first, then a 401 (the new provider not
    // yet asked). Room for a loaded machine.
    assert!(
        moved.elapsed() < Duration::from_secs(3),
        "{:?}",
        moved.elapsed()
    );
    assert_eq!(next.hits(), 1, "asked once");
}

/// A provider that cannot be fetched at start is logged once, with the reason (here the
/// connection refused, not only "error sending request"), and asked again when a token
/// needs it (not at once: a second failure to count and nothing new to say).
/// A redirect is followed only where `jwks_url` itself may point: one to plain http off
/// loopback is refused before any connection, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fetch_says_why_and_a_redirect_stays_where_the_url_may_point() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let gw = start(
        &redis,
        &up,
        &format!("algorithms = [\"RS256\"]\njwks_url = \"http://127.0.0.1:{port}/jwks.json\""),
    );
    // The start's fetch, once: the next is the refresh's, 30 s after a failure at most...
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        gw.metric("sentinel_jwks_refresh_total{result=\"failure\"}"),
        1.0
    );
    // ...or a token's whose `kid` the keys lack (none here).
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 401);
    wait_until(Duration::from_secs(5), "the retry", || {
        gw.metric("sentinel_jwks_refresh_total{result=\"failure\"}") == 2.0
    });
    let logs = gw.logs();
    let warned: Vec<_> = logs.lines().filter(|l| l.contains("JWKS")).collect();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(warned[0].contains("Connection refused"), "{}", warned[0]);

    // TEST-NET-1: never connected to, the policy refuses it first.
    let redirecting = Provider::start(
        "HTTP/1.1 302 Found\r\nlocation: http://192.0.2.1/jwks.json\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into(),
    )
    .await;
    let gw = start(
        &redis,
        &up,
        &format!(
            "algorithms = [\"RS256\"]\njwks_url = \"http://127.0.0.1:{}/jwks.json\"",
            redirecting.port
        ),
    );
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 401);
    let logs = gw.logs();
    assert!(
        logs.contains("redirected to a URL that is neither https nor http to a loopback address"),
        "{logs}"
    );
}

/// An outage whose reason changes says the new one: the provider answers 503, then a body
/// that is no JWKS; each reason is logged once (one line said the first reason for the whole
/// outage).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_whose_reason_changes_says_the_new_one() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let provider = Provider::start(String::new()).await;
    *provider.body.lock().unwrap() = None;
    let gw = start(
        &redis,
        &up,
        &format!(
            "algorithms = [\"RS256\"]\njwks_url = \"http://127.0.0.1:{}/jwks.json\"\njwks_refresh_seconds = 10",
            provider.port
        ),
    );
    *provider.body.lock().unwrap() = Some("not a JWKS".into());
    // Fetched again at once (perhaps before the body changed: the same reason, not said
    // again), then every 10 s.
    let warned = |gw: &common::Gateway| -> Vec<String> {
        gw.logs()
            .lines()
            .filter(|l| l.contains("JWKS") && l.contains("WARN"))
            .map(str::to_owned)
            .collect()
    };
    wait_until(Duration::from_secs(25), "the new reason said", || {
        warned(&gw).len() >= 2
    });
    let warned = warned(&gw);
    assert_eq!(warned.len(), 2, "{warned:?}");
    assert!(warned[0].contains("answered 503"), "{}", warned[0]);
    assert!(warned[1].contains("is not a JWKS"), "{}", warned[1]);
}

/// A fetched set may hold a key that cannot verify (here an Ed25519 key of 16 bytes, which
/// made the JWT library panic on a token signed for it, and a symmetric key, a secret
/// published): it is left out, the others serve, and one WARN names it, not one for every
/// fetch. A key for encryption is named once at INFO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetched_key_that_cannot_verify_is_left_out_and_named_once() {
    let mut set: serde_json::Value = serde_json::from_str(&jwks_with(&["rsa-1"])).unwrap();
    let keys = set["keys"].as_array_mut().unwrap();
    keys.push(serde_json::json!({
        "kty": "OKP", "crv": "Ed25519", "kid": "short-ed", "x": "AAAAAAAAAAAAAAAAAAAAAA"
    }));
    // A published secret, and an encryption key as providers publish beside their own.
    keys.push(serde_json::json!({"kty": "oct", "kid": "shared", "k": "c2VjcmV0LXNlY3JldA"}));
    let mut enc = keys[0].clone();
    enc["kid"] = "for-enc".into();
    enc["use"] = "enc".into();
    keys.push(enc);
    let (provider, gw, _processes) = verifying_from(&set, r#"["RS256", "EdDSA"]"#).await;
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 200);
    // An unknown kid fetches the same set again.
    let before = provider.hits();
    assert_eq!(status(&gw, &token("nobody", "other-rsa.der")).await, 401);
    assert_eq!(provider.hits(), before + 1);
    warned_once(&gw, "cannot verify a signature", "short-ed");
    warned_once(&gw, "cannot verify a signature", "shared: a symmetric key");
    // Not for signing: said at INFO, once.
    let beside: Vec<_> = (gw.logs().lines())
        .filter(|l| l.contains("keys not for signing"))
        .map(str::to_owned)
        .collect();
    assert_eq!(beside.len(), 1, "{beside:?}");
    assert!(
        beside[0].contains("for-enc") && beside[0].contains("\"level\":\"INFO\""),
        "{}",
        beside[0]
    );
}

/// A fetched set in which no key verifies is not used (the last good keys stay), and the
/// WARN that says so names each key left out and why, as when some keys verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetched_set_without_a_usable_key_names_the_keys_left_out() {
    let good: serde_json::Value = serde_json::from_str(&jwks_with(&["rsa-1"])).unwrap();
    let (provider, gw, _processes) = verifying_from(&good, r#"["RS256"]"#).await;
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 200);
    let mut bad = good.clone();
    bad["keys"][0]["kid"] = "leaked".into();
    bad["keys"][0]["d"] = "c2VjcmV0".into();
    (bad["keys"].as_array_mut().unwrap())
        .push(serde_json::json!({"kty": "oct", "kid": "shared", "k": "c2VjcmV0LXNlY3JldA"}));
    *provider.body.lock().unwrap() = Some(bad.to_string());
    // A token with an unknown kid asks for a fetch.
    assert_eq!(status(&gw, &token("nobody", "other-rsa.der")).await, 401);
    wait_until(Duration::from_secs(10), "the refused set said", || {
        gw.logs().contains("holds no key that verifies")
    });
    let line = (gw.logs().lines())
        .find(|l| l.contains("holds no key that verifies"))
        .unwrap()
        .to_owned();
    assert!(
        line.contains("\"level\":\"WARN\"")
            && line.contains("leaked: it holds its private key")
            && line.contains("shared: a symmetric key")
            && !line.contains("c2VjcmV0"),
        "{line}"
    );
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 200);
}

/// A fetched set larger than 1 MiB is a failed fetch, said with its reason; the last good
/// keys stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetched_set_over_a_mebibyte_is_a_failed_fetch() {
    let good: serde_json::Value = serde_json::from_str(&jwks_with(&["rsa-1"])).unwrap();
    let (provider, gw, _processes) = verifying_from(&good, r#"["RS256"]"#).await;
    let mut big = good.clone();
    big["padding"] = "x".repeat(1 << 20).into();
    *provider.body.lock().unwrap() = Some(big.to_string());
    assert_eq!(status(&gw, &token("nobody", "other-rsa.der")).await, 401);
    wait_until(Duration::from_secs(10), "the refused set said", || {
        gw.logs().contains("is larger than 1048576 bytes")
    });
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 200);
}

/// A gateway whose `jwks_url` is a provider serving `set`, verifying `algorithms` (a TOML
/// list), and the processes it needs, kept alive with it.
async fn verifying_from(
    set: &serde_json::Value,
    algorithms: &str,
) -> (Provider, common::Gateway, (Redis, Upstream)) {
    let provider = Provider::start(set.to_string()).await;
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let url = format!("http://127.0.0.1:{}/jwks.json", provider.port);
    let gw = start(
        &redis,
        &up,
        &format!("algorithms = {algorithms}\njwks_url = {}", quoted(&url)),
    );
    (provider, gw, (redis, up))
}

/// One log line says `what`, at WARN, and names `kid`.
fn warned_once(gw: &common::Gateway, what: &str, kid: &str) {
    let warned: Vec<_> = gw
        .logs()
        .lines()
        .filter(|l| l.contains(what))
        .map(str::to_owned)
        .collect();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].contains(kid) && warned[0].contains("\"level\":\"WARN\""),
        "{}",
        warned[0]
    );
}

/// A fetched key that came with its private half (`"d"`: the provider published it) is left
/// out, as the JWKS file's check refuses one: anyone who fetched it could sign tokens. The
/// others serve, and one WARN names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetched_key_published_with_its_private_half_is_left_out() {
    let mut set: serde_json::Value = serde_json::from_str(&jwks_with(&["rsa-1", "rsa-2"])).unwrap();
    for key in set["keys"].as_array_mut().unwrap() {
        if key["kid"] == "rsa-2" {
            key["d"] = "c2VjcmV0".into();
        }
    }
    let (_provider, gw, _processes) = verifying_from(&set, r#"["RS256"]"#).await;
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 200);
    assert_eq!(status(&gw, &token("rsa-2", "rsa2.der")).await, 401);
    warned_once(&gw, "private key", "rsa-2");
}

#[test]
fn check_refuses_plain_http_to_another_host_and_both_sources() {
    let dir = tempfile::tempdir().unwrap();
    let run = |jwt: &str| {
        common::check_body(
            dir.path(),
            &format!("[redis]\nurl = \"redis://127.0.0.1:1\"\n[auth.jwt]\nalgorithms = [\"RS256\"]\n{jwt}\n"),
            &[],
        )
    };
    let (ok, out) = run("jwks_url = \"http://idp.example/jwks.json\"");
    assert!(
        !ok && out.contains("http:// only to a loopback address"),
        "{out}"
    );
    let (ok, out) = run("jwks_url = \"https://idp.example/jwks.json\"");
    assert!(ok, "{out}");
    let (ok, out) = run(&format!(
        "jwks_url = \"https://idp.example/jwks.json\"\njwks_path = {}",
        quoted(fixture("jwks.json").to_str().unwrap())
    ));
    assert!(!ok && out.contains("are both set"), "{out}");
    let (ok, out) = run("jwks_url = \"https://idp.example/j\"\njwks_refresh_seconds = 1");
    assert!(
        !ok && out.contains("auth.jwt.jwks_refresh_seconds = 1 is out of range"),
        "{out}"
    );
}

/// A fetched set without kids beside tokens that name one: each such token asks for the
/// refresh an unknown kid asks for, is still refused after it (the token's kid picks the
/// key), and the cause is said once at INFO; a token without a kid is verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetched_set_without_kids_beside_tokens_naming_one_is_said_once() {
    let mut set: serde_json::Value = serde_json::from_str(&jwks_with(&["rsa-1"])).unwrap();
    set["keys"][0].as_object_mut().unwrap().remove("kid");
    let (provider, gw, _processes) = verifying_from(&set, r#"["RS256"]"#).await;
    let before = provider.hits();
    assert_eq!(status(&gw, &token("rsa-1", "rsa.der")).await, 401);
    assert_eq!(provider.hits(), before + 1, "the refresh asked for");
    assert_eq!(status(&gw, &token("rsa-2", "rsa.der")).await, 401);
    let said: Vec<_> = (gw.logs().lines())
        .filter(|l| l.contains("signed by a JWKS key that has no kid"))
        .map(str::to_owned)
        .collect();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains("\"level\":\"INFO\""), "{}", said[0]);
    assert_eq!(status(&gw, &signed(None, "rsa.der")).await, 200);
}
