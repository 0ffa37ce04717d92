//! HTTPS to upstreams, against the binary: the upstream here is a second gateway with a TLS
//! listener (its certificate from a test CA) in front of the demo backend. The certificate is
//! checked against `ca_path` and the `sni` name; a failed handshake is 502 with the reason in
//! the log; `verify = false` skips the check, with a WARN.

mod common;

use common::config::{quoted, GatewayConfig, Route};
use common::tls::Ca;
use common::{client, free_port, Gateway, Redis, Upstream};
use serde_json::Value;
use std::path::PathBuf;

/// A TLS front for the demo backend, its certificate for `localhost` from a new test CA whose
/// own certificate is written to `ca.pem` in `dir`: the front, its TLS port and that file.
fn tls_front(redis: &Redis, up: &Upstream, dir: &std::path::Path) -> (Gateway, u16, PathBuf) {
    let ca = Ca::new();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    let (cert, key) = ca.leaf(&["localhost"]).write(dir, "front");
    let tls_port = free_port();
    let gw = GatewayConfig::new(&redis.url())
        .section(&format!(
            "[[server.tls]]\nlisten = \"127.0.0.1:{tls_port}\"\ncert_path = {}\nkey_path = {}\n",
            quoted(&cert.display().to_string()),
            quoted(&key.display().to_string())
        ))
        .upstream("app", &[up.addr()])
        .route(Route::new("front").prefix("/").unlimited())
        .start();
    (gw, tls_port, ca_file)
}

fn edge(redis: &Redis, front_port: u16, tls_fields: &str) -> Gateway {
    GatewayConfig::new(&redis.url())
        .section(&format!(
            "[upstreams.secure]\naddrs = [\"127.0.0.1:{front_port}\"]\ntls = true\n{tls_fields}\n"
        ))
        .route(
            Route::new("edge")
                .prefix("/")
                .unlimited()
                .upstream("secure"),
        )
        .start()
}

async fn get(gw: &Gateway) -> (u16, String) {
    let r = client().get(gw.url("/x")).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_over_tls_is_verified_against_ca_path_and_the_sni_name() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let dir = tempfile::tempdir().unwrap();
    let (_front, front_port, ca_file) = tls_front(&redis, &up, dir.path());
    let ca_field = format!("ca_path = {}", quoted(&ca_file.display().to_string()));

    // Trusted CA and the right name: through, and the front saw TLS.
    let good = edge(
        &redis,
        front_port,
        &format!("{ca_field}\nsni = \"localhost\""),
    );
    let (status, body) = get(&good).await;
    assert_eq!(status, 200, "{body}\n{}", good.logs());
    let echo: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(echo["upstream"], "app");

    // The system roots do not know the test CA: 502, the reason in the log.
    let untrusted = edge(&redis, front_port, "sni = \"localhost\"");
    let (status, body) = get(&untrusted).await;
    assert_eq!(status, 502);
    assert_eq!(body, "{\"detail\":\"upstream unavailable\"}");
    common::wait_until(std::time::Duration::from_secs(3), "the reason", || {
        untrusted.logs().contains("upstream failed")
    });
    let logs = untrusted.logs();
    let failed = (logs.lines())
        .find(|l| l.contains("upstream failed"))
        .unwrap();
    assert!(failed.contains("UnknownIssuer"), "the reason: {failed}");

    // Without `sni`, the name is the address's host: `localhost` is the certificate's name,
    // an IP address is not.
    let by_name = GatewayConfig::new(&redis.url())
        .section(&format!(
            "[upstreams.secure]\naddrs = [\"localhost:{front_port}\"]\ntls = true\n{ca_field}\n"
        ))
        .route(
            Route::new("edge")
                .prefix("/")
                .unlimited()
                .upstream("secure"),
        )
        .start();
    let (status, body) = get(&by_name).await;
    assert_eq!(status, 200, "{body}\n{}", by_name.logs());
    let by_address = edge(&redis, front_port, &ca_field);
    assert_eq!(get(&by_address).await.0, 502);

    // The right CA, a name the certificate does not carry: 502.
    let wrong_name = edge(
        &redis,
        front_port,
        &format!("{ca_field}\nsni = \"other.example\""),
    );
    assert_eq!(get(&wrong_name).await.0, 502);

    // verify = false: through, whatever the certificate, with a WARN at start.
    let unchecked = edge(
        &redis,
        front_port,
        "sni = \"other.example\"\nverify = false",
    );
    assert_eq!(get(&unchecked).await.0, 200);
    let warnings = |gw: &common::Gateway| gw.logs().matches("verify = false:").count();
    assert_eq!(warnings(&unchecked), 1, "{}", unchecked.logs());
    // And on every reload, the upstream changed or not.
    assert_eq!(unchecked.reload(), 200);
    common::wait_until(std::time::Duration::from_secs(5), "the WARN again", || {
        warnings(&unchecked) == 2
    });
}

#[test]
fn check_takes_tls_fields_without_tls_as_inert_and_refuses_a_bad_ca_file() {
    let dir = tempfile::tempdir().unwrap();
    let run = |upstream: &str| {
        common::check_body(
            dir.path(),
            &format!("[redis]\nurl = \"redis://127.0.0.1:1\"\n[upstreams.u]\naddrs = [\"127.0.0.1:1\"]\n{upstream}\n"),
            &[],
        )
    };
    // The contract's own example writes them beside `tls = false`: they do nothing (the
    // start logs them at WARN), and `ca_path` is not read.
    let (ok, out) =
        run("tls = false\nsni = \"a.example\"\nca_path = \"missing.pem\"\nverify = true");
    assert!(ok, "{out}");
    // The warning points at the first field that does nothing (line 8 of the file, `sni`), not at the
    // upstream's header; `verify = false` beside `tls = true` at itself.
    assert!(
        out.contains(":8:7: upstreams.u has TLS fields without tls = true (sni, ca_path)"),
        "{out}"
    );
    let (ok, out) = run("tls = true\nverify = false");
    assert!(
        ok && out.contains(":8:10: upstreams.u.verify = false:"),
        "{out}"
    );
    let (ok, out) = run("tls = true\nca_path = \"missing.pem\"");
    assert!(
        !ok && out.contains("upstreams.u.ca_path = \"missing.pem\" cannot be read"),
        "{out}"
    );
    let (ok, out) = run("tls = true\nsni = \"a.example\"");
    assert!(ok, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_fields_beside_tls_false_do_nothing_but_a_warn_at_start() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = GatewayConfig::new(&redis.url())
        .section(&format!(
            "[upstreams.plain]\naddrs = [\"{}\"]\ntls = false\nsni = \"a.example\"\nca_path = \"missing.pem\"\nverify = true\n",
            up.addr()
        ))
        .route(Route::new("edge").prefix("/").unlimited().upstream("plain"))
        .start();
    // Plain HTTP to the demo backend, which speaks no TLS.
    let (status, body) = get(&gw).await;
    assert_eq!(status, 200, "{body}");
    let warn = gw
        .logs()
        .lines()
        .find(|l| l.contains("has TLS fields without tls = true"))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no WARN for the inert fields:\n{}", gw.logs()));
    assert!(warn.contains(r#""level":"WARN""#), "{warn}");
    assert!(warn.contains(r#""upstream":"plain""#), "{warn}");
    // `verify = true` is the default, so only the two that would change something are named.
    assert!(
        warn.contains(r#""fields":"[\"sni\", \"ca_path\"]""#),
        "{warn}"
    );
}

/// A pooled upstream connection was checked against one set of roots: it never serves a peer
/// that trusts another, neither another upstream at the same address and name nor the same
/// upstream after a reload rotated its CA (section 11: the certificate is verified against
/// `ca_path` or the system roots).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_verified_against_one_ca_never_serves_an_upstream_that_trusts_another() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let dir = tempfile::tempdir().unwrap();
    let (_front, front_port, ca_file) = tls_front(&redis, &up, dir.path());
    let gw = GatewayConfig::new(&redis.url())
        .section(&format!(
            "[upstreams.trusted]\naddrs = [\"127.0.0.1:{front_port}\"]\ntls = true\nsni = \"localhost\"\nca_path = {}\n\
             [upstreams.roots]\naddrs = [\"127.0.0.1:{front_port}\"]\ntls = true\nsni = \"localhost\"\n",
            quoted(&ca_file.display().to_string())
        ))
        .route(Route::new("trusted").prefix("/trusted").unlimited().upstream("trusted"))
        .route(Route::new("roots").prefix("/roots").unlimited().upstream("roots"))
        .start();
    let status = |path: &'static str| {
        let url = gw.url(path);
        async move { client().get(url).send().await.unwrap().status().as_u16() }
    };
    for _ in 0..3 {
        assert_eq!(status("/trusted/x").await, 200, "{}", gw.logs());
        // The connection just verified against the test CA is idle in the pool: the
        // system's roots do not know that CA.
        assert_eq!(status("/roots/x").await, 502, "{}", gw.logs());
    }

    // The CA file now holds another CA: after the reload, the front's certificate is not
    // trusted any more, pooled connections or not.
    std::fs::write(&ca_file, &Ca::new().pem).unwrap();
    assert_eq!(gw.reload(), 200, "{}", gw.logs());
    for _ in 0..3 {
        assert_eq!(status("/trusted/x").await, 502, "{}", gw.logs());
    }
}
