//! Where a TOML error lies, named as the config's other messages name places.
//!
//! TOML's own messages name no table or key ("invalid type: string, expected i64"). A
//! best-effort parse of the file keeps each key's and value's span, and each table header's;
//! the innermost table, list entry and key holding the error's offset name it, from the
//! route on (`routes[1] (b.second)`, then `limits[0] (burst).capacity_micro`) or from the top
//! level (`upstreams."my app".addrs`), however the file spells its headers, keys, quotes and
//! inline tables (one line or several).

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
    let region = match region {
        Some((_, steps, table)) => (steps.to_vec(), *table),
        None => (Vec::new(), root.get_ref()),
    };
    let (mut steps, table) = region;
    within(source, table, offset, &mut steps);
    said(&steps)
}

/// Every table written with a header (`[x]`, each entry of `[[x]]`), with its header's start
/// and its steps from the top, in the file's order.
fn tables_with_headers<'a, 'i>(
    source: &str,
    table: &'a DeTable<'i>,
    steps: &mut Vec<Step<'a, 'i>>,
    out: &mut Vec<(usize, Vec<Step<'a, 'i>>, &'a DeTable<'i>)>,
) {
    for (key, value) in table.iter() {
        steps.push(Step::Key(key.get_ref().as_ref()));
        let start = value.span().start;
        match value.get_ref() {
            // An inline table holds no header.
            DeValue::Table(_) if starts_with(source, start, "{") => {}
            DeValue::Table(t) => {
                if starts_with(source, start, "[") {
                    out.push((start, steps.to_vec(), t));
                }
                // A header's table, or one made by a dotted key or a longer header.
                tables_with_headers(source, t, steps, out);
            }
            DeValue::Array(entries) => {
                for (i, entry) in entries.iter().enumerate() {
                    let at = entry.span().start;
                    if let (DeValue::Table(t), true) =
                        (entry.get_ref(), starts_with(source, at, "[["))
                    {
                        steps.push(Step::Entry(i, Some(t)));
                        out.push((at, steps.to_vec(), t));
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

/// Down from `table` to the innermost key, entry or inline table holding `offset`.
fn within<'a, 'i>(
    source: &str,
    table: &'a DeTable<'i>,
    offset: usize,
    steps: &mut Vec<Step<'a, 'i>>,
) -> bool {
    for (key, value) in table.iter() {
        let (k, v) = (key.span(), value.span());
        match value.get_ref() {
            // Another header's table is its own place; a dotted key's table (`a.b = 1`) holds
            // its keys' spans, not its own.
            DeValue::Table(_) if starts_with(source, v.start, "[") => continue,
            DeValue::Table(t) if !starts_with(source, v.start, "{") => {
                steps.push(Step::Key(key.get_ref().as_ref()));
                // An error on the dotted key's own span is the table's (an unknown field of
                // it: `identity.heder = ...`).
                if within(source, t, offset, steps) || k.contains(&offset) {
                    return true;
                }
                steps.pop();
                continue;
            }
            DeValue::Array(entries)
                if entries
                    .iter()
                    .next()
                    .is_some_and(|e| starts_with(source, e.span().start, "[[")) =>
            {
                continue;
            }
            _ => {}
        }
        if k.contains(&offset) {
            // On the key itself (an unknown field): its table is the place.
            return true;
        }
        if !holds(v, offset) {
            continue;
        }
        steps.push(Step::Key(key.get_ref().as_ref()));
        in_value(source, value, offset, steps);
        return true;
    }
    false
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
