//! `exempt_client_cidrs`: clients inside are forwarded without identity, limit or Redis call,
//! and counted; everyone else is limited as before.

mod common;

use common::config::{GatewayConfig, Route};
use common::{client, Redis, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exempt_clients_skip_identity_limit_and_redis() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let route = |id: &str, prefix: &str, exempt: &str| {
        Route::new(id)
            .prefix(prefix)
            .identity_header("X-API-Key")
            .token_bucket(1_000_000, 0)
            .set("exempt_client_cidrs", exempt)
    };
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(route("x.inside", "/inside", r#"["127.0.0.0/8"]"#))
        .route(route("x.outside", "/outside", r#"["10.0.0.0/8", "::1"]"#))
        .start();
    let http = client();
    redis.reset_stats();
    for _ in 0..5 {
        let r = http.get(gw.url("/inside")).send().await.unwrap();
        assert_eq!(r.status(), 200, "no key needed, no limit");
    }
    assert_eq!(redis.limiter_calls(), 0, "no Redis call");
    assert_eq!(
        gw.metric(r#"sentinel_exempt_requests_total{endpoint_id="x.inside"}"#),
        5.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_decisions_total{allowed="true",decision_reason="allowed",endpoint_id="x.inside"}"#),
        0.0,
        "no decision"
    );
    let statuses = [
        http.get(gw.url("/outside")).send().await.unwrap().status(),
        http.get(gw.url("/outside"))
            .header("X-API-Key", "k")
            .send()
            .await
            .unwrap()
            .status(),
        http.get(gw.url("/outside"))
            .header("X-API-Key", "k")
            .send()
            .await
            .unwrap()
            .status(),
    ];
    assert_eq!(
        statuses.map(|s| s.as_u16()),
        [401, 200, 429],
        "outside the list: limited"
    );
    assert_eq!(
        gw.metric(r#"sentinel_exempt_requests_total{endpoint_id="x.outside"}"#),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_trusted_proxy_only_the_client_it_names_can_be_exempt() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        .server("trusted_proxies", r#"["127.0.0.0/8"]"#)
        .upstream("app", &[up.addr()])
        .route(
            Route::new("x.api")
                .prefix("/api")
                .identity_header("X-API-Key")
                .token_bucket(1_000_000, 0)
                .set("exempt_client_cidrs", r#"["127.0.0.0/8"]"#),
        )
        .start();
    let http = client();
    let status = |xff: &'static [u8]| {
        let (http, url) = (http.clone(), gw.url("/api"));
        async move {
            http.get(url)
                .header(
                    "X-Forwarded-For",
                    http::HeaderValue::from_bytes(xff).unwrap(),
                )
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    // The proxy's own address is exempt; a client it cannot name is not the proxy, nor
    // exempt: it goes on to its own identity (none here: 401).
    assert_eq!(status(b"garbage").await, 401);
    assert_eq!(status(b"\xff").await, 401);
    assert_eq!(status(b"10.1.2.3, garbage").await, 401);
    assert_eq!(status(b"1.2.3.4").await, 401, "a client outside the list");
    assert_eq!(
        status(b"127.0.0.5").await,
        200,
        "an internal caller named by the proxy"
    );
    assert_eq!(
        gw.metric(r#"sentinel_exempt_requests_total{endpoint_id="x.api"}"#),
        1.0
    );
}

/// `check` names the exempt networks in the route's line, and warns of them on a route that
/// is not limited, where they change nothing.
#[test]
fn check_names_the_exempt_networks_and_warns_of_them_where_they_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let body = |route: Route| {
        format!(
            "[redis]\nurl = \"redis://127.0.0.1:1\"\n[upstreams.app]\naddrs = [\"127.0.0.1:1\"]\n{}",
            route.toml()
        )
    };
    let limited = Route::new("e.x")
        .prefix("/x")
        .identity("client_ip")
        .token_bucket(2_000_000, 0)
        .set(
            "exempt_client_cidrs",
            "[\"10.0.0.0/8\", \"192.168.1.0/24\"]",
        );
    let (ok, out) = common::check_body(dir.path(), &body(limited), &[]);
    assert!(
        ok && out.contains("per client IP; clients in 10.0.0.0/8, 192.168.1.0/24 not limited;"),
        "{out}"
    );
    assert!(!out.contains("changes nothing"), "{out}");
    let unlimited = Route::new("e.y")
        .prefix("/y")
        .unlimited()
        .set("exempt_client_cidrs", "[\"10.0.0.0/8\"]");
    let (ok, out) = common::check_body(dir.path(), &body(unlimited), &[]);
    assert!(
        ok && out.contains("exempt_client_cidrs on a route that is not limited"),
        "{out}"
    );
}
