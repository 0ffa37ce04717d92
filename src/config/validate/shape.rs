//! A file TOML cannot read into the config's shape: its first error, said as the config's
//! other errors are (file, line and column, route, field), with what would do.
//!
//! TOML's own messages name no table or key ("invalid type: string, expected i64"). A
//! best-effort parse of the file keeps each key's and value's span, and each table header's;
//! the innermost table, list entry and key holding the error's offset name it, from the
//! route on (`routes[1] (b.second)`, then `limits[0] (burst).capacity_micro`) or from the top
//! level (`upstreams."my app".addrs`), however the file spells its headers, keys, quotes and
//! inline tables (one line or several). An error in a header is said by what is wrong with
//! the header: a table written twice or both ways, a list of tables written as one table or
//! the reverse, a table under a list written before the list's first entry, a header adding
//! to what a value, a dotted key or an inline list already wrote.

use std::borrow::Cow;
use std::ops::Range;

use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::route_label;

/// The key (before a line's `=`, or a table header) of the most dot-separated parts, and
/// their number: where a file nests too deep for TOML's reader.
pub(crate) fn deepest_key(source: &str) -> Option<(Range<usize>, usize)> {
    let mut deepest: Option<(Range<usize>, usize)> = None;
    let mut offset = 0;
    for line in source.split_inclusive('\n') {
        let start = offset + (line.len() - line.trim_start().len());
        offset += line.len();
        let (mut parts, mut quote, mut end) = (1, None, start);
        for (i, ch) in line.trim_start().char_indices() {
            match (quote, ch) {
                (None, '"' | '\'') => quote = Some(ch),
                (Some(q), _) if ch == q => quote = None,
                (None, '.') => parts += 1,
                (None, '=' | ']' | '#') if i > 0 => {
                    end = start + i;
                    break;
                }
                _ => {}
            }
            end = start + i + ch.len_utf8();
        }
        if deepest.as_ref().is_none_or(|(_, most)| parts > *most) {
            deepest = Some((start..end, parts));
        }
    }
    deepest.filter(|(_, parts)| *parts > 1)
}

/// A file TOML cannot read into the config's shape: where its first error is, the route it
/// is in, and the message, without a password a value it quotes may hold.
pub(super) fn error(
    source: &str,
    e: &toml::de::Error,
) -> (Option<Range<usize>>, Option<String>, String) {
    let (at, route, message) = first_error(source, e);
    let message = with_the_field_meant(without_credentials(&message));
    (at, route, not_repeating_a_pasted_value(message))
}

/// A word that reads as a value pasted where a key belongs (a password, a token, an access
/// key on a line of its own), not as a field's name: 12 characters or more with an
/// uppercase letter, two digits or a sign no field's name has (`-` is a name's). The config's fields are
/// lowercase words and `_`; a route's or an upstream's own name is never an unknown key.
fn looks_pasted(word: &str) -> bool {
    let digits = word.chars().filter(char::is_ascii_digit).count();
    word.chars().count() >= 12
        && (digits >= 2
            || (word.chars())
                .any(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')))
}

/// Such a word as an error says it: by its length.
fn hidden(word: &str) -> String {
    format!(
        "<{} characters, not repeated here: a value pasted in, perhaps a secret?>",
        word.chars().count()
    )
}

/// A shape error that would repeat such a word (a key with no value, an unknown field near
/// no known one) with the word left out: the line and column find it, and a secret pasted
/// into the file by mistake is not copied into a terminal's scrollback, a log or a reload's
/// answer.
fn not_repeating_a_pasted_value(message: String) -> String {
    if let Some((before, rest)) = message.split_once("unknown field `") {
        if let Some((word, after)) = rest.split_once('`') {
            if looks_pasted(word) && !after.contains("did you mean") {
                return format!("{before}unknown field {}{after}", hidden(word));
            }
        }
    }
    message
}

/// An unknown field's message with the known field nearest to it, when one is near (a third
/// of its characters, two at least): `refill_rate_micro_per_second` is most likely
/// `refill_rate_micro_per_sec`, which a list of 29 fields leaves the reader to find.
fn with_the_field_meant(message: String) -> String {
    let Some(rest) = message.split("unknown field `").nth(1) else {
        return message;
    };
    // Of a list: where one field alone is expected, the message names it already.
    let Some((written, expected)) = rest.split_once("`, expected one of ") else {
        return message;
    };
    let near = (written.chars().count() / 3).max(2);
    let nearest = (expected.split('`').skip(1).step_by(2))
        .map(|known| (super::route::edit_distance(written, known), known))
        .filter(|(d, _)| (1..=near).contains(d))
        .min();
    match nearest {
        Some((_, known)) => format!("{message}: did you mean `{known}`?"),
        None => message,
    }
}

/// `message` with each string it quotes (`invalid type: string "..."`) that holds a user and
/// password (`u:pw@host`, a URL with one or with a query) shown as the config's messages show
/// URLs: a URL list written as one string would be said with its password otherwise.
fn without_credentials(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("string \"") {
        let start = at + "string \"".len();
        out.push_str(&rest[..start]);
        // The quoted text as serde writes it (Rust's escapes): to the first unescaped quote.
        let body = &rest[start..];
        let mut end = body.len();
        let mut escaped = false;
        for (i, ch) in body.char_indices() {
            match ch {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = i;
                    break;
                }
                _ => escaped = false,
            }
        }
        let quoted = &body[..end];
        if quoted.contains("://") {
            out.push_str(&crate::config::redact_url_and_query(quoted));
        } else if looks_pasted(quoted)
            && !(quoted.chars()).all(|c| c.is_ascii_digit() || ".:[]".contains(c))
        {
            // A value of the wrong type that reads as a secret (a token where a number
            // belongs, base64 starting with `/`): said by its length, as a pasted key is.
            // Not an address.
            out.push_str(&format!(
                "<{} characters, not repeated here: a secret?>",
                quoted.chars().count()
            ));
        } else if quoted.contains('@') {
            out.push_str(&crate::config::redact_url_and_query(quoted));
        } else {
            out.push_str(quoted);
        }
        rest = &body[end..];
    }
    out.push_str(rest);
    out
}

fn first_error(
    source: &str,
    e: &toml::de::Error,
) -> (Option<Range<usize>>, Option<String>, String) {
    // A byte order mark is no part of the first line: read as spaces, offsets kept.
    let source: Cow<str> = match source.strip_prefix('\u{feff}') {
        Some(rest) => Cow::Owned(format!("   {rest}")),
        None => Cow::Borrowed(source),
    };
    let source = source.as_ref();
    let (root, syntax) = DeTable::parse_recoverable(source);
    // Of several syntax errors TOML reports one, not always the first in the file (a string
    // left open on its line is said where the next line stumbles over it): the first is.
    // (Of two at one offset, a string's own error says more than what stumbled after it.)
    let first = (syntax.iter())
        .filter(|s| s.span().is_some())
        .min_by_key(|s| (s.span().map(|r| r.start), !s.message().contains(" string")));
    let (message, span) = match first {
        Some(first) => (first.message(), first.span()),
        None => (e.message(), e.span()),
    };
    let message = past_i64(message.trim());
    let Some(span) = span else {
        // TOML gives no place for a key nested past its reader's depth: the key of most
        // parts is it.
        if message.contains("recursion limit") {
            if let Some((at, parts)) = deepest_key(source) {
                return (Some(at), None, format!("a key of {parts} parts (a dotted key or a table header) nests deeper than the TOML reader goes; no field of the config is nested more than a few tables deep"));
            }
        }
        return (None, None, message);
    };
    let message = said_plainly(source, span.clone(), message);
    let doc = Doc::new(source, root.get_ref());
    // A date where a number or a string belongs: TOML hands it on as a table.
    let date = (source.get(span.clone()))
        .is_some_and(|t| t.trim().parse::<toml::value::Datetime>().is_ok());
    let message = match date {
        true => message.replacen("invalid type: map", "invalid type: a date-time", 1),
        false => message,
    };
    // ``unknown field `x` ``: the key TOML does not know.
    let unknown = (message.strip_prefix("unknown field `"))
        .and_then(|rest| rest.split_once('`'))
        .map(|(key, _)| key);
    let missing = message.starts_with("missing field");
    let place = doc.place_at(span.start, unknown);
    // A table of the shape written as a list of tables (`[[server]]`, `[[routes.tiers.pro]]`):
    // serde takes the list for the table's fields, and its messages say nothing of it.
    if let Some(header) = (place.region).and_then(|at| Header::on_line(source, at)) {
        if header.list && is_a_table(&header.raw()) {
            let route = doc.place_at(header.at.start, None).route;
            return (Some(header.at.clone()), route, header.a_table_as_a_list());
        }
    }
    if let Some(table) = &place.listed_table {
        let message = format!("{table} is written as a list where it is one table: write it as one table, without the [ ] around it");
        return (Some(span), place.route, message);
    }
    let (mut route, mut field) = (place.route, place.field);
    let unknown_at = place.unknown_at;
    // A dotted key adding to what the table already holds as a value (`threads = 2`, then
    // `threads.max = 4`): said as for a header, from the file before the line.
    if message.starts_with("cannot extend value of type") {
        if let Some(said) = dotted_over_a_value(source, span.start, place.region) {
            return (Some(span), route, said);
        }
    }
    // An error in a header (a table written twice or in the wrong form, a syntax error, an
    // unknown table) is said by the header; a field missing from a table with a header points
    // at the header and is named by that table (or by the one above that the header makes:
    // `[upstreams.app.health_check]` alone makes `upstreams.app`, without its `addrs`).
    let on_a_header = !place.in_value
        && source[line_of(source, span.start)]
            .trim_start()
            .starts_with('[');
    let header = on_a_header
        .then(|| Header::on_line(source, span.start))
        .flatten();
    if on_a_header && header.is_none() {
        // A header TOML cannot read: its own words say what is wrong (the route before it
        // may not be its own). One whole but followed by more (`[breaker] x`) is named.
        (route, field) = (None, None);
        let before = source[line_of(source, span.start).start..span.start].trim();
        if before.ends_with(']') && message.starts_with("unexpected key or value") {
            if let Some(keys) = keys_of(before).filter(|k| !k.is_empty()) {
                let list = before.starts_with("[[");
                let (open, close) = if list { ("[[", "]]") } else { ("[", "]") };
                let message = format!("{open}{}{close} is followed by more on its line: a header stands alone on its line (a # comment may follow it)", shown(&keys));
                return (Some(span), None, message);
            }
        }
    }
    if let Some(header) = header {
        let key = header.key_at(span.start);
        if !missing {
            if let Some((at, about)) = doc.about_a_header(&header, span.start, &message) {
                // The route of what is pointed at; none for a header that is no route's (the
                // last route is the place before it).
                let route = match &at {
                    Some(at) => doc.place_at(at.start, None).route,
                    None if header.raw().first() == Some(&"routes") => route,
                    None => None,
                };
                return (Some(at.unwrap_or(span)), route, about);
            }
            // An unknown table is named by the table above it (its list entry too, when the
            // header is the table's: `limits[0] (burst)` for `[routes.limits.bogus]`); any
            // other error by its own.
            field = match (key, unknown.is_some()) {
                // (The header is the region's own: the table holding the error starts here.)
                _ if unknown.is_some()
                    && place.region.is_some_and(|at| header.at.contains(&at))
                    && header.names(unknown) =>
                {
                    place.above
                }
                (Some(key), true) => header.field(..key, route.is_some()),
                (Some(key), false) => header.field(..key + 1, route.is_some()),
                (None, _) => field,
            };
        } else if let Some(key) = key.filter(|k| k + 1 < header.keys.len()) {
            field = header.field(..key + 1, route.is_some());
        }
    }
    // `threads =` with nothing after it: TOML reads the end of the line as an unquoted string.
    let nothing = (source[line_of(source, span.start)].split_once('='))
        .is_some_and(|(_, v)| v.split('#').next().unwrap_or_default().trim().is_empty());
    let message = match message.starts_with("string values must be quoted") && nothing {
        true => {
            // The key as written, when it reads as a pasted value (`AKIA... =`): the field
            // is said without it.
            let written =
                (source[line_of(source, span.start)].split_once('=')).map_or("", |(k, _)| k.trim());
            if looks_pasted(&written.replace('.', "_")) && !written.contains(' ') {
                let marker = hidden(written);
                field = Some(
                    match field.as_deref().and_then(|f| f.strip_suffix(written)) {
                        Some(table) => format!("{table}{marker}"),
                        None => marker,
                    },
                );
            }
            "no value after `=`: write one, or leave the key out for its default".to_owned()
        }
        false => message,
    };
    // `threads 2`: the key TOML read before it found no `=` is in no table of its reading;
    // it is the line's text up to the error.
    if message.starts_with("key with no value") {
        let written = source[line_of(source, span.start).start..span.start].trim();
        if let Some(keys) = keys_of(&format!("{written} = 0")).filter(|k| !k.is_empty()) {
            // A dotted line read as a whole: `my.Secret.Passw0rd99x` is one pasted value,
            // though no part of it alone reads as one.
            let key = match looks_pasted(&written.replace('.', "_")) && !written.contains(' ') {
                true => hidden(written),
                false => shown(&keys),
            };
            field = Some(field.map_or(key.clone(), |f| format!("{f}.{key}")));
        }
    }
    // A multi-line string left open is read to the file's end, where TOML points: the line
    // it opened on is said (no string can hold its own delimiter three times).
    let message = match (message.strip_prefix("invalid multi-line "))
        .and_then(|m| m.split_once(" string"))
        .map(|(kind, _)| if kind == "basic" { "\"\"\"" } else { "'''" })
    {
        Some(quotes) if span.start >= source.trim_end().len() => match opening(source, quotes) {
            Some(at) => format!(
                "{message}: the string opened on line {} is not closed",
                line_number(source, at)
            ),
            None => message,
        },
        _ => message,
    };
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
    (Some(unknown_at.unwrap_or(span)), route, message)
}

/// TOML's words for two syntax errors a hand makes, said for what they are: a string that
/// runs past its line (TOML: "invalid basic string, expected `"`"), and a bare word where a
/// value belongs (`fail_mode = fail_closed`; TOML: "invalid boolean, expected `false`").
fn said_plainly(source: &str, span: Range<usize>, message: String) -> String {
    for (kind, quote) in [("basic", '"'), ("literal", '\'')] {
        if message == format!("invalid {kind} string, expected `{quote}`") {
            return format!("{message}: a string ends on the line it starts on: close it with {quote} there (a string of several lines is written between {q3})", q3 = quote.to_string().repeat(3));
        }
    }
    let word = source.get(span).unwrap_or_default();
    let bare = !word.is_empty()
        && (word.bytes()).all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        && !word.starts_with(|c: char| c.is_ascii_digit() || c == '-');
    let stumbled = [
        "invalid boolean",
        "invalid float",
        "invalid integer",
        "invalid string",
        "string values must be quoted",
    ];
    if bare && stumbled.iter().any(|m| message.starts_with(m)) {
        if ["true", "false"].contains(&word.to_ascii_lowercase().as_str()) {
            return format!(
                "`{word}` is no TOML value: a switch is written in lower case, {}",
                word.to_ascii_lowercase()
            );
        }
        if looks_pasted(word) {
            return format!("a bare word of {} characters is no TOML value (not repeated here: a value pasted in, perhaps a secret?): a string is written in quotes, a number in digits, a switch as true or false", word.chars().count());
        }
        return format!("`{word}` is no TOML value: a string is written in quotes (\"{word}\"), a number in digits, a switch as true or false");
    }
    message
}

/// Where the last `quotes` (`"""` or `'''`) of `source` start that no backslash escapes (a
/// basic string may hold `\"""`): the opening of a multi-line string left open.
fn opening(source: &str, quotes: &str) -> Option<usize> {
    let mut before = source.len();
    while let Some(at) = source[..before].rfind(quotes) {
        let slashes = source[..at]
            .bytes()
            .rev()
            .take_while(|b| *b == b'\\')
            .count();
        if quotes.starts_with('\'') || slashes % 2 == 0 {
            return Some(at);
        }
        before = at + quotes.len() - 1;
    }
    None
}

/// Where an error's offset lies.
struct Place {
    /// The route's label when the offset is inside a route: `routes[1] (b.second)`.
    route: Option<String>,
    /// From the route (or the top level) to the innermost table, list entry or key holding
    /// the offset: `limits[0] (burst).capacity_micro`; `None` for a route's own table and
    /// the top level.
    field: Option<String>,
    /// The table above the region's own (`field` without its last key), for an unknown
    /// table named by its header.
    above: Option<String>,
    /// The offset is in a value (or just past one on its line), not on a key or a header.
    in_value: bool,
    /// A table of the shape the offset is in, written as a list (`app = [{ ... }]` under
    /// `[upstreams]`): its name.
    listed_table: Option<String>,
    /// Where the header of the table holding the offset starts.
    region: Option<usize>,
    /// Where the unknown key is written.
    unknown_at: Option<Range<usize>>,
}

/// One step of a place: a key, or an entry of a list (with its table, for its name).
#[derive(Clone, Copy)]
enum Step<'a, 'i> {
    Key(&'a str),
    Entry(usize, Option<&'a DeTable<'i>>),
}

/// How a table or a list is written.
#[derive(PartialEq)]
enum Form {
    /// `[x]`, or a list of `[[x]]` entries.
    Headers,
    /// `{ ... }`, `[ ... ]`, or a value that is neither table nor list.
    Inline,
    /// Made by a dotted key (`a.b = 1`) or a longer header (`[a.b]` makes `a`).
    Dotted,
}

/// The file as TOML's best effort read it, with every table written with a whole header.
struct Doc<'a, 'i> {
    source: &'a str,
    root: &'a DeTable<'i>,
    /// By their header's start: their steps from the top, and the table.
    headers: Vec<(usize, Vec<Step<'a, 'i>>, &'a DeTable<'i>)>,
}

impl<'a, 'i> Doc<'a, 'i> {
    fn new(source: &'a str, root: &'a DeTable<'i>) -> Self {
        let mut doc = Doc {
            source,
            root,
            headers: Vec::new(),
        };
        let mut headers = Vec::new();
        doc.tables_with_headers(root, &mut Vec::new(), &mut headers);
        headers.sort_by_key(|(start, _, _)| *start);
        doc.headers = headers;
        doc
    }

    fn form(&self, value: &Spanned<DeValue>) -> Form {
        let starts =
            |at: usize, text: &str| self.source.get(at..).is_some_and(|s| s.starts_with(text));
        let at = value.span().start;
        match value.get_ref() {
            DeValue::Table(_) if starts(at, "{") => Form::Inline,
            DeValue::Table(_) if starts(at, "[") => Form::Headers,
            DeValue::Table(_) => Form::Dotted,
            DeValue::Array(entries) => match entries.iter().next() {
                Some(e)
                    if matches!(e.get_ref(), DeValue::Table(_)) && starts(e.span().start, "[[") =>
                {
                    Form::Headers
                }
                _ => Form::Inline,
            },
            _ => Form::Inline,
        }
    }

    /// Every table written with a header (`[x]`, each entry of `[[x]]`). A header TOML could
    /// only take in part (`[[routes.limits]` unclosed: its table is taken up to the next
    /// header's end, named by that header's keys) is none.
    fn tables_with_headers(
        &self,
        table: &'a DeTable<'i>,
        steps: &mut Vec<Step<'a, 'i>>,
        out: &mut Vec<(usize, Vec<Step<'a, 'i>>, &'a DeTable<'i>)>,
    ) {
        let whole = |span: Range<usize>| self.source.get(span).is_some_and(|h| !h.contains('\n'));
        for (key, value) in table.iter() {
            steps.push(Step::Key(key.get_ref().as_ref()));
            match (value.get_ref(), self.form(value)) {
                (DeValue::Table(_), Form::Inline) => {}
                (DeValue::Table(t), form) => {
                    if form == Form::Headers && whole(value.span()) {
                        out.push((value.span().start, steps.to_vec(), t));
                    }
                    self.tables_with_headers(t, steps, out);
                }
                (DeValue::Array(entries), Form::Headers) => {
                    for (i, entry) in entries.iter().enumerate() {
                        if let DeValue::Table(t) = entry.get_ref() {
                            steps.push(Step::Entry(i, Some(t)));
                            if whole(entry.span()) {
                                out.push((entry.span().start, steps.to_vec(), t));
                            }
                            self.tables_with_headers(t, steps, out);
                            steps.pop();
                        }
                    }
                }
                _ => {}
            }
            steps.pop();
        }
    }

    /// The place of byte `offset`. An offset on a key (an unknown field) names the key's
    /// table, the message naming the key (`unknown`, the key TOML does not know: the first
    /// key of a dotted key too).
    fn place_at(&self, offset: usize, unknown: Option<&str>) -> Place {
        // The table whose header is the last one at or before the offset (the top level when
        // none is).
        let region = self
            .headers
            .iter()
            .rev()
            .find(|(start, _, _)| *start <= offset);
        let (mut steps, table) = match region {
            Some((_, steps, table)) => (steps.to_vec(), *table),
            None => (Vec::new(), self.root),
        };
        // Its own key (and entry, for `[[x]]`) left out.
        let above = match steps.as_slice() {
            [.., Step::Key(_), Step::Entry(..)] => said(&steps[..steps.len() - 2]).1,
            [.., Step::Key(_)] => said(&steps[..steps.len() - 1]).1,
            _ => None,
        };
        let line = line_of(self.source, offset);
        let mut found = self.within(table, offset, unknown, &mut steps);
        if found == Found::Nothing {
            // An error just past a value on its line (an unclosed string, `5 000`): that key's.
            // A value TOML read to the offset (an unclosed multi-line string, read to the
            // file's end) is that value's too.
            let before = (table.iter())
                .filter(|(k, v)| {
                    k.span().start < offset
                        && (line.contains(&k.span().start) || v.span().end == offset)
                })
                .max_by_key(|(k, _)| k.span().start);
            if let Some((key, _)) = before {
                steps.push(Step::Key(key.get_ref().as_ref()));
                found = Found::Value;
            }
        }
        // Keys down to an entry of a list, when those keys name a table of the shape.
        let listed_table = (0..steps.len()).find_map(|n| {
            let keys: Vec<&str> = (steps[..n].iter())
                .filter_map(|s| match s {
                    Step::Key(k) => Some(*k),
                    Step::Entry(..) => None,
                })
                .collect();
            let entry = matches!(steps[n], Step::Entry(..)) && n > 0;
            (entry && is_a_table(&keys))
                .then(|| said(&steps[..n]).1)
                .flatten()
        });
        // An unknown key is pointed at where it is written, in the innermost table the steps
        // lead to (TOML points at the table's header, or its `{`).
        let unknown_at = unknown.and_then(|unknown| {
            let table = self.table_at(&steps);
            (table.iter())
                .find(|(k, _)| k.get_ref() == unknown)
                .map(|(k, _)| k.span())
        });
        let (route, field) = said(&steps);
        Place {
            route,
            field,
            listed_table,
            above,
            in_value: found == Found::Value,
            region: region.map(|(start, _, _)| *start),
            unknown_at,
        }
    }

    /// The innermost table `steps` lead to from the top.
    fn table_at(&self, steps: &[Step]) -> &'a DeTable<'i> {
        let mut table = self.root;
        let mut steps = steps.iter().peekable();
        while let Some(Step::Key(key)) = steps.next() {
            let Some(value) = table.get(*key) else {
                break;
            };
            table = match (value.get_ref(), steps.peek()) {
                (DeValue::Table(t), _) => t,
                (DeValue::Array(entries), Some(Step::Entry(i, _))) => {
                    steps.next();
                    match entries.get(*i).map(|e| e.get_ref()) {
                        Some(DeValue::Table(t)) => t,
                        _ => break,
                    }
                }
                _ => break,
            };
        }
        table
    }

    /// Down from `table` to the innermost key, entry or inline table holding `offset`.
    fn within(
        &self,
        table: &'a DeTable<'i>,
        offset: usize,
        unknown: Option<&str>,
        steps: &mut Vec<Step<'a, 'i>>,
    ) -> Found {
        for (key, value) in table.iter() {
            let (k, v) = (key.span(), value.span());
            match (value.get_ref(), self.form(value)) {
                // Another header's table is its own place.
                (_, Form::Headers) => continue,
                // A dotted key's table holds its keys' spans, not its own; an error on the
                // dotted key's own span is about the table (a field missing from it), or
                // about the key (unknown: its table above is the place).
                (DeValue::Table(t), Form::Dotted) => {
                    steps.push(Step::Key(key.get_ref().as_ref()));
                    match self.within(t, offset, unknown, steps) {
                        Found::Nothing if k.contains(&offset) => {
                            if unknown == Some(key.get_ref().as_ref()) {
                                steps.pop();
                            }
                            return Found::Key;
                        }
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
            self.in_value(value, offset, unknown, steps);
            return Found::Value;
        }
        Found::Nothing
    }

    /// Into a value holding `offset`: an inline table's key, a list's entry.
    fn in_value(
        &self,
        value: &'a Spanned<DeValue<'i>>,
        offset: usize,
        unknown: Option<&str>,
        steps: &mut Vec<Step<'a, 'i>>,
    ) {
        match value.get_ref() {
            DeValue::Table(t) => {
                self.within(t, offset, unknown, steps);
            }
            DeValue::Array(entries) => {
                let at = (entries.iter().enumerate()).find(|(_, e)| holds(e.span(), offset));
                if let Some((i, entry)) = at {
                    let table = match entry.get_ref() {
                        DeValue::Table(t) => Some(t),
                        _ => None,
                    };
                    steps.push(Step::Entry(i, table));
                    self.in_value(entry, offset, unknown, steps);
                }
            }
            _ => {}
        }
    }

    /// TOML's words for an error in a table's header `header` (the error at `offset`), which
    /// name neither the table nor what would do: a table written twice, `[routes]` for
    /// `[[routes]]`, `[[upstreams]]` for `[upstreams.NAME]`, a header that a table, a value or
    /// an inline list written before it makes wrong. Where to point, when it is not the
    /// error's own place, and what to say; `None` for another error.
    fn about_a_header(
        &self,
        header: &Header,
        offset: usize,
        message: &str,
    ) -> Option<(Option<Range<usize>>, String)> {
        // The table TOML's error is about: the header's own, or one above it that the header
        // makes (`[routes.limits.0]` makes `routes.limits` a table).
        let about = header.key_at(offset).map_or(header.keys.len(), |i| i + 1);
        let whole = about == header.keys.len();
        let raw = header.raw();
        let (name, text, list) = (shown(&header.keys[..about]), &header.text, header.list);
        let taken = message.ends_with("duplicate key")
            || message.starts_with("invalid type: map, expected a sequence")
            || message.starts_with("cannot extend value of type");
        // The file as it is before the header's line: where TOML meets a key twice, what it
        // keeps is not always what was written first.
        let before = &self.source[..line_of(self.source, header.at.start).start];
        let (before_root, _) = DeTable::parse_recoverable(before);
        let before = Doc::new(before, before_root.get_ref());
        if taken {
            if let Some(said) = before.made_before(header, "a header") {
                return Some(said);
            }
        }
        // Written both ways: `[[routes]]`, then `[routes]` for a later one (or the reverse),
        // among the headers TOML took in the file and in the file before this one.
        let other_form = (self.headers.iter().chain(&before.headers))
            .filter_map(|(at, _, _)| Header::on_line(self.source, *at))
            .any(|h| shown(&h.keys) == name && h.list != list);
        let is_list = is_a_list(&raw[..about]);
        let listed = format!("[[{name}]] (one per entry)");
        Some((
            None,
            if message.ends_with("duplicate key") && other_form {
                match is_list {
                    true => format!("{name} is written both as [{name}] and as [[{name}]]: it is a list of tables, each entry written {listed}"),
                    false => format!("{name} is written both as [{name}] and as [[{name}]]: it is one table, written {} once", named(&raw[..about])),
                }
            } else if list && whole && is_a_table(&raw) {
                header.a_table_as_a_list()
            } else if message.ends_with("duplicate key") {
                format!("{text} is written twice: give each table once (merge their keys into one)")
            } else if message.starts_with("invalid type: map, expected a sequence") && is_list {
                match whole && !list {
                    true => format!("{text} is one table where {name} is a list of tables: write {listed}"),
                    false => format!("{text} makes {name} one table where it is a list of tables: write {listed}, and the entry's fields in it"),
                }
            } else if message.starts_with("invalid type: sequence, expected a map") && list {
                format!(
                    "{text} is a list of tables where {name} is one table: write {}",
                    named(&raw[..about])
                )
            } else {
                return None;
            },
        ))
    }

    /// In the file before the header `header` (this document), what makes the header wrong:
    /// the reading followed down its keys meets a list written inline (`routes = [{ ... }]`, then `[[routes]]`), a
    /// value, a dotted key or an inline table where the header makes a table, or, for a list
    /// of tables, a table under it written before any of its entries (`[routes.tiers.x]`
    /// before `[[routes]]`: it belongs to no entry; `[routes.limits.burst]`, which makes the
    /// list one table). Where it is, and what to say.
    fn made_before(&self, header: &Header, adding: &str) -> Option<(Option<Range<usize>>, String)> {
        let raw = header.raw();
        let mut table = self.root;
        for n in 0..header.keys.len() {
            let (key, value) = table.iter().find(|(k, _)| k.get_ref().as_ref() == raw[n])?;
            let path = shown(&header.keys[..=n]);
            let by_a_header = Header::on_line(self.source, key.span().start).is_some();
            match (value.get_ref(), self.form(value)) {
                (DeValue::Array(entries), Form::Headers) => {
                    match entries.iter().last()?.get_ref() {
                        DeValue::Table(t) => table = t,
                        _ => return None,
                    }
                }
                (DeValue::Array(entries), Form::Inline)
                    if entries
                        .iter()
                        .all(|e| matches!(e.get_ref(), DeValue::Table(_))) =>
                {
                    let line = line_number(self.source, value.span().start);
                    return Some((None, format!("{path} is written as an inline list (line {line}), which {adding} cannot add to: write its entries one way, all inline or each as [[{path}]] with its tables after it")));
                }
                (DeValue::Table(t), Form::Headers) => table = t,
                // A dotted key's table under the header's own (`upstreams.app.addrs = ...`,
                // then `[upstreams.b]`): the header may still add to it.
                (DeValue::Table(t), Form::Dotted) if !by_a_header && n + 1 < header.keys.len() => {
                    table = t;
                }
                (DeValue::Table(t), Form::Dotted) if by_a_header => {
                    if is_a_list(&raw[..=n]) {
                        let first = self.first_header_under(t)?;
                        let first = Header::on_line(self.source, first)?;
                        let next = first.keys.get(n + 1)?.0.as_str();
                        let text = &first.text;
                        return Some((Some(first.at.clone()), match tables_of_an_entry(&raw[..=n]).contains(&next) {
                            true => format!("{text} comes before any [[{path}]]: write it after the [[{path}]] of the entry it belongs to"),
                            false => format!("{text} makes {path} one table where it is a list of tables: write [[{path}]] (one per entry), and the entry's fields in it"),
                        }));
                    }
                    table = t;
                }
                _ => {
                    let line = line_of(self.source, key.span().start);
                    let written = self.source[line.clone()].trim();
                    let number = line_number(self.source, line.start);
                    return Some((None, format!("{path} is already written on line {number} (`{written}`), which {adding} cannot add to: write {path} one way")));
                }
            }
        }
        None
    }

    /// Where the first table written with a header under `table` starts.
    fn first_header_under(&self, table: &'a DeTable<'i>) -> Option<usize> {
        (table.iter())
            .filter_map(|(_, value)| match (value.get_ref(), self.form(value)) {
                (DeValue::Table(_), Form::Headers) => Some(value.span().start),
                (DeValue::Table(t), Form::Dotted) => self.first_header_under(t),
                (DeValue::Array(entries), Form::Headers) => {
                    entries.iter().next().map(|e| e.span().start)
                }
                _ => None,
            })
            .min()
    }
}

/// For a dotted key at `offset` that TOML cannot add to what is already written (its line's
/// key, under the table whose header starts at `region`), what is written and where.
fn dotted_over_a_value(source: &str, offset: usize, region: Option<usize>) -> Option<String> {
    let line = line_of(source, offset);
    let (written, _) = source[line.clone()].split_once('=')?;
    let mut keys: Vec<(String, Range<usize>)> =
        match region.and_then(|at| Header::on_line(source, at)) {
            Some(header) => header.keys,
            None => Vec::new(),
        };
    keys.extend(
        keys_of(&format!("{} = 0", written.trim()))?
            .into_iter()
            .map(|(k, _)| (k, offset..offset)),
    );
    let header = Header {
        text: written.trim().to_owned(),
        keys,
        list: false,
        at: offset..offset,
    };
    let before = &source[..line.start];
    let (root, _) = DeTable::parse_recoverable(before);
    let (_, said) = Doc::new(before, root.get_ref()).made_before(&header, "a dotted key")?;
    Some(said)
}

/// The keys of the first key-value or header of `document`, followed down (`a."b".c = 0` is
/// `a`, `b`, `c`; a header's, to its own table), each with where it is in `document`.
fn keys_of(document: &str) -> Option<Vec<(String, Range<usize>)>> {
    let document = DeTable::parse(document).ok()?;
    let (mut table, mut keys) = (document.get_ref(), Vec::new());
    while let Some((key, value)) = table.iter().next() {
        keys.push((key.get_ref().to_string(), key.span()));
        table = match value.get_ref() {
            DeValue::Table(t) => t,
            DeValue::Array(entries) => match entries.iter().next().map(|e| e.get_ref()) {
                Some(DeValue::Table(t)) => t,
                _ => break,
            },
            _ => break,
        };
    }
    Some(keys)
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

/// A table header as its line writes it.
struct Header {
    /// As written, to its closing bracket: `[[ routes . "limits" ]]`.
    text: String,
    /// Its keys as TOML reads them, each with where it is in the file.
    keys: Vec<(String, Range<usize>)>,
    /// `[[x]]`: an entry of a list of tables.
    list: bool,
    /// Where it is in the file.
    at: Range<usize>,
}

impl Header {
    /// The header on the line of `offset`, if that line is one TOML can read.
    fn on_line(source: &str, offset: usize) -> Option<Header> {
        let line = line_of(source, offset);
        let written = &source[line.clone()];
        let header = written.trim_start();
        if !header.starts_with('[') {
            return None;
        }
        let from = line.start + written.len() - header.len();
        let keys: Vec<(String, Range<usize>)> = (keys_of(header.trim_end())?.into_iter())
            .map(|(key, at)| (key, from + at.start..from + at.end))
            .collect();
        // To its closing bracket (a quoted key may hold a `#`).
        let last = keys.last()?.1.end;
        let close = last + source[last..line.end].find(']')?;
        let end = close
            + if source[close..].starts_with("]]") {
                2
            } else {
                1
            };
        Some(Header {
            text: source[from..end].to_owned(),
            keys,
            list: header.starts_with("[["),
            at: from..end,
        })
    }

    fn raw(&self) -> Vec<&str> {
        self.keys.iter().map(|(k, _)| k.as_str()).collect()
    }

    /// Which of its keys holds `offset`.
    fn key_at(&self, offset: usize) -> Option<usize> {
        self.keys.iter().position(|(_, at)| at.contains(&offset))
    }

    /// Its first keys, to `end`, as a field: inside a route, from the route on; `None` when
    /// nothing is left.
    fn field(&self, end: std::ops::RangeTo<usize>, in_route: bool) -> Option<String> {
        let keys = &self.keys[end];
        let keys = match (in_route, keys.first()) {
            (true, Some((first, _))) if first == "routes" => &keys[1..],
            _ => keys,
        };
        (!keys.is_empty()).then(|| shown(keys))
    }

    /// Whether its last key is `key`.
    fn names(&self, key: Option<&str>) -> bool {
        self.keys.last().map(|(k, _)| k.as_str()) == key
    }

    /// Said of a table written as a list of tables.
    fn a_table_as_a_list(&self) -> String {
        let name = shown(&self.keys);
        format!(
            "{} is a list of tables where {name} is one table: write {}",
            self.text,
            named(&self.raw())
        )
    }
}

/// The tables of the config's shape (not lists of tables), by their keys (`*`: any one key,
/// a name the file chooses). `raw.rs` is the shape itself: the test below holds the two
/// together.
const TABLES: &[&[&str]] = &[
    &["server"],
    &["redis"],
    &["breaker"],
    &["auth"],
    &["auth", "jwt"],
    &["auth", "api_keys"],
    &["access_log"],
    &["upstreams"],
    &["upstreams", "*"],
    &["upstreams", "*", "health_check"],
    &["routes", "identity"],
    &["routes", "tier_from"],
    &["routes", "cost_from_response"],
    &["routes", "tiers"],
    &["routes", "tiers", "*"],
];

/// The lists of tables of the config's shape, by their keys.
const LISTS: &[&[&str]] = &[
    &["routes"],
    &["routes", "limits"],
    &["routes", "tiers", "*", "limits"],
    &["server", "tls"],
    &["server", "tls", "sni"],
];

fn on_path(path: &[&str], keys: &[&str]) -> bool {
    path.len() == keys.len() && path.iter().zip(keys).all(|(p, k)| *p == "*" || p == k)
}

fn is_a_table(keys: &[&str]) -> bool {
    TABLES.iter().any(|path| on_path(path, keys))
}

fn is_a_list(keys: &[&str]) -> bool {
    LISTS.iter().any(|path| on_path(path, keys))
}

/// The tables an entry of the list of tables `list` may have, written with headers after
/// its `[[list]]` (`[[routes.limits]]` after `[[routes]]`).
fn tables_of_an_entry(list: &[&str]) -> &'static [&'static str] {
    match list {
        ["routes"] => &[
            "limits",
            "tiers",
            "cost_from_response",
            "identity",
            "tier_from",
        ],
        ["server", "tls"] => &["sni"],
        _ => &[],
    }
}

/// How a table of the shape is written, for advice.
fn named(keys: &[&str]) -> String {
    match keys {
        ["upstreams"] => "[upstreams.NAME] (one table per upstream, by its name)".to_owned(),
        ["routes", "tiers"] => "[routes.tiers.NAME] (one table per tier, by its name)".to_owned(),
        keys => {
            let keys: Vec<String> = keys.iter().map(|k| key_shown(k)).collect();
            format!("[{}]", keys.join("."))
        }
    }
}

/// Keys as a message names them, joined: `upstreams."my app"`.
fn shown<K: AsRef<str>>(keys: &[(K, Range<usize>)]) -> String {
    let keys: Vec<String> = keys.iter().map(|(k, _)| key_shown(k.as_ref())).collect();
    keys.join(".")
}

/// The steps said as the messages say them: the route's label, and the field from it.
fn said(steps: &[Step]) -> (Option<String>, Option<String>) {
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
    (route, (!field.is_empty()).then_some(field))
}

/// A key written twice, as TOML reads it (`health_check.path`; `"identity".header` is
/// `identity.header`): the whole dotted key its line writes up to the error's end, else the
/// error's own text.
fn key_written(source: &str, span: Range<usize>) -> String {
    let line = line_of(source, span.start);
    let as_key = |text: &str| {
        let keys = keys_of(&format!("{text} = 0"))?;
        let keys: Vec<String> = keys.iter().map(|(key, _)| key_shown(key)).collect();
        Some(keys.join("."))
    };
    let own = source.get(span.clone()).unwrap_or_default().trim();
    (source.get(line.start..span.end))
        .and_then(|written| as_key(written.trim_start()))
        .or_else(|| as_key(own))
        .unwrap_or_else(|| own.to_owned())
}

/// A key as TOML writes it: bare when it can be, else a TOML string (`upstreams."my app"`).
pub(crate) fn key_shown(key: &str) -> String {
    let bare =
        !key.is_empty() && (key.chars()).all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    match bare {
        true => key.to_owned(),
        false => toml::Value::String(key.to_owned()).to_string(),
    }
}

fn string_in<'a>(table: &'a DeTable, key: &str) -> Option<&'a str> {
    (table.iter()).find_map(|(k, v)| match (k.get_ref().as_ref(), v.get_ref()) {
        (k, DeValue::String(s)) if k == key => Some(s.as_ref()),
        _ => None,
    })
}

/// Whether a value's span holds `offset` (an empty span: its start).
fn holds(span: Range<usize>, offset: usize) -> bool {
    (span.start..span.end.max(span.start + 1)).contains(&offset)
}

/// The byte range of the line holding `offset`.
fn line_of(source: &str, offset: usize) -> Range<usize> {
    let offset = offset.min(source.len());
    let start = source[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = (source[offset..].find('\n')).map_or(source.len(), |i| offset + i);
    start..end
}

/// The 1-based number of the line holding `offset`.
fn line_number(source: &str, offset: usize) -> usize {
    super::super::error::line_col(source, offset).0
}

/// TOML's words for an integer it cannot hold, said as what is wrong and what would do.
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
        "header" if place.is_some_and(|p| p.ends_with("cost_from_response")) => {
            "header = \"X-OCR-Pages\""
        }
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

#[cfg(test)]
mod tests {
    use super::{LISTS, TABLES};
    use crate::config::raw::RawConfig;

    /// A document with `path` written by a header (`[[path]]` for a list), after the
    /// entries of the lists above it.
    fn written(path: &[&str], list: bool) -> String {
        let keys: Vec<&str> = path
            .iter()
            .map(|k| if *k == "*" { "x" } else { k })
            .collect();
        let mut document = String::new();
        for above in LISTS
            .iter()
            .filter(|l| l.len() < keys.len() && super::on_path(l, &keys[..l.len()]))
        {
            document += &format!("[[{}]]\n", keys[..above.len()].join("."));
        }
        match list {
            true => document + &format!("[[{}]]\n", keys.join(".")),
            false => document + &format!("[{}]\n", keys.join(".")),
        }
    }

    /// The shape's tables and lists as `raw.rs` reads them: a table written as one is no
    /// unknown field and no list (a field it lacks may be missing); a list written as
    /// entries is neither unknown nor one table; each written the other way is refused.
    #[test]
    fn the_tables_and_lists_are_the_configs() {
        let read = |document: &str| match toml::from_str::<RawConfig>(document) {
            Ok(_) => String::new(),
            Err(e) => e.message().to_owned(),
        };
        for path in TABLES {
            let as_table = read(&written(path, false));
            assert!(
                !as_table.starts_with("unknown field") && !as_table.contains("expected a sequence"),
                "{path:?} as a table: {as_table}"
            );
            assert!(!read(&written(path, true)).is_empty(), "{path:?} as a list");
        }
        for path in LISTS {
            let as_list = read(&written(path, true));
            assert!(
                !as_list.starts_with("unknown field") && !as_list.contains("expected a map"),
                "{path:?} as a list: {as_list}"
            );
            assert!(
                read(&written(path, false)).contains("expected a sequence"),
                "{path:?} as one table"
            );
        }
    }
}
