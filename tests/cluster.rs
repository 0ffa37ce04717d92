//! Redis Cluster: every key decided by the primary that owns it, MOVED and ASK followed
//! within the budget, a fleet of gateways exact on the cluster, and a dead primary that
//! costs only its own keys their fail mode.

mod common;

use std::time::{Duration, Instant};

use common::cluster::RedisCluster;
use common::config::{GatewayConfig, Route};
use common::{blocking_get, client, free_port, wait_until, Gateway, Upstream};
use sentinel_gateway::limiter::bucket_key;

fn key(tenant: &str, endpoint: &str) -> String {
    bucket_key(
        "sentinel",
        &format!("header:x-api-key:{tenant}"),
        endpoint,
        1,
    )
}

/// 3 requests per tenant (`x-api-key`) that never refill.
fn per_tenant(id: &str, path: &str) -> Route {
    Route::new(id)
        .path(path)
        .identity_header("x-api-key")
        .token_bucket(3_000_000, 0)
}

/// A gateway on the cluster, once it is connected to every primary.
fn start_gateway(seeds: &[String], upstream: &str) -> Gateway {
    connected(start_unchecked(seeds, upstream))
}

/// `gw`, once it is connected to every primary.
fn connected(gw: Gateway) -> Gateway {
    wait_until(
        Duration::from_secs(10),
        "the gateway to reach every primary",
        || {
            blocking_get(&gw.admin("/readyz")).is_some_and(|(_, body)| {
                body.contains(r#""redis":"up""#) && body.matches(r#""redis":"up""#).count() == 4
            })
        },
    );
    gw
}

/// A gateway with these seeds: `/open` (fail_open, with a fleet-wide emergency rate, so the
/// fleet heartbeat runs) and `/closed` (fail_closed), both 3 requests per tenant that never
/// refill; the breaker opens after 5 failures for 1 s.
fn start_unchecked(seeds: &[String], upstream: &str) -> Gateway {
    cluster_config(seeds, upstream).start()
}

/// [`start_unchecked`]'s config, to change before it starts.
fn cluster_config(seeds: &[String], upstream: &str) -> GatewayConfig {
    GatewayConfig::bare_cluster(seeds)
        .server("threads", "2")
        .redis("timeout_ms", "20")
        .breaker(5, 1)
        .upstream("app", &[upstream])
        .route(per_tenant("c.open", "/open").fail_open_fleet(1_000_000_000))
        .route(per_tenant("c.closed", "/closed").fail_closed())
}

/// Tenants whose bucket key for `endpoint` lives on each node: `per_node` for every node.
fn tenants_by_node(
    cluster: &RedisCluster,
    endpoint: &str,
    per_node: usize,
    tag: &str,
) -> Vec<Vec<String>> {
    let mut by_node = vec![Vec::new(); cluster.nodes.len()];
    let mut i = 0;
    while by_node.iter().any(|v: &Vec<String>| v.len() < per_node) {
        let tenant = format!("{tag}-{i}");
        let owner = cluster.owner(&key(&tenant, endpoint));
        if by_node[owner].len() < per_node {
            by_node[owner].push(tenant);
        }
        i += 1;
    }
    by_node
}

async fn get(path: &str, gw: &Gateway, tenant: &str) -> (u16, Option<String>) {
    let r = client()
        .get(gw.url(path))
        .header("x-api-key", tenant)
        .send()
        .await
        .expect("gateway answers");
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    (r.status().as_u16(), retry)
}

async fn statuses(path: &str, gw: &Gateway, tenant: &str, n: usize) -> Vec<u16> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(get(path, gw, tenant).await.0);
    }
    out
}

/// `tenant` asks `/closed` every 50 ms, answered 503 until one is 200 within `within` (else
/// `what` is said).
async fn admitted_within(gw: &Gateway, tenant: &str, within: Duration, what: &str) {
    let since = Instant::now();
    loop {
        let (status, _) = get("/closed", gw, tenant).await;
        if status == 200 {
            return;
        }
        assert_eq!(status, 503);
        assert!(since.elapsed() < within, "{what}: {}", gw.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn decisions(gw: &Gateway, endpoint: &str, reason: &str, allowed: bool) -> f64 {
    gw.metric(&format!(
        r#"sentinel_decisions_total{{allowed="{allowed}",decision_reason="{reason}",endpoint_id="{endpoint}"}}"#
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_lives_on_its_owner_and_a_dead_primary_costs_only_its_keys() {
    let mut cluster = RedisCluster::start();
    let up = Upstream::start("app");
    // One seed is enough: the gateway learns the other primaries from it.
    let gw = start_gateway(&cluster.seed_urls()[..1], &up.addr());
    let tenants = tenants_by_node(&cluster, "c.closed", 2, "t");

    // Healthy: every tenant on every node gets exactly its 3 requests, and its bucket is on
    // the node that owns the key and nowhere else.
    for (owner, list) in tenants.iter().enumerate() {
        for tenant in list {
            assert_eq!(
                statuses("/closed", &gw, tenant, 4).await,
                [200, 200, 200, 429]
            );
            for (i, node) in cluster.nodes.iter().enumerate() {
                let exists: bool = redis::cmd("EXISTS")
                    .arg(key(tenant, "c.closed"))
                    .query(&mut node.conn())
                    .unwrap_or(false);
                assert_eq!(exists, i == owner, "{tenant}'s bucket on node {i}");
            }
        }
    }
    let healthy_decisions = decisions(&gw, "c.closed", "allowed", true);
    assert_eq!(healthy_decisions, 18.0);

    // Node 1 dies.
    let dead = 1;
    cluster.kill(dead);
    let dead_node = format!("127.0.0.1:{}", cluster.nodes[dead].port);
    let fresh = tenants_by_node(&cluster, "c.closed", 1, "after");
    let fresh_open = tenants_by_node(&cluster, "c.open", 1, "after-open");
    // Its keys follow their fail mode, fast: fail_closed is a 503 with Retry-After, and
    // fail_open admits through the emergency limiter. Enough of them trip its breaker.
    for _ in 0..8 {
        let started = Instant::now();
        let (status, retry) = get("/closed", &gw, &fresh[dead][0]).await;
        // 20 ms budget; a refused connection fails at once. The bound is generous for a
        // loaded two-core machine; what it rules out is waiting on the dead node.
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(status, 503);
        assert!(retry.is_some_and(|r| r.parse::<u64>().unwrap() >= 1));
        assert_eq!(get("/open", &gw, &fresh_open[dead][0]).await.0, 200);
    }
    wait_until(
        Duration::from_secs(5),
        "the dead node's breaker to open",
        || {
            gw.metric(&format!(
                r#"sentinel_redis_node_breaker_state{{node="{dead_node}"}}"#
            )) == 1.0
        },
    );
    // The other nodes' keys are still decided by Redis, exactly.
    for owner in [0, 2] {
        let tenant = &fresh[owner][0];
        assert_eq!(
            statuses("/closed", &gw, tenant, 4).await,
            [200, 200, 200, 429],
            "{tenant} on node {owner}"
        );
        let tenant = &fresh_open[owner][0];
        assert_eq!(
            statuses("/open", &gw, tenant, 4).await,
            [200, 200, 200, 429],
            "{tenant} on node {owner}"
        );
    }
    for owner in [0, 2] {
        let node = format!("127.0.0.1:{}", cluster.nodes[owner].port);
        assert_eq!(
            gw.metric(&format!(
                r#"sentinel_redis_node_breaker_state{{node="{node}"}}"#
            )),
            0.0
        );
    }
    // The dead node's quarantine is 1 s: by now it may be half-open (its next request
    // probes). The process gauge shows its state, whichever, read in the same scrape.
    let (_, body) = common::blocking_get(&gw.admin("/metrics")).unwrap();
    let dead_state = common::metric_value(
        &body,
        &format!(r#"sentinel_redis_node_breaker_state{{node="{dead_node}"}}"#),
    );
    assert!(dead_state == 1.0 || dead_state == 2.0, "{dead_state}");
    assert_eq!(
        common::metric_value(&body, "sentinel_breaker_state"),
        dead_state,
        "the process gauge shows the worst node"
    );
    assert_eq!(
        decisions(&gw, "c.closed", "allowed", true),
        healthy_decisions + 6.0
    );
    let (_, ready) = blocking_get(&gw.admin("/readyz")).unwrap();
    assert!(
        ready.contains(&format!(
            r#"{{"breaker":"open","maxmemory_policy":"noeviction","node":"{dead_node}","redis":"down"}}"#
        )),
        "{ready}"
    );
    assert!(ready.contains(r#""redis":"down""#), "{ready}");
    // The dead node's keys: fail_closed denied with the table's reasons, fail_open admitted
    // with its cause, and nothing else.
    let closed_degraded = decisions(&gw, "c.closed", "fail_closed", false)
        + decisions(&gw, "c.closed", "circuit_open", false);
    assert_eq!(closed_degraded, 8.0);
    let open_admitted = decisions(&gw, "c.open", "redis_connection_error", true)
        + decisions(&gw, "c.open", "circuit_open", true);
    assert_eq!(open_admitted, 8.0);

    // Back: the node rejoins with its slots; after the quarantine the probe closes its
    // breaker and Redis decides its keys again (its data died with it: a fresh bucket).
    cluster.restart(dead);
    wait_until(
        Duration::from_secs(15),
        "the dead node's keys to be decided by Redis again",
        || {
            let rt = tokio::runtime::Handle::current();
            let status = std::thread::scope(|s| {
                s.spawn(|| rt.block_on(get("/closed", &gw, &fresh[dead][0])).0)
                    .join()
                    .unwrap()
            });
            status == 200
        },
    );
    assert_eq!(
        gw.metric(&format!(
            r#"sentinel_redis_node_breaker_state{{node="{dead_node}"}}"#
        )),
        0.0
    );
    assert_eq!(gw.metric("sentinel_breaker_state"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moved_and_ask_are_followed_and_the_bucket_moves_with_its_slot() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let gw = start_gateway(&cluster.seed_urls(), &up.addr());
    let tenant = "migrating";
    let k = key(tenant, "c.closed");
    let from = cluster.owner(&k);
    let to = (from + 1) % 3;
    assert_eq!(get("/closed", &gw, tenant).await.0, 200);

    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(&k)
        .query(&mut cluster.nodes[from].conn())
        .unwrap();
    // Mid-migration, the key already moved: the old owner answers ASK. The importing node
    // has lost its scripts too: the `NOSCRIPT` met behind `ASKING` is one reload and one
    // retry there, as anywhere.
    cluster.migrate_key(slot, from, to, &k);
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut cluster.nodes[to].conn())
        .unwrap();
    assert_eq!(
        get("/closed", &gw, tenant).await.0,
        200,
        "followed ASK to the importing node"
    );
    // Done: the slot is the new node's, and the old owner answers MOVED.
    let to_id = cluster.node_id(to);
    for node in 0..3 {
        cluster.setslot(node, slot, &["NODE", &to_id]);
    }
    assert_eq!(
        statuses("/closed", &gw, tenant, 2).await,
        [200, 429],
        "followed MOVED with the bucket"
    );
    assert_eq!(decisions(&gw, "c.closed", "allowed", true), 3.0);
    assert_eq!(decisions(&gw, "c.closed", "rate_limited", false), 1.0);
    let exists: bool = redis::cmd("EXISTS")
        .arg(&k)
        .query(&mut cluster.nodes[to].conn())
        .unwrap();
    assert!(exists, "the bucket lives on the new owner");
    for reason in [
        "redis_timeout",
        "redis_connection_error",
        "redis_noscript_retry",
        "fail_closed",
    ] {
        assert_eq!(decisions(&gw, "c.closed", reason, false), 0.0, "{reason}");
    }
    // The map follows the MOVED: another key of the slot goes straight to the new owner.
    let neighbour = (0..)
        .map(|i| format!("neighbour-{i}"))
        .find(|t| sentinel_gateway::store::slot(key(t, "c.closed").as_bytes()) == slot)
        .unwrap();
    let before = cluster.nodes[from].command_calls("evalsha");
    assert_eq!(get("/closed", &gw, &neighbour).await.0, 200);
    assert_eq!(cluster.nodes[from].command_calls("evalsha"), before);
    assert_eq!(decisions(&gw, "c.closed", "allowed", true), 4.0);
}

/// `tenant`'s `/closed` bucket, made by one request, then moved to the next primary while
/// its slot is still migrating there (its owner answers `ASK` for it): the key, its slot,
/// the owner and the node it moved to.
async fn moved_mid_migration(
    cluster: &RedisCluster,
    gw: &Gateway,
    tenant: &str,
) -> (String, u16, usize, usize) {
    let k = key(tenant, "c.closed");
    let from = cluster.owner(&k);
    let to = (from + 1) % 3;
    assert_eq!(get("/closed", gw, tenant).await.0, 200);
    let slot = sentinel_gateway::store::slot(k.as_bytes());
    cluster.migrate_key(slot, from, to, &k);
    (k, slot, from, to)
}

/// A slot being moved to a node that stalls: the decisions an `ASK` sends there time out and
/// count on that node's breaker, not on the owner's, which answered (the `ASK`): every other
/// key the owner holds keeps being decided. (The owner's breaker opened, and its every key
/// was refused for the quarantine.) Once that node's breaker is open, an `ASK` to it is its
/// short-circuit, answered at once (`circuit_open`), not a wait of the whole budget; after
/// the quarantine the next such call is its probe, which opens it again. (Every call went
/// on and waited the budget, and a breaker half-open stayed so: no redirected call probed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_importing_node_trips_its_own_breaker_not_the_owners() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let gw = start_gateway(&cluster.seed_urls(), &up.addr());
    let tenant = "moving";
    let (_, slot, from, to) = moved_mid_migration(&cluster, &gw, tenant).await;
    let other = tenants_by_node(&cluster, "c.closed", 4, "owner")[from]
        .iter()
        .find(|t| sentinel_gateway::store::slot(key(t, "c.closed").as_bytes()) != slot)
        .cloned()
        .unwrap();
    cluster.nodes[to].proc.signal("STOP");
    // Past the threshold of 5: each waits its budget at the stalled node.
    assert_eq!(statuses("/closed", &gw, tenant, 6).await, [503; 6]);
    let (_, ready) = blocking_get(&gw.admin("/readyz")).unwrap();
    let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
    let breaker_of = |i: usize| {
        let name = format!("127.0.0.1:{}", cluster.nodes[i].port);
        (ready["redis_nodes"].as_array().unwrap().iter())
            .find(|n| n["node"] == name)
            .map(|n| n["breaker"].clone())
    };
    assert_eq!(breaker_of(to), Some("open".into()), "{ready}");
    assert_eq!(breaker_of(from), Some("closed".into()), "{ready}");
    assert_eq!(
        get("/closed", &gw, &other).await.0,
        200,
        "the owner's other keys"
    );
    let closed = |reason| decisions(&gw, "c.closed", reason, false);
    assert_eq!(closed("fail_closed"), 5.0, "five waited the budget");
    assert_eq!(closed("circuit_open"), 1.0, "the sixth was not sent on");
    // The quarantine (1 s) over, the next redirected call probes the stalled node, fails,
    // and opens its breaker again: the one after is short-circuited.
    let transitions = |to: &str| {
        gw.metric(&format!(
            r#"sentinel_breaker_transitions_total{{to="{to}"}}"#
        ))
    };
    wait_until(Duration::from_secs(5), "half-open", || {
        transitions("half_open") >= 1.0
    });
    assert_eq!(statuses("/closed", &gw, tenant, 2).await, [503; 2]);
    assert_eq!(closed("fail_closed"), 6.0, "the probe waited the budget");
    assert_eq!(closed("circuit_open"), 2.0, "the next did not");
    assert_eq!(transitions("open"), 2.0, "opened again by the probe");
    cluster.nodes[to].proc.signal("CONT");
}

/// A slot migrating to a node outside the slot map (a primary without slots yet) that
/// dies: redirects that name it fail at once once its first attempt failed, each as a node
/// down fails, and its outage is said once. (Its link was made again at each refresh of
/// the map, which it is not in: dialled and said down again each time, about once a
/// second, and every redirected decision waited its whole budget for the new link.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_to_a_dead_node_outside_the_map_fails_at_once_and_is_said_once() {
    let mut cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let away = cluster.add_empty_node();
    // A budget far above a refused connection's few milliseconds.
    let gw = connected(
        cluster_config(&cluster.seed_urls()[..3], &up.addr())
            .redis("timeout_ms", "400")
            .breaker(1000, 1)
            .start(),
    );
    let tenant = "asked-away";
    let k = key(tenant, "c.closed");
    assert_eq!(get("/closed", &gw, tenant).await.0, 200);
    let slot = sentinel_gateway::store::slot(k.as_bytes());
    cluster.migrate_key(slot, cluster.owner(&k), away, &k);
    cluster.kill(away);
    let mut took = Vec::new();
    for _ in 0..8 {
        let asked = std::time::Instant::now();
        assert_eq!(get("/closed", &gw, tenant).await.0, 503);
        took.push(asked.elapsed());
        // Past the map's refreshes (every second while a node is not healthy).
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    // Generous for a loaded machine: the wait was the budget, 400 ms, each time.
    assert!(
        took[1..].iter().all(|t| *t < Duration::from_millis(200)),
        "{took:?}"
    );
    let node = format!("127.0.0.1:{}", cluster.nodes[away].port);
    let said = gw
        .logs()
        .lines()
        .filter(|l| l.contains("redis unavailable") && l.contains(&node))
        .count();
    assert_eq!(said, 1, "{}", gw.logs());
    assert_eq!(decisions(&gw, "c.closed", "fail_closed", false), 8.0);
    // The admin's read follows the same redirect, and fails at once there too (it waited
    // its whole second).
    let asked = std::time::Instant::now();
    let read = client()
        .get(gw.admin(&format!(
            "/limits/c.closed?identity=header%3Ax-api-key%3A{tenant}"
        )))
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 503);
    assert!(
        asked.elapsed() < Duration::from_millis(600),
        "{:?}",
        asked.elapsed()
    );
}

/// `/limits` follows `ASK` and `MOVED` as decisions do: mid-migration its read finds the
/// bucket where it went, and once the slot has moved its reset deletes it there. It answered
/// 503 for as long as a slot migrated, and logged nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admins_limits_follow_ask_and_moved() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let gw = start_gateway(&cluster.seed_urls(), &up.addr());
    let tenant = "admin-migrating";
    let (k, slot, _, to) = moved_mid_migration(&cluster, &gw, tenant).await;
    let limits = gw.admin(&format!(
        "/limits/c.closed?identity=header%3Ax-api-key%3A{tenant}"
    ));
    let read = client().get(&limits).send().await.unwrap();
    assert_eq!(read.status(), 200);
    let body: serde_json::Value = serde_json::from_str(&read.text().await.unwrap()).unwrap();
    assert_eq!(body["limits"][0]["remaining"], 2, "{body}");
    let to_id = cluster.node_id(to);
    for node in 0..3 {
        cluster.setslot(node, slot, &["NODE", &to_id]);
    }
    let reset = client().delete(&limits).send().await.unwrap();
    assert_eq!(reset.status(), 200);
    assert_eq!(
        reset.text().await.unwrap(),
        r#"{"keys_deleted":1,"reset":true}"#
    );
    let exists: bool = redis::cmd("EXISTS")
        .arg(&k)
        .query(&mut cluster.nodes[to].conn())
        .unwrap();
    assert!(!exists, "deleted on the new owner");
    assert!(!gw.logs().contains("admin: cannot"), "{}", gw.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_identities_at_once_are_each_decided_exactly_on_their_primaries() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    // Decisions in flight together on one primary are other identities', in other slots: one
    // call for them all would be CROSSSLOT. The 1 s budget as in the fleet test below.
    let gw = connected(
        cluster_config(&cluster.seed_urls(), &up.addr())
            .redis("timeout_ms", "1000")
            .start(),
    );
    let tenants: Vec<String> = (0..24).map(|i| format!("crowd-{i}")).collect();
    for round in 0..2 {
        let tasks: Vec<_> = tenants
            .iter()
            .map(|tenant| {
                let (url, tenant) = (gw.url("/closed"), tenant.clone());
                tokio::spawn(async move {
                    let http = client();
                    let mut seen = Vec::new();
                    for _ in 0..3 {
                        let r = http.get(&url).header("x-api-key", &tenant).send().await;
                        seen.push(r.expect("gateway answers").status().as_u16());
                    }
                    seen
                })
            })
            .collect();
        for (tenant, task) in tenants.iter().zip(tasks) {
            let want = if round == 0 {
                [200, 200, 200]
            } else {
                [429, 429, 429]
            };
            assert_eq!(task.await.unwrap(), want, "{tenant}, round {round}");
        }
    }
    assert_eq!(
        gw.metric(r#"sentinel_store_errors_total{cause="connection_error"}"#),
        0.0
    );
    assert_eq!(gw.metric("sentinel_breaker_state"), 0.0);
    assert_eq!(decisions(&gw, "c.closed", "allowed", true), 72.0);
    assert_eq!(decisions(&gw, "c.closed", "rate_limited", false), 72.0);
}

/// A burst on every primary at once: each primary's decisions in flight together go out in
/// batches on its own connection, though their keys lie in other slots of the node, and each
/// is decided exactly. (Each decision was one call of its own, answered through one thread
/// for the whole cluster: under such a burst the answers were read past the budget, the
/// breakers opened and decisions Redis had charged were answered 503.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_on_every_primary_is_decided_exactly_in_batches() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    // 40 requests per tenant; the budget is generous for a debug build sharing two cores
    // with the client of 450 connections: what is tested is exactness and batching, not speed.
    let gw = connected(
        GatewayConfig::bare_cluster(&cluster.seed_urls())
            .server("threads", "2")
            .redis("timeout_ms", "500")
            .upstream("app", &[&up.addr()])
            .route(
                Route::new("c.burst")
                    .path("/burst")
                    .identity_header("x-api-key")
                    .token_bucket(40_000_000, 0)
                    .fail_closed(),
            )
            .start(),
    );
    // Three tenants whose buckets live on each primary, in three slots of it.
    let owners = tenants_by_node(&cluster, "c.burst", 3, "burst");
    let tenants: Vec<String> = owners.into_iter().flatten().collect();
    let tasks: Vec<_> = tenants
        .iter()
        .flat_map(|tenant| (0..50).map(move |_| tenant.clone()))
        .map(|tenant| {
            let url = gw.url("/burst");
            tokio::spawn(async move {
                // 450 connections opened at once on a loaded machine: a connect can wait out
                // a dropped SYN or two (1 s, then 3 s more) before the gateway sees it.
                let client = common::client_builder()
                    .timeout(Duration::from_secs(30))
                    .build()
                    .unwrap();
                let r = client.get(&url).header("x-api-key", &tenant).send().await;
                (tenant, r.expect("gateway answers").status().as_u16())
            })
        })
        .collect();
    let mut seen = std::collections::BTreeMap::<(String, u16), usize>::new();
    for task in tasks {
        *seen.entry(task.await.unwrap()).or_default() += 1;
    }
    for tenant in &tenants {
        assert_eq!(seen.get(&(tenant.clone(), 200)), Some(&40), "{seen:?}");
        assert_eq!(seen.get(&(tenant.clone(), 429)), Some(&10), "{seen:?}");
    }
    assert_eq!(decisions(&gw, "c.burst", "allowed", true), 360.0);
    assert_eq!(
        gw.metric(r#"sentinel_breaker_transitions_total{to="open"}"#),
        0.0
    );
    // Every decision Redis made went in a batch, and batches carried several.
    let (sum, count) = (
        gw.metric("sentinel_redis_batch_size_sum"),
        gw.metric("sentinel_redis_batch_size_count"),
    );
    assert!(sum >= 360.0 && count < sum, "{count} batches of {sum}");
    let keys_per_node: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|n| redis::cmd("DBSIZE").query(&mut n.conn()).unwrap())
        .collect();
    assert_eq!(keys_per_node, [3, 3, 3], "each bucket on its own primary");
}

/// A Redis Cluster node's batch (`BATCH_CLUSTER_LUA`, its keys undeclared) meets a decision
/// whose slot is migrating away, one of its keys already moved: the node refuses it inside
/// the script, in the words the gateway reads as "not served here" (it then sends the
/// decision on its own, to be redirected), and none of its keys is written, a refund of two
/// limits included; the batch's other decision, in another slot of the node, is made.
#[test]
fn a_cluster_batch_writes_nothing_of_a_decision_whose_slot_is_migrating_away() {
    use sentinel_gateway::store::batch::Argv;
    use sentinel_gateway::store::script::BATCH_CLUSTER_LUA;
    let cluster = RedisCluster::start();
    let (a, b) = ("{mig}a", "{mig}b");
    let from = cluster.owner(a);
    let to = (from + 1) % 3;
    // Another key of the same node, in another slot.
    let other = (0..)
        .map(|i| format!("other-{i}"))
        .find(|k| {
            cluster.owner(k) == from
                && sentinel_gateway::store::slot(k.as_bytes())
                    != sentinel_gateway::store::slot(a.as_bytes())
        })
        .unwrap();
    let limit = [1u64, 5_000_000, 0, 1_000_000];
    let batch = |keys: &[&str], decisions: &[Vec<u64>]| -> String {
        let args = Argv::default()
            .of(decisions.iter().map(Vec::as_slice))
            .to_vec();
        redis::cmd("EVAL")
            .arg(BATCH_CLUSTER_LUA)
            .arg(0)
            .arg(keys.len())
            .arg(keys)
            .arg(args)
            .query(&mut cluster.nodes[from].conn())
            .expect("the batch script runs")
    };
    // Both limits of one decision charged once: both keys exist.
    let both = |mode: u64| [&[3, 2, mode][..], &limit, &limit].concat();
    let first = batch(&[a, b], &[both(0)]);
    assert!(!first.starts_with("E "), "{first}");
    let hash = |key: &str, node: usize| -> Vec<(String, String)> {
        redis::cmd("HGETALL")
            .arg(key)
            .query(&mut cluster.nodes[node].conn())
            .unwrap()
    };
    let before = hash(a, from);
    // Mid-migration: b has moved, a has not.
    cluster.migrate_key(sentinel_gateway::store::slot(a.as_bytes()), from, to, b);
    // A refund (mode 1) of both, then one decision of the other slot.
    let reply = batch(&[a, b, &other], &[both(1), limit.to_vec()]);
    let answers: Vec<&str> = reply.split('\n').collect();
    assert_eq!(answers.len(), 2, "{reply}");
    assert!(
        answers[0].starts_with("E ") && answers[0].contains("attempted to access a non local key"),
        "{reply}"
    );
    assert_eq!(hash(a, from), before, "a is not given back alone");
    assert!(
        sentinel_gateway::decision::ScriptReply::parse(answers[1].as_bytes())
            .is_some_and(|r| r.allowed),
        "{reply}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_a_cluster_admit_exactly_one_bucket() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    // Exact counts under load: a debug build's decision that misses a 20 ms budget on a busy
    // machine would be a 503 by design (and may still have spent), so the budget here is 1 s.
    let gateways: Vec<Gateway> = (0..3)
        .map(|i| {
            let seeds = &cluster.seed_urls()[i..=i];
            connected(
                cluster_config(seeds, &up.addr())
                    .redis("timeout_ms", "1000")
                    .start(),
            )
        })
        .collect();
    let urls: Vec<String> = gateways.iter().map(|g| g.url("/closed")).collect();
    let admitted = common::admitted_over(&urls, 30, 10, ("x-api-key", "shared")).await;
    assert_eq!(
        admitted, 3,
        "300 requests over three gateways admit exactly the bucket"
    );
    // The fleet heartbeat works on the cluster too: every gateway counts three.
    for gw in &gateways {
        wait_until(Duration::from_secs(10), "the fleet counted", || {
            gw.metric("sentinel_fleet_instances") == 3.0
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noscript_is_per_node_and_a_stalled_primary_times_out_only_its_own_keys() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let gw = start_gateway(&cluster.seed_urls(), &up.addr());
    let tenants = tenants_by_node(&cluster, "c.closed", 1, "s");
    for list in &tenants {
        assert_eq!(get("/closed", &gw, &list[0]).await.0, 200);
    }
    // NOSCRIPT is handled on the node that answers it: one SCRIPT LOAD there, same budget.
    let flushed = &cluster.nodes[0];
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut flushed.conn())
        .unwrap();
    let loads = flushed.command_calls("script|load");
    let fresh = tenants_by_node(&cluster, "c.closed", 1, "flushed");
    assert_eq!(get("/closed", &gw, &fresh[0][0]).await.0, 200);
    assert_eq!(flushed.command_calls("script|load"), loads + 1);
    assert_eq!(
        gw.metric(r#"sentinel_store_errors_total{cause="noscript"}"#),
        0.0
    );

    let stalled = 2;
    let paused = Instant::now();
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(3000)
        .arg("ALL")
        .query(&mut cluster.nodes[stalled].conn())
        .unwrap();
    // Two more each: the buckets hold three.
    for _ in 0..2 {
        let started = Instant::now();
        assert_eq!(get("/closed", &gw, &tenants[stalled][0]).await.0, 503);
        // The 20 ms budget, plus HTTP over loopback on a busy two-core machine.
        assert!(
            started.elapsed() < Duration::from_millis(300),
            "{:?}",
            started.elapsed()
        );
        for owner in [0, 1] {
            let started = Instant::now();
            assert_eq!(get("/closed", &gw, &tenants[owner][0]).await.0, 200);
            assert!(
                started.elapsed() < Duration::from_millis(300),
                "{:?}",
                started.elapsed()
            );
        }
    }
    assert_eq!(
        gw.metric(r#"sentinel_store_errors_total{cause="timeout"}"#),
        2.0
    );
    assert_eq!(decisions(&gw, "c.closed", "fail_closed", false), 2.0);
    assert_eq!(decisions(&gw, "c.closed", "allowed", true), 8.0);
    // When the pause ends, the primary runs the two decisions that waited in it: past their
    // deadlines, they write nothing, and the tenant still has the 2 it had.
    std::thread::sleep(Duration::from_millis(3_300).saturating_sub(paused.elapsed()));
    assert_eq!(
        statuses("/closed", &gw, &tenants[stalled][0], 3).await,
        [200, 200, 429]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_follows_new_seeds_and_asks_for_a_restart_to_leave_the_cluster() {
    let cluster = RedisCluster::start();
    let single = common::Redis::start();
    let up = Upstream::start("app");
    let gw = start_gateway(&cluster.seed_urls()[..1], &up.addr());
    assert_eq!(get("/closed", &gw, "reloaded").await.0, 200);
    let config = std::fs::read_to_string(&gw.config_path).unwrap();
    let seed = |i: usize| format!("\"{}\"", cluster.seed_urls()[i]);
    let http = client();

    // New seeds: the gateway discovers the same cluster from them; the bucket carries on.
    gw.rewrite_config(&config.replace(&seed(0), &format!("{}, {}", seed(1), seed(2))));
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"config_generation":2,"reloaded":true}"#
    );
    wait_until(Duration::from_secs(10), "the cluster rediscovered", || {
        blocking_get(&gw.admin("/readyz"))
            .is_some_and(|(_, body)| body.matches(r#""redis":"up""#).count() == 4)
    });
    assert_eq!(
        statuses("/closed", &gw, "reloaded", 3).await,
        [200, 200, 429]
    );

    // One Redis instead of the cluster: that needs a restart, and the cluster keeps deciding.
    let cluster_line = config
        .lines()
        .find(|l| l.starts_with("cluster_urls"))
        .unwrap();
    gw.rewrite_config(&config.replace(cluster_line, &format!("url = \"{}\"", single.url())));
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"config_generation":3,"reloaded":true,"restart_required":["redis.url"]}"#
    );
    assert_eq!(
        statuses("/closed", &gw, "after-restart-required", 4).await,
        [200, 200, 200, 429]
    );
    assert_eq!(single.command_calls("evalsha"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_seed_reachable_every_key_follows_its_fail_mode_at_once() {
    let up = Upstream::start("app");
    let nowhere = vec![format!("redis://127.0.0.1:{}", free_port())];
    let gw = start_unchecked(&nowhere, &up.addr());
    let (status, ready) = blocking_get(&gw.admin("/readyz")).unwrap();
    assert_eq!(
        status, 200,
        "Redis being down does not make the gateway unready"
    );
    assert!(ready.contains(r#""redis":"down""#), "{ready}");
    for tenant in ["a", "b", "c"] {
        let started = Instant::now();
        let (status, retry) = get("/closed", &gw, tenant).await;
        assert_eq!(status, 503);
        assert!(retry.is_some());
        assert_eq!(get("/open", &gw, tenant).await.0, 200);
        // No slot map: nothing to wait for. Generous for a loaded machine.
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "{:?}",
            started.elapsed()
        );
    }
    assert_eq!(decisions(&gw, "c.closed", "fail_closed", false), 3.0);
    assert_eq!(
        decisions(&gw, "c.open", "redis_connection_error", true),
        3.0
    );
    assert!(gw.logs().contains("cannot read the redis cluster slot map"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_replica_takes_over_its_dead_primarys_keys() {
    let mut cluster = RedisCluster::start_with_replicas(1);
    let up = Upstream::start("app");
    let gw = connected(start_unchecked(&cluster.seed_urls()[..1], &up.addr()));
    let tenant = "failover";
    let primary = cluster.owner(&key(tenant, "c.closed"));
    assert_eq!(get("/closed", &gw, tenant).await.0, 200);
    let dead_node = format!("127.0.0.1:{}", cluster.nodes[primary].port);
    cluster.kill(primary);
    let killed = Instant::now();
    // Its keys follow their fail mode until a replica is promoted (cluster-node-timeout 1 s
    // plus the election), then Redis decides them again on the new primary.
    let mut degraded = 0;
    loop {
        let (status, _) = get("/closed", &gw, tenant).await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 503);
        degraded += 1;
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "no replica took over: {}",
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(degraded > 0, "the primary's death was seen");
    let new_primary = cluster.owner(&key(tenant, "c.closed"));
    assert_ne!(new_primary, primary);
    let (_, ready) = blocking_get(&gw.admin("/readyz")).unwrap();
    assert!(
        !ready.contains(&dead_node),
        "the dead primary left the map: {ready}"
    );
    assert!(ready.contains(r#""redis":"up""#), "{ready}");
}

/// A primary hands its slots to its replica (`CLUSTER FAILOVER`) while its breaker is open
/// (its decisions timed out in a pause, as the handover's own pause makes them under load):
/// an open breaker sends nothing that would be answered `MOVED`, so the map is read again
/// when a primary's breaker opens and every second while one is not closed. The keys are
/// decided on the new primary within about a second, not at the next 5 s refresh or the end
/// of the old primary's 30 s quarantine, which ends, said and counted, as it leaves the map.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_hands_its_slots_over_while_its_breaker_is_open_is_left_soon() {
    let cluster = RedisCluster::start_with_replicas(1);
    let up = Upstream::start("app");
    let gw = GatewayConfig::bare_cluster(&cluster.seed_urls())
        .server("threads", "2")
        .redis("timeout_ms", "50")
        .breaker(1, 30)
        .upstream("app", &[&up.addr()])
        .route(per_tenant("c.closed", "/closed").fail_closed())
        .start();
    let gw = connected(gw);
    let tenant = "handover";
    let primary = cluster.owner(&key(tenant, "c.closed"));
    assert_eq!(get("/closed", &gw, tenant).await.0, 200);
    // Past the first refreshes of a start (every second until every primary is connected):
    // the map is now read every 5 s.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let _: () = redis::cmd("CLIENT")
        .arg(&["PAUSE", "300", "WRITE"])
        .query(&mut cluster.nodes[primary].conn())
        .unwrap();
    assert_eq!(get("/closed", &gw, tenant).await.0, 503, "timed out");
    assert_eq!(
        get("/closed", &gw, tenant).await.0,
        503,
        "the breaker is open"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let port = cluster.nodes[primary].port;
    let replica = (0..cluster.nodes.len())
        .find(|&i| {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query(&mut cluster.nodes[i].conn())
                .unwrap();
            info.contains(&format!("master_port:{port}\r"))
        })
        .expect("the primary's replica");
    let _: () = redis::cmd("CLUSTER")
        .arg("FAILOVER")
        .query(&mut cluster.nodes[replica].conn())
        .unwrap();
    wait_until(Duration::from_secs(10), "the replica to take over", || {
        cluster.owner(&key(tenant, "c.closed")) == replica
    });
    admitted_within(
        &gw,
        tenant,
        Duration::from_millis(2_500),
        "the keys stayed with the old primary's open breaker",
    )
    .await;
    // The old primary's quarantine ended when it left the map: every opening has its end in
    // the counter and the log.
    let transitions = |to: &str| {
        gw.metric(&format!(
            "sentinel_breaker_transitions_total{{to=\"{to}\"}}"
        ))
    };
    assert_eq!(transitions("open"), 1.0);
    assert_eq!(transitions("closed"), 1.0, "{}", gw.logs());
    assert_eq!(gw.metric("sentinel_breaker_state"), 0.0);
    assert!(
        gw.logs()
            .contains("the node left the gateway's map of the cluster"),
        "{}",
        gw.logs()
    );
}

/// A node that says its cluster is down (`CLUSTERDOWN`) opens its own breaker, as any
/// failure of its answers does; once it says the cluster is whole again, its quarantine
/// ends within about a second, not after `open_seconds`: the node answered all along (before,
/// its keys were refused for the rest of the 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_whole_again_ends_the_quarantine_its_clusterdown_opened() {
    let cluster = RedisCluster::start();
    // As an ACL user with the documented permissions alone (`CLUSTER INFO` is not among
    // them: the node is asked by a read of a key of its own).
    for i in 0..cluster.nodes.len() {
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("gw")
            .arg(
                "on >pw-gw-0123 ~sentinel:* resetchannels &sentinel:v1:resets* -@all \
                 +evalsha +script|load +time +hmget +hset +expire +pexpire +persist +del \
                 +publish +subscribe +config|get +ping +cluster|slots +asking +pubsub|numsub"
                    .split_whitespace()
                    .collect::<Vec<_>>(),
            )
            .query(&mut cluster.nodes[i].conn())
            .unwrap();
    }
    let up = Upstream::start("app");
    let gw = GatewayConfig::bare_cluster(&cluster.seed_urls())
        .server("threads", "2")
        .redis("timeout_ms", "50")
        .redis("username", "\"gw\"")
        .redis("password_env", "\"TEST_REDIS_PASSWORD\"")
        .breaker(3, 30)
        .upstream("app", &[&up.addr()])
        .route(per_tenant("c.closed", "/closed").fail_closed())
        .start_with_env(&[("TEST_REDIS_PASSWORD", "pw-gw-0123")]);
    let gw = connected(gw);
    let tenants = tenants_by_node(&cluster, "c.closed", 4, "whole");
    let down = 0;
    let mut node = cluster.nodes[down].conn();
    let state = |node: &mut redis::Connection| -> String {
        redis::cmd("CLUSTER").arg("INFO").query(node).unwrap()
    };
    // One of its own slots taken from the node's own view: with full coverage required, the
    // node says the whole cluster is down; the other nodes still own their keys.
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "cluster-require-full-coverage", "yes"])
        .query(&mut node)
        .unwrap();
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key(&tenants[down][3], "c.closed"))
        .query(&mut node)
        .unwrap();
    // The slot taken from (or given back to) the node's view, and the cluster's state it
    // then says.
    let slot_to = |node: &mut redis::Connection, how: &str, then: &str| {
        let _: () = redis::cmd("CLUSTER")
            .arg(how)
            .arg(slot)
            .query(node)
            .unwrap();
        wait_until(Duration::from_secs(5), then, || {
            state(node).contains(&format!("cluster_state:{then}"))
        });
    };
    slot_to(&mut node, "DELSLOTS", "fail");
    for _ in 0..3 {
        assert_eq!(get("/closed", &gw, &tenants[down][0]).await.0, 503);
    }
    assert_eq!(
        gw.metric(r#"sentinel_breaker_transitions_total{to="open"}"#),
        1.0,
        "three CLUSTERDOWN replies open the node's breaker: {}",
        gw.logs()
    );
    assert_eq!(decisions(&gw, "c.closed", "circuit_open", false), 0.0);
    assert_eq!(get("/closed", &gw, &tenants[down][1]).await.0, 503);
    assert_eq!(decisions(&gw, "c.closed", "circuit_open", false), 1.0);
    assert_eq!(
        get("/closed", &gw, &tenants[1][0]).await.0,
        200,
        "another node's keys are decided"
    );

    slot_to(&mut node, "ADDSLOTS", "ok");
    // The map is read every second while a breaker is open; a loaded machine may add a
    // little to the node's answer.
    admitted_within(
        &gw,
        &tenants[down][2],
        Duration::from_secs(4),
        "the node's keys stayed refused for its quarantine",
    )
    .await;
    assert!(
        gw.logs().contains("redis cluster is whole again"),
        "{}",
        gw.logs()
    );
    assert_eq!(
        gw.metric(r#"sentinel_breaker_transitions_total{to="closed"}"#),
        1.0
    );
}

/// A cluster none of whose seeds answers (down, or refusing the password) before any slot
/// map was read: each decision fails at once as a connection error and is counted, and each
/// failed attempt to read the map counts against a breaker, which opens as one Redis's does
/// (before, no error was counted and no breaker ever opened); seeds that answer close it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_never_reached_counts_its_failures_and_opens_the_breaker() {
    let up = Upstream::start("app");
    let nowhere = format!("redis://127.0.0.1:{}", free_port());
    // Three failed reads of the map (one a second) open the breaker; a quarantine long
    // enough that no reader of `/metrics` sees it half-open in this test.
    let gw = GatewayConfig::bare_cluster(std::slice::from_ref(&nowhere))
        .breaker(3, 30)
        .upstream("app", &[up.addr()])
        .route(per_tenant("c.closed", "/closed"))
        .start();
    assert_eq!(get("/closed", &gw, "t").await.0, 503);
    // Decided by its fail mode as a connection error and counted as one (or, on a machine so
    // slow that the breaker opened first, short-circuited and not counted).
    let failed = decisions(&gw, "c.closed", "fail_closed", false);
    assert_eq!(
        failed + decisions(&gw, "c.closed", "circuit_open", false),
        1.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_store_errors_total{cause="connection_error"}"#),
        failed,
        "each decision that found no map is a store error"
    );
    wait_until(Duration::from_secs(10), "the breaker to open", || {
        gw.metric(r#"sentinel_breaker_transitions_total{to="open"}"#) >= 1.0
    });
    assert_eq!(gw.metric("sentinel_breaker_state"), 1.0);
    assert_eq!(get("/closed", &gw, "t").await.0, 503);
    assert!(
        decisions(&gw, "c.closed", "circuit_open", false) >= 1.0,
        "an open breaker short-circuits: {}",
        gw.logs()
    );
    // Seeds that answer: the map is read, the breaker closes, Redis decides.
    let cluster = RedisCluster::start();
    let config = std::fs::read_to_string(&gw.config_path).unwrap();
    gw.rewrite_config(&config.replace(&nowhere, &cluster.seed_urls()[0]));
    assert_eq!(gw.reload(), 200);
    wait_until(Duration::from_secs(10), "the breaker to close", || {
        gw.metric("sentinel_breaker_state") == 0.0
    });
    let began = Instant::now();
    while get("/closed", &gw, "t").await.0 != 200 {
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "no decision by Redis: {}",
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinel_redis_url_overrides_cluster_urls_too() {
    let redis = common::Redis::start();
    let up = Upstream::start("app");
    let nowhere = format!("redis://127.0.0.1:{}", free_port());
    let gw = GatewayConfig::bare_cluster(&[nowhere])
        .upstream("app", &[up.addr()])
        .route(per_tenant("c.closed", "/closed"))
        .start_with_env(&[("SENTINEL_REDIS_URL", &redis.url())]);
    assert_eq!(
        statuses("/closed", &gw, "env", 4).await,
        [200, 200, 200, 429],
        "decided by the Redis of SENTINEL_REDIS_URL"
    );
    assert_eq!(redis.keys("sentinel:v1:*").len(), 1);
    assert!(gw.logs().contains("it overrides redis.cluster_urls"));
}

/// On a cluster, a reset on one gateway reaches another's over-limit cache before the
/// DELETE is answered: the listeners subscribe on the primary serving the channel's slot,
/// where the announcement is published, and the announcer waits for the listeners of every
/// primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_on_one_gateway_is_heard_by_the_others_on_a_cluster() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let config = GatewayConfig::bare_cluster(&cluster.seed_urls())
        .server("threads", "2")
        .redis("timeout_ms", "1000")
        .upstream("app", &[up.addr()])
        .route(
            Route::new("c.slow")
                .path("/api")
                .identity_header("x-api-key")
                .token_bucket(2_000_000, 10_000),
        );
    let (one, two) = (config.start(), config.start());
    for round in 0..10 {
        let who = format!("t{round}");
        assert_eq!(
            [
                one.status_for("/api", &who).await,
                one.status_for("/api", &who).await
            ],
            [200, 200]
        );
        assert_eq!(
            [
                two.status_for("/api", &who).await,
                two.status_for("/api", &who).await
            ],
            [429, 429]
        );
        assert_eq!(one.reset_key("c.slow", &who).await, 200);
        assert_eq!(
            [
                two.status_for("/api", &who).await,
                two.status_for("/api", &who).await,
                two.status_for("/api", &who).await
            ],
            [200, 200, 429],
            "round {round}: the next request starts full"
        );
    }
}

/// `require_noeviction` at start reads the policy of every primary of the slot map, where the
/// buckets are, not of the seeds: an evicting primary that is no seed refuses the start,
/// named in the message, and a replica given as the only seed is not what is checked
/// (before, the seeds were, so whether the gateway started hung on which hosts were listed).
#[test]
fn the_start_checks_every_primarys_eviction_policy_not_the_seeds() {
    let cluster = RedisCluster::start_with_replicas(1);
    let up = Upstream::start("app");
    let is_primary = |i: usize| {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut cluster.nodes[i].conn())
            .unwrap();
        info.contains("role:master")
    };
    let (primaries, replicas): (Vec<usize>, Vec<usize>) =
        (0..cluster.nodes.len()).partition(|&i| is_primary(i));
    let policy = |i: usize, p: &str| {
        let _: () = redis::cmd("CONFIG")
            .arg(&["SET", "maxmemory-policy", p])
            .query(&mut cluster.nodes[i].conn())
            .unwrap();
    };
    let seed = |i: usize| vec![format!("redis://127.0.0.1:{}", cluster.nodes[i].port)];

    let evicting = primaries[0];
    policy(evicting, "allkeys-lru");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    let (port, admin) = (free_port(), free_port());
    let config = cluster_config(&seed(primaries[1]), &up.addr());
    std::fs::write(&path, config.render(port, admin)).unwrap();
    let out = common::run_binary(
        &[std::ffi::OsStr::new("--config"), path.as_os_str()],
        &[("SENTINEL_REDIS_URL", None)],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let named = format!(
        "redis maxmemory-policy is allkeys-lru on 127.0.0.1:{}",
        cluster.nodes[evicting].port
    );
    assert!(stderr.contains(&named), "{stderr}");

    // Without the check, the evicting primary is named in `/readyz`, the others too.
    let gw = cluster_config(&seed(primaries[1]), &up.addr())
        .redis("require_noeviction", "false")
        .start();
    let gw = connected(gw);
    let (_, ready) = blocking_get(&gw.admin("/readyz")).unwrap();
    let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
    assert_eq!(ready["redis_maxmemory_policy"], "allkeys-lru", "{ready}");
    let nodes = ready["redis_nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), primaries.len(), "{ready}");
    for node in nodes {
        let evicts = node["node"] == format!("127.0.0.1:{}", cluster.nodes[evicting].port);
        let expected = if evicts { "allkeys-lru" } else { "noeviction" };
        assert_eq!(node["maxmemory_policy"], expected, "{ready}");
    }
    drop(gw);

    policy(evicting, "noeviction");
    policy(replicas[0], "allkeys-lru");
    let gw = cluster_config(&seed(replicas[0]), &up.addr()).start();
    connected(gw);
}

/// `check --redis` with one seed reads every primary of the slot map it gives, one line
/// each, as the gateway would connect to them.
#[test]
fn check_redis_reads_every_primary_of_the_slot_map() {
    let cluster = RedisCluster::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let config = cluster_config(&cluster.seed_urls()[..1], &up.addr());
    let (code, stdout, lines) = common::check_redis(dir.path(), &config, &[]);
    assert_eq!(code, Some(0), "{stdout}");
    let mut nodes: Vec<&str> = (lines.iter())
        .map(|l| {
            assert!(l.contains(": ok: "), "{l}");
            l.split(": ").next().unwrap()
        })
        .collect();
    nodes.sort();
    let mut expected: Vec<String> = (cluster.nodes.iter())
        .map(|n| format!("redis 127.0.0.1:{}", n.port))
        .collect();
    expected.sort();
    assert_eq!(nodes, expected);
}
