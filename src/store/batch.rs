//! Decisions in flight together on one node share one call (contract section 14).
//!
//! Each link's decision connection (`wire.rs`) has a queue and at most one call in flight. A
//! decision joins the queue; when no call is in flight it also sends what waits, from its own
//! task, as one `EVALSHA` of `lua/batch.lua`, which decides the decisions in order and
//! answers each. A decision alone goes out at once, in a batch of one: nothing waits for
//! company, no timer. Every decision then waits for its answer or for the socket to be
//! readable, whichever comes first: the one that runs first after the answer came in reads
//! it, tells each decision of the batch its part, and sends what queued meanwhile. A reader
//! task on the connection does the same when no decision is waiting, and notices the node
//! closing the connection while it is idle.
//!
//! The connection is registered with the proxy's workers (from the first limited request on;
//! before, with the store's own thread), so the waiting decisions read the answers themselves,
//! with no other thread in between. By default (`[redis] dedicated_io_thread = true`) the
//! store's thread also watches it ([`watch_over`]): a call still in flight a millisecond
//! after it was last seen is read from there, so an answer that came while every worker is
//! busy is told, and the next call sent, within a millisecond or two, not after the workers'
//! queue. With `false`, nothing but the workers reads it.
//!
//! A decision that would wait for the call in flight and then for its own past three
//! quarters of what is left of its budget (a node far away: [`Batches::waits_too_long`])
//! goes on its own at once instead, on the node's other connection.
//!
//! Each decision keeps its own deadline (it stops waiting at it and is a timeout, whatever
//! the batch does after), its own reason (a broken key fails its own decision only: the
//! script runs each under `pcall`) and its own exact outcome. A failure of the call itself
//! (a lost connection, `OOM`) is each of its decisions' failure. `NOSCRIPT` loads the batch
//! script once per batch, on the same connection, and sends the batch again behind the load.
//! A redirect (`MOVED`, `ASK`) sends every decision of the batch its own way, as if it had
//! been alone; so does a Redis that refuses the batch script. A Redis Cluster primary's batch
//! may hold keys of every slot it serves: its keys are not declared (Redis would refuse
//! declared keys of several slots in one call) but passed among the arguments, to the batch
//! script flagged `allow-cross-slot-keys`; a decision whose key's slot the node no longer
//! serves (moved, or migrating away) fails alone in the script, writes nothing, and goes
//! again on its own to follow the redirect. A call whose answer never comes (a Redis
//! that stopped answering) keeps its connection's turn: the decisions queued behind it time
//! out at their own deadlines, and the breaker's probe opens a fresh connection.

use std::collections::VecDeque;
use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard, Weak};

use tokio::sync::oneshot;

use super::deadline::{self, RedisClock};
use super::eval::{key_of_error, Call, Step};
use super::link::{Conn, Link};
use super::script::ScriptKind;
use super::wire::{self, next_reply, Look, Resp, Wire, WireState};
use super::Store;
use crate::decision::{Failure, ScriptReply};

/// The kinds `lua/batch.lua` reads at the head of each decision's arguments.
fn kind_code(kind: ScriptKind) -> u64 {
    match kind {
        ScriptKind::TokenBucket => 1,
        ScriptKind::SlidingWindow => 2,
        ScriptKind::Limits => 3,
    }
}

/// What a waiting decision is told.
pub(super) enum Answer {
    /// Its part of the batch's answer.
    Reply(Arc<Vec<u8>>, Range<usize>),
    Failed(Failure),
    /// Not decided: it goes on its own (the batch was redirected, or refused).
    Alone,
}

/// A decision waiting for its answer.
struct Waiting {
    tx: oneshot::Sender<Answer>,
    /// When its task stops waiting ([`Call::deadline_us`]).
    deadline_us: u64,
    /// Its keys in [`Queue::keys`] (by index into `key_ends`) and its arguments in
    /// [`Queue::args`], kind first.
    keys: Range<usize>,
    args: Range<usize>,
    /// An admission answered after it gave up is given back ([`super::IfLate`]).
    give_back: bool,
    /// Its keys lie in several slots of a cluster node: it can only go in a batch.
    across: bool,
}

/// Decisions waiting for a call or for its answer, their keys and arguments back to back:
/// nothing is allocated per decision but its answer's channel.
#[derive(Default)]
pub(super) struct Queue {
    waiting: Vec<Waiting>,
    keys: Vec<u8>,
    key_ends: Vec<usize>,
    args: Vec<u64>,
}

impl Queue {
    fn push(&mut self, call: Call<'_>) -> oneshot::Receiver<Answer> {
        let (tx, rx) = oneshot::channel();
        let first_key = self.key_ends.len();
        for key in call.keys {
            self.keys.extend_from_slice(key.as_bytes());
            self.key_ends.push(self.keys.len());
        }
        let first_arg = self.args.len();
        self.args.push(kind_code(call.kind));
        if call.kind == ScriptKind::Limits {
            self.args.push(call.keys.len() as u64);
        }
        self.args.extend_from_slice(call.args);
        self.waiting.push(Waiting {
            tx,
            deadline_us: call.deadline_us,
            keys: first_key..self.key_ends.len(),
            args: first_arg..self.args.len(),
            give_back: call.if_late == super::IfLate::GivenBack,
            across: call.across,
        });
        rx
    }

    /// The refund of a decision's charge (its keys and arguments in the queue), made by
    /// Redis at `charged_at_us`: its keys, and the several-limits script's arguments that
    /// give each limit its cost back; `None` when the decision charged nothing whatever its
    /// answer (a peek, a refund, a charge).
    fn refund_of(
        &self,
        keys: Range<usize>,
        args: Range<usize>,
        charged_at_us: u64,
    ) -> Option<(Vec<String>, Vec<u64>)> {
        let args = refund_args(&self.args[args], charged_at_us)?;
        let keys = keys
            .map(|k| String::from_utf8_lossy(self.key(k)).into_owned())
            .collect();
        Some((keys, args))
    }

    fn key(&self, index: usize) -> &[u8] {
        let start = if index == 0 {
            0
        } else {
            self.key_ends[index - 1]
        };
        &self.keys[start..self.key_ends[index]]
    }

    fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// Empties the queue, keeping what it allocated for the next batch.
    fn clear(&mut self) {
        self.waiting.clear();
        self.keys.clear();
        self.key_ends.clear();
        self.args.clear();
    }

    /// Moves `w` (a decision of `from`) to the end of this queue, with its keys and
    /// arguments.
    fn adopt(&mut self, from: &Queue, w: Waiting) {
        let first_key = self.key_ends.len();
        for k in w.keys.clone() {
            self.keys.extend_from_slice(from.key(k));
            self.key_ends.push(self.keys.len());
        }
        let first_arg = self.args.len();
        self.args.extend_from_slice(&from.args[w.args.clone()]);
        self.waiting.push(Waiting {
            keys: first_key..self.key_ends.len(),
            args: first_arg..self.args.len(),
            ..w
        });
    }

    /// Tells every decision the same thing, and empties the queue.
    fn tell_all(&mut self, answer: impl Fn() -> Answer) {
        for w in self.waiting.drain(..) {
            let _ = w.tx.send(answer());
        }
        self.clear();
    }

    /// The batch's `EVALSHA` of the script `sha`, appended to `out`, each decision's
    /// deadline in the node's time by `clock`; `argv` is where its arguments are put
    /// together; `in_cluster`: its keys among the arguments ([`command`]).
    fn command(
        &self,
        out: &mut Vec<u8>,
        argv: &mut Argv,
        sha: &str,
        clock: &RedisClock,
        in_cluster: bool,
    ) {
        let keys = self
            .waiting
            .iter()
            .flat_map(|w| w.keys.clone())
            .map(|k| self.key(k));
        let now = deadline::mono_us();
        let args = self.waiting.iter().map(|w| {
            (
                clock.deadline(w.deadline_us, now),
                &self.args[w.args.clone()],
            )
        });
        command(out, sha, keys, argv.of_timed(args), in_cluster);
    }
}

/// A reply expected on the decision connection, in the order they come.
enum Expect {
    /// The batch script's `SCRIPT LOAD` after a `NOSCRIPT`.
    Load,
    /// The answer of the batch in flight; `reloaded`: sent again behind a load.
    Batch { reloaded: bool },
}

/// One decision connection's turn-taking: whether a call is in flight, the decisions it
/// carries, those waiting for the next one, and the replies expected.
#[derive(Default)]
pub(super) struct Batches {
    busy: bool,
    in_flight: Queue,
    queue: Queue,
    /// An emptied queue: the next batch fills it without allocating.
    spare: Queue,
    expect: VecDeque<Expect>,
    /// The command being sent, and its arguments put together.
    out: Vec<u8>,
    argv: Argv,
    /// The queue's length at which the decisions that gave up are dropped next (0: at
    /// [`QUEUE_COMPACT_AT`]).
    compact_at: usize,
    /// Calls sent so far: the watch tells a call still in flight from the next one by it.
    sent: u64,
    /// When the call in flight was sent ([`deadline::mono_us`]).
    sent_us: u64,
    /// The node's round trip as its fastest recent calls took it, in microseconds (0: none
    /// answered yet): it falls to a faster call at once and rises by an eighth of the
    /// difference a call, so a stall of the machine moves it little and the next fast call
    /// undoes that.
    round_trip_us: u64,
    /// Calls whose round trip was noted (up to [`ROUND_TRIPS_TO_TRUST`]): the first ones of
    /// a connection (a cold start, the connection's move to the proxy's workers) say little.
    round_trips: u32,
    /// The watch sleeps until the next call (see [`watch_over`]).
    watch_asleep: bool,
}

/// Below this round trip no decision is sent past the call in flight: two of them fit any
/// budget but the smallest with room to spare.
const ROUND_TRIP_WORTH_A_LOOK_US: u64 = 250;

/// Calls noted before the round trip is believed.
const ROUND_TRIPS_TO_TRUST: u32 = 16;

/// A call in flight this long is late whatever the round trip learned: see
/// [`Batches::in_flight_late`]. A Redis on the same host answers a batch of a few decisions
/// in well under a millisecond, but under 256 connections on two shared cores calls of 2 to
/// 15 ms come about a hundred times a cell: at 2 ms, those sent what waited on its own, and
/// the calls a request went from 0.033 to 0.057 (measured).
const LATE_AFTER_US: u64 = 5_000;

/// What each decision of the call in flight adds to [`LATE_AFTER_US`]: about twice what
/// Redis takes to decide one in a batch (256 in 3.8-5.2 ms, docs/benchmarks.md), so a large
/// batch is not taken for a late one.
const LATE_PER_DECISION_US: u64 = 40;

impl Batches {
    /// A call was sent and its answer has not been read yet.
    pub(super) fn call_in_flight(&self) -> bool {
        self.busy
    }

    /// Whether decisions wait here: in the call in flight, or for the next.
    pub(super) fn deciding(&self) -> bool {
        !self.in_flight.waiting.is_empty() || !self.queue.waiting.is_empty()
    }

    /// When the last call was sent (0: none yet).
    pub(super) fn sent_us(&self) -> u64 {
        self.sent_us
    }

    /// The number of the call in flight, if one is: a later look tells the same call
    /// unanswered from the next one.
    fn unanswered_call(&self) -> Option<u64> {
        self.busy.then_some(self.sent)
    }

    /// Whether a decision due at `deadline_us` would spend more than three quarters of what
    /// is left of its budget waiting for the call in flight and then for its own: two round
    /// trips, where the node is far (8 ms of a 20 ms budget timed out a third of such
    /// decisions under load). It then goes on its own, at once, in one round trip (on the
    /// node's other connection, which takes calls in a pipeline).
    fn waits_too_long(&self, deadline_us: u64) -> bool {
        if !self.busy || deadline_us == 0 {
            return false;
        }
        let now = deadline::mono_us();
        if self.in_flight_late(now) {
            return late_for(self.sent_us, deadline_us, now);
        }
        let trip = self.round_trip_us;
        if trip < ROUND_TRIP_WORTH_A_LOOK_US || self.round_trips < ROUND_TRIPS_TO_TRUST {
            return false;
        }
        let own_call_from = self.sent_us.saturating_add(trip).max(now);
        let done = own_call_from.saturating_add(trip) - now;
        let left = deadline_us.saturating_sub(now);
        done > left / 4 * 3
    }

    /// Whether the call in flight is late at `now`: out for more than four round trips as
    /// learned and more than [`LATE_AFTER_US`], and [`LATE_PER_DECISION_US`] more for each
    /// of its decisions. The node slowed at once (a Redis that began to swap, a network path
    /// that changed), and the learned round trip, which rises slowly, no longer says when the
    /// call in flight or the next one will be answered.
    fn in_flight_late(&self, now: u64) -> bool {
        let size = self.in_flight.waiting.len() as u64;
        self.busy
            && now.saturating_sub(self.sent_us)
                > (self.round_trip_us.saturating_mul(4).max(LATE_AFTER_US))
                    .saturating_add(size.saturating_mul(LATE_PER_DECISION_US))
    }

    /// The decisions waiting for the next call that go on their own now, taken out of the
    /// queue (the others keep their place): the call in flight is late, and waiting for the
    /// next would spend their budget ([`late_for`]). A step in the node's round
    /// trip (a near Redis 10 ms away at once) timed out such decisions in a burst that
    /// opened the breaker.
    fn release_if_late(&mut self, now: u64) -> Option<Vec<Waiting>> {
        if self.queue.is_empty() || !self.in_flight_late(now) {
            return None;
        }
        let sent_us = self.sent_us;
        let goes =
            |w: &Waiting| !w.across && w.deadline_us != 0 && late_for(sent_us, w.deadline_us, now);
        if !self.queue.waiting.iter().any(goes) {
            return None;
        }
        Some(take_out(self, goes))
    }

    /// A call sent at `sent_us` was answered now: a batch, or a decision of this node sent on
    /// its own (without these, decisions all sent alone would never lower it again).
    pub(super) fn note_round_trip(&mut self, sent_us: u64) {
        self.round_trips = self.round_trips.saturating_add(1).min(ROUND_TRIPS_TO_TRUST);
        let trip = deadline::mono_us().saturating_sub(sent_us);
        self.round_trip_us = match self.round_trip_us {
            0 => trip,
            floor if trip <= floor => trip,
            floor => floor + (trip - floor) / 8,
        };
    }

    /// Appends the batch in flight's `EVALSHA` of `sha` to what is sent next, and notes when
    /// it goes.
    fn append_in_flight(&mut self, sha: &str, clock: &RedisClock, in_cluster: bool) {
        self.in_flight
            .command(&mut self.out, &mut self.argv, sha, clock, in_cluster);
        self.sent_us = deadline::mono_us();
    }

    /// Takes back a queue emptied by telling its decisions, for the next batch, unless the
    /// spare one already holds as much.
    fn recycle(&mut self, emptied: Queue) {
        if emptied.waiting.capacity() > self.spare.waiting.capacity() {
            self.spare = emptied;
        }
    }

    /// A connection let go (retired, or replaced and its call in flight answered or waited
    /// for long enough) with decisions on it: those in flight have no answer to wait for
    /// (their call may still run in Redis: dropped, they are timeouts, never sent twice);
    /// those never sent go on their own.
    pub(super) fn let_go(mut self) {
        self.in_flight.clear();
        self.queue.tell_all(|| Answer::Alone);
    }
}

/// With the call in flight (sent at `sent_us`) late, whether a decision due at `deadline_us`
/// goes on its own: waiting, it would take the rest of the late call (unknown) and then a call
/// of its own, which may well take as long as the late one has so far (a step in the round
/// trip); once that is more than an eighth of what is left of its budget, a call of its own
/// now is its chance (a quarter, measured, left too little for it on a loaded machine). A
/// decision with much budget left keeps waiting (a 1 s budget, a Redis stalled 5 ms): while
/// Redis itself is slow (busy, or stalled), calls of their own would only add to its work.
fn late_for(sent_us: u64, deadline_us: u64, now: u64) -> bool {
    now.saturating_sub(sent_us) > deadline_us.saturating_sub(now) / 8
}

/// Queued behind a call in flight, at most this many decisions are kept before the ones that
/// gave up are dropped (a Redis that stopped answering while the breaker stays closed).
const QUEUE_COMPACT_AT: usize = 4096;

/// How long a node that refused the batch script has its decisions sent alone before a
/// decision tries the batch script again (an ACL or a managed Redis's rules changed back).
const RETRY_REFUSED_US: u64 = 10_000_000;

/// A link's willingness to batch: whether its node refused the batch script lately.
#[derive(Default)]
pub(super) struct Turns {
    /// When Redis last refused the batch script (`deadline::mono_us`); 0: it has not;
    /// `u64::MAX`: it cannot compile it, until a new connection loads it.
    refused_at_us: AtomicU64,
    /// The refusal was logged: once until the node loads the script again.
    warned: AtomicBool,
}

impl Turns {
    /// The node loaded the batch script (again: a Redis upgraded meanwhile, say).
    pub(super) fn accept(&self) {
        self.refused_at_us.store(0, Ordering::Relaxed);
        self.warned.store(false, Ordering::Relaxed);
    }

    /// The node refused the batch script: decisions on it are sent one by one for
    /// `RETRY_REFUSED_US`, then the batch script is tried again.
    /// A Redis that cannot compile it (a cluster node before Redis 7, which knows no script
    /// flags) is not asked again on this connection.
    pub(super) fn refuse(&self, node: &str, error: &dyn std::fmt::Display) {
        let error = error.to_string();
        let cannot_compile = error.contains("compiling") || error.contains("shebang");
        let at = match cannot_compile {
            true => u64::MAX,
            false => super::deadline::mono_us(),
        };
        self.refused_at_us.store(at, Ordering::Relaxed);
        if !self.warned.swap(true, Ordering::Relaxed) {
            match cannot_compile {
                true => {
                    tracing::warn!(node, error = %error, "redis cannot compile the batch script (a Redis Cluster's batches need Redis 7 or later); decisions on this node are sent one by one")
                }
                false => {
                    tracing::warn!(node, error = %error, "redis refused the batch script; decisions on this node are sent one by one, and the batch script tried again every 10 s")
                }
            }
        }
    }

    fn is_refused(&self) -> bool {
        let at = self.refused_at_us.load(Ordering::Relaxed);
        at != 0 && super::deadline::mono_us().saturating_sub(at) < RETRY_REFUSED_US
    }
}

impl Store {
    /// Whether `link`'s decisions go in batches on its decision connection.
    pub(super) fn batches_on(&self, link: &Link) -> bool {
        self.batch_max() > 1 && !link.turns.is_refused()
    }

    /// Decides `call` in `link`'s next call. `None`: it must go on its own (see
    /// [`Answer::Alone`]; also when batching is off, and when waiting for the call in flight
    /// would cost it too much of its budget: [`Batches::waits_too_long`]).
    pub(super) async fn in_turn(&self, link: &Arc<Link>, call: Call<'_>) -> Option<Step> {
        if !self.batches_on(link) {
            return None;
        }
        let Some(conn) = link.conn.load_full() else {
            return Some(Step::Failed(Failure::NotConnected));
        };
        let wire = &conn.wire;
        if wire.start_reading() {
            let reader = read_on(self.clone(), Arc::clone(link), Arc::downgrade(&conn));
            drop(wire.runtime.spawn(reader));
            if let Some(watcher) = &wire.watcher {
                let watch = watch_over(self.clone(), Arc::clone(link), Arc::downgrade(&conn));
                drop(watcher.spawn(watch));
            }
        }
        let mut told = {
            let mut state = wire.lock();
            if state.bytes.dead {
                // Ended alone while idle ([`Link::batches_closed_alone`]): alone on the checks'
                // socket until the connector makes it again.
                if link.holds(&conn) {
                    link.wake.notify_one();
                    return None;
                }
                return Some(Step::Failed(Failure::NotConnected));
            }
            // Idle for a second at least and ended, its end not read yet (Redis's idle
            // `timeout`: before its first batch, or just now): this decision goes alone, on
            // redis-rs's socket (one across slots is then split in two calls, as when batches
            // are off); the reader, started now if it was not, takes the end, and the
            // batches' socket is made again ([`Link::batches_closed_alone`]).
            if !state.batches.deciding()
                && super::link::idle_since(state.batches.sent_us())
                && wire.peer_closed()
            {
                link.wake.notify_one();
                return None;
            }
            let batches = &mut state.batches;
            // A call across slots can only go in a batch (`Failure::Split`).
            if !call.across && batches.waits_too_long(call.deadline_us) {
                return None;
            }
            if batches.busy
                && batches.queue.waiting.len() >= batches.compact_at.max(QUEUE_COMPACT_AT)
            {
                compact(batches);
                // Decisions that still wait stay; the next look is when as many more came.
                batches.compact_at = 2 * batches.queue.waiting.len();
            }
            let told = batches.queue.push(call);
            if !state.batches.busy {
                if let Err(cause) = self.send_next(link, wire, &mut state) {
                    self.lose(link, &conn, state, cause);
                }
            }
            told
        };
        // A connection still registered with the store's thread (opened before a decision
        // showed the proxy's runtime) is read by its reader task there the moment the answer
        // comes; waiting on its readiness from here would only wake this task once more.
        if !wire.on_workers {
            return step_of(told.await);
        }
        loop {
            tokio::select! {
                biased;
                answer = &mut told => return step_of(answer),
                ready = wire.readable() => match ready {
                    // A connection that broke stays readable (its end): whoever saw it break
                    // tells every decision, this one included.
                    Ok(()) if !self.pump(link, &conn, Look::Ready) => return step_of(told.await),
                    Ok(()) => {}
                    Err(_) => return Some(Step::Failed(Failure::ConnectionLost)),
                },
            }
        }
    }

    /// Reads what the node answered, tells each decision of an answered batch its part, and
    /// sends what waits. Whoever runs first after the socket turns readable calls it; the
    /// others find the connection's lock free and nothing to read. False when the connection
    /// is broken.
    fn pump(&self, link: &Arc<Link>, conn: &Arc<Conn>, look: Look) -> bool {
        let wire = &conn.wire;
        let mut state = wire.lock();
        if state.bytes.dead {
            return false;
        }
        let mut answered = None;
        if let Err(cause) = self.take_replies(link, wire, &mut state, &mut answered, look) {
            drop(state);
            if let Some(batch) = answered {
                self.deliver(link, batch);
            }
            self.lose(link, conn, wire.lock(), cause);
            return false;
        }
        drop(state);
        // The decisions are told outside the lock: waking each one (on another thread, as
        // often as not) must not keep the workers from queueing the next batch meanwhile.
        if let Some(batch) = answered {
            let emptied = self.deliver(link, batch);
            wire.lock().batches.recycle(emptied);
        }
        true
    }

    fn take_replies(
        &self,
        link: &Arc<Link>,
        wire: &Arc<Wire>,
        state: &mut WireState,
        answered: &mut Option<Answered>,
        look: Look,
    ) -> io::Result<()> {
        // An answer read together with the connection's end is still an answer.
        let open = wire.receive(&mut state.bytes, look)?;
        let broken = |e: String| io::Error::new(io::ErrorKind::InvalidData, e);
        while let Some((reply, used)) = next_reply(&state.bytes.input).map_err(broken)? {
            let got = Got::of(reply);
            state.bytes.input.drain(..used);
            let Some(expect) = state.batches.expect.pop_front() else {
                return Err(broken("redis answered a call that was not made".into()));
            };
            if let Some(batch) = self.answered(link, wire, state, expect, got)? {
                // One call is in flight at a time: a second answer in one read would be a
                // reply to a call never made.
                if answered.replace(batch).is_some() {
                    return Err(broken("redis answered two batches at once".into()));
                }
            }
        }
        if !open {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "redis closed the connection",
            ));
        }
        if !state.batches.busy {
            self.send_next(link, wire, state)?;
        }
        Ok(())
    }

    /// Acts on one reply; an answered batch is returned, to be told outside the lock.
    fn answered(
        &self,
        link: &Arc<Link>,
        wire: &Arc<Wire>,
        state: &mut WireState,
        expect: Expect,
        got: Got,
    ) -> io::Result<Option<Answered>> {
        let batches = &mut state.batches;
        let reloaded = match expect {
            Expect::Load => {
                match got {
                    Got::Bulk(_) => link.turns.accept(),
                    Got::Error(e) => link.turns.refuse(&link.node(), &e),
                    Got::Line(l) => link.turns.refuse(&link.node(), &l),
                }
                return Ok(None);
            }
            Expect::Batch { reloaded } => reloaded,
        };
        let told = match got {
            Got::Bulk(bytes) => Told::Parts(bytes),
            Got::Error(e) => {
                let code = e.split(' ').next().unwrap_or("");
                // A redirect, or a script the node refused to load: each goes its own way. So
                // does a cluster batch that met a replica (a primary demoted since the map was
                // read): its keys were not declared, so it says READONLY, where each decision
                // on its own is sent on by `MOVED`.
                let refused = code == "NOSCRIPT" && link.turns.is_refused();
                let demoted = code == "READONLY" && link.in_cluster;
                if demoted {
                    self.ask_refresh();
                }
                if code == "MOVED" || code == "ASK" || refused || demoted {
                    Told::Alone
                } else if code == "NOSCRIPT" && !reloaded {
                    // One load, and the same batch again behind it, on this connection.
                    let script = self.inner.scripts.batch(link.in_cluster);
                    batches.out.clear();
                    wire::encode(
                        &mut batches.out,
                        [&b"SCRIPT"[..], b"LOAD", script.body().as_bytes()].into_iter(),
                    );
                    batches.append_in_flight(&script.sha, &link.clock, link.in_cluster);
                    batches.expect.push_back(Expect::Load);
                    batches.expect.push_back(Expect::Batch { reloaded: true });
                    wire.send(&mut state.bytes, &batches.out)?;
                    return Ok(None);
                } else {
                    Told::Error(e)
                }
            }
            Got::Line(line) => {
                tracing::error!(reply = %line, "the batch script answered an unexpected shape: this is a bug");
                Told::Failed(Failure::Rejected)
            }
        };
        batches.busy = false;
        let sent_us = batches.sent_us;
        batches.note_round_trip(sent_us);
        let queue = std::mem::take(&mut batches.in_flight);
        Ok(Some(Answered {
            queue,
            told,
            sent_us: batches.sent_us,
        }))
    }

    /// Tells each decision of an answered batch what it came to; returns the emptied queue.
    fn deliver(&self, link: &Link, batch: Answered) -> Queue {
        let Answered {
            mut queue,
            told,
            sent_us,
        } = batch;
        match told {
            Told::Parts(bytes) => self.answer_each(link, &mut queue, bytes, sent_us),
            Told::Alone => queue.tell_all(|| Answer::Alone),
            Told::Failed(f) => queue.tell_all(|| Answer::Failed(f)),
            Told::Error(e) => {
                let key =
                    String::from_utf8_lossy(queue.key(queue.waiting[0].keys.start)).into_owned();
                let failure = self.failed_reply(link, &key, &e);
                queue.tell_all(|| Answer::Failed(failure));
            }
        }
        queue.clear();
        queue
    }

    /// Sends the decisions that wait, up to `batch_max`, as one call; with none, the
    /// connection's turn is free.
    fn send_next(&self, link: &Link, wire: &Arc<Wire>, state: &mut WireState) -> io::Result<()> {
        let batches = &mut state.batches;
        let max = self.batch_max().max(1);
        loop {
            if batches.queue.is_empty() {
                batches.busy = false;
                return Ok(());
            }
            let taken = take(&mut batches.queue, &mut batches.spare, max);
            batches.compact_at = 0;
            batches.spare = std::mem::replace(&mut batches.in_flight, taken);
            // Decisions that gave up while waiting are not sent: nobody would read their
            // answer.
            batches.in_flight.waiting.retain(|w| !w.tx.is_closed());
            if !batches.in_flight.is_empty() {
                break;
            }
            batches.in_flight.clear();
        }
        self.inner
            .batch_size
            .observe(batches.in_flight.waiting.len() as f64);
        let script = self.inner.scripts.batch(link.in_cluster);
        batches.out.clear();
        batches.append_in_flight(&script.sha, &link.clock, link.in_cluster);
        batches.expect.push_back(Expect::Batch { reloaded: false });
        batches.busy = true;
        batches.sent = batches.sent.wrapping_add(1);
        if batches.watch_asleep {
            batches.watch_asleep = false;
            wire.watch.notify_one();
        }
        wire.send(&mut state.bytes, &batches.out)
    }

    /// The connection broke under its decisions: each one fails as a lost connection (its
    /// loss counted once, by [`Link::forget`]).
    fn lose(
        &self,
        link: &Link,
        conn: &Arc<Conn>,
        mut state: MutexGuard<'_, WireState>,
        cause: io::Error,
    ) {
        state.bytes.dead = true;
        let deciding = state.batches.deciding();
        // Closed by the node (not reset, not failed), nothing on it, none sent within the
        // last second: closed for idleness, perhaps alone.
        let idle = !deciding
            && cause.kind() == io::ErrorKind::UnexpectedEof
            && super::link::idle_since(state.batches.sent_us());
        conn.lost_deciding.store(deciding, Ordering::Release);
        (conn.sent_us).fetch_max(state.batches.sent_us, Ordering::Relaxed);
        let mut batches = std::mem::take(&mut state.batches);
        drop(state);
        if deciding {
            link.lost_under(conn);
        }
        batches
            .in_flight
            .tell_all(|| Answer::Failed(Failure::ConnectionLost));
        batches
            .queue
            .tell_all(|| Answer::Failed(Failure::ConnectionLost));
        if idle && link.batches_closed_alone(conn) {
            tracing::info!(node = %link.node(), error = %cause, "redis closed the batches' connection while it was idle (its idle timeout, a kill); made again alone, the other kept");
            return;
        }
        link.forget(conn, &cause, deciding);
    }

    /// Tells each decision its part of the batch's answer, or its own error. (A decision
    /// that gave up meanwhile has dropped its receiver: its answer goes nowhere.)
    fn answer_each(&self, link: &Link, queue: &mut Queue, bytes: Vec<u8>, sent_us: u64) {
        let bytes = Arc::new(bytes);
        let Some(parts) = answer_parts(&bytes, queue.waiting.len()) else {
            tracing::error!(
                decisions = queue.waiting.len(),
                "the batch script answered a different number of decisions: this is a bug"
            );
            queue.tell_all(|| Answer::Failed(Failure::Rejected));
            return;
        };
        let mut sampled = false;
        let mut waiting = std::mem::take(&mut queue.waiting);
        for (range, w) in parts.zip(waiting.drain(..)) {
            if !sampled {
                sampled = link.clock.note(&bytes[range.clone()], sent_us);
            }
            let answer = match bytes[range.clone()].strip_prefix(b"E ") {
                None => Answer::Reply(Arc::clone(&bytes), range),
                Some(error) if link.in_cluster && not_served_here(error) => {
                    // Nothing was written: it goes again on its own, and follows the
                    // redirect; the map is read again.
                    self.ask_refresh();
                    Answer::Alone
                }
                Some(error) => {
                    let error = String::from_utf8_lossy(error);
                    let (error, at) = key_of_error(&error, w.keys.len());
                    let key = String::from_utf8_lossy(queue.key(w.keys.start + at));
                    Answer::Failed(self.failed_reply(link, &key, error))
                }
            };
            let Waiting {
                tx,
                keys,
                args,
                give_back,
                ..
            } = w;
            if let Err(Answer::Reply(bytes, range)) = tx.send(answer) {
                // Nobody waits for it: the decision gave up (its request was refused by its
                // fail mode) or its request is gone. What it was charged is given back.
                let replies = ScriptReply::parse_many(&bytes[range], keys.len());
                let admitted = (replies.as_ref()).is_some_and(|r| r.iter().all(|r| r.allowed));
                let charged_at = (replies.as_ref())
                    .and_then(|r| r.first())
                    .map_or(0, |r| r.now_us);
                if give_back && admitted {
                    if let Some((keys, args)) = queue.refund_of(keys, args, charged_at) {
                        self.give_back(keys, args);
                    }
                }
            }
        }
        queue.waiting = waiting;
    }

    /// Gives back what a decision answered too late was charged, off the request path: in
    /// one call per slot (a decision across slots of its node was charged in a batch, which
    /// a give-back, sent on its own, may not get).
    pub(super) fn give_back(&self, keys: Vec<String>, args: Vec<u64>) {
        let store = self.clone();
        drop(self.runtime.spawn(async move {
            for (keys, args) in by_slot(&keys, &args) {
                match store.evaluate_limits_late(&keys, &args).await.outcome {
                    Ok(_) => {
                        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
                        store.gave_back(&keys);
                        tracing::debug!("gave back an admission answered after its decision gave up");
                    }
                    Err(e) => tracing::warn!(cause = ?e, "could not give back an admission answered after its decision gave up"),
                }
            }
        }));
    }
}

/// The several-limits script's arguments that give a decision's charge back, from the
/// decision's arguments as a batch holds them (its kind's code, then, for several limits, its
/// key count and mode, then its arguments) and the time Redis charged it (its answer's
/// `now`); `None` when it charged nothing whatever its answer (a peek, a refund, a charge).
pub(super) fn refund_args(args: &[u64], charged_at_us: u64) -> Option<Vec<u64>> {
    let refund = crate::limiter::mode::refund(charged_at_us);
    match args {
        limit @ [1 | 2, ..] => Some([&[refund][..], limit].concat()),
        [3, _, mode, limits @ ..] if *mode == crate::limiter::mode::DECIDE => {
            Some([&[refund][..], limits].concat())
        }
        _ => None,
    }
}

/// A decision's arguments as a batch holds them ([`refund_args`]).
pub(super) fn as_queued(call: &Call<'_>) -> Vec<u64> {
    let mut args = vec![kind_code(call.kind)];
    if call.kind == ScriptKind::Limits {
        args.push(call.keys.len() as u64);
    }
    args.extend_from_slice(call.args);
    args
}

/// A several-limits call's `keys` and `args` (its mode, then four arguments a key) as one
/// call per slot, in the order the slots first come.
fn by_slot<'a>(keys: &'a [String], args: &[u64]) -> Vec<(Vec<&'a str>, Vec<u64>)> {
    let mut calls: Vec<(u16, Vec<&str>, Vec<u64>)> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let slot = super::slot(key.as_bytes());
        let limit = args.get(1 + 4 * i..5 + 4 * i).unwrap_or_default();
        match calls.iter_mut().find(|(s, ..)| *s == slot) {
            Some((_, keys, args)) => {
                keys.push(key);
                args.extend_from_slice(limit);
            }
            None => calls.push((slot, vec![key], [&args[..1], limit].concat())),
        }
    }
    calls.into_iter().map(|(_, k, a)| (k, a)).collect()
}

/// Whether a cluster batch's decision failed on a key whose slot the node does not serve
/// (moved away, migrating and not here, or served by no node): Redis's words for it inside a
/// script, whose keys were not declared, where a call of its own would have been answered
/// `MOVED`, `ASK` or `CLUSTERDOWN`.
fn not_served_here(error: &[u8]) -> bool {
    const WORDS: [&[u8]; 2] = [
        b"attempted to access a non local key",
        b"attempted to access a slot not served",
    ];
    WORDS
        .iter()
        .any(|words| error.windows(words.len()).any(|w| w == *words))
}

/// The connection's reader task: reads answers when no decision is waiting for one, and
/// notices the node closing the connection while it is idle. Ends when the connection is
/// let go or breaks.
async fn read_on(store: Store, link: Arc<Link>, conn: Weak<Conn>) {
    let Some(wire) = conn.upgrade().map(|c| Arc::clone(&c.wire)) else {
        return;
    };
    loop {
        tokio::select! {
            ready = wire.readable() => if ready.is_err() { return },
            _ = wire.closing.notified() => return,
        }
        let Some(conn) = conn.upgrade() else {
            return;
        };
        if !store.pump(&link, &conn, Look::Ready) {
            return;
        }
    }
}

/// Least time between two attempts to replace one node's silent connection; doubled by each
/// attempt dropped since the last that replaced one, up to [`REPLACE_SILENT_AT_MOST`].
const REPLACE_SILENT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
const REPLACE_SILENT_AT_MOST: std::time::Duration = std::time::Duration::from_secs(32);

impl Store {
    /// A decision on `link` timed out with a batched call unanswered: Redis is slow, or the
    /// connection's peer is gone without a word (a host gone, a failover to another address
    /// behind the same name, a firewall or NAT that forgot the connection), which no reset
    /// will ever say. A new connection is opened beside it in the background
    /// ([`Self::replace_silent`]): one attempt a node at a time, the next a second later at
    /// the soonest, and later still after each attempt that found Redis only slow.
    pub(super) fn replace_if_silent(&self, link: &Arc<Link>) {
        // Looked at first: under a slow Redis every decision times out, and most find an
        // attempt made (or its pause running) without taking the connection's lock.
        if link.replacing.load(Ordering::Relaxed)
            || !self.batches_on(link)
            || link.moving.load(Ordering::Relaxed)
        {
            return;
        }
        let Some(conn) = link.conn.load_full() else {
            return;
        };
        let Some(call) = conn.wire.lock().batches.unanswered_call() else {
            return;
        };
        if link.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        let store = self.clone();
        let link = Arc::clone(link);
        // On the store's thread, where the connector makes its connections.
        self.runtime().spawn(async move {
            let replaced = store.replace_silent(&link, &conn, call).await;
            drop(conn);
            let misses = if replaced {
                link.replace_misses.store(0, Ordering::Relaxed);
                0
            } else {
                link.replace_misses.fetch_add(1, Ordering::Relaxed) + 1
            };
            let pause = REPLACE_SILENT_EVERY
                .saturating_mul(1 << misses.min(5))
                .min(REPLACE_SILENT_AT_MOST);
            tokio::time::sleep(pause).await;
            link.replacing.store(false, Ordering::Release);
        });
    }

    /// Opens a new connection to `link`'s node; when Redis has answered its set-up (several
    /// round trips) while `old`'s call `call` is still unanswered, even read now, it is not
    /// Redis that is slow (a Redis that answers in order answers the old call first): the
    /// new connection takes `old`'s place (which is let go once answered, or after the
    /// longest wait). The breaker is left to count as before: what opened it is probed on
    /// the new connection when its quarantine ends. A Redis that is stopped or out of reach
    /// makes no new connection, and nothing changes. Whether it replaced `old`.
    async fn replace_silent(&self, link: &Arc<Link>, old: &Arc<Conn>, call: u64) -> bool {
        let target = link.target.load_full();
        let Some((fresh, wire)) = self.inner.connector.fresh(link, &target).await else {
            return false;
        };
        let held = link.conn.load_full();
        if !held.is_some_and(|c| Arc::ptr_eq(&c, old))
            || !Arc::ptr_eq(&target, &link.target.load_full())
            || !self.pump(link, old, Look::Now)
        {
            // Replaced, moved or lost meanwhile: the connector or a probe made a new one.
            return false;
        }
        if old.wire.lock().batches.unanswered_call() != Some(call) {
            return false;
        }
        if !self
            .inner
            .connector
            .install_fresh(link, old, fresh, wire)
            .await
        {
            return false;
        }
        tracing::warn!(node = %target.node, "a redis connection left a call unanswered while a new one was answered at once (a peer gone without a word, or a Redis that answers other connections first); the new connection replaces it");
        true
    }
}

/// How often the store's thread looks at a connection the workers read (the default, with
/// the socket on the workers): a call in flight at one look and still in flight at the next
/// may have its answer waiting behind the workers' queue, and is read from here. A
/// decision's timer fires only after its own task is polled, which polls its answer
/// first: an answer read in time is never a timeout, however long the workers' queue.
const WATCH_EVERY: std::time::Duration = std::time::Duration::from_millis(1);

/// Looks without a call in flight after which the watch sleeps until the next call.
const WATCH_IDLE_LOOKS: u32 = 100;

/// The watch over a connection the workers read, on the store's thread: every
/// [`WATCH_EVERY`], a call in flight since the previous look is read from here. Sleeps while
/// the connection is idle (the next call wakes it); ends when the connection is let go or
/// breaks.
async fn watch_over(store: Store, link: Arc<Link>, conn: Weak<Conn>) {
    let Some(wire) = conn.upgrade().map(|c| Arc::clone(&c.wire)) else {
        return;
    };
    let mut seen = None;
    let mut idle = 0;
    loop {
        let (late, asleep) = {
            let mut state = wire.lock();
            if state.bytes.dead {
                return;
            }
            let batches = &mut state.batches;
            if batches.busy {
                idle = 0;
                let late = seen == Some(batches.sent);
                seen = Some(batches.sent);
                (late, false)
            } else {
                seen = None;
                idle += 1;
                if idle >= WATCH_IDLE_LOOKS {
                    batches.watch_asleep = true;
                }
                (false, batches.watch_asleep)
            }
        };
        if late {
            let Some(conn) = conn.upgrade() else {
                return;
            };
            if !store.pump(&link, &conn, Look::Now) {
                return;
            }
            // Still unanswered, and late: what waits for the next call goes on its own now.
            let released = wire.lock().batches.release_if_late(deadline::mono_us());
            for w in released.into_iter().flatten() {
                let _ = w.tx.send(Answer::Alone);
            }
        }
        if asleep {
            wire.watch.notified().await;
            idle = 0;
        } else {
            tokio::time::sleep(WATCH_EVERY).await;
        }
    }
}

/// A batch whose answer came, and what its decisions are to be told.
struct Answered {
    queue: Queue,
    told: Told,
    /// When the call was sent ([`deadline::mono_us`]): its answer's `now` less this is an
    /// upper bound of the node's clock offset.
    sent_us: u64,
}

enum Told {
    /// The answer: each decision its part.
    Parts(Vec<u8>),
    /// The call's error (`CODE detail`): each decision fails by it.
    Error(String),
    Failed(Failure),
    Alone,
}

/// A reply, owned.
enum Got {
    Bulk(Vec<u8>),
    /// `CODE detail`.
    Error(String),
    Line(String),
}

impl Got {
    fn of(reply: Resp<'_>) -> Self {
        match reply {
            Resp::Bulk(b) => Got::Bulk(b.to_vec()),
            Resp::Error(e) => Got::Error(String::from_utf8_lossy(e).into_owned()),
            Resp::Line(l) => Got::Line(String::from_utf8_lossy(l).into_owned()),
        }
    }
}

/// Drops the queued decisions that gave up, keeping the others in order.
fn compact(batches: &mut Batches) {
    drop(take_out(batches, |w| w.tx.is_closed()));
}

/// Takes the waiting decisions `out` picks out of the queue, the others keeping their order;
/// answers those taken.
fn take_out(batches: &mut Batches, out: impl Fn(&Waiting) -> bool) -> Vec<Waiting> {
    let mut kept = std::mem::take(&mut batches.spare);
    let mut queue = std::mem::take(&mut batches.queue);
    let mut taken = Vec::new();
    for w in std::mem::take(&mut queue.waiting) {
        if out(&w) {
            taken.push(w);
        } else {
            kept.adopt(&queue, w);
        }
    }
    queue.clear();
    batches.queue = kept;
    batches.spare = queue;
    taken
}

/// What a waiting decision does with what it was told: `None`, go alone, only when the
/// batch was never run. A connection let go with a batch in flight drops its decisions'
/// channels while the `EVALSHA` may still run in Redis: each of them is a timeout, never sent
/// a second time, or it would spend twice.
fn step_of(answer: Result<Answer, oneshot::error::RecvError>) -> Option<Step> {
    use super::eval::Reply;
    match answer {
        Ok(Answer::Reply(bytes, range)) => Some(Step::Reply(Reply::Part(bytes, range))),
        Ok(Answer::Failed(f)) => Some(Step::Failed(f)),
        Ok(Answer::Alone) => None,
        Err(_) => Some(Step::Failed(Failure::Timeout)),
    }
}

/// The first `max` waiting decisions, taken out of the queue with their keys and arguments;
/// `spare` (empty) takes their place.
fn take(queue: &mut Queue, spare: &mut Queue, max: usize) -> Queue {
    if queue.waiting.len() <= max {
        return std::mem::replace(queue, std::mem::take(spare));
    }
    let rest = queue.waiting.split_off(max);
    let mut kept = std::mem::take(spare);
    for w in rest {
        kept.adopt(queue, w);
    }
    std::mem::replace(queue, kept)
}

/// How many of a batch's limits a decision's own is looked for among (see [`Argv::index_of`]).
const LIMITS_LOOKED_AT: usize = 16;

/// `lua/batch.lua`'s arguments, put together from each decision's own (its kind first, as
/// the queue keeps them): every distinct limit of the batch once, then each decision as the
/// index of its limit (several limits: 0, the mode, their number and an index each). Kept
/// between batches, so that making them allocates nothing once it has held a large batch.
#[derive(Default)]
pub struct Argv {
    /// The batch's limits: kind, the two numbers of the limit, cost.
    limits: Vec<[u64; 4]>,
    decisions: Vec<u64>,
    argv: Vec<u64>,
}

impl Argv {
    /// The arguments of a batch of these decisions, none with a deadline.
    pub fn of<'a>(&mut self, decisions: impl Iterator<Item = &'a [u64]>) -> &[u64] {
        self.of_timed(decisions.map(|args| (0, args)))
    }

    /// The arguments of a batch of these decisions, each with its deadline in the node's
    /// time (0: none).
    pub fn of_timed<'a>(&mut self, decisions: impl Iterator<Item = (u64, &'a [u64])>) -> &[u64] {
        self.limits.clear();
        self.decisions.clear();
        for (deadline, args) in decisions {
            self.decisions.push(deadline);
            match *args {
                [3, n, mode, ref each @ ..] => {
                    self.decisions.extend([0, mode, n]);
                    for limit in each.chunks_exact(4) {
                        let index = self.index_of([limit[0], limit[1], limit[2], limit[3]]);
                        self.decisions.push(index);
                    }
                }
                [kind, x, y, cost] => {
                    let index = self.index_of([kind, x, y, cost]);
                    self.decisions.push(index);
                }
                _ => unreachable!("the queue keeps four arguments a limit"),
            }
        }
        self.argv.clear();
        self.argv.push(self.limits.len() as u64);
        self.argv.extend(self.limits.iter().flatten());
        self.argv.extend_from_slice(&self.decisions);
        &self.argv
    }

    /// The index (from 1) of `limit` among the batch's limits, added when new. A batch
    /// mostly holds the limits of a few routes, so a look along the first
    /// [`LIMITS_LOOKED_AT`] beats a map; past them (response charges, each of its own cost,
    /// say) a limit is sent again rather than looked for, so that a batch of a thousand
    /// distinct limits costs a thousand pushes, not half a million comparisons.
    fn index_of(&mut self, limit: [u64; 4]) -> u64 {
        let known = self.limits.len().min(LIMITS_LOOKED_AT);
        let at = match self.limits[..known].iter().position(|l| *l == limit) {
            Some(at) => at,
            None => {
                self.limits.push(limit);
                self.limits.len() - 1
            }
        };
        at as u64 + 1
    }
}

/// Appends the batch's `EVALSHA` of the script `sha` to `out`: every decision's keys, then
/// the arguments [`Argv::of`] put together. `in_cluster` (a Redis Cluster node's batch,
/// `BATCH_CLUSTER_LUA`): no key declared, the keys' number and the keys leading the
/// arguments.
pub fn command<'a>(
    out: &mut Vec<u8>,
    sha: &str,
    keys: impl Iterator<Item = &'a [u8]> + Clone,
    argv: &[u64],
    in_cluster: bool,
) {
    let n_keys = keys.clone().count() as u64;
    let count = 3 + n_keys + argv.len() as u64 + u64::from(in_cluster);
    wire::header(out, b'*', count);
    wire::bulk(out, b"EVALSHA");
    wire::bulk(out, sha.as_bytes());
    if in_cluster {
        wire::bulk_u64(out, 0);
    }
    wire::bulk_u64(out, n_keys);
    for key in keys {
        wire::bulk(out, key);
    }
    for a in argv {
        wire::bulk_u64(out, *a);
    }
}

/// Where each of the `n` decisions' answers lies in a batch's answer (they are joined by
/// newlines), in order; `None` when there are not `n` of them.
pub fn answer_parts(bytes: &[u8], n: usize) -> Option<impl Iterator<Item = Range<usize>> + '_> {
    let newlines = bytes.iter().filter(|b| **b == b'\n').count();
    if newlines + 1 != n {
        return None;
    }
    let mut start = 0;
    let ends = bytes
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == b'\n')
        .map(|(i, _)| i)
        .chain([bytes.len()]);
    Some(ends.map(move |end| {
        let part = start..end;
        start = end + 1;
        part
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_answer_splits_into_one_part_per_decision() {
        let answer = b"1 5 0 1 100 0\nE WRONGTYPE Operation\n0 0 3 9 100 2500000 1 4 0 1 100 0";
        let parts = answer_parts(answer, 3).expect("three parts");
        let text: Vec<&[u8]> = parts.map(|r| &answer[r]).collect();
        assert_eq!(
            text,
            [
                &b"1 5 0 1 100 0"[..],
                b"E WRONGTYPE Operation",
                b"0 0 3 9 100 2500000 1 4 0 1 100 0"
            ]
        );
        assert!(
            answer_parts(answer, 2).is_none(),
            "a count that differs is refused"
        );
        let empty: Vec<Range<usize>> = answer_parts(b"", 1).unwrap().collect();
        assert_eq!(empty.len(), 1);
        assert!(empty[0].is_empty(), "one empty answer");
    }

    #[test]
    fn a_batch_that_gave_up_never_sends_its_decisions_again() {
        use super::super::eval::Step;
        let (tx, rx) = oneshot::channel::<Answer>();
        drop(tx);
        let told = rx.blocking_recv();
        assert!(
            matches!(step_of(told), Some(Step::Failed(Failure::Timeout))),
            "a dropped answer is a timeout: the batch may still run in Redis"
        );
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(Answer::Alone);
        assert!(
            step_of(rx.blocking_recv()).is_none(),
            "a batch never run (redirected, refused) sends its decisions alone"
        );
    }

    #[test]
    fn the_command_carries_every_key_then_each_limit_once_then_the_decisions() {
        let keys = [&b"k1"[..], b"k2", b"k3", b"k4"];
        let args = [
            &[1u64, 10, 20, 30][..],
            &[3, 2, 0, 1, 10, 20, 30, 2, 5, 6, 1],
            &[2, 5, 6, 1],
        ];
        let mut argv = Argv::default();
        let mut out = Vec::new();
        command(
            &mut out,
            "abc",
            keys.iter().copied(),
            argv.of_timed([7, 0, 9].into_iter().zip(args.iter().copied())),
            false,
        );
        let packed = String::from_utf8(out).unwrap();
        assert!(packed.starts_with("*26\r\n"), "{packed}");
        let words: Vec<&str> = packed
            .split("\r\n")
            .filter(|w| !w.starts_with(['*', '$']))
            .collect();
        assert_eq!(&words[..7], ["EVALSHA", "abc", "4", "k1", "k2", "k3", "k4"]);
        assert_eq!(
            words[7..words.len() - 1].join(" "),
            "2 1 10 20 30 2 5 6 1 7 1 0 0 0 2 1 2 9 2",
            "two limits, each once; the decisions, each after its deadline, name them"
        );
        // A cluster node's: no key declared, the keys leading the arguments.
        let mut clustered = Vec::new();
        command(
            &mut clustered,
            "abc",
            keys.iter().copied(),
            argv.of_timed([7, 0, 9].into_iter().zip(args.iter().copied())),
            true,
        );
        let clustered = String::from_utf8(clustered).unwrap();
        assert!(clustered.starts_with("*27\r\n"), "{clustered}");
        let words: Vec<&str> = clustered
            .split("\r\n")
            .filter(|w| !w.starts_with(['*', '$']))
            .collect();
        assert_eq!(
            &words[..8],
            ["EVALSHA", "abc", "0", "4", "k1", "k2", "k3", "k4"]
        );
        assert_eq!(
            words[8..words.len() - 1].join(" "),
            "2 1 10 20 30 2 5 6 1 7 1 0 0 0 2 1 2 9 2"
        );
        let many: Vec<[u64; 4]> = (0..40).map(|cost| [1, 10, 20, cost % 20]).collect();
        let sent = argv.of(many.iter().map(|l| &l[..])).to_vec();
        let limits = sent[0] as usize;
        assert!(
            limits > 20 && limits <= 40,
            "past the first ones a limit may be sent again: {limits}"
        );
        for (d, pair) in sent[1 + 4 * limits..].chunks(2).enumerate() {
            assert_eq!(pair[0], 0, "no deadline");
            let at = 1 + 4 * (pair[1] as usize - 1);
            assert_eq!(
                sent[at..at + 4],
                many[d],
                "decision {d} names its own limit"
            );
        }
        let again: Vec<u64> = argv.of([&[2u64, 5, 6, 1][..]].into_iter()).to_vec();
        assert_eq!(
            again,
            [1, 2, 5, 6, 1, 0, 1],
            "nothing of the last batch is kept"
        );
    }

    #[test]
    fn a_give_back_across_slots_goes_slot_by_slot_with_each_keys_arguments() {
        // Two keys of one hash tag and one of another: two calls, each with the mode first
        // and its keys' four arguments each, in order.
        let keys: Vec<String> = ["{a}:burst", "{b}:ceiling", "{a}:daily"]
            .map(String::from)
            .into();
        let args = [1, 1, 10, 11, 12, 2, 20, 21, 22, 1, 30, 31, 32];
        let calls = by_slot(&keys, &args);
        assert_eq!(
            calls,
            [
                (
                    vec!["{a}:burst", "{a}:daily"],
                    vec![1, 1, 10, 11, 12, 1, 30, 31, 32]
                ),
                (vec!["{b}:ceiling"], vec![1, 2, 20, 21, 22]),
            ]
        );
        // One slot: one call, as it came.
        assert_eq!(
            by_slot(&keys[..1], &args[..5]),
            [(vec!["{a}:burst"], args[..5].to_vec())]
        );
    }
}
