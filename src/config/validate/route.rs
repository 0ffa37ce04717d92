//! One `[[routes]]` entry; its parts (path, identity, limits, policy, tiers, CORS) and the
//! rules between routes in the modules below.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use toml::Spanned;

use super::{int_in, route_label};
use crate::config::error::Collector;
use crate::config::raw::{RawConfig, RawIdentity, RawRateLimitHeaders, RawRoute};
use crate::config::*;
use crate::routing::{self, PathError, PathMatch};

mod algorithm;
mod cors;
mod identity;
mod limits;
mod path;
mod policy;
mod shared;
mod tiers;

pub(crate) use algorithm::*;
use cors::*;
pub(crate) use identity::*;
pub(crate) use limits::*;
pub(crate) use path::*;
pub(crate) use policy::*;
pub(crate) use shared::*;
pub(crate) use tiers::*;

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
