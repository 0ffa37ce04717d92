//! The store and the limiter in-process, as the gateway builds and runs them: for what a
//! test must hold in its own hands (the allocator, the proxy's runtime).

use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use sentinel_gateway::clock::{MonotonicClock, SharedClock};
use sentinel_gateway::config::{Config, EndpointId};
use sentinel_gateway::decision::fleet::Fleet;
use sentinel_gateway::limiter::endpoint::Endpoint;
use sentinel_gateway::limiter::{self, identity_hash};
use sentinel_gateway::metrics::Metrics;
use sentinel_gateway::snapshot::Snapshot;
use sentinel_gateway::store::Store;

/// The store started from `config` (a gateway.toml's text) and the endpoint `endpoint_id`.
pub fn store_and_endpoint(config: &str, endpoint_id: &str) -> (Store, Arc<Endpoint>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, config).unwrap();
    let config = Config::load(&path).expect("a valid config");
    let metrics = Arc::new(Metrics::new());
    let clock: SharedClock = Arc::new(MonotonicClock::default());
    let store = Store::start(&config.redis, config.breaker, Arc::clone(&clock), &metrics).unwrap();
    let snapshot = Snapshot::build(
        config,
        1,
        &metrics,
        &clock,
        &Arc::new(Fleet::default()),
        None,
    )
    .unwrap();
    let id = EndpointId::parse(endpoint_id).unwrap();
    let endpoint = Arc::clone(&snapshot.endpoints[&id]);
    (store, endpoint)
}

/// Two decisions on a proxy runtime of one worker, the second queued behind the first's call,
/// and then the worker stalled for twice the budget (a request's work that does not yield, or
/// a saturated worker). Returns whether each was admitted by Redis's own answer.
/// `redis_section`: the `[redis]` lines that say where Redis is (and how to reach it).
pub fn two_decisions_behind_a_stalled_worker(redis_section: &str) -> (bool, bool) {
    let (store, endpoint) = store_and_endpoint(
        &format!(
            r#"
[redis]
{redis_section}
require_noeviction = false
# A budget far above this machine's noise: the stall below is twice it.
timeout_ms = 250
[upstreams.app]
addrs = ["127.0.0.1:9"]
[[routes]]
endpoint_id = "a.stalled"
path = "/a"
upstream = "app"
identity = {{ header = "X-API-Key" }}
algorithm = "token_bucket"
capacity_micro = 1_000_000_000_000
refill_rate_micro_per_sec = 1_000_000_000
"#
        ),
        "a.stalled",
    );
    let proxy = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    crate::common::wait_until(Duration::from_secs(5), "redis connected", || {
        store.is_connected()
    });
    // The first decisions show the store the proxy's runtime; the connection the decisions
    // use is then opened again there (a few milliseconds on loopback; a second is generous).
    let warm = |store: &Store| {
        proxy.block_on(async {
            for i in 0..8 {
                let hash = identity_hash(&format!("header:x-api-key:warm{i}"));
                assert!(limiter::decide(store, &endpoint, &hash)
                    .await
                    .admitted_by_redis());
            }
        })
    };
    warm(&store);
    std::thread::sleep(Duration::from_secs(1));
    warm(&store);
    let (a, b) = (
        identity_hash("header:x-api-key:a"),
        identity_hash("header:x-api-key:b"),
    );
    let endpoint = Arc::clone(&endpoint);
    proxy.block_on(async move {
        tokio::spawn(async move {
            let mut first = Box::pin(limiter::decide(&store, &endpoint, &a));
            let mut second = Box::pin(limiter::decide(&store, &endpoint, &b));
            // The first one's call goes out; the second queues behind it.
            assert!((&mut first).now_or_never().is_none());
            assert!((&mut second).now_or_never().is_none());
            // Nothing else runs on the proxy's worker for twice the budget.
            std::thread::sleep(Duration::from_millis(500));
            (
                first.await.admitted_by_redis(),
                second.await.admitted_by_redis(),
            )
        })
        .await
        .unwrap()
    })
}
