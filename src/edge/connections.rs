//! Downstream connections: the TLS handshake, the request-head deadline, and the bound on
//! how many are open.
//!
//! Pingora accepts every listener's sockets and hands each to [`Guard`], which wraps the
//! proxy. Every connection is counted from its accept. On a TLS listener the guard makes the
//! handshake itself (Pingora's rustls acceptor, with the listener's certificates), so that it
//! falls under the same deadline as a request head and the same bound. Every connection is
//! then wrapped in a [`Guarded`] stream that knows where the connection is:
//!
//! - `Handshake`: its TLS handshake is under way (read through [`Handshaking`]).
//! - `Head`: a request head is on its way. Its bytes must all be in before
//!   `header_read_timeout_ms` from the first one (from the accept, on a new connection);
//!   after that the read fails and the connection is closed (slowloris).
//! - `Busy`: the head was read (the proxy says so), until the answer is finished.
//! - `Idle`: between keep-alive requests; closed after `keepalive_timeout_seconds`.
//! - `Multiplexed`: HTTP/2. With no stream in the proxy for `keepalive_timeout_seconds`
//!   (counted from its last stream's end) it is sent a GOAWAY, as nginx does, and it is cut
//!   (reads end, writes fail) if the client has not closed it `GOAWAY_GRACE_MS` later.
//!
//! The deadlines are kept by one sweeper task for all connections ([`Connections::sweep`],
//! every 100 ms), not by a timer per connection or per read: a request then costs two
//! atomic stores here, and a deadline is kept to within 100 ms. (Pingora's own keep-alive
//! timeout arms a timer on every read; measured, that cost a fifth of the plain proxy's
//! throughput.)
//!
//! At `max_connections`, a new connection first makes room with the connection idle longest
//! that has no request in progress, as nginx does (of the 64 oldest such connections: a
//! bounded look, which picks the longest idle among them, not always of all): one waiting for
//! its first request (`Handshake`, `Head`, including a wait for the h2c preface), an HTTP/1
//! one between requests (`Idle`), or an HTTP/2 one without a stream in the proxy
//! ([`StreamSlot`]) since its last stream ended. An HTTP/1 one asked to close reads
//! end-of-file, which Pingora treats as a client that left; an HTTP/2 one is sent a GOAWAY
//! through its own shutdown watch: a stream still on its way from the HTTP/2 layer to the
//! proxy, where nothing here sees it, is answered all the same, then the connection closes
//! (its socket held until its client closes it, `GOAWAY_GRACE_MS` at most; past 64 such, the
//! one sent its GOAWAY first is cut at once). When no connection is idle, the new connection
//! is closed at once.
//!
//! The requests in flight are bounded by `max_connections` too (each holds an upstream
//! connection), and an HTTP/2 connection's streams past its first in progress may take at
//! most half of it together ([`Connections::stream_started`]): a few connections opening
//! streams they never finish cannot take every place from the clients beside them.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use futures_util::task::AtomicWaker;
use pingora_core::apps::ServerApp;
use pingora_core::protocols::raw_connect::ProxyDigest;
use pingora_core::protocols::tls::{SslDigest, TlsRef};
use pingora_core::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, TimingDigest,
    UniqueID, UniqueIDType, ALPN,
};
use pingora_core::protocols::{Ssl, Stream};
use pingora_core::server::ShutdownWatch;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;

use crate::edge::tls::Certificates;

/// The traits Pingora wants of a connection, passed through to `inner()`.
macro_rules! delegate_io {
    ($t:ty) => {
        delegate_write!($t);
        delegate_rest!($t);
    };
}

/// Writes passed through to `inner()`.
macro_rules! delegate_write {
    ($t:ty) => {
        impl AsyncWrite for $t {
            fn poll_write(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<std::io::Result<usize>> {
                Pin::new(self.inner()).poll_write(cx, buf)
            }

            fn poll_flush(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<std::io::Result<()>> {
                Pin::new(self.inner()).poll_flush(cx)
            }

            fn poll_shutdown(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<std::io::Result<()>> {
                Pin::new(self.inner()).poll_shutdown(cx)
            }

            fn poll_write_vectored(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> Poll<std::io::Result<usize>> {
                Pin::new(self.inner()).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.inner_ref().is_write_vectored()
            }
        }
    };
}

/// Every trait Pingora wants of a connection but the writes, passed through to `inner()`.
macro_rules! delegate_rest {
    ($t:ty) => {
        #[async_trait]
        impl Shutdown for $t {
            async fn shutdown(&mut self) {
                self.inner().shutdown().await
            }
        }

        impl UniqueID for $t {
            fn id(&self) -> UniqueIDType {
                self.inner_ref().id()
            }
        }

        impl Ssl for $t {
            fn get_ssl(&self) -> Option<&TlsRef> {
                self.inner_ref().get_ssl()
            }

            fn get_ssl_digest(&self) -> Option<Arc<SslDigest>> {
                self.inner_ref().get_ssl_digest()
            }

            // `http/1.0`, which the TLS listeners offer too, is HTTP/1 to the server (Pingora
            // would hand an ALPN it does not know to a custom protocol's handler, and close).
            fn selected_alpn_proto(&self) -> Option<ALPN> {
                match self.inner_ref().selected_alpn_proto() {
                    Some(ALPN::Custom(c)) if c.protocol() == b"http/1.0" => Some(ALPN::H1),
                    other => other,
                }
            }
        }

        impl GetTimingDigest for $t {
            fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
                self.inner_ref().get_timing_digest()
            }

            fn get_read_pending_time(&self) -> Duration {
                self.inner_ref().get_read_pending_time()
            }

            fn get_write_pending_time(&self) -> Duration {
                self.inner_ref().get_write_pending_time()
            }
        }

        impl GetProxyDigest for $t {
            fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
                self.inner_ref().get_proxy_digest()
            }

            fn set_proxy_digest(&mut self, digest: ProxyDigest) {
                self.inner().set_proxy_digest(digest)
            }
        }

        impl GetSocketDigest for $t {
            fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
                self.inner_ref().get_socket_digest()
            }

            fn set_socket_digest(&mut self, digest: SocketDigest) {
                self.inner().set_socket_digest(digest)
            }
        }
    };
}

const HEAD: u8 = 0;
const BUSY: u8 = 1;
const IDLE: u8 = 2;
const MULTIPLEXED: u8 = 3;
/// A TLS handshake is under way: it has a head's deadline, and no request is in progress.
const HANDSHAKE: u8 = 4;
/// HTTP/2, before its first request's header block is complete ([`H2Head`]): it has a
/// head's deadline, and no request is in progress.
const H2_HEAD: u8 = 5;

/// The HTTP/2 connection preface, which an h2c client sends first.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Why a connection is asked to close.
const KEEP: u8 = 0;
/// Closed to make room at `max_connections`: reads end-of-file.
const EVICTED: u8 = 1;
/// Its request head missed `header_read_timeout_ms`: the read fails.
const HEAD_TIMED_OUT: u8 = 2;
/// Idle past `keepalive_timeout_seconds`: reads end-of-file (HTTP/1), or is sent a
/// GOAWAY (HTTP/2).
const IDLE_TIMED_OUT: u8 = 3;
/// Not reasons kept in `close`: what the sweeper does to an HTTP/2 connection past its
/// GOAWAY's grace (`GOAWAY_GRACE_MS`), and to one asked to close before it was HTTP/2's.
const CUT: u8 = 4;
const GOAWAY: u8 = 5;

/// How often the sweeper looks for heads and idle connections past their time.
pub const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// How long an HTTP/2 connection sent a GOAWAY here (idle, or to make room) may stay open
/// without a stream in the proxy before its socket is cut: a client that answers closes it
/// within a round trip (its PING's answer, then the last GOAWAY); one that never answers
/// would otherwise hold its place for good.
const GOAWAY_GRACE_MS: u64 = 5_000;

/// Every open downstream connection of the process.
#[derive(Debug)]
pub struct Connections {
    max: usize,
    header_timeout_ms: AtomicU64,
    keepalive_ms: AtomicU64,
    next_id: AtomicU64,
    open: Mutex<BTreeMap<u64, Arc<Conn>>>,
    /// Connections asked to close that have not gone yet.
    closing: AtomicUsize,
    /// The clock of `Conn::since_ms`.
    epoch: Instant,
    /// `request_id_header`, lower case, and `strict_transport_security`, for the answers
    /// written here ([`Guarded`]).
    answer_fields: ArcSwap<AnswerFields>,
    /// Told of the request heads answered 400 here (the access log, the metrics).
    bad_head: std::sync::OnceLock<BadHeadHook>,
    /// The HTTP/2 connections by their socket digest (its address), which every stream's
    /// session shares: how a stream finds its connection ([`Connections::stream_started`]).
    h2: Mutex<std::collections::HashMap<usize, Arc<Conn>>>,
    /// Connections closed (or sent a GOAWAY) to make room at the bound, and new ones closed
    /// at once there because every connection was busy: `sentinel_connections_shed_total`.
    shed: [AtomicU64; 3],
    /// HTTP/2 streams in the proxy past their connection's first ([`Connections::stream_started`]).
    extra_streams: Arc<AtomicUsize>,
    /// HTTP/2 connections sent a GOAWAY to make room and not gone yet.
    lingering: AtomicUsize,
    /// TLS handshakes by how they ended: `sentinel_tls_handshakes_total`.
    handshakes: [AtomicU64; 3],
}

/// How a TLS handshake ended ([`Connections::handshakes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handshake {
    Success = 0,
    /// The client's hello or its later messages refused (no version or cipher in common,
    /// no certificate for its name, not TLS at all), or the connection closed in it.
    Failure = 1,
    /// Not complete within `header_read_timeout_ms`.
    Timeout = 2,
}

/// What the bound did to a connection ([`Connections::shed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shed {
    /// An idle connection closed, or an idle HTTP/2 one sent a GOAWAY, to make room.
    ClosedIdle = 0,
    /// A new connection closed at once: every connection was busy.
    Refused = 1,
    /// A request answered 503 at capacity ([`Connections::request_refused`]).
    RequestRefused = 2,
}

/// Since when a connection has had no request in progress, on the `since_ms` clock: a new
/// one waiting for its first request (or its TLS handshake, or its h2c preface), an HTTP/1
/// one between keep-alive requests, an HTTP/2 one without a stream in the proxy since its
/// last stream ended (frames without a stream, a PING, do not make it busy); `None` while
/// it has a request in progress.
fn idle_since(c: &Conn) -> Option<u64> {
    match c.state.load(Ordering::Relaxed) {
        HEAD | IDLE | HANDSHAKE | H2_HEAD => Some(c.since_ms.load(Ordering::Relaxed)),
        MULTIPLEXED if c.streams.load(Ordering::Relaxed) == 0 => {
            Some(c.stream_end_ms.load(Ordering::Relaxed))
        }
        _ => None,
    }
}

/// How many HTTP/2 connections sent a GOAWAY to make room may keep their sockets at once
/// ([`Connections::admit`]).
const LINGERING_MOST: usize = 64;

/// How many idle connections, oldest first, are looked at to choose the one idle longest.
const EVICTION_SAMPLE: usize = 64;

#[derive(Debug)]
struct Conn {
    state: AtomicU8,
    /// `KEEP`, or why it must close.
    close: AtomicU8,
    /// Milliseconds since the epoch when the current `Head` or `Idle` began; for a
    /// `Multiplexed` one, when it last read.
    since_ms: AtomicU64,
    waker: AtomicWaker,
    /// What Pingora watches for the shutdown of this connection: set at the process's
    /// shutdown, and to close an HTTP/2 connection gracefully to make room (a GOAWAY, after
    /// which every stream the client already sent is still answered).
    goaway: watch::Sender<bool>,
    /// HTTP/2 streams in the proxy now ([`Connections::stream_started`]).
    streams: AtomicUsize,
    /// HTTP/2: when its last stream in the proxy ended (or its first request's header block
    /// was complete), on the `since_ms` clock; its idle time counts from here. Frames
    /// without a stream (a PING) do not keep it open: Pingora's own idle timeout, behind
    /// the sweeper's, does not count them either.
    stream_end_ms: AtomicU64,
    /// When this process sent it a GOAWAY (idle, or to make room), on the `since_ms`
    /// clock; 0 when it has not.
    goaway_ms: AtomicU64,
    /// Past its GOAWAY's grace: its reads end and its writes fail (`Guarded`), which closes
    /// it, whether its client still reads or not.
    cut: std::sync::atomic::AtomicBool,
    /// Its key among the HTTP/2 connections (`Connections::h2`), 0 when it has none.
    h2_key: AtomicUsize,
    /// HTTP/2, once multiplexed: when a header block it is sending began (a `HEADERS` frame
    /// whose block has not ended, its `CONTINUATION`s to come), on the `since_ms` clock; 0
    /// when none is on its way. The connection can carry nothing else meanwhile, and the
    /// block has a request head's deadline, as its first one had.
    block_since_ms: AtomicU64,
    /// HTTP/2, sent a GOAWAY to make room: counted in `Connections::lingering` until it is
    /// gone.
    lingers: AtomicBool,
    /// TLS: its client sent its first bytes, so a handshake began (a connection closed
    /// without a byte, a TCP health check, began none).
    spoke: AtomicBool,
}

impl Connections {
    pub fn new(max: usize, header_timeout: Duration, keepalive: Duration) -> Self {
        Self {
            max,
            header_timeout_ms: AtomicU64::new(header_timeout.as_millis() as u64),
            keepalive_ms: AtomicU64::new(keepalive.as_millis() as u64),
            next_id: AtomicU64::new(0),
            open: Mutex::new(BTreeMap::new()),
            closing: AtomicUsize::new(0),
            epoch: Instant::now(),
            answer_fields: ArcSwap::from_pointee(AnswerFields {
                request_id_header: "x-request-id".to_owned(),
                hsts: None,
            }),
            bad_head: std::sync::OnceLock::new(),
            h2: Mutex::new(std::collections::HashMap::new()),
            shed: Default::default(),
            handshakes: Default::default(),
            extra_streams: Arc::new(AtomicUsize::new(0)),
            lingering: AtomicUsize::new(0),
        }
    }

    /// How many connections the bound shed `how`, since the start.
    pub fn shed(&self, how: Shed) -> u64 {
        self.shed[how as usize].load(Ordering::Relaxed)
    }

    /// How many TLS handshakes ended `how`, since the start.
    pub fn handshakes(&self, how: Handshake) -> u64 {
        self.handshakes[how as usize].load(Ordering::Relaxed)
    }

    fn handshake_ended(&self, how: Handshake) {
        self.handshakes[how as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// `max_connections`, which also bounds the requests in flight: an HTTP/2 connection
    /// carries many, each holding an upstream connection of its own.
    pub fn max(&self) -> usize {
        self.max
    }

    /// An HTTP/2 stream of the connection whose socket digest is `digest` reached the
    /// proxy: it counts as the connection's request in progress until the slot drops.
    ///
    /// A stream past its connection's first in progress is an extra one: the extra streams
    /// of every connection together may hold at most half of `max_connections`
    /// ([`StreamSlot::over_share`]), so that a few connections opening streams they never
    /// finish (a body that never comes) leave the other half to every other client's
    /// requests, one connection's worth each, as HTTP/1 gives.
    pub fn stream_started(&self, digest: &Arc<SocketDigest>) -> Option<StreamSlot> {
        let key = Arc::as_ptr(digest) as usize;
        let conn = Arc::clone(
            self.h2
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&key)?,
        );
        // The extra streams' count is every connection's streams in progress past one: a
        // stream that starts beside others adds one, and one that ends beside others takes
        // one away, whichever of them was first.
        let before = conn.streams.fetch_add(1, Ordering::Relaxed);
        let over_share =
            before > 0 && self.extra_streams.fetch_add(1, Ordering::Relaxed) + 1 > self.max / 2;
        Some(StreamSlot {
            conn,
            epoch: self.epoch,
            extras: Arc::clone(&self.extra_streams),
            over_share,
        })
    }

    /// A request answered 503 at capacity: past the requests in flight that
    /// `max_connections` bounds, or past the extra HTTP/2 streams' share of them.
    pub fn request_refused(&self) {
        self.shed[Shed::RequestRefused as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Sets what is told of each request head answered 400 here, once, at start.
    pub fn on_bad_head(&self, hook: BadHeadHook) {
        let _ = self.bad_head.set(hook);
    }

    /// The config's `request_id_header` and `strict_transport_security`, at start and on
    /// every reload.
    pub fn set_answer_fields(&self, server: &crate::config::ServerConfig) {
        let hsts = (server.strict_transport_security.as_ref())
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        self.answer_fields.store(Arc::new(AnswerFields {
            request_id_header: server.request_id_header.as_str().to_ascii_lowercase(),
            hsts,
        }));
    }

    /// `keepalive_timeout_seconds` as the process started with it (a reload's takes effect
    /// at the next start): 0, no keep-alive.
    pub fn keepalive_off(&self) -> bool {
        self.keepalive_ms.load(Ordering::Relaxed) == 0
    }

    /// A reload's `header_read_timeout_ms`, for heads that start from now on.
    pub fn set_header_timeout(&self, timeout: Duration) {
        self.header_timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }

    fn header_timeout(&self) -> Duration {
        Duration::from_millis(self.header_timeout_ms.load(Ordering::Relaxed))
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// How many downstream connections are open now.
    pub fn open(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Conn>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks `conn` to close for `why`, once.
    fn close(&self, conn: &Conn, why: u8) {
        if conn
            .close
            .compare_exchange(KEEP, why, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.closing.fetch_add(1, Ordering::Relaxed);
            conn.waker.wake();
        }
    }

    /// Sends an HTTP/2 connection a GOAWAY (through the watch Pingora keeps for it): every
    /// stream the client already sent is still answered, then the connection closes.
    fn goaway(&self, conn: &Conn) {
        conn.goaway_ms
            .store(self.now_ms().max(1), Ordering::Relaxed);
        conn.goaway.send_replace(true);
    }

    /// Every `SWEEP_EVERY`: closes the connections whose request head is past
    /// `header_read_timeout_ms` and the idle ones past `keepalive_timeout_seconds` (an
    /// HTTP/2 one by a GOAWAY, as nginx does, then its socket once the client closed it or
    /// `GOAWAY_GRACE_MS` passed). One task for all of them, so that a request costs no
    /// timer of its own.
    pub async fn sweep(self: Arc<Self>) {
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = self.now_ms();
            let head = self.header_timeout_ms.load(Ordering::Relaxed);
            let idle = self.keepalive_ms.load(Ordering::Relaxed);
            let late: Vec<(Arc<Conn>, u8)> = self
                .lock()
                .values()
                .filter_map(|c| {
                    let state = c.state.load(Ordering::Relaxed);
                    // Loaded before the stream's end time, which a slot stores before it
                    // leaves (`StreamSlot::drop`): no stream seen means its end is seen.
                    let quiet = || c.streams.load(Ordering::Acquire) == 0;
                    let ended = || now.saturating_sub(c.stream_end_ms.load(Ordering::Relaxed));
                    if c.close.load(Ordering::Relaxed) != KEEP {
                        if state != MULTIPLEXED || c.cut.load(Ordering::Relaxed) {
                            return None;
                        }
                        let sent = c.goaway_ms.load(Ordering::Relaxed);
                        // Asked to close while its first request was on its way (its
                        // reads then became the HTTP/2 layer's): its GOAWAY now.
                        if sent == 0 {
                            return Some((Arc::clone(c), GOAWAY));
                        }
                        // Sent a GOAWAY, not closed by its client since, nothing in the proxy.
                        // The grace counts from the GOAWAY, or from the end of a stream that
                        // was on its way then (its answer may still be draining).
                        let overdue = quiet()
                            && now.saturating_sub(sent) >= GOAWAY_GRACE_MS
                            && ended() >= GOAWAY_GRACE_MS;
                        return overdue.then(|| (Arc::clone(c), CUT));
                    }
                    let since = now.saturating_sub(c.since_ms.load(Ordering::Relaxed));
                    match state {
                        HEAD | HANDSHAKE | H2_HEAD if since >= head => {
                            Some((Arc::clone(c), HEAD_TIMED_OUT))
                        }
                        IDLE if idle > 0 && since >= idle => Some((Arc::clone(c), IDLE_TIMED_OUT)),
                        // A header block on its way past the head's deadline.
                        MULTIPLEXED
                            if matches!(c.block_since_ms.load(Ordering::Relaxed), b if b != 0 && now.saturating_sub(b) >= head) =>
                        {
                            Some((Arc::clone(c), HEAD_TIMED_OUT))
                        }
                        // With no keep-alive (0), as soon as its streams are done.
                        MULTIPLEXED if quiet() && ended() >= idle => {
                            Some((Arc::clone(c), IDLE_TIMED_OUT))
                        }
                        _ => None,
                    }
                })
                .collect();
            for (conn, why) in late {
                match why {
                    // A stream may have reached the proxy since the look above.
                    CUT if conn.streams.load(Ordering::Relaxed) == 0 => {
                        conn.cut.store(true, Ordering::Relaxed);
                        conn.waker.wake();
                        continue;
                    }
                    CUT => continue,
                    GOAWAY => {
                        self.goaway(&conn);
                        continue;
                    }
                    _ => {}
                }
                self.close(&conn, why);
                // (One stuck in a header block is cut at its next read: it could not read
                // a GOAWAY's streams to their end anyway.)
                if conn.state.load(Ordering::Relaxed) == MULTIPLEXED && why != HEAD_TIMED_OUT {
                    self.goaway(&conn);
                }
            }
        }
    }

    /// Registers a new connection in `state`, making room when at the bound; `None`: every
    /// connection is busy, close this one.
    fn admit(self: &Arc<Self>, state: u8) -> Option<Registration> {
        let mut open = self.lock();
        if open.len() - self.closing.load(Ordering::Relaxed).min(open.len()) >= self.max {
            let keep = |c: &&Arc<Conn>| c.close.load(Ordering::Relaxed) == KEEP;
            // Of the first idle connections by age, HTTP/1 and HTTP/2 alike, the one idle
            // longest (a client using its old connection in a tight loop is not the one cut,
            // nor one between two requests for connections idle for seconds beside it); a
            // bounded look at the idle ones (busy ones are passed over).
            let idle_longest = open
                .values()
                .filter(keep)
                .filter_map(|c| Some((idle_since(c)?, c)))
                .take(EVICTION_SAMPLE)
                .min_by_key(|(since, _)| *since);
            let Some((_, idle)) = idle_longest else {
                self.shed[Shed::Refused as usize].fetch_add(1, Ordering::Relaxed);
                return None;
            };
            self.close(idle, EVICTED);
            self.shed[Shed::ClosedIdle as usize].fetch_add(1, Ordering::Relaxed);
            // An HTTP/2 one is sent a GOAWAY: a stream whose HEADERS are on their way to
            // the proxy is still answered before it closes; the client opens a new
            // connection for its next request.
            if idle.state.load(Ordering::Relaxed) == MULTIPLEXED {
                idle.lingers.store(true, Ordering::Relaxed);
                self.goaway(idle);
                // An HTTP/2 one sent a GOAWAY keeps its socket until its client closes it,
                // `GOAWAY_GRACE_MS` at most: past `LINGERING_MOST` such, the one sent its
                // GOAWAY first is cut now (a client that ignores GOAWAYs would otherwise
                // hold a socket past the bound for each new connection for 5 s).
                if self.lingering.fetch_add(1, Ordering::Relaxed) >= LINGERING_MOST {
                    let first = (open.values())
                        .filter(|c| c.lingers.load(Ordering::Relaxed))
                        .filter(|c| !c.cut.load(Ordering::Relaxed))
                        .filter(|c| c.streams.load(Ordering::Relaxed) == 0)
                        .min_by_key(|c| c.goaway_ms.load(Ordering::Relaxed));
                    if let Some(first) = first {
                        first.cut.store(true, Ordering::Relaxed);
                        first.waker.wake();
                    }
                }
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            state: AtomicU8::new(state),
            close: AtomicU8::new(KEEP),
            since_ms: AtomicU64::new(self.now_ms()),
            waker: AtomicWaker::new(),
            goaway: watch::Sender::new(false),
            streams: AtomicUsize::new(0),
            stream_end_ms: AtomicU64::new(0),
            goaway_ms: AtomicU64::new(0),
            cut: std::sync::atomic::AtomicBool::new(false),
            h2_key: AtomicUsize::new(0),
            block_since_ms: AtomicU64::new(0),
            lingers: AtomicBool::new(false),
            spoke: AtomicBool::new(false),
        });
        open.insert(id, Arc::clone(&conn));
        drop(open);
        Some(Registration {
            conn,
            id,
            connections: Arc::clone(self),
        })
    }

    /// Passes the process's shutdown on to every connection's own watch, once.
    async fn forward_shutdown(self: Arc<Self>, mut process: ShutdownWatch) {
        while !*process.borrow_and_update() {
            if process.changed().await.is_err() {
                return;
            }
        }
        for conn in self.lock().values() {
            conn.goaway.send_replace(true);
        }
    }

    fn forget(&self, id: u64, conn: &Arc<Conn>) {
        self.lock().remove(&id);
        let key = conn.h2_key.load(Ordering::Relaxed);
        if key != 0 {
            let mut h2 = self.h2.lock().unwrap_or_else(|p| p.into_inner());
            if h2.get(&key).is_some_and(|c| Arc::ptr_eq(c, conn)) {
                h2.remove(&key);
            }
        }
        if conn.close.load(Ordering::Relaxed) != KEEP {
            self.closing.fetch_sub(1, Ordering::Relaxed);
        }
        if conn.lingers.load(Ordering::Relaxed) {
            self.lingering.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// An HTTP/2 stream in the proxy, counted on its connection until dropped; the
/// connection's idle time starts again when it ends (the `Instant` is the clock's epoch).
#[derive(Debug)]
pub struct StreamSlot {
    conn: Arc<Conn>,
    epoch: Instant,
    /// Every connection's extra streams' count ([`Connections::stream_started`]).
    extras: Arc<AtomicUsize>,
    over_share: bool,
}

impl StreamSlot {
    /// An extra stream past the extra streams' share of `max_connections`: it is answered
    /// 503 at capacity.
    pub fn over_share(&self) -> bool {
        self.over_share
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let now = self.epoch.elapsed().as_millis() as u64;
        self.conn.stream_end_ms.store(now, Ordering::Relaxed);
        if self.conn.streams.fetch_sub(1, Ordering::Release) > 1 {
            self.extras.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Guarded {
    /// Registers an HTTP/2 connection by its socket digest, which its streams' sessions
    /// share ([`Connections::stream_started`]).
    fn register_h2(&self) {
        let Some(digest) = self.inner.get_socket_digest() else {
            return;
        };
        let key = Arc::as_ptr(&digest) as usize;
        self.reg.conn.h2_key.store(key, Ordering::Relaxed);
        self.reg
            .connections
            .h2
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, Arc::clone(&self.reg.conn));
    }
}

/// A connection's place among the open ones, given up when dropped.
#[derive(Debug)]
struct Registration {
    conn: Arc<Conn>,
    id: u64,
    connections: Arc<Connections>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.connections.forget(self.id, &self.conn);
    }
}

/// A downstream connection under watch.
#[derive(Debug)]
pub struct Guarded {
    inner: Stream,
    reg: Registration,
    /// The gateway's own answer written in place of Pingora's bare 400 or 431, and how much of it
    /// is written ([`Guarded::poll_write`]).
    replacing: Option<(Vec<u8>, usize)>,
    /// Bytes read while looking for the h2c preface, given back to the first reads.
    peeked: Vec<u8>,
    /// An error the read behind them met, told at the next read.
    deferred: Option<std::io::Error>,
    /// Where an HTTP/2 connection is in its first request's head (`H2_HEAD`).
    h2_head: H2Head,
    /// The request in progress needs its upstream's answer whatever becomes of the client
    /// (a cost it reports is charged): a reset is read as the end of the client's side
    /// ([`Guarded::read_through_a_reset`]).
    through_reset: AtomicBool,
    /// A reset was read as such while a request was in progress.
    was_reset: AtomicBool,
    /// Bytes read of the HTTP/1 request head on its way (`HEAD`): past [`HEAD_WIRE_LIMIT`]
    /// it is refused before Pingora buffers more of it.
    head_bytes: usize,
    /// The 431 written in place of further reads of a head past the limit.
    refusing: Option<Refusal>,
}

/// The most of a refused request's rest read and thrown away after its answer (nginx's
/// lingering close; the head's deadline bounds the time).
const LINGER_BYTES: usize = 1 << 20;

/// The gateway's answer to a request refused before Pingora has it, and the close after it.
/// Closed with the client's bytes unread, the connection would be reset, which can destroy
/// the answer before the client reads it: once the answer is written, the writing side is
/// shut, and what the client still sends is read and thrown away until it closes (or the
/// head's deadline, or a megabyte), as nginx's lingering close does.
#[derive(Debug)]
struct Refusal {
    answer: Vec<u8>,
    written: usize,
    /// Once the writing side is shut: the bytes read and thrown away since.
    lingering: Option<usize>,
}

impl Refusal {
    fn new(answer: Vec<u8>) -> Self {
        Self {
            answer,
            written: 0,
            lingering: None,
        }
    }

    /// Writes the answer, shuts the writing side and lingers; `Ready` once the connection
    /// may close (or the stream failed).
    fn poll_out(&mut self, stream: &mut Stream, cx: &mut Context<'_>) -> Poll<()> {
        while self.written < self.answer.len() {
            match Pin::new(&mut *stream).poll_write(cx, &self.answer[self.written..]) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Ready(Ok(n)) => self.written += n,
                Poll::Pending => return Poll::Pending,
            }
        }
        if self.lingering.is_none() && Pin::new(&mut *stream).poll_flush(cx).is_pending() {
            return Poll::Pending;
        }
        let mut thrown = match self.lingering {
            Some(n) => n,
            None => {
                if Pin::new(&mut *stream).poll_shutdown(cx).is_pending() {
                    return Poll::Pending;
                }
                *self.lingering.insert(0)
            }
        };
        let mut scratch = [0u8; 8192];
        while thrown < LINGER_BYTES {
            let mut rest = ReadBuf::new(&mut scratch);
            match Pin::new(&mut *stream).poll_read(cx, &mut rest) {
                Poll::Ready(Ok(())) if !rest.filled().is_empty() => thrown += rest.filled().len(),
                Poll::Ready(_) => break,
                Poll::Pending => {
                    self.lingering = Some(thrown);
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(())
    }
}

/// The most bytes of an HTTP/1 request head read while it is not complete: the 64 KiB its
/// fields may hold ([`MAX_HEADER_BYTES`]) and 16 KiB for the request line and the fields'
/// framing. Pingora would buffer up to 1 MiB of an unfinished head per connection (and
/// answer a complete one past that 400); a head still unfinished here is answered 431 and
/// its connection closed, so a trickled head holds at most about 128 KiB (Pingora's buffer
/// doubles as it fills).
///
/// [`MAX_HEADER_BYTES`]: crate::proxy::respond::MAX_HEADER_BYTES
pub const HEAD_WIRE_LIMIT: usize = crate::proxy::respond::MAX_HEADER_BYTES + 16 * 1024;

impl Guarded {
    /// The request in progress is charged what its upstream reports: an HTTP/1 client that
    /// resets its connection is read as one that closed its side, so the upstream's answer
    /// is still read (and its cost charged) though it cannot be written. Until the answer.
    pub fn read_through_a_reset(&self) {
        self.through_reset.store(true, Ordering::Relaxed);
    }

    /// The client reset its connection while the request was in progress.
    pub fn was_reset(&self) -> bool {
        self.was_reset.load(Ordering::Relaxed)
    }

    fn inner(&mut self) -> &mut Stream {
        &mut self.inner
    }

    fn inner_ref(&self) -> &Stream {
        &self.inner
    }

    /// The connection the proxy reads a request from, when it is one of ours (HTTP/1).
    pub fn of(stream: Option<&Stream>) -> Option<&Guarded> {
        stream.and_then(|s| (**s).as_any().downcast_ref::<Guarded>())
    }

    /// The request head is complete: no deadline until the next one. A pipelined request
    /// whose head came with the previous one is read without a read of this connection:
    /// it finds it `Idle`.
    pub fn head_complete(&self) {
        let state = &self.reg.conn.state;
        let _ = state.compare_exchange(HEAD, BUSY, Ordering::Relaxed, Ordering::Relaxed);
        let _ = state.compare_exchange(IDLE, BUSY, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// The answer is finished: the connection waits for the next request.
    pub fn answered(&self) {
        self.through_reset.store(false, Ordering::Relaxed);
        self.reg
            .conn
            .since_ms
            .store(self.reg.connections.now_ms(), Ordering::Relaxed);
        let _ =
            self.reg
                .conn
                .state
                .compare_exchange(BUSY, IDLE, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// An HTTP/2 connection past its GOAWAY's grace: its writes fail, so that the HTTP/2
    /// layer ends it even when it waits to write (a client that stopped reading never lets
    /// it read the end-of-file).
    fn cut(&self) -> Option<std::io::Error> {
        self.reg
            .conn
            .cut
            .load(Ordering::Relaxed)
            .then(Self::cut_error)
    }

    fn cut_error() -> std::io::Error {
        std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "an HTTP/2 connection kept past its GOAWAY's grace",
        )
    }

    /// An HTTP/2 read or write that waits can be woken by the cut (`sweep`): its waker is
    /// kept, and the cut looked at again, in case it came just before. True: cut now.
    fn waits(&self, cx: &Context<'_>, pending: bool) -> bool {
        let conn = &self.reg.conn;
        if !pending || conn.state.load(Ordering::Relaxed) != MULTIPLEXED {
            return false;
        }
        conn.waker.register(cx.waker());
        conn.cut.load(Ordering::Relaxed)
    }

    /// A head past [`HEAD_WIRE_LIMIT`] and still not complete: 431 is written (a read waits
    /// while the client does not take it, within the head's deadline), then the read fails
    /// and Pingora closes the connection.
    fn refuse_head(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.refusing.is_none() {
            self.refusing = Some(Refusal::new(self.refusal(431)));
        }
        let Some(refusing) = &mut self.refusing else {
            unreachable!("set above")
        };
        if refusing.poll_out(&mut self.inner, cx).is_pending() {
            return Poll::Pending;
        }
        Poll::Ready(Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "request head larger than the gateway reads",
        )))
    }

    /// How long the head on its way has had: since the accept for a connection's first
    /// request, since its first byte for a later one.
    fn head_took(&self) -> Duration {
        let since = self.reg.conn.since_ms.load(Ordering::Relaxed);
        Duration::from_millis(self.reg.connections.now_ms().saturating_sub(since))
    }

    fn header_timed_out() -> std::io::Error {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "request head not complete within header_read_timeout_ms",
        )
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let state = this.reg.conn.state.load(Ordering::Relaxed);
        if state == BUSY {
            // (The error the read behind the preface's bytes met, in its place.)
            let read = match this.deferred.take() {
                Some(e) => Poll::Ready(Err(e)),
                None => Pin::new(&mut this.inner).poll_read(cx, buf),
            };
            return match read {
                Poll::Ready(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    this.was_reset.store(true, Ordering::Relaxed);
                    match this.through_reset.load(Ordering::Relaxed) {
                        true => Poll::Ready(Ok(())),
                        false => Poll::Ready(Err(e)),
                    }
                }
                read => read,
            };
        }
        if let Some(e) = this.deferred.take() {
            return Poll::Ready(Err(e));
        }
        if state == MULTIPLEXED {
            if this.reg.conn.cut.load(Ordering::Relaxed) {
                return Poll::Ready(Ok(()));
            }
            // A header block not complete within the head's deadline: the read fails, and
            // the block is told as a 408 without an answer, as a first one's.
            // (One whose first request became whole as the sweeper found its first head late
            // has no block on its way: the sweeper's GOAWAY closes it gracefully.)
            if this.reg.conn.close.load(Ordering::Relaxed) == HEAD_TIMED_OUT {
                let since = this.reg.conn.block_since_ms.load(Ordering::Relaxed);
                let took = this.reg.connections.now_ms().saturating_sub(since);
                // A block begun since the sweeper's look (its GOAWAY's grace) has its own time.
                if since != 0 && took >= this.reg.connections.header_timeout().as_millis() as u64 {
                    this.reg.conn.block_since_ms.store(0, Ordering::Relaxed);
                    let request_id = crate::proxy::forwarded::new_request_id();
                    let took = Duration::from_millis(took);
                    let head = BadHead::of(408, &request_id, "HTTP/2", took, 0);
                    tell_bad_head(&this.reg.connections, &this.inner, head);
                    return Poll::Ready(Err(Self::header_timed_out()));
                }
            }
            // Its last read tells which HTTP/2 connection is quietest (`admit`).
            let before = buf.filled().len();
            let read = Pin::new(&mut this.inner).poll_read(cx, buf);
            if this.waits(cx, read.is_pending()) {
                return Poll::Ready(Ok(()));
            }
            if buf.filled().len() > before {
                let now = this.reg.connections.now_ms();
                this.reg.conn.since_ms.store(now, Ordering::Relaxed);
                let head = &mut this.h2_head;
                let was = head.pending();
                head.follow(&buf.filled()[before..]);
                let pending = head.pending();
                // What is pending after a block ended in these bytes has the deadline from
                // now; a frame header that came in parts, from its first byte.
                if pending != was || (pending && head.ended) {
                    let since = if pending { now.max(1) } else { 0 };
                    this.reg.conn.block_since_ms.store(since, Ordering::Relaxed);
                }
            }
            return read;
        }
        match this.reg.conn.close.load(Ordering::Relaxed) {
            KEEP => {}
            // Its head took too long (slowloris): the read fails, Pingora closes. A head
            // begun is told to the access log and the metrics as a 408 without an answer
            // (nginx's `client_header_timeout`); a connection that sent nothing sent no
            // request.
            HEAD_TIMED_OUT => {
                let begun = match state {
                    // A head refused as too large was told as its 431 already.
                    HEAD => std::mem::take(&mut this.head_bytes) > 0 && this.refusing.is_none(),
                    H2_HEAD => std::mem::take(&mut this.h2_head.begun),
                    _ => false,
                };
                if begun {
                    let request_id = crate::proxy::forwarded::new_request_id();
                    let protocol = if state == H2_HEAD {
                        "HTTP/2"
                    } else {
                        "HTTP/1.1"
                    };
                    let head = BadHead::of(408, &request_id, protocol, this.head_took(), 0);
                    tell_bad_head(&this.reg.connections, &this.inner, head);
                }
                return Poll::Ready(Err(Self::header_timed_out()));
            }
            // Idle too long, or closed to make room: an end-of-file, as if the client left.
            _ => return Poll::Ready(Ok(())),
        }
        // Asked for more with the limit read: the head is not complete within it.
        if state == HEAD && this.head_bytes >= HEAD_WIRE_LIMIT {
            this.reg.conn.waker.register(cx.waker());
            return this.refuse_head(cx);
        }
        let before = buf.filled().len();
        let read = if this.peeked.is_empty() {
            this.reg.conn.waker.register(cx.waker());
            // A head is read no further than one byte past the limit: what Pingora holds of
            // an unfinished one stays bounded.
            let so_far = if state == HEAD { this.head_bytes } else { 0 };
            let allowance = HEAD_WIRE_LIMIT - so_far;
            if matches!(state, HEAD | IDLE) && buf.remaining() > allowance {
                let mut limited = buf.take(allowance);
                let start = limited.filled().as_ptr();
                let read = Pin::new(&mut this.inner).poll_read(cx, &mut limited);
                // The reader wrote into the buffer it was given (as tokio's `Take` checks).
                assert_eq!(
                    start,
                    limited.filled().as_ptr(),
                    "the read swapped its buffer"
                );
                let n = limited.filled().len();
                // SAFETY: the `n` bytes after `filled` were written by the read above.
                unsafe { buf.assume_init(n) };
                buf.advance(n);
                read
            } else {
                Pin::new(&mut this.inner).poll_read(cx, buf)
            }
        } else {
            let n = this.peeked.len().min(buf.remaining());
            buf.put_slice(&this.peeked[..n]);
            this.peeked.drain(..n);
            // With what came behind them, when it is there already: the look for the
            // preface stopped after at most its 24 bytes, which may end inside the request
            // line, and Pingora refuses a line it cannot read yet (a raw space, which it
            // escapes in a whole line, made such a partial one a 400).
            if this.peeked.is_empty() && buf.remaining() > 0 {
                let mut more = buf.take(HEAD_WIRE_LIMIT.saturating_sub(n));
                let start = more.filled().as_ptr();
                match Pin::new(&mut this.inner).poll_read(cx, &mut more) {
                    Poll::Ready(Ok(())) => {
                        assert_eq!(start, more.filled().as_ptr(), "the read swapped its buffer");
                        let read = more.filled().len();
                        // SAFETY: the `read` bytes after `filled` were written by the read
                        // above.
                        unsafe { buf.assume_init(read) };
                        buf.advance(read);
                    }
                    // Told at the next read, after the bytes in hand.
                    Poll::Ready(Err(e)) => this.deferred = Some(e),
                    Poll::Pending => {}
                }
            }
            Poll::Ready(Ok(()))
        };
        if !matches!(read, Poll::Ready(Ok(()))) || buf.filled().len() == before {
            return read;
        }
        let conn = &this.reg.conn;
        let n = buf.filled().len() - before;
        match state {
            HEAD => this.head_bytes += n,
            // The first bytes of the next request: its head has the full time from now.
            IDLE => {
                this.head_bytes = n;
                conn.since_ms
                    .store(this.reg.connections.now_ms(), Ordering::Relaxed);
                conn.state.store(HEAD, Ordering::Relaxed);
            }
            // The first request's header block is complete: from here on the HTTP/2 layer
            // and its streams are the proxy's.
            H2_HEAD
                if {
                    this.h2_head.follow(&buf.filled()[before..]);
                    this.h2_head.completed
                } =>
            {
                let now = this.reg.connections.now_ms();
                conn.since_ms.store(now, Ordering::Relaxed);
                conn.stream_end_ms.store(now, Ordering::Relaxed);
                // The next block may have begun in the same bytes.
                if this.h2_head.pending() {
                    conn.block_since_ms.store(now.max(1), Ordering::Relaxed);
                }
                conn.state.store(MULTIPLEXED, Ordering::Relaxed);
            }
            _ => {}
        }
        read
    }
}

/// Follows an HTTP/2 connection's bytes, frame by frame: until its first header block ends
/// (a `HEADERS` or `CONTINUATION` frame with `END_HEADERS`, its payload all in) no request
/// has reached the HTTP/2 layer whole, and the connection has a request head's deadline and
/// can be closed to make room like one waiting for an HTTP/1 request; after it, each header
/// block on its way has that deadline too ([`Conn::block_since_ms`]). Without it, a TLS
/// client that chose `h2` and sent nothing, or one trickling a header block, kept its
/// connection until the keep-alive timeout or for good.
#[derive(Debug, Default)]
struct H2Head {
    /// Bytes to pass over before the next frame header (the preface, a frame's payload).
    skip: usize,
    /// The frame header read so far.
    frame: [u8; 9],
    have: usize,
    /// The frame being passed over ends a header block: the block is complete when its
    /// payload is all in (a client trickling it is held to the head's deadline).
    ends: bool,
    /// A `HEADERS` frame has begun: a request is on its way (cut at the deadline, it is
    /// logged and counted as a 408, as an HTTP/1 head begun).
    begun: bool,
    /// A header block is on its way (begun, not complete).
    open: bool,
    /// A header block ended in the bytes the last [`H2Head::follow`] was given.
    ended: bool,
    /// A header block has been complete: the first request is the HTTP/2 layer's.
    completed: bool,
}

impl H2Head {
    const HEADERS: u8 = 0x1;
    const CONTINUATION: u8 = 0x9;
    const END_HEADERS: u8 = 0x4;

    /// At the start of the connection, before the client's preface.
    fn at_preface() -> Self {
        Self {
            skip: H2_PREFACE.len(),
            ..Self::default()
        }
    }

    /// Whether a header block may be on its way: one begun and not complete, or a frame's
    /// header read in part (a `HEADERS` one's, perhaps).
    fn pending(&self) -> bool {
        self.open || self.have > 0
    }

    /// Follows `bytes`, the next ones read ([`H2Head::pending`] says where they left it).
    fn follow(&mut self, mut bytes: &[u8]) {
        self.ended = false;
        loop {
            let passed = self.skip.min(bytes.len());
            self.skip -= passed;
            bytes = &bytes[passed..];
            if self.skip > 0 {
                return;
            }
            if std::mem::take(&mut self.ends) {
                self.open = false;
                self.completed = true;
                self.ended = true;
            }
            let n = (self.frame.len() - self.have).min(bytes.len());
            self.frame[self.have..self.have + n].copy_from_slice(&bytes[..n]);
            self.have += n;
            bytes = &bytes[n..];
            if self.have < self.frame.len() {
                return;
            }
            self.have = 0;
            let [l0, l1, l2, kind, flags, ..] = self.frame;
            self.begun |= kind == Self::HEADERS;
            if matches!(kind, Self::HEADERS | Self::CONTINUATION) {
                self.open = true;
                self.ends = flags & Self::END_HEADERS != 0;
            }
            self.skip = usize::from(l0) << 16 | usize::from(l1) << 8 | usize::from(l2);
        }
    }
}

delegate_rest!(Guarded);

/// Pingora answers a request head it cannot parse (a malformed header, a bad
/// `Content-Length`, a head over its limits) itself, before any hook of the gateway runs:
/// an empty 400 with its own `Server` header, or 431 for a head of more fields than its
/// parser takes (256; `vendor/pingora-proxy`). Such an answer is the only thing written
/// while a head is on its way (`Head`); it is replaced by the gateway's own, as every answer
/// the gateway writes: JSON, `content-type`, a request id, and the connection closed. The
/// status it has, when it is one.
fn pingora_refusal(buf: &[u8]) -> Option<u16> {
    if !buf.starts_with(b"HTTP/1.") {
        return None;
    }
    match buf.get(8..13) {
        Some(b" 400 ") => Some(400),
        Some(b" 431 ") => Some(431),
        _ => None,
    }
}

/// A request head Pingora could not parse, answered with the gateway's 400 (431 for one of
/// too many fields) here, or one refused as too large before it was whole (431): what the
/// access log and the metrics are told of it ([`Connections::on_bad_head`]).
pub struct BadHead<'a> {
    /// 400, 431 for a head past [`HEAD_WIRE_LIMIT`] or of too many fields, or 408 for one not complete within
    /// `header_read_timeout_ms` (no answer written).
    pub status: u16,
    pub request_id: &'a str,
    /// The peer's address (the head was not read, so no forwarded header either).
    pub peer: Option<std::net::IpAddr>,
    pub tls: bool,
    /// `HTTP/1.1`, or `HTTP/2` for a header block begun and cut.
    pub protocol: &'static str,
    /// Since its head's time began (the accept for a connection's first request, else the
    /// request's first byte) until now.
    pub took: Duration,
    /// Body bytes of the answer.
    pub bytes_sent: u64,
}

impl<'a> BadHead<'a> {
    /// One not yet told its peer and TLS ([`tell_bad_head`] reads them from the stream).
    fn of(
        status: u16,
        request_id: &'a str,
        protocol: &'static str,
        took: Duration,
        bytes_sent: u64,
    ) -> Self {
        Self {
            status,
            request_id,
            peer: None,
            tls: false,
            protocol,
            took,
            bytes_sent,
        }
    }
}

/// Told of every [`BadHead`].
pub struct BadHeadHook(pub Box<dyn Fn(&BadHead<'_>) + Send + Sync>);

impl std::fmt::Debug for BadHeadHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BadHeadHook")
    }
}

impl Guarded {
    /// The gateway's answer in place of Pingora's 400 or 431 ([`pingora_refusal`]).
    fn refusal(&self, status: u16) -> Vec<u8> {
        match status {
            431 => self.own_answer(
                431,
                "Request Header Fields Too Large",
                r#"{"detail":"request header fields too large"}"#,
            ),
            _ => self.own_answer(400, "Bad Request", r#"{"detail":"bad request"}"#),
        }
    }

    /// The gateway's answer to a head it refuses before Pingora parses it, told to the
    /// access log and the metrics as every answer is.
    fn own_answer(&self, status: u16, reason: &str, body: &str) -> Vec<u8> {
        let took = self.head_took();
        own_answer(
            &self.reg.connections,
            &self.inner,
            took,
            (status, reason, body),
        )
    }
}

/// Fields the answers written here carry: the request id's name, and HSTS over TLS.
#[derive(Debug)]
struct AnswerFields {
    request_id_header: String,
    hsts: Option<String>,
}

/// The gateway's own answer, `(status, reason, body)`, to a request it refuses before
/// Pingora has one: told to the access log and the metrics ([`Connections::on_bad_head`]).
fn own_answer(
    connections: &Connections,
    stream: &Stream,
    took: Duration,
    (status, reason, body): (u16, &str, &str),
) -> Vec<u8> {
    let request_id = crate::proxy::forwarded::new_request_id();
    let head = BadHead::of(status, &request_id, "HTTP/1.1", took, body.len() as u64);
    tell_bad_head(connections, stream, head);
    let fields = connections.answer_fields.load();
    // Over TLS, as the proxy's answers say it.
    let hsts = match (&fields.hsts, stream.get_ssl_digest().is_some()) {
        (Some(v), true) => format!("strict-transport-security: {v}\r\n"),
        _ => String::new(),
    };
    format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{}: {request_id}\r\n{hsts}connection: close\r\n\r\n{body}",
        body.len(),
        fields.request_id_header,
    )
    .into_bytes()
}

/// Tells the access log and the metrics of a request refused or given up before Pingora
/// had its head ([`Connections::on_bad_head`]), with the peer and TLS of `stream`.
fn tell_bad_head(connections: &Connections, stream: &Stream, mut head: BadHead<'_>) {
    if let Some(hook) = connections.bad_head.get() {
        head.peer = stream
            .get_socket_digest()
            .and_then(|d| d.peer_addr().and_then(|a| a.as_inet()).map(|a| a.ip()));
        head.tls = stream.get_ssl_digest().is_some();
        (hook.0)(&head);
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = &mut *self;
        if this.replacing.is_none() && this.reg.conn.state.load(Ordering::Relaxed) == HEAD {
            if let Some(status) = pingora_refusal(buf) {
                this.replacing = Some((this.refusal(status), 0));
            }
        }
        let Some((answer, written)) = &mut this.replacing else {
            if let Some(cut) = this.cut() {
                return Poll::Ready(Err(cut));
            }
            let write = Pin::new(&mut this.inner).poll_write(cx, buf);
            if this.waits(cx, write.is_pending()) {
                return Poll::Ready(Err(Self::cut_error()));
            }
            return write;
        };
        // Pingora's bytes (and anything after them: the connection closes) are taken as
        // written once the gateway's answer is.
        while *written < answer.len() {
            match Pin::new(&mut this.inner).poll_write(cx, &answer[*written..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                }
                Poll::Ready(Ok(n)) => *written += n,
                other => return other,
            }
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if let Some(cut) = self.cut() {
            return Poll::Ready(Err(cut));
        }
        let flush = Pin::new(&mut self.inner).poll_flush(cx);
        match self.waits(cx, flush.is_pending()) {
            true => Poll::Ready(Err(Self::cut_error())),
            false => flush,
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if self.replacing.is_some() || self.reg.conn.state.load(Ordering::Relaxed) == HEAD {
            let first = bufs
                .iter()
                .find(|b| !b.is_empty())
                .map_or(&[][..], |b| &**b);
            return self.poll_write(cx, first);
        }
        if let Some(cut) = self.cut() {
            return Poll::Ready(Err(cut));
        }
        let write = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        match self.waits(cx, write.is_pending()) {
            true => Poll::Ready(Err(Self::cut_error())),
            false => write,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A connection as Pingora accepted it, as the transport under TLS. While the handshake is
/// under way (the connection's state is `HANDSHAKE`) a read sees what the watch decided, as
/// [`Guarded`] does for a head: end-of-file when closed to make room, an error past the
/// deadline. Afterwards the [`Guarded`] around the TLS stream watches, and reads pass
/// through.
#[derive(Debug)]
struct Handshaking {
    stream: Stream,
    conn: Arc<Conn>,
    connections: Arc<Connections>,
    /// Nothing was read yet: the first bytes say whether the client speaks TLS at all.
    first: bool,
    /// The 400 written to a client that sent plain HTTP.
    refusing: Option<Refusal>,
}

impl Handshaking {
    fn inner(&mut self) -> &mut Stream {
        &mut self.stream
    }

    fn inner_ref(&self) -> &Stream {
        &self.stream
    }
}

impl AsyncRead for Handshaking {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.conn.state.load(Ordering::Relaxed) == HANDSHAKE {
            match this.conn.close.load(Ordering::Relaxed) {
                KEEP => this.conn.waker.register(cx.waker()),
                HEAD_TIMED_OUT => return Poll::Ready(Err(Guarded::header_timed_out())),
                _ => return Poll::Ready(Ok(())),
            }
        }
        if let Some(refusing) = &mut this.refusing {
            return refusing
                .poll_out(&mut this.stream, cx)
                .map(|()| Err(plain_http()));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut this.stream).poll_read(cx, buf);
        if this.first && buf.filled().len() > before {
            this.first = false;
            this.conn.spoke.store(true, Ordering::Relaxed);
            // A TLS record starts with its content type (22, a handshake); a request line
            // with a method's capital letters. nginx answers such a client 400 too.
            if buf.filled().get(before).is_some_and(u8::is_ascii_uppercase) {
                // Not yet TLS: the access log says `"tls":false`.
                let answer = own_answer(
                    &this.connections,
                    &this.stream,
                    Duration::ZERO,
                    (400, "Bad Request", r#"{"detail":"bad request"}"#),
                );
                let refusing = this.refusing.insert(Refusal::new(answer));
                return refusing
                    .poll_out(&mut this.stream, cx)
                    .map(|()| Err(plain_http()));
            }
        }
        read
    }
}

delegate_io!(Handshaking);

fn plain_http() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        "plain HTTP sent to a TLS listener",
    )
}

#[async_trait]
impl Peek for Handshaking {
    async fn try_peek(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
        self.stream.try_peek(buf).await
    }
}

#[async_trait]
impl Peek for Guarded {
    /// Pingora peeks for the h2c preface before the first request: the wait is part of the
    /// head's time, and a preface turns the connection into a multiplexed one.
    async fn try_peek(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
        let timeout = self.reg.connections.header_timeout();
        let conn = Arc::clone(&self.reg.conn);
        // Closed to make room while it waits: Pingora closes a connection whose peek fails.
        let closed = std::future::poll_fn(|cx| {
            conn.waker.register(cx.waker());
            match conn.close.load(Ordering::Relaxed) {
                KEEP => Poll::Pending,
                _ => Poll::Ready(()),
            }
        });
        let peeked = tokio::select! {
            peeked = tokio::time::timeout(timeout, Self::read_preface(&mut self.inner, buf)) => {
                peeked.map_err(|_| Self::header_timed_out())??
            }
            () = closed => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "closed to make room at max_connections",
                ))
            }
        };
        if buf.starts_with(H2_PREFACE) {
            self.reg.conn.state.store(H2_HEAD, Ordering::Relaxed);
            self.register_h2();
        }
        self.peeked.extend_from_slice(&buf[..peeked]);
        Ok(true)
    }
}

impl Guarded {
    /// Reads into `buf` until it holds the preface, or what it holds cannot be one; says
    /// how many bytes it read. Pingora's own peek waits for as many bytes as the preface
    /// has, so an HTTP/1 request shorter than that (`GET / HTTP/1.0` and its blank line)
    /// would wait for the header deadline.
    async fn read_preface(inner: &mut Stream, buf: &mut [u8]) -> std::io::Result<usize> {
        use tokio::io::AsyncReadExt;
        let mut n = 0;
        while n < buf.len() && H2_PREFACE.starts_with(&buf[..n]) {
            match inner.read(&mut buf[n..]).await? {
                0 if n == 0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                0 => break,
                read => n += read,
            }
        }
        Ok(n)
    }
}

/// The proxy behind the connection watch, and the TLS listeners' acceptors.
pub struct Guard<A> {
    pub app: Arc<A>,
    pub connections: Arc<Connections>,
    pub certificates: Arc<Certificates>,
    /// [`Connections::forward_shutdown`] started, on the first connection.
    pub forwarding: std::sync::Once,
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for Guard<A> {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let stream: Stream = if (*stream).as_any().is::<Guarded>() {
            stream
        } else {
            let local = stream
                .get_socket_digest()
                .and_then(|d| d.local_addr().and_then(|a| a.as_inet()).copied());
            let acceptor = local.and_then(|l| self.certificates.acceptor(l));
            // Counted from the accept, so that connections still in their TLS handshake are
            // bounded (and closed to make room) like those waiting for a first request.
            let state = if acceptor.is_some() { HANDSHAKE } else { HEAD };
            let Some(reg) = self.connections.admit(state) else {
                tracing::debug!(
                    "max_connections reached and every connection busy: closing a new one"
                );
                return None;
            };
            let inner: Stream = match acceptor {
                None => stream,
                Some(acceptor) => {
                    let timeout = self.connections.header_timeout();
                    let transport = Handshaking {
                        stream,
                        conn: Arc::clone(&reg.conn),
                        connections: Arc::clone(&self.connections),
                        first: true,
                        refusing: None,
                    };
                    match tokio::time::timeout(timeout, acceptor.tls_handshake(transport)).await {
                        Ok(Ok(tls)) => {
                            self.connections.handshake_ended(Handshake::Success);
                            let h2 = matches!(tls.selected_alpn_proto(), Some(ALPN::H2));
                            // The request head has its full time from the end of the handshake.
                            reg.conn
                                .since_ms
                                .store(self.connections.now_ms(), Ordering::Relaxed);
                            reg.conn
                                .state
                                .store(if h2 { H2_HEAD } else { HEAD }, Ordering::Relaxed);
                            Box::new(tls)
                        }
                        Ok(Err(e)) => {
                            // The sweeper's deadline may end it first (a timeout all the
                            // same); one closed to make room at the bound is neither.
                            let ended = match reg.conn.close.load(Ordering::Relaxed) {
                                HEAD_TIMED_OUT => Some(Handshake::Timeout),
                                KEEP => Some(Handshake::Failure),
                                _ => None,
                            };
                            if let (Some(how), true) =
                                (ended, reg.conn.spoke.load(Ordering::Relaxed))
                            {
                                self.connections.handshake_ended(how);
                            }
                            tracing::debug!(error = %e, "TLS handshake failed");
                            return None;
                        }
                        Err(_) => {
                            if reg.conn.spoke.load(Ordering::Relaxed) {
                                self.connections.handshake_ended(Handshake::Timeout);
                            }
                            tracing::debug!(
                                "TLS handshake not complete within header_read_timeout_ms"
                            );
                            return None;
                        }
                    }
                }
            };
            let guarded = Guarded {
                inner,
                reg,
                replacing: None,
                peeked: Vec::new(),
                deferred: None,
                h2_head: H2Head::at_preface(),
                through_reset: AtomicBool::new(false),
                was_reset: AtomicBool::new(false),
                head_bytes: 0,
                refusing: None,
            };
            if guarded.reg.conn.state.load(Ordering::Relaxed) == H2_HEAD {
                guarded.register_h2();
            }
            Box::new(guarded)
        };
        let conn = match Guarded::of(Some(&stream)) {
            Some(guarded) => Arc::clone(&guarded.reg.conn),
            None => return None,
        };
        self.forwarding.call_once(|| {
            let connections = Arc::clone(&self.connections);
            drop(tokio::spawn(connections.forward_shutdown(shutdown.clone())));
        });
        // Pingora watches the connection's own watch, which the process's shutdown sets
        // too (a connection registered after `forward_shutdown` went over them sees it here).
        let mut watch = conn.goaway.subscribe();
        if *shutdown.borrow() {
            conn.goaway.send_replace(true);
        }
        if *watch.borrow() {
            watch.mark_changed();
        }
        self.app.process_new(stream, &watch).await
    }

    async fn cleanup(&self) {
        self.app.cleanup().await
    }
}
