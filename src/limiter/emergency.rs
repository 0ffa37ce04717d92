//! The emergency limiter: what a fail-open endpoint admits while Redis cannot decide.
//!
//! One token bucket per endpoint per process (or, with `emergency_scope = "identity"`, one per
//! identity, in a bounded map), capacity = refill per second =
//! `fallback_rate_per_process_micro`, on the monotonic clock. Each request costs one token
//! (10^6 micro-tokens) whatever its route's `cost_micro`: the fallback rate is a request rate.
//! State is written only when a request is admitted, so a stream of denials cannot bank
//! partial refills. Being per process, N gateway instances admit up to N times the rate.

use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;

use super::token_bucket::{Bucket, BucketState, Take};
use crate::clock::SharedClock;
use crate::config::ONE_TOKEN_MICRO;

pub struct EmergencyBucket {
    bucket: Bucket,
    state: Mutex<Option<BucketState>>,
    clock: SharedClock,
}

/// The emergency limiter's answer: admitted, or denied with the seconds to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmergencyOutcome {
    Admitted,
    Denied { retry_after_secs: u64 },
}

impl EmergencyBucket {
    pub fn new(rate_micro: u64, clock: SharedClock) -> Self {
        Self {
            bucket: Bucket {
                capacity: rate_micro,
                rate_per_sec: rate_micro,
            },
            state: Mutex::new(None),
            clock,
        }
    }

    pub fn rate_micro(&self) -> u64 {
        self.bucket.rate_per_sec
    }

    pub fn try_admit(&self) -> EmergencyOutcome {
        let now = self.clock.now_us();
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match self.bucket.take(*state, ONE_TOKEN_MICRO, now) {
            Take::Admitted { state: next } => {
                *state = Some(next);
                EmergencyOutcome::Admitted
            }
            Take::Denied {
                retry_after_secs, ..
            } => EmergencyOutcome::Denied {
                retry_after_secs: retry_after_secs.unwrap_or(1).max(1),
            },
        }
    }
}

/// Identities remembered per endpoint by a per-identity emergency limiter; the least recently
/// seen is forgotten first, and its next request starts with a full bucket.
pub const IDENTITY_CAPACITY: usize = 10_000;

/// One emergency bucket per identity, bounded.
pub struct IdentityBuckets {
    bucket: Bucket,
    states: Mutex<LruCache<String, BucketState>>,
    clock: SharedClock,
}

impl IdentityBuckets {
    pub fn new(rate_micro: u64, capacity: usize, clock: SharedClock) -> Self {
        Self {
            bucket: Bucket {
                capacity: rate_micro,
                rate_per_sec: rate_micro,
            },
            states: Mutex::new(LruCache::new(
                NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN),
            )),
            clock,
        }
    }

    pub fn try_admit(&self, identity_hash: &str) -> EmergencyOutcome {
        let now = self.clock.now_us();
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        let state = states.get(identity_hash).copied();
        match self.bucket.take(state, ONE_TOKEN_MICRO, now) {
            Take::Admitted { state: next } => {
                states.put(identity_hash.to_owned(), next);
                EmergencyOutcome::Admitted
            }
            Take::Denied {
                retry_after_secs, ..
            } => EmergencyOutcome::Denied {
                retry_after_secs: retry_after_secs.unwrap_or(1).max(1),
            },
        }
    }

    pub fn len(&self) -> usize {
        self.states.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An endpoint's emergency limiter, by scope.
pub enum Emergency {
    Endpoint(EmergencyBucket),
    Identity(IdentityBuckets),
}

impl Emergency {
    pub fn rate_micro(&self) -> u64 {
        match self {
            Emergency::Endpoint(b) => b.bucket.rate_per_sec,
            Emergency::Identity(b) => b.bucket.rate_per_sec,
        }
    }

    pub fn per_identity(&self) -> bool {
        matches!(self, Emergency::Identity(_))
    }

    pub fn try_admit(&self, identity_hash: &str) -> EmergencyOutcome {
        match self {
            Emergency::Endpoint(b) => b.try_admit(),
            Emergency::Identity(b) => b.try_admit(identity_hash),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::sync::Arc;
    use std::time::Duration;

    fn admitted_over(
        bucket: &EmergencyBucket,
        clock: &ManualClock,
        step: Duration,
        steps: u32,
    ) -> u64 {
        let mut n = 0;
        for _ in 0..steps {
            if bucket.try_admit() == EmergencyOutcome::Admitted {
                n += 1;
            }
            clock.advance(step);
        }
        n
    }

    #[test]
    fn admits_one_second_of_burst_then_the_rate() {
        let clock = ManualClock::default();
        let b = EmergencyBucket::new(5 * ONE_TOKEN_MICRO, Arc::new(clock.clone()));
        // 10 s of a request every millisecond: burst 5 plus 5/s x 10 s.
        let n = admitted_over(&b, &clock, Duration::from_millis(1), 10_000);
        assert!((54..=56).contains(&n), "admitted {n}");
    }

    #[test]
    fn denials_do_not_bank_partial_refills() {
        // 1.5 requests per second, hammered every 10 us: the refill remainder must carry
        // across denials exactly, neither lost nor counted twice.
        let clock = ManualClock::default();
        let b = EmergencyBucket::new(1_500_000, Arc::new(clock.clone()));
        let n = admitted_over(&b, &clock, Duration::from_micros(10), 2_000_000);
        // 20 s: burst of 1 whole token (1.5 capacity) + 1.5 x 20 = 31 within one.
        assert!((30..=32).contains(&n), "admitted {n}");
    }

    #[test]
    fn denial_says_when_to_return() {
        let clock = ManualClock::default();
        let b = EmergencyBucket::new(ONE_TOKEN_MICRO, Arc::new(clock.clone()));
        assert_eq!(b.try_admit(), EmergencyOutcome::Admitted);
        assert_eq!(
            b.try_admit(),
            EmergencyOutcome::Denied {
                retry_after_secs: 1
            }
        );
    }

    #[test]
    fn per_identity_buckets_keep_a_noisy_tenant_from_starving_a_quiet_one() {
        let clock = ManualClock::default();
        let b = IdentityBuckets::new(2 * ONE_TOKEN_MICRO, 100, Arc::new(clock.clone()));
        let noisy = (0..100)
            .filter(|_| b.try_admit("noisy") == EmergencyOutcome::Admitted)
            .count();
        assert_eq!(noisy, 2, "the noisy tenant gets its own burst only");
        assert_eq!(b.try_admit("quiet"), EmergencyOutcome::Admitted);
    }

    #[test]
    fn the_least_recently_seen_identity_is_forgotten_first() {
        let clock = ManualClock::default();
        let b = IdentityBuckets::new(ONE_TOKEN_MICRO, 2, Arc::new(clock.clone()));
        assert_eq!(b.try_admit("a"), EmergencyOutcome::Admitted);
        assert_eq!(b.try_admit("b"), EmergencyOutcome::Admitted);
        assert_eq!(b.try_admit("c"), EmergencyOutcome::Admitted);
        assert_eq!(b.len(), 2);
        assert_eq!(
            b.try_admit("a"),
            EmergencyOutcome::Admitted,
            "evicted: starts afresh"
        );
        assert!(
            matches!(b.try_admit("c"), EmergencyOutcome::Denied { .. }),
            "still remembered"
        );
    }
}
