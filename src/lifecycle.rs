//! Where the process is in its life: starting, ready, draining; and how many requests are in
//! flight, so a drain can end as soon as the last one finishes.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, Default)]
pub struct Lifecycle {
    ready: AtomicBool,
    draining: AtomicBool,
    in_flight: AtomicUsize,
    /// Held while turning ready or draining and saying so: the two lines come in the order
    /// of the two changes, and a process draining before it was ready never says ready.
    turning: Mutex<()>,
}

impl Lifecycle {
    fn set_ready(&self) {
        self.ready.store(true, Ordering::Release);
    }

    /// Ready, and `say` it, unless a drain began first.
    pub fn become_ready(&self, say: impl FnOnce()) {
        let _turning = self.turning.lock().unwrap_or_else(|p| p.into_inner());
        self.set_ready();
        if !self.is_draining() {
            say();
        }
    }

    fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// `say` the drain, then begin it.
    pub fn begin_draining(&self, say: impl FnOnce()) {
        let _turning = self.turning.lock().unwrap_or_else(|p| p.into_inner());
        say();
        self.start_draining();
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Ready: listeners are up and the process is not draining.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire) && !self.is_draining()
    }

    /// Whether it was ever ready (a drain since included).
    pub fn was_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// Counts one request until the guard drops; also says how many are in flight with
    /// it, itself included.
    pub fn track(self: &Arc<Self>) -> (InFlight, usize) {
        let before = self.in_flight.fetch_add(1, Ordering::AcqRel);
        (InFlight(Arc::clone(self)), before + 1)
    }
}

/// One request in flight.
pub struct InFlight(Arc<Lifecycle>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}
