//! `admin_token_env`: with a token configured, every admin request but the probes needs it as
//! a bearer token; without one, the admin listener answers as before.

mod common;

use common::config::{quoted, GatewayConfig, Route};
use common::{client, Redis, Upstream};
use std::time::Duration;

const TOKEN: &str = "admin-token-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_guards_everything_but_the_probes() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        .server("admin_token_env", quoted("SENTINEL_ADMIN_TOKEN"))
        .upstream("app", &[up.addr()])
        .route(Route::new("a.open").prefix("/").unlimited())
        .start_with_env(&[("SENTINEL_ADMIN_TOKEN", TOKEN)]);
    let http = client();
    for path in ["/healthz", "/readyz"] {
        let r = http.get(gw.admin(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path} stays open for probes");
        if path == "/readyz" {
            let body: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
            assert_eq!(body["ready"], true, "{body}");
        }
    }
    let metrics = (http.get(gw.admin("/metrics")))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        metrics.headers()["content-type"],
        "text/plain; version=0.0.4",
        "Prometheus' text format"
    );
    for (method, path) in [
        ("GET", "/metrics"),
        ("POST", "/reload"),
        ("GET", "/nowhere"),
        ("GET", "/limits/a.open?identity=global"),
        ("DELETE", "/limits/a.open?identity=global"),
    ] {
        let req = |auth: Option<&str>| {
            let mut r = http.request(method.parse().unwrap(), gw.admin(path));
            if let Some(a) = auth {
                r = r.header("Authorization", a);
            }
            r
        };
        for wrong in [
            None,
            Some("Bearer wrong"),
            Some(TOKEN),
            Some("Basic YWRtaW4="),
            Some(&format!("Basic {TOKEN}")),
            Some(&format!("Bearer{TOKEN}")),
        ] {
            let r = req(wrong).send().await.unwrap();
            assert_eq!(r.status(), 401, "{method} {path} with {wrong:?}");
            assert_eq!(r.headers()["www-authenticate"], "Bearer");
            assert_eq!(
                r.text().await.unwrap(),
                r#"{"detail":"authentication required"}"#
            );
        }
        // The scheme in any case and the token trimmed, as a route reads a bearer token.
        for right in [format!("Bearer {TOKEN}"), format!("BEARER  {TOKEN} ")] {
            let r = req(Some(&right)).send().await.unwrap();
            assert_ne!(r.status(), 401, "{method} {path} with {right:?}");
        }
    }
    assert!(!gw.logs().contains(TOKEN), "the token never reaches a log");
    // Every refusal counted; one line for them (at most one every 10 s), naming the first.
    let metrics = http
        .get(gw.admin("/metrics"))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("\nsentinel_admin_refused_total 30\n"),
        "{metrics}"
    );
    let logs = gw.logs();
    let refused: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("admin request refused"))
        .collect();
    assert_eq!(refused.len(), 1, "{}", gw.logs());
    for field in [
        r#""level":"INFO""#,
        r#""peer":"127.0.0.1""#,
        r#""method":"GET""#,
        r#""path":"/metrics""#,
        r#""token":"missing""#,
        r#""refused":1"#,
        r#""wrong":0"#,
        r#""missing":1"#,
    ] {
        assert!(refused[0].contains(field), "{field}: {}", refused[0]);
    }

    // Without the variable the config is invalid.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(
        &path,
        GatewayConfig::new(&redis.url())
            .server("admin_token_env", quoted("SENTINEL_TEST_UNSET_TOKEN"))
            .upstream("app", &[up.addr()])
            .route(Route::new("a.open").prefix("/").unlimited())
            .render(1, 2),
    )
    .unwrap();
    let out = common::check_config(&path, &[("SENTINEL_TEST_UNSET_TOKEN", None)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains(
        "server.admin_token_env: the environment variable SENTINEL_TEST_UNSET_TOKEN is not set"
    ));
    // A token no Authorization header can carry as it is (a stray space or newline from an
    // env file) would never match: refused at load, not at every admin request.
    for unsendable in ["an-admin-token-of-length ", "an-admin-token\nof-length-26"] {
        let out = common::check_config(&path, &[("SENTINEL_TEST_UNSET_TOKEN", Some(unsendable))]);
        assert_eq!(out.status.code(), Some(2), "{unsendable:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("the admin token must be visible ASCII"),
            "{stderr}"
        );
        assert!(
            !stderr.contains(unsendable.trim()),
            "the token is never printed"
        );
    }
}

/// A gateway with one unlimited route, `a.open`, for every path.
fn unlimited(redis: &Redis, up: &Upstream) -> common::Gateway {
    GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(Route::new("a.open").prefix("/").unlimited())
        .start()
}

/// The probes and `/metrics` answer `HEAD` as `GET` without a body (load balancers probe
/// with it); a method a path does not take is 405 with `Allow`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probes_answer_head_and_a_wrong_method_is_told_what_is_allowed() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = unlimited(&redis, &up);
    let http = client();
    for path in ["/healthz", "/readyz", "/metrics"] {
        let r = http.head(gw.admin(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "HEAD {path}");
        assert_eq!(r.bytes().await.unwrap().len(), 0, "HEAD {path} has no body");
    }
    for (method, path, allow) in [
        ("POST", "/healthz", "GET, HEAD"),
        ("DELETE", "/metrics", "GET, HEAD"),
        ("GET", "/reload", "POST"),
        (
            "POST",
            "/limits/a.open?identity=global",
            "GET, HEAD, DELETE",
        ),
    ] {
        let r = http
            .request(method.parse().unwrap(), gw.admin(path))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 405, "{method} {path}");
        assert_eq!(r.headers()["allow"], allow, "{method} {path}");
        assert_eq!(
            r.text().await.unwrap(),
            r#"{"detail":"method not allowed"}"#
        );
    }
}

/// `/metrics` is gzipped for a scraper that takes it (Prometheus asks so), plain text for one
/// that does not or refuses it; both say the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_gzipped_for_a_scraper_that_takes_it() {
    use std::io::Read;
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = unlimited(&redis, &up);
    let http = client();
    let get = |encoding: Option<&'static str>| {
        let (http, url) = (http.clone(), gw.admin("/metrics"));
        async move {
            let mut r = http.get(url);
            if let Some(e) = encoding {
                r = r.header("accept-encoding", e);
            }
            let r = r.send().await.unwrap();
            // Either way the answer depends on what was asked: caches are told so.
            assert_eq!(r.headers()["vary"], "accept-encoding");
            let zipped = r
                .headers()
                .get("content-encoding")
                .map(|v| v.to_str().unwrap().to_owned());
            (zipped, r.bytes().await.unwrap())
        }
    };
    // As Prometheus asks.
    let (zipped, body) = get(Some("gzip")).await;
    assert_eq!(zipped.as_deref(), Some("gzip"));
    let mut text = String::new();
    flate2::read::GzDecoder::new(&body[..])
        .read_to_string(&mut text)
        .expect("a gzip stream");
    assert!(text.contains("sentinel_config_generation 1"), "{text}");
    // Without jwks_url, no keys gauge to read as "none held" (SentinelJwksEmpty).
    assert!(!text.contains("sentinel_jwks_keys"), "{text}");
    assert!(
        body.len() * 3 < text.len(),
        "{} of {}",
        body.len(),
        text.len()
    );
    for (asked, expected) in [
        (None, None),
        (Some("identity"), None),
        (Some("gzip;q=0, identity"), None),
        (Some("br;q=1.0, *;q=0.5"), Some("gzip")),
        (Some("deflate, gzip;q=0.8"), Some("gzip")),
    ] {
        let (zipped, body) = get(asked).await;
        assert_eq!(zipped.as_deref(), expected, "{asked:?}");
        if expected.is_none() {
            let plain = String::from_utf8(body.to_vec()).unwrap();
            assert!(plain.contains("sentinel_config_generation 1"), "{asked:?}");
        }
    }
}

/// A client that closes its side once its request is sent (`nc -N`, `printf | nc -q0`) gets
/// its answer, and what it asked for is done and logged: a reset's line was lost with the
/// answer before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_closed_admin_request_is_answered_and_logged() {
    use std::io::{Read, Write};
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(
            Route::new("a.key")
                .prefix("/")
                .identity_header("X-Key")
                .token_bucket(3_000_000, 0),
        )
        .start();
    let http = client();
    for _ in 0..3 {
        let r = http
            .get(gw.url("/x"))
            .header("X-Key", "hc")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let half_closed = |request: &str| {
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", gw.admin_port)).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        conn.write_all(request.as_bytes()).unwrap();
        conn.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = String::new();
        let _ = conn.read_to_string(&mut answer);
        answer
    };
    let answer = half_closed("GET /healthz HTTP/1.1\r\nHost: admin\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    let answer = half_closed(
        "DELETE /limits/a.key?identity=header%3Ax-key%3Ahc HTTP/1.1\r\nHost: admin\r\n\r\n",
    );
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(answer.contains(r#""keys_deleted":1"#), "{answer}");
    common::wait_until(Duration::from_secs(2), "the reset's log line", || {
        gw.logs().contains("limits reset from the admin listener")
    });
    let r = http
        .get(gw.url("/x"))
        .header("X-Key", "hc")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the bucket starts full");
}

/// An unlimited route keys no request: any identity has no limits there, and a reset
/// deletes nothing, without asking Redis (stopped here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlimited_route_has_no_limits_to_read_or_reset() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = unlimited(&redis, &up);
    drop(redis);
    let http = client();
    for identity in ["global", "header%3Ax-api-key%3Ak", "ip%3A10.0.0.1"] {
        let url = gw.admin(&format!("/limits/a.open?identity={identity}"));
        let read = http.get(&url).send().await.unwrap();
        assert_eq!(read.status(), 200, "{identity}");
        let read: serde_json::Value = serde_json::from_str(&read.text().await.unwrap()).unwrap();
        assert_eq!(read["limits"], serde_json::json!([]), "{identity}");
        assert_eq!(read["tier"], serde_json::Value::Null);
        let reset = http.delete(&url).send().await.unwrap();
        assert_eq!(reset.status(), 200, "{identity}");
        assert_eq!(
            reset.text().await.unwrap(),
            r#"{"keys_deleted":0,"reset":true}"#
        );
    }
    assert!(!gw.logs().contains("limits reset"), "nothing was reset");
}
