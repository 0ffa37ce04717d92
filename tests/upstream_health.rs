//! Active health checks of upstream addresses, against the binary and real demo backends: a
//! dead address leaves the rotation after `unhealthy_after` failed checks and comes back
//! after `healthy_after` passes, `sentinel_upstream_healthy` says which, and when every
//! address is down all are tried anyway.

mod common;

use std::time::Duration;

use common::config::{GatewayConfig, Route};
use common::{client, wait_until, Gateway, Redis, Upstream};

fn healthy(gw: &Gateway, up: &Upstream) -> f64 {
    gw.metric(&format!(
        "sentinel_upstream_healthy{{addr=\"127.0.0.1:{}\",upstream=\"app\"}}",
        up.port
    ))
}

async fn served_by(gw: &Gateway, n: usize) -> Vec<String> {
    let http = client();
    let mut out = Vec::new();
    for _ in 0..n {
        let r = http.get(gw.url("/x")).send().await.unwrap();
        out.push(match r.status().as_u16() {
            200 => r.headers()["x-upstream"].to_str().unwrap().to_owned(),
            other => other.to_string(),
        });
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_address_leaves_the_rotation_and_comes_back() {
    let redis = Redis::start();
    let a = Upstream::start("a");
    let b = Upstream::start("b");
    let b_port = b.port;
    let gw = GatewayConfig::new(&redis.url())
        .section(&format!(
            "[upstreams.app]\naddrs = [\"{}\", \"{}\"]\nhealth_check = {{ path = \"/healthz\", interval_ms = 200, timeout_ms = 200, unhealthy_after = 2, healthy_after = 2 }}\n",
            a.addr(),
            b.addr()
        ))
        .route(Route::new("all").prefix("/").unlimited())
        .start();
    wait_until(Duration::from_secs(5), "both healthy", || {
        healthy(&gw, &a) == 1.0 && healthy(&gw, &b) == 1.0
    });
    let both = served_by(&gw, 6).await;
    assert!(
        both.contains(&"a".to_owned()) && both.contains(&"b".to_owned()),
        "{both:?}"
    );

    drop(b);
    wait_until(Duration::from_secs(5), "b unhealthy", || {
        healthy(&gw, &a) == 1.0 && healthy_port(&gw, b_port) == 0.0
    });
    assert_eq!(
        served_by(&gw, 10).await,
        vec!["a"; 10],
        "only the healthy address"
    );
    // The change is logged once, naming the upstream and the address.
    let b_addr = format!("upstreams.app address 127.0.0.1:{b_port} becomes unhealthy");
    assert_eq!(gw.logs().matches(&b_addr).count(), 1, "{}", gw.logs());

    let b = Upstream::start_on(b_port, "b");
    wait_until(Duration::from_secs(5), "b healthy again", || {
        healthy(&gw, &b) == 1.0
    });
    let again = served_by(&gw, 6).await;
    assert!(again.contains(&"b".to_owned()), "{again:?}");
    let b_back = format!("upstreams.app address 127.0.0.1:{b_port} becomes healthy");
    assert_eq!(gw.logs().matches(&b_back).count(), 1, "{}", gw.logs());

    // Every address down: all are tried anyway (and fail), logged once.
    drop((a, b));
    wait_until(Duration::from_secs(5), "all unhealthy", || all_down(&gw));
    let down = served_by(&gw, 3).await;
    assert_eq!(down, vec!["502"; 3]);
    assert_eq!(
        gw.logs()
            .matches("every address of the upstream is unhealthy")
            .count(),
        1
    );
}

/// A check fails on a non-2xx answer and on a timeout, not only on a refused connection: an
/// address whose health path answers 503, or answers past `timeout_ms`, leaves the rotation
/// while it still serves requests; and when every address is unhealthy, all are tried
/// anyway, so requests are still served (200) by the address the checks call unhealthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_whose_check_answers_non_2xx_or_late_is_unhealthy_and_still_tried() {
    for (path, timeout_ms) in [("/status/503", 200), ("/slow?ms=2000", 200)] {
        let redis = Redis::start();
        let up = Upstream::start("a");
        let gw = GatewayConfig::new(&redis.url())
            .section(&format!(
                "[upstreams.app]\naddrs = [\"{}\"]\nhealth_check = {{ path = \"{path}\", interval_ms = 200, timeout_ms = {timeout_ms}, unhealthy_after = 2, healthy_after = 2 }}\n",
                up.addr()
            ))
            .route(Route::new("e.open").prefix("/").unlimited())
            .start();
        // (The series is there once checked: a missing one reads 0 too.)
        wait_until(Duration::from_secs(10), "unhealthy", || all_down(&gw));
        let served = served_by(&gw, 3).await;
        assert_eq!(served, vec!["a"; 3], "{path}");
        assert_eq!(
            gw.logs()
                .matches("every address of the upstream is unhealthy")
                .count(),
            1,
            "{path}: {}",
            gw.logs()
        );
    }
}

fn healthy_port(gw: &Gateway, port: u16) -> f64 {
    gw.metric(&format!(
        "sentinel_upstream_healthy{{addr=\"127.0.0.1:{port}\",upstream=\"app\"}}"
    ))
}

fn all_down(gw: &Gateway) -> bool {
    let (_, body) = common::blocking_get(&gw.admin("/metrics")).unwrap();
    let lines: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("sentinel_upstream_healthy{"))
        .collect();
    !lines.is_empty() && lines.iter().all(|l| l.ends_with(" 0"))
}

/// Without health checks, a dead address stays in rotation and a failed connect tries the
/// next one: with three addresses, two of them refusing, every request of 8 concurrent
/// clients is answered by the live one, however the other requests move the rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_connect_tries_every_other_address_under_concurrency() {
    let redis = Redis::start();
    let live = Upstream::start("live");
    let [dead1, dead2] = common::free_ports();
    let gw = GatewayConfig::new(&redis.url())
        .section(&format!(
            "[upstreams.app]\naddrs = [\"127.0.0.1:{dead1}\", \"{}\", \"127.0.0.1:{dead2}\"]\n",
            live.addr()
        ))
        .route(Route::new("all").prefix("/").unlimited())
        .start();
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let url = gw.url("/x");
            tokio::spawn(async move {
                let http = client();
                let mut statuses = Vec::new();
                for _ in 0..25 {
                    let r = http.get(&url).send().await.unwrap();
                    statuses.push(r.status().as_u16());
                }
                statuses
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.extend(t.await.unwrap());
    }
    let failed = statuses.iter().filter(|s| **s != 200).count();
    assert_eq!(failed, 0, "{failed} of {} not served", statuses.len());
}

/// A name that does not resolve when the gateway starts is an outage, not a mistake in the
/// file (as a Redis that does not answer): `check` warns and passes, the gateway starts and
/// answers that upstream's requests 502 while the other upstreams serve, and a reload is
/// not refused for it. Each 502's access-log line names the upstream (no address tried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_does_not_resolve_at_start_is_a_502_not_a_config_error() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let logs_dir = tempfile::tempdir().unwrap();
    let log = logs_dir.path().join("access.log");
    // `.invalid` never resolves (RFC 6761).
    let config = GatewayConfig::new(&redis.url())
        .access_log(&log)
        .upstream("gone", &["backend.invalid:8080"])
        .upstream("app", &[up.addr()])
        .route(
            Route::new("away")
                .prefix("/away")
                .upstream("gone")
                .unlimited(),
        )
        .route(
            Route::new("here")
                .prefix("/here")
                .upstream("app")
                .unlimited(),
        );
    let dir = tempfile::tempdir().unwrap();
    let (ok, out) = common::check_body(dir.path(), &config.body(), &[]);
    assert!(ok, "{out}");
    assert!(
        out.contains("upstreams.gone.addrs entry \"backend.invalid:8080\" does not resolve now"),
        "{out}"
    );
    let gw = config.start();
    let http = client();
    let away = http.get(gw.url("/away/x")).send().await.unwrap();
    assert_eq!(away.status(), 502);
    assert_eq!(
        away.text().await.unwrap(),
        r#"{"detail":"upstream unavailable"}"#
    );
    assert_eq!(
        http.get(gw.url("/here/x")).send().await.unwrap().status(),
        200
    );
    // Said once (beside each request's own WARN line, as for any upstream failure), and
    // never at ERROR: no fault of the gateway's.
    for _ in 0..3 {
        assert_eq!(
            http.get(gw.url("/away/x")).send().await.unwrap().status(),
            502
        );
    }
    let logs = gw.logs();
    let said = logs
        .matches(r#""message":"the upstream has no address"#)
        .count();
    assert_eq!(said, 1, "{logs}");
    assert!(!logs.contains("\"ERROR\""), "{logs}");
    common::wait_until(Duration::from_secs(5), "the five lines", || {
        common::access_lines(&log).len() == 5
    });
    for line in common::access_lines(&log) {
        if line["path"] == "/away/x" {
            assert_eq!(
                (
                    &line["status"],
                    &line["upstream"],
                    &line["upstream_addr"],
                    &line["error"]
                ),
                (
                    &502.into(),
                    &"gone".into(),
                    &serde_json::Value::Null,
                    &"upstream_failed".into()
                ),
                "{line}"
            );
        }
    }
    let (status, body) = gw.reload_answer();
    assert_eq!(status, 200, "{body}");
}
