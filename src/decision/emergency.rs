//! The emergency limiter: what a fail-open endpoint admits while Redis cannot decide.
//!
//! One token bucket per endpoint per process (or, with `emergency_scope = "identity"`, one per
//! identity, in a bounded map), capacity = refill per second =
//! `fallback_rate_per_process_micro`, on the monotonic clock. Each request costs one token
//! (10^6 micro-tokens) whatever its route's `cost_micro`: the fallback rate is a request rate.
//! State is written only when a request is admitted, so a stream of denials cannot bank
//! partial refills. Being per process, N gateway instances admit up to N times the rate.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lru::LruCache;

use super::fleet::Fleet;
use super::token_bucket::{Bucket, BucketState, Take};
use crate::clock::SharedClock;
use crate::config::ONE_TOKEN_MICRO;

/// An emergency rate in micro-tokens per second: fixed per process, or this process's share
/// of a fleet-wide rate.
#[derive(Clone)]
pub enum Rate {
    PerProcess(u64),
    Fleet { total: u64, fleet: Arc<Fleet> },
}

impl Rate {
    pub fn current(&self) -> u64 {
        match self {
            Rate::PerProcess(r) => *r,
            Rate::Fleet { total, fleet } => fleet.share(*total),
        }
    }

    /// What the config said: (rate, fleet-wide).
    pub fn configured(&self) -> (u64, bool) {
        match self {
            Rate::PerProcess(r) => (*r, false),
            Rate::Fleet { total, .. } => (*total, true),
        }
    }

    /// One request against `state` at `now_us`: the state to store (only when admitted, so
    /// denials never bank partial refills) and the outcome.
    fn take(
        &self,
        state: Option<BucketState>,
        now_us: u64,
    ) -> (Option<BucketState>, EmergencyOutcome) {
        let (bucket, state) = self.bucket(state);
        match bucket.take(state, ONE_TOKEN_MICRO, now_us) {
            Take::Admitted { state } => (Some(state), EmergencyOutcome::Admitted),
            Take::Denied {
                retry_after_secs, ..
            } => (
                None,
                EmergencyOutcome::Denied {
                    retry_after: Duration::from_secs(retry_after_secs.unwrap_or(1).max(1)),
                },
            ),
        }
    }

    /// A bucket of capacity = refill = the current rate. A stored state above a capacity
    /// that shrank (the fleet grew) is cut to it.
    fn bucket(&self, state: Option<BucketState>) -> (Bucket, Option<BucketState>) {
        let r = self.current();
        let state = state.map(|s| BucketState {
            tokens: s.tokens.min(r),
            ..s
        });
        (
            Bucket {
                capacity: r,
                rate_per_sec: r,
            },
            state,
        )
    }
}

pub struct EmergencyBucket {
    rate: Rate,
    state: Mutex<Option<BucketState>>,
    clock: SharedClock,
}

/// The emergency limiter's answer: admitted, or denied with the time to wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmergencyOutcome {
    Admitted,
    Denied { retry_after: Duration },
}

impl EmergencyBucket {
    pub fn new(rate_micro: u64, clock: SharedClock) -> Self {
        Self::with_rate(Rate::PerProcess(rate_micro), clock)
    }

    pub fn with_rate(rate: Rate, clock: SharedClock) -> Self {
        Self {
            rate,
            state: Mutex::new(None),
            clock,
        }
    }

    pub fn try_admit(&self) -> EmergencyOutcome {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (next, outcome) = self.rate.take(*state, self.clock.now_us());
        if next.is_some() {
            *state = next;
        }
        outcome
    }
}

/// Identities remembered per endpoint by a per-identity emergency limiter; the least recently
/// seen is forgotten first, and its next request starts with a full bucket.
pub const IDENTITY_CAPACITY: usize = 10_000;

/// One emergency bucket per identity, bounded.
pub struct IdentityBuckets {
    rate: Rate,
    states: Mutex<LruCache<String, BucketState>>,
    clock: SharedClock,
}

impl IdentityBuckets {
    pub fn new(rate: Rate, capacity: usize, clock: SharedClock) -> Self {
        Self {
            rate,
            states: Mutex::new(LruCache::new(
                NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN),
            )),
            clock,
        }
    }

    pub fn try_admit(&self, identity_hash: &str) -> EmergencyOutcome {
        let mut states = self.states.lock().unwrap_or_else(|p| p.into_inner());
        let (next, outcome) = self
            .rate
            .take(states.get(identity_hash).copied(), self.clock.now_us());
        if let Some(next) = next {
            states.put(identity_hash.to_owned(), next);
        }
        outcome
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
    /// What the config said: (rate, fleet-wide).
    pub fn configured(&self) -> (u64, bool) {
        match self {
            Emergency::Endpoint(b) => b.rate.configured(),
            Emergency::Identity(b) => b.rate.configured(),
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
                retry_after: Duration::from_secs(1)
            }
        );
    }

    #[test]
    fn per_identity_buckets_keep_a_noisy_tenant_from_starving_a_quiet_one() {
        let clock = ManualClock::default();
        let b = IdentityBuckets::new(
            Rate::PerProcess(2 * ONE_TOKEN_MICRO),
            100,
            Arc::new(clock.clone()),
        );
        let noisy = (0..100)
            .filter(|_| b.try_admit("noisy") == EmergencyOutcome::Admitted)
            .count();
        assert_eq!(noisy, 2, "the noisy tenant gets its own burst only");
        assert_eq!(b.try_admit("quiet"), EmergencyOutcome::Admitted);
    }

    #[test]
    fn the_least_recently_seen_identity_is_forgotten_first() {
        let clock = ManualClock::default();
        let b = IdentityBuckets::new(
            Rate::PerProcess(ONE_TOKEN_MICRO),
            2,
            Arc::new(clock.clone()),
        );
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

    #[test]
    fn a_fleet_rate_is_split_among_the_live_instances() {
        let clock = ManualClock::default();
        let fleet = Arc::new(Fleet::default());
        fleet.set_live(3);
        let rate = Rate::Fleet {
            total: 6 * ONE_TOKEN_MICRO,
            fleet: Arc::clone(&fleet),
        };
        let b = EmergencyBucket::with_rate(rate, Arc::new(clock.clone()));
        // 10 s at a request per millisecond: 2 of burst + 2 per second.
        let n = admitted_over(&b, &clock, Duration::from_millis(1), 10_000);
        assert!((21..=23).contains(&n), "admitted {n}");
        fleet.set_live(1);
        clock.advance(Duration::from_secs(5));
        let burst = (0..100)
            .filter(|_| b.try_admit() == EmergencyOutcome::Admitted)
            .count();
        assert_eq!(burst, 6, "alone, the process gets the whole fleet rate");
    }
}
