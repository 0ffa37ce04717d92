//! Path normalization: the one normal form every request path is matched and forwarded in.
//!
//! Percent-encoded unreserved characters are decoded, duplicate slashes collapse, and `.` and
//! `..` segments are resolved; a path that escapes the root, encodes a separator or NUL, or is
//! not UTF-8 once decoded is refused (the proxy answers 400).

use std::borrow::Cow;
use std::fmt;

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
    /// A path parameter on an empty or dot segment (`/a/;x/b`, `/a/..;/b`): Java backends
    /// themselves read it in different ways (Tomcat drops the emptied segment, Jetty keeps it
    /// before it resolves a `..`), so no route can be told to be the one that serves it.
    AmbiguousParameter,
}

/// A segment of dots and spaces only, past `.` and `..` (`/a/.../b`, `/a/.%20/b`): a Windows
/// server trims it to nothing, and no route can be told to be the one that serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DotsOnly;

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
            PathError::AmbiguousParameter => {
                "a path parameter (';') stands on an empty or dot segment"
            }
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
    normalized(raw).map(Cow::into_owned)
}

/// [`normalize_path`], borrowing the path when it is already in normal form (most are):
/// one pass over its bytes and no allocation.
pub fn normalized(raw: &str) -> Result<Cow<'_, str>, PathError> {
    if is_normal(raw) {
        Ok(Cow::Borrowed(raw))
    } else {
        normalize_slow(raw).map(Cow::Owned)
    }
}

/// Whether `normalize_slow` would answer `raw` itself: absolute, not too long, visible
/// ASCII without `%`, a backslash, `?` or `#`, and no empty (but the last), `.` or `..`
/// segment.
fn is_normal(raw: &str) -> bool {
    let bytes = raw.as_bytes();
    if bytes.first() != Some(&b'/') || bytes.len() > MAX_PATH_BYTES {
        return false;
    }
    if !bytes
        .iter()
        .all(|&b| (0x21..0x7f).contains(&b) && !matches!(b, b'%' | b'\\' | b'?' | b'#'))
    {
        return false;
    }
    let mut segments = raw[1..].split('/').peekable();
    while let Some(segment) = segments.next() {
        let last = segments.peek().is_none();
        if matches!(segment, "." | "..") || (segment.is_empty() && !last) {
            return false;
        }
    }
    true
}

fn normalize_slow(raw: &str) -> Result<String, PathError> {
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
        if matches!(b, b' ' | b'?' | b'#') {
            // Only a config file can hold these raw (a request's path ends at `?` and `#`,
            // and a space ends its target): encoded as a client sends them.
            push_escape(&mut text, b);
        } else if b.is_ascii() {
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

/// A normal path as Java backends read it: each segment without its path parameters (from a
/// raw `;` to the segment's end). Servlet containers and Spring serve `/api;x/v1` and
/// `/api/v1;jsessionid=1` as `/api/v1`, where most other backends read the path as written;
/// a request whose route the two readings choose differently is refused (the proxy's request
/// filter). A parameter on an empty or dot segment (`/;x/`, `/..;/`: Tomcat and Jetty read
/// those differently from each other, and `..;` is the classic way past a proxy's rules) is
/// [`PathError::AmbiguousParameter`]. An encoded `%3B` is data, as those servers read it.
pub fn without_parameters(normal: &str) -> Result<Cow<'_, str>, PathError> {
    if !normal.contains(';') {
        return Ok(Cow::Borrowed(normal));
    }
    let mut segments = normal.split('/').skip(1).peekable();
    while let Some(segment) = segments.next() {
        let bare = segment.split(';').next().unwrap_or_default();
        // The last segment emptied (`/api/;jsessionid=1`) is a trailing slash to every
        // reader; any other emptied or dot segment is not read alike.
        let last = segments.peek().is_none();
        if bare.len() < segment.len() && (matches!(bare, "." | "..") || (bare.is_empty() && !last))
        {
            return Err(PathError::AmbiguousParameter);
        }
    }
    Ok(parameters_dropped(normal))
}

/// `path` with each segment cut at its first raw `;`, whatever is left: what the access log
/// writes (a session id there is a cookie's equal), and [`without_parameters`]'s reading.
pub fn parameters_dropped(path: &str) -> Cow<'_, str> {
    if !path.contains(';') {
        return Cow::Borrowed(path);
    }
    let mut cut = String::with_capacity(path.len());
    for (i, segment) in path.split('/').enumerate() {
        if i > 0 {
            cut.push('/');
        }
        cut.push_str(segment.split(';').next().unwrap_or_default());
    }
    Cow::Owned(cut)
}

/// A normal path as Windows servers read it (IIS and HTTP.sys, whose file names cannot end
/// so): each segment without its trailing dots and spaces, `/ingest.` and `/ingest%20` being
/// `/ingest`, where other backends read the path as written; a request whose route the two
/// readings choose differently is refused (the proxy's request filter). `None` when no
/// segment ends so.
pub fn without_trailing_dots(normal: &str) -> Result<Option<String>, DotsOnly> {
    // A segment's name (before its parameters, which a Java reading drops) and the segment
    // as a whole: `/ingest.;x` is `/ingest.` to Tomcat, then `/ingest` to Windows.
    fn name(segment: &str) -> &str {
        segment.split(';').next().unwrap_or_default()
    }
    fn trim(mut bare: &str) -> &str {
        while let Some(rest) = bare.strip_suffix('.').or_else(|| bare.strip_suffix("%20")) {
            bare = rest;
        }
        bare
    }
    let trailing = |s: &str| s.ends_with('.') || s.ends_with("%20");
    if !normal.split('/').any(|s| trailing(s) || trailing(name(s))) {
        return Ok(None);
    }
    let mut trimmed = String::with_capacity(normal.len());
    for segment in normal.split('/').skip(1) {
        trimmed.push('/');
        let (own, parameters) = segment.split_at(name(segment).len());
        let bare = trim(own);
        if bare.is_empty() && !own.is_empty() {
            return Err(DotsOnly);
        }
        trimmed.push_str(bare);
        trimmed.push_str(trim(parameters));
    }
    Ok(Some(trimmed))
}

/// A normal path as older Undertow reads it (before 2.0.30: WildFly 18, Spring Boot 2.2):
/// up to its first raw `;`, the rest taken for parameters (`/login;x/foo` is `/login`).
pub fn before_parameters(normal: &str) -> &str {
    normal.find(';').map_or(normal, |at| &normal[..at])
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The borrowed fast path answers what the full normalization does, for every path
        /// it takes.
        #[test]
        fn a_path_already_normal_is_borrowed_unchanged(raw in "(/|/\\.|/\\.\\.|/a|/%2[eEfF]|/%41|\\\\|/b\\.c|/~| |\\?|#){0,8}") {
            prop_assert_eq!(normalized(&raw).map(Cow::into_owned), normalize_slow(&raw));
            if is_normal(&raw) {
                prop_assert_eq!(normalize_slow(&raw), Ok(raw.clone()));
            }
        }
    }

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
            ("/a b", "/a%20b"),
            ("/q?b", "/q%3Fb"),
            ("/h#b", "/h%23b"),
            ("/q%3fb%23", "/q%3Fb%23"),
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

    #[test]
    fn a_path_as_windows_servers_trim_its_segments() {
        for (path, trimmed) in [
            ("/ingest/doc", None),
            ("/ingest.", Some("/ingest")),
            ("/ingest%20./x", Some("/ingest/x")),
            // A segment's name before its parameters, and the segment as a whole.
            ("/ingest.;x", Some("/ingest;x")),
            (
                "/ingest%20;jsessionid=1/doc",
                Some("/ingest;jsessionid=1/doc"),
            ),
            ("/ingest;x.", Some("/ingest;x")),
            ("/ingest;x", None),
        ] {
            assert_eq!(
                without_trailing_dots(path),
                Ok(trimmed.map(str::to_owned)),
                "{path}"
            );
        }
        for dots in ["/a/.../b", "/a/.%20/b", "/a/..;x"] {
            assert_eq!(without_trailing_dots(dots), Err(DotsOnly), "{dots}");
        }
    }

    #[test]
    fn a_path_without_its_parameters_as_java_backends_read_it() {
        let cases = [
            ("/api/v1", Ok("/api/v1")),
            ("/api;x/v1", Ok("/api/v1")),
            ("/api/v1;jsessionid=1", Ok("/api/v1")),
            ("/api/v1;a;b/doc", Ok("/api/v1/doc")),
            ("/api/v1;/", Ok("/api/v1/")),
            ("/api/v1%3Bx", Ok("/api/v1%3Bx")),
            ("/api/..x;y", Ok("/api/..x")),
            ("/x/..;/api/v1", Err(PathError::AmbiguousParameter)),
            ("/x/.;y/api", Err(PathError::AmbiguousParameter)),
            ("/;x/api", Err(PathError::AmbiguousParameter)),
            ("/api/;x", Ok("/api/")),
            ("/;jsessionid=A", Ok("/")),
            ("/api/;x/y", Err(PathError::AmbiguousParameter)),
            ("/api/..;", Err(PathError::AmbiguousParameter)),
            ("/api/ocr;/;/..;/doc", Err(PathError::AmbiguousParameter)),
            ("/..;/api", Err(PathError::AmbiguousParameter)),
        ];
        for (normal, want) in cases {
            assert_eq!(
                without_parameters(normal).as_deref().map_err(|e| *e),
                want,
                "{normal}"
            );
        }
    }

    #[test]
    fn older_undertow_ends_a_path_at_its_first_parameter() {
        assert_eq!(before_parameters("/login;x/foo"), "/login");
        assert_eq!(before_parameters("/a/b;x"), "/a/b");
        assert_eq!(before_parameters("/a/b"), "/a/b");
        assert_eq!(before_parameters("/;x"), "/");
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
