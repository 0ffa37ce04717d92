//! Redis Sentinel: which Redis is the master, and following it through a failover.
//!
//! The store keeps one link, as with one Redis; this watcher points it at the master the
//! sentinels name. It asks them (`SENTINEL get-master-addr-by-name`) at start, every second,
//! whenever a sentinel publishes `+switch-master` for the master (a subscription kept on one
//! sentinel), and whenever the link loses its connection or Redis answers `READONLY` (the
//! node was demoted). An address is used only once it answers `ROLE` as a master, so a
//! sentinel with a stale view never points the gateway at a replica: the next sentinel is
//! asked instead.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use futures_util::StreamExt;
use tokio::sync::Notify;

use super::connect;
use super::dial::Dial;
use super::link::{Link, Opened, Target};
use crate::config::{redact_url, RedisAccess, SentinelTarget};

/// How long one question to one sentinel (or the master's `ROLE`) may take.
const ASK_TIMEOUT: Duration = Duration::from_millis(500);
/// How often the sentinels are asked when nothing else asks.
const POLL_EVERY: Duration = Duration::from_secs(1);
/// The least time between two questions, however often something asks.
const ASK_GAP: Duration = Duration::from_millis(100);

pub(super) struct Sentinel {
    target: ArcSwap<SentinelTarget>,
    access: ArcSwap<RedisAccess>,
    /// The master in use, `host:port`.
    master: ArcSwapOption<String>,
    /// Ask the sentinels again now.
    pub(super) ask: Arc<Notify>,
    /// The master in use answered `READONLY`: the next question checks its role too, though
    /// the sentinels still name it.
    suspect: AtomicBool,
    /// The connection of the last question each sentinel answered, by URL: asked every
    /// second, a sentinel is not dialled (and authenticated, over TLS handshaken) every
    /// second.
    kept: tokio::sync::Mutex<HashMap<String, Opened>>,
    /// The master's user may not run `ROLE`, and it was said.
    role_refused: AtomicBool,
    /// Nodes a sentinel named that answered `ROLE` as replicas, and when: a stale sentinel
    /// listed first names its node at every question (every second), which is not dialled
    /// again for [`REPLICA_KEPT`].
    replicas: std::sync::Mutex<Vec<(String, std::time::Instant)>>,
}

/// How long a node found a replica is taken as one without asking it again.
const REPLICA_KEPT: Duration = Duration::from_secs(10);

/// The sentinels (by URL) that did not answer when last asked, each said once: one fewer
/// sentinel to follow a failover with is an operator's business. The process's, not a
/// store's: the check made before the start asks the same sentinels.
static SILENT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

impl Sentinel {
    pub(super) fn new(target: SentinelTarget, access: RedisAccess) -> Self {
        Self {
            target: ArcSwap::from_pointee(target),
            access: ArcSwap::from_pointee(access),
            master: ArcSwapOption::empty(),
            ask: Arc::new(Notify::new()),
            role_refused: AtomicBool::new(false),
            replicas: std::sync::Mutex::new(Vec::new()),
            suspect: AtomicBool::new(false),
            kept: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The master in use, as `/readyz` names it.
    pub(super) fn master(&self) -> Option<String> {
        self.master.load().as_deref().cloned()
    }

    /// One asked once, for a check beside the store's own (the eviction check at start and
    /// on reload): what the store's says once, this one does not say again.
    pub(super) fn for_a_check(target: SentinelTarget, access: RedisAccess) -> Self {
        let sentinel = Self::new(target, access);
        sentinel.role_refused.store(true, Ordering::Relaxed);
        sentinel
    }

    /// The master's name the sentinels are asked for (`sentinel_master`).
    pub(super) fn master_name(&self) -> String {
        self.target.load().master.clone()
    }

    /// A reload: new sentinels, master name or credentials; asked again at once.
    pub(super) fn retarget(&self, target: &SentinelTarget, access: &RedisAccess) -> bool {
        let changed = **self.target.load() != *target || **self.access.load() != *access;
        if changed {
            self.target.store(Arc::new(target.clone()));
            self.access.store(Arc::new(access.clone()));
            self.master.store(None);
            // Made with the old credentials, perhaps to a sentinel no longer listed.
            if let Ok(mut kept) = self.kept.try_lock() {
                kept.clear();
            }
            self.ask.notify_one();
        }
        changed
    }

    /// A sentinel's connection settings (its own password, no ACL user; `[redis]`'s TLS
    /// settings for `rediss://` sentinels).
    fn sentinel_dial(&self, url: &str) -> Option<Dial> {
        let access = RedisAccess {
            username: None,
            password: self.target.load().password.clone(),
            tls: self.access.load().tls.clone(),
        };
        Dial::new(url, &access).ok()
    }

    /// The master's address as the sentinel at `url` (`dial`) names it, on the connection
    /// kept from the last question to it while that is still open.
    async fn ask_one(&self, url: &str, dial: &Dial, master: &str) -> Result<(String, u16), String> {
        let asked = async {
            let mut kept = self.kept.lock().await;
            let reused = kept.remove(url).filter(|opened| !*opened.closed.borrow());
            let mut opened = match reused {
                Some(opened) => opened,
                None => connect::open(dial).await.map_err(|e| connect::reason(&e))?,
            };
            let named = redis::cmd("SENTINEL")
                .arg("get-master-addr-by-name")
                .arg(master)
                .query_async::<Option<(String, u16)>>(&mut opened.conn)
                .await
                .map_err(|e| connect::reason(&e))?;
            kept.insert(url.to_owned(), opened);
            named.ok_or_else(|| format!("it knows no master named {master}"))
        };
        match tokio::time::timeout(ASK_TIMEOUT, asked).await {
            Ok(Ok(addr)) => Ok(addr),
            Ok(Err(e)) => Err(format!("sentinel {}: {e}", dial.info.addr())),
            Err(_) => Err(format!("sentinel {}: no answer in time", dial.info.addr())),
        }
    }

    /// The master in use answered `READONLY` (it was demoted): ask again, checking it.
    pub(super) fn suspect_master(&self) {
        self.suspect.store(true, Ordering::Relaxed);
        self.ask.notify_one();
    }

    /// The link's target for the master at `host:port`, with `[redis]`'s credentials; over
    /// TLS when the sentinels are.
    pub(super) fn target_for(&self, host: &str, port: u16) -> Option<Target> {
        let tls = self
            .target
            .load()
            .sentinels
            .iter()
            .all(|u| u.starts_with("rediss://"));
        let scheme = if tls { "rediss" } else { "redis" };
        let url = format!("{scheme}://{}/0", super::slots::node_name(host, port));
        Target::new(&url, &self.access.load()).ok()
    }

    /// Whether `target` answers `ROLE` as a master. A node that refuses the gateway's
    /// credentials is taken as the master the sentinels say it is: its role cannot be
    /// read, and the decisions' own connection to it then fails with the reason
    /// (`WRONGPASS`), logged, instead of on an address that means nothing.
    async fn is_master(&self, target: &Target) -> Result<bool, String> {
        let check = async {
            let mut opened = match connect::open(&target.dial).await {
                Ok(opened) => opened,
                Err(e) if e.kind() == redis::ErrorKind::AuthenticationFailed => return Ok(true),
                Err(e) => return Err(format!("cannot connect to it: {}", super::Said(&e))),
            };
            match master_by_role(&mut opened.conn).await {
                Ok(Some(master)) => Ok(master),
                // The user may not run ROLE: the sentinel's word is taken, said once.
                Ok(None) => {
                    if !self.role_refused.swap(true, Ordering::Relaxed) {
                        tracing::warn!(node = %target.node, "redis sentinel: the user may not run ROLE (grant +role), so the master a sentinel names is taken on its word: a stale sentinel's old master would not be caught");
                    }
                    Ok(true)
                }
                Err(e) => Err(format!("ROLE failed: {}", super::Said(&e))),
            }
        };
        tokio::time::timeout(ASK_TIMEOUT, check)
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {} ms", ASK_TIMEOUT.as_millis())))
    }

    /// Points `link` at `target`, dropping the connection to the old master.
    fn switch(&self, link: &Link, target: Target) {
        let node = target.node.clone();
        let before = self.master.swap(Some(Arc::new(node.clone())));
        // Another master, or the same with other credentials or TLS settings (a reload): a
        // new target, whose connection ends a quarantine the old one's failures opened. The
        // same master found again (new sentinels alone) is no new target: the failures were
        // its own; nor is the first master found after none answered at the start.
        let was = link.target.load();
        let new_target =
            (was.node != node && was.node != super::link::NO_MASTER) || was.access != target.access;
        drop(was);
        link.new_target.store(new_target, Ordering::Release);
        link.forget_outage();
        link.point_at(target);
        match before {
            Some(old) => {
                tracing::warn!(old = %old, new = %node, "redis sentinel: the master changed; following it")
            }
            None => {
                tracing::info!(master = %node, "redis sentinel: using the master the sentinels name")
            }
        }
    }

    /// The master's target: the first address a sentinel names that is the master in use or
    /// answers `ROLE` as a master; a sentinel that cannot be asked, or names a node that is
    /// not a master (a stale or misconfigured sentinel), is passed over for the next one.
    /// Else why not, as the last sentinel asked said.
    pub(super) async fn discover(&self) -> Result<Target, String> {
        self.discover_checking(true).await.map(|(target, _)| target)
    }

    /// As [`Sentinel::discover`]; the master in use is taken without a `ROLE` check when it
    /// is `trusted` and not suspect. With whether the target was checked.
    async fn discover_checking(&self, trusted: bool) -> Result<(Target, bool), String> {
        let sentinels = self.target.load_full();
        // A sentinel a reload removed is forgotten: listed again, it is said again.
        SILENT
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|u| sentinels.sentinels.contains(u));
        let recheck = self.suspect.swap(false, Ordering::Relaxed) || !trusted;
        let mut why = String::from("no sentinel to ask");
        let mut not_masters: Vec<String> = Vec::new();
        // Named, but taken as replicas without asking ([`REPLICA_KEPT`]).
        let mut passed_over: Vec<(String, u16)> = Vec::new();
        for url in &sentinels.sentinels {
            let Some(dial) = self.sentinel_dial(url) else {
                continue;
            };
            let (host, port) = match self.ask_one(url, &dial, &sentinels.master).await {
                Ok(addr) => {
                    answered(url, None);
                    addr
                }
                Err(e) => {
                    answered(url, Some(&e));
                    why = e;
                    continue;
                }
            };
            let Some(target) = self.target_for(&host, port) else {
                why = format!(
                    "sentinel {} names {host}:{port}, which is no address",
                    dial.info.addr()
                );
                continue;
            };
            if not_masters.contains(&target.node) {
                continue;
            }
            let in_use = self.master().as_deref() == Some(target.node.as_str());
            if in_use && !recheck {
                return Ok((target, false));
            }
            let replica_lately = !in_use && {
                let mut replicas = self.replicas.lock().unwrap_or_else(|p| p.into_inner());
                replicas.retain(|(_, at)| at.elapsed() < REPLICA_KEPT);
                replicas.iter().any(|(node, _)| *node == target.node)
            };
            let role = match replica_lately {
                true => {
                    passed_over.push((host.clone(), port));
                    Ok(false)
                }
                false => self.is_master(&target).await,
            };
            match role {
                Ok(true) => return Ok((target, true)),
                Ok(false) => {
                    if !replica_lately {
                        let mut replicas = self.replicas.lock().unwrap_or_else(|p| p.into_inner());
                        replicas.push((target.node.clone(), std::time::Instant::now()));
                    }
                    tracing::debug!(node = %target.node, sentinel = %dial.info.addr(), "a sentinel names a node that is not a master (yet)");
                    why = format!(
                        "sentinel {} names {}, which does not answer as a master",
                        dial.info.addr(),
                        target.node
                    );
                }
                Err(e) => {
                    why = format!(
                        "sentinel {} names {}, which cannot be asked whether it is the master: {e}",
                        dial.info.addr(),
                        target.node
                    );
                }
            }
            not_masters.push(target.node);
        }
        // None answered as a master: one taken as a replica lately may have been promoted
        // since (a quick fail-back).
        for (host, port) in passed_over {
            let Some(target) = self.target_for(&host, port) else {
                continue;
            };
            if let Ok(true) = self.is_master(&target).await {
                self.replicas
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .retain(|(node, _)| *node != target.node);
                return Ok((target, true));
            }
        }
        Err(why)
    }

    /// The master found at start: the link is made pointing at it.
    pub(super) fn started_on(&self, target: &Target) {
        self.master.store(Some(Arc::new(target.node.clone())));
        tracing::info!(master = %target.node, "redis sentinel: using the master the sentinels name");
    }

    /// Asks once and follows the answer: `Ok(true)` when the master was checked (or is new),
    /// `Ok(false)` when the one in use was taken on the sentinels' word; `Err`: why the link
    /// points at no master now. The master in use is checked when it answered `READONLY` or
    /// the link has no connection to it (dead, or refusing: a sentinel that still names it
    /// may be stale), or when a connection to it was refused because it answered as a
    /// replica.
    pub(super) async fn follow_once(&self, link: &Link) -> Result<bool, String> {
        let trusted =
            link.conn.load().is_some() && !link.found_replica.swap(false, Ordering::Relaxed);
        let (target, checked) = self.discover_checking(trusted).await?;
        // A reload that came while the sentinels were asked made this target with the old
        // settings: the next question (the reload asked for one) makes it with the new.
        let access = self.access.load();
        if target.access != **access {
            return Ok(false);
        }
        // The master in use, connected with settings a reload has since changed, is
        // switched to as though new.
        let stale = link.target.load().access != **access;
        if stale || self.master().as_deref() != Some(target.node.as_str()) {
            self.switch(link, target);
            return Ok(true);
        }
        Ok(checked)
    }
}

/// Whether the node on `conn` answers `ROLE` as a master; `None` when the user may not run
/// `ROLE`.
pub(super) async fn master_by_role(
    conn: &mut redis::aio::MultiplexedConnection,
) -> redis::RedisResult<Option<bool>> {
    let unknown = || {
        redis::RedisError::from((
            redis::ErrorKind::UnexpectedReturnType,
            "ROLE answered an unknown shape",
        ))
    };
    match redis::cmd("ROLE").query_async(conn).await {
        Ok(redis::Value::Array(items)) => match items.first() {
            Some(redis::Value::BulkString(b)) => Ok(Some(b.as_slice() == b"master")),
            _ => Err(unknown()),
        },
        Ok(_) => Err(unknown()),
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Notes whether the sentinel at `url` named a master (`None`) or not (why: no answer, a
/// refused password, no master of that name): said once at WARN, and once at INFO when
/// it names one again.
fn answered(url: &str, failed: Option<&str>) {
    let mut silent = SILENT.lock().unwrap_or_else(|p| p.into_inner());
    let known = silent.iter().position(|u| u == url);
    match (failed, known) {
        (None, Some(at)) => {
            silent.swap_remove(at);
            tracing::info!(sentinel = %redact_url(url), "redis sentinel: the sentinel names a master again");
        }
        (Some(reason), None) => {
            silent.push(url.to_owned());
            tracing::warn!(reason = %reason, "redis sentinel: a sentinel cannot be asked for the master; the next one is asked (one fewer to follow a failover with)");
        }
        _ => {}
    }
}

/// Keeps `link` on the master for the life of the store.
pub(super) async fn follow(sentinel: Arc<Sentinel>, link: Arc<Link>) {
    tokio::spawn(watch_switches(Arc::clone(&sentinel)));
    // No master at start was said as the store started.
    let mut warned = sentinel.master().is_none();
    loop {
        match sentinel.follow_once(&link).await {
            // Warned again only after a master was found that answers as one: taking the one
            // in use on the sentinels' word between its READONLY answers is not a recovery.
            Ok(true) => warned = false,
            Ok(false) => {}
            Err(reason) if !warned => {
                warned = true;
                // The master already followed is kept: decisions go on there as long as it
                // answers, and a failover meanwhile is found when a sentinel answers again.
                match sentinel.master() {
                    Some(master) => {
                        tracing::warn!(reason = %reason, master = %master, "redis sentinel: no sentinel names a reachable master now; decisions stay on the last one named, asking again every second")
                    }
                    None => {
                        tracing::warn!(reason = %reason, "redis sentinel: no sentinel names a reachable master; asking again every second")
                    }
                }
            }
            Err(_) => {}
        }
        // Asked again at once by every READONLY answer: not more often than this.
        tokio::time::sleep(ASK_GAP).await;
        tokio::select! {
            _ = tokio::time::sleep(POLL_EVERY - ASK_GAP) => {}
            _ = sentinel.ask.notified() => {}
        }
    }
}

/// Subscribes to `+switch-master` on the first sentinel that takes the subscription, and
/// asks the sentinels again on every switch of this master; resubscribes when the sentinel
/// goes away.
async fn watch_switches(sentinel: Arc<Sentinel>) {
    loop {
        let target = sentinel.target.load_full();
        for url in &target.sentinels {
            let Some(dial) = sentinel.sentinel_dial(url) else {
                continue;
            };
            let Ok(pubsub) = connect::subscribed(&dial, "+switch-master").await else {
                continue;
            };
            let mut messages = pubsub.into_on_message();
            let mut ended = true;
            while let Some(msg) = messages.next().await {
                let payload: String = msg.get_payload().unwrap_or_default();
                if payload.split(' ').next() == Some(target.master.as_str()) {
                    sentinel.ask.notify_one();
                }
                if **sentinel.target.load() != *target {
                    ended = false;
                    break;
                }
            }
            if ended {
                // A failover is still followed (the sentinels are asked every second); this
                // says one of them went away.
                tracing::info!(sentinel = %redact_url(url), "redis sentinel: the subscription to +switch-master on this sentinel ended; subscribing on the next that takes it");
            }
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}
