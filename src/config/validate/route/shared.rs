//! Routes that share an `endpoint_id` share its buckets: they must say the same policy.

use super::*;

/// Routes may share an endpoint id, and so a bucket, only with identical limits.
/// The error is pointed at the first of the differing fields the later route writes (at its
/// header when it writes none of them: the difference is the earlier route's field).
pub(crate) fn shared_endpoints(
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
pub(crate) fn differing(a: &RouteConfig, b: &RouteConfig) -> Vec<&'static str> {
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
pub(crate) fn field_span(
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
pub(crate) fn algorithm_fields(a: &Algorithm, b: &Algorithm) -> Vec<&'static str> {
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
