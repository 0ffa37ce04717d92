//! The compiled route table: request -> the route that owns it.
//!
//! Matching is by specificity, never by file order: an exact `path` beats a `path_prefix`, a
//! longer prefix beats a shorter one, a route with `host` beats one without, and one with
//! `methods` beats one without. Paths are case sensitive. A trailing slash does not change
//! which route matches (`/a/b/` is matched as `/a/b`), so it cannot slip past a limit.
//!
//! A leaf room: it knows nothing of the config file; config builds [`Matcher`]s from routes.

mod path;

pub use path::{
    before_parameters, normalize_path, normalized, parameters_dropped, without_parameters,
    without_trailing_dots, PathError, MAX_PATH_BYTES,
};

use http::Method;

/// What a route's path matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    /// `path`: this normalized path only.
    Exact(String),
    /// `path_prefix`: this path and everything below it, by whole segments.
    Prefix(String),
}

/// What a route matches on, compiled from its config.
#[derive(Debug, Clone)]
pub struct Matcher {
    pub path: PathMatch,
    pub host: Option<String>,
    pub methods: Option<Vec<Method>>,
}

impl Matcher {
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
            && self.methods.as_ref().is_none_or(|m| allows(m, method))
    }

    /// Whether some request could match both with equal specificity.
    fn overlaps(&self, other: &Matcher) -> bool {
        let methods_meet = match (&self.methods, &other.methods) {
            (Some(a), Some(b)) => a.iter().any(|m| allows(b, m)) || b.iter().any(|m| allows(a, m)),
            _ => true,
        };
        self.specificity() == other.specificity()
            && self.path == other.path
            && self.host == other.host
            && methods_meet
    }
}

/// Whether a route's `methods` admit `method`: a route for `GET` also matches `HEAD` (as
/// nginx's `limit_except` does), so a HEAD cannot slip past a GET limit to a less specific
/// route.
fn allows(methods: &[Method], method: &Method) -> bool {
    methods.contains(method) || (*method == Method::HEAD && methods.contains(&Method::GET))
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

/// Pairs of entries (earlier, later) that could match one request with equal specificity.
pub fn ambiguities<T: Copy>(entries: impl IntoIterator<Item = (Matcher, T)>) -> Vec<(T, T)> {
    let all: Vec<(Matcher, T)> = entries.into_iter().collect();
    let mut out = Vec::new();
    for (i, (a, ta)) in all.iter().enumerate() {
        for (b, tb) in &all[i + 1..] {
            if a.overlaps(b) {
                out.push((*ta, *tb));
            }
        }
    }
    out
}

/// A field name of letters, digits and `-` only: no CGI server reads it as another name.
pub fn plain_field_name(name: &str) -> bool {
    name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// A field name as CGI servers fold it into a variable: every character but a letter or a
/// digit read as `-` (`X_Real.IP` is `X-Real-IP`).
pub fn folded_field_name(name: &str) -> std::borrow::Cow<'_, str> {
    if plain_field_name(name) {
        return std::borrow::Cow::Borrowed(name);
    }
    let folded = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' });
    std::borrow::Cow::Owned(folded.collect())
}

/// Whether a method is one the gateway takes at its edge, and so one a route can match:
/// upper-case letters, `-` and `_` (nginx's rule). Methods are case-sensitive (RFC 9110,
/// 9.1): `post` matched no `methods = ["POST"]` route and went to a less specific one,
/// unlimited, while a backend that folds the case serves it as the POST it limits.
pub fn plain_method(method: &Method) -> bool {
    (method.as_str().bytes()).all(|b| b.is_ascii_uppercase() || b == b'-' || b == b'_')
}

/// The request's host, lower-case and without port: HTTP/2 carries it in the URI authority,
/// HTTP/1 in `Host`.
pub fn request_host<'a>(uri_host: Option<&'a str>, host_header: Option<&'a str>) -> Option<String> {
    let raw = uri_host.or(host_header)?;
    let without_port = if raw.starts_with('[') {
        raw.find(']').map_or(raw, |end| &raw[..=end])
    } else {
        raw.rsplit_once(':').map_or(raw, |(h, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                raw
            }
        })
    };
    Some(host_form(without_port))
}

/// A host as requests and routes are compared in: an IPv6 address (bracketed or not) in one
/// form (`[0:0::1]` is `::1`), a name in lower case without the trailing dot of its fully
/// qualified form (`API.example.com.` is `api.example.com`).
pub fn host_form(host: &str) -> String {
    let inside = host
        .strip_prefix('[')
        .map_or(host, |h| h.strip_suffix(']').unwrap_or(h));
    // A colon is no name's: an address in its one form, or else kept as it came (`::1.` is
    // no address and no name either). Only such a host is parsed as an address.
    if inside.contains(':') {
        return inside
            .parse::<std::net::Ipv6Addr>()
            .map_or_else(|_| inside.to_ascii_lowercase(), |ip| ip.to_string());
    }
    let name = inside.strip_suffix('.').unwrap_or(inside);
    name.to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_name_folds_as_cgi_servers_fold_it() {
        assert!(plain_field_name("x-real-ip") && !plain_field_name("x_real.ip"));
        assert_eq!(folded_field_name("x-real-ip"), "x-real-ip");
        assert_eq!(folded_field_name("x_real.ip"), "x-real-ip");
        assert_eq!(folded_field_name("x~sentinel!tier"), "x-sentinel-tier");
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
        let get_only = RouteTable::new([
            (m(prefix("/"), None, None), "root"),
            (m(prefix("/a"), None, Some(&["GET"])), "get"),
        ]);
        assert_eq!(
            get_only.find(None, &Method::HEAD, "/a/x"),
            Some(&"get"),
            "HEAD is matched by a GET route"
        );
        assert_eq!(get_only.find(None, &post, "/a/x"), Some(&"root"));
        assert_eq!(table.find(None, &get, "/b"), Some(&"root"));
        let empty: RouteTable<()> = RouteTable::new([]);
        assert_eq!(empty.find(None, &get, "/"), None);
    }

    #[test]
    fn a_head_route_beside_a_get_route_is_ambiguous() {
        let pairs = ambiguities([
            (m(prefix("/a"), None, Some(&["GET"])), 0),
            (m(prefix("/a"), None, Some(&["HEAD"])), 1),
            (m(prefix("/a"), None, Some(&["POST"])), 2),
            (m(prefix("/b"), None, Some(&["GET"])), 3),
        ]);
        assert_eq!(pairs, vec![(0, 1)]);
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
        assert_eq!(
            request_host(None, Some("[0:0::0:1]")).as_deref(),
            Some("::1")
        );
        assert_eq!(
            request_host(Some("[FE80::A]"), None).as_deref(),
            Some("fe80::a")
        );
        assert_eq!(request_host(None, None), None);
        // A fully qualified name's one trailing dot, never two (an HTTP/2 authority is not
        // refused for it as `Host` is: it must then match no route written without it).
        assert_eq!(
            request_host(None, Some("api.example.:80")).as_deref(),
            Some("api.example")
        );
        assert_eq!(
            request_host(Some("api.example.."), None).as_deref(),
            Some("api.example.")
        );
        // No address with a dot after it, and so no route's.
        assert_eq!(request_host(Some("[::1.]"), None).as_deref(), Some("::1."));
    }
}
