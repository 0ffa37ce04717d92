//! What a request head must be before anything is done with it: one way to frame its body
//! and a `Host` that names a host, read the same by the gateway and the upstream.

use pingora_http::RequestHeader;

/// The body length the head announces (`None` inside: no `Content-Length`), or `None` when
/// the head is refused:
/// - RFC 9110, 8.6: a `Content-Length` that is not one run of digits (`5, 5`, `+5`), or two
///   of them: the upstream could frame the body otherwise than the gateway did;
/// - RFC 9112, 6.1: transfer codings other than one `chunked` (`gzip, chunked`, two fields):
///   Pingora reads the chunks and sends them on as plain `chunked`, so a gzip body would
///   arrive labelled as plain (one whose last coding is not `chunked` Pingora refuses itself);
/// - RFC 9110, 7.2: a `Host` that is not an authority ([`is_authority`]): one with a space, a
///   quote or a byte past ASCII names no host, and would reach the upstream (and its
///   `X-Forwarded-Host`) as it came. Empty is allowed (a target without authority). The
///   same of the target's authority (HTTP/2's `:authority`, an absolute-form target), which
///   routes the request where it has no `Host`: `api.example..` would otherwise miss a
///   `host = "api.example"` route over HTTP/2 and reach the route without a host.
pub fn announced_length(req: &RequestHeader) -> Option<Option<u64>> {
    if req
        .headers
        .get(http::header::HOST)
        .is_some_and(|h| !is_authority(h.as_bytes()))
        || target_authority(req).is_some_and(|a| !is_authority(a.as_bytes()))
    {
        return None;
    }
    let mut codings = req.headers.get_all(http::header::TRANSFER_ENCODING).iter();
    if let Some(coding) = codings.next() {
        let chunked = coding
            .as_bytes()
            .trim_ascii()
            .eq_ignore_ascii_case(b"chunked");
        if !chunked || codings.next().is_some() {
            return None;
        }
    }
    let mut lengths = req.headers.get_all(http::header::CONTENT_LENGTH).iter();
    let Some(length) = lengths.next() else {
        return Some(None);
    };
    let digits = !length.is_empty() && length.as_bytes().iter().all(u8::is_ascii_digit);
    if !digits || lengths.next().is_some() {
        return None;
    }
    // Digits only: past u64, larger than any limit.
    let n = std::str::from_utf8(length.as_bytes())
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    Some(Some(n.unwrap_or(u64::MAX)))
}

/// A field some backends take the request's method or path from instead of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Override {
    /// `X-HTTP-Method-Override`, `X-HTTP-Method`, `X-Method-Override` (Rack, Express's
    /// method-override, Symfony, Laravel, ASP.NET).
    Method,
    /// `X-Original-URL`, `X-Rewrite-URL` (Symfony and Zend behind IIS).
    Path,
}

/// Which override the field `name` (lower case, as the header map holds it) is, also under
/// the spellings a CGI server folds into it (`x_original_url`). Called for every field of
/// every request: a length and a first byte turn nearly all away.
pub fn override_of(name: &str) -> Option<Override> {
    if !matches!(name.len(), 13 | 14 | 17 | 22) || !name.starts_with('x') {
        return None;
    }
    let folded = crate::routing::folded_field_name(name);
    match folded.as_ref() {
        "x-http-method-override" | "x-http-method" | "x-method-override" => Some(Override::Method),
        "x-original-url" | "x-rewrite-url" => Some(Override::Path),
        _ => None,
    }
}

/// The method an override field (or a `_method` parameter) names, as the backends read it:
/// upper-cased. `Some(None)` for an empty value, which they ignore; `None` for one that is
/// no method the gateway takes.
pub fn override_method(value: &[u8]) -> Option<Option<http::Method>> {
    let value = value.trim_ascii();
    if value.is_empty() {
        return Some(None);
    }
    let method = http::Method::from_bytes(&value.to_ascii_uppercase()).ok()?;
    crate::routing::plain_method(&method).then_some(Some(method))
}

/// The path an `X-Original-URL` or `X-Rewrite-URL` names, normalized as a request's is, its
/// query and fragment left out. `Some(None)` for an empty value; `None` for one that is no
/// absolute path (a full URL included) or that no request's path could be.
pub fn override_path(value: &[u8]) -> Option<Option<String>> {
    let value = std::str::from_utf8(value.trim_ascii()).ok()?;
    if value.is_empty() {
        return Some(None);
    }
    let path = value.split(['?', '#']).next().unwrap_or_default();
    if !path.starts_with('/') || path.starts_with("//") {
        return None;
    }
    // Backends take the field as written, without resolving `..` (`/ingest/../x` may be an
    // `/ingest/{id}` of theirs) or decoding: only a path already in normal form is read.
    match crate::routing::normalized(path).ok()? {
        std::borrow::Cow::Borrowed(normal) => Some(Some(normal.to_owned())),
        std::borrow::Cow::Owned(_) => None,
    }
}

/// Whether the request's `Connection` names what Pingora refuses to send on (a protected
/// field, `host` or an `x-forwarded-*` the gateway writes; a pseudo-header; a token with
/// bytes no token may hold; ten names or more) once the request was decided, which then
/// cost a token for a 400. Refused before the route and the limiter instead, by the same
/// rule (`pingora-proxy`'s `ConnectionNominations`).
pub fn connection_refused(req: &RequestHeader) -> bool {
    let mut fields = req
        .headers
        .get_all(http::header::CONNECTION)
        .iter()
        .peekable();
    if fields.peek().is_none() {
        return false;
    }
    let mut names = 0;
    for token in fields
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
    {
        names += 1;
        let protected = [
            "host",
            "x-forwarded-for",
            "x-forwarded-host",
            "x-forwarded-proto",
        ]
        .iter()
        .any(|p| token.eq_ignore_ascii_case(p.as_bytes()));
        if names >= 10 || protected || !token.iter().all(|b| is_tchar(*b)) {
            return true;
        }
    }
    false
}

/// RFC 9110, 5.6.2: a byte of a `token`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The authority the request's target names: HTTP/2's `:authority`, or an HTTP/1
/// absolute-form target's (`GET http://host/path`, which Pingora takes off the URI).
pub fn target_authority(req: &RequestHeader) -> Option<&str> {
    match req.uri.authority() {
        Some(a) => Some(a.as_str()),
        None => super::forwarded::absolute_form_authority(req),
    }
}

/// Whether `v` is an authority as a `Host` carries it (RFC 3986, 3.2): a host, then
/// optionally `:` and a port of digits. The host is an IP literal in brackets, or a name or
/// IPv4 address of letters, digits, `-`, `.` and `_` with no empty label (`a..b`, `a..`:
/// nginx refuses them too; one trailing dot is a fully qualified name). RFC 3986 also lets a
/// name hold `~`, percent-encodings and sub-delimiters, which no DNS name holds: such a host
/// matches no route's `host`, and would reach the upstream as `Host` and `X-Forwarded-Host`
/// as it came, where a backend taking the first of a list (`api.example,other`) serves it
/// as the host whose limit it went around.
/// Userinfo (`@`) is Pingora's to refuse before this. Empty is an authority (a target
/// without one).
pub fn is_authority(v: &[u8]) -> bool {
    // What follows the host: nothing, or `:` and the port.
    let port = match v.strip_prefix(b"[") {
        Some(rest) => {
            let Some(end) = rest.iter().position(|&b| b == b']') else {
                return false;
            };
            let literal = &rest[..end];
            if !literal.iter().all(|&b| name_char(b) || b == b':') || !ip_literal(literal) {
                return false;
            }
            &rest[end + 1..]
        }
        None => {
            let at = v.iter().position(|&b| b == b':').unwrap_or(v.len());
            let name = &v[..at];
            let empty_label = name.first() == Some(&b'.') || name.windows(2).any(|w| w == b"..");
            // A port without a host (`:80`).
            if name.is_empty() && at < v.len() {
                return false;
            }
            if !name.iter().all(|&b| host_name_char(b)) || empty_label {
                return false;
            }
            &v[at..]
        }
    };
    match port.split_first() {
        None => true,
        Some((b':', digits)) => digits.iter().all(u8::is_ascii_digit),
        Some(_) => false,
    }
}

/// What may stand in brackets: an IPv6 address, with a zone after `%25` (RFC 6874) of
/// letters, digits and `-._~`, as interface names are written. RFC 3986 also lets an
/// `IPvFuture` stand there (`v` and hex digits, `.`, then unreserved characters and
/// sub-delimiters), which no address holds yet: refused, as a name's sub-delimiters are
/// ([`is_authority`]). A name in brackets (`[api.example.com]`) is none: it names no host.
fn ip_literal(literal: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(literal) else {
        return false;
    };
    let (address, zone) = text.split_once("%25").unwrap_or((text, "-"));
    let zone_char = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~');
    !zone.is_empty() && zone.bytes().all(zone_char) && address.parse::<std::net::Ipv6Addr>().is_ok()
}

/// A character of a host name or IPv4 address as DNS names are written: a letter, a digit,
/// `-`, `.`, or `_` (some internal names hold it).
fn host_name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_')
}

/// A character of an IP literal's inside (RFC 3986, 3.2.2): unreserved, `%` of a zone's
/// percent-encoding, or a sub-delimiter (an `IPvFuture` may hold them).
fn name_char(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'-' | b'.'
                | b'_'
                | b'~'
                | b'%'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_an_authority_or_nothing() {
        for good in [
            "api.example.com",
            "api.example.com:8443",
            "127.0.0.1:80",
            "[::1]:8080",
            "[fe80::1%25eth0]",
            "xn--bcher-kva.example",
            "_service.internal-host.example",
            "",
        ] {
            assert!(is_authority(good.as_bytes()), "{good:?}");
        }
        for bad in [
            "a b",
            "a\tb",
            "\"a\"",
            "a/b",
            "a\\b",
            "a<b>",
            "a{b}",
            "a|b",
            "a^b",
            "a`b",
            // Where the characters stand: a bracket or colon out of place, a port not of
            // digits, an empty label.
            "a]b",
            "x:abc",
            "a:1:2",
            "[::1",
            "[]",
            "[::1]x",
            "[::1]:8a",
            // A name or a broken address in brackets names no host.
            "[api.example.com]",
            "[1.2.3.4]",
            "[::1::2]",
            "[v.x]",
            "[::1%25]",
            "a[b]",
            "api.example..",
            "a..b:80",
            "..",
            // RFC 3986's other name characters, no DNS name's: a list, a parameter, an
            // encoding.
            "api.example.com,evil.example",
            "api.example.com;x",
            "api%2eexample.com",
            "a~b",
            "a!b",
            "a$b",
            "a&b",
            "a'b",
            "a(b)",
            "a*b",
            "a+b",
            "a=b",
            // Nor in brackets: an `IPvFuture`, a zone of them; nor a port without a host.
            "[v1.fe80::a+en1]",
            "[v1.api.example,evil.example]",
            "[fe80::1%25a,b]",
            "[fe80::1%25%2e]",
            ":80",
        ] {
            assert!(!is_authority(bad.as_bytes()), "{bad:?}");
        }
        assert!(!is_authority(b"\xc3\xa9.example"), "past ASCII");
        assert!(!is_authority(b"a\x00b"), "NUL");
    }

    #[test]
    fn a_head_announces_one_length_in_one_way() {
        let head = |fields: &[(&str, &str)]| {
            let mut r = RequestHeader::build("POST", b"/", None).unwrap();
            for (k, v) in fields {
                r.append_header(k.to_string(), *v).unwrap();
            }
            announced_length(&r)
        };
        assert_eq!(head(&[]), Some(None));
        assert_eq!(head(&[("Content-Length", "007")]), Some(Some(7)));
        assert_eq!(
            head(&[("Content-Length", "99999999999999999999999")]),
            Some(Some(u64::MAX))
        );
        assert_eq!(head(&[("Transfer-Encoding", " Chunked")]), Some(None));
        for refused in [
            &[("Content-Length", "5, 5")][..],
            &[("Content-Length", "+5")],
            &[("Content-Length", "5"), ("Content-Length", "5")],
            &[("Transfer-Encoding", "gzip, chunked")],
            &[
                ("Transfer-Encoding", "chunked"),
                ("Transfer-Encoding", "chunked"),
            ],
            &[("Host", "a b")],
        ] {
            assert_eq!(head(refused), None, "{refused:?}");
        }
    }

    #[test]
    fn override_fields_are_known_by_their_name_and_cgi_spellings() {
        for (name, kind) in [
            ("x-http-method-override", Some(Override::Method)),
            ("x-http-method", Some(Override::Method)),
            ("x-method-override", Some(Override::Method)),
            ("x_http_method_override", Some(Override::Method)),
            ("x-original-url", Some(Override::Path)),
            ("x_original.url", Some(Override::Path)),
            ("x-rewrite-url", Some(Override::Path)),
            ("x-request-id", None),
            ("x-forwarded-for", None),
            ("content-length", None),
        ] {
            assert_eq!(override_of(name), kind, "{name}");
        }
        assert_eq!(override_method(b" post "), Some(Some(http::Method::POST)));
        assert_eq!(override_method(b""), Some(None));
        assert_eq!(override_method(b"P O S T"), None);
        assert_eq!(override_method(b"GET\x01"), None);
        assert_eq!(
            override_path(b"/a/b;x/c?x=1#f"),
            Some(Some("/a/b;x/c".to_owned()))
        );
        assert_eq!(override_path(b" "), Some(None));
        // Read as written by the backends: a path not in normal form is refused, not
        // resolved (`/ingest/../x` is routed as written by some).
        for refused in [
            &b"/a/./b/../c"[..],
            b"/ingest/../x",
            b"/ingest/%2e%2e/x",
            b"/%61",
            b"http://a/b",
            b"//a/b",
            b"a/b",
            b"/%2e%2e/%2e%2e/x",
            b"/a\\b",
        ] {
            assert_eq!(
                override_path(refused),
                None,
                "{:?}",
                String::from_utf8_lossy(refused)
            );
        }
    }
}
