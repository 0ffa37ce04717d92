//! The decision: one limited request in, exactly one of eight reasons out.
//!
//! This file holds the decision table of the contract in one place. Redis decides when it
//! can (`allowed` / `rate_limited`); when it cannot, the endpoint's fail mode decides:
//!
//! | Redis outcome    | fail_open                              | fail_closed             |
//! |------------------|----------------------------------------|-------------------------|
//! | timeout          | emergency limiter, `redis_timeout`     | deny, `fail_closed`     |
//! | connection error | emergency limiter, `redis_connection_error` | deny, `fail_closed` |
//! | NOSCRIPT twice   | emergency limiter, `redis_noscript_retry` | deny, `fail_closed`  |
//! | breaker OPEN     | emergency limiter, `circuit_open`      | deny, `circuit_open`    |
//!
//! An emergency denial is `emergency_local_limit`.

pub mod breaker;
pub mod cluster;
pub mod connector;
pub mod emergency;
mod endpoint;
pub mod fleet;
pub mod overlimit;
pub mod script;
pub mod sliding_window;
pub mod store;
pub mod token_bucket;

use std::time::Duration;

pub use breaker::{Breaker, BreakerState};
pub use endpoint::{identity_hash, Endpoint};
pub use store::{NodeStatus, ScriptKind, ScriptReply, Store, StoreFailure};

use crate::config::{Algorithm, FailMode};
use emergency::EmergencyOutcome;

/// The eight reasons a decision can end with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecisionReason {
    Allowed = 0,
    RateLimited,
    RedisTimeout,
    RedisConnectionError,
    RedisNoscriptRetry,
    CircuitOpen,
    FailClosed,
    EmergencyLocalLimit,
}

impl DecisionReason {
    pub const ALL: [DecisionReason; 8] = [
        DecisionReason::Allowed,
        DecisionReason::RateLimited,
        DecisionReason::RedisTimeout,
        DecisionReason::RedisConnectionError,
        DecisionReason::RedisNoscriptRetry,
        DecisionReason::CircuitOpen,
        DecisionReason::FailClosed,
        DecisionReason::EmergencyLocalLimit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DecisionReason::Allowed => "allowed",
            DecisionReason::RateLimited => "rate_limited",
            DecisionReason::RedisTimeout => "redis_timeout",
            DecisionReason::RedisConnectionError => "redis_connection_error",
            DecisionReason::RedisNoscriptRetry => "redis_noscript_retry",
            DecisionReason::CircuitOpen => "circuit_open",
            DecisionReason::FailClosed => "fail_closed",
            DecisionReason::EmergencyLocalLimit => "emergency_local_limit",
        }
    }

    /// Whether Redis made this decision.
    pub fn by_redis(self) -> bool {
        matches!(self, DecisionReason::Allowed | DecisionReason::RateLimited)
    }
}

/// What the limiter decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub reason: DecisionReason,
    pub allowed: bool,
    /// For a denial: whole seconds after which a retry can succeed (>= 1). For an
    /// unavailable limiter it is the base the 503's jittered `Retry-After` is drawn around.
    pub retry_after_secs: u64,
    /// The breaker's state when the decision was made, for the deny log.
    pub breaker: BreakerState,
    /// The script's answer, when Redis decided.
    pub reply: Option<ScriptReply>,
    /// A denial repeated from the over-limit cache (reason `rate_limited`, no Redis call).
    pub cached: bool,
}

/// Retry-After is capped at a day: a bucket that never refills still gets an answer.
pub const MAX_RETRY_AFTER_SECS: u64 = 86_400;

impl Decision {
    /// The status a denial is answered with: 429 for a limit, 503 for an unavailable limiter.
    pub fn deny_status(&self) -> u16 {
        match self.reason {
            DecisionReason::RateLimited | DecisionReason::EmergencyLocalLimit => 429,
            _ => 503,
        }
    }
}

/// Why Redis did not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degradation {
    Store(StoreFailure),
    BreakerOpen { retry_in: Duration },
}

/// The right half of the decision table.
pub fn degrade(
    cause: Degradation,
    fail_mode: FailMode,
    emergency: Option<&emergency::Emergency>,
    identity_hash: &str,
    breaker: BreakerState,
) -> Decision {
    let (cause_reason, base_retry) = match cause {
        Degradation::Store(StoreFailure::Timeout) => (DecisionReason::RedisTimeout, 1),
        Degradation::Store(StoreFailure::ConnectionError) => {
            (DecisionReason::RedisConnectionError, 1)
        }
        Degradation::Store(StoreFailure::Noscript) => (DecisionReason::RedisNoscriptRetry, 1),
        Degradation::BreakerOpen { retry_in } => (
            DecisionReason::CircuitOpen,
            retry_in.as_secs_f64().ceil().max(1.0) as u64,
        ),
    };
    let deny = |reason, retry_after_secs| Decision {
        reason,
        allowed: false,
        retry_after_secs,
        breaker,
        reply: None,
        cached: false,
    };
    match (fail_mode, emergency) {
        (FailMode::FailOpen, Some(bucket)) => match bucket.try_admit(identity_hash) {
            EmergencyOutcome::Admitted => Decision {
                reason: cause_reason,
                allowed: true,
                retry_after_secs: 0,
                breaker,
                reply: None,
                cached: false,
            },
            EmergencyOutcome::Denied { retry_after_secs } => {
                deny(DecisionReason::EmergencyLocalLimit, retry_after_secs)
            }
        },
        // Validation guarantees a fail-open endpoint has an emergency bucket; without one,
        // deny rather than pass unmetered.
        (FailMode::FailOpen, None) | (FailMode::FailClosed, _) => match cause {
            Degradation::BreakerOpen { .. } => deny(DecisionReason::CircuitOpen, base_retry),
            Degradation::Store(_) => deny(DecisionReason::FailClosed, base_retry),
        },
    }
}

/// The limiter of one process: the Redis store behind its breakers (one per Redis node),
/// then the fail mode.
pub struct Limiter {
    pub store: Store,
}

impl Limiter {
    /// Decides one request for a limited endpoint. Never waits longer than the store's
    /// budget; never fails.
    pub async fn decide(&self, endpoint: &Endpoint, identity_hash: &str) -> Decision {
        let policy = &endpoint.policy;
        let (kind, args) = match policy.algorithm {
            Algorithm::TokenBucket {
                capacity_micro,
                refill_micro_per_sec,
            } => (
                ScriptKind::TokenBucket,
                [capacity_micro, refill_micro_per_sec, policy.cost_micro],
            ),
            Algorithm::SlidingWindow {
                limit,
                window_micro,
            } => (
                ScriptKind::SlidingWindow,
                [
                    limit,
                    window_micro,
                    policy.cost_micro / crate::config::ONE_TOKEN_MICRO,
                ],
            ),
            Algorithm::None => {
                return Decision {
                    reason: DecisionReason::Allowed,
                    allowed: true,
                    retry_after_secs: 0,
                    breaker: self.store.breaker_state(),
                    reply: None,
                    cached: false,
                }
            }
        };
        let key = endpoint.bucket_key(identity_hash);
        if let Some(left_us) = endpoint.overlimit.denied_for(&key) {
            return Decision {
                reason: DecisionReason::RateLimited,
                allowed: false,
                retry_after_secs: left_us.div_ceil(1_000_000).clamp(1, MAX_RETRY_AFTER_SECS),
                breaker: self.store.breaker_state(),
                reply: None,
                cached: true,
            };
        }
        // No node to ask: a cluster whose slot map is not known yet, or whose slot no
        // primary serves. Fails at once, as a disconnected Redis does.
        let Some(link) = self.store.link_for(&key) else {
            return self.degraded(
                endpoint,
                identity_hash,
                Degradation::Store(StoreFailure::ConnectionError),
                self.store.breaker_state(),
            );
        };
        let breaker = &link.breaker;
        let permit = match breaker.acquire() {
            Ok(p) => p,
            Err(short) => {
                return self.degraded(
                    endpoint,
                    identity_hash,
                    Degradation::BreakerOpen {
                        retry_in: short.retry_in,
                    },
                    breaker.state(),
                )
            }
        };
        match self
            .store
            .run(&link, kind, &key, args, permit.is_probe())
            .await
        {
            Ok(reply) => {
                permit.success();
                if let (false, Some(wait)) = (reply.allowed, reply.wait_us) {
                    endpoint.overlimit.remember(&key, wait);
                }
                Decision {
                    reason: if reply.allowed {
                        DecisionReason::Allowed
                    } else {
                        DecisionReason::RateLimited
                    },
                    allowed: reply.allowed,
                    retry_after_secs: reply.retry_after_secs(),
                    breaker: breaker.state(),
                    reply: Some(reply),
                    cached: false,
                }
            }
            Err(failure) => {
                permit.failure();
                self.degraded(
                    endpoint,
                    identity_hash,
                    Degradation::Store(failure),
                    breaker.state(),
                )
            }
        }
    }

    fn degraded(
        &self,
        endpoint: &Endpoint,
        identity_hash: &str,
        cause: Degradation,
        breaker: BreakerState,
    ) -> Decision {
        degrade(
            cause,
            endpoint.policy.fail_mode,
            endpoint.emergency.as_deref(),
            identity_hash,
            breaker,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::emergency::{Emergency, EmergencyBucket};
    use super::*;
    use crate::clock::ManualClock;
    use std::sync::Arc;

    fn open(secs: u64) -> Degradation {
        Degradation::BreakerOpen {
            retry_in: Duration::from_secs(secs),
        }
    }

    #[test]
    fn fail_closed_denies_with_the_table_reasons() {
        let d = degrade(
            Degradation::Store(StoreFailure::Timeout),
            FailMode::FailClosed,
            None,
            "id",
            BreakerState::Closed,
        );
        assert_eq!(
            (d.reason, d.allowed, d.deny_status()),
            (DecisionReason::FailClosed, false, 503)
        );
        let d = degrade(
            open(12),
            FailMode::FailClosed,
            None,
            "id",
            BreakerState::Open,
        );
        assert_eq!(
            (d.reason, d.allowed, d.retry_after_secs),
            (DecisionReason::CircuitOpen, false, 12)
        );
    }

    #[test]
    fn fail_open_admits_through_the_emergency_bucket_with_the_cause() {
        let bucket = Emergency::Endpoint(EmergencyBucket::new(
            1_000_000,
            Arc::new(ManualClock::default()),
        ));
        for (cause, reason) in [
            (
                Degradation::Store(StoreFailure::ConnectionError),
                DecisionReason::RedisConnectionError,
            ),
            (
                Degradation::Store(StoreFailure::Noscript),
                DecisionReason::RedisNoscriptRetry,
            ),
            (
                Degradation::Store(StoreFailure::Timeout),
                DecisionReason::RedisTimeout,
            ),
            (open(3), DecisionReason::CircuitOpen),
        ] {
            let fresh = Emergency::Endpoint(EmergencyBucket::new(
                1_000_000,
                Arc::new(ManualClock::default()),
            ));
            let d = degrade(
                cause,
                FailMode::FailOpen,
                Some(&fresh),
                "id",
                BreakerState::Closed,
            );
            assert_eq!((d.reason, d.allowed), (reason, true));
        }
        assert!(
            degrade(
                open(3),
                FailMode::FailOpen,
                Some(&bucket),
                "id",
                BreakerState::Open
            )
            .allowed
        );
        let d = degrade(
            open(3),
            FailMode::FailOpen,
            Some(&bucket),
            "id",
            BreakerState::Open,
        );
        assert_eq!(
            (d.reason, d.deny_status()),
            (DecisionReason::EmergencyLocalLimit, 429)
        );
    }
}
