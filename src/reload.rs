//! Reload: re-read and validate the config file, then swap the live snapshot atomically.
//! An invalid file changes nothing: the old config keeps serving.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::clock::SharedClock;
use crate::config::{Config, RedisConfig};
use crate::decision::fleet::Fleet;
use crate::edge::{AccessLog, Edge};
use crate::metrics::Metrics;
use crate::server::StartError;
use crate::snapshot::Snapshot;
use crate::store::{preflight, EvictionPolicy, Store};

pub struct Reloader {
    pub path: PathBuf,
    pub live: Arc<ArcSwap<Snapshot>>,
    pub store: Store,
    pub metrics: Arc<Metrics>,
    pub clock: SharedClock,
    pub fleet: Arc<Fleet>,
    pub edge: Edge,
    /// Serializes reloads: SIGHUP and POST /reload may race.
    lock: Mutex<()>,
    /// What `watch_config` compares with, as the last reload attempt (or the start) left it.
    watched: Mutex<Watched>,
    /// The settings the process started with, of those only a restart changes: a reload is
    /// told a restart is required while the file differs from them (and no longer once it is
    /// back to them).
    running: Running,
}

/// The files `watch_config` looks at, each as it was just before it was last read, and the
/// reload attempt that said so (counted from 0, the start): the running config's files, and
/// those only the last refused config named (a key file it names anew, not written yet).
#[derive(Clone, Default)]
struct Watched {
    attempt: u64,
    files: Vec<(PathBuf, FileStamp)>,
}

struct Running {
    server: crate::config::ServerConfig,
    dedicated_io_thread: bool,
}

impl Reloader {
    /// `read`: the started config's files as its reading found them, what the watch compares
    /// with until the first reload.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        path: PathBuf,
        live: Arc<ArcSwap<Snapshot>>,
        store: Store,
        metrics: Arc<Metrics>,
        clock: SharedClock,
        fleet: Arc<Fleet>,
        edge: Edge,
        read: Vec<FileStamp>,
    ) -> Self {
        let started = live.load();
        let running = Running {
            server: started.config.server.clone(),
            dedicated_io_thread: started.config.redis.dedicated_io_thread,
        };
        let files = files(&path, &started.config)
            .into_iter()
            .zip(read)
            .collect();
        drop(started);
        Self {
            watched: Mutex::new(Watched { attempt: 0, files }),
            running,
            path,
            live,
            store,
            metrics,
            clock,
            fleet,
            edge,
            lock: Mutex::new(()),
        }
    }

    /// Reloads; returns the new generation, or every problem found. `trigger` says what
    /// asked (`admin`, `signal`, `watch`), for the log line.
    pub fn reload(&self, trigger: &'static str) -> Result<Reloaded, String> {
        let _one_at_a_time = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        // Before reading: a change made while the reload reads is then seen by the watch
        // (one more reload at worst), never missed.
        let before = file_stamp(&self.path);
        let _ = crate::config::take_refused_named();
        // A bug met while loading the new config is a failed reload, counted and logged as
        // one, never a task gone unsaid. Its words (which may quote the file) go to the
        // standard error only, as every panic's; the answer says a restart is the sure way
        // back, as the bug may have come after some of the new config was put in place.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.try_reload()))
            .unwrap_or_else(|_| {
                Err(format!(
                    "{}: the reload met a bug of the gateway (said on the standard error); the previous config serves, perhaps with some of the new one's Redis, TLS or access-log settings already in place: restart the gateway to be sure",
                    self.path.display()
                ))
            });
        let running = files(&self.path, &self.live.load().config);
        let mut watched = self.watched.lock().unwrap_or_else(|p| p.into_inner());
        let files = match &result {
            // The new config's files as they were before it read them.
            Ok(_) => (running.iter().cloned())
                .zip(stamp_read(&self.path, &self.live.load().config, before))
                .collect(),
            // The refused config's reading: the file and what it named as it found them (so the
            // same refusal is not tried again until one changes), the running config's other
            // files as they are now.
            Err(_) => {
                let read = crate::config::take_refused_named();
                let mut files = vec![(self.path.clone(), before)];
                for file in &running[1..] {
                    let stamp = (read.iter().find(|(r, _)| r == file))
                        .map_or_else(|| file_stamp(file), |(_, stamp)| *stamp);
                    files.push((file.clone(), stamp));
                }
                for (file, stamp) in read {
                    if files.iter().all(|(f, _)| *f != file) {
                        files.push((file, stamp));
                    }
                }
                files
            }
        };
        *watched = Watched {
            attempt: watched.attempt + 1,
            files,
        };
        drop(watched);
        self.metrics.config_reload(result.is_ok());
        let config = self.path.display();
        match &result {
            Ok(r) if r.restart_required.is_empty() => {
                tracing::info!(config_generation = r.generation, config_hash = %r.config_hash, routes = r.routes, %config, trigger, "config reloaded")
            }
            Ok(r) => tracing::info!(
                config_generation = r.generation,
                config_hash = %r.config_hash,
                routes = r.routes,
                %config,
                trigger,
                // The fields as one list: `server.listen,server.threads`.
                restart_required = %r.restart_required.join(","),
                "config reloaded"
            ),
            Err(e) => {
                tracing::error!(error = %e, %config, trigger, "config reload failed; the previous config keeps serving")
            }
        }
        result
    }

    /// `reload` from async code: file reading and validation run on a blocking thread.
    pub async fn reload_off_thread(
        self: &Arc<Self>,
        trigger: &'static str,
    ) -> Result<Reloaded, String> {
        let reloader = Arc::clone(self);
        tokio::task::spawn_blocking(move || reloader.reload(trigger))
            .await
            .unwrap_or_else(|e| Err(format!("reload task failed: {e}")))
    }

    /// The start's refusal of an evicting Redis, for a reload that points at another Redis
    /// (or turns `require_noeviction` on): else the reload would be taken and the next start
    /// refused. A Redis that does not answer is not refused, as at start; the reload waits
    /// for it up to the preflight's few seconds.
    fn refuse_evicting(&self, old: &RedisConfig, new: &RedisConfig) -> Result<(), String> {
        let elsewhere = old.target != new.target || old.access != new.access;
        let check = new.require_noeviction && (elsewhere || !old.require_noeviction);
        if !check {
            return Ok(());
        }
        match self.store.runtime().block_on(preflight(new)) {
            (EvictionPolicy::Evicting(policy), node) => Err(format!(
                "{}: [redis] require_noeviction: {}",
                self.path.display(),
                StartError::Evicting { policy, node }
            )),
            // The same Redis, the requirement turned on: its connections are not made again,
            // so the connector would not say it.
            (EvictionPolicy::Unknown, _) if !elsewhere => {
                tracing::warn!("cannot read redis maxmemory-policy (CONFIG not permitted); make sure it is noeviction");
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn try_reload(&self) -> Result<Reloaded, String> {
        let config = Config::load(&self.path).map_err(|e| e.to_string())?;
        let current = self.live.load_full();
        // A file cut short after its first tables (a deploy's half-written copy) is valid
        // TOML and would take every route away: every request 404.
        if config.routes.is_empty() && !current.config.routes.is_empty() {
            return Err(format!(
                "{}: the file has no [[routes]]: loaded, every request would be 404 (a file cut short?); the previous config keeps serving",
                self.path.display()
            ));
        }
        self.refuse_evicting(&current.config.redis, &config.redis)?;
        let (old, new) = (&self.running.server, &config.server);
        let mut restart_required: Vec<&'static str> = [
            ("server.listen", old.listen != new.listen),
            ("server.admin_listen", old.admin_listen != new.admin_listen),
            ("server.threads", old.threads != new.threads),
            (
                "server.grace_period_seconds",
                old.grace_period != new.grace_period,
            ),
            (
                "server.drain_delay_seconds",
                old.drain_delay != new.drain_delay,
            ),
            ("server.h2c", old.h2c != new.h2c),
            (
                "server.h2_max_concurrent_streams",
                old.h2_max_streams != new.h2_max_streams,
            ),
            (
                "server.h2_stream_window_bytes",
                old.h2_stream_window != new.h2_stream_window,
            ),
            (
                "server.h2_connection_window_bytes",
                old.h2_connection_window != new.h2_connection_window,
            ),
            (
                "server.keepalive_timeout_seconds",
                old.keepalive_timeout != new.keepalive_timeout,
            ),
            (
                "server.max_connections",
                old.max_connections != new.max_connections
                    && crate::edge::limits::in_force(old.max_connections, old.threads)
                        != crate::edge::limits::in_force(new.max_connections, old.threads),
            ),
            (
                "redis.dedicated_io_thread",
                self.running.dedicated_io_thread != config.redis.dedicated_io_thread,
            ),
        ]
        .into_iter()
        .filter_map(|(field, changed)| changed.then_some(field))
        .collect();
        let redis = config.redis.clone();
        let breaker = config.breaker;
        let tls = config.server.tls.clone();
        let header_read_timeout = config.server.header_read_timeout;
        // Opened before anything changes (a path that cannot be written fails the reload),
        // installed once nothing else can fail.
        let access_log = AccessLog::open(config.access_log.as_ref())
            .map_err(|e| format!("access_log.path: cannot open it: {e}"))?;
        let generation = current.generation + 1;
        let moved = buckets_moved(&current.config, &config);
        let mut snapshot = Snapshot::build(
            config,
            generation,
            &self.metrics,
            &self.clock,
            &self.fleet,
            Some(&current),
        )
        .map_err(|e| format!("cannot build upstream pools: {e}"))?;
        let store = &self.store;
        if let Some(field) = store
            .retarget(&redis)
            .map_err(|e| format!("redis.url: {e}"))?
        {
            restart_required.push(field);
        }
        store.reconfigure_breakers(breaker);
        self.edge.access_log.install(access_log);
        if self.edge.certificates.install(&tls) {
            restart_required.push("server.tls");
        }
        let served = self.edge.certificates.expiries();
        self.metrics.tls_certs(
            served
                .iter()
                .map(|(path, t)| (path.as_str(), *t))
                .chain(redis.access.client_cert_expiry()),
        );
        self.edge
            .connections
            .set_header_timeout(header_read_timeout);
        self.edge
            .connections
            .set_answer_fields(&snapshot.config.server);
        snapshot.config.log_warnings();
        for (name, pool) in &snapshot.upstreams {
            let kept = current
                .upstreams
                .get(name)
                .is_some_and(|old| Arc::ptr_eq(old, pool));
            if !kept && pool.needs_tending() {
                self.store.runtime().spawn(crate::upstream::tend(
                    Arc::downgrade(pool),
                    self.metrics.upstream_healthy.clone(),
                ));
            }
        }
        // A new JWKS URL or period is fetched from now, once the new config is live (the
        // refresher reads it before each fetch).
        let jwks_changed = snapshot
            .jwks_target()
            .is_some_and(|target| Some(target) != current.jwks_target());
        let jwks = Arc::clone(&snapshot.jwks);
        for gone in current
            .endpoints
            .keys()
            .filter(|id| !snapshot.endpoints.contains_key(*id))
        {
            self.metrics.endpoint_removed(gone.as_str());
        }
        let hash = snapshot.config.source_hash.clone();
        let routes = snapshot.config.routes.len();
        snapshot.restart_required = restart_required.clone();
        self.live.store(Arc::new(snapshot));
        if jwks_changed {
            jwks.refresh_now();
        }
        self.metrics
            .config_loaded(generation, &hash, restart_required.len());
        for (endpoint, why) in &moved {
            tracing::warn!(endpoint_id = %endpoint, "{why}");
        }
        Ok(Reloaded {
            generation,
            config_hash: hash,
            routes,
            restart_required,
        })
    }
}

/// How often the watcher looks at the file, and how long a change must stay unchanged
/// before it is loaded (an editor writing in several steps is read once, complete).
pub const WATCH_EVERY: Duration = Duration::from_millis(500);

/// How many more looks a change that leaves a file missing waits for it to come back before
/// it is loaded (and fails, said once): 5 s.
const MISSING_LOOKS: u32 = 10;

/// With `server.watch_config = true`: reloads when the file's modification time or size
/// changes, once it has been stable for one more look. Failed reloads are counted and logged
/// as any reload; the next change is tried again, a change to a file only the refused config
/// names too (a key file or certificate it names anew, written after it: Kubernetes updates
/// a ConfigMap's and a Secret's volumes each in its own time).
pub async fn watch(reloader: Arc<Reloader>) {
    // The last attempt's files, when it is not the attempt `seen`.
    let since = |seen: Option<u64>| {
        let w = reloader.watched.lock().unwrap_or_else(|p| p.into_inner());
        (Some(w.attempt) != seen).then(|| w.clone())
    };
    let (mut seen, mut looked_at, mut loaded) = (None, Vec::new(), Vec::new());
    if let Some(Watched { attempt, files }) = since(seen) {
        seen = Some(attempt);
        (looked_at, loaded) = files.into_iter().unzip();
    }
    let (mut pending, mut missing_looks) = (None, 0);
    loop {
        tokio::time::sleep(WATCH_EVERY).await;
        if !reloader.live.load().config.server.watch_config {
            pending = None;
            continue;
        }
        // A reload attempt by any trigger (the one that turned the watch on, too): the files
        // as it read them, so a change made just after it is still a change.
        if let Some(Watched { attempt, files }) = since(seen) {
            seen = Some(attempt);
            (looked_at, loaded) = files.into_iter().unzip();
            pending = None;
        }
        let now: Vec<FileStamp> = looked_at.iter().map(|f| file_stamp(f)).collect();
        if now == loaded {
            pending = None;
            continue;
        }
        if pending.as_ref() != Some(&now) {
            (pending, missing_looks) = (Some(now), 0);
            continue;
        }
        // A file gone is waited for a while: a deploy that deletes it and writes it again
        // (a second later, say) is one change, not a failed reload in between. One missing
        // already (a refused config's, yet to come) is no reason to wait.
        let gone = now
            .iter()
            .zip(&loaded)
            .any(|(n, l)| n.is_none() && l.is_some());
        if gone && missing_looks < MISSING_LOOKS {
            missing_looks += 1;
            continue;
        }
        loaded = now;
        (pending, missing_looks) = (None, 0);
        let _ = reloader.reload_off_thread("watch").await;
    }
}

pub(crate) use crate::config::{file_stamp, FileStamp};

/// The config file and the files it names (API keys, JWKS, certificates and keys): what
/// `watch_config` looks at.
fn files(path: &std::path::Path, config: &Config) -> Vec<PathBuf> {
    std::iter::once(path.to_path_buf())
        .chain(config.named_files())
        .collect()
}

/// The files of `config` as its reading found them: the config file as `before` stamped it
/// before it was read, the files it names as they were just before each was read (one it
/// names but did not read, as it is now).
pub(crate) fn stamp_read(
    path: &std::path::Path,
    config: &Config,
    before: FileStamp,
) -> Vec<FileStamp> {
    let files = files(path, config);
    std::iter::once(before)
        .chain(files[1..].iter().map(|f| {
            (config.named_read.iter())
                .find(|(read, _)| read == f)
                .map_or_else(|| file_stamp(f), |(_, stamp)| *stamp)
        }))
        .collect()
}

/// The endpoints a reload keeps under the same `key_prefix` and `policy_version` whose
/// buckets it moves all the same, with why: limits moved between the single-limit fields and
/// `[[routes.limits]]` (other keys: every caller starts afresh), or a limit whose algorithm
/// changed (both kinds keep their state in the same key: the new one reads it as none, and
/// a change back finds what the old one left). Said at WARN: `policy_version` says it on
/// purpose.
fn buckets_moved(old: &Config, new: &Config) -> Vec<(String, String)> {
    use crate::config::{Algorithm, Policy};
    let kind = |a: Algorithm| match a {
        Algorithm::None => "none",
        Algorithm::TokenBucket { .. } => "token_bucket",
        Algorithm::SlidingWindow { .. } => "sliding_window",
    };
    if old.redis.key_prefix != new.redis.key_prefix {
        return Vec::new();
    }
    let before: std::collections::HashMap<&str, &Policy> = old
        .routes
        .iter()
        .map(|r| (r.policy.endpoint_id.as_str(), &*r.policy))
        .collect();
    let mut moved = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for route in &new.routes {
        let p = &route.policy;
        let id = p.endpoint_id.as_str();
        let Some(q) = before
            .get(id)
            .filter(|q| q.policy_version == p.policy_version)
        else {
            continue;
        };
        if !seen.insert(id) {
            continue;
        }
        if !p.is_limited() || !q.is_limited() {
            continue;
        }
        if p.several != q.several {
            moved.push((id.to_owned(), "a reload moved the endpoint's limits between the single-limit fields and [[routes.limits]] under the same policy_version: their buckets live under other keys, so every caller starts afresh".to_owned()));
            continue;
        }
        // Each limit kept by name, the route's own and each tier's (a tier's keys are its
        // own, kept under the same rule).
        let matched = |now: &[crate::config::Limit], was: &[crate::config::Limit], tier: &str| {
            now.iter()
                .filter_map(|l| {
                    let old = was
                        .iter()
                        .find(|o| o.name == l.name && o.global == l.global)?;
                    let name = match tier {
                        "" => l.name.clone(),
                        tier => format!("{} of tier {tier}", l.name),
                    };
                    Some((l.algorithm, old.algorithm, name))
                })
                .collect::<Vec<_>>()
        };
        let mut pairs: Vec<(Algorithm, Algorithm, String)> = match p.several {
            true => matched(&p.limits, &q.limits, ""),
            false => vec![(p.algorithm, q.algorithm, "default".to_owned())],
        };
        if let (Some(now), Some(was)) = (&p.tiers, &q.tiers) {
            for (tier, limits) in &now.tiers {
                if let (
                    crate::config::TierLimits::Limits(now),
                    Some(crate::config::TierLimits::Limits(was)),
                ) = (limits, was.tiers.get(tier))
                {
                    pairs.extend(matched(now, was, tier));
                }
            }
        }
        for (now, was, name) in pairs {
            if kind(was) != kind(now) {
                moved.push((id.to_owned(), format!("a reload changed limit {name} from {} to {} under the same policy_version: both keep their state in the same Redis key, so the new one starts afresh and a change back finds what the old one left; bump policy_version with such a change", kind(was), kind(now))));
            } else if let (
                Algorithm::SlidingWindow {
                    window_micro: w, ..
                },
                Algorithm::SlidingWindow {
                    window_micro: v, ..
                },
            ) = (was, now)
            {
                if w != v {
                    moved.push((id.to_owned(), format!("a reload changed limit {name}'s window_size_micro from {w} to {v} under the same policy_version: a window's count is kept under its index in windows of the old size, so every caller's count starts afresh; bump policy_version with such a change")));
                }
            }
        }
        // Its IPv6 callers are keyed by another network length: other keys.
        let (was, now) = (
            old.server.ipv6_identity_prefix,
            new.server.ipv6_identity_prefix,
        );
        if was != now && route.identity == crate::config::IdentitySource::ClientIp {
            moved.push((id.to_owned(), format!("a reload changed server.ipv6_identity_prefix from {was} to {now}: the endpoint's IPv6 callers are keyed by other networks, so each starts afresh (set it alike on every gateway of a fleet, or their IPv6 callers have a bucket for each)")));
        }
    }
    moved
}

/// A successful reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reloaded {
    pub generation: u64,
    /// The new config's `config_hash` (as `/readyz` says it) and its routes: what a deploy
    /// compares with the file it wrote, in the log line.
    pub config_hash: String,
    pub routes: usize,
    /// Changed fields that only take effect after a restart.
    pub restart_required: Vec<&'static str>,
}
