//! Redis Sentinel against the binary: a real master, its replica and a sentinel. The
//! gateway asks the sentinel for the master, decides on it, and follows a failover after the
//! master is killed (`kill -9`): decisions are Redis's again within a few seconds of the
//! promotion, on the promoted replica, and `/readyz` names it.

mod common;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::config::{quoted, GatewayConfig, Route};
use common::tls::Ca;
use common::{blocking_get, client, free_port, wait_until, Proc, Redis, Upstream};

/// A sentinel monitoring `master_port` as `mymaster`, quorum 1, down after 1 s; with
/// `password`, the sentinel itself requires it.
fn sentinel(master_port: u16, dir: &std::path::Path) -> (Proc, u16) {
    sentinel_with(master_port, dir, None)
}

fn sentinel_with(master_port: u16, dir: &std::path::Path, password: Option<&str>) -> (Proc, u16) {
    let auth = password.map_or(String::new(), |p| format!("requirepass {p}\n"));
    sentinel_conf(master_port, dir, password, &auth)
}

/// A sentinel as [`sentinel_with`], with `extra` lines in its config; its plain port.
fn sentinel_conf(
    master_port: u16,
    dir: &std::path::Path,
    password: Option<&str>,
    extra: &str,
) -> (Proc, u16) {
    let port = free_port();
    let conf = dir.join("sentinel.conf");
    let url = match password {
        Some(p) => format!("redis://:{p}@127.0.0.1:{port}"),
        None => format!("redis://127.0.0.1:{port}"),
    };
    std::fs::write(
        &conf,
        format!(
            "port {port}\nbind 127.0.0.1\ndir {}\n{extra}sentinel monitor mymaster 127.0.0.1 {master_port} 1\nsentinel down-after-milliseconds mymaster 1000\nsentinel failover-timeout mymaster 5000\nsentinel parallel-syncs mymaster 1\n",
            dir.display()
        ),
    )
    .unwrap();
    let child = Command::new("redis-server")
        .arg(&conf)
        .arg("--sentinel")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server --sentinel starts");
    let proc = Proc {
        child,
        name: "redis-sentinel",
    };
    wait_until(
        Duration::from_secs(10),
        "the sentinel to know the master",
        || {
            redis::Client::open(url.as_str())
                .ok()
                .and_then(|c| c.get_connection().ok())
                .and_then(|mut c| {
                    redis::cmd("SENTINEL")
                        .arg("get-master-addr-by-name")
                        .arg("mymaster")
                        .query::<Option<(String, u16)>>(&mut c)
                        .ok()
                        .flatten()
                })
                .is_some()
        },
    );
    (proc, port)
}

/// A master and its replica, once the replica has synced.
/// Waits until `replica` has synced with its master (a connection it resets meanwhile is
/// tried again).
fn wait_for_sync(replica: &Redis) {
    wait_until(Duration::from_secs(10), "the replica to sync", || {
        let info: String = replica
            .try_conn()
            .and_then(|mut c| redis::cmd("INFO").arg("replication").query(&mut c).ok())
            .unwrap_or_default();
        info.contains("master_link_status:up")
    });
}

fn replicated() -> (Redis, Redis) {
    let master = Redis::start();
    let replica = Redis::start_with(
        free_port(),
        &["--replicaof", "127.0.0.1", &master.port.to_string()],
    );
    wait_for_sync(&replica);
    (master, replica)
}

/// A gateway on the master `sentinel_port`'s sentinel names, with one limited route: 3
/// requests per `X-API-Key`, never refilled, fail_closed.
fn gateway(sentinel_port: u16, up: &Upstream, password: Option<&str>) -> common::Gateway {
    gateway_on(on_sentinel(sentinel_port), up, password)
}

/// 3 requests per `X-API-Key`, never refilled, fail_closed.
fn api_route() -> Route {
    Route::new("s.api")
        .prefix("/api")
        .identity_header("X-API-Key")
        .token_bucket(3_000_000, 0)
        .fail_closed()
}

/// The same on `config`.
fn gateway_on(config: GatewayConfig, up: &Upstream, password: Option<&str>) -> common::Gateway {
    let mut config = config.upstream("app", &[up.addr()]).route(api_route());
    let gw = match password {
        None => config.start(),
        Some(p) => {
            config = config.redis("sentinel_password_env", quoted("TEST_SENTINEL_PASSWORD"));
            config.start_with_env(&[("TEST_SENTINEL_PASSWORD", p)])
        }
    };
    // Until the master's connection is up, routes follow their fail modes (contract
    // section 4); the tests start from a connected gateway.
    common::wait_until(Duration::from_secs(5), "the master connected", || {
        readyz(&gw)["redis"] == "up"
    });
    gw
}

/// A config whose Redis is the master `sentinel_port`'s sentinel names as `mymaster`.
fn on_sentinel(sentinel_port: u16) -> GatewayConfig {
    on_sentinel_at(&format!("redis://127.0.0.1:{sentinel_port}"))
}

/// The same, with the sentinel at `url` (`rediss://` for TLS).
fn on_sentinel_at(url: &str) -> GatewayConfig {
    sentinel_quarantine(url, 1)
}

/// On the sentinel at `url`, the breaker open `open_seconds` after 3 failures.
fn sentinel_quarantine(url: &str, open_seconds: u64) -> GatewayConfig {
    GatewayConfig::empty()
        .server("threads", "2")
        .redis("timeout_ms", "50")
        .redis("sentinel_urls", format!("[{}]", quoted(url)))
        .redis("sentinel_master", quoted("mymaster"))
        .breaker(3, open_seconds)
}

async fn statuses(gw: &common::Gateway, key: &str, n: usize) -> Vec<u16> {
    let http = client();
    let mut out = Vec::new();
    for _ in 0..n {
        let r = http
            .get(gw.url("/api/x"))
            .header("X-API-Key", key)
            .send()
            .await
            .unwrap();
        out.push(r.status().as_u16());
    }
    out
}

/// Whether `key`'s first request is admitted (Redis decides again) within about 5 s.
async fn admitted_within_5_s(gw: &common::Gateway, key: &str) -> bool {
    for _ in 0..50 {
        if statuses(gw, key, 1).await == [200] {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

fn readyz(gw: &common::Gateway) -> serde_json::Value {
    let (_, body) = blocking_get(&gw.admin("/readyz")).unwrap();
    serde_json::from_str(&body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_decides_on_the_master_and_follows_a_failover() {
    let (mut master, replica) = replicated();
    let dir = tempfile::tempdir().unwrap();
    let (_sentinel, sentinel_port) = sentinel(master.port, dir.path());
    let up = Upstream::start("app");
    // The default quarantine (30 s): the old master's failures open the breaker, and the new
    // master is still asked within seconds of its promotion.
    let sentinel_url = format!("redis://127.0.0.1:{sentinel_port}");
    let gw = gateway_on(sentinel_quarantine(&sentinel_url, 30), &up, None);
    assert_eq!(statuses(&gw, "a", 4).await, [200, 200, 200, 429]);
    assert_eq!(
        readyz(&gw)["redis_sentinel_master"]["addr"],
        format!("127.0.0.1:{}", master.port)
    );
    assert!(master.limiter_calls() >= 4, "decided on the master");

    // Traffic all through the outage: requests find the old master gone.
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (stop, url) = (Arc::clone(&stop), gw.url("/api/x"));
        tokio::spawn(async move {
            let http = client();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let _ = http
                    .get(&url)
                    .header("X-API-Key", format!("outage-{i}"))
                    .send()
                    .await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    // The master dies; the sentinel promotes the replica.
    master.proc.signal("KILL");
    master.proc.wait_exit(Duration::from_secs(5));
    let killed = Instant::now();
    wait_until(Duration::from_secs(20), "the promotion", || {
        // A connection the replica resets while it takes over is tried again.
        replica
            .try_conn()
            .and_then(|mut c| redis::cmd("ROLE").query::<redis::Value>(&mut c).ok())
            .is_some_and(|v| format!("{v:?}").contains("master"))
    });
    let promoted = Instant::now();
    stop.store(true, Ordering::Relaxed);
    traffic.await.unwrap();
    assert!(
        gw.metric(r#"sentinel_breaker_transitions_total{to="open"}"#) >= 1.0,
        "the requests to the dead master opened the breaker"
    );
    // Decisions are Redis's again soon after: a new caller's exact sequence.
    let mut recovered = None;
    while promoted.elapsed() < Duration::from_secs(10) {
        if statuses(&gw, "probe", 1).await == [200] {
            recovered = Some(promoted.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let recovered = recovered.expect("decisions on the promoted replica");
    // About 2 s are promised; 5 s here leaves room for a loaded machine.
    assert!(
        recovered < Duration::from_secs(5),
        "{recovered:?} after the promotion ({:?} after the kill)",
        killed.elapsed()
    );
    assert_eq!(statuses(&gw, "b", 4).await, [200, 200, 200, 429]);
    assert_eq!(
        readyz(&gw)["redis_sentinel_master"]["addr"],
        format!("127.0.0.1:{}", replica.port)
    );
    assert!(
        replica.limiter_calls() >= 4,
        "decided on the promoted replica"
    );
    // The bucket of `a` was replicated before the kill: still exhausted.
    assert_eq!(statuses(&gw, "a", 1).await, [429]);
}

/// A manual failover (`SENTINEL FAILOVER`) while the old master stays up, with a sentinel
/// that requires a password (`sentinel_password_env`): the gateway follows the switch, by the
/// `+switch-master` message or the old master's READONLY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_failover_is_followed_through_a_password_protected_sentinel() {
    let (master, replica) = replicated();
    let dir = tempfile::tempdir().unwrap();
    let (_sentinel, sentinel_port) = sentinel_with(master.port, dir.path(), Some("s3ntinel-pw"));
    let up = Upstream::start("app");
    let gw = gateway(sentinel_port, &up, Some("s3ntinel-pw"));
    assert_eq!(statuses(&gw, "a", 4).await, [200, 200, 200, 429]);
    let mut sentinel_conn =
        redis::Client::open(format!("redis://:s3ntinel-pw@127.0.0.1:{sentinel_port}"))
            .unwrap()
            .get_connection()
            .unwrap();
    // The sentinel must have discovered the replica before it can promote it.
    wait_until(Duration::from_secs(15), "the sentinel to fail over", || {
        redis::cmd("SENTINEL")
            .arg("FAILOVER")
            .arg("mymaster")
            .query::<String>(&mut sentinel_conn)
            .is_ok()
    });
    wait_until(
        Duration::from_secs(20),
        "the gateway on the promoted replica",
        || readyz(&gw)["redis_sentinel_master"]["addr"] == format!("127.0.0.1:{}", replica.port),
    );
    let recovered = admitted_within_5_s(&gw, "b").await;
    assert!(recovered, "decisions on the new master");
    assert_eq!(statuses(&gw, "b", 3).await, [200, 200, 429]);
    assert!(replica.limiter_calls() >= 3);
}

/// The master is swapped by hand, without a failover of the sentinel's (so no
/// `+switch-master` is published): the replica becomes a master, the old master its replica,
/// and the sentinel is pointed at the new one. The gateway learns it from the old master's
/// `READONLY` and the sentinel's answer; meanwhile the fail_closed route admits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_demoted_without_a_failover_is_left_for_the_one_the_sentinel_names() {
    let (master, replica) = replicated();
    let dir = tempfile::tempdir().unwrap();
    let (_sentinel, sentinel_port) = sentinel(master.port, dir.path());
    let up = Upstream::start("app");
    let gw = gateway(sentinel_port, &up, None);
    assert_eq!(statuses(&gw, "a", 4).await, [200, 200, 200, 429]);
    // Replication is asynchronous: the bucket of `a` must be on the replica before the swap,
    // or the new master starts it afresh (what the last assertion below relies on). A write
    // of this connection's own, acknowledged by the replica, comes after the gateway's in the
    // replication stream.
    let mut fence = master.conn();
    let _: () = redis::cmd("SET")
        .arg(&["test:fence", "1"])
        .query(&mut fence)
        .unwrap();
    let acked: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(2000)
        .query(&mut fence)
        .unwrap();
    assert_eq!(acked, 1, "the replica acknowledged the writes");

    let role = |conn: &mut redis::Connection, args: &[&str]| {
        let _: () = redis::cmd("REPLICAOF").arg(args).query(conn).unwrap();
    };
    role(&mut replica.conn(), &["NO", "ONE"]);
    role(
        &mut master.conn(),
        &["127.0.0.1", &replica.port.to_string()],
    );
    // The old master answers READONLY now: fail_closed, never an admission.
    let meanwhile = statuses(&gw, "m", 5).await;
    assert!(
        meanwhile.iter().all(|s| *s == 503 || *s == 200),
        "{meanwhile:?}"
    );
    // The sentinel still names it: its role is checked again, and the log says what it is
    // (it said READONLY alone, and the node stayed the master in use without a word).
    wait_until(Duration::from_secs(5), "the demoted master named", || {
        gw.logs().lines().any(|l| {
            l.contains("no sentinel names a reachable master")
                && l.contains("which does not answer as a master")
        })
    });
    let mut sentinel_conn = redis::Client::open(format!("redis://127.0.0.1:{sentinel_port}"))
        .unwrap()
        .get_connection()
        .unwrap();
    let _: () = redis::cmd("SENTINEL")
        .arg(&["REMOVE", "mymaster"])
        .query(&mut sentinel_conn)
        .unwrap();
    let _: () = redis::cmd("SENTINEL")
        .arg(&[
            "MONITOR",
            "mymaster",
            "127.0.0.1",
            &replica.port.to_string(),
            "1",
        ])
        .query(&mut sentinel_conn)
        .unwrap();
    let pointed = Instant::now();
    wait_until(
        Duration::from_secs(10),
        "the gateway on the new master",
        || readyz(&gw)["redis_sentinel_master"]["addr"] == format!("127.0.0.1:{}", replica.port),
    );
    // Asked every second and at every READONLY: about 2 s are promised.
    assert!(
        pointed.elapsed() < Duration::from_secs(5),
        "{:?}",
        pointed.elapsed()
    );
    let recovered = admitted_within_5_s(&gw, "b").await;
    assert!(recovered, "decisions on the new master");
    assert_eq!(statuses(&gw, "b", 3).await, [200, 200, 429]);
    // The bucket of `a` was replicated before the swap: still exhausted.
    assert_eq!(statuses(&gw, "a", 1).await, [429]);
    let logs = gw.logs();
    assert!(logs.contains("READONLY"), "the reason is logged: {logs}");
}

/// The master in use is demoted (a replica of another node now) while the sentinel still
/// names it, and its connections are killed: the connection made again at once finds by
/// `ROLE` that the node is a replica, is refused with why, and no decision is sent to it;
/// promoted again, it is connected to and decided on. (The gateway connected to it again and
/// decided on it until its first `READONLY`, `/readyz` saying up.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_master_connected_again_at_once_is_refused_by_its_role() {
    let (master, other) = (Redis::start(), Redis::start());
    let dir = tempfile::tempdir().unwrap();
    let (_sentinel, sentinel_port) = sentinel(master.port, dir.path());
    let up = Upstream::start("app");
    let gw = gateway(sentinel_port, &up, None);
    assert_eq!(statuses(&gw, "a", 1).await, [200]);
    let replicaof = |args: &[&str]| {
        let _: () = redis::cmd("REPLICAOF")
            .arg(args)
            .query(&mut master.conn())
            .unwrap();
    };
    replicaof(&["127.0.0.1", &other.port.to_string()]);
    let killed: i64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal"])
        .query(&mut master.conn())
        .unwrap();
    assert!(killed >= 1, "the gateway's connections");
    wait_until(Duration::from_secs(5), "the replica refused", || {
        gw.logs().contains("answers ROLE as a replica")
    });
    assert_ne!(readyz(&gw)["redis"], "up");
    assert_eq!(statuses(&gw, "b", 3).await, [503; 3]);
    let logs = gw.logs();
    assert!(!logs.contains("READONLY"), "nothing sent to it: {logs}");

    replicaof(&["NO", "ONE"]);
    assert!(admitted_within_5_s(&gw, "c").await, "{}", gw.logs());
    assert_eq!(readyz(&gw)["redis"], "up");
}

/// A stale sentinel listed first goes on naming a master that was demoted: the gateway
/// follows the next sentinel's master, and asks the demoted node its role once in a while,
/// not at every question to the sentinels (every second: a connection, `AUTH` and `ROLE`
/// each time, from every gateway of the fleet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_a_stale_sentinel_names_is_not_dialled_every_second() {
    let (first, second) = (Redis::start(), Redis::start());
    let up = Upstream::start("app");
    let (_sentinels, gw) = on_two_sentinels(first.port, second.port, &up);
    let at = |port: u16| format!("127.0.0.1:{port}");
    assert_eq!(readyz(&gw)["redis_sentinel_master"]["addr"], at(first.port));
    let _: () = redis::cmd("REPLICAOF")
        .arg(&["127.0.0.1", &second.port.to_string()])
        .query(&mut first.conn())
        .unwrap();
    let _: i64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal"])
        .query(&mut first.conn())
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        "the next sentinel's master",
        || readyz(&gw)["redis_sentinel_master"]["addr"] == at(second.port),
    );
    assert!(admitted_within_5_s(&gw, "a").await, "decisions on it");
    let before = common::connections_received(first.port);
    tokio::time::sleep(Duration::from_secs(4)).await;
    // This test's own two `INFO` connections, and at most one of the gateway's.
    let made = common::connections_received(first.port) - before;
    assert!(made <= 2, "{made} connections in 4 s");
}

/// Two sentinels, each monitoring its own master as `mymaster`, and their processes.
struct TwoSentinels {
    ports: [u16; 2],
    _procs: [Proc; 2],
    _dirs: [tempfile::TempDir; 2],
}

/// Sentinels on `first_master` and `second_master`, listed in that order, and a gateway on
/// them (a generous budget: these tests are about which master, not time).
fn on_two_sentinels(
    first_master: u16,
    second_master: u16,
    up: &Upstream,
) -> (TwoSentinels, common::Gateway) {
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let (first, first_port) = sentinel(first_master, dirs[0].path());
    let (second, second_port) = sentinel(second_master, dirs[1].path());
    let urls = format!("[\"redis://127.0.0.1:{first_port}\", \"redis://127.0.0.1:{second_port}\"]");
    let gw = gateway_on(
        on_sentinel(first_port)
            .redis("sentinel_urls", urls)
            .redis("timeout_ms", "1000"),
        up,
        None,
    );
    let sentinels = TwoSentinels {
        ports: [first_port, second_port],
        _procs: [first, second],
        _dirs: dirs,
    };
    (sentinels, gw)
}

/// A sentinel with a stale or wrong view (it names a master that is gone) listed first does
/// not stop the gateway: the next sentinel is asked, and its master, which answers as one, is
/// used. (The first answer won: the gateway stayed without a master.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_naming_a_gone_master_is_passed_over_for_the_next() {
    let master = Redis::start();
    let up = Upstream::start("app");
    let (sentinels, gw) = on_two_sentinels(free_port(), master.port, &up);
    let [stale_port, sentinel_port] = sentinels.ports;
    assert_eq!(
        readyz(&gw)["redis_sentinel_master"]["addr"],
        format!("127.0.0.1:{}", master.port)
    );
    assert_eq!(statuses(&gw, "a", 4).await, [200, 200, 200, 429]);

    // Asked every second, each sentinel keeps its connection: it is not dialled (and
    // authenticated) anew each time. (Three seconds of polls made three connections to each.)
    let connections = common::connections_received;
    let before = [connections(stale_port), connections(sentinel_port)];
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = [connections(stale_port), connections(sentinel_port)];
    // This test's own INFO connection is one of them.
    assert!(
        after[0] - before[0] <= 2 && after[1] - before[1] <= 2,
        "{before:?} -> {after:?}"
    );
}

/// A sentinel that does not answer (listed first here) is passed over for the next, and
/// said once at WARN: one fewer sentinel to follow a failover with was invisible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_that_does_not_answer_is_said_once_and_passed_over() {
    let master = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let (_live, live_port) = sentinel(master.port, dir.path());
    let urls = format!(
        "[\"redis://127.0.0.1:{}\", \"redis://127.0.0.1:{live_port}\"]",
        free_port()
    );
    let gw = gateway_on(
        on_sentinel(live_port)
            .redis("sentinel_urls", urls)
            .redis("timeout_ms", "1000"),
        &up,
        None,
    );
    assert_eq!(statuses(&gw, "a", 4).await, [200, 200, 200, 429]);
    // Asked every second: three more questions, still one line.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let said = gw
        .logs()
        .lines()
        .filter(|l| l.contains("a sentinel cannot be asked"))
        .count();
    let logs = gw.logs();
    let lines: Vec<_> = logs
        .lines()
        .filter(|l| l.contains("a sentinel cannot be asked"))
        .collect();
    assert_eq!(said, 1, "{lines:#?}");
}

/// The master in use dies and the first sentinel, stale, still names it: the gateway checks
/// it (its connection is gone) and follows the next sentinel's master. (The master in use was
/// taken on the first sentinel's word: the gateway stayed on the dead one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_master_a_stale_sentinel_still_names_is_left_for_the_next_sentinels() {
    let (first, second) = (Redis::start(), Redis::start());
    let up = Upstream::start("app");
    let (_sentinels, gw) = on_two_sentinels(first.port, second.port, &up);
    let at = |port: u16| format!("127.0.0.1:{port}");
    assert_eq!(readyz(&gw)["redis_sentinel_master"]["addr"], at(first.port));
    drop(first);
    wait_until(
        Duration::from_secs(10),
        "the next sentinel's master",
        || readyz(&gw)["redis_sentinel_master"]["addr"] == at(second.port),
    );
    assert!(admitted_within_5_s(&gw, "a").await, "decisions on it");
}

/// `require_noeviction` and the fleet heartbeat on the master the sentinels name: an evicting
/// master stops the start (exit 2, the policy named); on a noeviction one two gateways count
/// each other and `/readyz` shows the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_named_master_is_checked_for_eviction_and_carries_the_fleet_heartbeat() {
    let master = Redis::start_with(free_port(), &["--maxmemory-policy", "allkeys-lru"]);
    let dir = tempfile::tempdir().unwrap();
    let (_sentinel, sentinel_port) = sentinel(master.port, dir.path());
    let up = Upstream::start("app");
    let config = on_sentinel(sentinel_port)
        .upstream("app", &[up.addr()])
        .route(common::config::fleet_route());
    let (code, stderr) = config.start_refused();
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("redis maxmemory-policy is allkeys-lru"),
        "{stderr}"
    );

    master.config_set("maxmemory-policy", "noeviction");
    let gateways = [config.start(), config.start()];
    for gw in &gateways {
        wait_until(
            Duration::from_secs(10),
            "both gateways in the fleet",
            || gw.metric("sentinel_fleet_instances") == 2.0,
        );
        assert_eq!(readyz(gw)["redis_maxmemory_policy"], "noeviction");
    }
}

/// The ACL user `gateway`, password `gateway-pass`, on `master`, with these rules.
fn gateway_user(master: &Redis, rules: &[&str]) {
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "gateway", "on", ">gateway-pass"])
        .arg(rules)
        .query(&mut master.conn())
        .unwrap();
}

/// A master's user without `+role` (the check that the named node is the master): the
/// sentinel's word is taken and said once at WARN, naming the grant. It made every request
/// of the route a 503 for good, logged as a master that "does not answer as a master".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_who_may_not_run_role_is_decided_for_on_the_sentinels_word() {
    let master = Redis::start();
    gateway_user(
        &master,
        &[
            "~sentinel:*",
            "resetchannels",
            "-@all",
            "+evalsha",
            "+script|load",
            "+time",
            "+hmget",
            "+hset",
            "+expire",
            "+pexpire",
            "+persist",
            "+del",
            "+config|get",
            "+ping",
            "+select",
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let (_sentinel, sentinel_port) = sentinel(master.port, dir.path());
    let up = Upstream::start("app");
    let config = on_sentinel(sentinel_port)
        .redis("username", quoted("gateway"))
        .redis("password_env", quoted("TEST_REDIS_PASSWORD"))
        .upstream("app", &[up.addr()])
        .route(api_route());
    let gw = config.start_with_env(&[("TEST_REDIS_PASSWORD", "gateway-pass")]);
    wait_until(Duration::from_secs(5), "the master connected", || {
        readyz(&gw)["redis"] == "up"
    });
    assert_eq!(statuses(&gw, "k", 4).await, [200, 200, 200, 429]);
    let said: Vec<String> = gw
        .logs()
        .lines()
        .filter(|l| l.contains("may not run ROLE (grant +role)"))
        .map(str::to_owned)
        .collect();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains(r#""level":"WARN""#), "{}", said[0]);
}

/// Sentinels, master and replica all over TLS (`rediss://` sentinels, `tls-replication`):
/// the gateway asks the sentinel over TLS, decides on the master over TLS, and follows the
/// promotion after the master is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_the_master_is_found_decided_on_and_followed() {
    let ca = Ca::new();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = ca.leaf(&["127.0.0.1"]).write(dir.path(), "redis");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    let tls_files = format!(
        "tls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\ntls-auth-clients no\ntls-replication yes\n",
        cert.display(),
        key.display(),
        ca_file.display()
    );
    let tls_args = |tls_port: u16| -> Vec<String> {
        let mut args = vec!["--tls-port".to_owned(), tls_port.to_string()];
        for line in tls_files.lines() {
            let (k, v) = line.split_once(' ').unwrap();
            args.push(format!("--{k}"));
            args.push(v.to_owned());
        }
        args
    };
    let start = |tls_port: u16, more: &[String]| {
        let mut args = tls_args(tls_port);
        args.extend_from_slice(more);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Redis::start_with(free_port(), &args)
    };
    let (master_tls, replica_tls, sentinel_tls) = (free_port(), free_port(), free_port());
    let mut master = start(master_tls, &[]);
    let replica = start(
        replica_tls,
        &[
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            master_tls.to_string(),
        ],
    );
    wait_for_sync(&replica);
    let sentinel_dir = tempfile::tempdir().unwrap();
    let (_sentinel, sentinel_plain) = sentinel_conf(
        master_tls,
        sentinel_dir.path(),
        None,
        &format!("tls-port {sentinel_tls}\n{tls_files}"),
    );
    let up = Upstream::start("app");
    let gw = on_sentinel_at(&format!("rediss://127.0.0.1:{sentinel_tls}"))
        .redis("tls_ca_path", quoted(&ca_file.display().to_string()))
        .upstream("app", &[up.addr()])
        .route(api_route())
        .start();
    wait_until(Duration::from_secs(10), "the master connected", || {
        readyz(&gw)["redis"] == "up"
    });
    assert_eq!(
        readyz(&gw)["redis_sentinel_master"]["addr"],
        format!("127.0.0.1:{master_tls}")
    );
    assert_eq!(statuses(&gw, "a", 4).await, [200, 200, 200, 429]);
    assert!(master.limiter_calls() >= 4, "decided on the master");
    // The `+switch-master` subscription is held over TLS too.
    let mut sentinel_conn = redis::Client::open(format!("redis://127.0.0.1:{sentinel_plain}"))
        .unwrap()
        .get_connection()
        .unwrap();
    wait_until(Duration::from_secs(5), "the gateway subscribed", || {
        redis::cmd("CLIENT")
            .arg("LIST")
            .query::<String>(&mut sentinel_conn)
            .unwrap_or_default()
            .lines()
            .any(|c| {
                c.contains(" sub=1 ") && c.contains(&format!("laddr=127.0.0.1:{sentinel_tls}"))
            })
    });

    master.proc.signal("KILL");
    master.proc.wait_exit(Duration::from_secs(5));
    wait_until(
        Duration::from_secs(30),
        "the gateway on the promoted replica",
        || readyz(&gw)["redis_sentinel_master"]["addr"] == format!("127.0.0.1:{replica_tls}"),
    );
    let recovered = admitted_within_5_s(&gw, "b").await;
    assert!(recovered, "decisions on the promoted replica");
    assert_eq!(statuses(&gw, "b", 3).await, [200, 200, 429]);
    assert!(
        replica.limiter_calls() >= 3,
        "decided on the promoted replica"
    );
    assert_eq!(
        statuses(&gw, "a", 1).await,
        [429],
        "replicated before the kill"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_other_sentinels_moves_the_decisions_to_the_master_they_name() {
    let (first, second) = (Redis::start(), Redis::start());
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (_sentinel_a, port_a) = sentinel(first.port, dir_a.path());
    let (_sentinel_b, port_b) = sentinel(second.port, dir_b.path());
    let up = Upstream::start("app");
    let config = |sentinel_port: u16| {
        on_sentinel(sentinel_port)
            .upstream("app", &[up.addr()])
            .route(api_route())
    };
    let gw = config(port_a).start();
    wait_until(Duration::from_secs(5), "the first master connected", || {
        readyz(&gw)["redis"] == "up"
    });
    assert_eq!(statuses(&gw, "k", 4).await, [200, 200, 200, 429]);

    gw.rewrite_config(&config(port_b).render(gw.port, gw.admin_port));
    assert_eq!(gw.reload(), 200, "{}", gw.logs());
    wait_until(Duration::from_secs(5), "the second master named", || {
        readyz(&gw)["redis_sentinel_master"]["addr"] == format!("127.0.0.1:{}", second.port)
    });
    // The second master holds no bucket for `k` yet: it decides, and counts from full.
    first.reset_stats();
    assert!(admitted_within_5_s(&gw, "k").await, "{}", gw.logs());
    assert_eq!(statuses(&gw, "k", 3).await, [200, 200, 429]);
    assert_eq!(first.limiter_calls(), 0, "the first master is left alone");
    assert!(second.limiter_calls() >= 4, "decided on the second master");

    // A reload to a single `url` needs a restart: until then `/readyz` says what runs (the
    // sentinels' master), not what the file says (it dropped the master).
    let single = GatewayConfig::new(&first.url())
        .upstream("app", &[up.addr()])
        .route(api_route());
    gw.rewrite_config(&single.render(gw.port, gw.admin_port));
    assert_eq!(gw.reload(), 200, "{}", gw.logs());
    assert_eq!(
        readyz(&gw)["redis_sentinel_master"]["addr"],
        format!("127.0.0.1:{}", second.port)
    );
}

/// A refused password is logged with its reason (contract section 11: "logged once per
/// outage with the reason, e.g. `WRONGPASS`"), the master's or a sentinel's. Before, the
/// master whose password was refused was not taken for the master at all, and the log named
/// a made-up address refusing connections; a sentinel's refusal was not named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_password_of_the_master_or_a_sentinel_is_logged_with_its_reason() {
    let master = Redis::start_with(free_port(), &["--requirepass", "right-pw"]);
    let dir = tempfile::tempdir().unwrap();
    let (_sentinel, sentinel_port) = sentinel_with(master.port, dir.path(), Some("s3ntinel-pw"));
    let up = Upstream::start("app");
    let route = || {
        Route::new("s.api")
            .prefix("/api")
            .identity_header("X-API-Key")
            .token_bucket(3_000_000, 0)
            .fail_closed()
    };
    let sentinel_pw = ("TEST_SENTINEL_PASSWORD", "s3ntinel-pw");
    let wrong_master = on_sentinel(sentinel_port)
        .redis("sentinel_password_env", quoted("TEST_SENTINEL_PASSWORD"))
        .redis("password_env", quoted("TEST_REDIS_PASSWORD"))
        .upstream("app", &[up.addr()])
        .route(route())
        .start_with_env(&[sentinel_pw, ("TEST_REDIS_PASSWORD", "wrong-pw")]);
    assert_eq!(statuses(&wrong_master, "a", 2).await, [503, 503]);
    let master_node = format!("127.0.0.1:{}", master.port);
    wait_until(Duration::from_secs(5), "the master named", || {
        readyz(&wrong_master)["redis_sentinel_master"]["addr"] == master_node.as_str()
    });
    let logs = wrong_master.logs();
    assert!(
        logs.lines()
            .any(|l| l.contains("WRONGPASS") && l.contains(&master_node)),
        "{logs}"
    );
    assert!(
        !logs.contains("wrong-pw") && !logs.contains("right-pw"),
        "{logs}"
    );

    let wrong_sentinel = on_sentinel(sentinel_port)
        .redis("sentinel_password_env", quoted("TEST_SENTINEL_PASSWORD"))
        .upstream("app", &[up.addr()])
        .route(route())
        .start_with_env(&[("TEST_SENTINEL_PASSWORD", "not-it")]);
    assert_eq!(statuses(&wrong_sentinel, "a", 1).await, [503]);
    let logs = wrong_sentinel.logs();
    assert!(
        logs.lines()
            .any(|l| l.contains("no sentinel names a reachable master")
                && l.contains("WRONGPASS")
                && l.contains(&format!("127.0.0.1:{sentinel_port}"))),
        "{logs}"
    );
    assert!(
        !logs.contains("not-it") && !logs.contains("s3ntinel-pw"),
        "{logs}"
    );
    // With no master named, no line names a node the config does not have (an address that
    // only refuses was once dialled in its place).
    let named: Vec<&str> = logs.lines().filter(|l| l.contains("\"node\"")).collect();
    assert!(
        !named.is_empty() && named.iter().all(|l| l.contains("(no master named yet)")),
        "{logs}"
    );
}

#[test]
fn check_refuses_sentinels_beside_a_url_and_a_missing_master_name() {
    let dir = tempfile::tempdir().unwrap();
    let run = |redis: &str| common::check_body(dir.path(), &format!("[redis]\n{redis}\n"), &[]);
    let (ok, out) = run("url = \"redis://127.0.0.1:6379\"\nsentinel_urls = [\"redis://127.0.0.1:26379\"]\nsentinel_master = \"m\"");
    assert!(
        !ok && out.contains("keep exactly one of the three"),
        "{out}"
    );
    let (ok, out) = run("sentinel_urls = [\"redis://127.0.0.1:26379\"]");
    assert!(!ok && out.contains("needs redis.sentinel_master"), "{out}");
    let (ok, out) =
        run("sentinel_urls = [\"redis://127.0.0.1:26379\"]\nsentinel_master = \"mymaster\"");
    assert!(ok, "{out}");
    let (ok, out) = run("sentinel_urls = [\"rediss://127.0.0.1:26379\", \"redis://127.0.0.1:26380\"]\nsentinel_master = \"mymaster\"");
    assert!(
        !ok && out.contains("redis.sentinel_urls mixes redis:// and rediss:// sentinels"),
        "{out}"
    );
    let (ok, out) = run("sentinel_urls = [\"redis://127.0.0.1:26379\"]\nsentinel_master = \"mymaster\"\ntls_ca_path = \"ca.pem\"");
    assert!(!ok && out.contains("redis.tls_ca_path is set but"), "{out}");
    let (ok, out) =
        run("sentinel_urls = [\"rediss://127.0.0.1:26379\"]\nsentinel_master = \"mymaster\"");
    assert!(ok, "{out}");
    // A database or options on a sentinel's URL would be dropped without a word.
    for url in [
        "redis://127.0.0.1:26379/3",
        "redis://127.0.0.1:26379/0?protocol=3",
        "redis://127.0.0.1:26379/3?x=a@b",
    ] {
        let (ok, out) = run(&format!(
            "sentinel_urls = [\"{url}\"]\nsentinel_master = \"mymaster\""
        ));
        assert!(
            !ok && out.contains("with no database but 0 and no options"),
            "{out}"
        );
    }
    // A sentinel's address needs its port (6379, a Redis URL's default, is not a sentinel's);
    // an address alone is not a URL, and the form said is a sentinel's.
    for (url, said) in [
        (
            "redis://10.0.1.1",
            "name the sentinel's port, redis://host:26379 as a rule",
        ),
        ("redis://u@[::1]/", "name the sentinel's port"),
        ("127.0.0.1:26379", "is not a Redis URL"),
    ] {
        let (ok, out) = run(&format!(
            "sentinel_urls = [\"{url}\"]\nsentinel_master = \"mymaster\""
        ));
        assert!(!ok && out.contains(said), "{out}");
        assert!(!out.contains("/db"), "{out}");
    }
    let (ok, out) =
        run("sentinel_urls = [\"redis://[::1]:26379\"]\nsentinel_master = \"mymaster\"");
    assert!(ok, "{out}");
    // SENTINEL_REDIS_URL overrides the sentinels as it overrides a cluster's seeds: said,
    // and a TLS field left beside `rediss://` sentinels names the variable.
    let env = [("SENTINEL_REDIS_URL", Some("redis://127.0.0.1:6379/0"))];
    let with_env =
        |redis: &str| common::check_body(dir.path(), &format!("[redis]\n{redis}\n"), &env);
    let (ok, out) =
        with_env("sentinel_urls = [\"redis://127.0.0.1:26379\"]\nsentinel_master = \"mymaster\"");
    assert!(
        ok && out.contains("SENTINEL_REDIS_URL is set: it overrides redis.sentinel_urls"),
        "{out}"
    );
    let (ok, out) = with_env(
        "sentinel_urls = [\"redis://:pw@127.0.0.1:26379\"]\nsentinel_master = \"mymaster\"",
    );
    assert!(
        !ok && out.contains("redis.sentinel_password_env") && !out.contains("pw@"),
        "a password in the file is refused with the variable set too: {out}"
    );
    // The file's sentinels are checked as they would be read without the variable, and a
    // password in a query is a password in the file.
    for (url, said) in [
        (
            "redis://127.0.0.1:26379/3",
            "with no database but 0 and no options",
        ),
        ("redis://127.0.0.1:26379?password=pw", "holds a password"),
    ] {
        let (ok, out) = with_env(&format!(
            "sentinel_urls = [\"{url}\"]\nsentinel_master = \"mymaster\""
        ));
        assert!(!ok && out.contains(said), "{url}: {out}");
    }
    let (ok, out) = with_env("sentinel_urls = [\"rediss://127.0.0.1:26379\"]\nsentinel_master = \"mymaster\"\ntls_ca_path = \"ca.pem\"");
    assert!(
        !ok && out
            .contains("SENTINEL_REDIS_URL, which overrides the file's Redis, is not rediss://"),
        "{out}"
    );
}

/// Sentinels that stop answering while the master serves: decisions go on exactly on the
/// master already followed, and the one WARN says so, naming it (it once read as if there
/// were no master at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sentinels_that_stop_answering_leave_the_decisions_on_the_master() {
    let master = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (sentinel, sentinel_port) = sentinel(master.port, dir.path());
    let up = Upstream::start("app");
    let gw = gateway(sentinel_port, &up, None);
    assert_eq!(statuses(&gw, "a", 2).await, [200, 200]);

    sentinel.signal("STOP");
    wait_until(Duration::from_secs(10), "the WARN", || {
        gw.logs()
            .contains("no sentinel names a reachable master now")
    });
    assert_eq!(
        statuses(&gw, "a", 2).await,
        [200, 429],
        "still decided by Redis"
    );
    let logs = gw.logs();
    let warned: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("no sentinel names a reachable master"))
        .collect();
    assert_eq!(warned.len(), 1, "{logs}");
    assert!(
        warned[0].contains(&format!("127.0.0.1:{}", master.port))
            && warned[0].contains("decisions stay on the last one named"),
        "{logs}"
    );
    sentinel.signal("CONT");
}

/// `check --redis` on `sentinel_urls` reads the master the sentinel names now, and says so
/// when no sentinel answers.
#[test]
fn check_redis_reads_the_master_the_sentinel_names() {
    let (master, _replica) = replicated();
    let dir = tempfile::tempdir().unwrap();
    let (sentinel, sentinel_port) = sentinel(master.port, dir.path());
    let up = Upstream::start("app");
    let check = || {
        let config = on_sentinel(sentinel_port)
            .upstream("app", &[up.addr()])
            .route(api_route());
        let (code, _, lines) = common::check_redis(dir.path(), &config, &[]);
        (code, lines)
    };
    let (code, lines) = check();
    assert_eq!(code, Some(0), "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with(&format!("redis 127.0.0.1:{}: ok: ", master.port)),
        "{lines:?}"
    );
    drop(sentinel);
    let (code, lines) = check();
    assert_eq!(code, Some(1), "{lines:?}");
    assert!(lines[0].starts_with("redis: cannot serve: "), "{lines:?}");
}

/// A wrong password mended by a reload behind Sentinel ends the quarantine its refusals
/// opened, as on one Redis: the next request probes the master with the new password
/// rather than waiting out `open_seconds` (ten minutes here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mended_password_behind_sentinel_ends_the_quarantine_the_wrong_one_opened() {
    let master = Redis::start();
    gateway_user(&master, &["~*", "&*", "+@all"]);
    let dir = tempfile::tempdir().unwrap();
    let (_sentinel, sentinel_port) = sentinel(master.port, dir.path());
    let up = Upstream::start("app");
    let file = dir.path().join("redis-password");
    std::fs::write(&file, "not-the-password\n").unwrap();
    let gw = sentinel_quarantine(&format!("redis://127.0.0.1:{sentinel_port}"), 600)
        .server("watch_config", "true")
        .redis("username", quoted("gateway"))
        .redis("password_file", quoted(file.to_str().unwrap()))
        .upstream("app", &[up.addr()])
        .route(api_route())
        .start();
    let deadline = Instant::now() + Duration::from_secs(10);
    while gw.metric("sentinel_breaker_state") != 1.0 {
        assert_eq!(statuses(&gw, "a", 1).await, [503]);
        assert!(Instant::now() < deadline, "{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let next = dir.path().join(".next");
    std::fs::write(&next, "gateway-pass\n").unwrap();
    std::fs::rename(&next, &file).unwrap();
    wait_until(Duration::from_secs(10), "the watch to reload", || {
        gw.metric("sentinel_config_generation") == 2.0
    });
    assert!(admitted_within_5_s(&gw, "b").await, "{}", gw.logs());
    assert_eq!(gw.metric("sentinel_breaker_state"), 0.0);
}
