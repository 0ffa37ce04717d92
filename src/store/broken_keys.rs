//! Bucket keys whose data the limiter cannot read (`WRONGTYPE`, a script error on a
//! corrupted bucket): each is logged with its key, which holds the identity's hash and never
//! the identity, at most once a minute, so an operator can delete it without the log filling
//! up with one line per request.

use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lru::LruCache;

/// How often one broken key is logged at most.
const EVERY: Duration = Duration::from_secs(60);
/// Keys remembered; beyond, the least recently logged is forgotten (and may be logged again).
const CAPACITY: usize = 1024;

pub(super) struct BrokenKeys {
    logged: Mutex<LruCache<String, Instant>>,
}

impl Default for BrokenKeys {
    fn default() -> Self {
        Self {
            logged: Mutex::new(LruCache::new(
                NonZeroUsize::new(CAPACITY).expect("non-zero"),
            )),
        }
    }
}

impl BrokenKeys {
    /// Logs `key` unless it was logged within the last minute.
    pub(super) fn report(&self, key: &str, error: &dyn std::fmt::Display) {
        if self.first_in_a_while(key, Instant::now()) {
            tracing::warn!(
                key,
                error = %error,
                "a bucket key holds data the limiter cannot read: the requests it counts (one identity's, or every caller's for a ceiling) follow the route's fail mode until the key is deleted (redis-cli DEL <key>)"
            );
        }
    }

    fn first_in_a_while(&self, key: &str, now: Instant) -> bool {
        let mut logged = self.logged.lock().unwrap_or_else(|p| p.into_inner());
        match logged.get(key) {
            Some(at) if now.duration_since(*at) < EVERY => false,
            _ => {
                logged.put(key.to_owned(), now);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_once_a_minute() {
        let keys = BrokenKeys::default();
        let t0 = Instant::now();
        assert!(keys.first_in_a_while("a", t0));
        assert!(!keys.first_in_a_while("a", t0 + Duration::from_secs(59)));
        assert!(keys.first_in_a_while("b", t0), "another key is its own");
        assert!(keys.first_in_a_while("a", t0 + Duration::from_secs(60)));
    }
}
