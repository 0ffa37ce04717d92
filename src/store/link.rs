//! One Redis node as the store holds it: where it is, its current connection, the state of
//! keeping that connection up, and its circuit breaker.
//!
//! A [`Link`] is the one Redis of `[redis] url`, or one primary of a Redis Cluster. Each link
//! has its own breaker, so a dead cluster node quarantines the keys it owns and nothing else.
//! The connector (`connect.rs`) keeps it connected; a connection Redis closes is forgotten at
//! once, in use or not, but for its checks' socket closed alone while its decisions' carries
//! decisions ([`Link::checks_closed`]), and its decisions' socket closed while idle, before
//! it carried a batch or after ([`Link::batches_closed_alone`], [`Link::replace_wire`]): each
//! is made again alone.

use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Weak};

use arc_swap::{ArcSwap, ArcSwapOption};
use redis::aio::MultiplexedConnection;
use tokio::sync::{watch, Notify};

use super::deadline;
use super::dial::Dial;
use super::eval::COMPENSATION_WAIT;
use super::slots::node_name;
use super::wire::Wire;
use crate::config::RedisAccess;
use crate::decision::Breaker;

/// A connection just opened, and the signal that its socket has closed: the value turns
/// true when the socket reads its end or fails, and the sender is dropped with the socket
/// when the connection is let go. Either way, a waiter wakes.
pub(super) struct Opened {
    pub(super) conn: MultiplexedConnection,
    pub(super) closed: watch::Receiver<bool>,
}

/// A link's connection: redis-rs's multiplexed connection for everything but the decisions
/// (the checks' socket), and the decisions' own (`wire.rs`), opened and let go together. Each
/// is made again alone in one case: the checks' socket when Redis closes it while the
/// decisions' stays up ([`Link::checks_closed`]), the decisions' when Redis closes it while
/// idle ([`Link::batches_closed_alone`], [`Link::replace_wire`]).
pub(super) struct Conn {
    /// redis-rs's connection and its socket's end (see [`Opened`]); [`Conn::redis`].
    checks: ArcSwap<Opened>,
    pub(super) wire: Arc<Wire>,
    /// The checks' socket closed while the decisions' did not: the connector makes it again.
    pub(super) checks_lost: AtomicBool,
    /// Its loss was counted for the breaker ([`Link::lost_under`]).
    loss_counted: AtomicBool,
    /// Decisions sent on the checks' socket one by one and not yet answered
    /// ([`Conn::deciding`]); shared with the `Conn` that gets a new `wire` beside the same one.
    solo: Arc<std::sync::atomic::AtomicUsize>,
    /// The decision connection broke with decisions waiting on it (set before they are
    /// told, so that a watcher that sees the socket closed then still knows).
    pub(super) lost_deciding: AtomicBool,
    /// When a decision was last sent on it ([`deadline::mono_us`]): one sent alone, or the
    /// last batch's time, kept here when the connection's loss takes its batches. Shared as
    /// `solo` is.
    pub(super) sent_us: Arc<AtomicU64>,
    /// Dropped with the connection: the watch of its checks' socket ends then (a `Conn`
    /// given a new decisions' socket keeps the checks' socket, and watches it anew).
    gone: watch::Sender<()>,
}

/// Redis closes a client idle for its `timeout`, a whole number of seconds: a connection
/// that carried a decision within the last second was not closed for being idle (a
/// `CLIENT KILL` under load, between two batches, is a loss under decisions). The checks'
/// socket (the checks, every 15 s or every half of Redis's `timeout`, and little else under
/// batching) is idle longer than the decisions' under traffic: closed alone (a `timeout` the
/// checks could not read), it is made again alone.
const IDLE_AT_LEAST_US: u64 = 1_000_000;

/// Whether a socket whose last decision went at `sent_us` ([`deadline::mono_us`]; 0: none
/// yet) may have been closed for idleness: none went within the last second.
pub(super) fn idle_since(sent_us: u64) -> bool {
    sent_us == 0 || deadline::mono_us().saturating_sub(sent_us) >= IDLE_AT_LEAST_US
}

impl Conn {
    /// redis-rs's connection (the checks' socket), for a command of its own.
    pub(super) fn redis(&self) -> MultiplexedConnection {
        self.checks.load().conn.clone()
    }

    /// Counts a decision sent alone on the checks' socket until the guard goes (answered, or given up).
    pub(super) fn deciding(&self) -> Deciding<'_> {
        self.solo.fetch_add(1, Ordering::Relaxed);
        self.sent_us
            .fetch_max(deadline::mono_us(), Ordering::Relaxed);
        Deciding(&self.solo)
    }

    /// Whether this connection was in use: a decision waiting on it (sent alone, or
    /// batched), or one sent on it within the last second.
    fn in_use(&self) -> bool {
        let wire = self.wire.lock();
        let sent_us = (self.sent_us.load(Ordering::Relaxed)).max(wire.batches.sent_us());
        self.solo.load(Ordering::Relaxed) > 0
            || self.lost_deciding.load(Ordering::Acquire)
            || wire.batches.deciding()
            || !idle_since(sent_us)
    }
}

/// A decision in flight on a connection's checks' socket ([`Conn::deciding`]).
pub(super) struct Deciding<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Deciding<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for Conn {
    /// Let go (replaced, forgotten, retired): the decision connection closes with it.
    fn drop(&mut self) {
        self.wire.close().let_go();
    }
}

/// What logs call the node of a Sentinel-followed link before any sentinel named a master.
pub(super) const NO_MASTER: &str = "(no master named yet)";

/// Where a link connects.
pub(super) struct Target {
    /// The URL as configured (single Redis), compared on reload; the node's `host:port` in a
    /// cluster.
    pub(super) url: String,
    /// `host:port` (or the socket path), without credentials: what logs and metrics name.
    pub(super) node: String,
    pub(super) dial: Dial,
    /// The access it was made with, compared on reload.
    pub(super) access: RedisAccess,
}

impl Target {
    pub(super) fn new(url: &str, access: &RedisAccess) -> std::io::Result<Self> {
        let dial = Dial::new(url, access)?;
        let node = match dial.info.addr() {
            redis::ConnectionAddr::Tcp(host, port) => node_name(host, *port),
            redis::ConnectionAddr::TcpTls { host, port, .. } => node_name(host, *port),
            redis::ConnectionAddr::Unix(path) => path.display().to_string(),
            _ => String::new(),
        };
        Ok(Self {
            url: url.to_owned(),
            node,
            dial,
            access: access.clone(),
        })
    }

    /// No master known yet (Sentinel): nothing is dialled, every attempt fails with `why`,
    /// and logs name the node as `NO_MASTER`.
    pub(super) fn nowhere(why: &'static str, access: &RedisAccess) -> Self {
        Self {
            url: String::new(),
            node: NO_MASTER.to_owned(),
            dial: Dial::nowhere(why),
            access: access.clone(),
        }
    }

    /// A cluster node, reached with the seed's credentials and settings.
    pub(super) fn node(seed: &Dial, access: &RedisAccess, host: &str, port: u16) -> Self {
        Self {
            url: node_name(host, port),
            node: node_name(host, port),
            dial: seed.at(host, port),
            access: access.clone(),
        }
    }
}

/// One Redis node: its connection, the state of keeping it up, and its breaker.
pub(super) struct Link {
    pub(super) conn: ArcSwapOption<Conn>,
    /// Wakes the connector: the connection was dropped, or the target changed.
    pub(super) wake: Notify,
    /// Woken each time a connection is installed.
    pub(super) ready: Notify,
    /// Replaced when a reload changes `[redis] url`.
    pub(super) target: ArcSwap<Target>,
    /// The reasons logged for the outage going on (empty: none is): each is logged once.
    outage_logged: std::sync::Mutex<Vec<String>>,
    /// A request found the node without a connection since it was last connected: from then
    /// on each failed connection attempt counts for the breaker ([`Link::attempt_failed`]).
    asked_while_down: AtomicBool,
    /// The target is a new Redis not yet connected: a Sentinel failover's master, or a
    /// reload's new URL, credentials or TLS settings. The failures that opened the breaker
    /// were the old target's, so its quarantine ends once the new one is connected.
    pub(super) new_target: AtomicBool,
    /// A reload pointed the link at another Redis: its connection to the old one serves on
    /// until one is made to the new one, or an attempt there fails ([`Link::move_to`]).
    pub(super) moving: AtomicBool,
    /// The node's `maxmemory-policy` as last read, when it could be read.
    pub(super) eviction_policy: ArcSwapOption<String>,
    /// The policy of the node the link points at was said (logged) once: it is said again
    /// only when it changes, however often the connection is made again.
    pub(super) policy_said: AtomicBool,
    /// The node's `timeout` for idle clients, in seconds, as last read (0: none, or not
    /// readable): the checks' socket is used often enough that Redis never closes it idle
    /// ([`super::connect::checks_every`]).
    pub(super) idle_timeout_s: AtomicU64,
    /// Whether the current connection is driven on the proxy's runtime.
    pub(super) on_proxy_runtime: AtomicBool,
    /// The last evaluation timed out: the connection may be talking to a peer that is gone
    /// without a word (no RST), so the next breaker probe opens a fresh one, unless every call
    /// on it has been answered since and no probe kept it yet (see `Store::connection`).
    pub(super) suspect: AtomicBool,
    /// A new connection is being tried beside one that left a call unanswered
    /// (`Store::replace_if_silent`), or was, less than its pause ago.
    pub(super) replacing: AtomicBool,
    /// New connections tried beside one that left a call unanswered and dropped since the
    /// last that replaced one (Redis was slow, not gone): each doubles the pause before the
    /// next try.
    pub(super) replace_misses: std::sync::atomic::AtomicU32,
    /// A probe since the last timeout kept the connections (see `Store::connection`): the
    /// next one while still suspect replaces them.
    pub(super) probe_kept: AtomicBool,
    /// The node left the cluster's topology: its connector stops.
    pub(super) retired: AtomicBool,
    /// When a reply that says the node cannot serve was last logged
    /// ([`super::deadline::once_every`]).
    unavailable_logged: std::sync::atomic::AtomicU64,
    /// The code of the reply last said so (`OOM`, `READONLY`, ...): another is said at once.
    unavailable_said: std::sync::Mutex<String>,
    /// The last connection attempt failed (none has succeeded since).
    attempt_failed: AtomicBool,
    /// In a cluster, when a redirect last named the node ([`super::deadline::mono_us`], 0:
    /// never): a node outside the slot map is kept while redirects name it.
    pub(super) named_at: AtomicU64,
    /// In a cluster, the node answered that its cluster is down (`CLUSTERDOWN`): it is up,
    /// and its breaker's quarantine ends once it says the cluster is whole again.
    pub(super) cluster_down: AtomicBool,
    pub(super) breaker: Breaker,
    /// Whether the node takes batches.
    pub(super) turns: super::batch::Turns,
    /// The node refused the last `SCRIPT LOAD` (logged once until a load succeeds).
    pub(super) load_refused: AtomicBool,
    /// The commands of the limiter scripts the ACL user may not run on a bucket, as the last
    /// connection or check found them (`lua/permissions.lua`); while some are, decisions
    /// fail without being sent (they would fail after their first write).
    pub(super) refused: ArcSwapOption<String>,
    /// Whether `refused` names any: what a decision looks at.
    pub(super) lacks_commands: AtomicBool,
    /// A decision met an ACL refusal: the permissions are asked at the next look.
    pub(super) permissions_asked: AtomicBool,
    /// The last ask named nothing refused (a Redis before 7.0, a refusal of a key pattern
    /// the ask's key passes): refusals ask nothing more until the next check.
    pub(super) permissions_quiet: AtomicBool,
    /// Behind Sentinel: a connection was refused because the node answered `ROLE` as a
    /// replica; the sentinels' next answer is checked, though it names the node in use.
    pub(super) found_replica: AtomicBool,
    /// The node's `TIME` against this process's clock: decisions' deadlines in its time.
    pub(super) clock: super::deadline::RedisClock,
    /// A primary of a Redis Cluster (its batches may span several slots).
    pub(super) in_cluster: bool,
    /// In a cluster, the slot map's refresher: woken when the connection is lost (a replica
    /// may be taking over).
    refresh: Option<Arc<Notify>>,
}

impl Link {
    pub(super) fn new(target: Target, breaker: Breaker, refresh: Option<Arc<Notify>>) -> Self {
        Self {
            conn: ArcSwapOption::empty(),
            wake: Notify::new(),
            ready: Notify::new(),
            target: ArcSwap::from_pointee(target),
            outage_logged: std::sync::Mutex::new(Vec::new()),
            asked_while_down: AtomicBool::new(false),
            new_target: AtomicBool::new(false),
            moving: AtomicBool::new(false),
            clock: super::deadline::RedisClock::default(),
            eviction_policy: ArcSwapOption::empty(),
            policy_said: AtomicBool::new(false),
            idle_timeout_s: AtomicU64::new(0),
            on_proxy_runtime: AtomicBool::new(false),
            suspect: AtomicBool::new(false),
            replacing: AtomicBool::new(false),
            replace_misses: std::sync::atomic::AtomicU32::new(0),
            probe_kept: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            unavailable_logged: std::sync::atomic::AtomicU64::new(0),
            unavailable_said: std::sync::Mutex::new(String::new()),
            attempt_failed: AtomicBool::new(false),
            named_at: AtomicU64::new(0),
            cluster_down: AtomicBool::new(false),
            breaker,
            turns: Default::default(),
            load_refused: AtomicBool::new(false),
            refused: ArcSwapOption::empty(),
            lacks_commands: AtomicBool::new(false),
            permissions_asked: AtomicBool::new(false),
            permissions_quiet: AtomicBool::new(false),
            found_replica: AtomicBool::new(false),
            in_cluster: false,
            refresh,
        }
    }

    /// A decision met an ACL refusal: the connector asks which commands the user may not
    /// run, now (once until it has asked).
    pub(super) fn ask_permissions(&self) {
        // Known already (the refusals of decisions sent before it was: a few milliseconds of
        // them under load), the next check asks again.
        if self.lacks_commands.load(Ordering::Relaxed)
            || self.permissions_quiet.load(Ordering::Relaxed)
        {
            return;
        }
        if !self.permissions_asked.swap(true, Ordering::Relaxed) {
            self.wake.notify_one();
        }
    }

    /// The one link of a Sentinel layout (whose `refresh` asks the sentinels).
    pub(super) fn follows_sentinels(&self) -> bool {
        !self.in_cluster && self.refresh.is_some()
    }

    /// Asks the sentinels (or a cluster's map) again now.
    pub(super) fn ask_where(&self) {
        if let Some(refresh) = &self.refresh {
            refresh.notify_one();
        }
    }

    /// The node's `host:port`, for logs and metrics.
    pub(super) fn node(&self) -> String {
        self.target.load().node.clone()
    }

    /// Points the link at another Redis (a reload, a Sentinel failover): the connection is
    /// dropped and made again there, and what was read of the old one (its eviction policy)
    /// is forgotten.
    pub(super) fn point_at(&self, target: Target) {
        self.target.store(Arc::new(target));
        self.eviction_policy.store(None);
        self.policy_said.store(false, Ordering::Relaxed);
        self.idle_timeout_s.store(0, Ordering::Relaxed);
        self.moving.store(false, Ordering::Relaxed);
        self.conn.store(None);
        self.wake.notify_one();
    }

    /// Points the link at another Redis for a reload, make before break: the connection to
    /// the old one keeps deciding until one to the new one is made (then requests on the old
    /// one finish on it), or until the first attempt there fails (then the new target's
    /// outage is everyone's, as after a start). Dropped at once, the requests of the few
    /// milliseconds a connection takes failed by their fail mode (503 on `fail_closed`).
    pub(super) fn move_to(&self, target: Target) {
        self.target.store(Arc::new(target));
        self.eviction_policy.store(None);
        self.policy_said.store(false, Ordering::Relaxed);
        self.idle_timeout_s.store(0, Ordering::Relaxed);
        self.moving.store(self.is_connected(), Ordering::Relaxed);
        self.new_target.store(true, Ordering::Release);
        // The new target's failures are its own: said again (another wrong password too).
        self.forget_outage();
        self.wake.notify_one();
    }

    pub(super) fn is_connected(&self) -> bool {
        self.conn.load().is_some()
    }

    /// Waits until a connection is up (the caller bounds the wait).
    pub(super) async fn connected(&self) {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_connected() {
                return;
            }
            notified.await;
        }
    }

    /// Waits for the connection a redirect needs: whether there is one, at once when the
    /// node's last attempt failed (it is down, and a request fails at once, as while any
    /// node is down); for a node just named, until its first attempt's outcome (the caller
    /// bounds the wait).
    pub(super) async fn reached(&self) -> bool {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_connected() {
                return true;
            }
            if self.attempt_failed.load(Ordering::Acquire) || self.retired.load(Ordering::Relaxed) {
                return false;
            }
            notified.await;
        }
    }

    /// Wakes the connector out of its backoff and waits for the outcome of its attempt:
    /// connected, or failed (the caller bounds the wait).
    pub(super) async fn try_now(&self) {
        let notified = self.ready.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.is_connected() {
            return;
        }
        self.wake.notify_one();
        notified.await;
    }

    /// Installs a connection, as the connector or a breaker probe opened it, and watches it:
    /// when Redis closes it, it is forgotten at once, in use or not (see
    /// [`Link::checks_closed`] for its checks' socket closed alone).
    pub(super) fn install(self: &Arc<Self>, opened: Opened, wire: Wire, on_proxy_runtime: bool) {
        self.put(opened, wire, on_proxy_runtime, None);
    }

    /// As [`Self::install`], in the place of `old` only: false (the new connection dropped)
    /// when the link no longer holds it (a probe, the connector or a reload replaced it).
    pub(super) fn replace(
        self: &Arc<Self>,
        old: &Arc<Conn>,
        opened: Opened,
        wire: Wire,
        on_proxy_runtime: bool,
    ) -> bool {
        self.put(opened, wire, on_proxy_runtime, Some(old))
    }

    fn put(
        self: &Arc<Self>,
        opened: Opened,
        wire: Wire,
        on_proxy_runtime: bool,
        in_place_of: Option<&Arc<Conn>>,
    ) -> bool {
        let conn = Arc::new(Conn {
            checks: ArcSwap::from_pointee(opened),
            wire: Arc::new(wire),
            checks_lost: AtomicBool::new(false),
            loss_counted: AtomicBool::new(false),
            solo: Arc::default(),
            lost_deciding: AtomicBool::new(false),
            sent_us: Arc::default(),
            gone: watch::channel(()).0,
        });
        let previous = match in_place_of {
            None => self.conn.swap(Some(Arc::clone(&conn))),
            Some(old) => {
                let previous = self.conn.compare_and_swap(old, Some(Arc::clone(&conn)));
                if !previous.as_ref().is_some_and(|p| Arc::ptr_eq(p, old)) {
                    return false;
                }
                Some(Arc::clone(old))
            }
        };
        // Perhaps another host (a failover): its clock is read afresh.
        self.clock.reset();
        if let Some(old) = previous {
            let_go_when_answered(old);
        }
        self.on_proxy_runtime
            .store(on_proxy_runtime, Ordering::Relaxed);
        self.ready.notify_waiters();
        // Once installed: a socket already closed is then forgotten at once.
        self.forget_when_closed(&conn);
        true
    }

    /// Watches `conn`'s checks' socket (redis-rs's): when Redis closes it, the connection is
    /// forgotten if the link still holds it, or only that socket made again while the
    /// decisions' is up ([`Link::checks_closed`]).
    fn forget_when_closed(self: &Arc<Self>, conn: &Arc<Conn>) {
        let checks = conn.checks.load_full();
        tokio::spawn(forget_when_closed(
            Arc::downgrade(self),
            Arc::downgrade(conn),
            Arc::downgrade(&checks),
            checks.closed.clone(),
            conn.gone.subscribe(),
        ));
    }

    /// The checks' socket of `conn` closed. While the decisions' socket is up, and the link
    /// still holds `conn` where it was made (no reload moving it), Redis closed that socket
    /// alone (its `timeout` for idle clients, which the decisions' traffic keeps the other
    /// from; a `CLIENT KILL` of that one client): the connector makes it again alone
    /// ([`Link::checks_made_again`]) and the decisions go on. Else the connection is lost
    /// as a whole ([`Link::forget`]).
    fn checks_closed(&self, conn: &Arc<Conn>) {
        let recent = |sent_us: u64| !idle_since(sent_us);
        // The checks' socket idle: no decision sent alone on it waits, none went within the
        // last second (one that did was not closed for idleness: a loss under decisions).
        let checks_idle =
            conn.solo.load(Ordering::Relaxed) == 0 && !recent(conn.sent_us.load(Ordering::Relaxed));
        // The decisions' socket in use: a batch waits, or one went within the last second (so
        // Redis did not close it for idleness), and its reader sees its end. Unused, it may
        // be closed as well, with nothing reading it: both are made again.
        let deciding = {
            let wire = conn.wire.lock();
            !wire.bytes.dead && (wire.batches.deciding() || recent(wire.batches.sent_us()))
        };
        // (While a reload moves the link, the connection goes on without its checks' socket
        // until the new one replaces it: make before break.)
        let held = self.conn.load();
        let alone = held.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
            && !self.retired.load(Ordering::Relaxed)
            && checks_idle
            && deciding;
        if alone {
            conn.checks_lost.store(true, Ordering::Release);
            self.wake.notify_one();
        } else {
            self.forget(conn, &"redis closed the connection", false);
        }
    }

    /// `conn`'s batches' socket ended with nothing on it, none sent within the last second
    /// (Redis's `timeout` for idle clients, which the checks keep from the checks' socket:
    /// `connect::checks_every`): while the link holds `conn` where it was made and its checks'
    /// socket is up, the connector makes the batches' socket again alone
    /// ([`Link::replace_wire`]), the decisions meanwhile going alone on the checks' socket.
    /// False: the connection is lost as a whole.
    pub(super) fn batches_closed_alone(&self, conn: &Arc<Conn>) -> bool {
        let held = self.conn.load();
        let alone = held.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
            && !self.retired.load(Ordering::Relaxed)
            && !self.moving.load(Ordering::Relaxed)
            && !conn.checks_lost.load(Ordering::Acquire)
            && !*conn.checks.load().closed.borrow();
        if alone {
            self.wake.notify_one();
        }
        alone
    }

    /// Whether the link still holds `conn`.
    pub(super) fn holds(&self, conn: &Arc<Conn>) -> bool {
        self.conn
            .load()
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(c, conn))
    }

    /// Puts a checks' socket made again at `target` in `conn` ([`Link::checks_closed`]);
    /// false (and it dropped) when the link no longer holds `conn`, points elsewhere now (a
    /// reload, a new master) or `conn`'s decisions' socket broke meanwhile.
    pub(super) fn checks_made_again(
        self: &Arc<Self>,
        conn: &Arc<Conn>,
        target: &Arc<Target>,
        opened: Opened,
    ) -> bool {
        let held = self.conn.load();
        if !held.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
            || !Arc::ptr_eq(target, &self.target.load())
            || self.moving.load(Ordering::Relaxed)
            || conn.wire.lock().bytes.dead
        {
            return false;
        }
        conn.checks.store(Arc::new(opened));
        conn.checks_lost.store(false, Ordering::Release);
        self.forget_when_closed(conn);
        // A probe waiting for it ([`Link::checks_again`]).
        self.ready.notify_waiters();
        true
    }

    /// Waits until `conn`'s checks' socket is made again ([`Link::checks_closed`]), or the
    /// link lets `conn` go (the caller bounds the wait).
    pub(super) async fn checks_again(&self, conn: &Arc<Conn>) {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let held = self.conn.load();
            if !held.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
                || !conn.checks_lost.load(Ordering::Acquire)
            {
                return;
            }
            notified.await;
        }
    }

    /// Gives the current connection a new decision connection (opened on the proxy's
    /// runtime), keeping redis-rs's. False when the connection went meanwhile (the connector
    /// opens both again).
    pub(super) fn install_wire(self: &Arc<Self>, wire: Wire) -> bool {
        let Some(old) = self.conn.load_full() else {
            return false;
        };
        self.replace_wire(&old, wire)
    }

    /// Gives `old`, while the link holds it, a new decision connection, keeping redis-rs's:
    /// false (and `wire` dropped) when it no longer does.
    pub(super) fn replace_wire(self: &Arc<Self>, old: &Arc<Conn>, wire: Wire) -> bool {
        let on_workers = wire.on_workers;
        let conn = Arc::new(Conn {
            checks: ArcSwap::new(old.checks.load_full()),
            wire: Arc::new(wire),
            checks_lost: AtomicBool::new(old.checks_lost.load(Ordering::Acquire)),
            loss_counted: AtomicBool::new(false),
            solo: Arc::clone(&old.solo),
            lost_deciding: AtomicBool::new(false),
            sent_us: Arc::clone(&old.sent_us),
            gone: watch::channel(()).0,
        });
        let watched = Arc::clone(&conn);
        let prev = self.conn.compare_and_swap(old, Some(conn));
        if !prev.as_ref().is_some_and(|p| Arc::ptr_eq(p, old)) {
            return false;
        }
        if on_workers {
            self.on_proxy_runtime.store(true, Ordering::Relaxed);
        }
        self.forget_when_closed(&watched);
        // A decisions' socket that never carried a batch, or ended, has nothing to answer:
        // let go with the old `Conn` (a decision sent alone on the checks' socket still holds
        // it, and its loss there still counts).
        if old.wire.reading.load(Ordering::Acquire) && !old.wire.lock().bytes.dead {
            let_go_when_answered(Arc::clone(old));
        }
        true
    }

    /// Logs a reply that says the node cannot serve (`OOM`, `READONLY`, `LOADING`...) with
    /// its reason, at most once every 10 s per node and reason (the reply's code: a
    /// `READONLY` just after an `OOM` line is said at once): the breaker's transition says
    /// that Redis failed, this says why.
    pub(super) fn log_unavailable(&self, error: &dyn std::fmt::Display) {
        let error = error.to_string();
        // Redis's code (an upper-case word); a refusal the gateway tells itself (a command
        // the ACL refuses, not sent) is no new reason.
        let code = error.split(' ').next().unwrap_or_default();
        let new_reason = !code.is_empty() && code.bytes().all(|b| b.is_ascii_uppercase()) && {
            let mut said = self
                .unavailable_said
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let new = *said != code;
            if new {
                code.clone_into(&mut said);
            }
            new
        };
        if new_reason {
            self.unavailable_logged
                .store(super::deadline::mono_us(), Ordering::Relaxed);
        }
        if new_reason || super::deadline::once_every(&self.unavailable_logged, 10) {
            // A dependency's fault (contract section 8), as the outage's line is: what an
            // operator alerts on, whether or not the connection stays up.
            tracing::error!(node = %self.node(), error = %error, "redis cannot serve the limiter scripts");
        }
    }

    /// Logs why a connection attempt failed: when an outage starts, and again each time it
    /// fails for a reason not yet logged in this outage (Redis back, refusing the password; a
    /// new master without the ACL user), up to a few reasons: not once per retry.
    /// `kind` says which reasons are one: a refused connection, a reset and a timeout all say
    /// that the node cannot be reached, and are logged once for all.
    pub(super) fn log_outage(&self, kind: &str, reason: &str) {
        const REASONS_LOGGED: usize = 8;
        let mut logged = self
            .outage_logged
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if logged.len() < REASONS_LOGGED && !logged.iter().any(|k| k == kind) {
            // A dependency's fault, said once a reason: ERROR, what an operator alerts on.
            tracing::error!(node = %self.node(), error = reason, "redis unavailable; reconnecting in the background");
            logged.push(kind.to_owned());
        }
    }

    /// The next failed attempt starts an outage of its own, logged afresh: the node is
    /// connected again, or the link now points at another node (a new master).
    pub(super) fn forget_outage(&self) {
        self.outage_logged
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
    }

    /// A request failed at once: the node has no connection (it is being made again).
    pub(super) fn failed_at_once(&self) {
        if !self.asked_while_down.load(Ordering::Relaxed) {
            self.asked_while_down.store(true, Ordering::Relaxed);
        }
    }

    /// A connection attempt failed: one failure of the node, once a request has found it
    /// down. A node that goes down while nothing asks for it opens no breaker, so the first
    /// requests to find it down are answered `redis_connection_error` by their fail mode, as
    /// the decision table's row says, not `circuit_open`.
    pub(super) fn attempt_failed(&self) {
        self.attempt_failed.store(true, Ordering::Release);
        if self.asked_while_down.load(Ordering::Relaxed) {
            self.breaker.count_failure();
        }
    }

    /// A connection is up again: the next outage starts unasked. When it is a new target's
    /// (a new master, or a reload's new URL or credentials: a wrong password mended), the
    /// breaker's quarantine, opened by the old target's failures, ends: the next request
    /// probes the new one.
    pub(super) fn connected_again(&self) {
        self.attempt_failed.store(false, Ordering::Release);
        self.forget_outage();
        self.asked_while_down.store(false, Ordering::Relaxed);
        if self.new_target.swap(false, Ordering::AcqRel) {
            self.breaker.end_quarantine();
        }
    }

    /// Forgets a broken connection (once, however many requests, or its watcher, saw it
    /// break), counts the loss as one failure of the node, and wakes the connector; in a
    /// cluster, also asks for a fresh slot map. `deciding`: the caller saw decisions waiting
    /// on it. A connection Redis closed while nothing used it (its `timeout` for idle
    /// clients, say) is said at INFO: no decision failed.
    pub(super) fn forget(&self, conn: &Arc<Conn>, cause: &dyn std::fmt::Display, deciding: bool) {
        let prev = self.conn.compare_and_swap(conn, None);
        if prev.as_ref().is_some_and(|p| Arc::ptr_eq(p, conn)) {
            if deciding || conn.in_use() {
                tracing::warn!(node = %self.node(), error = %cause, "redis connection lost; reconnecting in the background");
            } else {
                tracing::info!(node = %self.node(), error = %cause, "redis closed a connection no decision was using (its idle timeout, a restart or a kill: a failed reconnection says it is down); reconnecting in the background");
            }
            self.wake.notify_one();
            if let Some(refresh) = &self.refresh {
                refresh.notify_one();
            }
        }
    }

    /// Decisions were in flight on `conn` when it was lost: one failure for the breaker,
    /// however many they were. A connection lost while nothing used it (Redis's idle
    /// `timeout`, a `CLIENT KILL`, a restart between requests) counts nothing: the next
    /// request finds a new one, or finds none and counts that.
    pub(super) fn lost_under(&self, conn: &Conn) {
        if !conn.loss_counted.swap(true, Ordering::Relaxed) {
            self.breaker.count_failure();
        }
    }

    /// Stops the connector and drops the connection (the node left the topology).
    pub(super) fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
        self.conn.store(None);
        self.wake.notify_one();
        // A redirect waiting for it ([`Link::reached`]) is told at once.
        self.ready.notify_waiters();
    }
}

/// Lets go of a connection the link no longer holds (a reload moved it, the decisions moved
/// to the proxy's workers) once its call in flight is answered, or after [`LET_GO_AFTER`]:
/// the decisions in that call are told their answers, and an admission answered after its
/// decision gave up is given back. Dropped at once, they were all timeouts, charged for
/// good. The decisions queued behind that call go in the next call on it, as they would
/// have (each holds the connection while it waits); the old one's loss, if it breaks
/// meanwhile, is not the node's failure.
fn let_go_when_answered(old: Arc<Conn>) {
    old.loss_counted.store(true, Ordering::Relaxed);
    tokio::spawn(async move {
        let until = tokio::time::Instant::now() + LET_GO_AFTER;
        while tokio::time::Instant::now() < until {
            {
                let state = old.wire.lock();
                if state.bytes.dead || !state.batches.call_in_flight() {
                    break;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        drop(old);
    });
}

/// How long a replaced connection's call in flight is waited for: the longest budget
/// (`timeout_ms` = 10 000) and then [`COMPENSATION_WAIT`], as a late answer is.
const LET_GO_AFTER: std::time::Duration =
    std::time::Duration::from_secs(10).saturating_add(COMPENSATION_WAIT);

/// Waits for an installed connection's checks' socket to close, then tells the link
/// ([`Link::checks_closed`]). Ends quietly when the connection was replaced and let go, or
/// the socket made again (a later watch has it).
async fn forget_when_closed(
    link: Weak<Link>,
    conn: Weak<Conn>,
    checks: Weak<Opened>,
    mut closed: watch::Receiver<bool>,
    mut gone: watch::Receiver<()>,
) {
    tokio::select! {
        // Ok: the socket ended; Err: the socket was dropped with the connection.
        _ = closed.wait_for(|ended| *ended) => {}
        // The connection was let go (its checks' socket may live on in another's).
        _ = gone.changed() => return,
    }
    if let (Some(link), Some(conn)) = (link.upgrade(), conn.upgrade()) {
        if std::ptr::eq(Arc::as_ptr(&conn.checks.load()), checks.as_ptr()) {
            link.checks_closed(&conn);
        }
    }
}
