//! The access log writer: one JSON line per request, written on a thread of its own so a slow
//! disk never slows a request. A request serializes its line into a buffer of its worker
//! thread's, then appends it to one shared buffer under a short lock (a copy of a few hundred
//! bytes); the writer swaps the shared buffer for its spare one and writes the whole batch.
//! Nothing is allocated or sent per line, and the writer is woken only by the first line
//! after it went idle. When the shared buffer holds [`QUEUE_BYTES`], a line is dropped and
//! counted (`sentinel_access_log_dropped_total`) instead of waiting. `SIGUSR1` and every
//! reload reopen the file (log rotation): lines buffered meanwhile go to the new file.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use serde::Serialize;

use crate::config::AccessLogTarget;

/// What the shared buffer holds at most before lines are dropped: about 16 000 lines.
pub const QUEUE_BYTES: usize = 8 * 1024 * 1024;

/// A target opened by [`AccessLog::open`], not yet in use.
pub struct Opened(Option<Sink>);

/// Where the writer writes: stdout, or an open file.
enum Sink {
    Stdout,
    File(BufWriter<File>),
}

impl Sink {
    fn open(target: &AccessLogTarget) -> io::Result<Sink> {
        match target {
            AccessLogTarget::Stdout => Ok(Sink::Stdout),
            AccessLogTarget::File(path) => Ok(Sink::File(BufWriter::with_capacity(
                64 * 1024,
                open_append(path)?,
            ))),
        }
    }

    /// Whole lines, each ending in a newline.
    fn write_lines(&mut self, lines: &[u8]) -> io::Result<()> {
        match self {
            // One write of whole lines under the lock, so lines never interleave with the logs.
            Sink::Stdout => io::stdout().lock().write_all(lines),
            Sink::File(w) => w.write_all(lines),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Sink::Stdout => io::stdout().flush(),
            Sink::File(w) => w.flush(),
        }
    }
}

fn open_append(path: &Path) -> io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// The process's access log. Lines are only built while the live config has an
/// `[access_log]`; the writer follows the config's target.
pub struct AccessLog {
    shared: Arc<Shared>,
    dropped: prometheus::IntCounter,
}

/// What the requests and the writer share.
struct Shared {
    /// Whole lines, newline-terminated, waiting for the writer.
    lines: Mutex<Vec<u8>>,
    /// The writer waits here when there was nothing to write.
    wake: Condvar,
    /// Set by the writer just before it waits: the next line wakes it.
    idle: AtomicBool,
    /// A sink opened by a reload or `SIGUSR1` (`Some(None)`: the log was turned off), for the
    /// writer to take before its next batch.
    next: Mutex<Option<Option<Sink>>>,
}

thread_local! {
    /// Each thread's line being serialized, kept for the next one.
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(Vec::with_capacity(1024));
}

impl AccessLog {
    /// Starts the writer thread; `target` is opened now, so a path that cannot be written is
    /// an error at start.
    pub fn start(
        target: Option<&AccessLogTarget>,
        dropped: prometheus::IntCounter,
    ) -> io::Result<AccessLog> {
        let shared = Arc::new(Shared {
            lines: Mutex::new(Vec::with_capacity(64 * 1024)),
            wake: Condvar::new(),
            idle: AtomicBool::new(false),
            next: Mutex::new(None),
        });
        let sink = target.map(Sink::open).transpose()?;
        let writer = Arc::clone(&shared);
        let writer_dropped = dropped.clone();
        std::thread::Builder::new()
            .name("sentinel-access".into())
            .spawn(move || write_batches(&writer, sink, &writer_dropped))?;
        Ok(AccessLog { shared, dropped })
    }

    /// Hands one line to the writer, serialized as JSON on one line; never waits for the
    /// writer.
    pub fn log(&self, line: &impl Serialize) {
        SCRATCH.with_borrow_mut(|scratch| {
            scratch.clear();
            if serde_json::to_writer(&mut *scratch, line).is_err() {
                self.dropped.inc();
                return;
            }
            scratch.push(b'\n');
            let mut lines = self.shared.lines.lock().unwrap_or_else(|p| p.into_inner());
            if lines.len() + scratch.len() > QUEUE_BYTES {
                drop(lines);
                self.dropped.inc();
                return;
            }
            lines.extend_from_slice(scratch);
            drop(lines);
            if self.shared.idle.load(Ordering::Relaxed)
                && self.shared.idle.swap(false, Ordering::AcqRel)
            {
                self.shared.wake.notify_one();
            }
        });
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
        Ok(Opened(target.map(Sink::open).transpose()?))
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

/// The writer: takes what the requests appended, in batches every `WRITE_EVERY` (and
/// flushes); after a quiet pass it waits to be woken by the next line.
fn write_batches(shared: &Shared, mut sink: Option<Sink>, dropped: &prometheus::IntCounter) {
    let mut batch: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut failing = false;
    loop {
        {
            let mut lines = shared.lines.lock().unwrap_or_else(|p| p.into_inner());
            if lines.is_empty() {
                shared.idle.store(true, Ordering::Release);
                // The timeout bounds a lost wake-up (a line appended between the check and
                // the wait) and lets a reopen be taken while no request comes.
                lines = shared
                    .wake
                    .wait_timeout(lines, Duration::from_millis(250))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                shared.idle.store(false, Ordering::Release);
            }
            std::mem::swap(&mut *lines, &mut batch);
        }
        if let Some(new) = shared.next.lock().unwrap_or_else(|p| p.into_inner()).take() {
            if let Some(old) = sink.as_mut() {
                let _ = old.flush();
            }
            sink = new;
            failing = false;
        }
        if batch.is_empty() {
            continue;
        }
        let count = || batch.iter().filter(|b| **b == b'\n').count() as u64;
        match sink.as_mut() {
            // The log was turned off with lines still buffered: they are not written.
            None => dropped.inc_by(count()),
            Some(out) => match out.write_lines(&batch).and_then(|()| out.flush()) {
                Ok(()) => failing = false,
                Err(e) => {
                    dropped.inc_by(count());
                    if !failing {
                        tracing::error!(error = %e, "cannot write the access log; lines are dropped and counted until it can");
                        failing = true;
                    }
                }
            },
        }
        batch.clear();
        // Don't keep a burst's worth of memory for good.
        batch.shrink_to(1024 * 1024);
        std::thread::sleep(WRITE_EVERY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        log.log(&serde_json::json!({"n": 1}));
        log.log(&serde_json::json!({"n": 2}));
        assert_eq!(wait_for(&path, 2), "{\"n\":1}\n{\"n\":2}\n");
        let rotated = dir.path().join("access.log.1");
        std::fs::rename(&path, &rotated).unwrap();
        log.reopen(Some(&target)).unwrap();
        log.log(&serde_json::json!({"n": 3}));
        assert_eq!(
            wait_for(&path, 1),
            "{\"n\":3}\n",
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
        let line = serde_json::json!({ "path": "x".repeat(200) });
        let started = std::time::Instant::now();
        let lines = 2 * QUEUE_BYTES / 200;
        for _ in 0..lines {
            log.log(&line);
        }
        // Generous for a loaded machine: the lines cost about a microsecond each.
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
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
}
