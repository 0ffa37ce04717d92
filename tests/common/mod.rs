//! Real processes for integration tests: redis-server, the demo upstream and the gateway
//! binary, each on a free loopback port and each stopped by its PID when dropped.

#![allow(dead_code)]

pub mod cluster;
pub mod config;
pub mod fault;
pub mod inproc;
pub mod tls;

use std::ffi::OsStr;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// `N` distinct free loopback ports ([`free_port`]).
pub fn free_ports<const N: usize>() -> [u16; N] {
    std::array::from_fn(|_| free_port())
}

/// A loopback port nobody listens on, for a process a test starts. Taken below the
/// kernel's ephemeral range (32768 and up), where the local ends of every test's outgoing
/// connections come from: a port the kernel handed out as free could be given to such a
/// connection before the process bound it ("Address already in use"). Each test process
/// walks the range from a start of its own.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 10_000;
    const SPAN: u32 = 20_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7_919) % SPAN,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    loop {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Polls `f` until it returns true or `within` passes.
pub fn wait_until(within: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("timed out after {within:?} waiting for {what}");
}

fn port_open(port: u16) -> bool {
    TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// Makes a FIFO at `path` (a file a process writes as another reads it): tests hold a read of
/// the gateway's on one for as long as they need.
pub fn mkfifo(path: &Path) {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a C string that lives through the call.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// A child process killed (SIGKILL) by its PID when dropped.
pub struct Proc {
    pub child: Child,
    pub name: &'static str,
}

impl Proc {
    /// The gateway on `config`, not waited for (it may not get ready); stdout to `log`, or
    /// nowhere.
    pub fn gateway(config: &Path, log: Option<&Path>) -> Proc {
        let stdout = log.map_or_else(Stdio::null, |l| {
            Stdio::from(std::fs::File::create(l).expect("log file"))
        });
        Proc {
            child: binary()
                .arg("--config")
                .arg(config)
                .env_remove("SENTINEL_REDIS_URL")
                .env_remove("SENTINEL_JWT_SECRET")
                .env("RUST_LOG", "info")
                .stdout(stdout)
                .stderr(Stdio::null())
                .spawn()
                .expect("gateway starts"),
            name: "sentinel-gateway",
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process catches every signal of `mask` (bit n: signal n + 1; SIGHUP is
    /// bit 0), by its `SigCgt` in /proc.
    pub fn catches(&self, mask: u64) -> bool {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .ok()
            .and_then(|st| {
                let caught = st.lines().find_map(|l| l.strip_prefix("SigCgt:"))?;
                u64::from_str_radix(caught.trim(), 16).ok()
            })
            .is_some_and(|m| m & mask == mask)
    }

    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{sig} {} failed", self.name);
    }

    /// Waits for the process to exit; its exit code, or None if it outlives `within`.
    pub fn wait_exit(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status.code().unwrap_or(-1));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Redis {
    pub port: u16,
    pub proc: Proc,
    dir: tempfile::TempDir,
    /// Another directory that must live as long as the server (a cluster node's config).
    kept: Option<tempfile::TempDir>,
}

impl Redis {
    pub fn start() -> Redis {
        Self::start_on(free_port())
    }

    pub fn start_on(port: u16) -> Redis {
        Self::start_with(port, &[])
    }

    pub fn start_with(port: u16, extra: &[&str]) -> Redis {
        let dir = tempfile::tempdir().expect("temp dir");
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(extra)
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start redis-server ({e}): install it with `apt-get install -y redis-server`")
            });
        let redis = Redis {
            port,
            proc: Proc {
                child,
                name: "redis-server",
            },
            dir,
            kept: None,
        };
        wait_until(Duration::from_secs(10), "redis-server to answer", || {
            redis.client().get_connection().is_ok()
        });
        redis
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    pub fn keep_dir(&mut self, dir: tempfile::TempDir) {
        self.kept = Some(dir);
    }

    pub fn take_dir(&mut self) -> Option<tempfile::TempDir> {
        self.kept.take()
    }

    pub fn proc_alive(&self) -> bool {
        std::fs::metadata(format!("/proc/{}", self.proc.pid())).is_ok()
            && !std::fs::read_to_string(format!("/proc/{}/stat", self.proc.pid()))
                .unwrap_or_default()
                .contains(") Z ")
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).expect("valid url")
    }

    pub fn conn(&self) -> redis::Connection {
        self.client().get_connection().expect("redis connection")
    }

    /// Each client with its last command (`CLIENT LIST`'s `id` and `cmd`; the asking one's
    /// is `client|list`).
    pub fn clients(&self) -> Vec<(u64, String)> {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query(&mut self.conn())
            .unwrap();
        let field = |line: &str, name: &str| {
            line.split(' ')
                .find_map(|f| f.strip_prefix(name).map(str::to_owned))
                .unwrap_or_default()
        };
        list.lines()
            .map(|l| (field(l, "id=").parse().unwrap_or(0), field(l, "cmd=")))
            .collect()
    }

    /// `CLIENT KILL ID id`: Redis closes that one client's connection.
    pub fn kill_client(&self, id: u64) {
        let _: i64 = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query(&mut self.conn())
            .unwrap();
    }

    /// `CONFIG SET name value`, as the tests change a running Redis.
    pub fn config_set(&self, name: &str, value: &str) {
        let _: () = redis::cmd("CONFIG")
            .arg(&["SET", name, value])
            .query(&mut self.conn())
            .expect("CONFIG SET");
    }

    /// A connection, or `None` while this Redis refuses or resets one (a replica during a
    /// failover, say): for polls that wait for a state and try again.
    pub fn try_conn(&self) -> Option<redis::Connection> {
        self.client().get_connection().ok()
    }

    /// Calls of one command so far, from `INFO commandstats` (0 if never called).
    pub fn command_calls(&self, command: &str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut self.conn())
            .expect("INFO");
        let prefix = format!("cmdstat_{}:calls=", command.to_ascii_lowercase());
        info.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// Calls of every command except INFO itself, CONFIG RESETSTAT and the connection setup.
    pub fn limiter_calls(&self) -> u64 {
        ["evalsha", "eval", "script|load", "hmget", "hset"]
            .iter()
            .map(|c| self.command_calls(c))
            .sum()
    }

    pub fn reset_stats(&self) {
        let _: () = redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query(&mut self.conn())
            .expect("RESETSTAT");
    }

    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(pattern)
            .query(&mut self.conn())
            .expect("KEYS");
        keys.sort();
        keys
    }
}

pub struct Upstream {
    pub port: u16,
    pub proc: Proc,
}

impl Upstream {
    pub fn start(name: &str) -> Upstream {
        Self::start_on(free_port(), name)
    }

    /// On a given port (a restart on the port it had).
    pub fn start_on(port: u16, name: &str) -> Upstream {
        let child = Command::new(env!("CARGO_BIN_EXE_demo-upstream"))
            .args([format!("127.0.0.1:{port}"), name.to_owned()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("demo-upstream starts");
        let up = Upstream {
            port,
            proc: Proc {
                child,
                name: "demo-upstream",
            },
        };
        wait_until(
            Duration::from_secs(10),
            "the demo upstream to listen",
            || port_open(port),
        );
        up
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

/// The gateway binary with a config written to a temp file.
pub struct Gateway {
    pub port: u16,
    pub admin_port: u16,
    pub proc: Proc,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    _dir: tempfile::TempDir,
}

/// A failed test shows the end of its gateway's log, which its temporary directory takes
/// with it: a dropped connection or a wrong answer is read there (a panic, a WARN).
impl Drop for Gateway {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let logs = self.logs();
            let lines: Vec<&str> = logs.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            eprintln!(
                "--- the last {} lines of the gateway's log ({}) ---\n{}",
                tail.len(),
                self.log_path.display(),
                tail.join("\n")
            );
        }
    }
}

/// The `[server]` and `[redis]` sections for a test gateway; routes and upstreams follow.
pub fn base_config(port: u16, admin_port: u16, redis_url: &str) -> String {
    config::GatewayConfig::new(redis_url).render(port, admin_port)
}

/// The gateway binary, not yet started.
fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sentinel-gateway"))
}

/// Runs the gateway binary to its exit (`check`, `--version`, a start that must fail), with
/// `env` applied over this process's environment: `None` removes the variable.
pub fn run_binary(args: &[&OsStr], env: &[(&str, Option<&str>)]) -> Output {
    let mut command = binary();
    command.args(args);
    for (name, value) in env {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    command.output().expect("the binary runs")
}

/// Runs the gateway binary to its exit with `stdin` as its standard input (`hash-key`).
pub fn run_binary_with_stdin(args: &[&OsStr], stdin: &[u8]) -> Output {
    let mut child = binary()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(stdin)
        .expect("stdin written");
    child.wait_with_output().expect("the binary exits")
}

/// `sentinel-gateway check --redis` on `config`, written as `gateway.toml` in `dir`: its exit
/// code, its stdout, and the lines it says of Redis (`redis ...`).
pub fn check_redis(
    dir: &Path,
    config: &config::GatewayConfig,
    env: &[(&str, Option<&str>)],
) -> (Option<i32>, String, Vec<String>) {
    let path = dir.join("gateway.toml");
    std::fs::write(&path, config.render(free_port(), free_port())).unwrap();
    let out = run_binary(
        &[
            OsStr::new("check"),
            OsStr::new("--redis"),
            OsStr::new("--config"),
            path.as_os_str(),
        ],
        env,
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines = (stdout.lines())
        .filter(|l| l.starts_with("redis"))
        .map(str::to_owned)
        .collect();
    (out.status.code(), stdout, lines)
}

/// `sentinel-gateway check --config <path>`.
pub fn check_config(path: &Path, env: &[(&str, Option<&str>)]) -> Output {
    run_binary(
        &[
            OsStr::new("check"),
            OsStr::new("--config"),
            path.as_os_str(),
        ],
        env,
    )
}

impl Gateway {
    /// Starts the gateway with `rest` (upstreams, routes, breaker...) after the base sections.
    pub fn start(redis_url: &str, rest: &str) -> Gateway {
        let [port, admin_port] = free_ports();
        Self::start_with(
            port,
            admin_port,
            &format!("{}\n{rest}", base_config(port, admin_port, redis_url)),
        )
    }

    pub fn start_with(port: u16, admin_port: u16, config: &str) -> Gateway {
        Self::start_with_env(port, admin_port, config, &[])
    }

    pub fn start_with_env(
        port: u16,
        admin_port: u16,
        config: &str,
        env: &[(&str, &str)],
    ) -> Gateway {
        let dir = tempfile::tempdir().expect("temp dir");
        let config_path = dir.path().join("gateway.toml");
        std::fs::write(&config_path, config).expect("write config");
        let log_path = dir.path().join("gateway.log");
        let log = std::fs::File::create(&log_path).expect("log file");
        let child = binary()
            .arg("--config")
            .arg(&config_path)
            .env_remove("SENTINEL_REDIS_URL")
            .env_remove("SENTINEL_JWT_SECRET")
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .expect("gateway starts");
        let mut gw = Gateway {
            port,
            admin_port,
            proc: Proc {
                child,
                name: "sentinel-gateway",
            },
            config_path,
            log_path,
            _dir: dir,
        };
        // Every listener of the file: Pingora binds them one after another, and a TLS
        // listener may still be unbound when the plain one answers.
        let listeners: Vec<u16> = config
            .lines()
            .filter_map(|l| l.trim().strip_prefix("listen = \"127.0.0.1:"))
            .filter_map(|rest| rest.trim_end_matches('"').parse().ok())
            .collect();
        let ready = |gw: &mut Gateway| {
            if let Ok(Some(status)) = gw.proc.child.try_wait() {
                panic!("gateway exited with {status}: {}", gw.logs());
            }
            blocking_get(&format!("http://127.0.0.1:{}/readyz", gw.admin_port))
                .is_some_and(|(s, _)| s == 200)
                && port_open(gw.port)
                && listeners.iter().all(|p| port_open(*p))
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ready(&mut gw) {
            assert!(
                Instant::now() < deadline,
                "gateway not ready in 20 s: {}",
                gw.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        gw
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn admin(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }

    /// Resident memory of the gateway process, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.proc.pid()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    pub fn proc_alive(&mut self) -> bool {
        matches!(self.proc.child.try_wait(), Ok(None))
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// `POST /reload` on the admin listener; the status.
    pub fn reload(&self) -> u16 {
        self.reload_answer().0
    }

    /// `POST /reload` on the admin listener; the status and the body.
    pub fn reload_answer(&self) -> (u16, String) {
        use std::io::Read;
        let mut stream = TcpStream::connect(("127.0.0.1", self.admin_port)).expect("the admin");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream
            .write_all(b"POST /reload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .expect("send the reload");
        let mut raw = String::new();
        stream.read_to_string(&mut raw).expect("the admin answers");
        let status = raw.split_whitespace().nth(1).and_then(|s| s.parse().ok());
        let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        (status.expect("a status line"), body.to_owned())
    }

    pub fn rewrite_config(&self, config: &str) {
        let mut f = std::fs::File::create(&self.config_path).expect("config file");
        f.write_all(config.as_bytes()).expect("write config");
    }

    /// The status of `GET <path>` with `X-API-Key: <key>`.
    pub async fn status_for(&self, path: &str, key: &str) -> u16 {
        client()
            .get(self.url(path))
            .header("X-API-Key", key)
            .send()
            .await
            .expect("the gateway answers")
            .status()
            .as_u16()
    }

    /// The status of `DELETE /limits/<endpoint>?identity=header:x-api-key:<key>`.
    pub async fn reset_key(&self, endpoint: &str, key: &str) -> u16 {
        client()
            .delete(self.admin(&format!(
                "/limits/{endpoint}?identity=header%3Ax-api-key%3A{key}"
            )))
            .send()
            .await
            .expect("the admin answers")
            .status()
            .as_u16()
    }

    /// What `GET /limits/<endpoint>?identity=header:x-api-key:<key>` says is left of the
    /// first limit.
    pub fn remaining_of_key(&self, endpoint: &str, key: &str) -> i64 {
        let url = self.admin(&format!(
            "/limits/{endpoint}?identity=header%3Ax-api-key%3A{key}"
        ));
        let (_, body) = blocking_get(&url).expect("the admin answers");
        let view: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        view["limits"][0]["remaining"]
            .as_i64()
            .expect("a remaining count")
    }

    /// The value of one metric series from /metrics (0 when absent). Metrics are recorded
    /// when a request ends, just after its answer was sent, so this first waits (up to 2 s)
    /// for the requests in flight to finish.
    pub fn metric(&self, series: &str) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let (_, body) = blocking_get(&self.admin("/metrics")).expect("metrics answer");
            if metric_value(&body, "sentinel_requests_in_flight") == 0.0
                || Instant::now() > deadline
            {
                return metric_value(&body, series);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The value of `series` (name with its labels in the exposition's order) in a text body.
pub fn metric_value(body: &str, series: &str) -> f64 {
    body.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A minimal blocking HTTP/1.1 GET over loopback, for readiness polls and metrics.
pub fn blocking_get(url: &str) -> Option<(u16, String)> {
    use std::io::Read;
    let rest = url.strip_prefix("http://")?;
    let (authority, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_owned()), |(a, p)| (a, format!("/{p}")));
    let mut stream = TcpStream::connect(authority).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).ok()?;
    let status = raw.split_whitespace().nth(1)?.parse().ok()?;
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// Runs `check` on a config of `[server] listen` (a free port) and `body`, written in `dir`
/// (so files it names can sit beside it); whether it passed, and everything it printed.
pub fn check_body(dir: &Path, body: &str, env: &[(&str, Option<&str>)]) -> (bool, String) {
    let path = dir.join("check.toml");
    std::fs::write(
        &path,
        format!("[server]\nlisten = \"127.0.0.1:{}\"\n{body}", free_port()),
    )
    .expect("write the config");
    let out = check_config(&path, env);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// A raw TCP server on a free loopback port for as long as the test runs: each connection
/// handed to `serve` on a thread of its own. Its address.
pub fn raw_server(serve: impl Fn(std::net::TcpStream) + Send + Sync + 'static) -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let serve = std::sync::Arc::new(serve);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let serve = std::sync::Arc::clone(&serve);
            std::thread::spawn(move || serve(stream));
        }
    });
    addr
}

/// Reads from `s` until a request or answer head ends (a blank line); `None` when the
/// connection ends first. What came after the head in the same reads is kept with it.
pub fn read_head(s: &mut impl std::io::Read) -> Option<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    Some(head)
}

/// The status of the request `send` makes, sent again (up to 20 times, 100 ms apart) while
/// it is 503: a gateway's first decision moves its Redis connection to the proxy's workers,
/// which a machine busy with other tests can stretch past the budget.
pub async fn status_past_a_busy_start(send: impl Fn() -> reqwest::RequestBuilder) -> u16 {
    let mut status = 0;
    for _ in 0..20 {
        status = send().send().await.unwrap().status().as_u16();
        if status != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    status
}

/// The lines of the access log at `path` written so far, as JSON.
pub fn access_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

/// The one line of the access log at `path`, once written (within 5 s), as JSON.
pub fn the_access_log_line(path: &std::path::Path) -> serde_json::Value {
    let mut text = String::new();
    wait_until(Duration::from_secs(5), "the access log's line", || {
        text = std::fs::read_to_string(path).unwrap_or_default();
        text.ends_with('\n')
    });
    serde_json::from_str(text.trim()).expect("one JSON line")
}

/// Sends raw bytes and returns the status line's code, for requests a client library would
/// refuse to build.
/// How many connections the Redis (or sentinel) on `port` has accepted since it started
/// (`INFO stats`' `total_connections_received`), this call's own included.
pub fn connections_received(port: u16) -> u64 {
    let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_connection()
        .unwrap();
    let info: String = redis::cmd("INFO").arg("stats").query(&mut c).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_connections_received:"))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .unwrap()
}

pub fn raw_request(port: u16, request: &[u8]) -> Option<u16> {
    use std::io::Read;
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream.write_all(request).ok()?;
    let mut buf = vec![0u8; 4096];
    let n = stream.read(&mut buf).ok()?;
    if n == 0 {
        return None;
    }
    let text = String::from_utf8_lossy(&buf[..n]);
    text.split_whitespace().nth(1)?.parse().ok()
}

/// `clients` concurrent clients, client `i` sending `each` GETs to `urls[i % urls.len()]`
/// with `header`; how many were answered 200.
pub async fn admitted_over(
    urls: &[String],
    clients: usize,
    each: usize,
    header: (&str, &str),
) -> u64 {
    let tasks: Vec<_> = (0..clients)
        .map(|i| {
            let url = urls[i % urls.len()].clone();
            let (name, value) = (header.0.to_owned(), header.1.to_owned());
            tokio::spawn(async move {
                let http = client();
                let mut admitted = 0;
                for _ in 0..each {
                    let r = http.get(&url).header(&name, &value).send().await;
                    admitted += u64::from(r.expect("gateway answers").status() == 200);
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.expect("client task");
    }
    admitted
}

/// A reqwest builder for loopback tests: no proxy, and rustls's `ring` provider installed
/// (reqwest's TLS is built without a provider of its own).
pub fn client_builder() -> reqwest::ClientBuilder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().no_proxy()
}

pub fn client() -> reqwest::Client {
    client_builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("http client")
}

/// An HTTP/2 client with prior knowledge (h2c), one connection per client.
pub fn h2c_client() -> reqwest::Client {
    client_builder()
        .http2_prior_knowledge()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("http client")
}

/// The whole seconds of an answer's `Retry-After`.
pub fn retry_after(r: &reqwest::Response) -> u64 {
    r.headers()["retry-after"]
        .to_str()
        .expect("Retry-After is text")
        .parse()
        .expect("Retry-After is whole seconds")
}
