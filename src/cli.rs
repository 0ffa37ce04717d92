//! The command line: run the gateway, check a config file, or hash an API key for the key
//! file.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::{Algorithm, Config, IdentitySource, RouteConfig};
use crate::routing::PathMatch;

/// Exit code for an invalid config.
pub const EXIT_INVALID_CONFIG: i32 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "sentinel-gateway",
    version,
    about = "A rate-limiting reverse proxy with explicit failure semantics"
)]
struct Cli {
    /// The config file.
    #[arg(
        long,
        global = true,
        default_value = "gateway.toml",
        value_name = "PATH"
    )]
    config: PathBuf,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Validate the config file and print one line per route; exit 0 when valid, 2 when not.
    Check {
        /// Also connect to Redis as the gateway would and read what decides whether it can
        /// serve (the connection, maxmemory-policy, the ACL for the limiter's commands);
        /// exit 1 when a node cannot serve the limiter, 2 when the gateway would refuse to
        /// start (an evicting policy with require_noeviction).
        #[arg(long)]
        redis: bool,
    },
    /// Read an API key on stdin and print the `sha256 = "..."` line for the key file (with
    /// --tenant, a whole [[keys]] entry). The key itself is never stored.
    HashKey {
        /// The tenant the key belongs to.
        #[arg(long)]
        tenant: Option<String>,
        /// The tenant's tier, for routes with tiers.
        #[arg(long, requires = "tenant")]
        tier: Option<String>,
    },
}

/// `hash-key`: the key is one line of stdin (its line ending is not part of it). Typed at a
/// terminal, the line ends it; piped, the whole input must be that one line, so a file of
/// several keys is refused rather than its first key hashed alone.
fn hash_key(tenant: Option<&str>, tier: Option<&str>) -> i32 {
    use std::io::{IsTerminal, Read};
    // A command line that cannot be used exits 2, as every other (before stdin is read).
    for (field, value) in [("tenant", tenant), ("tier", tier)] {
        if value.is_some_and(|v| crate::config::EndpointId::parse(v).is_none()) {
            eprintln!("error: --{field} must be 1 to 128 of a-z, 0-9, '.', '_', '-'");
            return 2;
        }
    }
    let mut input = String::new();
    let stdin = std::io::stdin();
    let read = if stdin.is_terminal() {
        stdin.read_line(&mut input).map(drop)
    } else {
        stdin.lock().read_to_string(&mut input).map(drop)
    };
    if let Err(e) = read {
        eprintln!("cannot read the key from stdin: {e}");
        return 1;
    }
    let key = input.strip_suffix('\n').unwrap_or(&input);
    let key = key.strip_suffix('\r').unwrap_or(key);
    if key.contains(['\n', '\r']) {
        eprintln!("stdin holds more than one line: hash-key hashes one key a run");
        return 1;
    }
    if key.is_empty() {
        eprintln!("no key on stdin: pipe the key in, e.g. `printf %s \"$KEY\" | sentinel-gateway hash-key`");
        return 1;
    }
    // HTTP strips a header value's spaces and tabs at either end, and a value holds no control
    // character: no client could present such a key, and its hash would match nothing.
    if key.starts_with([' ', '\t']) || key.ends_with([' ', '\t']) {
        eprintln!("the key starts or ends with a space or tab, which HTTP strips from a header's value: no client could send it; hash it without them");
        return 1;
    }
    if key.len() > crate::identity::MAX_HEADER_IDENTITY_BYTES {
        eprintln!(
            "the key is {} bytes: an identity header longer than {} bytes is refused (401), so no client could use it; issue a shorter key",
            key.len(),
            crate::identity::MAX_HEADER_IDENTITY_BYTES
        );
        return 1;
    }
    if key.chars().any(char::is_control) {
        eprintln!("the key holds a control character, which no header value may carry: no client could send it");
        return 1;
    }
    let line = crate::config::api_keys::key_line(key.as_bytes());
    match tenant {
        None => println!("{line}"),
        Some(tenant) => {
            println!("[[keys]]\n{line}\ntenant = \"{tenant}\"");
            if let Some(tier) = tier {
                println!("tier = \"{tier}\"");
            }
        }
    }
    0
}

/// Runs the command line; returns the process exit code.
pub fn main() -> i32 {
    crate::signatures::install();
    let cli = Cli::parse();
    if cli.command.is_some() {
        // `check | head` and the like: a closed pipe ends a command quietly, as it does any
        // Unix tool. (The gateway itself keeps ignoring SIGPIPE: a client that goes away
        // must never stop it.)
        // SAFETY: restoring a signal's default disposition before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    if cli.command.is_none() {
        crate::server::hold_early_signals();
    }
    let (check, ask_redis) = match &cli.command {
        Some(Command::HashKey { tenant, tier }) => {
            return hash_key(tenant.as_deref(), tier.as_deref())
        }
        Some(Command::Check { redis }) => (true, *redis),
        None => (false, false),
    };
    // Before reading: a change made while it is read is then seen by `watch_config`.
    let config_file = crate::reload::file_stamp(&cli.config);
    let loaded = Config::load_at_start(&cli.config);
    match (check, loaded) {
        (_, Err(errors)) => {
            eprintln!("{errors}");
            eprintln!(
                "{}: {} error(s); the config was not loaded",
                cli.config.display(),
                errors.0.len()
            );
            if !check {
                // Starting, the errors are also one JSON line on stdout, as every log line.
                crate::telemetry::init();
                tracing::error!(
                    config = %cli.config.display(),
                    errors = %errors,
                    "the config is invalid; not started"
                );
            }
            EXIT_INVALID_CONFIG
        }
        (true, Ok(config)) => {
            let claim = config
                .jwt
                .as_ref()
                .map_or("sub", |j| j.identity_claim.as_str());
            for route in &config.routes {
                println!(
                    "{}",
                    describe(route, claim, config.server.ipv6_identity_prefix)
                );
            }
            for t in &config.server.tls {
                println!("{}", describe_tls(t));
            }
            if let Some(k) = &config.api_keys {
                println!(
                    "api keys: {} key(s) of {} tenant(s) from {}, read from the {} header",
                    k.keys.len(),
                    k.keys.tenants(),
                    k.file.display(),
                    k.header
                );
            }
            for w in config.warnings_in_words() {
                eprintln!("warning: {w}");
            }
            println!(
                "{}: ok, {} route(s)",
                cli.config.display(),
                config.routes.len()
            );
            if ask_redis {
                return check_redis(&config.redis);
            }
            0
        }
        (false, Ok(config)) => {
            crate::telemetry::init();
            let read = crate::reload::stamp_read(&config.source, &config, config_file);
            match crate::server::run(config, read) {
                Ok(()) => 0,
                Err(e) => {
                    tracing::error!(error = %e, "cannot start");
                    eprintln!("cannot start: {e}");
                    match e {
                        crate::server::StartError::Evicting { .. } => EXIT_INVALID_CONFIG,
                        _ => 1,
                    }
                }
            }
        }
    }
}

/// `check --redis`: one line per node; 0 when every node can serve the limiter, 1 when one
/// cannot (not reached, a replica, or its user may not run the scripts' commands: the gateway would
/// start and decide by each route's fail mode), 2 when the gateway would not start (an
/// evicting policy with `require_noeviction`).
fn check_redis(config: &crate::config::RedisConfig) -> i32 {
    use crate::store::EvictionPolicy;
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start a runtime to reach redis: {e}");
            return 1;
        }
    };
    let nodes = match runtime.block_on(crate::store::inspect(config)) {
        Ok(nodes) => nodes,
        Err(why) => {
            println!("redis: cannot serve: {why}");
            return 1;
        }
    };
    let mut code = 0;
    for n in &nodes {
        if let Some(why) = &n.unreachable {
            println!("redis {}: cannot serve: {why}", n.node);
            code = code.max(1);
            continue;
        }
        let mut node = 0;
        let mut said = Vec::new();
        if let Some(v) = &n.version {
            said.push(format!("redis {v}"));
        }
        // A replica refuses every decision's write (`READONLY`): a URL left on a master
        // demoted by a failover, or a replica's address given for the master's.
        if let Some(master) = &n.replica_of {
            node = 1;
            said.push(format!("a replica of {master}: a read-only one (the default) refuses every decision's write (READONLY), a writable one keeps writes its master never sees (lost at its next sync); point redis.url at the master, or follow failovers with redis.sentinel_urls"));
        }
        said.push(match &n.policy {
            None => "maxmemory-policy not read: Redis is busy (a script running) or loading; ask again".to_owned(),
            Some(EvictionPolicy::NoEviction) => "maxmemory-policy noeviction".to_owned(),
            Some(EvictionPolicy::Evicting(p)) if config.require_noeviction => {
                node = 2;
                format!("maxmemory-policy {p}: keys can be evicted, which require_noeviction refuses")
            }
            Some(EvictionPolicy::Evicting(p)) => {
                format!("maxmemory-policy {p}: keys can be evicted (allowed: require_noeviction = false): an evicted bucket starts full again")
            }
            Some(EvictionPolicy::Unknown) => {
                "maxmemory-policy not readable (CONFIG not permitted): make sure it is noeviction"
                    .to_owned()
            }
        });
        match &n.refused {
            Ok(refused) if refused.is_empty() => {
                said.push("the limiter's commands permitted".to_owned())
            }
            Ok(refused) => {
                node = node.max(1);
                said.push(format!(
                    "the user may not run {}",
                    refused_in_words(refused)
                ));
            }
            Err(e) => {
                node = node.max(1);
                said.push(format!("the user cannot run the limiter's scripts: {e}"));
            }
        }
        let verdict = match node {
            0 => "ok",
            1 => "cannot serve",
            _ => "the gateway would not start",
        };
        println!("redis {}: {verdict}: {}", n.node, said.join("; "));
        code = code.max(node);
    }
    code
}

/// The commands a node's user may not run, with what each would stop.
fn refused_in_words(refused: &[String]) -> String {
    let of = |names: &[&str]| -> Vec<&str> {
        (refused.iter())
            .map(String::as_str)
            .filter(|c| names.contains(c))
            .collect()
    };
    [
        (
            of(&["time", "hmget", "hset", "expire", "pexpire", "persist"]),
            "every decision would fail",
        ),
        (
            of(&["zadd", "zremrangebyscore", "zcard"]),
            "the fleet heartbeat of fallback_rate_fleet_micro would fail",
        ),
        (
            of(&["del", "publish", "subscribe"]),
            "DELETE /limits would fail or not reach the other gateways",
        ),
    ]
    .into_iter()
    .filter(|(names, _)| !names.is_empty())
    .map(|(names, what)| format!("{}: {what}", names.join(", ")))
    .collect::<Vec<_>>()
    .join("; ")
}

fn requests(micro: u64) -> String {
    let whole = micro / 1_000_000;
    let frac = micro % 1_000_000;
    if frac == 0 {
        whole.to_string()
    } else {
        let s = format!("{whole}.{frac:06}");
        s.trim_end_matches('0').to_owned()
    }
}

/// `micro` millionths of `noun`, in words: "1 request", "0.5 requests", "5 requests".
fn counted(micro: u64, noun: &str) -> String {
    let n = requests(micro);
    let s = if micro == 1_000_000 { "" } else { "s" };
    format!("{n} {noun}{s}")
}

/// One TLS listener in plain words: its versions and which certificate each name gets.
pub fn describe_tls(t: &crate::config::TlsListener) -> String {
    let versions = match t.min_version {
        crate::config::TlsVersion::V1_2 => "TLS 1.2 and 1.3",
        crate::config::TlsVersion::V1_3 => "TLS 1.3 only",
    };
    let mut line = format!(
        "tls {}: {versions}, ALPN h2, http/1.1 and http/1.0; default certificate {} (expires {})",
        t.listen,
        t.default.cert_path.display(),
        t.default.expires
    );
    for sni in &t.sni {
        let names: Vec<String> = sni.server_names.iter().map(|n| n.to_string()).collect();
        line.push_str(&format!(
            "; {} -> {} (expires {})",
            names.join(", "),
            sni.pair.cert_path.display(),
            sni.pair.expires
        ));
    }
    line
}

/// One limit's algorithm in plain words: in requests, or, when a request costs other than
/// one token, in tokens with the requests they make.
fn describe_algorithm(algorithm: Algorithm, cost_micro: u64) -> String {
    let one = cost_micro == 1_000_000;
    match algorithm {
        Algorithm::None => "not limited".to_owned(),
        Algorithm::TokenBucket {
            capacity_micro,
            refill_micro_per_sec,
        } => {
            let unit = if one { "request" } else { "token" };
            let refill = if refill_micro_per_sec == 0 {
                "never refilled".to_owned()
            } else {
                format!(
                    "refilled at {} per second",
                    counted(refill_micro_per_sec, unit)
                )
            };
            let size = if one {
                counted(capacity_micro, "request")
            } else {
                let whole = capacity_micro / cost_micro;
                let s = if whole == 1 { "" } else { "s" };
                format!(
                    "{} ({whole} request{s} at {} each)",
                    counted(capacity_micro, "token"),
                    counted(cost_micro, "token")
                )
            };
            format!("token bucket of {size}, {refill}")
        }
        Algorithm::SlidingWindow {
            limit,
            window_micro,
        } => {
            let cost = if one {
                String::new()
            } else {
                let whole = limit / (cost_micro / 1_000_000).max(1);
                let s = if whole == 1 { "" } else { "s" };
                format!(
                    ", each call counting as {} ({whole} call{s})",
                    counted(cost_micro, "request")
                )
            };
            let s = if limit == 1 { "" } else { "s" };
            format!(
                "sliding window of {limit} request{s} per {}{cost}",
                counted(window_micro, "second")
            )
        }
    }
}

/// The route in plain words; `claim` is the JWT claim that names a caller, `ipv6_prefix` the
/// prefix an IPv6 client is keyed by.
pub fn describe(route: &RouteConfig, claim: &str, ipv6_prefix: u8) -> String {
    let p = &route.policy;
    // A GET route matches HEAD too (section 3): the line says what it matches.
    let methods = route.methods.as_ref().map_or("any method".to_owned(), |m| {
        let mut names: Vec<&str> = Vec::with_capacity(m.len() + 1);
        // Each once (a method written twice, in any case, is warned of).
        for name in m.iter().map(|m| m.as_str()) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        if names.contains(&"GET") && !names.contains(&"HEAD") {
            let at = names.iter().position(|n| *n == "GET").unwrap_or(0) + 1;
            names.insert(at, "HEAD");
        }
        names.join(",")
    });
    let path = match &route.path {
        PathMatch::Exact(p) => p.clone(),
        PathMatch::Prefix(p) if p == "/" => "/**".to_owned(),
        PathMatch::Prefix(p) => format!("{p}/**"),
    };
    let host = route
        .host
        .as_deref()
        .map_or(String::new(), |h| format!(" on {h}"));
    let identity = match &route.identity {
        IdentitySource::Jwt if claim == "sub" => "per JWT subject".to_owned(),
        IdentitySource::Jwt => format!("per JWT {claim} claim"),
        IdentitySource::ClientIp if ipv6_prefix < 128 => {
            format!("per client IP (IPv6 by its /{ipv6_prefix})")
        }
        IdentitySource::ClientIp => "per client IP".to_owned(),
        IdentitySource::Global => "shared by all clients".to_owned(),
        IdentitySource::Header(h) => format!("per {h} header"),
        IdentitySource::ApiKey => "per API key tenant".to_owned(),
    };
    let limit = if p.several {
        let each: Vec<String> = p
            .limits
            .iter()
            .map(|l| {
                let on = if l.global {
                    "shared by all clients (a ceiling)"
                } else {
                    identity.as_str()
                };
                format!(
                    "limit {}: {}, {on}",
                    l.name,
                    describe_algorithm(l.algorithm, p.cost_micro)
                )
            })
            .collect();
        match &each[..] {
            [one] => format!("1 limit, which must admit: {one}"),
            _ => format!(
                "{} limits, each must admit: {}",
                each.len(),
                each.join("; ")
            ),
        }
    } else if p.algorithm == Algorithm::None {
        "not limited".to_owned()
    } else {
        format!(
            "{}, {identity}",
            describe_algorithm(p.algorithm, p.cost_micro)
        )
    };
    let fail = match (p.algorithm, p.fallback_rate_micro, p.fail_mode) {
        // Said, though it never applies: no Redis call is made.
        (Algorithm::None, _, mode) => format!("; {} (unused)", mode.as_str()),
        (_, Some(rate), crate::config::FailMode::FailOpen) => {
            let each = if p.emergency_per_identity {
                " per identity"
            } else {
                ""
            };
            let whole = if p.fallback_fleet {
                "for the whole fleet"
            } else {
                "per process"
            };
            format!(
                "; fail_open (emergency cap {} per second{each} {whole})",
                counted(rate, "request")
            )
        }
        (_, _, mode) => format!("; {}", mode.as_str()),
    };
    let tiers = match &p.tiers {
        None => String::new(),
        Some(plan) => {
            let from = match &plan.from {
                crate::config::TierFrom::ApiKey => "the key file".to_owned(),
                crate::config::TierFrom::Claim(c) => format!("the token's {c} claim"),
            };
            let each: Vec<String> = plan
                .tiers
                .iter()
                .map(|(name, t)| match t {
                    crate::config::TierLimits::Unlimited => format!("{name}: not limited"),
                    crate::config::TierLimits::Limits(limits) => {
                        let l: Vec<String> = limits
                            .iter()
                            .map(|l| {
                                format!(
                                    "limit {}: {}",
                                    l.name,
                                    describe_algorithm(l.algorithm, p.cost_micro)
                                )
                            })
                            .collect();
                        format!("{name}: {}", l.join(", "))
                    }
                })
                .collect();
            // A listed default tier has limits of its own; otherwise the route's are its.
            let default = if plan.tiers.iter().any(|(name, _)| *name == plan.default) {
                format!("a caller without a listed tier is tier {}", plan.default)
            } else {
                format!(
                    "the limits above are tier {}'s, and a caller's without a listed tier",
                    plan.default
                )
            };
            let listed: String = each.iter().map(|t| format!("; {t}")).collect();
            format!("; tiers from {from} ({default}){listed}")
        }
    };
    let shadow = if p.mode == crate::config::Enforcement::Shadow {
        "; shadow mode"
    } else {
        ""
    };
    let cors = match &route.cors {
        None => String::new(),
        Some(crate::config::CorsOrigins::Any) => "; CORS for any origin".to_owned(),
        Some(crate::config::CorsOrigins::Listed(origins)) => {
            format!("; CORS for {}", origins.join(", "))
        }
    };
    let exempt = match &route.exempt_client_cidrs[..] {
        [] => String::new(),
        cidrs => {
            let cidrs: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
            format!("; clients in {} not limited", cidrs.join(", "))
        }
    };
    let cost = p.cost_from_response.as_ref().map_or(String::new(), |c| {
        format!(
            "; charged {} per unit of the answer's {} header",
            // In the bucket's unit: tokens, unless a request costs one token.
            counted(
                c.unit_micro,
                if p.cost_micro == 1_000_000 {
                    "request"
                } else {
                    "token"
                }
            ),
            c.header
        )
    });
    let told = match (route.forward_identity, &p.tiers) {
        (false, _) => "",
        (true, None) => "; the upstream is told the caller (X-Sentinel-Identity)",
        (true, Some(_)) => {
            "; the upstream is told the caller and tier (X-Sentinel-Identity, X-Sentinel-Tier)"
        }
    };
    format!(
        "{}: {methods} {path}{host} -> {}{}; {limit}{tiers}{exempt}{cost}{told}{fail}{shadow}{cors}; policy v{}",
        p.endpoint_id,
        name_shown(&route.upstream.name),
        if route.upstream.http2 { " (HTTP/2)" } else { "" },
        p.policy_version
    )
}

/// An upstream's name on a route's line: as written when TOML writes it bare, else quoted on
/// one line with its escapes (`"api v2"`, `"a\nb"`): one line a route, whatever the name.
fn name_shown(name: &str) -> std::borrow::Cow<'_, str> {
    let bare = (name.chars()).all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    match bare && !name.is_empty() {
        true => name.into(),
        false => format!("{name:?}").into(),
    }
}

#[cfg(test)]
mod tests {
    use super::counted;

    #[test]
    fn one_of_a_thing_is_singular_and_every_other_count_plural() {
        assert_eq!(counted(1_000_000, "request"), "1 request");
        assert_eq!(counted(5_000_000, "request"), "5 requests");
        assert_eq!(counted(500_000, "request"), "0.5 requests");
        assert_eq!(counted(1_500_000, "second"), "1.5 seconds");
        assert_eq!(counted(0, "token"), "0 tokens");
    }
}
