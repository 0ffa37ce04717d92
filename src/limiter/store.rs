//! The Redis store: one shared multiplexed connection per Redis node, EVALSHA within the
//! budget, and the classification of every failure as timeout, connection error or NOSCRIPT.
//!
//! With one Redis there is one [`Link`]; with Redis Cluster one per primary, chosen by the
//! key's slot (see `cluster.rs`), and a request follows `MOVED` / `ASK` within its budget.
//! Each link has its own breaker.
//!
//! A connection is first driven on a runtime the store owns; once the first request shows
//! the proxy's runtime, a new one is opened there and swapped in (a decision then needs no
//! hop to another thread). While it is down, an evaluation fails at
//! once as a connection error (there is no offline queue) and a background task reconnects
//! with capped, jittered backoff, so a Redis that comes back is not hit by every worker at
//! once. A slow but connected Redis is a timeout. `NOSCRIPT` costs one `SCRIPT LOAD` and one
//! retry, inside the same budget.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

use super::breaker::{BreakerBoard, BreakerState};
use super::cluster::{keep_topology, Cluster};
use super::connector::{connector, Link, Target};
use super::script::{Script, HEARTBEAT_LUA, SLIDING_WINDOW_LUA, TOKEN_BUCKET_LUA};
pub use super::script::{ScriptKind, ScriptReply, StoreFailure};

use crate::clock::SharedClock;
use crate::config::{BreakerConfig, RedisConfig, RedisTarget};
use crate::metrics::{Metrics, StoreErrorCounters};

/// One Redis, or the primaries of a cluster.
pub(crate) enum Mode {
    Single(Arc<Link>),
    Cluster(Cluster),
}

/// What the whole store shares: budget, scripts, metrics, breakers, and its links.
pub(crate) struct Shared {
    budget_us: AtomicU64,
    pub(crate) token_bucket: Script,
    pub(crate) sliding_window: Script,
    heartbeat: redis::Script,
    errors: StoreErrorCounters,
    redis_duration: prometheus::Histogram,
    /// The proxy's runtime, learnt from the first request: connections' driver tasks are
    /// moved there so a decision does not hop to another thread and back.
    pub(crate) proxy_runtime: std::sync::OnceLock<tokio::runtime::Handle>,
    pub(crate) require_noeviction: AtomicBool,
    /// `[redis] dedicated_io_thread`: the connections stay on the store's own thread.
    dedicated_io_thread: bool,
    breakers: Arc<BreakerBoard>,
    /// The store's own runtime: connectors and the cluster refresher run there.
    runtime: tokio::runtime::Handle,
    pub(crate) mode: Mode,
}

impl Shared {
    /// A link to one node, its breaker and its connector.
    pub(crate) fn new_link(self: &Arc<Self>, target: Target) -> Arc<Link> {
        let node = match self.mode {
            Mode::Cluster(_) => Some(target.node.clone()),
            Mode::Single(_) => None,
        };
        if let Some(node) = &node {
            self.breakers.metrics.redis_node(node, Some(false));
        }
        let breaker = self.breakers.breaker(node);
        let link = Arc::new(Link::new(target, breaker));
        self.runtime
            .spawn(connector(Arc::clone(self), Arc::clone(&link)));
        link
    }

    /// A node left: its connector stops and its breaker no longer counts.
    pub(crate) fn retire(&self, link: &Link) {
        link.retire();
        self.breakers.forget(link.breaker.state());
        self.breakers.metrics.redis_node(&link.node(), None);
    }
}

/// A cluster primary as `/readyz` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatus {
    pub node: String,
    pub connected: bool,
    pub breaker: BreakerState,
}

/// The process's Redis store. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    shared: Arc<Shared>,
    runtime: Arc<tokio::runtime::Runtime>,
}

/// Where one evaluation stands.
enum Step {
    Reply(Value),
    Failed(StoreFailure),
    /// `MOVED` (`ask` false) or `ASK`: try again on `addr`.
    Redirect {
        slot: u16,
        addr: String,
        ask: bool,
    },
}

/// Tokio's timers tick in whole milliseconds: a timer fires on the first tick after its
/// deadline, and then waits for a worker to run it, so a timer set to the budget ends a
/// millisecond or two beyond it. The evaluation's timer is set this much earlier: 2 ms, or a
/// quarter of a smaller budget.
fn timer_for(budget: Duration) -> Duration {
    budget - (budget / 4).min(Duration::from_millis(2))
}

/// Redirects one evaluation follows before it gives up (a slot moving twice in one budget
/// is already unusual).
const MAX_REDIRECTS: usize = 3;

impl Store {
    /// Starts the store's runtime and its connectors; returns at once, connected or not.
    pub fn start(
        config: &RedisConfig,
        breaker: BreakerConfig,
        clock: SharedClock,
        metrics: &Arc<Metrics>,
    ) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("sentinel-store")
            .enable_all()
            .build()?;
        let board = Arc::new(BreakerBoard::new(breaker, clock, Arc::clone(metrics)));
        let mode = match &config.target {
            RedisTarget::Single(url) => {
                Mode::Single(Arc::new(Link::new(Target::new(url)?, board.breaker(None))))
            }
            RedisTarget::Cluster(seeds) => Mode::Cluster(Cluster::new(seeds.clone())),
        };
        let shared = Arc::new(Shared {
            budget_us: AtomicU64::new(config.timeout.as_micros() as u64),
            token_bucket: Script::new(TOKEN_BUCKET_LUA),
            sliding_window: Script::new(SLIDING_WINDOW_LUA),
            heartbeat: redis::Script::new(HEARTBEAT_LUA),
            errors: metrics.store_errors(),
            redis_duration: metrics.redis_duration.clone(),
            proxy_runtime: std::sync::OnceLock::new(),
            require_noeviction: AtomicBool::new(config.require_noeviction),
            dedicated_io_thread: config.dedicated_io_thread,
            runtime: runtime.handle().clone(),
            mode,
            breakers: board,
        });
        match &shared.mode {
            Mode::Single(link) => {
                runtime.spawn(connector(Arc::clone(&shared), Arc::clone(link)));
            }
            Mode::Cluster(_) => {
                runtime.spawn(keep_topology(Arc::clone(&shared)));
            }
        }
        Ok(Self {
            shared,
            runtime: Arc::new(runtime),
        })
    }

    /// The runtime the store's connections start on; also hosts the gateway's control tasks.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        self.runtime.handle()
    }

    /// Follows a reloaded `[redis]` section: a new URL (or new seeds) drops the connections
    /// and reconnects. Switching between one Redis and a cluster needs a restart: returns
    /// the field that says so, and keeps the current store.
    pub fn retarget(&self, config: &RedisConfig) -> std::io::Result<Option<&'static str>> {
        self.set_budget(config.timeout);
        self.shared
            .require_noeviction
            .store(config.require_noeviction, Ordering::Relaxed);
        match (&self.shared.mode, &config.target) {
            (Mode::Single(link), RedisTarget::Single(url)) => {
                if link.target.load().url != *url {
                    link.target.store(Arc::new(Target::new(url)?));
                    tracing::info!("redis.url changed; reconnecting");
                    link.conn.store(None);
                    link.wake.notify_one();
                }
                Ok(None)
            }
            (Mode::Cluster(cluster), RedisTarget::Cluster(seeds)) => {
                if *cluster.seeds() != *seeds {
                    tracing::info!("redis.cluster_urls changed; discovering the cluster anew");
                    cluster.reseed(&self.shared, seeds.clone());
                }
                Ok(None)
            }
            (Mode::Single(_), RedisTarget::Cluster(_)) => Ok(Some("redis.cluster_urls")),
            (Mode::Cluster(_), RedisTarget::Single(_)) => Ok(Some("redis.url")),
        }
    }

    /// Every link: the one Redis, or every primary known.
    fn links(&self) -> Vec<Arc<Link>> {
        match &self.shared.mode {
            Mode::Single(link) => vec![Arc::clone(link)],
            Mode::Cluster(cluster) => cluster.topology.load().links.clone(),
        }
    }

    /// Redis's `maxmemory-policy` when last read; `None` until read or when not permitted.
    /// In a cluster, the first evicting policy of a primary, else `noeviction` once every
    /// primary said so.
    pub fn eviction_policy(&self) -> Option<String> {
        let policies: Vec<Option<Arc<String>>> = self
            .links()
            .iter()
            .map(|l| l.eviction_policy.load_full())
            .collect();
        if let Some(evicting) = policies
            .iter()
            .flatten()
            .find(|p| p.as_str() != "noeviction")
        {
            return Some((**evicting).clone());
        }
        let all_known = !policies.is_empty() && policies.iter().all(Option::is_some);
        all_known.then(|| "noeviction".to_owned())
    }

    /// Whether the store can reach its Redis: the one Redis, or every primary of the map.
    pub fn is_connected(&self) -> bool {
        let links = self.links();
        !links.is_empty() && links.iter().all(|l| l.is_connected())
    }

    /// Each cluster primary's state; empty with one Redis.
    pub fn nodes(&self) -> Vec<NodeStatus> {
        let Mode::Cluster(_) = &self.shared.mode else {
            return Vec::new();
        };
        let mut nodes: Vec<NodeStatus> = self
            .links()
            .iter()
            .map(|l| NodeStatus {
                node: l.node(),
                connected: l.is_connected(),
                breaker: l.breaker.state(),
            })
            .collect();
        nodes.sort_by(|a, b| a.node.cmp(&b.node));
        nodes
    }

    /// The process's breaker state: see [`BreakerBoard`].
    pub fn breaker_state(&self) -> BreakerState {
        self.shared.breakers.state()
    }

    /// A reload changes the breakers' thresholds; their states carry on.
    pub fn reconfigure_breakers(&self, config: BreakerConfig) {
        *self
            .shared
            .breakers
            .config
            .lock()
            .expect("breaker config lock") = config;
        let links = match &self.shared.mode {
            Mode::Single(link) => vec![Arc::clone(link)],
            Mode::Cluster(cluster) => cluster.links(),
        };
        for link in links {
            link.breaker.reconfigure(config);
        }
    }

    pub fn set_budget(&self, budget: Duration) {
        self.shared
            .budget_us
            .store(budget.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn budget(&self) -> Duration {
        Duration::from_micros(self.shared.budget_us.load(Ordering::Relaxed))
    }

    /// The link that decides `key`: the one Redis, or the primary owning its slot. `None`
    /// while a cluster's map is unknown or no primary serves the slot.
    /// (Borrowed with one Redis: no reference count to touch per request.)
    pub(crate) fn link_for(&self, key: &str) -> Option<Cow<'_, Arc<Link>>> {
        match &self.shared.mode {
            Mode::Single(link) => Some(Cow::Borrowed(link)),
            Mode::Cluster(cluster) => cluster.link_for(key).map(Cow::Owned),
        }
    }

    /// Runs a limiter script for `key` on `link` within the budget.
    ///
    /// `probe`: this is the link's breaker's half-open probe; after a timeout it opens a fresh
    /// connection first, inside the same budget, so a peer that vanished silently (or moved
    /// behind its DNS name) is left behind.
    pub(crate) async fn run(
        &self,
        link: &Arc<Link>,
        kind: ScriptKind,
        key: &str,
        args: [u64; 3],
        probe: bool,
    ) -> Result<ScriptReply, StoreFailure> {
        if !self.shared.dedicated_io_thread && self.shared.proxy_runtime.get().is_none() {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                if self.shared.proxy_runtime.set(handle).is_ok() {
                    for link in self.links() {
                        link.wake.notify_one();
                    }
                }
            }
        }
        let script = match kind {
            ScriptKind::TokenBucket => &self.shared.token_bucket,
            ScriptKind::SlidingWindow => &self.shared.sliding_window,
        };
        let started = Instant::now();
        let result = self.eval(link, script, key, &args, probe).await;
        link.suspect
            .store(result == Err(StoreFailure::Timeout), Ordering::Relaxed);
        self.shared
            .redis_duration
            .observe(started.elapsed().as_secs_f64());
        let reply = result.and_then(|v| {
            let parsed = match &v {
                Value::BulkString(bytes) => ScriptReply::parse(bytes),
                _ => None,
            };
            parsed.ok_or_else(|| {
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
        let Some(conn) = self.link_for(key).and_then(|l| l.conn.load_full()) else {
            return Err(StoreFailure::ConnectionError);
        };
        let mut c = (*conn).clone();
        let mut invocation = self.shared.heartbeat.key(key);
        invocation.arg(instance).arg(ttl_ms);
        let call = invocation.invoke_async::<u64>(&mut c);
        match tokio::time::timeout(Duration::from_millis(500), call).await {
            Err(_) => Err(StoreFailure::Timeout),
            Ok(Ok(n)) => Ok(n),
            Ok(Err(e)) => Err(StoreFailure::ConnectionError).inspect_err(|_| {
                tracing::debug!(error = %e, "fleet heartbeat failed");
            }),
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

    /// The connection to use: the link's, or, for a probe after a timeout, a new one.
    async fn connection(
        &self,
        link: &Arc<Link>,
        probe: bool,
    ) -> Result<Arc<MultiplexedConnection>, StoreFailure> {
        if !(probe && link.suspect.load(Ordering::Relaxed)) {
            return link.conn.load_full().ok_or(StoreFailure::ConnectionError);
        }
        let target = link.target.load_full();
        let fresh = super::connector::open(&target.client).await.map_err(|e| {
            tracing::debug!(error = %e, "the probe could not open a fresh redis connection");
            StoreFailure::ConnectionError
        })?;
        link.install(
            &self.shared,
            fresh,
            self.shared.proxy_runtime.get().is_some(),
        );
        tracing::info!(node = %target.node, "the breaker probe replaced a redis connection that had timed out");
        link.conn.load_full().ok_or(StoreFailure::ConnectionError)
    }

    /// The evaluation, redirects included, inside one budget.
    async fn eval(
        &self,
        link: &Arc<Link>,
        script: &Script,
        key: &str,
        args: &[u64],
        probe: bool,
    ) -> Result<Value, StoreFailure> {
        let budget = self.budget();
        let attempt = async {
            // Owned only after a redirect: the common case touches no reference count.
            let mut link: Cow<'_, Arc<Link>> = Cow::Borrowed(link);
            let mut asking = false;
            for hop in 0..=MAX_REDIRECTS {
                match self
                    .eval_on(&link, script, key, args, probe && hop == 0, asking)
                    .await
                {
                    Step::Reply(v) => return Ok(v),
                    Step::Failed(f) => return Err(f),
                    Step::Redirect { slot, addr, ask } => {
                        let Mode::Cluster(cluster) = &self.shared.mode else {
                            tracing::error!(%addr, "redis answered MOVED/ASK but redis.url names one Redis: use redis.cluster_urls for a cluster");
                            return Err(StoreFailure::ConnectionError);
                        };
                        let next = if ask {
                            cluster.asked(&self.shared, &addr)
                        } else {
                            cluster.moved(&self.shared, slot, &addr)
                        };
                        let Some(next) = next else {
                            tracing::warn!(%addr, "redis redirected to an address that cannot be used");
                            return Err(StoreFailure::ConnectionError);
                        };
                        // A node first named by this redirect connects now; the budget
                        // bounds the wait.
                        next.connected().await;
                        link = Cow::Owned(next);
                        asking = ask;
                    }
                }
            }
            tracing::warn!(
                key_slot = super::cluster::slot(key.as_bytes()),
                "redis cluster redirected too many times"
            );
            Err(StoreFailure::ConnectionError)
        };
        tokio::time::timeout(timer_for(budget), attempt)
            .await
            .unwrap_or(Err(StoreFailure::Timeout))
    }

    /// One node's answer: EVALSHA, and on NOSCRIPT one SCRIPT LOAD and one retry.
    async fn eval_on(
        &self,
        link: &Arc<Link>,
        script: &Script,
        key: &str,
        args: &[u64],
        probe: bool,
        asking: bool,
    ) -> Step {
        let conn = match self.connection(link, probe).await {
            Ok(c) => c,
            Err(f) => return Step::Failed(f),
        };
        let mut c = (*conn).clone();
        let step = |r: redis::RedisResult<Value>| match r {
            Ok(v) => Step::Reply(v),
            Err(e) => match e.redirect_node() {
                Some((addr, slot)) => Step::Redirect {
                    slot,
                    addr: addr.to_owned(),
                    ask: e.kind() == ErrorKind::Server(ServerErrorKind::Ask),
                },
                None => Step::Failed(self.classify(link, &conn, &e)),
            },
        };
        match evalsha(&mut c, script, key, args, asking).await {
            Err(e) if is_noscript(&e) => {}
            other => return step(other),
        }
        // One SCRIPT LOAD and one retry. A load Redis refuses (a managed Redis that
        // forbids SCRIPT, say) leaves the script missing: that is the NOSCRIPT row.
        match script.load(&mut c).await {
            Ok(_) => {}
            Err(e) if is_transport(&e) => return Step::Failed(self.classify(link, &conn, &e)),
            Err(e) => {
                tracing::warn!(error = %e, "redis refused SCRIPT LOAD after NOSCRIPT");
                return Step::Failed(StoreFailure::Noscript);
            }
        }
        step(evalsha(&mut c, script, key, args, asking).await)
    }

    /// One cause per error. Anything that is not a timeout or NOSCRIPT means this connection
    /// cannot answer now; errors that hint at a bug on our side are logged as such.
    fn classify(
        &self,
        link: &Link,
        conn: &Arc<MultiplexedConnection>,
        e: &RedisError,
    ) -> StoreFailure {
        if is_noscript(e) {
            return StoreFailure::Noscript;
        }
        if e.is_timeout() {
            return StoreFailure::Timeout;
        }
        if is_transport(e) {
            forget_connection(&self.shared, link, conn, e);
        } else if matches!(
            e.kind(),
            ErrorKind::Parse | ErrorKind::UnexpectedReturnType | ErrorKind::Client
        ) || e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        {
            tracing::error!(error = %e, "redis rejected the limiter's command: this is a bug, not an outage");
        } else {
            tracing::debug!(error = %e, "redis could not run the limiter script");
            // READONLY, CLUSTERDOWN, MASTERDOWN...: in a cluster the map may be stale (this
            // node was demoted after a failover, say); look again rather than wait 5 s.
            if let Mode::Cluster(cluster) = &self.shared.mode {
                cluster.refresh.notify_one();
            }
        }
        StoreFailure::ConnectionError
    }
}

/// Forgets a broken connection (once, however many requests, or its watcher, saw it break)
/// and wakes the connector; in a cluster, also asks for a fresh slot map (a replica may be
/// taking over).
pub(crate) fn forget_connection(
    shared: &Shared,
    link: &Link,
    conn: &Arc<MultiplexedConnection>,
    cause: &dyn std::fmt::Display,
) {
    let prev = link.conn.compare_and_swap(conn, None);
    if prev.as_ref().is_some_and(|p| Arc::ptr_eq(p, conn)) {
        tracing::warn!(node = %link.node(), error = %cause, "redis connection lost; reconnecting in the background");
        link.wake.notify_one();
        if let Mode::Cluster(cluster) = &shared.mode {
            cluster.refresh.notify_one();
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

/// `EVALSHA`; after an `ASK`, sent behind `ASKING` in one round trip.
async fn evalsha(
    c: &mut MultiplexedConnection,
    script: &Script,
    key: &str,
    args: &[u64],
    asking: bool,
) -> redis::RedisResult<Value> {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(&script.sha).arg(1).arg(key).arg(args);
    if !asking {
        return cmd.query_async(c).await;
    }
    let (reply,): (Value,) = redis::pipe()
        .cmd("ASKING")
        .ignore()
        .add_command(cmd)
        .query_async(c)
        .await?;
    Ok(reply)
}
