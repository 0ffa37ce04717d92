//! Redis over TLS (`rediss://`, a CA file, client certificates) and with ACL credentials
//! (`username`, `password_env`), against a real redis-server with `--tls-port` and ACL users.
//! Each server also has a plain port, which only the test uses to look inside.

mod common;

use std::time::Duration;

use common::config::{quoted, GatewayConfig, Route};
use common::tls::Ca;
use common::{client, free_port, wait_until, Redis, Upstream};

struct TlsRedis {
    redis: Redis,
    tls_port: u16,
    ca: Ca,
    dir: tempfile::TempDir,
}

/// A redis-server with a TLS port whose certificate names 127.0.0.1; `clients` asks it to
/// require client certificates signed by the same CA.
fn tls_redis(require_client_certs: bool) -> TlsRedis {
    tls_redis_with(require_client_certs, &[])
}

/// As [`tls_redis`], with `extra` arguments for redis-server (ACL users, say).
fn tls_redis_with(require_client_certs: bool, extra: &[&str]) -> TlsRedis {
    let ca = Ca::new();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = ca.leaf(&["127.0.0.1"]).write(dir.path(), "redis");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &ca.pem).unwrap();
    let tls_port = free_port();
    let auth = if require_client_certs { "yes" } else { "no" };
    let args = [
        "--tls-port".to_owned(),
        tls_port.to_string(),
        "--tls-cert-file".to_owned(),
        cert.display().to_string(),
        "--tls-key-file".to_owned(),
        key.display().to_string(),
        "--tls-ca-cert-file".to_owned(),
        ca_file.display().to_string(),
        "--tls-auth-clients".to_owned(),
        auth.to_owned(),
    ];
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend_from_slice(extra);
    let redis = Redis::start_with(free_port(), &args);
    TlsRedis {
        redis,
        tls_port,
        ca,
        dir,
    }
}

impl TlsRedis {
    fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/0", self.tls_port)
    }

    fn url_db(&self, db: u8) -> String {
        format!("rediss://127.0.0.1:{}/{db}", self.tls_port)
    }

    fn ca_path(&self) -> String {
        self.dir.path().join("ca.pem").display().to_string()
    }
}

/// redis-server's arguments for the ACL user `gateway` (password `s3cret-Pa55word`).
const ACL_USER: [&str; 7] = [
    "--user",
    "gateway",
    "on",
    ">s3cret-Pa55word",
    "~*",
    "&*",
    "+@all",
];

fn limited(config: GatewayConfig, up: &Upstream) -> GatewayConfig {
    config.upstream("app", &[up.addr()]).route(
        Route::new("e.api")
            .prefix("/api")
            .identity_header("X-API-Key")
            .token_bucket(3_000_000, 0)
            .fail_closed(),
    )
}

fn redis_up(gw: &common::Gateway) -> bool {
    common::blocking_get(&gw.admin("/readyz"))
        .is_some_and(|(_, body)| body.contains("\"redis\":\"up\""))
}

/// Until a first request is admitted (within 10 s): a gateway's first decision moves its
/// Redis connection to the proxy's workers, a few round trips that a machine busy with other
/// tests can stretch past the budget (its route's fail mode then answers).
async fn warmed(gw: &common::Gateway) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while statuses(gw, "warm-up", 1).await != [200] {
        assert!(std::time::Instant::now() < deadline, "{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
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
            .unwrap_or_else(|e| panic!("{e:?}\nLOGS:\n{}", gw.logs()));
        out.push(r.status().as_u16());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_over_tls_decides_exactly_and_survives_a_restart() {
    let mut t = tls_redis(false);
    let up = Upstream::start("app");
    let gw = limited(
        GatewayConfig::new(&t.url()).redis("tls_ca_path", quoted(&t.ca_path())),
        &up,
    )
    .start();
    assert_eq!(statuses(&gw, "a", 5).await, [200, 200, 200, 429, 429]);
    assert!(t.redis.limiter_calls() >= 5, "the decisions were Redis's");
    // NOSCRIPT over TLS: the scripts are loaded again within the request's budget.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut t.redis.conn())
        .unwrap();
    assert_eq!(statuses(&gw, "n", 2).await, [200, 200]);
    assert!(redis_up(&gw));

    // kill -9 and restart on the same ports: the socket watch notices over TLS too, and
    // decisions are Redis's again (the bucket is new: the restarted Redis is empty).
    let (port, tls_port) = (t.redis.port, t.tls_port);
    t.redis.proc.signal("KILL");
    t.redis.proc.wait_exit(Duration::from_secs(5));
    wait_until(
        Duration::from_secs(5),
        "the gateway to see Redis gone",
        || gw.metric("sentinel_redis_connected") == 0.0,
    );
    let restarted = TlsRedis {
        redis: Redis::start_with(
            port,
            &[
                "--tls-port",
                &tls_port.to_string(),
                "--tls-cert-file",
                &t.dir.path().join("redis.pem").display().to_string(),
                "--tls-key-file",
                &t.dir.path().join("redis.key").display().to_string(),
                "--tls-ca-cert-file",
                &t.ca_path(),
                "--tls-auth-clients",
                "no",
            ],
        ),
        ..t
    };
    wait_until(Duration::from_secs(10), "the gateway to reconnect", || {
        redis_up(&gw)
    });
    assert_eq!(statuses(&gw, "b", 4).await, [200, 200, 200, 429]);
    drop(restarted);
}

/// The decisions' own connection (beside redis-rs's) makes the same TLS handshake, logs in as
/// the same ACL user and selects the URL's database: decisions in flight together over it
/// share calls and are admitted exactly, before and after a `SCRIPT FLUSH`, and the buckets
/// are written in that database only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_as_an_acl_user_batched_decisions_are_exact_in_the_urls_database() {
    let t = tls_redis_with(false, &ACL_USER);
    let up = Upstream::start("app");
    // 1 s budget: this test counts admissions; a late decision of a debug build on a busy
    // machine would be a 503 by design (the budget has tests of its own).
    let config = GatewayConfig::new(&t.url_db(3))
        .redis("tls_ca_path", quoted(&t.ca_path()))
        .redis("username", quoted("gateway"))
        .redis("password_env", quoted("TEST_REDIS_PASSWORD"))
        .redis("timeout_ms", "1000")
        .upstream("app", &[up.addr()])
        .route(
            Route::new("e.api")
                .prefix("/api")
                .identity_header("X-API-Key")
                .token_bucket(20_000_000, 0)
                .fail_closed(),
        );
    let gw = config.start_with_env(&[("TEST_REDIS_PASSWORD", "s3cret-Pa55word")]);
    let urls = [gw.url("/api/x")];
    // 24 connections, 4 requests each, one identity: exactly its 20 tokens are spent.
    assert_eq!(
        common::admitted_over(&urls, 24, 4, ("X-API-Key", "a")).await,
        20
    );
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut t.redis.conn())
        .unwrap();
    let as_gateway = clients
        .lines()
        .filter(|l| l.contains("user=gateway"))
        .count();
    assert!(
        as_gateway >= 2,
        "both connections log in as the ACL user: {clients}"
    );
    assert!(
        clients
            .lines()
            .filter(|l| l.contains("user=gateway"))
            .all(|l| l.contains(" db=3 ")),
        "both connections use the URL's database: {clients}"
    );

    // The scripts are gone: the first batch after it loads the batch script once, on the
    // decisions' connection, and is sent again behind it within the budget.
    let loads = t.redis.command_calls("script|load");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query(&mut t.redis.conn())
        .unwrap();
    assert_eq!(
        common::admitted_over(&urls, 24, 4, ("X-API-Key", "b")).await,
        20
    );
    assert!(t.redis.command_calls("script|load") > loads);
    let decisions = 2.0 * 24.0 * 4.0;
    // Each decision went in a batch but for a few sent alone: those queued on the first
    // connection when the decisions' connection moved onto the workers, and any that would
    // have waited too long behind a call on a machine busy enough to make the round trip
    // look far.
    let batched = gw.metric("sentinel_redis_batch_size_sum");
    assert!(
        batched <= decisions && batched >= decisions - 24.0,
        "{batched} of {decisions} decisions in batches"
    );
    assert!(
        gw.metric("sentinel_redis_batch_size_count") < decisions,
        "decisions in flight together shared calls"
    );
    assert_eq!(
        gw.metric(r#"sentinel_store_errors_total{cause="noscript"}"#),
        0.0
    );

    let mut plain = t.redis.conn();
    let in_db0: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut plain).unwrap();
    assert!(
        in_db0.is_empty(),
        "nothing written in database 0: {in_db0:?}"
    );
    let _: () = redis::cmd("SELECT").arg(3).query(&mut plain).unwrap();
    let in_db3: Vec<String> = redis::cmd("KEYS")
        .arg("sentinel:*")
        .query(&mut plain)
        .unwrap();
    assert!(
        in_db3.len() >= 2,
        "both identities' buckets in database 3: {in_db3:?}"
    );
}

/// `require_noeviction` and the fleet heartbeat over TLS: an evicting Redis stops the start
/// (exit 2, the policy named); on a noeviction one two gateways count each other and
/// `/readyz` shows the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_the_eviction_policy_is_checked_and_the_fleet_heartbeat_beats() {
    let t = tls_redis(false);
    let up = Upstream::start("app");
    let set_policy = |policy: &str| {
        t.redis.config_set("maxmemory-policy", policy);
    };
    let config = GatewayConfig::new(&t.url())
        .redis("tls_ca_path", quoted(&t.ca_path()))
        .upstream("app", &[up.addr()])
        .route(common::config::fleet_route());
    set_policy("allkeys-lru");
    let (code, stderr) = config.start_refused();
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("redis maxmemory-policy is allkeys-lru"),
        "{stderr}"
    );

    set_policy("noeviction");
    let gateways = [config.start(), config.start()];
    for gw in &gateways {
        wait_until(
            Duration::from_secs(10),
            "both gateways in the fleet",
            || gw.metric("sentinel_fleet_instances") == 2.0,
        );
        let (_, body) = common::blocking_get(&gw.admin("/readyz")).unwrap();
        assert!(
            body.contains(r#""redis_maxmemory_policy":"noeviction""#),
            "{body}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_redis_certificate_is_a_connection_error_never_a_plain_connection() {
    let t = tls_redis(false);
    let up = Upstream::start("app");
    // No tls_ca_path: the system roots do not know the test CA.
    let gw = limited(GatewayConfig::new(&t.url()), &up).start();
    assert_eq!(statuses(&gw, "a", 2).await, [503, 503]);
    wait_until(Duration::from_secs(5), "the reason in the log", || {
        gw.logs().contains("TLS handshake with redis")
    });
    assert_eq!(t.redis.limiter_calls(), 0);
    // The CA given by a reload: the connection is made again, said as what changed (it was
    // said to be the URL or the credentials), and decisions are Redis's.
    let trusted = limited(
        GatewayConfig::new(&t.url()).redis("tls_ca_path", quoted(&t.ca_path())),
        &up,
    );
    gw.rewrite_config(&trusted.render(gw.port, gw.admin_port));
    assert_eq!(gw.reload(), 200);
    assert!(
        gw.logs()
            .contains(r#""message":"redis connection settings changed; reconnecting","changed":"the TLS settings or files""#),
        "{}",
        gw.logs()
    );
    wait_until(Duration::from_secs(5), "connected", || redis_up(&gw));
    assert_eq!(statuses(&gw, "b", 1).await, [200]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_needs_the_client_certificate() {
    let t = tls_redis(true);
    let up = Upstream::start("app");
    let without = limited(
        GatewayConfig::new(&t.url()).redis("tls_ca_path", quoted(&t.ca_path())),
        &up,
    )
    .start();
    assert_eq!(statuses(&without, "a", 2).await, [503, 503]);
    // Said as TLS's refusal, and what it asks for (TLS 1.3 sends the alert after the
    // handshake, where it read as a bare "received fatal alert").
    wait_until(Duration::from_secs(5), "the refusal's reason", || {
        without
            .logs()
            .contains("TLS handshake with redis: received fatal alert: CertificateRequired: it asks for a client certificate")
    });

    let leaf = t.ca.leaf(&["sentinel-gateway"]);
    let not_after = x509_parser::parse_x509_certificate(&leaf.der)
        .unwrap()
        .1
        .validity()
        .not_after
        .timestamp() as f64;
    let (cert, key) = leaf.write(t.dir.path(), "client");
    let with = limited(
        GatewayConfig::new(&t.url())
            .redis("tls_ca_path", quoted(&t.ca_path()))
            .redis("tls_cert_path", quoted(&cert.display().to_string()))
            .redis("tls_key_path", quoted(&key.display().to_string())),
        &up,
    )
    .start();
    assert_eq!(statuses(&with, "a", 4).await, [200, 200, 200, 429]);
    // Redis refuses the certificate once it expires: its date is watched as the listeners'.
    assert_eq!(
        with.metric(&format!(
            "sentinel_tls_cert_expiry_timestamp_seconds{{cert_path=\"{}\"}}",
            cert.display()
        )),
        not_after
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_with_the_password_from_the_environment() {
    let redis = Redis::start_with(free_port(), &ACL_USER);
    let up = Upstream::start("app");
    let config = limited(
        GatewayConfig::new(&redis.url())
            .redis("username", quoted("gateway"))
            .redis("password_env", quoted("TEST_REDIS_PASSWORD")),
        &up,
    );
    let gw = config.start_with_env(&[("TEST_REDIS_PASSWORD", "s3cret-Pa55word")]);
    assert_eq!(statuses(&gw, "a", 4).await, [200, 200, 200, 429]);
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut redis.conn())
        .unwrap();
    assert!(clients.contains("user=gateway"), "{clients}");

    // A wrong password: every decision is a redis_connection_error, logged with Redis's
    // reason, never with the password.
    let wrong = config.start_with_env(&[("TEST_REDIS_PASSWORD", "not-the-password")]);
    assert_eq!(statuses(&wrong, "a", 3).await, [503, 503, 503]);
    wait_until(Duration::from_secs(5), "WRONGPASS in the log", || {
        wrong.logs().contains("WRONGPASS")
    });
    let logs = wrong.logs();
    assert!(!logs.contains("not-the-password"), "{logs}");
    let metrics = common::blocking_get(&wrong.admin("/metrics")).unwrap().1;
    assert!(!metrics.contains("not-the-password"));
    // The store failure is a connection error; the fail_closed route answers by its mode.
    assert_eq!(
        wrong.metric("sentinel_store_errors_total{cause=\"connection_error\"}"),
        3.0,
        "{metrics}"
    );
}

/// A Redis password in a file, replaced whole as the kubelet swaps a Secret's files.
struct PasswordFile {
    dir: tempfile::TempDir,
}

impl PasswordFile {
    fn holding(password: &str) -> Self {
        let file = PasswordFile {
            dir: tempfile::tempdir().unwrap(),
        };
        std::fs::write(file.path(), password).unwrap();
        file
    }

    fn path(&self) -> std::path::PathBuf {
        self.dir.path().join("redis-password")
    }

    fn replace(&self, password: &str) {
        let next = self.dir.path().join(".next");
        std::fs::write(&next, password).unwrap();
        std::fs::rename(&next, self.path()).unwrap();
    }
}

/// The ACL user `gateway` with its password read from `file`, watched; `breaker` set.
fn on_a_password_file(
    redis: &Redis,
    up: &Upstream,
    file: &PasswordFile,
    breaker: Option<(u32, u64)>,
) -> common::Gateway {
    let mut config = GatewayConfig::new(&redis.url())
        .server("watch_config", "true")
        .redis("username", quoted("gateway"))
        .redis("password_file", quoted(file.path().to_str().unwrap()));
    if let Some((failures, open_seconds)) = breaker {
        config = config.breaker(failures, open_seconds);
    }
    limited(config, up).start()
}

/// Requests (each answered as `each` says, when it says) until the breaker opens, within
/// 10 s.
async fn until_the_breaker_opens(gw: &common::Gateway, each: Option<u16>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while gw.metric("sentinel_breaker_state") != 1.0 {
        let answered = statuses(gw, "a", 1).await;
        if let Some(status) = each {
            assert_eq!(answered, [status]);
        }
        assert!(std::time::Instant::now() < deadline, "{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A password read from a file of its own (a Kubernetes Secret's), rotated as Redis's ACLs
/// rotate one: the new password added to the user, the file replaced (watched: reloaded),
/// the old password taken away. Connections made after that use the new one; neither is
/// ever in a log line or a metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_from_a_file_rotates_with_the_file() {
    let redis = Redis::start_with(free_port(), &ACL_USER);
    let up = Upstream::start("app");
    // As `echo` writes it: the line break is not part of the password.
    let file = PasswordFile::holding("s3cret-Pa55word\n");
    let gw = on_a_password_file(&redis, &up, &file, None);
    warmed(&gw).await;
    assert_eq!(statuses(&gw, "a", 4).await, [200, 200, 200, 429]);

    let acl = |args: &[&str]| {
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("gateway")
            .arg(args)
            .query(&mut redis.conn())
            .unwrap();
    };
    acl(&[">n3w-Pa55word-2"]);
    file.replace("n3w-Pa55word-2\r\n");
    wait_until(Duration::from_secs(10), "the watch to reload", || {
        gw.metric("sentinel_config_generation") == 2.0
    });
    acl(&["<s3cret-Pa55word"]);
    // Every connection of the gateway cut: those it makes again must use the new password.
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("USER")
        .arg("gateway")
        .query(&mut redis.conn())
        .unwrap();
    warmed(&gw).await;
    assert_eq!(statuses(&gw, "b", 4).await, [200, 200, 200, 429]);
    let logs = gw.logs();
    let metrics = common::blocking_get(&gw.admin("/metrics")).unwrap().1;
    for secret in ["s3cret-Pa55word", "n3w-Pa55word-2"] {
        assert!(!logs.contains(secret), "{logs}");
        assert!(!metrics.contains(secret));
    }
}

/// A wrong password mended by a reload ends the quarantine its failures opened: they were
/// the old credentials', so the next request probes with the new ones, as after a
/// Sentinel failover, rather than waiting out `open_seconds`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mended_password_ends_the_quarantine_the_wrong_one_opened() {
    let redis = Redis::start_with(free_port(), &ACL_USER);
    let up = Upstream::start("app");
    let file = PasswordFile::holding("not-the-Pa55word\n");
    let gw = on_a_password_file(&redis, &up, &file, Some((2, 600)));
    // Refused at every attempt: the first requests fail, then the breaker opens.
    until_the_breaker_opens(&gw, Some(503)).await;
    file.replace("s3cret-Pa55word\n");
    wait_until(Duration::from_secs(10), "the watch to reload", || {
        gw.metric("sentinel_config_generation") == 2.0
    });
    // Ten minutes of quarantine without the mend; seconds with it (the reconnection waits
    // at most one step of its backoff; generous for a loaded machine).
    warmed(&gw).await;
    assert_eq!(statuses(&gw, "b", 4).await, [200, 200, 200, 429]);
    assert_eq!(gw.metric("sentinel_breaker_state"), 0.0);
}

/// A reload to a password Redis refuses, while the working one is connected, keeps that
/// connection deciding (no request fails, no breaker opens), says so at ERROR without either
/// password, and moves to the new password once Redis's ACL takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_a_refused_password_keeps_the_working_connection_deciding() {
    let redis = Redis::start_with(free_port(), &ACL_USER);
    let up = Upstream::start("app");
    let file = PasswordFile::holding("s3cret-Pa55word\n");
    let gw = on_a_password_file(&redis, &up, &file, Some((2, 600)));
    warmed(&gw).await;
    file.replace("typo-Pa55word\n");
    wait_until(Duration::from_secs(10), "the refusal said", || {
        gw.logs()
            .contains("the reloaded redis settings are refused")
    });
    assert_eq!(gw.metric("sentinel_config_generation"), 2.0);
    // Decided by Redis, on the connection made with the working password.
    assert_eq!(statuses(&gw, "b", 4).await, [200, 200, 200, 429]);
    assert_eq!(gw.metric("sentinel_breaker_state"), 0.0);
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "gateway", ">typo-Pa55word"])
        .query(&mut redis.conn())
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        "the move to the new password",
        || {
            gw.logs()
                .contains("redis connected with the reloaded settings")
        },
    );
    assert_eq!(statuses(&gw, "b", 1).await, [429]);
    let logs = gw.logs();
    for secret in ["s3cret-Pa55word", "typo-Pa55word"] {
        assert!(!logs.contains(secret), "{logs}");
    }
}

/// A reload to a password Redis refuses, while no connection is up (the old password was
/// refused too), opens a quarantine on the new target's own failures: a connection made
/// later with it (the ACL given that password meanwhile, no reload) ends none of it early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantine_the_new_passwords_refusals_opened_runs_its_course() {
    let redis = Redis::start_with(free_port(), &ACL_USER);
    let up = Upstream::start("app");
    let file = PasswordFile::holding("not-the-Pa55word\n");
    let gw = on_a_password_file(&redis, &up, &file, Some((2, 600)));
    until_the_breaker_opens(&gw, None).await;
    file.replace("typo-Pa55word\n");
    wait_until(Duration::from_secs(10), "the watch to reload", || {
        gw.metric("sentinel_config_generation") == 2.0
    });
    // The new password's own refusals: the breaker stays open (reopened) on them.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "gateway", ">typo-Pa55word"])
        .query(&mut redis.conn())
        .unwrap();
    wait_until(Duration::from_secs(10), "the new password taken", || {
        redis_up(&gw)
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(statuses(&gw, "b", 1).await, [503]);
    assert_eq!(gw.metric("sentinel_breaker_state"), 1.0);
}

/// A secret's file is one of two places: not beside its variable, and one that cannot be
/// read is a config error naming the field and the file, never what it holds.
#[test]
fn a_secret_file_is_checked_as_its_variable_is() {
    let dir = tempfile::tempdir().unwrap();
    let check = |body: &str| common::check_body(dir.path(), body, &[("SENTINEL_REDIS_URL", None)]);
    let (ok, out) = check("[redis]\npassword_env = \"X\"\npassword_file = \"pw\"");
    assert!(
        !ok && out.contains("redis.password_env and redis.password_file are both set"),
        "{out}"
    );
    let (ok, out) = check("[redis]\npassword_file = \"missing-pw\"");
    assert!(
        !ok && out.contains("redis.password_file = \"missing-pw\": cannot read it: No such file"),
        "{out}"
    );
    std::fs::write(dir.path().join("empty"), "\n").unwrap();
    let (ok, out) = check("[redis]\npassword_file = \"empty\"");
    let empty = dir.path().join("empty");
    assert!(
        !ok && out.contains(&format!(
            "redis.password_file: the file {} is empty",
            empty.display()
        )),
        "{out}"
    );
    // One last line break is the file's, a second one the password's: refused, not sent.
    std::fs::write(dir.path().join("two-breaks"), "s3cret-Pa55word\n\n").unwrap();
    let (ok, out) = check("[redis]\npassword_file = \"two-breaks\"");
    assert!(!ok && out.contains("holds a line break or a NUL"), "{out}");
    assert!(!out.contains("s3cret"), "{out}");
    // A secret's file is a secret, not a device that never ends.
    let (ok, out) = check("[redis]\npassword_file = \"/dev/zero\"");
    assert!(
        !ok && out.contains("redis.password_file = \"/dev/zero\" is over 64 KiB"),
        "{out}"
    );
    std::fs::write(dir.path().join("short-token"), "Tok3n-short\n").unwrap();
    // Inside `[server]`, which `check_body` opens.
    let (ok, out) = check("admin_token_file = \"short-token\"");
    let short = dir.path().join("short-token");
    assert!(
        !ok && out.contains(&format!("server.admin_token_file: the file {} holds 11 bytes: the admin token must be at least 16 bytes", short.display())),
        "{out}"
    );
    assert!(!out.contains("Tok3n"), "{out}");
    std::fs::write(
        dir.path().join("token"),
        "an-admin-token-of-32-bytes-0123\n",
    )
    .unwrap();
    let (ok, out) = check("[redis]\npassword_file = \"token\"");
    assert!(ok, "{out}");
    assert!(!out.contains("an-admin-token"), "{out}");
}

/// An outage is logged again when its reason changes: a Redis restarted with the gateway's
/// password rotated away is logged as refusing it, not only as the refused connections of
/// the seconds before (the one line of the outage named those alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_whose_reason_changes_is_logged_again() {
    let port = free_port();
    let redis = Redis::start_with(port, &ACL_USER);
    let up = Upstream::start("app");
    let gw = limited(
        GatewayConfig::new(&redis.url())
            .redis("username", quoted("gateway"))
            .redis("password_env", quoted("TEST_REDIS_PASSWORD")),
        &up,
    )
    .start_with_env(&[("TEST_REDIS_PASSWORD", "s3cret-Pa55word")]);
    assert_eq!(statuses(&gw, "a", 1).await, [200]);
    let outage_lines = |gw: &common::Gateway| {
        gw.logs()
            .lines()
            .filter(|l| l.contains("redis unavailable"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    drop(redis);
    wait_until(Duration::from_secs(10), "the outage logged", || {
        !outage_lines(&gw).is_empty()
    });
    let mut rotated = ACL_USER;
    rotated[3] = ">rotated-Pa55word";
    let _redis = Redis::start_with(port, &rotated);
    wait_until(
        Duration::from_secs(10),
        "the refused password logged",
        || outage_lines(&gw).iter().any(|l| l.contains("WRONGPASS")),
    );
    // Once per reason, not per retry.
    let reasons: Vec<String> = outage_lines(&gw)
        .iter()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["error"].to_string())
        .collect();
    // One for the node not reached (refused, reset or timed out: one reason), one for the
    // refused password.
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    // A dependency's fault: at ERROR (contract section 8).
    assert!(
        outage_lines(&gw)
            .iter()
            .all(|l| l.contains(r#""level":"ERROR""#)),
        "{:?}",
        outage_lines(&gw)
    );
    assert!(!gw.logs().contains("Pa55word"), "never a password");
}

#[test]
fn check_refuses_tls_settings_that_would_not_be_used_and_unreadable_files() {
    let dir = tempfile::tempdir().unwrap();
    let check = |redis: &str, env: &[(&str, Option<&str>)]| {
        common::check_body(dir.path(), &format!("[redis]\n{redis}\n"), env)
    };
    let (ok, out) = check(
        "url = \"redis://127.0.0.1:6379/0\"\ntls_ca_path = \"ca.pem\"",
        &[],
    );
    assert!(
        !ok && out.contains("redis.tls_ca_path") && out.contains("not rediss://"),
        "{out}"
    );

    let (ok, out) = check(
        "url = \"rediss://127.0.0.1:6380/0\"\ntls_ca_path = \"nope.pem\"",
        &[],
    );
    assert!(
        !ok && out.contains("redis.tls_ca_path = \"nope.pem\" cannot be read"),
        "{out}"
    );

    let (ok, out) = check(
        "url = \"rediss://127.0.0.1:6380/0\"\ntls_cert_path = \"client.pem\"",
        &[],
    );
    assert!(!ok && out.contains("go together"), "{out}");

    let (ok, out) = check(
        "url = \"redis://127.0.0.1:6379/0\"\npassword_env = \"TEST_UNSET_REDIS_PASSWORD\"",
        &[("TEST_UNSET_REDIS_PASSWORD", None)],
    );
    assert!(
        !ok && out.contains("redis.password_env") && out.contains("is not set"),
        "{out}"
    );

    let (ok, out) = check("url = \"rediss://127.0.0.1:6380/0\"", &[]);
    assert!(ok, "rediss:// with the system roots: {out}");
}

/// Contract section 11: the password is read from `password_env`, never from the file; and no
/// message shows one, whether the file or `SENTINEL_REDIS_URL` held it.
#[test]
fn a_password_is_never_read_from_the_file_nor_shown_in_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let check = |redis: &str, env: &[(&str, Option<&str>)]| {
        common::check_body(dir.path(), &format!("[redis]\n{redis}\n"), env)
    };
    let no_env = [("SENTINEL_REDIS_URL", None)];
    for (redis, field) in [
        (
            "url = \"redis://gateway:Hunter2-pw@127.0.0.1:6379/0\"",
            "redis.password_env",
        ),
        (
            "url = \"rediss://:Hunter2-pw@127.0.0.1:6380/0\"",
            "redis.password_env",
        ),
        (
            "cluster_urls = [\"redis://127.0.0.1:7000\", \"redis://u:Hunter2-pw@127.0.0.1:7001\"]",
            "redis.password_env",
        ),
        (
            "sentinel_urls = [\"redis://:Hunter2-pw@127.0.0.1:26379\"]\nsentinel_master = \"m\"",
            "redis.sentinel_password_env",
        ),
    ] {
        let (ok, out) = check(redis, &no_env);
        assert!(!ok, "{redis}: {out}");
        assert!(
            out.contains("holds a password") && out.contains(field),
            "{redis}: {out}"
        );
        assert!(!out.contains("Hunter2"), "{redis}: {out}");
    }
    // A user name in the URL is no secret.
    let (ok, out) = check("url = \"redis://gateway@127.0.0.1:6379/0\"", &no_env);
    assert!(ok, "{out}");
    // The environment may hold the whole URL, password and all; a message never shows it.
    let with_env = |url: &str| {
        check(
            "url = \"redis://127.0.0.1:6379/0\"",
            &[("SENTINEL_REDIS_URL", Some(url))],
        )
    };
    let (ok, out) = with_env("redis://u:Hunter2-pw@127.0.0.1:6379/0");
    assert!(ok, "{out}");
    // Refused, and not shown: a bad port, and a typo that leaves no URL at all.
    for (url, said) in [
        (
            "redis://u:Hunter2-pw@127.0.0.1:99999/0",
            "SENTINEL_REDIS_URL",
        ),
        ("redis//u:Hunter2-pw@127.0.0.1:6379/0", "is not a Redis URL"),
    ] {
        let (ok, out) = with_env(url);
        assert!(!ok && out.contains(said), "{url}: {out}");
        assert!(!out.contains("Hunter2"), "{url}: {out}");
    }
    // The environment's URL wins, and the file still may not hold a password.
    let (ok, out) = check(
        "url = \"redis://u:Hunter2-pw@127.0.0.1:6379/0\"",
        &[("SENTINEL_REDIS_URL", Some("redis://127.0.0.1:6379/0"))],
    );
    assert!(!ok && out.contains("holds a password"), "{out}");
    assert!(!out.contains("Hunter2"), "{out}");
    // A unix socket's password is a query parameter; a password with a `/` makes the URL
    // unreadable: neither is shown.
    for url in [
        "unix:///run/redis.sock?pass=Hunter2-pw",
        "redis://u:Hunter2/pw@127.0.0.1:6379/0",
    ] {
        let (ok, out) = check(&format!("url = \"{url}\""), &no_env);
        assert!(!ok, "{url}: {out}");
        assert!(!out.contains("Hunter2"), "{url}: {out}");
    }
}

/// Over TLS too, the store's thread reads a batch's answer while the proxy's only worker is
/// stalled (through the TLS session, whatever the workers' runtime last saw of the socket),
/// and sends the next batch.
#[test]
fn over_tls_answers_are_read_while_the_workers_are_stalled() {
    let t = tls_redis_with(false, &[]);
    let section = format!(
        "url = \"{}\"\ntls_ca_path = {}",
        t.url(),
        quoted(&t.ca_path())
    );
    assert_eq!(
        common::inproc::two_decisions_behind_a_stalled_worker(&section),
        (true, true)
    );
}

/// A reload whose file holds a Redis password is refused (400, the old config serving), and
/// its logged error names the field without the password.
#[test]
fn a_reload_with_a_password_in_the_file_is_refused_without_showing_it() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::new(&redis.url())
        .upstream("app", &[up.addr()])
        .route(
            Route::new("e.api")
                .prefix("/api")
                .identity_header("X-API-Key")
                .token_bucket(5_000_000, 0),
        )
        .start();
    let config = std::fs::read_to_string(&gw.config_path).unwrap();
    let with_password = config.replace("redis://", "redis://gateway:Hunter2-pw@");
    assert_ne!(config, with_password);
    gw.rewrite_config(&with_password);
    assert_eq!(gw.reload(), 400);
    let logs = gw.logs();
    assert!(logs.contains("holds a password"), "{logs}");
    assert!(!logs.contains("Hunter2"), "{logs}");
}

/// The least-privilege ACL user of docs/configuration.md ("The Redis user's permissions")
/// is enough for every decision, the fleet heartbeat, the eviction check and the admin's
/// reset; a user without a command a script needs (`HSET`; `EXPIRE` and `PEXPIRE`) makes
/// every decision a store failure by its fail mode, counted by the breaker as an `OOM` is,
/// never logged as a bug: the first fails in Redis (said with Redis's words, its bucket
/// charged when the refusal came after its `HSET`), and has the gateway ask the ACL which
/// commands, said once at ERROR; from then on the decisions are not sent (no bucket
/// charged), until a check finds them granted. (Every decision was sent, and charged.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_acl_permissions_are_enough_and_a_missing_one_is_an_outage() {
    let least = "~sentinel:* resetchannels &sentinel:v1:resets* -@all +evalsha +script|load \
                 +time +hmget +hset +expire +pexpire +persist +zadd +zremrangebyscore +zcard \
                 +del +publish +subscribe +config|get +ping +select";
    let user = |name: &str, rules: &str| {
        let mut args = vec![
            "--user".to_owned(),
            name.to_owned(),
            "on".to_owned(),
            format!(">pw-{name}-0123"),
        ];
        args.extend(rules.split_whitespace().map(str::to_owned));
        args
    };
    let mut args = user("least", least);
    args.extend(user("nohset", &least.replace(" +hset", "")));
    args.extend(user("noexpire", &least.replace(" +expire +pexpire", "")));
    args.extend(user("revoked", least));
    args.extend(user("noconfig", &least.replace(" +config|get", "")));
    args.extend(user("otherkeys", &least.replace("~sentinel:*", "~other:*")));
    // Idle clients closed after 4 s: the gateways' checks (and so their look at the
    // permissions) run every 2 s.
    args.extend(["--timeout".to_owned(), "4".to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let redis = Redis::start_with(free_port(), &args);
    let up = Upstream::start("app");
    let as_user = |name: &str| {
        limited(
            GatewayConfig::new(&redis.url())
                .redis("username", quoted(name))
                .redis("password_env", quoted("TEST_REDIS_PASSWORD")),
            &up,
        )
        .route(common::config::fleet_route())
        .route(
            // One request, then a wait of 1000 s: its denial is remembered.
            Route::new("e.rare")
                .prefix("/rare")
                .identity_header("X-API-Key")
                .token_bucket(1_000_000, 1_000),
        )
        .breaker(5, 30)
        .start_with_env(&[("TEST_REDIS_PASSWORD", &format!("pw-{name}-0123"))])
    };

    let least = as_user("least");
    warmed(&least).await;
    assert_eq!(statuses(&least, "a", 4).await, [200, 200, 200, 429]);
    let reset = client()
        .delete(least.admin("/limits/e.api?identity=header%3Ax-api-key%3Aa"))
        .send()
        .await
        .unwrap();
    assert_eq!(reset.status(), 200);
    assert_eq!(statuses(&least, "a", 1).await, [200], "reset by the admin");
    let slow = |status: u16| {
        let req = client().get(least.url("/rare")).header("X-API-Key", "a");
        async move { assert_eq!(req.send().await.unwrap().status(), status) }
    };
    slow(200).await;
    slow(429).await;
    // It remembered a denial: it listens for the other gateways' resets.
    wait_until(Duration::from_secs(5), "the resets channel", || {
        redis::cmd("PUBSUB")
            .arg(&["NUMSUB", "sentinel:v1:resets"])
            .query::<(String, u32)>(&mut redis.conn())
            .unwrap()
            .1
            == 1
    });
    wait_until(Duration::from_secs(5), "the fleet heartbeat", || {
        redis::cmd("EXISTS")
            .arg("sentinel:v1:fleet")
            .query::<u32>(&mut redis.conn())
            .unwrap()
            == 1
    });
    let logs = least.logs();
    assert!(
        !logs.contains("NOPERM") && !logs.contains("can't") && !logs.contains("\"ERROR\""),
        "{logs}"
    );

    let buckets = || {
        redis::cmd("KEYS")
            .arg("sentinel:v1:*:e.rare:*")
            .query::<Vec<String>>(&mut redis.conn())
            .unwrap()
            .len()
    };
    let refused_line = |gw: &common::Gateway, commands: &str| {
        let logs = gw.logs();
        let told: Vec<String> = logs
            .lines()
            .filter(|l| l.contains("may not run commands the limiter scripts need"))
            .map(str::to_owned)
            .collect();
        assert_eq!(told.len(), 1, "once: {logs}");
        assert!(told[0].contains("\"ERROR\""), "{logs}");
        assert!(
            told[0].contains(&format!("\"commands\":\"{commands}\"")),
            "{logs}"
        );
        assert!(!logs.contains("this is a bug"), "{logs}");
    };
    let nohset = as_user("nohset");
    wait_until(Duration::from_secs(10), "connected", || redis_up(&nohset));
    assert_eq!(statuses(&nohset, "a", 1).await, [503]);
    // The first refusal has the gateway ask which commands.
    wait_until(Duration::from_secs(5), "the refused commands", || {
        nohset
            .logs()
            .contains("may not run commands the limiter scripts need")
    });
    assert_eq!(statuses(&nohset, "a", 5).await, [503; 5]);
    assert_eq!(
        nohset.metric("sentinel_breaker_state"),
        1.0,
        "five failures open it"
    );
    assert_eq!(
        nohset.metric("sentinel_store_errors_total{cause=\"connection_error\"}"),
        5.0,
        "the sixth short-circuited"
    );
    refused_line(&nohset, "HSET");
    let logs = nohset.logs();
    let told: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("redis cannot serve the limiter scripts"))
        .collect();
    assert_eq!(told.len(), 1, "once for the decisions: {logs}");
    assert!(
        told[0].contains("\"ERROR\"")
            && told[0].contains("The user executing the script can't run this command"),
        "with Redis's words: {logs}"
    );
    drop(nohset);

    // Without `EXPIRE` and `PEXPIRE` a script fails after its `HSET` on a bucket that
    // refills (`/rare`), the bucket charged: once the first refusal said which commands,
    // the decisions are not sent.
    let rare = |gw: &common::Gateway, key: &str, n: usize| {
        let (http, url, key) = (client(), gw.url("/rare"), key.to_owned());
        async move {
            let mut out = Vec::new();
            for _ in 0..n {
                let r = http.get(&url).header("X-API-Key", &key).send().await;
                out.push(r.unwrap().status().as_u16());
            }
            out
        }
    };
    let before = buckets();
    let noexpire = as_user("noexpire");
    wait_until(Duration::from_secs(10), "connected", || redis_up(&noexpire));
    assert_eq!(rare(&noexpire, "n", 1).await, [503]);
    wait_until(Duration::from_secs(5), "the refused commands", || {
        noexpire
            .logs()
            .contains("may not run commands the limiter scripts need")
    });
    assert_eq!(buckets(), before + 1, "the first decision charged");
    assert_eq!(rare(&noexpire, "m", 3).await, [503; 3]);
    assert_eq!(buckets(), before + 1, "none of the next three");
    refused_line(&noexpire, "EXPIRE PEXPIRE");
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "noexpire", "+expire", "+pexpire"])
        .query(&mut redis.conn())
        .unwrap();
    wait_until(Duration::from_secs(10), "the next check", || {
        noexpire
            .logs()
            .contains("may run every command the limiter scripts need again")
    });
    // A bucket of one: untouched by the three refused, it admits one.
    assert_eq!(rare(&noexpire, "m", 2).await, [200, 429]);
    drop(noexpire);

    // Key patterns that do not match the buckets' keys refuse every command on them: said
    // with the keys, and the decisions not sent from then on (nothing was written).
    let otherkeys = as_user("otherkeys");
    wait_until(Duration::from_secs(10), "connected", || {
        redis_up(&otherkeys)
    });
    let before = buckets();
    assert_eq!(rare(&otherkeys, "o", 1).await, [503]);
    wait_until(Duration::from_secs(5), "the refused commands", || {
        otherkeys
            .logs()
            .contains("may not run commands the limiter scripts need")
    });
    assert_eq!(rare(&otherkeys, "o", 3).await, [503; 3]);
    refused_line(&otherkeys, "HMGET HSET EXPIRE PEXPIRE PERSIST");
    assert!(
        otherkeys.logs().contains(r#""keys":"sentinel:*""#),
        "{}",
        otherkeys.logs()
    );
    assert_eq!(buckets(), before, "nothing written");
    drop(otherkeys);

    // Taken away while connected: Redis refuses it inside the script, in its own words,
    // and the gateway asks which commands at once.
    let revoked = as_user("revoked");
    warmed(&revoked).await;
    let _: () = redis::cmd("ACL")
        .arg(&["SETUSER", "revoked", "-hset"])
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(statuses(&revoked, "r", 1).await, [503]);
    let logs = revoked.logs();
    let told: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("The user executing the script can't run this command"))
        .collect();
    assert_eq!(told.len(), 1, "with Redis's words: {logs}");
    assert!(told[0].contains("\"ERROR\""), "{logs}");
    wait_until(Duration::from_secs(5), "the refused commands", || {
        revoked
            .logs()
            .contains("may not run commands the limiter scripts need")
    });
    refused_line(&revoked, "HSET");
    drop(revoked);

    // Without `CONFIG GET` (a managed Redis) the gateway decides as usual and says once that
    // it cannot check the eviction policy (the start-up check does not say it a second time).
    let noconfig = as_user("noconfig");
    warmed(&noconfig).await;
    assert_eq!(statuses(&noconfig, "c", 4).await, [200, 200, 200, 429]);
    let logs = noconfig.logs();
    let told = logs
        .lines()
        .filter(|l| l.contains("CONFIG not permitted"))
        .count();
    assert_eq!(told, 1, "once: {logs}");

    // Turned on by a reload, on the same Redis: said then, once.
    let relaxed = limited(
        GatewayConfig::new(&redis.url())
            .redis("username", quoted("noconfig"))
            .redis("password_env", quoted("TEST_REDIS_PASSWORD"))
            .redis("require_noeviction", "false"),
        &up,
    )
    .start_with_env(&[("TEST_REDIS_PASSWORD", "pw-noconfig-0123")]);
    assert_eq!(statuses(&relaxed, "d", 1).await, [200]);
    let told = |gw: &common::Gateway| {
        gw.logs()
            .lines()
            .filter(|l| l.contains("CONFIG not permitted"))
            .count()
    };
    assert_eq!(told(&relaxed), 0, "not required: not said");
    let text = std::fs::read_to_string(&relaxed.config_path).unwrap();
    relaxed
        .rewrite_config(&text.replace("require_noeviction = false", "require_noeviction = true"));
    assert_eq!(relaxed.reload(), 200);
    assert_eq!(told(&relaxed), 1, "{}", relaxed.logs());
}

/// A Redis busy running a script (`BUSY`) cannot serve now; it does not refuse `CONFIG` or
/// `SCRIPT LOAD`. When the gateway connects, the attempt fails and the next one after the
/// script connects as usual; when the eviction policy is read again (every 15 s), the last
/// reading stands. Neither said `CONFIG` was not permitted (and `/readyz`'s policy was lost
/// until the next reading) nor that the scripts were refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_busy_with_a_script_cannot_serve_and_refuses_nothing() {
    let redis = Redis::start_with(free_port(), &["--busy-reply-threshold", "50"]);
    let up = Upstream::start("app");
    let hold = |seconds: u32| {
        let mut held = redis.conn();
        std::thread::spawn(move || {
            let _: redis::RedisResult<i64> = redis::cmd("EVAL")
                .arg("local t = redis.call('TIME')[1] + ARGV[1] while redis.call('TIME')[1] + 0 < t do end return 1")
                .arg(0)
                .arg(seconds)
                .query(&mut held);
        })
    };
    let policy = |gw: &common::Gateway| {
        let (_, ready) = common::blocking_get(&gw.admin("/readyz")).unwrap();
        let ready: serde_json::Value = serde_json::from_str(&ready).unwrap();
        ready["redis_maxmemory_policy"].clone()
    };
    let busy = hold(2);
    std::thread::sleep(Duration::from_millis(300));
    let gw = limited(GatewayConfig::new(&redis.url()), &up).start();
    busy.join().unwrap();
    wait_until(
        Duration::from_secs(10),
        "connected after the script",
        || redis_up(&gw),
    );
    assert_eq!(statuses(&gw, "k", 4).await, [200, 200, 200, 429]);
    assert_eq!(policy(&gw), "noeviction");
    // The start's attempts met the script: said as Redis said it.
    assert!(gw.logs().contains("BUSY"), "{}", gw.logs());
    // Busy for longer than the time between two readings of the policy (15 s).
    hold(16).join().unwrap();
    assert_eq!(policy(&gw), "noeviction");
    let logs = gw.logs();
    assert!(!logs.contains("CONFIG not permitted"), "{logs}");
    assert!(!logs.contains("refused SCRIPT LOAD"), "{logs}");
}

/// A Redis that asks for a password the gateway was not given (`NOAUTH`) cannot serve: the
/// attempts fail and say why, nothing says `CONFIG` is not permitted, and once the password
/// is lifted the gateway connects on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_wants_a_password_it_was_not_given_is_noauth_not_a_refusal() {
    let redis = Redis::start_with(free_port(), &["--requirepass", "not-given-0123"]);
    let up = Upstream::start("app");
    let config = limited(GatewayConfig::new(&redis.url()), &up);
    // `check --redis` says it as the start does, not as a Redis busy for a moment.
    let dir = tempfile::tempdir().unwrap();
    let (code, stdout, lines) = common::check_redis(dir.path(), &config, &[]);
    assert_eq!(
        (code, lines),
        (
            Some(1),
            vec![format!("redis 127.0.0.1:{}: cannot serve: Redis wants a password and was given none (NOAUTH): set redis.password_env or redis.password_file (and redis.username for an ACL user)", redis.port)]
        ),
        "{stdout}"
    );
    let gw = config.start();
    wait_until(Duration::from_secs(10), "the reason said", || {
        gw.logs().contains("NOAUTH")
    });
    let mut admin = redis.conn();
    let _: () = redis::cmd("AUTH")
        .arg("not-given-0123")
        .query(&mut admin)
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("requirepass")
        .arg("")
        .query(&mut admin)
        .unwrap();
    wait_until(
        Duration::from_secs(15),
        "connected once no password is asked",
        || redis_up(&gw),
    );
    assert_eq!(statuses(&gw, "k", 4).await, [200, 200, 200, 429]);
    let logs = gw.logs();
    assert!(!logs.contains("CONFIG not permitted"), "{logs}");
    assert!(!logs.contains("refused SCRIPT LOAD"), "{logs}");
}

/// A Redis that closes idle clients (its `timeout`, as managed Redis services set it): the
/// gateway's connections closed while no decision used them are said at INFO and made
/// again, never a WARN of a lost connection (it was one each idle period), and the next
/// decisions are Redis's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_redis_closes_while_idle_is_no_warning() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = limited(GatewayConfig::new(&redis.url()), &up).start();
    assert_eq!(statuses(&gw, "k", 1).await, [200]);
    // Idle clients closed after a second, while the gateway has nothing to decide; then
    // no more (a timeout that short also closes the connection between requests).
    let timeout = |seconds: &str| {
        redis.config_set("timeout", seconds);
    };
    timeout("1");
    wait_until(Duration::from_secs(10), "an idle connection closed", || {
        gw.logs()
            .contains("redis closed a connection no decision was using")
    });
    timeout("0");
    wait_until(Duration::from_secs(10), "connected again", || redis_up(&gw));
    assert_eq!(statuses(&gw, "k", 3).await, [200, 200, 429]);
    let logs = gw.logs();
    let closed = (logs.lines())
        .find(|l| l.contains("no decision was using"))
        .unwrap();
    assert!(closed.contains(r#""level":"INFO""#), "{closed}");
    assert!(!logs.contains("redis connection lost"), "{logs}");
}

/// A Redis whose `timeout` for idle clients is shorter than the 15 s between the gateway's
/// checks, read at connect: the checks run at half of it, so Redis never finds redis-rs's
/// socket idle that long, and on a quiet gateway only the batches' socket is closed (and made
/// again alone). The connection is never made again as a whole: before, both sockets of an
/// idle gateway were closed at once every few seconds, and a request in the milliseconds the
/// new connection took was answered by its fail mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_timeout_shorter_than_the_checks_never_closes_the_checks_socket() {
    let redis = Redis::start();
    redis.config_set("timeout", "2");
    let up = Upstream::start("app");
    let gw = limited(GatewayConfig::new(&redis.url()), &up).start();
    warmed(&gw).await;
    let gateway_clients = || {
        (redis.clients().into_iter())
            .filter(|(_, cmd)| cmd != "client|list")
            .map(|(id, _)| id)
            .collect::<Vec<_>>()
    };
    let before = gateway_clients();
    // Three of Redis's timeouts and more, idle.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let after = gateway_clients();
    assert!(
        before.iter().any(|id| after.contains(id)),
        "a socket kept: {before:?} then {after:?}\n{}",
        gw.logs()
    );
    assert_eq!(statuses(&gw, "k", 4).await, [200, 200, 200, 429]);
    let logs = gw.logs();
    assert!(!logs.contains("no decision was using"), "{logs}");
    assert!(!logs.contains("redis connection lost"), "{logs}");
    assert_eq!(logs.matches("\"redis connected\"").count(), 1, "{logs}");
}

/// A Redis whose `timeout` was lowered below the 15 s between the gateway's own checks
/// since they last read it, under steady traffic: until the next check reads it, the
/// decisions' socket is never idle, the checks' socket is, and Redis closes it every two or
/// three seconds. That socket alone is made again: no decision meets a lost connection
/// (every one is Redis's, none a fail mode's 503), no WARN, the connection is never made
/// again as a whole, and the eviction policy is still read (a change to `allkeys-lru` under
/// the traffic is said by the next check).
async fn checks_closed_alone_under_traffic(config: GatewayConfig, redis: &Redis) {
    let gw = config.start();
    warmed(&gw).await;
    let connections = || common::connections_received(redis.port);
    // Lowered just after a check read it: about 15 s until the next one reads it again.
    let checks = redis.command_calls("config|get");
    wait_until(Duration::from_secs(20), "the next check", || {
        redis.command_calls("config|get") > checks
    });
    redis.config_set("timeout", "2");
    let before = connections();
    // A request every 10 ms, each with a key of its own (admitted when Redis decides it; 503
    // when its decision meets a lost connection), for 6 s, then until the policy is read
    // again (within 15 s of the last reading, which was before the traffic).
    let started = std::time::Instant::now();
    let mut answered = Vec::new();
    let mut i = 0;
    let evicting = "redis may evict keys";
    while started.elapsed() < Duration::from_secs(6)
        || (!gw.logs().contains(evicting) && started.elapsed() < Duration::from_secs(30))
    {
        if i == 300 {
            redis.config_set("maxmemory-policy", "allkeys-lru");
        }
        answered.extend(statuses(&gw, &format!("k{i}"), 1).await);
        i += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Each `connections()` call is one connection of its own, the last one included.
    let made = connections() - before - 1;
    redis.config_set("timeout", "0");
    // No decision met a lost connection. (A machine loaded by the tests beside this one
    // can stall a decision past its budget: a timeout, not what this test is about.)
    let lost = gw.metric(r#"sentinel_store_errors_total{cause="connection_error"}"#);
    let timeouts = gw.metric(r#"sentinel_store_errors_total{cause="timeout"}"#);
    let refused = answered.iter().filter(|&&s| s != 200).count();
    assert!(
        lost == 0.0 && refused as f64 == timeouts && refused <= 5,
        "{refused} of {} refused, {lost} for a lost connection, {timeouts} timeouts\n{}",
        answered.len(),
        gw.logs()
    );
    // Closed and made again while the decisions went on: the test saw what it is about.
    assert!(made >= 2, "{made} connections made\n{}", gw.logs());
    let logs = gw.logs();
    assert!(logs.contains(evicting), "{logs}");
    assert!(!logs.contains("redis connection lost"), "{logs}");
    assert_eq!(logs.matches("\"redis connected\"").count(), 1, "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_timeout_shorter_than_the_checks_loses_nothing_under_traffic() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    checks_closed_alone_under_traffic(limited(GatewayConfig::new(&redis.url()), &up), &redis).await;
}

/// As above, with both sockets on the proxy's workers (`dedicated_io_thread = false`): the
/// checks' socket is made again there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_timeout_shorter_than_the_checks_loses_nothing_without_the_io_thread() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let config = GatewayConfig::new(&redis.url()).redis("dedicated_io_thread", "false");
    checks_closed_alone_under_traffic(limited(config, &up), &redis).await;
}

/// Without batching (`batch_max = 1`) decisions go one by one on the checks' socket and the
/// decisions' socket is never used: the checks' socket killed within a second of one is the
/// connection lost under decisions (a WARN), never made again alone as if Redis had closed
/// it for idleness beside a busy decisions' socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checks_socket_killed_after_a_decision_sent_alone_is_a_loss() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let config = GatewayConfig::new(&redis.url()).redis("batch_max", "1");
    let gw = limited(config, &up).start();
    warmed(&gw).await;
    assert_eq!(statuses(&gw, "k1", 1).await, [200]);
    let _: () = redis::cmd("CLIENT")
        .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
        .query(&mut redis.conn())
        .unwrap();
    let said = || {
        let logs = gw.logs();
        logs.contains("redis connection lost") || logs.contains("no decision was using")
    };
    wait_until(Duration::from_secs(10), "the close said", said);
    let logs = gw.logs();
    let lost = (logs.lines())
        .find(|l| l.contains("redis connection lost"))
        .unwrap_or_else(|| panic!("{logs}"));
    assert!(lost.contains(r#""level":"WARN""#), "{lost}");
    wait_until(Duration::from_secs(10), "connected again", || redis_up(&gw));
    assert_eq!(statuses(&gw, "k0", 3).await, [200, 200, 200]);
}

/// An evicting policy is said once, and said again only when it changes: a connection made
/// again and again (Redis closing every client while the gateway is idle), each read again,
/// does not repeat the ERROR (it did, once a connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_policy_is_said_once_however_often_the_connection_is_made_again() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = limited(GatewayConfig::new(&redis.url()), &up).start();
    warmed(&gw).await;
    redis.config_set("maxmemory-policy", "allkeys-lru");
    let count = |what: &str| gw.logs().matches(what).count();
    let evicting = "redis may evict keys";
    wait_until(Duration::from_secs(20), "the policy said", || {
        count(evicting) >= 1
    });
    let closed = "no decision was using";
    // Idle for more than a second: a close is not one under decisions.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    for round in 1..=3 {
        let closes = count(closed);
        let _: () = redis::cmd("CLIENT")
            .arg(&["KILL", "TYPE", "normal", "SKIPME", "yes"])
            .query(&mut redis.conn())
            .unwrap();
        wait_until(Duration::from_secs(10), "the close said", || {
            count(closed) > closes
        });
        wait_until(Duration::from_secs(10), "connected again", || redis_up(&gw));
        assert_eq!(count(evicting), 1, "round {round}\n{}", gw.logs());
    }
    redis.config_set("maxmemory-policy", "noeviction");
    wait_until(Duration::from_secs(20), "the change back said", || {
        count("noeviction again") == 1
    });
    assert_eq!(count(evicting), 1, "{}", gw.logs());
}

/// `check --redis`, as an operator runs it before a deploy: connects as the gateway would (the
/// documented least-privilege user) and says of each node whether it can serve the limiter,
/// with an exit code a pipeline reads: 0 it can; 1 it cannot (a command the scripts need
/// refused, a wrong password, Redis down: the gateway would start and decide by each
/// route's fail mode); 2 the gateway would not start (an evicting policy with
/// `require_noeviction`). The password never reaches its output.
#[test]
fn check_redis_says_whether_each_node_can_serve_the_limiter() {
    let least = "~sentinel:* resetchannels &sentinel:v1:resets* -@all +evalsha +script|load \
                 +time +hmget +hset +expire +pexpire +persist +zadd +zremrangebyscore +zcard \
                 +del +publish +subscribe +config|get +ping +select";
    let mut args: Vec<String> = Vec::new();
    for (name, rules) in [
        ("least", least.to_owned()),
        ("nohset", least.replace(" +hset", "")),
        ("nopublish", least.replace(" +publish", "")),
    ] {
        args.extend(["--user", name, "on", &format!(">pw-{name}-0123")].map(str::to_owned));
        args.extend(rules.split_whitespace().map(str::to_owned));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let redis = Redis::start_with(free_port(), &args);
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let url = redis.url();
    let check = |user: &str, password: &str| {
        let config = limited(
            GatewayConfig::new(&url)
                .redis("username", quoted(user))
                .redis("password_env", quoted("TEST_REDIS_PASSWORD")),
            &up,
        );
        let env = [("TEST_REDIS_PASSWORD", Some(password))];
        let (code, stdout, lines) = common::check_redis(dir.path(), &config, &env);
        assert!(!stdout.contains(password), "{stdout}");
        (
            code,
            lines.first().cloned().unwrap_or_else(|| panic!("{stdout}")),
        )
    };
    let node = format!("redis 127.0.0.1:{}", redis.port);
    assert_eq!(
        check("least", "pw-least-0123"),
        (
            Some(0),
            format!("{node}: ok: maxmemory-policy noeviction; the limiter's commands permitted")
        )
    );
    assert_eq!(
        check("nohset", "pw-nohset-0123"),
        (Some(1), format!("{node}: cannot serve: maxmemory-policy noeviction; the user may not run hset: every decision would fail"))
    );
    assert_eq!(
        check("nopublish", "pw-nopublish-0123"),
        (Some(1), format!("{node}: cannot serve: maxmemory-policy noeviction; the user may not run publish: DELETE /limits would fail or not reach the other gateways"))
    );
    let (code, line) = check("least", "not-the-password");
    assert!(line.contains("Redis refused AUTH"), "{line}");
    assert_eq!(code, Some(1));
    assert!(
        line.starts_with(&format!("{node}: cannot serve: ")),
        "{line}"
    );
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(
        check("least", "pw-least-0123"),
        (Some(2), format!("{node}: the gateway would not start: maxmemory-policy allkeys-lru: keys can be evicted, which require_noeviction refuses; the limiter's commands permitted"))
    );
    let port = redis.port;
    drop(redis);
    let (code, line) = check("least", "pw-least-0123");
    assert_eq!(code, Some(1));
    assert!(
        line.starts_with(&format!("redis 127.0.0.1:{port}: cannot serve: ")),
        "{line}"
    );
}

/// `check --redis` on a replica (a URL left on a master that a failover demoted): it
/// refuses every decision's write, so it cannot serve, whatever else reads well.
#[test]
fn check_redis_says_a_replica_cannot_serve() {
    let master = Redis::start();
    let port = free_port();
    let replica = Redis::start_with(
        port,
        &["--replicaof", "127.0.0.1", &master.port.to_string()],
    );
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let (code, stdout, lines) = common::check_redis(
        dir.path(),
        &limited(GatewayConfig::new(&replica.url()), &up),
        &[],
    );
    assert_eq!(code, Some(1), "{stdout}");
    let line = lines.first().unwrap_or_else(|| panic!("{stdout}"));
    assert!(
        line.starts_with(&format!("redis 127.0.0.1:{port}: cannot serve: redis ")),
        "{line}"
    );
    assert!(
        line.contains(&format!(
            "a replica of 127.0.0.1:{}: a read-only one",
            master.port
        )),
        "{line}"
    );
    let (code, stdout, _) = common::check_redis(
        dir.path(),
        &limited(GatewayConfig::new(&master.url()), &up),
        &[],
    );
    assert_eq!(code, Some(0), "{stdout}");
}

/// `check --redis` over TLS reads the node as the gateway would reach it (the CA of
/// `tls_ca_path`), says a certificate it cannot trust in the TLS layer's words, and a node
/// busy with a long script (`BUSY`) is one that cannot serve now, in Redis's words.
#[test]
fn check_redis_reads_a_node_over_tls_and_says_a_busy_one() {
    let t = tls_redis_with(false, &["--busy-reply-threshold", "100"]);
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let node = format!("redis 127.0.0.1:{}", t.tls_port);
    let check = |ca_path: &str| {
        let config = limited(
            GatewayConfig::new(&t.url()).redis("tls_ca_path", quoted(ca_path)),
            &up,
        );
        let (code, stdout, lines) = common::check_redis(dir.path(), &config, &[]);
        (
            code,
            lines.first().cloned().unwrap_or_else(|| panic!("{stdout}")),
        )
    };
    // The default user may run `INFO`: Redis's version is said too.
    let (code, line) = check(&t.ca_path());
    assert_eq!(code, Some(0), "{line}");
    assert!(line.starts_with(&format!("{node}: ok: redis ")), "{line}");
    assert!(
        line.ends_with("; maxmemory-policy noeviction; the limiter's commands permitted"),
        "{line}"
    );

    // Another CA: the node's certificate is not trusted, so nothing can be decided on it.
    let other = Ca::new();
    let other_ca = dir.path().join("other-ca.pem");
    std::fs::write(&other_ca, &other.pem).unwrap();
    let (code, line) = check(&other_ca.display().to_string());
    assert_eq!(code, Some(1), "{line}");
    assert!(
        line.starts_with(&format!("{node}: cannot serve: ")),
        "{line}"
    );
    assert!(line.to_lowercase().contains("certificate"), "{line}");

    // A script that runs past busy-reply-threshold: every other client is answered BUSY.
    let busy_port = t.redis.port;
    let busy = std::thread::spawn(move || {
        let client = redis::Client::open(format!("redis://127.0.0.1:{busy_port}/")).unwrap();
        let mut conn = client.get_connection().unwrap();
        // Ends when SCRIPT KILL stops it, with an error this thread ignores.
        let _: redis::RedisResult<()> = redis::cmd("EVAL")
            .arg("while true do end")
            .arg(0)
            .query(&mut conn);
    });
    // Busy once past the threshold: a PING is answered BUSY.
    let mut conn = t.redis.conn();
    common::wait_until(Duration::from_secs(10), "the script running", || {
        redis::cmd("PING")
            .query::<String>(&mut conn)
            .is_err_and(|e| e.code() == Some("BUSY"))
    });
    let (code, line) = check(&t.ca_path());
    common::wait_until(Duration::from_secs(10), "the script killed", || {
        redis::cmd("SCRIPT")
            .arg("KILL")
            .query::<()>(&mut conn)
            .is_ok()
    });
    busy.join().unwrap();
    assert_eq!(code, Some(1), "{line}");
    assert!(
        line.starts_with(&format!("{node}: cannot serve: ")),
        "{line}"
    );
    assert!(line.contains("BUSY"), "{line}");
}
