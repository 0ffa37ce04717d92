//! The gateway on the happy path: real redis-server, real upstream, real HTTP.

mod common;

use std::time::Duration;

use common::config::{GatewayConfig, Route};
use common::{client, raw_request, Gateway, Redis, Upstream};
use sentinel_gateway::limiter::{bucket_key, identity_hash};

/// The base config with the upstream `app` at `up`: 500 ms to connect, 5 s to answer.
fn app_config(redis_url: &str, up: &Upstream) -> GatewayConfig {
    GatewayConfig::new(redis_url).upstream_timeouts("app", &[up.addr()], Some(500), Some(5000))
}

/// A fail_closed token bucket of `capacity` requests on a path prefix, policy version 1.
fn bucket(id: &str, prefix: &str, capacity: u64, refill_rate_micro_per_sec: u64) -> Route {
    Route::new(id)
        .prefix(prefix)
        .token_bucket(capacity * 1_000_000, refill_rate_micro_per_sec)
        .fail_closed()
        .policy_version(1)
}

async fn status_of(resp: reqwest::Result<reqwest::Response>) -> u16 {
    resp.expect("gateway answers").status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_longer_than_a_day_is_told_whole() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    // One token, refilled at 5 micro-tokens a second: the next one in 200 000 s.
    let gw = app_config(&redis.url(), &up)
        .route(bucket("t.slow", "/api", 1, 5).identity_header("X-API-Key"))
        .start();
    let http = client();
    let get = || {
        http.get(gw.url("/api/x"))
            .header("x-api-key", "alice")
            .send()
    };
    assert_eq!(get().await.unwrap().status(), 200);
    // Redis's denial, then the over-limit cache's repeat of it: the same wait, whole.
    for source in ["redis", "the over-limit cache"] {
        let denied = get().await.unwrap();
        assert_eq!(denied.status(), 429, "{source}");
        let retry = common::retry_after(&denied);
        assert!(
            (199_990..=200_000).contains(&retry),
            "{source}: Retry-After {retry}, the wait is 200 000 s"
        );
    }
    assert_eq!(
        gw.metric(r#"sentinel_overlimit_cache_hits_total{endpoint_id="t.slow"}"#),
        1.0,
        "the second denial came from the over-limit cache"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_admits_its_capacity_then_429s_then_refills() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    // The bucket's arithmetic, not the budget, is under test: a generous budget keeps a
    // loaded machine's late first answer (its SCRIPT LOAD) from failing closed as a 503.
    let gw = app_config(&redis.url(), &up)
        .redis("timeout_ms", "1000")
        .route(bucket("t.bucket", "/api", 3, 1_000_000).identity_header("X-API-Key"))
        .start();
    let http = client();
    for i in 0..3 {
        let r = http
            .get(gw.url("/api/x"))
            .header("x-api-key", "alice")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "request {i} within capacity");
        assert_eq!(r.headers()["x-upstream"], "app");
    }
    let denied = http
        .get(gw.url("/api/x"))
        .header("x-api-key", "alice")
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), 429);
    assert_eq!(denied.headers()["content-type"], "application/json");
    assert_eq!(
        denied.headers()["retry-after"],
        "1",
        "one token refills in 1 s"
    );
    assert_eq!(
        denied.text().await.unwrap(),
        r#"{"detail":"rate limit exceeded"}"#
    );

    // One token per second: after a little over a second exactly one more is admitted.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let again = http
        .get(gw.url("/api/x"))
        .header("x-api-key", "alice")
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    let next = http
        .get(gw.url("/api/x"))
        .header("x-api-key", "alice")
        .send()
        .await
        .unwrap();
    assert_eq!(next.status(), 429);

    assert_eq!(gw.metric(r#"sentinel_decisions_total{allowed="true",decision_reason="allowed",endpoint_id="t.bucket"}"#), 4.0);
    assert_eq!(gw.metric(r#"sentinel_decisions_total{allowed="false",decision_reason="rate_limited",endpoint_id="t.bucket"}"#), 2.0);
    // A route of one limit names it `default`.
    assert_eq!(
        gw.metric(r#"sentinel_limit_denials_total{endpoint_id="t.bucket",limit="default"}"#),
        2.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="t.bucket",status="200"}"#),
        4.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="t.bucket",status="429"}"#),
        2.0
    );
    let logs = gw.logs();
    let deny_lines: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("\"request denied\""))
        .collect();
    assert_eq!(deny_lines.len(), 2, "one WARN line per denial");
    for field in [
        "\"endpoint_id\":\"t.bucket\"",
        "\"decision_reason\":\"rate_limited\"",
        "\"latency_us\":",
        "\"breaker_state\":\"closed\"",
        "\"status\":429",
        &format!(
            "\"identity_hash\":\"{}\"",
            identity_hash("header:x-api-key:alice")
        ),
    ] {
        assert!(
            deny_lines[0].contains(field),
            "deny line lacks {field}: {}",
            deny_lines[0]
        );
    }
    assert!(!logs.contains("alice"), "a raw identity reached the logs");
    assert_eq!(
        logs.matches("\"endpoint_id\":\"t.bucket\"").count(),
        2,
        "admissions are not logged: only the two denials name the endpoint"
    );
    // Every decision is timed; every Redis evaluation too (no over-limit cache hit here).
    assert_eq!(
        gw.metric(r#"sentinel_decision_duration_seconds_count{endpoint_id="t.bucket"}"#),
        6.0
    );
    assert_eq!(gw.metric("sentinel_redis_duration_seconds_count"), 6.0);
    let (status, metrics) = common::blocking_get(&gw.admin("/metrics")).unwrap();
    assert_eq!(status, 200);
    assert!(
        !metrics.contains("alice") && !metrics.contains(&identity_hash("header:x-api-key:alice")),
        "no identity in metrics"
    );
    assert_eq!(
        common::blocking_get(&gw.admin("/healthz")),
        Some((200, r#"{"status":"ok"}"#.to_owned()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_on_one_bucket_admit_exactly_its_capacity() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    // A 1 s budget: this test counts admissions under concurrency; a decision of a debug
    // build answered after 20 ms on a busy machine would be a 503 by design, not a miscount.
    let gw = app_config(&redis.url(), &up)
        .redis("timeout_ms", "1000")
        .route(bucket("t.shared", "/api", 50, 0).identity("global"))
        .start();
    let url = gw.url("/api/doc");
    // 30 connections, 10 requests each.
    let tasks: Vec<_> = (0..30)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let http = client();
                let mut seen = Vec::new();
                for _ in 0..10 {
                    seen.push(status_of(http.post(&url).body("x").send().await).await);
                }
                seen
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.extend(t.await.unwrap());
    }
    let admitted = statuses.iter().filter(|&&s| s == 200).count();
    let denied = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!(
        (admitted, denied),
        (50, 250),
        "every answer is 200 or 429 and exactly 50 pass"
    );
    assert_eq!(gw.metric(r#"sentinel_decisions_total{allowed="true",decision_reason="allowed",endpoint_id="t.shared"}"#), 50.0);
    assert_eq!(gw.metric(r#"sentinel_decisions_total{allowed="false",decision_reason="rate_limited",endpoint_id="t.shared"}"#), 250.0);
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="t.shared",status="429"}"#),
        250.0
    );
    // Each decision in exactly one call; decisions in flight together may share one.
    let calls = redis.command_calls("evalsha");
    assert!(
        calls <= 300,
        "at most one EVALSHA per limited request: {calls}"
    );
    assert_eq!(gw.metric("sentinel_redis_batch_size_sum"), 300.0);
    assert_eq!(gw.metric("sentinel_redis_batch_size_count"), calls as f64);
    // Refill 0: the bucket never expires and never refills.
    let key = bucket_key("sentinel", "global", "t.shared", 1);
    let ttl: i64 = redis::cmd("TTL")
        .arg(&key)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(ttl, -1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identities_keys_and_policy_versions() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let routes = |version| {
        app_config(&redis.url(), &up)
            .route(
                bucket("t.keyed", "/keyed", 2, 0)
                    .identity_header("X-API-Key")
                    .policy_version(version),
            )
            .route(bucket("t.global", "/global", 2, 0).identity("global"))
            .route(bucket("t.ip", "/ip", 2, 0).identity("client_ip"))
    };
    let gw = routes(1).start();
    let http = client();
    let get = |path: &str, key: Option<&str>| {
        let mut r = http.get(gw.url(path));
        if let Some(k) = key {
            r = r.header("X-API-Key", k);
        }
        async move { r.send().await.unwrap().status().as_u16() }
    };
    // Header identities: distinct buckets.
    assert_eq!(
        [
            get("/keyed", Some("a")).await,
            get("/keyed", Some("a")).await,
            get("/keyed", Some("a")).await
        ],
        [200, 200, 429]
    );
    assert_eq!(
        [
            get("/keyed", Some("b")).await,
            get("/keyed", Some("b")).await
        ],
        [200, 200]
    );
    // Global: one bucket whoever asks.
    assert_eq!(
        [
            get("/global", Some("a")).await,
            get("/global", Some("b")).await,
            get("/global", None).await
        ],
        [200, 200, 429]
    );
    assert_eq!(
        [
            get("/ip", None).await,
            get("/ip", Some("z")).await,
            get("/ip", None).await
        ],
        [200, 200, 429]
    );
    let mut expected = vec![
        bucket_key("sentinel", "header:x-api-key:a", "t.keyed", 1),
        bucket_key("sentinel", "header:x-api-key:b", "t.keyed", 1),
        bucket_key("sentinel", "global", "t.global", 1),
        bucket_key("sentinel", "ip:127.0.0.1", "t.ip", 1),
    ];
    expected.sort();
    assert_eq!(redis.keys("sentinel:*"), expected);

    // A new policy version starts every bucket of the endpoint afresh.
    gw.rewrite_config(&routes(2).render(gw.port, gw.admin_port));
    let reload = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(reload.status(), 200);
    assert_eq!(
        reload.text().await.unwrap(),
        r#"{"config_generation":2,"reloaded":true}"#
    );
    assert_eq!(
        [
            get("/keyed", Some("a")).await,
            get("/keyed", Some("a")).await,
            get("/keyed", Some("a")).await
        ],
        [200, 200, 429]
    );
    assert!(redis.keys("sentinel:*").contains(&bucket_key(
        "sentinel",
        "header:x-api-key:a",
        "t.keyed",
        2
    )));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_before_the_limiter_never_reach_redis() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = app_config(&redis.url(), &up)
        .route(bucket("t.limited", "/limited", 5, 0).identity_header("X-API-Key"))
        .route(Route::new("t.open").path("/open").unlimited())
        .start();
    let http = client();
    redis.reset_stats();

    let r = http.get(gw.url("/nothing/here")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.headers()["content-type"], "application/json");
    assert_eq!(r.text().await.unwrap(), r#"{"detail":"no route"}"#);

    let r = http.get(gw.url("/limited")).send().await.unwrap();
    assert_eq!(r.status(), 401, "missing identity header");
    assert!(
        r.headers().get("www-authenticate").is_none(),
        "only jwt routes name the Bearer scheme"
    );
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"detail":"authentication required"}"#
    );
    let r = http
        .get(gw.url("/limited"))
        .header("X-API-Key", "")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "empty identity header");

    for bad in [
        "/limited/a%2fb",
        "/limited/%00",
        "/limited/%ff",
        "/limited/a%5Cb",
        "/limited/%zz",
    ] {
        let r = http
            .get(gw.url(bad))
            .header("X-API-Key", "k")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        assert_eq!(r.text().await.unwrap(), r#"{"detail":"bad request"}"#);
    }
    // Sent raw: a URL library would resolve the dots before sending.
    assert_eq!(
        raw_request(
            gw.port,
            b"GET /../../etc/passwd HTTP/1.1\r\nHost: x\r\nX-API-Key: k\r\n\r\n"
        ),
        Some(400)
    );
    assert_eq!(
        raw_request(
            gw.port,
            b"GET /limited/%2e%2e/%2E%2e/x HTTP/1.1\r\nHost: x\r\nX-API-Key: k\r\n\r\n"
        ),
        Some(400)
    );
    // Bytes that are no UTF-8 sent raw, not escaped: the path is not valid UTF-8 either
    // (read as the replacement character, every such path would be one).
    for bad in [&b"\xff"[..], b"\xc3(", b"a\xe2\x82"] {
        let head = [
            &b"GET /limited/"[..],
            bad,
            b" HTTP/1.1\r\nHost: x\r\nX-API-Key: k\r\n\r\n",
        ]
        .concat();
        assert_eq!(raw_request(gw.port, &head), Some(400), "{bad:?}");
    }
    // HTTP/1.1 without Host (RFC 9112, 3.2); HTTP/1.0 may leave it out.
    assert_eq!(
        raw_request(gw.port, b"GET /open HTTP/1.1\r\nConnection: close\r\n\r\n"),
        Some(400)
    );
    assert_eq!(
        raw_request(gw.port, b"GET /open HTTP/1.0\r\n\r\n"),
        Some(200)
    );
    // CONNECT: the gateway is no tunnel, and says so as it says everything else.
    {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        conn.write_all(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        let _ = conn.read_to_string(&mut answer);
        let lower = answer.to_ascii_lowercase();
        assert!(answer.starts_with("HTTP/1.1 405"), "{answer}");
        assert!(lower.contains("content-type: application/json"), "{answer}");
        assert!(lower.contains("x-request-id: "), "{answer}");
        assert!(
            answer.ends_with(r#"{"detail":"method not allowed"}"#),
            "{answer}"
        );
    }
    // TRACE, as nginx: never echoed by a backend (cross-site tracing).
    let trace = http
        .request(reqwest::Method::TRACE, gw.url("/open"))
        .send()
        .await
        .unwrap();
    assert_eq!(trace.status(), 405);
    assert_eq!(
        trace.text().await.unwrap(),
        r#"{"detail":"method not allowed"}"#
    );

    for _ in 0..5 {
        assert_eq!(
            http.get(gw.url("/open")).send().await.unwrap().status(),
            200
        );
    }
    assert_eq!(
        redis.limiter_calls(),
        0,
        "no limiter command for 404, 401, 400 or algorithm none"
    );
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="_unmatched",status="404"}"#),
        1.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="t.limited",status="401"}"#),
        2.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="t.open",status="200"}"#),
        6.0,
        "five, and the HTTP/1.0 one"
    );
    let decisions: f64 = ["allowed", "rate_limited"].iter().map(|r| gw.metric(&format!(r#"sentinel_decisions_total{{allowed="{}",decision_reason="{r}",endpoint_id="t.limited"}}"#, r == &"allowed"))).sum();
    assert_eq!(decisions, 0.0, "a 401 produces no decision");
}

/// A raw space in an HTTP/1 target is taken as `%20` wherever it stands in the request line,
/// with h2c on as off. With h2c on, the look for the HTTP/2 preface reads at most its 24
/// bytes first, and a line cut there with its space in it was refused 400.
#[test]
fn a_raw_space_in_the_target_is_read_as_an_escape_wherever_it_stands() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    for h2c in ["true", "false"] {
        let gw = GatewayConfig::new(&redis.url())
            .server("h2c", h2c)
            .upstream("app", &[up.addr()])
            .route(Route::new("t.space").prefix("/rl").unlimited())
            .start();
        for n in 1..=30 {
            let request = format!(
                "GET /rl/{} b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                "a".repeat(n)
            );
            assert_eq!(
                common::raw_request(gw.port, request.as_bytes()),
                Some(200),
                "h2c = {h2c}, the space after {} bytes",
                8 + n
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_the_normalized_request_and_round_robins() {
    let redis = Redis::start();
    let (a, b) = (Upstream::start("a"), Upstream::start("b"));
    let gw = GatewayConfig::new(&redis.url())
        .upstream_timeouts("app", &[a.addr(), b.addr()], Some(500), Some(5000))
        .route(Route::new("t.fwd").prefix("/docs").unlimited())
        .start();
    let http = client();
    let r = http
        .put(gw.url("/x/..//docs/./%7Euser/%41b%20c?q=1&r=%2F"))
        .header("X-Custom", "kept")
        .body("hello body")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let echo: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(echo["method"], "PUT");
    assert_eq!(echo["path"], "/docs/~user/Ab%20c");
    assert_eq!(echo["query"], "q=1&r=%2F");
    assert_eq!(echo["headers"]["x-custom"], "kept");
    assert_eq!(echo["body"], "hello body");

    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..10 {
        let r = http.get(gw.url("/docs")).send().await.unwrap();
        *seen
            .entry(r.headers()["x-upstream"].to_str().unwrap().to_owned())
            .or_insert(0) += 1;
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        vec![("a".to_owned(), 5), ("b".to_owned(), 5)]
    );
}

/// An upstream whose name TOML quotes (`[upstreams."pdftalk.internal v2"]`, as the docs
/// allow) is the one its routes name: served at start and after a reload that renames it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_whose_name_is_quoted_is_served() {
    let redis = Redis::start();
    let (a, b) = (Upstream::start("a"), Upstream::start("b"));
    let name = "pdftalk.internal v2";
    let gw = GatewayConfig::new(&redis.url())
        .upstream(&format!("\"{name}\""), &[a.addr()])
        .route(
            Route::new("t.quoted")
                .prefix("/docs")
                .upstream(name)
                .unlimited(),
        )
        .start();
    let http = client();
    let served_by = |r: reqwest::Response| {
        assert_eq!(r.status(), 200);
        r.headers()["x-upstream"].to_str().unwrap().to_owned()
    };
    assert_eq!(
        served_by(http.get(gw.url("/docs")).send().await.unwrap()),
        "a"
    );
    let written = std::fs::read_to_string(&gw.config_path).unwrap();
    let renamed = (written.replace("pdftalk.internal v2", "é\\\\b"))
        .replace(&a.addr().to_string(), &b.addr().to_string());
    gw.rewrite_config(&renamed);
    let (status, body) = gw.reload_answer();
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        served_by(http.get(gw.url("/docs")).send().await.unwrap()),
        "b"
    );
    // The reload's line says which config now serves, as /readyz does, and its routes.
    let ready = common::blocking_get(&gw.admin("/readyz")).unwrap().1;
    let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
    let logs = gw.logs();
    let line = (logs.lines())
        .find(|l| l.contains(r#""message":"config reloaded""#))
        .unwrap();
    let line: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(line["config_hash"], ready["config_hash"], "{line}");
    assert_eq!(line["routes"], 1, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_is_502_and_slow_is_504() {
    let redis = Redis::start();
    let up = Upstream::start("slow");
    let dead = format!("127.0.0.1:{}", common::free_port());
    let gw = GatewayConfig::new(&redis.url())
        .upstream_timeouts("dead", &[dead], Some(500), Some(1000))
        .upstream_timeouts("slow", &[up.addr()], Some(500), Some(300))
        .route(
            Route::new("t.dead")
                .prefix("/dead")
                .upstream("dead")
                .unlimited(),
        )
        .route(
            Route::new("t.slow")
                .prefix("/slow")
                .upstream("slow")
                .unlimited(),
        )
        .start();
    let http = client();
    let r = http.get(gw.url("/dead")).send().await.unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(r.headers()["content-type"], "application/json");
    // The request id on the gateway's own answers too, and in the request's WARN line.
    let dead_id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(dead_id.len(), 32, "{dead_id}");
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"detail":"upstream unavailable"}"#
    );
    let r = http.get(gw.url("/slow?ms=3000")).send().await.unwrap();
    assert_eq!(r.status(), 504);
    assert_eq!(r.headers()["x-request-id"].len(), 32);
    assert_eq!(r.text().await.unwrap(), r#"{"detail":"upstream timeout"}"#);
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="t.dead",status="502"}"#),
        1.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="t.slow",status="504"}"#),
        1.0
    );
    let logs = gw.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("\"upstream failed\"") && l.contains("\"endpoint_id\":\"t.dead\""))
        .expect("one structured WARN line per upstream failure");
    assert!(
        line.contains("\"status\":502") && line.contains("\"upstream\":\"dead\""),
        "{line}"
    );
    assert!(
        line.contains(&format!("\"request_id\":\"{dead_id}\"")),
        "{line}"
    );
}

/// An upstream on loopback that answers `200 ok` on kept-alive connections, and closes the
/// connection without an answer to any request for a path under `/drop`, counting those.
async fn dropping_upstream() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let dropped = std::sync::Arc::new(AtomicUsize::new(0));
    let count = std::sync::Arc::clone(&dropped);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let count = std::sync::Arc::clone(&count);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Ok(n) = conn.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    head.extend_from_slice(&buf[..n]);
                    while let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
                        let request: Vec<u8> = head.drain(..end + 4).collect();
                        if request
                            .split(|b| *b == b' ')
                            .nth(1)
                            .is_some_and(|p| p.starts_with(b"/drop"))
                        {
                            count.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                        let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                        if conn.write_all(ok).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, dropped)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_upstream_drops_is_sent_at_most_twice() {
    use std::sync::atomic::Ordering;
    let redis = Redis::start();
    let (addr, dropped) = dropping_upstream().await;
    let gw = GatewayConfig::new(&redis.url())
        .upstream_timeouts("app", &[addr.to_string()], Some(500), Some(2000))
        .route(
            Route::new("t.any")
                .prefix("/")
                .upstream("app")
                .unlimited()
                .set("max_body_bytes", "100"),
        )
        .start();
    let http = client();
    // Kept-alive upstream connections for the drops to be sent on: one per concurrent
    // request, pooled when each is answered.
    for _ in 0..3 {
        let oks =
            futures_util::future::join_all((0..8).map(|_| http.get(gw.url("/ok")).send())).await;
        for r in oks {
            assert_eq!(r.unwrap().status(), 200);
        }
    }
    // Sent on a kept connection that fails, a GET is sent once more (the upstream may have
    // closed that connection as it was sent), and no more.
    let r = http.get(gw.url("/drop")).send().await.unwrap();
    assert_eq!(r.status(), 502);
    let gets = dropped.load(Ordering::SeqCst);
    assert_eq!(gets, 2, "the upstream received the GET {gets} times");
    // A PUT is sent twice too, its body counted once against `max_body_bytes` (60 of 100
    // bytes, twice over the two attempts, is not a body over the limit).
    let r = http
        .put(gw.url("/drop"))
        .body("p".repeat(60))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(dropped.load(Ordering::SeqCst) - gets, 2);
    // A POST is never sent twice.
    let before = dropped.load(Ordering::SeqCst);
    let r = http.post(gw.url("/drop")).body("x").send().await.unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(dropped.load(Ordering::SeqCst) - before, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_tried_again_is_logged_with_its_request_id_and_no_query() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dead = format!("127.0.0.1:{}", common::free_port());
    let gw = GatewayConfig::new(&redis.url())
        .upstream_timeouts("app", &[dead, up.addr()], Some(500), Some(2000))
        .route(Route::new("t.two").prefix("/").upstream("app").unlimited())
        .start();
    let http = client();
    let mut ids = Vec::new();
    for _ in 0..4 {
        let r = http
            .get(gw.url("/two/x?access_token=TOPSECRET1"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "the live address answers");
        ids.push(r.headers()["x-request-id"].to_str().unwrap().to_owned());
    }
    let logs = gw.logs();
    assert!(!logs.contains("TOPSECRET1"), "{logs}");
    let retried: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("an upstream attempt failed"))
        .collect();
    assert!(
        !retried.is_empty(),
        "half the requests meet the dead address first: {logs}"
    );
    for line in retried {
        assert!(line.contains("\"level\":\"WARN\""), "{line}");
        assert!(
            ids.iter()
                .any(|id| line.contains(&format!("\"request_id\":\"{id}\""))),
            "{line}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_by_specificity_not_file_order() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let route = |id: &str| Route::new(id).unlimited();
    let gw = app_config(&redis.url(), &up)
        .route(route("r.root").prefix("/"))
        .route(route("r.short").prefix("/a"))
        .route(route("r.long").prefix("/a/b"))
        .route(route("r.exact").path("/a/b"))
        .route(route("r.host").prefix("/a").host("api.example.com"))
        .route(route("r.post").prefix("/a").methods(&["POST"]))
        // The fully qualified form, in any case, is the same host.
        .route(route("r.fqdn").prefix("/a").host("Fqdn.Example."))
        // An IPv6 address as a `Host` carries it, and a name with `_` (both were refused).
        .route(route("r.v6").prefix("/a").host("[::1]"))
        .route(route("r.under").prefix("/a").host("Under_Score.example"))
        .start();
    let http = client();
    let cases: &[(&str, &str, Option<&str>, &str)] = &[
        ("GET", "/a/b", None, "r.exact"),
        ("GET", "/a/b/", None, "r.exact"),
        ("GET", "/a/b/c", None, "r.long"),
        ("GET", "/a/bc", None, "r.short"),
        ("GET", "/a", Some("API.example.com:8080"), "r.host"),
        ("POST", "/a/x", None, "r.post"),
        ("POST", "/a/x", Some("api.example.com"), "r.host"),
        ("GET", "/zzz", None, "r.root"),
        ("GET", "/a", Some("fqdn.example"), "r.fqdn"),
        ("GET", "/a/q", Some("FQDN.example.:8080"), "r.fqdn"),
        ("GET", "/a", Some("[::1]:8080"), "r.v6"),
        ("GET", "/a/v", Some("[0:0::0:1]"), "r.v6"),
        ("GET", "/a", Some("under_score.example"), "r.under"),
    ];
    for (method, path, host, want) in cases {
        let mut req = http.request(method.parse().unwrap(), gw.url(path));
        if let Some(h) = host {
            req = req.header("host", *h);
        }
        assert_eq!(req.send().await.unwrap().status(), 200);
        let series = format!(r#"sentinel_requests_total{{endpoint_id="{want}",status="200"}}"#);
        assert!(
            gw.metric(&series) >= 1.0,
            "{method} {path} host {host:?} should go to {want}"
        );
    }
    let total: f64 = [
        "r.root", "r.short", "r.long", "r.exact", "r.host", "r.post", "r.fqdn", "r.v6", "r.under",
    ]
    .iter()
    .map(|id| {
        gw.metric(&format!(
            r#"sentinel_requests_total{{endpoint_id="{id}",status="200"}}"#
        ))
    })
    .sum();
    assert_eq!(total, cases.len() as f64);
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="r.exact",status="200"}"#),
        2.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unreachable_is_a_503_never_a_500_or_a_hang() {
    let up = Upstream::start("app");
    let nowhere = format!("redis://127.0.0.1:{}/0", common::free_port());
    let gw = app_config(&nowhere, &up)
        .route(bucket("t.closed", "/c", 5, 0).identity("global"))
        .start();
    let http = client();
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let r = http.get(gw.url("/c")).send().await.unwrap();
        assert_eq!(r.status(), 503);
        let retry = common::retry_after(&r);
        assert!(retry >= 1);
        assert_eq!(
            r.text().await.unwrap(),
            r#"{"detail":"rate limiter unavailable"}"#
        );
        // Generous bound for a loaded 2-core machine; the budget itself is 20 ms.
        assert!(started.elapsed() < Duration::from_millis(500));
    }
    let (status, body) = common::blocking_get(&gw.admin("/readyz")).unwrap();
    assert_eq!(
        status, 200,
        "a Redis outage does not make the gateway unready"
    );
    assert!(body.contains(r#""redis":"down""#), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_window_cost_and_ratelimit_headers() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = app_config(&redis.url(), &up)
        .route(
            Route::new("t.window")
                .path("/window")
                .identity("global")
                .sliding_window(3, 2_000_000)
                .set("ratelimit_headers", "true"),
        )
        .route(
            Route::new("t.costly")
                .path("/costly")
                .identity("global")
                .token_bucket(5_000_000, 1_000_000)
                .set("cost_micro", "2_000_000")
                .set("ratelimit_headers", "true"),
        )
        .start();
    let http = client();
    let mut remaining = Vec::new();
    for _ in 0..3 {
        let r = http.get(gw.url("/window")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["ratelimit-policy"], r#""t.window";q=3;w=2"#);
        remaining.push(r.headers()["ratelimit"].to_str().unwrap().to_owned());
    }
    for (i, v) in remaining.iter().enumerate() {
        assert!(
            v.starts_with(&format!(r#""t.window";r={};t="#, 2 - i)),
            "{v}"
        );
    }
    let denied = http.get(gw.url("/window")).send().await.unwrap();
    assert_eq!(denied.status(), 429);
    let retry = common::retry_after(&denied);
    assert!(
        (1..=4).contains(&retry),
        "the estimate admits again within two windows: {retry}"
    );
    assert!(denied.headers()["ratelimit"]
        .to_str()
        .unwrap()
        .starts_with(r#""t.window";r=0"#));
    // The over-limit cache repeats the denial with the same fields.
    let repeated = http.get(gw.url("/window")).send().await.unwrap();
    assert_eq!(repeated.status(), 429);
    assert_eq!(
        gw.metric(r#"sentinel_overlimit_cache_hits_total{endpoint_id="t.window"}"#),
        1.0
    );
    assert_eq!(
        repeated.headers()["ratelimit-policy"],
        r#""t.window";q=3;w=2"#
    );
    let fields = repeated.headers()["ratelimit"].to_str().unwrap();
    let t: u64 = fields
        .strip_prefix(r#""t.window";r=0;t="#)
        .unwrap_or_else(|| panic!("{fields}"))
        .parse()
        .unwrap();
    // The window ends within 2 s, but the denial lasts until the estimate admits: `t` is
    // never before the `Retry-After`, or a client reading `t` comes back still refused.
    let wait = common::retry_after(&repeated);
    assert!(
        (1..=4).contains(&t) && t >= wait,
        "{fields}, Retry-After {wait}"
    );

    // A request costing two tokens: a burst of 5 tokens admits two such requests.
    let statuses = [
        http.get(gw.url("/costly")).send().await.unwrap(),
        http.get(gw.url("/costly")).send().await.unwrap(),
        http.get(gw.url("/costly")).send().await.unwrap(),
    ];
    assert_eq!(
        statuses
            .iter()
            .map(|r| r.status().as_u16())
            .collect::<Vec<_>>(),
        vec![200, 200, 429]
    );
    assert_eq!(
        statuses[0].headers()["ratelimit-policy"],
        r#""t.costly";q=2;w=5"#
    );
    assert!(statuses[1].headers()["ratelimit"]
        .to_str()
        .unwrap()
        .starts_with(r#""t.costly";r=0;t="#));
    assert_eq!(
        statuses[2].headers()["retry-after"],
        "1",
        "one more token refills in a second"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ratelimit_headers_are_absent_when_redis_did_not_decide() {
    let up = Upstream::start("app");
    let nowhere = format!("redis://127.0.0.1:{}/0", common::free_port());
    let gw = app_config(&nowhere, &up)
        .route(
            Route::new("t.fo")
                .path("/fo")
                .identity("global")
                .token_bucket(5_000_000, 0)
                .fail_open(100_000_000)
                .set("ratelimit_headers", "true"),
        )
        .start();
    let r = client().get(gw.url("/fo")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers().get("ratelimit").is_none() && r.headers().get("ratelimit-policy").is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_one_redis_admit_exactly_one_bucket() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    // A 1 s budget, as in concurrent_clients_on_one_bucket_admit_exactly_its_capacity.
    let config = app_config(&redis.url(), &up)
        .redis("timeout_ms", "1000")
        .route(bucket("t.fleet", "/api", 50, 0).identity("global"));
    let gateways: Vec<Gateway> = (0..3).map(|_| config.start()).collect();
    let urls: Vec<String> = gateways.iter().map(|g| g.url("/api")).collect();
    let admitted = common::admitted_over(&urls, 30, 10, ("x-api-key", "any")).await;
    assert_eq!(
        admitted, 50,
        "300 requests over three gateways admit exactly the bucket"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_identity_over_its_limit_is_denied_locally_until_its_token_is_due() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = app_config(&redis.url(), &up)
        .route(bucket("t.hot", "/hot", 2, 1_000_000).identity("global"))
        .route(bucket("t.warm", "/warm", 1_000, 0).identity("global"))
        .start();
    let http = client();
    // A gateway's first decision moves its Redis connection to the proxy's workers, a few
    // round trips that a machine busy with other tests can stretch past the budget (a 503):
    // done on another route, as this test counts from its route's first admission.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while status_of(http.get(gw.url("/warm")).send().await).await != 200 {
        assert!(std::time::Instant::now() < deadline, "never admitted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(status_of(http.get(gw.url("/hot")).send().await).await, 200);
    assert_eq!(status_of(http.get(gw.url("/hot")).send().await).await, 200);
    redis.reset_stats();
    for _ in 0..50 {
        let r = http.get(gw.url("/hot")).send().await.unwrap();
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["retry-after"], "1");
        assert_eq!(
            r.text().await.unwrap(),
            r#"{"detail":"rate limit exceeded"}"#
        );
    }
    // One Redis denial told the gateway when the next token is due; the rest were local.
    assert_eq!(redis.command_calls("evalsha"), 1);
    assert_eq!(
        gw.metric(r#"sentinel_overlimit_cache_hits_total{endpoint_id="t.hot"}"#),
        49.0
    );
    assert_eq!(gw.metric(r#"sentinel_decisions_total{allowed="false",decision_reason="rate_limited",endpoint_id="t.hot"}"#), 50.0);
    // Every denial, the cache's repeats too, is the one limit's, in the metric and the log.
    assert_eq!(
        gw.metric(r#"sentinel_limit_denials_total{endpoint_id="t.hot",limit="default"}"#),
        50.0
    );
    let denied: Vec<String> = gw
        .logs()
        .lines()
        .filter(|l| l.contains(r#""message":"request denied""#))
        .map(str::to_owned)
        .collect();
    assert_eq!(denied.len(), 50);
    assert!(
        denied
            .iter()
            .all(|l| l.contains(r#""limit":"default""#) && l.contains(r#""level":"WARN""#)),
        "{denied:#?}"
    );
    // Once the token is due, Redis decides again and admits exactly one.
    tokio::time::sleep(Duration::from_millis(1050)).await;
    assert_eq!(status_of(http.get(gw.url("/hot")).send().await).await, 200);
    assert_eq!(status_of(http.get(gw.url("/hot")).send().await).await, 429);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_window_shared_by_gateways_never_admits_more_than_its_bound() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let config = app_config(&redis.url(), &up).route(
        Route::new("t.sw")
            .path("/sw")
            .identity("global")
            .sliding_window(20, 1_000_000),
    );
    let gateways: Vec<Gateway> = (0..3).map(|_| config.start()).collect();
    let started = std::time::Instant::now();
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let url = gateways[i % 3].url("/sw");
            tokio::spawn(async move {
                let http = client();
                let mut admitted = 0u64;
                while started.elapsed() < Duration::from_millis(2_500) {
                    admitted += u64::from(status_of(http.get(&url).send().await).await == 200);
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    // 2.5 s touch at most 4 fixed windows of 1 s, and the window never admits more than its
    // limit within one fixed window: at most 80. The estimate also lets at least one full
    // limit through.
    assert!((20..=80).contains(&admitted), "admitted {admitted}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_never_accepts_the_connection_is_504() {
    // A listener that never accepts, its accept queue filled: the kernel drops further SYNs,
    // so connecting to it times out (on loopback, like a black-holed host).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    loop {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(s) => queued.push(s),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break,
            Err(e) => panic!("filling the accept queue: {e}"),
        }
        assert!(queued.len() < 5000, "the accept queue never filled");
    }
    let redis = Redis::start();
    let gw = GatewayConfig::new(&redis.url())
        .upstream_timeouts("hole", &[addr], Some(300), Some(1000))
        .route(
            Route::new("t.hole")
                .prefix("/hole")
                .upstream("hole")
                .unlimited(),
        )
        .start();
    let started = std::time::Instant::now();
    let r = client().get(gw.url("/hole")).send().await.unwrap();
    let took = started.elapsed();
    assert_eq!(r.status(), 504);
    assert_eq!(r.text().await.unwrap(), r#"{"detail":"upstream timeout"}"#);
    // The connect timeout, not the client's: well under its 10 s, at least the 300 ms.
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
    drop(queued);
}

/// An upstream that hangs up halfway through its body: the client keeps the 200 already sent
/// and sees the body cut short; the WARN says that status and what happened, not a 502 the
/// client never got, and the access log's line says the 200 and what cut it, as it does for
/// an event stream that falls silent past the upstream's read timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_hangs_up_mid_body_is_logged_with_the_status_the_client_got() {
    use std::io::{Read, Write};
    // `hold`: the connection is kept open, silent, after the first ten bytes.
    let upstream = |hold: bool| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                let mut head = [0u8; 4096];
                let _ = stream.read(&mut head);
                let _ =
                    stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nten bytes.");
                if hold {
                    held.push(stream);
                }
            }
        });
        addr
    };
    let (cut, silent) = (upstream(false), upstream(true));
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let gw = GatewayConfig::new(&redis.url())
        .upstream_timeouts("cut", &[cut], Some(300), Some(1000))
        .upstream_timeouts("silent", &[silent], Some(300), Some(500))
        .route(
            Route::new("t.cut")
                .prefix("/cut")
                .upstream("cut")
                .unlimited(),
        )
        .route(
            Route::new("t.silent")
                .prefix("/silent")
                .upstream("silent")
                .unlimited(),
        )
        .server("h2c", "true")
        .access_log(&log)
        .start();
    // Over HTTP/1.1 first (the WARN read below is the first request's), then over h2c.
    for http in [client(), common::h2c_client()] {
        for path in ["/cut", "/silent"] {
            let r = http.get(gw.url(path)).send().await.unwrap();
            assert_eq!(r.status(), 200);
            assert!(r.bytes().await.is_err(), "the body is cut short");
        }
    }
    common::wait_until(Duration::from_secs(3), "four access-log lines", || {
        common::access_lines(&log).len() == 4
    });
    for line in common::access_lines(&log) {
        let error = match line["path"].as_str() {
            Some("/cut") => "upstream_failed",
            _ => "upstream_timeout",
        };
        assert_eq!(
            (&line["status"], &line["error"]),
            (&200.into(), &error.into()),
            "{line}"
        );
        // Over HTTP/1.1 the count is what the socket took (docs/operations.md).
        if line["protocol"] == "HTTP/1.1" {
            assert_eq!(line["bytes_sent"], 10, "{line}");
        }
    }
    assert_eq!(
        (common::access_lines(&log).iter())
            .filter(|l| l["protocol"] == "HTTP/2")
            .count(),
        2
    );
    common::wait_until(Duration::from_secs(3), "the WARN", || {
        gw.logs().contains("the body was cut short")
    });
    let logs = gw.logs();
    let line = logs
        .lines()
        .find(|l| l.contains("the body was cut short"))
        .unwrap();
    assert!(line.contains(r#""level":"WARN""#), "{line}");
    assert!(line.contains(r#""status":200"#), "{line}");
    assert!(line.contains(r#""endpoint_id":"t.cut""#), "{line}");
}

/// Keys, tokens and cookies never reach a log line, even at `RUST_LOG=debug`: not from a
/// request, not from an upstream's answer that Pingora cannot parse (its errors quote the
/// head's bytes), not from a request head it cannot parse. Nor with Pingora's own DEBUG and
/// TRACE lines asked for by name, which print whole heads and bodies: they are cut before
/// what they quote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_carries_a_key_a_token_or_a_cookie_even_at_debug() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let bad = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut head = [0u8; 4096];
            let _ = stream.read(&mut head);
            let _ = stream.write_all(
                b"HTTP/1.1 200 OK\r\nSet-Cookie: session=UPSTREAMCOOKIE\r\nX-Bad: a\x00b\r\nContent-Length: 2\r\n\r\nok",
            );
        }
    });
    let redis = Redis::start();
    let up = Upstream::start("app");
    for rust_log in [
        "debug",
        "trace,pingora_core=trace,pingora_proxy=trace,pingora_pool=trace",
    ] {
        let gw = GatewayConfig::new(&redis.url())
            .upstream("app", &[up.addr()])
            .upstream_timeouts("bad", &[bad], Some(300), Some(1000))
            .route(
                Route::new("t.key")
                    .prefix("/key")
                    .identity_header("X-API-Key")
                    .token_bucket(100_000_000, 0),
            )
            .route(
                Route::new("t.bad")
                    .prefix("/bad")
                    .upstream("bad")
                    .unlimited(),
            )
            .start_with_env(&[("RUST_LOG", rust_log)]);
        let r = client()
            .get(gw.url("/key?token=QUERYSECRET"))
            .header("X-API-Key", "KEYSECRET")
            .header("Authorization", "Bearer TOKENSECRET")
            .header("Cookie", "c=COOKIESECRET")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let r = client().get(gw.url("/bad")).send().await.unwrap();
        assert_eq!(r.status(), 502);
        let head =
            b"GET /key HTTP/1.1\r\nHost: gw\r\nX-API-Key: HEADSECRET\r\nBad\x01Name: y\r\n\r\n";
        assert_eq!(raw_request(gw.port, head), Some(400));
        common::wait_until(
            Duration::from_secs(3),
            "the upstream's failure logged",
            || gw.logs().contains("\"upstream failed\""),
        );
        let logs = gw.logs();
        if rust_log == "debug" {
            // Pingora's own DEBUG lines print every header sent upstream: without a
            // `pingora` target named in RUST_LOG they are not passed on.
            assert!(!logs.contains("Response header: "), "{logs}");
        } else {
            // Named, they are, cut before what they quote.
            assert!(
                logs.contains("Request header: Parts (not logged)")
                    && logs.contains("Response header: ResponseHeader (not logged)"),
                "{logs}"
            );
        }
        for secret in [
            "KEYSECRET",
            "TOKENSECRET",
            "COOKIESECRET",
            "QUERYSECRET",
            "UPSTREAMCOOKIE",
            "HEADSECRET",
        ] {
            assert!(
                !logs.contains(secret),
                "{rust_log}: {secret} logged:\n{logs}"
            );
        }
    }
}

/// The fields of the upstream's own connection end at the gateway (RFC 9110, 7.6.1): those
/// its `Connection` names, `Keep-Alive`, `Proxy-Connection`, `TE`, `Upgrade`; and `Trailer`,
/// whose fields are not passed on; the others pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstreams_hop_by_hop_fields_are_not_passed_on() {
    use std::io::{Read, Write};
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = app_config(&redis.url(), &up)
        .server("h2c", "true")
        .route(Route::new("a.open").prefix("/").unlimited())
        .start();
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    conn.write_all(
        b"GET /x HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\
          X-Demo-Reply-Keep-Alive: timeout=1, max=1\r\n\
          X-Demo-Reply-Proxy-Connection: close\r\n\
          X-Demo-Reply-TE: trailers\r\n\
          X-Demo-Reply-Trailer: X-Checksum\r\n\
          X-Demo-Reply-Upgrade: h2c\r\n\
          X-Demo-Reply-X-Kept: yes\r\n\r\n",
    )
    .unwrap();
    let mut answer = String::new();
    let _ = conn.read_to_string(&mut answer);
    let head = answer
        .split("\r\n\r\n")
        .next()
        .unwrap()
        .to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("\r\nx-kept: yes"), "{head}");
    for gone in [
        "keep-alive:",
        "proxy-connection:",
        "\r\nte:",
        "upgrade:",
        "trailer:",
    ] {
        assert!(!head.contains(gone), "{gone} in {head}");
    }

    // Over HTTP/2 a connection's field in an answer is malformed (RFC 9113, 8.2.2: the
    // client would refuse the answer), and a `Trailer` would promise what never comes.
    let mut request = common::h2c_client().get(gw.url("/x"));
    for (name, value) in [
        ("Keep-Alive", "timeout=1, max=1"),
        ("Proxy-Connection", "close"),
        ("TE", "trailers"),
        ("Trailer", "X-Checksum"),
        ("Upgrade", "h2c"),
        ("X-Kept", "yes"),
    ] {
        request = request.header(format!("X-Demo-Reply-{name}"), value);
    }
    let r = request
        .send()
        .await
        .expect("an answer the HTTP/2 client takes");
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kept"], "yes");
    for gone in ["keep-alive", "proxy-connection", "te", "upgrade", "trailer"] {
        assert!(r.headers().get(gone).is_none(), "{gone}: {:?}", r.headers());
    }
}

/// An upstream's interim answer (`103 Early Hints`) reaches an HTTP/1.1 client, never an
/// HTTP/1.0 one (RFC 9110, 15.2: a server must not send it a 1xx).
#[test]
fn an_interim_answer_never_reaches_an_http_1_0_client() {
    use std::io::{Read, Write};
    let redis = Redis::start();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                }
                let _ = conn.write_all(
                    b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n\
                      HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                );
            });
        }
    });
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[addr])
        .route(Route::new("a.open").prefix("/").unlimited())
        .start();
    let answer = |version: &str| {
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        conn.write_all(
            format!("GET /x {version}\r\nHost: gw\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .unwrap();
        let mut text = String::new();
        let _ = conn.read_to_string(&mut text);
        text
    };
    let old = answer("HTTP/1.0");
    assert!(
        old.starts_with("HTTP/1.1 200") || old.starts_with("HTTP/1.0 200"),
        "{old}"
    );
    assert!(!old.contains(" 103 "), "{old}");
    let new = answer("HTTP/1.1");
    assert!(new.starts_with("HTTP/1.1 103 "), "{new}");
    assert!(new.contains("HTTP/1.1 200"), "{new}");
}

/// A route that decides nothing (`algorithm = "none"`) has no series of what a decision does
/// (a dashboard summing degraded decisions by `fail_mode` listed it under `fail_closed`); a
/// limited route has them from the start, its shadow denials and reported costs where it is
/// in shadow mode and its upstream reports costs (a platform's thousands of routes would show
/// four more series each, always 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_that_decides_nothing_has_no_decision_series() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(
            Route::new("m.limited")
                .prefix("/limited")
                .identity_header("X-API-Key")
                .token_bucket(5_000_000, 0),
        )
        .route(
            Route::new("m.costs")
                .prefix("/costs")
                .identity_header("X-API-Key")
                .token_bucket(5_000_000, 0)
                .set("mode", "\"shadow\"")
                .set(
                    "cost_from_response",
                    "{ header = \"X-OCR-Pages\", unit_micro = 1_000_000 }",
                ),
        )
        .route(Route::new("m.open").prefix("/").unlimited())
        .start();
    let r = client().get(gw.url("/open")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (_, body) = common::blocking_get(&gw.admin("/metrics")).unwrap();
    let series = |family: &str, endpoint: &str| {
        body.lines()
            .filter(|l| l.starts_with(family))
            .filter(|l| l.contains(&format!("endpoint_id=\"{endpoint}\"")))
            .count()
    };
    for family in [
        "sentinel_decisions_total",
        "sentinel_decision_duration_seconds",
        "sentinel_degraded_decisions_total",
        "sentinel_shadow_denials_total",
        "sentinel_overlimit_cache_hits_total",
        "sentinel_response_charges_total",
    ] {
        assert_eq!(series(family, "m.open"), 0, "{family}:\n{body}");
        assert!(series(family, "m.costs") > 0, "{family}:\n{body}");
        let enforced_without_costs = family == "sentinel_shadow_denials_total"
            || family == "sentinel_response_charges_total";
        assert_eq!(
            series(family, "m.limited") == 0,
            enforced_without_costs,
            "{family}:\n{body}"
        );
    }
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="m.open",status="200"}"#),
        1.0
    );
    assert!(series("sentinel_endpoint_mode", "m.open") > 0, "{body}");
}

/// An upstream's failures are one WARN a request under a target of their own, filtered apart
/// as the denials' are: a backend down under load writes tens of thousands a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_failures_are_logged_under_a_target_that_filters_them_apart() {
    let redis = Redis::start();
    // A port nothing listens on: every connection refused.
    let config = GatewayConfig::new(&redis.url())
        .upstream("app", &[format!("127.0.0.1:{}", common::free_port())])
        .route(Route::new("e.open").prefix("/").unlimited());
    let said = config.start();
    let quiet =
        config.start_with_env(&[("RUST_LOG", "info,sentinel_gateway::upstream_failures=error")]);
    for gw in [&said, &quiet] {
        let r = client().get(gw.url("/x")).send().await.unwrap();
        assert_eq!(r.status(), 502);
    }
    common::wait_until(Duration::from_secs(5), "the WARN", || {
        said.logs().lines().any(|l| {
            l.contains("\"message\":\"upstream failed\"")
                && l.contains("\"target\":\"sentinel_gateway::upstream_failures\"")
        })
    });
    assert!(
        !quiet.logs().contains("upstream failed"),
        "{}",
        quiet.logs()
    );
}
