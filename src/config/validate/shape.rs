//! A file TOML cannot read into the config's shape: its first error, said as the config's
//! other errors are (file, line and column, route, field), with what would do.
//!
//! TOML's own messages name no table or key ("invalid type: string, expected i64"). A
//! best-effort parse of the file keeps each key's and value's span, and each table header's;
//! the innermost table, list entry and key holding the error's offset name it, from the
//! route on (`routes[1] (b.second)`, then `limits[0] (burst).capacity_micro`) or from the top
//! level (`upstreams."my app".addrs`), however the file spells its headers, keys, quotes and
//! inline tables (one line or several). An error in a header is said by what is wrong with
//! the header: a table written twice or both ways, a list of tables written as one table, a
//! table under a list written before the list's first entry.

use std::ops::Range;

use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::route_label;

/// Where an error's offset lies.
pub(super) struct Place {
    /// The route's label when the offset is inside a route: `routes[1] (b.second)`.
    pub route: Option<String>,
    /// From the route (or the top level) to the innermost table, list entry or key holding
    /// the offset: `limits[0] (burst).capacity_micro`; `None` for a route's own table and
    /// the top level.
    pub field: Option<String>,
    /// The offset is in a value (or just past one on its line), not on a key or a header.
    pub in_value: bool,
}

/// One step of a place: a key, or an entry of a list (with its table, for its name).
#[derive(Clone, Copy)]
enum Step<'a, 'i> {
    Key(&'a str),
    Entry(usize, Option<&'a DeTable<'i>>),
}

/// The place of byte `offset`. An offset on a key (an unknown field) names the key's table:
/// the message names the key.
pub(super) fn place_at(source: &str, offset: usize) -> Place {
    let (root, _) = DeTable::parse_recoverable(source);
    let mut headers = Vec::new();
    tables_with_headers(source, root.get_ref(), &mut Vec::new(), &mut headers);
    headers.sort_by_key(|(start, _, _)| *start);
    // The table whose header is the last one at or before the offset (the top level when
    // none is).
    let region = headers.iter().rev().find(|(start, _, _)| *start <= offset);
    let (mut steps, table) = match region {
        Some((_, steps, table)) => (steps.to_vec(), *table),
        None => (Vec::new(), root.get_ref()),
    };
    let mut found = within(source, table, offset, &mut steps);
    if found == Found::Nothing {
        // An error just past a value on its line (an unclosed string, `5 000`): that key's.
        let line = line_of(source, offset);
        let before = (table.iter())
            .filter(|(k, _)| line.contains(&k.span().start) && k.span().start < offset)
            .max_by_key(|(k, _)| k.span().start);
        if let Some((key, _)) = before {
            steps.push(Step::Key(key.get_ref().as_ref()));
            found = Found::Value;
        }
    }
    let mut place = said(&steps);
    place.in_value = found == Found::Value;
    place
}

/// How a table or a list is written.
#[derive(PartialEq)]
enum Form {
    /// `[x]`, or a list of `[[x]]` entries.
    Headers,
    /// `{ ... }`, or `[ ... ]`.
    Inline,
    /// Made by a dotted key (`a.b = 1`) or a longer header (`[a.b]` makes `a`).
    Dotted,
}

fn form(source: &str, value: &Spanned<DeValue>) -> Form {
    let at = value.span().start;
    match value.get_ref() {
        DeValue::Table(_) if starts_with(source, at, "{") => Form::Inline,
        DeValue::Table(_) if starts_with(source, at, "[") => Form::Headers,
        DeValue::Table(_) => Form::Dotted,
        DeValue::Array(entries) => match entries.iter().next() {
            Some(e)
                if matches!(e.get_ref(), DeValue::Table(_))
                    && starts_with(source, e.span().start, "[[") =>
            {
                Form::Headers
            }
            _ => Form::Inline,
        },
        _ => Form::Inline,
    }
}

/// Every table written with a header (`[x]`, each entry of `[[x]]`), with its header's start
/// and its steps from the top. A header TOML could only take in part (`[[routes.limits]`
/// unclosed: its table is taken up to the next header's end, named by that header's keys)
/// is none.
fn tables_with_headers<'a, 'i>(
    source: &str,
    table: &'a DeTable<'i>,
    steps: &mut Vec<Step<'a, 'i>>,
    out: &mut Vec<(usize, Vec<Step<'a, 'i>>, &'a DeTable<'i>)>,
) {
    let whole = |span: Range<usize>| source.get(span).is_some_and(|h| !h.contains('\n'));
    for (key, value) in table.iter() {
        steps.push(Step::Key(key.get_ref().as_ref()));
        match (value.get_ref(), form(source, value)) {
            (DeValue::Table(_), Form::Inline) => {}
            (DeValue::Table(t), form) => {
                if form == Form::Headers && whole(value.span()) {
                    out.push((value.span().start, steps.to_vec(), t));
                }
                tables_with_headers(source, t, steps, out);
            }
            (DeValue::Array(entries), Form::Headers) => {
                for (i, entry) in entries.iter().enumerate() {
                    if let DeValue::Table(t) = entry.get_ref() {
                        steps.push(Step::Entry(i, Some(t)));
                        if whole(entry.span()) {
                            out.push((entry.span().start, steps.to_vec(), t));
                        }
                        tables_with_headers(source, t, steps, out);
                        steps.pop();
                    }
                }
            }
            _ => {}
        }
        steps.pop();
    }
}

/// What holds an offset in a table.
#[derive(PartialEq)]
enum Found {
    Nothing,
    /// A key (an unknown field; a dotted key's table: a field missing from it).
    Key,
    /// A value, or something inside one.
    Value,
}

/// Down from `table` to the innermost key, entry or inline table holding `offset`.
fn within<'a, 'i>(
    source: &str,
    table: &'a DeTable<'i>,
    offset: usize,
    steps: &mut Vec<Step<'a, 'i>>,
) -> Found {
    for (key, value) in table.iter() {
        let (k, v) = (key.span(), value.span());
        match (value.get_ref(), form(source, value)) {
            // Another header's table is its own place.
            (_, Form::Headers) => continue,
            // A dotted key's table holds its keys' spans, not its own; an error on the
            // dotted key's own span is the table's (`identity.heder = ...`: unknown field of
            // `identity`; a field missing from it).
            (DeValue::Table(t), Form::Dotted) => {
                steps.push(Step::Key(key.get_ref().as_ref()));
                match within(source, t, offset, steps) {
                    Found::Nothing if k.contains(&offset) => return Found::Key,
                    Found::Nothing => {}
                    found => return found,
                }
                steps.pop();
                continue;
            }
            _ => {}
        }
        if k.contains(&offset) {
            // On the key itself (an unknown field): its table is the place.
            return Found::Key;
        }
        if !holds(v, offset) {
            continue;
        }
        steps.push(Step::Key(key.get_ref().as_ref()));
        in_value(source, value, offset, steps);
        return Found::Value;
    }
    Found::Nothing
}

/// Into a value holding `offset`: an inline table's key, a list's entry.
fn in_value<'a, 'i>(
    source: &str,
    value: &'a Spanned<DeValue<'i>>,
    offset: usize,
    steps: &mut Vec<Step<'a, 'i>>,
) {
    match value.get_ref() {
        DeValue::Table(t) => {
            within(source, t, offset, steps);
        }
        DeValue::Array(entries) => {
            let at = (entries.iter().enumerate()).find(|(_, e)| holds(e.span(), offset));
            if let Some((i, entry)) = at {
                let table = match entry.get_ref() {
                    DeValue::Table(t) => Some(t),
                    _ => None,
                };
                steps.push(Step::Entry(i, table));
                in_value(source, entry, offset, steps);
            }
        }
        _ => {}
    }
}

/// The steps said as the messages say them.
fn said(steps: &[Step]) -> Place {
    let (route, rest) = match steps {
        [Step::Key("routes"), Step::Entry(i, table), rest @ ..] => {
            let id = table.and_then(|t| string_in(t, "endpoint_id"));
            (Some(route_label(*i, id.unwrap_or("?"))), rest)
        }
        _ => (None, steps),
    };
    let mut field = String::new();
    for step in rest {
        match step {
            Step::Key(key) => {
                if !field.is_empty() {
                    field.push('.');
                }
                field.push_str(&key_shown(key));
            }
            Step::Entry(i, table) => {
                field.push_str(&format!("[{i}]"));
                if let Some(name) = table.and_then(|t| string_in(t, "name")) {
                    field.push_str(&format!(" ({name})"));
                }
            }
        }
    }
    Place {
        route,
        field: (!field.is_empty()).then_some(field),
        in_value: false,
    }
}

/// A key written twice, as TOML reads it (`health_check.path`; `"identity".header` is
/// `identity.header`): the whole dotted key its line writes up to the error's end, else the
/// error's own text.
pub(super) fn key_written(source: &str, span: Range<usize>) -> String {
    let line = line_of(source, span.start);
    let as_key = |text: &str| {
        let assignment = format!("{text} = 0");
        let document = DeTable::parse(&assignment).ok()?;
        let (mut table, mut keys) = (document.get_ref(), Vec::new());
        while let Some((key, value)) = table.iter().next() {
            keys.push(key_shown(key.get_ref()));
            match value.get_ref() {
                DeValue::Table(t) => table = t,
                _ => break,
            }
        }
        Some(keys.join("."))
    };
    let own = source.get(span.clone()).unwrap_or_default().trim();
    (source.get(line.start..span.end))
        .and_then(|written| as_key(written.trim_start_matches('\u{feff}').trim_start()))
        .or_else(|| as_key(own))
        .unwrap_or_else(|| own.to_owned())
}

/// A key as TOML writes it: bare when it can be, else quoted (`upstreams."my app"`).
pub(super) fn key_shown(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    match bare {
        true => key.to_owned(),
        false => format!("{key:?}"),
    }
}

fn string_in<'a>(table: &'a DeTable, key: &str) -> Option<&'a str> {
    table
        .iter()
        .find_map(|(k, v)| match (k.get_ref().as_ref(), v.get_ref()) {
            (k, DeValue::String(s)) if k == key => Some(s.as_ref()),
            _ => None,
        })
}

/// Whether a value's span holds `offset` (an empty span: its start).
fn holds(span: Range<usize>, offset: usize) -> bool {
    (span.start..span.end.max(span.start + 1)).contains(&offset)
}

fn starts_with(source: &str, at: usize, text: &str) -> bool {
    source.get(at..).is_some_and(|s| s.starts_with(text))
}

/// Whether `offset` is on a table header's line (`[x]`, `[[x]]`).
pub(super) fn on_a_header(source: &str, offset: usize) -> bool {
    source[line_of(source, offset)]
        .trim_start()
        .starts_with('[')
}

/// The byte range of the line holding `offset`.
fn line_of(source: &str, offset: usize) -> Range<usize> {
    let offset = offset.min(source.len());
    let start = source[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = source[offset..]
        .find('\n')
        .map_or(source.len(), |i| offset + i);
    start..end
}

/// A file TOML cannot read into the config's shape: its first error, with its place named as
/// the other errors name theirs (the route, the limit entry, the key) and, for a header, what
/// would do.
pub(super) fn error(
    source: &str,
    e: &toml::de::Error,
) -> (Option<Range<usize>>, Option<String>, String) {
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
    let place = place_at(source, span.start);
    let (route, mut field) = (place.route, place.field);
    // An error in a header (a table written twice or in the wrong form, a syntax error, an
    // unknown table) is said by the header; a field missing from a table with a header points
    // at the header and is named by that table (or by the one above that the header makes:
    // `[upstreams.app.health_check]` alone makes `upstreams.app`, without its `addrs`).
    let on_a_header = !place.in_value && on_a_header(source, span.start);
    let missing = message.starts_with("missing field");
    if on_a_header && !missing {
        if let Some((at, about)) = about_a_header(source, span.start, &message) {
            let route = match &at {
                Some(at) => place_at(source, at.start).route,
                None => route,
            };
            return (Some(at.unwrap_or(span)), route, about);
        }
        // An unknown table is named by the table above it; any other error by its own.
        let keys = header_key_at(source, span.start, route.is_some());
        field = match (keys, message.starts_with("unknown field")) {
            (Some((above, _, _)), true) => above,
            (Some((_, through, _)), false) => through,
            (None, _) => None,
        };
    } else if on_a_header {
        if let Some((_, through, false)) = header_key_at(source, span.start, route.is_some()) {
            field = through;
        }
    }
    // TOML's own message names no field ("invalid type: string, expected i64"): the place it
    // points into does. A key written twice is not in TOML's reading of the file: it is
    // named as it is written there.
    let message = missing_field(&message, field.as_deref());
    let message = if message == "duplicate key" {
        let key = key_written(source, span.clone());
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

/// For an error on a key of a header's line: the table above that key, the table the key
/// names, and whether the key is the header's last (else the header makes the table above its
/// own: `[upstreams.app.health_check]` makes `upstreams.app`). As fields: inside a route,
/// from the route on; `None` at the top level.
fn header_key_at(
    source: &str,
    offset: usize,
    in_route: bool,
) -> Option<(Option<String>, Option<String>, bool)> {
    let line = line_of(source, offset);
    let parts = header_parts(&source[line.clone()])?;
    let key = (parts.iter()).position(|(_, at)| at.contains(&(offset - line.start)))?;
    let from = match (in_route, parts.first()) {
        (true, Some((first, _))) if first == "routes" => 1.min(key),
        _ => 0,
    };
    let field = |keys: &[(String, Range<usize>)]| (!keys.is_empty()).then(|| shown(keys));
    Some((
        field(&parts[from..key]),
        field(&parts[from..=key]),
        key + 1 == parts.len(),
    ))
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
fn shown<K: AsRef<str>>(keys: &[(K, Range<usize>)]) -> String {
    let keys: Vec<String> = keys.iter().map(|(k, _)| key_shown(k.as_ref())).collect();
    keys.join(".")
}

/// A header line's keys as TOML reads them, each with where it is in `line`.
fn header_parts(line: &str) -> Option<Vec<(String, Range<usize>)>> {
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
) -> Option<(Option<Range<usize>>, String)> {
    let offset = offset.min(source.len());
    let line_start = source[..offset].rfind('\n').map_or(0, |i| i + 1);
    let line = source[line_start..].lines().next().unwrap_or_default();
    let parts = header_parts(line)?;
    // The header as written, to its closing bracket (a quoted key may hold a `#`).
    let last = parts.last().map_or(0, |(_, at)| at.end);
    let close = line[last..].find(']').map_or(line.len(), |i| last + i);
    let close = close
        + if line[close..].starts_with("]]") {
            2
        } else {
            1
        };
    let header = line[..close.min(line.len())]
        .trim_start_matches('\u{feff}')
        .trim();
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
    // A list of tables written as one table, or the reverse, by this header or by one above
    // it that this header makes; any other message is TOML's own.
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
        } else if message.starts_with("invalid type: map, expected a sequence")
            && !whole
            && is_a_list(name)
        {
            format!(
            "{header} makes {name} one table where it is a list of tables: write {}, and the entry's fields in it",
            listed(name)
        )
        } else if message.starts_with("invalid type: map, expected a sequence")
            && !list
            && is_a_list(name)
        {
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
    keys: &[(String, Range<usize>)],
    end: usize,
) -> Option<(Option<Range<usize>>, String)> {
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
                    let line = super::super::error::line_col(source, value.span().start).0;
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
