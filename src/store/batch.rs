//! Decisions in flight together on one node share one call (contract section 14).
//!
//! Each link has a queue and at most one call in flight. A decision joins the queue; when no
//! call is in flight it also starts the link's sender, a task that takes everything waiting
//! and sends it as one `EVALSHA` of `lua/batch.lua`, which decides the decisions in order and
//! answers each; when the answer is in, it takes what queued meanwhile, and so on until the
//! queue is empty. A decision alone goes out at once, in a batch of one: nothing waits for
//! company, no timer.
//!
//! The sender runs where the connections are driven: on the store's own thread by default
//! (`[redis] dedicated_io_thread`), so that on saturated proxy workers a batch's answer is
//! read and handed out the moment Redis gives it, and only each request's own wake-up
//! queues; otherwise on the proxy's workers.
//!
//! Each decision keeps its own deadline (it stops waiting at it and is a timeout, whatever
//! the batch does after), its own reason (a broken key fails its own decision only: the
//! script runs each under `pcall`) and its own exact outcome. A failure of the call itself
//! (a lost connection, `OOM`, a timeout) is each waiting decision's failure. `NOSCRIPT` loads
//! the batch script once per batch. A redirect (`MOVED`, `ASK`) sends every decision of the
//! batch its own way, as if it had been alone; so does a Redis that refuses the batch script
//! (a cluster older than Redis 7, which cannot declare `allow-cross-slot-keys`).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use redis::Value;
use tokio::sync::oneshot;

use super::connect::is_transport;
use super::eval::{classify, redirect, Call};
use super::link::Link;
use super::script::{Script, ScriptKind};
use super::Store;
use crate::decision::Failure;

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

/// A decision waiting for the next call.
struct Waiting {
    tx: oneshot::Sender<Answer>,
    deadline: Instant,
    /// Its keys in [`Queue::keys`] (by index into `key_ends`) and its arguments in
    /// [`Queue::args`], kind first.
    keys: Range<usize>,
    args: Range<usize>,
}

/// The decisions waiting for the next call, their keys and arguments back to back: nothing
/// is allocated per decision but its answer's channel.
#[derive(Default)]
pub(super) struct Queue {
    waiting: Vec<Waiting>,
    keys: Vec<u8>,
    key_ends: Vec<usize>,
    args: Vec<u64>,
}

impl Queue {
    fn push(&mut self, call: Call<'_>, deadline: Instant) -> oneshot::Receiver<Answer> {
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
            deadline,
            keys: first_key..self.key_ends.len(),
            args: first_arg..self.args.len(),
        });
        rx
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
}

/// A link's turn-taking: whether a call is in flight, and who waits for the next one.
#[derive(Default)]
pub(super) struct Turns {
    state: Mutex<TurnState>,
    /// Redis refused the batch script: every decision on this link goes alone.
    refused: AtomicBool,
}

#[derive(Default)]
struct TurnState {
    busy: bool,
    queue: Queue,
    /// The last batch's queue, emptied: the next one fills it without allocating.
    spare: Queue,
}

impl Turns {
    fn lock(&self) -> MutexGuard<'_, TurnState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The node loaded the batch script (again: a Redis upgraded meanwhile, say).
    pub(super) fn accept(&self) {
        self.refused.store(false, Ordering::Relaxed);
    }

    /// The node refused the batch script: decisions on it are sent one by one.
    pub(super) fn refuse(&self, node: &str, error: &redis::RedisError) {
        if !self.refused.swap(true, Ordering::Relaxed) {
            tracing::warn!(node, error = %error, "redis refused the batch script; decisions on this node are sent one by one");
        }
    }
}

impl Store {
    /// Decides `call` in `link`'s next call. `None`: it must go on its own (see
    /// [`Answer::Alone`]; also when batching is off).
    pub(super) async fn in_turn(
        &self,
        link: &Arc<Link>,
        call: Call<'_>,
        deadline: Instant,
    ) -> Option<super::eval::Step> {
        let turns = &link.turns;
        if self.batch_max() <= 1 || turns.refused.load(Ordering::Relaxed) {
            return None;
        }
        let (answer, start) = {
            let mut state = turns.lock();
            let start = !state.busy;
            state.busy = true;
            (state.queue.push(call, deadline), start)
        };
        if start {
            let store = self.clone();
            let link = Arc::clone(link);
            let sender = async move { store.send_batches(&link).await };
            let proxy = tokio::runtime::Handle::try_current();
            match proxy {
                Ok(handle) if self.inner.connector.on_proxy_runtime() => drop(handle.spawn(sender)),
                _ => drop(self.runtime.spawn(sender)),
            }
        }
        step_of(answer.await)
    }

    /// Sends what waits, batch after batch, until nothing does.
    async fn send_batches(&self, link: &Arc<Link>) {
        let mut used: Option<Queue> = None;
        loop {
            let batch = {
                let mut state = link.turns.lock();
                if let Some(q) = used.take() {
                    state.spare = q;
                }
                if state.queue.is_empty() {
                    state.busy = false;
                    return;
                }
                let state = &mut *state;
                take(&mut state.queue, &mut state.spare, self.batch_max())
            };
            used = Some(self.send_batch(link, batch).await);
        }
    }

    /// One batch: one `EVALSHA` (and on `NOSCRIPT` one load and one retry), each decision
    /// told its answer.
    async fn send_batch(&self, link: &Arc<Link>, mut queue: Queue) -> Queue {
        // Decisions that gave up while waiting are not sent: nobody would read their answer.
        queue.waiting.retain(|w| !w.tx.is_closed());
        let Some(latest) = queue.waiting.iter().map(|w| w.deadline).max() else {
            queue.clear();
            return queue;
        };
        self.inner.batch_size.observe(queue.waiting.len() as f64);
        let script = self.inner.scripts.batch(link.in_cluster);
        let keys = queue
            .waiting
            .iter()
            .flat_map(|w| w.keys.clone())
            .map(|k| queue.key(k));
        let args = queue.waiting.iter().map(|w| &queue.args[w.args.clone()]);
        let cmd = command(&script.sha, keys, args);
        let first_key = queue.key(queue.waiting[0].keys.start);
        let outcome = tokio::time::timeout_at(
            latest.into(),
            self.call_batch(link, script, &cmd, first_key),
        )
        .await;
        match outcome {
            // Every decision's own deadline has passed: each already counted its timeout.
            Err(_) => {}
            Ok(Batched::Reply(bytes)) => self.answer_each(link, &mut queue, bytes),
            Ok(Batched::Failed(f)) => {
                for w in queue.waiting.drain(..) {
                    let _ = w.tx.send(Answer::Failed(f));
                }
            }
            Ok(Batched::Alone) => {
                for w in queue.waiting.drain(..) {
                    let _ = w.tx.send(Answer::Alone);
                }
            }
        }
        queue.clear();
        queue
    }

    async fn call_batch(
        &self,
        link: &Arc<Link>,
        script: &Script,
        cmd: &redis::Cmd,
        first_key: &[u8],
    ) -> Batched {
        let first_key = &String::from_utf8_lossy(first_key);
        let Some(conn) = link.conn.load_full() else {
            return Batched::Failed(Failure::NotConnected);
        };
        let mut c = (*conn).clone();
        let mut reloaded = false;
        loop {
            let e = match cmd.query_async::<Value>(&mut c).await {
                Ok(Value::BulkString(bytes)) => return Batched::Reply(bytes),
                Ok(other) => {
                    tracing::error!(reply = ?other, "the batch script answered an unexpected shape: this is a bug");
                    return Batched::Failed(Failure::Rejected);
                }
                Err(e) => e,
            };
            if redirect(&e).is_some() {
                return Batched::Alone;
            }
            if classify(&e) != Failure::Noscript || reloaded {
                return Batched::Failed(self.failed(link, &conn, first_key, &e));
            }
            reloaded = true;
            match script.load(&mut c).await {
                Ok(()) => {}
                Err(e) if is_transport(&e) => {
                    return Batched::Failed(self.failed(link, &conn, first_key, &e))
                }
                Err(e) => {
                    link.turns.refuse(&link.node(), &e);
                    return Batched::Alone;
                }
            }
        }
    }

    /// Tells each decision its part of the batch's answer, or its own error. (A decision
    /// that gave up meanwhile has dropped its receiver: its answer goes nowhere.)
    fn answer_each(&self, link: &Link, queue: &mut Queue, bytes: Vec<u8>) {
        let bytes = Arc::new(bytes);
        let Some(parts) = answer_parts(&bytes, queue.waiting.len()) else {
            tracing::error!(
                decisions = queue.waiting.len(),
                "the batch script answered a different number of decisions: this is a bug"
            );
            for w in queue.waiting.drain(..) {
                let _ = w.tx.send(Answer::Failed(Failure::Rejected));
            }
            return;
        };
        let mut waiting = std::mem::take(&mut queue.waiting);
        for (range, w) in parts.zip(waiting.drain(..)) {
            let answer = match bytes[range.clone()].strip_prefix(b"E ") {
                None => Answer::Reply(Arc::clone(&bytes), range),
                Some(error) => {
                    let error = String::from_utf8_lossy(error);
                    let key = String::from_utf8_lossy(queue.key(w.keys.start));
                    Answer::Failed(self.failed_reply(link, &key, &error))
                }
            };
            let _ = w.tx.send(answer);
        }
        queue.waiting = waiting;
    }
}

/// What a waiting decision does with what it was told: `None`, go alone, only when the
/// batch was never run. A batch that gave up at its last deadline drops its channels while
/// its `EVALSHA` may still run in Redis: a member whose own timer has not fired yet (it is
/// set a moment later) is a timeout, never sent a second time, or it would spend twice.
fn step_of(answer: Result<Answer, oneshot::error::RecvError>) -> Option<super::eval::Step> {
    use super::eval::{Reply, Step};
    match answer {
        Ok(Answer::Reply(bytes, range)) => Some(Step::Reply(Reply::Part(bytes, range))),
        Ok(Answer::Failed(f)) => Some(Step::Failed(f)),
        Ok(Answer::Alone) => None,
        Err(_) => Some(Step::Failed(Failure::Timeout)),
    }
}

/// What a batch's call came to.
enum Batched {
    Reply(Vec<u8>),
    Failed(Failure),
    Alone,
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
        let first_key = kept.key_ends.len();
        for k in w.keys.clone() {
            kept.keys.extend_from_slice(queue.key(k));
            kept.key_ends.push(kept.keys.len());
        }
        let first_arg = kept.args.len();
        kept.args.extend_from_slice(&queue.args[w.args.clone()]);
        kept.waiting.push(Waiting {
            keys: first_key..kept.key_ends.len(),
            args: first_arg..kept.args.len(),
            ..w
        });
    }
    std::mem::replace(queue, kept)
}

/// The batch's `EVALSHA` of the script `sha`: every decision's keys, then every decision's
/// arguments (each led by its kind, as `lua/batch.lua` reads them).
pub fn command<'a>(
    sha: &str,
    keys: impl Iterator<Item = &'a [u8]> + Clone,
    args: impl Iterator<Item = &'a [u64]>,
) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(sha).arg(keys.clone().count());
    for key in keys {
        cmd.arg(key);
    }
    for a in args {
        cmd.arg(a);
    }
    cmd
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
    fn the_command_carries_every_key_before_every_argument() {
        let keys = [&b"k1"[..], b"k2", b"k3"];
        let args = [&[1u64, 10, 20, 30][..], &[3, 2, 0, 1, 1, 1, 1, 2, 1, 1, 1]];
        let cmd = command("abc", keys.iter().copied(), args.iter().copied());
        let packed = String::from_utf8(cmd.get_packed_command()).unwrap();
        let words: Vec<&str> = packed
            .split("\r\n")
            .filter(|w| !w.starts_with(['*', '$']))
            .collect();
        assert_eq!(&words[..6], ["EVALSHA", "abc", "3", "k1", "k2", "k3"]);
        assert_eq!(
            words[6..words.len() - 1].join(" "),
            "1 10 20 30 3 2 0 1 1 1 1 2 1 1 1"
        );
    }
}
