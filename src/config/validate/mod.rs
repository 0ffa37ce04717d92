//! Raw config -> domain config. Every problem is collected, never just the first.
//!
//! `sections.rs` checks `[server]`, `[redis]`, `[breaker]`, `[auth.jwt]` and `[upstreams]`;
//! `route.rs` checks each `[[routes]]` entry and the rules between routes.

mod place;
mod route;
mod sections;
mod tls;

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
            let (at, route, message) = shape_error(source, &e);
            c.push(at.as_ref(), route.as_deref(), message);
            return Err(ConfigErrors(c.errors));
        }
    };

    let server = sections::server(&mut c, &raw, path);
    let redis = sections::redis(&mut c, &raw, redis_url_override, path);
    let breaker = sections::breaker(&mut c, &raw);
    let jwt = sections::jwt(&mut c, &raw, path);
    let access_log = sections::access_log(&mut c, &raw, path);
    let api_keys = sections::api_keys(&mut c, &raw, path);
    let upstreams: BTreeMap<String, Arc<UpstreamConfig>> = raw
        .upstreams
        .iter()
        .filter_map(|(name, up)| {
            sections::upstream(&mut c, name, up, path).map(|u| (name.clone(), Arc::new(u)))
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
    route::shared_endpoints(&mut c, &routes);
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
        return Err(ConfigErrors(c.errors));
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
        named_read: Vec::new(),
    })
}

/// A file TOML cannot read into the config's shape: its first error, with its place named as
/// the other errors name theirs (the route, the limit entry, the key) and, for a header, what
/// would do.
fn shape_error(
    source: &str,
    e: &toml::de::Error,
) -> (Option<std::ops::Range<usize>>, Option<String>, String) {
    let message = past_i64(e.message().trim());
    let Some(span) = e.span() else {
        return (None, None, message);
    };
    // A date where a number or a string belongs: TOML hands it on as a table.
    let date = (source.get(span.clone()))
        .is_some_and(|t| t.trim().parse::<toml::value::Datetime>().is_ok());
    let message = match date {
        true => message.replacen("invalid type: map", "invalid type: a date-time", 1),
        false => message,
    };
    let place::Place { route, mut field } = place::place_at(source, span.start);
    // An error in a header (a table written twice or in the wrong form, a syntax error, an
    // unknown table) is said by the header; a field missing from a table with a header points
    // at the header and is named by that table.
    if place::on_a_header(source, span.start) && !message.starts_with("missing field") {
        if let Some((at, about)) = about_a_header(source, span.start, &message) {
            let route = match &at {
                Some(at) => place::place_at(source, at.start).route,
                None => route,
            };
            return (Some(at.unwrap_or(span)), route, about);
        }
        field = header_above(source, span.start, route.is_some());
    }
    // TOML's own message names no field ("invalid type: string, expected i64"): the place it
    // points into does. A key written twice is not in TOML's reading of the file: it is
    // named as it is written there.
    let message = missing_field(&message, field.as_deref());
    let message = if message == "duplicate key" {
        let key = place::key_written(source, span.clone());
        let field = [field.as_deref().unwrap_or(""), key.as_str()]
            .into_iter()
            .filter(|p| !p.is_empty())
            .collect::<Vec<_>>()
            .join(".");
        format!("{field}: duplicate key: a key is written twice here (or a table in two places): keep one")
    } else {
        match field {
            Some(field) => format!("{field}: {message}"),
            None => message,
        }
    };
    (Some(span), route, message)
}

/// For an error on a header's key (an unknown table: `[auth.oauth]`), the table above that
/// key, as a field (inside a route, from the route on); `None` at the top level.
fn header_above(source: &str, offset: usize, in_route: bool) -> Option<String> {
    let line_start = source[..offset.min(source.len())]
        .rfind('\n')
        .map_or(0, |i| i + 1);
    let line = source[line_start..].lines().next().unwrap_or_default();
    let parts = header_parts(line)?;
    let key = (parts.iter()).position(|(_, at)| at.contains(&(offset - line_start)))?;
    let above = match (in_route, parts.first()) {
        (true, Some((first, _))) if first == "routes" => &parts[1.min(key)..key],
        _ => &parts[..key],
    };
    (!above.is_empty()).then(|| shown(above))
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

/// TOML's words for an integer it cannot hold (``invalid type: integer `N` as i128,
/// expected i64``), said as what is wrong and what would do.
fn past_i64(message: &str) -> String {
    // Past u64 TOML says `invalid type: integer `N` as i128`; from 2^63 to 2^64 - 1 it reads
    // the number and the field refuses it: `invalid value: integer `N`, expected i64`.
    let too_big = (message.strip_prefix("invalid type: integer `"))
        .and_then(|rest| rest.split_once('`'))
        .filter(|(_, tail)| tail.contains("as i128"))
        .or_else(|| {
            (message.strip_prefix("invalid value: integer `"))
                .and_then(|rest| rest.split_once('`'))
                .filter(|(n, _)| n.parse::<u64>().is_ok_and(|n| n > i64::MAX as u64))
        });
    match too_big {
        Some((number, _)) => format!(
            "{number} is out of range: no field takes an integer past {} (each field's range is in docs/configuration.md)",
            i64::MAX
        ),
        None => in_words(message),
    }
}

/// The deserializer's type names in words: "expected i64" says what a Rust programmer reads.
fn in_words(message: &str) -> String {
    let mut out = message.to_owned();
    for (rust, words) in [
        (
            "expected i64",
            "expected an integer (underscores allowed: 5_000_000)",
        ),
        (
            "expected u64",
            "expected a whole number (underscores allowed: 5_000_000)",
        ),
        ("expected u32", "expected a whole number"),
        ("expected u16", "expected a whole number"),
        ("expected usize", "expected a whole number"),
        ("expected f64", "expected a number"),
    ] {
        if let Some(at) = out.find(rust) {
            // Not a longer name that starts the same (`expected u64` in `expected u640`).
            let end = at + rust.len();
            if !out[end..].starts_with(|c: char| c.is_ascii_alphanumeric()) {
                out.replace_range(at..end, words);
            }
        }
    }
    // A table of the file where another value is written: `expected struct RawUpstream`.
    if let Some(at) = out.find("expected struct Raw") {
        let end = (out[at + "expected struct ".len()..].find(|c: char| !c.is_ascii_alphanumeric()))
            .map_or(out.len(), |i| at + "expected struct ".len() + i);
        out.replace_range(at..end, "expected a table");
    }
    out
}

pub(super) fn route_label(index: usize, endpoint_id: &str) -> String {
    format!("routes[{index}] ({endpoint_id})")
}

/// TOML's ``missing field `x` `` said as what is missing (the caller names where: `place`)
/// and a line that would give it; other messages as they are.
fn missing_field(message: &str, place: Option<&str>) -> String {
    let Some(field) = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.strip_suffix('`'))
    else {
        return message.to_owned();
    };
    let example = match field {
        "addrs" => "addrs = [\"host:port\"]",
        "endpoint_id" => "endpoint_id = \"a.name\"",
        "upstream" => "upstream = \"<a name of an [upstreams.NAME] table>\"",
        "listen" => "listen = \"0.0.0.0:8443\"",
        "cert_path" => "cert_path = \"tls/cert.pem\"",
        "key_path" => "key_path = \"tls/cert.key\"",
        "server_names" => "server_names = [\"api.example.com\"]",
        "file" => "file = \"keys.toml\"",
        "header" => "header = \"X-API-Key\"",
        "name" => "name = \"burst\"",
        // A limit entry's algorithm cannot be "none" (a route's can).
        "algorithm" if place.is_some_and(|p| p.contains("limits[")) => {
            "algorithm = \"token_bucket\" (or \"sliding_window\")"
        }
        "algorithm" => "algorithm = \"token_bucket\" (or \"sliding_window\", \"none\")",
        _ => "",
    };
    if example.is_empty() {
        format!("`{field}` is missing: it is required (docs/configuration.md)")
    } else {
        format!("`{field}` is missing: it is required, e.g. {example}")
    }
}

/// The table a header line names (`[x]` or `[[x]]`), as TOML reads it (`[[ routes .
/// "limits" ]]` is `routes.limits`, `[upstreams."my app"]` is `upstreams."my app"`,
/// `[["routes.limits"]]` is `"routes.limits"`); `None` for another line or a header TOML
/// cannot read (TOML's own error names that).
fn header_name(line: &str) -> Option<String> {
    header_parts(line).map(|parts| shown(&parts))
}

/// Keys as a message names them, joined: `upstreams."my app"`.
fn shown<K: AsRef<str>>(keys: &[(K, std::ops::Range<usize>)]) -> String {
    let keys: Vec<String> = keys
        .iter()
        .map(|(k, _)| place::key_shown(k.as_ref()))
        .collect();
    keys.join(".")
}

/// A header line's keys as TOML reads them, each with where it is in `line`.
fn header_parts(line: &str) -> Option<Vec<(String, std::ops::Range<usize>)>> {
    let header = line.trim_start_matches('\u{feff}').trim_start();
    let skipped = line.len() - header.len();
    if !header.starts_with('[') {
        return None;
    }
    let document = toml::de::DeTable::parse(header.trim_end()).ok()?;
    let (mut table, mut parts) = (document.get_ref(), Vec::new());
    // One key a level, down to the header's own (empty) table.
    while let Some((key, value)) = table.iter().next() {
        let at = key.span();
        parts.push((
            key.get_ref().to_string(),
            at.start + skipped..at.end + skipped,
        ));
        table = match value.get_ref() {
            toml::de::DeValue::Table(t) => t,
            toml::de::DeValue::Array(entries) => match entries.iter().next().map(|e| e.get_ref()) {
                Some(toml::de::DeValue::Table(t)) => t,
                _ => break,
            },
            _ => break,
        };
    }
    (!parts.is_empty()).then_some(parts)
}

/// Whether the file's table `name` is a list of tables (`[[routes]]`, `[[routes.limits]]`,
/// `[[server.tls]]`): by the config's shape.
fn is_a_list(name: &str) -> bool {
    name == "routes" || name.ends_with(".limits") || name.starts_with("server.tls")
}

/// The tables an entry of the list of tables `list` may have, written with headers after
/// its `[[list]]` (`[[routes.limits]]` after `[[routes]]`).
fn tables_of_an_entry(list: &str) -> &'static [&'static str] {
    match list {
        "routes" => &[
            "limits",
            "tiers",
            "cost_from_response",
            "identity",
            "tier_from",
        ],
        "server.tls" => &["sni"],
        _ => &[],
    }
}

/// TOML's words for an error in a table's header (the line `offset` is on), which name
/// neither the table nor what would do: a table written twice, `[routes]` for `[[routes]]`,
/// `[[upstreams]]` for `[upstreams.NAME]`, a header that a table written before it (or an
/// inline list) makes wrong. Where to point, when it is not the error's own place, and what
/// to say; `None` for an error elsewhere.
fn about_a_header(
    source: &str,
    offset: usize,
    message: &str,
) -> Option<(Option<std::ops::Range<usize>>, String)> {
    let offset = offset.min(source.len());
    let line_start = source[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line = source[line_start..].lines().next().unwrap_or_default();
    let header = line.split('#').next().unwrap_or_default().trim();
    let parts = header_parts(line)?;
    // The table TOML's error is about: the header's own, or one above it that the header
    // makes (`[routes.limits.0]` makes `routes.limits` a table).
    let about = (parts.iter())
        .position(|(_, at)| at.contains(&(offset - line_start)))
        .map_or(parts.len(), |i| i + 1);
    let whole = about == parts.len();
    let name = shown(&parts[..about]);
    let name = name.as_str();
    let list = header.starts_with("[[");
    let listed = |name: &str| format!("[[{name}]] (one per entry)");
    let named = |name: &str| match name {
        "upstreams" => "[upstreams.NAME] (one table per upstream, by its name)".to_owned(),
        n => format!("[{n}]"),
    };
    let taken = message.ends_with("duplicate key")
        || message.starts_with("invalid type: map, expected a sequence")
        || message.starts_with("cannot extend value of type array");
    if taken {
        if let Some(said) = made_before(source, &parts[..about], line_start + line.len()) {
            return Some(said);
        }
    }
    // Written both ways: `[[routes]]`, then `[routes]` for a later one (or the reverse).
    let other_form = source.lines().any(|l| {
        let l = l.trim_start();
        header_name(l).as_deref() == Some(name) && l.starts_with("[[") != list
    });
    // A message about a table above this one (`[[server.tls.sni]]` with no `[[server.tls]]`)
    // is left as TOML's own: the header's own form is not what is wrong.
    Some((
        None,
        if message.ends_with("duplicate key") && other_form {
            if is_a_list(name) {
                format!("{name} is written both as [{name}] and as [[{name}]]: it is a list of tables, each entry written {}", listed(name))
            } else {
                format!("{name} is written both as [{name}] and as [[{name}]]: it is one table, written {} once", named(name))
            }
        } else if message.ends_with("duplicate key") {
            format!("{header} is written twice: give each table once (merge their keys into one)")
        } else if message.starts_with("invalid type: map, expected a sequence") && !whole {
            format!(
            "{header} makes {name} one table where it is a list of tables: write {}, and the entry's fields in it",
            listed(name)
        )
        } else if message.starts_with("invalid type: map, expected a sequence") && !list {
            format!(
                "{header} is one table where {name} is a list of tables: write {}",
                listed(name)
            )
        } else if message.starts_with("invalid type: sequence, expected a map") && list {
            format!(
                "{header} is a list of tables where {name} is one table: write {}",
                named(name)
            )
        } else {
            return None;
        },
    ))
}

/// What, written before `end`, makes the table `keys` (a header's, or one above it) what a
/// header cannot be: a list written inline (`routes = [{ ... }]`, then `[[routes]]`), or, for a
/// list of tables, a header under it before any of its entries (`[routes.tiers.x]` before
/// `[[routes]]`: it belongs to no entry; `[routes.limits.burst]`, which makes the list one
/// table). Where it is, and what to say.
fn made_before(
    source: &str,
    keys: &[(String, std::ops::Range<usize>)],
    end: usize,
) -> Option<(Option<std::ops::Range<usize>>, String)> {
    let (root, _) = toml::de::DeTable::parse_recoverable(source);
    // The longest run of `keys` that is a list written inline.
    let mut table = root.get_ref();
    for n in 1..=keys.len() {
        let Some((_, value)) = table.iter().find(|(k, _)| k.get_ref() == &keys[n - 1].0) else {
            break;
        };
        match value.get_ref() {
            toml::de::DeValue::Array(entries) => {
                let by_headers = (entries.iter().next()).is_some_and(|e| {
                    source
                        .get(e.span().start..)
                        .is_some_and(|t| t.starts_with("[["))
                });
                if !by_headers {
                    let list = shown(&keys[..n]);
                    let line = super::error::line_col(source, value.span().start).0;
                    return Some((None, format!("{list} is written as an inline list (line {line}), which a header cannot add to: write its entries one way, all inline or each as [[{list}]] with its tables after it")));
                }
                break;
            }
            toml::de::DeValue::Table(t) => table = t,
            _ => break,
        }
    }
    let list = shown(keys);
    if !is_a_list(&list) {
        return None;
    }
    // The entry of the list above it that this list's entries belong to starts anew at each
    // of its headers (`[[routes]]` for `routes.limits`).
    let above = (1..keys.len())
        .rev()
        .map(|n| shown(&keys[..n]))
        .find(|n| is_a_list(n));
    let mut first = None;
    let mut at = 0;
    for line in source[..end.min(source.len())].split_inclusive('\n') {
        let here = at..at + line.trim_end().len();
        at += line.len();
        let Some(parts) = header_parts(line) else {
            continue;
        };
        let name = shown(&parts);
        let is_list = line
            .trim_start()
            .trim_start_matches('\u{feff}')
            .starts_with("[[");
        // An entry of the list: what came before it belongs to no entry.
        if is_list && name == list {
            break;
        }
        if is_list && above.as_deref() == Some(name.as_str()) {
            first = None;
        } else if first.is_none()
            && parts.len() > keys.len()
            && name.starts_with(&format!("{list}."))
        {
            let start = here.start + line.len() - line.trim_start().len();
            first = Some((start..here.end, parts, line.trim().to_owned()));
        }
    }
    let (at, parts, header) = first?;
    let header = header
        .split('#')
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned();
    Some((
        Some(at),
        if tables_of_an_entry(&list).contains(&parts[keys.len()].0.as_str()) {
            format!("{header} comes before any [[{list}]]: write it after the [[{list}]] of the entry it belongs to")
        } else {
            format!("{header} makes {list} one table where it is a list of tables: write [[{list}]] (one per entry), and the entry's fields in it")
        },
    ))
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
