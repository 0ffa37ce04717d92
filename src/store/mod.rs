//! The Redis store: the only room that speaks to Redis. This file is its whole API: start it,
//! follow a reload, evaluate a limiter script within the budget, run the fleet heartbeat, and
//! say how the nodes are for `/readyz`.
//!
//! With one Redis there is one link; with Redis Cluster one per primary, chosen by the key's
//! slot, and an evaluation follows `MOVED` / `ASK` within its budget. Each link has its own
//! breaker. While a link is down an evaluation fails at once as a connection error (there is
//! no offline queue) and its connector reconnects in the background; a slow but connected
//! Redis is a timeout; `NOSCRIPT` costs one `SCRIPT LOAD` and one retry inside the same budget.
//!
//! Inside: `link.rs` (one node), `connect.rs` (opening and keeping connections),
//! `cluster.rs` + `slots.rs` (the slot map), `eval.rs` (the evaluation loop and the
//! classification of failures), `script.rs` (the Lua), `breakers.rs` (the breakers' sum).

pub mod batch;
mod breakers;
mod broken_keys;
mod channel;
mod cluster;
mod connect;
pub mod deadline;
mod dial;
mod eval;
mod link;
pub mod script;
mod sentinel;
mod slots;
mod wire;

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use connect::{inspect, preflight, EvictionPolicy, NodeReport};
pub use script::ScriptKind;
pub use slots::slot;

use breakers::BreakerBoard;
use broken_keys::BrokenKeys;
pub use channel::{Announced, Heard, Listener};
use cluster::{keep_topology, Cluster};
use connect::Connector;
use eval::Call;
use link::{Link, Target};
use script::{Scripts, HEARTBEAT_LUA};
use sentinel::Sentinel;

use crate::clock::SharedClock;
use crate::config::{BreakerConfig, RedisConfig, RedisTarget};
use crate::decision::{BreakerState, Degradation, Failure, ScriptReply, StoreFailure};
use crate::metrics::{Metrics, StoreErrorCounters};

/// One Redis, or the primaries of a cluster.
enum Layout {
    Single(Arc<Link>),
    Cluster(Arc<Cluster>),
}

/// What the store's handles share.
struct Inner {
    budget_us: AtomicU64,
    scripts: Scripts,
    heartbeat: redis::Script,
    errors: StoreErrorCounters,
    redis_duration: prometheus::Histogram,
    /// `sentinel_redis_batch_size`: decisions per batched call.
    batch_size: prometheus::Histogram,
    /// `[redis] batch_max`: the most decisions one call carries (1: no batching).
    batch_max: std::sync::atomic::AtomicUsize,
    connector: Arc<Connector>,
    layout: Layout,
    broken_keys: BrokenKeys,
    /// With `sentinel_urls`: the watcher that keeps the one link on the master.
    sentinel: Option<Arc<Sentinel>>,
    /// Told the keys of each charge given back after its decision gave up ([`Store::on_give_back`]).
    gave_back: std::sync::OnceLock<GiveBackHook>,
    /// What [`Store::tell`] has to publish at its next flush, by channel.
    told: std::sync::Mutex<std::collections::HashSet<(String, String)>>,
    /// An announcement failed (said at INFO once).
    announce_failed: std::sync::atomic::AtomicBool,
    /// An announcement's replies could not be heard (said at INFO once).
    replies_failed: std::sync::atomic::AtomicBool,
}

/// What the store tells of a charge given back: its keys.
pub type GiveBackHook = Box<dyn Fn(&[String]) + Send + Sync>;

/// A cluster primary as `/readyz` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatus {
    pub node: String,
    pub connected: bool,
    pub breaker: BreakerState,
    /// The node's `maxmemory-policy` as last read (`None`: not yet, or `CONFIG` refused).
    pub eviction_policy: Option<Arc<String>>,
}

/// What one evaluation came to: the script's answer or why there is none, and the state of
/// the breaker of the node that was asked (or that refused the call).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation<T = ScriptReply> {
    pub outcome: Result<T, Degradation>,
    pub breaker: BreakerState,
}

/// What becomes of an admission Redis made but whose answer came after the decision gave
/// up (its budget spent, or its request gone): Redis charged a request that was then not
/// served by that answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfLate {
    /// The charge stands: the request was served all the same (a `fail_open` route's
    /// emergency limiter, a shadow route), or the call was no decision.
    Stands,
    /// Given back, as a denied request's charge is: the request was refused (a
    /// `fail_closed` route answers 503). Done where the answer is read: a batch's reader,
    /// or the task a decision sent alone is asked from (`eval.rs`).
    GivenBack,
}

/// The bound of an admin operation's Redis call (`/limits`).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(1);

/// How often the store's thread looks for open breakers whose quarantine is over.
const BREAKERS_LOOKED_AT_EVERY: Duration = Duration::from_millis(100);

impl Inner {
    /// Moves every breaker whose quarantine is over to half-open.
    fn refresh_breakers(&self) {
        let cluster = match &self.layout {
            Layout::Single(link) => return link.breaker.refresh(),
            Layout::Cluster(cluster) => cluster,
        };
        cluster.mapless.refresh();
        for link in cluster.primaries() {
            // A primary that left the cluster no longer counts in the process's state.
            if !link.retired.load(Ordering::Relaxed) {
                link.breaker.refresh();
            }
        }
    }
}

/// The process's Redis store. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
    runtime: Arc<tokio::runtime::Runtime>,
}

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
        let scripts = Scripts::new();
        let board = Arc::new(BreakerBoard::new(breaker, clock, Arc::clone(metrics)));
        let connector = Arc::new(Connector::new(
            scripts.clone(),
            &config.key_prefix,
            config.require_noeviction,
            config.dedicated_io_thread,
            board,
            runtime.handle().clone(),
        ));
        let mut sentinel_watcher = None;
        let layout = match &config.target {
            RedisTarget::Single(url) => {
                Layout::Single(connector.single(Target::new(url, &config.access)?))
            }
            RedisTarget::Sentinel(s) => {
                let watcher = Arc::new(Sentinel::new(s.clone(), config.access.clone()));
                // Asked before the link exists, so it starts on the master when one answers;
                // otherwise on no address at all (each attempt fails at once and counts as
                // a failed connection), until the watcher finds one.
                let found = runtime.block_on(async {
                    tokio::time::timeout(Duration::from_secs(2), watcher.discover())
                        .await
                        .unwrap_or_else(|_| Err("the sentinels did not answer within 2 s".into()))
                });
                let initial = match found {
                    Ok(t) => {
                        watcher.started_on(&t);
                        t
                    }
                    Err(reason) => {
                        tracing::warn!(reason = %reason, "redis sentinel: no sentinel names a reachable master yet; routes follow their fail modes until one does");
                        Target::nowhere("no sentinel names a reachable master", &config.access)
                    }
                };
                let link = connector.single_following(initial, Arc::clone(&watcher.ask));
                runtime.spawn(sentinel::follow(Arc::clone(&watcher), Arc::clone(&link)));
                sentinel_watcher = Some(watcher);
                Layout::Single(link)
            }
            RedisTarget::Cluster(seeds) => {
                let cluster = Arc::new(Cluster::new(
                    seeds.clone(),
                    config.access.clone(),
                    connector.breaker(),
                ));
                runtime.spawn(keep_topology(Arc::clone(&cluster), Arc::clone(&connector)));
                Layout::Cluster(cluster)
            }
        };
        let inner = Arc::new(Inner {
            budget_us: AtomicU64::new(config.timeout.as_micros() as u64),
            scripts,
            heartbeat: redis::Script::new(HEARTBEAT_LUA),
            errors: metrics.store_errors(),
            redis_duration: metrics.redis_duration.clone(),
            batch_size: metrics.redis_batch_size.clone(),
            batch_max: std::sync::atomic::AtomicUsize::new(config.batch_max),
            connector,
            layout,
            broken_keys: BrokenKeys::default(),
            sentinel: sentinel_watcher,
            gave_back: std::sync::OnceLock::new(),
            told: std::sync::Mutex::new(std::collections::HashSet::new()),
            announce_failed: std::sync::atomic::AtomicBool::new(false),
            replies_failed: std::sync::atomic::AtomicBool::new(false),
        });
        // An open breaker whose quarantine is over is half-open at that moment (its WARN
        // line, its count and the gauge then), whether or not a request or a reader of the
        // state comes.
        let store = Arc::downgrade(&inner);
        runtime.spawn(async move {
            loop {
                tokio::time::sleep(BREAKERS_LOOKED_AT_EVERY).await;
                let Some(inner) = store.upgrade() else { return };
                inner.refresh_breakers();
            }
        });
        Ok(Self {
            inner,
            runtime: Arc::new(runtime),
        })
    }

    /// Tells `hook` the keys of every charge given back once Redis applied the give-back (a
    /// decision answered after it gave up, on a `fail_closed` route): a denial of those keys
    /// read in between may have been made by that charge, and must not be repeated for its
    /// whole wait. Set once, at start.
    pub fn on_give_back(&self, hook: GiveBackHook) {
        let _ = self.inner.gave_back.set(hook);
    }

    /// The keys of a charge given back, to the hook.
    fn gave_back(&self, keys: &[String]) {
        if let Some(hook) = self.inner.gave_back.get() {
            hook(keys);
        }
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
        self.inner
            .batch_max
            .store(config.batch_max, Ordering::Relaxed);
        let connector = &self.inner.connector;
        connector.set_require_noeviction(config.require_noeviction);
        connector.set_key_prefix(&config.key_prefix);
        match (&self.inner.layout, &config.target) {
            (Layout::Single(_), RedisTarget::Sentinel(s)) => match &self.inner.sentinel {
                Some(watcher) => {
                    if watcher.retarget(s, &config.access) {
                        tracing::info!("redis.sentinel_* or the credentials changed; asking the sentinels again");
                    }
                    Ok(None)
                }
                None => Ok(Some("redis.sentinel_urls")),
            },
            (Layout::Single(_), RedisTarget::Single(_)) if self.inner.sentinel.is_some() => {
                Ok(Some("redis.url"))
            }
            (Layout::Cluster(_), RedisTarget::Sentinel(_)) => Ok(Some("redis.sentinel_urls")),
            (Layout::Single(link), RedisTarget::Single(url)) => {
                let current = link.target.load();
                if current.url != *url || current.access != config.access {
                    link.move_to(Target::new(url, &config.access)?);
                    // Said as what changed: a CA file rewritten is no new URL.
                    let (was, now) = (&current.access, &config.access);
                    let changed: Vec<&str> = [
                        ("the url", current.url != *url),
                        (
                            "the credentials",
                            was.username != now.username || was.password != now.password,
                        ),
                        ("the TLS settings or files", was.tls != now.tls),
                    ]
                    .into_iter()
                    .filter_map(|(what, changed)| changed.then_some(what))
                    .collect();
                    let changed = match changed.is_empty() {
                        true => "the connection settings".to_owned(),
                        false => changed.join(", "),
                    };
                    tracing::info!(%changed, "redis connection settings changed; reconnecting");
                }
                Ok(None)
            }
            (Layout::Cluster(cluster), RedisTarget::Cluster(seeds)) => {
                if *cluster.seeds() != *seeds || *cluster.access() != config.access {
                    tracing::info!("redis.cluster_urls or their credentials changed; discovering the cluster anew");
                    cluster.reseed(connector, seeds.clone(), config.access.clone());
                }
                Ok(None)
            }
            (Layout::Single(_), RedisTarget::Cluster(_)) => Ok(Some("redis.cluster_urls")),
            (Layout::Cluster(_), RedisTarget::Single(_)) => Ok(Some("redis.url")),
        }
    }

    /// A reload changes the breakers' thresholds; their states carry on.
    pub fn reconfigure_breakers(&self, config: BreakerConfig) {
        self.inner.connector.breakers().reconfigure(config);
        let links = match &self.inner.layout {
            Layout::Single(link) => vec![Arc::clone(link)],
            Layout::Cluster(cluster) => cluster.links(),
        };
        for link in links {
            link.breaker.reconfigure(config);
        }
        if let Layout::Cluster(cluster) = &self.inner.layout {
            cluster.mapless.reconfigure(config);
        }
    }

    /// The budget of one evaluation (`[redis] timeout_ms`).
    pub fn budget(&self) -> Duration {
        Duration::from_micros(self.inner.budget_us.load(Ordering::Relaxed))
    }

    /// How long to wait for something that must be over within `left` of the budget: a
    /// little less, as tokio's timer fires up to a tick late.
    pub fn timer_within(left: Duration) -> Duration {
        eval::timer_for(left)
    }

    /// `[redis] batch_max`.
    fn batch_max(&self) -> usize {
        self.inner.batch_max.load(Ordering::Relaxed)
    }

    fn set_budget(&self, budget: Duration) {
        self.inner
            .budget_us
            .store(budget.as_micros() as u64, Ordering::Relaxed);
    }

    /// Runs the limiter script `kind` for `key` on the node that owns it, through that node's
    /// breaker, within the budget. Never waits longer than the budget; never fails: a failure
    /// is the [`Degradation`] the decision table reads.
    pub async fn evaluate(
        &self,
        kind: ScriptKind,
        key: &str,
        args: [u64; 3],
        if_late: IfLate,
    ) -> Evaluation {
        let call = Call {
            kind,
            keys: &[key],
            args: &args,
            within: None,
            deadline_us: 0,
            compensation: false,
            if_late,
            across: false,
        };
        let evaluation = self.evaluate_call(call, ScriptReply::parse).await;
        evaluation.unwrap_or_else(|| self.unasked())
    }

    /// Runs the several-limits script (`lua/limits_multi.lua`) over `keys`, which must share
    /// one Redis Cluster slot, as [`Store::evaluate`] does: one `EVALSHA`, one answer per key,
    /// within `within` when it is less than the budget (what a decision's first call left).
    pub async fn evaluate_limits(
        &self,
        keys: &[&str],
        args: &[u64],
        within: Option<Duration>,
        if_late: IfLate,
    ) -> Evaluation<Vec<ScriptReply>> {
        let evaluation = self.limits_call(keys, args, (within, false, false), if_late);
        evaluation.await.unwrap_or_else(|| self.unasked())
    }

    /// [`Store::evaluate_limits`] of a call Redis applies whenever it runs it, past the
    /// budget too (a refund, which must not be lost to a stall), sent whatever the node's
    /// breaker says.
    pub async fn evaluate_limits_late(
        &self,
        keys: &[&str],
        args: &[u64],
    ) -> Evaluation<Vec<ScriptReply>> {
        let evaluation = self.limits_call(keys, args, (None, true, false), IfLate::Stands);
        evaluation.await.unwrap_or_else(|| self.unasked())
    }

    /// A call of the several-limits script: `within`, `compensation` and `across` as
    /// [`Call`] has them; `None` only for a call across slots that must be split.
    async fn limits_call(
        &self,
        keys: &[&str],
        args: &[u64],
        (within, compensation, across): (Option<Duration>, bool, bool),
        if_late: IfLate,
    ) -> Option<Evaluation<Vec<ScriptReply>>> {
        let call = Call {
            kind: ScriptKind::Limits,
            keys,
            args,
            within,
            deadline_us: 0,
            compensation,
            if_late,
            across,
        };
        self.evaluate_call(call, |reply| ScriptReply::parse_many(reply, keys.len()))
            .await
    }

    /// [`Store::evaluate_limits`] of keys that lie in several slots of one Redis Cluster
    /// primary ([`Store::one_node`]): decided in one `EVALSHA`, that node's batch, whose
    /// script may touch every slot of its node. `None` when it cannot go that way after all
    /// (the node now sends its decisions one by one, the call would be its breaker's probe,
    /// or a key's slot has moved): nothing was written or counted, and the caller decides the
    /// keys slot by slot.
    pub async fn evaluate_limits_across(
        &self,
        keys: &[&str],
        args: &[u64],
        within: Duration,
        if_late: IfLate,
    ) -> Option<Evaluation<Vec<ScriptReply>>> {
        self.limits_call(keys, args, (Some(within), false, true), if_late)
            .await
    }

    /// Behind Sentinel (as the store was made: a reload cannot change it), the master's name
    /// and the address in use (`host:port`, once the sentinels named one).
    pub fn sentinel(&self) -> Option<(String, Option<String>)> {
        self.inner
            .sentinel
            .as_ref()
            .map(|s| (s.master_name(), s.master()))
    }

    /// Whether `keys` can be decided by one script call: always on one Redis; on a cluster
    /// when they share a slot.
    pub fn one_call(&self, keys: &[&str]) -> bool {
        match &self.inner.layout {
            Layout::Single(_) => true,
            Layout::Cluster(_) => keys.split_first().is_none_or(|(first, rest)| {
                let s = slot(first.as_bytes());
                rest.iter().all(|k| slot(k.as_bytes()) == s)
            }),
        }
    }

    /// Whether `keys` of several slots may be decided by one call all the same
    /// ([`Store::evaluate_limits_across`]): on a cluster, when one primary serves them all
    /// and takes its decisions in batches.
    pub fn one_node(&self, keys: &[&str]) -> bool {
        let Layout::Cluster(cluster) = &self.inner.layout else {
            return true;
        };
        let Some((first, rest)) = keys.split_first() else {
            return true;
        };
        cluster.link_for(first).is_some_and(|link| {
            self.batches_on(&link)
                && rest
                    .iter()
                    .all(|k| cluster.link_for(k).is_some_and(|l| Arc::ptr_eq(&l, &link)))
        })
    }

    /// A decision no node can be asked for: a cluster whose slot map is not known yet, or
    /// whose slot no primary serves. It fails at once as a connection error (and is counted
    /// as one); with no map, through the breaker that stands for the cluster meanwhile
    /// (`Cluster::mapless`, one failure per failed attempt to read the map): open, it
    /// short-circuits as one Redis's does, and its half-open probe fails at once. A
    /// `compensation` is no decision: it counts for no breaker.
    fn unlinked<T>(&self, compensation: bool) -> Evaluation<T> {
        if let Layout::Cluster(cluster) = &self.inner.layout {
            if cluster.has_no_map() && !compensation {
                match cluster.mapless.acquire() {
                    Err(short) => {
                        return Evaluation {
                            outcome: Err(Degradation::BreakerOpen {
                                retry_in: short.retry_in,
                            }),
                            breaker: self.breaker_state(),
                        }
                    }
                    Ok(permit) if permit.is_probe() => permit.failure(),
                    Ok(permit) => permit.nothing(),
                }
            }
        }
        self.count(StoreFailure::ConnectionError);
        self.unasked()
    }

    /// A call no node was asked: it fails at once, as a disconnected Redis does.
    fn unasked<T>(&self) -> Evaluation<T> {
        Evaluation {
            outcome: Err(Degradation::Store(StoreFailure::ConnectionError)),
            breaker: self.breaker_state(),
        }
    }

    /// The call's evaluation; `None` only for a call `across` slots that must be split
    /// ([`Failure::Split`]).
    async fn evaluate_call<T>(
        &self,
        call: Call<'_>,
        parse: impl FnOnce(&[u8]) -> Option<T>,
    ) -> Option<Evaluation<T>> {
        // No node to ask: a cluster whose slot map is not known yet, or whose slot no primary
        // serves.
        let Some(link) = self.link_for(call.keys[0]) else {
            return Some(self.unlinked(call.compensation));
        };
        let breaker = &link.breaker;
        // A compensation (giving back what a denied request was charged) is owed whatever the
        // breaker says, and is no decision: it goes out though the breaker is open, and its
        // outcome counts neither for nor against it.
        if call.compensation {
            let (outcome, _) = self.run(&link, call, false, parse).await;
            return Some(Evaluation {
                outcome: outcome.map_err(|f| Degradation::Store(f.cause())),
                breaker: breaker.state(),
            });
        }
        let permit = match breaker.acquire() {
            Ok(p) => p,
            Err(short) => {
                return Some(Evaluation {
                    outcome: Err(Degradation::BreakerOpen {
                        retry_in: short.retry_in,
                    }),
                    breaker: breaker.state(),
                })
            }
        };
        let probe = permit.is_probe();
        let (result, redirected) = self.run(&link, call, probe, parse).await;
        match (&result, redirected) {
            // The node a redirect named is in quarantine: its short-circuit, as though asked
            // first; the node asked answered.
            (Err(Failure::Quarantined(retry_in)), _) => {
                permit.success();
                return Some(Evaluation {
                    outcome: Err(Degradation::BreakerOpen {
                        retry_in: *retry_in,
                    }),
                    breaker: BreakerState::Open,
                });
            }
            // Went on to the node a `MOVED` or `ASK` named (a slot being moved, perhaps to a
            // node that is down, slow or refuses `ASKING`): its outcome there is that node's,
            // counted by its breaker; the node asked first answered (the redirect), and
            // every other key it owns keeps being decided.
            (outcome, Some(next)) => {
                permit.success();
                let failed = outcome.as_ref().err().copied();
                if failed == Some(Failure::NotConnected) {
                    next.link.failed_at_once();
                }
                let link = Arc::clone(&next.link);
                next.settle(failed);
                if link.breaker.state() == BreakerState::Open {
                    self.ask_refresh();
                }
            }
            (Ok(_), None) => permit.success(),
            (Err(Failure::Split), None) => {
                // Nothing decided: a probe goes to the next call.
                permit.charge(Failure::Split.charge(probe), Failure::Split.cause());
                return None;
            }
            (Err(failure), None) => {
                if *failure == Failure::NotConnected {
                    link.failed_at_once();
                }
                permit.charge(failure.charge(probe), failure.cause());
                // A cluster primary whose breaker opens may have handed its slots to a
                // replica (a `CLUSTER FAILOVER` pauses it long enough to time out): its
                // open breaker sends nothing that would say so (no `MOVED`), so the map
                // is read again now rather than at the next periodic refresh.
                if breaker.state() == BreakerState::Open {
                    self.ask_refresh();
                }
            }
        }
        Some(Evaluation {
            outcome: result.map_err(|f| Degradation::Store(f.cause())),
            breaker: breaker.state(),
        })
    }

    /// Runs the fleet heartbeat (off the request path); returns the live instance count and
    /// the fleet set's age (milliseconds).
    pub async fn heartbeat(
        &self,
        key: &str,
        instance: &str,
        ttl_ms: u64,
    ) -> Result<(u64, u64), StoreFailure> {
        let Some(conn) = self.link_for(key).and_then(|l| l.conn.load_full()) else {
            return Err(StoreFailure::ConnectionError);
        };
        let mut c = conn.redis();
        let mut invocation = self.inner.heartbeat.key(key);
        invocation.arg(instance).arg(ttl_ms);
        let call = invocation.invoke_async::<(u64, u64)>(&mut c);
        match tokio::time::timeout(Duration::from_millis(500), call).await {
            Err(_) => Err(StoreFailure::Timeout),
            Ok(Ok(n)) => Ok(n),
            Ok(Err(e)) => Err(StoreFailure::ConnectionError).inspect_err(|_| {
                tracing::debug!(error = %e, "fleet heartbeat failed");
            }),
        }
    }

    /// Reads `fields` of the hash at `key` and Redis `TIME` (in microseconds), in one round
    /// trip and without writing: what `/limits` shows of a bucket. Off the request path, with a
    /// timeout of its own.
    pub async fn read_fields(
        &self,
        key: &str,
        fields: &[&str],
    ) -> Result<(Vec<Option<i64>>, u64), StoreFailure> {
        let ((secs, micros), values) = self
            .admin_call::<((u64, u64), Vec<Option<String>>)>(key, "read a bucket", |asking| {
                let mut pipe = redis::pipe();
                pipe.cmd("TIME");
                // `ASKING` holds for the next command only: the one that reads the key.
                if asking {
                    pipe.cmd("ASKING").ignore();
                }
                pipe.cmd("HMGET").arg(key).arg(fields);
                pipe
            })
            .await?;
        let values = read_as_the_script_does(fields, values).map_err(|why| {
            // As a decision meets it (the script's arithmetic on it fails): not a bucket
            // never used, which would read full.
            tracing::warn!(
                key,
                error = %why,
                "admin: cannot read a bucket in redis; answered 503 (the key holds data the limiter cannot read: redis-cli DEL <key> starts it afresh)"
            );
            StoreFailure::ConnectionError
        })?;
        Ok((values, deadline::time_us(secs, micros)))
    }

    /// Deletes `keys` (all on one node: the keys of one identity); how many existed.
    pub async fn delete(&self, keys: &[String]) -> Result<u64, StoreFailure> {
        let Some(first) = keys.first() else {
            return Ok(0);
        };
        let (deleted,) = self
            .admin_call::<(u64,)>(first, "delete buckets", |asking| {
                let mut pipe = redis::pipe();
                if asking {
                    pipe.cmd("ASKING").ignore();
                }
                pipe.cmd("DEL").arg(keys);
                pipe
            })
            .await?;
        Ok(deleted)
    }

    /// One admin command on the node that serves `key` (`command(asking)` builds it), within
    /// [`ADMIN_TIMEOUT`], following a cluster's `MOVED` and `ASK` as decisions do (a slot
    /// being migrated is read and reset where it is). A failure is logged with its reason:
    /// the admin's 503 says only that Redis could not answer.
    async fn admin_call<T: redis::FromRedisValue>(
        &self,
        key: &str,
        what: &str,
        command: impl Fn(bool) -> redis::Pipeline,
    ) -> Result<T, StoreFailure> {
        let attempt = async {
            let mut link = self.link_for(key).map(Cow::into_owned);
            let mut asking = false;
            for _ in 0..=eval::MAX_REDIRECTS {
                let conn = link
                    .as_ref()
                    .and_then(|l| l.conn.load_full())
                    .ok_or_else(|| "not connected".to_owned())?;
                let mut c = conn.redis();
                let e = match command(asking).query_async::<T>(&mut c).await {
                    Ok(answer) => return Ok(answer),
                    Err(e) => eval::unpacked(e),
                };
                let (Some(redirect), Layout::Cluster(cluster)) =
                    (eval::redirect(&e), &self.inner.layout)
                else {
                    return Err(Said(&e).to_string());
                };
                let connector = &self.inner.connector;
                let next = match redirect.ask {
                    true => cluster.asked(connector, &redirect.addr),
                    false => cluster.moved(connector, redirect.slot, &redirect.addr),
                }
                .ok_or_else(|| format!("redirected to {}, which cannot be used", redirect.addr))?;
                if !next.reached().await {
                    return Err(format!("redirected to {}, which is down", redirect.addr));
                }
                link = Some(next);
                asking = redirect.ask;
            }
            Err("redirected too many times".to_owned())
        };
        let failure = match tokio::time::timeout(ADMIN_TIMEOUT, attempt).await {
            Ok(Ok(answer)) => return Ok(answer),
            Ok(Err(reason)) => (StoreFailure::ConnectionError, reason),
            Err(_) => (
                StoreFailure::Timeout,
                format!("no answer within {} ms", ADMIN_TIMEOUT.as_millis()),
            ),
        };
        tracing::warn!(
            key_slot = slot(key.as_bytes()),
            error = %failure.1,
            "admin: cannot {what} in redis; answered 503"
        );
        Err(failure.0)
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
        let Layout::Cluster(_) = &self.inner.layout else {
            return Vec::new();
        };
        let mut nodes: Vec<NodeStatus> = self
            .links()
            .iter()
            .map(|l| NodeStatus {
                node: l.node(),
                connected: l.is_connected(),
                breaker: l.breaker.state(),
                eviction_policy: l.eviction_policy.load_full(),
            })
            .collect();
        nodes.sort_by(|a, b| a.node.cmp(&b.node));
        nodes
    }

    /// The process's breaker state: with one Redis its breaker's; in a cluster open when any
    /// primary's is open, else half_open when any is, else closed.
    /// When the breaker of the node that holds `key` would short-circuit a call now: the
    /// quarantine left and its state.
    pub fn short_circuited(&self, key: &str) -> Option<(Duration, BreakerState)> {
        let link = self.link_for(key)?;
        let left = link.breaker.short_circuits()?;
        Some((left, link.breaker.state()))
    }

    pub fn breaker_state(&self) -> BreakerState {
        self.inner.connector.breakers().state()
    }

    /// Moves every breaker whose quarantine is over to half-open
    /// ([`crate::decision::breaker::Breaker::refresh`]), for a reader of the state (`/readyz`,
    /// `/metrics`) between two of the store's own looks ([`BREAKERS_LOOKED_AT_EVERY`]).
    pub fn refresh_breakers(&self) {
        self.inner.refresh_breakers();
    }

    /// In a cluster, asks for a fresh slot map now (a node said a key's slot is not its own).
    fn ask_refresh(&self) {
        if let Layout::Cluster(cluster) = &self.inner.layout {
            cluster.ask_refresh();
        }
    }

    /// Every link: the one Redis, or every primary of the map.
    fn links(&self) -> Vec<Arc<Link>> {
        match &self.inner.layout {
            Layout::Single(link) => vec![Arc::clone(link)],
            Layout::Cluster(cluster) => cluster.primaries(),
        }
    }

    /// The link that decides `key`: the one Redis, or the primary owning its slot. `None`
    /// while a cluster's map is unknown or no primary serves the slot.
    /// (Borrowed with one Redis: no reference count to touch per request.)
    fn link_for(&self, key: &str) -> Option<Cow<'_, Arc<Link>>> {
        match &self.inner.layout {
            Layout::Single(link) => Some(Cow::Borrowed(link)),
            Layout::Cluster(cluster) => cluster.link_for(key).map(Cow::Owned),
        }
    }
}

/// 2^53: the scripts refuse a bucket's number at or past it (lua/limits.lua, `EXACT`).
const EXACT: u64 = 1 << 53;

/// A bucket's fields as the scripts read them: none when its first field is absent (a bucket
/// never used, or expired), else every field a number below 2^53 as Lua's `tonumber` takes
/// one (an integer, a decimal such as `5.0` or `1e3`, or hexadecimal as C's `strtod` reads
/// it, `0x10` or `0x1p4`; spaces around it allowed);
/// why not, naming the field.
fn read_as_the_script_does(
    fields: &[&str],
    values: Vec<Option<String>>,
) -> Result<Vec<Option<i64>>, String> {
    if values.first().is_none_or(Option::is_none) {
        return Ok(vec![None; values.len()]);
    }
    (fields.iter().zip(values))
        .map(|(field, value)| match value {
            None => Err(format!("field {field} is missing")),
            Some(text) => {
                // C's `isspace`, not Unicode's.
                let text = text.trim_matches([' ', '\t', '\n', '\x0b', '\x0c', '\r']);
                let n = match text.parse::<i64>() {
                    Ok(n) => Some(n),
                    Err(_) => match hex_number(text).or_else(|| text.parse::<f64>().ok()) {
                        Some(x) if x.is_finite() && x.abs() < EXACT as f64 => Some(x as i64),
                        _ => None,
                    },
                };
                // Past 2^53, `inf` and `nan`: the scripts refuse them (they would loop).
                match n.filter(|n| n.unsigned_abs() < EXACT) {
                    Some(n) => Ok(Some(n)),
                    None => Err(format!("field {field} is not a number the limiter wrote")),
                }
            }
        })
        .collect()
}

/// A hexadecimal number as C's `strtod` reads it, which Lua's `tonumber` uses: a sign, `0x`,
/// hex digits with an optional point and an optional binary exponent (`-0x10`, `0x1.8p1` is
/// 3, `0x1p-2` is 0.25). The first 32 significant digits are kept (128 bits, rounded once to
/// a double), an exponent past any double's is saturated, as `strtod` rounds and saturates.
fn hex_number(text: &str) -> Option<f64> {
    let (negative, rest) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    let rest = (rest.strip_prefix("0x")).or_else(|| rest.strip_prefix("0X"))?;
    let (mantissa, exponent) = match rest.split_once(['p', 'P']) {
        Some((m, e)) => (m, saturated_exponent(e)?),
        None => (rest, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    let (mut value, mut kept, mut shift) = (0u128, 0u32, 0i64);
    for (i, digit) in whole.chars().chain(fraction.chars()).enumerate() {
        let d = digit.to_digit(16)?;
        let in_fraction = i >= whole.len();
        if kept < 32 {
            value = value * 16 + u128::from(d);
            // Leading zeros are no significant digits.
            kept += u32::from(value != 0);
            shift -= 4 * i64::from(in_fraction);
        } else if !in_fraction {
            shift += 4;
        }
    }
    let scale = (shift + exponent).clamp(-2_000, 2_000) as i32;
    let x = (value as f64) * 2f64.powi(scale);
    Some(if negative { -x } else { x })
}

/// A binary exponent's decimal digits with their sign, saturated far past any double's.
fn saturated_exponent(text: &str) -> Option<i64> {
    let (negative, digits) = match text.as_bytes().first()? {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n = digits
        .bytes()
        .fold(0i64, |n, b| (n * 10 + i64::from(b - b'0')).min(1_000_000));
    Some(if negative { -n } else { n })
}

/// A Redis error as logs say it: an error reply as Redis writes it and a batch's reply gives
/// it, `CODE detail`, so that one reason reads the same whichever call met it (redis-rs
/// spells it `"CODE": detail`); any other error as redis-rs says it.
struct Said<'a>(&'a redis::RedisError);

impl std::fmt::Display for Said<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.0.code(), self.0.detail()) {
            (Some(code), Some(detail)) => write!(f, "{code} {detail}"),
            _ => self.0.fmt(f),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::read_as_the_script_does;

    #[test]
    fn a_bucket_is_read_whole_or_not_at_all() {
        let read = |values: &[Option<&str>]| {
            read_as_the_script_does(
                &["t", "f", "ts"],
                values.iter().map(|v| v.map(str::to_owned)).collect(),
            )
        };
        assert_eq!(read(&[None, None, None]), Ok(vec![None, None, None]));
        assert_eq!(
            read(&[Some("-5"), Some("0"), Some("17")]),
            Ok(vec![Some(-5), Some(0), Some(17)])
        );
        assert_eq!(
            read(&[None, Some("x"), None]),
            Ok(vec![None, None, None]),
            "without its first field the scripts take a bucket for new"
        );
        assert_eq!(
            read(&[Some("12x"), Some("0"), Some("1")]),
            Err("field t is not a number the limiter wrote".into())
        );
        assert_eq!(
            read(&[Some("1"), Some("1.5e"), Some("1")]),
            Err("field f is not a number the limiter wrote".into())
        );
        assert_eq!(
            read(&[Some("1"), Some("0"), None]),
            Err("field ts is missing".into())
        );
        // What Lua's `tonumber` reads, the scripts read too.
        assert_eq!(
            read(&[Some("5000000.0"), Some(" 3"), Some("1e3")]),
            Ok(vec![Some(5_000_000), Some(3), Some(1000)])
        );
        assert_eq!(
            read(&[Some("0x10"), Some("0"), Some("1")]),
            Ok(vec![Some(16), Some(0), Some(1)])
        );
        // Hexadecimal as C's `strtod` reads it (each value as Redis 7's Lua read it).
        for (text, n) in [
            ("0x1p4", 16),
            ("-0x10", -16),
            ("0x1.8p1", 3),
            (" 0X1P+4 ", 16),
            ("+0x10", 16),
            ("0x.8p1", 1),
            ("0x1p-2", 0),
        ] {
            assert_eq!(
                read(&[Some(text), Some("0"), Some("1")]),
                Ok(vec![Some(n), Some(0), Some(1)]),
                "{text}"
            );
        }
        // Past what a double holds, as `strtod` reads them: many digits, a huge exponent.
        let long = format!("0x1.{}", "0".repeat(256));
        let many = format!("0x1{}p-1024", "0".repeat(256));
        for (text, n) in [
            (long.as_str(), 1),
            (many.as_str(), 1),
            ("0x1p-99999999999", 0),
            ("0x0000000000000000000000000000000000001p4", 16),
            ("0xce2466fe4a1.16464e1p9", 7_252_983_746_740_781),
        ] {
            assert_eq!(
                read(&[Some(text), Some("0"), Some("1")]),
                Ok(vec![Some(n), Some(0), Some(1)]),
                "{text}"
            );
        }
        for unread in [
            "0x",
            "0x1p",
            "0xg",
            "0x1.2.3",
            "0x1p2.5",
            "--0x1",
            "16\u{a0}",
            "0x1p99999999999",
        ] {
            assert_eq!(
                read(&[Some(unread), Some("0"), Some("1")]),
                Err("field t is not a number the limiter wrote".into()),
                "{unread}"
            );
        }
        for endless in ["inf", "-inf", "nan", "-1e300", "9007199254740992"] {
            assert_eq!(
                read(&[Some(endless), Some("0"), Some("1")]),
                Err("field t is not a number the limiter wrote".into())
            );
        }
    }
}
