//! One `[[routes]]` entry, and the rules between routes.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use toml::Spanned;

use super::{int_in, route_label};
use crate::config::error::Collector;
use crate::config::raw::{RawConfig, RawIdentity, RawRateLimitHeaders, RawRoute};
use crate::config::*;
use crate::routing::{self, PathError, PathMatch};

/// The names to offer for `written`, a name none of `known` is, as `[a, b]`: all of them
/// when they are few, else the three nearest by edit distance that are near at all (a
/// third of the name's characters, two at least), said as such (a platform's 200 upstreams
/// on one line help no one).
fn nearest<'a>(written: &str, known: impl Iterator<Item = &'a str>) -> String {
    const ALL_UP_TO: usize = 8;
    let known: Vec<&str> = known.collect();
    if known.len() <= ALL_UP_TO {
        return format!("[{}]", known.join(", "));
    }
    let total = known.len();
    let near = (written.chars().count() / 3).max(2);
    let mut close: Vec<(usize, &str)> = (known.iter())
        .map(|k| (edit_distance(written, k), *k))
        .filter(|(d, _)| *d <= near)
        .collect();
    close.sort();
    match close.len() {
        0 => format!("the {total} defined (none is near this name)"),
        n => {
            let names: Vec<&str> = close.iter().take(3).map(|(_, k)| *k).collect();
            format!(
                "[{}] (the nearest {} of {total})",
                names.join(", "),
                n.min(3)
            )
        }
    }
}

/// Levenshtein's distance between `a` and `b`, in characters.
pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let replaced = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = replaced.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

/// The methods of IANA's HTTP Method Registry (RFC 9110's, PATCH, WebDAV's and its
/// extensions'), with QUERY (the safe method with a body) and PURGE (caches'): a route's
/// method outside them is warned of as a likely misspelling.
const REGISTERED_METHODS: &[&str] = &[
    "ACL",
    "BASELINE-CONTROL",
    "BIND",
    "CHECKIN",
    "CHECKOUT",
    "CONNECT",
    "COPY",
    "DELETE",
    "GET",
    "HEAD",
    "LABEL",
    "LINK",
    "LOCK",
    "MERGE",
    "MKACTIVITY",
    "MKCALENDAR",
    "MKCOL",
    "MKREDIRECTREF",
    "MKWORKSPACE",
    "MOVE",
    "OPTIONS",
    "ORDERPATCH",
    "PATCH",
    "POST",
    "PRI",
    "PROPFIND",
    "PROPPATCH",
    "PURGE",
    "PUT",
    "QUERY",
    "REBIND",
    "REPORT",
    "SEARCH",
    "TRACE",
    "UNBIND",
    "UNCHECKOUT",
    "UNLINK",
    "UNLOCK",
    "UPDATE",
    "UPDATEREDIRECTREF",
    "VERSION-CONTROL",
];

pub(super) fn route(
    c: &mut Collector,
    index: usize,
    spanned: &Spanned<RawRoute>,
    raw: &RawConfig,
    upstreams: &BTreeMap<String, Arc<UpstreamConfig>>,
    server_max_body_bytes: Option<u64>,
) -> (Option<RouteConfig>, Option<Matcher>) {
    let r = spanned.get_ref();
    let id_text = r.endpoint_id.as_ref().map_or("?", |v| v.get_ref().as_str());
    let label = route_label(index, id_text);
    let label = Some(label.as_str());
    let before = c.errors.len();
    // A required field left out is said with the route's other problems, at the route.
    let missing = |c: &mut Collector, field: &str, example: &str| {
        c.push(
            Some(&spanned.span()),
            label,
            format!("`{field}` is missing: it is required, e.g. {example}"),
        );
    };

    let endpoint_id = match &r.endpoint_id {
        None => {
            missing(c, "endpoint_id", "endpoint_id = \"a.name\"");
            None
        }
        Some(id) => {
            let parsed = EndpointId::parse(id.get_ref());
            if parsed.is_none() {
                c.push(
                    Some(&id.span()),
                    label,
                    format!(
                        "endpoint_id = \"{}\" is not valid: use 1 to 128 of a-z, 0-9, '.', '_', '-'",
                        super::cut(id_text)
                    ),
                );
            }
            parsed
        }
    };
    let path = route_path(c, label, spanned);
    let methods = r.methods.as_ref().map(|m| {
        if m.get_ref().is_empty() {
            c.push(
                Some(&m.span()),
                label,
                "methods = [] matches nothing: leave methods out to match any method".into(),
            );
        }
        let all = m.get_ref();
        // Listed before (in any case: `get` is `GET`): said (it matches as once).
        let again: std::collections::HashMap<usize, usize> =
            super::listed_again(all, |w| w.get_ref().to_ascii_uppercase())
                .into_iter()
                .collect();
        (all.iter().enumerate())
            .filter_map(|(i, written)| {
                let (name, at) = (written.get_ref(), Some(written.span()));
                if let Some(j) = again.get(&i) {
                    c.warn(at.as_ref(), label, format!("methods[{i}] = \"{name}\" is listed already as methods[{j}]: keep one"));
                }
                match http::Method::from_bytes(name.to_ascii_uppercase().as_bytes()) {
                    Ok(method)
                        if method == http::Method::CONNECT || method == http::Method::TRACE =>
                    {
                        c.warn(
                            at.as_ref(),
                            label,
                            format!("methods[{i}] = \"{name}\" never reaches a route: the gateway answers CONNECT and TRACE 405 itself (it is no tunnel, and a backend that echoes TRACE hands a page's script the request's cookies)"),
                        );
                        Some(method)
                    }
                    // What the edge lets through (letters, `-`, `_`): a method of other
                    // characters is answered 400 before any route, and would match nothing.
                    Ok(method) if !crate::routing::plain_method(&method) => {
                        c.warn(
                            at.as_ref(),
                            label,
                            format!("methods[{i}] = \"{name}\" never reaches a route: requests whose method holds more than letters, '-' and '_' are answered 400"),
                        );
                        Some(method)
                    }
                    // A method no registry knows is most often a misspelling (`POTS`), which
                    // leaves the method meant to another route: a catch-all's limit, or none.
                    Ok(method) if !REGISTERED_METHODS.contains(&method.as_str()) => {
                        c.warn(
                            at.as_ref(),
                            label,
                            format!("methods[{i}] = \"{name}\" is no registered HTTP method (IANA's registry, or PURGE): if it is a misspelling, the method meant goes to another route (a catch-all's limit, or none); keep it if clients send it"),
                        );
                        Some(method)
                    }
                    Ok(method) => Some(method),
                    Err(_) => {
                        c.push(
                            at.as_ref(),
                            label,
                            format!("methods[{i}] = \"{name}\" is not an HTTP method: write a method's name, such as \"GET\" or \"POST\" (letters, '-' and '_')"),
                        );
                        None
                    }
                }
            })
            .collect::<Vec<_>>()
    });
    let host = r.host.as_ref().and_then(|h| {
        // Kept in the form requests' hosts are compared in: the fully qualified form
        // (`api.example.com.`) is the same host, an IPv6 address is bracketed as a `Host`
        // carries it or not (`[0:0::1]` is `::1`).
        let raw = h.get_ref();
        let v = crate::routing::host_form(raw);
        // An IPv6 address bare or in both brackets (`[::1` is neither).
        let bracketed = raw.starts_with('[') && raw.ends_with(']');
        if v.parse::<std::net::Ipv6Addr>().is_ok() && (bracketed || !raw.contains(['[', ']'])) {
            return Some(v);
        }
        // `_` is no host name's, yet internal names carry it and a `Host` may; a label
        // neither starts nor ends with `-` and holds at most 63 characters (RFC 1123).
        let valid = !v.is_empty()
            && !raw.contains(['[', ']'])
            && v.len() <= 253
            && v.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
            && v.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            });
        if !valid {
            c.push(Some(&h.span()), label, format!("host = \"{}\" is not a host name: write it without scheme or port, such as \"api.example.com\" (an IPv6 address as \"[::1]\")", h.get_ref()));
        }
        valid.then_some(v)
    });
    // What the route matches, when that much is valid: its clash with another route is
    // reported beside its other problems.
    let methods_valid = r.methods.as_ref().is_none_or(|m| {
        methods
            .as_ref()
            .is_some_and(|v| !v.is_empty() && v.len() == m.get_ref().len())
    });
    let matcher = match (&path, methods_valid, r.host.is_none() || host.is_some()) {
        (Some(path), true, true) => Some(Matcher {
            path: path.clone(),
            host: host.clone(),
            methods: methods.clone(),
        }),
        _ => None,
    };
    let upstream = match &r.upstream {
        None => {
            missing(
                c,
                "upstream",
                "upstream = \"<a name of an [upstreams.NAME] table>\"",
            );
            None
        }
        Some(name) => {
            let found = upstreams.get(name.get_ref()).cloned();
            if found.is_none() && !raw.upstreams.contains_key(name.get_ref()) {
                let known = nearest(name.get_ref(), raw.upstreams.keys().map(String::as_str));
                // An empty name is no upstream's (none may be defined with it).
                let message = match name.get_ref().trim().is_empty() {
                    true => format!(
                        "upstream = \"{}\" names no upstream: use one of {known}",
                        name.get_ref(),
                    ),
                    false => format!(
                        "upstream = \"{}\" is not defined: define [upstreams.{}] or use one of {known}",
                        name.get_ref(),
                        super::shape::key_shown(name.get_ref()),
                    ),
                };
                c.push(Some(&name.span()), label, message);
            }
            found
        }
    };
    // A WebSocket's upgrade is HTTP/1.1's: an HTTP/2 upstream cannot take one.
    if let (Some(ws), Some(up)) = (r.websocket.as_ref(), upstream.as_ref()) {
        if *ws.get_ref() && up.http2 {
            c.push(Some(&ws.span()), label, format!("websocket = true needs an HTTP/1.1 upstream: upstreams.{} has http2 = true (a WebSocket's upgrade is HTTP/1.1's; give the WebSocket route an upstream of its own without http2)", super::shape::key_shown(&up.name)));
        }
    }
    let limits = limits(c, label, spanned);
    let algorithm = limits.as_ref().map(|(l, _)| match l.first() {
        Some(first) => first.algorithm,
        None => Algorithm::None,
    });
    // An unknown algorithm is already an error; do not pile an identity error on it.
    let limited = algorithm.is_some_and(|a| a != Algorithm::None);
    let identity = identity(c, label, spanned, limited, raw);
    let tiers = tiers(c, label, spanned, identity.as_ref(), limits.as_ref());
    let policy = policy(c, label, r, endpoint_id, limits, tiers);

    if c.errors.len() > before {
        return (None, matcher);
    }
    if let (Some(IdentitySource::Header(name)), Some(p), Some(scope)) =
        (&identity, &policy, &r.emergency_scope)
    {
        if p.emergency_per_identity && p.fail_mode == FailMode::FailOpen {
            c.warn(Some(&scope.span()), label, format!("emergency_scope = \"identity\" with identity = {{ header = \"{name}\" }}: a client chooses its own header value, and each value gets an emergency bucket of its own, so during an outage a client sending new values is limited only by the 10 000 buckets kept (use api_key or jwt, whose identities a client cannot make up)"));
        }
    }
    // A bucket that never refills keeps its key for ever (it has no time to live): made up
    // header values are keys that stay, which a `noeviction` Redis keeps until it is full;
    // so are the addresses of an IPv6 /64, each a caller of its own past a prefix of 64.
    let ipv6_prefix = (raw.server.as_ref())
        .and_then(|s| s.get_ref().ipv6_identity_prefix.as_ref())
        .map_or(128, |p| *p.get_ref());
    let made_up = match &identity {
        Some(IdentitySource::Header(name)) => Some(format!("identity = {{ header = \"{name}\" }} every value a client makes up")),
        Some(IdentitySource::ClientIp) if ipv6_prefix > 64 => Some(format!("identity = \"client_ip\" keyed by IPv6 addresses of {ipv6_prefix} bits (server.ipv6_identity_prefix) every address of a client's /64")),
        _ => None,
    };
    if let (Some(made_up), Some(p)) = (made_up, &policy) {
        let quota = (p.limits.iter()).find(|l| {
            !l.global
                && matches!(
                    l.algorithm,
                    Algorithm::TokenBucket {
                        refill_micro_per_sec: 0,
                        ..
                    }
                )
        });
        if let Some(quota) = quota {
            let at = (r.refill_rate_micro_per_sec.as_ref()).map_or(spanned.span(), |v| v.span());
            let limit = match p.several {
                true => format!("limit \"{}\" never refills", quota.name),
                false => "refill_rate_micro_per_sec = 0: the bucket never refills".to_owned(),
            };
            c.warn(Some(&at), label, format!("{limit}, so its Redis key never expires (a fixed quota, renewed only by a new policy_version, whose old keys stay too), and with {made_up} is a key kept for good: a noeviction Redis fills up; give it a refill, however slow, or key it by api_key or jwt"));
        }
    }
    let exempt = super::sections::cidrs(
        c,
        label,
        "exempt_client_cidrs",
        r.exempt_client_cidrs.as_ref(),
    );
    if policy.as_ref().is_some_and(|p| !p.is_limited()) {
        if let Some(set) = &r.exempt_client_cidrs {
            c.warn(Some(&set.span()), label, "exempt_client_cidrs on a route that is not limited (algorithm = \"none\") changes nothing: every client is forwarded without a limit already".into());
        }
        inert_when_not_limited(c, label, r);
    }
    let forward_identity = forward_identity(c, label, r, limited, identity.as_ref());
    let cors = cors_origins(c, label, r);
    let max_body_bytes = match &r.max_body_bytes {
        None => Some(server_max_body_bytes),
        own => super::sections::body_limit(c, label, "max_body_bytes", own.as_ref()),
    };
    let route = (|| {
        Some(RouteConfig {
            index,
            path: path?,
            methods,
            host,
            upstream: upstream?,
            identity: identity?,
            policy: Arc::new(policy?),
            max_body_bytes: max_body_bytes?,
            websocket: r.websocket.as_ref().is_some_and(|w| *w.get_ref()),
            exempt_client_cidrs: exempt?,
            forward_identity: forward_identity?,
            cors: cors?,
        })
    })();
    (route, matcher)
}

/// `cors_origins`: `["*"]`, or origins as a browser writes them in `Origin`: `http` or
/// `https`, `://`, a host and perhaps a port, nothing after (`https://app.example.com`).
/// `None`: an error was said.
fn cors_origins(
    c: &mut Collector,
    label: Option<&str>,
    r: &RawRoute,
) -> Option<Option<CorsOrigins>> {
    let Some(list) = &r.cors_origins else {
        return Some(None);
    };
    if list.get_ref().is_empty() {
        c.push(Some(&list.span()), label, "cors_origins is empty: list the origins whose scripts may read the answers (\"https://app.example.com\"), or [\"*\"] for any, or leave it out".into());
        return None;
    }
    let any = list.get_ref().iter().any(|o| o.get_ref() == "*");
    if any {
        if list.get_ref().len() > 1 {
            c.push(Some(&list.span()), label, "cors_origins holds \"*\" beside other origins: \"*\" is every origin; write it alone, or list the origins".into());
            return None;
        }
        return Some(Some(CorsOrigins::Any));
    }
    let before = c.errors.len();
    let mut origins: Vec<String> = Vec::new();
    for (i, o) in list.get_ref().iter().enumerate() {
        let written = o.get_ref();
        match origin(written) {
            Ok(origin) if origins.contains(&origin) => c.warn(Some(&o.span()), label, format!("cors_origins[{i}] = \"{written}\" is listed already: keep one")),
            Ok(origin) => origins.push(origin),
            Err(why) => c.push(Some(&o.span()), label, format!("cors_origins[{i}] = \"{}\" is not an origin as a browser sends it: {why} (such as \"https://app.example.com\" or \"http://localhost:3000\")", crate::config::redact_url_and_query(written))),
        }
    }
    (c.errors.len() == before).then_some(Some(CorsOrigins::Listed(origins)))
}

/// An origin as a browser serializes it: `scheme://host[:port]`, lower-case, without the
/// scheme's default port.
fn origin(written: &str) -> Result<String, &'static str> {
    let (scheme, rest) = written
        .split_once("://")
        .ok_or("no scheme (http:// or https://)")?;
    let scheme = scheme.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "http" => "80",
        "https" => "443",
        _ => return Err("its scheme is not http or https"),
    };
    if rest.contains(['/', '?', '#']) {
        return Err("an origin has no path, query or fragment (nor a trailing /)");
    }
    if rest.contains('@') {
        return Err("an origin has no user or password");
    }
    let (host, port) = match rest.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, Some(port)),
        _ => (rest, None),
    };
    // As a browser serializes the host (the URL standard): an IPv6 address compressed and
    // in lower case, an IPv4 address in its four decimal parts, a name's labels whole.
    let host = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => match v6.parse::<std::net::Ipv6Addr>() {
            Ok(a) if a.to_ipv4_mapped().is_some() => {
                return Err("an IPv4-mapped IPv6 host: write the IPv4 address itself");
            }
            Ok(a) => format!("[{a}]"),
            Err(_) => return Err("its host is not a host name or an address"),
        },
        None => {
            let labels_ok = !host.is_empty()
                && (host.bytes()).all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
                && host
                    .split('.')
                    .all(|l| !l.is_empty() && !l.starts_with('-') && !l.ends_with('-'));
            // A last label of digits is an IPv4 address's (`1.2.3` and `0x7f.0.0.1` are
            // written otherwise by a browser).
            let numeric = host
                .rsplit('.')
                .next()
                .is_some_and(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()));
            if !labels_ok || (numeric && host.parse::<std::net::Ipv4Addr>().is_err()) {
                return Err("its host is not a host name or an address");
            }
            host.to_ascii_lowercase()
        }
    };
    let port = match port {
        None => None,
        Some(p) if p == default_port => None,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 && !p.starts_with('0') && p.bytes().all(|b| b.is_ascii_digit()) => {
                Some(p)
            }
            _ => return Err("its port is not a number from 1 to 65535"),
        },
    };
    Ok(match port {
        Some(p) => format!("{scheme}://{host}:{p}"),
        None => format!("{scheme}://{host}"),
    })
}

/// `forward_identity = true` tells the upstream who the caller is, where only the gateway
/// knows: the tenant a key file maps a key to, the claim of a token it verified. Other
/// identities the upstream has already, or there is none.
fn forward_identity(
    c: &mut Collector,
    label: Option<&str>,
    r: &RawRoute,
    limited: bool,
    identity: Option<&IdentitySource>,
) -> Option<bool> {
    let Some(field) = r.forward_identity.as_ref().filter(|f| *f.get_ref()) else {
        return Some(false);
    };
    let why = match identity? {
        _ if !limited => "a route that is not limited (algorithm = \"none\") has no caller: it forwards without identifying one".to_owned(),
        IdentitySource::ApiKey | IdentitySource::Jwt => return Some(true),
        IdentitySource::Global => "with identity = \"global\" every caller is one".to_owned(),
        IdentitySource::ClientIp => "with identity = \"client_ip\" the upstream is told the caller already, in X-Real-IP".to_owned(),
        IdentitySource::Header(name) => format!("with identity = {{ header = \"{name}\" }} the upstream receives that header itself"),
    };
    c.push(
        Some(&field.span()),
        label,
        format!("forward_identity = true needs identity = \"api_key\" or \"jwt\": {why}"),
    );
    None
}

fn route_path(
    c: &mut Collector,
    label: Option<&str>,
    spanned: &Spanned<RawRoute>,
) -> Option<PathMatch> {
    let r = spanned.get_ref();
    let (field, value, exact) = match (&r.path, &r.path_prefix) {
        (Some(p), None) => ("path", p, true),
        (None, Some(p)) => ("path_prefix", p, false),
        (Some(p), Some(_)) => {
            c.push(
                Some(&p.span()),
                label,
                "path and path_prefix are both set: keep exactly one".into(),
            );
            return None;
        }
        (None, None) => {
            c.push(
                Some(&spanned.span()),
                label,
                "neither path nor path_prefix is set: give exactly one".into(),
            );
            return None;
        }
    };
    let text = value.get_ref();
    if text.contains(';') {
        c.push(
            Some(&value.span()),
            label,
            format!("{field} = \"{text}\" holds a ';': a request reaching it would carry path parameters (from a ';' to the segment's end), which Java backends drop, and a request whose route depends on them is refused, so the route could never serve; write the path without them (a literal ';' in a path is %3B)"),
        );
        return None;
    }
    match routing::normalize_path(text) {
        // What a request reaching it would be refused for: a segment Windows servers read
        // otherwise (checked on the normal form, which `check` would have written next).
        Ok(n) if !matches!(routing::without_trailing_dots(&n), Ok(None)) => {
            c.push(
                Some(&value.span()),
                label,
                format!("{field} = \"{text}\" has a segment ending in a dot or a space: Windows servers trim those, and a request whose route depends on it is refused, so the route could never serve; write the path without them"),
            );
            None
        }
        Ok(n) if n.as_str() == text.as_str() && (text == "/" || !text.ends_with('/')) => {
            Some(if exact {
                PathMatch::Exact(n)
            } else {
                PathMatch::Prefix(n)
            })
        }
        // A query or fragment written into the path: the route would match neither what
        // was meant (routes match the path alone) nor, written `%3F`, any usual request.
        Ok(_) if text.contains(['?', '#']) => {
            c.push(
                Some(&value.span()),
                label,
                format!("{field} = \"{text}\" holds a '?' or '#': routes match a request's path alone, never its query or fragment, so write the path without them (a literal one in the path is %3F or %23)"),
            );
            None
        }
        Ok(n) => {
            let suggestion = if n.len() > 1 {
                n.trim_end_matches('/')
            } else {
                n.as_str()
            };
            c.push(
                Some(&value.span()),
                label,
                format!("{field} = \"{text}\" is not in normal form: write \"{suggestion}\""),
            );
            None
        }
        Err(e) => {
            let valid = match e {
                PathError::NotAbsolute => "it must start with '/'".to_owned(),
                PathError::TooLong => {
                    format!("it must be at most {} bytes", routing::MAX_PATH_BYTES)
                }
                PathError::BadEscape => "write '%25' for a '%'".to_owned(),
                PathError::EscapesRoot => "write the path without them".to_owned(),
                PathError::EncodedSeparator
                | PathError::Backslash
                | PathError::ControlCharacter
                | PathError::NotUtf8
                | PathError::AmbiguousParameter => "a request holding that is answered 400 and never routed, so no request could match: write the path without it".to_owned(),
            };
            c.push(
                Some(&value.span()),
                label,
                format!("{field} = \"{text}\" is not usable: {e}; {valid}"),
            );
            None
        }
    }
}

/// The fields of a limited route's decision written on a route that is not limited
/// (`algorithm = "none"`, no limits or tiers), which change nothing there: taken, and said
/// (as `exempt_client_cidrs` is), at the first of them. Not `identity` (a `Host` or
/// `User-Agent` identity still keeps that field out of the access log), `mode` (shown in
/// `sentinel_endpoint_mode`) or `fallback_rate_fleet_micro`, said on its own.
fn inert_when_not_limited(c: &mut Collector, label: Option<&str>, r: &RawRoute) {
    if let Some(fleet) = &r.fallback_rate_fleet_micro {
        c.warn(Some(&fleet.span()), label, "fallback_rate_fleet_micro on a route that is not limited (algorithm = \"none\") has no emergency to share: the fleet is not counted for it".into());
    }
    let mut written: Vec<(&str, Range<usize>)> = [
        ("fail_mode", r.fail_mode.as_ref().map(|v| v.span())),
        (
            "fallback_rate_per_process_micro",
            r.fallback_rate_per_process_micro.as_ref().map(|v| v.span()),
        ),
        (
            "emergency_scope",
            r.emergency_scope.as_ref().map(|v| v.span()),
        ),
        (
            "policy_version",
            r.policy_version.as_ref().map(|v| v.span()),
        ),
        (
            "ratelimit_headers",
            r.ratelimit_headers.as_ref().map(|v| v.span()),
        ),
    ]
    .into_iter()
    .filter_map(|(field, span)| Some((field, span?)))
    .collect();
    written.sort_by_key(|(_, span)| span.start);
    let Some((_, first)) = written.first() else {
        return;
    };
    let fields: Vec<&str> = written.iter().map(|(field, _)| *field).collect();
    let verb = if fields.len() == 1 {
        "changes"
    } else {
        "change"
    };
    c.warn(Some(first), label, format!("{} on a route that is not limited (algorithm = \"none\") {verb} nothing: its requests are forwarded without a decision", fields.join(", ")));
}

/// The fields that describe one limit: the route's own, or one `[[routes.limits]]` entry's.
pub(super) struct AlgorithmFields<'a> {
    /// `""` for the route's fields, `limits[i].` for an entry's.
    pub(super) at: String,
    pub(super) algorithm: &'a Spanned<String>,
    pub(super) limit: &'a Option<Spanned<i64>>,
    pub(super) window_size_micro: &'a Option<Spanned<i64>>,
    pub(super) capacity_micro: &'a Option<Spanned<i64>>,
    pub(super) refill_rate_micro_per_sec: &'a Option<Spanned<i64>>,
    pub(super) cost_micro: &'a Option<Spanned<i64>>,
}

fn algorithm(c: &mut Collector, label: Option<&str>, r: &AlgorithmFields<'_>) -> Option<Algorithm> {
    let at = r.at.as_str();
    let misplaced = |c: &mut Collector, field: &str, v: &Option<Spanned<i64>>, alg: &str| {
        if let Some(v) = v {
            c.push(
                Some(&v.span()),
                label,
                format!("{at}{field} does not apply to algorithm = \"{alg}\": remove it"),
            );
        }
    };
    match r.algorithm.get_ref().as_str() {
        "none" if at.is_empty() => {
            for (f, v) in [
                ("limit", r.limit),
                ("window_size_micro", r.window_size_micro),
                ("capacity_micro", r.capacity_micro),
                ("refill_rate_micro_per_sec", r.refill_rate_micro_per_sec),
                ("cost_micro", r.cost_micro),
            ] {
                misplaced(c, f, v, "none");
            }
            Some(Algorithm::None)
        }
        "token_bucket" => {
            misplaced(c, "limit", r.limit, "token_bucket");
            misplaced(c, "window_size_micro", r.window_size_micro, "token_bucket");
            let capacity = match r.capacity_micro {
                None => {
                    c.push(Some(&r.algorithm.span()), label, format!("{at}capacity_micro is required for algorithm = \"token_bucket\": the burst in micro-tokens (1 request = 1000000)"));
                    None
                }
                Some(v) if *v.get_ref() < ONE_TOKEN_MICRO as i64 => {
                    c.push(Some(&v.span()), label, format!("{at}capacity_micro = {} can never admit a request: it must be >= 1000000 (one token)", v.get_ref()));
                    None
                }
                Some(v) => int_in(
                    c,
                    label,
                    &format!("{at}capacity_micro"),
                    Some(v),
                    0,
                    (1_000_000, MAX_CAPACITY_MICRO as i64),
                    " (10^9 requests)",
                ),
            };
            let refill = match r.refill_rate_micro_per_sec {
                None => {
                    c.push(Some(&r.algorithm.span()), label, format!("{at}refill_rate_micro_per_sec is required for algorithm = \"token_bucket\": micro-tokens added per second (0 = never refills)"));
                    None
                }
                v => {
                    let refill = int_in(
                        c,
                        label,
                        &format!("{at}refill_rate_micro_per_sec"),
                        v.as_ref(),
                        0,
                        (0, MAX_RATE_MICRO_PER_SEC as i64),
                        " (10^6 requests per second)",
                    );
                    if let (Some(rate), Some(written)) = (refill, v) {
                        slow_refill(c, label, at, rate, written);
                    }
                    refill
                }
            };
            Some(Algorithm::TokenBucket {
                capacity_micro: capacity?,
                refill_micro_per_sec: refill?,
            })
        }
        "sliding_window" => {
            misplaced(c, "capacity_micro", r.capacity_micro, "sliding_window");
            misplaced(
                c,
                "refill_rate_micro_per_sec",
                r.refill_rate_micro_per_sec,
                "sliding_window",
            );
            let limit = match r.limit {
                None => {
                    c.push(
                        Some(&r.algorithm.span()),
                        label,
                        format!("{at}limit is required for algorithm = \"sliding_window\": requests per window"),
                    );
                    None
                }
                v => int_in(
                    c,
                    label,
                    &format!("{at}limit"),
                    v.as_ref(),
                    0,
                    (1, 1_000_000_000),
                    " requests",
                ),
            };
            let window = match r.window_size_micro {
                None => {
                    c.push(Some(&r.algorithm.span()), label, format!("{at}window_size_micro is required for algorithm = \"sliding_window\": the window in microseconds (60_000_000 = one minute)"));
                    None
                }
                v => int_in(
                    c,
                    label,
                    &format!("{at}window_size_micro"),
                    v.as_ref(),
                    0,
                    (1_000, 86_400_000_000),
                    " (1 ms to 1 day)",
                ),
            };
            let (limit, window) = (limit?, window?);
            Some(Algorithm::SlidingWindow {
                limit,
                window_micro: window,
            })
        }
        other => {
            let choices = if at.is_empty() {
                "\"token_bucket\", \"sliding_window\" or \"none\""
            } else {
                "\"token_bucket\" or \"sliding_window\""
            };
            c.push(
                Some(&r.algorithm.span()),
                label,
                format!("{at}algorithm = \"{other}\" is unknown: use {choices}"),
            );
            None
        }
    }
}

/// A token bucket refilled more slowly than one token a day: `refill_rate_micro_per_sec = 10`
/// written for "10 a second", as nginx's `rate=10r/s` or Kong's `second = 10` read. Warned,
/// not refused: a quota of one request a week is a rate too.
fn slow_refill(
    c: &mut Collector,
    label: Option<&str>,
    at: &str,
    rate: u64,
    written: &Spanned<i64>,
) {
    const DAY_SECONDS: u64 = 86_400;
    if rate == 0 || rate * DAY_SECONDS >= ONE_TOKEN_MICRO {
        return;
    }
    let hours = ONE_TOKEN_MICRO as f64 / rate as f64 / 3600.0;
    c.warn(Some(&written.span()), label, format!("{at}refill_rate_micro_per_sec = {rate} adds one token (one request of cost 1_000_000) every {hours:.1} hours: the rate is in micro-tokens a second ({rate} requests a second is {})", rate * ONE_TOKEN_MICRO));
}

/// Headers that carry a client's address as a proxy wrote it, or as the client did: an
/// identity read from one is the client's own choice (`client_ip` reads them past the
/// trusted proxies).
const ADDRESS_HEADERS: [&str; 3] = ["x-forwarded-for", "forwarded", "x-real-ip"];

fn identity(
    c: &mut Collector,
    label: Option<&str>,
    route: &Spanned<RawRoute>,
    limited: bool,
    raw: &RawConfig,
) -> Option<IdentitySource> {
    let r = route.get_ref();
    let Some(spanned) = &r.identity else {
        if limited {
            let at = r.endpoint_id.as_ref().map_or(route.span(), |v| v.span());
            c.push(Some(&at), label, "identity is required for a limited route: use \"jwt\", \"api_key\", \"client_ip\", \"global\" or { header = \"X-API-Key\" }".into());
            return None;
        }
        return Some(IdentitySource::Global);
    };
    let span = spanned.span();
    match spanned.get_ref() {
        RawIdentity::Named(n) if n == "global" => Some(IdentitySource::Global),
        RawIdentity::Named(n) if n == "client_ip" => Some(IdentitySource::ClientIp),
        RawIdentity::Named(n) if n == "jwt" => {
            if raw
                .auth
                .as_ref()
                .and_then(|a| a.get_ref().jwt.as_ref())
                .is_none()
            {
                c.push(
                    Some(&span),
                    label,
                    "identity = \"jwt\" needs an [auth.jwt] section".into(),
                );
                return None;
            }
            Some(IdentitySource::Jwt)
        }
        RawIdentity::Named(n) if n == "api_key" => {
            if raw
                .auth
                .as_ref()
                .and_then(|a| a.get_ref().api_keys.as_ref())
                .is_none()
            {
                c.push(
                    Some(&span),
                    label,
                    "identity = \"api_key\" needs an [auth.api_keys] section".into(),
                );
                return None;
            }
            Some(IdentitySource::ApiKey)
        }
        RawIdentity::Named(n) => {
            c.push(Some(&span), label, format!("identity = \"{n}\" is unknown: use \"jwt\", \"api_key\", \"client_ip\", \"global\" or {{ header = \"X-API-Key\" }}"));
            None
        }
        RawIdentity::Header { header } => match http::HeaderName::from_bytes(header.as_bytes()) {
            Ok(name) if super::sections::is_the_gateways_caller_header(name.as_str()) => {
                c.push(
                    Some(&span),
                    label,
                    format!(
                        "identity = {{ header = \"{header}\" }} {}",
                        super::sections::CALLER_HEADER_TAKEN
                    ),
                );
                None
            }
            Ok(name) => {
                if ADDRESS_HEADERS.contains(&name.as_str()) {
                    c.warn(Some(&span), label, format!("identity = {{ header = \"{header}\" }}: the client writes this header itself, so every value it makes up is a bucket of its own; for the client's address behind a load balancer use identity = \"client_ip\" with [server] trusted_proxies, which reads X-Forwarded-For from the right, past your proxies"));
                }
                Some(IdentitySource::Header(name.as_str().to_owned()))
            }
            Err(_) => {
                c.push(
                    Some(&span),
                    label,
                    format!("identity = {{ header = \"{header}\" }} is not a header name: use letters, digits and '-', such as \"X-API-Key\""),
                );
                None
            }
        },
    }
}

/// The route's limits: its single-limit fields as one limit named `default`, or its
/// `[[routes.limits]]`; the bool says which (several).
fn limits(
    c: &mut Collector,
    label: Option<&str>,
    spanned: &Spanned<RawRoute>,
) -> Option<(Vec<Limit>, bool)> {
    let r = spanned.get_ref();
    if let Some(written) = r.limits.as_ref().filter(|l| l.get_ref().is_empty()) {
        c.push(Some(&written.span()), label, format!("limits = [] names no limit: a route has 1 to {MAX_LIMITS} [[routes.limits]], or the single-limit fields (algorithm and its own)"));
        return None;
    }
    let named = r
        .limits
        .as_ref()
        .map_or(&[][..], |l| l.get_ref().as_slice());
    if named.is_empty() {
        let Some(alg) = &r.algorithm else {
            c.push(Some(&spanned.span()), label, "algorithm is not set: give algorithm (\"token_bucket\", \"sliding_window\" or \"none\") or one [[routes.limits]] per limit".into());
            return None;
        };
        let fields = AlgorithmFields {
            at: String::new(),
            algorithm: alg,
            limit: &r.limit,
            window_size_micro: &r.window_size_micro,
            capacity_micro: &r.capacity_micro,
            refill_rate_micro_per_sec: &r.refill_rate_micro_per_sec,
            cost_micro: &r.cost_micro,
        };
        let algorithm = algorithm(c, label, &fields)?;
        let limits = match algorithm {
            Algorithm::None => Vec::new(),
            algorithm => vec![Limit {
                name: DEFAULT_LIMIT.to_owned(),
                algorithm,
                global: false,
            }],
        };
        return Some((limits, false));
    }
    let mut ok = true;
    for (field, set) in [
        ("algorithm", r.algorithm.as_ref().map(|a| a.span())),
        ("limit", r.limit.as_ref().map(|v| v.span())),
        (
            "window_size_micro",
            r.window_size_micro.as_ref().map(|v| v.span()),
        ),
        (
            "capacity_micro",
            r.capacity_micro.as_ref().map(|v| v.span()),
        ),
        (
            "refill_rate_micro_per_sec",
            r.refill_rate_micro_per_sec.as_ref().map(|v| v.span()),
        ),
    ] {
        if let Some(span) = set {
            // An unlimited route has no limits to move it into.
            let none =
                field == "algorithm" && r.algorithm.as_ref().is_some_and(|a| a.get_ref() == "none");
            let what = match none {
                true => "leave out either algorithm = \"none\" (the route is then limited by its [[routes.limits]]) or the limits",
                false => "move it into a [[routes.limits]] entry",
            };
            c.push(Some(&span), label, format!("{field} is set beside [[routes.limits]]: a route has either the single-limit fields or named limits; {what}"));
            ok = false;
        }
    }
    let out = named_limits(c, label, named, "limits", true);
    (ok && out.is_some()).then(|| (out.unwrap_or_default(), true))
}

/// `[[routes.limits]]` entries (or a tier's, under `at`), each checked; `ceilings`: whether
/// an entry may have `identity = "global"`.
fn named_limits(
    c: &mut Collector,
    label: Option<&str>,
    entries: &[Spanned<crate::config::raw::RawLimit>],
    at: &str,
    ceilings: bool,
) -> Option<Vec<Limit>> {
    let mut ok = true;
    if entries.len() > MAX_LIMITS {
        c.push(
            Some(&entries[MAX_LIMITS].span()),
            label,
            format!(
                "{} limits in {at}: a route has at most {MAX_LIMITS}",
                entries.len()
            ),
        );
        ok = false;
    }
    let mut out: Vec<Limit> = Vec::new();
    for (i, l) in entries.iter().enumerate() {
        let l = l.get_ref();
        let name = l.name.get_ref();
        let here = format!("{at}[{i}] ({name}).");
        let valid = !name.is_empty()
            && name.len() <= 64
            && name.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
            });
        if !valid {
            c.push(Some(&l.name.span()), label, format!("{at}[{i}].name = \"{name}\" is not valid: use 1 to 64 of a-z, 0-9, '.', '_', '-'"));
            ok = false;
        } else if out.iter().any(|o| o.name == *name) {
            c.push(Some(&l.name.span()), label, format!("{at}[{i}].name = \"{name}\" is used twice: each limit of a route has a name of its own"));
            ok = false;
        }
        let global = match l.identity.as_ref().map(|v| (v, v.get_ref().as_str())) {
            None => false,
            Some((_, "global")) if ceilings => true,
            Some((v, _)) if !ceilings => {
                c.push(Some(&v.span()), label, format!("{here}identity is set: a tier's limits count on the caller's identity; a ceiling (identity = \"global\") belongs in the route's [[routes.limits]], where it applies to every tier"));
                ok = false;
                false
            }
            Some((v, other)) => {
                c.push(Some(&v.span()), label, format!("{here}identity = \"{other}\" is not supported: a limit counts on the route's identity (leave identity out) or on one bucket for every caller (identity = \"global\")"));
                ok = false;
                false
            }
        };
        let fields = AlgorithmFields {
            at: here.clone(),
            algorithm: &l.algorithm,
            limit: &l.limit,
            window_size_micro: &l.window_size_micro,
            capacity_micro: &l.capacity_micro,
            refill_rate_micro_per_sec: &l.refill_rate_micro_per_sec,
            cost_micro: &None,
        };
        match algorithm(c, label, &fields) {
            Some(algorithm) => out.push(Limit {
                name: name.clone(),
                algorithm,
                global,
            }),
            None => ok = false,
        }
    }
    ok.then_some(out)
}

fn policy(
    c: &mut Collector,
    label: Option<&str>,
    r: &RawRoute,
    endpoint_id: Option<EndpointId>,
    limits: Option<(Vec<Limit>, bool)>,
    tiers: Option<Option<TierPlan>>,
) -> Option<Policy> {
    let algorithm = limits.as_ref().map(|(l, _)| match l.first() {
        Some(first) => first.algorithm,
        None => Algorithm::None,
    });
    let fail_mode = match r.fail_mode.as_ref().map(|f| (f, f.get_ref().as_str())) {
        None | Some((_, "fail_closed")) => Some(FailMode::FailClosed),
        Some((_, "fail_open")) => Some(FailMode::FailOpen),
        Some((f, other)) => {
            c.push(
                Some(&f.span()),
                label,
                format!("fail_mode = \"{other}\" is unknown: use \"fail_open\" or \"fail_closed\""),
            );
            None
        }
    };
    let per_identity = match r
        .emergency_scope
        .as_ref()
        .map(|s| (s, s.get_ref().as_str()))
    {
        None | Some((_, "endpoint")) => Some(false),
        Some((_, "identity")) => Some(true),
        Some((s, other)) => {
            c.push(
                Some(&s.span()),
                label,
                format!(
                    "emergency_scope = \"{other}\" is unknown: use \"endpoint\" or \"identity\""
                ),
            );
            None
        }
    };
    let rate_field = |c: &mut Collector, field: &str, v: &Spanned<i64>| {
        if *v.get_ref() < ONE_TOKEN_MICRO as i64 {
            c.push(
                Some(&v.span()),
                label,
                format!(
                    "{field} = {} can never admit a request: it must be >= 1000000 (one token)",
                    v.get_ref()
                ),
            );
            return None;
        }
        int_in(
            c,
            label,
            field,
            Some(v),
            0,
            (1_000_000, MAX_RATE_MICRO_PER_SEC as i64),
            " (10^6 requests per second)",
        )
    };
    let (fallback, fallback_fleet) = match (
        &r.fallback_rate_per_process_micro,
        &r.fallback_rate_fleet_micro,
    ) {
        (Some(p), Some(f)) => {
            c.push(Some(&f.span()), label, "fallback_rate_per_process_micro and fallback_rate_fleet_micro are both set: keep one".into());
            let _ = (p, f);
            (None, false)
        }
        (Some(v), None) => (rate_field(c, "fallback_rate_per_process_micro", v), false),
        (None, Some(v)) => (rate_field(c, "fallback_rate_fleet_micro", v), true),
        (None, None) => (None, false),
    };
    let limited = !matches!(algorithm, Some(Algorithm::None));
    if limited
        && fail_mode == Some(FailMode::FailOpen)
        && r.fallback_rate_per_process_micro.is_none()
        && r.fallback_rate_fleet_micro.is_none()
    {
        let span = r.fail_mode.as_ref().map(|f| f.span());
        c.push(span.as_ref(), label, "fail_mode = \"fail_open\" needs fallback_rate_per_process_micro (or fallback_rate_fleet_micro): fail-open is limited, never unlimited (1000000 = one request per second per process)".into());
    }
    let cost = int_in(
        c,
        label,
        "cost_micro",
        r.cost_micro.as_ref(),
        ONE_TOKEN_MICRO as i64,
        (1, MAX_CAPACITY_MICRO as i64),
        "",
    );
    let every: Vec<(String, Algorithm)> = limits
        .as_ref()
        .map(|(l, several)| {
            (l.iter().enumerate())
                .map(|(i, l)| {
                    let at = if *several {
                        format!(" by limits[{i}] ({})", l.name)
                    } else {
                        String::new()
                    };
                    (at, l.algorithm)
                })
                .collect()
        })
        .unwrap_or_default();
    for (at, algorithm) in &every {
        cost_fits(c, label, r, cost, *algorithm, at);
    }
    // Each tier's own limits take the route's cost too.
    if let Some(Some(plan)) = &tiers {
        for (name, t) in &plan.tiers {
            if let TierLimits::Limits(limits) = t {
                for (i, l) in limits.iter().enumerate() {
                    let at = format!(
                        " by tiers.{}.limits[{i}] ({})",
                        super::shape::key_shown(name),
                        l.name
                    );
                    cost_fits(c, label, r, cost, l.algorithm, &at);
                }
            }
        }
    }
    let version = int_in(
        c,
        label,
        "policy_version",
        r.policy_version.as_ref(),
        1,
        (0, i64::from(u32::MAX)),
        "",
    );
    let mode = match r.mode.as_ref().map(|m| (m, m.get_ref().as_str())) {
        None | Some((_, "enforce")) => Some(Enforcement::Enforce),
        Some((_, "shadow")) => Some(Enforcement::Shadow),
        Some((m, other)) => {
            c.push(
                Some(&m.span()),
                label,
                format!("mode = \"{other}\" is unknown: use \"enforce\" or \"shadow\""),
            );
            None
        }
    };
    let cost_from_response = r.cost_from_response.as_ref().and_then(|spanned| {
        let raw = spanned.get_ref();
        let header = match http::HeaderName::from_bytes(raw.header.get_ref().as_bytes()) {
            Ok(h) if RESERVED_COST_HEADERS.contains(&h.as_str()) => {
                c.push(Some(&raw.header.span()), label, format!("cost_from_response.header = \"{}\" is a header HTTP or the answer itself needs, and the cost header is removed from every answer: name the header the upstream reports its cost in, such as \"X-OCR-Pages\"", raw.header.get_ref()));
                None
            }
            Ok(h) => Some(h),
            Err(_) => {
                c.push(Some(&raw.header.span()), label, format!("cost_from_response.header = \"{}\" is not a header name: use letters, digits and '-', such as \"X-Cost\"", raw.header.get_ref()));
                None
            }
        };
        let unit = int_in(
            c,
            label,
            "cost_from_response.unit_micro",
            raw.unit_micro.as_ref(),
            ONE_TOKEN_MICRO as i64,
            (1, MAX_CAPACITY_MICRO as i64),
            " micro-tokens per unit",
        );
        let buckets = every
            .iter()
            .any(|(_, a)| matches!(a, Algorithm::TokenBucket { .. }));
        // Limits with errors of their own were reported already; whether the route has a
        // token bucket is then not known.
        if !buckets && limits.is_some() {
            c.push(Some(&spanned.span()), label, "cost_from_response charges token buckets, and this route has none: give it a token_bucket limit, or remove cost_from_response".into());
        }
        if !buckets {
            return None;
        }
        Some(CostFromResponse {
            header: header?,
            unit_micro: unit?,
        })
    });
    let ratelimit_headers = ratelimit_headers(c, label, r.ratelimit_headers.as_ref());
    if r.cost_from_response.is_some() && cost_from_response.is_none() {
        return None;
    }
    let (limits, several) = limits?;
    Some(Policy {
        endpoint_id: endpoint_id?,
        algorithm: algorithm?,
        limits,
        several,
        cost_micro: cost?,
        fail_mode: fail_mode?,
        fallback_rate_micro: fallback,
        fallback_fleet,
        policy_version: version?,
        mode: mode?,
        ratelimit_headers: ratelimit_headers?,
        emergency_per_identity: per_identity?,
        cost_from_response,
        tiers: tiers?,
    })
}

/// `ratelimit_headers`: `true` is the IETF fields, as before the names.
fn ratelimit_headers(
    c: &mut Collector,
    label: Option<&str>,
    written: Option<&Spanned<RawRateLimitHeaders>>,
) -> Option<RateLimitHeaders> {
    let Some(written) = written else {
        return Some(RateLimitHeaders::default());
    };
    let (ietf, x) = match written.get_ref() {
        RawRateLimitHeaders::Bool(on) => (*on, false),
        RawRateLimitHeaders::Named(n) if n == "ietf" => (true, false),
        RawRateLimitHeaders::Named(n) if n == "x-ratelimit" => (false, true),
        RawRateLimitHeaders::Named(n) if n == "both" => (true, true),
        RawRateLimitHeaders::Named(n) => {
            c.push(Some(&written.span()), label, format!("ratelimit_headers = \"{}\" is unknown: use true (the IETF RateLimit-Policy and RateLimit fields, as \"ietf\"), \"x-ratelimit\" (X-RateLimit-Limit, -Remaining and -Reset), \"both\" or false", super::cut(n)));
            return None;
        }
    };
    Some(RateLimitHeaders { ietf, x })
}

/// `tier_from`, `default_tier` and `[routes.tiers.*]`: `Some(None)` for a route without
/// tiers.
fn tiers(
    c: &mut Collector,
    label: Option<&str>,
    spanned: &Spanned<RawRoute>,
    identity: Option<&IdentitySource>,
    limits: Option<&(Vec<Limit>, bool)>,
) -> Option<Option<TierPlan>> {
    let r = spanned.get_ref();
    let Some(from) = &r.tier_from else {
        if let Some(d) = &r.default_tier {
            c.push(Some(&d.span()), label, "default_tier is set without tier_from: name where the caller's tier comes from (tier_from = \"api_key\" or { claim = \"plan\" })".into());
            return None;
        }
        if let Some((name, t)) = r.tiers.iter().next() {
            c.push(Some(&t.span()), label, format!("tiers.{name} is set without tier_from: name where the caller's tier comes from (tier_from = \"api_key\" or {{ claim = \"plan\" }})"));
            return None;
        }
        return Some(None);
    };
    let mut ok = true;
    let from_kind = match from.get_ref() {
        crate::config::raw::RawTierFrom::Named(n) if n == "api_key" => {
            if identity.is_some_and(|i| *i != IdentitySource::ApiKey) {
                c.push(Some(&from.span()), label, "tier_from = \"api_key\" needs identity = \"api_key\": the tier is the key file's".into());
                ok = false;
            }
            Some(TierFrom::ApiKey)
        }
        crate::config::raw::RawTierFrom::Claim { claim } if super::unprintable(claim) => {
            c.push(Some(&from.span()), label, format!("tier_from = {{ claim = \"{}\" }}: the claim's name holds a control character or one that turns the text's direction: no token's claim is written so", claim.escape_debug()));
            None
        }
        crate::config::raw::RawTierFrom::Claim { claim } if !claim.is_empty() => {
            if identity.is_some_and(|i| *i != IdentitySource::Jwt) {
                c.push(Some(&from.span()), label, format!("tier_from = {{ claim = \"{claim}\" }} needs identity = \"jwt\": the tier is a claim of the caller's token"));
                ok = false;
            }
            Some(TierFrom::Claim(claim.clone()))
        }
        _ => {
            c.push(
                Some(&from.span()),
                label,
                "tier_from is not usable: write \"api_key\" or { claim = \"<claim>\" }".into(),
            );
            None
        }
    };
    // The names a key file's tiers are checked by: a tier a key names is one a route can list.
    let valid_name = |n: &str| EndpointId::parse(n).is_some();
    let default = match &r.default_tier {
        None => {
            c.push(Some(&from.span()), label, "tier_from needs default_tier: the tier of callers without one (or with one not listed), under which the route's own limits count".into());
            None
        }
        Some(d) if !valid_name(d.get_ref()) => {
            c.push(Some(&d.span()), label, format!("default_tier = \"{}\" is not a tier name: use 1 to 128 of a-z, 0-9, '.', '_', '-'", d.get_ref()));
            None
        }
        Some(d) => Some(d.get_ref().clone()),
    };
    if limits.is_some_and(|(l, _)| l.is_empty()) {
        c.push(Some(&from.span()), label, "tier_from on a route without limits: tiers choose limits, so give the route its own (the default tier's) limits".into());
        ok = false;
    }
    let mut plan = std::collections::BTreeMap::new();
    for (name, t) in &r.tiers {
        let at = format!("tiers.{name}");
        if !valid_name(name) {
            c.push(
                Some(&t.span()),
                label,
                format!(
                    "{at}: \"{name}\" is not a tier name: use 1 to 128 of a-z, 0-9, '.', '_', '-'"
                ),
            );
            ok = false;
            continue;
        }
        let raw_tier = t.get_ref();
        match (
            raw_tier.unlimited.as_ref().map(|u| *u.get_ref()),
            raw_tier.limits.is_empty(),
        ) {
            (Some(true), true) => {
                plan.insert(name.clone(), TierLimits::Unlimited);
            }
            (Some(true), false) => {
                let written = raw_tier.unlimited.as_ref().map(|u| u.span());
                c.push(
                    Some(&written.unwrap_or_else(|| t.span())),
                    label,
                    format!("{at} is unlimited and has limits: keep one"),
                );
                ok = false;
            }
            (_, true) => {
                c.push(Some(&t.span()), label, format!("{at} has no limits: give it [[routes.tiers.{name}.limits]], or unlimited = true"));
                ok = false;
            }
            (_, false) => {
                match named_limits(c, label, &raw_tier.limits, &format!("{at}.limits"), false) {
                    Some(l) => {
                        // The route's ceilings apply to this tier too: a name shared with
                        // one would name two limits in the RateLimit fields, `/limits`, the
                        // metrics and the logs.
                        let ceilings = limits.map(|(all, _)| all.iter().filter(|c| c.global));
                        for (i, limit) in l.iter().enumerate() {
                            if ceilings
                                .clone()
                                .is_some_and(|mut c| c.any(|c| c.name == limit.name))
                            {
                                c.push(Some(&raw_tier.limits[i].get_ref().name.span()), label, format!("{at}.limits[{i}].name = \"{}\" is the name of the route's ceiling (identity = \"global\"), which applies to this tier too: each limit a caller meets has a name of its own", limit.name));
                                ok = false;
                            }
                        }
                        plan.insert(name.clone(), TierLimits::Limits(l));
                    }
                    None => ok = false,
                }
            }
        }
    }
    // Callers without a tier get the listed default tier's limits: the route's own limits
    // (on the caller's identity) then apply to no caller.
    if let (Some(d), Some(listed)) = (&r.default_tier, default.as_ref()) {
        let own = limits.is_some_and(|(l, _)| l.iter().any(|l| !l.global));
        if own && plan.contains_key(listed) {
            c.warn(Some(&d.span()), label, format!("default_tier = \"{listed}\" is listed under tiers, so callers without a tier get tiers.{listed}'s limits: the route's own limits (those on the caller's identity) apply to no caller"));
        }
    }
    let plan = TierPlan {
        from: from_kind?,
        default: default?,
        tiers: plan,
    };
    ok.then_some(Some(plan))
}

/// Whether the route's cost can ever be admitted by one limit (`at` names it in messages).
fn cost_fits(
    c: &mut Collector,
    label: Option<&str>,
    r: &RawRoute,
    cost: Option<u64>,
    algorithm: Algorithm,
    at: &str,
) {
    if let (Some(cost), Algorithm::SlidingWindow { limit, .. }) = (cost, algorithm) {
        let span = r.cost_micro.as_ref().map(|v| v.span());
        if cost % ONE_TOKEN_MICRO != 0 {
            c.push(span.as_ref(), label, {
                let window = match at.strip_prefix(" by ") {
                    Some(limit) => format!("the sliding window of {limit}"),
                    None => "a sliding window".to_owned(),
                };
                format!("cost_micro = {cost} is not a whole number of requests: {window} counts requests, so use a multiple of 1000000")
            });
        } else if cost / ONE_TOKEN_MICRO > limit {
            c.push(
                span.as_ref(),
                label,
                format!(
                    "cost_micro = {cost} can never be admitted{at}: it must be <= {} (the window's limit = {limit} requests, in micro-tokens)",
                    limit * ONE_TOKEN_MICRO
                ),
            );
        }
    }
    if let (Some(cost), Algorithm::TokenBucket { capacity_micro, .. }) = (cost, algorithm) {
        if cost > capacity_micro {
            let span = r.cost_micro.as_ref().map(|v| v.span());
            c.push(span.as_ref(), label, {
                let its = if at.is_empty() { "" } else { "its " };
                format!("cost_micro = {cost} can never be admitted{at}: it must be <= {its}capacity_micro ({capacity_micro})")
            });
        }
    }
}

/// Routes may share an endpoint id, and so a bucket, only with identical limits.
/// The error is pointed at the first of the differing fields the later route writes (at its
/// header when it writes none of them: the difference is the earlier route's field).
pub(super) fn shared_endpoints(
    c: &mut Collector,
    raw: &[Spanned<RawRoute>],
    routes: &[(Range<usize>, RouteConfig)],
) {
    let mut first: BTreeMap<&EndpointId, (&RouteConfig, usize)> = BTreeMap::new();
    for (span, route) in routes {
        let id = &route.policy.endpoint_id;
        match first.get(id) {
            Some(&(prev, prev_line))
                if prev.policy != route.policy || prev.identity != route.identity =>
            {
                let fields = differing(prev, route);
                let written = raw.get(route.index).map(|r| r.get_ref());
                let before = prev.policy.tiers.as_ref().map(|t| &t.tiers);
                let after = route.policy.tiers.as_ref().map(|t| &t.tiers);
                // The tiers the later route writes otherwise than the earlier, or alone.
                let other_tiers = |name: &str| {
                    before.and_then(|b| b.get(name)) != after.and_then(|a| a.get(name))
                };
                // The first limit the later route writes otherwise than the earlier.
                let other_limit =
                    |i: usize| prev.policy.limits.get(i) != route.policy.limits.get(i);
                let at = fields
                    .iter()
                    .filter_map(|field| {
                        written.and_then(|r| field_span(r, field, &other_tiers, &other_limit))
                    })
                    .min_by_key(|at| at.start)
                    .unwrap_or_else(|| span.clone());
                c.push(
                    Some(&at),
                    Some(&route_label(route.index, id.as_str())),
                    format!(
                        "shares endpoint_id with routes[{}] (line {prev_line}) but not its limit fields (different: {}): \
                         routes of one endpoint share one bucket, so identity, algorithm, limits, \
                         cost, fail mode, fallback, emergency_scope, mode, policy_version, \
                         ratelimit_headers, cost_from_response and tiers must be identical",
                        prev.index,
                        fields.join(", ")
                    ),
                )
            }
            Some(_) => {}
            None => {
                first.insert(id, (route, c.position(span).0));
            }
        }
    }
}

/// What two routes of one `endpoint_id` write differently, by the fields' names.
fn differing(a: &RouteConfig, b: &RouteConfig) -> Vec<&'static str> {
    let (p, q) = (&a.policy, &b.policy);
    [
        (a.identity != b.identity, "identity"),
        (
            p.several != q.several,
            "limits (one route writes [[routes.limits]])",
        ),
        (p.several && q.several && p.limits != q.limits, "limits"),
        (p.cost_micro != q.cost_micro, "cost_micro"),
        (p.fail_mode != q.fail_mode, "fail_mode"),
        (
            p.fallback_rate_micro != q.fallback_rate_micro || p.fallback_fleet != q.fallback_fleet,
            "fallback",
        ),
        (p.policy_version != q.policy_version, "policy_version"),
        (p.mode != q.mode, "mode"),
        (
            p.ratelimit_headers != q.ratelimit_headers,
            "ratelimit_headers",
        ),
        (
            p.emergency_per_identity != q.emergency_per_identity,
            "emergency_scope",
        ),
        (
            p.cost_from_response != q.cost_from_response,
            "cost_from_response",
        ),
        (
            p.tiers.as_ref().map(|t| &t.from) != q.tiers.as_ref().map(|t| &t.from),
            "tier_from",
        ),
        (
            p.tiers.as_ref().map(|t| &t.default) != q.tiers.as_ref().map(|t| &t.default),
            "default_tier",
        ),
        (
            p.tiers.as_ref().map(|t| &t.tiers) != q.tiers.as_ref().map(|t| &t.tiers),
            "tiers",
        ),
    ]
    .into_iter()
    .filter_map(|(differs, name)| differs.then_some(name))
    .chain(if p.several || q.several {
        Vec::new()
    } else {
        algorithm_fields(&p.algorithm, &q.algorithm)
    })
    .collect()
}

/// Where a route writes one of the fields `differing` names (of its tiers, the first that
/// `other_tier` says differs; of its limits, the first `other_limit` says differs); `None`
/// where it leaves it to its default.
fn field_span(
    r: &RawRoute,
    field: &str,
    other_tier: &dyn Fn(&str) -> bool,
    other_limit: &dyn Fn(usize) -> bool,
) -> Option<Range<usize>> {
    fn at<T>(v: &Option<Spanned<T>>) -> Option<Range<usize>> {
        v.as_ref().map(Spanned::span)
    }
    match field {
        "identity" => at(&r.identity),
        "limits" => r.limits.as_ref().map(|limits| {
            let entries = limits.get_ref();
            let first = (0..entries.len()).find(|&i| other_limit(i));
            // Fewer entries than the earlier route's: the list, where it ends short.
            first.map_or_else(|| limits.span(), |i| entries[i].span())
        }),
        "limits (one route writes [[routes.limits]])" => at(&r.limits),
        "cost_micro" => at(&r.cost_micro),
        "fail_mode" => at(&r.fail_mode),
        "fallback" => [
            at(&r.fallback_rate_per_process_micro),
            at(&r.fallback_rate_fleet_micro),
        ]
        .into_iter()
        .flatten()
        .min_by_key(|s| s.start),
        "policy_version" => at(&r.policy_version),
        "mode" => at(&r.mode),
        "emergency_scope" => at(&r.emergency_scope),
        "cost_from_response" => at(&r.cost_from_response),
        "tier_from" => at(&r.tier_from),
        "default_tier" => at(&r.default_tier),
        "tiers" => (r.tiers.iter())
            .filter(|(name, _)| other_tier(name))
            .map(|(_, tier)| tier.span())
            .min_by_key(|s| s.start),
        "ratelimit_headers" => at(&r.ratelimit_headers),
        "capacity_micro" => at(&r.capacity_micro),
        "refill_rate_micro_per_sec" => at(&r.refill_rate_micro_per_sec),
        "limit" => at(&r.limit),
        "window_size_micro" => at(&r.window_size_micro),
        "algorithm" => at(&r.algorithm),
        _ => None,
    }
}

/// The single-limit fields two algorithms write differently.
fn algorithm_fields(a: &Algorithm, b: &Algorithm) -> Vec<&'static str> {
    let fields = match (a, b) {
        (
            Algorithm::TokenBucket {
                capacity_micro: c1,
                refill_micro_per_sec: r1,
            },
            Algorithm::TokenBucket {
                capacity_micro: c2,
                refill_micro_per_sec: r2,
            },
        ) => [
            (c1 != c2, "capacity_micro"),
            (r1 != r2, "refill_rate_micro_per_sec"),
        ],
        (
            Algorithm::SlidingWindow {
                limit: l1,
                window_micro: w1,
            },
            Algorithm::SlidingWindow {
                limit: l2,
                window_micro: w2,
            },
        ) => [(l1 != l2, "limit"), (w1 != w2, "window_size_micro")],
        _ => [(a != b, "algorithm"), (false, "")],
    };
    fields
        .into_iter()
        .filter_map(|(differs, name)| differs.then_some(name))
        .collect()
}

/// Headers an answer cannot lose: its framing, hop-by-hop fields, and what the gateway or
/// HTTP itself writes (a cost header is removed from every answer).
const RESERVED_COST_HEADERS: &[&str] = &[
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "proxy-connection",
    "proxy-authenticate",
    "content-type",
    "content-encoding",
    "date",
    "location",
    "set-cookie",
    "www-authenticate",
    "retry-after",
    "ratelimit",
    "ratelimit-policy",
    "content-range",
    "vary",
    "sec-websocket-accept",
    "sec-websocket-protocol",
    "sec-websocket-extensions",
];

#[cfg(test)]
mod tests {
    use super::origin;

    #[test]
    fn an_origin_is_kept_as_a_browser_writes_it() {
        let o = |w: &str| origin(w).unwrap();
        assert_eq!(o("HTTPS://App.Example.com:443"), "https://app.example.com");
        assert_eq!(o("http://localhost:80"), "http://localhost");
        assert_eq!(o("http://localhost:3000"), "http://localhost:3000");
        assert_eq!(o("https://[0:0::1]:3000"), "https://[::1]:3000");
        assert_eq!(o("https://[2001:DB8::A]"), "https://[2001:db8::a]");
        assert_eq!(o("https://127.0.0.1:8443"), "https://127.0.0.1:8443");
        for wrong in [
            "https://0x7f.0.0.1",
            "https://01.2.3.4",
            "https://a-.example",
            "https://x:0",
        ] {
            assert!(origin(wrong).is_err(), "{wrong}");
        }
    }
}
