//! One `[[routes]]` entry, and the rules between routes.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use toml::Spanned;

use super::{int_in, route_label};
use crate::config::error::Collector;
use crate::config::raw::{RawConfig, RawIdentity, RawRoute};
use crate::config::*;
use crate::routing::{self, PathMatch};

pub(super) fn route(
    c: &mut Collector,
    index: usize,
    spanned: &Spanned<RawRoute>,
    raw: &RawConfig,
    upstreams: &BTreeMap<String, Arc<UpstreamConfig>>,
    server_max_body_bytes: Option<u64>,
) -> Option<RouteConfig> {
    let r = spanned.get_ref();
    let id_text = r.endpoint_id.get_ref();
    let label = route_label(index, id_text);
    let label = Some(label.as_str());
    let before = c.errors.len();

    let endpoint_id = EndpointId::parse(id_text);
    if endpoint_id.is_none() {
        c.push(
            Some(&r.endpoint_id.span()),
            label,
            format!(
                "endpoint_id = \"{id_text}\" is not valid: use 1 to 128 of a-z, 0-9, '.', '_', '-'"
            ),
        );
    }
    let path = route_path(c, label, spanned);
    let methods = r.methods.as_ref().map(|m| {
        if m.get_ref().is_empty() {
            c.push(
                Some(&m.span()),
                label,
                "methods = [] matches nothing: leave methods out to match any method".into(),
            );
        }
        m.get_ref()
            .iter()
            .filter_map(|name| {
                match http::Method::from_bytes(name.to_ascii_uppercase().as_bytes()) {
                    Ok(method) => Some(method),
                    Err(_) => {
                        c.push(
                            Some(&m.span()),
                            label,
                            format!("methods: \"{name}\" is not an HTTP method"),
                        );
                        None
                    }
                }
            })
            .collect::<Vec<_>>()
    });
    let host = r.host.as_ref().and_then(|h| {
        let v = h.get_ref().to_ascii_lowercase();
        let valid = !v.is_empty() && v.len() <= 253 && v.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-'));
        if !valid {
            c.push(Some(&h.span()), label, format!("host = \"{}\" is not a host name: write it without scheme or port, such as \"api.example.com\"", h.get_ref()));
        }
        valid.then_some(v)
    });
    let upstream = upstreams.get(r.upstream.get_ref()).cloned();
    if upstream.is_none() && !raw.upstreams.contains_key(r.upstream.get_ref()) {
        let known: Vec<&str> = raw.upstreams.keys().map(String::as_str).collect();
        c.push(
            Some(&r.upstream.span()),
            label,
            format!(
                "upstream = \"{}\" is not defined: define [upstreams.{}] or use one of [{}]",
                r.upstream.get_ref(),
                r.upstream.get_ref(),
                known.join(", ")
            ),
        );
    }
    let algorithm = algorithm(c, label, r);
    // An unknown algorithm is already an error; do not pile an identity error on it.
    let limited = algorithm.is_some_and(|a| a != Algorithm::None);
    let identity = identity(c, label, r, limited, raw);
    let policy = policy(c, label, r, endpoint_id, algorithm);

    if c.errors.len() > before {
        return None;
    }
    let exempt = super::sections::cidrs(
        c,
        label,
        "exempt_client_cidrs",
        r.exempt_client_cidrs.as_ref(),
    );
    let max_body_bytes = match &r.max_body_bytes {
        None => Some(server_max_body_bytes),
        own => super::sections::body_limit(c, label, "max_body_bytes", own.as_ref()),
    };
    Some(RouteConfig {
        index,
        path: path?,
        methods,
        host,
        upstream: upstream?,
        identity: identity?,
        policy: Arc::new(policy?),
        max_body_bytes: max_body_bytes?,
        exempt_client_cidrs: exempt?,
    })
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
    match routing::normalize_path(text) {
        Ok(n) if n.as_str() == text.as_str() && (text == "/" || !text.ends_with('/')) => {
            Some(if exact {
                PathMatch::Exact(n)
            } else {
                PathMatch::Prefix(n)
            })
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
            c.push(
                Some(&value.span()),
                label,
                format!("{field} = \"{text}\" is not usable: {e}; it must start with '/'"),
            );
            None
        }
    }
}

fn algorithm(c: &mut Collector, label: Option<&str>, r: &RawRoute) -> Option<Algorithm> {
    let misplaced = |c: &mut Collector, field: &str, v: &Option<Spanned<i64>>, alg: &str| {
        if let Some(v) = v {
            c.push(
                Some(&v.span()),
                label,
                format!("{field} does not apply to algorithm = \"{alg}\": remove it"),
            );
        }
    };
    match r.algorithm.get_ref().as_str() {
        "none" => {
            for (f, v) in [
                ("limit", &r.limit),
                ("window_size_micro", &r.window_size_micro),
                ("capacity_micro", &r.capacity_micro),
                ("refill_rate_micro_per_sec", &r.refill_rate_micro_per_sec),
                ("cost_micro", &r.cost_micro),
            ] {
                misplaced(c, f, v, "none");
            }
            Some(Algorithm::None)
        }
        "token_bucket" => {
            misplaced(c, "limit", &r.limit, "token_bucket");
            misplaced(c, "window_size_micro", &r.window_size_micro, "token_bucket");
            let capacity = match &r.capacity_micro {
                None => {
                    c.push(Some(&r.algorithm.span()), label, "capacity_micro is required for algorithm = \"token_bucket\": the burst in micro-tokens (1 request = 1000000)".into());
                    None
                }
                Some(v) if *v.get_ref() < ONE_TOKEN_MICRO as i64 => {
                    c.push(Some(&v.span()), label, format!("capacity_micro = {} can never admit a request: it must be >= 1000000 (one token)", v.get_ref()));
                    None
                }
                Some(v) => int_in(
                    c,
                    label,
                    "capacity_micro",
                    Some(v),
                    0,
                    (1_000_000, MAX_CAPACITY_MICRO as i64),
                    " (10^9 requests)",
                ),
            };
            let refill = match &r.refill_rate_micro_per_sec {
                None => {
                    c.push(Some(&r.algorithm.span()), label, "refill_rate_micro_per_sec is required for algorithm = \"token_bucket\": micro-tokens added per second (0 = never refills)".into());
                    None
                }
                v => int_in(
                    c,
                    label,
                    "refill_rate_micro_per_sec",
                    v.as_ref(),
                    0,
                    (0, MAX_RATE_MICRO_PER_SEC as i64),
                    " (10^6 requests per second)",
                ),
            };
            Some(Algorithm::TokenBucket {
                capacity_micro: capacity?,
                refill_micro_per_sec: refill?,
            })
        }
        "sliding_window" => {
            misplaced(c, "capacity_micro", &r.capacity_micro, "sliding_window");
            misplaced(
                c,
                "refill_rate_micro_per_sec",
                &r.refill_rate_micro_per_sec,
                "sliding_window",
            );
            let limit = match &r.limit {
                None => {
                    c.push(
                        Some(&r.algorithm.span()),
                        label,
                        "limit is required for algorithm = \"sliding_window\": requests per window"
                            .into(),
                    );
                    None
                }
                v => int_in(
                    c,
                    label,
                    "limit",
                    v.as_ref(),
                    0,
                    (1, 1_000_000_000),
                    " requests",
                ),
            };
            let window = match &r.window_size_micro {
                None => {
                    c.push(Some(&r.algorithm.span()), label, "window_size_micro is required for algorithm = \"sliding_window\": the window in microseconds (60_000_000 = one minute)".into());
                    None
                }
                v => int_in(
                    c,
                    label,
                    "window_size_micro",
                    v.as_ref(),
                    0,
                    (1_000, 86_400_000_000),
                    " (1 ms to 1 day)",
                ),
            };
            let (limit, window) = (limit?, window?);
            if limit.saturating_mul(window) > MAX_WINDOW_PRODUCT {
                let span = r.limit.as_ref().map(|v| v.span());
                c.push(span.as_ref(), label, format!("limit x window_size_micro = {limit} x {window} is too large to count exactly: it must be <= 4000000000000000 (for example 1000000 requests per 4000 s)"));
                return None;
            }
            Some(Algorithm::SlidingWindow {
                limit,
                window_micro: window,
            })
        }
        other => {
            c.push(Some(&r.algorithm.span()), label, format!("algorithm = \"{other}\" is unknown: use \"token_bucket\", \"sliding_window\" or \"none\""));
            None
        }
    }
}

fn identity(
    c: &mut Collector,
    label: Option<&str>,
    r: &RawRoute,
    limited: bool,
    raw: &RawConfig,
) -> Option<IdentitySource> {
    let Some(spanned) = &r.identity else {
        if limited {
            c.push(Some(&r.endpoint_id.span()), label, "identity is required for a limited route: use \"jwt\", \"api_key\", \"client_ip\", \"global\" or { header = \"X-API-Key\" }".into());
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
            Ok(name) => Some(IdentitySource::Header(name.as_str().to_owned())),
            Err(_) => {
                c.push(
                    Some(&span),
                    label,
                    format!("identity = {{ header = \"{header}\" }} is not a valid header name"),
                );
                None
            }
        },
    }
}

fn policy(
    c: &mut Collector,
    label: Option<&str>,
    r: &RawRoute,
    endpoint_id: Option<EndpointId>,
    algorithm: Option<Algorithm>,
) -> Option<Policy> {
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
    if let (Some(cost), Some(Algorithm::SlidingWindow { limit, .. })) = (cost, algorithm) {
        let span = r.cost_micro.as_ref().map(|v| v.span());
        if cost % ONE_TOKEN_MICRO != 0 {
            c.push(span.as_ref(), label, format!("cost_micro = {cost} is not a whole number of requests: a sliding window counts requests, so use a multiple of 1000000"));
        } else if cost / ONE_TOKEN_MICRO > limit {
            c.push(
                span.as_ref(),
                label,
                format!(
                    "cost_micro = {cost} can never be admitted: it must be <= limit x 1000000 ({})",
                    limit * ONE_TOKEN_MICRO
                ),
            );
        }
    }
    if let (Some(cost), Some(Algorithm::TokenBucket { capacity_micro, .. })) = (cost, algorithm) {
        if cost > capacity_micro {
            let span = r.cost_micro.as_ref().map(|v| v.span());
            c.push(span.as_ref(), label, format!("cost_micro = {cost} can never be admitted: it must be <= capacity_micro ({capacity_micro})"));
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
    Some(Policy {
        endpoint_id: endpoint_id?,
        algorithm: algorithm?,
        cost_micro: cost?,
        fail_mode: fail_mode?,
        fallback_rate_micro: fallback,
        fallback_fleet,
        policy_version: version?,
        mode: mode?,
        ratelimit_headers: r.ratelimit_headers.unwrap_or(false),
        emergency_per_identity: per_identity?,
    })
}

/// Routes may share an endpoint id, and so a bucket, only with identical limits.
pub(super) fn shared_endpoints(c: &mut Collector, routes: &[(Range<usize>, RouteConfig)]) {
    let mut first: BTreeMap<&EndpointId, &RouteConfig> = BTreeMap::new();
    for (span, route) in routes {
        let id = &route.policy.endpoint_id;
        match first.get(id) {
            Some(prev) if prev.policy != route.policy => c.push(
                Some(span),
                Some(&route_label(route.index, id.as_str())),
                format!(
                    "shares endpoint_id with routes[{}] but not its limit fields: routes of one \
                     endpoint share one bucket, so algorithm, limits, cost, fail mode, fallback, \
                     mode and policy_version must be identical",
                    prev.index
                ),
            ),
            Some(_) => {}
            None => {
                first.insert(id, route);
            }
        }
    }
}
