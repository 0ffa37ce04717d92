//! The decision, as pure code: what Redis said, or why it could not say it, in; exactly one of
//! eight reasons out. No I/O and no Redis client here: the store (`crate::store`) brings the
//! answers, the limiter (`crate::limiter`) puts the two together.
//!
//! The decision table of the contract is [`degrade`], for the rows where Redis did not decide:
//!
//! | Redis outcome    | fail_open                              | fail_closed             |
//! |------------------|----------------------------------------|-------------------------|
//! | timeout          | emergency limiter, `redis_timeout`     | deny, `fail_closed`     |
//! | connection error | emergency limiter, `redis_connection_error` | deny, `fail_closed` |
//! | NOSCRIPT twice   | emergency limiter, `redis_noscript_retry` | deny, `fail_closed`  |
//! | breaker OPEN     | emergency limiter, `circuit_open`      | deny, `circuit_open`    |
//!
//! An emergency denial is `emergency_local_limit`. The room also holds what those rows run
//! on: the breaker's state machine, the emergency limiter, the over-limit cache, and the Rust
//! models of the Lua algorithms.

pub mod breaker;
pub mod emergency;
pub mod failure;
pub mod fleet;
pub mod overlimit;
pub mod reply;
pub mod sliding_window;
pub mod token_bucket;

use std::time::Duration;

pub use breaker::{Breaker, BreakerState};
pub use failure::{is_acl_refusal, Charge, Failure};
pub use reply::ScriptReply;

use crate::config::FailMode;
use emergency::{Emergency, EmergencyOutcome};

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

/// How a store call failed: the three causes of the decision table's store rows (what each
/// failure of the store is, and how it counts, is `failure.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFailure {
    Timeout,
    ConnectionError,
    Noscript,
}

impl StoreFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            StoreFailure::Timeout => "timeout",
            StoreFailure::ConnectionError => "connection_error",
            StoreFailure::Noscript => "noscript",
        }
    }
}

/// Why Redis did not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Degradation {
    Store(StoreFailure),
    /// The node's breaker is open (or half-open with its probe taken); `retry_in` is what is
    /// left of the quarantine.
    BreakerOpen {
        retry_in: Duration,
    },
}

impl Degradation {
    /// The reason of a decision the emergency limiter admitted for this cause.
    fn reason(self) -> DecisionReason {
        match self {
            Degradation::Store(StoreFailure::Timeout) => DecisionReason::RedisTimeout,
            Degradation::Store(StoreFailure::ConnectionError) => {
                DecisionReason::RedisConnectionError
            }
            Degradation::Store(StoreFailure::Noscript) => DecisionReason::RedisNoscriptRetry,
            Degradation::BreakerOpen { .. } => DecisionReason::CircuitOpen,
        }
    }
}

/// The `Retry-After` of a limit that never refills (a quota): a day, so that its clients
/// still get an answer to wait by.
pub const NEVER_REFILLS_RETRY_AFTER_SECS: u64 = 86_400;
const NEVER_REFILLS: Duration = Duration::from_secs(NEVER_REFILLS_RETRY_AFTER_SECS);
/// The largest `Retry-After` written (about 68 years): every longer wait says this, so that
/// clients reading the header into a signed 32-bit integer read it right.
pub const MAX_RETRY_AFTER_SECS: u64 = i32::MAX as u64;

/// What was decided; each variant fixes its reason and whether the request may pass, so a
/// decision cannot say `allowed` with a denying reason or the reverse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    /// Redis admitted (`allowed`).
    Admitted { reply: Option<ScriptReply> },
    /// Redis denied (`rate_limited`), or the over-limit cache repeated its denial (`cached`,
    /// with the reply the cache can give: nothing left, the wait, when the limit is full).
    Limited {
        wait: Duration,
        reply: Option<ScriptReply>,
        cached: bool,
    },
    /// Redis could not decide and the emergency limiter admitted; the reason is the cause's.
    EmergencyAdmitted { cause: Degradation },
    /// Redis could not decide and the emergency limiter denied (`emergency_local_limit`).
    EmergencyLimited { wait: Duration },
    /// Redis could not decide and the route fails closed: `circuit_open` when the breaker
    /// refused the call, else `fail_closed`. `wait` is the base of the 503's jittered
    /// Retry-After.
    Unavailable { cause: Degradation, wait: Duration },
}

/// What the limiter decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    verdict: Verdict,
    /// The breaker's state when the decision was made, for the deny log.
    breaker: BreakerState,
}

impl Decision {
    /// Redis decided: admitted or denied as its script said.
    pub fn by_redis(reply: ScriptReply, breaker: BreakerState) -> Self {
        let verdict = if reply.allowed {
            Verdict::Admitted { reply: Some(reply) }
        } else {
            Verdict::Limited {
                wait: reply.retry_after.map_or(NEVER_REFILLS, Duration::from_secs),
                reply: Some(reply),
                cached: false,
            }
        };
        Self { verdict, breaker }
    }

    /// A denial the over-limit cache repeated for `wait` more: `rate_limited`, no Redis call.
    pub fn cached_denial(denied: overlimit::Denied, breaker: BreakerState) -> Self {
        // What Redis would answer now, as far as the cache knows: nothing left, the same
        // wait, and the limit full again when it said.
        let wait = Duration::from_micros(denied.left_us);
        let reply = ScriptReply {
            allowed: false,
            remaining: 0,
            retry_after: Some(denied.left_us.div_ceil(1_000_000)),
            reset: denied.full_in_s,
            now_us: 0,
            wait_us: Some(denied.left_us),
        };
        Self {
            verdict: Verdict::Limited {
                wait,
                reply: Some(reply),
                cached: true,
            },
            breaker,
        }
    }

    /// An endpoint without a limit (`algorithm = "none"`): allowed, nothing asked.
    pub fn unlimited(breaker: BreakerState) -> Self {
        Self {
            verdict: Verdict::Admitted { reply: None },
            breaker,
        }
    }

    pub fn reason(&self) -> DecisionReason {
        match self.verdict {
            Verdict::Admitted { .. } => DecisionReason::Allowed,
            Verdict::Limited { .. } => DecisionReason::RateLimited,
            Verdict::EmergencyAdmitted { cause } => cause.reason(),
            Verdict::EmergencyLimited { .. } => DecisionReason::EmergencyLocalLimit,
            Verdict::Unavailable {
                cause: Degradation::BreakerOpen { .. },
                ..
            } => DecisionReason::CircuitOpen,
            Verdict::Unavailable { .. } => DecisionReason::FailClosed,
        }
    }

    pub fn allowed(&self) -> bool {
        matches!(
            self.verdict,
            Verdict::Admitted { .. } | Verdict::EmergencyAdmitted { .. }
        )
    }

    /// Admitted by Redis's own answer: not by the emergency limiter, and not a pass with no
    /// limit at all (an `unlimited` tier, `algorithm = "none"`), which has nothing to charge.
    pub fn admitted_by_redis(&self) -> bool {
        matches!(self.verdict, Verdict::Admitted { reply: Some(_) })
    }

    pub fn breaker(&self) -> BreakerState {
        self.breaker
    }

    /// The script's answer, when Redis decided (not for a cached denial).
    pub fn reply(&self) -> Option<&ScriptReply> {
        match &self.verdict {
            Verdict::Admitted { reply } | Verdict::Limited { reply, .. } => reply.as_ref(),
            _ => None,
        }
    }

    /// A denial repeated from the over-limit cache.
    pub fn cached(&self) -> bool {
        matches!(self.verdict, Verdict::Limited { cached: true, .. })
    }

    /// For a denial, how long until a retry can succeed (for an unavailable limiter: the
    /// base the 503's jittered Retry-After is drawn around); `None` when admitted.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.verdict {
            Verdict::Limited { wait, .. }
            | Verdict::EmergencyLimited { wait }
            | Verdict::Unavailable { wait, .. } => Some(wait),
            Verdict::Admitted { .. } | Verdict::EmergencyAdmitted { .. } => None,
        }
    }

    /// [`Self::retry_after`] in whole seconds for `Retry-After`, rounded up: at least 1, the
    /// whole wait however long (up to [`MAX_RETRY_AFTER_SECS`]); 0 when admitted.
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after().map_or(0, |wait| {
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            secs.clamp(1, MAX_RETRY_AFTER_SECS)
        })
    }

    /// The status a denial is answered with: 429 for a limit, 503 for an unavailable limiter.
    pub fn deny_status(&self) -> u16 {
        match self.verdict {
            Verdict::Limited { .. } | Verdict::EmergencyLimited { .. } => 429,
            _ => 503,
        }
    }
}

/// The right half of the decision table: Redis did not decide, so the fail mode does.
pub fn degrade(
    cause: Degradation,
    fail_mode: FailMode,
    emergency: Option<&Emergency>,
    identity_hash: &str,
    breaker: BreakerState,
) -> Decision {
    let verdict = match (fail_mode, emergency) {
        (FailMode::FailOpen, Some(bucket)) => match bucket.try_admit(identity_hash) {
            EmergencyOutcome::Admitted => Verdict::EmergencyAdmitted { cause },
            EmergencyOutcome::Denied { retry_after } => {
                Verdict::EmergencyLimited { wait: retry_after }
            }
        },
        // Validation guarantees a fail-open endpoint has an emergency bucket; without one,
        // deny rather than pass unmetered.
        (FailMode::FailOpen, None) | (FailMode::FailClosed, _) => Verdict::Unavailable {
            cause,
            wait: match cause {
                Degradation::BreakerOpen { retry_in } => retry_in,
                Degradation::Store(_) => Duration::from_secs(1),
            },
        },
    };
    Decision { verdict, breaker }
}

#[cfg(test)]
mod tests {
    use super::emergency::EmergencyBucket;
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
            (d.reason(), d.allowed(), d.deny_status()),
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
            (d.reason(), d.allowed(), d.retry_after_secs()),
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
            assert_eq!((d.reason(), d.allowed()), (reason, true));
        }
        assert!(degrade(
            open(3),
            FailMode::FailOpen,
            Some(&bucket),
            "id",
            BreakerState::Open
        )
        .allowed());
        let d = degrade(
            open(3),
            FailMode::FailOpen,
            Some(&bucket),
            "id",
            BreakerState::Open,
        );
        assert_eq!(
            (d.reason(), d.deny_status()),
            (DecisionReason::EmergencyLocalLimit, 429)
        );
    }

    fn reply(allowed: bool, retry_after: Option<u64>) -> ScriptReply {
        ScriptReply {
            allowed,
            remaining: 0,
            retry_after,
            reset: None,
            now_us: 0,
            wait_us: None,
        }
    }

    #[test]
    fn redis_and_cached_decisions_carry_their_wait_in_whole_seconds() {
        let d = Decision::by_redis(reply(true, Some(0)), BreakerState::Closed);
        assert_eq!(
            (
                d.reason(),
                d.allowed(),
                d.retry_after(),
                d.retry_after_secs()
            ),
            (DecisionReason::Allowed, true, None, 0)
        );
        let d = Decision::by_redis(reply(false, Some(7)), BreakerState::Closed);
        assert_eq!(
            (
                d.reason(),
                d.allowed(),
                d.retry_after_secs(),
                d.deny_status()
            ),
            (DecisionReason::RateLimited, false, 7, 429)
        );
        assert!(d.reply().is_some() && !d.cached());
        let never = Decision::by_redis(reply(false, None), BreakerState::Closed);
        assert_eq!(
            never.retry_after_secs(),
            NEVER_REFILLS_RETRY_AFTER_SECS,
            "a day for a limit that never refills"
        );
        let long = Decision::by_redis(reply(false, Some(200_000)), BreakerState::Closed);
        assert_eq!(
            long.retry_after_secs(),
            200_000,
            "a wait past a day is told whole"
        );
        let endless = Decision::by_redis(reply(false, Some(u64::MAX / 2)), BreakerState::Closed);
        assert_eq!(endless.retry_after_secs(), MAX_RETRY_AFTER_SECS);
        let zero = Decision::by_redis(reply(false, Some(0)), BreakerState::Closed);
        assert_eq!(zero.retry_after_secs(), 1, "never below one second");
        let d = Decision::cached_denial(
            overlimit::Denied {
                left_us: 1_000_001,
                limit: 0,
                full_in_s: Some(30),
            },
            BreakerState::Open,
        );
        assert_eq!(
            (d.reason(), d.allowed(), d.retry_after_secs(), d.breaker()),
            (DecisionReason::RateLimited, false, 2, BreakerState::Open)
        );
        assert!(d.cached());
        let repeated = d.reply().expect("what the cache repeats");
        assert_eq!((repeated.remaining, repeated.reset), (0, Some(30)));
    }
}
