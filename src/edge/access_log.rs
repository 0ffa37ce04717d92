//! The access log writer: one JSON line per request, written on a thread of its own so a slow
//! disk never slows a request. Requests hand their line over a bounded queue; when it is full
//! the line is dropped and counted (`sentinel_access_log_dropped_total`) instead of waiting.
//! `SIGUSR1` and every reload reopen the file (log rotation): lines queued meanwhile go to the
//! new file.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::AccessLogTarget;

/// Lines waiting for the writer at most; beyond, lines are dropped.
pub const QUEUE_LINES: usize = 16_384;

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

    fn write_line(&mut self, line: &str) -> io::Result<()> {
        match self {
            // One write per line under the lock, so lines never interleave with the logs.
            Sink::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(line.as_bytes())?;
                out.write_all(b"\n")
            }
            Sink::File(w) => {
                w.write_all(line.as_bytes())?;
                w.write_all(b"\n")
            }
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
    lines: SyncSender<String>,
    /// A sink opened by a reload or `SIGUSR1` (`Some(None)`: the log was turned off), for the
    /// writer to take before its next line.
    next: Arc<Mutex<Option<Option<Sink>>>>,
    dropped: prometheus::IntCounter,
}

impl AccessLog {
    /// Starts the writer thread; `target` is opened now, so a path that cannot be written is
    /// an error at start.
    pub fn start(
        target: Option<&AccessLogTarget>,
        dropped: prometheus::IntCounter,
    ) -> io::Result<AccessLog> {
        let (lines, queue) = mpsc::sync_channel(QUEUE_LINES);
        let next = Arc::new(Mutex::new(None));
        let sink = target.map(Sink::open).transpose()?;
        let writer_next = Arc::clone(&next);
        let writer_dropped = dropped.clone();
        std::thread::Builder::new()
            .name("sentinel-access-log".into())
            .spawn(move || write_lines(queue, sink, writer_next, writer_dropped))?;
        Ok(AccessLog {
            lines,
            next,
            dropped,
        })
    }

    /// Hands one line (without its newline) to the writer; never waits.
    pub fn log(&self, line: String) {
        match self.lines.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => self.dropped.inc(),
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
        Ok(Opened(target.map(Sink::open).transpose()?))
    }

    /// The writer takes `opened` before its next line.
    pub fn install(&self, opened: Opened) {
        *self.next.lock().unwrap_or_else(|p| p.into_inner()) = Some(opened.0);
    }
}

/// How long the writer rests between batches. It never blocks on the queue while requests
/// come: a worker's `try_send` to a writer parked on the channel would wake it, a system call
/// and a context switch per line; measured, that cost about a fifth of the plain proxy's
/// throughput on two cores. Lines reach the file within this long.
const WRITE_EVERY: Duration = Duration::from_millis(20);

/// The writer: lines in, written in batches every `WRITE_EVERY` (and flushed), or as soon
/// as a line comes after the queue was quiet for a while.
fn write_lines(
    queue: Receiver<String>,
    mut sink: Option<Sink>,
    next: Arc<Mutex<Option<Option<Sink>>>>,
    dropped: prometheus::IntCounter,
) {
    let mut failing = false;
    let mut busy = false;
    loop {
        // While lines come, take them in batches without waiting on the queue; once it has
        // been quiet, wait on it (a lone request's line is written at once).
        let first = if busy {
            std::thread::sleep(WRITE_EVERY);
            match queue.try_recv() {
                Ok(line) => Some(line),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        } else {
            match queue.recv_timeout(Duration::from_millis(250)) {
                Ok(line) => Some(line),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        };
        busy = first.is_some();
        if let Some(new) = next.lock().unwrap_or_else(|p| p.into_inner()).take() {
            if let Some(old) = sink.as_mut() {
                let _ = old.flush();
            }
            sink = new;
            failing = false;
        }
        let Some(first) = first else {
            continue;
        };
        let Some(out) = sink.as_mut() else {
            // The log was turned off with lines still queued: they are not written.
            dropped.inc_by(1 + queue.try_iter().count() as u64);
            continue;
        };
        let mut result = out.write_line(&first);
        let mut lost = u64::from(result.is_err());
        while let Ok(line) = queue.try_recv() {
            let r = out.write_line(&line);
            lost += u64::from(r.is_err());
            result = result.and(r);
        }
        let result = result.and_then(|()| out.flush());
        if lost > 0 {
            dropped.inc_by(lost);
        }
        match result {
            Err(e) if !failing => {
                tracing::error!(error = %e, "cannot write the access log; lines are dropped and counted until it can");
                failing = true;
            }
            Err(_) => {}
            Ok(()) => failing = false,
        }
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
        log.log(r#"{"n":1}"#.into());
        log.log(r#"{"n":2}"#.into());
        assert_eq!(wait_for(&path, 2), "{\"n\":1}\n{\"n\":2}\n");
        let rotated = dir.path().join("access.log.1");
        std::fs::rename(&path, &rotated).unwrap();
        log.reopen(Some(&target)).unwrap();
        log.log(r#"{"n":3}"#.into());
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

    #[test]
    fn a_path_that_cannot_be_opened_is_an_error() {
        let target = AccessLogTarget::File("/nonexistent-dir/access.log".into());
        let dropped = prometheus::IntCounter::new("d", "d").unwrap();
        assert!(AccessLog::start(Some(&target), dropped).is_err());
    }
}
