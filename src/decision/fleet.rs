//! The fleet as this process counts it: how many gateway instances share this Redis, so a
//! fleet-wide emergency rate (`fallback_rate_fleet_micro`) can be split among them. The count
//! is kept current by the heartbeat (`limiter::heartbeat`); see there for its staleness.

use std::sync::atomic::{AtomicU64, Ordering};

use rand::Rng;

use crate::config::ONE_TOKEN_MICRO;

/// This process's view of the fleet.
pub struct Fleet {
    pub instance: String,
    live: AtomicU64,
}

impl Default for Fleet {
    fn default() -> Self {
        Self {
            instance: format!("{:016x}", rand::rng().random::<u64>()),
            live: AtomicU64::new(1),
        }
    }
}

impl Fleet {
    /// The last known number of live instances (at least 1).
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed).max(1)
    }

    pub fn set_live(&self, n: u64) {
        self.live.store(n.max(1), Ordering::Relaxed);
    }

    /// This process's share of a fleet-wide rate, never below one request per second.
    pub fn share(&self, fleet_rate_micro: u64) -> u64 {
        (fleet_rate_micro / self.live()).max(ONE_TOKEN_MICRO)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_never_drop_below_one_request_per_second() {
        let fleet = Fleet::default();
        assert_eq!(fleet.share(6_000_000), 6_000_000);
        fleet.set_live(3);
        assert_eq!(fleet.share(6_000_000), 2_000_000);
        fleet.set_live(10);
        assert_eq!(fleet.share(6_000_000), 1_000_000);
        fleet.set_live(0);
        assert_eq!(fleet.live(), 1);
    }
}
