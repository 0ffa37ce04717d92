//! Promises of the contract's command line and config that other tests do not reach:
//! `--version` and `--help`, `SENTINEL_REDIS_URL` at run time, `RUST_LOG`, a list of listen
//! addresses, a custom `key_prefix`, and routes sharing one `endpoint_id`.

mod common;

use std::process::Command;

use common::{client, free_port, Gateway, Redis, Upstream};
use sha2::{Digest, Sha256};

fn routes(upstream: &str) -> String {
    format!(
        r#"
[upstreams.app]
addrs = ["{upstream}"]

[[routes]]
endpoint_id = "c.shared"
path = "/one"
upstream = "app"
identity = "global"
algorithm = "token_bucket"
capacity_micro = 3_000_000
refill_rate_micro_per_sec = 0

[[routes]]
endpoint_id = "c.shared"
path = "/two"
upstream = "app"
identity = "global"
algorithm = "token_bucket"
capacity_micro = 3_000_000
refill_rate_micro_per_sec = 0
"#
    )
}

#[test]
fn version_and_help() {
    let run = |arg: &str| {
        Command::new(env!("CARGO_BIN_EXE_sentinel-gateway"))
            .arg(arg)
            .output()
            .unwrap()
    };
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
    let (a, b, admin) = (free_port(), free_port(), free_port());
    // The file names a Redis that does not exist; the environment names the real one.
    let config = format!(
        "[server]\nlisten = [\"127.0.0.1:{a}\", \"127.0.0.1:{b}\"]\nadmin_listen = \"127.0.0.1:{admin}\"\n\n[redis]\nurl = \"redis://127.0.0.1:{}/0\"\nkey_prefix = \"edge-7\"\n{}",
        free_port(),
        routes(&up.addr())
    );
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
    let key = format!(
        "edge-7:v1:{}:c.shared:1",
        hex::encode(Sha256::digest(b"global"))
    );
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
