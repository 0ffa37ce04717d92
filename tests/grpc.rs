//! gRPC through the gateway, against the real binary: an `http2` upstream spoken to over h2c
//! and over TLS by ALPN, calls from an HTTP/2 client (h2c) with their trailers both ways, a
//! bidirectional stream, and the gateway's own answers to a call said as gRPC statuses.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::config::{quoted, GatewayConfig, Route};
use common::{access_lines, free_port, wait_until, Redis};
use http::HeaderMap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::PrivateKeyDer;

/// A gRPC message: uncompressed, its length, its bytes.
fn message(payload: &[u8]) -> Bytes {
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    framed.extend_from_slice(payload);
    Bytes::from(framed)
}

/// The heads of the calls an upstream received.
type Seen = Arc<Mutex<Vec<http::request::Parts>>>;

/// A gRPC server as far as the gateway can tell, over HTTP/2 only (h2c, or TLS offering
/// ALPN `h2` alone): `/echo.Echo/Fail` answers Trailers-Only with `NOT_FOUND`; any other
/// path echoes each piece of the body as it comes, then ends with `grpc-status: 0` and an
/// `x-checksum` trailer. Lives as long as the test's runtime.
async fn grpc_upstream(tls: Option<tokio_rustls::TlsAcceptor>) -> (u16, Seen) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen: Seen = Arc::default();
    let kept = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (tls, seen) = (tls.clone(), Arc::clone(&kept));
            tokio::spawn(async move {
                match tls {
                    Some(acceptor) => {
                        if let Ok(stream) = acceptor.accept(tcp).await {
                            serve_connection(stream, seen).await;
                        }
                    }
                    None => serve_connection(tcp, seen).await,
                }
            });
        }
    });
    (port, seen)
}

async fn serve_connection<T>(io: T, seen: Seen)
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let Ok(mut connection) = h2::server::handshake(io).await else {
        return;
    };
    while let Some(Ok((request, respond))) = connection.accept().await {
        tokio::spawn(serve_call(request, respond, Arc::clone(&seen)));
    }
}

async fn serve_call(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    seen: Seen,
) {
    let (parts, mut body) = request.into_parts();
    let path = parts.uri.path().to_owned();
    seen.lock().unwrap().push(parts);
    let head = |status: Option<&str>| {
        let mut b = http::Response::builder()
            .status(200)
            .header("content-type", "application/grpc");
        if let Some(code) = status {
            b = b
                .header("grpc-status", code)
                .header("grpc-message", "no such thing");
        }
        b.body(()).unwrap()
    };
    // The first such call is refused unprocessed (`REFUSED_STREAM`), as a server that is
    // shutting down or at its stream limit does.
    static REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if path == "/echo.Echo/RefusedOnce" && !REFUSED.swap(true, std::sync::atomic::Ordering::SeqCst)
    {
        respond.send_reset(h2::Reason::REFUSED_STREAM);
        return;
    }
    // Reports its cost in its initial metadata (`x-pages: 4`), and another in its trailers,
    // which no one reads.
    if path == "/echo.Echo/Pages" {
        let head = http::Response::builder()
            .status(200)
            .header("content-type", "application/grpc")
            .header("x-pages", "4")
            .body(())
            .unwrap();
        let Ok(mut send) = respond.send_response(head, false) else {
            return;
        };
        let _ = send.send_data(message(b"done"), false);
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        trailers.insert("x-pages", "100".parse().unwrap());
        let _ = send.send_trailers(trailers);
        return;
    }
    // Answers one message, then falls silent.
    if path == "/echo.Echo/Stall" {
        let Ok(mut send) = respond.send_response(head(None), false) else {
            return;
        };
        let _ = send.send_data(message(b"first"), false);
        tokio::time::sleep(Duration::from_secs(30)).await;
        return;
    }
    // Reads the whole call before it answers, as a unary server does.
    if path == "/echo.Echo/Collect" {
        let mut asked = 0;
        while let Some(Ok(chunk)) = body.data().await {
            let _ = body.flow_control().release_capacity(chunk.len());
            asked += chunk.len();
        }
        let Ok(mut send) = respond.send_response(head(None), false) else {
            return;
        };
        let _ = send.send_data(message(asked.to_string().as_bytes()), false);
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let _ = send.send_trailers(trailers);
        return;
    }
    if path == "/echo.Echo/Fail" {
        let _ = respond.send_response(head(Some("5")), true);
        return;
    }
    if path == "/grpc.health.v1.Health/Check" {
        let mut asked = Vec::new();
        while let Some(Ok(chunk)) = body.data().await {
            let _ = body.flow_control().release_capacity(chunk.len());
            asked.extend_from_slice(&chunk);
        }
        // `HealthCheckRequest.service`, after the message's prefix and the field's tag and length.
        let service = asked.get(7..).unwrap_or_default();
        let status = match service {
            b"" | b"echo.Echo" => 1,
            b"sick.Svc" => 2,
            _ => {
                let _ = respond.send_response(head(Some("5")), true);
                return;
            }
        };
        let Ok(mut send) = respond.send_response(head(None), false) else {
            return;
        };
        let _ = send.send_data(message(&[0x08, status]), false);
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let _ = send.send_trailers(trailers);
        return;
    }
    // As tonic answers a path it does not serve: 200, and `UNIMPLEMENTED`.
    if !path.starts_with("/echo.Echo/") && path != "/healthz" {
        let _ = respond.send_response(head(Some("12")), true);
        return;
    }
    let Ok(mut send) = respond.send_response(head(None), false) else {
        return;
    };
    while let Some(Ok(chunk)) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.len());
        if send.send_data(chunk, false).is_err() {
            return;
        }
    }
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().unwrap());
    trailers.insert("x-checksum", "c0ffee".parse().unwrap());
    let _ = send.send_trailers(trailers);
}

/// What a client read of one call.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: HeaderMap,
    /// The head ended the stream: no body, no trailers (Trailers-Only).
    head_only: bool,
    body: Vec<u8>,
    trailers: Option<HeaderMap>,
}

/// A client's HTTP/2 connection (prior knowledge) to the gateway's plain listener.
async fn connect(port: u16) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    h2.ready().await.unwrap()
}

fn call_head(path: &str, key: Option<&str>) -> http::Request<()> {
    let mut b = http::Request::post(format!("http://grpc.example{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(key) = key {
        b = b.header("x-api-key", key);
    }
    b.body(()).unwrap()
}

/// A unary call: one message, the stream ended with it.
async fn unary(h2: &mut h2::client::SendRequest<Bytes>, path: &str, key: Option<&str>) -> Answer {
    let (response, mut send) = h2.send_request(call_head(path, key), false).unwrap();
    let _ = send.send_data(message(b"hello"), true);
    read_answer(response).await
}

async fn read_answer(response: h2::client::ResponseFuture) -> Answer {
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("an answer within 10 s")
        .unwrap();
    let (parts, mut body) = response.into_parts();
    let head_only = body.is_end_stream();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.unwrap();
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    let trailers = body.trailers().await.unwrap();
    Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        head_only,
        body: bytes,
        trailers,
    }
}

fn field<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .map(|v| v.to_str().unwrap())
        .unwrap_or_else(|| panic!("no {name} in {headers:?}"))
}

/// A gateway taking h2c, with `[upstreams.echo]` over HTTP/2 (`fields` added); routes follow.
fn echo_gateway(redis: &Redis, up: u16, fields: &str) -> GatewayConfig {
    GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .section(&http2_upstream(up, fields))
}

/// The unlimited route of every method of the echo service.
fn open_echo() -> Route {
    Route::new("grpc.echo")
        .prefix("/echo.Echo")
        .upstream("echo")
        .unlimited()
}

/// `[upstreams.echo]` over HTTP/2, with `extra` fields.
fn http2_upstream(port: u16, extra: &str) -> String {
    format!(
        "[upstreams.echo]\naddrs = [{}]\nhttp2 = true\n{extra}",
        quoted(&format!("127.0.0.1:{port}"))
    )
}

/// A unary call and an HTTP/1.1 request reach an `http2` upstream spoken to with prior
/// knowledge (h2c): the call's answer, its message and its trailers come back as the upstream
/// sent them, the upstream sees the call's `te: trailers` and the gateway's forwarded
/// fields, an upstream's Trailers-Only status passes, the access log says each call's
/// `grpc_status`, and the health check speaks HTTP/2 to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_reaches_an_http2_upstream_and_its_trailers_come_back() {
    let redis = Redis::start();
    let (up, seen) = grpc_upstream(None).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let health = "health_check = { path = \"/healthz\", interval_ms = 100, timeout_ms = 1000 }\n";
    let gw = echo_gateway(&redis, up, health)
        .access_log(&log)
        .route(open_echo())
        .start();
    let mut h2 = connect(gw.port).await;
    let answer = unary(&mut h2, "/echo.Echo/Say", None).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(field(&answer.headers, "content-type"), "application/grpc");
    assert_eq!(answer.body, message(b"hello"));
    let trailers = answer.trailers.expect("the upstream's trailers");
    assert_eq!(field(&trailers, "grpc-status"), "0");
    assert_eq!(field(&trailers, "x-checksum"), "c0ffee");
    let request_id = field(&answer.headers, "x-request-id").to_owned();

    let calls = |path: &str| -> Vec<http::request::Parts> {
        let seen = seen.lock().unwrap();
        seen.iter()
            .filter(|c| c.uri.path() == path)
            .cloned()
            .collect()
    };
    let call = calls("/echo.Echo/Say")[0].clone();
    assert_eq!(call.uri.path(), "/echo.Echo/Say");
    assert_eq!(call.version, http::Version::HTTP_2);
    assert_eq!(field(&call.headers, "te"), "trailers");
    assert_eq!(field(&call.headers, "content-type"), "application/grpc");
    assert_eq!(field(&call.headers, "x-forwarded-for"), "127.0.0.1");
    // The rest of the contract's forwarded fields, and the client's authority, over HTTP/2.
    assert_eq!(field(&call.headers, "x-forwarded-proto"), "http");
    assert_eq!(field(&call.headers, "x-forwarded-host"), "grpc.example");
    assert_eq!(field(&call.headers, "x-real-ip"), "127.0.0.1");
    assert_eq!(call.uri.authority().unwrap().as_str(), "grpc.example");
    assert_eq!(field(&call.headers, "x-request-id"), request_id);

    let failed = unary(&mut h2, "/echo.Echo/Fail", None).await;
    assert!(failed.head_only, "{failed:?}");
    assert_eq!(field(&failed.headers, "grpc-status"), "5");

    // A call the upstream refused unprocessed is sent again (a POST, as every call).
    let refused = unary(&mut h2, "/echo.Echo/RefusedOnce", None).await;
    assert_eq!(refused.body, message(b"hello"), "{refused:?}");
    assert_eq!(
        field(refused.trailers.as_ref().unwrap(), "grpc-status"),
        "0"
    );
    assert_eq!(calls("/echo.Echo/RefusedOnce").len(), 2);

    // An empty `Host` (HTTP/1.1 allows one; no `:authority` may be empty) goes up with the
    // upstream's address as its authority.
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    let request = b"POST /echo.Echo/Empty HTTP/1.1\r\nHost:\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi";
    std::io::Write::write_all(&mut tcp, request).unwrap();
    let mut answer = String::new();
    std::io::Read::read_to_string(&mut tcp, &mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let empty = calls("/echo.Echo/Empty");
    assert_eq!(
        empty[0].uri.authority().unwrap().as_str(),
        format!("127.0.0.1:{up}")
    );

    // An HTTP/1.1 client's request goes upstream over HTTP/2 too (its answer has no trailers).
    let plain = common::client()
        .post(gw.url("/echo.Echo/Say"))
        .body("plain")
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status(), 200);
    assert_eq!(plain.text().await.unwrap(), "plain");
    assert_eq!(calls("/echo.Echo/Say")[1].version, http::Version::HTTP_2);

    wait_until(Duration::from_secs(10), "five access log lines", || {
        access_lines(&log).len() >= 5
    });
    let lines = access_lines(&log);
    let status_of = |path: &str| -> Vec<serde_json::Value> {
        let with = lines.iter().filter(|l| l["path"] == path);
        with.map(|l| l["grpc_status"].clone()).collect()
    };
    assert_eq!(
        status_of("/echo.Echo/Say"),
        [0.into(), serde_json::Value::Null]
    );
    assert_eq!(status_of("/echo.Echo/Fail"), [serde_json::Value::from(5)]);

    let healthy = format!("sentinel_upstream_healthy{{addr=\"127.0.0.1:{up}\",upstream=\"echo\"}}");
    wait_until(Duration::from_secs(10), "a passed health check", || {
        seen.lock()
            .unwrap()
            .iter()
            .any(|c| c.uri.path() == "/healthz")
    });
    assert_eq!(gw.metric(&healthy), 1.0);
}

/// A bidirectional stream: each message the client sends comes back before it sends the
/// next, through the gateway both ways, and the stream ends with the upstream's trailers; the
/// connection may hold `h2_max_concurrent_streams` of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bidirectional_stream_flows_both_ways_while_it_is_open() {
    let redis = Redis::start();
    let (up, _) = grpc_upstream(None).await;
    let gw = GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .server("h2_max_concurrent_streams", "500")
        .section(&http2_upstream(up, ""))
        .route(
            Route::new("grpc.chat")
                .prefix("/echo.Echo")
                .upstream("echo")
                .identity_header("x-api-key")
                .token_bucket(1_000_000_000, 1_000_000),
        )
        .start();
    let mut h2 = connect(gw.port).await;
    let (response, mut send) = h2
        .send_request(call_head("/echo.Echo/Chat", Some("k1")), false)
        .unwrap();
    send.send_data(message(b"one"), false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("the head within 10 s")
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    for (i, said) in [&b"one"[..], b"two", b"three"].into_iter().enumerate() {
        if i > 0 {
            send.send_data(message(said), false).unwrap();
        }
        let mut echoed = Vec::new();
        while echoed.len() < message(said).len() {
            let chunk = tokio::time::timeout(Duration::from_secs(10), body.data())
                .await
                .unwrap_or_else(|_| panic!("message {i} echoed while the stream is open"))
                .expect("the stream goes on")
                .unwrap();
            let _ = body.flow_control().release_capacity(chunk.len());
            echoed.extend_from_slice(&chunk);
        }
        assert_eq!(echoed, message(said));
    }
    // More long streams open on the connection than HTTP/2's usual 100: each answered while
    // all are open (`h2_max_concurrent_streams`, for clients of many watches).
    let mut open = Vec::new();
    for _ in 0..120 {
        let (response, mut more) = h2
            .send_request(call_head("/echo.Echo/Chat", Some("k2")), false)
            .unwrap();
        more.send_data(message(b"hi"), false).unwrap();
        open.push((response, more));
    }
    for (response, _) in &mut open {
        let head = tokio::time::timeout(Duration::from_secs(10), response).await;
        let head = head.expect("every stream answered").unwrap();
        // The upstream's head, its stream open: not the gateway's own answer.
        assert!(!head.headers().contains_key("grpc-status"), "{head:?}");
    }
    send.send_data(Bytes::new(), true).unwrap();
    assert!(body.data().await.is_none());
    let trailers = body.trailers().await.unwrap().expect("trailers");
    assert_eq!(field(&trailers, "grpc-status"), "0");
}

/// The gateway's own answers to a call are gRPC's Trailers-Only answers, which every gRPC
/// client reads: a rate limit is `RESOURCE_EXHAUSTED` with its wait as
/// `grpc-retry-pushback-ms`, a missing key `UNAUTHENTICATED`, no route `UNIMPLEMENTED`, an
/// upstream down `UNAVAILABLE`; `:status` 200, the request id and the RateLimit fields kept.
/// The access log says status 200 and the gRPC status. A request that is no call still gets
/// the JSON 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateways_own_answers_to_a_call_are_grpc_statuses() {
    let redis = Redis::start();
    let (up, seen) = grpc_upstream(None).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let closed = free_port();
    let gw = echo_gateway(&redis, up, "")
        .access_log(&log)
        .section(&format!(
            "[upstreams.down]\naddrs = [{}]\nhttp2 = true\n",
            quoted(&format!("127.0.0.1:{closed}"))
        ))
        .route(
            Route::new("grpc.echo")
                .prefix("/echo.Echo")
                .upstream("echo")
                .identity_header("x-api-key")
                .token_bucket(2_000_000, 1)
                .set("ratelimit_headers", "true"),
        )
        .route(
            Route::new("grpc.down")
                .prefix("/down.Down")
                .upstream("down")
                .unlimited(),
        )
        .start();
    let mut h2 = connect(gw.port).await;
    for _ in 0..2 {
        let admitted = unary(&mut h2, "/echo.Echo/Say", Some("k1")).await;
        assert_eq!(
            field(admitted.trailers.as_ref().unwrap(), "grpc-status"),
            "0"
        );
    }
    let limited = unary(&mut h2, "/echo.Echo/Say", Some("k1")).await;
    assert_eq!(limited.status, 200, "{limited:?}");
    assert!(
        limited.head_only,
        "a head that ends the stream: {limited:?}"
    );
    assert_eq!(field(&limited.headers, "content-type"), "application/grpc");
    assert_eq!(field(&limited.headers, "grpc-status"), "8");
    assert_eq!(
        field(&limited.headers, "grpc-message"),
        "rate limit exceeded"
    );
    let wait: u64 = field(&limited.headers, "retry-after").parse().unwrap();
    let pushback: u64 = field(&limited.headers, "grpc-retry-pushback-ms")
        .parse()
        .unwrap();
    assert_eq!(pushback, wait * 1000);
    assert_eq!(field(&limited.headers, "x-request-id").len(), 32);
    assert!(field(&limited.headers, "ratelimit").contains("r=0"));
    assert_eq!(
        seen.lock().unwrap().len(),
        2,
        "the denied call never went up"
    );

    let keyless = unary(&mut h2, "/echo.Echo/Say", None).await;
    assert_eq!(field(&keyless.headers, "grpc-status"), "16");
    assert!(keyless.head_only);
    let unrouted = unary(&mut h2, "/other.Svc/Call", Some("k1")).await;
    assert_eq!(field(&unrouted.headers, "grpc-status"), "12");
    let down = unary(&mut h2, "/down.Down/Call", None).await;
    assert_eq!(down.status, 200);
    assert_eq!(field(&down.headers, "grpc-status"), "14");
    assert!(down.head_only);

    // A gRPC-Web call over HTTP/1.1: the same head, its length said (0), nothing after it.
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    let web = "POST /echo.Echo/Say HTTP/1.1\r\nHost: grpc.example\r\nx-api-key: k1\r\ncontent-type: application/grpc-web+proto\r\ncontent-length: 5\r\n\r\n\0\0\0\0\0";
    std::io::Write::write_all(&mut tcp, web.as_bytes()).unwrap();
    let mut answer = String::new();
    std::io::Read::read_to_string(&mut tcp, &mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{answer}");
    let lower = head.to_ascii_lowercase();
    for field in [
        "content-type: application/grpc-web+proto",
        "content-length: 0",
        "grpc-status: 8",
    ] {
        assert!(lower.contains(field), "{field}: {answer}");
    }
    assert_eq!(body, "");

    // Not a call: the JSON 429 of every other client.
    let plain = common::client()
        .post(gw.url("/echo.Echo/Say"))
        .header("x-api-key", "k1")
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status(), 429);
    assert_eq!(
        plain.text().await.unwrap(),
        r#"{"detail":"rate limit exceeded"}"#
    );

    wait_until(Duration::from_secs(10), "eight access log lines", || {
        access_lines(&log).len() >= 8
    });
    let lines = access_lines(&log);
    let denied: Vec<_> = lines
        .iter()
        .filter(|l| l["decision_reason"] == "rate_limited")
        .map(|l| (l["status"].clone(), l["grpc_status"].clone()))
        .collect();
    assert_eq!(
        denied,
        [
            (200.into(), 8.into()),
            (200.into(), 8.into()),
            (429.into(), serde_json::Value::Null)
        ]
    );
    let grpc = |endpoint: &str, code: u8| {
        gw.metric(&format!(
            "sentinel_grpc_status_total{{endpoint_id=\"{endpoint}\",grpc_status=\"{code}\"}}"
        ))
    };
    assert_eq!(grpc("grpc.echo", 0), 2.0);
    assert_eq!(grpc("grpc.echo", 8), 2.0);
    assert_eq!(grpc("grpc.echo", 16), 1.0);
    assert_eq!(grpc("grpc.down", 14), 1.0);
    let down_line = lines
        .iter()
        .find(|l| l["path"] == "/down.Down/Call")
        .unwrap();
    assert_eq!(down_line["grpc_status"], 14);
    assert_eq!(down_line["error"], "upstream_failed");
}

/// A TLS acceptor for `echo.internal`, signed by `ca`, offering these ALPN protocols.
fn acceptor(ca: &common::tls::Ca, alpn: &[&[u8]]) -> tokio_rustls::TlsAcceptor {
    let leaf = ca.leaf(&["echo.internal"]);
    let key = PrivateKeyDer::from_pem_slice(leaf.key_pem.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der.clone()], key)
        .unwrap();
    server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsAcceptor::from(Arc::new(server))
}

/// An `http2` upstream over TLS is spoken to by ALPN `h2`: an upstream that offers nothing
/// else answers the call, trailers and all. One that offers only `http/1.1` is spoken to in
/// HTTP/1.1, its connection kept for the next request (ALPN offers both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_upstream_over_tls_is_reached_by_alpn() {
    let redis = Redis::start();
    let ca = common::tls::Ca::new();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ca.pem"), &ca.pem).unwrap();
    let (up, seen) = grpc_upstream(Some(acceptor(&ca, &[b"h2"]))).await;
    let tls = format!(
        "tls = true\nsni = \"echo.internal\"\nca_path = {}\n",
        quoted(&dir.path().join("ca.pem").display().to_string())
    );
    // An HTTP/1.1 server over TLS: counts its connections, answers every request `ok`.
    let h1 = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let h1_port = h1.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (count, only_h1) = (Arc::clone(&accepted), acceptor(&ca, &[b"http/1.1"]));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = h1.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let only_h1 = only_h1.clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let Ok(mut tls) = only_h1.accept(tcp).await else {
                    return;
                };
                let (mut read, mut buf) = (Vec::new(), [0u8; 4096]);
                while let Ok(n @ 1..) = tls.read(&mut buf).await {
                    read.extend_from_slice(&buf[..n]);
                    while let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
                        read.drain(..end + 4);
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if tls.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    let gw = echo_gateway(&redis, up, &tls)
        .section(&format!(
            "[upstreams.plain]\naddrs = [{}]\nhttp2 = true\n{tls}",
            quoted(&format!("127.0.0.1:{h1_port}"))
        ))
        .route(open_echo())
        .route(
            Route::new("plain.get")
                .prefix("/plain")
                .upstream("plain")
                .unlimited(),
        )
        .start();
    let mut h2 = connect(gw.port).await;
    let answer = unary(&mut h2, "/echo.Echo/Say", None).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.body, message(b"hello"));
    let trailers = answer.trailers.expect("the upstream's trailers over TLS");
    assert_eq!(field(&trailers, "grpc-status"), "0");
    assert_eq!(seen.lock().unwrap()[0].uri.scheme_str(), Some("https"));

    let http = common::client();
    for _ in 0..3 {
        let answer = http.get(gw.url("/plain/x")).send().await.unwrap();
        assert_eq!(answer.status(), 200);
        assert_eq!(answer.text().await.unwrap(), "ok");
    }
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// gRPC's health check of an `http2` upstream (`grpc_service`) passes on `SERVING` and fails
/// on `NOT_SERVING`, saying so; a GET health check (`path`) fails on a gRPC error status in a
/// 200 (a gRPC server answering a path it does not serve), where any 2xx passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcs_health_check_says_an_address_serving_or_not() {
    let redis = Redis::start();
    let (up, _) = grpc_upstream(None).await;
    let addr = quoted(&format!("127.0.0.1:{up}"));
    let upstream = |name: &str, check: &str| {
        format!("[upstreams.{name}]\naddrs = [{addr}]\nhttp2 = true\nhealth_check = {{ {check}, interval_ms = 100 }}\n")
    };
    let gw = GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .section(&upstream("serving", r#"grpc_service = "echo.Echo""#))
        .section(&upstream("whole", r#"grpc_service = """#))
        .section(&upstream("sick", r#"grpc_service = "sick.Svc""#))
        .section(&upstream("unserved", r#"path = "/status""#))
        .route(
            Route::new("grpc.echo")
                .prefix("/echo.Echo")
                .upstream("serving")
                .unlimited(),
        )
        .start();
    let healthy = |name: &str| {
        gw.metric(&format!(
            "sentinel_upstream_healthy{{addr=\"127.0.0.1:{up}\",upstream=\"{name}\"}}"
        ))
    };
    wait_until(Duration::from_secs(10), "both failing checks said", || {
        let logs = gw.logs();
        logs.contains("health check answered NOT_SERVING")
            && logs.contains("health check answered grpc-status 12")
    });
    // Three checks in a row to pass (the default healthy_after is 2), a check each 100 ms.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(healthy("serving"), 1.0);
    assert_eq!(healthy("whole"), 1.0);
    assert_eq!(healthy("sick"), 0.0);
    assert_eq!(healthy("unserved"), 0.0);
}

/// A call whose messages outgrow the route's `max_body_bytes` on their way to an HTTP/2
/// upstream ends at once, `RESOURCE_EXHAUSTED` (the gateway's answer before the upstream
/// answered, its trailers after); it waited for the upstream's answer to a body that never
/// ended, until the read timeout (60 s by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_max_body_bytes_is_resource_exhausted_at_once() {
    let redis = Redis::start();
    let (up, _) = grpc_upstream(None).await;
    let gw = echo_gateway(&redis, up, "read_timeout_ms = 30000\n")
        .route(
            Route::new("grpc.small")
                .prefix("/echo.Echo")
                .upstream("echo")
                .unlimited()
                .set("max_body_bytes", "1000"),
        )
        .start();
    let mut h2 = connect(gw.port).await;
    let within = Duration::from_secs(5);
    let (response, mut send) = h2
        .send_request(call_head("/echo.Echo/Collect", None), false)
        .unwrap();
    send.send_data(message(&[b'a'; 900]), false).unwrap();
    send.send_data(message(&[b'b'; 900]), true).unwrap();
    let started = std::time::Instant::now();
    let refused = tokio::time::timeout(within, read_answer(response))
        .await
        .expect("answered at once, not after the read timeout");
    assert_eq!(field(&refused.headers, "grpc-status"), "8", "{refused:?}");
    assert_eq!(
        field(&refused.headers, "grpc-message"),
        "request body too large"
    );
    assert!(started.elapsed() < within);
    // Under the limit: the upstream's answer, as ever.
    let (response, mut send) = h2
        .send_request(call_head("/echo.Echo/Collect", None), false)
        .unwrap();
    send.send_data(message(&[b'a'; 900]), true).unwrap();
    let answer = read_answer(response).await;
    assert_eq!(answer.body, message(b"905"));
}

/// An upstream that falls silent past its `read_timeout_ms` after the call's answer began:
/// the call ends with trailers that say `UNAVAILABLE` (`upstream timeout`), which a client's
/// retry policy can retry, where a reset stream read as the client's own `CANCELLED`; a call
/// the client cancels is logged `CANCELLED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_by_its_upstream_after_its_answer_began_ends_unavailable() {
    let redis = Redis::start();
    let (up, _) = grpc_upstream(None).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let gw = echo_gateway(&redis, up, "read_timeout_ms = 300\n")
        .access_log(&log)
        .route(open_echo())
        .start();
    let mut h2 = connect(gw.port).await;
    let answer = unary(&mut h2, "/echo.Echo/Stall", None).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body, message(b"first"));
    let trailers = answer.trailers.expect("trailers, not a reset stream");
    assert_eq!(field(&trailers, "grpc-status"), "14");
    assert_eq!(field(&trailers, "grpc-message"), "upstream timeout");
    wait_until(Duration::from_secs(10), "its access log line", || {
        !access_lines(&log).is_empty()
    });
    let line = &access_lines(&log)[0];
    assert_eq!(line["status"], 200);
    assert_eq!(line["grpc_status"], 14);
    assert_eq!(line["error"], "upstream_timeout");

    // A call its client cancels mid-answer is logged `CANCELLED`, as gRPC says it.
    let (response, mut send) = h2
        .send_request(call_head("/echo.Echo/Stall", None), false)
        .unwrap();
    send.send_data(message(b"bye"), true).unwrap();
    let head = response.await.unwrap();
    let mut body = head.into_body();
    let _ = body.data().await;
    send.send_reset(h2::Reason::CANCEL);
    wait_until(Duration::from_secs(10), "the cancelled call's line", || {
        access_lines(&log).len() >= 2
    });
    let line = &access_lines(&log)[1];
    assert_eq!(line["grpc_status"], 1, "{line}");
    assert_eq!(line["error"], "client_closed");
}

/// A call's reported cost (`cost_from_response`) is read from the upstream's initial
/// metadata, as an HTTP answer's head, and charged; a cost in its trailers is not read. The
/// header is not shown to the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_reported_cost_is_read_from_its_initial_metadata() {
    let redis = Redis::start();
    let (up, _) = grpc_upstream(None).await;
    let gw = echo_gateway(&redis, up, "")
        .route(
            Route::new("grpc.ocr")
                .prefix("/echo.Echo")
                .upstream("echo")
                .identity_header("x-api-key")
                .token_bucket(10_000_000, 0)
                .set("cost_from_response", r#"{ header = "x-pages" }"#),
        )
        .start();
    let mut h2 = connect(gw.port).await;
    let answer = unary(&mut h2, "/echo.Echo/Pages", Some("k1")).await;
    assert_eq!(answer.body, message(b"done"), "{answer:?}");
    assert!(!answer.headers.contains_key("x-pages"), "{answer:?}");
    // One token to be admitted, four reported: five of ten left (never 100 more).
    wait_until(Duration::from_secs(5), "the charge made", || {
        gw.remaining_of_key("grpc.ocr", "k1") == 5
    });
    assert_eq!(gw.remaining_of_key("grpc.ocr", "k1"), 5);
}
