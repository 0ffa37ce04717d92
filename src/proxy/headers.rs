//! The IETF `RateLimit-Policy` and `RateLimit` header fields
//! (draft-ietf-httpapi-ratelimit-headers-09), computed from the script's answer (or, for a
//! denial the over-limit cache repeats, from what it kept of that answer): never from a
//! second Redis call, and never for a decision Redis did not make.
//!
//! Values are in requests of this route's cost:
//! - token bucket: `q` = capacity / cost, `w` = seconds to refill the whole capacity,
//!   `r` = tokens left / cost, `t` = seconds until the bucket is full again;
//! - sliding window: `q` = limit / cost, `w` = the window in seconds, `r` = requests the
//!   estimate still admits / cost, `t` = seconds until the current window ends;
//! - on a denial by the limit, `t` is at least its `Retry-After`.
//!
//! `w` and `t` are left out when the bucket never refills.

use crate::config::{Algorithm, Policy, ONE_TOKEN_MICRO};
use crate::decision::ScriptReply;

/// The two header values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitFields {
    pub policy: String,
    pub state: String,
}

/// A single-limit route's item is named after the endpoint, as before `[[routes.limits]]`;
/// on a tiered route, whose tiers' limits are named, it is the limit named `default` (as
/// `/limits`, the metrics and the logs name it), beside the names a tier's limits have.
pub fn fields(policy: &Policy, reply: &ScriptReply) -> Option<RateLimitFields> {
    let name = match policy.tiers {
        Some(_) => "default",
        None => policy.endpoint_id.as_str(),
    };
    let (policy_item, state_item) = item(name, policy.algorithm, policy.cost_micro, reply)?;
    Some(RateLimitFields {
        policy: policy_item,
        state: state_item,
    })
}

/// With `[[routes.limits]]`: one item per limit, named after the limit, in the policy's
/// order; a limit Redis could not be asked about (a ceiling on another cluster node whose
/// read failed after the caller's own limits denied) is left out.
pub fn several(policy: &Policy, replies: &[ScriptReply]) -> Option<RateLimitFields> {
    let items: Vec<(String, String)> = policy
        .limits
        .iter()
        .zip(replies)
        .filter(|(_, r)| r.now_us > 0)
        .filter_map(|(l, r)| item(&l.name, l.algorithm, policy.cost_micro, r))
        .collect();
    if items.is_empty() {
        return None;
    }
    let (policies, states): (Vec<String>, Vec<String>) = items.into_iter().unzip();
    Some(RateLimitFields {
        policy: policies.join(", "),
        state: states.join(", "),
    })
}

/// With `[[routes.limits]]`, a denial repeated by the over-limit cache: the item of the
/// limit that denied, the only one the cache knows about.
pub fn one(policy: &Policy, limit: usize, reply: &ScriptReply) -> Option<RateLimitFields> {
    let l = policy.limits.get(limit)?;
    let (policy_item, state_item) = item(&l.name, l.algorithm, policy.cost_micro, reply)?;
    Some(RateLimitFields {
        policy: policy_item,
        state: state_item,
    })
}

/// One limit's `RateLimit-Policy` and `RateLimit` items.
fn item(
    name: &str,
    algorithm: Algorithm,
    cost_micro: u64,
    reply: &ScriptReply,
) -> Option<(String, String)> {
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
    let mut policy_item = format!("\"{name}\";q={quota}");
    if let Some(w) = window {
        policy_item.push_str(&format!(";w={w}"));
    }
    let mut state = format!("\"{name}\";r={remaining}");
    // A bucket that never refills has no time to full, whatever the reply says. On a denial
    // by this limit, never before it admits again: a sliding window's current window can
    // end while the last one's weight still refuses, and `t=0` beside `r=0` would send a
    // client that reads only these fields straight back.
    if let (Some(_), Some(t)) = (window, reply.reset) {
        let t = match (reply.allowed, reply.retry_after) {
            (false, Some(wait)) => t.max(wait),
            _ => t,
        };
        state.push_str(&format!(";t={t}"));
    }
    Some((policy_item, state))
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
            ratelimit_headers: true,
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
        assert_eq!(f.policy, r#""resumint.tailor";q=10;w=10"#);
        assert_eq!(f.state, r#""resumint.tailor";r=3;t=7"#);
        let never = policy(
            Algorithm::TokenBucket {
                capacity_micro: 5_000_000,
                refill_micro_per_sec: 0,
            },
            1_000_000,
        );
        let f = fields(&never, &reply(0, None)).unwrap();
        assert_eq!(
            (f.policy.as_str(), f.state.as_str()),
            (r#""resumint.tailor";q=5"#, r#""resumint.tailor";r=0"#)
        );
        // Beside another limit that denied, the script reports a reset of 0 for it: still
        // no `t`.
        let f = fields(&never, &reply(3_000_000, Some(0))).unwrap();
        assert_eq!(f.state, r#""resumint.tailor";r=3"#);
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
        assert_eq!(f.policy, r#""resumint.tailor";q=100;w=60"#);
        assert_eq!(f.state, r#""resumint.tailor";r=42;t=13"#);
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
            fields(&p, &denied).unwrap().state,
            r#""resumint.tailor";r=0;t=2"#
        );
        // A later window end stays as it is.
        let later = ScriptReply {
            allowed: false,
            retry_after: Some(2),
            ..reply(0, Some(7))
        };
        assert_eq!(
            fields(&p, &later).unwrap().state,
            r#""resumint.tailor";r=0;t=7"#
        );
    }
}
