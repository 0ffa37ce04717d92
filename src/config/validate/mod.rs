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
        Err(e)
            if (e.message().contains("duplicate key")
                || e.message()
                    .starts_with("invalid type: map, expected a sequence"))
                && limits_before_any_route(source).is_some() =>
        {
            let at = limits_before_any_route(source);
            c.push(at.as_ref(), None, "[[routes.limits]] comes before any [[routes]]: a limit is written after the [[routes]] of the route it belongs to".into());
            return Err(ConfigErrors(c.errors));
        }
        Err(e) => {
            let message = past_i64(e.message().trim());
            let place = e.span().map(|s| place::place_at(source, s.start));
            let (route, mut field) = place.map_or((None, None), |p| (p.route, p.field));
            // An error in a header (a table written twice or in the wrong form, a syntax
            // error) is said by the header; a field missing from a table with a header points
            // at the header and is named by that table.
            let on_a_header = e
                .span()
                .is_some_and(|s| place::on_a_header(source, s.start));
            if on_a_header && !message.starts_with("missing field") {
                field = None;
                if let Some(about) =
                    about_a_header(source, e.span().unwrap_or_default().start, &message)
                {
                    c.push(e.span().as_ref(), route.as_deref(), about);
                    return Err(ConfigErrors(c.errors));
                }
            }
            // TOML's own message names no field ("invalid type: string, expected i64"): the
            // place it points into does. A key written twice is not in TOML's reading of
            // the file: it is named as written, at the error.
            let message = missing_field(&message);
            let message = match (message == "duplicate key", e.span()) {
                (true, Some(span)) => {
                    let key = source.get(span).unwrap_or_default().trim();
                    let field = [field.as_deref().unwrap_or(""), key]
                        .into_iter()
                        .filter(|p| !p.is_empty())
                        .collect::<Vec<_>>()
                        .join(".");
                    format!("{field}: duplicate key: a key is written twice here (or a table in two places): keep one")
                }
                _ => match field {
                    Some(field) => format!("{field}: {message}"),
                    None => message,
                },
            };
            c.push(e.span().as_ref(), route.as_deref(), message);
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
    let too_big = message
        .strip_prefix("invalid type: integer `")
        .and_then(|rest| rest.split_once('`'))
        .filter(|(_, tail)| tail.contains("as i128"));
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
    out
}

pub(super) fn route_label(index: usize, endpoint_id: &str) -> String {
    format!("routes[{index}] ({endpoint_id})")
}

/// TOML's ``missing field `x` `` said as what is missing (the caller names where) and a line
/// that would give it; other messages as they are.
fn missing_field(message: &str) -> String {
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
    let parts = header_parts(line)?;
    Some(
        parts
            .into_iter()
            .map(|(part, _)| part)
            .collect::<Vec<_>>()
            .join("."),
    )
}

/// A header line's keys, each as TOML writes it and where it is in `line`.
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
            place::key_shown(key.get_ref()),
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

/// Whether `line` is the header of an entry of the list of tables `name` (`[[routes]]`).
fn is_entry_of(line: &str, name: &str) -> bool {
    let line = line.trim_start_matches('\u{feff}').trim_start();
    line.starts_with("[[") && header_name(line).as_deref() == Some(name)
}

/// The byte range of a `[[routes.limits]]` header written before any `[[routes]]`: the
/// limit belongs to no route (TOML then says `[[routes]]` is written twice, or that
/// `routes` is no list).
fn limits_before_any_route(source: &str) -> Option<std::ops::Range<usize>> {
    let mut offset = 0;
    for line in source.split_inclusive('\n') {
        if header_name(line).as_deref() == Some("routes") {
            return None;
        }
        if is_entry_of(line, "routes.limits") {
            let start = offset + line.len() - line.trim_start().len();
            return Some(start..offset + line.trim_end().len());
        }
        offset += line.len();
    }
    None
}

/// Whether the file's table `name` is a list of tables (`[[routes]]`, `[[routes.limits]]`,
/// `[[server.tls]]`): by the config's shape.
fn is_a_list(name: &str) -> bool {
    name == "routes" || name.ends_with(".limits") || name.starts_with("server.tls")
}

/// TOML's words for an error in a table's header (the line `offset` is on), which name
/// neither the table nor what would do: a table written twice, `[routes]` for `[[routes]]`,
/// `[[upstreams]]` for `[upstreams.NAME]`. `None` for an error elsewhere.
fn about_a_header(source: &str, offset: usize, message: &str) -> Option<String> {
    let offset = offset.min(source.len());
    let line_start = source[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line = source[line_start..].lines().next().unwrap_or_default();
    let header = line.split('#').next().unwrap_or_default().trim();
    if !header.starts_with('[') {
        return None;
    }
    let parts = header_parts(line)?;
    // The table TOML's error is about: the header's own, or one above it that the header
    // makes (`[routes.limits.0]` makes `routes.limits` a table).
    let about = (parts.iter())
        .position(|(_, at)| at.contains(&(offset - line_start)))
        .map_or(parts.len(), |i| i + 1);
    let whole = about == parts.len();
    let name = (parts[..about].iter())
        .map(|(part, _)| part.as_str())
        .collect::<Vec<_>>()
        .join(".");
    let name = name.as_str();
    let list = header.starts_with("[[");
    let listed = |name: &str| format!("[[{name}]] (one per entry)");
    let named = |name: &str| match name {
        "upstreams" => "[upstreams.NAME] (one table per upstream, by its name)".to_owned(),
        n => format!("[{n}]"),
    };
    // Written both ways: `[[routes]]`, then `[routes]` for a later one (or the reverse).
    let other_form = source.lines().any(|l| {
        let l = l.trim_start();
        header_name(l).as_deref() == Some(name) && l.starts_with("[[") != list
    });
    // A message about a table above this one (`[[server.tls.sni]]` with no `[[server.tls]]`)
    // is left as TOML's own: the header's own form is not what is wrong.
    Some(if message.ends_with("duplicate key") && other_form {
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
    })
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
