//! Announcements every gateway of a fleet hears: a Redis pub/sub channel.
//!
//! An operator's `DELETE /limits` on one gateway deletes the identity's buckets in Redis,
//! which every gateway reads, but each gateway also remembers the denials Redis gave it (the
//! over-limit cache) and repeats them without asking. The gateway that deleted announces the
//! reset on a channel, and every gateway that remembers a denial listens and forgets it.
//!
//! A gateway listens only once it has remembered a denial (a gateway that never refused
//! holds no extra connection), on one connection of its own to the node a decision would
//! reach first (one Redis, Sentinel's master, a cluster's first connected primary: Redis
//! passes a message published on one node of a cluster, or on a master, to the others). A
//! message missed while not listening cannot be read later: each time the subscription is
//! made again (after a lost connection), the listener forgets every remembered denial, so
//! none outlives a reset it did not hear. The first subscription forgets nothing (a denial
//! remembered in the tenth of a second before it, reset on another gateway in that moment,
//! is repeated for its wait): forgetting there would ask Redis again for the denial that
//! made it listen.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;

use super::connect;
use super::link::Link;

/// What a listener is told: `Some(message)`, or `None` when it (re)subscribed and may have
/// missed messages meanwhile.
pub type Listener = Box<dyn Fn(Option<&str>) + Send + Sync>;

/// Between attempts to subscribe again, and between looks for whether to.
const RETRY: Duration = Duration::from_secs(1);

/// After Redis refused the subscription itself (an ACL without the channel): the reason
/// does not go away by retrying sooner.
const RETRY_REFUSED: Duration = Duration::from_secs(30);

/// Listens on the channel `channel()` names (followed when it changes) while `wanted()` says
/// so (once true, for good), through a connection to the node `node()` names, telling
/// `listener` each message.
pub(super) async fn listen(
    channel_of: impl Fn() -> String,
    wanted: impl Fn() -> bool,
    node: impl Fn() -> Option<Arc<Link>>,
    listener: Listener,
) {
    let mut refused_said = false;
    let mut subscribed = false;
    loop {
        if !wanted() {
            tokio::time::sleep(RETRY / 10).await;
            continue;
        }
        let Some(link) = node() else {
            tokio::time::sleep(RETRY).await;
            continue;
        };
        let target = link.target.load_full();
        let channel = channel_of();
        let mut pubsub = match connect::pubsub(&target.dial).await {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(node = %target.node, error = %e, "cannot open the resets channel's connection yet");
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        if let Err(e) = pubsub.subscribe(&channel).await {
            if !std::mem::replace(&mut refused_said, true) {
                tracing::info!(node = %target.node, channel = channel.as_str(), error = %e, "redis refused the subscription to the resets channel (the ACL user needs +subscribe and the channel); a DELETE /limits on another gateway is not heard here: remembered denials last their wait");
            }
            tokio::time::sleep(RETRY_REFUSED).await;
            continue;
        }
        refused_said = false;
        // The first time, what was remembered before came after the last thing this
        // gateway could have missed but for the moment it took to subscribe; each time
        // after, a lost connection may have hidden resets.
        if subscribed {
            listener(None);
        }
        subscribed = true;
        let mut messages = pubsub.into_on_message();
        let mut look = tokio::time::interval(RETRY * 5);
        look.tick().await;
        loop {
            tokio::select! {
                msg = messages.next() => match msg {
                    Some(msg) => {
                        if let Ok(payload) = msg.get_payload::<String>() {
                            listener(Some(&payload));
                        }
                    }
                    None => break,
                },
                // The node left (a failover, a reload, a cluster's new map) or the channel moved
                // (a reload of `key_prefix`): listen where decisions go now.
                _ = look.tick() => {
                    if link.retired.load(Ordering::Relaxed)
                        || !Arc::ptr_eq(&link.target.load_full(), &target)
                        || !link.is_connected()
                        || channel_of() != channel
                    {
                        break;
                    }
                }
            }
        }
        tokio::time::sleep(RETRY / 10).await;
    }
}
