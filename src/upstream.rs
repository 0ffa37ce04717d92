//! An upstream at run time: its addresses behind round robin (host names resolved again
//! every 30 s, every address of a name used), active health checks, and TLS.
//!
//! Pingora's load balancer keeps the addresses and runs the health checks (`HttpHealthCheck`
//! with its consecutive-failure and consecutive-success hysteresis); this module feeds it
//! addresses and runs both on timers of their own, off the request path ([`tend`]). After
//! each, the pool makes the list requests choose from ([`Pick`]s, the healthy ones apart), so
//! the rotation itself is an atomic add on a list: measured, Pingora's own `select` cost
//! about 2 000 instructions a request (a set of tried backends, a hash per backend, a clone
//! of the chosen backend's extensions).

use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use futures_util::FutureExt;
use pingora_core::utils::tls::{parse_x509, WrappedX509};
use pingora_load_balancing::discovery::ServiceDiscovery;
use pingora_load_balancing::health_check::HttpHealthCheck;

mod grpc_health;
use grpc_health::GrpcHealthCheck;
pub use grpc_health::GRPC_HEALTH_PATH;
use pingora_load_balancing::selection::RoundRobin;
use pingora_load_balancing::{Backend, Backends, LoadBalancer};
use prometheus::IntGaugeVec;

use crate::config::UpstreamConfig;

/// How often host names are resolved again.
pub const RESOLVE_EVERY: Duration = Duration::from_secs(30);

/// How often while the upstream has no address at all (its names did not resolve yet).
const NO_ADDRESS_RESOLVE: Duration = Duration::from_secs(1);

/// The host an address came from, as written in `addrs`: the SNI name of a TLS upstream.
#[derive(Debug, Clone)]
pub struct UpstreamHost(pub String);

/// An upstream's addresses behind round robin, with its timeouts.
pub struct UpstreamPool {
    pub config: Arc<UpstreamConfig>,
    pub balancer: LoadBalancer<RoundRobin>,
    /// `tls = true`: what each connection's handshake needs.
    pub tls: Option<PeerTls>,
    addresses: Arc<Addresses>,
    /// What requests choose from: the balancer's addresses and their health as last seen,
    /// made again after each resolution and health check (off the request path).
    picks: ArcSwap<Picks>,
    /// The round robin's position.
    next: AtomicUsize,
    /// Logged once while every address is unhealthy.
    all_down: AtomicBool,
    /// Logged once while the pool has no address at all (its names do not resolve).
    no_address: AtomicBool,
}

/// One attempt's address: its place in the rotation (to continue from on a retry), how many
/// addresses the rotation held, and the address.
pub struct Turn {
    pub place: usize,
    pub of: usize,
    pub pick: Arc<Pick>,
}

/// An address a request can be sent to.
#[derive(Debug)]
pub struct Pick {
    pub addr: pingora_core::protocols::l4::socket::SocketAddr,
    /// The host it came from, as written in `addrs`: the SNI name of a TLS upstream without
    /// `sni`.
    pub host: String,
}

/// Every address, and the healthy ones.
#[derive(Default)]
struct Picks {
    all: Vec<Arc<Pick>>,
    healthy: Vec<Arc<Pick>>,
}

impl Picks {
    fn of(balancer: &LoadBalancer<RoundRobin>) -> Self {
        let backends = balancer.backends();
        let mut picks = Picks::default();
        for b in backends.get_backend().iter() {
            let pick = Arc::new(Pick {
                addr: b.addr.clone(),
                host: b
                    .ext
                    .get::<UpstreamHost>()
                    .map(|h| h.0.clone())
                    .unwrap_or_default(),
            });
            if backends.ready(b) {
                picks.healthy.push(Arc::clone(&pick));
            }
            picks.all.push(pick);
        }
        picks
    }
}

/// TLS towards one upstream, ready for Pingora's connector.
pub struct PeerTls {
    /// The configured SNI name; `None`: each address's host.
    pub sni: Option<String>,
    pub ca: Option<Arc<pingora_core::protocols::tls::CaType>>,
    pub verify: bool,
    /// Pingora pools upstream connections by address, SNI and `verify`, not by the roots a
    /// connection was checked against: this key (of the `ca_path` certificates; 0 for the
    /// system's roots) keeps a connection verified against one set of roots from serving a
    /// peer that trusts another (another upstream at the same address, or the same one after
    /// a reload rotated its CA).
    pub pool_key: u64,
}

impl PeerTls {
    fn new(up: &UpstreamConfig) -> Option<Self> {
        let tls = up.tls.as_ref()?;
        let ca = tls.ca.as_ref().map(|certs| {
            let wrapped: Vec<WrappedX509> = certs
                .iter()
                .map(|der| WrappedX509::new(der.clone(), parse_x509))
                .collect();
            Arc::from(wrapped.into_boxed_slice())
        });
        let pool_key = tls.ca.as_ref().map_or(0, |certs| {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            certs.hash(&mut hasher);
            hasher.finish().max(1)
        });
        Some(Self {
            sni: tls.sni.clone(),
            ca,
            verify: tls.verify,
            pool_key,
        })
    }

    /// The SNI name for `backend`.
    pub fn sni_for(&self, pick: &Pick) -> String {
        self.sni.clone().unwrap_or_else(|| pick.host.clone())
    }
}

/// The addresses the last resolution found; what the load balancer's discovery answers.
struct Addresses {
    latest: Mutex<BTreeSet<Backend>>,
}

struct Discovery(Arc<Addresses>);

#[async_trait]
impl ServiceDiscovery for Discovery {
    async fn discover(&self) -> pingora_core::Result<(BTreeSet<Backend>, HashMap<u64, bool>)> {
        let latest = self.0.latest.lock().unwrap_or_else(|p| p.into_inner());
        Ok((latest.clone(), HashMap::new()))
    }
}

/// The addresses of the entries of `up` that resolve now (an IP is its own), each tagged
/// with its host; a name that does not resolve has none here.
fn resolve(up: &UpstreamConfig) -> BTreeSet<Backend> {
    let mut set = BTreeSet::new();
    for (host, written) in up.hosts.iter().zip(&up.addrs) {
        let found: Vec<SocketAddr> = if host.parse::<std::net::IpAddr>().is_ok() {
            vec![*written]
        } else {
            match (host.as_str(), written.port()).to_socket_addrs() {
                Ok(found) => found.collect(),
                Err(_) => Vec::new(),
            }
        };
        set.extend(found.into_iter().map(|addr| backend(host, addr)));
    }
    set
}

/// The host a backend came from, as written in `addrs`.
fn host_of(b: &Backend) -> &str {
    b.ext.get::<UpstreamHost>().map_or("", |h| h.0.as_str())
}

/// What a pool holds after a resolution that `found` these: each name's new addresses, and
/// a name that did not resolve now keeps its last ones (none if it never resolved); and
/// whether every entry resolved.
fn merge(
    up: &UpstreamConfig,
    latest: &BTreeSet<Backend>,
    found: BTreeSet<Backend>,
) -> (BTreeSet<Backend>, bool) {
    let resolved = |host: &str, set: &BTreeSet<Backend>| set.iter().any(|b| host_of(b) == host);
    let every = up.hosts.iter().all(|h| resolved(h, &found));
    let kept: Vec<Backend> = latest
        .iter()
        .filter(|b| !resolved(host_of(b), &found))
        .cloned()
        .collect();
    let mut merged = found;
    merged.extend(kept);
    (merged, every)
}

/// When to resolve again: after `every`, or after a second while the pool has no address at
/// all (its names never resolved).
fn resolve_at(every: Duration, empty: bool) -> Instant {
    Instant::now()
        + if empty {
            every.min(NO_ADDRESS_RESOLVE)
        } else {
            every
        }
}

/// Most calls one HTTP/2 connection to an `http2` upstream carries at once (fewer when the
/// upstream's SETTINGS say so); past them, another connection is opened. gRPC servers
/// commonly allow 100.
pub const H2_STREAMS: usize = 100;

impl UpstreamPool {
    pub fn new(up: &Arc<UpstreamConfig>) -> std::io::Result<Self> {
        // At load: the addresses of every entry that resolves now; a name that does not is
        // resolved again by `tend` (every second while the pool has no address at all).
        let initial = resolve(up);
        let addresses = Arc::new(Addresses {
            latest: Mutex::new(initial),
        });
        let backends = Backends::new(Box::new(Discovery(Arc::clone(&addresses))));
        let mut balancer = LoadBalancer::<RoundRobin>::from_backends(backends);
        let tls = PeerTls::new(up);
        if let Some(hc) = &up.health_check {
            let host = tls
                .as_ref()
                .and_then(|t| t.sni.clone())
                .or_else(|| up.hosts.first().cloned())
                .unwrap_or_default();
            let mut check = HttpHealthCheck::new(&host, up.tls.is_some());
            check.consecutive_failure = hc.unhealthy_after as usize;
            check.consecutive_success = hc.healthy_after as usize;
            check.reuse_connection = false;
            check.req.set_uri(
                hc.path
                    .parse()
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
            );
            let options = &mut check.peer_template.options;
            if up.http2 {
                options.set_http_version(2, if up.tls.is_some() { 1 } else { 2 });
            }
            options.connection_timeout = Some(hc.timeout);
            options.total_connection_timeout = Some(hc.timeout);
            options.read_timeout = Some(hc.timeout);
            options.write_timeout = Some(hc.timeout);
            if let Some(t) = &tls {
                options.verify_cert = t.verify;
                options.verify_hostname = t.verify;
                options.ca = t.ca.clone();
            }
            // Any 2xx passes; connect errors, timeouts and other statuses fail, and so does a
            // gRPC error status in the head (a gRPC server answering a path it has not).
            check.validator = Some(Box::new(|resp| {
                let grpc = crate::proxy::grpc::status_in(&resp.headers).filter(|c| *c != 0);
                if let (true, Some(code)) = (resp.status.is_success(), grpc) {
                    pingora_core::Error::e_explain(
                        pingora_core::ErrorType::CustomCode("unhealthy status", 0),
                        format!("health check answered grpc-status {code}"),
                    )
                } else if resp.status.is_success() {
                    Ok(())
                } else {
                    pingora_core::Error::e_explain(
                        pingora_core::ErrorType::CustomCode("unhealthy status", 0),
                        format!("health check answered {}", resp.status),
                    )
                }
            }));
            // Pingora logs each address's change of health (WARN with the failed check's
            // error, INFO when it passes again) naming the address by this.
            // As the config's messages name it: quoted when TOML quotes it (`"api v2"`).
            let name = crate::config::key_shown(&up.name);
            let summary =
                move |backend: &Backend| format!("upstreams.{name} address {}", backend.addr);
            match &hc.grpc_service {
                None => {
                    check.backend_summary_callback = Some(Box::new(summary));
                    balancer.set_health_check(Box::new(check));
                }
                Some(service) => {
                    let peer = check.peer_template.clone();
                    let mut grpc = GrpcHealthCheck::new(peer, &host, service, hc.timeout);
                    grpc.unhealthy_after = hc.unhealthy_after as usize;
                    grpc.healthy_after = hc.healthy_after as usize;
                    grpc.summary = Box::new(summary);
                    balancer.set_health_check(Box::new(grpc));
                }
            }
        }
        balancer
            .update()
            .now_or_never()
            .expect("the discovery answers at once")
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(Self {
            config: Arc::clone(up),
            picks: ArcSwap::from_pointee(Picks::of(&balancer)),
            balancer,
            tls,
            addresses,
            next: AtomicUsize::new(0),
            all_down: AtomicBool::new(false),
            no_address: AtomicBool::new(false),
        })
    }

    /// Makes the addresses requests choose from again, from the balancer's.
    fn refresh_picks(&self) {
        let picks = Picks::of(&self.balancer);
        // Addresses again: the next time there are none is said again (off the request path).
        if !picks.all.is_empty() {
            self.no_address.store(false, Ordering::Relaxed);
        }
        self.picks.store(Arc::new(picks));
    }

    /// The address of one attempt: round robin over the healthy ones; when none is healthy,
    /// over all of them (logged once until one is healthy again). A load, an atomic add and
    /// a reference count: no allocation, no hashing (Pingora's own `select` builds a set and
    /// clones the backend with its extensions on every call).
    ///
    /// A request's first attempt (`after = None`) takes the rotation's next place; a retry
    /// after a failed connect passes its first place plus the attempts so far and takes the
    /// place after its last, so one request goes round the list in order whatever other
    /// requests take meanwhile, and tries no address twice before it has tried them all.
    pub fn select_turn(&self, after: Option<usize>) -> Option<Turn> {
        let picks = self.picks.load();
        let list = if picks.healthy.is_empty() {
            // Read before the swap: while everything is down, requests do not all write the
            // flag's cache line.
            if !picks.all.is_empty()
                && !self.all_down.load(Ordering::Relaxed)
                && !self.all_down.swap(true, Ordering::Relaxed)
            {
                tracing::warn!(
                    upstream = self.config.name.as_str(),
                    "every address of the upstream is unhealthy; trying them all"
                );
            }
            &picks.all
        } else {
            if self.all_down.load(Ordering::Relaxed) && self.all_down.swap(false, Ordering::Relaxed)
            {
                tracing::info!(
                    upstream = self.config.name.as_str(),
                    "an upstream address is healthy again"
                );
            }
            &picks.healthy
        };
        if list.is_empty() {
            if !self.no_address.load(Ordering::Relaxed)
                && !self.no_address.swap(true, Ordering::Relaxed)
            {
                tracing::warn!(
                    upstream = self.config.name.as_str(),
                    "the upstream has no address (its host names did not resolve yet); its requests are answered 502"
                );
            }
            return None;
        }
        let place = after.unwrap_or_else(|| self.next.fetch_add(1, Ordering::Relaxed));
        Some(Turn {
            place,
            of: list.len(),
            pick: Arc::clone(&list[place % list.len()]),
        })
    }

    /// Whether this pool needs [`tend`]: a host name to resolve again, or health checks.
    pub fn needs_tending(&self) -> bool {
        self.config.health_check.is_some()
            || self
                .config
                .hosts
                .iter()
                .any(|h| h.parse::<std::net::IpAddr>().is_err())
    }
}

/// Resolves the pool's names every 30 s and runs its health checks every `interval_ms`,
/// until the pool is dropped (a reload replaced it); `healthy` is
/// `sentinel_upstream_healthy{upstream, addr}`.
pub async fn tend(pool: Weak<UpstreamPool>, healthy: IntGaugeVec) {
    tend_with(pool, healthy, Resolver::system()).await
}

/// The addresses of an upstream's entries that resolve now ([`resolve`]).
pub type ResolveFn = dyn Fn(&UpstreamConfig) -> BTreeSet<Backend> + Send + Sync;

/// How a pool's names become addresses, and how often it asks: the system's resolver every
/// [`RESOLVE_EVERY`] in the gateway; tests put one of their own in its place.
#[derive(Clone)]
pub struct Resolver {
    pub resolve: Arc<ResolveFn>,
    pub every: Duration,
}

impl Resolver {
    pub fn system() -> Self {
        Self {
            resolve: Arc::new(resolve),
            every: RESOLVE_EVERY,
        }
    }
}

/// A backend of `host` at `addr`, as the resolution makes them.
pub fn backend(host: &str, addr: SocketAddr) -> Backend {
    let mut backend = Backend {
        addr: pingora_core::protocols::l4::socket::SocketAddr::Inet(addr),
        weight: 1,
        ext: http::Extensions::new(),
    };
    backend.ext.insert(UpstreamHost(host.to_owned()));
    backend
}

/// Whether an upstream's names stopped resolving: said once when they stop, once when they
/// resolve again, not at every look.
#[derive(Debug, Default)]
struct Failing(bool);

#[derive(Debug, PartialEq, Eq)]
enum Change {
    Failing,
    Resolved,
}

impl Failing {
    fn saw(&mut self, resolved: bool) -> Option<Change> {
        let was = std::mem::replace(&mut self.0, !resolved);
        match (was, resolved) {
            (false, false) => Some(Change::Failing),
            (true, true) => Some(Change::Resolved),
            _ => None,
        }
    }
}

/// [`tend`] with `resolver` in place of the system's.
pub async fn tend_with(pool: Weak<UpstreamPool>, healthy: IntGaugeVec, resolver: Resolver) {
    let every = resolver.every;
    let empty = pool
        .upgrade()
        .is_some_and(|p| p.picks.load().all.is_empty());
    let mut next_resolve = resolve_at(every, empty);
    let mut shown: BTreeSet<String> = BTreeSet::new();
    let mut failing = Failing::default();
    let Some(name) = pool.upgrade().map(|p| p.config.name.clone()) else {
        return;
    };
    loop {
        let Some(p) = pool.upgrade() else {
            // Replaced by a reload: its series go unless the new pool shows them again.
            for addr in &shown {
                let _ = healthy.remove_label_values(&[&name, addr]);
            }
            return;
        };
        if Instant::now() >= next_resolve {
            let config = Arc::clone(&p.config);
            let resolve = Arc::clone(&resolver.resolve);
            let found = tokio::task::spawn_blocking(move || resolve(&config))
                .await
                .unwrap_or_default();
            let (merged, resolved) = {
                let latest = p.addresses.latest.lock().unwrap_or_else(|e| e.into_inner());
                merge(&p.config, &latest, found)
            };
            *p.addresses.latest.lock().unwrap_or_else(|e| e.into_inner()) = merged;
            if let Err(e) = p.balancer.update().await {
                tracing::warn!(upstream = p.config.name.as_str(), error = %e, "cannot update the upstream's addresses");
            }
            p.refresh_picks();
            match failing.saw(resolved) {
                Some(Change::Failing) => tracing::warn!(
                    upstream = p.config.name.as_str(),
                    "some of the upstream's host names do not resolve; each keeps the addresses it last had (none if it never resolved) until it does"
                ),
                Some(Change::Resolved) => tracing::info!(
                    upstream = p.config.name.as_str(),
                    "the upstream's host names resolve again"
                ),
                None => {}
            }
            next_resolve = resolve_at(every, p.picks.load().all.is_empty());
        }
        let wait = match &p.config.health_check {
            Some(hc) => {
                p.balancer.backends().run_health_check(true).await;
                p.refresh_picks();
                let name = name.as_str();
                let now: BTreeSet<String> = p
                    .balancer
                    .backends()
                    .get_backend()
                    .iter()
                    .map(|b| {
                        let addr = b.addr.to_string();
                        healthy
                            .with_label_values(&[name, &addr])
                            .set(i64::from(p.balancer.backends().ready(b)));
                        addr
                    })
                    .collect();
                for gone in shown.difference(&now) {
                    let _ = healthy.remove_label_values(&[name, gone]);
                }
                shown = now;
                hc.interval
            }
            None => every,
        };
        drop(p);
        tokio::time::sleep(wait.min(next_resolve.saturating_duration_since(Instant::now()))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(addrs: Vec<SocketAddr>, hosts: Vec<String>) -> Arc<UpstreamConfig> {
        Arc::new(UpstreamConfig {
            name: "u".into(),
            addrs,
            hosts,
            connect_timeout: Duration::from_secs(1),
            read_timeout: Duration::from_secs(1),
            tls: None,
            http2: false,
            health_check: None,
            inert_tls: Vec::new(),
            written_at: Default::default(),
        })
    }

    /// The addresses `n` selections choose, each connected to as a request would.
    async fn chosen(pool: &UpstreamPool, n: usize) -> BTreeSet<SocketAddr> {
        let mut seen = BTreeSet::new();
        for _ in 0..n {
            let Some(turn) = pool.select_turn(None) else {
                return seen;
            };
            let backend = turn.pick;
            let addr = *backend.addr.as_inet().expect("an inet address");
            tokio::net::TcpStream::connect(addr)
                .await
                .unwrap_or_else(|e| panic!("{addr} chosen but refused: {e}"));
            seen.insert(addr);
        }
        seen
    }

    /// A name whose addresses change while the pool is in use: a new address is used from the
    /// next resolution on, one that went is no longer chosen, a resolution that fails keeps
    /// what there was, and no selection comes back empty or names an address that refuses.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_name_whose_addresses_change_is_followed_without_a_refused_connection() {
        let mut listeners = Vec::new();
        for _ in 0..2 {
            listeners.push(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
        }
        let (a, b) = (
            listeners[0].local_addr().unwrap(),
            listeners[1].local_addr().unwrap(),
        );
        let servers: Vec<_> = listeners
            .into_iter()
            .map(|l| tokio::spawn(async move { while l.accept().await.is_ok() {} }))
            .collect();
        let answer = Arc::new(Mutex::new(Some(vec![a])));
        let resolver = Resolver {
            resolve: Arc::new({
                let answer = Arc::clone(&answer);
                move |_: &UpstreamConfig| {
                    let found = answer.lock().unwrap().clone().unwrap_or_default();
                    found
                        .into_iter()
                        .map(|x| backend("app.internal", x))
                        .collect()
                }
            }),
            every: Duration::from_millis(50),
        };
        // The name does not resolve with the system's resolver: the pool starts without an
        // address (a request is a 502), and has the name's as soon as the resolver answers.
        let pool =
            Arc::new(UpstreamPool::new(&config(vec![a], vec!["app.internal".into()])).unwrap());
        assert!(pool.needs_tending());
        assert!(pool.select_turn(None).is_none());
        let healthy =
            IntGaugeVec::new(prometheus::Opts::new("h", "h"), &["upstream", "addr"]).unwrap();
        tokio::spawn(tend_with(Arc::downgrade(&pool), healthy, resolver));
        let within = |want: BTreeSet<SocketAddr>| {
            let pool = Arc::clone(&pool);
            async move {
                let deadline = Instant::now() + Duration::from_secs(5);
                loop {
                    let seen = chosen(&pool, 16).await;
                    if seen == want {
                        return;
                    }
                    assert!(Instant::now() < deadline, "chose {seen:?}, want {want:?}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        within(BTreeSet::from([a])).await;
        *answer.lock().unwrap() = Some(vec![a, b]);
        within(BTreeSet::from([a, b])).await;
        // The resolver fails for a while: both stay.
        *answer.lock().unwrap() = None;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(chosen(&pool, 16).await, BTreeSet::from([a, b]));
        // `a` leaves the name, then goes away: never chosen again.
        *answer.lock().unwrap() = Some(vec![b]);
        within(BTreeSet::from([b])).await;
        servers[0].abort();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(chosen(&pool, 64).await, BTreeSet::from([b]));
    }

    #[test]
    fn a_resolution_that_stops_and_comes_back_is_said_once_each_way() {
        let mut failing = Failing::default();
        let seen: Vec<Option<Change>> = [true, false, false, false, true, true, false]
            .into_iter()
            .map(|resolved| failing.saw(resolved))
            .collect();
        assert_eq!(
            seen,
            [
                None,
                Some(Change::Failing),
                None,
                None,
                Some(Change::Resolved),
                None,
                Some(Change::Failing)
            ]
        );
    }

    /// A retry goes round the list from its own first place, whatever other requests take
    /// meanwhile: each address once.
    #[test]
    fn a_retry_takes_the_places_after_its_own_first() {
        let addrs: Vec<SocketAddr> = (1..=3)
            .map(|port| SocketAddr::from(([127, 0, 0, 1], port)))
            .collect();
        let pool = UpstreamPool::new(&config(addrs.clone(), vec!["127.0.0.1".into(); 3])).unwrap();
        let first = pool.select_turn(None).unwrap();
        assert_eq!(first.of, 3);
        let mut tried = vec![*first.pick.addr.as_inet().unwrap()];
        for attempt in 1..3 {
            // Two other requests move the rotation between this request's attempts.
            pool.select_turn(None).unwrap();
            pool.select_turn(None).unwrap();
            let retry = pool.select_turn(Some(first.place + attempt)).unwrap();
            tried.push(*retry.pick.addr.as_inet().unwrap());
        }
        tried.sort();
        assert_eq!(tried, addrs, "each address once");
    }

    /// Round robin over healthy addresses: 300 selections over three choose each 100 times.
    #[tokio::test]
    async fn the_rotation_takes_every_address_in_turn() {
        let addrs: Vec<SocketAddr> = (1..=3)
            .map(|port| SocketAddr::from(([127, 0, 0, 1], port)))
            .collect();
        let pool = UpstreamPool::new(&config(addrs.clone(), vec!["127.0.0.1".into(); 3])).unwrap();
        let mut counts: HashMap<SocketAddr, usize> = HashMap::new();
        for _ in 0..300 {
            let pick = pool.select_turn(None).expect("an address").pick;
            *counts.entry(*pick.addr.as_inet().unwrap()).or_default() += 1;
        }
        assert_eq!(counts.len(), 3, "{counts:?}");
        assert!(counts.values().all(|&n| n == 100), "{counts:?}");
    }

    /// A pool whose names did not resolve at load asks again after a second, not after the
    /// 30 s of a pool that has addresses.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pool_without_an_address_asks_again_within_a_second() {
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let resolver = Resolver {
            resolve: Arc::new({
                let asked = Arc::clone(&asked);
                move |_: &UpstreamConfig| {
                    // The first ask fails, as the load's did; the next finds the name.
                    match asked.fetch_add(1, Ordering::SeqCst) {
                        0 => BTreeSet::new(),
                        _ => [backend("app.internal", "127.0.0.1:9".parse().unwrap())].into(),
                    }
                }
            }),
            every: RESOLVE_EVERY,
        };
        let pool = Arc::new(
            UpstreamPool::new(&config(
                vec!["0.0.0.0:9".parse().unwrap()],
                vec!["app.internal".into()],
            ))
            .unwrap(),
        );
        assert!(pool.select_turn(None).is_none());
        let healthy =
            IntGaugeVec::new(prometheus::Opts::new("h", "h"), &["upstream", "addr"]).unwrap();
        tokio::spawn(tend_with(Arc::downgrade(&pool), healthy, resolver));
        let deadline = Instant::now() + Duration::from_secs(5);
        while pool.select_turn(None).is_none() {
            assert!(
                Instant::now() < deadline,
                "asked {} times",
                asked.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            asked.load(Ordering::SeqCst),
            2,
            "a second, then a second again"
        );
    }

    /// Two names: one resolves, the other never does, then stops and comes back. The one
    /// that resolves is followed whatever the other does; the other keeps what it last had.
    #[test]
    fn each_name_keeps_its_own_last_addresses() {
        let up = config(
            vec!["0.0.0.0:80".parse().unwrap(), "0.0.0.0:80".parse().unwrap()],
            vec!["a.internal".into(), "b.internal".into()],
        );
        let at = |host: &str, last: u8| backend(host, format!("10.0.0.{last}:80").parse().unwrap());
        let set = |items: &[Backend]| items.iter().cloned().collect::<BTreeSet<Backend>>();
        // b never resolved: a's addresses alone, and a's change is taken.
        let (held, every) = merge(&up, &BTreeSet::new(), set(&[at("a.internal", 1)]));
        assert_eq!((held.len(), every), (1, false));
        let (held, _) = merge(&up, &held, set(&[at("a.internal", 2)]));
        assert_eq!(held, set(&[at("a.internal", 2)]));
        // b resolves; then b's resolver fails while a moves: b keeps its address.
        let (held, every) = merge(&up, &held, set(&[at("a.internal", 2), at("b.internal", 7)]));
        assert!(every);
        let (held, every) = merge(&up, &held, set(&[at("a.internal", 3)]));
        assert!(!every);
        assert_eq!(held, set(&[at("a.internal", 3), at("b.internal", 7)]));
    }

    #[test]
    fn every_address_of_a_name_is_used_and_tagged_with_its_host() {
        let up = config(
            vec![
                "127.0.0.1:9".parse().unwrap(),
                "127.0.0.1:8".parse().unwrap(),
            ],
            vec!["localhost".into(), "127.0.0.1".into()],
        );
        let set = resolve(&up);
        let named: Vec<_> = set
            .iter()
            .filter(|b| {
                b.ext
                    .get::<UpstreamHost>()
                    .is_some_and(|h| h.0 == "localhost")
            })
            .collect();
        assert!(!named.is_empty());
        assert!(named
            .iter()
            .all(|b| b.addr.as_inet().is_some_and(|a| a.port() == 9)));
        assert!(set.iter().any(|b| b.addr.to_string() == "127.0.0.1:8"));
    }
}
