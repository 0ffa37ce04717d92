//! Raw config -> domain config. Every problem is collected, never just the first.
//!
//! `sections.rs` checks `[server]` and `[auth.api_keys]`, `redis.rs` `[redis]` and
//! `[breaker]`, `jwt.rs` `[auth.jwt]`, `upstream.rs` `[upstreams]`, `files.rs` the files the
//! gateway writes or reads secrets from, `tls.rs` the TLS listeners; `route.rs` checks each
//! `[[routes]]` entry and the rules between routes; `shape.rs` says TOML's own errors.

mod files;
mod jwt;
mod redis;
mod route;
mod sections;
mod shape;
pub(super) use shape::deepest_key;
pub(crate) use shape::key_shown;
mod tls;
mod upstream;

use std::path::Path;
use std::sync::Arc;

use toml::Spanned;

use super::error::{Collector, ConfigErrors};
use super::raw::RawConfig;
use super::*;
use crate::routing;

pub fn validate(
    path: &Path,
    source: &str,
    redis_url_override: Option<&str>,
) -> Result<Config, ConfigErrors> {
    let mut c = Collector::new(path, source);
    if super::is_empty_toml(source) {
        c.push(None, None, "the file is empty (no table, no key: blank lines or comments only): a file truncated or not yet written is never loaded".into());
        return Err(ConfigErrors(c.errors));
    }
    let raw: RawConfig = match toml::from_str(source) {
        Ok(raw) => raw,
        Err(e) => {
            let (at, route, message) = shape::error(source, &e);
            c.push(at.as_ref(), route.as_deref(), message);
            return Err(ConfigErrors(c.errors));
        }
    };

    let server = sections::server(&mut c, &raw, path);
    let redis = redis::redis(&mut c, &raw, redis_url_override, path);
    let breaker = redis::breaker(&mut c, &raw);
    let jwt = jwt::jwt(&mut c, &raw, path);
    let access_log = files::access_log(&mut c, &raw, path);
    files::secrets_of_their_own(&mut c, &raw, path);
    let api_keys = sections::api_keys(&mut c, &raw, path);
    let upstreams: BTreeMap<String, Arc<UpstreamConfig>> = raw
        .upstreams
        .iter()
        .filter_map(|(name, up)| {
            upstream::upstream(&mut c, name, up, path).map(|u| (name.clone(), Arc::new(u)))
        })
        .collect();
    let mut routes = Vec::new();
    let mut matchers = Vec::new();
    for (index, r) in raw.routes.iter().enumerate() {
        let server_body = server.as_ref().and_then(|s| s.max_body_bytes);
        let (route, matcher) = route::route(&mut c, index, r, &raw, &upstreams, server_body);
        if let Some(route) = route {
            routes.push((r.span(), route));
        }
        if let Some(matcher) = matcher {
            matchers.push((matcher, index));
        }
    }
    if raw.routes.is_empty() {
        c.warn(None, None, "no [[routes]]: every request is answered 404 (a reload to such a file is refused while routes are serving: a file cut short)".into());
    }
    upstreams_unused_or_looping(&mut c, &raw, server.as_ref(), &upstreams);
    route::shared_endpoints(&mut c, &raw.routes, &routes);
    unlisted_key_tiers(&mut c, api_keys.as_ref(), &routes);
    request_id_clashes(&mut c, &raw, server.as_ref(), api_keys.as_ref(), &routes);
    // Over every route whose path, host and methods are valid, whatever else is wrong with it.
    for (a, b) in routing::ambiguities(matchers) {
        let id = |i: usize| {
            let id = raw.routes[i].get_ref().endpoint_id.as_ref();
            id.map_or("?", |v| v.get_ref().as_str())
        };
        c.push(
            Some(&raw.routes[b].span()),
            Some(&route_label(b, id(b))),
            format!(
                "matches the same requests as {} with equal specificity: give one of them a \
                 host, methods or a more specific path",
                route_label(a, id(a))
            ),
        );
    }

    if !c.errors.is_empty() {
        return Err(ConfigErrors(in_file_order(path, c.errors)));
    }
    Ok(Config {
        source: path.to_path_buf(),
        server: server.expect("no errors means a server section"),
        redis: redis.expect("no errors means a redis section"),
        breaker: breaker.expect("no errors means a breaker section"),
        jwt,
        api_keys,
        access_log,
        upstreams,
        routes: routes.into_iter().map(|(_, r)| r).collect(),
        warnings: c.warnings,
        secret_files: c.secret_files,
        named_read: Vec::new(),
        source_hash: String::new(),
    })
}

/// An upstream no route names (said: a misspelt route's upstream leaves the meant one
/// unused), and an upstream address that is one of the gateway's own listeners (refused:
/// each request would be sent back in, again and again, until the connection bound).
fn upstreams_unused_or_looping(
    c: &mut Collector,
    raw: &RawConfig,
    server: Option<&ServerConfig>,
    upstreams: &BTreeMap<String, Arc<UpstreamConfig>>,
) {
    for (name, u) in &raw.upstreams {
        let named = (raw.routes.iter()).any(|r| {
            r.get_ref()
                .upstream
                .as_ref()
                .is_some_and(|n| n.get_ref() == name)
        });
        if !named {
            let shown = shape::key_shown(name);
            c.warn(
                Some(&u.span()),
                None,
                format!("upstreams.{shown} is named by no route: no request goes to it"),
            );
        }
    }
    let Some(server) = server else {
        return;
    };
    // gRPC clients speak HTTP/2 only: in plain, with prior knowledge (`h2c`).
    if !server.h2c && server.tls.is_empty() {
        for (name, u) in upstreams.iter().filter(|(_, u)| u.http2) {
            let at = raw.upstreams.get(name).map(|r| r.span());
            c.warn(at.as_ref(), None, format!("upstreams.{} has http2 = true, but no listener takes HTTP/2 from clients (server.h2c = false, no [[server.tls]]): a gRPC client cannot reach it (HTTP/1.1 clients can); set h2c = true", shape::key_shown(&u.name)));
        }
    }
    let own = (server.listen.iter()).chain(server.tls.iter().map(|t| &t.listen));
    let own: Vec<&SocketAddr> = own.collect();
    // Whether `[::]` takes IPv4 too: the host's setting, read where the listeners are bound.
    let dual =
        std::fs::read_to_string("/proc/sys/net/ipv6/bindv6only").is_ok_and(|v| v.trim() == "0");
    for (name, u) in upstreams {
        let Some(raw_u) = raw.upstreams.get(name) else {
            continue;
        };
        // One address an entry, in the entries' order (a name's holds none yet).
        let entries = raw_u.get_ref().addrs.get_ref();
        for ((addr, host), entry) in u.addrs.iter().zip(&u.hosts).zip(entries) {
            // `localhost` as the host resolves it (as the upstream's addresses will be).
            let addrs: Vec<SocketAddr> = match host.parse::<std::net::IpAddr>() {
                Ok(_) => vec![*addr],
                Err(_) if host.eq_ignore_ascii_case("localhost") => {
                    use std::net::ToSocketAddrs;
                    (host.as_str(), addr.port())
                        .to_socket_addrs()
                        .map(Iterator::collect)
                        .unwrap_or_default()
                }
                Err(_) => continue,
            };
            let found = (own.iter()).find(|l| addrs.iter().any(|a| sends_back(l, a, dual)));
            let Some(l) = found else {
                continue;
            };
            let shown = shape::key_shown(name);
            c.push(Some(&entry.span()), None, format!("upstreams.{shown}.addrs entry \"{}\" is the gateway's own listener ({l}): each request would be sent back into the gateway, again and again; name the backend's address", entry.get_ref()));
        }
    }
}

/// Whether a connection to `upstream` reaches the listener `listen`: the same port and
/// address (an IPv4-mapped IPv6 address as the IPv4 one), or a wildcard listener of the
/// upstream's family and a loopback (or unspecified, which dials the host itself) upstream;
/// `dual`: the host's `[::]` takes IPv4 too (`net.ipv6.bindv6only = 0`).
fn sends_back(listen: &SocketAddr, upstream: &SocketAddr, dual: bool) -> bool {
    let (l, u) = (
        crate::identity::canonical(listen.ip()),
        crate::identity::canonical(upstream.ip()),
    );
    let local = |ip: std::net::IpAddr| ip.is_loopback() || ip.is_unspecified();
    let takes = |wild: std::net::IpAddr, other: std::net::IpAddr| {
        wild.is_ipv4() == other.is_ipv4() || (dual && wild.is_ipv6() && other.is_ipv4())
    };
    listen.port() == upstream.port()
        && (l == u
            || (l.is_unspecified() && takes(l, u) && local(u))
            || (u.is_unspecified() && u.is_ipv4() == l.is_ipv4() && local(l)))
}

/// A tier the key file gives keys that no route taking tiers from the key file lists (nor
/// has as `default_tier`): a misspelt tier drops a paying tenant to every route's default
/// tier without a word, so `check` and every reload say it.
fn unlisted_key_tiers(
    c: &mut Collector,
    api_keys: Option<&ApiKeysConfig>,
    routes: &[(std::ops::Range<usize>, RouteConfig)],
) {
    let Some(api_keys) = api_keys else {
        return;
    };
    let mut listed = std::collections::BTreeSet::new();
    let mut tiered = false;
    for (_, r) in routes {
        if let Some(plan) = r
            .policy
            .tiers
            .as_ref()
            .filter(|p| p.from == TierFrom::ApiKey)
        {
            tiered = true;
            listed.insert(plan.default.as_str());
            listed.extend(plan.tiers.keys().map(String::as_str));
        }
    }
    if !tiered {
        return;
    }
    for (tier, keys) in api_keys.keys.tiers() {
        if !listed.contains(tier) {
            c.warn(None, None, format!("auth.api_keys.file ({}): tier = \"{tier}\" ({keys} key(s)) is listed by no route with tier_from = \"api_key\": those callers count as each route's default tier", api_keys.file.display()));
        }
    }
    // The tier is the key's, the bucket the tenant's in each tier: a tenant moved to a new
    // tier by a new key, its old one kept, has both allowances. Each tenant is said once, at
    // the first route that reads its keys into several tiers (a key without a tier and one of
    // the default tier's name, or of a tier the route does not list, share its buckets).
    let mut said = std::collections::BTreeSet::new();
    for (_, r) in routes {
        let Some(plan) = r
            .policy
            .tiers
            .as_ref()
            .filter(|p| p.from == TierFrom::ApiKey)
        else {
            continue;
        };
        let several = api_keys.keys.tenants_of_several_tiers(|tier| match tier {
            Some(t) if plan.tiers.contains_key(t) => t,
            _ => plan.default.as_str(),
        });
        for (tenant, tiers) in several {
            if !said.insert(tenant.to_owned()) {
                continue;
            }
            let label = route_label(r.index, r.policy.endpoint_id.as_str());
            c.warn(None, None, format!("auth.api_keys.file ({}): tenant \"{tenant}\" holds keys of several tiers of {label} ({}): each tier has its own buckets, so the tenant's allowances add up (when moving a tenant to another tier, remove its keys of the old one)", api_keys.file.display(), tiers.join(", ")));
        }
    }
}

/// `server.request_id_header` must not be a header a route reads an identity from, or the
/// upstream reports a cost in: a trusted proxy's value would be kept and logged as the request
/// id (a raw key in every log line), and a new id written over the header sent upstream.
fn request_id_clashes(
    c: &mut Collector,
    raw: &RawConfig,
    server: Option<&ServerConfig>,
    api_keys: Option<&ApiKeysConfig>,
    routes: &[(std::ops::Range<usize>, RouteConfig)],
) {
    let Some(server) = server else {
        return;
    };
    let written = raw
        .server
        .as_ref()
        .and_then(|s| s.get_ref().request_id_header.as_ref());
    let id = server.request_id_header.as_str();
    let mut uses = Vec::new();
    // Where the file says it when it leaves the request id header at its default: the first
    // route that uses it.
    let mut first_route = None;
    if api_keys.is_some_and(|k| k.header == id) {
        uses.push("auth.api_keys.header".to_owned());
    }
    for (span, r) in routes {
        let label = route_label(r.index, r.policy.endpoint_id.as_str());
        let before = uses.len();
        if matches!(&r.identity, IdentitySource::Header(h) if h == id) {
            uses.push(format!("the identity header of {label}"));
        }
        if r.policy
            .cost_from_response
            .as_ref()
            .is_some_and(|cost| cost.header == id)
        {
            uses.push(format!("the cost header of {label}"));
        }
        if uses.len() > before && first_route.is_none() {
            first_route = Some(span.clone());
        }
    }
    if uses.is_empty() {
        return;
    }
    let (span, named, advice) = match written {
        Some(w) => (
            Some(w.span()),
            format!("server.request_id_header = \"{}\"", w.get_ref()),
            "choose another, such as \"X-Request-Id\"",
        ),
        None => (
            first_route,
            "server.request_id_header (by default \"X-Request-Id\")".to_owned(),
            "set server.request_id_header to another, such as \"X-Trace-Id\"",
        ),
    };
    c.push(
        span.as_ref(),
        None,
        format!(
            "{named} is also {}: the request id would be read from, logged as and written over that header; {advice}",
            uses.join(", ")
        ),
    );
}

pub(super) fn route_label(index: usize, endpoint_id: &str) -> String {
    format!("routes[{index}] ({})", cut(endpoint_id))
}

/// A value written in the file, as a message repeats it: whole up to 128 bytes (every valid
/// name fits), else its start and how long it is, so that a value pasted by mistake (a
/// megabyte of it) does not fill every line said of it.
pub(super) fn cut(value: &str) -> std::borrow::Cow<'_, str> {
    const SHOWN: usize = 128;
    if value.len() <= SHOWN {
        return value.into();
    }
    let mut end = SHOWN - 16;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes)", &value[..end], value.len()).into()
}

/// How an `*_env` field's variable is named in a message: as written when the environment
/// has such a variable, or when it reads as one (upper case, digits and at least one `_`,
/// as `SENTINEL_REDIS_PASSWORD`); else not at all, since what was written there may be the
/// secret itself pasted in place of the name (an AWS key id is upper case too). The
/// message's line and column point at it.
pub(super) fn env_var_shown(name: &str) -> String {
    let reads_as_a_name = name.len() <= 64
        && name.contains('_')
        && name.starts_with(|c: char| c.is_ascii_uppercase())
        && name
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
    if reads_as_a_name || std::env::var_os(name).is_some() {
        name.to_owned()
    } else {
        "named here".to_owned()
    }
}

/// Each entry of `list` that reads (as `key` reads it) as an earlier one: its index and the
/// first such earlier one's. A list written with an entry twice is still each entry once,
/// which `check` says.
pub(super) fn listed_again<T, K: Eq + std::hash::Hash>(
    list: &[T],
    key: impl Fn(&T) -> K,
) -> Vec<(usize, usize)> {
    let mut seen = std::collections::HashMap::new();
    (list.iter().enumerate())
        .filter_map(|(i, entry)| match seen.entry(key(entry)) {
            std::collections::hash_map::Entry::Occupied(first) => Some((i, *first.get())),
            std::collections::hash_map::Entry::Vacant(place) => {
                place.insert(i);
                None
            }
        })
        .collect()
}

/// Whether a name holds a character no name is written with: a control character (a line
/// break, a NUL) or one that turns the direction text is shown in (U+202E and its kin), which
/// would show `check`'s lines and the logs otherwise than they are.
pub(super) fn unprintable(name: &str) -> bool {
    name.chars().any(|ch| {
        ch.is_control()
            || matches!(ch, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    })
}

/// Reads an optional integer within `lo..=hi`, naming the field and the valid range.
pub(super) fn int_in(
    c: &mut Collector,
    route: Option<&str>,
    field: &str,
    value: Option<&Spanned<i64>>,
    default: i64,
    (lo, hi): (i64, i64),
    unit: &str,
) -> Option<u64> {
    let Some(v) = value else {
        return Some(default as u64);
    };
    let n = *v.get_ref();
    if n < lo || n > hi {
        c.push(
            Some(&v.span()),
            route,
            format!("{field} = {n} is out of range: it must be between {lo} and {hi}{unit}"),
        );
        return None;
    }
    Some(n as u64)
}

/// Errors as a reader meets them: each file's by line and column, the config's first, then
/// the files it names (a key file, a JWKS) in the order their errors came; one with no place
/// first among its file's. The
/// checks run section by section, route by route, and then across routes, which would
/// otherwise print a file's line 2 848 after its line 31 109.
fn in_file_order(
    config: &Path,
    mut errors: Vec<super::error::ConfigError>,
) -> Vec<super::error::ConfigError> {
    let mut files: Vec<PathBuf> = vec![config.to_path_buf()];
    for e in &errors {
        if !files.contains(&e.file) {
            files.push(e.file.clone());
        }
    }
    errors.sort_by_key(|e| (files.iter().position(|f| *f == e.file), e.position));
    errors
}

/// A secret as read from where the config says: `<field>_env`, an environment variable, or
/// `<field>_file`, a file (a Kubernetes Secret's, Docker's `/run/secrets`), read at the start
/// and at every reload, and watched with `watch_config` as the other files a config names.
pub(super) struct SecretRead {
    /// The field that says where (`redis.password_file`), for messages.
    pub field: String,
    /// Where, in words: `the environment variable REDIS_PASSWORD`, `the file
    /// /run/secrets/redis` (never the value).
    pub from: String,
    pub span: std::ops::Range<usize>,
    /// The value: `None` for a variable that is not set. A file's last line break (`\n` or
    /// `\r\n`, as `echo` and editors leave it) is not part of it.
    pub value: Option<Vec<u8>>,
    /// Read from a file: an empty value is said as an empty file, not an unset variable.
    pub file: bool,
}

impl SecretRead {
    /// "is not set (or empty)" for a variable, "is empty" for a file.
    pub fn unset(&self) -> &'static str {
        match self.file {
            true => "is empty",
            false => "is not set (or empty)",
        }
    }
}

/// A secret's file is read up to this size: past it, it holds more than a secret.
const SECRET_FILE_MOST: u64 = 64 * 1024;

/// Where the secret `field` (`redis.password`) is read from and what it holds: `Ok(None)`
/// when neither `<field>_env` nor `<field>_file` is written (and no `default_env`), `Err`
/// once a problem is said (both written; a file that cannot be read).
pub(super) fn secret(
    c: &mut Collector,
    field: &str,
    env: Option<&Spanned<String>>,
    file: Option<&Spanned<String>>,
    default_env: Option<(&str, std::ops::Range<usize>)>,
    config: &Path,
) -> Result<Option<SecretRead>, ()> {
    match (env, file) {
        (Some(_), Some(f)) => {
            c.push(
                Some(&f.span()),
                None,
                format!(
                    "{field}_env and {field}_file are both set: read the secret from one of them"
                ),
            );
            Err(())
        }
        (None, Some(f)) => {
            let written = f.get_ref();
            let path = config
                .parent()
                .map_or_else(|| PathBuf::from(written), |dir| dir.join(written));
            // Two bytes more: a secret of the whole 64 KiB and its line break (`\r\n`).
            match super::read_named_up_to(&path, SECRET_FILE_MOST + 2) {
                Ok(mut value) => {
                    c.secret_files.push(path.clone());
                    if value.ends_with(b"\n") {
                        value.pop();
                        if value.ends_with(b"\r") {
                            value.pop();
                        }
                    }
                    if value.len() as u64 > SECRET_FILE_MOST {
                        c.push(Some(&f.span()), None, format!("{field}_file = \"{written}\" is over {} KiB: a secret's file holds the secret alone", SECRET_FILE_MOST / 1024));
                        return Err(());
                    }
                    Ok(Some(SecretRead {
                        field: format!("{field}_file"),
                        from: format!("the file {}", path.display()),
                        span: f.span(),
                        value: Some(value),
                        file: true,
                    }))
                }
                Err(e) => {
                    // (Watched all the same, as every file a refused config tried to read.)
                    c.push(
                        Some(&f.span()),
                        None,
                        format!("{field}_file = \"{written}\": cannot read it: {e}"),
                    );
                    Err(())
                }
            }
        }
        (env, None) => {
            let (name, span) = match (env, default_env) {
                (Some(v), _) => (v.get_ref().as_str(), v.span()),
                (None, Some((name, span))) => (name, span),
                (None, None) => return Ok(None),
            };
            Ok(Some(SecretRead {
                field: format!("{field}_env"),
                from: format!("the environment variable {}", env_var_shown(name)),
                span,
                value: std::env::var_os(name).map(|v| v.into_encoded_bytes()),
                file: false,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::sends_back;

    /// A value past 128 bytes is said by its start and length: a 5 MB `key_prefix` made a
    /// 5 MB message, and a long `endpoint_id` was repeated whole on every line of its route.
    #[test]
    fn a_long_value_is_cut_in_messages() {
        assert_eq!(super::cut("api.v1"), "api.v1");
        let exact = "e".repeat(128);
        assert_eq!(super::cut(&exact), exact);
        let long = "k".repeat(5_000_000);
        assert_eq!(
            super::cut(&long),
            format!("{}... (5000000 bytes)", "k".repeat(112))
        );
        // Never inside a character.
        let wide = "\u{e9}".repeat(100);
        assert_eq!(
            super::cut(&wide),
            format!("{}... (200 bytes)", "\u{e9}".repeat(56))
        );
    }

    #[test]
    fn an_upstream_at_a_listener_of_its_family_sends_back() {
        let loops = |l: &str, u: &str| sends_back(&l.parse().unwrap(), &u.parse().unwrap(), false);
        let dual = |l: &str, u: &str| sends_back(&l.parse().unwrap(), &u.parse().unwrap(), true);
        assert!(loops("127.0.0.1:8080", "127.0.0.1:8080"));
        assert!(loops("0.0.0.0:8080", "127.0.0.1:8080"));
        assert!(loops("0.0.0.0:8080", "0.0.0.0:8080"));
        assert!(loops("127.0.0.1:8080", "0.0.0.0:8080"));
        assert!(loops("127.0.0.1:8080", "[::ffff:127.0.0.1]:8080"));
        assert!(loops("[::]:8080", "[::1]:8080"));
        assert!(loops("[::1]:8080", "[::]:8080"));
        // Another port, another address, another family (0.0.0.0 takes no IPv6; whether
        // [::] takes IPv4 is the host's setting).
        assert!(!loops("127.0.0.1:8080", "127.0.0.1:8081"));
        assert!(!loops("127.0.0.1:8080", "127.0.0.10:8080"));
        assert!(!loops("0.0.0.0:8080", "[::1]:8080"));
        assert!(!loops("[::1]:8080", "0.0.0.0:8080"));
        assert!(!loops("[::]:8080", "127.0.0.1:8080"));
        // Where the host's `[::]` takes IPv4 too, it takes the IPv4 loopback.
        assert!(dual("[::]:8080", "127.0.0.1:8080"));
        assert!(!dual("0.0.0.0:8080", "[::1]:8080"));
    }
}
