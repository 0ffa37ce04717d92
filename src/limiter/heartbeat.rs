//! The fleet heartbeat: how this process learns how many gateway instances share its Redis, so
//! a fleet-wide emergency rate (`fallback_rate_fleet_micro`) can be split among them.
//!
//! While Redis is healthy each instance runs `lua/heartbeat.lua` every
//! [`HEARTBEAT_EVERY`], off the request path: it keeps the instance in one sorted set with an
//! expiry [`HEARTBEAT_TTL`] ahead (on Redis `TIME`) and learns the live count N. When Redis
//! fails, each process keeps the last N it learnt, and its emergency buckets run at
//! fleet rate / N, never below one request per second.
//!
//! Staleness: an instance that stops is still counted for up to `HEARTBEAT_TTL`, and a new
//! one is noticed by the others within `HEARTBEAT_EVERY` of its first beat. During an outage
//! N is frozen, so instances started or stopped during it are not accounted for: the fleet may
//! then admit up to (actual instances / N) times the fleet rate. A set younger than
//! `HEARTBEAT_TTL` (a Redis back without its data, whose set the first instance to beat
//! makes again) may lack instances that have not beaten into it yet: N only grows until it is
//! that old, so the first instances back do not each take the whole fleet rate while their
//! breakers still send every decision to the emergency buckets.

use std::sync::Arc;
use std::time::Duration;

use crate::decision::fleet::Fleet;
use crate::store::Store;

pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(2);
pub const HEARTBEAT_TTL: Duration = Duration::from_secs(6);

/// The sorted set the instances of a fleet beat in.
pub fn fleet_key(key_prefix: &str) -> String {
    format!("{key_prefix}:v1:fleet")
}

/// Beats while `fleet_key` names a key: the live config's [`fleet_key`] while any of its
/// routes has a fleet-wide emergency rate, else `None`.
pub async fn heartbeat(
    fleet: Arc<Fleet>,
    store: Store,
    fleet_key: impl Fn() -> Option<String>,
    metrics: prometheus::IntGauge,
) {
    let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(key) = fleet_key() else {
            continue;
        };
        match store
            .heartbeat(&key, &fleet.instance, HEARTBEAT_TTL.as_millis() as u64)
            .await
        {
            Ok((counted, age_ms)) => {
                let young = age_ms < HEARTBEAT_TTL.as_millis() as u64;
                let n = if young {
                    counted.max(fleet.live())
                } else {
                    counted
                };
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
