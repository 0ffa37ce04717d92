//! Reload and shutdown, as an operator drives them: POST /reload, SIGHUP, SIGTERM.

mod common;

use std::time::{Duration, Instant};

use common::{blocking_get, client, wait_until, Gateway, Redis, Upstream};

fn routes(upstream: &str, capacity: u64) -> String {
    format!(
        r#"
[upstreams.app]
addrs = ["{upstream}"]
read_timeout_ms = 10000

[[routes]]
endpoint_id = "l.api"
path_prefix = "/api"
upstream = "app"
identity = "global"
algorithm = "token_bucket"
capacity_micro = {}
refill_rate_micro_per_sec = 0
"#,
        capacity * 1_000_000
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_then_exits_zero() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let mut gw = Gateway::start(&redis.url(), &routes(&up.addr(), 100));
    let http = client();
    let slow = {
        let (http, url) = (http.clone(), gw.url("/api/slow?ms=1500"));
        tokio::spawn(async move {
            let r = http
                .get(url)
                .send()
                .await
                .expect("the in-flight request completes");
            (r.status().as_u16(), r.text().await.unwrap())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = Instant::now();
    gw.proc.signal("TERM");
    wait_until(Duration::from_secs(2), "/readyz to turn 503", || {
        blocking_get(&gw.admin("/readyz"))
            .is_some_and(|(s, b)| s == 503 && b.contains(r#""ready":false"#))
    });
    let (status, body) = slow.await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"path\":\"/api/slow\""));
    let code = gw
        .proc
        .wait_exit(Duration::from_secs(5))
        .expect("exits within the grace period");
    assert_eq!(code, 0);
    assert!(
        sent.elapsed() < Duration::from_secs(4),
        "exited once drained, not after the whole grace period"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_reload_keeps_the_old_config_serving() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = Gateway::start(&redis.url(), &routes(&up.addr(), 2));
    let http = client();
    let good = std::fs::read_to_string(&gw.config_path).unwrap();
    gw.rewrite_config(&good.replace("capacity_micro = 2000000", "capacity_micro = 5"));
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(body["reloaded"], false);
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("routes[0] (l.api): capacity_micro = 5 can never admit a request"),
        "{error}"
    );
    assert_eq!(
        gw.metric(r#"sentinel_config_reloads_total{result="failure"}"#),
        1.0
    );
    assert_eq!(gw.metric("sentinel_config_generation"), 1.0);
    let statuses = [
        http.get(gw.url("/api"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        http.get(gw.url("/api"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        http.get(gw.url("/api"))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
    ];
    assert_eq!(statuses, [200, 200, 429], "the old limit still applies");
    assert_eq!(
        gw.logs().matches("config reload failed").count(),
        1,
        "logged once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_and_a_new_route_serves() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = Gateway::start(&redis.url(), &routes(&up.addr(), 2));
    let http = client();
    assert_eq!(http.get(gw.url("/new")).send().await.unwrap().status(), 404);
    let mut text = std::fs::read_to_string(&gw.config_path).unwrap();
    text.push_str("\n[[routes]]\nendpoint_id = \"l.new\"\npath = \"/new\"\nupstream = \"app\"\nalgorithm = \"none\"\n");
    gw.rewrite_config(&text);
    gw.proc.signal("HUP");
    wait_until(Duration::from_secs(5), "the reload", || {
        gw.metric("sentinel_config_generation") == 2.0
    });
    assert_eq!(http.get(gw.url("/new")).send().await.unwrap().status(), 200);
    assert_eq!(
        gw.metric(r#"sentinel_config_reloads_total{result="success"}"#),
        1.0
    );
    let (status, body) = blocking_get(&gw.admin("/readyz")).unwrap();
    assert_eq!(status, 200);
    assert!(body.contains(r#""config_generation":2"#), "{body}");
}
