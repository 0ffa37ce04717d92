//! Redis Cluster: which primary owns a key, and keeping that map current.
//!
//! The gateway keeps its own slot map (from `CLUSTER SLOTS`) and one [`Link`] per primary,
//! each with its own connection and breaker, instead of a cluster client that pauses every
//! request while it refreshes its map: a dead primary must cost the keys it owns their fail
//! mode, and nothing to the keys of the others. The map is refreshed off the request path:
//! at start, every few seconds, at once after a `MOVED`, and every second while a primary is
//! unreachable (so a replica promoted in its place is found quickly). A request follows
//! `MOVED` and `ASK` itself, inside its budget.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use rand::seq::SliceRandom;
use redis::Value;

use super::dial::Dial;
use crate::config::{redact_url, RedisAccess};
use tokio::sync::Notify;

use crate::decision::breaker::Breaker;
use crate::decision::BreakerState;

use super::connect::{open, reason, Connector};
use super::link::{Link, Target};
use super::slots::{node_name, parse_addr, parse_slots, slot, SlotMap, SlotRange};

/// Which primary owns each slot.
pub(super) type Topology = SlotMap<Arc<Link>>;

/// How often the slot map is refreshed when every primary is reachable.
const REFRESH_EVERY: Duration = Duration::from_secs(5);
/// How often while a primary is unreachable, its breaker not closed, or the map unknown.
const REFRESH_DEGRADED_EVERY: Duration = Duration::from_secs(1);
/// At most this often, however many `MOVED` replies ask for it.
const REFRESH_MIN_GAP: Duration = Duration::from_millis(100);
/// One `CLUSTER SLOTS` query, connection included.
const QUERY_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a node outside the slot map is kept after a redirect last named it.
const NAMED_KEPT: Duration = Duration::from_secs(10);

pub(super) struct Cluster {
    seeds: ArcSwap<Vec<String>>,
    /// How the seeds and every node are reached.
    access: ArcSwap<RedisAccess>,
    /// +1 per new set of seeds: a map read from the cluster before is not applied after.
    epoch: AtomicU64,
    topology: ArcSwap<Topology>,
    /// Asks the refresher for a new map now; each link holds it too, to ask when its
    /// connection is lost.
    refresh: Arc<Notify>,
    /// Every link by `host:port`: the topology's, and those only a redirect named.
    known: Mutex<HashMap<String, Arc<Link>>>,
    /// The breaker of the cluster while no slot map is known (at start, after new seeds):
    /// no primary's breaker can count the failed attempts to reach it, so this one counts one
    /// failure per failed attempt to read the map, and short-circuits the decisions when
    /// open, as one Redis's breaker does while its connection cannot be made.
    pub(super) mapless: Breaker,
    /// When "redirected too many times" was last said ([`super::deadline::once_every`]).
    pub(super) redirects_logged: AtomicU64,
}

impl Cluster {
    pub(super) fn new(seeds: Vec<String>, access: RedisAccess, mapless: Breaker) -> Self {
        Self {
            mapless,
            redirects_logged: AtomicU64::new(0),
            seeds: ArcSwap::from_pointee(seeds),
            access: ArcSwap::from_pointee(access),
            epoch: AtomicU64::new(0),
            topology: ArcSwap::from_pointee(Topology::empty()),
            refresh: Arc::new(Notify::new()),
            known: Mutex::new(HashMap::new()),
        }
    }

    /// The primary that owns `key`'s slot, when the map knows one.
    pub(super) fn link_for(&self, key: &str) -> Option<Arc<Link>> {
        self.topology.load().owner(slot(key.as_bytes())).cloned()
    }

    pub(super) fn seeds(&self) -> Arc<Vec<String>> {
        self.seeds.load_full()
    }

    pub(super) fn access(&self) -> Arc<RedisAccess> {
        self.access.load_full()
    }

    /// Whether no slot map is known (none read yet since the start or the last new seeds).
    pub(super) fn has_no_map(&self) -> bool {
        self.topology.load().nodes().is_empty()
    }

    /// The primaries of the current map.
    pub(super) fn primaries(&self) -> Vec<Arc<Link>> {
        self.topology.load().nodes().to_vec()
    }

    /// Asks for a fresh slot map now (a node answered READONLY or CLUSTERDOWN, say).
    pub(super) fn ask_refresh(&self) {
        self.refresh.notify_one();
    }

    /// Every link the gateway holds: the map's, and those only a redirect named.
    pub(super) fn links(&self) -> Vec<Arc<Link>> {
        self.known
            .lock()
            .expect("cluster links lock")
            .values()
            .cloned()
            .collect()
    }

    /// New seed nodes (a reload): forget the map and every link, and discover anew.
    pub(super) fn reseed(&self, connector: &Connector, seeds: Vec<String>, access: RedisAccess) {
        // Under the links lock, which `apply` holds too: a refresh that read the old cluster
        // sees the new epoch and throws its map away.
        let mut known = self.known.lock().expect("cluster links lock");
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.seeds.store(Arc::new(seeds));
        self.access.store(Arc::new(access));
        self.topology.store(Arc::new(Topology::empty()));
        for (_, link) in known.drain() {
            connector.retire(&link);
        }
        drop(known);
        self.refresh.notify_one();
    }

    /// What every node is reached with: the first seed's credentials and settings (its
    /// address is replaced by the node's).
    fn node_template(&self) -> Option<Dial> {
        let seeds = self.seeds.load();
        Dial::new(seeds.first()?.as_str(), &self.access.load()).ok()
    }

    /// The link for a node a redirect named, opened when it is new.
    fn link_named(&self, connector: &Arc<Connector>, addr: &str) -> Option<Arc<Link>> {
        let (host, port) = parse_addr(addr)?;
        let name = node_name(host, port);
        let mut known = self.known.lock().expect("cluster links lock");
        let link = match known.get(&name) {
            Some(link) => Arc::clone(link),
            None => {
                let seed = self.node_template()?;
                let link = connector.node(
                    Target::node(&seed, &self.access.load(), host, port),
                    &self.refresh,
                );
                known.insert(name, Arc::clone(&link));
                link
            }
        };
        link.named_at
            .store(super::deadline::mono_us(), Ordering::Relaxed);
        Some(link)
    }

    /// `MOVED slot addr`: the slot is now `addr`'s for good. Records it and asks for a fresh
    /// map (more slots have probably moved with it).
    pub(super) fn moved(
        &self,
        connector: &Arc<Connector>,
        slot: u16,
        addr: &str,
    ) -> Option<Arc<Link>> {
        let link = self.link_named(connector, addr)?;
        // rcu: concurrent redirects for different slots must not undo each other.
        self.topology
            .rcu(|current| current.moved(slot, &link, Arc::ptr_eq));
        self.refresh.notify_one();
        Some(link)
    }

    /// `ASK slot addr`: this one request goes to `addr` (a slot being migrated).
    pub(super) fn asked(&self, connector: &Arc<Connector>, addr: &str) -> Option<Arc<Link>> {
        self.link_named(connector, addr)
    }

    /// Reads the slot map from a connected primary, else from the seeds, and applies it.
    async fn refresh_once(&self, connector: &Arc<Connector>) -> Result<(), String> {
        let epoch = self.epoch.load(Ordering::Acquire);
        let mut candidates: Vec<Arc<Link>> = self
            .topology
            .load()
            .nodes()
            .iter()
            .filter(|l| l.is_connected())
            .cloned()
            .collect();
        candidates.shuffle(&mut rand::rng());
        let mut last_error = String::from("no seed node answered");
        for link in candidates {
            let Some(conn) = link.conn.load_full() else {
                continue;
            };
            let host = link.target.load().node.clone();
            let host = parse_addr(&host)
                .map(|(h, _)| h.to_owned())
                .unwrap_or_default();
            let mut c = conn.redis();
            match tokio::time::timeout(QUERY_TIMEOUT, query_slots(&mut c, &host)).await {
                Ok(Ok(ranges)) => return self.apply(connector, epoch, ranges),
                Ok(Err(e)) => last_error = e,
                Err(_) => last_error = "CLUSTER SLOTS timed out".into(),
            }
        }
        for seed in self.seeds.load().iter() {
            let attempt = async { ask_seed(seed, &self.access.load()).await?.1 };
            match tokio::time::timeout(QUERY_TIMEOUT, attempt).await {
                Ok(Ok(ranges)) => return self.apply(connector, epoch, ranges),
                Ok(Err(e)) => last_error = format!("{}: {e}", redact_url(seed)),
                Err(_) => last_error = format!("{}: timed out", redact_url(seed)),
            }
        }
        Err(last_error)
    }

    fn apply(
        &self,
        connector: &Arc<Connector>,
        epoch: u64,
        ranges: Vec<SlotRange>,
    ) -> Result<(), String> {
        if ranges.is_empty() {
            return Err("CLUSTER SLOTS listed no slots: is the cluster created?".into());
        }
        let seed = self.node_template().ok_or("no usable seed URL")?;
        let mut known = self.known.lock().expect("cluster links lock");
        if self.epoch.load(Ordering::Acquire) != epoch {
            return Ok(());
        }
        let map = Topology::from_ranges(&ranges, |r| {
            let link = known.entry(node_name(&r.host, r.port)).or_insert_with(|| {
                connector.node(
                    Target::node(&seed, &self.access.load(), &r.host, r.port),
                    &self.refresh,
                )
            });
            Arc::clone(link)
        });
        // A node outside the map that redirects still name (a migration's destination
        // without slots yet, or one gone down or demoted mid-migration) is kept: made again
        // at each refresh, it was dialled and its outage said again each time, and each
        // redirected call waited for its first attempt.
        let now = super::deadline::mono_us();
        known.retain(|_, link| {
            let named = link.named_at.load(Ordering::Relaxed);
            let keep = map.nodes().iter().any(|l| Arc::ptr_eq(l, link))
                || (named != 0 && now < named + NAMED_KEPT.as_micros() as u64);
            if !keep {
                connector.retire(link);
            }
            keep
        });
        if !self.topology.load().same_as(&map, Arc::ptr_eq) {
            let primaries: Vec<String> = map.nodes().iter().map(|l| l.node()).collect();
            tracing::info!(
                ?primaries,
                unowned_slots = map.unowned(),
                "redis cluster slot map updated"
            );
        }
        self.topology.store(Arc::new(map));
        drop(known);
        Ok(())
    }
}

impl Cluster {
    /// Ends the quarantine of each primary whose breaker `CLUSTERDOWN` replies opened, once
    /// the node answers a key of its own again: the node answered all along, so waiting out
    /// `open_seconds` would refuse its keys for nothing, as a Sentinel failover's new master
    /// does not wait out its old master's. The key is read (`HMGET`, which the scripts' ACL
    /// user may run on the buckets' keys; `CLUSTER INFO` is not among its commands), on
    /// every such node at once and briefly, so that a node that stalls holds up neither the
    /// others nor the next read of the slot map.
    async fn end_cluster_down_quarantines(&self, connector: &Connector) {
        const ASK_WITHIN: Duration = Duration::from_millis(250);
        let topology = self.topology.load_full();
        let prefix = connector.key_prefix();
        let asks = topology.nodes().iter().filter_map(|link| {
            if !link.cluster_down.load(Ordering::Relaxed) {
                return None;
            }
            if link.breaker.state() == BreakerState::Closed {
                link.cluster_down.store(false, Ordering::Relaxed);
                return None;
            }
            let conn = link.conn.load_full()?;
            let key = key_of(&topology, link, &prefix)?;
            Some(async move {
                let mut c = conn.redis();
                let mut read = redis::cmd("HMGET");
                read.arg(&key).arg("t");
                let answer = tokio::time::timeout(ASK_WITHIN, read.query_async::<Value>(&mut c));
                let whole = match answer.await {
                    Ok(Ok(_)) => true,
                    // A redirect: the node answers, its cluster up; the map is read again.
                    Ok(Err(e)) => matches!(
                        e.kind(),
                        redis::ErrorKind::Server(
                            redis::ServerErrorKind::Moved | redis::ServerErrorKind::Ask
                        )
                    ),
                    Err(_) => false,
                };
                if whole {
                    link.cluster_down.store(false, Ordering::Relaxed);
                    if link.breaker.state() == BreakerState::Open {
                        tracing::info!(node = %link.node(), "redis cluster is whole again; the node's quarantine ends and the next request probes it");
                        link.breaker.end_quarantine();
                    }
                }
            })
        });
        futures_util::future::join_all(asks).await;
    }
}

/// A key under `prefix` whose slot `link` owns in `topology` (its hash tag found by trying
/// numbers: a node owning one slot of 16 384 takes about that many tries, a few
/// milliseconds).
fn key_of(topology: &Topology, link: &Arc<Link>, prefix: &str) -> Option<String> {
    (0..200_000u32)
        .map(|i| format!("{prefix}:cluster-probe:{{{i}}}"))
        .find(|key| {
            topology
                .owner(super::slots::slot(key.as_bytes()))
                .is_some_and(|owner| Arc::ptr_eq(owner, link))
        })
}

/// Whether an error reply says the node's whole cluster is down: `CLUSTERDOWN The cluster
/// is down` for a call of its own, `ERR ... while the cluster is down` for a batch's script
/// (not `CLUSTERDOWN Hash slot not served`: one slot's, which the slot map settles).
pub(super) fn says_cluster_down(error: &str) -> bool {
    error.contains("cluster is down")
}

/// Keeps the slot map current for as long as the store lives.
pub(super) async fn keep_topology(cluster: Arc<Cluster>, connector: Arc<Connector>) {
    let mut failing = false;
    loop {
        match cluster.refresh_once(&connector).await {
            Ok(()) => {
                failing = false;
                if !cluster.has_no_map() {
                    cluster.mapless.close();
                }
            }
            Err(e) => {
                if cluster.has_no_map() {
                    cluster.mapless.count_failure();
                }
                if !failing {
                    tracing::warn!(error = %e, "cannot read the redis cluster slot map; retrying");
                }
                failing = true;
            }
        }
        cluster.end_cluster_down_quarantines(&connector).await;
        let topology = cluster.topology.load();
        // A primary whose breaker is not closed may be one that handed its slots over.
        let healthy = !failing
            && !topology.nodes().is_empty()
            && topology
                .nodes()
                .iter()
                .all(|l| l.is_connected() && l.breaker.state() == BreakerState::Closed);
        let wait = if healthy {
            REFRESH_EVERY
        } else {
            REFRESH_DEGRADED_EVERY
        };
        drop(topology);
        tokio::select! {
            _ = cluster.refresh.notified() => {}
            _ = tokio::time::sleep(wait) => {}
        }
        tokio::time::sleep(REFRESH_MIN_GAP).await;
    }
}

/// The primaries of the slot map the first seed to answer `CLUSTER SLOTS` gives (each seed
/// asked at once, within [`QUERY_TIMEOUT`]), reached as the store reaches them: the start's
/// eviction check reads their policies, where the buckets are, not the seeds' (a seed may
/// be a replica, and a primary need not be a seed). Empty when a seed answered without a
/// map (an error, no slots); `None` when none answered at all (down, or too slow: a Redis
/// that does not answer is not refused, and waiting for it again would double the start's
/// wait).
pub(super) async fn primaries_of(seeds: &[String], access: &RedisAccess) -> Option<Vec<Target>> {
    use futures_util::StreamExt;
    let mut asks: futures_util::stream::FuturesUnordered<_> = seeds
        .iter()
        .map(|seed| async move {
            let asked = tokio::time::timeout(QUERY_TIMEOUT, ask_seed(seed, access)).await;
            let (dial, ranges) = asked.ok()?.ok()?;
            Some((dial, ranges.unwrap_or_default()))
        })
        .collect();
    let mut answered = false;
    while let Some(answer) = asks.next().await {
        let Some((seed, ranges)) = answer else {
            continue;
        };
        answered = true;
        if ranges.is_empty() {
            continue;
        }
        let mut primaries: Vec<Target> = Vec::new();
        for r in &ranges {
            let name = node_name(&r.host, r.port);
            if !primaries.iter().any(|t| t.node == name) {
                primaries.push(Target::node(&seed, access, &r.host, r.port));
            }
        }
        return Some(primaries);
    }
    answered.then(Vec::new)
}

/// Asks one seed for the slot map: `Err` when it cannot be reached (its URL, a refused
/// connection or password), else its dial and what `CLUSTER SLOTS` answered.
async fn ask_seed(
    seed: &str,
    access: &RedisAccess,
) -> Result<(Dial, Result<Vec<SlotRange>, String>), String> {
    let dial = Dial::new(seed, access).map_err(|e| e.to_string())?;
    let host = match dial.info.addr() {
        redis::ConnectionAddr::Tcp(h, _) => h.clone(),
        _ => String::new(),
    };
    let mut opened = open(&dial).await.map_err(|e| reason(&e))?;
    let ranges = query_slots(&mut opened.conn, &host).await;
    Ok((dial, ranges))
}

async fn query_slots(
    conn: &mut redis::aio::MultiplexedConnection,
    queried_host: &str,
) -> Result<Vec<SlotRange>, String> {
    let reply: Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(conn)
        .await
        .map_err(|e| super::Said(&e).to_string())?;
    parse_slots(&reply, queried_host)
        .ok_or_else(|| "CLUSTER SLOTS answered an unexpected shape".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_urls_are_logged_without_their_password() {
        assert_eq!(redact_url("redis://u:secret@h:1"), "redis://u:***@h:1");
        assert_eq!(redact_url("redis://:secret@h:1/0"), "redis://:***@h:1/0");
        assert_eq!(redact_url("rediss://gateway@h:1"), "rediss://gateway@h:1");
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(redact_url("https://a:b@h/p"), "https://a:***@h/p");
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(redact_url("redis//u:secret@h:1/0"), "***@h:1/0");
        assert_eq!(redact_url("redis:/u:se/cret@h:1"), "***@h:1");
        assert_eq!(redact_url("redis:/u:a://b@h:1"), "***@h:1");
        assert_eq!(
            redact_url("unix:///run/redis.sock?db=2&pass=secret"),
            "unix:///run/redis.sock?db=2&pass=***"
        );
        assert_eq!(
            redact_url("unix:///run/redis.sock?pa%73s=secret&Pass%77ord=s"),
            "unix:///run/redis.sock?pa%73s=***&Pass%77ord=***"
        );
        assert_eq!(redact_url("redis://u:pa/ss@h:1/0"), "redis://u:***@h:1/0");
    }
}
