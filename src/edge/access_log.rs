//! The access log writer: one JSON line per request, written on a thread of its own so a slow
//! disk never slows a request. A request appends its [`Line`] to one shared buffer, under a
//! short lock, in a compact binary form (its numbers and the bytes of its strings); the
//! writer swaps the buffer for its spare one every `WRITE_EVERY`, turns each record into
//! JSON and writes the whole batch. Nothing is allocated or sent per line, the JSON is made
//! in one tight loop on the writer's thread (where the serializer's code stays in cache)
//! rather than once per request among the proxy's own work, and the writer is woken only by
//! the first line after it went idle. When the buffer holds [`QUEUE_BYTES`], a line is
//! dropped and counted (`sentinel_access_log_dropped_total`) instead of waiting. `SIGUSR1`
//! and every reload reopen the file (log rotation): lines buffered meanwhile go to the new
//! file.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use crate::config::AccessLogTarget;

/// What the shared buffer holds at most before lines are dropped: about 40 000 lines.
pub const QUEUE_BYTES: usize = 8 * 1024 * 1024;

/// One access log line; its keys in the order the contract lists them. Built by the request
/// from what it holds (borrowed).
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Line<'a> {
    pub timestamp: Timestamp,
    pub request_id: Option<&'a str>,
    pub client_ip: Option<IpAddr>,
    /// `None` for a request head that could not be parsed.
    pub method: Option<&'a str>,
    pub host: Option<Lossy<'a>>,
    pub path: Option<&'a str>,
    pub protocol: &'a str,
    pub tls: bool,
    pub status: u16,
    /// A gRPC call's status: the gateway's own answer's, or the one the upstream's head or
    /// trailers carried; `None` for other requests (and a call whose upstream said none).
    pub grpc_status: Option<u8>,
    pub endpoint_id: Option<&'a str>,
    pub decision_reason: Option<&'a str>,
    pub allowed: Option<bool>,
    pub tier: Option<&'a str>,
    pub limit: Option<&'a str>,
    pub upstream: Option<&'a str>,
    pub upstream_addr: Option<SocketAddr>,
    pub duration_ms: f64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub identity_hash: Option<&'a str>,
    pub user_agent: Option<Lossy<'a>>,
    /// What ended the request otherwise than with a whole answer (`upstream_timeout`,
    /// `upstream_failed`, `client_closed`, `client_timeout`, `client_error`,
    /// `request_too_large`, `internal`); `None` when nothing did.
    pub error: Option<&'a str>,
}

/// Header bytes as the client sent them, written as UTF-8 (invalid sequences replaced).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lossy<'a>(pub &'a [u8]);

impl Serialize for Lossy<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&String::from_utf8_lossy(self.0))
    }
}

/// When the request started, in milliseconds since the Unix epoch; written as RFC 3339 in UTC
/// with milliseconds (`2026-12-01T17:30:05.042Z`). The date and time of day are formatted
/// once a second (per thread); each line adds its milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timestamp(pub u64);

impl Timestamp {
    pub fn of(at: SystemTime) -> Self {
        let since = at
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        Self(since.as_millis() as u64)
    }
}

thread_local! {
    /// The second last formatted on this thread, and its `YYYY-MM-DDTHH:MM:SS.`.
    static SECOND: std::cell::RefCell<(u64, String)> = const { std::cell::RefCell::new((u64::MAX, String::new())) };
}

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let (secs, millis) = (self.0 / 1000, self.0 % 1000);
        SECOND.with_borrow_mut(|(second, prefix)| {
            if *second != secs {
                let at = chrono::DateTime::<chrono::Utc>::from(
                    SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
                );
                *prefix = at.format("%Y-%m-%dT%H:%M:%S.").to_string();
                *second = secs;
            }
            let mut text = [0u8; 32];
            let n = prefix.len().min(27);
            text[..n].copy_from_slice(&prefix.as_bytes()[..n]);
            text[n] = b'0' + (millis / 100) as u8;
            text[n + 1] = b'0' + (millis / 10 % 10) as u8;
            text[n + 2] = b'0' + (millis % 10) as u8;
            text[n + 3] = b'Z';
            s.serialize_str(std::str::from_utf8(&text[..n + 4]).unwrap_or_default())
        })
    }
}

/// A string field absent (`None`) in the record form.
const ABSENT: u16 = u16::MAX;
/// The longest string a record keeps (a longer one is cut at a character boundary).
const LONGEST: usize = ABSENT as usize - 1;

impl Line<'_> {
    /// Appends this line's record to `out`: its length (u32), then its fields.
    fn encode(&self, out: &mut Vec<u8>) {
        let at = out.len();
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.timestamp.0.to_le_bytes());
        out.extend_from_slice(&self.status.to_le_bytes());
        let flags = u8::from(self.tls)
            | (u8::from(self.allowed.is_some()) << 1)
            | (u8::from(self.allowed == Some(true)) << 2);
        out.push(flags);
        // gRPC's codes end at 16: 255 says none.
        out.push(self.grpc_status.unwrap_or(u8::MAX));
        out.extend_from_slice(&self.duration_ms.to_le_bytes());
        out.extend_from_slice(&self.bytes_received.to_le_bytes());
        out.extend_from_slice(&self.bytes_sent.to_le_bytes());
        put_ip(out, self.client_ip);
        put_ip(out, self.upstream_addr.map(|a| a.ip()));
        out.extend_from_slice(&self.upstream_addr.map_or(0, |a| a.port()).to_le_bytes());
        for field in [
            self.request_id.map(str::as_bytes),
            self.method.map(str::as_bytes),
            self.host.map(|h| h.0),
            self.path.map(str::as_bytes),
            Some(self.protocol.as_bytes()),
            self.endpoint_id.map(str::as_bytes),
            self.decision_reason.map(str::as_bytes),
            self.tier.map(str::as_bytes),
            self.limit.map(str::as_bytes),
            self.upstream.map(str::as_bytes),
            self.identity_hash.map(str::as_bytes),
            self.user_agent.map(|u| u.0),
            self.error.map(str::as_bytes),
        ] {
            match field {
                None => out.extend_from_slice(&ABSENT.to_le_bytes()),
                Some(bytes) => {
                    let bytes = &bytes[..cut(bytes)];
                    out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
                    out.extend_from_slice(bytes);
                }
            }
        }
        let len = (out.len() - at - 4) as u32;
        out[at..at + 4].copy_from_slice(&len.to_le_bytes());
    }

    /// The first record of `bytes` and what follows it; `None` at the end (or on a record
    /// this module did not write).
    fn decode(bytes: &[u8]) -> Option<(Line<'_>, &[u8])> {
        let len = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
        let (record, rest) = bytes.get(4..)?.split_at_checked(len)?;
        let mut r = Reader(record);
        let timestamp = Timestamp(u64::from_le_bytes(r.array()?));
        let status = u16::from_le_bytes(r.array()?);
        let [flags] = r.array()?;
        let [grpc_status] = r.array()?;
        let duration_ms = f64::from_le_bytes(r.array()?);
        let bytes_received = u64::from_le_bytes(r.array()?);
        let bytes_sent = u64::from_le_bytes(r.array()?);
        let client_ip = r.ip()?;
        let upstream_ip = r.ip()?;
        let upstream_port = u16::from_le_bytes(r.array()?);
        let mut text = || {
            r.string()
                .map(|b| b.and_then(|b| std::str::from_utf8(b).ok()))
        };
        let request_id = text()?;
        let method = text()?;
        let host = text_bytes(&mut r)?;
        let mut text = || {
            r.string()
                .map(|b| b.and_then(|b| std::str::from_utf8(b).ok()))
        };
        let path = text()?;
        let protocol = text()?.unwrap_or_default();
        let endpoint_id = text()?;
        let decision_reason = text()?;
        let tier = text()?;
        let limit = text()?;
        let upstream = text()?;
        let identity_hash = text()?;
        let user_agent = text_bytes(&mut r)?;
        let error = r.string()?.and_then(|b| std::str::from_utf8(b).ok());
        let line = Line {
            timestamp,
            request_id,
            client_ip,
            method,
            host,
            path,
            protocol,
            tls: flags & 1 != 0,
            status,
            grpc_status: (grpc_status != u8::MAX).then_some(grpc_status),
            endpoint_id,
            decision_reason,
            allowed: (flags & 2 != 0).then_some(flags & 4 != 0),
            tier,
            limit,
            upstream,
            upstream_addr: upstream_ip.map(|ip| SocketAddr::new(ip, upstream_port)),
            duration_ms,
            bytes_received,
            bytes_sent,
            identity_hash,
            user_agent,
            error,
        };
        Some((line, rest))
    }
}

/// A raw-bytes field (a header as the client sent it).
fn text_bytes<'a>(r: &mut Reader<'a>) -> Option<Option<Lossy<'a>>> {
    r.string().map(|b| b.map(Lossy))
}

/// How much of `bytes` a record keeps: all of it, or at most [`LONGEST`] bytes ending at a
/// character boundary.
fn cut(bytes: &[u8]) -> usize {
    if bytes.len() <= LONGEST {
        return bytes.len();
    }
    let mut end = LONGEST;
    while end > 0 && (bytes[end] & 0xC0) == 0x80 {
        end -= 1;
    }
    end
}

fn put_ip(out: &mut Vec<u8>, ip: Option<IpAddr>) {
    match ip {
        None => out.push(0),
        Some(IpAddr::V4(v4)) => {
            out.push(4);
            out.extend_from_slice(&v4.octets());
        }
        Some(IpAddr::V6(v6)) => {
            out.push(6);
            out.extend_from_slice(&v6.octets());
        }
    }
}

/// Reads a record's fields in order.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    fn ip(&mut self) -> Option<Option<IpAddr>> {
        match self.array::<1>()?[0] {
            0 => Some(None),
            4 => Some(Some(Ipv4Addr::from(self.array::<4>()?).into())),
            6 => Some(Some(Ipv6Addr::from(self.array::<16>()?).into())),
            _ => None,
        }
    }

    /// A string field: `Some(None)` when absent.
    fn string(&mut self) -> Option<Option<&'a [u8]>> {
        let len = u16::from_le_bytes(self.array()?);
        if len == ABSENT {
            return Some(None);
        }
        self.take(len as usize).map(Some)
    }
}

/// A target opened by [`AccessLog::open`], not yet in use.
pub struct Opened(Option<Sink>);

/// Where the writer writes: stdout, or an open file.
enum Sink {
    Stdout,
    File(BufWriter<File>),
}

impl Sink {
    /// `wait_for_reader`: a FIFO with no reader is waited for (the start, as nginx's open
    /// waits) rather than refused (a reload or `SIGUSR1`, whose thread must not stop).
    fn open(target: &AccessLogTarget, wait_for_reader: bool) -> io::Result<Sink> {
        match target {
            AccessLogTarget::Stdout => Ok(Sink::Stdout),
            AccessLogTarget::File(path) => Ok(Sink::File(BufWriter::with_capacity(
                64 * 1024,
                open_append(path, wait_for_reader)
                    .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?,
            ))),
        }
    }

    /// Whole lines, each ending in a newline.
    fn write_lines(&mut self, lines: &[u8]) -> io::Result<()> {
        match self {
            // Through the log lines' own queue: stdout is written by one queue, so lines
            // never cut one another, and a stdout that does not drain is never waited for.
            Sink::Stdout => match crate::stdout_log::stdout().write(lines.to_vec()) {
                true => Ok(()),
                false => Err(io::Error::other(
                    "stdout is not taking lines: more than 8 MiB wait for it",
                )),
            },
            Sink::File(w) => w.write_all(lines),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Sink::Stdout => Ok(()),
            Sink::File(w) => w.flush(),
        }
    }
}

fn open_append(path: &Path, wait_for_reader: bool) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.create(true).append(true);
    if wait_for_reader {
        return options.open(path);
    }
    // Opened without waiting: a FIFO no process reads is refused at once (`ENXIO`) instead of
    // holding the thread that opens it (a `SIGUSR1` held the admin listener and the signals
    // with it). Writes then wait as before: the writer's thread is its own.
    crate::config::open_without_waiting(&mut options, path).map_err(|e| match e.raw_os_error() {
        Some(libc::ENXIO) => io::Error::new(
            e.kind(),
            "a FIFO no process reads: start its reader, then reopen",
        ),
        _ => e,
    })
}

/// The process's access log. Lines are only built while the live config has an
/// `[access_log]`; the writer follows the config's target.
pub struct AccessLog {
    shared: Arc<Shared>,
    dropped: prometheus::IntCounter,
}

/// What the requests and the writer share.
struct Shared {
    /// Records of lines waiting for the writer.
    records: Mutex<Vec<u8>>,
    /// The writer waits here when there was nothing to write.
    wake: Condvar,
    /// Set by the writer just before it waits: the next line wakes it.
    idle: AtomicBool,
    /// A sink opened by a reload or `SIGUSR1` (`Some(None)`: the log was turned off), for the
    /// writer to take before its next batch.
    next: Mutex<Option<Option<Sink>>>,
    /// The writer holds a batch it has not written yet (set and read under `records`'s lock).
    writing: AtomicBool,
}

impl AccessLog {
    /// Starts the writer thread; `target` is opened now, so a path that cannot be written is
    /// an error at start.
    pub fn start(
        target: Option<&AccessLogTarget>,
        dropped: prometheus::IntCounter,
    ) -> io::Result<AccessLog> {
        let shared = Arc::new(Shared {
            records: Mutex::new(Vec::with_capacity(64 * 1024)),
            wake: Condvar::new(),
            idle: AtomicBool::new(false),
            next: Mutex::new(None),
            writing: AtomicBool::new(false),
        });
        let sink = target.map(|t| Sink::open(t, true)).transpose()?;
        let writer = Arc::clone(&shared);
        let writer_dropped = dropped.clone();
        std::thread::Builder::new()
            .name("sentinel-access".into())
            .spawn(move || write_batches(&writer, sink, &writer_dropped))?;
        Ok(AccessLog { shared, dropped })
    }

    /// Hands one line to the writer; never waits for it.
    pub fn log(&self, line: &Line<'_>) {
        let mut records = self
            .shared
            .records
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let before = records.len();
        line.encode(&mut records);
        if records.len() > QUEUE_BYTES {
            records.truncate(before);
            drop(records);
            self.dropped.inc();
            return;
        }
        drop(records);
        if self.shared.idle.load(Ordering::Relaxed)
            && self.shared.idle.swap(false, Ordering::AcqRel)
        {
            // Taken after the writer's wait released it: the writer is waiting by now, not
            // about to.
            let _held = self.shared.records.lock();
            self.shared.wake.notify_one();
        }
    }

    /// Waits, up to `within`, until every line handed over so far is written: the process is
    /// about to exit (the drain's end), and lines still queued would be lost with it.
    pub fn flush(&self, within: Duration) {
        let deadline = std::time::Instant::now() + within;
        loop {
            {
                let records = self
                    .shared
                    .records
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                if records.is_empty() && !self.shared.writing.load(Ordering::Acquire) {
                    return;
                }
                self.shared.wake.notify_one();
            }
            if std::time::Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Opens `target` again (a reload, or `SIGUSR1` after the file was rotated); the old
    /// file keeps being written until this succeeds. `None`: the log is off.
    pub fn reopen(&self, target: Option<&AccessLogTarget>) -> io::Result<()> {
        let opened = Self::open(target)?;
        self.install(opened);
        Ok(())
    }

    /// Opens `target` without using it yet: a reload opens first (a path that cannot be
    /// opened fails it) and installs only once nothing else can fail.
    pub fn open(target: Option<&AccessLogTarget>) -> io::Result<Opened> {
        Ok(Opened(target.map(|t| Sink::open(t, false)).transpose()?))
    }

    /// The writer takes `opened` before its next batch.
    pub fn install(&self, opened: Opened) {
        *self.shared.next.lock().unwrap_or_else(|p| p.into_inner()) = Some(opened.0);
    }
}

/// How long the writer rests between batches while lines come: a batch per rest instead of
/// a wake-up per line (a worker waking the writer is a system call and a context switch;
/// measured per line, that cost about a fifth of the plain proxy's throughput on two cores).
/// Lines reach the file within this long.
const WRITE_EVERY: Duration = Duration::from_millis(20);

/// How long the file of a log a reload turned off is still written after its last line: the
/// lines of requests that began under the old config and end after the reload.
const RETIRE_AFTER: Duration = Duration::from_secs(1);

/// The JSON lines of `records`, each ending in a newline, appended to `out`; how many.
fn to_json(mut records: &[u8], out: &mut Vec<u8>) -> u64 {
    let mut lines = 0;
    while let Some((line, rest)) = Line::decode(records) {
        if serde_json::to_writer(&mut *out, &line).is_ok() {
            out.push(b'\n');
            lines += 1;
        }
        records = rest;
    }
    lines
}

/// The writer: takes what the requests appended, in batches every `WRITE_EVERY`, writes
/// them as JSON lines (and flushes); after a quiet pass it waits for the next line.
fn write_batches(shared: &Shared, mut sink: Option<Sink>, dropped: &prometheus::IntCounter) {
    let mut batch: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut json: Vec<u8> = Vec::with_capacity(128 * 1024);
    let mut failing = false;
    // The log was turned off at this moment, the old file still written (see below).
    let mut retiring: Option<Instant> = None;
    loop {
        {
            let mut records = shared.records.lock().unwrap_or_else(|p| p.into_inner());
            if records.is_empty() {
                shared.idle.store(true, Ordering::Release);
                // The timeout lets a reopen be taken while no request comes.
                records = shared
                    .wake
                    .wait_timeout(records, Duration::from_millis(250))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                shared.idle.store(false, Ordering::Release);
            }
            shared.writing.store(!records.is_empty(), Ordering::Release);
            std::mem::swap(&mut *records, &mut batch);
        }
        if let Some(new) = shared.next.lock().unwrap_or_else(|p| p.into_inner()).take() {
            match new {
                // Turned off: requests that began under the old config still end, and log;
                // their lines go where they were going until a quiet second has passed.
                None if sink.is_some() => retiring = Some(Instant::now()),
                new => {
                    if let Some(old) = sink.as_mut() {
                        let _ = old.flush();
                    }
                    sink = new;
                    retiring = None;
                }
            }
            failing = false;
        }
        if let Some(since) = retiring {
            if !batch.is_empty() {
                retiring = Some(Instant::now());
            } else if since.elapsed() >= RETIRE_AFTER {
                if let Some(old) = sink.as_mut() {
                    let _ = old.flush();
                }
                sink = None;
                retiring = None;
            }
        }
        if batch.is_empty() {
            continue;
        }
        let lines = to_json(&batch, &mut json);
        match sink.as_mut() {
            // A line of the old config's request that ended after the turned-off log's file
            // was let go (a quiet second after the reload): not written, counted.
            None => dropped.inc_by(lines),
            Some(out) => match out.write_lines(&json).and_then(|()| out.flush()) {
                Ok(()) => failing = false,
                Err(e) => {
                    dropped.inc_by(lines);
                    if !failing {
                        tracing::error!(error = %e, "cannot write the access log; lines are dropped and counted until it can");
                        failing = true;
                    }
                }
            },
        }
        batch.clear();
        shared.writing.store(false, Ordering::Release);
        json.clear();
        // A burst's worth of memory is not kept for good.
        batch.shrink_to(1024 * 1024);
        json.shrink_to(2 * 1024 * 1024);
        std::thread::sleep(WRITE_EVERY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line with every field present; `n` as its status.
    fn full(n: u16) -> Line<'static> {
        Line {
            timestamp: Timestamp(1_796_146_205_042),
            request_id: Some("4bf92f3577b34da6a3ce929d0e0e4736"),
            client_ip: Some("2001:db8::7".parse().unwrap()),
            method: Some("POST"),
            host: Some(Lossy(b"api.pdftalk.example")),
            path: Some("/pdftalk/ingest/doc"),
            protocol: "HTTP/2",
            tls: true,
            status: n,
            grpc_status: Some(8),
            endpoint_id: Some("pdftalk.ingest"),
            decision_reason: Some("allowed"),
            allowed: Some(true),
            tier: Some("pro"),
            limit: Some("per_minute"),
            upstream: Some("pdftalk"),
            upstream_addr: Some("127.0.0.1:9001".parse().unwrap()),
            duration_ms: 1.25,
            bytes_received: 5120,
            bytes_sent: 312,
            identity_hash: Some("9f86d081884c7d65"),
            user_agent: Some(Lossy(b"curl/8.5.0")),
            error: Some("upstream_timeout"),
        }
    }

    /// A line with every optional field absent.
    fn bare(n: u16) -> Line<'static> {
        Line {
            timestamp: Timestamp(0),
            request_id: None,
            client_ip: None,
            method: Some("GET"),
            host: None,
            path: None,
            protocol: "HTTP/1.1",
            tls: false,
            status: n,
            grpc_status: None,
            endpoint_id: None,
            decision_reason: None,
            allowed: None,
            tier: None,
            limit: None,
            upstream: None,
            upstream_addr: None,
            duration_ms: 0.0,
            bytes_received: 0,
            bytes_sent: 0,
            identity_hash: None,
            user_agent: None,
            error: None,
        }
    }

    #[test]
    fn a_record_reads_back_as_the_line_it_was() {
        let mut denied = full(429);
        denied.allowed = Some(false);
        denied.client_ip = Some("10.0.0.7".parse().unwrap());
        denied.upstream_addr = Some("[::1]:8443".parse().unwrap());
        let lines = [full(200), bare(404), denied];
        let mut records = Vec::new();
        for l in &lines {
            l.encode(&mut records);
        }
        let mut rest = records.as_slice();
        for want in &lines {
            let (got, after) = Line::decode(rest).expect("a record");
            assert_eq!(&got, want);
            rest = after;
        }
        assert!(rest.is_empty() && Line::decode(rest).is_none());
        // A cut record is not read.
        assert!(Line::decode(&records[..records.len() / 2]).is_some());
        assert!(Line::decode(&records[..10]).is_none());
    }

    #[test]
    fn the_json_has_the_contracts_keys_in_order_and_header_bytes_as_utf8() {
        let mut line = full(200);
        line.user_agent = Some(Lossy(b"bad \xff agent \"quoted\""));
        let long = "é".repeat(40_000);
        line.path = Some(&long);
        let mut records = Vec::new();
        line.encode(&mut records);
        let mut json = Vec::new();
        assert_eq!(to_json(&records, &mut json), 1);
        let text = String::from_utf8(json).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        // In the text's order (a `Value`'s map is sorted).
        let mut keys: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_by_key(|k| text.find(&format!("\"{k}\":")).unwrap());
        assert_eq!(
            keys,
            [
                "timestamp",
                "request_id",
                "client_ip",
                "method",
                "host",
                "path",
                "protocol",
                "tls",
                "status",
                "grpc_status",
                "endpoint_id",
                "decision_reason",
                "allowed",
                "tier",
                "limit",
                "upstream",
                "upstream_addr",
                "duration_ms",
                "bytes_received",
                "bytes_sent",
                "identity_hash",
                "user_agent",
                "error"
            ]
        );
        assert_eq!(value["timestamp"], "2026-12-01T17:30:05.042Z");
        assert_eq!(value["client_ip"], "2001:db8::7");
        assert_eq!(value["upstream_addr"], "127.0.0.1:9001");
        assert_eq!(value["user_agent"], "bad \u{fffd} agent \"quoted\"");
        // Cut at a character boundary below 64 KiB.
        let path = value["path"].as_str().unwrap();
        assert!(
            path.len() <= LONGEST && path.chars().all(|c| c == 'é'),
            "{}",
            path.len()
        );
        assert!(text.ends_with("}\n"));
    }

    fn wait_for(path: &Path, lines: usize) -> String {
        for _ in 0..200 {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if text.lines().count() >= lines {
                return text;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        std::fs::read_to_string(path).unwrap_or_default()
    }

    #[test]
    fn lines_reach_the_file_and_a_reopen_follows_a_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.log");
        let target = AccessLogTarget::File(path.clone());
        let dropped = prometheus::IntCounter::new("d", "d").unwrap();
        let log = AccessLog::start(Some(&target), dropped.clone()).unwrap();
        log.log(&bare(1));
        log.log(&bare(2));
        let text = wait_for(&path, 2);
        let statuses: Vec<u64> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["status"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(statuses, [1, 2]);
        let rotated = dir.path().join("access.log.1");
        std::fs::rename(&path, &rotated).unwrap();
        log.reopen(Some(&target)).unwrap();
        log.log(&bare(3));
        assert!(
            wait_for(&path, 1).contains("\"status\":3"),
            "the new file gets new lines"
        );
        assert_eq!(
            std::fs::read_to_string(&rotated).unwrap().lines().count(),
            2
        );
        assert_eq!(dropped.get(), 0);
    }

    /// A disk that stops taking writes (a pipe nobody reads): requests keep handing lines over
    /// without waiting, and what does not fit is dropped and counted.
    #[test]
    fn a_writer_that_cannot_write_never_makes_a_request_wait() {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stuck.log");
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo reads the NUL-terminated path only.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        // A reader that never reads, so the writer's open succeeds and its writes then block.
        let _reader = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .unwrap();
        let dropped = prometheus::IntCounter::new("d", "d").unwrap();
        let log = AccessLog::start(Some(&AccessLogTarget::File(path)), dropped.clone()).unwrap();
        let path = "x".repeat(200);
        let mut line = bare(200);
        line.path = Some(&path);
        let started = std::time::Instant::now();
        // Four queues' worth: the writer may hold one queue's lines it took before its write
        // blocked, beside a full queue, so at least half are dropped however the threads
        // interleave (with two queues' worth, a writer that took the queue early left room
        // for nearly all of them on a busy machine).
        let lines = 4 * QUEUE_BYTES / 250;
        for _ in 0..lines {
            log.log(&line);
        }
        // Generous for a loaded machine: the lines cost about a microsecond each.
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        assert!(
            dropped.get() as usize >= lines / 3,
            "{} of {lines} dropped",
            dropped.get()
        );
    }

    #[test]
    fn a_path_that_cannot_be_opened_is_an_error() {
        let target = AccessLogTarget::File("/nonexistent-dir/access.log".into());
        let dropped = prometheus::IntCounter::new("d", "d").unwrap();
        assert!(AccessLog::start(Some(&target), dropped).is_err());
    }

    #[test]
    fn timestamps_are_rfc3339_utc_with_milliseconds_across_seconds() {
        let at = |ms: u64| serde_json::to_string(&Timestamp(ms)).unwrap();
        assert_eq!(at(1_796_146_205_042), "\"2026-12-01T17:30:05.042Z\"");
        assert_eq!(at(1_796_146_205_999), "\"2026-12-01T17:30:05.999Z\"");
        assert_eq!(at(1_796_146_206_000), "\"2026-12-01T17:30:06.000Z\"");
        assert_eq!(at(0), "\"1970-01-01T00:00:00.000Z\"");
        let now = SystemTime::now();
        let chrono_said = chrono::DateTime::<chrono::Utc>::from(now)
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        assert_eq!(
            serde_json::to_string(&Timestamp::of(now)).unwrap(),
            format!("\"{chrono_said}\"")
        );
    }
}
