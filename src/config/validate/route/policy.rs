//! A route's limiting policy: its fields together, its RateLimit fields and its reported cost.

use super::*;

/// The fields of a limited route's decision written on a route that is not limited
/// (`algorithm = "none"`, no limits or tiers), which change nothing there: taken, and said
/// (as `exempt_client_cidrs` is), at the first of them. Not `identity` (a `Host` or
/// `User-Agent` identity still keeps that field out of the access log), `mode` (shown in
/// `sentinel_endpoint_mode`) or `fallback_rate_fleet_micro`, said on its own.
pub(crate) fn inert_when_not_limited(c: &mut Collector, label: Option<&str>, r: &RawRoute) {
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

pub(crate) fn policy(
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
                        super::super::shape::key_shown(name),
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
pub(crate) fn ratelimit_headers(
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
            c.push(Some(&written.span()), label, format!("ratelimit_headers = \"{}\" is unknown: use true (the IETF RateLimit-Policy and RateLimit fields, as \"ietf\"), \"x-ratelimit\" (X-RateLimit-Limit, -Remaining and -Reset), \"both\" or false", super::super::cut(n)));
            return None;
        }
    };
    Some(RateLimitHeaders { ietf, x })
}

/// Whether the route's cost can ever be admitted by one limit (`at` names it in messages).
pub(crate) fn cost_fits(
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

/// Headers an answer cannot lose: its framing, hop-by-hop fields, and what the gateway or
/// HTTP itself writes (a cost header is removed from every answer).
pub(crate) const RESERVED_COST_HEADERS: &[&str] = &[
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
