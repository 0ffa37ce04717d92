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
use tokio::sync::Notify;

use super::connector::{node_name, open, Link, Target};
use super::store::Shared;

/// Redis Cluster's number of hash slots.
pub const SLOTS: usize = 16_384;
const UNOWNED: u16 = u16::MAX;

/// How often the slot map is refreshed when every primary is reachable.
const REFRESH_EVERY: Duration = Duration::from_secs(5);
/// How often while a primary is unreachable or the map is unknown.
const REFRESH_DEGRADED_EVERY: Duration = Duration::from_secs(1);
/// At most this often, however many `MOVED` replies ask for it.
const REFRESH_MIN_GAP: Duration = Duration::from_millis(100);
/// One `CLUSTER SLOTS` query, connection included.
const QUERY_TIMEOUT: Duration = Duration::from_secs(1);

/// The hash slot of a key, hash tags included (as Redis computes it).
pub fn slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|b| *b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|b| *b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(tagged) % SLOTS as u16
}

/// Which primary owns each slot.
pub(crate) struct Topology {
    /// Index into `links` per slot; `UNOWNED` while no primary serves it.
    slots: Box<[u16]>,
    pub(crate) links: Vec<Arc<Link>>,
}

impl Topology {
    fn empty() -> Self {
        Self {
            slots: vec![UNOWNED; SLOTS].into_boxed_slice(),
            links: Vec::new(),
        }
    }

    fn owner(&self, slot: u16) -> Option<&Arc<Link>> {
        let i = *self.slots.get(slot as usize)?;
        self.links.get(i as usize)
    }

    fn index_of(&self, link: &Arc<Link>) -> Option<u16> {
        self.links
            .iter()
            .position(|l| Arc::ptr_eq(l, link))
            .map(|i| i as u16)
    }
}

/// One contiguous range of slots and its primary, as `CLUSTER SLOTS` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlotRange {
    start: u16,
    end: u16,
    host: String,
    port: u16,
}

pub(crate) struct Cluster {
    seeds: ArcSwap<Vec<String>>,
    /// +1 per new set of seeds: a map read from the cluster before is not applied after.
    epoch: AtomicU64,
    pub(crate) topology: ArcSwap<Topology>,
    /// Asks the refresher for a new map now.
    pub(crate) refresh: Notify,
    /// Every link by `host:port`: the topology's, and those only a redirect named.
    known: Mutex<HashMap<String, Arc<Link>>>,
}

impl Cluster {
    pub(crate) fn new(seeds: Vec<String>) -> Self {
        Self {
            seeds: ArcSwap::from_pointee(seeds),
            epoch: AtomicU64::new(0),
            topology: ArcSwap::from_pointee(Topology::empty()),
            refresh: Notify::new(),
            known: Mutex::new(HashMap::new()),
        }
    }

    /// The primary that owns `key`'s slot, when the map knows one.
    pub(crate) fn link_for(&self, key: &str) -> Option<Arc<Link>> {
        self.topology.load().owner(slot(key.as_bytes())).cloned()
    }

    pub(crate) fn seeds(&self) -> Arc<Vec<String>> {
        self.seeds.load_full()
    }

    /// Every link the gateway holds: the map's, and those only a redirect named.
    pub(crate) fn links(&self) -> Vec<Arc<Link>> {
        self.known
            .lock()
            .expect("cluster links lock")
            .values()
            .cloned()
            .collect()
    }

    /// New seed nodes (a reload): forget the map and every link, and discover anew.
    pub(crate) fn reseed(&self, shared: &Shared, seeds: Vec<String>) {
        // Under the links lock, which `apply` holds too: a refresh that read the old cluster
        // sees the new epoch and throws its map away.
        let mut known = self.known.lock().expect("cluster links lock");
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.seeds.store(Arc::new(seeds));
        self.topology.store(Arc::new(Topology::empty()));
        for (_, link) in known.drain() {
            shared.retire(&link);
        }
        drop(known);
        self.refresh.notify_one();
    }

    /// What every node is reached with: the first seed's credentials and settings (its
    /// address is replaced by the node's).
    fn node_template(&self) -> Option<redis::ConnectionInfo> {
        let seeds = self.seeds.load();
        redis::IntoConnectionInfo::into_connection_info(seeds.first()?.as_str()).ok()
    }

    /// The link for a node a redirect named, opened when it is new.
    fn link_named(&self, shared: &Arc<Shared>, addr: &str) -> Option<Arc<Link>> {
        let (host, port) = parse_addr(addr)?;
        let name = node_name(host, port);
        let mut known = self.known.lock().expect("cluster links lock");
        if let Some(link) = known.get(&name) {
            return Some(Arc::clone(link));
        }
        let seed = self.node_template()?;
        let link = shared.new_link(Target::node(&seed, host, port));
        known.insert(name, Arc::clone(&link));
        Some(link)
    }

    /// `MOVED slot addr`: the slot is now `addr`'s for good. Records it and asks for a fresh
    /// map (more slots have probably moved with it).
    pub(crate) fn moved(&self, shared: &Arc<Shared>, slot: u16, addr: &str) -> Option<Arc<Link>> {
        let link = self.link_named(shared, addr)?;
        // rcu: concurrent redirects for different slots must not undo each other.
        self.topology.rcu(|current| {
            let mut links = current.links.clone();
            let index = current.index_of(&link).unwrap_or_else(|| {
                links.push(Arc::clone(&link));
                (links.len() - 1) as u16
            });
            let mut slots = current.slots.clone();
            if let Some(s) = slots.get_mut(slot as usize) {
                *s = index;
            }
            Topology { slots, links }
        });
        self.refresh.notify_one();
        Some(link)
    }

    /// `ASK slot addr`: this one request goes to `addr` (a slot being migrated).
    pub(crate) fn asked(&self, shared: &Arc<Shared>, addr: &str) -> Option<Arc<Link>> {
        self.link_named(shared, addr)
    }

    /// Reads the slot map from a connected primary, else from the seeds, and applies it.
    async fn refresh_once(&self, shared: &Arc<Shared>) -> Result<(), String> {
        let epoch = self.epoch.load(Ordering::Acquire);
        let mut candidates: Vec<Arc<Link>> = self
            .topology
            .load()
            .links
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
            let mut c = (*conn).clone();
            match tokio::time::timeout(QUERY_TIMEOUT, query_slots(&mut c, &host)).await {
                Ok(Ok(ranges)) => return self.apply(shared, epoch, ranges),
                Ok(Err(e)) => last_error = e,
                Err(_) => last_error = "CLUSTER SLOTS timed out".into(),
            }
        }
        for seed in self.seeds.load().iter() {
            let attempt = async {
                let client = redis::Client::open(seed.as_str()).map_err(|e| e.to_string())?;
                let host = match client.get_connection_info().addr() {
                    redis::ConnectionAddr::Tcp(h, _) => h.clone(),
                    _ => String::new(),
                };
                let mut opened = open(&client).await.map_err(|e| e.to_string())?;
                query_slots(&mut opened.conn, &host).await
            };
            match tokio::time::timeout(QUERY_TIMEOUT, attempt).await {
                Ok(Ok(ranges)) => return self.apply(shared, epoch, ranges),
                Ok(Err(e)) => last_error = format!("{}: {e}", redact(seed)),
                Err(_) => last_error = format!("{}: timed out", redact(seed)),
            }
        }
        Err(last_error)
    }

    fn apply(
        &self,
        shared: &Arc<Shared>,
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
        let mut slots = vec![UNOWNED; SLOTS].into_boxed_slice();
        let mut links: Vec<Arc<Link>> = Vec::new();
        let mut index: HashMap<String, u16> = HashMap::new();
        for r in &ranges {
            let name = node_name(&r.host, r.port);
            let i = *index.entry(name.clone()).or_insert_with(|| {
                let link = known
                    .entry(name)
                    .or_insert_with(|| shared.new_link(Target::node(&seed, &r.host, r.port)));
                links.push(Arc::clone(link));
                (links.len() - 1) as u16
            });
            for s in r.start..=r.end.min(SLOTS as u16 - 1) {
                slots[s as usize] = i;
            }
        }
        known.retain(|name, link| {
            let keep = index.contains_key(name);
            if !keep {
                shared.retire(link);
            }
            keep
        });
        let previous = self.topology.load();
        let changed = previous.slots != slots
            || previous.links.len() != links.len()
            || previous
                .links
                .iter()
                .zip(&links)
                .any(|(a, b)| !Arc::ptr_eq(a, b));
        if changed {
            let unowned = slots.iter().filter(|s| **s == UNOWNED).count();
            let primaries: Vec<String> = links.iter().map(|l| l.node()).collect();
            tracing::info!(
                ?primaries,
                unowned_slots = unowned,
                "redis cluster slot map updated"
            );
        }
        self.topology.store(Arc::new(Topology { slots, links }));
        drop(known);
        Ok(())
    }
}

/// Keeps the slot map current for as long as the store lives.
pub(crate) async fn keep_topology(shared: Arc<Shared>) {
    let super::store::Mode::Cluster(cluster) = &shared.mode else {
        return;
    };
    let mut failing = false;
    loop {
        match cluster.refresh_once(&shared).await {
            Ok(()) => failing = false,
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "cannot read the redis cluster slot map; retrying");
                }
                failing = true;
            }
        }
        let topology = cluster.topology.load();
        let healthy = !failing
            && !topology.links.is_empty()
            && topology.links.iter().all(|l| l.is_connected());
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

async fn query_slots(
    conn: &mut redis::aio::MultiplexedConnection,
    queried_host: &str,
) -> Result<Vec<SlotRange>, String> {
    let reply: Value = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    parse_slots(&reply, queried_host)
        .ok_or_else(|| "CLUSTER SLOTS answered an unexpected shape".into())
}

/// `CLUSTER SLOTS`: `[[start, end, [host, port, id, ...], replicas...], ...]`. An empty host
/// means the node that answered.
fn parse_slots(reply: &Value, queried_host: &str) -> Option<Vec<SlotRange>> {
    let Value::Array(entries) = reply else {
        return None;
    };
    let int = |v: &Value| match v {
        Value::Int(i) => u16::try_from(*i).ok(),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(parts) = entry else {
            return None;
        };
        let (start, end) = (int(parts.first()?)?, int(parts.get(1)?)?);
        let Value::Array(primary) = parts.get(2)? else {
            return None;
        };
        let host = text(primary.first()?)?;
        let port = int(primary.get(1)?)?;
        // "?" is a node whose address is not known yet: skip it until the next refresh.
        if host == "?" {
            continue;
        }
        let host = if host.is_empty() {
            queried_host.to_owned()
        } else {
            host
        };
        ranges.push(SlotRange {
            start,
            end,
            host,
            port,
        });
    }
    Some(ranges)
}

/// `host:port` or `[v6]:port`, as redirects and node names write it.
fn parse_addr(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    Some((host, port.parse().ok()?))
}

/// A seed URL without its password, for logs.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Values from `CLUSTER KEYSLOT`.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
        assert_eq!(slot(b"{user1000}.following"), slot(b"{user1000}.followers"));
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        // An empty tag hashes the whole key.
        assert_eq!(
            slot(b"foo{}{bar}"),
            crc16::State::<crc16::XMODEM>::calculate(b"foo{}{bar}") % 16384
        );
    }

    #[test]
    fn cluster_slots_replies_are_read_with_empty_hosts_filled_in() {
        let node = |h: &str, p: i64| {
            Value::Array(vec![
                Value::BulkString(h.as_bytes().to_vec()),
                Value::Int(p),
                Value::BulkString(b"id".to_vec()),
            ])
        };
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node("10.0.0.1", 7000),
                node("10.0.0.4", 7003),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), node("", 7001)]),
            Value::Array(vec![Value::Int(7), Value::Int(7), node("?", 0)]),
        ]);
        let ranges = parse_slots(&reply, "10.0.0.9").expect("parsed");
        assert_eq!(
            ranges,
            vec![
                SlotRange {
                    start: 0,
                    end: 5460,
                    host: "10.0.0.1".into(),
                    port: 7000
                },
                SlotRange {
                    start: 5461,
                    end: 16383,
                    host: "10.0.0.9".into(),
                    port: 7001
                },
            ]
        );
        assert_eq!(parse_slots(&Value::Int(1), ""), None);
    }

    #[test]
    fn redirect_addresses_and_redaction() {
        assert_eq!(parse_addr("127.0.0.1:7000"), Some(("127.0.0.1", 7000)));
        assert_eq!(parse_addr("[::1]:7000"), Some(("::1", 7000)));
        assert_eq!(parse_addr("nope"), None);
        assert_eq!(redact("redis://u:secret@h:1"), "redis://***@h:1");
        assert_eq!(redact("redis://h:1"), "redis://h:1");
    }
}
