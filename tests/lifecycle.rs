//! Reload and shutdown, as an operator drives them: POST /reload, SIGHUP, SIGTERM.

mod common;

use std::ffi::OsStr;
use std::time::{Duration, Instant};

use common::config::{GatewayConfig, Route};
use common::{blocking_get, client, wait_until, Gateway, Redis, Upstream};

/// `base` with the upstream `app` at `upstream`, given 10 s to answer, and the route `api`.
fn routes(base: GatewayConfig, upstream: &str, api: Route) -> GatewayConfig {
    base.upstream_timeouts("app", &[upstream], None, Some(10_000))
        .route(api)
}

/// `l.api`: one global token bucket of `capacity` requests on `/api` that never refills.
fn api(capacity: u64) -> Route {
    Route::new("l.api")
        .prefix("/api")
        .identity("global")
        .token_bucket(capacity * 1_000_000, 0)
}

/// An unlimited route on `/new`, for reloads that add one.
fn new_route() -> String {
    Route::new("l.new").path("/new").unlimited().toml()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests_then_exits_zero() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let config = GatewayConfig::new(&redis.url())
        .server("h2c", "true")
        .access_log(&log);
    let mut gw = routes(config, &up.addr(), api(100)).start();
    let http = client();
    let h2 = common::h2c_client;
    // An idle HTTP/2 connection, which must not hold the exit.
    let idle = h2();
    assert_eq!(
        idle.get(gw.url("/api/x")).send().await.unwrap().status(),
        200
    );
    let slow_over = |http: reqwest::Client, ms: u64| {
        let url = gw.url(&format!("/api/slow?ms={ms}"));
        tokio::spawn(async move {
            let r = http
                .get(url)
                .send()
                .await
                .expect("the in-flight request completes");
            let connection = r
                .headers()
                .get("connection")
                .map(|v| v.to_str().unwrap().to_ascii_lowercase());
            (r.status().as_u16(), connection, r.text().await.unwrap())
        })
    };
    // Several on HTTP/1, which end a few milliseconds apart: their access-log lines are
    // written before the exit (lost with the process, but for the first batch).
    let mut slow: Vec<_> = (0..8)
        .map(|i| slow_over(http.clone(), 1500 + 3 * i))
        .collect();
    slow.push(slow_over(h2(), 1500));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = Instant::now();
    gw.proc.signal("TERM");
    wait_until(Duration::from_secs(2), "/readyz to turn 503", || {
        blocking_get(&gw.admin("/readyz")).is_some_and(|(s, b)| {
            s == 503 && b.contains(r#""ready":false"#) && b.contains(r#""draining":true"#)
        })
    });
    // Answered during the drain, an HTTP/1 answer says `Connection: close`: the client
    // sends its next request elsewhere, not into a connection about to close (it said
    // `keep-alive`, and 16 of 16 clients' next requests met the close).
    let http1 = slow.len() - 1;
    for (i, slow) in slow.into_iter().enumerate() {
        let (status, connection, body) = slow.await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("\"path\":\"/api/slow\""));
        if i < http1 {
            assert_eq!(connection.as_deref(), Some("close"), "request {i}");
        }
    }
    let code = gw
        .proc
        .wait_exit(Duration::from_secs(5))
        .expect("exits within the grace period");
    assert_eq!(code, 0);
    assert!(
        sent.elapsed() < Duration::from_secs(4),
        "exited once drained, not after the whole grace period"
    );
    assert!(
        gw.logs()
            .contains(r#""message":"drained; exiting","in_flight":0"#),
        "{}",
        gw.logs()
    );
    let lines = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        lines.matches(r#""path":"/api/slow""#).count(),
        9,
        "one line per request answered: {lines}"
    );
}

/// A gateway with `drain_delay_seconds = secs`, and the Redis and upstream it uses.
fn with_drain_delay(secs: &str) -> (common::Gateway, (Redis, Upstream)) {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let config = GatewayConfig::new(&redis.url()).server("drain_delay_seconds", secs);
    let gw = routes(config, &up.addr(), api(100)).start();
    (gw, (redis, up))
}

/// With `drain_delay_seconds`, a SIGTERM turns `/readyz` unready at once while the listeners
/// go on accepting for that long: a new connection then is served (its answer says
/// `Connection: close`), not refused; after it, the listeners close and the drain ends as
/// without it.
#[test]
fn a_drain_delay_keeps_accepting_while_unready() {
    let (mut gw, _processes) = with_drain_delay("3");
    let sent = Instant::now();
    gw.proc.signal("TERM");
    wait_until(Duration::from_secs(2), "/readyz to turn 503", || {
        blocking_get(&gw.admin("/readyz")).is_some_and(|(s, _)| s == 503)
    });
    // A new connection, its request without `Connection: close`: read until the gateway
    // closes it.
    let answer = {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", gw.port)).expect("accepted");
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        conn.write_all(b"GET /api/x HTTP/1.1\r\nHost: a\r\nX-API-Key: k\r\n\r\n")
            .unwrap();
        let mut answer = Vec::new();
        let _ = conn.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    };
    assert!(
        sent.elapsed() < Duration::from_millis(2500),
        "within the delay: {:?}",
        sent.elapsed()
    );
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    let code = gw
        .proc
        .wait_exit(Duration::from_secs(10))
        .expect("exits once drained");
    assert_eq!(code, 0);
    assert!(
        sent.elapsed() >= Duration::from_secs(3),
        "not before the delay: {:?}",
        sent.elapsed()
    );
    assert!(
        gw.logs().contains(r#""drain_delay_seconds":3"#),
        "{}",
        gw.logs()
    );
}

/// A SIGINT during the drain delay stops at once, as during the drain itself.
#[test]
fn a_sigint_during_the_drain_delay_stops_at_once() {
    let (mut gw, _processes) = with_drain_delay("60");
    gw.proc.signal("TERM");
    common::wait_until(Duration::from_secs(5), "the drain begun", || {
        gw.logs().contains("SIGTERM: draining")
    });
    let sent = Instant::now();
    gw.proc.signal("INT");
    gw.proc
        .wait_exit(Duration::from_secs(10))
        .expect("stops, not after the delay's minute");
    assert!(sent.elapsed() < Duration::from_secs(10));
    assert!(gw.logs().contains("SIGINT: stopping now"), "{}", gw.logs());
}

/// SIGQUIT, nginx's graceful stop, drains as SIGTERM does (it was ignored without a word).
#[test]
fn sigquit_drains_as_sigterm_does() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let mut gw = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(100)).start();
    assert!(blocking_get(&gw.url("/api/x")).is_some_and(|(s, _)| s == 200));
    // nginx's binary upgrade has no counterpart: said and ignored, never the default end.
    gw.proc.signal("USR2");
    common::wait_until(Duration::from_secs(5), "the SIGUSR2 line", || {
        gw.logs().contains("SIGUSR2 ignored")
    });
    assert!(blocking_get(&gw.url("/api/x")).is_some_and(|(s, _)| s == 200));
    gw.proc.signal("QUIT");
    let code = gw
        .proc
        .wait_exit(Duration::from_secs(5))
        .expect("exits once drained");
    assert_eq!(code, 0);
    assert!(
        gw.logs().contains(r#""message":"drained; exiting""#),
        "{}",
        gw.logs()
    );
    // Said as what it was (it was logged "SIGTERM: draining").
    assert!(gw.logs().contains("SIGQUIT: draining"), "{}", gw.logs());
    assert!(!gw.logs().contains("SIGTERM: draining"), "{}", gw.logs());
}

/// The listeners open once the first Redis connection is made: with a Redis 50 ms away (its
/// connection's set-up takes a few of its round trips), the first request is decided by Redis
/// within its budget, not answered at once by its fail mode (`fail_closed`: a 503) for want of
/// a connection. One that cannot be reached still lets the gateway start, after at most a
/// second's wait, its requests answered by their fail mode.
#[test]
fn the_listeners_open_once_the_first_redis_connection_is_made() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let far = common::fault::FaultProxy::start(redis.port);
    far.set(common::fault::Mode::Delay(Duration::from_millis(50)));
    let config = GatewayConfig::new(&far.url()).redis("timeout_ms", "1000");
    let gw = routes(config, &up.addr(), api(100).fail_closed()).start();
    let (status, body) = blocking_get(&gw.url("/api/x")).expect("an answer");
    assert_eq!(status, 200, "{body}\n{}", gw.logs());

    let unreachable = common::fault::FaultProxy::start(redis.port);
    unreachable.set(common::fault::Mode::Blackhole);
    // With the eviction check on (the default), which waits a second for the Redis that
    // does not answer: the listeners still open a second after the start, not two (the wait
    // for the first connection began after the check). Timed from the admin's first
    // "starting" answer to ready, which leaves the process's own start out.
    let [port, admin] = common::free_ports();
    let config = routes(GatewayConfig::new(&unreachable.url()), &up.addr(), api(100))
        .redis("require_noeviction", "true")
        .render(port, admin);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, config).unwrap();
    let mut proc = common::Proc::gateway(&path, None);
    let readyz = format!("http://127.0.0.1:{admin}/readyz");
    let mut starting = None;
    wait_until(Duration::from_secs(10), "ready", || {
        match blocking_get(&readyz) {
            Some((200, _)) => return true,
            Some((503, b)) if b.contains(r#""starting":true"#) => {
                starting.get_or_insert_with(Instant::now);
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(5));
        false
    });
    let waited = starting.expect("seen starting").elapsed();
    // A second, and 0.85 s of room for a loaded machine (at least two seconds before: both
    // waits were a second each).
    assert!(waited < Duration::from_millis(1_850), "{waited:?}");
    assert_eq!(proc.wait_exit(Duration::ZERO), None);
    let (status, body) =
        blocking_get(&format!("http://127.0.0.1:{port}/api/x")).expect("an answer");
    assert_eq!(status, 503, "{body}");
}

/// `signal` makes the gateway exit 0 within 3 s (a loaded machine may take longer than the
/// moment it should take), cutting the request in flight (`slow`), which gets no answer.
async fn stops_and_cuts(
    gw: &mut common::Gateway,
    signal: &str,
    slow: tokio::task::JoinHandle<reqwest::Result<reqwest::Response>>,
) {
    let sent = Instant::now();
    gw.proc.signal(signal);
    let code = gw.proc.wait_exit(Duration::from_secs(10));
    assert_eq!(code, Some(0), "exits 0 on SIG{signal}");
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "{:?}",
        sent.elapsed()
    );
    let cut = slow.await.unwrap().expect_err("the request was cut");
    assert!(!cut.is_timeout(), "{cut}");
}

/// A gateway with `grace_period_seconds = grace` and one request in flight that its upstream
/// answers after `ms`; the processes it needs, kept alive with it.
fn one_in_flight(
    grace: &str,
    ms: u64,
) -> (
    common::Gateway,
    tokio::task::JoinHandle<reqwest::Result<reqwest::Response>>,
    (Redis, Upstream),
) {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let config = GatewayConfig::new(&redis.url()).server("grace_period_seconds", grace);
    let gw = routes(config, &up.addr(), api(100)).start();
    let url = gw.url(&format!("/api/slow?ms={ms}"));
    let slow = tokio::spawn(async move { client().get(url).send().await });
    common::wait_until(Duration::from_secs(5), "the request in flight", || {
        blocking_get(&gw.admin("/metrics")).is_some_and(|(_, body)| {
            common::metric_value(&body, "sentinel_requests_in_flight") == 1.0
        })
    });
    (gw, slow, (redis, up))
}

/// A request still in flight when the grace period ends is cut, and one WARN says how many
/// were: never "drained", never nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_cuts_what_outlives_the_grace_period_and_says_so() {
    let (mut gw, slow, _processes) = one_in_flight("1", 6000);
    // One second of grace, then the request is cut.
    stops_and_cuts(&mut gw, "TERM", slow).await;
    let logs = gw.logs();
    let cut: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("grace_period_seconds is over"))
        .collect();
    assert_eq!(cut.len(), 1, "{logs}");
    assert!(
        cut[0].contains(r#""level":"WARN""#) && cut[0].contains(r#""in_flight":1"#),
        "{}",
        cut[0]
    );
    assert!(!logs.contains("drained; exiting"), "{logs}");
    // One grace period said: Pingora's own (a second longer) is not.
    assert!(!logs.contains("grace period 2s starts"), "{logs}");
}

/// SIGINT stops at once, also while a SIGTERM drain waits for a request in flight (it was
/// not heard then: the drain went on to its end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_during_a_drain_stops_at_once() {
    let (mut gw, slow, _processes) = one_in_flight("30", 20000);
    gw.proc.signal("TERM");
    common::wait_until(Duration::from_secs(5), "the drain begun", || {
        gw.logs().contains("SIGTERM: draining")
    });
    stops_and_cuts(&mut gw, "INT", slow).await;
    let logs = gw.logs();
    assert!(
        logs.contains("SIGINT: stopping now, which cuts the requests in flight"),
        "{logs}"
    );
}

/// SIGINT alone stops at once too, and says how many requests it cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_says_what_it_cuts() {
    let (mut gw, slow, _processes) = one_in_flight("30", 20_000);
    stops_and_cuts(&mut gw, "INT", slow).await;
    let logs = gw.logs();
    let line = (logs.lines())
        .find(|l| l.contains("SIGINT: stopping now"))
        .unwrap_or_else(|| panic!("{logs}"));
    assert!(
        line.contains("which cuts the requests in flight") && line.contains(r#""in_flight":1"#),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_reload_keeps_the_old_config_serving() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(2)).start();
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
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(
            http.get(gw.url("/api"))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
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
    let gw = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(2)).start();
    let http = client();
    assert_eq!(http.get(gw.url("/new")).send().await.unwrap().status(), 404);
    let mut text = std::fs::read_to_string(&gw.config_path).unwrap();
    text.push_str(&new_route());
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

/// A config file as an operator might write it: gateway defaults but a 5 s grace period.
fn file_config(redis_url: &str) -> GatewayConfig {
    GatewayConfig::bare(redis_url).server("grace_period_seconds", "5")
}

/// While the gateway starts (here its Redis client waits a second for a Redis that does not
/// answer), the admin listener answers: `/healthz` 200, `/readyz` 503 saying so, never a
/// refused connection once the listeners are checked.
#[test]
fn the_admin_answers_while_the_gateway_starts() {
    let redis = Redis::start();
    let proxy = common::fault::FaultProxy::start(redis.port);
    proxy.set(common::fault::Mode::Blackhole);
    let up = Upstream::start("app");
    let (port, admin) = (common::free_port(), common::free_port());
    let config = routes(GatewayConfig::new(&proxy.url()), &up.addr(), api(5))
        .redis("require_noeviction", "false")
        .render(port, admin);
    let starting = std::thread::spawn(move || Gateway::start_with(port, admin, &config));
    let (mut readyz, mut healthz) = (Vec::new(), Vec::new());
    while !starting.is_finished() {
        readyz.extend(blocking_get(&format!("http://127.0.0.1:{admin}/readyz")));
        healthz.extend(blocking_get(&format!("http://127.0.0.1:{admin}/healthz")));
        std::thread::sleep(Duration::from_millis(20));
    }
    let gw = starting.join().unwrap();
    assert!(
        readyz
            .iter()
            .any(|(s, b)| *s == 503 && b.contains(r#""ready":false,"starting":true"#)),
        "{readyz:?}"
    );
    assert!(
        !healthz.is_empty() && healthz.iter().all(|(s, _)| *s == 200),
        "{healthz:?}"
    );
    assert_eq!(blocking_get(&gw.admin("/readyz")).unwrap().0, 200);
}

#[test]
fn an_evicting_redis_refuses_start_unless_allowed() {
    let redis = Redis::start_with(common::free_port(), &["--maxmemory-policy", "allkeys-lru"]);
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    let (port, admin) = (common::free_port(), common::free_port());
    let config = routes(file_config(&redis.url()), &up.addr(), api(5));
    std::fs::write(&path, config.render(port, admin)).unwrap();
    let out = common::run_binary(
        &[OsStr::new("--config"), path.as_os_str()],
        &[("SENTINEL_REDIS_URL", None)],
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("redis maxmemory-policy is allkeys-lru"),
        "{stderr}"
    );

    let allowed = config.clone().redis("require_noeviction", "false");
    let gw = Gateway::start_with(port, admin, &allowed.render(port, admin));
    assert_eq!(blocking_get(&gw.admin("/readyz")).unwrap().0, 200);
    wait_until(Duration::from_secs(5), "the policy in /readyz", || {
        blocking_get(&gw.admin("/readyz"))
            .is_some_and(|(_, b)| b.contains(r#""redis_maxmemory_policy":"allkeys-lru""#))
    });

    // A reload is refused what the start is: turning require_noeviction on over this Redis,
    // and, from a gateway on a noeviction Redis, a move to this one. The old config serves.
    let refused = |gw: &Gateway, text: &str| {
        gw.rewrite_config(text);
        let (status, body) = gw.reload_answer();
        assert_eq!(status, 400, "{body}");
        assert!(
            body.contains(r#""reloaded":false"#)
                && body
                    .contains("[redis] require_noeviction: redis maxmemory-policy is allkeys-lru")
                && body.contains(&gw.config_path.display().to_string()),
            "{body}"
        );
        let ready = blocking_get(&gw.admin("/readyz")).unwrap().1;
        assert!(ready.contains(r#""config_generation":1"#), "{ready}");
    };
    refused(&gw, &config.render(port, admin));
    let clean = Redis::start();
    let (port, admin) = (common::free_port(), common::free_port());
    let moving = routes(file_config(&clean.url()), &up.addr(), api(5));
    let gw = Gateway::start_with(port, admin, &moving.render(port, admin));
    refused(&gw, &config.render(port, admin));
    // The same move with the requirement off is taken.
    gw.rewrite_config(&allowed.render(port, admin));
    assert_eq!(gw.reload(), 200);
}

#[test]
fn a_redis_that_starts_evicting_later_is_reported() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(5)).start();
    assert!(blocking_get(&gw.admin("/readyz"))
        .unwrap()
        .1
        .contains(r#""redis_maxmemory_policy":"noeviction""#));
    let mut conn = redis.conn();
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "maxmemory-policy", "volatile-lru"])
        .query(&mut conn)
        .unwrap();
    let _: i64 = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
        .query(&mut conn)
        .unwrap();
    // The next limited request sees the dropped connection; the reconnect reads the policy.
    let _ = blocking_get(&gw.url("/api"));
    wait_until(Duration::from_secs(5), "the new policy in /readyz", || {
        let _ = blocking_get(&gw.url("/api"));
        blocking_get(&gw.admin("/readyz")).is_some_and(|(s, b)| {
            s == 200 && b.contains(r#""redis_maxmemory_policy":"volatile-lru""#)
        })
    });
    assert!(gw.logs().contains("redis may evict keys"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_can_move_the_gateway_to_another_redis() {
    let (a, b) = (Redis::start(), Redis::start());
    let up = Upstream::start("app");
    let gw = routes(GatewayConfig::new(&a.url()), &up.addr(), api(5)).start();
    let http = client();
    assert_eq!(http.get(gw.url("/api")).send().await.unwrap().status(), 200);
    assert_eq!(a.keys("sentinel:*").len(), 1);
    let policy = || {
        let (_, body) = blocking_get(&gw.admin("/readyz")).unwrap();
        let ready: serde_json::Value = serde_json::from_str(&body).unwrap();
        ready["redis_maxmemory_policy"].clone()
    };
    wait_until(Duration::from_secs(5), "the policy read", || {
        policy() == "noeviction"
    });
    // A Redis that never answers: its policy is not known, and not the last one's.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("redis://{}", silent.local_addr().unwrap());
    gw.rewrite_config(
        &routes(file_config(&silent_url), &up.addr(), api(5)).render(gw.port, gw.admin_port),
    );
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(policy(), serde_json::Value::Null);
    gw.rewrite_config(
        &routes(file_config(&b.url()), &up.addr(), api(5)).render(gw.port, gw.admin_port),
    );
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let moved = Instant::now();
    wait_until(
        Duration::from_secs(5),
        "a decision on the new redis",
        || {
            let _ = blocking_get(&gw.url("/api"));
            !b.keys("sentinel:*").is_empty()
        },
    );
    // The attempt at the silent one is dropped, not waited out (its connect timeout is 1 s;
    // the margin is for a loaded machine).
    let took = moved.elapsed();
    assert!(took < Duration::from_millis(800), "{took:?}");
    assert!(
        !gw.logs().contains("did not accept the connection"),
        "no outage is said of a Redis the gateway was moved off"
    );
}

/// Eight clients asking one URL in a loop, each request after the last one's answer.
struct Load {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<Vec<u16>>>,
}

impl Load {
    fn start(url: &str) -> Load {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let workers = (0..8)
            .map(|_| {
                let (url, stop) = (url.to_owned(), std::sync::Arc::clone(&stop));
                tokio::spawn(async move {
                    let http = client();
                    let mut statuses = Vec::new();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        match http.get(&url).send().await {
                            Ok(r) => statuses.push(r.status().as_u16()),
                            Err(e) => panic!("a request failed under the load: {e}"),
                        }
                    }
                    statuses
                })
            })
            .collect();
        Load { stop, workers }
    }

    /// Every status the clients got.
    async fn stop(self) -> Vec<u16> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut all = Vec::new();
        for w in self.workers {
            all.extend(w.await.unwrap());
        }
        all
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_under_load_drop_nothing() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    // A budget of 1 s: what this test asks is that reloads drop nothing. With 20 ms, a debug
    // build on a busy machine now and then answers 503 for a decision Redis answered late:
    // the budget doing its job, not a reload losing a request.
    let config = GatewayConfig::new(&redis.url()).redis("timeout_ms", "1000");
    let gw = routes(config, &up.addr(), api(1_000_000)).start();
    let good = std::fs::read_to_string(&gw.config_path).unwrap();
    let load = Load::start(&gw.url("/api"));
    let http = client();
    for i in 0..10 {
        // Alternate between two valid configs so every reload really changes something.
        let text = if i % 2 == 0 {
            good.replace("[[routes]]", "# reloaded\n[[routes]]")
        } else {
            good.clone()
        };
        gw.rewrite_config(&text);
        let r = http.post(gw.admin("/reload")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let all = load.stop().await;
    assert!(all.len() > 100, "load ran: {}", all.len());
    assert!(
        all.iter().all(|s| *s == 200),
        "non-200 during reloads: {:?}",
        all.iter().filter(|s| **s != 200).collect::<Vec<_>>()
    );
    assert_eq!(gw.metric("sentinel_config_generation"), 11.0);
    assert_eq!(
        gw.metric(r#"sentinel_config_reloads_total{result="success"}"#),
        10.0
    );
}

/// A reload that moves `[redis] url` (to another Redis, or the same one spelt otherwise)
/// makes the new connection before it leaves the old one: no request is failed by its fail
/// mode meanwhile (dropped first, every decision of the few milliseconds a connection takes
/// answered 503 on a `fail_closed` route).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_another_redis_url_fails_no_request_meanwhile() {
    let (a, b) = (Redis::start(), Redis::start());
    let up = Upstream::start("app");
    // A budget of 1 s: a connection made late on a loaded machine is waited for, not failed;
    // a dropped connection fails at once whatever the budget.
    let config = |url: &str| {
        routes(
            file_config(url).redis("timeout_ms", "1000"),
            &up.addr(),
            api(1_000_000).fail_closed(),
        )
    };
    let gw = config(&a.url()).start();
    let load = Load::start(&gw.url("/api"));
    let respelt = a.url().trim_end_matches("/0").to_owned();
    for url in [b.url(), a.url(), b.url(), respelt] {
        tokio::time::sleep(Duration::from_millis(150)).await;
        gw.rewrite_config(&config(&url).render(gw.port, gw.admin_port));
        assert_eq!(gw.reload(), 200);
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let all = load.stop().await;
    assert!(all.len() > 100, "load ran: {}", all.len());
    let failed: Vec<&u16> = all.iter().filter(|s| **s != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {}: {failed:?}",
        failed.len(),
        all.len()
    );
    assert!(!b.keys("sentinel:*").is_empty(), "decided on b in between");
    assert!(gw
        .logs()
        .contains("redis connected with the reloaded settings"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_mode_decides_and_counts_but_forwards() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = routes(
        GatewayConfig::new(&redis.url()),
        &up.addr(),
        api(1).set("mode", "\"shadow\""),
    )
    .start();
    let http = client();
    for _ in 0..3 {
        assert_eq!(http.get(gw.url("/api")).send().await.unwrap().status(), 200);
    }
    assert_eq!(gw.metric(r#"sentinel_decisions_total{allowed="true",decision_reason="allowed",endpoint_id="l.api"}"#), 1.0);
    assert_eq!(gw.metric(r#"sentinel_decisions_total{allowed="false",decision_reason="rate_limited",endpoint_id="l.api"}"#), 2.0);
    assert_eq!(
        gw.metric(r#"sentinel_shadow_denials_total{endpoint_id="l.api"}"#),
        2.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_endpoint_mode{endpoint_id="l.api",mode="shadow"}"#),
        1.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_endpoint_mode{endpoint_id="l.api",mode="enforce"}"#),
        0.0
    );
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="l.api",status="200"}"#),
        3.0
    );
    let logs = gw.logs();
    assert_eq!(
        logs.lines()
            .filter(|l| l.contains("request denied") && l.contains("\"shadow\":true"))
            .count(),
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breaker_and_emergency_state_survive_a_reload_unless_the_rate_changes() {
    let up = Upstream::start("app");
    let nowhere = format!("redis://127.0.0.1:{}/0", common::free_port());
    let config = |fallback: u64| {
        GatewayConfig::new(&nowhere)
            .breaker(2, 60)
            .upstream("app", &[up.addr()])
            .route(
                Route::new("l.fo")
                    .path("/fo")
                    .identity("global")
                    .token_bucket(100_000_000, 0)
                    .fail_open(fallback),
            )
    };
    let gw = config(3_000_000).start();
    let http = client();
    let statuses = |n: usize| {
        let (http, url) = (http.clone(), gw.url("/fo"));
        async move {
            let mut v = Vec::new();
            for _ in 0..n {
                v.push(http.get(&url).send().await.unwrap().status().as_u16());
            }
            v
        }
    };
    // Redis is unreachable: once a request has found it down, the breaker opens after two
    // failed connection attempts; then the emergency bucket (3, refilling 3 a second, so full
    // again after 0.4 s) is spent.
    assert_eq!(statuses(1).await, vec![200]);
    wait_until(Duration::from_secs(5), "the breaker to open", || {
        gw.metric("sentinel_breaker_state") == 1.0
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(statuses(4).await, vec![200, 200, 200, 429]);

    gw.rewrite_config(
        &config(3_000_000)
            .render(gw.port, gw.admin_port)
            .replace("[[routes]]", "# same limits\n[[routes]]"),
    );
    assert_eq!(
        http.post(gw.admin("/reload"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        gw.metric("sentinel_breaker_state"),
        1.0,
        "the breaker stays open across a reload"
    );
    assert_eq!(
        statuses(1).await,
        vec![429],
        "the spent emergency bucket carried over"
    );

    gw.rewrite_config(&config(5_000_000).render(gw.port, gw.admin_port));
    assert_eq!(
        http.post(gw.admin("/reload"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        statuses(6).await,
        vec![200, 200, 200, 200, 200, 429],
        "a new rate starts a fresh bucket"
    );

    // A listener change is accepted but reported as needing a restart.
    let running = std::fs::read_to_string(&gw.config_path).unwrap();
    let moved = running.replace("threads = 2", "threads = 3");
    let moved = if moved.contains("threads = 3") {
        moved
    } else {
        moved.replace("[server]\n", "[server]\nthreads = 3\n")
    };
    gw.rewrite_config(&moved);
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(
        body["restart_required"],
        serde_json::json!(["server.threads"])
    );
    // Said on as long as it waits, where a fleet's probes and scrapes see it.
    let readyz = |http: reqwest::Client| {
        let url = gw.admin("/readyz");
        async move {
            let r = http.get(url).send().await.unwrap();
            serde_json::from_str::<serde_json::Value>(&r.text().await.unwrap()).unwrap()
        }
    };
    assert_eq!(
        readyz(http.clone()).await["restart_required"],
        serde_json::json!(["server.threads"])
    );
    assert_eq!(gw.metric("sentinel_config_restart_required"), 1.0);
    // The file put back to the running values, the bound the default derived written out
    // too: nothing waits.
    let logs = gw.logs();
    let bound: String = (logs.split("\"max_connections\":").nth(1).unwrap())
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let written = running.replacen(
        "[server]\n",
        &format!("[server]\nmax_connections = {bound}\n"),
        1,
    );
    gw.rewrite_config(&written);
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body = readyz(http.clone()).await;
    assert!(body.get("restart_required").is_none(), "{body}");
    assert_eq!(gw.metric("sentinel_config_restart_required"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_file_reloads_itself_when_it_changes() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let watched = GatewayConfig::new(&redis.url()).server("watch_config", "true");
    let gw = routes(watched, &up.addr(), api(5)).start();
    let http = client();
    assert_eq!(http.get(gw.url("/new")).send().await.unwrap().status(), 404);
    let original = std::fs::read_to_string(&gw.config_path).unwrap();
    let mut text = original.clone();
    text.push_str(&new_route());
    gw.rewrite_config(&text);
    wait_until(Duration::from_secs(5), "the watcher to reload", || {
        gw.metric("sentinel_config_generation") == 2.0
    });
    assert_eq!(http.get(gw.url("/new")).send().await.unwrap().status(), 200);
    // A broken edit keeps the old config serving and is counted once.
    gw.rewrite_config(&text.replace("algorithm = \"none\"", "algorithm = \"nope\""));
    wait_until(Duration::from_secs(5), "the failed reload", || {
        gw.metric(r#"sentinel_config_reloads_total{result="failure"}"#) == 1.0
    });
    assert_eq!(http.get(gw.url("/new")).send().await.unwrap().status(), 200);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        gw.metric(r#"sentinel_config_reloads_total{result="failure"}"#),
        1.0,
        "not retried until it changes again"
    );
    // A file truncated on its way (a deploy's first write) is not a config of no routes: it
    // is refused, and the routes, the watch and the rest stay as they were.
    gw.rewrite_config("");
    wait_until(Duration::from_secs(5), "the empty file refused", || {
        gw.metric(r#"sentinel_config_reloads_total{result="failure"}"#) == 2.0
    });
    assert_eq!(http.get(gw.url("/new")).send().await.unwrap().status(), 200);
    gw.rewrite_config(&text);
    wait_until(
        Duration::from_secs(5),
        "the whole file loaded again",
        || gw.metric("sentinel_config_generation") == 3.0,
    );
    let mode = r#"sentinel_endpoint_mode{endpoint_id="l.new",mode="enforce"}"#;
    assert_eq!(gw.metric(mode), 1.0);
    // The route removed: no gauge says it is enforced any more.
    gw.rewrite_config(&original);
    wait_until(Duration::from_secs(5), "the route removed", || {
        gw.metric("sentinel_config_generation") == 4.0
    });
    let (_, body) = blocking_get(&gw.admin("/metrics")).unwrap();
    assert!(
        !body.contains(r#"sentinel_endpoint_mode{endpoint_id="l.new""#),
        "{body}"
    );
}

/// `watch_config` turned on by a reload watches from then on: the reload that turned it on
/// is not followed by another of the same file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_config_turned_on_by_a_reload_watches_from_then_on() {
    turn_the_watch_on_then_add_a_route(Duration::from_millis(2000)).await;
}

/// A change made right after the reload that turned `watch_config` on is loaded: the watch
/// compares with the files as that reload read them, not as its next look finds them (which
/// took in, and so lost, a change made in the half second between).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_right_after_the_reload_that_turned_the_watch_on_is_loaded() {
    turn_the_watch_on_then_add_a_route(Duration::ZERO).await;
}

/// Turns `watch_config` on by a reload, waits `pause`, then adds a route to the file: the
/// watch loads it, and only it.
async fn turn_the_watch_on_then_add_a_route(pause: Duration) {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(5)).start();
    let text = std::fs::read_to_string(&gw.config_path).unwrap();
    let watched = text.replacen("[server]\n", "[server]\nwatch_config = true\n", 1);
    assert_ne!(watched, text);
    gw.rewrite_config(&watched);
    assert_eq!(gw.reload(), 200);
    std::thread::sleep(pause);
    assert_eq!(gw.metric("sentinel_config_generation"), 2.0, "one reload");
    gw.rewrite_config(&format!("{watched}{}", new_route()));
    wait_until(Duration::from_secs(5), "the watcher to reload", || {
        gw.metric("sentinel_config_generation") == 3.0
    });
    assert_eq!(
        client().get(gw.url("/new")).send().await.unwrap().status(),
        200
    );
}

#[test]
fn a_busy_listen_address_fails_fast_and_names_it() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(5)).start();
    let clash = std::fs::read_to_string(&gw.config_path).unwrap().replace(
        &format!("admin_listen = \"127.0.0.1:{}\"", gw.admin_port),
        &format!("admin_listen = \"127.0.0.1:{}\"", common::free_port()),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, clash).unwrap();
    // The gateway started on `path` exits 1 at once, naming `field` and the busy address.
    let refused_naming = |field: &str| {
        let started = std::time::Instant::now();
        let out = common::run_binary(&[OsStr::new("--config"), path.as_os_str()], &[]);
        assert_eq!(out.status.code(), Some(1));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let named = format!("cannot listen on {field} 127.0.0.1:{}", gw.port);
        assert!(stderr.contains(&named), "{stderr}");
        assert!(started.elapsed() < Duration::from_secs(5));
    };
    refused_naming("server.listen");

    // A TLS listener's busy address is named by its own field.
    let (cert, key) = common::tls::Ca::new()
        .leaf(&["localhost"])
        .write(dir.path(), "edge");
    let tls_clash = std::fs::read_to_string(&path).unwrap().replace(
        &format!("listen = \"127.0.0.1:{}\"", gw.port),
        &format!("listen = \"127.0.0.1:{}\"", common::free_port()),
    ) + &format!(
        "\n[[server.tls]]\nlisten = \"127.0.0.1:{}\"\ncert_path = \"{}\"\nkey_path = \"{}\"\n",
        gw.port,
        cert.display(),
        key.display()
    );
    std::fs::write(&path, tls_clash).unwrap();
    refused_naming("server.tls[0].listen");
}

/// Signals that come while the gateway starts (its look at the eviction policy waits about a
/// second for a Redis that accepts and never answers) do not end it by their default action:
/// a SIGHUP or SIGUSR1 is kept for when it runs, a SIGTERM stops it then, with exit 0. (They
/// killed it: exit 129, 138 and 143.)
#[test]
fn signals_while_it_starts_do_not_kill_it() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let redis_url = format!("redis://{}/0", silent.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in silent.incoming() {
            held.push(s);
        }
    });
    let up = Upstream::start("app");
    for sig in ["HUP", "USR1", "TERM"] {
        let [port, admin] = common::free_ports();
        let config = routes(GatewayConfig::new(&redis_url), &up.addr(), api(5)).render(port, admin);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gateway.toml");
        std::fs::write(&path, config).unwrap();
        let out = dir.path().join("out.log");
        let mut proc = common::Proc::gateway(&path, Some(&out));
        // Once the process catches SIGHUP, SIGUSR1 and SIGTERM (bits 0, 9 and 14 of its
        // caught-signals mask), while it still waits for the silent Redis.
        wait_until(Duration::from_secs(10), "the signals caught", || {
            proc.catches(1 << 0 | 1 << 9 | 1 << 14)
        });
        assert_eq!(
            proc.wait_exit(Duration::ZERO),
            None,
            "{sig}: still starting"
        );
        let ready = common::blocking_get(&format!("http://127.0.0.1:{admin}/readyz"));
        assert!(
            ready
                .as_ref()
                .is_none_or(|(s, b)| *s == 503 && b.contains(r#""starting":true"#)),
            "{sig}: not ready yet, so the signal comes while it starts: {ready:?}"
        );
        proc.signal(sig);
        if sig == "TERM" {
            assert_eq!(proc.wait_exit(Duration::from_secs(10)), Some(0), "{sig}");
            // Told to stop as it starts, it says it is ready only before it says it drains
            // (whichever of the two came first), never after.
            let logs = std::fs::read_to_string(&out).unwrap();
            let at = |what: &str| logs.find(what);
            let draining = at("SIGTERM: draining").unwrap_or_else(|| panic!("{logs}"));
            assert!(
                at("gateway ready").is_none_or(|ready| ready < draining),
                "{logs}"
            );
            continue;
        }
        wait_until(Duration::from_secs(10), "ready after the signal", || {
            common::blocking_get(&format!("http://127.0.0.1:{admin}/readyz"))
                .is_some_and(|(s, _)| s == 200)
        });
        assert_eq!(proc.wait_exit(Duration::ZERO), None, "{sig}: it runs");
        if sig == "HUP" {
            // One reload for the one signal (it reloaded twice: the signal was noted both
            // as come before the runtime listened and by the runtime).
            let reloads = || {
                let logs = std::fs::read_to_string(&out).unwrap_or_default();
                logs.matches(r#""message":"config reloaded""#).count()
            };
            wait_until(Duration::from_secs(10), "the reload", || reloads() >= 1);
            std::thread::sleep(Duration::from_millis(500));
            assert_eq!(reloads(), 1);
        }
    }
}

/// A SIGHUP that comes while the config file is still being read (a supervisor's reload
/// right after the start) is a reload once the gateway runs: it ended the process by its
/// default action, as any signal before the runtime listened did; so did a SIGUSR1 or
/// SIGUSR2, which are ignored then. The config file is a FIFO here, so the read waits for it
/// as long as the test needs.
#[test]
fn a_sighup_while_the_config_is_read_is_a_reload_once_it_runs_and_usr1_usr2_are_ignored() {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let redis = Redis::start();
    let up = Upstream::start("app");
    let [port, admin] = common::free_ports();
    let config = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(5)).render(port, admin);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    common::mkfifo(&path);
    let out = dir.path().join("out.log");
    let mut proc = common::Proc::gateway(&path, Some(&out));
    // Once it catches SIGHUP, SIGUSR1 and SIGUSR2 (bits 0, 9 and 11 of its caught-signals
    // mask), it waits in the read. The two others are ignored then (their default ends a
    // process).
    let (hup, usr1, usr2) = (1, 1 << 9, 1 << 11);
    wait_until(Duration::from_secs(10), "the signals caught", || {
        proc.catches(hup | usr1 | usr2)
    });
    for signal in ["USR1", "USR2", "HUP"] {
        proc.signal(signal);
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        proc.wait_exit(Duration::ZERO),
        None,
        "alive after SIGUSR1, SIGUSR2 and SIGHUP"
    );
    // The FIFO opened for writing first (the gateway reads it), then a plain file put in its
    // place for the reload to read (a FIFO would wait for another writer), then the start's
    // config written and the FIFO closed.
    let mut fifo = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&path)
        .unwrap();
    let staged = dir.path().join("gateway.new");
    std::fs::write(&staged, &config).unwrap();
    std::fs::rename(&staged, &path).unwrap();
    fifo.write_all(config.as_bytes()).unwrap();
    drop(fifo);
    wait_until(Duration::from_secs(15), "ready", || {
        blocking_get(&format!("http://127.0.0.1:{admin}/readyz")).is_some_and(|(s, _)| s == 200)
    });
    wait_until(
        Duration::from_secs(10),
        "the reload the SIGHUP asked for",
        || {
            std::fs::read_to_string(&out).is_ok_and(|log| {
                log.lines().any(|l| {
                    l.contains(r#""message":"config reloaded""#)
                        && l.contains(r#""trigger":"signal""#)
                })
            })
        },
    );
    assert!(blocking_get(&format!("http://127.0.0.1:{port}/api/x")).is_some_and(|(s, _)| s == 200));
    assert_eq!(proc.wait_exit(Duration::ZERO), None, "it runs");
}

/// SIGUSR1 without an access log reopens nothing and says so (it said "access log reopened").
/// And a `RUST_LOG` that is no filter is said, not silently taken as `info`.
#[test]
fn sigusr1_without_an_access_log_says_there_is_none() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(5))
        .start_with_env(&[("RUST_LOG", "info,sentinel_gateway=loud")]);
    assert!(
        gw.logs()
            .contains("RUST_LOG is not a valid filter; logging at info"),
        "{}",
        gw.logs()
    );
    gw.proc.signal("USR1");
    wait_until(Duration::from_secs(5), "the SIGUSR1 line", || {
        gw.logs()
            .contains("no access log is configured; nothing to reopen")
    });
    assert!(!gw.logs().contains("access log reopened"));
    // Blank, or a list of nothing, is `info` (an empty filter passed no line at all).
    for blank in ["", " ", ","] {
        let gw = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(5))
            .start_with_env(&[("RUST_LOG", blank)]);
        assert!(
            gw.logs().contains("gateway ready"),
            "{blank:?}: {}",
            gw.logs()
        );
    }
}

/// A `SIGUSR1` while the access log is a FIFO whose reader went away (a log shipper that
/// restarts) cannot reopen it and says so at once: the reopen waited in the open for a
/// reader, on the thread of the admin listener and the signals, so `/healthz` stopped
/// answering and a SIGTERM no longer ended the process.
#[test]
fn a_reopen_to_a_fifo_nobody_reads_holds_nothing() {
    use std::os::unix::fs::OpenOptionsExt;
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("access.fifo");
    common::mkfifo(&fifo);
    // A reader while the gateway starts (its open waits for one, as nginx's does).
    let reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    let mut gw = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(100))
        .access_log(&fifo)
        .server("grace_period_seconds", "5")
        .start();
    drop(reader);
    gw.proc.signal("USR1");
    wait_until(Duration::from_secs(5), "the failed reopen said", || {
        gw.logs().contains("cannot reopen the access log")
    });
    assert!(
        gw.logs().contains("a FIFO no process reads"),
        "{}",
        gw.logs()
    );
    let started = Instant::now();
    let health = blocking_get(&gw.admin("/healthz"));
    assert_eq!(health.map(|(s, _)| s), Some(200));
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(blocking_get(&gw.url("/api/x")).is_some_and(|(s, _)| s == 200));
    gw.proc.signal("TERM");
    assert_eq!(gw.proc.wait_exit(Duration::from_secs(10)), Some(0));
}

/// A file cut short after its first tables (a deploy's half-written copy) is valid TOML with
/// no route: a reload to it is refused, the routes keep serving, and `check` warns of it. It
/// was taken, and every request was 404.
#[test]
fn a_reload_that_would_take_every_route_away_is_refused() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = routes(GatewayConfig::new(&redis.url()), &up.addr(), api(100)).start();
    assert_eq!(blocking_get(&gw.url("/api/x")).map(|(s, _)| s), Some(200));
    let text = std::fs::read_to_string(&gw.config_path).unwrap();
    let cut = &text[..text.find("[[routes]]").expect("a route")];
    gw.rewrite_config(cut);
    let (status, body) = gw.reload_answer();
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("the file has no [[routes]]"), "{body}");
    assert_eq!(blocking_get(&gw.url("/api/x")).map(|(s, _)| s), Some(200));
    let out = common::check_config(&gw.config_path, &[]);
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("no [[routes]]: every request is answered 404"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A reload that keeps an endpoint's `policy_version` but moves its buckets all the same (a
/// limit's algorithm or sliding window's size changed, or its limits moved to
/// `[[routes.limits]]`) says so at WARN;
/// with a new `policy_version`, which says it on purpose, it does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_moves_buckets_under_the_same_policy_version_says_so() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let with = |route: Route| routes(file_config(&redis.url()), &up.addr(), route);
    let gw = with(api(5)).start();
    let window = || {
        Route::new("l.api")
            .prefix("/api")
            .identity("global")
            .sliding_window(5, 60_000_000)
    };
    let said = |gw: &common::Gateway, what: &str| {
        gw.logs()
            .lines()
            .filter(|l| l.contains("\"WARN\"") && l.contains(what))
            .count()
    };
    let algorithm = "from token_bucket to sliding_window under the same policy_version";
    gw.rewrite_config(&with(window()).render(gw.port, gw.admin_port));
    assert_eq!(gw.reload(), 200);
    wait_until(Duration::from_secs(3), "the warning", || {
        said(&gw, algorithm) == 1
    });
    // A sliding window's size: its counts are kept by the window's index.
    let wider = Route::new("l.api")
        .prefix("/api")
        .identity("global")
        .sliding_window(5, 120_000_000);
    gw.rewrite_config(&with(wider).render(gw.port, gw.admin_port));
    assert_eq!(gw.reload(), 200);
    wait_until(Duration::from_secs(3), "the warning", || {
        said(
            &gw,
            "window_size_micro from 60000000 to 120000000 under the same policy_version",
        ) == 1
    });
    gw.rewrite_config(&with(window().policy_version(2)).render(gw.port, gw.admin_port));
    assert_eq!(gw.reload(), 200);
    let several = Route::new("l.api")
        .prefix("/api")
        .identity("global")
        .policy_version(2)
        .bucket_limit("default", 5, 0);
    gw.rewrite_config(&with(several).render(gw.port, gw.admin_port));
    assert_eq!(gw.reload(), 200);
    wait_until(Duration::from_secs(3), "the warning", || {
        said(&gw, "between the single-limit fields and [[routes.limits]]") == 1
    });
    assert_eq!(
        said(&gw, "under the same policy_version"),
        3,
        "{}",
        gw.logs()
    );
}

/// A stdout nobody reads (a log collector that stalled) stops no request, limited or not,
/// and not the exit at SIGTERM: the lines it cannot take go to a thread of their own, and
/// past a buffer are dropped and counted. With the access log on stdout too, every line that
/// comes out is whole, none cut by another (each writer's, through one queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stdout_nobody_reads_stops_no_request_and_no_exit() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let keyed = Route::new("l.keyed")
        .prefix("/keyed")
        .identity_header("X-API-Key")
        .token_bucket(1_000_000, 0);
    // A budget no busy machine overruns: every one of the denials below is Redis's.
    let config = routes(GatewayConfig::new(&redis.url()), &up.addr(), keyed)
        .route(Route::new("l.open").prefix("/open").unlimited())
        .redis("timeout_ms", "1000")
        .access_log(std::path::Path::new("-"));
    let [port, admin_port] = common::free_ports();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, config.render(port, admin_port)).unwrap();
    // Its stdout is a pipe held open and never read.
    let mut gw = common::Proc {
        child: std::process::Command::new(env!("CARGO_BIN_EXE_sentinel-gateway"))
            .arg("--config")
            .arg(&path)
            .env_remove("SENTINEL_REDIS_URL")
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
        name: "sentinel-gateway",
    };
    let admin = |p: &str| format!("http://127.0.0.1:{admin_port}{p}");
    wait_until(Duration::from_secs(20), "the gateway ready", || {
        blocking_get(&admin("/readyz")).is_some_and(|(s, _)| s == 200)
    });
    // A WARN line each (about 400 bytes): far more than the pipe and the buffer hold.
    let http = client();
    let mut senders = Vec::new();
    for _ in 0..8 {
        let http = http.clone();
        let url = format!("http://127.0.0.1:{port}/keyed/x");
        senders.push(tokio::spawn(async move {
            let mut denied = 0;
            for _ in 0..2_600 {
                let r = http.get(&url).header("X-API-Key", "k").send().await;
                denied += u32::from(r.expect("answered").status() == 429);
            }
            denied
        }));
    }
    let mut denied = 0;
    for s in senders {
        denied += s.await.unwrap();
    }
    assert!(denied >= 20_799, "{denied} denials");
    let open = http
        .get(format!("http://127.0.0.1:{port}/open/x"))
        .send()
        .await
        .unwrap();
    assert_eq!(open.status(), 200);
    let (_, metrics) = blocking_get(&admin("/metrics")).unwrap();
    let dropped = common::metric_value(&metrics, "sentinel_log_dropped_total")
        + common::metric_value(&metrics, "sentinel_access_log_dropped_total");
    assert!(dropped > 0.0, "{dropped}");
    // Read from now on: what waited comes out, then the exit's lines.
    let mut out = gw.child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        std::io::Read::read_to_string(&mut out, &mut all).unwrap();
        all
    });
    gw.signal("TERM");
    // The drain, then at most a second and a half for the lines left: room for a loaded
    // machine.
    assert_eq!(gw.wait_exit(Duration::from_secs(10)), Some(0));
    let all = reader.join().unwrap();
    let (mut denials, mut requests) = (0, 0);
    for line in all.lines() {
        let line: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a line cut or spliced ({e}): {line}"));
        denials += u32::from(line["message"] == "request denied");
        requests += u32::from(line["request_id"].is_string() && line["status"].is_number());
    }
    assert!(denials > 0 && requests > 0, "{denials} {requests}");
}

/// Which config an instance runs: `/readyz`'s `config_hash` and `sentinel_config_info`, the
/// first 16 hex digits of the SHA-256 of the file's text (alike on every gateway given the
/// same file, where `config_generation` counts one process's reloads), one series alone,
/// following a reload.
#[test]
fn the_config_an_instance_runs_is_named_by_its_hash() {
    use sha2::Digest;
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(Route::new("e.open").prefix("/").unlimited())
        .start();
    let hash_of = |path: &std::path::Path| -> String {
        let digest = sha2::Sha256::digest(std::fs::read(path).unwrap());
        digest[..8].iter().map(|b| format!("{b:02x}")).collect()
    };
    let readyz = || -> serde_json::Value {
        let (_, body) = common::blocking_get(&gw.admin("/readyz")).unwrap();
        serde_json::from_str(&body).unwrap()
    };
    let series = || -> Vec<String> {
        let (_, body) = common::blocking_get(&gw.admin("/metrics")).unwrap();
        (body.lines())
            .filter(|l| l.starts_with("sentinel_config_info{"))
            .map(str::to_owned)
            .collect()
    };
    let first = hash_of(&gw.config_path);
    assert_eq!(readyz()["config_hash"], first.as_str());
    assert_eq!(
        series(),
        [format!("sentinel_config_info{{config_hash=\"{first}\"}} 1")]
    );
    let text = std::fs::read_to_string(&gw.config_path).unwrap();
    std::fs::write(&gw.config_path, format!("# edited\n{text}")).unwrap();
    let (status, body) = gw.reload_answer();
    assert_eq!(status, 200, "{body}");
    let second = hash_of(&gw.config_path);
    assert_ne!(first, second);
    let ready = readyz();
    assert_eq!(
        (&ready["config_hash"], &ready["config_generation"]),
        (&second.as_str().into(), &2.into())
    );
    assert_eq!(
        series(),
        [format!(
            "sentinel_config_info{{config_hash=\"{second}\"}} 1"
        )]
    );
}
