//! Promises of the contract's command line and config that other tests do not reach:
//! `--version` and `--help`, `SENTINEL_REDIS_URL` at run time, `RUST_LOG`, a list of listen
//! addresses, a custom `key_prefix`, and routes sharing one `endpoint_id`.

mod common;

use std::ffi::OsStr;

use common::config::{string_list, GatewayConfig, Route};
use common::{client, free_port, free_ports, Gateway, Redis, Upstream};
use sentinel_gateway::limiter::bucket_key;

/// Two routes sharing the endpoint `c.shared`: one global bucket of 3 that never refills.
fn routes(base: GatewayConfig, upstream: &str) -> GatewayConfig {
    let shared = |path: &str| {
        Route::new("c.shared")
            .path(path)
            .identity("global")
            .token_bucket(3_000_000, 0)
    };
    base.upstream("app", &[upstream])
        .route(shared("/one"))
        .route(shared("/two"))
}

#[test]
fn version_and_help() {
    let run = |arg: &str| common::run_binary(&[OsStr::new(arg)], &[]);
    let version = run("--version");
    assert!(version.status.success());
    assert_eq!(
        String::from_utf8_lossy(&version.stdout).trim(),
        format!("sentinel-gateway {}", env!("CARGO_PKG_VERSION"))
    );
    let help = run("--help");
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(
        text.contains("check") && text.contains("--config"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn env_url_listen_list_key_prefix_and_a_shared_endpoint() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let [a, b, admin] = free_ports();
    // The file names a Redis that does not exist; the environment names the real one.
    let config = routes(
        GatewayConfig::bare(&format!("redis://127.0.0.1:{}/0", free_port()))
            .server(
                "listen",
                string_list(&[format!("127.0.0.1:{a}"), format!("127.0.0.1:{b}")]),
            )
            .redis("key_prefix", "\"edge-7\""),
        &up.addr(),
    )
    .render(a, admin);
    let gw = Gateway::start_with_env(
        a,
        admin,
        &config,
        &[("SENTINEL_REDIS_URL", &redis.url()), ("RUST_LOG", "error")],
    );
    let http = client();
    let mut statuses = Vec::new();
    for (port, path) in [(a, "/one"), (b, "/two"), (a, "/two"), (b, "/one")] {
        statuses.push(
            http.get(format!("http://127.0.0.1:{port}{path}"))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    assert_eq!(
        statuses,
        vec![200, 200, 200, 429],
        "both listeners, both routes, one bucket of 3, decided by Redis"
    );
    let key = bucket_key("edge-7", "global", "c.shared", 1);
    assert_eq!(
        redis.keys("*"),
        vec![key],
        "the bucket lives in the Redis from SENTINEL_REDIS_URL, under key_prefix"
    );
    assert!(
        !gw.logs().contains("request denied"),
        "RUST_LOG=error filters out the WARN denial line"
    );
}
