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

pub struct OverlimitCache {
    /// Key -> (until, the index of the limit that denied).
    shards: Vec<Mutex<HashMap<String, (u64, u8)>>>,
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

    fn shard(&self, key: &str) -> &Mutex<HashMap<String, (u64, u8)>> {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// Microseconds left of a remembered denial of `key`, and the index of the limit that
    /// denied, if any.
    pub fn denied_for(&self, key: &str) -> Option<(u64, usize)> {
        let now = self.clock.now_us();
        let mut shard = self.shard(key).lock().unwrap_or_else(|p| p.into_inner());
        match shard.get(key) {
            Some(&(until, limit)) if until > now => Some((until - now, usize::from(limit))),
            Some(_) => {
                shard.remove(key);
                None
            }
            None => None,
        }
    }

    /// Remembers that Redis denied `key` for the next `wait_us` microseconds, by the limit
    /// of index `limit`.
    pub fn remember(&self, key: &str, wait_us: u64, limit: usize) {
        let now = self.clock.now_us();
        let mut shard = self.shard(key).lock().unwrap_or_else(|p| p.into_inner());
        if shard.len() >= CAPACITY / SHARDS && !shard.contains_key(key) {
            shard.retain(|_, (until, _)| *until > now);
            if shard.len() >= CAPACITY / SHARDS {
                return;
            }
        }
        shard.insert(
            key.to_owned(),
            (now + wait_us, u8::try_from(limit).unwrap_or(u8::MAX)),
        );
    }

    /// Forgets a remembered denial of `key` (an operator reset the bucket).
    pub fn forget(&self, key: &str) {
        self.shard(key)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
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
        cache.remember("k", 1_500_000, 2);
        assert_eq!(cache.denied_for("k"), Some((1_500_000, 2)));
        clock.advance(Duration::from_millis(1_499));
        assert_eq!(cache.denied_for("k"), Some((1_000, 2)));
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
            cache.remember(&format!("key-{i}"), 60_000_000, 0);
        }
        assert!(cache.len() <= CAPACITY);
        clock.advance(Duration::from_secs(61));
        cache.remember("fresh", 1_000_000, 0);
        assert_eq!(
            cache.denied_for("fresh"),
            Some((1_000_000, 0)),
            "expired entries make room"
        );
    }
}
