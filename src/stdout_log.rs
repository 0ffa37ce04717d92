//! Stdout for the log lines: written at once by the thread that logs while stdout takes them,
//! so a line is out before the event that logged it goes on (an answer, an exit); handed to a
//! thread of its own when stdout would block (a pipe whose reader stopped, a stalled log
//! collector), so no worker ever waits for it. Lines wait there in order, up to
//! [`BYTES_WAITING`]; past that they are dropped and counted. The access log, when it writes
//! to stdout (`path = "-"`), hands its lines here too: every write to stdout goes through one
//! queue, so no line is ever cut by another.
//!
//! Kept here rather than taken from `tracing-appender`, whose non-blocking writer hands every
//! line to its thread: a line then reaches stdout some time after the event, which a reader of
//! the log (a test, an operator's `grep` right after a request) sees as a line missing.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

/// What may wait for stdout (about 20 000 log lines); what comes past it is dropped.
pub const BYTES_WAITING: usize = 8 << 20;

/// A line longer than this may not fit the room a writable pipe has (one page): it always
/// goes through the thread, which may wait.
const AT_ONCE_MAX: usize = 4096;

#[derive(Default)]
struct Waiting {
    lines: VecDeque<Vec<u8>>,
    /// The bytes of `lines`.
    bytes: usize,
    /// The thread has a line out (written outside the lock): a line written at once now
    /// would pass it.
    writing: bool,
}

#[derive(Default)]
pub struct Stdout {
    waiting: Mutex<Waiting>,
    more: Condvar,
    /// The thread's queue is empty and it is not writing.
    emptied: Condvar,
    dropped: AtomicU64,
    /// Of `dropped`, those already counted in the metric.
    counted: AtomicU64,
}

static STDOUT: OnceLock<Stdout> = OnceLock::new();

/// The process's stdout for log lines (its thread started on first use).
pub fn stdout() -> &'static Stdout {
    static THREAD: Once = Once::new();
    let out = STDOUT.get_or_init(Stdout::default);
    THREAD.call_once(|| {
        std::thread::Builder::new()
            .name("sentinel-log".into())
            .spawn(|| out.write_waiting())
            .expect("a thread for the log");
    });
    out
}

impl Stdout {
    fn lock(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One whole log line: written now if stdout takes it without waiting, else queued; past
    /// [`BYTES_WAITING`], dropped and counted.
    pub fn line(&self, line: Vec<u8>) {
        if !self.write(line) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whole lines, as [`Self::line`]; false when they were dropped (the caller counts them).
    pub fn write(&self, lines: Vec<u8>) -> bool {
        let mut waiting = self.lock();
        if waiting.lines.is_empty()
            && !waiting.writing
            && lines.len() <= AT_ONCE_MAX
            && writable_now()
        {
            // Under the lock: lines keep their order.
            write_out(&lines);
            return true;
        }
        if waiting.bytes + lines.len() > BYTES_WAITING {
            return false;
        }
        waiting.bytes += lines.len();
        waiting.lines.push_back(lines);
        self.more.notify_one();
        true
    }

    /// Lines dropped since the last call (the metric adds them): two scrapes at once never
    /// count a line twice.
    pub fn newly_dropped(&self) -> u64 {
        let dropped = self.dropped.load(Ordering::Relaxed);
        dropped.saturating_sub(self.counted.fetch_max(dropped, Ordering::Relaxed))
    }

    /// Waits until the lines queued are written, at most `within`.
    pub fn flush(&self, within: Duration) {
        let deadline = Instant::now() + within;
        let mut waiting = self.lock();
        while !waiting.lines.is_empty() || waiting.writing {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            waiting = (self.emptied.wait_timeout(waiting, left))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// The thread: writes the queued lines in order, waiting for stdout as long as it takes.
    fn write_waiting(&self) {
        let mut waiting = self.lock();
        loop {
            let Some(line) = waiting.lines.pop_front() else {
                waiting.writing = false;
                self.emptied.notify_all();
                waiting = self.more.wait(waiting).unwrap_or_else(|p| p.into_inner());
                continue;
            };
            waiting.bytes -= line.len();
            waiting.writing = true;
            drop(waiting);
            write_out(&line);
            waiting = self.lock();
        }
    }
}

/// Writes `line` to file descriptor 1 itself, not through Rust's `stdout()`: its buffer and
/// lock are not wanted here, where one queue already orders every write.
fn write_out(mut line: &[u8]) {
    while !line.is_empty() {
        // SAFETY: a valid buffer of `line.len()` bytes, for the duration of the call.
        let n = unsafe { libc::write(1, line.as_ptr().cast(), line.len()) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        line = &line[n as usize..];
    }
}

/// Whether stdout takes a line without waiting: a file or a terminal always does; a pipe or
/// socket when it has room.
fn writable_now() -> bool {
    let mut fd = libc::pollfd {
        fd: 1,
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, for the duration of the call.
    let ready = unsafe { libc::poll(&mut fd, 1, 0) };
    ready == 1 && fd.revents & libc::POLLOUT != 0
}

/// A `tracing-subscriber` writer: gathers one event's line, hands it over whole when dropped.
pub struct LineWriter(Vec<u8>);

impl Write for LineWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            stdout().line(std::mem::take(&mut self.0));
        }
    }
}

/// Makes a [`LineWriter`] for each event.
pub struct MakeLineWriter;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for MakeLineWriter {
    type Writer = LineWriter;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter(Vec::with_capacity(512))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines queue in order behind a line being written; past the bound they are dropped,
    /// and counted once.
    #[test]
    fn queued_lines_keep_their_order_and_are_counted_when_too_many() {
        let out = Stdout::default();
        out.lock().writing = true;
        let line = vec![b'x'; 1023];
        let fit = BYTES_WAITING / 1024;
        for i in 0..fit + 3 {
            out.line([format!("{i:09}").as_bytes(), &line[9..], b"\n"].concat());
        }
        assert_eq!(out.newly_dropped(), 3);
        assert_eq!(out.newly_dropped(), 0, "counted once");
        assert!(
            !out.write(line.clone()),
            "a batch past the bound is refused"
        );
        let w = out.lock();
        assert_eq!(w.lines.len(), fit);
        assert_eq!(w.bytes, fit * 1024);
        assert!(w.lines.front().unwrap().starts_with(b"000000000"));
        assert!(w
            .lines
            .back()
            .unwrap()
            .starts_with(format!("{:09}", fit - 1).as_bytes()));
    }
}
