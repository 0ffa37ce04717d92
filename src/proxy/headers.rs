//! The IETF `RateLimit-Policy` and `RateLimit` header fields
//! (draft-ietf-httpapi-ratelimit-headers-09), computed from the script's answer (or, for a
//! denial the over-limit cache repeats, from what it kept of that answer): never from a
//! second Redis call, and never for a decision Redis did not make.
//!
//! Values are in requests of this route's cost:
//! - token bucket: `q` = capacity / cost, `w` = seconds to refill the whole capacity,
//!   `r` = tokens left / cost, `t` = seconds until the bucket is full again;
//! - sliding window: `q` = limit / cost, `w` = the window in seconds, `r` = requests the
//!   estimate still admits / cost, `t` = seconds until the current window ends (with `r` 0,
//!   until the estimate admits another request: the script's `reset`);
//! - on a denial by the limit, `t` is at least its `Retry-After`.
//!
//! `w` and `t` are left out when the bucket never refills.

use crate::config::{Algorithm, Policy, RateLimitHeaders, ONE_TOKEN_MICRO};
use crate::decision::ScriptReply;
use sfv::SerializeValue;

/// The header fields of one answer, as the route asks for them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitFields {
    /// `RateLimit-Policy` and `RateLimit`, with `ratelimit_headers = true` (or `"ietf"`).
    pub ietf: Option<(String, String)>,
    /// `X-RateLimit-Limit`, `-Remaining` and `-Reset` (`None` when it never refills), with
    /// `"x-ratelimit"`: the limit nearest to refusing (see [`nearest`]).
    pub x: Option<(u64, u64, Option<u64>)>,
}

impl RateLimitFields {
    /// Sets the fields on an answer's head.
    pub fn set_on(&self, head: &mut pingora_http::ResponseHeader) -> pingora_core::Result<()> {
        if let Some((policy, state)) = &self.ietf {
            head.insert_header("ratelimit-policy", policy.as_str())?;
            head.insert_header("ratelimit", state.as_str())?;
        }
        if let Some((limit, remaining, reset)) = self.x {
            head.insert_header("x-ratelimit-limit", limit.to_string())?;
            head.insert_header("x-ratelimit-remaining", remaining.to_string())?;
            if let Some(reset) = reset {
                head.insert_header("x-ratelimit-reset", reset.to_string())?;
            }
        }
        Ok(())
    }

    /// Sets the fields on an upstream's answer, beside what the upstream wrote of its own
    /// limits (a backend that limits too): `RateLimit-Policy` and `RateLimit` are lists of
    /// items named by policy, so the gateway's items are added after the upstream's; the
    /// `X-RateLimit-*` trio says one limit, the one nearest to refusing, so the upstream's
    /// stays when it has fewer requests left (its own 429 says 0, not the gateway's 999).
    /// A policy both name is said once, by the side with fewer requests left (as the trio
    /// is: the upstream's only when it gives both items of it); an upstream's field that is no Structured Field list (RFC 9651) is replaced by
    /// the gateway's, which a client could not read joined to it.
    pub fn merge_onto(&self, head: &mut pingora_http::ResponseHeader) -> pingora_core::Result<()> {
        let theirs = |head: &pingora_http::ResponseHeader, name: &str| -> Option<String> {
            let values: Option<Vec<&str>> = (head.headers.get_all(name).iter())
                .map(|v| v.to_str().ok().map(str::trim))
                .collect();
            // Several fields of a list are one list, comma-joined (RFC 9110, 5.3); an empty
            // one adds nothing to it.
            let values: Vec<&str> = values?.into_iter().filter(|v| !v.is_empty()).collect();
            (!values.is_empty()).then(|| values.join(", "))
        };
        if let Some((policy, state)) = &self.ietf {
            let their_policy = theirs(head, "ratelimit-policy").filter(|t| !t.is_empty());
            let their_state = theirs(head, "ratelimit").filter(|t| !t.is_empty());
            match (their_policy, their_state) {
                // An upstream that says nothing of its limits: the gateway's fields as made.
                (None, None) => {
                    head.insert_header("ratelimit-policy", policy.as_str())?;
                    head.insert_header("ratelimit", state.as_str())?;
                }
                (their_policy, their_state) => {
                    let (policy, state) = merged(
                        (their_policy.as_deref(), their_state.as_deref()),
                        (policy, state),
                    );
                    head.insert_header("ratelimit-policy", policy)?;
                    head.insert_header("ratelimit", state)?;
                }
            }
        }
        if let Some((_, remaining, _)) = self.x {
            let upstream_nearer = theirs(head, "x-ratelimit-remaining")
                .and_then(|r| r.parse::<u64>().ok())
                .is_some_and(|theirs| theirs < remaining);
            if upstream_nearer {
                return Ok(());
            }
            for name in [
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
            ] {
                head.remove_header(name);
            }
            let ours = RateLimitFields {
                ietf: None,
                x: self.x,
            };
            ours.set_on(head)?;
        }
        Ok(())
    }
}

/// The upstream's `RateLimit-Policy` and `RateLimit` lists with the gateway's after them: a
/// policy both name keeps the items of the side with fewer requests left (its `r`; the
/// gateway's when the upstream's says none), and a field of the upstream's that is no
/// Structured Field list is left out.
fn merged(theirs: (Option<&str>, Option<&str>), ours: (&str, &str)) -> (String, String) {
    let read = |v: Option<&str>| {
        v.and_then(|v| sfv::Parser::parse_list(v.as_bytes()).ok())
            .unwrap_or_default()
    };
    let (mut their_policy, mut their_state) = (read(theirs.0), read(theirs.1));
    let (mut our_policy, mut our_state) = (read(Some(ours.0)), read(Some(ours.1)));
    // An item's integer parameter (`r`, `t`).
    let param = |list: &sfv::List, name: &str, key: &str| {
        (list.iter())
            .find(|e| policy_name(e) == Some(name))
            .and_then(|e| match e {
                sfv::ListEntry::Item(i) => i.params.get(key).and_then(|v| v.as_int()),
                sfv::ListEntry::InnerList(_) => None,
            })
    };
    let mut shared: Vec<String> = (our_state.iter().chain(&our_policy))
        .filter_map(policy_name)
        .filter(|n| (their_policy.iter().chain(&their_state)).any(|e| policy_name(e) == Some(n)))
        .map(str::to_owned)
        .collect();
    shared.sort_unstable();
    shared.dedup();
    for name in &shared {
        // The upstream's pair, when it gives one (its `RateLimit` beside a `RateLimit-Policy`
        // of the name: its `r` and `t` are not paired with the gateway's `q` and `w`), with
        // fewer left; of two alike, the one that frees last (as the `X-RateLimit-*` trio's).
        let paired = their_policy.iter().any(|e| policy_name(e) == Some(name));
        let (r, t) = (
            |l: &sfv::List| param(l, name, "r"),
            |l: &sfv::List| param(l, name, "t"),
        );
        let upstream_nearer = paired
            && match (r(&their_state), r(&our_state)) {
                (Some(theirs), Some(ours)) if theirs == ours => {
                    t(&their_state).unwrap_or(0) > t(&our_state).unwrap_or(0)
                }
                (Some(theirs), Some(ours)) => theirs < ours,
                _ => false,
            };
        let (policy, state) = match upstream_nearer {
            true => (&mut our_policy, &mut our_state),
            false => (&mut their_policy, &mut their_state),
        };
        policy.retain(|e| policy_name(e) != Some(name));
        state.retain(|e| policy_name(e) != Some(name));
    }
    let joined = |mut theirs: sfv::List, ours: sfv::List, made: &str| {
        theirs.extend(ours);
        theirs.serialize_value().unwrap_or_else(|_| made.to_owned())
    };
    (
        joined(their_policy, our_policy, ours.0),
        joined(their_state, our_state, ours.1),
    )
}

/// The policy an item of a `RateLimit` list is about: its value, a string or a token.
fn policy_name(entry: &sfv::ListEntry) -> Option<&str> {
    match entry {
        sfv::ListEntry::Item(i) => i.bare_item.as_str().or_else(|| i.bare_item.as_token()),
        sfv::ListEntry::InnerList(_) => None,
    }
}

/// One limit's numbers and items.
struct Item {
    policy: String,
    state: String,
    quota: u64,
    remaining: u64,
    reset: Option<u64>,
}

/// A single-limit route's item is named after the endpoint, as before `[[routes.limits]]`;
/// on a tiered route, whose tiers' limits are named, it is the limit named `default` (as
/// `/limits`, the metrics and the logs name it), beside the names a tier's limits have.
pub fn fields(policy: &Policy, reply: &ScriptReply) -> Option<RateLimitFields> {
    let name = match policy.tiers {
        Some(_) => "default",
        None => policy.endpoint_id.as_str(),
    };
    let item = item(name, policy.algorithm, policy.cost_micro, reply)?;
    Some(joined(policy.ratelimit_headers, vec![item]))
}

/// With `[[routes.limits]]`: one item per limit, named after the limit, in the policy's
/// order; a limit Redis could not be asked about (a ceiling on another cluster node whose
/// read failed after the caller's own limits denied) is left out.
pub fn several(policy: &Policy, replies: &[ScriptReply]) -> Option<RateLimitFields> {
    let items: Vec<Item> = policy
        .limits
        .iter()
        .zip(replies)
        .filter(|(_, r)| r.now_us > 0)
        .filter_map(|(l, r)| item(&l.name, l.algorithm, policy.cost_micro, r))
        .collect();
    if items.is_empty() {
        return None;
    }
    Some(joined(policy.ratelimit_headers, items))
}

/// With `[[routes.limits]]`, a denial repeated by the over-limit cache: the item of the
/// limit that denied, the only one the cache knows about.
pub fn one(policy: &Policy, limit: usize, reply: &ScriptReply) -> Option<RateLimitFields> {
    let l = policy.limits.get(limit)?;
    let item = item(&l.name, l.algorithm, policy.cost_micro, reply)?;
    Some(joined(policy.ratelimit_headers, vec![item]))
}

fn joined(which: RateLimitHeaders, items: Vec<Item>) -> RateLimitFields {
    let x = which
        .x
        .then(|| nearest(&items))
        .flatten()
        .map(|i| (i.quota, i.remaining, i.reset));
    let ietf = which.ietf.then(|| {
        let (policies, states): (Vec<&str>, Vec<&str>) = items
            .iter()
            .map(|i| (i.policy.as_str(), i.state.as_str()))
            .unzip();
        (policies.join(", "), states.join(", "))
    });
    RateLimitFields { ietf, x }
}

/// The limit whose numbers the `X-RateLimit-*` fields give, as Envoy's and Kong's single set
/// does: the one with the fewest requests left; among those, the one that frees last (on a
/// 429, the denying limit whose `Reset` is the wait until every limit admits again).
fn nearest(items: &[Item]) -> Option<&Item> {
    items.iter().min_by(|a, b| {
        a.remaining.cmp(&b.remaining).then(
            b.reset
                .unwrap_or(u64::MAX)
                .cmp(&a.reset.unwrap_or(u64::MAX)),
        )
    })
}

/// One limit's `RateLimit-Policy` and `RateLimit` items, and its numbers.
fn item(name: &str, algorithm: Algorithm, cost_micro: u64, reply: &ScriptReply) -> Option<Item> {
    let (quota, window, remaining) = match algorithm {
        Algorithm::None => return None,
        Algorithm::TokenBucket {
            capacity_micro,
            refill_micro_per_sec,
        } => {
            let window =
                (refill_micro_per_sec > 0).then(|| capacity_micro.div_ceil(refill_micro_per_sec));
            (
                capacity_micro / cost_micro,
                window,
                reply.remaining.max(0) as u64 / cost_micro,
            )
        }
        Algorithm::SlidingWindow {
            limit,
            window_micro,
        } => {
            let cost = (cost_micro / ONE_TOKEN_MICRO).max(1);
            let window = Some(window_micro.div_ceil(ONE_TOKEN_MICRO));
            (limit / cost, window, reply.remaining.max(0) as u64 / cost)
        }
    };
    let mut policy = format!("\"{name}\";q={quota}");
    if let Some(w) = window {
        policy.push_str(&format!(";w={w}"));
    }
    let mut state = format!("\"{name}\";r={remaining}");
    // A bucket that never refills has no time to full, whatever the reply says. On a denial
    // by this limit, never before it admits again (a sliding window's script says that wait
    // itself; a token bucket's time to full is never below it), so `t` beside `r=0` never
    // sends a client that reads only these fields straight back.
    let reset = match (window, reply.reset) {
        (Some(_), Some(t)) => Some(match (reply.allowed, reply.retry_after) {
            (false, Some(wait)) => t.max(wait),
            _ => t,
        }),
        _ => None,
    };
    if let Some(t) = reset {
        state.push_str(&format!(";t={t}"));
    }
    Some(Item {
        policy,
        state,
        quota,
        remaining,
        reset,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{EndpointId, Enforcement, FailMode};

    fn policy(algorithm: Algorithm, cost_micro: u64) -> Policy {
        Policy {
            endpoint_id: EndpointId::parse("resumint.tailor").unwrap(),
            algorithm,
            limits: Vec::new(),
            several: false,
            cost_micro,
            fail_mode: FailMode::FailOpen,
            fallback_rate_micro: Some(1_000_000),
            fallback_fleet: false,
            policy_version: 1,
            mode: Enforcement::Enforce,
            ratelimit_headers: RateLimitHeaders {
                ietf: true,
                x: true,
            },
            emergency_per_identity: false,
            cost_from_response: None,
            tiers: None,
        }
    }

    fn reply(remaining: i64, reset: Option<u64>) -> ScriptReply {
        ScriptReply {
            allowed: true,
            remaining,
            retry_after: None,
            reset,
            now_us: 0,
            wait_us: None,
        }
    }

    #[test]
    fn token_bucket_fields_count_requests_of_the_route_cost() {
        let p = policy(
            Algorithm::TokenBucket {
                capacity_micro: 20_000_000,
                refill_micro_per_sec: 2_000_000,
            },
            2_000_000,
        );
        let f = fields(&p, &reply(7_500_000, Some(7))).unwrap();
        assert_eq!(f.ietf.as_ref().unwrap().0, r#""resumint.tailor";q=10;w=10"#);
        assert_eq!(f.ietf.as_ref().unwrap().1, r#""resumint.tailor";r=3;t=7"#);
        assert_eq!(f.x, Some((10, 3, Some(7))));
        let never = policy(
            Algorithm::TokenBucket {
                capacity_micro: 5_000_000,
                refill_micro_per_sec: 0,
            },
            1_000_000,
        );
        let f = fields(&never, &reply(0, None)).unwrap();
        assert_eq!(
            (
                f.ietf.as_ref().unwrap().0.as_str(),
                f.ietf.as_ref().unwrap().1.as_str()
            ),
            (r#""resumint.tailor";q=5"#, r#""resumint.tailor";r=0"#)
        );
        // Beside another limit that denied, the script reports a reset of 0 for it: still
        // no `t`.
        let f = fields(&never, &reply(3_000_000, Some(0))).unwrap();
        assert_eq!(f.ietf.as_ref().unwrap().1, r#""resumint.tailor";r=3"#);
    }

    #[test]
    fn sliding_window_fields() {
        let p = policy(
            Algorithm::SlidingWindow {
                limit: 100,
                window_micro: 60_000_000,
            },
            1_000_000,
        );
        let f = fields(&p, &reply(42, Some(13))).unwrap();
        assert_eq!(
            f.ietf.as_ref().unwrap().0,
            r#""resumint.tailor";q=100;w=60"#
        );
        assert_eq!(f.ietf.as_ref().unwrap().1, r#""resumint.tailor";r=42;t=13"#);
    }

    #[test]
    fn a_denial_never_says_to_come_back_before_it_admits() {
        let p = policy(
            Algorithm::SlidingWindow {
                limit: 5,
                window_micro: 10_000_000,
            },
            1_000_000,
        );
        // The current window has just ended, the last one's weight still refuses for 2 s.
        let denied = ScriptReply {
            allowed: false,
            retry_after: Some(2),
            ..reply(0, Some(0))
        };
        assert_eq!(
            fields(&p, &denied).unwrap().ietf.unwrap().1,
            r#""resumint.tailor";r=0;t=2"#
        );
        // A later window end stays as it is.
        let later = ScriptReply {
            allowed: false,
            retry_after: Some(2),
            ..reply(0, Some(7))
        };
        assert_eq!(
            fields(&p, &later).unwrap().ietf.unwrap().1,
            r#""resumint.tailor";r=0;t=7"#
        );
    }

    fn item(name: &str, remaining: u64, reset: Option<u64>) -> Item {
        Item {
            policy: format!("\"{name}\";q=10"),
            state: format!("\"{name}\";r={remaining}"),
            quota: 10,
            remaining,
            reset,
        }
    }

    #[test]
    fn the_x_ratelimit_fields_give_the_limit_nearest_to_refusing() {
        let both = RateLimitHeaders {
            ietf: true,
            x: true,
        };
        // The fewest left wins; among limits with none left, the one that frees last.
        let f = joined(
            both,
            vec![item("burst", 4, Some(2)), item("daily", 1, Some(5000))],
        );
        assert_eq!(f.x, Some((10, 1, Some(5000))));
        let f = joined(
            both,
            vec![
                item("burst", 0, Some(3)),
                item("daily", 0, Some(70)),
                item("fleet", 2, Some(1)),
            ],
        );
        assert_eq!(f.x, Some((10, 0, Some(70))));
        // A limit that never refills has no reset, and frees last of all.
        let f = joined(both, vec![item("a", 0, Some(9)), item("b", 0, None)]);
        assert_eq!(f.x, Some((10, 0, None)));
        let ietf = f.ietf.unwrap();
        assert_eq!(
            ietf,
            (
                "\"a\";q=10, \"b\";q=10".to_owned(),
                "\"a\";r=0, \"b\";r=0".to_owned()
            )
        );
        // Only what the route asks for.
        let only_x = joined(
            RateLimitHeaders {
                ietf: false,
                x: true,
            },
            vec![item("a", 3, Some(1))],
        );
        assert_eq!((only_x.ietf, only_x.x), (None, Some((10, 3, Some(1)))));
        let only_ietf = joined(
            RateLimitHeaders {
                ietf: true,
                x: false,
            },
            vec![item("a", 3, Some(1))],
        );
        assert_eq!(only_ietf.x, None);
    }

    /// A backend that limits too: its items stay beside the gateway's, and its own 429's
    /// `X-RateLimit-Remaining: 0` is not turned into the gateway's 999.
    #[test]
    fn an_upstreams_own_fields_are_kept_beside_the_gateways() {
        let ours = RateLimitFields {
            ietf: Some((
                "\"resumint.tailor\";q=1000;w=10".to_owned(),
                "\"resumint.tailor\";r=999;t=1".to_owned(),
            )),
            x: Some((1000, 999, Some(1))),
        };
        let field = |h: &pingora_http::ResponseHeader, name: &str| {
            let all: Vec<&str> = h
                .headers
                .get_all(name)
                .iter()
                .map(|v| v.to_str().unwrap())
                .collect();
            all.join(" | ")
        };
        let mut theirs = pingora_http::ResponseHeader::build(429, None).unwrap();
        theirs
            .append_header("ratelimit-policy", "\"backend\";q=10;w=60")
            .unwrap();
        theirs
            .append_header("ratelimit", "\"backend\";r=0;t=7")
            .unwrap();
        theirs.append_header("x-ratelimit-limit", "10").unwrap();
        theirs.append_header("x-ratelimit-remaining", "0").unwrap();
        ours.merge_onto(&mut theirs).unwrap();
        assert_eq!(
            field(&theirs, "ratelimit-policy"),
            "\"backend\";q=10;w=60, \"resumint.tailor\";q=1000;w=10"
        );
        assert_eq!(
            field(&theirs, "ratelimit"),
            "\"backend\";r=0;t=7, \"resumint.tailor\";r=999;t=1"
        );
        assert_eq!(field(&theirs, "x-ratelimit-remaining"), "0");
        assert_eq!(field(&theirs, "x-ratelimit-limit"), "10");
        assert_eq!(field(&theirs, "x-ratelimit-reset"), "");
        // The gateway's limit nearer to refusing: its trio, whole, in place of the upstream's.
        let mut roomy = pingora_http::ResponseHeader::build(200, None).unwrap();
        roomy.append_header("x-ratelimit-limit", "5000").unwrap();
        roomy
            .append_header("x-ratelimit-remaining", "4000")
            .unwrap();
        roomy.append_header("x-ratelimit-reset", "60").unwrap();
        ours.merge_onto(&mut roomy).unwrap();
        assert_eq!(field(&roomy, "x-ratelimit-limit"), "1000");
        assert_eq!(field(&roomy, "x-ratelimit-remaining"), "999");
        assert_eq!(field(&roomy, "x-ratelimit-reset"), "1");
        // A field of the upstream's that no client could read: the gateway's alone, readable.
        let mut garbled = pingora_http::ResponseHeader::build(200, None).unwrap();
        garbled
            .append_header("ratelimit", "limit=10; remaining=(3")
            .unwrap();
        garbled
            .append_header("ratelimit-policy", "\"backend\";q=10;w=60")
            .unwrap();
        ours.merge_onto(&mut garbled).unwrap();
        assert_eq!(
            field(&garbled, "ratelimit"),
            "\"resumint.tailor\";r=999;t=1"
        );
        assert_eq!(
            field(&garbled, "ratelimit-policy"),
            "\"backend\";q=10;w=60, \"resumint.tailor\";q=1000;w=10"
        );
        // An empty field line beside a whole one adds nothing to the list.
        let mut blank = pingora_http::ResponseHeader::build(200, None).unwrap();
        blank.append_header("ratelimit", "").unwrap();
        (blank.append_header("ratelimit", "\"backend\";r=0;t=7")).unwrap();
        ours.merge_onto(&mut blank).unwrap();
        assert_eq!(
            field(&blank, "ratelimit"),
            "\"backend\";r=0;t=7, \"resumint.tailor\";r=999;t=1"
        );
        // A policy both name, said once, by the side with fewer left: the upstream's when
        // its own is nearer to refusing, the gateway's otherwise.
        let same = |r: u64| {
            let mut h = pingora_http::ResponseHeader::build(200, None).unwrap();
            (h.append_header("ratelimit-policy", "\"resumint.tailor\";q=50;w=60")).unwrap();
            (h.append_header("ratelimit", format!("\"resumint.tailor\";r={r};t=9"))).unwrap();
            ours.merge_onto(&mut h).unwrap();
            (field(&h, "ratelimit-policy"), field(&h, "ratelimit"))
        };
        assert_eq!(
            same(3),
            (
                "\"resumint.tailor\";q=50;w=60".to_owned(),
                "\"resumint.tailor\";r=3;t=9".to_owned()
            )
        );
        // Its `RateLimit` alone for the name: not paired with the gateway's policy item.
        let mut lonely = pingora_http::ResponseHeader::build(200, None).unwrap();
        (lonely.append_header("ratelimit", "\"resumint.tailor\";r=0;t=9")).unwrap();
        ours.merge_onto(&mut lonely).unwrap();
        assert_eq!(field(&lonely, "ratelimit"), "\"resumint.tailor\";r=999;t=1");
        assert_eq!(
            field(&lonely, "ratelimit-policy"),
            "\"resumint.tailor\";q=1000;w=10"
        );
        // As many left on both sides: the one that frees last.
        assert_eq!(
            same(999),
            (
                "\"resumint.tailor\";q=50;w=60".to_owned(),
                "\"resumint.tailor\";r=999;t=9".to_owned()
            )
        );
        assert_eq!(
            same(1000),
            (
                "\"resumint.tailor\";q=1000;w=10".to_owned(),
                "\"resumint.tailor\";r=999;t=1".to_owned()
            )
        );
        // An upstream without fields of its own: the gateway's alone, as before.
        let mut plain = pingora_http::ResponseHeader::build(200, None).unwrap();
        ours.merge_onto(&mut plain).unwrap();
        assert_eq!(field(&plain, "ratelimit"), "\"resumint.tailor\";r=999;t=1");
        assert_eq!(field(&plain, "x-ratelimit-remaining"), "999");
    }
}
