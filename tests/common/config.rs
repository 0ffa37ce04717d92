//! Gateway configs for tests, built from typed parts and rendered as the TOML the binary reads:
//! `[server]`, `[redis]`, then sections, upstreams and routes in the order they were added.

use std::fmt::Display;

use super::{free_ports, Gateway};

/// A TOML basic string holding `s`.
pub fn quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// A TOML array of basic strings, on one line.
pub fn string_list(items: &[impl Display]) -> String {
    let items: Vec<String> = items.iter().map(|i| quoted(&i.to_string())).collect();
    format!("[{}]", items.join(", "))
}

/// `key = literal` lines of one table, in insertion order; setting a key again replaces its
/// value where it stands.
#[derive(Clone, Debug, Default)]
struct Fields(Vec<(String, String)>);

impl Fields {
    fn set(&mut self, key: &str, literal: impl Into<String>) {
        let literal = literal.into();
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = literal,
            None => self.0.push((key.to_owned(), literal)),
        }
    }

    fn render(&self) -> String {
        self.0.iter().map(|(k, v)| format!("{k} = {v}\n")).collect()
    }
}

/// One `[[routes]]` entry. Its upstream is `app` unless set.
#[derive(Clone, Debug)]
pub struct Route(Fields, Vec<String>);

impl Route {
    pub fn new(endpoint_id: &str) -> Route {
        let mut fields = Fields::default();
        fields.set("endpoint_id", quoted(endpoint_id));
        fields.set("upstream", quoted("app"));
        Route(fields, Vec::new())
    }

    /// Sets any route field to a TOML literal (`"text"`, `5`, `true`, `[...]`).
    pub fn set(mut self, field: &str, literal: impl Into<String>) -> Route {
        self.0.set(field, literal);
        self
    }

    pub fn prefix(self, path_prefix: &str) -> Route {
        self.set("path_prefix", quoted(path_prefix))
    }

    pub fn path(self, path: &str) -> Route {
        self.set("path", quoted(path))
    }

    pub fn upstream(self, name: &str) -> Route {
        self.set("upstream", quoted(name))
    }

    pub fn methods(self, methods: &[&str]) -> Route {
        self.set("methods", string_list(methods))
    }

    pub fn host(self, host: &str) -> Route {
        self.set("host", quoted(host))
    }

    /// The identity is the value of this request header.
    pub fn identity_header(self, header: &str) -> Route {
        self.set("identity", format!("{{ header = {} }}", quoted(header)))
    }

    /// A named identity: `jwt`, `client_ip` or `global`.
    pub fn identity(self, kind: &str) -> Route {
        self.set("identity", quoted(kind))
    }

    /// Capacity and refill in micro-tokens, as the config file has them.
    pub fn token_bucket(self, capacity_micro: u64, refill_rate_micro_per_sec: u64) -> Route {
        self.set("algorithm", quoted("token_bucket"))
            .set("capacity_micro", capacity_micro.to_string())
            .set(
                "refill_rate_micro_per_sec",
                refill_rate_micro_per_sec.to_string(),
            )
    }

    pub fn sliding_window(self, limit: u64, window_size_micro: u64) -> Route {
        self.set("algorithm", quoted("sliding_window"))
            .set("limit", limit.to_string())
            .set("window_size_micro", window_size_micro.to_string())
    }

    /// `algorithm = "none"`: forwarded without a decision.
    pub fn unlimited(self) -> Route {
        self.set("algorithm", quoted("none"))
    }

    /// `fail_open` with an emergency rate of its own in each process.
    pub fn fail_open(self, fallback_rate_per_process_micro: u64) -> Route {
        self.set("fail_mode", quoted("fail_open")).set(
            "fallback_rate_per_process_micro",
            fallback_rate_per_process_micro.to_string(),
        )
    }

    /// `fail_open` with an emergency rate shared by the live instances of the fleet.
    pub fn fail_open_fleet(self, fallback_rate_fleet_micro: u64) -> Route {
        self.set("fail_mode", quoted("fail_open")).set(
            "fallback_rate_fleet_micro",
            fallback_rate_fleet_micro.to_string(),
        )
    }

    /// Written out, though it is also what a route without `fail_mode` gets.
    pub fn fail_closed(self) -> Route {
        self.set("fail_mode", quoted("fail_closed"))
    }

    pub fn policy_version(self, version: u64) -> Route {
        self.set("policy_version", version.to_string())
    }

    /// One `[[routes.limits]]` entry: `name` and its fields as TOML lines
    /// (`algorithm = "token_bucket"`, ...).
    pub fn limit(mut self, name: &str, fields: &str) -> Route {
        self.1.push(format!(
            "\n[[routes.limits]]\nname = {}\n{}\n",
            quoted(name),
            fields.trim()
        ));
        self
    }

    /// A token-bucket limit of `capacity` whole requests refilled at `refill_micro` per second.
    pub fn bucket_limit(self, name: &str, capacity: u64, refill_micro: u64) -> Route {
        self.limit(
            name,
            &format!(
                "algorithm = \"token_bucket\"\ncapacity_micro = {}\nrefill_rate_micro_per_sec = {refill_micro}",
                capacity * 1_000_000
            ),
        )
    }

    pub fn toml(&self) -> String {
        format!("\n[[routes]]\n{}{}", self.0.render(), self.1.concat())
    }
}

/// A whole gateway config. Listeners are filled in when it is rendered for given ports.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    server: Fields,
    redis: Fields,
    sections: Vec<String>,
}

impl GatewayConfig {
    /// What most test gateways run with: two threads, a 5 s grace period and the 20 ms Redis
    /// budget.
    pub fn new(redis_url: &str) -> GatewayConfig {
        GatewayConfig::bare(redis_url)
            .server("threads", "2")
            .server("grace_period_seconds", "5")
            .redis("timeout_ms", "20")
    }

    /// Only the Redis URL; every other `[server]` and `[redis]` field keeps the gateway's
    /// default.
    pub fn bare(redis_url: &str) -> GatewayConfig {
        GatewayConfig::empty().redis("url", quoted(redis_url))
    }

    /// Like `bare`, on a Redis Cluster reached through these seeds.
    pub fn bare_cluster(seeds: &[String]) -> GatewayConfig {
        GatewayConfig::empty().redis("cluster_urls", string_list(seeds))
    }

    /// No `[redis]` field at all: the test sets the target (Sentinel, say).
    pub fn empty() -> GatewayConfig {
        GatewayConfig {
            server: Fields::default(),
            redis: Fields::default(),
            sections: Vec::new(),
        }
    }

    /// A `[server]` field as a TOML literal; `listen` set here replaces the rendered one.
    pub fn server(mut self, field: &str, literal: impl Into<String>) -> GatewayConfig {
        self.server.set(field, literal);
        self
    }

    /// A `[redis]` field as a TOML literal.
    pub fn redis(mut self, field: &str, literal: impl Into<String>) -> GatewayConfig {
        self.redis.set(field, literal);
        self
    }

    /// Raw TOML (one or more whole sections) placed after everything added before it.
    pub fn section(mut self, toml: &str) -> GatewayConfig {
        self.sections
            .push(format!("\n{}", toml.trim_start_matches('\n')));
        self
    }

    /// The `[breaker]` section; a later call replaces an earlier one.
    pub fn breaker(mut self, failure_threshold: u32, open_seconds: u64) -> GatewayConfig {
        self.sections.retain(|s| !s.starts_with("\n[breaker]"));
        self.section(&format!(
            "[breaker]\nfailure_threshold = {failure_threshold}\nopen_seconds = {open_seconds}\n"
        ))
    }

    /// `[upstreams.{name}]` with the gateway's default timeouts.
    pub fn upstream(self, name: &str, addrs: &[impl Display]) -> GatewayConfig {
        self.upstream_timeouts(name, addrs, None, None)
    }

    /// `[upstreams.{name}]`; a timeout left `None` keeps the gateway's default.
    pub fn upstream_timeouts(
        self,
        name: &str,
        addrs: &[impl Display],
        connect_timeout_ms: Option<u64>,
        read_timeout_ms: Option<u64>,
    ) -> GatewayConfig {
        let mut fields = Fields::default();
        fields.set("addrs", string_list(addrs));
        if let Some(ms) = connect_timeout_ms {
            fields.set("connect_timeout_ms", ms.to_string());
        }
        if let Some(ms) = read_timeout_ms {
            fields.set("read_timeout_ms", ms.to_string());
        }
        self.section(&format!("[upstreams.{name}]\n{}", fields.render()))
    }

    /// `[access_log]` writing to `path`.
    pub fn access_log(self, path: &std::path::Path) -> GatewayConfig {
        self.section(&format!(
            "[access_log]\npath = {}\n",
            quoted(&path.display().to_string())
        ))
    }

    pub fn route(mut self, route: Route) -> GatewayConfig {
        self.sections.push(route.toml());
        self
    }

    /// Everything after `[server]` and `[redis]`.
    pub fn body(&self) -> String {
        self.sections.concat()
    }

    /// The config file for a gateway listening on these loopback ports.
    pub fn render(&self, port: u16, admin_port: u16) -> String {
        let mut server = Fields::default();
        server.set("listen", quoted(&format!("127.0.0.1:{port}")));
        server.set("admin_listen", quoted(&format!("127.0.0.1:{admin_port}")));
        for (k, v) in &self.server.0 {
            server.set(k, v.clone());
        }
        format!(
            "[server]\n{}\n[redis]\n{}{}",
            server.render(),
            self.redis.render(),
            self.body()
        )
    }

    /// Starts a gateway with this config on free ports, once it is ready.
    pub fn start(&self) -> Gateway {
        self.start_with_env(&[])
    }

    /// Runs a gateway with this config that must refuse to start: its exit code and standard
    /// error. One that starts anyway is stopped after 20 s and fails the test.
    pub fn start_refused(&self) -> (Option<i32>, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gateway.toml");
        let [port, admin_port] = free_ports();
        std::fs::write(&path, self.render(port, admin_port)).unwrap();
        let mut child = super::Proc {
            child: std::process::Command::new(env!("CARGO_BIN_EXE_sentinel-gateway"))
                .arg("--config")
                .arg(&path)
                .env_remove("SENTINEL_REDIS_URL")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("the binary runs"),
            name: "sentinel-gateway",
        };
        let code = child.wait_exit(std::time::Duration::from_secs(20));
        assert!(
            code.is_some(),
            "the gateway started, and was meant to refuse"
        );
        let mut stderr = String::new();
        if let Some(mut pipe) = child.child.stderr.take() {
            std::io::Read::read_to_string(&mut pipe, &mut stderr).unwrap();
        }
        (code, stderr)
    }

    /// Like `start`, with these variables set for the process.
    pub fn start_with_env(&self, env: &[(&str, &str)]) -> Gateway {
        let [port, admin_port] = free_ports();
        Gateway::start_with_env(port, admin_port, &self.render(port, admin_port), env)
    }
}

/// `/open`, one bucket for every caller that Redis never runs dry, fail_open with a fleet-wide
/// emergency rate: a route that makes the fleet heartbeat beat.
pub fn fleet_route() -> Route {
    Route::new("f.open")
        .path("/open")
        .identity("global")
        .token_bucket(1_000_000_000, 1_000_000_000)
        .fail_open_fleet(3_000_000)
}

/// `/closed` (fail_closed) and `/open` (fail_open through a generous emergency rate), keyed by
/// `X-API-Key`, `capacity` requests each that never refill, in front of `upstream`: the pair
/// of routes the fault tests share.
pub fn closed_and_open(redis_url: &str, upstream: &str, capacity: u64) -> GatewayConfig {
    GatewayConfig::new(redis_url)
        .upstream("app", &[upstream])
        .route(
            Route::new("t.closed")
                .prefix("/closed")
                .identity_header("X-API-Key")
                .token_bucket(capacity * 1_000_000, 0)
                .fail_closed(),
        )
        .route(
            Route::new("t.open")
                .prefix("/open")
                .identity_header("X-API-Key")
                .token_bucket(capacity * 1_000_000, 0)
                .fail_open(1_000_000_000),
        )
}
