//! The fleet: how many gateway instances share this Redis, so a fleet-wide emergency rate
//! (`fallback_rate_fleet_micro`) can be split among them.
//!
//! While Redis is healthy each instance runs `lua/heartbeat.lua` every
//! [`HEARTBEAT_EVERY`], off the request path: it keeps the instance in one sorted set with an
//! expiry [`HEARTBEAT_TTL`] ahead (on Redis `TIME`) and learns the live count N. When Redis
//! fails, each process keeps the last N it learnt, and its emergency buckets run at
//! fleet rate / N, never below one request per second.
//!
//! Staleness: an instance that stops is still counted for up to `HEARTBEAT_TTL`, and a new
//! one is noticed by the others within `HEARTBEAT_EVERY`. During an outage N is frozen, so
//! instances started or stopped during it are not accounted for: the fleet may then admit up
//! to (actual instances / N) times the fleet rate.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rand::Rng;

use super::Store;
use crate::config::ONE_TOKEN_MICRO;
use crate::snapshot::Snapshot;

pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
pub const HEARTBEAT_TTL: Duration = Duration::from_secs(6);

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

/// Beats while any route of the live config has a fleet-wide emergency rate.
pub async fn heartbeat(
    fleet: Arc<Fleet>,
    store: Store,
    live: Arc<ArcSwap<Snapshot>>,
    metrics: prometheus::IntGauge,
) {
    let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let snapshot = live.load_full();
        if !snapshot.uses_fleet {
            continue;
        }
        let key = format!("{}:v1:fleet", snapshot.config.redis.key_prefix);
        match store
            .heartbeat(&key, &fleet.instance, HEARTBEAT_TTL.as_millis() as u64)
            .await
        {
            Ok(n) => {
                if n != fleet.live() {
                    tracing::info!(instances = n, "fleet size changed");
                }
                fleet.set_live(n);
                metrics.set(n as i64);
            }
            Err(failure) => {
                tracing::debug!(
                    cause = failure.as_str(),
                    "fleet heartbeat failed; keeping the last fleet size"
                );
            }
        }
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
