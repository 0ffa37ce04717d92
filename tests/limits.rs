//! `/limits` on the admin listener: an identity's buckets read without writing, and reset so
//! its next request starts full (the over-limit cache forgets it too).

mod common;

use common::config::{GatewayConfig, Route};
use std::time::{Duration, Instant};

use common::fault::FaultProxy;
use common::{client, Redis, Upstream};
use sentinel_gateway::limiter::{bucket_key, identity_hash};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_reads_and_resets_one_identitys_buckets() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(
            Route::new("l.tb")
                .prefix("/tb")
                .identity_header("X-API-Key")
                .token_bucket(3_000_000, 10_000),
        )
        .route(
            Route::new("l.sw")
                .prefix("/sw")
                .identity_header("X-API-Key")
                .sliding_window(5, 60_000_000),
        )
        .start();
    let http = client();
    let send = |path: &'static str| {
        let (http, url) = (http.clone(), gw.url(path));
        async move {
            http.get(url)
                .header("X-API-Key", "k+1")
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    let limits = |method: &str, endpoint: &str, query: &str| {
        let req = http.request(
            method.parse().unwrap(),
            gw.admin(&format!("/limits/{endpoint}{query}")),
        );
        async move {
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            (
                status,
                serde_json::from_str::<Value>(&r.text().await.unwrap()).unwrap(),
            )
        }
    };
    let who = "?identity=header%3Ax-api-key%3Ak%2B1";
    let hash = identity_hash("header:x-api-key:k+1");
    assert_eq!([send("/tb").await, send("/tb").await], [200, 200]);
    let key = bucket_key("sentinel", "header:x-api-key:k+1", "l.tb", 1);
    let before: Vec<String> = redis::cmd("HGETALL")
        .arg(&key)
        .query(&mut redis.conn())
        .unwrap();
    redis.reset_stats();
    let (status, body) = limits("GET", "l.tb", who).await;
    assert_eq!(status, 200);
    assert_eq!(body["endpoint_id"], "l.tb");
    assert_eq!(body["identity_hash"], hash.as_str());
    assert_eq!(body["tier"], Value::Null);
    let l = &body["limits"][0];
    assert_eq!(
        (&l["name"], &l["algorithm"]),
        (&json!("default"), &json!("token_bucket"))
    );
    assert_eq!((&l["remaining"], &l["capacity"]), (&json!(1), &json!(3)));
    let reset = l["reset_seconds"].as_u64().unwrap();
    assert!(
        (199..=201).contains(&reset),
        "two tokens at 0.01 per second: {reset}"
    );
    let after: Vec<String> = redis::cmd("HGETALL")
        .arg(&key)
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(before, after, "read without writing");
    assert_eq!(redis.command_calls("evalsha"), 0);

    let (_, fresh) = limits("GET", "l.tb", "?identity=header%3Ax-api-key%3Anever").await;
    assert_eq!(
        (
            &fresh["limits"][0]["remaining"],
            &fresh["limits"][0]["reset_seconds"]
        ),
        (&json!(3), &json!(0)),
        "a bucket never used reads full"
    );
    assert!(
        redis.keys("sentinel:*").len() == 1,
        "and nothing was created"
    );

    assert_eq!([send("/sw").await, send("/sw").await], [200, 200]);
    let (_, sw) = limits("GET", "l.sw", who).await;
    let l = &sw["limits"][0];
    assert_eq!(
        (&l["algorithm"], &l["remaining"], &l["capacity"]),
        (&json!("sliding_window"), &json!(3), &json!(5))
    );
    assert!(l["reset_seconds"].as_u64().unwrap() <= 120);

    // A bucket the limiter cannot read (its decisions fail) is not read as full: 503, and
    // a WARN naming the key. Its reset deletes it.
    let sw_key = bucket_key("sentinel", "header:x-api-key:k+1", "l.sw", 1);
    let _: () = redis::cmd("HSET")
        .arg(&sw_key)
        .arg("c")
        .arg("x7")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(send("/sw").await, 503, "the script cannot read it either");
    assert_eq!(
        limits("GET", "l.sw", who).await,
        (503, json!({"detail": "rate limiter unavailable"}))
    );
    assert!(
        gw.logs()
            .lines()
            .any(|l| l.contains("admin: cannot read a bucket")
                && l.contains(&sw_key)
                && l.contains("field c is not a number the limiter wrote")),
        "{}",
        gw.logs()
    );
    assert_eq!(
        limits("DELETE", "l.sw", who).await,
        (200, json!({"reset": true, "keys_deleted": 1}))
    );
    assert_eq!(
        limits("GET", "l.sw", who).await.1["limits"][0]["remaining"],
        5
    );

    // Exhausted, denied from the over-limit cache, reset: the next request is admitted.
    assert_eq!(
        [send("/tb").await, send("/tb").await, send("/tb").await],
        [200, 429, 429]
    );
    let (status, body) = limits("DELETE", "l.tb", who).await;
    assert_eq!(
        (status, body),
        (200, json!({"reset": true, "keys_deleted": 1}))
    );
    assert_eq!(send("/tb").await, 200, "starts full");
    assert_eq!(
        gw.logs()
            .lines()
            .filter(|l| l.contains("limits reset")
                && l.contains(hash.as_str())
                && l.contains("\"l.tb\""))
            .count(),
        1
    );
    assert!(!gw.logs().contains("k+1"), "never the raw identity");

    assert_eq!(
        limits("GET", "l.nope", who).await,
        (404, json!({"detail": "no such endpoint"}))
    );
    // The endpoint id is percent-decoded, as a client may write any of its characters.
    assert_eq!(limits("GET", "l%2Etb", who).await.0, 200);
    assert_eq!(limits("GET", "l.tb", "").await.0, 400);
    assert_eq!(limits("POST", "l.tb", who).await.0, 405);
    // A malformed identity is refused, saying why, rather than read some other way.
    for (query, why) in [
        (
            "?identity=%ZZ",
            "identity is not percent-encoded: a % must be followed by two hex digits (%25 for a %)",
        ),
        ("?identity=a&identity=b", "identity is sent more than once"),
        // A parameter it does not take (a typo of `tier` read as the default tier).
        (
            "?identity=header%3Ax-api-key%3Ak&Tier=pro",
            "unknown query parameter \"Tier\": /limits takes identity and tier",
        ),
        // One no request to the endpoint is keyed by (the raw key, another header) would
        // read as a full bucket and reset nothing.
        (
            "?identity=k%2B1",
            "no request to l.tb is keyed by this identity: its callers are header:x-api-key:<value>",
        ),
        (
            "?identity=header%3Ax-other%3Ak%2B1",
            "no request to l.tb is keyed by this identity: its callers are header:x-api-key:<value>",
        ),
        (
            "?identity=%FF%FE",
            "identity is not UTF-8 once percent-decoded",
        ),
        // Values no request can carry: past the 1024 bytes a header identity may have, or
        // with a NUL in it.
        (
            &format!("?identity=header%3Ax-api-key%3A{}", "k".repeat(1025)),
            "no request to l.tb is keyed by this identity: its callers are header:x-api-key:<value>",
        ),
        (
            "?identity=header%3Ax-api-key%3Ak%00",
            "no request to l.tb is keyed by this identity: its callers are header:x-api-key:<value>",
        ),
    ] {
        for method in ["GET", "DELETE"] {
            assert_eq!(
                limits(method, "l.tb", query).await,
                (400, json!({ "detail": why })),
                "{method} {query}"
            );
        }
    }
}

/// A reload that lowers a token bucket's capacity holds the callers who already have a
/// bucket to it at once, whether the bucket refills or not (one that never refilled kept the
/// tokens it held above the new capacity, and spent them all).
/// A `DELETE` after a reload changed `policy_version` deletes the buckets of the current
/// version, which the requests now spend; the old version's are left to expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_deletes_the_current_policy_versions_buckets() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let config = |version: u64| {
        GatewayConfig::new(&redis.url())
            .upstream("app", &[up.addr()])
            .route(
                Route::new("l.v")
                    .prefix("/v")
                    .identity_header("X-API-Key")
                    .token_bucket(2_000_000, 0)
                    .policy_version(version),
            )
    };
    let gw = config(1).start();
    let send = || client().get(gw.url("/v")).header("X-API-Key", "k").send();
    let identity = "header:x-api-key:k";
    assert_eq!(send().await.unwrap().status(), 200);
    gw.rewrite_config(&config(2).render(gw.port, gw.admin_port));
    assert_eq!(gw.reload(), 200);
    // A new version starts full: two more.
    assert_eq!(send().await.unwrap().status(), 200);
    assert_eq!(send().await.unwrap().status(), 200);
    assert_eq!(send().await.unwrap().status(), 429);
    let r = client()
        .delete(gw.admin("/limits/l.v?identity=header%3Ax-api-key%3Ak"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(body["keys_deleted"], 1, "{body}");
    assert_eq!(
        redis.keys("sentinel:*"),
        vec![bucket_key("sentinel", identity, "l.v", 1)],
        "the old version's bucket is left"
    );
    assert_eq!(send().await.unwrap().status(), 200, "full again");
}

/// `/limits` counts in whole requests at the route's cost, rounded down: 7 tokens at a cost
/// of 2 are a capacity of 3; after one request 5 tokens are 2 requests left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_are_read_in_whole_requests_at_the_routes_cost() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(
            Route::new("l.cost")
                .prefix("/cost")
                .identity_header("X-API-Key")
                .token_bucket(7_000_000, 0)
                .set("cost_micro", "2_000_000"),
        )
        .start();
    let r = client()
        .get(gw.url("/cost"))
        .header("X-API-Key", "k")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (status, body) =
        common::blocking_get(&gw.admin("/limits/l.cost?identity=header%3Ax-api-key%3Ak")).unwrap();
    assert_eq!(status, 200, "{body}");
    let view: Value = serde_json::from_str(&body).unwrap();
    let l = &view["limits"][0];
    assert_eq!(
        (&l["remaining"], &l["capacity"]),
        (&json!(2), &json!(3)),
        "{view}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_lowers_a_capacity_holds_existing_buckets_to_it() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let config = |capacity: u64, refill: u64| {
        GatewayConfig::new(&redis.url())
            .upstream("app", &[up.addr()])
            .route(
                Route::new("q.never")
                    .prefix("/never")
                    .identity_header("X-Key")
                    .fail_closed()
                    .token_bucket(capacity * 1_000_000, 0),
            )
            .route(
                Route::new("q.slow")
                    .prefix("/slow")
                    .identity_header("X-Key")
                    .fail_closed()
                    .token_bucket(capacity * 1_000_000, refill),
            )
    };
    let gw = config(10, 1).start();
    let http = client();
    let admitted = |path: &'static str, n: usize| {
        let (http, gw) = (&http, &gw);
        async move {
            let mut ok = 0;
            for _ in 0..n {
                let r = http
                    .get(gw.url(path))
                    .header("X-Key", "k")
                    .send()
                    .await
                    .unwrap();
                ok += usize::from(r.status() == 200);
            }
            ok
        }
    };
    assert_eq!(admitted("/never/x", 2).await, 2);
    assert_eq!(admitted("/slow/x", 2).await, 2);
    gw.rewrite_config(&config(3, 1).render(gw.port, gw.admin_port));
    assert_eq!(gw.reload(), 200);
    assert_eq!(
        admitted("/never/x", 10).await,
        3,
        "the new capacity, not the 8 left"
    );
    assert_eq!(admitted("/slow/x", 10).await, 3);
}

/// The resets' route: two requests a key, then one every 100 s (a denial is remembered
/// for long enough to be seen).
fn two_a_key() -> Route {
    Route::new("l.tb")
        .prefix("/tb")
        .identity_header("X-API-Key")
        .token_bucket(2_000_000, 10_000)
}

/// Two gateways of the resets' route: the first spent key `k`'s bucket, the second was
/// denied it once, remembers the denial and listens for resets (the only listener: the first
/// has no reason to).
async fn two_gateways_the_second_listening(
    redis: &Redis,
    up: &Upstream,
) -> (common::Gateway, common::Gateway) {
    let config = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(two_a_key());
    let (one, two) = (config.start(), config.start());
    for _ in 0..2 {
        assert_eq!(one.status_for("/tb", "k").await, 200);
    }
    assert_eq!(two.status_for("/tb", "k").await, 429);
    common::wait_until(Duration::from_secs(5), "one listener", || {
        let subscribers: (String, i64) = redis::cmd("PUBSUB")
            .arg(&["NUMSUB", "sentinel:v1:resets"])
            .query(&mut redis.conn())
            .unwrap();
        subscribers.1 == 1
    });
    (one, two)
}

/// A reset on one gateway reaches the others' over-limit caches: a gateway that remembered
/// the identity's denial admits its next request, where it repeated the denial for the
/// bucket's whole wait (100 s here) before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_on_one_gateway_is_heard_by_the_others() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let (one, two) = two_gateways_the_second_listening(&redis, &up).await;
    assert_eq!(two.status_for("/tb", "k").await, 429);
    assert_eq!(
        two.metric(r#"sentinel_overlimit_cache_hits_total{endpoint_id="l.tb"}"#),
        1.0,
        "the second denial was the remembered one"
    );
    let listener = || -> String {
        let clients: String = redis::cmd("CLIENT")
            .arg(&["LIST", "TYPE", "pubsub"])
            .query(&mut redis.conn())
            .unwrap();
        clients.split(' ').next().unwrap_or_default().to_owned()
    };
    let first = listener();
    for round in 0..20 {
        assert_eq!(one.reset_key("l.tb", "k").await, 200);
        assert_eq!(
            [
                two.status_for("/tb", "k").await,
                two.status_for("/tb", "k").await,
                two.status_for("/tb", "k").await
            ],
            [200, 200, 429],
            "round {round}: the next request starts full"
        );
    }
    // Its connection answers the pings it gets every 5 s: the same subscription stays.
    tokio::time::sleep(std::time::Duration::from_millis(6_500)).await;
    assert_eq!(listener(), first, "still listening on the same connection");
    assert!(first.starts_with("id="), "{first}");
}

/// A reset's answer says how many gateways remembering denials said in time that they forgot
/// the identity (`x-sentinel-gateways-heard: <heard>/<listening>`), and one that did not (its
/// process stopped, its subscription still open in Redis: a connection silently lost looks
/// the same until its next ping) is a WARN: the reset was answered 200 without a sign before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_says_how_many_gateways_heard_it() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let (one, two) = two_gateways_the_second_listening(&redis, &up).await;
    let reset = || async {
        let r = client()
            .delete(one.admin("/limits/l.tb?identity=header%3Ax-api-key%3Ak"))
            .send()
            .await
            .expect("the admin answers");
        let heard = r.headers().get("x-sentinel-gateways-heard").cloned();
        (
            r.status().as_u16(),
            heard.map(|h| h.to_str().unwrap().to_owned()),
        )
    };
    // Its answer has a quarter of a second: a loaded machine may take longer once.
    let mut heard = Vec::new();
    for _ in 0..3 {
        heard.push(reset().await);
        if heard.last() == Some(&(200, Some("1/1".to_owned()))) {
            break;
        }
    }
    assert_eq!(
        heard.last(),
        Some(&(200, Some("1/1".to_owned()))),
        "{heard:?}"
    );
    // The listener remembers the denial again, then stops answering.
    for _ in 0..2 {
        assert_eq!(two.status_for("/tb", "k").await, 200);
    }
    assert_eq!(two.status_for("/tb", "k").await, 429);
    two.proc.signal("STOP");
    let stopped = reset().await;
    two.proc.signal("CONT");
    assert_eq!(stopped, (200, Some("0/1".to_owned())));
    // One line a reset: the last one, a WARN.
    let logs = one.logs();
    let lines: Vec<&str> = (logs.lines())
        .filter(|l| l.contains("limits reset from the admin listener"))
        .collect();
    assert_eq!(lines.len(), heard.len() + 1, "{logs}");
    let warned = lines.last().unwrap();
    assert!(
        warned.contains("not every gateway remembering denials said it heard the reset"),
        "{warned}"
    );
    assert!(warned.contains(r#""level":"WARN""#), "{warned}");
    assert!(warned.contains(r#""gateways_listening":1"#), "{warned}");
    assert!(warned.contains(r#""gateways_heard":0"#), "{warned}");
}

/// Once the fault proxy has taken no new connection for 300 ms: the gateway's decisions
/// have their connection (it moves to the proxy's workers at the first decision).
async fn settled(proxy: &FaultProxy) {
    let (began, mut seen, mut still) = (Instant::now(), proxy.accepted(), Instant::now());
    while still.elapsed() < Duration::from_millis(300) {
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "connections keep coming"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        if proxy.accepted() != seen {
            (seen, still) = (proxy.accepted(), Instant::now());
        }
    }
}

/// A gateway's first remembered denial makes it listen for resets, on a connection of its
/// own; that denial is answered once it listens (within the budget), so that a reset made as
/// soon as the client has it is heard there. Here the listening connection's commands reach
/// Redis 150 ms late: before, the reset found no listener, and the gateway repeated the
/// denial for its whole wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_remembered_denial_is_answered_once_its_gateway_listens() {
    let redis = Redis::start();
    let proxy = FaultProxy::start(redis.port);
    let up = Upstream::start("app");
    let config = |url: &str| {
        GatewayConfig::new(url)
            .redis("timeout_ms", "1000")
            .upstream("app", &[up.addr()])
            .route(two_a_key())
    };
    let (one, two) = (config(&redis.url()).start(), config(&proxy.url()).start());
    // The second gateway's decisions have their connection (made at the first one): once
    // the fault proxy has taken no new connection for 300 ms.
    assert_eq!(two.status_for("/tb", "warm").await, 200);
    settled(&proxy).await;
    proxy.slow_new(Duration::from_millis(150));
    assert_eq!(
        [
            one.status_for("/tb", "k").await,
            one.status_for("/tb", "k").await
        ],
        [200, 200]
    );
    let asked = Instant::now();
    assert_eq!(two.status_for("/tb", "k").await, 429);
    assert!(
        asked.elapsed() >= Duration::from_millis(150),
        "answered before the gateway listened: {:?}",
        asked.elapsed()
    );
    assert_eq!(one.reset_key("l.tb", "k").await, 200);
    assert_eq!(
        two.status_for("/tb", "k").await,
        200,
        "the next request starts full"
    );
    // Listening now: a denial is answered at once.
    assert_eq!(two.status_for("/tb", "k").await, 200);
    let asked = Instant::now();
    assert_eq!(two.status_for("/tb", "k").await, 429);
    assert!(asked.elapsed() < Duration::from_millis(150));
}

/// The first denial's wait for the listener is the budget's: a subscription slower than it
/// (its commands reach Redis 600 ms late here, the budget is 50 ms) does not hold the 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_denials_wait_for_the_listener_ends_with_the_budget() {
    let redis = Redis::start();
    let proxy = FaultProxy::start(redis.port);
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&proxy.url())
        .redis("timeout_ms", "50")
        .upstream("app", &[up.addr()])
        .route(two_a_key())
        .start();
    assert_eq!(gw.status_for("/tb", "warm").await, 200);
    settled(&proxy).await;
    proxy.slow_new(Duration::from_millis(600));
    assert_eq!(
        [
            gw.status_for("/tb", "k").await,
            gw.status_for("/tb", "k").await
        ],
        [200, 200]
    );
    let asked = Instant::now();
    assert_eq!(gw.status_for("/tb", "k").await, 429);
    // 50 ms of budget; the rest is a loaded machine's slack, far below the 600 ms.
    assert!(
        asked.elapsed() < Duration::from_millis(400),
        "the 429 waited past the budget: {:?}",
        asked.elapsed()
    );
}
