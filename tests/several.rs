//! Several limits on one route (`[[routes.limits]]`) against the real binary and a real
//! redis-server (and the real three-primary cluster): exact admitted counts, a denial that
//! charges no limit, the longest wait in `Retry-After`, ceilings shared by every caller, the
//! denying limit in metrics, logs and headers, and one `EVALSHA` per decision.

mod common;

use std::time::Duration;

use common::cluster::RedisCluster;
use common::config::{GatewayConfig, Route};
use common::{blocking_get, client, Redis, Upstream};
use sentinel_gateway::config::{Algorithm, Limit};
use sentinel_gateway::limiter::limit_keys;
use serde_json::Value;

/// `/api`, per `X-API-Key`, with these limits.
fn route(limits: impl FnOnce(Route) -> Route) -> Route {
    limits(
        Route::new("e.api")
            .prefix("/api")
            .identity_header("X-API-Key")
            .fail_closed()
            .set("ratelimit_headers", "true"),
    )
}

async fn get(gw: &common::Gateway, key: &str) -> reqwest::Response {
    client()
        .get(gw.url("/api/x"))
        .header("X-API-Key", key)
        .send()
        .await
        .unwrap()
}

/// `/limits/<endpoint>` for `identity`: the body of its 200.
fn limits_of_route(gw: &common::Gateway, endpoint: &str, identity: &str) -> Value {
    let (status, body) = blocking_get(&gw.admin(&format!(
        "/limits/{endpoint}?identity={}",
        percent_encode(identity)
    )))
    .unwrap();
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn limits_of(gw: &common::Gateway, identity: &str) -> Value {
    limits_of_route(gw, "e.api", identity)
}

/// `DELETE /limits/e.api` for `identity`: the body of its 200.
async fn reset(gw: &common::Gateway, identity: &str) -> Value {
    let r = client()
        .delete(gw.admin(&format!(
            "/limits/e.api?identity={}",
            percent_encode(identity)
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    serde_json::from_str(&r.text().await.unwrap()).unwrap()
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'-' || b == b'.' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

fn remaining(view: &Value, name: &str) -> i64 {
    view["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name)
        .unwrap_or_else(|| panic!("no limit {name}: {view}"))["remaining"]
        .as_i64()
        .unwrap()
}

/// `ratelimit_headers = "x-ratelimit"`: `X-RateLimit-Limit`, `-Remaining` and `-Reset` of the
/// limit nearest to refusing, as clients of Envoy and APISIX read them, on
/// answers Redis decided and on the denials the over-limit cache repeats; no IETF fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_x_ratelimit_fields_give_the_limit_nearest_to_refusing() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    // burst: 3, refilled 1 per 100 s; daily: 5, refilled 1 per 1000 s.
    let gw = GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .upstream("app", &[up.addr()])
        .route(route(|r| {
            r.set("ratelimit_headers", "\"x-ratelimit\"")
                .bucket_limit("burst", 3, 10_000)
                .bucket_limit("daily", 5, 1_000)
        }))
        .start();
    let fields = |r: &reqwest::Response| {
        let h = r.headers();
        assert!(h.get("ratelimit").is_none() && h.get("ratelimit-policy").is_none());
        let n = |name: &str| -> u64 { h[name].to_str().unwrap().parse().unwrap() };
        (
            n("x-ratelimit-limit"),
            n("x-ratelimit-remaining"),
            n("x-ratelimit-reset"),
        )
    };
    // burst has 2 left of 3, daily 4 of 5: burst is nearest; full again in 100 s.
    let r = get(&gw, "k1").await;
    assert_eq!(r.status(), 200);
    let (limit, remaining, reset) = fields(&r);
    assert_eq!((limit, remaining), (3, 2));
    assert!((99..=100).contains(&reset), "{reset}");
    // Two more admitted (burst 0 left, daily 2), then denials by burst, which charge nothing.
    for _ in 0..2 {
        assert_eq!(get(&gw, "k1").await.status(), 200);
    }
    for cached in [false, true] {
        let r = get(&gw, "k1").await;
        assert_eq!(r.status(), 429);
        let wait = common::retry_after(&r);
        let (limit, remaining, reset) = fields(&r);
        assert_eq!((limit, remaining), (3, 0), "cached: {cached}");
        assert!(
            reset >= wait && reset <= 300,
            "cached: {cached}: {reset} against {wait}"
        );
    }
    assert_eq!(
        gw.metric(r#"sentinel_overlimit_cache_hits_total{endpoint_id="e.api"}"#),
        1.0
    );
    // The same fields over HTTP/2 (lower case there, as every field).
    let r = (common::h2c_client().get(gw.url("/api/x")))
        .header("X-API-Key", "k1")
        .send()
        .await
        .unwrap();
    assert_eq!(
        (r.version(), r.status().as_u16()),
        (reqwest::Version::HTTP_2, 429)
    );
    let (limit, remaining, _) = fields(&r);
    assert_eq!((limit, remaining), (3, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_limits_on_one_identity_admit_exactly_and_a_denial_charges_neither() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    // burst: 3, refilled 1 per 100 s; daily: 5, refilled 1 per 1000 s.
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(route(|r| {
            r.bucket_limit("burst", 3, 10_000)
                .bucket_limit("daily", 5, 1_000)
        }))
        .start();
    redis.reset_stats();
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(get(&gw, "k1").await.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    assert_eq!(
        redis.command_calls("evalsha"),
        4,
        "one EVALSHA per decision, both limits in it; the second denial is the over-limit cache's"
    );
    // The two denials took nothing from daily: 5 - 3 left.
    let view = limits_of(&gw, "header:x-api-key:k1");
    assert_eq!(remaining(&view, "burst"), 0, "{view}");
    assert_eq!(remaining(&view, "daily"), 2, "{view}");
    assert_eq!(view["limits"].as_array().unwrap().len(), 2);

    // A denial by burst waits for burst (about 100 s). This one is repeated by the
    // over-limit cache: Retry-After, and one RateLimit item per limit, as Redis's own denial
    // had them (the contract asks one item per limit of every answer).
    let r = get(&gw, "k1").await;
    assert_eq!(r.status(), 429);
    let retry = common::retry_after(&r);
    assert!((1..=100).contains(&retry), "{retry}");
    assert_eq!(
        r.headers()["ratelimit-policy"],
        "\"burst\";q=3;w=300, \"daily\";q=5;w=5000"
    );
    let fields = r.headers()["ratelimit"].to_str().unwrap();
    assert!(
        fields.starts_with("\"burst\";r=0;t=") && fields.contains(", \"daily\";r=2;t="),
        "{fields}"
    );
    // A new caller's answer has one item per limit.
    let r = get(&gw, "k2").await;
    assert_eq!(r.status(), 200);
    let fields = r.headers()["ratelimit"].to_str().unwrap().to_owned();
    assert!(
        fields.starts_with("\"burst\";r=2;t=") && fields.contains(", \"daily\";r=4;t="),
        "{fields}"
    );
    let policy = r.headers()["ratelimit-policy"].to_str().unwrap().to_owned();
    assert_eq!(policy, "\"burst\";q=3;w=300, \"daily\";q=5;w=5000");
    assert_eq!(
        gw.metric("sentinel_limit_denials_total{endpoint_id=\"e.api\",limit=\"burst\"}"),
        3.0
    );
    assert_eq!(
        gw.metric("sentinel_limit_denials_total{endpoint_id=\"e.api\",limit=\"daily\"}"),
        0.0
    );
    assert!(gw.logs().contains("\"limit\":\"burst\""), "{}", gw.logs());

    // A reset deletes both buckets in one command: no decision can run between the two.
    redis.reset_stats();
    let body = reset(&gw, "header:x-api-key:k1").await;
    assert_eq!(body["keys_deleted"], 2, "{body}");
    assert_eq!(redis.command_calls("del"), 1, "one DEL for both limits");
    let view = limits_of(&gw, "header:x-api-key:k1");
    assert_eq!(remaining(&view, "burst"), 3, "{view}");
    assert_eq!(remaining(&view, "daily"), 5, "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_the_longest_wait_of_the_denying_limits() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    // Both hold 2; burst refills one a second, hourly one per 1000 s.
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(route(|r| {
            r.bucket_limit("burst", 2, 1_000_000)
                .bucket_limit("hourly", 2, 1_000)
        }))
        .start();
    assert_eq!(get(&gw, "k").await.status(), 200);
    assert_eq!(get(&gw, "k").await.status(), 200);
    let r = get(&gw, "k").await;
    assert_eq!(r.status(), 429);
    let retry = common::retry_after(&r);
    assert!(
        (900..=1000).contains(&retry),
        "the hourly wait, not burst's: {retry}"
    );
    assert_eq!(
        gw.metric("sentinel_limit_denials_total{endpoint_id=\"e.api\",limit=\"hourly\"}"),
        1.0
    );
}

/// A caller refused by its own limit is refused again from the over-limit cache; once the
/// ceiling every caller shares is spent too (by another caller), that repeated 429 says the
/// ceiling's wait when it is the longer, its item says the ceiling is spent, and the denial
/// counts as the ceiling's: the contract's "the wait until every denying limit admits
/// again". (It kept its own shorter wait and the ceiling's item as at its own denial.) Once
/// the ceiling admits a request again, the caller's own wait is said alone again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remembered_denial_says_the_wait_of_a_ceiling_spent_since() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    // Each caller: 2, one more every 100 s. Everyone: 3, one more every 1000 s.
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(route(|r| {
            r.bucket_limit("own", 2, 10_000).limit(
                "fleet",
                "identity = \"global\"\nalgorithm = \"token_bucket\"\ncapacity_micro = 3_000_000\nrefill_rate_micro_per_sec = 1_000",
            )
        }))
        .start();
    assert_eq!(get(&gw, "a").await.status(), 200);
    assert_eq!(get(&gw, "a").await.status(), 200);
    // a's own limit: about 100 s; the ceiling has one left.
    let r = get(&gw, "a").await;
    assert_eq!(r.status(), 429);
    assert!((1..=100).contains(&common::retry_after(&r)));
    // b takes the ceiling's last; its next is the ceiling's (about 1000 s).
    assert_eq!(get(&gw, "b").await.status(), 200);
    let r = get(&gw, "b").await;
    assert_eq!(r.status(), 429);
    assert!((900..=1000).contains(&common::retry_after(&r)));
    // a, from the cache: the ceiling's wait, its item spent.
    let r = get(&gw, "a").await;
    assert_eq!(r.status(), 429);
    let retry = common::retry_after(&r);
    assert!((900..=1000).contains(&retry), "the ceiling's wait: {retry}");
    let fields = r.headers()["ratelimit"].to_str().unwrap();
    assert!(
        fields.starts_with("\"own\";r=0;t=") && fields.contains(", \"fleet\";r=0;t="),
        "{fields}"
    );
    assert_eq!(
        gw.metric("sentinel_overlimit_cache_hits_total{endpoint_id=\"e.api\"}"),
        1.0
    );
    let denials = |limit: &str| {
        gw.metric(&format!(
            "sentinel_limit_denials_total{{endpoint_id=\"e.api\",limit=\"{limit}\"}}"
        ))
    };
    assert_eq!((denials("own"), denials("fleet")), (1.0, 2.0));
    // The ceiling's key deleted by hand (no gateway told): it admits c, and a's repeated
    // denial, from the cache still, is its own again.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*:fleet")
        .query(&mut redis.conn())
        .unwrap();
    let _: () = redis::cmd("DEL")
        .arg(&keys)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(get(&gw, "c").await.status(), 200);
    let r = get(&gw, "a").await;
    assert_eq!(r.status(), 429);
    let retry = common::retry_after(&r);
    assert!((1..=100).contains(&retry), "a's own wait: {retry}");
    assert_eq!(
        gw.metric("sentinel_overlimit_cache_hits_total{endpoint_id=\"e.api\"}"),
        2.0
    );
    assert_eq!((denials("own"), denials("fleet")), (2.0, 2.0));
}

fn ceiling(r: Route) -> Route {
    r.bucket_limit("burst", 3, 0).limit(
        "backend",
        "identity = \"global\"\nalgorithm = \"sliding_window\"\nlimit = 5\nwindow_size_micro = 60_000_000",
    )
}

/// The limits of [`ceiling`], as the library names them (for their keys).
fn ceiling_limits() -> [Limit; 2] {
    [
        Limit {
            name: "burst".into(),
            algorithm: Algorithm::TokenBucket {
                capacity_micro: 3_000_000,
                refill_micro_per_sec: 0,
            },
            global: false,
        },
        Limit {
            name: "backend".into(),
            algorithm: Algorithm::SlidingWindow {
                limit: 5,
                window_micro: 60_000_000,
            },
            global: true,
        },
    ]
}

/// A gateway on `cluster` with [`ceiling`]'s route to `up`: two threads, a budget of 200 ms
/// (room for a loaded machine; what is tested is which calls are made).
fn ceiling_gateway(cluster: &RedisCluster, up: &Upstream) -> GatewayConfig {
    GatewayConfig::bare_cluster(&cluster.seed_urls())
        .server("threads", "2")
        .redis("timeout_ms", "200")
        .upstream("app", &[up.addr()])
        .route(route(ceiling))
}

/// On `cluster`, the primary of [`ceiling`]'s ceiling, and the key of a caller's own limit
/// (to pick callers on that node, or on another).
fn ceiling_layout(cluster: &RedisCluster) -> (usize, impl Fn(&str) -> String) {
    let limits = ceiling_limits();
    let node = cluster.owner(&limit_keys("sentinel", "x", "e.api", 1, &limits)[1]);
    let own_key = move |k: &str| {
        let identity = format!("header:x-api-key:{k}");
        limit_keys("sentinel", &identity, "e.api", 1, &limits)[0].clone()
    };
    (node, own_key)
}

/// Four callers whose own limits live on another primary than [`ceiling`]'s ceiling, once
/// the gateway knows the slot map (the first answers may be 503 until then).
fn off_the_ceilings_node(cluster: &RedisCluster, gw: &common::Gateway) -> Vec<String> {
    let (ceiling_node, own_key) = ceiling_layout(cluster);
    let callers = (0..200)
        .map(|i| format!("key-{i}"))
        .filter(|k| cluster.owner(&own_key(k)) != ceiling_node)
        .take(4)
        .collect();
    common::wait_until(Duration::from_secs(10), "the cluster to be usable", || {
        blocking_get(&gw.url("/api/warm")).is_some()
            && blocking_get(&gw.admin("/readyz")).is_some_and(|(s, _)| s == 200)
    });
    callers
}

async fn total_over_keys(gw: &common::Gateway, keys: &[&str], each: usize) -> Vec<u64> {
    let mut admitted = vec![0; keys.len()];
    for (i, k) in keys.iter().enumerate() {
        for _ in 0..each {
            if get(gw, k).await.status() == 200 {
                admitted[i] += 1;
            }
        }
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_ceiling_caps_every_caller_together() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(route(ceiling))
        .start();
    let admitted = total_over_keys(&gw, &["a", "b", "c"], 4).await;
    assert_eq!(
        admitted,
        [3, 2, 0],
        "3 for a (its burst), then the ceiling's 5 in all"
    );
    // a's fourth was its burst's; b's third and fourth, and all of c's, the ceiling's.
    assert_eq!(
        gw.metric("sentinel_limit_denials_total{endpoint_id=\"e.api\",limit=\"burst\"}"),
        1.0
    );
    assert_eq!(
        gw.metric("sentinel_limit_denials_total{endpoint_id=\"e.api\",limit=\"backend\"}"),
        6.0
    );
    // The ceiling's denials charged nobody's burst: c still has all of it.
    assert_eq!(remaining(&limits_of(&gw, "header:x-api-key:c"), "burst"), 3);
    assert_eq!(remaining(&limits_of(&gw, "header:x-api-key:b"), "burst"), 1);
    // `global` is the ceiling's identity only: no caller's burst is read for it.
    let everyone = limits_of(&gw, "global");
    assert_eq!(
        everyone["limits"].as_array().unwrap().len(),
        1,
        "{everyone}"
    );
    assert_eq!(remaining(&everyone, "backend"), 0);

    // DELETE resets the caller's own limits, not the shared ceiling.
    let body = reset(&gw, "header:x-api-key:a").await;
    assert_eq!(body["keys_deleted"], 1, "{body}");
    assert_eq!(remaining(&limits_of(&gw, "header:x-api-key:a"), "burst"), 3);
    assert_eq!(remaining(&limits_of(&gw, "global"), "backend"), 0);

    // Resetting the ceiling lets back in the callers it refused, though the over-limit
    // cache remembers those denials under each caller's own key.
    assert_eq!(get(&gw, "c").await.status(), 429);
    reset(&gw, "global").await;
    assert_eq!(get(&gw, "c").await.status(), 200);
}

/// A ceiling listed before the caller's own limit: a caller who spent its own burst is
/// denied, and its denial, repeated from the over-limit cache, is its own; every other caller
/// is still decided by its own burst and the ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_denial_is_never_repeated_to_others_whatever_the_order_of_the_limits() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let ceiling_first = |r: Route| {
        r.limit(
            "backend",
            "identity = \"global\"\nalgorithm = \"sliding_window\"\nlimit = 100\nwindow_size_micro = 60_000_000",
        )
        .bucket_limit("burst", 2, 10_000)
    };
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(route(ceiling_first))
        .start();
    assert_eq!(total_over_keys(&gw, &["a"], 4).await, [2]);
    assert_eq!(
        total_over_keys(&gw, &["b", "c", "d"], 1).await,
        [1, 1, 1],
        "a's denials were a's own"
    );
    // a's third went to Redis; its fourth was the cache's, under a's own key.
    assert_eq!(
        gw.metric("sentinel_overlimit_cache_hits_total{endpoint_id=\"e.api\"}"),
        1.0
    );
    assert_eq!(remaining(&limits_of(&gw, "global"), "backend"), 95);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_ceiling_on_another_primary_still_never_charges_a_denied_request() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let gw = ceiling_gateway(&cluster, &up)
        .route(
            Route::new("e.two")
                .prefix("/two")
                .identity_header("X-API-Key")
                .fail_closed()
                .bucket_limit("burst", 5, 0)
                .bucket_limit("daily", 9, 0),
        )
        .start();
    let (ceiling_node, _) = ceiling_layout(&cluster);
    let callers = off_the_ceilings_node(&cluster, &gw);
    let keys: Vec<&str> = callers[..3].iter().map(String::as_str).collect();
    let admitted = total_over_keys(&gw, &keys, 4).await;
    assert_eq!(admitted, [3, 2, 0], "{callers:?}");
    // The refunds are made before the answers: read at once.
    let first = format!("header:x-api-key:{}", callers[1]);
    let third = format!("header:x-api-key:{}", callers[2]);
    assert_eq!(
        remaining(&limits_of(&gw, &first), "burst"),
        1,
        "charged for its 2 only"
    );
    assert_eq!(
        remaining(&limits_of(&gw, &third), "burst"),
        3,
        "never charged (refused by the remembered ceiling after a read of its burst)"
    );
    // Every 429 carries one item per limit: the ceiling's, read without writing, when the
    // caller's own burst denied; the caller's burst as Redis read it when the ceiling
    // (remembered) denied.
    let items = |r: &reqwest::Response| {
        (
            r.headers()["ratelimit-policy"].to_str().unwrap().to_owned(),
            r.headers()["ratelimit"].to_str().unwrap().to_owned(),
        )
    };
    let by_burst = get(&gw, &callers[0]).await;
    assert_eq!(by_burst.status(), 429);
    let (policy, state) = items(&by_burst);
    assert_eq!(policy, "\"burst\";q=3, \"backend\";q=5;w=60", "{state}");
    assert!(
        state.starts_with("\"burst\";r=0, \"backend\";r=0;t="),
        "{state}"
    );
    let by_ceiling = get(&gw, &callers[2]).await;
    assert_eq!(by_ceiling.status(), 429);
    let (_, state) = items(&by_ceiling);
    assert!(
        state.starts_with("\"burst\";r=3, \"backend\";r=0;t="),
        "{state}"
    );

    // The ceiling's denial is remembered: a fresh caller's concurrent requests are refused by
    // the ceiling, with its wait, without a call to the ceiling's node and without charging
    // the caller's burst. (Charged first and given back, the burst's charge was seen by the
    // caller's other requests in the same batch, refused by the burst then: `Retry-After:
    // 86400`, a burst that never refills.)
    // The memory is repeated for a second at most: let it lapse, and let a refused request
    // ask the ceiling again, so that the burst below comes within the second.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(get(&gw, &callers[2]).await.status(), 429);
    for node in &cluster.nodes {
        node.reset_stats();
    }
    let fresh = &callers[3];
    let answers = futures_util::future::join_all((0..10).map(|_| get(&gw, fresh))).await;
    for answer in &answers {
        assert_eq!(answer.status(), 429);
        let retry: u64 = answer.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=120).contains(&retry), "within two windows: {retry}");
        let (_, state) = items(answer);
        assert!(
            state.starts_with("\"burst\";r=3, \"backend\";r=0;t="),
            "{state}"
        );
    }
    assert_eq!(
        cluster.nodes[ceiling_node].command_calls("evalsha"),
        0,
        "the ceiling's node is not asked"
    );
    let fresh_identity = format!("header:x-api-key:{fresh}");
    assert_eq!(
        remaining(&limits_of(&gw, &fresh_identity), "burst"),
        3,
        "never charged"
    );
    // Resetting the ceiling forgets its denial: the next request is admitted at once.
    reset(&gw, "global").await;
    assert_eq!(get(&gw, fresh).await.status(), 200);

    // One identity's limits share a hash tag: one EVALSHA per decision on the cluster too.
    for node in &cluster.nodes {
        node.reset_stats();
    }
    let http = client();
    for _ in 0..4 {
        let r = http
            .get(gw.url("/two/x"))
            .header("X-API-Key", "solo")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let calls: u64 = cluster
        .nodes
        .iter()
        .map(|n| n.command_calls("evalsha"))
        .sum();
    assert_eq!(calls, 4, "one EVALSHA per request");
}

/// On a cluster whose ceiling lies on another primary, a caller's own limits are charged
/// first and given back when the ceiling denies. The caller's concurrent requests must not
/// take that passing charge for a denial by their own limit: they are refused by the ceiling,
/// with its wait of a second, and once the ceiling has room the caller is admitted (its own
/// limit's denial, with an hour's wait, was remembered and repeated for the hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_concurrent_requests_never_take_a_charge_given_back_for_their_own_denial() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let hourly_and_ceiling = |r: Route| {
        r.bucket_limit("burst", 1, 277).limit(
            "backend",
            "identity = \"global\"\nalgorithm = \"token_bucket\"\ncapacity_micro = 1_000_000\nrefill_rate_micro_per_sec = 1_000_000",
        )
    };
    let gw = GatewayConfig::bare_cluster(&cluster.seed_urls())
        .server("threads", "2")
        // A denial in doubt waits for the give-back within the budget, and is answered as
        // it is when the budget runs out first (documented): a budget a loaded machine
        // cannot spend on a few milliseconds' work.
        .redis("timeout_ms", "1000")
        .upstream("app", &[up.addr()])
        .route(route(hourly_and_ceiling))
        .start();
    let callers = off_the_ceilings_node(&cluster, &gw);
    for round in callers.chunks(2) {
        let (other, fresh) = (&round[0], &round[1]);
        // The ceiling full (a second refills it), then spent by another caller; then eight
        // requests of a fresh caller at once.
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        assert_eq!(get(&gw, other).await.status(), 200, "{round:?}");
        let asked = std::time::Instant::now();
        let answers = futures_util::future::join_all((0..8).map(|_| get(&gw, fresh))).await;
        // A doubted denial waits and is decided again within the one budget (1 s), never
        // for a give-back's own 5 s: the round is over within the budget and some room.
        let took = asked.elapsed();
        assert!(took < Duration::from_millis(2_500), "{took:?}");
        for answer in &answers {
            assert_eq!(answer.status(), 429, "{round:?}");
            let retry = answer.headers()["retry-after"].to_str().unwrap().to_owned();
            assert!(
                retry == "1" || retry == "2",
                "the ceiling's wait, not the burst's hour: {retry} ({round:?})"
            );
        }
        assert_eq!(
            remaining(
                &limits_of(&gw, &format!("header:x-api-key:{fresh}")),
                "burst"
            ),
            1,
            "never charged"
        );
        // The ceiling has room again: the caller's own limit admits it.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_eq!(get(&gw, fresh).await.status(), 200, "{round:?}");
    }
    assert_eq!(
        gw.metric("sentinel_limit_denials_total{endpoint_id=\"e.api\",limit=\"burst\"}"),
        0.0
    );
}

/// On a cluster, while the ceiling's primary stalls and its breaker is open, a caller on another
/// primary is answered the ceiling's `circuit_open` after one read of its own limits: they
/// were charged and given back for every such request (two writes on a node that was fine).
/// A caller its own limits refuse still gets their 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_ceiling_whose_node_is_away_costs_the_callers_node_one_read() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let gw = ceiling_gateway(&cluster, &up).breaker(2, 60).start();
    let (ceiling_node, own_key) = ceiling_layout(&cluster);
    let mut callers = (0..200)
        .map(|i| format!("key-{i}"))
        .filter(|k| cluster.owner(&own_key(k)) != ceiling_node);
    let (caller, spent) = (callers.next().unwrap(), callers.next().unwrap());
    let caller_node = cluster.owner(&own_key(&caller));
    common::wait_until(Duration::from_secs(10), "the cluster to be usable", || {
        blocking_get(&gw.admin("/readyz")).is_some_and(|(s, _)| s == 200)
    });
    assert_eq!(total_over_keys(&gw, &[&spent], 3).await, [3]);
    assert_eq!(total_over_keys(&gw, &[&caller], 1).await, [1]);
    assert_eq!(get(&gw, &spent).await.status(), 429, "its burst is spent");

    // The ceiling's primary stalls: two timeouts open its breaker.
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(15_000)
        .arg("ALL")
        .query(&mut cluster.nodes[ceiling_node].conn())
        .unwrap();
    let circuit_open = "sentinel_decisions_total{allowed=\"false\",decision_reason=\"circuit_open\",endpoint_id=\"e.api\"}";
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while gw.metric(circuit_open) < 1.0 {
        assert_eq!(get(&gw, &caller).await.status(), 503);
        assert!(
            std::time::Instant::now() < deadline,
            "the ceiling's breaker never opened"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.nodes[caller_node].reset_stats();
    for _ in 0..3 {
        let answer = get(&gw, &caller).await;
        assert_eq!(answer.status(), 503);
    }
    assert_eq!(
        cluster.nodes[caller_node].command_calls("hset"),
        0,
        "the caller's limits were read, not charged and given back"
    );
    // Refused by its own limits, a caller gets their 429, not the ceiling's 503.
    assert_eq!(get(&gw, &spent).await.status(), 429);
}

/// On a cluster, a caller whose limits live on the ceiling's primary (other slots of it) is
/// decided in one call there, exactly: no charge of its burst for the ceiling to take back,
/// which its concurrent requests saw; and when a slot of the two moves, the decision is made
/// slot by slot, following the redirect, still exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_caller_on_the_ceilings_primary_is_decided_in_one_call() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let gw = ceiling_gateway(&cluster, &up).start();
    let (ceiling_node, own_key) = ceiling_layout(&cluster);
    let callers: Vec<String> = (0..200)
        .map(|i| format!("key-{i}"))
        .filter(|k| cluster.owner(&own_key(k)) == ceiling_node)
        .take(5)
        .collect();
    common::wait_until(Duration::from_secs(10), "the cluster to be usable", || {
        blocking_get(&gw.admin("/readyz")).is_some_and(|(s, _)| s == 200)
    });
    for node in &cluster.nodes {
        node.reset_stats();
    }
    let keys: Vec<&str> = callers[..3].iter().map(String::as_str).collect();
    assert_eq!(total_over_keys(&gw, &keys, 4).await, [3, 2, 0]);
    // One call a decision Redis made: 4 for the first caller (3 admitted, 1 by its burst),
    // 3 for the second (the ceiling's denial is then repeated by the gateway), 1 for the
    // third. Two calls in sequence would have made 3 x 2 + 1 + a read of the ceiling, and
    // charged and given back the others' bursts.
    let calls = cluster.nodes[ceiling_node].command_calls("evalsha");
    assert!((6..=8).contains(&calls), "{calls} calls");
    assert_eq!(
        cluster.nodes[ceiling_node].command_calls("hset"),
        10,
        "the 5 admissions wrote their 2 limits each, and nothing was given back"
    );
    for (i, node) in cluster.nodes.iter().enumerate() {
        if i != ceiling_node {
            assert_eq!(node.command_calls("evalsha"), 0, "node {i}");
        }
    }
    // A fresh caller's concurrent requests, the ceiling spent: each refused by the ceiling,
    // with its wait, and its burst untouched. (In two calls, a charge of the burst given
    // back a moment later was seen by the others, refused by the burst then: a wait of a
    // day, for a burst that never refills.)
    let fresh = &callers[3];
    let answers = futures_util::future::join_all((0..10).map(|_| get(&gw, fresh))).await;
    for answer in &answers {
        assert_eq!(answer.status(), 429);
        let retry = common::retry_after(answer);
        assert!((1..=120).contains(&retry), "within two windows: {retry}");
    }
    let fresh_identity = format!("header:x-api-key:{fresh}");
    assert_eq!(remaining(&limits_of(&gw, &fresh_identity), "burst"), 3);

    // The ceiling's denial is remembered for every caller: with the node stalled, a new
    // caller on it is still refused by the ceiling (its own limits' read times out), not
    // `fail_closed`. (The memory lasts a second: let it lapse, and renew it by a request
    // Redis refuses, so that the stall comes within the second.)
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(get(&gw, fresh).await.status(), 429);
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(500)
        .arg("ALL")
        .query(&mut cluster.nodes[ceiling_node].conn())
        .unwrap();
    let refused = get(&gw, &callers[4]).await;
    assert_eq!(refused.status(), 429);
    assert!(common::retry_after(&refused) >= 1);
    tokio::time::sleep(Duration::from_millis(600)).await;

    // The fresh caller's burst moves to another primary (its slot handed over, its key
    // with it) while the gateway's map still says the ceiling's: the call across slots
    // meets a key the node no longer serves, writes nothing, and the decision is made in
    // two calls, the first following the MOVED.
    reset(&gw, "global").await;
    let k = own_key(fresh);
    let slot = sentinel_gateway::store::slot(k.as_bytes());
    let to = (ceiling_node + 1) % 3;
    // The bucket exists once it was charged: one admitted request first.
    assert_eq!(get(&gw, fresh).await.status(), 200);
    cluster.migrate_key(slot, ceiling_node, to, &k);
    let to_id = cluster.node_id(to);
    for node in 0..3 {
        cluster.setslot(node, slot, &["NODE", &to_id]);
    }
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(get(&gw, fresh).await.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429], "its burst of 3, exactly");
    assert_eq!(remaining(&limits_of(&gw, "global"), "backend"), 2);
}

#[test]
fn check_prints_every_limit_and_refuses_mixed_or_duplicate_limits() {
    let dir = tempfile::tempdir().unwrap();
    let check = |route: &str| {
        common::check_body(
            dir.path(),
            &format!("[redis]\nurl = \"redis://127.0.0.1:1\"\n[upstreams.app]\naddrs = [\"127.0.0.1:1\"]\n{route}"),
            &[],
        )
    };
    let (success, out) = check(&route(ceiling).toml());
    assert!(success, "{out}");
    assert!(out.contains("2 limits, each must admit"), "{out}");
    assert!(
        out.contains("limit burst: token bucket of 3 requests"),
        "{out}"
    );
    assert!(
        out.contains(
            "limit backend: sliding window of 5 requests per 60 seconds, shared by all clients"
        ),
        "{out}"
    );

    let (success, out) =
        check(&route(|r| r.token_bucket(1_000_000, 0).bucket_limit("burst", 3, 0)).toml());
    assert!(
        !success && out.contains("is set beside [[routes.limits]]"),
        "{out}"
    );

    let (success, out) =
        check(&route(|r| r.bucket_limit("burst", 3, 0).bucket_limit("burst", 4, 0)).toml());
    assert!(
        !success && out.contains("limits[1].name = \"burst\" is used twice"),
        "{out}"
    );

    let (success, out) = check(&route(|r| {
            r.limit(
                "x",
                "identity = \"client_ip\"\nalgorithm = \"token_bucket\"\ncapacity_micro = 1_000\nrefill_rate_micro_per_sec = 0",
            )
        })
        .toml());
    assert!(!success, "{out}");
    assert!(
        out.contains("limits[0] (x).identity = \"client_ip\" is not supported"),
        "{out}"
    );
    assert!(
        out.contains("limits[0] (x).capacity_micro = 1000 can never admit"),
        "{out}"
    );
}

/// `/ocr`: burst 10 (no refill) and a 3-request ceiling window, charged by the pages the
/// upstream reports in `X-OCR-Pages` (one page = one request).
fn ocr() -> Route {
    Route::new("e.ocr")
        .prefix("/ocr")
        .identity_header("X-API-Key")
        .fail_closed()
        .set(
            "cost_from_response",
            "{ header = \"X-OCR-Pages\", unit_micro = 1_000_000 }",
        )
        .bucket_limit("pages", 10, 0)
}

async fn ocr_call(gw: &common::Gateway, key: &str, pages: &str) -> reqwest::Response {
    client()
        .get(gw.url("/ocr/doc"))
        .header("X-API-Key", key)
        .header("X-Demo-Reply-X-OCR-Pages", pages)
        .send()
        .await
        .unwrap()
}

fn ocr_remaining(gw: &common::Gateway, key: &str) -> i64 {
    let view = limits_of_route(gw, "e.ocr", &format!("header:x-api-key:{key}"));
    remaining(&view, "pages")
}

/// A reported cost is charged to every token-bucket limit that admitted the request, the
/// caller's own and a ceiling every caller shares alike, and not to a sliding window (which
/// counts requests), in one call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reported_cost_is_charged_to_every_token_bucket_and_no_window() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let route = ocr()
        .bucket_limit("daily", 100, 0)
        .limit(
            "hourly",
            "algorithm = \"sliding_window\"\nlimit = 50\nwindow_size_micro = 3_600_000_000",
        )
        .limit(
            "everyone",
            "identity = \"global\"\nalgorithm = \"token_bucket\"\ncapacity_micro = 1_000_000_000\nrefill_rate_micro_per_sec = 0",
        );
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(route)
        .start();
    let calls = redis.command_calls("evalsha");
    assert_eq!(ocr_call(&gw, "t", "4").await.status(), 200);
    common::wait_until(Duration::from_secs(2), "the charge", || {
        gw.metric("sentinel_response_charges_total{endpoint_id=\"e.ocr\",result=\"charged\"}")
            == 1.0
    });
    let mine = limits_of_route(&gw, "e.ocr", "header:x-api-key:t");
    // Admitted at a cost of 1, then 4 more charged to each bucket; the window counts the
    // request once.
    assert_eq!(remaining(&mine, "pages"), 10 - 1 - 4, "{mine}");
    assert_eq!(remaining(&mine, "daily"), 100 - 1 - 4, "{mine}");
    assert_eq!(remaining(&mine, "hourly"), 50 - 1, "{mine}");
    let everyone = limits_of_route(&gw, "e.ocr", "global");
    assert_eq!(remaining(&everyone, "everyone"), 1000 - 1 - 4, "{everyone}");
    // The decision and the charge: one call each.
    assert_eq!(redis.command_calls("evalsha") - calls, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_the_upstream_reports_is_charged_after_the_answer_and_may_go_into_debt() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(ocr())
        .start();
    // Admitted at a cost of 1, then 3 pages charged: 10 - 1 - 3.
    let r = ocr_call(&gw, "t", "3").await;
    assert_eq!(r.status(), 200);
    assert!(
        !r.headers().contains_key("x-ocr-pages"),
        "never shown to the client"
    );
    common::wait_until(Duration::from_secs(2), "the charge", || {
        gw.metric("sentinel_response_charges_total{endpoint_id=\"e.ocr\",result=\"charged\"}")
            == 1.0
    });
    assert_eq!(ocr_remaining(&gw, "t"), 6);
    // Malformed values charge nothing and are counted.
    for bad in ["-2", "two", "1.5", ""] {
        assert_eq!(ocr_call(&gw, "t", bad).await.status(), 200);
    }
    // Sent twice, the cost is not one number: nothing charged either.
    let twice = client()
        .get(gw.url("/ocr/doc"))
        .header("X-API-Key", "t")
        .header("X-Demo-Reply-X-OCR-Pages", "1")
        .header("X-Demo-Reply-X-OCR-Pages", "2")
        .send()
        .await
        .unwrap();
    assert_eq!(twice.status(), 200);
    assert!(!twice.headers().contains_key("x-ocr-pages"));
    common::wait_until(Duration::from_secs(2), "the invalid charges", || {
        gw.metric("sentinel_response_charges_total{endpoint_id=\"e.ocr\",result=\"invalid\"}")
            >= 5.0
    });
    assert_eq!(
        ocr_remaining(&gw, "t"),
        1,
        "five admissions of 1, nothing charged"
    );
    // A 30-page document: admitted (cost 1), then 30 charged: 1 - 1 - 30, held at -10.
    assert_eq!(ocr_call(&gw, "t", "30").await.status(), 200);
    common::wait_until(Duration::from_secs(2), "the big charge", || {
        ocr_remaining(&gw, "t") == -10
    });
    // In debt: denied, and the bucket never refills, so Retry-After is a day.
    let r = ocr_call(&gw, "t", "1").await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "86400");
}

/// The caller's next request is decided with the charge of the answer before it: sent on
/// the same connection the moment the answer came, or pipelined behind it. (Charged once the
/// answer had gone, the charge raced the next request, which was admitted on a bucket the
/// charge had emptied: every pipelined one, one in four sent at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_request_is_decided_with_the_charge_of_the_answer_before_it() {
    use std::io::{Read, Write};
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(ocr())
        .start();
    // One connection, kept alive: a 30-page document empties the burst of 10 into debt,
    // and the very next request on it, sent the moment the answer came, is refused. (A
    // client's pool may send it on another connection, which is not waited for.)
    let exchange = |conn: &mut std::net::TcpStream, key: &str, pages: &str| {
        let request = format!("GET /ocr/doc HTTP/1.1\r\nHost: gw\r\nX-API-Key: {key}\r\nX-Demo-Reply-X-OCR-Pages: {pages}\r\n\r\n");
        conn.write_all(request.as_bytes()).unwrap();
        let mut text = String::new();
        let mut buf = [0u8; 4096];
        while !text.contains("HTTP/1.1 ") || !text.ends_with('}') {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => text.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
        text.get(9..12).unwrap_or_default().to_owned()
    };
    for i in 0..10 {
        let key = format!("next-{i}");
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        assert_eq!(exchange(&mut conn, &key, "30"), "200", "{key}");
        assert_eq!(exchange(&mut conn, &key, "0"), "429", "{key}");
    }
    // Pipelined: two requests in one write; the second is decided after the first's charge.
    for i in 0..5 {
        let pipelined: String = ["30", "0"]
            .iter()
            .map(|pages| {
                format!("GET /ocr/doc HTTP/1.1\r\nHost: gw\r\nX-API-Key: pipe-{i}\r\nX-Demo-Reply-X-OCR-Pages: {pages}\r\n\r\n")
            })
            .collect();
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        conn.write_all(pipelined.as_bytes()).unwrap();
        let mut text = String::new();
        let mut buf = [0u8; 4096];
        while text.matches("HTTP/1.1 ").count() < 2 || !text.ends_with('}') {
            match conn.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => text.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
        let statuses: Vec<&str> = text
            .match_indices("HTTP/1.1 ")
            .map(|(at, _)| &text[at + 9..at + 12])
            .collect();
        assert_eq!(statuses, ["200", "429"], "{text}");
    }
    assert_eq!(
        gw.metric("sentinel_response_charges_total{endpoint_id=\"e.ocr\",result=\"charged\"}"),
        15.0
    );
}

/// A client that resets its connection while the upstream works is still charged the cost
/// the upstream reports: the upstream's answer is read though it can no longer be written.
#[test]
fn a_client_that_resets_its_connection_is_still_charged_the_reported_cost() {
    use std::io::Write;
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(ocr())
        .route(Route::new("e.plain").prefix("/plain").unlimited())
        .start();
    // Sent, then the connection reset (a zero linger) while the upstream works.
    let reset_while_proxied = |request: &[u8]| {
        let conn = std::net::TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
        (&conn).write_all(request).unwrap();
        std::thread::sleep(Duration::from_millis(150));
        socket2::SockRef::from(&conn)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(conn);
    };
    reset_while_proxied(b"GET /ocr/slow?ms=400 HTTP/1.1\r\nHost: gw\r\nX-API-Key: rst\r\nX-Demo-Reply-X-OCR-Pages: 4\r\n\r\n");
    common::wait_until(Duration::from_secs(3), "the charge", || {
        gw.metric("sentinel_response_charges_total{endpoint_id=\"e.ocr\",result=\"charged\"}")
            == 1.0
    });
    assert_eq!(ocr_remaining(&gw, "rst"), 10 - 1 - 4);
    // Logged and counted as a client that left: nothing reached it.
    assert_eq!(
        gw.metric("sentinel_requests_total{endpoint_id=\"e.ocr\",status=\"499\"}"),
        1.0
    );
    // A route that charges nothing is cut short by a reset as before: 499 long before the
    // upstream's answer (read through, it would count the upstream's 200 after 5 s).
    reset_while_proxied(b"GET /plain/slow?ms=5000 HTTP/1.1\r\nHost: gw\r\n\r\n");
    common::wait_until(Duration::from_secs(3), "the reset request's 499", || {
        gw.metric("sentinel_requests_total{endpoint_id=\"e.plain\",status=\"499\"}") == 1.0
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debt_is_paid_back_by_the_refill_and_retry_after_says_when() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(
            Route::new("e.ocr")
                .prefix("/ocr")
                .identity_header("X-API-Key")
                .fail_closed()
                .set(
                    "cost_from_response",
                    "{ header = \"X-OCR-Pages\", unit_micro = 1_000_000 }",
                )
                // 5 pages, refilled at one page a second.
                .token_bucket(5_000_000, 1_000_000),
        )
        .start();
    let started = std::time::Instant::now();
    assert_eq!(ocr_call(&gw, "t", "8").await.status(), 200);
    // 5 - 1 - 8 = -4: the next request (cost 1) waits until 1 is there, 5 s of refill.
    common::wait_until(Duration::from_secs(2), "the charge", || {
        gw.metric("sentinel_response_charges_total{endpoint_id=\"e.ocr\",result=\"charged\"}")
            == 1.0
    });
    let r = ocr_call(&gw, "t", "0").await;
    assert_eq!(r.status(), 429);
    let retry = common::retry_after(&r);
    let waited = started.elapsed().as_secs();
    assert!(
        (4u64.saturating_sub(waited)..=5).contains(&retry),
        "the debt of 4 and the cost of 1 at one a second: {retry}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charge_never_delays_the_answer_even_when_redis_is_gone() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(ocr().fail_open(100_000_000))
        .start();
    assert_eq!(ocr_call(&gw, "t", "1").await.status(), 200);
    // Its charge is sent after the answer: let it land before Redis is frozen.
    common::wait_until(Duration::from_secs(2), "the first charge", || {
        gw.metric("sentinel_response_charges_total{endpoint_id=\"e.ocr\",result=\"charged\"}")
            == 1.0
    });
    // Freeze Redis: decisions degrade (fail_open admits on the emergency bucket); no charge
    // is attempted for an admission Redis did not make, and no answer waits for one.
    redis.proc.signal("STOP");
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let r = ocr_call(&gw, "t", "2").await;
        assert_eq!(r.status(), 200);
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        assert!(!r.headers().contains_key("x-ocr-pages"));
    }
    redis.proc.signal("CONT");
    assert_eq!(
        gw.metric("sentinel_response_charges_total{endpoint_id=\"e.ocr\",result=\"charged\"}"),
        1.0
    );
}

/// A broken key among a decision's several (a ceiling's, here) is the one the log names, once
/// for all the callers it fails: an operator who deletes the key named clears it. (The log
/// named each caller's first key, which did not exist, once per caller.) Through the batch
/// script, and alone (`batch_max = 1`: the several-limits script of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_key_among_several_is_the_one_logged() {
    the_broken_key_among_several_is_logged(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_key_among_several_is_the_one_logged_without_batches() {
    the_broken_key_among_several_is_logged(Some("1")).await;
}

async fn the_broken_key_among_several_is_logged(batch_max: Option<&str>) {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let mut config = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(route(ceiling));
    if let Some(max) = batch_max {
        config = config.redis("batch_max", max);
    }
    let gw = config.start();
    let limits = ceiling_limits();
    let keys = limit_keys("sentinel", "header:x-api-key:a", "e.api", 1, &limits);
    let _: () = redis::cmd("SET")
        .arg(&keys[1])
        .arg("x")
        .query(&mut redis.conn())
        .unwrap();
    for caller in ["a", "b", "c"] {
        assert_eq!(get(&gw, caller).await.status(), 503, "fails closed");
    }
    let warned: Vec<String> = gw
        .logs()
        .lines()
        .filter(|l| l.contains("a bucket key holds data"))
        .map(str::to_owned)
        .collect();
    assert_eq!(warned.len(), 1, "once for every caller: {warned:?}");
    assert!(
        warned[0].contains(&keys[1]),
        "the ceiling's key: {warned:?}"
    );
    // Deleted as the log says, every caller is decided again.
    let _: () = redis::cmd("DEL")
        .arg(&keys[1])
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(get(&gw, "c").await.status(), 200);
}
