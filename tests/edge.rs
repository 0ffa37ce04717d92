//! The edge towards clients, against the real binary: forwarded headers and request ids as
//! the upstream sees them, body limits, HTTP/2 with prior knowledge (h2c), and the access log.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::config::{quoted, GatewayConfig, Route};
use common::{client, wait_until, Redis, Upstream};
use sentinel_gateway::limiter::identity_hash;
use serde_json::Value;

fn echo_headers(body: &str) -> serde_json::Map<String, Value> {
    let echo: Value = serde_json::from_str(body).expect("the demo upstream's JSON");
    echo["headers"].as_object().cloned().unwrap_or_default()
}

fn is_new_request_id(id: &str) -> bool {
    id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn limited(capacity: u64) -> Route {
    Route::new("e.api")
        .prefix("/api")
        .identity_header("X-API-Key")
        .token_bucket(capacity * 1_000_000, 0)
}

/// A 413 written while the client is still sending its body reaches it: the gateway reads
/// and throws away the rest of the body (bounded) before it ends the connection or stream,
/// so neither a TCP reset nor an HTTP/2 stream reset destroys the answer. (curl before 8.1
/// drops an HTTP/2 answer whose stream is reset while it uploads; it is the client here.)
#[test]
fn a_413_to_a_body_still_coming_reaches_the_client() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .server("max_body_bytes", "1000")
        .upstream("app", &[up.addr()])
        .route(Route::new("open").prefix("/").unlimited())
        .start();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("body");
    std::fs::write(&file, vec![b'x'; 2_000_000]).unwrap();
    let url = gw.url("/upload");
    for (protocol, framing) in [
        ("--http1.1", "Transfer-Encoding: chunked"),
        ("--http1.1", "Expect:"),
        ("--http2-prior-knowledge", "Transfer-Encoding: chunked"),
        ("--http2-prior-knowledge", "Expect:"),
    ] {
        for _ in 0..5 {
            let out = std::process::Command::new("curl")
                .args([
                    "-s",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    protocol,
                    "-H",
                    framing,
                ])
                .arg("--data-binary")
                .arg(format!("@{}", file.display()))
                .arg(&url)
                .output()
                .expect("curl runs");
            let status = String::from_utf8_lossy(&out.stdout).into_owned();
            assert_eq!(status, "413", "{protocol} {framing}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_clients_forwarded_headers_are_replaced() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(limited(1))
        .route(Route::new("e.open").prefix("/open").unlimited())
        .start();
    let http = client();
    let r = http
        .get(gw.url("/open/x"))
        .header("X-Forwarded-For", "1.2.3.4")
        .header("X-Forwarded-Proto", "https")
        .header("X-Forwarded-Host", "evil.example")
        .header("X-Real-IP", "1.2.3.4")
        .header("X-Request-Id", "chosen-by-the-client")
        .header("Forwarded", "for=1.2.3.4;proto=https")
        .header("X-Forwarded-Port", "443")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let answered_id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    let seen = echo_headers(&r.text().await.unwrap());
    assert_eq!(seen["x-forwarded-for"], "127.0.0.1");
    // The other spellings of the same claims are not passed on beside the rewritten ones.
    assert!(!seen.contains_key("forwarded"), "{seen:?}");
    assert!(!seen.contains_key("x-forwarded-port"), "{seen:?}");
    assert_eq!(seen["x-forwarded-proto"], "http");
    assert_eq!(seen["x-forwarded-host"], format!("127.0.0.1:{}", gw.port));
    assert_eq!(seen["x-real-ip"], "127.0.0.1");
    let sent_id = seen["x-request-id"].as_str().unwrap();
    assert!(is_new_request_id(sent_id), "{sent_id}");
    assert_eq!(
        sent_id, answered_id,
        "the client sees the id the upstream saw"
    );
    // Nor are spellings with `_` (or `.`, `~`), which a CGI or WSGI backend reads as the same variables
    // (`HTTP_X_REAL_IP`): the client's word came first, beside the gateway's. A field whose
    // `-` spelling the request also carries goes too (an identity header's second value);
    // other fields with `_` pass.
    let r = http
        .get(gw.url("/open/x"))
        .header("X_Forwarded_For", "6.6.6.6")
        .header("X_Real_IP", "6.6.6.6")
        .header("X_Forwarded_Proto", "https")
        .header("X_Request_Id", "forged")
        .header("X-API-Key", "mine")
        .header("X_API_Key", "someone-elses")
        .header("X-Real.IP", "6.6.6.6")
        .header("X~Forwarded~Host", "evil.example")
        .header("X_Custom", "kept")
        .header("X.Custom2", "kept")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = echo_headers(&r.text().await.unwrap());
    for gone in [
        "x_forwarded_for",
        "x_real_ip",
        "x_forwarded_proto",
        "x_request_id",
        "x_api_key",
        // Nor other characters some CGI servers fold as they fold `-`.
        "x-real.ip",
        "x~forwarded~host",
    ] {
        assert!(!seen.contains_key(gone), "{gone}: {seen:?}");
    }
    assert_eq!(seen["x-api-key"], "mine");
    assert_eq!(seen["x_custom"], "kept");
    assert_eq!(seen["x.custom2"], "kept");

    // The gateway's own answers carry a request id too, and the deny log names it.
    let r = http.get(gw.url("/nowhere")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(is_new_request_id(
        r.headers()["x-request-id"].to_str().unwrap()
    ));
    assert_eq!(
        http.get(gw.url("/api"))
            .header("X-API-Key", "k")
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let r = http
        .get(gw.url("/api"))
        .header("X-API-Key", "k")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let denied_id = r.headers()["x-request-id"].to_str().unwrap().to_owned();
    wait_until(Duration::from_secs(2), "the deny line", || {
        gw.logs()
            .lines()
            .any(|l| l.contains("request denied") && l.contains(&denied_id))
    });
}

/// A client on IPv6 loopback: its address is written as an IPv6 address in the forwarded
/// headers, and an IPv6 proxy in `trusted_proxies` is skipped like an IPv4 one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_client_and_an_ipv6_trusted_proxy_are_forwarded_as_written() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let config = GatewayConfig::new(&redis.url())
        .server("trusted_proxies", r#"["::1/128"]"#)
        .upstream("app", &[up.addr()])
        .route(Route::new("e.open").prefix("/open").unlimited());
    let [port, admin_port] = common::free_ports();
    let v4 = format!("listen = {}", quoted(&format!("127.0.0.1:{port}")));
    let both = format!(
        "listen = {}",
        common::config::string_list(&[format!("127.0.0.1:{port}"), format!("[::1]:{port}")])
    );
    let text = config.render(port, admin_port).replacen(&v4, &both, 1);
    assert_ne!(
        text,
        config.render(port, admin_port),
        "the listen line replaced"
    );
    let _gw = common::Gateway::start_with_env(port, admin_port, &text, &[]);
    let http = client();
    let url = format!("http://[::1]:{port}/open");
    let seen = echo_headers(&http.get(&url).send().await.unwrap().text().await.unwrap());
    assert_eq!(seen["x-forwarded-for"], "::1");
    assert_eq!(seen["x-real-ip"], "::1");
    assert_eq!(seen["x-forwarded-host"], format!("[::1]:{port}"));
    // Behind the trusted IPv6 proxy, the client is the address it names.
    let r = http
        .get(&url)
        .header("X-Forwarded-For", "2001:db8::7")
        .send()
        .await
        .unwrap();
    let seen = echo_headers(&r.text().await.unwrap());
    assert_eq!(seen["x-forwarded-for"], "2001:db8::7, ::1");
    assert_eq!(seen["x-real-ip"], "2001:db8::7");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_proxys_forwarded_headers_are_kept_and_extended() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        // Host bits set: taken as 127.0.0.0/8, with a config warning at start.
        .server("trusted_proxies", r#"["127.0.0.1/8"]"#)
        .server("request_id_header", quoted("X-Trace"))
        .upstream("app", &[up.addr()])
        .route(Route::new("e.open").prefix("/open").unlimited())
        .start();
    let http = client();
    let r = http
        .get(gw.url("/open"))
        .header("X-Forwarded-For", "1.2.3.4")
        .header("X-Forwarded-Proto", "https")
        .header("X-Forwarded-Host", "api.example.com")
        .header("X-Trace", "edge-4711")
        .header("Forwarded", "for=1.2.3.4;proto=https")
        .header("X-Forwarded-Port", "443")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-trace"], "edge-4711");
    assert!(
        r.headers().get("x-request-id").is_none(),
        "the configured name only"
    );
    let seen = echo_headers(&r.text().await.unwrap());
    assert_eq!(seen["x-forwarded-for"], "1.2.3.4, 127.0.0.1");
    assert_eq!(seen["x-forwarded-proto"], "https");
    assert_eq!(seen["x-forwarded-host"], "api.example.com");
    assert_eq!(seen["x-real-ip"], "1.2.3.4");
    assert_eq!(seen["x-trace"], "edge-4711");
    assert_eq!(seen["forwarded"], "for=1.2.3.4;proto=https");
    assert_eq!(seen["x-forwarded-port"], "443");
    // Sent twice: the first is kept, alone (as the request id's first is), where the upstream
    // got both and read either.
    let r = http
        .get(gw.url("/open"))
        .header("X-Forwarded-Proto", "https")
        .header("X-Forwarded-Proto", "http")
        .header("X-Forwarded-Host", "api.example.com")
        .header("X-Forwarded-Host", "evil.example")
        .send()
        .await
        .unwrap();
    let seen = echo_headers(&r.text().await.unwrap());
    assert_eq!(seen["x-forwarded-proto"], "https");
    assert_eq!(seen["x-forwarded-host"], "api.example.com");
    let warned = gw
        .logs()
        .lines()
        .filter(|l| l.contains("has host bits set"))
        .map(str::to_owned)
        .collect::<Vec<_>>();
    assert_eq!(warned.len(), 1, "{}", gw.logs());
    assert!(warned[0].contains(r#""level":"INFO""#), "{}", warned[0]);
    assert!(
        warned[0].contains(r#"taken as the network \"127.0.0.0/8\""#),
        "{}",
        warned[0]
    );
    let r = http
        .get(gw.url("/open"))
        .header("X-Trace", "has space")
        .send()
        .await
        .unwrap();
    let replaced = r.headers()["x-trace"].to_str().unwrap().to_owned();
    assert!(
        is_new_request_id(&replaced),
        "an unusable id is replaced: {replaced}"
    );
}

/// A trusted proxy whose `X-Forwarded-For` names no usable client, on a route that does not
/// key on the client: forwarded without `X-Real-IP`, and logged with the proxy's address
/// (it was `null`: nothing in the line said who sent the request).
#[test]
fn a_trusted_proxy_naming_no_client_is_logged_as_itself() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let gw = GatewayConfig::new(&redis.url())
        .server("trusted_proxies", r#"["127.0.0.0/8"]"#)
        .upstream("app", &[up.addr()])
        .route(Route::new("e.open").prefix("/").unlimited())
        .access_log(&log)
        .start();
    let request =
        b"GET /x HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: garbage\r\nConnection: close\r\n\r\n";
    assert_eq!(common::raw_request(gw.port, request), Some(200));
    wait_until(Duration::from_secs(3), "the line", || {
        common::access_lines(&log).len() == 1
    });
    assert_eq!(common::access_lines(&log)[0]["client_ip"], "127.0.0.1");
}

/// A trusted proxy's `X-Forwarded-For` fields are passed on byte for byte, with the peer
/// appended, whatever they hold: a field that is not text (a client's junk that the proxy
/// passed on beside the real address) is not dropped, so no client can erase the address
/// its proxy wrote.
#[test]
fn a_trusted_proxys_forwarded_for_is_kept_byte_for_byte() {
    let redis = Redis::start();
    let (upstream, received) = recording_upstream();
    let gw = GatewayConfig::new(&redis.url())
        .server("trusted_proxies", r#"["127.0.0.0/8"]"#)
        .upstream("app", &[upstream])
        .route(Route::new("e.open").prefix("/").unlimited())
        .start();
    let request = b"GET /x HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 1.2.3.4\r\nX-Forwarded-For: junk\xff, 5.6.7.8\r\n\r\n";
    assert_eq!(common::raw_request(gw.port, request), Some(200));
    let received = received.lock().unwrap().clone();
    let expected = b"x-forwarded-for: 1.2.3.4, junk\xff, 5.6.7.8, 127.0.0.1\r\n";
    assert!(
        received
            .to_ascii_lowercase()
            .windows(expected.len())
            .any(|w| w == expected),
        "{}",
        String::from_utf8_lossy(&received)
    );
}

/// Sends a chunked POST of `total` bytes in 1000-byte chunks; the status, or `None` when
/// the connection was closed without one.
fn chunked_post(port: u16, path: &str, total: usize) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: k\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    s.write_all(head.as_bytes()).ok()?;
    let chunk = format!("3e8\r\n{}\r\n", "a".repeat(1000));
    for _ in 0..total / 1000 {
        if s.write_all(chunk.as_bytes()).is_err() {
            break;
        }
    }
    let _ = s.write_all(b"0\r\n\r\n");
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).ok()?;
    String::from_utf8_lossy(&buf[..n])
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_are_413_before_any_token_is_spent() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        .server("max_body_bytes", "2000")
        .upstream("app", &[up.addr()])
        .route(limited(100))
        .route(
            Route::new("e.big")
                .prefix("/big")
                .unlimited()
                .set("max_body_bytes", "100000"),
        )
        .start();
    let http = client();
    redis.reset_stats();
    let r = http
        .post(gw.url("/api"))
        .header("X-API-Key", "k")
        .body(vec![b'a'; 2001])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(r.headers()["content-type"], "application/json");
    assert!(r.headers().get("x-request-id").is_some());
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"detail":"request body too large"}"#
    );
    assert_eq!(redis.limiter_calls(), 0, "no Redis call, no token spent");
    let r = http
        .post(gw.url("/api"))
        .header("X-API-Key", "k")
        .body(vec![b'a'; 2000])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "exactly the limit passes");
    let echo: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(echo["body_bytes"], 2000);
    let r = http
        .post(gw.url("/big"))
        .body(vec![b'a'; 50_000])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the route's own limit");

    // Without Content-Length: cut where it outgrows the limit.
    let port = gw.port;
    let status = tokio::task::spawn_blocking(move || chunked_post(port, "/api", 5000))
        .await
        .unwrap();
    assert!(
        matches!(status, Some(413) | None),
        "413, or closed once an answer had started: {status:?}"
    );
    let status = tokio::task::spawn_blocking(move || chunked_post(port, "/api", 1000))
        .await
        .unwrap();
    assert_eq!(status, Some(200), "a chunked body within the limit passes");
    assert!(gw.metric(r#"sentinel_requests_total{endpoint_id="e.api",status="413"}"#) >= 1.0);
    assert!(
        !gw.logs().contains("\"level\":\"ERROR\""),
        "a client's big body is not the gateway's error: {}",
        gw.logs()
    );
}

/// A chunked body that outgrows `max_body_bytes` is cut: the upstream never receives more of
/// it than the limit, whatever the client goes on sending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_past_the_limit_never_reaches_the_upstream_whole() {
    let redis = Redis::start();
    let (upstream, received) = recording_upstream();
    let gw = GatewayConfig::new(&redis.url())
        .server("max_body_bytes", "1500")
        .upstream("app", &[upstream.as_str()])
        .route(Route::new("e.open").prefix("/").unlimited())
        .start();
    let port = gw.port;
    let status = tokio::task::spawn_blocking(move || chunked_post(port, "/up", 8000))
        .await
        .unwrap();
    assert!(matches!(status, Some(413) | None), "{status:?}");
    // What the upstream got by now is all it gets.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let received = received.lock().unwrap().clone();
    let head = received
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(received.len(), |at| at + 4);
    let body_bytes = received[head..].iter().filter(|b| **b == b'a').count();
    assert!(
        body_bytes <= 1500,
        "{body_bytes} bytes of the body reached the upstream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_answers_as_http1_does() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .server("header_read_timeout_ms", "30000")
        .upstream("app", &[up.addr()])
        .route(limited(2))
        .route(Route::new("e.open").prefix("/open").unlimited())
        .start();
    // A request shorter than the h2c preface's 24 bytes is answered at once, not when
    // the header deadline (30 s here) ends the wait for more bytes; raw_request gives up
    // after 5 s.
    let short = b"GET / HTTP/1.0\r\n\r\n";
    assert!(short.len() < 24);
    assert_eq!(common::raw_request(gw.port, short), Some(404));
    let h2 = common::h2c_client();
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let r = h2
            .get(gw.url("/api/x"))
            .header("X-API-Key", "k")
            .send()
            .await
            .unwrap();
        assert_eq!(r.version(), reqwest::Version::HTTP_2);
        assert!(r.headers().get("x-request-id").is_some());
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, vec![200, 200, 429], "the same limit over HTTP/2");
    // Cookies an HTTP/2 client sent as one field each (as browsers do) reach the HTTP/1.1
    // upstream as one field (RFC 9113, 8.2.3); a backend reading one field had the last.
    let r = h2
        .get(gw.url("/open/c"))
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    let seen = echo_headers(&r.text().await.unwrap());
    assert_eq!(seen["cookie"], "a=1; b=2");
    let r = client()
        .get(gw.url("/api/x"))
        .header("X-API-Key", "k")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        429,
        "HTTP/1.1 on the same listener, the same bucket"
    );
    let r = h2.get(gw.url("/nowhere")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    // The gateway's own answers to HEAD carry no body over HTTP/2 (a stream that did would
    // be reset by the client as malformed); the headers are the GET's.
    for (path, key, status) in [
        ("/nowhere", "k", 404),
        ("/api/x", "k", 429),
        ("/api/x", "", 401),
    ] {
        let mut head = h2.head(gw.url(path));
        if !key.is_empty() {
            head = head.header("X-API-Key", key);
        }
        let r = head.send().await.unwrap();
        assert_eq!(r.status(), status, "HEAD {path}");
        assert_eq!(r.headers()["content-type"], "application/json");
        assert!(r.headers().get("x-request-id").is_some());
        assert_eq!(r.bytes().await.unwrap().len(), 0, "HEAD {path}");
    }
    // Headers over 64 KiB get the gateway's JSON 431 over HTTP/2 too, not the h2 library's
    // bodiless one.
    let r = h2
        .get(gw.url("/api/x"))
        .header("X-Big", "a".repeat(70_000))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 431);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"detail":"request header fields too large"}"#
    );

    // A stream the client resets while its answer is awaited is the client leaving, as a
    // closed HTTP/1.1 connection is: no 400 is counted for it (none could be sent).
    let impatient = common::client_builder()
        .http2_prior_knowledge()
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let cancelled = impatient
        .get(gw.url("/api/slow?ms=800"))
        .header("X-API-Key", "k2")
        .send()
        .await;
    assert!(cancelled.is_err());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="e.api",status="400"}"#),
        0.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="e.api",status="499"}"#),
        1.0,
        "a client that left first is counted as nginx's 499"
    );

    // Without h2c, prior knowledge gets no HTTP/2 answer.
    let plain = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(limited(2))
        .start();
    assert!(h2.get(plain.url("/api/x")).send().await.is_err());
}

/// A route limited by the `User-Agent` or `Host` header: that field of its lines would be the
/// raw identity, and is null (the identity's hash is there); other routes keep theirs. A
/// `Host` that is no authority (400) is not written either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_header_the_access_log_names_is_not_written() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(
            Route::new("e.agent")
                .prefix("/agent")
                .identity_header("User-Agent")
                .token_bucket(5_000_000, 0),
        )
        .route(
            Route::new("e.host")
                .prefix("/host")
                .identity_header("Host")
                .token_bucket(5_000_000, 0),
        )
        .route(Route::new("e.open").prefix("/open").unlimited())
        .access_log(&log)
        .server("h2c", "true")
        .start();
    let http = client();
    // Over HTTP/2 the host is the authority: the same caller as over HTTP/1.1.
    let h2 = common::h2c_client()
        .get(gw.url("/host/y"))
        .send()
        .await
        .unwrap();
    assert_eq!(h2.status(), 200);
    for path in ["/agent/x", "/host/x", "/open/x"] {
        let r = http
            .get(gw.url(path))
            .header("User-Agent", "tenant-key-7f3a")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    // Refused before a route is known (`TRACE`'s 405, a 431 for a head too large): the
    // request may be either route's, and neither field is written.
    let trace = http
        .request(reqwest::Method::TRACE, gw.url("/agent/x"))
        .header("User-Agent", "tenant-key-trace")
        .send()
        .await
        .unwrap();
    assert_eq!(trace.status(), 405);
    let large = http
        .get(gw.url("/host/x"))
        .header("User-Agent", "tenant-key-large")
        .header("X-Padding", "p".repeat(70_000))
        .send()
        .await
        .unwrap();
    assert_eq!(large.status(), 431);
    // A `CONNECT` names an authority, not a path: its line's path is null.
    let connect = b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n";
    assert_eq!(common::raw_request(gw.port, connect), Some(405));
    // A `Host` that is no authority is 400, and may be anything the client sent: the next
    // field of a head whose line break was lost, here. Not written.
    let lost = b"GET /open/x HTTP/1.1\r\nHost: xX-API-Key:tenant-key-lost\r\n\r\n";
    assert_eq!(common::raw_request(gw.port, lost), Some(400));
    wait_until(Duration::from_secs(3), "eight access lines", || {
        common::access_lines(&log).len() == 8
    });
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains("tenant-key-lost"), "{text}");
    let lines = common::access_lines(&log);
    let of = |endpoint: &str| {
        lines
            .iter()
            .rfind(|l| l["endpoint_id"] == endpoint)
            .unwrap()
            .clone()
    };
    let over_h2 = lines.iter().find(|l| l["path"] == "/host/y").unwrap();
    assert_eq!(over_h2["protocol"], "HTTP/2", "{over_h2}");
    assert_eq!(over_h2["host"], Value::Null, "{over_h2}");
    let (agent, host, open) = (of("e.agent"), of("e.host"), of("e.open"));
    assert_eq!(agent["user_agent"], Value::Null, "{agent}");
    assert!(agent["identity_hash"].is_string(), "{agent}");
    assert_eq!(agent["host"], format!("127.0.0.1:{}", gw.port), "{agent}");
    assert_eq!(host["host"], Value::Null, "{host}");
    assert_eq!(
        host["identity_hash"], over_h2["identity_hash"],
        "one caller"
    );
    assert_eq!(host["user_agent"], "tenant-key-7f3a", "{host}");
    assert_eq!(open["user_agent"], "tenant-key-7f3a", "{open}");
    assert!(open["host"].is_string(), "{open}");
    let connect = lines.iter().find(|l| l["method"] == "CONNECT").unwrap();
    assert_eq!(connect["path"], Value::Null, "{connect}");
    for status in [405, 431] {
        let refused = lines.iter().find(|l| l["status"] == status).unwrap();
        assert_eq!(refused["endpoint_id"], Value::Null, "{refused}");
        assert_eq!(refused["user_agent"], Value::Null, "{refused}");
        assert_eq!(refused["host"], Value::Null, "{refused}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_a_line_per_request_and_follows_rotation() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let config = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(limited(1))
        .route(Route::new("e.slow").prefix("/slow").unlimited());
    let gw = config.clone().access_log(&log).start();
    let http = client();
    let ok = http
        .get(gw.url("/api/doc?secret=q"))
        .header("X-API-Key", "raw-key-1")
        .header("Authorization", "Bearer not-logged")
        .header("User-Agent", "edge-test/1")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let ok_id = ok.headers()["x-request-id"].to_str().unwrap().to_owned();
    let denied = http
        .get(gw.url("/api/doc"))
        .header("X-API-Key", "raw-key-1")
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), 429);
    assert_eq!(
        http.get(gw.url("/nowhere;jsessionid=SESSION-7f3a/x"))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    // A head the HTTP/1 parser refuses gets the gateway's 400, and its line: the request id
    // the client got, no method or path (none was read).
    let bad_id = {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
        s.write_all(b"GET /api/doc HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        answer
            .lines()
            .find_map(|l| l.strip_prefix("x-request-id: "))
            .expect("a request id")
            .to_owned()
    };
    // Answered before its route was looked for, a request still has its path logged.
    let big = http
        .get(gw.url("/api/doc"))
        .header("X-Big", "a".repeat(70_000))
        .send()
        .await
        .unwrap();
    assert_eq!(big.status(), 431);
    wait_until(Duration::from_secs(3), "five access lines", || {
        common::access_lines(&log).len() == 5
    });
    let lines = common::access_lines(&log);
    let keys = [
        "timestamp",
        "request_id",
        "client_ip",
        "method",
        "host",
        "path",
        "protocol",
        "tls",
        "status",
        "endpoint_id",
        "decision_reason",
        "allowed",
        "tier",
        "limit",
        "upstream",
        "upstream_addr",
        "duration_ms",
        "bytes_received",
        "bytes_sent",
        "identity_hash",
        "user_agent",
        "error",
    ];
    for line in &lines {
        for key in keys {
            assert!(line.get(key).is_some(), "{key} missing from {line}");
        }
    }
    // One line each, found by status: lines written on different workers need not reach the
    // file in the order the requests were sent.
    let by_status = |status: u64| {
        let mut of: Vec<&Value> = lines.iter().filter(|l| l["status"] == status).collect();
        assert_eq!(of.len(), 1, "one line of status {status}: {lines:?}");
        of.remove(0)
    };
    let (a, d, n) = (by_status(200), by_status(429), by_status(404));
    let (bad, big) = (by_status(400), by_status(431));
    assert_eq!(bad["request_id"], bad_id.as_str());
    assert_eq!(
        (&bad["status"], &bad["method"], &bad["path"]),
        (&400.into(), &Value::Null, &Value::Null)
    );
    assert_eq!(bad["client_ip"], "127.0.0.1");
    // Only the head the client broke ended otherwise than with a whole answer.
    assert_eq!(bad["error"], "client_error");
    for whole in [a, d, n, big] {
        assert_eq!(whole["error"], Value::Null, "{whole}");
    }
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="_unmatched",status="400"}"#),
        1.0
    );
    assert_eq!(
        (&big["status"], &big["path"]),
        (&431.into(), &"/api/doc".into())
    );
    assert_eq!(a["request_id"], ok_id.as_str());
    assert_eq!(a["status"], 200);
    assert_eq!(a["method"], "GET");
    assert_eq!(a["path"], "/api/doc", "normalized, without the query");
    assert_eq!(a["protocol"], "HTTP/1.1");
    assert_eq!(a["tls"], false);
    assert_eq!(a["client_ip"], "127.0.0.1");
    assert_eq!(a["endpoint_id"], "e.api");
    assert_eq!(
        (&a["decision_reason"], &a["allowed"]),
        (&"allowed".into(), &true.into())
    );
    assert_eq!(a["limit"], Value::Null);
    assert_eq!(a["upstream"], "app");
    assert_eq!(a["upstream_addr"], up.addr().as_str());
    assert_eq!(
        a["identity_hash"],
        identity_hash("header:x-api-key:raw-key-1").as_str()
    );
    assert_eq!(a["user_agent"], "edge-test/1");
    assert!(a["bytes_sent"].as_u64().unwrap() > 0);
    assert!(a["duration_ms"].is_number());
    assert!(a["timestamp"].as_str().unwrap().ends_with('Z'));
    assert_eq!(d["status"], 429);
    assert_eq!(
        (&d["decision_reason"], &d["allowed"]),
        (&"rate_limited".into(), &false.into())
    );
    assert_eq!(d["limit"], "default");
    assert_eq!(
        (&d["upstream"], &d["upstream_addr"]),
        (&Value::Null, &Value::Null)
    );
    assert_eq!(n["status"], 404);
    // A path parameter may be a session id (a servlet's cookieless session): left out, as
    // the query is.
    assert_eq!(n["path"], "/nowhere/x", "{n}");
    assert!(
        !std::fs::read_to_string(&log)
            .unwrap()
            .contains("SESSION-7f3a"),
        "{lines:?}"
    );
    assert_eq!(
        (&n["endpoint_id"], &n["decision_reason"]),
        (&Value::Null, &Value::Null)
    );
    let text = std::fs::read_to_string(&log).unwrap();
    for secret in ["raw-key-1", "secret=q", "not-logged", "Bearer"] {
        assert!(!text.contains(secret), "{secret} reached the access log");
    }

    // Rotation: the file is moved away, SIGUSR1 opens a new one.
    let rotated = dir.path().join("access.log.1");
    std::fs::rename(&log, &rotated).unwrap();
    gw.proc.signal("USR1");
    wait_until(Duration::from_secs(3), "the reopen", || {
        gw.logs().contains("access log reopened")
    });
    http.get(gw.url("/nowhere")).send().await.unwrap();
    wait_until(Duration::from_secs(3), "a line in the new file", || {
        common::access_lines(&log).len() == 1
    });
    assert_eq!(common::access_lines(&rotated).len(), 5);
    // Rotated again, and a reload (unchanged config) reopens it too.
    let rotated_again = dir.path().join("access.log.2");
    std::fs::rename(&log, &rotated_again).unwrap();
    assert_eq!(gw.reload(), 200);
    http.get(gw.url("/nowhere")).send().await.unwrap();
    wait_until(Duration::from_secs(3), "a line in the newer file", || {
        common::access_lines(&log).len() == 1
    });
    assert_eq!(common::access_lines(&rotated_again).len(), 1);
    std::fs::remove_file(&log).unwrap();
    std::fs::rename(&rotated_again, &log).unwrap();
    assert_eq!(gw.reload(), 200);

    // Turned off by a reload: the lines of the requests answered before it are written (the
    // writer's last batch was dropped), and so is the line of one that began before it and
    // ends after it; no more.
    let burst = (0..20).map(|_| http.get(gw.url("/nowhere")).send());
    for answer in futures_util::future::join_all(burst).await {
        assert_eq!(answer.unwrap().status(), 404);
    }
    let slow = tokio::spawn(http.get(gw.url("/slow?ms=400")).send());
    tokio::time::sleep(Duration::from_millis(100)).await;
    gw.rewrite_config(&config.render(gw.port, gw.admin_port));
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    http.get(gw.url("/nowhere")).send().await.unwrap();
    assert_eq!(slow.await.unwrap().unwrap().status(), 200);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    http.get(gw.url("/nowhere")).send().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lines = common::access_lines(&log);
    assert_eq!(lines.len(), 22, "{lines:?}");
    assert_eq!(lines[21]["endpoint_id"], "e.slow");
    assert_eq!(gw.metric("sentinel_access_log_dropped_total"), 0.0);
}

#[test]
fn an_access_log_that_cannot_be_opened_stops_the_start() {
    let config = GatewayConfig::new("redis://127.0.0.1:1/0")
        .upstream("app", &["127.0.0.1:9"])
        .route(Route::new("e.open").prefix("/").unlimited())
        .section("[access_log]\npath = \"/nonexistent-dir/access.log\"\n");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(
        &path,
        config.render(common::free_port(), common::free_port()),
    )
    .unwrap();
    let out = common::run_binary(
        &[std::ffi::OsStr::new("--config"), path.as_os_str()],
        &[("SENTINEL_REDIS_URL", None)],
    );
    // A directory that is not there is a config error, named as every other is (and
    // `check` finds it too).
    assert_eq!(out.status.code(), Some(2));
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains(&format!("{}:", path.display()))
            && text.contains(
                "access_log.path = \"/nonexistent-dir/access.log\" cannot be made: /nonexistent-dir does not exist"
            ),
        "{text}"
    );
    let check = common::check_config(&path, &[("SENTINEL_REDIS_URL", None)]);
    assert_eq!(check.status.code(), Some(2));
    // Under a file, not a directory: the same, said so.
    let file = dir.path().join("plain");
    std::fs::write(&file, "").unwrap();
    let under_a_file = GatewayConfig::new("redis://127.0.0.1:1/0")
        .upstream("app", &["127.0.0.1:9"])
        .route(Route::new("e.open").prefix("/").unlimited())
        .section("[access_log]\npath = \"plain/access.log\"\n");
    std::fs::write(&path, under_a_file.render(1, 2)).unwrap();
    let check = common::check_config(&path, &[("SENTINEL_REDIS_URL", None)]);
    assert_eq!(check.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&check.stderr);
    assert!(
        stderr.contains(&format!(
            "access_log.path = \"plain/access.log\" cannot be made: {} is not a directory",
            file.display()
        )),
        "{stderr}"
    );
}

/// An upstream on a free port that keeps every byte it receives, and answers 200 `ok` to
/// each request: at the end of its head, or of its chunked body.
fn recording_upstream() -> (String, Arc<Mutex<Vec<u8>>>) {
    /// Where the first request in `pending` ends, when it is all there.
    fn request_end(pending: &[u8]) -> Option<usize> {
        let head = pending.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
        let chunked = String::from_utf8_lossy(&pending[..head])
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        if !chunked {
            return Some(head);
        }
        let end = b"\r\n0\r\n\r\n";
        let at = pending[head - 2..]
            .windows(end.len())
            .position(|w| w == end)?;
        Some(head - 2 + at + end.len())
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let received = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&received);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let kept = Arc::clone(&kept);
            std::thread::spawn(move || {
                let (mut pending, mut buf) = (Vec::new(), [0u8; 4096]);
                while let Ok(n @ 1..) = stream.read(&mut buf) {
                    kept.lock().unwrap().extend_from_slice(&buf[..n]);
                    pending.extend_from_slice(&buf[..n]);
                    while let Some(end) = request_end(&pending) {
                        pending.drain(..end);
                        let answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";
                        if stream.write_all(answer).is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, received)
}

/// `GET path` over HTTP/2 with prior knowledge on its own connection, with `authority`
/// as the request's `:authority`: the status, whether it carried a request id, the body.
async fn h2_get(port: u16, authority: &str, path: &str) -> (u16, bool, String) {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut h2 = h2.ready().await.unwrap();
    let request = http::Request::get(format!("http://{authority}{path}"))
        .body(())
        .unwrap();
    let (response, _) = h2.send_request(request, true).unwrap();
    let response = response.await.unwrap();
    let (status, id) = (
        response.status().as_u16(),
        response.headers().contains_key("x-request-id"),
    );
    let mut body = response.into_body();
    let mut text = Vec::new();
    while let Some(chunk) = body.data().await {
        text.extend_from_slice(&chunk.unwrap());
    }
    (status, id, String::from_utf8_lossy(&text).into_owned())
}

/// A gateway with h2c on, one unlimited route `open` for every path to `upstream`.
fn h2c_to(redis: &Redis, upstream: String) -> GatewayConfig {
    GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .upstream("app", &[upstream])
        .route(Route::new("open").prefix("/").unlimited())
}

/// A `POST /upload` over a new h2c connection to `gw`, its body left open: the answer to
/// come and the body's stream.
async fn h2c_upload(
    gw: &common::Gateway,
) -> (h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>) {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", gw.port))
        .await
        .unwrap();
    let (mut h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let request = http::Request::post(gw.url("/upload")).body(()).unwrap();
    h2.send_request(request, false).unwrap()
}

/// An HTTP/2 `:authority` is held to what a `Host` must be: one with an empty label or a
/// port not of digits is the gateway's 400 with its request id, as over HTTP/1.1, where it
/// was forwarded: `api.example..` stepped around the `host` route to the route without one,
/// and `api.example:x` reached the host's route with a port nobody could read;
/// `api.example,evil.example` reached the route without a host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_authority_is_held_to_what_a_host_must_be() {
    let redis = Redis::start();
    let (hosted, other) = (Upstream::start("hosted"), Upstream::start("other"));
    let gw = GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .upstream("hosted", &[hosted.addr()])
        .upstream("other", &[other.addr()])
        .route(
            Route::new("e.hosted")
                .prefix("/h")
                .host("api.example")
                .upstream("hosted")
                .unlimited(),
        )
        .route(
            Route::new("e.other")
                .prefix("/h")
                .upstream("other")
                .unlimited(),
        )
        .start();
    let (status, _, body) = h2_get(gw.port, "api.example", "/h/x").await;
    assert_eq!(status, 200);
    assert!(body.contains(r#""upstream":"hosted""#), "{body}");
    let (status, _, body) = h2_get(gw.port, "else.example", "/h/x").await;
    assert_eq!(status, 200);
    assert!(body.contains(r#""upstream":"other""#), "{body}");
    for authority in [
        "api.example..",
        "api.example:x",
        ".api.example",
        "api.example,evil.example",
    ] {
        let (status, id, body) = h2_get(gw.port, authority, "/h/x").await;
        assert_eq!(
            (status, id, body.as_str()),
            (400, true, r#"{"detail":"bad request"}"#),
            "{authority}"
        );
        // An HTTP/1 absolute-form target without `Host` is routed by its authority too.
        let request = format!("GET http://{authority}/h/x HTTP/1.0\r\n\r\n");
        assert_eq!(
            common::raw_request(gw.port, request.as_bytes()),
            Some(400),
            "{authority} over HTTP/1.0"
        );
    }
}

/// An HTTP/2 body of unknown length whose end comes in an empty DATA frame (as `curl -T -`
/// sends it) reaches the upstream chunked with one terminator: a second one would be read
/// by the upstream as the start of another request, and its answer to that given to the
/// next client on the pooled connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_body_ended_by_an_empty_frame_reaches_the_upstream_framed_once() {
    let redis = Redis::start();
    let (upstream, received) = recording_upstream();
    let gw = h2c_to(&redis, upstream).start();
    let (response, mut body) = h2c_upload(&gw).await;
    body.send_data(bytes::Bytes::from_static(b"xxxxxxxxxx"), false)
        .unwrap();
    body.send_data(bytes::Bytes::new(), true).unwrap();
    assert_eq!(response.await.unwrap().status(), 200);

    // Whatever the gateway wrote after the terminator was written with it.
    std::thread::sleep(Duration::from_millis(300));
    let received = String::from_utf8_lossy(&received.lock().unwrap()).into_owned();
    let (head, body) = received.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    assert_eq!(body, "A\r\nxxxxxxxxxx\r\n0\r\n\r\n");
}

/// An upstream may answer before the request's body has all come. Over HTTP/2, a client that
/// stops sending once the answer has ended (curl does) is not waited for: a quarter of a
/// second later the gateway resets the stream with `NO_ERROR` (RFC 9113, section 8.1: the
/// client is to stop sending, the answer stands). It waited, and the client with it, until
/// one side closed the connection. The body sent so far is not passed on as a whole one (no
/// chunked terminator), and the upstream connection is closed rather than pooled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_early_answer_ends_the_http2_stream_with_no_error() {
    let redis = Redis::start();
    let received = Arc::new(Mutex::new(Vec::new()));
    let (closed_tx, closed_rx) = std::sync::mpsc::channel();
    let upstream = {
        let received = Arc::clone(&received);
        common::raw_server(move |mut s| {
            let Some(head) = common::read_head(&mut s) else {
                return;
            };
            received.lock().unwrap().extend_from_slice(&head);
            // Answered at once, keep-alive, the body not read first.
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 14\r\n\r\n{\"early\":true}");
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = s.read(&mut buf) {
                received.lock().unwrap().extend_from_slice(&buf[..n]);
            }
            let _ = closed_tx.send(());
        })
    };
    let gw = h2c_to(&redis, upstream).start();
    let (response, mut body) = h2c_upload(&gw).await;
    body.send_data(bytes::Bytes::from_static(b"xxxxxxxxxx"), false)
        .unwrap();

    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    let mut answer = response.into_body();
    let mut text = Vec::new();
    while let Some(piece) = answer.data().await {
        text.extend_from_slice(&piece.unwrap());
    }
    assert_eq!(text, b"{\"early\":true}");

    // The rest of the body is never sent: the stream is reset all the same.
    let reset = tokio::time::timeout(
        Duration::from_secs(5),
        futures_util::future::poll_fn(|cx| body.poll_reset(cx)),
    )
    .await
    .expect("no reset within 5 s: the stream waits for the rest of the body");
    assert_eq!(reset.unwrap(), h2::Reason::NO_ERROR);

    tokio::task::block_in_place(|| closed_rx.recv_timeout(Duration::from_secs(5)))
        .expect("the upstream connection was kept open");
    let received = String::from_utf8_lossy(&received.lock().unwrap()).into_owned();
    let (head, sent) = received.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{head}"
    );
    assert!(
        !sent.contains("0\r\n\r\n"),
        "the cut body was ended: {sent:?}"
    );
}

/// An upstream's answer goes on as the gateway's own: an HTTP/1.0 upstream's status line in
/// the gateway's HTTP/1.1 (RFC 9110, 6.2), and a 204 that names a length it may not have
/// without it (an HTTP/2 client refused the whole answer: a stream error, no status at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstreams_answer_is_sent_in_the_gateways_own_version_and_framing() {
    let redis = Redis::start();
    let upstream = common::raw_server(|mut s| {
        while let Some(head) = common::read_head(&mut s) {
            let answer: &[u8] = if head.starts_with(b"GET /old") {
                b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"
            } else if head.starts_with(b"GET /cached") {
                // A 304 may name its representation's length (RFC 9110, 8.6): kept.
                b"HTTP/1.1 304 Not Modified\r\nContent-Length: 1234\r\n\r\n"
            } else {
                b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n"
            };
            if s.write_all(answer).is_err() {
                return;
            }
        }
    });
    let gw = h2c_to(&redis, upstream).start();
    let mut tcp = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    tcp.write_all(b"GET /old HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    tcp.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.ends_with("\r\n\r\nok"), "{answer}");
    for http in [common::h2c_client(), client()] {
        let r = http.get(gw.url("/empty")).send().await.unwrap();
        assert_eq!(r.status(), 204);
        assert!(r.headers().get("content-length").is_none(), "{r:?}");
        let r = http.get(gw.url("/cached")).send().await.unwrap();
        assert_eq!(r.status(), 304);
    }
}

/// A backend that limits too keeps its own fields beside the gateway's: its 429 says its own
/// `X-RateLimit-Remaining: 0` (not the gateway's 999), and its `RateLimit` item comes first in
/// the list the gateway adds its own to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backends_own_rate_limit_fields_are_kept_beside_the_gateways() {
    let redis = Redis::start();
    let upstream = common::raw_server(|mut s| {
        while common::read_head(&mut s).is_some() {
            let answer = b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 7\r\n\
                RateLimit-Policy: \"backend\";q=10;w=60\r\nRateLimit: \"backend\";r=0;t=7\r\n\
                X-RateLimit-Limit: 10\r\nX-RateLimit-Remaining: 0\r\nContent-Length: 0\r\n\r\n";
            if s.write_all(answer).is_err() {
                return;
            }
        }
    });
    let gw = GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .upstream("app", &[upstream])
        .route(
            Route::new("e.api")
                .prefix("/")
                .identity_header("X-User")
                .token_bucket(1_000_000_000, 0)
                .set("ratelimit_headers", "\"both\""),
        )
        .start();
    for http in [client(), common::h2c_client()] {
        let r = http
            .get(gw.url("/x"))
            .header("X-User", "u1")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 429);
        let field = |name: &str| r.headers()[name].to_str().unwrap().to_owned();
        assert_eq!(field("retry-after"), "7");
        assert_eq!(field("x-ratelimit-remaining"), "0");
        assert_eq!(field("x-ratelimit-limit"), "10");
        assert!(
            field("ratelimit").starts_with("\"backend\";r=0;t=7, \"e.api\";r="),
            "{}",
            field("ratelimit")
        );
        assert!(
            field("ratelimit-policy").starts_with("\"backend\";q=10;w=60, \"e.api\";q=1000"),
            "{}",
            field("ratelimit-policy")
        );
    }
}

/// A client still sending its body after an upstream's early answer over HTTP/2 is let finish
/// (its body read and thrown away, as after the gateway's own answers), so its stream ends
/// without a reset: some clients (curl 7.88) lose an answer whose stream is reset while they
/// upload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_still_sending_after_an_upstreams_early_answer_over_http2_is_not_reset() {
    let redis = Redis::start();
    let upstream = common::raw_server(|mut s| {
        if common::read_head(&mut s).is_none() {
            return;
        }
        let _ = s.write_all(b"HTTP/1.1 413 Too Large\r\nContent-Length: 7\r\n\r\ntoo big");
        let mut buf = [0u8; 4096];
        while let Ok(1..) = s.read(&mut buf) {}
    });
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let gw = h2c_to(&redis, upstream).access_log(&log).start();
    let sent_at = std::time::SystemTime::now();
    let (response, mut body) = h2c_upload(&gw).await;
    let piece = bytes::Bytes::from(vec![b'x'; 16 * 1024]);
    body.send_data(piece.clone(), false).unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 413);
    let mut answer = response.into_body();
    while let Some(part) = answer.data().await {
        part.unwrap();
    }
    // The answer is whole; the client goes on with its body, a piece every 50 ms for a second.
    for i in 0..20 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        body.send_data(piece.clone(), i == 19)
            .unwrap_or_else(|e| panic!("piece {i} after the answer: {e}"));
    }
    let line = tokio::task::block_in_place(|| common::the_access_log_line(&log));
    assert_eq!(line["status"], 413, "{line}");
    // Every byte was read (and thrown away), and the line says when the request came and
    // how long until its answer, not until its body's end a second later.
    assert_eq!(line["bytes_received"], 21 * 16 * 1024, "{line}");
    assert!(line["duration_ms"].as_f64().unwrap() < 500.0, "{line}");
    let stamp = line["timestamp"].as_str().unwrap();
    let of_day = |h: &str, m: &str, s: &str| -> i64 {
        let s: f64 = s.parse().unwrap();
        (h.parse::<i64>().unwrap() * 3600 + m.parse::<i64>().unwrap() * 60) * 1000
            + (s * 1000.0) as i64
    };
    let logged = of_day(&stamp[11..13], &stamp[14..16], &stamp[17..stamp.len() - 1]);
    let sent = (sent_at
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis()
        % 86_400_000) as i64;
    let late = (logged - sent + 43_200_000).rem_euclid(86_400_000) - 43_200_000;
    assert!(
        (-1000..500).contains(&late),
        "{late} ms after it was sent: {line}"
    );
}

/// nginx's pair of listeners, `listen = ["127.0.0.1:P", "[::]:P"]`: the `[::]` one is bound
/// IPv6 only beside an IPv4 listener on its port (as nginx binds it), so both start, each
/// serving its family; without that the wildcard took IPv4 too and the start failed.
#[test]
fn an_ipv6_wildcard_beside_an_ipv4_listener_of_its_port_starts_and_serves_both() {
    // A host without IPv6 (or with it turned off: Docker's default) has no `[::1]`.
    if std::net::TcpListener::bind("[::]:0").is_err()
        || std::net::TcpListener::bind("[::1]:0").is_err()
    {
        return;
    }
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let [p, admin] = common::free_ports();
    let config = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(Route::new("e.open").prefix("/").unlimited())
        .render(p, admin)
        .replace(
            &format!("listen = \"127.0.0.1:{p}\""),
            &format!("listen = [\"127.0.0.1:{p}\", \"[::]:{p}\"]"),
        );
    let gw = common::Gateway::start_with_env(p, admin, &config, &[]);
    let status = |to: std::net::SocketAddr| {
        let mut s = TcpStream::connect(to).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer.get(9..12)?.parse::<u16>().ok()
    };
    assert_eq!(
        status(([127, 0, 0, 1], p).into()),
        Some(200),
        "{}",
        gw.logs()
    );
    let v6: std::net::SocketAddr = format!("[::1]:{p}").parse().unwrap();
    assert_eq!(status(v6), Some(200), "{}", gw.logs());
}

/// A route that browsers on another origin call (`cors_origins`): the gateway answers a
/// listed origin's preflights itself (no key, no token, nothing upstream), by the route of
/// the method asked for (a `methods = ["POST"]` route too); every answer to that origin,
/// the upstream's 200 and the gateway's own 429 and 502, lets its script read it; another
/// origin's preflight goes on as any keyless request (401), and gets nothing readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browsers_preflight_is_answered_and_its_origin_may_read_every_answer() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dead = format!("127.0.0.1:{}", common::free_port());
    let origins = r#"["https://app.example.com"]"#;
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .upstream("dead", &[dead])
        .route(
            limited(2)
                .set("cors_origins", origins)
                .set("ratelimit_headers", "true"),
        )
        .route(
            Route::new("e.post")
                .prefix("/post")
                .methods(&["POST"])
                .identity_header("X-API-Key")
                .token_bucket(2_000_000, 0)
                .set("cors_origins", origins),
        )
        .route(
            Route::new("e.down")
                .prefix("/down")
                .upstream("dead")
                .unlimited()
                .set("cors_origins", origins),
        )
        .start();
    let http = client();
    let preflight = |path: &str, origin: &'static str| {
        http.request(reqwest::Method::OPTIONS, gw.url(path))
            .header("Origin", origin)
            .header("Access-Control-Request-Method", "POST")
            .header("Access-Control-Request-Headers", "x-api-key")
            .send()
    };
    for path in ["/api/x", "/api/x", "/api/x", "/post/x"] {
        let r = preflight(path, "https://app.example.com").await.unwrap();
        assert_eq!(r.status(), 204, "{path}");
        let h = r.headers();
        assert!(!h.contains_key("x-upstream"), "answered by the gateway");
        assert_eq!(h["access-control-allow-origin"], "https://app.example.com");
        assert_eq!(h["access-control-allow-methods"], "POST");
        assert_eq!(h["access-control-allow-headers"], "x-api-key");
        assert!(h.contains_key("x-request-id"));
    }
    // Another origin's preflight is a request without a key.
    let r = preflight("/api/x", "https://evil.example").await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(!r.headers().contains_key("access-control-allow-origin"));
    // No preflight spent a token: the bucket of 2 admits its 2, then 429.
    let get = |origin: &'static str| {
        http.get(gw.url("/api/x"))
            .header("X-API-Key", "browser")
            .header("Origin", origin)
            .send()
    };
    let admitted = get("https://app.example.com").await.unwrap();
    assert_eq!(admitted.status(), 200);
    assert_eq!(admitted.headers()["x-upstream"], "app");
    assert_eq!(
        admitted.headers()["access-control-allow-origin"],
        "https://app.example.com"
    );
    assert_eq!(get("https://app.example.com").await.unwrap().status(), 200);
    let denied = get("https://app.example.com").await.unwrap();
    assert_eq!(denied.status(), 429);
    let h = denied.headers();
    assert_eq!(h["access-control-allow-origin"], "https://app.example.com");
    assert_eq!(h["access-control-allow-credentials"], "true");
    assert_eq!(h["vary"], "Origin");
    let exposed = h["access-control-expose-headers"].to_str().unwrap();
    for field in [
        "Retry-After",
        "RateLimit",
        "RateLimit-Policy",
        "x-request-id",
    ] {
        assert!(exposed.contains(field), "{exposed}");
    }
    let other = get("https://evil.example").await.unwrap();
    assert_eq!(other.status(), 429);
    assert!(!other.headers().contains_key("access-control-allow-origin"));
    // A 400 written before the route is the request's (a method override another route
    // would take) too.
    let refused = http
        .post(gw.url("/post/x"))
        .header("Origin", "https://app.example.com")
        .header("X-HTTP-Method-Override", "GET")
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    assert_eq!(
        refused.headers()["access-control-allow-origin"],
        "https://app.example.com"
    );
    // The gateway's 502 too.
    let down = http
        .get(gw.url("/down/x"))
        .header("Origin", "https://app.example.com")
        .send()
        .await
        .unwrap();
    assert_eq!(down.status(), 502);
    assert_eq!(
        down.headers()["access-control-allow-origin"],
        "https://app.example.com"
    );
}
