//! Announcements every gateway of a fleet hears: a Redis pub/sub channel.
//!
//! An operator's `DELETE /limits` on one gateway deletes the identity's buckets in Redis,
//! which every gateway reads, but each gateway also remembers the denials Redis gave it (the
//! over-limit cache) and repeats them without asking. The gateway that deleted announces the
//! reset on a channel, and every gateway that remembers a denial listens and forgets it.
//!
//! A gateway listens only once it has remembered a denial (a gateway that never refused
//! holds no extra connection), on one connection of its own to the node the announcements
//! are published on (one Redis, Sentinel's master, the cluster primary serving the channel
//! name's slot). Each listener answers every announcement, once it has acted on it, on the
//! announcement's own reply channel, and the announcer waits (up to [`HEARD_WITHIN`]) for
//! as many answers as Redis said it had listeners (on a cluster, as many as listen on every
//! primary: while the channel's slot moves, some still listen on the node it left and hear
//! the announcement over the cluster bus): when the operator's `DELETE` is answered, every
//! gateway listening has forgotten the identity.
//!
//! The connection is pinged every few seconds (one that stopped answering is made again),
//! and the node looked at every quarter of a second (a failover, the channel's slot moved):
//! a subscription that ends is [`Heard::Lost`], and the gateway then forgets every
//! remembered denial and remembers none until it is [`Heard::Back`] (a message sent while
//! not listening cannot be read later). The first subscription, made at once, forgets
//! nothing (forgetting there would ask Redis again for the denial that made it listen):
//! instead the proxy answers the denials Redis gives before it is made only once it is made
//! or failed, within their budget (`overlimit::until_hearing`), so a reset asked for once a
//! client has such an answer is heard. The first attempt's end is told too
//! ([`Heard::Failed`]). A subscription Redis refuses ([`Heard::Refused`]) leaves the cache as
//! it was before there were announcements.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use rand::Rng;
use tokio::time::Instant;

use super::connect::{self, backoff, CONNECT_TIMEOUT};
use super::link::Link;
use super::{Store, ADMIN_TIMEOUT};

/// What an announcement learnt of its listeners ([`Store::announce`]): `None` where it could
/// not (the announcement failed; their answers could not be heard).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Announced {
    /// The gateways listening when it was published, as Redis counted them.
    pub listening: Option<u64>,
    /// Those that said they acted on it in time.
    pub heard: Option<u64>,
}

/// What a listener is told.
pub enum Heard<'a> {
    /// An announcement.
    Message(&'a str),
    /// The subscription is lost: until [`Heard::Back`], announcements go unheard.
    Lost,
    /// Subscribed; `missed`: announcements may have gone unheard since the first
    /// remembered denial (an attempt failed, or a subscription was lost).
    Back { missed: bool },
    /// Redis refuses the subscription (the ACL): announcements go unheard for good.
    Refused,
    /// An attempt to subscribe failed (no connection to the node, or no answer in time):
    /// tried again, and [`Heard::Back`] says `missed` once subscribed.
    Failed,
}

/// Told what the listener hears ([`Heard`]).
pub type Listener = Box<dyn Fn(Heard<'_>) + Send + Sync>;

/// How long [`Store::tell`] gathers what it is told before it publishes it.
const TELL_EVERY: Duration = Duration::from_millis(50);

/// What stands for the reply channel of a message that asks for no answer ([`Store::tell`]).
const NO_REPLY: &str = "-";

/// How long an announcement waits for its listeners to say they acted on it.
const HEARD_WITHIN: Duration = Duration::from_millis(250);

/// How long an announcement whose answers cannot be heard waits before the `DELETE` is
/// answered: listeners on this machine's network act on it in well under a millisecond.
const UNHEARD_GRACE: Duration = Duration::from_millis(10);

impl Store {
    /// Listens, on the store's runtime, to the channel `channel_of()` names once `wanted` is
    /// done, telling `listener` each announcement (and `None` when it
    /// may have missed some), and answering each once `listener` returned.
    pub fn listen(
        &self,
        channel_of: impl Fn() -> String + Send + Sync + 'static,
        wanted: impl std::future::Future<Output = ()> + Send + 'static,
        listener: Listener,
    ) {
        let store = self.clone();
        let node = move |channel: &str| store.link_for(channel).map(Cow::into_owned);
        let store = self.clone();
        let answering = Box::new(move |heard: Heard<'_>| {
            let Heard::Message(message) = heard else {
                listener(heard);
                return;
            };
            let Some((reply_to, body)) = message.split_once(' ') else {
                return;
            };
            listener(Heard::Message(body));
            if reply_to == NO_REPLY {
                return;
            }
            let (store, reply_to) = (store.clone(), reply_to.to_owned());
            tokio::spawn(async move {
                let _ = store.publish(&reply_to, "").await;
            });
        });
        self.runtime
            .spawn(listen(channel_of, wanted, node, answering));
    }

    /// Publishes `message` on `channel` to every gateway listening, and waits (up to
    /// [`HEARD_WITHIN`]) until each said it acted on it; best effort: a failure is logged
    /// (at INFO the first time), and what is known of who heard is returned.
    pub async fn announce(&self, channel: &str, message: &str) -> Announced {
        let nonce: u64 = rand::rng().random();
        let reply_to = format!("{channel}:{nonce:016x}");
        // Subscribed before the announcement goes, on the node the answers are published on.
        let replies = match self.link_for(&reply_to) {
            Some(link) => connect::subscribed(&link.target.load().dial, &reply_to).await,
            None => Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "no node serves the reply channel now",
            ))),
        };
        if let Err(e) = &replies {
            if !self.inner.replies_failed.swap(true, Ordering::Relaxed) {
                let hint = match e.code() {
                    Some("NOPERM") => {
                        " (the ACL user needs the channel pattern <key_prefix>:v1:resets*)"
                    }
                    _ => "",
                };
                tracing::info!(error = %super::Said(e), "cannot hear the other gateways say they heard a reset{hint}; a DELETE /limits is answered a few milliseconds after the announcement instead");
            }
        }
        // On a cluster, Redis counts only the publishing node's listeners; those still on
        // another node (the channel's slot just moved) hear it over the cluster bus.
        let elsewhere = self.listeners_on_every_node(channel).await;
        match self
            .publish(channel, &format!("{reply_to} {message}"))
            .await
        {
            Err(error) => {
                if !self.inner.announce_failed.swap(true, Ordering::Relaxed) {
                    let hint = match error.contains("NOPERM") {
                        true => " (the ACL user needs +publish and the channel)",
                        false => "",
                    };
                    tracing::info!(channel, error = %error, "could not announce a reset to the other gateways{hint}; their remembered denials of it last their wait");
                } else {
                    tracing::debug!(channel, error = %error, "could not announce a reset to the other gateways");
                }
                Announced::default()
            }
            Ok(listeners) => {
                let listeners = listeners.max(elsewhere).max(0) as u64;
                let Ok(replies) = replies else {
                    // Without their word, a moment for the listeners to act on it.
                    if listeners > 0 {
                        tokio::time::sleep(UNHEARD_GRACE).await;
                    }
                    return Announced {
                        listening: Some(listeners),
                        heard: None,
                    };
                };
                let mut replies = replies.into_on_message();
                let mut heard = 0;
                let hearing = async {
                    while heard < listeners && replies.next().await.is_some() {
                        heard += 1;
                    }
                };
                let _ = tokio::time::timeout(HEARD_WITHIN, hearing).await;
                Announced {
                    listening: Some(listeners),
                    heard: Some(heard),
                }
            }
        }
    }

    /// Publishes `message` on `channel` to every gateway listening, off the caller's path,
    /// asking for no answer: best effort, a failure said at DEBUG (what [`Store::announce`]
    /// does for a reset, without waiting for the listeners). What is told within
    /// [`TELL_EVERY`] goes out together, each message once, one line each: a burst of them
    /// (late answers come in bursts, from a Redis that is slow) is one `PUBLISH`.
    pub fn tell(&self, channel: String, message: String) {
        let mut told = self.inner.told.lock().unwrap_or_else(|p| p.into_inner());
        let first = told.is_empty();
        told.insert((channel, message));
        drop(told);
        if !first {
            return;
        }
        let store = self.clone();
        drop(self.runtime.spawn(async move {
            tokio::time::sleep(TELL_EVERY).await;
            let told =
                std::mem::take(&mut *store.inner.told.lock().unwrap_or_else(|p| p.into_inner()));
            let mut channels: Vec<&str> = told.iter().map(|(c, _)| c.as_str()).collect();
            channels.sort_unstable();
            channels.dedup();
            for channel in channels {
                let lines: Vec<&str> = (told.iter())
                    .filter(|(c, _)| c == channel)
                    .map(|(_, m)| m.as_str())
                    .collect();
                let message = format!("{NO_REPLY} {}", lines.join("\n"));
                if let Err(error) = store.publish(channel, &message).await {
                    tracing::debug!(channel, error = %error, "could not tell the other gateways");
                }
            }
        }));
    }

    /// How many listeners `channel` has on all a cluster's primaries together (0 with one
    /// Redis, whose `PUBLISH` counts them all), each asked within [`HEARD_WITHIN`].
    async fn listeners_on_every_node(&self, channel: &str) -> i64 {
        if !matches!(self.inner.layout, super::Layout::Cluster(_)) {
            return 0;
        }
        let asks = self.links().into_iter().map(|link| async move {
            let conn = link.conn.load_full()?;
            let mut c = conn.redis();
            let mut numsub = redis::cmd("PUBSUB");
            numsub.arg("NUMSUB").arg(channel);
            let ask = numsub.query_async::<(String, i64)>(&mut c);
            match tokio::time::timeout(HEARD_WITHIN, ask).await {
                Ok(Ok((_, n))) => Some(n),
                _ => None,
            }
        });
        futures_util::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .sum()
    }

    /// `PUBLISH`es `message` on `channel` on the node serving its name, within
    /// [`ADMIN_TIMEOUT`]: how many listeners Redis handed it to.
    async fn publish(&self, channel: &str, message: &str) -> Result<i64, String> {
        let conn = self
            .link_for(channel)
            .and_then(|l| l.conn.load_full())
            .ok_or_else(|| "not connected".to_owned())?;
        let mut c = conn.redis();
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(channel).arg(message);
        match tokio::time::timeout(ADMIN_TIMEOUT, publish.query_async::<i64>(&mut c)).await {
            Ok(Ok(listeners)) => Ok(listeners),
            Ok(Err(e)) => Err(super::Said(&e).to_string()),
            Err(_) => Err(format!("no answer within {} ms", ADMIN_TIMEOUT.as_millis())),
        }
    }
}

/// How often a listener looks whether its node or channel moved.
const LOOK_EVERY: Duration = Duration::from_millis(250);

/// Every this many looks, the listening connection is pinged.
const PING_EVERY_LOOKS: u32 = 20;

/// A subscription that lasted less than this was lost soon: the next one waits longer.
const LASTED: Duration = Duration::from_secs(1);

/// After Redis refused the subscription itself (an ACL without the channel or
/// `+subscribe`): the reason does not go away by retrying sooner.
const RETRY_REFUSED: Duration = Duration::from_secs(30);

/// Listens on the channel `channel_of()` names (followed when it changes) once `wanted` is
/// done, through a connection to the node `node(channel)` names, telling `listener` what
/// it hears.
async fn listen(
    channel_of: impl Fn() -> String + Sync,
    wanted: impl std::future::Future<Output = ()>,
    node: impl Fn(&str) -> Option<Arc<Link>> + Sync,
    listener: Listener,
) {
    wanted.await;
    let mut refused_said = false;
    // Announcements may have gone unheard: a subscription was lost, or an attempt failed.
    let mut missed = false;
    let mut attempt = 0u32;
    loop {
        let channel = channel_of();
        let Some(link) = node(&channel) else {
            missed = true;
            listener(Heard::Failed);
            tokio::time::sleep(backoff(attempt)).await;
            attempt = attempt.saturating_add(1);
            continue;
        };
        let target = link.target.load_full();
        let pubsub = match connect::subscribed(&target.dial, &channel).await {
            Ok(pubsub) => pubsub,
            Err(e) if e.code() == Some("NOPERM") => {
                missed = true;
                listener(Heard::Refused);
                if !std::mem::replace(&mut refused_said, true) {
                    tracing::info!(node = %target.node, channel = channel.as_str(), error = %super::Said(&e), "redis refused the subscription to the resets channel (the ACL user needs +subscribe and the channel); a DELETE /limits on another gateway is not heard here: remembered denials last their wait");
                }
                tokio::time::sleep(RETRY_REFUSED).await;
                continue;
            }
            Err(e) => {
                missed = true;
                listener(Heard::Failed);
                tracing::debug!(node = %target.node, error = %e, "cannot listen to the resets channel yet");
                retry_after(&link, &mut attempt).await;
                continue;
            }
        };
        refused_said = false;
        listener(Heard::Back {
            missed: std::mem::replace(&mut missed, false),
        });
        let since = Instant::now();
        let (mut sink, mut messages) = pubsub.split();
        let mut look = tokio::time::interval(LOOK_EVERY);
        look.tick().await;
        let mut looks = 0u32;
        loop {
            let moved = || {
                link.retired.load(Ordering::Relaxed)
                    || !Arc::ptr_eq(&link.target.load_full(), &target)
                    || channel_of() != channel
                    || !node(&channel).is_some_and(|n| Arc::ptr_eq(&n, &link))
            };
            tokio::select! {
                msg = messages.next() => match msg {
                    Some(msg) => {
                        if let Ok(payload) = msg.get_payload::<String>() {
                            listener(Heard::Message(&payload));
                        }
                    }
                    None => break,
                },
                // The link connected anew (a failover: perhaps to another node).
                _ = link.ready.notified() => {
                    if moved() {
                        break;
                    }
                }
                // The node left (a failover, a reload, a cluster's new map, the channel's
                // slot moved), the channel moved (a reload of `key_prefix`), or the
                // connection stopped answering: listen again where announcements go now.
                _ = look.tick() => {
                    looks = looks.wrapping_add(1);
                    if moved() {
                        break;
                    }
                    if looks.is_multiple_of(PING_EVERY_LOOKS) {
                        let ping = sink.ping::<redis::Value>();
                        if !matches!(tokio::time::timeout(CONNECT_TIMEOUT, ping).await, Ok(Ok(_))) {
                            break;
                        }
                    }
                }
            }
        }
        // Not listening from now until subscribed again: nothing remembered may outlive a
        // reset made meanwhile.
        listener(Heard::Lost);
        tracing::info!(node = %target.node, channel = channel.as_str(), "the resets channel's subscription ended; remembered denials forgotten until it is made again");
        missed = true;
        if since.elapsed() < LASTED {
            retry_after(&link, &mut attempt).await;
        } else {
            attempt = 0;
        }
    }
}

/// Waits before the next attempt: the backoff, or less when the link's decisions connect
/// again (a Redis back: the listener follows at once).
async fn retry_after(link: &Link, attempt: &mut u32) {
    tokio::select! {
        _ = tokio::time::sleep(backoff(*attempt)) => {}
        _ = link.ready.notified() => {}
    }
    *attempt = attempt.saturating_add(1);
}
