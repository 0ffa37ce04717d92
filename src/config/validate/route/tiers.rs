//! A route's tiers: `tier_from`, `default_tier` and `[routes.tiers.NAME]`.

use super::*;

/// `tier_from`, `default_tier` and `[routes.tiers.*]`: `Some(None)` for a route without
/// tiers.
pub(crate) fn tiers(
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
        crate::config::raw::RawTierFrom::Claim { claim } if super::super::unprintable(claim) => {
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
