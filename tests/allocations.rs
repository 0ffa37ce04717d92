//! How many times the decision path allocates, counted by a global allocator that counts:
//! one limited decision by a real Redis (the store's batch sender included, on its own
//! thread) stays within a small, fixed number of allocations, whatever the number of
//! decisions, so the limiter's cost does not grow with load or with time.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use sentinel_gateway::limiter::{self, identity_hash};

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Allocations per decision, documented in docs/benchmarks.md ("What one decision
/// allocates"), measured at 4 for decisions sent one at a time (a batch of one pays its
/// batch's share in full): the bucket key and the answer's channel; the answer's bytes and the
/// handle that shares them between the batch's decisions. The command, the queue and the
/// connection's read buffer are reused from call to call.
const MOST_PER_DECISION: f64 = 6.0;

#[test]
fn one_decision_allocates_a_bounded_number_of_times() {
    let redis = common::Redis::start();
    let (store, endpoint) = common::inproc::store_and_endpoint(
        &format!(
            r#"
[redis]
url = "{}"
require_noeviction = false
# Allocations are counted here, not latency: a debug build on a loaded machine may take
# longer than the default 20 ms budget now and then.
timeout_ms = 1_000
[upstreams.app]
addrs = ["127.0.0.1:9"]
[[routes]]
endpoint_id = "a.limited"
path = "/a"
upstream = "app"
identity = {{ header = "X-API-Key" }}
algorithm = "token_bucket"
capacity_micro = 1_000_000_000_000_000
refill_rate_micro_per_sec = 1_000_000_000_000
"#,
            redis.url()
        ),
        "a.limited",
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let hashes: Vec<String> = (0..64)
        .map(|i| identity_hash(&format!("header:x-api-key:k{i}")))
        .collect();
    let decide_all = |rounds: usize| {
        runtime.block_on(async {
            for _ in 0..rounds {
                for hash in &hashes {
                    let d = limiter::decide(&store, &endpoint, hash).await;
                    assert!(d.allowed(), "{d:?}");
                }
            }
        })
    };
    common::wait_until(std::time::Duration::from_secs(5), "redis connected", || {
        store.is_connected()
    });
    // Warm: the connection, the scripts, every lazily made structure.
    decide_all(4);
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    decide_all(30);
    let per = (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / (30.0 * 64.0);
    eprintln!("allocations per decision: {per:.2}");
    assert!(
        per <= MOST_PER_DECISION,
        "{per:.2} allocations per decision, more than the documented {MOST_PER_DECISION}"
    );
    // And no more with ten times the decisions: nothing accumulates.
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    decide_all(300);
    let per_long = (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / (300.0 * 64.0);
    assert!(
        per_long <= per * 1.1 + 0.5,
        "{per_long:.2} allocations per decision over a longer run, against {per:.2}"
    );
}
