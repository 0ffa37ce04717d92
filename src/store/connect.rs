//! Opening connections to Redis nodes and keeping each link connected: connect, check the
//! eviction policy, load the scripts; on loss, reconnect in the background with capped,
//! jittered backoff.
//!
//! A link's connections are first driven on the store's own runtime; once the first request
//! shows the proxy's runtime, a new decision connection is opened there and swapped in (a
//! decision then needs no hop to another thread), watched from the store's thread
//! (`batch::watch_over`). With `[redis] dedicated_io_thread = false` redis-rs's connection
//! moves too, and nothing watches from elsewhere.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use rand::Rng;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionAddr, RedisError};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::runtime::Handle;
use tokio::sync::{watch, Notify};

use super::breakers::BreakerBoard;
use super::dial::Dial;
use super::link::{Conn, Link, Opened, Target};
use super::script::{Scripts, PERMISSIONS_LUA};
use super::wire::Wire;
use super::Said;

/// Makes the store's links and keeps each one connected: what every connection is set up
/// with (the scripts to load, the eviction check), the breakers links get, and the runtime
/// their connectors run on.
pub(super) struct Connector {
    scripts: Scripts,
    /// `lua/permissions.lua`, asked with each node's settings.
    permissions: redis::Script,
    /// `[redis] key_prefix`: the buckets' keys the permissions are asked for.
    key_prefix: ArcSwap<String>,
    require_noeviction: AtomicBool,
    /// The proxy's runtime, learnt from the first request: connections' driver tasks are
    /// moved there so a decision does not hop to another thread and back.
    proxy_runtime: OnceLock<Handle>,
    /// `[redis] dedicated_io_thread`: redis-rs's connection stays on the store's own thread,
    /// which also watches the decision connection.
    dedicated_io_thread: bool,
    breakers: Arc<BreakerBoard>,
    /// The store's own runtime: connectors and the cluster refresher run there.
    runtime: Handle,
}

impl Connector {
    pub(super) fn new(
        scripts: Scripts,
        key_prefix: &str,
        require_noeviction: bool,
        dedicated_io_thread: bool,
        breakers: Arc<BreakerBoard>,
        runtime: Handle,
    ) -> Self {
        Self {
            scripts,
            permissions: redis::Script::new(PERMISSIONS_LUA),
            key_prefix: ArcSwap::from_pointee(key_prefix.to_owned()),
            require_noeviction: AtomicBool::new(require_noeviction),
            proxy_runtime: OnceLock::new(),
            dedicated_io_thread,
            breakers,
            runtime,
        }
    }

    pub(super) fn breakers(&self) -> &BreakerBoard {
        &self.breakers
    }

    /// A breaker of the process's board that stands for no one node (a cluster with no slot
    /// map yet).
    pub(super) fn breaker(&self) -> crate::decision::breaker::Breaker {
        self.breakers.breaker(None)
    }

    pub(super) fn set_require_noeviction(&self, required: bool) {
        self.require_noeviction.store(required, Ordering::Relaxed);
    }

    /// `[redis] key_prefix`, as the last load set it.
    pub(super) fn key_prefix(&self) -> Arc<String> {
        self.key_prefix.load_full()
    }

    /// A reload's `key_prefix`: the next checks ask the permissions on its keys.
    pub(super) fn set_key_prefix(&self, key_prefix: &str) {
        if **self.key_prefix.load() != key_prefix {
            self.key_prefix.store(Arc::new(key_prefix.to_owned()));
        }
    }

    /// Whether the proxy's runtime, where the decision connections are moved, is not known
    /// yet.
    pub(super) fn wants_proxy_runtime(&self) -> bool {
        self.proxy_runtime.get().is_none()
    }

    /// The thread that watches a decision connection on the workers: the store's own, unless
    /// `dedicated_io_thread = false` moved everything onto the workers.
    pub(super) fn watcher(&self) -> Option<Handle> {
        self.dedicated_io_thread.then(|| self.runtime.clone())
    }

    /// Learns the proxy's runtime (the first time only); true when it was new.
    pub(super) fn learn_proxy_runtime(&self, handle: Handle) -> bool {
        self.proxy_runtime.set(handle).is_ok()
    }

    pub(super) fn on_proxy_runtime(&self) -> bool {
        self.proxy_runtime.get().is_some()
    }

    /// The link of the one Redis, connected in the background from now on.
    pub(super) fn single(self: &Arc<Self>, target: Target) -> Arc<Link> {
        let link = Arc::new(Link::new(target, self.breakers.breaker(None), None));
        self.runtime
            .spawn(Arc::clone(self).keep_connected(Arc::clone(&link)));
        link
    }

    /// The one link of a Sentinel layout: a lost connection wakes the watcher (`ask`), which
    /// asks the sentinels whether the master moved.
    pub(super) fn single_following(
        self: &Arc<Self>,
        target: Target,
        ask: Arc<Notify>,
    ) -> Arc<Link> {
        let link = Arc::new(Link::new(target, self.breakers.breaker(None), Some(ask)));
        self.runtime
            .spawn(Arc::clone(self).keep_connected(Arc::clone(&link)));
        link
    }

    /// A cluster primary's link, with a breaker of its own, connected in the background from
    /// now on; a lost connection wakes `refresh`.
    pub(super) fn node(self: &Arc<Self>, target: Target, refresh: &Arc<Notify>) -> Arc<Link> {
        let node = target.node.clone();
        self.breakers.metrics().redis_node(&node, Some(false));
        let breaker = self.breakers.breaker(Some(node));
        let mut link = Link::new(target, breaker, Some(Arc::clone(refresh)));
        link.in_cluster = true;
        let link = Arc::new(link);
        self.runtime
            .spawn(Arc::clone(self).keep_connected(Arc::clone(&link)));
        link
    }

    /// A node left: its connector stops and its breaker no longer counts.
    pub(super) fn retire(&self, link: &Link) {
        link.retire();
        self.breakers.forget(&link.node(), link.breaker.retire());
        self.breakers.metrics().redis_node(&link.node(), None);
    }
}

/// The connection itself is broken (as opposed to Redis answering with an error).
pub(super) fn is_transport(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
}

/// Backoff between reconnection attempts: 50 ms doubling to 500 ms, with full jitter on top
/// of half the step so a fleet does not reconnect in lockstep. The cap bounds how long a
/// Redis that is back goes unused (a refused dial costs it next to nothing; with a 2 s cap,
/// `fail_closed` requests were refused up to 2 s after it was back).
/// How often settings Redis refused (a reload's mistyped password) are tried again while the
/// connection made with the previous ones keeps deciding.
const REFUSED_AGAIN_AFTER: Duration = Duration::from_secs(2);

pub(super) fn backoff(attempt: u32) -> Duration {
    let step_ms = (50u64 << attempt.min(6)).min(500);
    let jitter = rand::rng().random_range(0..=step_ms / 2);
    Duration::from_millis(step_ms / 2 + jitter)
}

/// Reads the node's `TIME` on the link's connection once, so that the first decisions have a
/// deadline in its time (`deadline.rs`); their answers keep it read.
async fn read_clock(link: &Link) {
    let Some(conn) = link.conn.load_full() else {
        return;
    };
    let mut c = conn.redis();
    let command = redis::cmd("TIME");
    let sent = super::deadline::mono_us();
    let time = tokio::time::timeout(CONNECT_TIMEOUT, command.query_async::<(u64, u64)>(&mut c));
    if let Ok(Ok((secs, micros))) = time.await {
        link.clock
            .sample(super::deadline::time_us(secs, micros), sent);
    }
}

/// The checks and script loads after a connection opens, bounded as a whole.
const SETUP_TIMEOUT: Duration = Duration::from_secs(3);
/// The TCP (or unix socket) connect and the handshake.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How often a connected node's `maxmemory-policy` (and `timeout`) is read again, at most.
const POLICY_RECHECK_EVERY: Duration = Duration::from_secs(15);

/// How often the checks run on a node whose `timeout` for idle clients is `idle_timeout_s`
/// seconds (0: none, or not readable): every [`POLICY_RECHECK_EVERY`], or every half of a
/// shorter `timeout`, so that Redis never finds redis-rs's socket idle that long (it closes
/// a client idle for more than its whole seconds). Redis closing it beside an idle batches'
/// socket would close both at once, and the whole connection would be made again: a request
/// in those milliseconds would get its fail mode.
pub(super) fn checks_every(idle_timeout_s: u64) -> Duration {
    if idle_timeout_s == 0 {
        return POLICY_RECHECK_EVERY;
    }
    POLICY_RECHECK_EVERY.min(Duration::from_millis(idle_timeout_s.saturating_mul(500)))
}
/// How often a batches' socket that has carried no batch yet (so no reader task watches it)
/// is looked at for its end.
const UNREAD_LOOK_EVERY: Duration = Duration::from_secs(1);
/// TCP keepalive on every socket to Redis: the first probe after this long idle, then every
/// [`KEEPALIVE_INTERVAL`], three unanswered ending the connection. A NAT or load balancer
/// that forgets idle connections keeps these; a peer gone without a word is found idle.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(15);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// Opens one connection: connect and handshake within 1 s, `TCP_NODELAY` on (a decision is a
/// small write that must not wait for the previous one's ACK). Commands on it carry no
/// timeout of redis-rs's: the request path bounds each evaluation by its budget, and every
/// other caller by a timeout of its own (the set-up below, the slot map query, the
/// heartbeat). A second timer per request would only cost time.
///
/// The socket is watched as redis-rs's driver reads it: when Redis closes it (killed,
/// restarted, `CLIENT KILL`), [`Opened::closed`] fires without a command being sent. An idle
/// connection, or one behind an open breaker, would otherwise look up until the next request
/// that used it.
pub(super) async fn open(dial: &Dial) -> redis::RedisResult<Opened> {
    let info = &dial.info;
    let (closed_tx, closed) = watch::channel(false);
    let setup = async {
        match socket(dial).await? {
            Socket::Tcp(s) => drive(info, s, closed_tx).await,
            Socket::Tls(s) => drive(info, s, closed_tx).await,
            Socket::Unix(s) => drive(info, s, closed_tx).await,
        }
    };
    let conn = tokio::time::timeout(CONNECT_TIMEOUT, setup)
        .await
        .map_err(|_| {
            redis::RedisError::from(io::Error::new(
                io::ErrorKind::TimedOut,
                "redis did not accept the connection and handshake within 1 s",
            ))
        })??;
    Ok(Opened { conn, closed })
}

/// A link's two connections to the node of `dial`, opened on the current runtime: redis-rs's
/// (watched) and the decisions' own. `on_workers`: the current runtime is the one requests
/// run on; `watcher`: the store's thread, which watches the decisions' connection there.
pub(super) async fn open_both(
    dial: &Dial,
    on_workers: bool,
    watcher: Option<Handle>,
) -> redis::RedisResult<(Opened, Wire)> {
    let opened = open(dial).await?;
    let wire = super::wire::open(dial, on_workers, watcher).await?;
    Ok((opened, wire))
}

/// A socket to a node, TLS made when the dial says so.
pub(super) enum Socket {
    Tcp(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
    Unix(tokio::net::UnixStream),
}

/// Connects to the node of `dial` (`TCP_NODELAY` on) and makes the TLS handshake of a
/// `rediss://` one; unbounded: callers bound it.
pub(super) async fn socket(dial: &Dial) -> io::Result<Socket> {
    if let Some(why) = dial.nowhere {
        return Err(io::Error::new(io::ErrorKind::NotConnected, why));
    }
    match dial.info.addr() {
        ConnectionAddr::Tcp(host, port) => {
            let socket = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
            socket.set_nodelay(true)?;
            let keepalive = socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_INTERVAL)
                .with_retries(3);
            if let Err(e) = socket2::SockRef::from(&socket).set_tcp_keepalive(&keepalive) {
                tracing::debug!(error = %e, "cannot set TCP keepalive on a socket to redis");
            }
            let Some(tls) = &dial.tls else {
                return Ok(Socket::Tcp(socket));
            };
            let name = rustls::pki_types::ServerName::try_from(host.clone())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
            let stream = tokio_rustls::TlsConnector::from(Arc::clone(tls))
                .connect(name, socket)
                .await
                .map_err(|e| io::Error::new(e.kind(), format!("TLS handshake with redis: {e}")))?;
            Ok(Socket::Tls(Box::new(stream)))
        }
        ConnectionAddr::Unix(path) => {
            Ok(Socket::Unix(tokio::net::UnixStream::connect(path).await?))
        }
        other => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("unsupported redis address {other}"),
        )),
    }
}

/// A RESP2 subscriber connection to the node of `dial` (a sentinel's `+switch-master`, the
/// resets channel), over TLS for `rediss://`; connect and handshake within 1 s.
async fn pubsub(dial: &Dial) -> redis::RedisResult<redis::aio::PubSub> {
    let settings = dial.info.redis_settings();
    let setup = async {
        match socket(dial).await? {
            Socket::Tcp(s) => redis::aio::PubSub::new(settings, s).await,
            Socket::Tls(s) => redis::aio::PubSub::new(settings, s).await,
            Socket::Unix(s) => redis::aio::PubSub::new(settings, s).await,
        }
    };
    tokio::time::timeout(CONNECT_TIMEOUT, setup)
        .await
        .map_err(|_| {
            redis::RedisError::from(io::Error::new(
                io::ErrorKind::TimedOut,
                "the server did not accept the subscription within 1 s",
            ))
        })?
}

/// A subscriber connection to the node of `dial`, subscribed to `channel`, within
/// [`CONNECT_TIMEOUT`] for each step.
pub(super) async fn subscribed(
    dial: &Dial,
    channel: &str,
) -> redis::RedisResult<redis::aio::PubSub> {
    let mut pubsub = pubsub(dial).await?;
    tokio::time::timeout(CONNECT_TIMEOUT, pubsub.subscribe(channel))
        .await
        .map_err(|_| {
            redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no answer to SUBSCRIBE within 1 s",
            ))
        })??;
    Ok(pubsub)
}

/// The handshake over a watched socket, and the connection's driver task, which runs until
/// the connection is let go or closed.
async fn drive<S>(
    info: &redis::ConnectionInfo,
    socket: S,
    closed: watch::Sender<bool>,
) -> redis::RedisResult<MultiplexedConnection>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let config = AsyncConnectionConfig::new().set_response_timeout(None);
    let stream = Watched {
        inner: socket,
        closed,
    };
    let (conn, driver) =
        MultiplexedConnection::new_with_config(info.redis_settings(), stream, config).await?;
    tokio::spawn(driver);
    Ok(conn)
}

/// A Redis socket that reports its end to [`Opened::closed`]; reads and writes pass straight
/// through.
struct Watched<S> {
    inner: S,
    closed: watch::Sender<bool>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let room = buf.remaining() > 0;
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        match &poll {
            Poll::Ready(Ok(())) if room && buf.filled().len() == before => {
                self.closed.send_replace(true);
            }
            Poll::Ready(Err(_)) => {
                self.closed.send_replace(true);
            }
            _ => {}
        }
        poll
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// What `CONFIG GET maxmemory-policy` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvictionPolicy {
    NoEviction,
    /// Keys can be evicted: quotas can silently reset.
    Evicting(String),
    /// `CONFIG` is not permitted (a managed Redis, say).
    Unknown,
}

/// The policy, or `None` when Redis could not answer it now (`BUSY` while a script runs): the
/// last reading stands, as `CONFIG` is not refused.
async fn eviction_policy(
    conn: &mut MultiplexedConnection,
) -> redis::RedisResult<Option<EvictionPolicy>> {
    let reply: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(conn)
        .await;
    match reply {
        Ok(v) => Ok(Some(match v.get(1).map(String::as_str) {
            Some("noeviction") => EvictionPolicy::NoEviction,
            Some(other) => EvictionPolicy::Evicting(other.to_owned()),
            None => EvictionPolicy::Unknown,
        })),
        Err(e) if is_transport(&e) || e.is_timeout() => Err(e),
        Err(e) if unable_now(&e) => Ok(None),
        // Refused: an ACL without `CONFIG`, a managed Redis that disabled or renamed it.
        Err(_) => Ok(Some(EvictionPolicy::Unknown)),
    }
}

/// What `CONFIG GET timeout` said: Redis's idle time, in seconds, after which it closes a
/// client (0: never); `None` when it could not be read (`CONFIG` refused, Redis busy).
async fn idle_timeout(conn: &mut MultiplexedConnection) -> Option<u64> {
    let reply: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("timeout")
        .query_async(conn)
        .await
        .ok()?;
    reply.get(1)?.parse().ok()
}

/// What `lua/permissions.lua` said of the ACL user: the commands of the limiter scripts it may
/// not run on a key of `key_prefix` (none: every one, or a Redis before 7.0 that cannot say);
/// `None` when it could not be asked (`EVALSHA` refused: every decision is refused anyway;
/// Redis busy or gone). Asked only once a decision met an ACL refusal, and then at each
/// check until the user may run them all: an `EVALSHA` of its own, which no decision is.
async fn refused_commands(
    conn: &mut MultiplexedConnection,
    script: &redis::Script,
    key_prefix: &str,
) -> Option<Vec<String>> {
    let key = format!("{key_prefix}:v1:permissions");
    script.arg(key).invoke_async(conn).await.ok()
}

/// The node's settings the gateway reads, on one connection, sent at once: the eviction
/// policy ([`eviction_policy`]), the idle timeout ([`idle_timeout`]) and, when a refusal
/// was met, the commands the ACL user may not run ([`refused_commands`]).
struct Settings {
    policy: redis::RedisResult<Option<EvictionPolicy>>,
    idle: Option<u64>,
    refused: Option<Vec<String>>,
}

impl Connector {
    async fn node_settings(&self, link: &Link, conn: &mut MultiplexedConnection) -> Settings {
        let (mut idle, mut permitted) = (conn.clone(), conn.clone());
        let key_prefix = self.key_prefix.load_full();
        let asked = link.permissions_asked.swap(false, Ordering::Relaxed);
        let ask = asked || link.lacks_commands.load(Ordering::Relaxed);
        // A check (not an ask) lets refusals ask again.
        link.permissions_quiet.store(asked, Ordering::Relaxed);
        let permissions = async {
            match ask {
                true => refused_commands(&mut permitted, &self.permissions, &key_prefix).await,
                false => None,
            }
        };
        let (policy, idle, refused) =
            tokio::join!(eviction_policy(conn), idle_timeout(&mut idle), permissions);
        Settings {
            policy,
            idle,
            refused,
        }
    }
}

/// Whether Redis answered that it cannot serve now (`BUSY` while a script runs, `LOADING`,
/// `NOAUTH`, a code it does not know: what a decision's call would count as a store failure,
/// [`Failure::of_reply`]) rather than refusing the command itself (an `ERR`: unknown,
/// disabled or renamed, a script that does not compile; `NOPERM`: the ACL).
fn unable_now(e: &RedisError) -> bool {
    e.code().is_some_and(|code| {
        !matches!(code, "ERR" | "NOPERM")
            && crate::decision::Failure::of_reply(code, e.detail().unwrap_or(""))
                == crate::decision::Failure::Unavailable
    })
}

/// What went wrong, in Redis's words where redis-rs renamed them: a refused `AUTH` becomes
/// redis-rs's `AuthenticationFailed`, without Redis's own text (`WRONGPASS`, `ERR invalid
/// password` before Redis 6, or an `ERR AUTH ... called without any password configured`),
/// so every cause is named.
/// A TLS alert Redis sends once the handshake is over (TLS 1.3 checks the client's
/// certificate then) reaches the first command: said to be TLS's too, and what it means.
/// Whether Redis refused the connection's access, as no outage does: its credentials
/// (`AuthenticationFailed`, `NOAUTH`), its user's permissions (`NOPERM`), or its TLS
/// settings (a certificate that does not verify, a client certificate refused).
fn access_refused(e: &RedisError) -> bool {
    let text = e.to_string();
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "NOPERM" | "WRONGPASS"))
        || text.contains("invalid peer certificate")
        || text.contains("received fatal alert")
}

pub(super) fn reason(e: &RedisError) -> String {
    let text = e.to_string();
    if e.kind() == redis::ErrorKind::AuthenticationFailed {
        format!("Redis refused AUTH: a wrong username or password (WRONGPASS), a disabled user, or a password sent to a Redis that has none set ({e})")
    } else if text.contains("received fatal alert") {
        let hint = if text.contains("CertificateRequired") {
            ": it asks for a client certificate (tls-auth-clients): set tls_cert_path and tls_key_path"
        } else if [
            "UnknownCA",
            "BadCertificate",
            "CertificateExpired",
            "CertificateUnknown",
            "DecryptError",
        ]
        .iter()
        .any(|a| text.contains(a))
        {
            ": it refused the client certificate (tls_cert_path): is it signed by a CA Redis trusts (tls-ca-cert-file), and still valid?"
        } else {
            ""
        };
        match text.contains("TLS handshake with redis") {
            true => format!("{text}{hint}"),
            false => format!("TLS handshake with redis: {text}{hint}"),
        }
    } else {
        Said(e).to_string()
    }
}

/// Start-up check: [`EvictionPolicy::Evicting`], with the node, when a Redis that answers
/// has an evicting policy, which a gateway requiring noeviction must refuse (in a cluster
/// every primary of the slot map, or every seed when no seed gives the map); `Unknown` when
/// one does not permit `CONFIG` (and none evicts). A Redis that is down is not an error here
/// (`NoEviction`): the routes follow their fail modes until it comes.
pub async fn preflight(config: &crate::config::RedisConfig) -> (EvictionPolicy, String) {
    let (targets, _) = targets(config).await;
    // Every node at once: nodes that do not answer cost their timeout once, not each.
    let checks = targets.iter().map(|target| async move {
        let check = async {
            let mut opened = open(&target.dial).await.ok()?;
            eviction_policy(&mut opened.conn).await.ok().flatten()
        };
        let policy = tokio::time::timeout(Duration::from_secs(3), check)
            .await
            .ok()
            .flatten();
        (policy, &target.node)
    });
    let mut found = EvictionPolicy::NoEviction;
    for (policy, node) in futures_util::future::join_all(checks).await {
        match policy {
            Some(EvictionPolicy::Evicting(p)) => {
                return (EvictionPolicy::Evicting(p), node.clone())
            }
            Some(EvictionPolicy::Unknown) => found = EvictionPolicy::Unknown,
            _ => {}
        }
    }
    (found, String::new())
}

/// The nodes a check reads: the Redis of the URL, a cluster's primaries (or its seeds, when
/// one answers without a map), the master the sentinels name now; none, with why, when no
/// seed or sentinel answered.
async fn targets(config: &crate::config::RedisConfig) -> (Vec<Target>, Option<String>) {
    match &config.target {
        crate::config::RedisTarget::Single(url) => match Target::new(url, &config.access) {
            Ok(target) => (vec![target], None),
            Err(e) => (Vec::new(), Some(e.to_string())),
        },
        crate::config::RedisTarget::Cluster(seeds) => {
            match super::cluster::primaries_of(seeds, &config.access).await {
                Some(primaries) if !primaries.is_empty() => (primaries, None),
                // A seed answered, without a map: the seeds themselves are what is known.
                Some(_) => (
                    seeds
                        .iter()
                        .filter_map(|url| Target::new(url, &config.access).ok())
                        .collect(),
                    None,
                ),
                // None answered: the store checks each primary once it is reached.
                None => (
                    Vec::new(),
                    Some("no cluster_urls seed gave the slot map".to_owned()),
                ),
            }
        }
        // The master the sentinels name now, if they answer (else the store checks it once
        // they do, and says so in the log and `/readyz`).
        crate::config::RedisTarget::Sentinel(target) => {
            let sentinel =
                super::sentinel::Sentinel::for_a_check(target.clone(), config.access.clone());
            match tokio::time::timeout(Duration::from_secs(3), sentinel.discover()).await {
                Ok(Ok(master)) => (vec![master], None),
                Ok(Err(e)) => (Vec::new(), Some(e.to_string())),
                Err(_) => (
                    Vec::new(),
                    Some("no sentinel named a master within 3 s".to_owned()),
                ),
            }
        }
    }
}

/// What `check --redis` found of one node.
#[derive(Debug)]
pub struct NodeReport {
    /// `host:port`, without credentials.
    pub node: String,
    /// Why the gateway could not connect (or authenticate, or make the TLS handshake).
    pub unreachable: Option<String>,
    /// `CONFIG GET maxmemory-policy`; `None` when Redis could not answer it now (`BUSY`
    /// while a script runs, `LOADING`).
    pub policy: Option<EvictionPolicy>,
    /// The commands the gateway sends (the scripts', the fleet heartbeat's, the resets')
    /// the connection's user may not run, or why that could not be asked (a user that may
    /// not run scripts at all).
    pub refused: Result<Vec<String>, String>,
    /// `INFO server`'s `redis_version`, when the user may read it.
    pub version: Option<String>,
    /// `INFO replication`'s master (`host:port`) when the node is a replica, which refuses
    /// the scripts' writes (`READONLY`); `None` for a master or when the user may not read
    /// it.
    pub replica_of: Option<String>,
}

/// `check --redis`: connects to every node the config names as the gateway would (URL,
/// credentials, TLS, the cluster's map, the sentinels' master) and reads what decides
/// whether it can serve: the connection, the eviction policy and the ACL for the scripts'
/// commands. `Err` when there is no node to read (no seed or sentinel answered).
pub async fn inspect(config: &crate::config::RedisConfig) -> Result<Vec<NodeReport>, String> {
    let (targets, why) = targets(config).await;
    if targets.is_empty() {
        return Err(why.unwrap_or_else(|| "no node to read".to_owned()));
    }
    let permissions = redis::Script::new(PERMISSIONS_LUA);
    let reads = targets.iter().map(|target| {
        let permissions = &permissions;
        async move {
            let read = async {
                let mut opened = open(&target.dial).await.map_err(|e| reason(&e))?;
                let mut conn = opened.conn.clone();
                let policy = eviction_policy(&mut conn).await.map_err(|e| reason(&e))?;
                // Not read for a reason of the moment (`BUSY`, `LOADING`), or because no
                // password was given to a Redis that wants one: `NOAUTH` is said as itself.
                if policy.is_none() {
                    let ping: redis::RedisResult<String> =
                        redis::cmd("PING").query_async(&mut conn).await;
                    if ping.is_err_and(|e| e.code() == Some("NOAUTH")) {
                        return Err("Redis wants a password and was given none (NOAUTH): set redis.password_env or redis.password_file (and redis.username for an ACL user)".to_owned());
                    }
                }
                let prefix = &config.key_prefix;
                let refused: redis::RedisResult<Vec<String>> = permissions
                    .arg(format!("{prefix}:v1:permissions"))
                    .arg(crate::limiter::heartbeat::fleet_key(prefix))
                    .arg(crate::limiter::inspect::reset_channel(prefix))
                    .invoke_async(&mut conn)
                    .await;
                // The default sections: `server` and `replication` (one `INFO` of two
                // sections needs Redis 7).
                let info: redis::RedisResult<String> =
                    redis::cmd("INFO").query_async(&mut opened.conn).await;
                let info = info.unwrap_or_default();
                let field = |name: &str| {
                    (info.lines())
                        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                        .map(|v| v.trim().to_owned())
                };
                let version = field("redis_version");
                let replica_of = (field("role").as_deref() == Some("slave")).then(|| {
                    match (field("master_host"), field("master_port")) {
                        (Some(host), Some(port)) if host.contains(':') => format!("[{host}]:{port}"),
                        (Some(host), Some(port)) => format!("{host}:{port}"),
                        _ => "a master it does not name".to_owned(),
                    }
                });
                Ok::<_, String>((policy, refused.map_err(|e| reason(&e)), version, replica_of))
            };
            let (unreachable, (policy, refused, version, replica_of)) =
                match tokio::time::timeout(Duration::from_secs(3), read).await {
                    Ok(Ok(found)) => (None, found),
                    Ok(Err(e)) => (Some(e), (None, Ok(Vec::new()), None, None)),
                    Err(_) => (
                        Some("no answer within 3 s".to_owned()),
                        (None, Ok(Vec::new()), None, None),
                    ),
                };
            NodeReport {
                node: target.node.clone(),
                unreachable,
                policy,
                refused,
                version,
                replica_of,
            }
        }
    });
    Ok(futures_util::future::join_all(reads).await)
}

impl Connector {
    /// Opens a new decision connection to `target` on the proxy's runtime, watched from this
    /// thread, and gives it to `link`'s current connection. False when there was none.
    async fn move_wire(&self, link: &Arc<Link>, target: &Target) -> io::Result<bool> {
        let Some(proxy) = self.proxy_runtime.get() else {
            return Ok(false);
        };
        let wire = self.wire_on(proxy, &target.dial).await?;
        Ok(link.install_wire(wire))
    }

    /// Opens a decision connection to the node of `dial` registered with `proxy`'s workers,
    /// watched from this thread.
    async fn wire_on(&self, proxy: &Handle, dial: &Dial) -> io::Result<Wire> {
        let dial = dial.clone();
        let watcher = self.runtime.clone();
        proxy
            .spawn(async move { super::wire::open(&dial, true, Some(watcher)).await })
            .await
            .map_err(io::Error::other)?
    }

    /// Makes `conn`'s batches' socket again, alone, where the connector makes it (it ended
    /// before it carried a batch, or while idle after: [`Link::batches_closed_alone`]); the
    /// whole connection is forgotten when that fails. Dropped
    /// when a reload moved the link meanwhile (its connection to the new target comes whole).
    async fn decisions_socket_again(&self, link: &Arc<Link>, conn: &Arc<super::link::Conn>) {
        // (One that ended after carrying batches was said where it ended.)
        let unread = !conn.wire.lock().bytes.dead;
        let target = link.target.load_full();
        let dial = target.dial.clone();
        let opened = async {
            match self.proxy_runtime.get() {
                Some(proxy) if self.dedicated_io_thread => self.wire_on(proxy, &dial).await,
                Some(proxy) => proxy
                    .spawn(async move { super::wire::open(&dial, true, None).await })
                    .await
                    .map_err(io::Error::other)?,
                None => super::wire::open(&dial, false, None).await,
            }
        };
        let made = tokio::time::timeout(SETUP_TIMEOUT, opened).await;
        match made {
            Ok(Ok(_)) if !Arc::ptr_eq(&target, &link.target.load_full()) => {}
            Ok(Ok(_)) if link.moving.load(Ordering::Relaxed) => {}
            Ok(Ok(wire)) => {
                if link.replace_wire(conn, wire) && unread {
                    tracing::info!(node = %target.node, "redis closed the decision connection before it carried a batch (its idle timeout, a kill); made again, the other kept");
                }
            }
            Ok(Err(e)) => link.forget(conn, &e, false),
            Err(_) => link.forget(
                conn,
                &"the decision connection could not be made again within 3 s",
                false,
            ),
        }
    }

    /// A connection to `target` made as the connector makes its own (within its set-up
    /// time), beside the one `link` holds: `None` when it could not be made.
    pub(super) async fn fresh(&self, link: &Link, target: &Target) -> Option<(Opened, Wire)> {
        match tokio::time::timeout(SETUP_TIMEOUT, self.connect(link, target)).await {
            Ok(Ok(made)) => Some(made),
            Ok(Err(e)) => {
                tracing::debug!(node = %target.node, error = %e, "cannot open a redis connection beside the one that left a call unanswered");
                None
            }
            Err(_) => None,
        }
    }

    /// Puts a connection from [`Self::fresh`] in the place of `old`, as the connector's own
    /// are put; false (and the new one dropped) when the link no longer holds `old`.
    pub(super) async fn install_fresh(
        &self,
        link: &Arc<Link>,
        old: &Arc<super::link::Conn>,
        opened: Opened,
        wire: Wire,
    ) -> bool {
        if !link.replace(old, opened, wire, self.proxy_runtime.get().is_some()) {
            return false;
        }
        read_clock(link).await;
        true
    }

    /// Opens a connection to `target` for `link`, checks the eviction policy (said the first
    /// time for the node and when it changed) and loads the scripts.
    async fn connect(&self, link: &Link, target: &Target) -> redis::RedisResult<(Opened, Wire)> {
        let (mut opened, wire) = match self.proxy_runtime.get() {
            // The decision connection is registered with the proxy's workers (whose waiting
            // decisions read its answers); redis-rs's stays here, and this thread watches
            // the decisions' one (`batch::watch_over`).
            Some(proxy) if self.dedicated_io_thread => {
                let opened = open(&target.dial).await?;
                (opened, self.wire_on(proxy, &target.dial).await?)
            }
            // Both on the workers: redis-rs's driver task too.
            Some(proxy) => {
                let dial = target.dial.clone();
                proxy
                    .spawn(async move { open_both(&dial, true, None).await })
                    .await
                    .map_err(|e| redis::RedisError::from(std::io::Error::other(e)))??
            }
            None => open_both(&target.dial, false, None).await?,
        };
        let conn = &mut opened.conn;
        let settings = self.node_settings(link, conn).await;
        if let Some(policy) = settings.policy? {
            self.note_policy(link, &target.node, policy);
        }
        self.note_settings(link, &target.node, settings.idle, settings.refused);
        // Behind Sentinel, the node must still be the master: one demoted while its
        // connection was made again at once (a stale sentinel listed first may still name
        // it) would be decided on until its first `READONLY`. Refused, the sentinels are
        // asked where the master went, checking the one in use.
        if link.follows_sentinels() {
            match super::sentinel::master_by_role(conn).await {
                Ok(Some(false)) => {
                    link.found_replica.store(true, Ordering::Relaxed);
                    link.ask_where();
                    return Err(RedisError::from(io::Error::other(
                        "the node answers ROLE as a replica now (demoted): asking the sentinels where the master went",
                    )));
                }
                Err(e) if is_transport(&e) || e.is_timeout() => return Err(e),
                // A master, or the role unknown (`ROLE` refused: the sentinel's word is
                // taken, as when it named the node).
                _ => {}
            }
        }
        for script in [&self.scripts.token_bucket, &self.scripts.sliding_window] {
            match script.load(conn).await {
                Ok(_) => {}
                // Redis cannot serve now (`BUSY` running a script, `LOADING`): this attempt
                // fails, and the next one loads them.
                Err(e) if is_transport(&e) || e.is_timeout() || unable_now(&e) => return Err(e),
                // Serve anyway: each request tries the NOSCRIPT path, and counts it if it fails.
                Err(e) => {
                    tracing::error!(node = %target.node, error = %Said(&e), "redis refused SCRIPT LOAD; limited requests will fail as NOSCRIPT");
                    return Ok((opened, wire));
                }
            }
        }
        match self.scripts.batch(link.in_cluster).load(conn).await {
            Ok(_) => link.turns.accept(),
            Err(e) if is_transport(&e) || e.is_timeout() || unable_now(&e) => return Err(e),
            Err(e) => link.turns.refuse(&target.node, &Said(&e)),
        }
        Ok((opened, wire))
    }
}

impl Connector {
    /// Records a node's eviction policy, and says when it is one that can silently reset
    /// quotas: at every connection, and when a re-check finds it changed.
    fn note_policy(&self, link: &Link, node: &str, policy: EvictionPolicy) {
        // Read from a Redis the link has since been moved off: not this one's.
        if link.target.load().node != node {
            return;
        }
        let text = match &policy {
            EvictionPolicy::NoEviction => Some("noeviction".to_owned()),
            EvictionPolicy::Evicting(p) => Some(p.clone()),
            EvictionPolicy::Unknown => None,
        };
        let changed = link.eviction_policy.load().as_deref() != text.as_ref();
        let required = self.require_noeviction.load(Ordering::Relaxed);
        // Said for the node's first reading and when it changes: not again at each new
        // connection (a `CLIENT KILL`, a Redis `timeout` the checks could not read).
        let first = !link.policy_said.swap(true, Ordering::Relaxed);
        if first || changed {
            match &policy {
                EvictionPolicy::Evicting(p) if required => {
                    tracing::error!(node, maxmemory_policy = %p, "redis may evict keys: rate limit quotas can silently reset; set maxmemory-policy noeviction");
                }
                // Allowed by the config, and still worth a line: a bucket Redis evicts
                // starts full again.
                EvictionPolicy::Evicting(p) => {
                    tracing::warn!(node, maxmemory_policy = %p, "redis may evict keys (allowed: require_noeviction = false): an evicted bucket starts full again");
                }
                EvictionPolicy::Unknown if required => {
                    tracing::warn!(node, "cannot read redis maxmemory-policy (CONFIG not permitted); make sure it is noeviction");
                }
                EvictionPolicy::NoEviction if !first => {
                    tracing::info!(node, "redis maxmemory-policy is noeviction again");
                }
                _ => {}
            }
        }
        link.eviction_policy.store(text.map(Arc::new));
    }

    /// Reads the eviction policy again on the link's connection (a `CONFIG SET` on a live
    /// Redis is otherwise only seen at the next reconnect). A connection that fails here is
    /// left to the socket watch and the requests to notice.
    async fn recheck_policy(&self, link: &Link) {
        let Some(conn) = link.conn.load_full() else {
            return;
        };
        let node = link.node();
        let mut c = conn.redis();
        let Ok(settings) =
            tokio::time::timeout(CONNECT_TIMEOUT, self.node_settings(link, &mut c)).await
        else {
            return;
        };
        if let Ok(Some(policy)) = settings.policy {
            self.note_policy(link, &node, policy);
        }
        self.note_settings(link, &node, settings.idle, settings.refused);
    }

    /// Records the idle timeout and the commands refused that `node` said, and says when
    /// the user lacks commands the scripts need, and when it no longer does.
    fn note_settings(
        &self,
        link: &Link,
        node: &str,
        idle: Option<u64>,
        refused: Option<Vec<String>>,
    ) {
        // Read from a Redis a reload has since moved the link off: not this one's.
        if link.target.load().node != node {
            return;
        }
        if let Some(seconds) = idle {
            link.idle_timeout_s.store(seconds, Ordering::Relaxed);
        }
        // Not asked (Redis busy, say): what was found stands.
        let Some(refused) = refused else {
            return;
        };
        let refused = (!refused.is_empty()).then(|| refused.join(" ").to_uppercase());
        let was = link.refused.load_full();
        if was.as_deref() == refused.as_ref() {
            return;
        }
        link.lacks_commands
            .store(refused.is_some(), Ordering::Relaxed);
        match &refused {
            Some(commands) => {
                // Redis's ACL refuses a command on a key the user's key patterns do not
                // match as it refuses the command itself: both are named.
                let keys = format!("{}:*", self.key_prefix.load());
                tracing::error!(node, commands = commands.as_str(), keys = keys.as_str(), "the redis user may not run commands the limiter scripts need on their keys (grant the commands, and the keys, as ~<keys>); limited requests are answered by their fail mode without reaching redis until it may");
            }
            None => {
                tracing::info!(
                    node,
                    "the redis user may run every command the limiter scripts need again"
                );
            }
        }
        link.refused.store(refused.map(Arc::new));
    }

    /// Makes the checks' socket of `conn` again, alone (Redis closed it while the decisions'
    /// carried decisions: `Link::checks_closed`), where the link's redis-rs connections are
    /// driven. When it cannot, the connection is lost as a whole.
    async fn make_checks_again(&self, link: &Arc<Link>, conn: &Arc<Conn>) {
        let target = link.target.load_full();
        let opened = match self.proxy_runtime.get() {
            Some(proxy)
                if !self.dedicated_io_thread && link.on_proxy_runtime.load(Ordering::Relaxed) =>
            {
                let dial = target.dial.clone();
                (proxy.spawn(async move { open(&dial).await }).await)
                    .map_err(|e| redis::RedisError::from(std::io::Error::other(e)))
                    .and_then(|opened| opened)
            }
            _ => open(&target.dial).await,
        };
        let made = match opened {
            Ok(opened) => link.checks_made_again(conn, &target, opened),
            Err(e) => {
                // Redis gone, or out of reach: the connection is lost.
                let cause = format!(
                    "redis closed the checks connection, which could not be made again: {}",
                    Said(&e)
                );
                conn.checks_lost.store(false, Ordering::Release);
                // Decisions in flight on it count the loss as they fail (none: nothing).
                link.forget(conn, &cause, false);
                return;
            }
        };
        if made {
            tracing::debug!(node = %target.node, "redis closed the gateway's checks connection while its decisions' connection was in use (its idle timeout, say); made again alone");
        } else {
            // Moved, replaced or broken meanwhile: made again whole, if the link still holds it.
            conn.checks_lost.store(false, Ordering::Release);
            link.forget(conn, &"redis closed the connection", false);
        }
    }

    /// Keeps one link's connection up: connects, checks, loads the scripts, then sleeps until
    /// the connection is dropped, reading the eviction policy and the idle timeout again every
    /// [`checks_every`]. Ends when the link is retired.
    async fn keep_connected(self: Arc<Self>, link: Arc<Link>) {
        let mut attempt = 0u32;
        // Kept across the loop's wake-ups (a checks' socket made again wakes it as often as
        // Redis's `timeout`), so the eviction policy is read every period whatever wakes it.
        let next_check = |link: &Link| {
            tokio::time::Instant::now() + checks_every(link.idle_timeout_s.load(Ordering::Relaxed))
        };
        let mut recheck_at = next_check(&link);
        // When a batches' socket was last made again alone.
        let mut again_at: Option<tokio::time::Instant> = None;
        while !link.retired.load(Ordering::Relaxed) {
            // (While a reload moves the link, the connection to the new Redis replaces it.)
            let checks_lost = (link.conn.load_full())
                .filter(|c| c.checks_lost.load(Ordering::Acquire))
                .filter(|_| !link.moving.load(Ordering::Relaxed));
            if let Some(conn) = checks_lost {
                self.make_checks_again(&link, &conn).await;
                continue;
            }
            let connected = link.is_connected();
            // A reload moved the link to another Redis: connect there while this one serves.
            // Without a connection (lost meanwhile) it is an ordinary connect.
            if !connected {
                link.moving.store(false, Ordering::Relaxed);
            }
            let moving = connected && link.moving.load(Ordering::Relaxed);
            let movable = self.proxy_runtime.get().is_some()
                && !link.on_proxy_runtime.load(Ordering::Relaxed);
            if connected && !movable && !moving {
                // A decision connection no reader task reads yet (no batch sent on it: the
                // first decisions after it was made, or every decision while batches are off):
                // Redis may close it while the checks' socket, used by the checks
                // ([`checks_every`]), stays open (its idle `timeout`), and the first batch sent
                // on it would fail with it. Looked at every second; made again alone,
                // redis-rs's socket kept.
                // (At most once a look: a socket closed as soon as it is made waits for the next.)
                // Or one that ended while idle after carrying batches
                // ([`Link::batches_closed_alone`]).
                let unread = (link.conn.load_full())
                    .filter(|_| again_at.is_none_or(|at| at.elapsed() >= UNREAD_LOOK_EVERY))
                    .filter(|c| {
                        c.wire.lock().bytes.dead
                            || (!c.wire.reading.load(Ordering::Acquire) && c.wire.peer_closed())
                    });
                // One that failed while unread (a reset, its keepalives unanswered): the peer
                // is gone, and redis-rs's socket with it, most likely.
                let failed = (link.conn.load_full())
                    .filter(|c| !c.wire.reading.load(Ordering::Acquire) && c.wire.failed());
                if let Some(conn) = failed {
                    link.forget(
                        &conn,
                        &"the batches' socket failed while unused (a reset, keepalives unanswered)",
                        false,
                    );
                    continue;
                }
                if let Some(conn) = unread {
                    again_at = Some(tokio::time::Instant::now());
                    self.decisions_socket_again(&link, &conn).await;
                    continue;
                }
                // A decision met an ACL refusal: which commands, asked now.
                if link.permissions_asked.load(Ordering::Relaxed) {
                    self.recheck_policy(&link).await;
                    continue;
                }
                tokio::select! {
                    _ = link.wake.notified() => {}
                    _ = tokio::time::sleep_until(recheck_at) => {
                        self.recheck_policy(&link).await;
                        recheck_at = next_check(&link);
                    }
                    _ = tokio::time::sleep(UNREAD_LOOK_EVERY) => {}
                }
                continue;
            }
            let target = link.target.load_full();
            if connected && self.dedicated_io_thread && !moving {
                // Only the decisions' connection moves; redis-rs's stays on this thread.
                let moved = tokio::time::timeout(SETUP_TIMEOUT, self.move_wire(&link, &target))
                    .await
                    .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()));
                match moved {
                    Ok(true) => {
                        tracing::info!(node = %target.node, "redis decision connection now read by the proxy workers, watched by the store thread (dedicated_io_thread)");
                        attempt = 0;
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::debug!(node = %target.node, error = %e, "cannot open the decision connection on the proxy runtime yet");
                        tokio::time::sleep(backoff(attempt)).await;
                        attempt = attempt.saturating_add(1);
                    }
                }
                continue;
            }
            let setup = tokio::time::timeout(SETUP_TIMEOUT, self.connect(&link, &target));
            // A reload that points the link elsewhere meanwhile drops this attempt: the new
            // target is tried at once, not after the old one's timeouts.
            let retargeted = async {
                loop {
                    link.wake.notified().await;
                    if !Arc::ptr_eq(&target, &link.target.load_full())
                        || link.retired.load(Ordering::Relaxed)
                    {
                        return;
                    }
                }
            };
            let outcome = tokio::select! {
                outcome = setup => outcome.unwrap_or_else(|_| {
                    Err(redis::RedisError::from(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "redis did not answer the connection checks and SCRIPT LOAD within 3 s",
                    )))
                }),
                () = retargeted => continue,
            };
            match outcome {
                // A reload may have changed the target while this one was connecting.
                Ok(_) if !Arc::ptr_eq(&target, &link.target.load_full()) => continue,
                Ok(_) if link.retired.load(Ordering::Relaxed) => break,
                Ok((opened, wire)) => {
                    // Swapping is seamless: requests on the old connection finish on it.
                    link.install(opened, wire, self.proxy_runtime.get().is_some());
                    read_clock(&link).await;
                    // The connection's set-up read the node's settings.
                    recheck_at = next_check(&link);
                    if moving {
                        link.moving.store(false, Ordering::Relaxed);
                        link.connected_again();
                        tracing::info!(node = %target.node, "redis connected with the reloaded settings; the old connection finishes what it has");
                        attempt = 0;
                        continue;
                    }
                    if connected {
                        tracing::info!(node = %target.node, "redis connection now driven by the proxy workers");
                        continue;
                    }
                    link.connected_again();
                    tracing::info!(node = %target.node, attempts = attempt + 1, "redis connected");
                    attempt = 0;
                }
                Err(e) if connected && !moving => {
                    tracing::debug!(node = %target.node, error = %e, "cannot open a connection on the proxy runtime yet");
                    tokio::time::sleep(backoff(attempt)).await;
                    attempt = attempt.saturating_add(1);
                }
                // The reload's new credentials or TLS files are refused (a mistyped password,
                // a user without the limiter's commands, a CA that does not sign the
                // server's certificate): what a reload got wrong, not an outage. The old
                // connection, which they do not change, keeps deciding; the new ones are
                // tried again (the ACL may be given them next), and the old connection's
                // loss makes the new target everyone's, as any failed move.
                Err(e) if moving && access_refused(&e) => {
                    if attempt == 0 {
                        tracing::error!(node = %target.node, error = %reason(&e), "the reloaded redis settings are refused; the connection made with the previous ones keeps deciding, and the new ones are tried again in the background (mend the file and reload, or give Redis's ACL what the file says)");
                    } else {
                        tracing::debug!(node = %target.node, error = %reason(&e), "the reloaded redis settings are still refused");
                    }
                    // Each refusal is a failed AUTH in Redis's ACL log: tried again every
                    // 2 s, not at the outage's pace; a reload wakes it at once.
                    tokio::select! {
                        _ = tokio::time::sleep(REFUSED_AGAIN_AFTER) => {}
                        _ = link.wake.notified() => {}
                    }
                    attempt = attempt.saturating_add(1);
                }
                Err(e) => {
                    if moving {
                        // The reloaded url does not answer: the old Redis is left now, and
                        // its outage is the new url's.
                        link.moving.store(false, Ordering::Relaxed);
                        link.conn.store(None);
                    }
                    // A new target that fails is failing on its own account: a quarantine
                    // its failures open runs its course (a later connection ends none).
                    if Arc::ptr_eq(&target, &link.target.load_full()) {
                        link.new_target.store(false, Ordering::Release);
                    }
                    // Requests meanwhile fail at once and count nothing: the attempts do, once
                    // a request has found the node down.
                    link.attempt_failed();
                    // A probe waiting for this attempt fails at once, as a request does.
                    link.ready.notify_waiters();
                    let reason = reason(&e);
                    let unreachable =
                        e.is_connection_refusal() || e.is_connection_dropped() || e.is_timeout();
                    link.log_outage(if unreachable { "unreachable" } else { &reason }, &reason);
                    // A breaker's probe cuts the wait short (`Store::connection`).
                    tokio::select! {
                        _ = tokio::time::sleep(backoff(attempt)) => {}
                        _ = link.wake.notified() => {}
                    }
                    attempt = attempt.saturating_add(1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Redis closes a client idle for more than its `timeout`'s whole seconds: the checks run
    /// at least twice in that time, and every 15 s without one (or past 30 s).
    #[test]
    fn the_checks_run_within_half_of_redis_idle_timeout() {
        assert_eq!(checks_every(0), Duration::from_secs(15));
        assert_eq!(checks_every(1), Duration::from_millis(500));
        assert_eq!(checks_every(2), Duration::from_secs(1));
        assert_eq!(checks_every(10), Duration::from_secs(5));
        assert_eq!(checks_every(30), Duration::from_secs(15));
        assert_eq!(checks_every(300), Duration::from_secs(15));
        assert_eq!(checks_every(u64::MAX), Duration::from_secs(15));
    }

    /// A NAT or load balancer that forgets idle connections keeps one that sends keepalives.
    #[tokio::test]
    async fn every_tcp_socket_to_redis_sends_keepalives() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        let dial = Dial::new(&url, &crate::config::RedisAccess::default()).unwrap();
        let Ok(Socket::Tcp(opened)) = socket(&dial).await else {
            panic!("a plain TCP socket");
        };
        let opened = socket2::SockRef::from(&opened);
        assert!(opened.keepalive().unwrap());
        assert_eq!(opened.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(opened.tcp_keepalive_interval().unwrap(), KEEPALIVE_INTERVAL);
        assert_eq!(opened.tcp_keepalive_retries().unwrap(), 3);
    }
}
