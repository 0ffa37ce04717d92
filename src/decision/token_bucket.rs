//! The token bucket's arithmetic, exactly as `lua/token_bucket.lua` computes it.
//!
//! The emergency limiter runs on this model with a monotonic clock; tests compare it with the
//! script. State is integer micro-tokens plus the remainder of the last partial refill, so no
//! micro-token is lost to rounding however the requests are spaced.

const MICRO: u64 = 1_000_000;

/// Bucket parameters in micro-tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    pub capacity: u64,
    pub rate_per_sec: u64,
}

/// What is stored after an admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketState {
    pub tokens: u64,
    /// Refill remainder in micro-token-microseconds per second, always below 10^6.
    pub frac: u64,
    pub at_us: u64,
}

/// The outcome of one request against the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// Admitted; the state to store.
    Admitted { state: BucketState },
    /// Denied; nothing is to be stored. `retry_after_secs` is `None` when the bucket never
    /// refills.
    Denied {
        tokens: u64,
        retry_after_secs: Option<u64>,
    },
}

impl Bucket {
    /// Microseconds until a bucket at (`tokens`, `frac`) is full again: 0 when full, `None`
    /// when it never refills.
    pub fn full_in_us(&self, tokens: u64, frac: u64) -> Option<u64> {
        self.full_in(tokens, frac)
            .map(|us| u64::try_from(us).unwrap_or(u64::MAX))
    }

    /// As [`Bucket::full_in_us`], in whole seconds rounded up (which a bucket far from full,
    /// refilling slowly, may need where its microseconds would not fit).
    pub fn full_in_secs(&self, tokens: u64, frac: u64) -> Option<u64> {
        self.full_in(tokens, frac)
            .map(|us| u64::try_from(us.div_ceil(u128::from(MICRO))).unwrap_or(u64::MAX))
    }

    fn full_in(&self, tokens: u64, frac: u64) -> Option<u128> {
        if tokens >= self.capacity {
            return Some(0);
        }
        if self.rate_per_sec == 0 {
            return None;
        }
        let missing = u128::from(self.capacity - tokens) * u128::from(MICRO) - u128::from(frac);
        Some(missing.div_ceil(u128::from(self.rate_per_sec)))
    }

    /// Tokens and remainder at `now_us`, from the last stored state (or a full bucket).
    pub fn refill(&self, state: Option<BucketState>, now_us: u64) -> (u64, u64) {
        let Some(s) = state else {
            return (self.capacity, 0);
        };
        // A bucket written under a larger capacity (a reload lowered it) holds no more than
        // the new one, refilling or not.
        if s.tokens >= self.capacity {
            return (self.capacity, 0);
        }
        let elapsed = now_us.saturating_sub(s.at_us);
        if elapsed == 0 || self.rate_per_sec == 0 {
            return (s.tokens, s.frac);
        }
        let secs = elapsed / MICRO;
        if secs > self.capacity / self.rate_per_sec {
            return (self.capacity, 0);
        }
        let us = elapsed % MICRO;
        let part = us * (self.rate_per_sec % MICRO) + s.frac;
        let gained = secs * self.rate_per_sec + us * (self.rate_per_sec / MICRO) + part / MICRO;
        let tokens = s.tokens + gained;
        if tokens >= self.capacity {
            (self.capacity, 0)
        } else {
            (tokens, part % MICRO)
        }
    }

    /// Spends `cost` at `now_us` if the bucket holds it.
    pub fn take(&self, state: Option<BucketState>, cost: u64, now_us: u64) -> Take {
        let (tokens, frac) = self.refill(state, now_us);
        if tokens < cost {
            let retry_after_secs =
                (self.rate_per_sec > 0).then(|| (cost - tokens).div_ceil(self.rate_per_sec));
            return Take::Denied {
                tokens,
                retry_after_secs,
            };
        }
        Take::Admitted {
            state: BucketState {
                tokens: tokens - cost,
                frac,
                at_us: now_us,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_to_full_do_not_saturate_where_microseconds_would() {
        // Twice 10^13 tokens missing at one a second: 2 * 10^13 s, 2 * 10^19 us (past u64).
        let bucket = Bucket {
            capacity: 20_000_000_000_000,
            rate_per_sec: 1,
        };
        assert_eq!(bucket.full_in_secs(0, 0), Some(20_000_000_000_000));
        assert_eq!(bucket.full_in_us(0, 0), Some(u64::MAX));
        assert_eq!(bucket.full_in_secs(bucket.capacity - 1, 999_999), Some(1));
    }
    use proptest::prelude::*;

    const ONE: u64 = MICRO;

    #[test]
    fn time_to_full_counts_the_refill_remainder() {
        let b = Bucket {
            capacity: 5 * MICRO,
            rate_per_sec: 2 * MICRO,
        };
        assert_eq!(b.full_in_us(5 * MICRO, 0), Some(0));
        assert_eq!(b.full_in_us(3 * MICRO, 0), Some(1_000_000));
        // Half a micro-token of remainder already banked: a quarter microsecond less, rounded up.
        assert_eq!(b.full_in_us(3 * MICRO, 500_000), Some(1_000_000));
        assert_eq!(b.full_in_us(4 * MICRO + 999_999, 999_999), Some(1));
        let never = Bucket {
            capacity: 5 * MICRO,
            rate_per_sec: 0,
        };
        assert_eq!(never.full_in_us(0, 0), None);
        assert_eq!(never.full_in_us(5 * MICRO, 0), Some(0));
    }

    #[test]
    fn a_fresh_bucket_admits_its_capacity_then_denies() {
        let b = Bucket {
            capacity: 3 * ONE,
            rate_per_sec: ONE,
        };
        let mut state = None;
        for _ in 0..3 {
            match b.take(state, ONE, 0) {
                Take::Admitted { state: s } => state = Some(s),
                d => panic!("denied early: {d:?}"),
            }
        }
        assert_eq!(
            b.take(state, ONE, 0),
            Take::Denied {
                tokens: 0,
                retry_after_secs: Some(1)
            }
        );
    }

    #[test]
    fn refill_keeps_the_remainder_of_partial_seconds() {
        // 1.5 tokens per second, refilled in 1 us steps: no remainder may be lost.
        let b = Bucket {
            capacity: 10 * ONE,
            rate_per_sec: 1_500_000,
        };
        let mut s = BucketState {
            tokens: 0,
            frac: 0,
            at_us: 0,
        };
        for now in 1..=1_000_000u64 {
            let (tokens, frac) = b.refill(Some(s), now);
            s = BucketState {
                tokens,
                frac,
                at_us: now,
            };
        }
        assert_eq!(s.tokens, 1_500_000);
        assert_eq!(s.frac, 0);
    }

    #[test]
    fn zero_refill_never_refills_and_has_no_retry_time() {
        let b = Bucket {
            capacity: ONE,
            rate_per_sec: 0,
        };
        let Take::Admitted { state } = b.take(None, ONE, 0) else {
            panic!("first request denied")
        };
        assert_eq!(
            b.take(Some(state), ONE, u64::MAX / 2),
            Take::Denied {
                tokens: 0,
                retry_after_secs: None
            }
        );
    }

    proptest! {
        // Splitting an interval never changes the refill: the bucket is exact in integers.
        #[test]
        fn refill_is_additive(rate in 0u64..=1_000_000_000_000, a in 0u64..5_000_000, b in 0u64..5_000_000) {
            let bucket = Bucket { capacity: 1_000_000_000_000_000, rate_per_sec: rate };
            let start = BucketState { tokens: 0, frac: 0, at_us: 0 };
            let (t1, f1) = bucket.refill(Some(start), a);
            let (t2, f2) = bucket.refill(Some(BucketState { tokens: t1, frac: f1, at_us: a }), a + b);
            let (direct, fd) = bucket.refill(Some(start), a + b);
            prop_assert_eq!((t2, f2), (direct, fd));
            prop_assert_eq!(u128::from(direct), u128::from(a + b) * u128::from(rate) / 1_000_000);
        }
    }
}
