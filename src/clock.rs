//! Monotonic time for the breaker and the emergency limiter: real in production, manual in
//! tests. Redis `TIME` is the clock of shared state; this one only runs local state.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub trait Clock: Send + Sync + 'static {
    /// Microseconds since an arbitrary fixed origin; never goes backwards.
    fn now_us(&self) -> u64;
}

/// The process's monotonic clock.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    origin: Instant,
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Clock for MonotonicClock {
    fn now_us(&self) -> u64 {
        self.origin.elapsed().as_micros() as u64
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    pub fn advance(&self, by: Duration) {
        self.now.fetch_add(by.as_micros() as u64, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}

pub type SharedClock = Arc<dyn Clock>;
