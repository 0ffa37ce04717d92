//! API keys from a key file, against the binary and a real Redis: every key of a tenant
//! spends the tenant's one bucket, an unknown key is 401 before Redis, `hash-key` makes the
//! entry to paste, and the file follows a reload (a broken file keeps the old keys serving).

mod common;

use std::ffi::OsStr;
use std::path::Path;
use std::time::Duration;

use common::config::{quoted, GatewayConfig, Route};
use common::{client, Redis, Upstream};
use sentinel_gateway::limiter::bucket_key;

/// The `[[keys]]` entry `hash-key` prints for `key`.
fn hash_key(key: &str, tenant: &str) -> String {
    let out = common::run_binary_with_stdin(
        &[
            OsStr::new("hash-key"),
            OsStr::new("--tenant"),
            OsStr::new(tenant),
        ],
        format!("{key}\n").as_bytes(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn write_keys(path: &Path, entries: &[String]) {
    std::fs::write(path, entries.join("\n")).unwrap();
}

/// The OCR route, keyed on API key tenants, 3 requests that never refill.
fn ocr_route() -> Route {
    Route::new("k.ocr")
        .prefix("/ocr")
        .identity("api_key")
        .token_bucket(3_000_000, 0)
}

fn config(redis: &Redis, up: &Upstream, keys: &Path) -> GatewayConfig {
    GatewayConfig::new(&redis.url())
        .section(&format!(
            "[auth.api_keys]\nfile = {}\n",
            quoted(keys.to_str().unwrap())
        ))
        .upstream("app", &[up.addr()])
        .route(ocr_route())
}

/// Whether `key` is admitted at `url` within `within` (a watched key file being loaded),
/// asked every 100 ms.
async fn admitted_within(http: &reqwest::Client, url: &str, key: &str, within: Duration) -> bool {
    let until = std::time::Instant::now() + within;
    while std::time::Instant::now() < until {
        if send(http, url, Some(key)).await.0 == 200 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

async fn send(http: &reqwest::Client, url: &str, key: Option<&str>) -> (u16, String) {
    let mut req = http.post(url);
    if let Some(k) = key {
        req = req.header("X-API-Key", k);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_of_a_tenant_spends_one_bucket_and_unknown_keys_never_reach_redis() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    write_keys(
        &keys,
        &[
            hash_key("acme-1", "acme"),
            hash_key("acme-2", "acme"),
            hash_key("globex-1", "globex"),
        ],
    );
    let gw = config(&redis, &up, &keys).start();
    let http = client();
    let url = gw.url("/ocr/doc");
    let mut statuses = Vec::new();
    for key in ["acme-1", "acme-2", "acme-1", "acme-2", "globex-1"] {
        statuses.push(send(&http, &url, Some(key)).await.0);
    }
    assert_eq!(
        statuses,
        [200, 200, 200, 429, 200],
        "a new key buys no new bucket"
    );
    assert_eq!(
        redis.keys("sentinel:*"),
        {
            let mut want = vec![
                bucket_key("sentinel", "tenant:acme", "k.ocr", 1),
                bucket_key("sentinel", "tenant:globex", "k.ocr", 1),
            ];
            want.sort();
            want
        },
        "one bucket per tenant"
    );

    redis.reset_stats();
    for key in [Some("made-up"), Some(""), None] {
        assert_eq!(
            send(&http, &url, key).await,
            (401, r#"{"detail":"authentication required"}"#.to_owned()),
            "{key:?}"
        );
    }
    assert_eq!(redis.limiter_calls(), 0, "refused before Redis");
    let logs = gw.logs();
    for raw in ["acme-1", "made-up", "globex-1"] {
        assert!(!logs.contains(raw), "{raw} reached the log");
    }

    // A new key, pasted from hash-key, and a removed one, after a reload.
    write_keys(
        &keys,
        &[hash_key("acme-1", "acme"), hash_key("newco-1", "newco")],
    );
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(send(&http, &url, Some("newco-1")).await.0, 200);
    assert_eq!(send(&http, &url, Some("globex-1")).await.0, 401, "removed");
    assert_eq!(
        send(&http, &url, Some("acme-1")).await.0,
        429,
        "the bucket carried on"
    );

    // A broken key file fails the reload with its own file and line; the old keys serve on.
    std::fs::write(&keys, "[[keys]]\nsha256 = \"not-a-hash\"\ntenant = \"x\"\n").unwrap();
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains(&format!("{}:2:10: keys[0]: sha256", keys.display())),
        "{error}"
    );
    assert_eq!(send(&http, &url, Some("newco-1")).await.0, 200);
}

#[test]
fn hash_key_prints_the_line_and_check_names_the_key_file() {
    let out = common::run_binary_with_stdin(&[OsStr::new("hash-key")], b"secret-key\r\n");
    assert!(out.status.success());
    let line = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        line.trim_end(),
        format!(
            "sha256 = \"{}\"",
            sentinel_gateway::limiter::identity_hash("secret-key")
        ),
        "the SHA-256 of the key without its line ending"
    );
    assert!(!line.contains("secret-key"));
    let empty = common::run_binary_with_stdin(&[OsStr::new("hash-key")], b"\n");
    assert_eq!(empty.status.code(), Some(1));
    // Keys no client could send in a header: refused, not hashed into a line that matches
    // nothing.
    let long = vec![b'k'; sentinel_gateway::identity::MAX_HEADER_IDENTITY_BYTES + 1];
    for unsendable in [&b" key \n"[..], b"key\t", b"ke\x01y", &long] {
        let out = common::run_binary_with_stdin(&[OsStr::new("hash-key")], unsendable);
        assert_eq!(out.status.code(), Some(1), "{unsendable:?}");
        assert!(out.stdout.is_empty());
    }
    // A tenant or tier that is no name is a command line that cannot be used: 2, as any.
    for args in [["--tenant", "ACME"], ["--tier", "p ro"]] {
        let mut argv = vec![OsStr::new("hash-key")];
        if args[0] == "--tier" {
            argv.extend([OsStr::new("--tenant"), OsStr::new("acme")]);
        }
        argv.extend(args.iter().map(OsStr::new));
        let out = common::run_binary_with_stdin(&argv, b"key\n");
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("error: --"), "{stderr}");
    }
    // Two keys piped in: refused, not the first one hashed alone.
    let two = common::run_binary_with_stdin(&[OsStr::new("hash-key")], b"key-a\nkey-b\n");
    assert_eq!(two.status.code(), Some(1));
    assert!(two.stdout.is_empty());
    assert!(
        String::from_utf8_lossy(&two.stderr).contains("more than one line"),
        "{}",
        String::from_utf8_lossy(&two.stderr)
    );

    // A relative key file is found beside the config file.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keys.toml"), hash_key("k", "acme")).unwrap();
    let cfg = GatewayConfig::new("redis://127.0.0.1:6379/0")
        .section("[auth.api_keys]\nfile = \"keys.toml\"\n")
        .upstream("app", &["127.0.0.1:9"])
        .route(ocr_route());
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, cfg.render(1, 2)).unwrap();
    let out = common::check_config(&path, &[("SENTINEL_REDIS_URL", None)]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("per API key tenant"), "{stdout}");
    assert!(
        stdout.contains("api keys: 1 key(s) of 1 tenant(s)"),
        "{stdout}"
    );

    // A byte that is not UTF-8 is said at the key file's own line and column, as its other
    // problems are (it was said at the config's line, with a byte index into the key file).
    let mut bytes = hash_key("k", "acme").into_bytes();
    bytes.extend_from_slice(b"# caf\xe9\n");
    std::fs::write(dir.path().join("keys.toml"), &bytes).unwrap();
    let line = String::from_utf8_lossy(&bytes).matches('\n').count();
    let out = common::check_config(&path, &[("SENTINEL_REDIS_URL", None)]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "keys.toml:{line}:6: the API key file is not UTF-8 here"
        )),
        "{stderr}"
    );
    std::fs::write(dir.path().join("keys.toml"), hash_key("k", "acme")).unwrap();

    // Without the section, a route cannot use api_key.
    let bare = GatewayConfig::new("redis://127.0.0.1:6379/0")
        .upstream("app", &["127.0.0.1:9"])
        .route(ocr_route());
    std::fs::write(&path, bare.render(1, 2)).unwrap();
    let out = common::check_config(&path, &[("SENTINEL_REDIS_URL", None)]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("identity = \"api_key\" needs an [auth.api_keys] section"));
}

/// With `watch_config`, a change to the key file made while the start reads it is seen: the
/// file was stamped after it was read, so a change in those moments looked like the file
/// the gateway had read and waited for its next change. The key file is a FIFO here, so
/// the read waits for the test: the file is replaced (key B) while the gateway reads key A
/// from the FIFO; the watch then loads key B.
#[test]
fn a_key_file_changed_while_the_start_reads_it_is_loaded() {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    common::mkfifo(&keys);
    let [port, admin] = common::free_ports();
    let text = config(&redis, &up, &keys)
        .server("watch_config", "true")
        .render(port, admin);
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, text).unwrap();
    let _proc = common::Proc::gateway(&path, None);
    // A non-blocking open for writing succeeds once the gateway has the FIFO open to read.
    let mut fifo = None;
    common::wait_until(Duration::from_secs(15), "the key file opened", || {
        fifo = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&keys)
            .ok();
        fifo.is_some()
    });
    let staged = dir.path().join("keys.new");
    write_keys(&staged, &[hash_key("key-b", "beta")]);
    std::fs::rename(&staged, &keys).unwrap();
    let mut fifo = fifo.unwrap();
    fifo.write_all(hash_key("key-a", "alpha").as_bytes())
        .unwrap();
    drop(fifo);
    common::wait_until(Duration::from_secs(15), "ready", || {
        common::blocking_get(&format!("http://127.0.0.1:{admin}/readyz"))
            .is_some_and(|(s, _)| s == 200)
    });
    let status = |key: &str| {
        let head = format!(
            "POST /ocr HTTP/1.1\r\nHost: x\r\nX-API-Key: {key}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        common::raw_request(port, head.as_bytes())
    };
    common::wait_until(Duration::from_secs(10), "key B loaded by the watch", || {
        status("key-b") == Some(200)
    });
    assert_eq!(
        status("key-a"),
        Some(401),
        "key A went with the FIFO's read"
    );
}

/// A gateway with `watch_config` whose key file (in its own directory) holds `key-a`; the
/// directory, the key file, and the Redis and upstream it uses.
fn watched_with_key_a() -> (
    common::Gateway,
    tempfile::TempDir,
    std::path::PathBuf,
    (Redis, Upstream),
) {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    write_keys(&keys, &[hash_key("key-a", "alpha")]);
    let gw = config(&redis, &up, &keys)
        .server("watch_config", "true")
        .start();
    (gw, dir, keys, (redis, up))
}

/// With `watch_config`, a key file replaced by one of the same length under its old
/// modification time (as `cp -p`, `rsync -a` or `tar` deploy a file) is loaded: the watch
/// compared the time and the length alone, and the old keys went on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_changed_under_its_old_time_and_length_is_loaded() {
    let (gw, dir, keys, _processes) = watched_with_key_a();
    let http = client();
    assert_eq!(send(&http, &gw.url("/ocr"), Some("key-a")).await.0, 200);
    let old = std::fs::metadata(&keys).unwrap();
    // A new file, renamed over the old one, and one written in place: each the same length,
    // each given the old modification time.
    for (key, tenant, renamed) in [("key-b", "betaa", true), ("key-c", "gamma", false)] {
        let text = hash_key(key, tenant);
        assert_eq!(text.len() as u64, old.len(), "the same length");
        let target = match renamed {
            true => dir.path().join("keys.new"),
            false => keys.clone(),
        };
        std::fs::write(&target, &text).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&target)
            .unwrap()
            .set_modified(old.modified().unwrap())
            .unwrap();
        if renamed {
            std::fs::rename(&target, &keys).unwrap();
        }
        let loaded = admitted_within(&http, &gw.url("/ocr"), key, Duration::from_secs(5)).await;
        assert!(loaded, "{key} loaded by the watch: {}", gw.logs());
    }
    assert_eq!(send(&http, &gw.url("/ocr"), Some("key-a")).await.0, 401);
}

/// With `watch_config`, a key file deleted and written again a second later (as some deploys
/// do) is one change: loaded, and no failed reload in between (the watch loaded the missing
/// file, an ERROR and a failure counted, which the shipped alert fires on). One gone for good
/// is said once it has stayed gone a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_deleted_and_written_again_is_one_change() {
    let (gw, _dir, keys, _processes) = watched_with_key_a();
    let http = client();
    assert_eq!(send(&http, &gw.url("/ocr"), Some("key-a")).await.0, 200);
    std::fs::remove_file(&keys).unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    write_keys(&keys, &[hash_key("key-b", "beta")]);
    let url = gw.url("/ocr");
    let loaded = admitted_within(&http, &url, "key-b", Duration::from_secs(10)).await;
    assert!(loaded, "{}", gw.logs());
    let failed = r#"sentinel_config_reloads_total{result="failure"}"#;
    assert_eq!(gw.metric(failed), 0.0, "{}", gw.logs());
    std::fs::remove_file(&keys).unwrap();
    common::wait_until(Duration::from_secs(15), "the missing file said", || {
        gw.metric(failed) == 1.0
    });
    assert_eq!(
        send(&http, &url, Some("key-b")).await.0,
        200,
        "still serving"
    );
}

/// A reload does not wait for a writer of a FIFO among the config's files (a key file
/// swapped for one by mistake): it held `POST /reload`, and every reload after it, until a
/// writer came. Read as empty, which no key file may be: refused at once, the old keys
/// serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_does_not_wait_for_a_fifo_without_a_writer() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    write_keys(&keys, &[hash_key("key-a", "alpha")]);
    let gw = config(&redis, &up, &keys).start();
    let http = client();
    assert_eq!(send(&http, &gw.url("/ocr"), Some("key-a")).await.0, 200);
    std::fs::remove_file(&keys).unwrap();
    common::mkfifo(&keys);
    let started = std::time::Instant::now();
    let (status, body) = gw.reload_answer();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "answered at once"
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("keys.toml"), "{body}");
    assert_eq!(send(&http, &gw.url("/ocr"), Some("key-a")).await.0, 200);
}

/// Keys read from `User-Agent` (`[auth.api_keys] header`): that field of the access log
/// would be the raw key, and is null on the route's lines and on a line answered before its
/// route was known (`TRACE`'s 405); the key's tenant is there as its hash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_read_from_the_user_agent_are_not_written_to_the_access_log() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    write_keys(&keys, &[hash_key("acme-agent-key-1", "acme")]);
    let log = dir.path().join("access.log");
    let gw = GatewayConfig::new(&redis.url())
        .section(&format!(
            "[auth.api_keys]\nfile = {}\nheader = \"User-Agent\"\n",
            quoted(keys.to_str().unwrap())
        ))
        .upstream("app", &[up.addr()])
        .route(ocr_route())
        .access_log(&log)
        .start();
    let http = client();
    let mut statuses = Vec::new();
    for method in [reqwest::Method::POST, reqwest::Method::TRACE] {
        let r = (http.request(method, gw.url("/ocr/doc")))
            .header("User-Agent", "acme-agent-key-1")
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, [200, 405]);
    let read = || std::fs::read_to_string(&log).unwrap_or_default();
    common::wait_until(Duration::from_secs(3), "two access lines", || {
        read().lines().count() == 2
    });
    let written = read();
    assert!(!written.contains("acme-agent-key-1"), "{written}");
    let lines: Vec<serde_json::Value> = (written.lines())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(lines[0]["identity_hash"].is_string(), "{written}");
    assert!(lines.iter().all(|l| l["user_agent"].is_null()), "{written}");
}

/// With `watch_config`, the config pointed at a key file not written yet is refused, and
/// loaded once that file comes (Kubernetes updates a ConfigMap's volume and a Secret's each in
/// its own time): the watch looked only at the files the running config names, so the
/// refused config stayed refused until a signal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_naming_a_key_file_yet_to_come_is_loaded_when_it_comes() {
    let (gw, dir, keys, _processes) = watched_with_key_a();
    let http = client();
    assert_eq!(send(&http, &gw.url("/ocr"), Some("key-a")).await.0, 200);
    let later = dir.path().join("keys-2.toml");
    let text = std::fs::read_to_string(&gw.config_path).unwrap();
    let (old, new) = (keys.display().to_string(), later.display().to_string());
    assert!(text.contains(&old));
    std::fs::write(&gw.config_path, text.replace(&old, &new)).unwrap();
    let failed = r#"sentinel_config_reloads_total{result="failure"}"#;
    common::wait_until(Duration::from_secs(15), "the refusal", || {
        gw.metric(failed) == 1.0
    });
    write_keys(&later, &[hash_key("key-b", "beta")]);
    let url = gw.url("/ocr");
    let loaded = admitted_within(&http, &url, "key-b", Duration::from_secs(5)).await;
    assert!(loaded, "{}", gw.logs());
    assert_eq!(send(&http, &url, Some("key-a")).await.0, 401);
    assert_eq!(gw.metric(failed), 1.0, "{}", gw.logs());
    // Pointed at one that never comes, then back at the first: the missing file is no
    // reason to wait for it (5 s) before the mended config is loaded.
    let text = std::fs::read_to_string(&gw.config_path).unwrap();
    let never = dir.path().join("keys-never.toml").display().to_string();
    std::fs::write(&gw.config_path, text.replace(&new, &never)).unwrap();
    common::wait_until(Duration::from_secs(15), "the second refusal", || {
        gw.metric(failed) == 2.0
    });
    let mended = std::time::Instant::now();
    std::fs::write(&gw.config_path, text.replace(&new, &old)).unwrap();
    let loaded = admitted_within(&http, &url, "key-a", Duration::from_secs(10)).await;
    assert!(loaded, "{}", gw.logs());
    // Two looks of 0.5 s at least; a loaded machine stretches them, never to 5 s.
    let took = mended.elapsed();
    assert!(took < Duration::from_millis(4500), "{took:?}");
}
