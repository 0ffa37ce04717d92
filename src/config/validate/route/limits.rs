//! A route's limits: its own fields, or `[[routes.limits]]` entries.

use super::*;

/// The route's limits: its single-limit fields as one limit named `default`, or its
/// `[[routes.limits]]`; the bool says which (several).
pub(crate) fn limits(
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
pub(crate) fn named_limits(
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
