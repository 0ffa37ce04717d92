//! Keeping a connection to one Redis node up: connect, check the eviction policy, load the
//! scripts; on loss, reconnect in the background with capped, jittered backoff.
//!
//! A [`Link`] is one node: the one Redis of `[redis] url`, or one primary of a Redis
//! Cluster. Each link has its own circuit breaker, so a dead cluster node quarantines the
//! keys it owns and nothing else.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use rand::Rng;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionAddr};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{watch, Notify};

use super::breaker::Breaker;
use super::store::{forget_connection, is_transport, Shared};

/// Where a link connects.
pub(crate) struct Target {
    /// The URL as configured (single Redis), compared on reload; the node's `host:port` in a
    /// cluster.
    pub(crate) url: String,
    /// `host:port` (or the socket path), without credentials: what logs and metrics name.
    pub(crate) node: String,
    pub(crate) client: redis::Client,
}

impl Target {
    pub(crate) fn new(url: &str) -> std::io::Result<Self> {
        let client = redis::Client::open(url)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let node = match client.get_connection_info().addr() {
            redis::ConnectionAddr::Tcp(host, port) => node_name(host, *port),
            redis::ConnectionAddr::TcpTls { host, port, .. } => node_name(host, *port),
            redis::ConnectionAddr::Unix(path) => path.display().to_string(),
            _ => String::new(),
        };
        Ok(Self {
            url: url.to_owned(),
            node,
            client,
        })
    }

    /// A cluster node, reached with the seed's credentials and settings.
    pub(crate) fn node(seed: &redis::ConnectionInfo, host: &str, port: u16) -> Self {
        let info = seed
            .clone()
            .set_addr(redis::ConnectionAddr::Tcp(host.to_owned(), port));
        Self {
            url: node_name(host, port),
            node: node_name(host, port),
            client: redis::Client::open(info).expect("a TCP connection info is always valid"),
        }
    }
}

/// `host:port`, with brackets around an IPv6 host.
pub(crate) fn node_name(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// One Redis node: its connection, the state of keeping it up, and its breaker.
pub(crate) struct Link {
    pub(crate) conn: ArcSwapOption<MultiplexedConnection>,
    /// Wakes the connector: the connection was dropped, or the target changed.
    pub(crate) wake: Notify,
    /// Woken each time a connection is installed.
    pub(crate) ready: Notify,
    /// Replaced when a reload changes `[redis] url`.
    pub(crate) target: ArcSwap<Target>,
    /// Whether the last connection attempt failed; logs once per outage, not per retry.
    pub(crate) outage_logged: AtomicBool,
    /// The node's `maxmemory-policy` as last read, when it could be read.
    pub(crate) eviction_policy: ArcSwapOption<String>,
    /// Whether the current connection is driven on the proxy's runtime.
    pub(crate) on_proxy_runtime: AtomicBool,
    /// The last evaluation timed out: the connection may be talking to a peer that is gone
    /// without a word (no RST), so the next breaker probe opens a fresh one.
    pub(crate) suspect: AtomicBool,
    /// The node left the cluster's topology: its connector stops.
    pub(crate) retired: AtomicBool,
    pub(crate) breaker: Breaker,
}

impl Link {
    pub(crate) fn new(target: Target, breaker: Breaker) -> Self {
        Self {
            conn: ArcSwapOption::empty(),
            wake: Notify::new(),
            ready: Notify::new(),
            target: ArcSwap::from_pointee(target),
            outage_logged: AtomicBool::new(false),
            eviction_policy: ArcSwapOption::empty(),
            on_proxy_runtime: AtomicBool::new(false),
            suspect: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            breaker,
        }
    }

    /// The node's `host:port`, for logs and metrics.
    pub(crate) fn node(&self) -> String {
        self.target.load().node.clone()
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.conn.load().is_some()
    }

    /// Waits until a connection is up (the caller bounds the wait).
    pub(crate) async fn connected(&self) {
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_connected() {
                return;
            }
            notified.await;
        }
    }

    /// Installs a connection, as the connector or a breaker probe opened it, and watches it:
    /// when Redis closes it, it is forgotten at once, in use or not.
    pub(crate) fn install(
        self: &Arc<Self>,
        shared: &Arc<Shared>,
        opened: Opened,
        on_proxy_runtime: bool,
    ) {
        let conn = Arc::new(opened.conn);
        let watched = Arc::downgrade(&conn);
        self.conn.store(Some(conn));
        self.on_proxy_runtime
            .store(on_proxy_runtime, Ordering::Relaxed);
        self.ready.notify_waiters();
        tokio::spawn(forget_when_closed(
            Arc::clone(shared),
            Arc::downgrade(self),
            watched,
            opened.closed,
        ));
    }

    /// Stops the connector and drops the connection (the node left the topology).
    pub(crate) fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
        self.conn.store(None);
        self.wake.notify_one();
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

/// Backoff between reconnection attempts: 50 ms doubling to 2 s, with full jitter on top of
/// half the step so a fleet does not reconnect in lockstep.
fn backoff(attempt: u32) -> Duration {
    let step_ms = (50u64 << attempt.min(6)).min(2_000);
    let jitter = rand::rng().random_range(0..=step_ms / 2);
    Duration::from_millis(step_ms / 2 + jitter)
}

/// The checks and script loads after a connection opens, bounded as a whole.
const SETUP_TIMEOUT: Duration = Duration::from_secs(3);
/// The TCP (or unix socket) connect and the handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// A connection just opened, and the signal that its socket has closed: the value turns
/// true when the socket reads its end or fails, and the sender is dropped with the socket
/// when the connection is let go. Either way, a waiter wakes.
pub(crate) struct Opened {
    pub(crate) conn: MultiplexedConnection,
    pub(crate) closed: watch::Receiver<bool>,
}

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
pub(crate) async fn open(client: &redis::Client) -> redis::RedisResult<Opened> {
    let info = client.get_connection_info();
    let (closed_tx, closed) = watch::channel(false);
    let setup = async {
        match info.addr() {
            ConnectionAddr::Tcp(host, port) => {
                let socket = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                socket.set_nodelay(true)?;
                drive(info, socket, closed_tx).await
            }
            ConnectionAddr::Unix(path) => {
                let socket = tokio::net::UnixStream::connect(path).await?;
                drive(info, socket, closed_tx).await
            }
            other => Err(redis::RedisError::from(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("unsupported redis address {other}"),
            ))),
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

/// Waits for an installed connection's socket to close, then forgets the connection if the
/// link still holds it. Ends quietly when the connection was replaced and let go.
async fn forget_when_closed(
    shared: Arc<Shared>,
    link: Weak<Link>,
    conn: Weak<MultiplexedConnection>,
    mut closed: watch::Receiver<bool>,
) {
    // Ok: the socket ended; Err: the socket was dropped with the connection.
    let _ = closed.wait_for(|ended| *ended).await;
    if let (Some(link), Some(conn)) = (link.upgrade(), conn.upgrade()) {
        forget_connection(&shared, &link, &conn, &"redis closed the connection");
    }
}

pub async fn eviction_policy(
    conn: &mut MultiplexedConnection,
) -> redis::RedisResult<EvictionPolicy> {
    let reply: redis::RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(conn)
        .await;
    match reply {
        Ok(v) => Ok(match v.get(1).map(String::as_str) {
            Some("noeviction") => EvictionPolicy::NoEviction,
            Some(other) => EvictionPolicy::Evicting(other.to_owned()),
            None => EvictionPolicy::Unknown,
        }),
        Err(e) if is_transport(&e) || e.is_timeout() => Err(e),
        Err(_) => Ok(EvictionPolicy::Unknown),
    }
}

/// Start-up check: `Some(policy)` when a Redis that answers has an evicting policy, which a
/// gateway requiring noeviction must refuse (every seed of a cluster is asked). A Redis that
/// is down is not an error here: the routes follow their fail modes until it comes.
pub async fn preflight(config: &crate::config::RedisConfig) -> Option<String> {
    let urls = match &config.target {
        crate::config::RedisTarget::Single(url) => std::slice::from_ref(url),
        crate::config::RedisTarget::Cluster(seeds) => seeds.as_slice(),
    };
    for url in urls {
        let Ok(client) = redis::Client::open(url.as_str()) else {
            continue;
        };
        let check = async {
            let mut opened = open(&client).await.ok()?;
            eviction_policy(&mut opened.conn).await.ok()
        };
        match tokio::time::timeout(Duration::from_secs(3), check).await {
            Ok(Some(EvictionPolicy::Evicting(p))) => return Some(p),
            Ok(Some(EvictionPolicy::Unknown)) => {
                tracing::warn!("cannot read redis maxmemory-policy (CONFIG not permitted); make sure it is noeviction");
            }
            _ => {}
        }
    }
    None
}

async fn connect(shared: &Shared, link: &Link, target: &Target) -> redis::RedisResult<Opened> {
    let mut opened = match shared.proxy_runtime.get() {
        // Spawned there, the connection's driver task runs on the proxy's workers.
        Some(proxy) => {
            let client = target.client.clone();
            proxy
                .spawn(async move { open(&client).await })
                .await
                .map_err(|e| redis::RedisError::from(std::io::Error::other(e)))??
        }
        None => open(&target.client).await?,
    };
    let conn = &mut opened.conn;
    let policy = eviction_policy(conn).await?;
    let required = shared.require_noeviction.load(Ordering::Relaxed);
    match &policy {
        EvictionPolicy::Evicting(p) if required => {
            tracing::error!(node = %target.node, maxmemory_policy = %p, "redis may evict keys: rate limit quotas can silently reset; set maxmemory-policy noeviction");
        }
        EvictionPolicy::Unknown if required => {
            tracing::warn!(node = %target.node, "cannot read redis maxmemory-policy (CONFIG not permitted); make sure it is noeviction");
        }
        _ => {}
    }
    link.eviction_policy.store(match policy {
        EvictionPolicy::NoEviction => Some(Arc::new("noeviction".to_owned())),
        EvictionPolicy::Evicting(p) => Some(Arc::new(p)),
        EvictionPolicy::Unknown => None,
    });
    for script in [&shared.token_bucket, &shared.sliding_window] {
        match script.load(conn).await {
            Ok(_) => {}
            Err(e) if is_transport(&e) || e.is_timeout() => return Err(e),
            // Serve anyway: each request tries the NOSCRIPT path, and counts it if it fails.
            Err(e) => {
                tracing::error!(node = %target.node, error = %e, "redis refused SCRIPT LOAD; limited requests will fail as NOSCRIPT");
                break;
            }
        }
    }
    Ok(opened)
}

/// Keeps one link's connection up: connects, checks, loads the scripts, then sleeps until
/// the connection is dropped. Ends when the link is retired.
pub(crate) async fn connector(shared: Arc<Shared>, link: Arc<Link>) {
    let mut attempt = 0u32;
    while !link.retired.load(Ordering::Relaxed) {
        let connected = link.is_connected();
        let movable =
            shared.proxy_runtime.get().is_some() && !link.on_proxy_runtime.load(Ordering::Relaxed);
        if connected && !movable {
            link.wake.notified().await;
            continue;
        }
        let target = link.target.load_full();
        let setup = tokio::time::timeout(SETUP_TIMEOUT, connect(&shared, &link, &target));
        let outcome = setup.await.unwrap_or_else(|_| {
            Err(redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "redis did not answer the connection checks and SCRIPT LOAD within 3 s",
            )))
        });
        match outcome {
            // A reload may have changed the target while this one was connecting.
            Ok(_) if !Arc::ptr_eq(&target, &link.target.load_full()) => continue,
            Ok(_) if link.retired.load(Ordering::Relaxed) => break,
            Ok(conn) => {
                // Swapping is seamless: requests on the old connection finish on it.
                link.install(&shared, conn, shared.proxy_runtime.get().is_some());
                if connected {
                    tracing::info!(node = %target.node, "redis connection now driven by the proxy workers");
                    continue;
                }
                link.outage_logged.store(false, Ordering::Relaxed);
                tracing::info!(node = %target.node, attempts = attempt + 1, "redis connected");
                attempt = 0;
            }
            Err(e) if connected => {
                tracing::debug!(node = %target.node, error = %e, "cannot open a connection on the proxy runtime yet");
                tokio::time::sleep(backoff(attempt)).await;
                attempt = attempt.saturating_add(1);
            }
            Err(e) => {
                if !link.outage_logged.swap(true, Ordering::Relaxed) {
                    tracing::warn!(node = %target.node, error = %e, "redis unavailable; reconnecting in the background");
                }
                tokio::time::sleep(backoff(attempt)).await;
                attempt = attempt.saturating_add(1);
            }
        }
    }
}
