//! The Redis store: one shared multiplexed connection, EVALSHA within the budget, and the
//! classification of every failure as timeout, connection error or NOSCRIPT.
//!
//! The connection is first driven on a runtime the store owns; once the first request shows
//! the proxy's runtime, a new one is opened there and swapped in (a decision then needs no
//! hop to another thread). While it is down, an evaluation fails at
//! once as a connection error (there is no offline queue) and a background task reconnects
//! with capped, jittered backoff, so a Redis that comes back is not hit by every worker at
//! once. A slow but connected Redis is a timeout. `NOSCRIPT` costs one `SCRIPT LOAD` and one
//! retry, inside the same budget.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use redis::aio::MultiplexedConnection;
use redis::{ErrorKind, RedisError, ServerErrorKind};
use tokio::sync::Notify;

use super::connector::{connector, Target};

use crate::config::RedisConfig;
use crate::metrics::{Metrics, StoreErrorCounters};

pub const TOKEN_BUCKET_LUA: &str = concat!(
    include_str!("../../lua/int.lua"),
    include_str!("../../lua/token_bucket.lua")
);
pub const SLIDING_WINDOW_LUA: &str = concat!(
    include_str!("../../lua/int.lua"),
    include_str!("../../lua/sliding_window.lua")
);
pub const HEARTBEAT_LUA: &str = include_str!("../../lua/heartbeat.lua");

/// The limiter scripts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptKind {
    /// Args: capacity, refill per second, cost (micro-tokens).
    TokenBucket,
    /// Args: limit, window in microseconds, cost (requests).
    SlidingWindow,
}

/// How a store call failed; the three causes of the decision table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFailure {
    Timeout,
    ConnectionError,
    Noscript,
}

impl StoreFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            StoreFailure::Timeout => "timeout",
            StoreFailure::ConnectionError => "connection_error",
            StoreFailure::Noscript => "noscript",
        }
    }
}

/// A limiter script's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScriptReply {
    pub allowed: bool,
    /// What is left after this request: micro-tokens (token bucket) or requests (window).
    pub remaining: u64,
    /// Seconds until the cost is available; `None` when the bucket never refills.
    pub retry_after: Option<u64>,
    /// Seconds until the bucket is full or the window ends; `None` when never.
    pub reset: Option<u64>,
    /// Redis `TIME` of the decision, in microseconds.
    pub now_us: u64,
    /// On a denial, microseconds until the request would be admitted, when known exactly.
    pub wait_us: Option<u64>,
}

impl ScriptReply {
    fn parse(v: &[i64]) -> Option<Self> {
        let [allowed, remaining, retry, reset, now, wait] = *v else {
            return None;
        };
        let opt = |x: i64| u64::try_from(x).ok();
        Some(Self {
            allowed: allowed == 1,
            remaining: opt(remaining)?,
            retry_after: opt(retry),
            reset: opt(reset),
            now_us: opt(now)?,
            wait_us: opt(wait).filter(|w| *w > 0),
        })
    }

    /// Whole seconds for `Retry-After` on a denial: at least 1, at most a day.
    pub fn retry_after_secs(&self) -> u64 {
        if self.allowed {
            return 0;
        }
        self.retry_after
            .unwrap_or(super::MAX_RETRY_AFTER_SECS)
            .clamp(1, super::MAX_RETRY_AFTER_SECS)
    }
}

pub(super) struct Script {
    pub(super) sha: String,
    pub(super) body: &'static str,
}

impl Script {
    fn new(body: &'static str) -> Self {
        Self {
            sha: redis::Script::new(body).get_hash().to_owned(),
            body,
        }
    }
}

pub(super) struct Shared {
    pub(super) conn: ArcSwapOption<MultiplexedConnection>,
    pub(super) wake: Notify,
    budget_us: AtomicU64,
    pub(super) token_bucket: Script,
    pub(super) sliding_window: Script,
    heartbeat: redis::Script,
    errors: StoreErrorCounters,
    redis_duration: prometheus::Histogram,
    /// Where to connect; replaced when a reload changes `[redis] url`.
    pub(super) target: ArcSwap<Target>,
    /// Whether the last connection attempt failed; logs once per outage, not per retry.
    pub(super) outage_logged: AtomicBool,
    /// Redis's `maxmemory-policy` as last read, when it could be read.
    pub(super) eviction_policy: ArcSwapOption<String>,
    /// The proxy's runtime, learnt from the first request: the connection's driver task is
    /// moved there so a decision does not hop to another thread and back.
    pub(super) proxy_runtime: std::sync::OnceLock<tokio::runtime::Handle>,
    /// Whether the current connection is driven on the proxy's runtime.
    pub(super) on_proxy_runtime: AtomicBool,
    /// The last evaluation timed out: the connection may be talking to a peer that is gone
    /// without a word (no RST), so the next breaker probe opens a fresh one.
    suspect: AtomicBool,
}

/// The process's Redis store. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    shared: Arc<Shared>,
    runtime: Arc<tokio::runtime::Runtime>,
}

impl Store {
    /// Starts the store's runtime and its connector; returns at once, connected or not.
    pub fn start(config: &RedisConfig, metrics: &Metrics) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("sentinel-store")
            .enable_all()
            .build()?;
        let shared = Arc::new(Shared {
            conn: ArcSwapOption::empty(),
            wake: Notify::new(),
            budget_us: AtomicU64::new(config.timeout.as_micros() as u64),
            token_bucket: Script::new(TOKEN_BUCKET_LUA),
            sliding_window: Script::new(SLIDING_WINDOW_LUA),
            heartbeat: redis::Script::new(HEARTBEAT_LUA),
            errors: metrics.store_errors(),
            redis_duration: metrics.redis_duration.clone(),
            target: ArcSwap::from_pointee(Target::new(config)?),
            outage_logged: AtomicBool::new(false),
            eviction_policy: ArcSwapOption::empty(),
            proxy_runtime: std::sync::OnceLock::new(),
            on_proxy_runtime: AtomicBool::new(false),
            suspect: AtomicBool::new(false),
        });
        runtime.spawn(connector(Arc::clone(&shared)));
        Ok(Self {
            shared,
            runtime: Arc::new(runtime),
        })
    }

    /// The runtime the store's connection runs on; also hosts the gateway's control tasks.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        self.runtime.handle()
    }

    /// Follows a reloaded `[redis]` section: a new URL drops the connection and reconnects.
    pub fn retarget(&self, config: &RedisConfig) -> std::io::Result<()> {
        self.set_budget(config.timeout);
        let current = self.shared.target.load();
        if current.url == config.url && current.require_noeviction == config.require_noeviction {
            return Ok(());
        }
        let url_changed = current.url != config.url;
        self.shared.target.store(Arc::new(Target::new(config)?));
        if url_changed {
            tracing::info!("redis.url changed; reconnecting");
            self.shared.conn.store(None);
            self.shared.wake.notify_one();
        }
        Ok(())
    }

    /// Redis's `maxmemory-policy` when last read; `None` until read or when not permitted.
    pub fn eviction_policy(&self) -> Option<String> {
        self.shared
            .eviction_policy
            .load_full()
            .map(|p| (*p).clone())
    }

    pub fn is_connected(&self) -> bool {
        self.shared.conn.load().is_some()
    }

    pub fn set_budget(&self, budget: Duration) {
        self.shared
            .budget_us
            .store(budget.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn budget(&self) -> Duration {
        Duration::from_micros(self.shared.budget_us.load(Ordering::Relaxed))
    }

    /// Runs a limiter script for `key` within the budget.
    ///
    /// `probe`: this is the breaker's half-open probe; after a timeout it opens a fresh
    /// connection first, inside the same budget, so a peer that vanished silently (or moved
    /// behind its DNS name) is left behind.
    pub async fn run(
        &self,
        kind: ScriptKind,
        key: &str,
        args: [u64; 3],
        probe: bool,
    ) -> Result<ScriptReply, StoreFailure> {
        if self.shared.proxy_runtime.get().is_none() {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                if self.shared.proxy_runtime.set(handle).is_ok() {
                    self.shared.wake.notify_one();
                }
            }
        }
        let script = match kind {
            ScriptKind::TokenBucket => &self.shared.token_bucket,
            ScriptKind::SlidingWindow => &self.shared.sliding_window,
        };
        let started = Instant::now();
        let result = self.eval(script, key, &args, probe).await;
        self.shared
            .suspect
            .store(result == Err(StoreFailure::Timeout), Ordering::Relaxed);
        self.shared
            .redis_duration
            .observe(started.elapsed().as_secs_f64());
        let reply = result.and_then(|v| {
            ScriptReply::parse(&v).ok_or_else(|| {
                tracing::error!(reply = ?v, "a limiter script answered an unexpected shape: this is a bug");
                StoreFailure::ConnectionError
            })
        });
        if let Err(failure) = reply {
            self.count(failure);
        }
        reply
    }

    /// Runs the fleet heartbeat (off the request path); returns the live instance count.
    pub async fn heartbeat(
        &self,
        key: &str,
        instance: &str,
        ttl_ms: u64,
    ) -> Result<u64, StoreFailure> {
        let Some(conn) = self.shared.conn.load_full() else {
            return Err(StoreFailure::ConnectionError);
        };
        let mut c = (*conn).clone();
        let mut invocation = self.shared.heartbeat.key(key);
        invocation.arg(instance).arg(ttl_ms);
        let call = invocation.invoke_async::<u64>(&mut c);
        match tokio::time::timeout(Duration::from_millis(500), call).await {
            Err(_) => Err(StoreFailure::Timeout),
            Ok(Ok(n)) => Ok(n),
            Ok(Err(e)) => Err(self.classify(&conn, &e)),
        }
    }

    fn count(&self, failure: StoreFailure) {
        let e = &self.shared.errors;
        match failure {
            StoreFailure::Timeout => e.timeout.inc(),
            StoreFailure::ConnectionError => e.connection_error.inc(),
            StoreFailure::Noscript => e.noscript.inc(),
        }
    }

    /// The connection to use: the shared one, or, for a probe after a timeout, a new one.
    async fn connection(&self, probe: bool) -> Result<Arc<MultiplexedConnection>, StoreFailure> {
        if !(probe && self.shared.suspect.load(Ordering::Relaxed)) {
            return self
                .shared
                .conn
                .load_full()
                .ok_or(StoreFailure::ConnectionError);
        }
        let target = self.shared.target.load_full();
        let fresh = super::connector::open(&target.client).await.map_err(|e| {
            tracing::debug!(error = %e, "the probe could not open a fresh redis connection");
            StoreFailure::ConnectionError
        })?;
        let fresh = Arc::new(fresh);
        self.shared.conn.store(Some(Arc::clone(&fresh)));
        self.shared
            .on_proxy_runtime
            .store(self.shared.proxy_runtime.get().is_some(), Ordering::Relaxed);
        tracing::info!("the breaker probe replaced a redis connection that had timed out");
        Ok(fresh)
    }

    async fn eval(
        &self,
        script: &Script,
        key: &str,
        args: &[u64],
        probe: bool,
    ) -> Result<Vec<i64>, StoreFailure> {
        let budget = self.budget();
        let attempt = async {
            let conn = self.connection(probe).await?;
            let mut c = (*conn).clone();
            match evalsha(&mut c, script, key, args).await {
                Err(e) if is_noscript(&e) => {}
                other => return other.map_err(|e| self.classify(&conn, &e)),
            }
            // One SCRIPT LOAD and one retry. A load Redis refuses (a managed Redis that
            // forbids SCRIPT, say) leaves the script missing: that is the NOSCRIPT row.
            let load = redis::cmd("SCRIPT")
                .arg("LOAD")
                .arg(script.body)
                .query_async::<String>(&mut c)
                .await;
            match load {
                Ok(_) => {}
                Err(e) if is_transport(&e) => return Err(self.classify(&conn, &e)),
                Err(e) => {
                    tracing::warn!(error = %e, "redis refused SCRIPT LOAD after NOSCRIPT");
                    return Err(StoreFailure::Noscript);
                }
            }
            evalsha(&mut c, script, key, args)
                .await
                .map_err(|e| self.classify(&conn, &e))
        };
        tokio::time::timeout(budget, attempt)
            .await
            .unwrap_or(Err(StoreFailure::Timeout))
    }

    /// One cause per error. Anything that is not a timeout or NOSCRIPT means this connection
    /// cannot answer now; errors that hint at a bug on our side are logged as such.
    fn classify(&self, conn: &Arc<MultiplexedConnection>, e: &RedisError) -> StoreFailure {
        if is_noscript(e) {
            return StoreFailure::Noscript;
        }
        if e.is_timeout() {
            return StoreFailure::Timeout;
        }
        if is_transport(e) {
            self.drop_connection(conn, e);
        } else if matches!(
            e.kind(),
            ErrorKind::Parse | ErrorKind::UnexpectedReturnType | ErrorKind::Client
        ) || e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        {
            tracing::error!(error = %e, "redis rejected the limiter's command: this is a bug, not an outage");
        } else {
            tracing::debug!(error = %e, "redis could not run the limiter script");
        }
        StoreFailure::ConnectionError
    }

    /// Forgets a broken connection (once, however many requests saw it break) and wakes the
    /// connector.
    fn drop_connection(&self, conn: &Arc<MultiplexedConnection>, e: &RedisError) {
        let prev = self.shared.conn.compare_and_swap(conn, None);
        if prev.as_ref().is_some_and(|p| Arc::ptr_eq(p, conn)) {
            tracing::warn!(error = %e, "redis connection lost; reconnecting in the background");
            self.shared.wake.notify_one();
        }
    }
}

pub(super) fn is_noscript(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// The connection itself is broken (as opposed to Redis answering with an error).
pub(super) fn is_transport(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
}

async fn evalsha(
    c: &mut MultiplexedConnection,
    script: &Script,
    key: &str,
    args: &[u64],
) -> redis::RedisResult<Vec<i64>> {
    redis::cmd("EVALSHA")
        .arg(&script.sha)
        .arg(1)
        .arg(key)
        .arg(args)
        .query_async(c)
        .await
}
