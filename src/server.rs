//! Builds the whole gateway from a validated config and runs it under Pingora: the proxy
//! service, the admin service, reload on SIGHUP and the drain on SIGTERM.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::{ExecutionPhase, RunArgs, Server, ShutdownSignal, ShutdownSignalWatch};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::admin::Admin;
use crate::clock::{MonotonicClock, SharedClock};
use crate::config::Config;
use crate::decision::fleet::Fleet;
use crate::edge::connections::{BadHeadHook, Connections, Guard};
use crate::edge::tls::Certificates;
use crate::edge::{AccessLog, Edge};
use crate::lifecycle::Lifecycle;
use crate::limiter::heartbeat::{fleet_key, heartbeat};
use crate::metrics::Metrics;
use crate::proxy::Gateway;
use crate::reload::Reloader;
use crate::snapshot::Snapshot;
use crate::store::{preflight, EvictionPolicy, Store};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot start the Redis store: {0}")]
    Store(std::io::Error),
    #[error("redis maxmemory-policy is {policy} on {node}: keys can be evicted and rate limit quotas silently reset; set it to noeviction, or set [redis] require_noeviction = false")]
    Evicting { policy: String, node: String },
    #[error("cannot build upstream pools: {0}")]
    Upstreams(std::io::Error),
    #[error("cannot open access_log.path: {0}")]
    AccessLog(std::io::Error),
    #[error("cannot listen on {field} {addr}: {source}")]
    Listen {
        /// `server.listen` or `server.tls[i].listen`.
        field: String,
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot listen on admin_listen {addr}: {source}")]
    Admin {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// Longest wait at start for the first connection to Redis before the listeners open.
const FIRST_CONNECTION_WAIT: Duration = Duration::from_secs(1);

/// Runs the gateway until SIGTERM or SIGINT.
///
/// `read`: the config's files as its reading found them ([`crate::reload::stamp_read`]), for
/// `watch_config`: a change made since (while the gateway starts: a JWKS fetch, the first
/// Redis connection) is a change.
pub fn run(config: Config, read: Vec<crate::reload::FileStamp>) -> Result<(), StartError> {
    // Pingora retries a busy listen address forever; fail fast and say which one instead.
    let plain = config
        .server
        .listen
        .iter()
        .map(|a| ("server.listen".to_owned(), a));
    let tls = (config.server.tls.iter().enumerate())
        .map(|(i, t)| (format!("server.tls[{i}].listen"), &t.listen));
    // Held together, so that two listeners that cannot both be bound (the same port on one
    // address, or a wildcard and an address of it) fail here too; the admin listener with them.
    let mut held = Vec::new();
    for (field, addr) in plain.chain(tls) {
        held.push(
            (config.server.bind(*addr)).map_err(|source| StartError::Listen {
                field,
                addr: *addr,
                source,
            })?,
        );
    }
    let admin_addr = config.server.admin_listen;
    let admin_socket = (config.server.bind(admin_addr)).map_err(|source| StartError::Admin {
        addr: admin_addr,
        source,
    })?;
    drop(held);
    let budget = crate::edge::limits::budget(config.server.max_connections, config.server.threads);
    // Answered from now on: `/readyz` says the gateway is starting while it does.
    let admin_connections = budget.admin_connections;
    let starting = admin_socket
        .try_clone()
        .and_then(|socket| crate::admin::Starting::serve(socket, admin_connections))
        .map_err(|source| StartError::Admin {
            addr: admin_addr,
            source,
        })?;
    let metrics = Arc::new(Metrics::new());
    let clock: SharedClock = Arc::new(MonotonicClock::default());
    // The listeners open once Redis is connected, or at most a second from here (below).
    let connecting = Instant::now();
    let store = Store::start(&config.redis, config.breaker, Arc::clone(&clock), &metrics)
        .map_err(StartError::Store)?;
    // From here on no signal ends the process by its default action while it starts (a
    // preflight or a JWKS fetch can take seconds): a SIGHUP or SIGUSR1 is kept for when the
    // gateway runs, a SIGTERM or SIGINT stops it then (exit 0).
    let early = store.runtime().block_on(async { EarlySignals::listen() });
    if config.redis.require_noeviction {
        // A policy that cannot be read (`CONFIG` not permitted) is said by the connector, once
        // per connection, naming the node.
        if let (EvictionPolicy::Evicting(policy), node) =
            store.runtime().block_on(preflight(&config.redis))
        {
            return Err(StartError::Evicting { policy, node });
        }
    }
    // The listeners open once Redis is connected, or after at most a second (the eviction
    // check's included: a Redis that does not answer took it a second, then this wait
    // another): a Redis down at start does not stop the gateway, but one a few milliseconds
    // from connected does not have the first requests answered by their fail mode for want of
    // the connection.
    while !store.is_connected() && connecting.elapsed() < FIRST_CONNECTION_WAIT {
        std::thread::sleep(Duration::from_millis(5));
    }
    let access_log = Arc::new(
        AccessLog::start(
            config.access_log.as_ref(),
            metrics.access_log_dropped.clone(),
        )
        .map_err(StartError::AccessLog)?,
    );
    let server_cfg = config.server.clone();
    let certificates = Arc::new(Certificates::new(&server_cfg.tls));
    let served = certificates.expiries();
    metrics.tls_certs(
        served
            .iter()
            .map(|(path, t)| (path.as_str(), *t))
            .chain(config.redis.access.client_cert_expiry()),
    );
    let max_connections = budget.max_connections;
    let connections = Arc::new(Connections::new(
        max_connections,
        server_cfg.header_read_timeout,
        server_cfg.keepalive_timeout,
    ));
    connections.set_answer_fields(&server_cfg);
    let path = config.source.clone();
    let fleet = Arc::new(Fleet::default());
    let snapshot = Snapshot::build(config, 1, &metrics, &clock, &fleet, None)
        .map_err(StartError::Upstreams)?;
    snapshot.config.log_warnings();
    metrics.config_loaded(1, &snapshot.config.source_hash, 0);
    let jwks = Arc::clone(&snapshot.jwks);
    let jwks_target = snapshot
        .config
        .jwt
        .as_ref()
        .and_then(|j| j.jwks_url.clone());
    let live = Arc::new(ArcSwap::from_pointee(snapshot));
    {
        // A charge answered too late and given back: a denial of its keys read in between
        // is not repeated by the over-limit cache, here or on the other gateways, which are
        // told as of a reset (without waiting for them): the denial one of them read while
        // the charge stood would otherwise be repeated for the bucket's whole wait.
        // (The store lives as long as the process: the hook's hold on it is no leak.)
        let (live, teller) = (Arc::clone(&live), store.clone());
        store.on_give_back(Box::new(move |keys| {
            use crate::limiter::endpoint::{endpoint_of_key, identity_hash_of_key};
            let snapshot = live.load();
            let mut told: Vec<(&str, &str)> = Vec::new();
            for key in keys {
                let id = endpoint_of_key(key);
                let endpoint = id
                    .and_then(crate::config::EndpointId::parse)
                    .and_then(|id| snapshot.endpoints.get(&id));
                if let Some(endpoint) = endpoint {
                    endpoint.forget_denial(key);
                }
                if let (Some(id), Some(hash)) = (id, identity_hash_of_key(key)) {
                    if !told.contains(&(id, hash)) {
                        told.push((id, hash));
                    }
                }
            }
            let channel = crate::limiter::inspect::reset_channel(&snapshot.config.redis.key_prefix);
            // Not a ceiling's (every caller's: told, every other gateway would forget all
            // it remembers of the endpoint, at each late answer of a slow Redis): their
            // memory of a ceiling's denial lasts its wait.
            let global = crate::limiter::identity_hash("global");
            for (id, hash) in told.into_iter().filter(|(_, h)| *h != global) {
                teller.tell(channel.clone(), format!("{id} {hash}"));
            }
        }));
    }
    {
        // Another gateway's `DELETE /limits`: this one forgets its remembered denials of the
        // identity too (listening once it has remembered one).
        let (live, channel_of) = (Arc::clone(&live), Arc::clone(&live));
        store.listen(
            move || {
                crate::limiter::inspect::reset_channel(&channel_of.load().config.redis.key_prefix)
            },
            crate::decision::overlimit::first_remembered(),
            Box::new(move |heard| {
                use crate::decision::overlimit::{set_deaf, tried_listening};
                use crate::limiter::inspect::heard_reset;
                use crate::store::Heard;
                let endpoints = &live.load().endpoints;
                if !matches!(heard, Heard::Message(_)) {
                    tried_listening();
                }
                match heard {
                    Heard::Message(message) => heard_reset(endpoints, Some(message)),
                    // Deaf first: nothing remembered after the caches are emptied. Not
                    // listening, whether it never was (an attempt failed) or no longer is.
                    Heard::Lost | Heard::Failed => {
                        set_deaf(true);
                        heard_reset(endpoints, None);
                    }
                    Heard::Back { missed } => {
                        if missed {
                            heard_reset(endpoints, None);
                        }
                        set_deaf(false);
                    }
                    // The cache as it was before there were announcements (documented).
                    Heard::Refused => set_deaf(false),
                }
            }),
        );
    }
    {
        // A request head the HTTP/1 parser refused is answered by the connection watch; it
        // is counted and logged as every other answer.
        let (live, access_log) = (Arc::clone(&live), Arc::clone(&access_log));
        connections.on_bad_head(BadHeadHook(Box::new(move |head| {
            let snapshot = live.load();
            snapshot.unmatched.inc(head.status);
            if snapshot.config.access_log.is_some() {
                crate::proxy::access::bad_head(&access_log, head);
            }
        })));
    }
    let lifecycle = Arc::new(Lifecycle::default());
    let reloader = Arc::new(Reloader::new(
        path,
        Arc::clone(&live),
        store.clone(),
        Arc::clone(&metrics),
        clock,
        Arc::clone(&fleet),
        Edge {
            access_log: Arc::clone(&access_log),
            certificates: Arc::clone(&certificates),
            connections: Arc::clone(&connections),
        },
        read,
    ));

    let conf = ServerConf {
        threads: server_cfg.threads,
        // The drain (`Drain`) ends the process itself when the grace period is over, having
        // counted what it cuts: Pingora's own end (which drops the requests' tasks, so that
        // none looks in flight any more) comes a second later and is never reached.
        grace_period_seconds: Some(server_cfg.grace_period.as_secs() + 1),
        graceful_shutdown_timeout_seconds: Some(1),
        // A worker's share of the idle upstream connections the descriptors carry (Pingora
        // keeps this many a worker, in one pool).
        upstream_keepalive_pool_size: budget.upstream_pool_per_worker,
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();

    let gateway = Gateway {
        live: Arc::clone(&live),
        store: store.clone(),
        lifecycle: Arc::clone(&lifecycle),
        access_log: Arc::clone(&access_log),
        connections: Arc::clone(&connections),
    };
    let mut proxy = pingora_proxy::http_proxy(&server.configuration, gateway);
    let mut options = pingora_core::apps::HttpServerOptions::default();
    options.h2c = server_cfg.h2c;
    // CONNECT reaches request_filter, which refuses it with the gateway's JSON 405.
    options.allow_connect_method_proxying = true;
    // An idle HTTP/2 connection is sent a GOAWAY by the sweeper at keepalive_timeout_seconds
    // (edge::connections); Pingora's own idle timeout, which closes the socket without one,
    // stays a second behind it, for connections that never reached the proxy.
    options.h2_idle_timeout = Some(if server_cfg.keepalive_timeout.is_zero() {
        Duration::from_secs(1)
    } else {
        server_cfg.keepalive_timeout + Duration::from_secs(1)
    });
    proxy.server_options = Some(options);
    // Pingora's HTTP/2 defaults, with `h2_max_concurrent_streams` (100 by default), room for
    // a header list past the gateway's own 64 KiB bound, so that one just over it gets the
    // gateway's JSON 431 as over HTTP/1.1, rather than the h2 library's bodiless one; and the
    // configured
    // flow-control windows (the protocol's 64 KiB held an upload to 64 KiB a round trip, and
    // one stream whose upstream stopped reading held every other stream of its connection).
    let mut h2 = pingora_core::protocols::http::v2::server::default_h2_options();
    h2.max_header_list_size(2 * crate::proxy::respond::MAX_HEADER_BYTES as u32);
    h2.max_concurrent_streams(server_cfg.h2_max_streams);
    h2.initial_window_size(server_cfg.h2_stream_window);
    h2.initial_connection_window_size(server_cfg.h2_connection_window);
    proxy.h2_options = Some(h2);
    let guard = Guard {
        app: Arc::new(proxy),
        connections: Arc::clone(&connections),
        certificates: Arc::clone(&certificates),
        forwarding: std::sync::Once::new(),
    };
    let mut proxy = pingora_core::services::listening::Service::new("sentinel-proxy".into(), guard);
    // Pingora gives every accepted connection a 64 KiB read buffer, most of what an idle
    // connection costs (about 110 KiB each; 45 KiB without it, measured with 10 000 idle
    // keep-alive connections, docs/benchmarks.md). On the plain listeners the request head
    // is read into Pingora's own header buffer anyway, and throughput is the same without
    // it; the TLS listeners keep it, since the TLS layer reads in small records.
    let plain = pingora_core::protocols::l4::stream::L4BufferSettings::default().read(0);
    for addr in &server_cfg.listen {
        let mut listener =
            pingora_core::listeners::ListenerConfig::tcp(addr.to_string()).l4_buffer(plain);
        if let Some(options) = server_cfg.socket_options(*addr) {
            listener = listener.tcp_socket_options(options);
        }
        proxy.add_listener(listener);
    }
    for tls in &server_cfg.tls {
        match server_cfg.socket_options(tls.listen) {
            Some(options) => proxy.add_tcp_with_settings(&tls.listen.to_string(), options),
            None => proxy.add_tcp(&tls.listen.to_string()),
        }
    }
    let admin = Admin {
        metrics: Arc::clone(&metrics),
        lifecycle: Arc::clone(&lifecycle),
        store: store.clone(),
        reloader: Arc::clone(&reloader),
        refusals: Default::default(),
        connections: Arc::clone(&connections),
    };
    let control = store.runtime().clone();
    control.spawn(Arc::clone(&connections).sweep());
    control.spawn(reopen_on_sigusr1(Arc::clone(&reloader), early.usr1));
    control.spawn(ignore_sigusr2(early.usr2));
    let stops = Arc::new(Stops::default());
    control.spawn(keep_stops(
        [early.term, early.quit],
        early.int,
        Arc::clone(&stops),
    ));
    let watched = Arc::clone(&live);
    let mut at_start = None;
    if let Some(url) = jwks_target {
        // Fetched once before the gateway turns ready, so the first tokens verify; a provider
        // that cannot answer now is tried again in the background.
        let first = control.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), async {
                let client = crate::remote_jwks::http_client();
                crate::remote_jwks::fetch(&client, &url).await
            })
            .await
        });
        match first {
            Ok(Ok((keys, left_out))) => {
                jwks.note_left_out(&url, left_out);
                metrics.jwks_refresh.success.inc();
                jwks.install(&url, keys);
                at_start = Some(Ok(()));
            }
            Ok(Err(e)) => {
                at_start = Some(Err(e.to_string()));
                metrics.jwks_refresh.failure.inc();
                tracing::warn!(url = %crate::remote_jwks::shown(&url), error = %e, "cannot fetch the JWKS at start; tokens are refused until it is fetched");
            }
            Err(_) => {
                // Said without the fetch's own words: whatever the next failure says, it
                // is this outage's, already said.
                at_start = Some(Err(String::new()));
                metrics.jwks_refresh.failure.inc();
                tracing::warn!(url = %crate::remote_jwks::shown(&url), "the JWKS did not come within 5 s at start; tokens are refused until it is fetched");
            }
        }
    }
    // The start is over but for the listeners: the admin proper takes over. The starting
    // admin stops accepting first: the connections that come meanwhile wait in the socket's
    // backlog for the admin proper, rather than two accept loops sharing it.
    drop(starting);
    control.spawn(Arc::new(admin).serve(admin_socket, admin_connections));
    // Reloads, by `SIGHUP` (kept meanwhile) or a watched file, from here on too.
    control.spawn(reload_on_sighup(
        Arc::clone(&reloader),
        early.hup,
        early.hup_before,
    ));
    control.spawn(crate::reload::watch(Arc::clone(&reloader)));
    control.spawn(crate::remote_jwks::keep_fresh(
        jwks,
        move || watched.load().jwks_target(),
        metrics.jwks_refresh.clone(),
        at_start,
    ));
    for pool in live.load().upstreams.values().filter(|p| p.needs_tending()) {
        control.spawn(crate::upstream::tend(
            Arc::downgrade(pool),
            metrics.upstream_healthy.clone(),
        ));
    }
    let beating = Arc::clone(&live);
    control.spawn(heartbeat(
        fleet,
        store.clone(),
        move || {
            let snapshot = beating.load();
            snapshot
                .uses_fleet
                .then(|| fleet_key(&snapshot.config.redis.key_prefix))
        },
        metrics.fleet_instances.clone(),
    ));
    let mut phases = server.watch_execution_phase();
    let ready = Arc::clone(&lifecycle);
    control.spawn(async move {
        while let Ok(phase) = phases.recv().await {
            if matches!(phase, ExecutionPhase::Running) {
                // A drain asked for while starting (a SIGTERM at once) keeps it unready.
                ready.become_ready(|| tracing::info!("gateway ready"));
            }
        }
    });

    server.add_service(proxy);
    let tls: Vec<_> = server_cfg.tls.iter().map(|t| t.listen).collect();
    tracing::info!(listen = ?server_cfg.listen, tls_listen = ?tls, max_connections, admin = %server_cfg.admin_listen, "gateway starting");
    server.run(RunArgs {
        shutdown_signal: Box::new(Drain {
            lifecycle,
            grace: server_cfg.grace_period,
            delay: server_cfg.drain_delay,
            stops,
            access_log,
        }),
    });
    Ok(())
}

async fn reload_on_sighup(reloader: Arc<Reloader>, hup: Option<Signal>, before: bool) {
    let Some(mut hup) = hup else {
        tracing::error!("cannot listen for SIGHUP; reload with POST /reload");
        return;
    };
    // One that came before the runtime listened (those after are in `hup`).
    if before {
        let _ = reloader.reload_off_thread("signal").await;
    }
    while hup.recv().await.is_some() {
        let _ = reloader.reload_off_thread("signal").await;
    }
}

/// `SIGUSR1`: the access log file was rotated; open it again.
async fn reopen_on_sigusr1(reloader: Arc<Reloader>, usr1: Option<Signal>) {
    let Some(mut usr1) = usr1 else {
        tracing::error!("cannot listen for SIGUSR1; reopen the access log with a reload");
        return;
    };
    while usr1.recv().await.is_some() {
        let target = reloader.live.load().config.access_log.clone();
        // Off this runtime's threads (the admin listener's and the signals'): opening a file
        // can wait (a slow network file system).
        let log = Arc::clone(&reloader);
        let reopened = tokio::task::spawn_blocking(move || {
            log.edge.access_log.reopen(target.as_ref()).map(|()| target)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        match reopened.map(|target| target.is_none()) {
            Ok(true) => {
                tracing::info!("SIGUSR1: no access log is configured; nothing to reopen")
            }
            Ok(false) => tracing::info!("access log reopened"),
            Err(e) => {
                tracing::error!(error = %e, "cannot reopen the access log; writing on to the old file")
            }
        }
    }
}

/// `SIGUSR2`, nginx's binary upgrade, which has no counterpart here: said and ignored,
/// rather than ending the process at once by its default action.
async fn ignore_sigusr2(usr2: Option<Signal>) {
    let Some(mut usr2) = usr2 else {
        return;
    };
    while usr2.recv().await.is_some() {
        tracing::warn!("SIGUSR2 ignored: this gateway has no binary upgrade; to replace it, send it SIGTERM (it drains) and start the new one");
    }
}

/// A SIGHUP that came before the runtime could listen (while the config was read, say):
/// noted by [`hold_early_signals`]'s handler and acted on once the gateway runs. (A SIGUSR1
/// then needs nothing: the access log is opened after it.)
static EARLY_HUP: AtomicBool = AtomicBool::new(false);

extern "C" fn note_early_signal(sig: libc::c_int) {
    // Only an atomic store: what a signal handler may do.
    if sig == libc::SIGHUP {
        EARLY_HUP.store(true, Ordering::Relaxed);
    }
}

/// From the first line of a start, before the config is read: SIGHUP, SIGUSR1 and SIGUSR2
/// no longer end the process by their default action (a SIGHUP sent by a supervisor right
/// after the start did). Tokio's handlers, installed later, chain to this one, so it goes on
/// noting them; only what came before the gateway runs is acted on ([`EARLY_HUP`]).
pub fn hold_early_signals() {
    for sig in [libc::SIGHUP, libc::SIGUSR1, libc::SIGUSR2] {
        // SAFETY: the handler only stores to an atomic; no thread is started yet.
        unsafe {
            libc::signal(
                sig,
                note_early_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
}

/// The signals the gateway acts on, listened for as soon as it has a runtime: from then on
/// each one that comes is kept until the gateway runs and acts on it.
struct EarlySignals {
    hup: Option<Signal>,
    /// A SIGHUP came before `hup` listened ([`EARLY_HUP`], read once then: the handler
    /// chained to tokio's notes later ones too, which `hup` has).
    hup_before: bool,
    usr1: Option<Signal>,
    /// SIGUSR2: ignored (nginx's binary upgrade).
    usr2: Option<Signal>,
    term: Option<Signal>,
    /// SIGQUIT: nginx's graceful stop, taken as SIGTERM.
    quit: Option<Signal>,
    int: Option<Signal>,
}

impl EarlySignals {
    /// Inside a runtime.
    fn listen() -> Self {
        let hup = signal(SignalKind::hangup()).ok();
        Self {
            hup_before: EARLY_HUP.swap(false, Ordering::Relaxed),
            hup,
            usr1: signal(SignalKind::user_defined1()).ok(),
            usr2: signal(SignalKind::user_defined2()).ok(),
            term: signal(SignalKind::terminate()).ok(),
            quit: signal(SignalKind::quit()).ok(),
            int: signal(SignalKind::interrupt()).ok(),
        }
    }
}

/// SIGTERM and SIGINT as they come, kept for [`Drain`] (a permit each: one that came while
/// the gateway started is acted on as soon as it runs).
#[derive(Default)]
struct Stops {
    term: tokio::sync::Notify,
    int: tokio::sync::Notify,
    /// The drain was asked for by SIGQUIT (said as such in its line).
    quit: AtomicBool,
    /// SIGINT came: a drain going on stops at once too.
    interrupted: AtomicBool,
}

async fn keep_stops([term, quit]: [Option<Signal>; 2], int: Option<Signal>, stops: Arc<Stops>) {
    let (Some(mut term), Some(mut quit), Some(mut int)) = (term, quit, int) else {
        tracing::error!("cannot listen for SIGTERM");
        return;
    };
    loop {
        tokio::select! {
            Some(()) = term.recv() => stops.term.notify_one(),
            Some(()) = quit.recv() => {
                stops.quit.store(true, Ordering::Relaxed);
                stops.term.notify_one();
            }
            Some(()) = int.recv() => {
                stops.interrupted.store(true, Ordering::Relaxed);
                stops.int.notify_one();
            }
            else => return,
        }
    }
}

/// SIGINT's line, saying how many requests in flight it cuts.
fn stopping_now(in_flight: usize) {
    match in_flight {
        0 => tracing::info!(in_flight, "SIGINT: stopping now"),
        _ => tracing::info!(
            in_flight,
            "SIGINT: stopping now, which cuts the requests in flight"
        ),
    }
}

/// SIGTERM: turn unready at once, let Pingora stop accepting, and exit 0 as soon as the
/// requests in flight have finished, or when the grace period ends.
struct Drain {
    lifecycle: Arc<Lifecycle>,
    grace: Duration,
    /// `drain_delay_seconds`.
    delay: Duration,
    stops: Arc<Stops>,
    access_log: Arc<AccessLog>,
}

#[async_trait]
impl ShutdownSignalWatch for Drain {
    async fn recv(&self) -> ShutdownSignal {
        tokio::select! {
            () = self.stops.term.notified() => {}
            () = self.stops.int.notified() => {
                stopping_now(self.lifecycle.in_flight());
                return ShutdownSignal::FastShutdown;
            }
        }
        let signal = match self.stops.quit.load(Ordering::Relaxed) {
            true => "SIGQUIT",
            false => "SIGTERM",
        };
        self.lifecycle.begin_draining(|| {
            tracing::info!(
                grace_period_seconds = self.grace.as_secs(),
                drain_delay_seconds = self.delay.as_secs(),
                "{signal}: draining"
            );
        });
        // Unready, answering with `Connection: close`, and still accepting, while a load
        // balancer takes the gateway out of its rotation: connections it sends meanwhile are
        // served, not refused. A `SIGINT` meanwhile stops at once. A process never ready was
        // in no rotation.
        if !self.delay.is_zero() && self.lifecycle.was_ready() {
            tokio::select! {
                () = tokio::time::sleep(self.delay) => {}
                () = self.stops.int.notified() => {
                    stopping_now(self.lifecycle.in_flight());
                    return ShutdownSignal::FastShutdown;
                }
            }
        }
        let lifecycle = Arc::clone(&self.lifecycle);
        let access_log = Arc::clone(&self.access_log);
        let stops = Arc::clone(&self.stops);
        let deadline = Instant::now() + self.grace;
        std::thread::spawn(move || {
            // Give the listeners a moment to close before counting what is left.
            std::thread::sleep(Duration::from_millis(50));
            let interrupted = || stops.interrupted.load(Ordering::Relaxed);
            while lifecycle.in_flight() > 0 && Instant::now() < deadline && !interrupted() {
                std::thread::sleep(Duration::from_millis(10));
            }
            match lifecycle.in_flight() {
                0 => tracing::info!(in_flight = 0, "drained; exiting"),
                cut if interrupted() => stopping_now(cut),
                cut => tracing::warn!(
                    in_flight = cut,
                    "grace_period_seconds is over with requests in flight; exiting, which cuts them (no access-log line is written for them)"
                ),
            }
            // The lines of the requests answered are written before the process ends.
            access_log.flush(Duration::from_secs(1));
            crate::telemetry::flush();
            std::process::exit(0);
        });
        ShutdownSignal::GracefulTerminate
    }
}
