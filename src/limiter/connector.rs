//! Keeping the store's one connection up: connect, check the eviction policy, load the
//! scripts; on loss, reconnect in the background with capped, jittered backoff.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;

use super::store::{is_transport, Shared};
use crate::config::RedisConfig;

/// Where the store connects.
pub(super) struct Target {
    pub(super) url: String,
    pub(super) client: redis::Client,
    pub(super) require_noeviction: bool,
}

impl Target {
    pub(super) fn new(config: &RedisConfig) -> std::io::Result<Self> {
        let client = redis::Client::open(config.url.as_str())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        Ok(Self {
            url: config.url.clone(),
            client,
            require_noeviction: config.require_noeviction,
        })
    }
}

/// What `CONFIG GET maxmemory-policy` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvictionPolicy {
    NoEviction,
    /// Keys can be evicted: quotas can silently reset.
    Evicting(String),
    /// `CONFIG` is not permitted (a managed Redis, say).
    Unknown,
}

/// Backoff between reconnection attempts: 50 ms doubling to 2 s, with full jitter on top of
/// half the step so a fleet does not reconnect in lockstep.
fn backoff(attempt: u32) -> Duration {
    let step_ms = (50u64 << attempt.min(6)).min(2_000);
    let jitter = rand::rng().random_range(0..=step_ms / 2);
    Duration::from_millis(step_ms / 2 + jitter)
}

pub(super) async fn open(client: &redis::Client) -> redis::RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(1)))
        .set_response_timeout(Some(Duration::from_secs(2)));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

pub async fn eviction_policy(
    conn: &mut MultiplexedConnection,
) -> redis::RedisResult<EvictionPolicy> {
    let reply: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(conn)
        .await;
    match reply {
        Ok(v) => Ok(match v.get(1).map(String::as_str) {
            Some("noeviction") => EvictionPolicy::NoEviction,
            Some(other) => EvictionPolicy::Evicting(other.to_owned()),
            None => EvictionPolicy::Unknown,
        }),
        Err(e) if is_transport(&e) || e.is_timeout() => Err(e),
        Err(_) => Ok(EvictionPolicy::Unknown),
    }
}

/// Start-up check: `Ok(Some(policy))` when Redis answers with an evicting policy, which a
/// gateway requiring noeviction must refuse. A Redis that is down is not an error here: the
/// routes follow their fail modes until it comes.
pub async fn preflight(config: &RedisConfig) -> Option<String> {
    let client = redis::Client::open(config.url.as_str()).ok()?;
    let check = async {
        let mut conn = open(&client).await.ok()?;
        eviction_policy(&mut conn).await.ok()
    };
    match tokio::time::timeout(Duration::from_secs(3), check).await {
        Ok(Some(EvictionPolicy::Evicting(p))) => Some(p),
        Ok(Some(EvictionPolicy::Unknown)) => {
            tracing::warn!("cannot read redis maxmemory-policy (CONFIG not permitted); make sure it is noeviction");
            None
        }
        _ => None,
    }
}

async fn connect(shared: &Shared, target: &Target) -> redis::RedisResult<MultiplexedConnection> {
    let mut conn = match shared.proxy_runtime.get() {
        // Spawned there, the connection's driver task runs on the proxy's workers.
        Some(proxy) => {
            let client = target.client.clone();
            proxy
                .spawn(async move { open(&client).await })
                .await
                .map_err(|e| redis::RedisError::from(std::io::Error::other(e)))??
        }
        None => open(&target.client).await?,
    };
    let policy = eviction_policy(&mut conn).await?;
    match &policy {
        EvictionPolicy::Evicting(p) if target.require_noeviction => {
            tracing::error!(maxmemory_policy = %p, "redis may evict keys: rate limit quotas can silently reset; set maxmemory-policy noeviction");
        }
        EvictionPolicy::Unknown if target.require_noeviction => {
            tracing::warn!("cannot read redis maxmemory-policy (CONFIG not permitted); make sure it is noeviction");
        }
        _ => {}
    }
    shared.eviction_policy.store(match policy {
        EvictionPolicy::NoEviction => Some(Arc::new("noeviction".to_owned())),
        EvictionPolicy::Evicting(p) => Some(Arc::new(p)),
        EvictionPolicy::Unknown => None,
    });
    for script in [&shared.token_bucket, &shared.sliding_window] {
        let loaded = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(script.body)
            .query_async::<String>(&mut conn)
            .await;
        match loaded {
            Ok(_) => {}
            Err(e) if is_transport(&e) || e.is_timeout() => return Err(e),
            // Serve anyway: each request tries the NOSCRIPT path, and counts it if it fails.
            Err(e) => {
                tracing::error!(error = %e, "redis refused SCRIPT LOAD; limited requests will fail as NOSCRIPT");
                break;
            }
        }
    }
    Ok(conn)
}

/// Keeps one connection up: connects, checks, loads the scripts, then sleeps until the
/// connection is dropped.
pub(super) async fn connector(shared: Arc<Shared>) {
    let mut attempt = 0u32;
    loop {
        let connected = shared.conn.load().is_some();
        let movable = shared.proxy_runtime.get().is_some()
            && !shared.on_proxy_runtime.load(Ordering::Relaxed);
        if connected && !movable {
            shared.wake.notified().await;
            continue;
        }
        let target = shared.target.load_full();
        match connect(&shared, &target).await {
            // A reload may have changed the target while this one was connecting.
            Ok(_) if !Arc::ptr_eq(&target, &shared.target.load_full()) => continue,
            Ok(conn) => {
                // Swapping is seamless: requests on the old connection finish on it.
                shared.conn.store(Some(Arc::new(conn)));
                shared
                    .on_proxy_runtime
                    .store(shared.proxy_runtime.get().is_some(), Ordering::Relaxed);
                if connected {
                    tracing::info!("redis connection now driven by the proxy workers");
                    continue;
                }
                shared.outage_logged.store(false, Ordering::Relaxed);
                tracing::info!(attempts = attempt + 1, "redis connected");
                attempt = 0;
            }
            Err(e) if connected => {
                tracing::debug!(error = %e, "cannot open a connection on the proxy runtime yet");
                tokio::time::sleep(backoff(attempt)).await;
                attempt = attempt.saturating_add(1);
            }
            Err(e) => {
                if !shared.outage_logged.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "redis unavailable; reconnecting in the background");
                }
                tokio::time::sleep(backoff(attempt)).await;
                attempt = attempt.saturating_add(1);
            }
        }
    }
}
