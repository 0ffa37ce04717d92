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
        use super::eval::{Reply, Step};
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
        match answer.await {
            Ok(Answer::Reply(bytes, range)) => Some(Step::Reply(Reply::Part(bytes, range))),
            Ok(Answer::Failed(f)) => Some(Step::Failed(f)),
            Ok(Answer::Alone) | Err(_) => None,
        }
    }

    /// Sends what waits, batch after batch, until nothing does.
    async fn send_batches(&self, link: &Arc<Link>) {
        loop {
            let batch = {
                let mut state = link.turns.lock();
                if state.queue.is_empty() {
                    state.busy = false;
                    return;
                }
                take(&mut state.queue, self.batch_max())
            };
            self.send_batch(link, batch).await;
        }
    }

    /// One batch: one `EVALSHA` (and on `NOSCRIPT` one load and one retry), each decision
    /// told its answer.
    async fn send_batch(&self, link: &Arc<Link>, mut queue: Queue) {
        // Decisions that gave up while waiting are not sent: nobody would read their answer.
        let live: Vec<Waiting> = std::mem::take(&mut queue.waiting)
            .into_iter()
            .filter(|w| !w.tx.is_closed())
            .collect();
        let Some(latest) = live.iter().map(|w| w.deadline).max() else {
            return;
        };
        self.inner.batch_size.observe(live.len() as f64);
        let script = self.inner.scripts.batch(link.in_cluster);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&script.sha)
            .arg(live.iter().map(|w| w.keys.len()).sum::<usize>());
        for w in &live {
            for k in w.keys.clone() {
                cmd.arg(queue.key(k));
            }
        }
        for w in &live {
            cmd.arg(&queue.args[w.args.clone()]);
        }
        let first_key = String::from_utf8_lossy(queue.key(live[0].keys.start)).into_owned();
        let outcome = tokio::time::timeout_at(
            latest.into(),
            self.call_batch(link, script, &cmd, &first_key),
        )
        .await;
        let answers = match outcome {
            // Every decision's own deadline has passed: each already counted its timeout.
            Err(_) => return,
            Ok(Batched::Reply(bytes)) => self.split(link, &queue, &live, bytes),
            Ok(Batched::Failed(f)) => live.iter().map(|_| Answer::Failed(f)).collect(),
            Ok(Batched::Alone) => live.iter().map(|_| Answer::Alone).collect(),
        };
        for (w, answer) in live.into_iter().zip(answers) {
            // A decision that gave up meanwhile has dropped its receiver.
            let _ = w.tx.send(answer);
        }
    }

    async fn call_batch(
        &self,
        link: &Arc<Link>,
        script: &Script,
        cmd: &redis::Cmd,
        first_key: &str,
    ) -> Batched {
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

    /// Each decision's part of the batch's answer, or its own error.
    fn split(&self, link: &Link, queue: &Queue, live: &[Waiting], bytes: Vec<u8>) -> Vec<Answer> {
        let bytes = Arc::new(bytes);
        let mut parts = Vec::with_capacity(live.len());
        let mut start = 0;
        let ends = bytes
            .iter()
            .enumerate()
            .filter(|(_, b)| **b == b'\n')
            .map(|(i, _)| i);
        for end in ends.chain([bytes.len()]) {
            parts.push(start..end);
            start = end + 1;
        }
        if parts.len() != live.len() {
            tracing::error!(
                answers = parts.len(),
                decisions = live.len(),
                "the batch script answered a different number of decisions: this is a bug"
            );
            return live
                .iter()
                .map(|_| Answer::Failed(Failure::Rejected))
                .collect();
        }
        parts
            .into_iter()
            .zip(live)
            .map(
                |(range, w)| match bytes[range.clone()].strip_prefix(b"E ") {
                    None => Answer::Reply(Arc::clone(&bytes), range),
                    Some(error) => {
                        let error = String::from_utf8_lossy(error);
                        let key = String::from_utf8_lossy(queue.key(w.keys.start));
                        Answer::Failed(self.failed_reply(link, &key, &error))
                    }
                },
            )
            .collect()
    }
}

/// What a batch's call came to.
enum Batched {
    Reply(Vec<u8>),
    Failed(Failure),
    Alone,
}

/// The first `max` waiting decisions, taken out of the queue with their keys and arguments.
fn take(queue: &mut Queue, max: usize) -> Queue {
    if queue.waiting.len() <= max {
        return std::mem::take(queue);
    }
    let rest = queue.waiting.split_off(max);
    let mut kept = Queue::default();
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
