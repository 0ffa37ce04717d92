//! The over-limit cache: when Redis denies a bucket and says exactly when the request would
//! next be admitted, that bucket's requests are denied locally until then, without a Redis
//! call. It only ever repeats a denial Redis gave; it never admits.
//!
//! Exact for the token bucket up to one round trip: a denial never changes the bucket, and
//! only time refills it, so nothing another gateway does can make a token appear sooner. The
//! deadline is taken on the local monotonic clock when the answer arrives, which is after
//! Redis evaluated: a client may be refused up to one round trip after its token appeared,
//! never before. The sliding window uses the moment its estimate would admit the request.
//!
//! Bounded: a fixed number of keys per endpoint; when full, expired entries are dropped and,
//! if still full, the denial is simply not cached. Each endpoint has its own cache, rebuilt
//! on every reload, so a reload or a new `policy_version` starts with an empty one.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;

use crate::clock::SharedClock;

/// Keys remembered per endpoint per process.
pub const CAPACITY: usize = 16_384;
const SHARDS: usize = 16;

/// A remembered denial, as the cache repeats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denied {
    /// Microseconds until the request could be admitted.
    pub left_us: u64,
    /// The index of the limit that denied.
    pub limit: usize,
    /// Whole seconds until that limit is full again, rounded up (`None`: never), for the
    /// `RateLimit` field of the repeated 429.
    pub full_in_s: Option<u64>,
}

/// Never full again, in an entry.
const NEVER: u64 = u64::MAX;

/// Key -> (until, when the limit is full again or `NEVER`, the index of the limit that
/// denied), times in microseconds of the local clock.
type Shard = Mutex<HashMap<String, (u64, u64, u8)>>;

pub struct OverlimitCache {
    shards: Vec<Shard>,
    hasher: RandomState,
    clock: SharedClock,
}

impl OverlimitCache {
    pub fn new(clock: SharedClock) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            clock,
        }
    }

    fn shard(&self, key: &str) -> &Shard {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// The remembered denial of `key`, if it still holds.
    pub fn denied_for(&self, key: &str) -> Option<Denied> {
        let now = self.clock.now_us();
        let mut shard = self.shard(key).lock().unwrap_or_else(|p| p.into_inner());
        match shard.get(key) {
            Some(&(until, full_at, limit)) if until > now => Some(Denied {
                left_us: until - now,
                limit: usize::from(limit),
                full_in_s: (full_at != NEVER)
                    .then(|| full_at.saturating_sub(now).div_ceil(1_000_000)),
            }),
            Some(_) => {
                shard.remove(key);
                None
            }
            None => None,
        }
    }

    /// Remembers that Redis denied `key` for the next `wait_us` microseconds, by the limit
    /// of index `limit`, which is full again in `full_in_s` seconds (`None`: never).
    pub fn remember(&self, key: &str, wait_us: u64, limit: usize, full_in_s: Option<u64>) {
        let now = self.clock.now_us();
        let mut shard = self.shard(key).lock().unwrap_or_else(|p| p.into_inner());
        if shard.len() >= CAPACITY / SHARDS && !shard.contains_key(key) {
            shard.retain(|_, (until, _, _)| *until > now);
            if shard.len() >= CAPACITY / SHARDS {
                return;
            }
        }
        let full_at = full_in_s.map_or(NEVER, |s| now.saturating_add(s.saturating_mul(1_000_000)));
        shard.insert(
            key.to_owned(),
            (
                now + wait_us,
                full_at,
                u8::try_from(limit).unwrap_or(u8::MAX),
            ),
        );
    }

    /// Forgets a remembered denial of `key` (an operator reset the bucket).
    pub fn forget(&self, key: &str) {
        self.shard(key)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }

    /// Forgets every remembered denial (an operator reset a ceiling every caller shares).
    pub fn clear(&self) {
        for shard in &self.shards {
            shard.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn repeats_a_denial_until_its_deadline_only() {
        let clock = ManualClock::default();
        let cache = OverlimitCache::new(Arc::new(clock.clone()));
        assert_eq!(cache.denied_for("k"), None);
        cache.remember("k", 1_500_000, 2, Some(10));
        let denied = |left_us, full_in_s| {
            Some(Denied {
                left_us,
                limit: 2,
                full_in_s,
            })
        };
        assert_eq!(cache.denied_for("k"), denied(1_500_000, Some(10)));
        clock.advance(Duration::from_millis(1_499));
        assert_eq!(
            cache.denied_for("k"),
            denied(1_000, Some(9)),
            "9.0015 s: 9 s"
        );
        clock.advance(Duration::from_millis(1));
        assert_eq!(
            cache.denied_for("k"),
            None,
            "expired exactly at the deadline"
        );
        assert!(cache.is_empty());
    }

    #[test]
    fn stays_bounded() {
        let clock = ManualClock::default();
        let cache = OverlimitCache::new(Arc::new(clock.clone()));
        for i in 0..3 * CAPACITY {
            cache.remember(&format!("key-{i}"), 60_000_000, 0, None);
        }
        assert!(cache.len() <= CAPACITY);
        clock.advance(Duration::from_secs(61));
        cache.remember("fresh", 1_000_000, 0, None);
        assert_eq!(
            cache.denied_for("fresh").map(|d| (d.left_us, d.full_in_s)),
            Some((1_000_000, None)),
            "expired entries make room"
        );
    }
}
