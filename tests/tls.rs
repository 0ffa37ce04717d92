//! TLS listeners against the real binary: certificates chosen by SNI, ALPN, `min_version`,
//! certificates swapped by a reload while open connections keep theirs, bad files refused by
//! `check` and by a reload, and a limited route over HTTP/2 (TLS and h2c) and HTTP/1.1.

mod common;

use std::path::Path;
use std::time::Duration;

use common::config::{quoted, GatewayConfig, Route};
use common::tls::{Ca, Conn, Leaf};
use common::{check_config, free_port, wait_until, Redis, Upstream};
use serde_json::Value;

const PDFTALK: &str = "api.pdftalk.example";

/// A gateway with one TLS listener: `default` for unknown names, `named` for PDFTALK and
/// every name one label below resumint.example.
fn tls_section(port: u16, default: (&Path, &Path), named: (&Path, &Path), extra: &str) -> String {
    format!(
        "[[server.tls]]\nlisten = {}\ncert_path = {}\nkey_path = {}\n{extra}\n\
         [[server.tls.sni]]\nserver_names = [{}, \"*.resumint.example\"]\ncert_path = {}\nkey_path = {}\n",
        quoted(&format!("127.0.0.1:{port}")),
        quoted(&default.0.display().to_string()),
        quoted(&default.1.display().to_string()),
        quoted(PDFTALK),
        quoted(&named.0.display().to_string()),
        quoted(&named.1.display().to_string()),
    )
}

struct Setup {
    ca: Ca,
    dir: tempfile::TempDir,
    tls_port: u16,
    default: Leaf,
    named: Leaf,
}

impl Setup {
    fn new() -> Setup {
        let ca = Ca::new();
        let dir = tempfile::tempdir().unwrap();
        let default = ca.leaf(&["localhost"]);
        let named = ca.leaf(&[PDFTALK, "*.resumint.example"]);
        default.write(dir.path(), "default");
        named.write(dir.path(), "named");
        Setup {
            ca,
            dir,
            tls_port: free_port(),
            default,
            named,
        }
    }

    fn path(&self, file: &str) -> std::path::PathBuf {
        self.dir.path().join(file)
    }

    fn section(&self, extra: &str) -> String {
        tls_section(
            self.tls_port,
            (&self.path("default.pem"), &self.path("default.key")),
            (&self.path("named.pem"), &self.path("named.key")),
            extra,
        )
    }

    fn config(&self, redis: &Redis, up: &Upstream, extra: &str) -> GatewayConfig {
        GatewayConfig::new(&redis.url())
            .server("h2c", "true")
            .section(&self.section(extra))
            .upstream("app", &[up.addr()])
            .route(
                Route::new("e.api")
                    .prefix("/api")
                    .identity_header("X-API-Key")
                    .token_bucket(3_000_000, 0),
            )
            .route(Route::new("e.open").prefix("/open").unlimited())
    }

    fn conn(&self, sni: &str) -> Result<Conn, String> {
        Conn::open(
            self.ca.client_config(rustls::ALL_VERSIONS),
            self.tls_port,
            sni,
        )
    }
}

#[test]
fn the_sni_name_chooses_the_certificate_and_unknown_names_get_the_default() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let _gw = s.config(&redis, &up, "").start();
    for (name, expected) in [
        ("localhost", &s.default),
        (PDFTALK, &s.named),
        ("API.PDFTALK.example", &s.named),
        ("eu.resumint.example", &s.named),
    ] {
        let conn = s.conn(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(conn.served(), expected.der, "{name}");
        assert_eq!(conn.alpn().as_deref(), Some(&b"h2"[..]), "ALPN offers h2");
    }
    // `*.` is one label: neither the bare name nor two labels below it, and an unknown name
    // gets the default (which the client then refuses: it is not valid for that name).
    for name in ["resumint.example", "a.eu.resumint.example", "other.example"] {
        let err = s
            .conn(name)
            .err()
            .unwrap_or_else(|| panic!("{name} verified"));
        assert!(
            err.contains("NotValidForName") || err.contains("not valid"),
            "{name}: {err}"
        );
    }
    // A client that asks for HTTP/1.1 only gets it.
    let mut config = s.ca.client_config(rustls::ALL_VERSIONS);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let mut conn = Conn::open(config, s.tls_port, PDFTALK).unwrap();
    assert_eq!(conn.alpn().as_deref(), Some(&b"http/1.1"[..]));
    assert_eq!(conn.get(PDFTALK, "/open/x"), 200);
    assert_eq!(conn.get(PDFTALK, "/open/y"), 200, "keep-alive over TLS");
    // One that offers HTTP/1.0 alone (`curl --http1.0`) is served, not refused.
    let mut config = s.ca.client_config(rustls::ALL_VERSIONS);
    config.alpn_protocols = vec![b"http/1.0".to_vec()];
    let mut conn = Conn::open(config, s.tls_port, PDFTALK).unwrap();
    assert_eq!(conn.alpn().as_deref(), Some(&b"http/1.0"[..]));
    assert_eq!(conn.get(PDFTALK, "/open/z"), 200);
}

/// A client resumes its TLS session (one round trip and no signature less) after hundreds of
/// other clients' handshakes: rustls's own store kept 256, under a second of a busy edge's.
#[test]
fn a_tls_session_is_resumed_after_hundreds_of_other_handshakes() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let _gw = s.config(&redis, &up, "").start();
    for version in [&rustls::version::TLS13, &rustls::version::TLS12] {
        let mut config = s.ca.client_config(&[version]);
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        // Clones share the client's session store.
        let mut first = Conn::open(config.clone(), s.tls_port, PDFTALK).unwrap();
        assert_eq!(first.get(PDFTALK, "/open/1"), 200);
        assert!(!first.resumed());
        for _ in 0..300 {
            let mut other = s.ca.client_config(&[version]);
            other.alpn_protocols = vec![b"http/1.1".to_vec()];
            let mut conn = Conn::open(other, s.tls_port, PDFTALK).unwrap();
            assert_eq!(conn.get(PDFTALK, "/open/2"), 200);
        }
        let mut again = Conn::open(config, s.tls_port, PDFTALK).unwrap();
        assert!(again.resumed(), "{version:?}");
        assert_eq!(again.get(PDFTALK, "/open/3"), 200);
    }
}

/// Plain HTTP sent to a TLS listener is answered with the gateway's 400 in plain HTTP, as
/// nginx answers it, and counted; it got a raw TLS alert that no HTTP client can show. A TLS
/// client on the same listener is served as before.
#[test]
fn plain_http_to_a_tls_listener_is_answered_400() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let gw = s.config(&redis, &up, "").start();
    let answer = {
        use std::io::{Read, Write};
        let mut tcp = std::net::TcpStream::connect(("127.0.0.1", s.tls_port)).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        tcp.write_all(b"GET /open HTTP/1.1\r\nHost: a\r\n\r\n")
            .unwrap();
        let mut answer = Vec::new();
        let _ = tcp.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    };
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer:?}");
    assert!(answer.contains("\r\nx-request-id: "), "{answer}");
    assert!(answer.ends_with(r#"{"detail":"bad request"}"#), "{answer}");
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="_unmatched",status="400"}"#),
        1.0
    );
    assert_eq!(s.conn("localhost").unwrap().served(), s.default.der);
}

/// An address sent as the SNI name (RFC 6066 forbids it; wrk and some other clients send it)
/// is the client's doing: the handshake goes on with the default certificate and nothing is
/// logged above DEBUG.
#[test]
fn an_address_sent_as_the_sni_name_is_answered_and_logs_no_warning() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let gw = s.config(&redis, &up, "").start();
    // rustls never sends an address as SNI: its hello for a name as long as "127.0.0.1",
    // with the name swapped.
    let config = std::sync::Arc::new(s.ca.client_config(rustls::ALL_VERSIONS));
    let name = rustls::pki_types::ServerName::try_from("sni-probe").unwrap();
    let mut client = rustls::ClientConnection::new(config, name).unwrap();
    let mut hello = Vec::new();
    client.write_tls(&mut hello).unwrap();
    let at = hello
        .windows(9)
        .position(|w| w == b"sni-probe")
        .expect("the name in the hello");
    hello[at..at + 9].copy_from_slice(b"127.0.0.1");
    let mut tcp = std::net::TcpStream::connect(("127.0.0.1", s.tls_port)).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    std::io::Write::write_all(&mut tcp, &hello).unwrap();
    let mut record = [0u8; 5];
    std::io::Read::read_exact(&mut tcp, &mut record).unwrap();
    assert_eq!(
        record[0], 22,
        "a handshake record (the server's hello), not an alert"
    );
    drop(tcp);
    // rustls read the hello (and would have logged) before it answered.
    let logs = gw.logs();
    let loud: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains(r#""level":"WARN""#) || l.contains(r#""level":"ERROR""#))
        .collect();
    assert!(loud.is_empty(), "{loud:#?}");
}

/// A certificate's expiry is labelled with its `cert_path` as the config writes it, here
/// relative to the config file: the series is the same however the file was named at start
/// (it was the path the file was read from, the config's directory before it).
#[test]
fn a_certificates_expiry_is_labelled_as_the_config_writes_its_path() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let [port, admin] = common::free_ports();
    let relative = tls_section(
        s.tls_port,
        (Path::new("default.pem"), Path::new("default.key")),
        (Path::new("named.pem"), Path::new("named.key")),
        "",
    );
    let text = GatewayConfig::new(&redis.url())
        .section(&relative)
        .upstream("app", &[up.addr()])
        .route(Route::new("e.open").prefix("/open").unlimited())
        .render(port, admin);
    let path = s.path("gateway.toml");
    std::fs::write(&path, text).unwrap();
    let _gw = common::Proc::gateway(&path, None);
    let metrics = || common::blocking_get(&format!("http://127.0.0.1:{admin}/metrics"));
    wait_until(Duration::from_secs(20), "ready", || {
        metrics().is_some_and(|(status, _)| status == 200)
    });
    let (_, body) = metrics().unwrap();
    for file in ["default.pem", "named.pem"] {
        let series = format!("sentinel_tls_cert_expiry_timestamp_seconds{{cert_path=\"{file}\"}}");
        assert!(body.contains(&series), "{series}: {body}");
    }
}

#[test]
fn min_version_1_3_refuses_a_tls_1_2_client() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let _gw = s.config(&redis, &up, "min_version = \"1.3\"").start();
    let only_12 = s.ca.client_config(&[&rustls::version::TLS12]);
    assert!(Conn::open(only_12, s.tls_port, PDFTALK).is_err());
    let conn = s.conn(PDFTALK).unwrap();
    assert_eq!(conn.version(), Some(rustls::ProtocolVersion::TLSv1_3));

    // Without min_version, TLS 1.2 is accepted.
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let _gw = s.config(&redis, &up, "").start();
    let only_12 = s.ca.client_config(&[&rustls::version::TLS12]);
    let conn = Conn::open(only_12, s.tls_port, PDFTALK).unwrap();
    assert_eq!(conn.version(), Some(rustls::ProtocolVersion::TLSv1_2));
}

/// What `check` says of `config` (written beside the setup's files), which it passes.
fn passes_check(s: &Setup, config: &GatewayConfig) -> String {
    let path = s.path("check.toml");
    std::fs::write(&path, config.render(free_port(), free_port())).unwrap();
    let out = check_config(&path, &[]);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    text
}

/// When a certificate's validity ends, in Unix seconds.
fn not_after(der: &[u8]) -> f64 {
    x509_parser::parse_x509_certificate(der)
        .unwrap()
        .1
        .validity()
        .not_after
        .timestamp() as f64
}

#[test]
fn a_reload_serves_new_certificates_to_new_handshakes_and_open_connections_keep_theirs() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let gw = s.config(&redis, &up, "").start();
    let mut config = s.ca.client_config(rustls::ALL_VERSIONS);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let mut open = Conn::open(config, s.tls_port, PDFTALK).unwrap();
    assert_eq!(open.get(PDFTALK, "/open/1"), 200);

    // When each served certificate's validity ends, by file: from the start, and after the
    // reload the renewed one's.
    let expiry = |stem: &str| {
        gw.metric(&format!(
            "sentinel_tls_cert_expiry_timestamp_seconds{{cert_path=\"{}\"}}",
            s.path(&format!("{stem}.pem")).display()
        ))
    };
    assert_eq!(expiry("named"), not_after(&s.named.der));
    assert_eq!(expiry("default"), not_after(&s.default.der));

    let renewed =
        s.ca.leaf_until(&[PDFTALK, "*.resumint.example"], Some(2040));
    renewed.write(s.dir.path(), "named");
    assert_eq!(gw.reload(), 200, "{}", gw.logs());
    assert_eq!(expiry("named"), not_after(&renewed.der));
    assert_ne!(expiry("named"), not_after(&s.named.der));
    assert_eq!(
        s.conn(PDFTALK).unwrap().served(),
        renewed.der,
        "new handshake"
    );
    assert_eq!(s.conn("localhost").unwrap().served(), s.default.der);
    assert_eq!(
        open.get(PDFTALK, "/open/2"),
        200,
        "the open connection goes on"
    );
    assert_eq!(
        open.served(),
        s.named.der,
        "with the certificate it negotiated"
    );

    // A key that is not a key: the reload fails and the renewed certificate keeps serving.
    std::fs::write(
        s.path("named.key"),
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    )
    .unwrap();
    assert_eq!(gw.reload(), 400, "{}", gw.logs());
    assert_eq!(s.conn(PDFTALK).unwrap().served(), renewed.der);
    let out = check_config(&gw.config_path, &[]);
    let stdout =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stdout.contains("server.tls[0].sni[0].key_path"), "{stdout}");
    assert!(stdout.contains("named.key"), "{stdout}");

    // The key of another certificate: refused too, naming the pair.
    let other = s.ca.leaf(&["x.example"]);
    std::fs::write(s.path("named.key"), &other.key_pem).unwrap();
    assert_eq!(gw.reload(), 400);
    let out = check_config(&gw.config_path, &[]);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("does not belong to the certificate"),
        "{text}"
    );
    assert_eq!(s.conn(PDFTALK).unwrap().served(), renewed.der);

    // The listener removed: taken, but only a restart closes it, so it serves the renewed
    // certificate still, and the metric keeps watching what is served.
    std::fs::write(s.path("named.key"), &renewed.key_pem).unwrap();
    let without_tls = GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .upstream("app", &[up.addr()])
        .route(Route::new("e.open").prefix("/open").unlimited());
    gw.rewrite_config(&without_tls.render(gw.port, gw.admin_port));
    let (status, body) = gw.reload_answer();
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(r#""restart_required":["server.tls"]"#),
        "{body}"
    );
    assert_eq!(s.conn(PDFTALK).unwrap().served(), renewed.der);
    assert_eq!(expiry("named"), not_after(&renewed.der));
    assert_eq!(expiry("default"), not_after(&s.default.der));
}

#[test]
fn watch_config_reloads_when_a_certificate_file_changes() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let _gw = s
        .config(&redis, &up, "")
        .server("watch_config", "true")
        .start();
    let renewed = s.ca.leaf(&["localhost"]);
    renewed.write(s.dir.path(), "default");
    wait_until(
        Duration::from_secs(10),
        "the renewed default certificate",
        || s.conn("localhost").is_ok_and(|c| c.served() == renewed.der),
    );
}

#[test]
fn check_refuses_missing_and_mismatched_files_naming_file_and_field() {
    let s = Setup::new();
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, tls: &str| {
        let path = dir.path().join(name);
        let config = format!(
            "[server]\nlisten = \"127.0.0.1:{}\"\n[redis]\nurl = \"redis://127.0.0.1:1\"\n{tls}",
            free_port()
        );
        std::fs::write(&path, config).unwrap();
        path
    };
    let output = |path: &Path| {
        let out = check_config(path, &[]);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let ok = write("ok.toml", &s.section(""));
    assert!(output(&ok).0, "{}", output(&ok).1);

    let missing = write(
        "missing.toml",
        &tls_section(
            s.tls_port,
            (&s.path("nope.pem"), &s.path("default.key")),
            (&s.path("named.pem"), &s.path("named.key")),
            "",
        ),
    );
    let (success, text) = output(&missing);
    assert!(!success);
    assert!(text.contains("missing.toml:"), "{text}");
    assert!(
        text.contains("server.tls[0].cert_path") && text.contains("nope.pem"),
        "{text}"
    );

    let swapped = write(
        "swapped.toml",
        &tls_section(
            s.tls_port,
            (&s.path("default.pem"), &s.path("named.key")),
            (&s.path("named.pem"), &s.path("named.key")),
            "",
        ),
    );
    let (success, text) = output(&swapped);
    assert!(!success);
    assert!(
        text.contains("server.tls[0].key_path") && text.contains("does not belong"),
        "{text}"
    );

    let bad_version = write("v.toml", &s.section("min_version = \"1.1\""));
    let (success, text) = output(&bad_version);
    assert!(
        !success && text.contains("server.tls[0].min_version"),
        "{text}"
    );
}

/// A certificate out of its validity is served with a warning, not refused: a gateway that
/// did not start (or reload) with it would take down every client, the plain listeners' and
/// the other certificates' included, where only the clients that check it are refused.
#[test]
fn an_expired_certificate_is_served_with_a_warning_not_refused() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let expired = s.ca.leaf_until(&["localhost"], Some(2020));
    expired.write(s.dir.path(), "default");
    let config = s.config(&redis, &up, "");
    let text = passes_check(&s, &config);
    assert!(
        text.contains("server.tls[0].cert_path") && text.contains("expired on"),
        "{text}"
    );
    let gw = config.start();
    let refused = s
        .conn("localhost")
        .err()
        .expect("an expired certificate verified");
    assert!(refused.contains("expired"), "{refused}");
    let mut config = s.ca.client_config(rustls::ALL_VERSIONS);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let mut named = Conn::open(config, s.tls_port, PDFTALK).expect("the other certificate");
    assert_eq!(named.served(), s.named.der);
    assert_eq!(named.get(PDFTALK, "/open/x"), 200);
    let logs = gw.logs();
    assert!(
        logs.lines()
            .any(|l| l.contains("\"level\":\"ERROR\"") && l.contains("expired on")),
        "the start says it at ERROR (a certificate's fault, section 8): {logs}"
    );
}

/// `strict_transport_security` is sent on every answer over TLS, the upstream's and the
/// gateway's own (a 401), over HTTP/1.1 and HTTP/2, and never over plain HTTP, where
/// browsers ignore it (RFC 6797, 7.2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_transport_security_is_sent_over_tls_only() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let hsts = "max-age=31536000; includeSubDomains";
    let gw = s
        .config(&redis, &up, "")
        .server("strict_transport_security", quoted(hsts))
        .start();
    let tls_url = |path: &str| format!("https://{PDFTALK}:{}{path}", s.tls_port);
    for http1_only in [false, true] {
        let client = s.ca.http_client(s.tls_port, &[PDFTALK], http1_only);
        for (path, status) in [("/open/x", 200), ("/api/x", 401)] {
            let r = client.get(tls_url(path)).send().await.unwrap();
            assert_eq!(r.status(), status, "{path}");
            assert_eq!(r.headers()["strict-transport-security"], hsts, "{path}");
        }
    }
    let r = common::client()
        .get(gw.url("/open/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("strict-transport-security").is_none());
    // The 400 written before any request is made of a head (two `Host` fields).
    let mut config = s.ca.client_config(rustls::ALL_VERSIONS);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let mut conn = Conn::open(config, s.tls_port, PDFTALK).unwrap();
    let answer = conn.raw(b"GET /open/x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(
        answer.contains(&format!("\r\nstrict-transport-security: {hsts}\r\n")),
        "{answer}"
    );
}

/// The chain a listener sends is as valid as its certificate that ends first: an intermediate
/// sent with the server's certificate that ends before it is when clients refuse the chain,
/// so the expiry metric (what `SentinelTlsCertExpiresSoon` reads) says its end, and one out
/// of date is warned of and logged as an expired server certificate is.
#[test]
fn an_intermediate_that_ends_first_ends_the_chain() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    // The chain's second certificate stands for an intermediate: only its dates are read.
    let chain = |second: &common::tls::Leaf| {
        let leaf = s.ca.leaf_until(&["localhost"], None);
        std::fs::write(
            s.path("default.pem"),
            format!("{}{}", leaf.cert_pem, second.cert_pem),
        )
        .unwrap();
        std::fs::write(s.path("default.key"), &leaf.key_pem).unwrap();
    };
    let soon = s.ca.leaf_until(&["Intermediate CA"], Some(2030));
    chain(&soon);
    let config = s.config(&redis, &up, "");
    let gw = config.start();
    let series = format!(
        "sentinel_tls_cert_expiry_timestamp_seconds{{cert_path=\"{}\"}}",
        s.path("default.pem").display()
    );
    assert_eq!(gw.metric(&series), not_after(&soon.der));
    drop(gw);
    let expired = s.ca.leaf_until(&["Intermediate CA"], Some(2020));
    chain(&expired);
    let text = passes_check(&s, &config);
    assert!(
        text.contains("server.tls[0].cert_path")
            && text.contains(
                "holds, after the server's certificate, one (CN=Intermediate CA) that expired on"
            ),
        "{text}"
    );
}

/// Several `[[server.tls]]` listeners, each with its own certificates: each serves the routes,
/// and chooses its certificate by its own names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tls_listeners_each_serve_with_their_own_certificates() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let second = free_port();
    // The second listener serves `named` to every client (no SNI table of its own).
    let extra = format!(
        "[[server.tls]]\nlisten = {}\ncert_path = {}\nkey_path = {}\n",
        quoted(&format!("127.0.0.1:{second}")),
        quoted(&s.path("named.pem").display().to_string()),
        quoted(&s.path("named.key").display().to_string()),
    );
    let gw = s.config(&redis, &up, "").section(&extra).start();
    for port in [s.tls_port, second] {
        let client = s.ca.http_client(port, &[PDFTALK], false);
        let r = client
            .get(format!("https://{PDFTALK}:{port}/open/x"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("{port}: {e:?}\n{}", gw.logs()));
        assert_eq!(r.status(), 200, "{port}");
        assert_eq!(r.version(), reqwest::Version::HTTP_2, "{port}");
    }
    // `localhost` is the first listener's default certificate's name, not the second's.
    for (port, ok) in [(s.tls_port, true), (second, false)] {
        let client = s.ca.http_client(port, &["localhost"], false);
        let r = client
            .get(format!("https://localhost:{port}/open/x"))
            .send()
            .await;
        assert_eq!(r.is_ok(), ok, "{port}: {r:?}");
    }
    // The start line names both TLS listeners, in a field of their own: `tls` is the access
    // log's boolean on the same stdout.
    let start = gw
        .logs()
        .lines()
        .find(|l| l.contains(r#""message":"gateway starting""#))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .expect("the start line");
    let tls = start["tls_listen"].as_str().expect("tls_listen");
    for port in [s.tls_port, second] {
        assert!(tls.contains(&format!("127.0.0.1:{port}")), "{start}");
    }
    assert!(start.get("tls").is_none(), "{start}");
}

/// The same limited route over HTTP/1.1 and HTTP/2 on TLS, and over h2c: the exact
/// sequence of 200s and 429s, the forwarded headers the upstream sees, and the access log's
/// `tls` and `protocol` of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_route_answers_the_same_over_http1_http2_tls_and_h2c() {
    let (redis, up, s) = (Redis::start(), Upstream::start("app"), Setup::new());
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let gw = s.config(&redis, &up, "").access_log(&log).start();
    let h2 = s.ca.http_client(s.tls_port, &[PDFTALK], false);
    let h1 = s.ca.http_client(s.tls_port, &[PDFTALK], true);
    let h2c = common::h2c_client();
    let tls_url = |path: &str| format!("https://{PDFTALK}:{}{path}", s.tls_port);
    for (client, url, version, key) in [
        (&h2, tls_url("/api/x"), reqwest::Version::HTTP_2, "k-h2"),
        (&h1, tls_url("/api/x"), reqwest::Version::HTTP_11, "k-h1"),
        (&h2c, gw.url("/api/x"), reqwest::Version::HTTP_2, "k-h2c"),
    ] {
        let mut statuses = Vec::new();
        for _ in 0..5 {
            let r = client
                .get(&url)
                .header("X-API-Key", key)
                .send()
                .await
                .unwrap();
            assert_eq!(r.version(), version, "{url}");
            statuses.push(r.status().as_u16());
            if r.status() == 429 {
                assert!(r.headers().contains_key("retry-after"));
                assert!(r.headers().contains_key("x-request-id"));
            }
        }
        assert_eq!(statuses, [200, 200, 200, 429, 429], "{url} {version:?}");
    }
    let r = h2
        .get(tls_url("/open/echo"))
        .header("X-Forwarded-Proto", "http")
        .send()
        .await
        .unwrap();
    let echo: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    let headers = &echo["headers"];
    assert_eq!(headers["x-forwarded-proto"], "https", "{echo}");
    assert_eq!(
        headers["x-forwarded-host"],
        format!("{PDFTALK}:{}", s.tls_port),
        "the authority of an h2 request is its host"
    );
    assert_eq!(headers["x-forwarded-for"], "127.0.0.1");
    // 5 requests over each, then the echo: each line says how it came.
    let mut lines = Vec::new();
    common::wait_until(Duration::from_secs(5), "sixteen lines", || {
        lines = common::access_lines(&log);
        lines.len() == 16
    });
    let how = |line: &Value| (line["tls"].clone(), line["protocol"].clone());
    for (range, tls, protocol) in [
        (0..5, true, "HTTP/2"),
        (5..10, true, "HTTP/1.1"),
        (10..15, false, "HTTP/2"),
        (15..16, true, "HTTP/2"),
    ] {
        for line in &lines[range] {
            assert_eq!(how(line), (tls.into(), protocol.into()), "{line}");
        }
    }
}
