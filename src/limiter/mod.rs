//! The limiter: one limited request's decision, from its endpoint and identity to one of the
//! eight reasons. [`decide`] reads top to bottom: the over-limit cache, the store (through
//! the node's breaker, within the budget), and when Redis did not decide, the fail mode's row
//! of the decision table (`crate::decision::degrade`).
//!
//! The limiter owns no connection and no clock: the store brings Redis's answer, the
//! decision room turns answers and failures into a [`Decision`].

mod endpoint;
pub mod heartbeat;
pub mod inspect;

use std::time::Duration;

pub use endpoint::{bucket_key, identity_hash, Endpoint};

use crate::config::{Algorithm, Policy, ONE_TOKEN_MICRO};
use crate::decision::{degrade, Decision};
use crate::store::{ScriptKind, Store};

/// Which script decides `policy`, and its arguments; `None` for `algorithm = "none"`.
fn script_call(policy: &Policy) -> Option<(ScriptKind, [u64; 3])> {
    match policy.algorithm {
        Algorithm::TokenBucket {
            capacity_micro,
            refill_micro_per_sec,
        } => Some((
            ScriptKind::TokenBucket,
            [capacity_micro, refill_micro_per_sec, policy.cost_micro],
        )),
        Algorithm::SlidingWindow {
            limit,
            window_micro,
        } => Some((
            ScriptKind::SlidingWindow,
            [limit, window_micro, policy.cost_micro / ONE_TOKEN_MICRO],
        )),
        Algorithm::None => None,
    }
}

/// Decides one request for `endpoint` by the caller whose identity hashes to
/// `identity_hash`. Never waits longer than the store's budget; never fails.
pub async fn decide(store: &Store, endpoint: &Endpoint, identity_hash: &str) -> Decision {
    let Some((kind, args)) = script_call(&endpoint.policy) else {
        return Decision::unlimited(store.breaker_state());
    };
    let key = endpoint.bucket_key(identity_hash);
    if let Some(left_us) = endpoint.overlimit.denied_for(&key) {
        return Decision::cached_denial(Duration::from_micros(left_us), store.breaker_state());
    }
    let evaluation = store.evaluate(kind, &key, args).await;
    match evaluation.outcome {
        Ok(reply) => {
            if let (false, Some(wait)) = (reply.allowed, reply.wait_us) {
                endpoint.overlimit.remember(&key, wait);
            }
            Decision::by_redis(reply, evaluation.breaker)
        }
        Err(cause) => degrade(
            cause,
            endpoint.policy.fail_mode,
            endpoint.emergency.as_deref(),
            identity_hash,
            evaluation.breaker,
        ),
    }
}
