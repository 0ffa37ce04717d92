//! The decision path's own connection to a node: a socket beside redis-rs's, that carries the
//! batches' `EVALSHA`s and nothing else.
//!
//! redis-rs's multiplexed connection hands each command over a channel to a driver task,
//! which writes it, reads the reply when the socket is readable, and hands it back over
//! another channel. On the proxy's workers that is two more waits in the workers' queue per
//! call; on a thread of its own, a wake-up of that thread per call and of the workers per
//! answer (docs/benchmarks.md, "Where the limited path's hop could go"). Here the request that
//! finds the connection idle writes its batch from its own task, and every decision waiting
//! on the connection waits for the socket to be readable: whichever is run first reads the
//! answer and hands out every decision's part, so the others find theirs when their turn
//! comes, one wait in all. `batch.rs` says what is sent and what an answer means; this file
//! moves the bytes: the handshake, non-blocking reads and writes (TLS through rustls's own
//! buffers), and the framing of the few replies the batches get.
//!
//! Everything else a link does (the scripts' loads, the eviction check, admin reads, the
//! heartbeat, redirects and probes) stays on redis-rs's connection.

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::runtime::Handle;
use tokio::sync::Notify;

use super::batch::Batches;
use super::connect::{socket, Socket};
use super::dial::Dial;

/// A node's socket, registered with the runtime it was opened on.
enum Io {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Io {
    async fn readable(&self) -> io::Result<()> {
        match self {
            Io::Tcp(s) => s.readable().await,
            Io::Unix(s) => s.readable().await,
        }
    }

    async fn writable(&self) -> io::Result<()> {
        match self {
            Io::Tcp(s) => s.writable().await,
            Io::Unix(s) => s.writable().await,
        }
    }

    fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Io::Tcp(s) => s.try_read(buf),
            Io::Unix(s) => s.try_read(buf),
        }
    }

    fn try_read_buf(&self, buf: &mut Vec<u8>) -> io::Result<usize> {
        match self {
            Io::Tcp(s) => s.try_read_buf(buf),
            Io::Unix(s) => s.try_read_buf(buf),
        }
    }

    fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Io::Tcp(s) => s.try_write(buf),
            Io::Unix(s) => s.try_write(buf),
        }
    }

    /// Reads what the socket holds whatever the runtime it is registered with last saw:
    /// from another thread, whose look must not wait for that runtime to poll its events.
    fn read_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        let socket = match self {
            Io::Tcp(s) => socket2::SockRef::from(s),
            Io::Unix(s) => socket2::SockRef::from(s),
        };
        (&*socket).read(buf)
    }

    fn read_now_buf(&self, buf: &mut Vec<u8>) -> io::Result<usize> {
        let at = buf.len();
        buf.resize(at + 16 * 1024, 0);
        let read = self.read_now(&mut buf[at..]);
        buf.truncate(at + *read.as_ref().unwrap_or(&0));
        read
    }
}

/// The socket as rustls reads and writes it: without waiting (`WouldBlock` when it would);
/// `Look::Now` reads past the runtime's readiness.
struct NoWait<'a>(&'a Io, Look);

impl Read for NoWait<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.1 {
            Look::Ready => self.0.try_read(buf),
            Look::Now => self.0.read_now(buf),
        }
    }
}

impl Write for NoWait<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The bytes in and out of one connection.
pub(super) struct Bytes {
    /// `rediss://`: the session; bytes written go through it, read bytes come out of it.
    tls: Option<Box<rustls::ClientConnection>>,
    /// Read and not yet taken as a whole reply.
    pub(super) input: Vec<u8>,
    /// Written by the caller and not yet taken by the socket (plain connections; rustls
    /// keeps its own).
    output: Vec<u8>,
    /// A task waits for the socket to take the rest.
    flushing: bool,
    /// The connection broke or was let go: nothing more is read or written.
    pub(super) dead: bool,
}

/// What [`Wire::lock`] guards: the bytes, and the batches they carry.
pub(super) struct WireState {
    pub(super) bytes: Bytes,
    pub(super) batches: Batches,
}

/// The decision connection of one link.
pub(super) struct Wire {
    io: Io,
    state: Mutex<WireState>,
    /// The runtime the socket is registered with: its reader and flusher run there.
    pub(super) runtime: Handle,
    /// That runtime is the one requests run on (the proxy's workers): a waiting decision can
    /// read the answer itself.
    pub(super) on_workers: bool,
    /// The store's thread, which watches a connection the workers read
    /// (`dedicated_io_thread` and the socket on the workers): see `batch::watch_over`.
    pub(super) watcher: Option<Handle>,
    /// The reader task is running (it starts with the first batch).
    pub(super) reading: AtomicBool,
    /// Wakes the reader task when the connection is let go.
    pub(super) closing: Notify,
    /// Wakes the watch: a batch went out while it slept, or the connection is let go.
    pub(super) watch: Notify,
}

/// The peer's end of a TCP or Unix stream, as `poll` says it (Linux's); none elsewhere.
#[cfg(any(target_os = "linux", target_os = "android"))]
const SHUT: libc::c_short = libc::POLLRDHUP;
#[cfg(not(any(target_os = "linux", target_os = "android")))]
const SHUT: libc::c_short = 0;

/// How a read looks at the socket.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Look {
    /// As the socket's runtime last saw it readable (it clears what it saw when nothing is
    /// there): the way of whoever was woken by that runtime.
    Ready,
    /// At the socket itself, whatever its runtime saw: the watch's way, from another thread.
    Now,
}

impl Wire {
    pub(super) fn lock(&self) -> MutexGuard<'_, WireState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the socket has something to read (or has ended).
    pub(super) async fn readable(&self) -> io::Result<()> {
        self.io.readable().await
    }

    /// Whether the node has closed the socket (its end read by the kernel, and no error: a
    /// reset or a keepalive gone unanswered is not a close), looked at without reading it:
    /// for a connection no reader task has read yet, from any thread. A TLS session's closing
    /// alert does not hide the end, as a read would see the alert first. Linux's `POLLRDHUP`;
    /// elsewhere never true.
    pub(super) fn peer_closed(&self) -> bool {
        let seen = self.look();
        SHUT != 0 && seen & SHUT != 0 && seen & libc::POLLERR == 0
    }

    /// Whether the socket failed (a reset, a keepalive gone unanswered), looked at as
    /// [`Wire::peer_closed`] looks.
    pub(super) fn failed(&self) -> bool {
        self.look() & libc::POLLERR != 0
    }

    /// The socket's `poll` events now, without waiting.
    fn look(&self) -> libc::c_short {
        use std::os::fd::AsRawFd;
        let fd = match &self.io {
            Io::Tcp(s) => s.as_raw_fd(),
            Io::Unix(s) => s.as_raw_fd(),
        };
        let mut look = libc::pollfd {
            fd,
            events: SHUT,
            revents: 0,
        };
        // SAFETY: one pollfd of a socket this wire owns, for the length of the call; no wait.
        match unsafe { libc::poll(&mut look, 1, 0) } {
            n if n > 0 => look.revents,
            _ => 0,
        }
    }

    /// Reads everything the socket holds into `bytes.input` (through the TLS session on a
    /// `rediss://` connection). `Ok(false)`: the node closed the connection.
    pub(super) fn receive(
        self: &std::sync::Arc<Self>,
        bytes: &mut Bytes,
        look: Look,
    ) -> io::Result<bool> {
        let Some(tls) = bytes.tls.as_deref_mut() else {
            loop {
                let read = match look {
                    Look::Ready => {
                        bytes.input.reserve(16 * 1024);
                        self.io.try_read_buf(&mut bytes.input)
                    }
                    Look::Now => self.io.read_now_buf(&mut bytes.input),
                };
                match read {
                    Ok(0) => return Ok(false),
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                    Err(e) => return Err(e),
                }
            }
        };
        loop {
            match tls.read_tls(&mut NoWait(&self.io, look)) {
                Ok(0) => return Ok(false),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
            let state = tls
                .process_new_packets()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            let plain = state.plaintext_bytes_to_read();
            if plain > 0 {
                let at = bytes.input.len();
                bytes.input.resize(at + plain, 0);
                tls.reader().read_exact(&mut bytes.input[at..])?;
            }
            if state.peer_has_closed() {
                return Ok(false);
            }
        }
        // An alert or a key update rustls wants to answer.
        if tls.wants_write() {
            let pending = self.flush_tls(tls)?;
            self.flush_later_if(bytes, pending);
        }
        Ok(true)
    }

    /// Starts the task that writes what the socket could not take, unless one runs.
    fn flush_later_if(self: &std::sync::Arc<Self>, bytes: &mut Bytes, pending: bool) {
        if pending && !bytes.flushing {
            bytes.flushing = true;
            self.runtime.spawn(flush_later(std::sync::Arc::clone(self)));
        }
    }

    /// Writes `data` (after whatever waits), as far as the socket takes it now; the rest is
    /// written by a task as soon as the socket takes more.
    pub(super) fn send(
        self: &std::sync::Arc<Self>,
        bytes: &mut Bytes,
        data: &[u8],
    ) -> io::Result<()> {
        let pending = match bytes.tls.as_deref_mut() {
            Some(tls) => {
                tls.writer().write_all(data)?;
                self.flush_tls(tls)?
            }
            None if bytes.output.is_empty() => {
                let n = write_some(&self.io, data)?;
                bytes.output.extend_from_slice(&data[n..]);
                !bytes.output.is_empty()
            }
            None => {
                bytes.output.extend_from_slice(data);
                self.flush_plain(bytes)?
            }
        };
        self.flush_later_if(bytes, pending);
        Ok(())
    }

    /// Writes the waiting plain bytes the socket takes now; true when some are left.
    fn flush_plain(&self, bytes: &mut Bytes) -> io::Result<bool> {
        let n = write_some(&self.io, &bytes.output)?;
        bytes.output.drain(..n);
        Ok(!bytes.output.is_empty())
    }

    /// Writes the TLS records the socket takes now; true when some are left.
    fn flush_tls(&self, tls: &mut rustls::ClientConnection) -> io::Result<bool> {
        while tls.wants_write() {
            match tls.write_tls(&mut NoWait(&self.io, Look::Ready)) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }
}

/// Writes as much of `data` as the socket takes without waiting.
fn write_some(io: &Io, data: &[u8]) -> io::Result<usize> {
    let mut written = 0;
    while written < data.len() {
        match io.try_write(&data[written..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

/// Writes what the socket could not take at once, as it takes it. A failure here is left
/// to the next read, which sees the same broken socket.
async fn flush_later(wire: std::sync::Arc<Wire>) {
    loop {
        let ready = wire.io.writable().await;
        let mut state = wire.lock();
        if ready.is_err() {
            state.bytes.flushing = false;
            return;
        }
        let bytes = &mut state.bytes;
        let pending = match bytes.tls.as_deref_mut() {
            _ if bytes.dead => Ok(false),
            Some(tls) => wire.flush_tls(tls),
            None => wire.flush_plain(bytes),
        };
        if !matches!(pending, Ok(true)) {
            bytes.flushing = false;
            return;
        }
    }
}

/// A reply the batches get, framed.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Resp<'a> {
    Bulk(&'a [u8]),
    /// `-CODE detail`, without the dash.
    Error(&'a [u8]),
    /// Anything else that is one line (`+OK`, `:1`, `$-1`): never a batch's answer.
    Line(&'a [u8]),
}

/// The first whole reply in `input` and the bytes it takes; `Ok(None)` while it is not all
/// in; `Err` for a reply these connections are never sent (an array), which cannot be framed
/// without a full parser and means the connection is not what it should be.
pub(super) fn next_reply(input: &[u8]) -> Result<Option<(Resp<'_>, usize)>, String> {
    let Some(end) = input.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let line = &input[..end];
    match line.first() {
        Some(b'-') => Ok(Some((Resp::Error(&line[1..]), end + 2))),
        Some(b'+' | b':') => Ok(Some((Resp::Line(line), end + 2))),
        Some(b'$') => {
            let len: i64 = std::str::from_utf8(&line[1..])
                .ok()
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| {
                    format!(
                        "a bulk reply of no length: {:?}",
                        String::from_utf8_lossy(line)
                    )
                })?;
            if len < 0 {
                return Ok(Some((Resp::Line(line), end + 2)));
            }
            let start = end + 2;
            let stop = start + len as usize;
            if input.len() < stop + 2 {
                return Ok(None);
            }
            if &input[stop..stop + 2] != b"\r\n" {
                return Err("a bulk reply that does not end where it says".into());
            }
            Ok(Some((Resp::Bulk(&input[start..stop]), stop + 2)))
        }
        _ => Err(format!(
            "an unexpected reply: {:?}",
            String::from_utf8_lossy(&line[..line.len().min(32)])
        )),
    }
}

/// Appends the RESP form of a command of `words` to `out`.
pub(super) fn encode<'a>(out: &mut Vec<u8>, words: impl ExactSizeIterator<Item = &'a [u8]>) {
    header(out, b'*', words.len() as u64);
    for w in words {
        bulk(out, w);
    }
}

/// `*n` or `$n` and its line end.
pub(super) fn header(out: &mut Vec<u8>, kind: u8, n: u64) {
    out.push(kind);
    decimal(out, n);
    out.extend_from_slice(b"\r\n");
}

/// One argument.
pub(super) fn bulk(out: &mut Vec<u8>, word: &[u8]) {
    header(out, b'$', word.len() as u64);
    out.extend_from_slice(word);
    out.extend_from_slice(b"\r\n");
}

/// One integer argument, written without a formatter.
pub(super) fn bulk_u64(out: &mut Vec<u8>, n: u64) {
    let mut buf = [0u8; 20];
    bulk(out, digits(n, &mut buf));
}

fn decimal(out: &mut Vec<u8>, n: u64) {
    let mut buf = [0u8; 20];
    out.extend_from_slice(digits(n, &mut buf));
}

/// `n`'s decimal digits, written at the end of `buf`.
fn digits(n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    let mut v = n;
    loop {
        at -= 1;
        buf[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &buf[at..];
        }
    }
}

/// How long the handshake may take, within the connector's own bound.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Opens the decision connection to the node of `dial`, on the current runtime: the socket
/// (TLS for `rediss://`), then `AUTH` with `[redis]`'s credentials and `SELECT` of the URL's
/// database, as redis-rs's own connection does, and a `PING`. Bounded at 1 s. `watcher`: the
/// store's thread, to watch a connection opened on the workers.
pub(super) async fn open(
    dial: &Dial,
    on_workers: bool,
    watcher: Option<Handle>,
) -> io::Result<Wire> {
    let settings = dial.info.redis_settings();
    let mut hello = Vec::new();
    let mut replies = 0;
    if let Some(password) = settings.password() {
        let mut words: Vec<&[u8]> = vec![b"AUTH"];
        if let Some(user) = settings.username() {
            words.push(user.as_bytes());
        }
        words.push(password.as_bytes());
        encode(&mut hello, words.into_iter());
        replies += 1;
    }
    if settings.db() != 0 {
        let db = settings.db().to_string();
        encode(&mut hello, [&b"SELECT"[..], db.as_bytes()].into_iter());
        replies += 1;
    }
    // Last, always: a node that accepted the socket only to refuse the client (`maxclients`)
    // says so here, not as the first batch's answer.
    encode(&mut hello, [&b"PING"[..]].into_iter());
    replies += 1;
    let setup = async {
        let (io, tls, input) = match socket(dial).await? {
            Socket::Tcp(mut s) => {
                let input = handshake(&mut s, &hello, replies).await?;
                (Io::Tcp(s), None, input)
            }
            Socket::Tls(mut s) => {
                let input = handshake(&mut *s, &hello, replies).await?;
                let (tcp, mut session) = s.into_inner();
                // What waits to be written is bounded by the batches themselves (one call in
                // flight, and a script load behind a NOSCRIPT): rustls's own bound would turn a
                // congested socket into a failed write.
                session.set_buffer_limit(None);
                (Io::Tcp(tcp), Some(Box::new(session)), input)
            }
            Socket::Unix(mut s) => {
                let input = handshake(&mut s, &hello, replies).await?;
                (Io::Unix(s), None, input)
            }
        };
        Ok::<_, io::Error>(Wire {
            io,
            state: Mutex::new(WireState {
                bytes: Bytes {
                    tls,
                    input,
                    output: Vec::new(),
                    flushing: false,
                    dead: false,
                },
                batches: Batches::default(),
            }),
            runtime: Handle::current(),
            on_workers,
            watcher: watcher.filter(|_| on_workers),
            reading: AtomicBool::new(false),
            closing: Notify::new(),
            watch: Notify::new(),
        })
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, setup)
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                "redis did not answer the decision connection's handshake within 1 s",
            )
        })?
}

/// Sends `hello` and reads its `replies`; returns what came after them (nothing, normally).
/// An error reply fails the connection, in Redis's words (never the credentials').
async fn handshake<S>(s: &mut S, hello: &[u8], replies: usize) -> io::Result<Vec<u8>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut input = Vec::new();
    s.write_all(hello).await?;
    s.flush().await?;
    let mut read = 0;
    while read < replies {
        match next_reply(&input).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))? {
            Some((Resp::Error(e), _)) => {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "redis refused the decision connection's handshake: {}",
                        String::from_utf8_lossy(e)
                    ),
                ))
            }
            Some((_, used)) => {
                input.drain(..used);
                read += 1;
            }
            None => {
                let mut chunk = [0u8; 512];
                let n = s.read(&mut chunk).await?;
                if n == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                input.extend_from_slice(&chunk[..n]);
            }
        }
    }
    Ok(input)
}

impl Wire {
    /// Marks the connection let go; the reader task ends. What it still carried is the
    /// batches' to answer (`Batches::let_go`).
    pub(super) fn close(&self) -> Batches {
        let mut state = self.lock();
        state.bytes.dead = true;
        let batches = std::mem::take(&mut state.batches);
        drop(state);
        self.closing.notify_one();
        self.watch.notify_one();
        batches
    }

    /// Whether the reader task is to be started (the first caller only).
    pub(super) fn start_reading(&self) -> bool {
        !self.reading.load(Ordering::Relaxed) && !self.reading.swap(true, Ordering::AcqRel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_framed_whole_or_not_at_all() {
        assert_eq!(
            next_reply(b"$5\r\nhello\r\n+OK"),
            Ok(Some((Resp::Bulk(b"hello"), 11)))
        );
        assert_eq!(
            next_reply(b"$5\r\nhel"),
            Ok(None),
            "a bulk reply cut short waits"
        );
        assert_eq!(next_reply(b"$5\r\nhello\r"), Ok(None));
        assert_eq!(next_reply(b"$0\r\n\r\n"), Ok(Some((Resp::Bulk(b""), 6))));
        assert_eq!(
            next_reply(b"-NOSCRIPT No matching script.\r\n"),
            Ok(Some((Resp::Error(b"NOSCRIPT No matching script."), 31)))
        );
        assert_eq!(next_reply(b"+OK\r\n"), Ok(Some((Resp::Line(b"+OK"), 5))));
        assert_eq!(next_reply(b"$-1\r\n"), Ok(Some((Resp::Line(b"$-1"), 5))));
        assert_eq!(next_reply(b"-ERR"), Ok(None));
        assert!(
            next_reply(b"*2\r\n").is_err(),
            "an array is never a batch's answer"
        );
        assert!(next_reply(b"$x\r\n").is_err());
        assert!(
            next_reply(b"$2\r\nabcd\r\n").is_err(),
            "a bulk reply longer than it says"
        );
    }

    #[test]
    fn a_command_is_written_as_resp() {
        let mut out = Vec::new();
        encode(&mut out, [&b"AUTH"[..], b"user", b"p\r\nw"].into_iter());
        assert_eq!(out, b"*3\r\n$4\r\nAUTH\r\n$4\r\nuser\r\n$4\r\np\r\nw\r\n");
        let mut out = Vec::new();
        for n in [0, 7, 10, 1_000_000_000_000_000, u64::MAX] {
            out.clear();
            bulk_u64(&mut out, n);
            let text = n.to_string();
            assert_eq!(out, format!("${}\r\n{text}\r\n", text.len()).into_bytes());
        }
    }
}
