//! The compiled route table and path normalization: request -> the route that owns it.
//!
//! Matching is by specificity, never by file order: an exact `path` beats a `path_prefix`, a
//! longer prefix beats a shorter one, a route with `host` beats one without, and one with
//! `methods` beats one without. Paths are case sensitive. A trailing slash does not change
//! which route matches (`/a/b/` is matched as `/a/b`), so it cannot slip past a limit.

use std::fmt;

use http::Method;

use crate::config::{PathMatch, RouteConfig};

/// Longest request path accepted, in bytes, before normalization.
pub const MAX_PATH_BYTES: usize = 8192;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathError {
    NotAbsolute,
    TooLong,
    BadEscape,
    EncodedSeparator,
    Backslash,
    ControlCharacter,
    NotUtf8,
    EscapesRoot,
}

impl fmt::Display for PathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PathError::NotAbsolute => "the path is not absolute",
            PathError::TooLong => "the path is too long",
            PathError::BadEscape => "a '%' is not followed by two hex digits",
            PathError::EncodedSeparator => "it encodes '/', '\\' or NUL",
            PathError::Backslash => "it contains '\\'",
            PathError::ControlCharacter => "it contains a control character",
            PathError::NotUtf8 => "it is not valid UTF-8 once decoded",
            PathError::EscapesRoot => "its '..' segments climb above the root",
        })
    }
}

fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Normalizes a request path (without query): percent-encoded unreserved characters are
/// decoded, other escapes are kept in upper-case hex, duplicate slashes collapse, and `.` and
/// `..` segments are resolved. A trailing slash is kept.
pub fn normalize_path(raw: &str) -> Result<String, PathError> {
    let bytes = raw.as_bytes();
    if bytes.first() != Some(&b'/') {
        return Err(PathError::NotAbsolute);
    }
    if bytes.len() > MAX_PATH_BYTES {
        return Err(PathError::TooLong);
    }
    // `decoded` holds every byte fully decoded, only to check UTF-8; `text` is the normal form.
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut text = String::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let hi = bytes.get(i + 1).copied().and_then(hex_value);
            let lo = bytes.get(i + 2).copied().and_then(hex_value);
            let (Some(hi), Some(lo)) = (hi, lo) else {
                return Err(PathError::BadEscape);
            };
            let v = hi * 16 + lo;
            match v {
                b'/' | b'\\' | 0 => return Err(PathError::EncodedSeparator),
                v if v < 0x20 || v == 0x7f => return Err(PathError::ControlCharacter),
                v if is_unreserved(v) => text.push(v as char),
                v => push_escape(&mut text, v),
            }
            decoded.push(v);
            i += 3;
            continue;
        }
        match b {
            b'\\' => return Err(PathError::Backslash),
            b if b < 0x20 || b == 0x7f => return Err(PathError::ControlCharacter),
            _ => {}
        }
        decoded.push(b);
        if b.is_ascii() {
            text.push(char::from(b));
        } else {
            // Only a config file can hold raw non-ASCII (request targets cannot): encode it
            // as a client would, so both meet in one normal form.
            push_escape(&mut text, b);
        }
        i += 1;
    }
    if std::str::from_utf8(&decoded).is_err() {
        return Err(PathError::NotUtf8);
    }
    resolve_segments(&text)
}

fn push_escape(text: &mut String, byte: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    text.push('%');
    text.push(char::from(HEX[usize::from(byte >> 4)]));
    text.push(char::from(HEX[usize::from(byte & 15)]));
}

fn resolve_segments(text: &str) -> Result<String, PathError> {
    let mut segments: Vec<&str> = Vec::new();
    let mut trailing = false;
    for seg in text.split('/') {
        trailing = matches!(seg, "" | "." | "..");
        match seg {
            "" | "." => {}
            ".." => {
                segments.pop().ok_or(PathError::EscapesRoot)?;
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(text.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() || trailing {
        out.push('/');
    }
    Ok(out)
}

/// What a route matches on, compiled from its config.
#[derive(Debug, Clone)]
pub struct Matcher {
    pub path: PathMatch,
    pub host: Option<String>,
    pub methods: Option<Vec<Method>>,
}

impl Matcher {
    pub fn of(route: &RouteConfig) -> Self {
        Self {
            path: route.path.clone(),
            host: route.host.clone(),
            methods: route.methods.clone(),
        }
    }

    /// Larger is more specific; compared lexicographically.
    fn specificity(&self) -> (bool, usize, bool, bool) {
        let (exact, len) = match &self.path {
            PathMatch::Exact(p) => (true, p.len()),
            PathMatch::Prefix(p) => (false, p.len()),
        };
        (exact, len, self.host.is_some(), self.methods.is_some())
    }

    /// `path` is normalized and has no trailing slash (except the root).
    fn matches(&self, host: Option<&str>, method: &Method, path: &str) -> bool {
        let path_ok = match &self.path {
            PathMatch::Exact(p) => p == path,
            PathMatch::Prefix(p) if p == "/" => true,
            PathMatch::Prefix(p) => {
                path.starts_with(p.as_str())
                    && matches!(path.as_bytes().get(p.len()), None | Some(b'/'))
            }
        };
        path_ok
            && self.host.as_deref().is_none_or(|h| Some(h) == host)
            && self.methods.as_ref().is_none_or(|m| m.contains(method))
    }

    /// Whether some request could match both with equal specificity.
    fn overlaps(&self, other: &Matcher) -> bool {
        let methods_meet = match (&self.methods, &other.methods) {
            (Some(a), Some(b)) => a.iter().any(|m| b.contains(m)),
            _ => true,
        };
        self.specificity() == other.specificity()
            && self.path == other.path
            && self.host == other.host
            && methods_meet
    }
}

/// Routes ordered most specific first; the first match wins.
#[derive(Debug)]
pub struct RouteTable<T> {
    entries: Vec<(Matcher, T)>,
}

impl<T> RouteTable<T> {
    pub fn new(entries: impl IntoIterator<Item = (Matcher, T)>) -> Self {
        let mut entries: Vec<_> = entries.into_iter().collect();
        entries.sort_by_key(|(m, _)| std::cmp::Reverse(m.specificity()));
        Self { entries }
    }

    /// The route for a request. `host` is lower-case without port; `path` is normalized.
    pub fn find(&self, host: Option<&str>, method: &Method, path: &str) -> Option<&T> {
        let path = match path.strip_suffix('/') {
            Some(p) if !p.is_empty() => p,
            _ => path,
        };
        self.entries
            .iter()
            .find(|(m, _)| m.matches(host, method, path))
            .map(|(_, t)| t)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Pairs of routes (earlier, later) that could match one request with equal specificity.
pub fn ambiguities<'a>(
    routes: impl Iterator<Item = &'a RouteConfig>,
) -> Vec<(&'a RouteConfig, &'a RouteConfig)> {
    let all: Vec<&RouteConfig> = routes.collect();
    let mut out = Vec::new();
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            if Matcher::of(a).overlaps(&Matcher::of(b)) {
                out.push((*a, *b));
            }
        }
    }
    out
}

/// The request's host, lower-case and without port: HTTP/2 carries it in the URI authority,
/// HTTP/1 in `Host`.
pub fn request_host<'a>(uri_host: Option<&'a str>, host_header: Option<&'a str>) -> Option<String> {
    let raw = uri_host.or(host_header)?;
    let without_port = if let Some(rest) = raw.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else {
        raw.rsplit_once(':').map_or(raw, |(h, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                raw
            }
        })
    };
    Some(without_port.trim_end_matches('.').to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn normalization_cases() {
        let ok = [
            ("/", "/"),
            ("//a///b", "/a/b"),
            ("/a/./b/.", "/a/b/"),
            ("/a/b/../c", "/a/c"),
            ("/a/%2e%2E/c", "/c"),
            ("/%61%62%63", "/abc"),
            ("/a%7e%5f", "/a~_"),
            ("/caf%c3%a9", "/caf%C3%A9"),
            ("/café", "/caf%C3%A9"),
            ("//ap/%5f/\u{15a}../..", "/ap/_/"),
            ("/a/b/", "/a/b/"),
            ("/A/B", "/A/B"),
            ("/a%20b", "/a%20b"),
        ];
        for (raw, want) in ok {
            assert_eq!(normalize_path(raw).as_deref(), Ok(want), "{raw}");
        }
        let bad = [
            ("a/b", PathError::NotAbsolute),
            ("", PathError::NotAbsolute),
            ("/..", PathError::EscapesRoot),
            ("/a/../..", PathError::EscapesRoot),
            ("/%2e%2e/x", PathError::EscapesRoot),
            ("/a%2fb", PathError::EncodedSeparator),
            ("/a%2Fb", PathError::EncodedSeparator),
            ("/a%5cb", PathError::EncodedSeparator),
            ("/a%00", PathError::EncodedSeparator),
            ("/a\\b", PathError::Backslash),
            ("/a%0a", PathError::ControlCharacter),
            ("/%ff", PathError::NotUtf8),
            ("/%c3", PathError::NotUtf8),
            ("/%zz", PathError::BadEscape),
            ("/%4", PathError::BadEscape),
        ];
        for (raw, want) in bad {
            assert_eq!(normalize_path(raw), Err(want), "{raw}");
        }
        assert_eq!(
            normalize_path(&format!("/{}", "a".repeat(MAX_PATH_BYTES))),
            Err(PathError::TooLong)
        );
    }

    fn m(path: PathMatch, host: Option<&str>, methods: Option<&[&str]>) -> Matcher {
        Matcher {
            path,
            host: host.map(str::to_owned),
            methods: methods.map(|ms| ms.iter().map(|s| s.parse().unwrap()).collect()),
        }
    }

    fn prefix(p: &str) -> PathMatch {
        PathMatch::Prefix(p.to_owned())
    }

    #[test]
    fn specificity_rules() {
        let table = RouteTable::new([
            (m(prefix("/"), None, None), "root"),
            (m(prefix("/a"), None, None), "a"),
            (m(prefix("/a/b"), None, None), "ab"),
            (m(PathMatch::Exact("/a/b".into()), None, None), "exact"),
            (m(prefix("/a"), Some("h.example"), None), "host"),
            (m(prefix("/a"), None, Some(&["POST"])), "post"),
        ]);
        let get = Method::GET;
        let post = Method::POST;
        assert_eq!(table.find(None, &get, "/a/b"), Some(&"exact"));
        assert_eq!(
            table.find(None, &get, "/a/b/"),
            Some(&"exact"),
            "trailing slash"
        );
        assert_eq!(table.find(None, &get, "/a/b/c"), Some(&"ab"));
        assert_eq!(
            table.find(None, &get, "/a/bc"),
            Some(&"a"),
            "whole segments only"
        );
        assert_eq!(
            table.find(Some("h.example"), &post, "/a/x"),
            Some(&"host"),
            "host beats methods"
        );
        assert_eq!(table.find(None, &post, "/a/x"), Some(&"post"));
        assert_eq!(table.find(None, &get, "/b"), Some(&"root"));
        let empty: RouteTable<()> = RouteTable::new([]);
        assert_eq!(empty.find(None, &get, "/"), None);
    }

    #[test]
    fn host_is_lowercased_and_port_stripped() {
        assert_eq!(
            request_host(None, Some("API.Example.com:8080")).as_deref(),
            Some("api.example.com")
        );
        assert_eq!(
            request_host(Some("h.example"), Some("other")).as_deref(),
            Some("h.example")
        );
        assert_eq!(request_host(None, Some("[::1]:80")).as_deref(), Some("::1"));
        assert_eq!(request_host(None, None), None);
    }

    proptest! {
        // Normal form is a fixed point, never climbs above the root, and never holds dot
        // segments or empty segments.
        #[test]
        fn normal_form_is_stable(raw in "/[a-zA-Z0-9%./_~-]{0,40}") {
            if let Ok(n) = normalize_path(&raw) {
                prop_assert_eq!(normalize_path(&n), Ok(n.clone()));
                prop_assert!(n.starts_with('/'));
                prop_assert!(!n.contains("//"));
                let segs: Vec<&str> = n.trim_end_matches('/').split('/').skip(1).collect();
                prop_assert!(segs.iter().all(|s| *s != "." && *s != ".."), "{}", n);
            }
        }
    }
}
