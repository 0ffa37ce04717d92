//! One evaluation of a limiter script, inside one budget: `EVALSHA`; on `NOSCRIPT` one
//! `SCRIPT LOAD` and one retry; `MOVED` / `ASK` followed to the node they name; every
//! failure classified as timeout, connection error or NOSCRIPT.
//!
//! The pure parts, [`classify`] (what a Redis error means) and [`redirect`] (where a redirect
//! points), are apart from the loop that acts on them, and tested on their own.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

use super::connect::{self, is_transport};
use super::deadline;
use super::link::{Conn, Link};
use super::script::{Script, ScriptKind};
use super::{Layout, Said, Store};
use crate::decision::{Failure, StoreFailure};

/// Tokio's timers tick in whole milliseconds: a timer fires on the first tick after its
/// deadline, and then waits for a worker to run it, so a timer set to the budget ends a
/// millisecond or two beyond it. The evaluation's timer is set this much earlier: 2 ms, or a
/// quarter of a smaller budget.
pub(super) fn timer_for(budget: Duration) -> Duration {
    budget - (budget / 4).min(Duration::from_millis(2))
}

/// How long a compensation (a refund) is waited for, off the request path: queued behind a
/// call Redis answers late, it is still sent, and applied, when that answer comes.
pub(super) const COMPENSATION_WAIT: Duration = Duration::from_secs(5);

/// Redirects one evaluation follows before it gives up (a slot moving twice in one budget
/// is already unusual).
pub(super) const MAX_REDIRECTS: usize = 3;

/// Which of a decision's `keys` its error was met on (from 0), and the error without what
/// says so: the scripts of several limits end such an error with " (key i)", i from 1
/// (lua/limits.lua, `error_text`); the first key when it does not.
pub(super) fn key_of_error(error: &str, keys: usize) -> (&str, usize) {
    let named = error.strip_suffix(')').and_then(|e| {
        let (rest, i) = e.rsplit_once(" (key ")?;
        let i: usize = i.parse().ok()?;
        (1..=keys).contains(&i).then(|| (rest, i - 1))
    });
    named.unwrap_or((error, 0))
}

/// The failure a Redis error stands for (`decision::failure` says what each one means).
pub(super) fn classify(e: &RedisError) -> Failure {
    if e.is_timeout() {
        Failure::Timeout
    } else if is_transport(e) {
        Failure::ConnectionLost
    } else if let (ErrorKind::Server(_) | ErrorKind::Extension, Some(code)) = (e.kind(), e.code()) {
        Failure::of_reply(code, e.detail().unwrap_or(""))
    } else {
        // Parse, unexpected return type, client-side: redis-rs could not use what it got.
        Failure::Rejected
    }
}

/// Where a `MOVED` or `ASK` sends the evaluation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Redirect {
    pub(super) slot: u16,
    pub(super) addr: String,
    /// `ASK`: this one request goes there (a slot being migrated); `MOVED`: the slot is
    /// there for good.
    pub(super) ask: bool,
}

/// The redirect an error carries, if it is one.
pub(super) fn redirect(e: &RedisError) -> Option<Redirect> {
    let (addr, slot) = e.redirect_node()?;
    Some(Redirect {
        slot,
        addr: addr.to_owned(),
        ask: e.kind() == ErrorKind::Server(ServerErrorKind::Ask),
    })
}

/// One script call: which script, its keys (all in one slot, unless `across`) and its
/// arguments.
#[derive(Clone, Copy)]
pub(super) struct Call<'a> {
    pub(super) kind: ScriptKind,
    pub(super) keys: &'a [&'a str],
    pub(super) args: &'a [u64],
    /// What is left of the request's budget, when less than a whole one (the second call of
    /// a decision).
    pub(super) within: Option<Duration>,
    /// When the gateway stops waiting for the answer ([`deadline::mono_us`]); 0: none yet
    /// (set by the evaluation), or none at all when `compensation`.
    pub(super) deadline_us: u64,
    /// A compensation (a refund of what a denied request was charged): applied whenever
    /// Redis runs it, past the budget too (it has no deadline), and sent whatever the node's
    /// breaker says, counting neither for nor against it.
    pub(super) compensation: bool,
    /// What becomes of an admission Redis made but whose answer came after the decision
    /// gave up ([`super::IfLate`]).
    pub(super) if_late: super::IfLate,
    /// Its keys lie in several slots of one cluster node: it can only be decided in that
    /// node's batch, never on its own ([`Failure::Split`]).
    pub(super) across: bool,
}

/// Where one evaluation stands after asking one node.
pub(super) enum Step {
    Reply(Reply),
    Failed(Failure),
    Redirect(Redirect),
}

/// A script's answer: a call's own, or one decision's part of a batch's answer.
pub(super) enum Reply {
    Value(Value),
    Part(Arc<Vec<u8>>, std::ops::Range<usize>),
}

impl Reply {
    /// The answer's bytes, when it is the one bulk string every script answers.
    fn bytes(&self) -> Option<&[u8]> {
        match self {
            Reply::Value(Value::BulkString(bytes)) => Some(bytes),
            Reply::Value(_) => None,
            Reply::Part(bytes, range) => bytes.get(range.clone()),
        }
    }
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.bytes() {
            Some(bytes) => write!(f, "{:?}", String::from_utf8_lossy(bytes)),
            None => match self {
                Reply::Value(v) => write!(f, "{v:?}"),
                Reply::Part(..) => write!(f, "(a part out of range)"),
            },
        }
    }
}

impl Store {
    /// Runs a limiter script for `keys` (one slot) on `link` within the budget, and reads
    /// its answer with `parse`.
    ///
    /// `probe`: this is the link's breaker's half-open probe; after a timeout whose call is
    /// still unanswered it opens a fresh connection first, inside the same budget, so a peer
    /// that vanished silently (or moved behind its DNS name) is left behind.
    ///
    /// Beside the answer, the node a `MOVED` or `ASK` sent the call on to, when it went on,
    /// with its breaker's permit: a failure there is that node's, not `link`'s (which
    /// answered, with the redirect).
    pub(super) async fn run<T>(
        &self,
        link: &Arc<Link>,
        call: Call<'_>,
        probe: bool,
        parse: impl FnOnce(&[u8]) -> Option<T>,
    ) -> (Result<T, Failure>, Option<Redirected>) {
        let connector = &self.inner.connector;
        if connector.wants_proxy_runtime() {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                if connector.learn_proxy_runtime(handle) {
                    for link in self.links() {
                        link.wake.notify_one();
                    }
                }
            }
        }
        // The ACL user may not run what the scripts need: sent, the decision would fail, and
        // after its first write (a bucket charged). It fails here, as an `OOM` would.
        if link.lacks_commands.load(Ordering::Relaxed) {
            let refused = link.refused.load_full();
            let commands = refused.as_deref().map_or("", String::as_str);
            link.log_unavailable(&format_args!("the redis user may not run {commands}"));
            self.count(Failure::Unavailable.cause());
            return (Err(Failure::Unavailable), None);
        }
        let script = self.inner.scripts.get(call.kind);
        let started = Instant::now();
        let (result, redirected) = self.eval(link, script, call, probe).await;
        if let Err(Failure::Split) = result {
            // Nothing was asked of Redis: its state and metrics are left as they were.
            return (Err(Failure::Split), None);
        }
        if let Err(Failure::Quarantined(left)) = result {
            // The node asked answered at once (the redirect), the next was not asked.
            return (Err(Failure::Quarantined(left)), redirected);
        }
        // The node that failed, when the call failed: the last one asked.
        let link = redirected.as_ref().map_or(link, |r| &r.link);
        let timed_out = matches!(result, Err(Failure::Timeout));
        link.suspect.store(timed_out, Ordering::Relaxed);
        if timed_out {
            self.replace_if_silent(link);
        }
        // Loaded first: a store on every decision would bounce the line between workers.
        if !timed_out && link.probe_kept.load(Ordering::Relaxed) {
            link.probe_kept.store(false, Ordering::Relaxed);
        }
        // How long Redis took to answer this decision (its batch's call, a NOSCRIPT reload
        // included) or ran out of budget: a decision that never reached a connection says
        // nothing about Redis's speed.
        if !matches!(result, Err(Failure::NotConnected)) {
            self.inner
                .redis_duration
                .observe(started.elapsed().as_secs_f64());
        }
        let reply = result.and_then(|v| {
            v.bytes().and_then(parse).ok_or_else(|| {
                tracing::error!(reply = ?v, "a limiter script answered an unexpected shape: this is a bug");
                Failure::Rejected
            })
        });
        if let Err(failure) = &reply {
            self.count(failure.cause());
        }
        (reply, redirected)
    }

    pub(super) fn count(&self, failure: StoreFailure) {
        let e = &self.inner.errors;
        match failure {
            StoreFailure::Timeout => e.timeout.inc(),
            StoreFailure::ConnectionError => e.connection_error.inc(),
            StoreFailure::Noscript => e.noscript.inc(),
        }
    }

    /// The connection to use: the link's; for a probe after a timeout whose call is still
    /// unanswered, a new one; for a probe of a node not connected, the one the connector
    /// opens now.
    async fn connection(&self, link: &Arc<Link>, probe: bool) -> Result<Arc<Conn>, Failure> {
        if probe && !link.is_connected() {
            // The quarantine is over and the node is not connected: the connector tries now
            // rather than at the end of its backoff step, and the probe waits for that attempt
            // within its budget, so that a Redis back in the meantime closes the breaker.
            link.try_now().await;
            return link.conn.load_full().ok_or(Failure::NotConnected);
        }
        let current = link.conn.load_full();
        if !(probe && link.suspect.load(Ordering::Relaxed)) {
            return current.ok_or(Failure::NotConnected);
        }
        // A node whose batched calls have all been answered since, late, is slow, not gone:
        // the first probe after it asks the connections it has, and needs only Redis's
        // answer within its budget. (Made within the budget, a fresh connection costs two
        // round trips more: a Redis whose round trip is a third of the budget would never be
        // probed back.) Should that probe time out too, the next one opens a fresh
        // connection, as after a call still unanswered (a peer gone without a word). Where
        // decisions do not go in batches nothing says what is unanswered, so probes take
        // turns: the first asks the connection the node has, the next (if that one timed out
        // too) a fresh one.
        let answered =
            |c: &Arc<Conn>| !self.batches_on(link) || !c.wire.lock().batches.call_in_flight();
        if let Some(conn) = current.filter(|c| answered(c)) {
            if !link.probe_kept.swap(true, Ordering::Relaxed) {
                return Ok(conn);
            }
        }
        let target = link.target.load_full();
        let watcher = self.inner.connector.watcher();
        let (fresh, wire) = connect::open_both(&target.dial, true, watcher)
            .await
            .map_err(|e| {
                tracing::debug!(error = %e, "the probe could not open a fresh redis connection");
                Failure::NotConnected
            })?;
        link.install(fresh, wire, self.inner.connector.on_proxy_runtime());
        link.probe_kept.store(false, Ordering::Relaxed);
        tracing::info!(node = %target.node, "the breaker probe replaced a redis connection that had timed out");
        link.conn.load_full().ok_or(Failure::NotConnected)
    }

    /// The evaluation, redirects included, inside one budget; and the node the last redirect
    /// sent it to, if any.
    async fn eval(
        &self,
        link: &Arc<Link>,
        script: &Script,
        call: Call<'_>,
        probe: bool,
    ) -> (Result<Reply, Failure>, Option<Redirected>) {
        // A compensation is waited for longer: dropped, it would leave the queue unsent.
        let budget = match call.compensation {
            true => COMPENSATION_WAIT,
            false => call.within.map_or(self.budget(), |w| w.min(self.budget())),
        };
        let timer = timer_for(budget);
        // Refused by the script once the gateway no longer waits for its answer, unless it
        // applies late.
        let call = Call {
            deadline_us: match call.compensation {
                true => 0,
                false => deadline::mono_us() + timer.as_micros() as u64,
            },
            ..call
        };
        // Where a redirect sent the call, kept past the budget's end (which drops `attempt`).
        let redirected: std::sync::Mutex<Option<Redirected>> = std::sync::Mutex::new(None);
        let attempt = async {
            // Owned only after a redirect: the common case touches no reference count.
            let mut link: Cow<'_, Arc<Link>> = Cow::Borrowed(link);
            let mut asking = false;
            for hop in 0..=MAX_REDIRECTS {
                // The first ask takes its turn on the node's connection (batch.rs); a probe
                // goes alone, as does a decision a batch could not carry.
                let batched = match probe && hop == 0 {
                    false if hop == 0 => self.in_turn(&link, call).await,
                    _ => None,
                };
                let step = match batched {
                    Some(step) => step,
                    // On its own, Redis would refuse its keys (`CROSSSLOT`).
                    None if call.across => return Err(Failure::Split),
                    // A decision sent alone (a probe, a redirect's, one a batch could not
                    // carry) answered late would keep its charge (its answer unread): it is
                    // read, and given back, as a batch's late answer is.
                    None if call.if_late == super::IfLate::GivenBack && !call.compensation => {
                        self.alone_reading_late(&link, call, (probe && hop == 0, asking))
                            .await
                    }
                    None => {
                        self.eval_on(&link, script, call, probe && hop == 0, asking)
                            .await
                    }
                };
                let redirect = match step {
                    Step::Reply(v) => return Ok(v),
                    Step::Failed(f) => return Err(f),
                    Step::Redirect(r) => r,
                };
                let Layout::Cluster(cluster) = &self.inner.layout else {
                    tracing::error!(addr = %redirect.addr, "redis answered MOVED/ASK but redis.url names one Redis: use redis.cluster_urls for a cluster");
                    return Err(Failure::Unavailable);
                };
                let connector = &self.inner.connector;
                let next = if redirect.ask {
                    cluster.asked(connector, &redirect.addr)
                } else {
                    cluster.moved(connector, redirect.slot, &redirect.addr)
                };
                let Some(next) = next else {
                    tracing::warn!(addr = %redirect.addr, "redis redirected to an address that cannot be used");
                    return Err(Failure::Unavailable);
                };
                // That node's breaker lets the call through, or not: open, the node is not
                // asked, and the budget is not spent waiting for a node known to fail (a slot
                // moving to a stalled one, say); half-open, the call may be its probe. A
                // compensation is owed whatever a breaker says, and counts for none.
                let went_on = match call.compensation {
                    true => Redirected::uncounted(Arc::clone(&next)),
                    false => match next.breaker.acquire() {
                        Ok(permit) => Redirected::new(Arc::clone(&next), permit.detach()),
                        Err(short) => {
                            // A node an earlier redirect named answered (with this one).
                            let before =
                                redirected.lock().unwrap_or_else(|p| p.into_inner()).take();
                            if let Some(before) = before {
                                before.settle(None);
                            }
                            return Err(Failure::Quarantined(short.retry_in));
                        }
                    },
                };
                let went_on_probes = went_on.probe;
                let before = redirected
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .replace(went_on);
                // A node an earlier redirect named answered (with this one).
                if let Some(before) = before {
                    before.settle(None);
                }
                // A node first named by this redirect connects now; the budget bounds the
                // wait. One known down fails a decision at once, as any node down does (its
                // probe first wakes the connector, as a first node's probe does); a give-back
                // waits for it, as it waits for any node.
                if call.compensation {
                    next.connected().await;
                } else {
                    if went_on_probes && !next.is_connected() {
                        next.try_now().await;
                    }
                    if !next.reached().await {
                        return Err(Failure::NotConnected);
                    }
                }
                link = Cow::Owned(next);
                asking = redirect.ask;
            }
            // A slot whose nodes redirect in a loop (a migration's destination demoted to a
            // replica, which sends it back) fails every decision of it: said once in 10 s.
            let say = match &self.inner.layout {
                Layout::Cluster(cluster) => {
                    super::deadline::once_every(&cluster.redirects_logged, 10)
                }
                _ => true,
            };
            if say {
                tracing::warn!(
                    key_slot = super::slot(call.keys[0].as_bytes()),
                    "redis cluster redirected too many times"
                );
            }
            Err(Failure::Unavailable)
        };
        let result = tokio::time::timeout(timer, attempt)
            .await
            .unwrap_or(Err(Failure::Timeout));
        let redirected = redirected.into_inner().unwrap_or_else(|p| p.into_inner());
        (result, redirected)
    }

    /// A `fail_closed` decision sent alone (a breaker's probe, `batch_max = 1`, a node that
    /// refused the batch script, a far node's decision that would wait too long for the
    /// batch, a redirect), as [`Store::eval_on`] asks it, but able to outlive the decision:
    /// when the decision gives up before the answer (its budget spent, its request gone), a
    /// task takes the call over, reads the answer up to [`COMPENSATION_WAIT`] past the
    /// decision's deadline, and gives back what an admission charged (the request was
    /// refused by its fail mode). What it costs a decision: a copy of its keys and arguments
    /// and one allocation; the task only for those that give up.
    fn alone_reading_late(
        &self,
        link: &Arc<Link>,
        call: Call<'_>,
        (probe, asking): (bool, bool),
    ) -> ReadLate {
        let (store, link) = (self.clone(), Arc::clone(link));
        let keys: Vec<String> = call.keys.iter().map(|k| (*k).to_owned()).collect();
        let (args, queued) = (call.args.to_vec(), super::batch::as_queued(&call));
        let (kind, deadline_us, within) = (call.kind, call.deadline_us, call.within);
        let asked = Box::pin(async move {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let call = Call {
                kind,
                keys: &refs,
                args: &args,
                within,
                deadline_us,
                compensation: false,
                if_late: super::IfLate::GivenBack,
                across: false,
            };
            let script = store.inner.scripts.get(kind);
            let step = store.eval_on(&link, script, call, probe, asking).await;
            drop(refs);
            (
                step,
                Late {
                    store,
                    keys,
                    queued,
                },
            )
        });
        ReadLate {
            asked: Some(asked),
            deadline_us,
        }
    }

    /// One node's answer: EVALSHA, and on NOSCRIPT one SCRIPT LOAD and one retry.
    pub(super) async fn eval_on(
        &self,
        link: &Arc<Link>,
        script: &Script,
        call: Call<'_>,
        probe: bool,
        asking: bool,
    ) -> Step {
        let key = call.keys[0];
        let mut conn = match self.connection(link, probe).await {
            Ok(c) => c,
            Err(f) => return Step::Failed(f),
        };
        // Its checks' socket (where a decision alone goes) is being made again
        // (`Link::checks_closed`): a decision fails at once, as while a connection is made
        // again, and counts nothing; a probe waits for it within its budget, so that a
        // quarantine is not prolonged by a socket Redis closed for idleness.
        if conn.checks_lost.load(Ordering::Acquire) {
            if !probe {
                return Step::Failed(Failure::NotConnected);
            }
            link.checks_again(&conn).await;
            conn = match link.conn.load_full() {
                Some(c) if !c.checks_lost.load(Ordering::Acquire) => c,
                _ => return Step::Failed(Failure::NotConnected),
            };
        }
        let mut c = conn.redis();
        // A loss of the connection meanwhile is one under a decision (a WARN, not an INFO).
        let _deciding = conn.deciding();
        // Before the call: its answer's `now` less this bounds the node's clock offset from
        // above (a retry after NOSCRIPT is sent later still).
        let sent_us = deadline::mono_us();
        let step = |r: redis::RedisResult<Value>| match r {
            Ok(v) => {
                if let Value::BulkString(bytes) = &v {
                    link.clock.note(bytes, sent_us);
                }
                if self.batches_on(link) {
                    conn.wire.lock().batches.note_round_trip(sent_us);
                }
                Step::Reply(Reply::Value(v))
            }
            Err(e) => match redirect(&e) {
                Some(r) => Step::Redirect(r),
                None => {
                    if e.code() == Some("EXPIRED") {
                        let now = e.detail().and_then(|d| d.split(' ').next()?.parse().ok());
                        if let Some(now) = now {
                            link.clock.expired(now, sent_us);
                        }
                    }
                    // The key the error was met on, for the log: a script of several
                    // limits names it.
                    let at = e.detail().map_or(0, |d| key_of_error(d, call.keys.len()).1);
                    Step::Failed(self.failed(link, &conn, call.keys[at], &e))
                }
            },
        };
        let deadline = link.clock.deadline(call.deadline_us, sent_us);
        match evalsha(&mut c, script, call, deadline, asking).await {
            Err(e) if classify(&e) == Failure::Noscript => {}
            other => return step(other),
        }
        // One SCRIPT LOAD and one retry. A load Redis refuses (a managed Redis that
        // forbids SCRIPT, say) leaves the script missing: that is the NOSCRIPT row.
        match script.load(&mut c).await {
            Ok(_) => link.load_refused.store(false, Ordering::Relaxed),
            Err(e) if is_transport(&e) => return Step::Failed(self.failed(link, &conn, key, &e)),
            Err(e) => {
                // Once until a load succeeds again: every decision meets the same refusal.
                if !link.load_refused.swap(true, Ordering::Relaxed) {
                    tracing::warn!(node = %link.node(), error = %Said(&e), "redis refused SCRIPT LOAD after NOSCRIPT; decisions are redis_noscript_retry until it loads the script");
                }
                return Step::Failed(Failure::Noscript);
            }
        }
        step(evalsha(&mut c, script, call, deadline, asking).await)
    }

    /// Acts on what an error means: a broken connection is forgotten (its loss counted
    /// once), a broken key logged for the operator, a rejected command logged as the bug it
    /// is, a node that cannot serve makes a cluster look at its map again.
    pub(super) fn failed(
        &self,
        link: &Link,
        conn: &Arc<Conn>,
        key: &str,
        e: &RedisError,
    ) -> Failure {
        let failure = classify(e);
        if failure == Failure::ConnectionLost {
            link.forget(conn, e, true);
            link.lost_under(conn);
        }
        self.report(link, failure, key, &Said(e))
    }

    /// As [`Store::failed`], for the error one decision of a batch met (`"CODE detail"`).
    pub(super) fn failed_reply(&self, link: &Link, key: &str, error: &str) -> Failure {
        let (code, detail) = error.split_once(' ').unwrap_or((error, ""));
        self.report(link, Failure::of_reply(code, detail), key, &error)
    }

    /// Logs what an error reply means for the operator, and acts on it.
    fn report(
        &self,
        link: &Link,
        failure: Failure,
        key: &str,
        e: &dyn std::fmt::Display,
    ) -> Failure {
        match failure {
            Failure::Timeout
            | Failure::Noscript
            | Failure::NotConnected
            | Failure::Split
            | Failure::Quarantined(_) => {}
            Failure::ConnectionLost => {}
            Failure::BrokenKey => self.inner.broken_keys.report(key, e),
            Failure::Rejected => {
                tracing::error!(error = %e, "redis rejected the limiter's command: this is a bug, not an outage");
            }
            Failure::Unavailable => {
                link.log_unavailable(e);
                // Which commands, asked of the ACL, so that the next decisions are not sent
                // to fail after their first write.
                if crate::decision::is_acl_refusal(&e.to_string()) {
                    link.ask_permissions();
                }
                // READONLY, CLUSTERDOWN, MASTERDOWN...: in a cluster the map may be stale
                // (this node was demoted after a failover, say); look again rather than wait
                // 5 s.
                if let Layout::Cluster(cluster) = &self.inner.layout {
                    if super::cluster::says_cluster_down(&e.to_string()) {
                        link.cluster_down.store(true, Ordering::Relaxed);
                    }
                    cluster.ask_refresh();
                } else if let Some(sentinel) = &self.inner.sentinel {
                    // READONLY from what was the master: ask the sentinels where it went.
                    sentinel.suspect_master();
                }
            }
        }
        failure
    }
}

/// The node a `MOVED` or `ASK` sent a call on to, with what its breaker let through: the
/// call's outcome there settles it ([`Redirected::settle`]); a probe dropped unsettled (its
/// request gone) counts as a failed probe, as a dropped permit does.
pub(super) struct Redirected {
    pub(super) link: Arc<Link>,
    probe: bool,
    /// Whether the outcome counts for the breaker (not for a compensation).
    counts: bool,
    settled: bool,
}

impl Redirected {
    fn new(link: Arc<Link>, probe: bool) -> Self {
        Self {
            link,
            probe,
            counts: true,
            settled: false,
        }
    }

    fn uncounted(link: Arc<Link>) -> Self {
        Self {
            link,
            probe: false,
            counts: false,
            settled: false,
        }
    }

    /// Settles the node's breaker by the call's outcome there: `None` when it answered.
    pub(super) fn settle(mut self, failed: Option<Failure>) {
        self.settled = true;
        if self.counts {
            let failed = failed.map(|f| (f.charge(self.probe), f.cause()));
            self.link.breaker.settle(self.probe, failed);
        }
    }
}

impl Drop for Redirected {
    fn drop(&mut self) {
        if !self.settled && self.counts && self.probe {
            let failed = (crate::decision::Charge::Failure, StoreFailure::Timeout);
            self.link.breaker.settle(true, Some(failed));
        }
    }
}

/// The call's `EVALSHA`, with its `deadline` in the node's time (0: none) after its own
/// arguments; after an `ASK`, sent behind `ASKING` in one round trip.
async fn evalsha(
    c: &mut MultiplexedConnection,
    script: &Script,
    call: Call<'_>,
    deadline: u64,
    asking: bool,
) -> redis::RedisResult<Value> {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(&script.sha)
        .arg(call.keys.len())
        .arg(call.keys)
        .arg(call.args)
        .arg(deadline);
    if !asking {
        return cmd.query_async(c).await;
    }
    let (reply,): (Value,) = redis::pipe()
        .cmd("ASKING")
        .ignore()
        .add_command(cmd)
        .query_async(c)
        .await
        .map_err(unpacked)?;
    Ok(reply)
}

/// A pipeline's failure as its command's own error: redis-rs wraps the errors of a
/// pipeline's commands, and a `MOVED`, `NOSCRIPT` or `EXPIRED` met behind `ASKING` (or
/// behind `TIME`) must read as what it is.
pub(super) fn unpacked(e: RedisError) -> RedisError {
    e.clone()
        .into_server_errors()
        .and_then(|errors| errors.first().map(|(_, e)| RedisError::from(e.clone())))
        .unwrap_or(e)
}

/// A decision sent alone, in flight: its answer, and what giving its charge back needs.
type Asked = std::pin::Pin<Box<dyn std::future::Future<Output = (Step, Late)> + Send>>;

/// What a decision sent alone needs to give its charge back once it gave up.
struct Late {
    store: Store,
    keys: Vec<String>,
    /// Its arguments as a batch holds them (`batch::as_queued`).
    queued: Vec<u64>,
}

/// A decision sent alone, asked from the request's own task ([`Store::alone_reading_late`]);
/// dropped before its answer (the decision gave up), the call is handed to a task that reads
/// the answer and gives an admission back.
struct ReadLate {
    asked: Option<Asked>,
    /// The decision's deadline ([`deadline::mono_us`]).
    deadline_us: u64,
}

impl std::future::Future for ReadLate {
    type Output = Step;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Step> {
        let Some(asked) = self.asked.as_mut() else {
            return std::task::Poll::Ready(Step::Failed(Failure::Timeout));
        };
        let (step, _) = std::task::ready!(asked.as_mut().poll(cx));
        self.asked = None;
        std::task::Poll::Ready(step)
    }
}

impl Drop for ReadLate {
    fn drop(&mut self) {
        let Some(asked) = self.asked.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // The decision's own budget, then as long as a late answer is waited for.
        let left = Duration::from_micros(self.deadline_us.saturating_sub(deadline::mono_us()));
        drop(runtime.spawn(async move {
            let Ok((Step::Reply(reply), late)) =
                tokio::time::timeout(left + COMPENSATION_WAIT, asked).await
            else {
                return;
            };
            let replies = reply
                .bytes()
                .and_then(|b| crate::decision::ScriptReply::parse_many(b, late.keys.len()));
            let Some(replies) = replies.filter(|r| r.iter().all(|r| r.allowed)) else {
                return;
            };
            let charged_at = replies.first().map_or(0, |r| r.now_us);
            if let Some(refund) = super::batch::refund_args(&late.queued, charged_at) {
                late.store.give_back(late.keys, refund);
            }
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_names_the_key_it_was_met_on() {
        let wrong = "WRONGTYPE Operation against a key holding the wrong kind of value";
        let named = format!("{wrong} (key 3)");
        assert_eq!(key_of_error(&named, 3), (wrong, 2));
        assert_eq!(key_of_error(wrong, 3), (wrong, 0), "none named: the first");
        assert_eq!(
            key_of_error(&named, 2),
            (named.as_str(), 0),
            "past its keys"
        );
        let zero = format!("{wrong} (key 0)");
        assert_eq!(key_of_error(&zero, 2), (zero.as_str(), 0));
    }

    /// The error redis-rs gives for a RESP error reply.
    fn reply_error(resp: &str) -> RedisError {
        redis::parse_redis_value(format!("-{resp}\r\n").as_bytes())
            .expect("a RESP error")
            .extract_error()
            .expect_err("an error reply")
    }

    #[test]
    fn every_error_is_read_as_one_failure() {
        let cases = [
            ("NOSCRIPT No matching script.", Failure::Noscript),
            ("ERR wrong number of arguments for 'evalsha' command", Failure::Rejected),
            (
                "ERR user_script:12: attempt to compare nil with number script: 9f1c, on @user_script:12.",
                Failure::BrokenKey,
            ),
            ("WRONGTYPE Operation against a key holding the wrong kind of value", Failure::BrokenKey),
            ("READONLY You can't write against a read only replica.", Failure::Unavailable),
            ("CLUSTERDOWN The cluster is down", Failure::Unavailable),
            (
                "ERR Error running script: ERR Script attempted to execute a command while the cluster is down",
                Failure::Unavailable,
            ),
            ("LOADING Redis is loading the dataset in memory", Failure::Unavailable),
            ("OOM command not allowed when used memory > 'maxmemory'.", Failure::Unavailable),
            ("BUSY Redis is busy running a script.", Failure::Unavailable),
            ("MASTERDOWN Link with MASTER is down", Failure::Unavailable),
            ("TRYAGAIN Multiple keys request during rehashing of slot", Failure::Unavailable),
            ("MISCONF Redis is configured to save RDB snapshots", Failure::Unavailable),
        ];
        for (resp, failure) in cases {
            assert_eq!(classify(&reply_error(resp)), failure, "{resp}");
        }
        let reset = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(classify(&reset), Failure::ConnectionLost);
        let timed_out = RedisError::from(std::io::Error::from(std::io::ErrorKind::TimedOut));
        assert_eq!(classify(&timed_out), Failure::Timeout);
    }

    #[test]
    fn an_error_reply_reads_as_a_batch_reply_gives_it() {
        for resp in [
            "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "NOSCRIPT No matching script.",
        ] {
            assert_eq!(Said(&reply_error(resp)).to_string(), resp);
        }
        let reset = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(Said(&reset).to_string(), reset.to_string());
    }

    #[test]
    fn redirects_name_their_slot_node_and_kind() {
        assert_eq!(
            redirect(&reply_error("MOVED 3999 127.0.0.1:6381")),
            Some(Redirect {
                slot: 3999,
                addr: "127.0.0.1:6381".into(),
                ask: false
            })
        );
        assert_eq!(
            redirect(&reply_error("ASK 12 10.0.0.2:7000")),
            Some(Redirect {
                slot: 12,
                addr: "10.0.0.2:7000".into(),
                ask: true
            })
        );
        assert_eq!(redirect(&reply_error("ERR nope")), None);
        assert_eq!(redirect(&reply_error("MOVED")), None, "no slot, no node");
    }

    #[test]
    fn the_timer_ends_before_the_budget() {
        assert_eq!(
            timer_for(Duration::from_millis(20)),
            Duration::from_millis(18)
        );
        assert_eq!(
            timer_for(Duration::from_millis(4)),
            Duration::from_millis(3)
        );
    }
}
