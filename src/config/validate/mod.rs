//! Raw config -> domain config. Every problem is collected, never just the first.
//!
//! `sections.rs` checks `[server]`, `[redis]`, `[breaker]`, `[auth.jwt]` and `[upstreams]`;
//! `route.rs` checks each `[[routes]]` entry and the rules between routes.

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
            let route = e.span().and_then(|s| route_at(source, s.start));
            let message = past_i64(e.message().trim());
            // TOML's own message names no field ("invalid type: string, expected i64"): the
            // table and key the error points into do (an inline table's key, for a field
            // missing inside it); a field missing from a table with a header is named by
            // that table.
            let field = e.span().and_then(|s| field_at(source, s.start, &message));
            let message = match (e.span(), &field) {
                (Some(span), None) => missing_field(source, span.start, route.is_some(), &message),
                (_, Some(_)) => missing_field_of(None, &message),
                (None, None) => message,
            };
            let message = match field {
                Some(field) if message == "duplicate key" => format!(
                    "{field}: duplicate key: a key is written twice here (or a table in two places): keep one"
                ),
                Some(field) => format!("{field}: {message}"),
                None => message,
            };
            let message = e
                .span()
                .and_then(|s| about_a_header(source, s.start, &message))
                .unwrap_or(message);
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

/// Names the route whose table holds byte `offset`, for parse errors inside a route.
fn route_at(source: &str, offset: usize) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Loose {
        #[serde(default)]
        routes: Vec<Spanned<toml::Table>>,
    }
    let loose: Option<Loose> = toml::from_str(source).ok();
    let mut header_starts = Vec::new();
    let mut at = 0;
    for line in source.split_inclusive('\n') {
        if is_entry_of(line, "routes") {
            header_starts.push(at);
        }
        at += line.len();
    }
    let index = header_starts.iter().rposition(|&start| start <= offset)?;
    // A table after the last route (`[breaker]`, `[upstreams.x]`) is not that route's; an
    // error may point at the table's header itself (a missing field).
    if table_at(source, offset).is_some_and(|t| t != "routes" && !t.starts_with("routes.")) {
        return None;
    }
    // A file TOML cannot read at all (a duplicate key, an integer past i64) is read by line.
    let id = match loose {
        Some(loose) => loose
            .routes
            .get(index)
            .and_then(|t| t.get_ref().get("endpoint_id")?.as_str().map(str::to_owned)),
        None => {
            let end = header_starts
                .get(index + 1)
                .copied()
                .unwrap_or(source.len());
            endpoint_id_in(&source[header_starts[index]..end])
        }
    }
    .unwrap_or_else(|| "?".to_owned());
    Some(route_label(index, &id))
}

/// TOML's ``missing field `x` `` (it points at the table's header): which table lacks it,
/// and what a line giving it looks like. Other messages are returned as they are.
fn missing_field(source: &str, offset: usize, in_route: bool, message: &str) -> String {
    let table = table_at(source, offset).unwrap_or_default();
    // A route's own fields are named by the route label; its sub-tables by their name.
    // The error may point at the entry's header: its place counts that header.
    let next_line = source[offset.min(source.len())..]
        .find('\n')
        .map_or(source.len(), |i| offset + i + 1);
    let table = match table.as_str() {
        "routes" if in_route => String::new(),
        "routes.limits" if in_route => limit_at(source, next_line),
        t if in_route => t.strip_prefix("routes.").unwrap_or(t).to_owned(),
        t => t.to_owned(),
    };
    missing_field_of(Some(&table), message)
}

/// ``missing field `x` `` said as what is missing from `table` (none: the caller names
/// where) and a line that would give it; other messages as they are.
fn missing_field_of(table: Option<&str>, message: &str) -> String {
    let Some(field) = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.strip_suffix('`'))
    else {
        return message.to_owned();
    };
    let table = table.unwrap_or("");
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
    let needs = if table.is_empty() {
        format!("`{field}` is missing")
    } else {
        format!("{table}: `{field}` is missing")
    };
    if example.is_empty() {
        format!("{needs}: it is required (docs/configuration.md)")
    } else {
        format!("{needs}: it is required, e.g. {example}")
    }
}

/// The `endpoint_id = "..."` line of one route's text, read without a TOML parser.
fn endpoint_id_in(route: &str) -> Option<String> {
    route.lines().find_map(|l| {
        let (key, value) = l.split_once('=')?;
        (key.trim() == "endpoint_id").then(|| {
            let value = value.trim();
            let value = value.split('#').next().unwrap_or(value).trim();
            value.trim_matches('"').trim_matches('\'').to_owned()
        })
    })
}

/// The table of byte `offset`: the header on its line, else the last one before it.
fn table_at(source: &str, offset: usize) -> Option<String> {
    let offset = offset.min(source.len());
    let line_end = source[offset..]
        .find('\n')
        .map_or(source.len(), |i| offset + i);
    table_header_before(source, line_end)
}

/// The name of the table whose header is the last one at or before byte `offset`
/// (`breaker`, `upstreams.app`, `routes`, `routes.limits`), as TOML reads it (`[[ routes .
/// "limits" ]]` is `routes.limits`); `None` at the top level.
fn table_header_before(source: &str, offset: usize) -> Option<String> {
    source[..offset.min(source.len())]
        .lines()
        .rev()
        .find_map(header_name)
}

/// The table a header line names (`[x]` or `[[x]]`), as TOML reads its dotted key: spaces
/// around its parts left out, a part quoted only when it must be (`[[ routes . "limits" ]]`
/// is `routes.limits`, `[upstreams."my app"]` is `upstreams."my app"`, `[["routes.limits"]]`
/// is `"routes.limits"`); `None` for another line.
fn header_name(line: &str) -> Option<String> {
    let line = line.trim_start_matches('\u{feff}').trim_start();
    let inner = line.strip_prefix('[')?;
    let (inner, close) = match inner.strip_prefix('[') {
        Some(inner) => (inner, "]]"),
        None => (inner, "]"),
    };
    let (mut parts, mut part, mut quote) = (Vec::new(), String::new(), None);
    let mut closed = false;
    for (i, c) in inner.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => part.push(c),
            (None, '"' | '\'') => quote = Some(c),
            (None, '.') => parts.push(std::mem::take(&mut part)),
            (None, ']') => {
                // A header not closed as it opened (`[[routes]`) is TOML's error to name.
                closed = inner[i..].starts_with(close);
                break;
            }
            (None, c) if c.is_whitespace() => {}
            (None, c) => part.push(c),
        }
    }
    if !closed {
        return None;
    }
    parts.push(part);
    let bare = |p: &str| {
        !p.is_empty()
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    };
    let shown: Vec<String> = (parts.iter())
        .map(|p| match bare(p) {
            true => p.clone(),
            false => format!("{p:?}"),
        })
        .collect();
    Some(shown.join("."))
}

/// Whether `line` is the header of an entry of the list of tables `name` (`[[routes]]`).
fn is_entry_of(line: &str, name: &str) -> bool {
    let line = line.trim_start_matches('\u{feff}').trim_start();
    line.starts_with("[[") && header_name(line).as_deref() == Some(name)
}

/// The field a parse error at byte `offset` is about, as the other errors name it: the
/// table's path (inside a route, from the route on: `limits[1] (day)`) and, when the error
/// is in a value, its key (`breaker.failure_threshold`). `None` when there is nothing to name.
fn field_at(source: &str, offset: usize, message: &str) -> Option<String> {
    let offset = offset.min(source.len());
    let line_start = source[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line_end = source[offset..]
        .find('\n')
        .map_or(source.len(), |i| offset + i);
    let line = &source[line_start..line_end];
    if line.trim_start().starts_with('[') {
        // A table header itself (a syntax error in it): the message says all there is.
        return None;
    }
    // A line of a list of inline tables written over several lines: the list's key above.
    let owner = (line.trim_start().starts_with('{'))
        .then(|| list_owner(source, line_start))
        .flatten();
    let key = match (owner, line.find('=')) {
        (Some((_, key)), _) => Some(key),
        // The error is in the value: name its key (a quoted key keeps its quotes); a key
        // written twice is named too.
        (None, Some(eq)) if line_start + eq < offset || message.contains("duplicate key") => {
            Some(line[..eq].trim())
        }
        _ => None,
    };
    let table = table_header_before(source, line_start).unwrap_or_default();
    // A route's limits written inline (`limits = [{ ... }, { ... }]`): the entry, named.
    let unquoted = key.map(|k| k.trim_matches(|c| c == '"' || c == '\''));
    let inline = match (table.as_str(), unquoted) {
        ("routes", Some("limits")) => {
            let from = owner.map_or(line_start, |(start, _)| start);
            inline_limit_at(&source[from..line_end], offset - from)
        }
        _ => None,
    };
    let key = inline.as_deref().or(key);
    let table = match table.as_str() {
        "routes" => String::new(),
        "routes.limits" => limit_at(source, line_start),
        t => t.strip_prefix("routes.").unwrap_or(t).to_owned(),
    };
    let path: Vec<&str> = [table.as_str(), key.unwrap_or("")]
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect();
    (!path.is_empty()).then(|| path.join("."))
}

/// The `[[routes.limits]]` entry the line at `line_start` is in, as the other errors name
/// it: `limits[1] (burst)`, its place in its route and its name when the entry gives one;
/// `limits` when no such entry of the route comes before the line.
fn limit_at(source: &str, line_start: usize) -> String {
    let mut index = 0usize;
    let mut entry_start = None;
    let mut offset = 0;
    for line in source[..line_start.min(source.len())].split_inclusive('\n') {
        if is_entry_of(line, "routes") {
            (index, entry_start) = (0, None);
        } else if is_entry_of(line, "routes.limits") {
            index += 1;
            entry_start = Some(offset + line.len());
        }
        offset += line.len();
    }
    let Some(entry_start) = entry_start else {
        return "limits".into();
    };
    // Its `name`, read as TOML reads it (any string form, a quoted key).
    let name = source[entry_start..]
        .lines()
        .take_while(|l| header_name(l).is_none())
        .filter_map(|l| toml::from_str::<toml::Table>(l).ok())
        .find_map(|t| t.get("name")?.as_str().map(str::to_owned));
    let place = format!("limits[{}]", index - 1);
    match name {
        Some(name) => format!("{place} ({name})"),
        None => place,
    }
}

/// For a line of a list written over several lines, the line above that opens it (`limits =
/// [`): its start and its key. `None` when a table's header comes first.
fn list_owner(source: &str, line_start: usize) -> Option<(usize, &str)> {
    let mut end = line_start.checked_sub(1)?;
    loop {
        let start = source[..end].rfind('\n').map_or(0, |i| i + 1);
        let line = &source[start..end];
        let trimmed = line.trim_start();
        if header_name(line).is_some() {
            return None;
        }
        // The list's other entries, comments and blank lines are passed over.
        if !(trimmed.starts_with('{') || trimmed.starts_with('#') || trimmed.is_empty()) {
            let eq = line.find('=')?;
            let opens = line[eq + 1..].trim_start().starts_with('[');
            return opens.then(|| (start, line[..eq].trim()));
        }
        end = start.checked_sub(1)?;
    }
}

/// In a list of inline limit tables (`limits = [{ name = "a", ... }, { ... }]`, on one line
/// or several), the entry byte `at` of `text` is in, as the other errors name it:
/// `limits[1] (b)`.
fn inline_limit_at(text: &str, at: usize) -> Option<String> {
    let open = text.find('[')?;
    // Each entry's start, and where `at` is: outside strings, by the braces' depth.
    let (mut depth, mut quote, mut starts) = (0usize, None::<&str>, Vec::new());
    let mut within = None;
    let (mut escaped, mut comment, mut skip) = (false, false, 0);
    for (i, c) in text.char_indices().skip_while(|&(i, _)| i < open) {
        let rest = &text[i..];
        if skip > 0 {
            skip -= 1;
            continue;
        }
        if comment {
            comment = c != '\n';
            continue;
        }
        match quote {
            // A basic string's `\"` is no end; a triple quote ends only at its like.
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if c == '\\' && q.starts_with('"') {
                    escaped = true;
                } else if rest.starts_with(q) {
                    (quote, skip) = (None, q.len() - 1);
                }
                continue;
            }
            None if rest.starts_with("\"\"\"") || rest.starts_with("'''") => {
                (quote, skip) = (Some(&rest[..3]), 2);
                continue;
            }
            None => {}
        }
        match c {
            '#' => comment = true,
            '"' | '\'' => quote = Some(&rest[..1]),
            '{' => {
                if depth == 0 {
                    starts.push(i);
                }
                depth += 1;
            }
            '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 && i >= at && within.is_none() && !starts.is_empty() {
                    within = Some((starts.len() - 1, starts[starts.len() - 1]..=i));
                }
            }
            _ => {}
        }
    }
    let (index, entry) = within?;
    let name = toml::from_str::<toml::Table>(&format!("entry = {}", &text[entry]))
        .ok()
        .and_then(|t| t.get("entry")?.get("name")?.as_str().map(str::to_owned));
    Some(match name {
        Some(name) => format!("limits[{index}] ({name})"),
        None => format!("limits[{index}]"),
    })
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
    let name = header_name(header)?;
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
