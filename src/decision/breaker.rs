//! The circuit breaker's state machine, lock-free and shared by every worker thread: one per
//! Redis node (the one Redis, or each primary of a cluster; the store holds them).
//!
//! CLOSED counts consecutive store failures; `failure_threshold` of them trip OPEN. OPEN
//! short-circuits every decision without touching Redis for `open_for` on the monotonic
//! clock. Then HALF_OPEN lets exactly one request probe Redis while all others keep
//! short-circuiting: a real answer closes the breaker, a failure (or a probe abandoned
//! midway) opens it afresh. Only a real answer of the script resets the failure count.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use super::failure::Charge;
use super::StoreFailure;
use crate::clock::SharedClock;
use crate::config::BreakerConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed = 0,
    Open = 1,
    HalfOpen = 2,
}

/// [`Breaker::retire`]d: no state a transition starts from, so none is made again.
const RETIRED: u8 = 3;

impl BreakerState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => BreakerState::Open,
            2 => BreakerState::HalfOpen,
            _ => BreakerState::Closed,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// Called once per transition with (from, to, the cause of the last failure counted).
pub type TransitionHook = Box<dyn Fn(BreakerState, BreakerState, StoreFailure) + Send + Sync>;

pub struct Breaker {
    state: AtomicU8,
    failures: AtomicU32,
    opened_at_us: AtomicU64,
    /// The quarantine was ended early ([`Breaker::end_quarantine`]).
    cut_short: AtomicBool,
    probe_taken: AtomicBool,
    threshold: AtomicU32,
    open_for_us: AtomicU64,
    clock: SharedClock,
    on_transition: TransitionHook,
    /// What the last failure counted was ([`Breaker::note_cause`]), for the transition's log
    /// line: a breaker opened by timeouts alone would otherwise say nothing of why.
    last_cause: AtomicU8,
}

/// Permission to call Redis. Report the outcome with `success`, `failure` or `nothing`; a
/// probe dropped without an outcome counts as a failure, so an abandoned probe cannot wedge
/// the breaker in HALF_OPEN.
#[must_use]
pub struct Permit<'a> {
    breaker: &'a Breaker,
    probe: bool,
    settled: bool,
}

/// The breaker refused the call; `retry_in` is what is left of the quarantine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShortCircuit {
    pub retry_in: Duration,
}

impl Breaker {
    pub fn new(config: BreakerConfig, clock: SharedClock, on_transition: TransitionHook) -> Self {
        Self {
            state: AtomicU8::new(BreakerState::Closed as u8),
            failures: AtomicU32::new(0),
            opened_at_us: AtomicU64::new(0),
            cut_short: AtomicBool::new(false),
            probe_taken: AtomicBool::new(false),
            threshold: AtomicU32::new(config.failure_threshold.get()),
            open_for_us: AtomicU64::new(config.open_for.as_micros() as u64),
            clock,
            on_transition,
            last_cause: AtomicU8::new(StoreFailure::ConnectionError as u8),
        }
    }

    /// The cause of a store failure about to be counted.
    fn note_cause(&self, cause: StoreFailure) {
        self.last_cause.store(cause as u8, Ordering::Relaxed);
    }

    fn last_cause(&self) -> StoreFailure {
        match self.last_cause.load(Ordering::Relaxed) {
            c if c == StoreFailure::Timeout as u8 => StoreFailure::Timeout,
            c if c == StoreFailure::Noscript as u8 => StoreFailure::Noscript,
            _ => StoreFailure::ConnectionError,
        }
    }

    /// A reload changes the thresholds; the state carries on.
    pub fn reconfigure(&self, config: BreakerConfig) {
        self.threshold
            .store(config.failure_threshold.get(), Ordering::Relaxed);
        self.open_for_us
            .store(config.open_for.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn state(&self) -> BreakerState {
        BreakerState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// The breaker is going away (its cluster node left): from now on it makes no
    /// transition (its hook is never called again; it reads as closed and lets every call
    /// through, to whatever still holds it), and the state it was in is returned, once: a
    /// second call returns `Closed`.
    pub fn retire(&self) -> BreakerState {
        BreakerState::from_u8(self.state.swap(RETIRED, Ordering::AcqRel))
    }

    /// Asks to call Redis now.
    pub fn acquire(&self) -> Result<Permit<'_>, ShortCircuit> {
        match self.state() {
            BreakerState::Closed => Ok(self.permit(false)),
            BreakerState::Open => {
                let remaining = self.quarantine_left_us();
                if remaining > 0 {
                    return Err(ShortCircuit {
                        retry_in: Duration::from_micros(remaining),
                    });
                }
                // The probe is taken before the state says half-open, so a caller that sees
                // half-open in between cannot take a second one.
                if self
                    .probe_taken
                    .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    if self.transition(BreakerState::Open, BreakerState::HalfOpen) {
                        return Ok(self.permit(true));
                    }
                    self.probe_taken.store(false, Ordering::Release);
                }
                self.half_open_probe()
            }
            BreakerState::HalfOpen => self.half_open_probe(),
        }
    }

    /// Whether [`acquire`](Self::acquire) would short-circuit now, without taking a probe:
    /// the quarantine left when it would.
    pub fn short_circuits(&self) -> Option<Duration> {
        let left = Duration::from_micros(self.quarantine_left_us());
        match self.state() {
            BreakerState::Closed => None,
            BreakerState::Open => (!left.is_zero()).then_some(left),
            BreakerState::HalfOpen => self.probe_taken.load(Ordering::Acquire).then_some(left),
        }
    }

    fn half_open_probe(&self) -> Result<Permit<'_>, ShortCircuit> {
        if self.state() == BreakerState::HalfOpen
            && self
                .probe_taken
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            return Ok(self.permit(true));
        }
        Err(ShortCircuit {
            retry_in: Duration::from_micros(self.quarantine_left_us()),
        })
    }

    fn permit(&self, probe: bool) -> Permit<'_> {
        Permit {
            breaker: self,
            probe,
            settled: false,
        }
    }

    fn quarantine_left_us(&self) -> u64 {
        if self.cut_short.load(Ordering::Acquire) {
            return 0;
        }
        let opened = self.opened_at_us.load(Ordering::Acquire);
        let open_for = self.open_for_us.load(Ordering::Relaxed);
        (opened + open_for).saturating_sub(self.clock.now_us())
    }

    fn transition(&self, from: BreakerState, to: BreakerState) -> bool {
        let done = self
            .state
            .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if done {
            (self.on_transition)(from, to, self.last_cause());
        }
        done
    }

    fn trip(&self, from: BreakerState) {
        self.opened_at_us
            .store(self.clock.now_us(), Ordering::Release);
        self.cut_short.store(false, Ordering::Release);
        if self.transition(from, BreakerState::Open) {
            self.failures.store(0, Ordering::Relaxed);
        }
    }

    fn record_success(&self, probe: bool) {
        self.failures.store(0, Ordering::Relaxed);
        if probe {
            self.transition(BreakerState::HalfOpen, BreakerState::Closed);
            self.probe_taken.store(false, Ordering::Release);
        }
    }

    /// An open breaker whose quarantine is over is half-open, whether or not a request came
    /// to probe yet: what `/readyz` and `sentinel_breaker_state` say of an idle gateway
    /// follows the clock, not the traffic. The next request takes the probe.
    pub fn refresh(&self) {
        if self.state() != BreakerState::Open || self.quarantine_left_us() > 0 {
            return;
        }
        // Holding the probe's place, no probe can start, fail and open a new quarantine
        // between the look at this one and the move (a request meanwhile short-circuits).
        if self
            .probe_taken
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            if self.quarantine_left_us() == 0 {
                self.transition(BreakerState::Open, BreakerState::HalfOpen);
            }
            self.probe_taken.store(false, Ordering::Release);
        }
    }

    /// Ends an open quarantine now: the next request probes. For a store that was replaced
    /// (a Sentinel failover's new master, or a reload's new URL or credentials, connected):
    /// what opened the breaker was the old one,
    /// and the contract wants decisions from the new one within about 2 s of the promotion.
    /// The failure count stays; only a Redis answer resets it.
    pub fn end_quarantine(&self) {
        if self.state() == BreakerState::Open {
            self.cut_short.store(true, Ordering::Release);
        }
    }

    /// Closes the breaker on an answer of Redis that was no decision: a cluster's slot map
    /// read at last, for the breaker that stands for a cluster with none (every decision
    /// then goes to its primary's own breaker).
    pub fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if !self.transition(BreakerState::Open, BreakerState::Closed) {
            self.transition(BreakerState::HalfOpen, BreakerState::Closed);
        }
        self.probe_taken.store(false, Ordering::Release);
    }

    /// A store failure with no request behind it (a connection lost, a connection attempt
    /// failed): counts toward the threshold while closed; a probe decides the other states.
    pub fn count_failure(&self) {
        self.note_cause(StoreFailure::ConnectionError);
        self.record_failure(false);
    }

    /// Settles a permit let go by [`Permit::detach`] (`probe`: whether it was the probe), as
    /// the permit would have been: `None` when Redis answered, else the failure's charge and
    /// cause.
    pub fn settle(&self, probe: bool, failed: Option<(Charge, StoreFailure)>) {
        match failed {
            None => self.record_success(probe),
            Some((Charge::Failure, cause)) => {
                self.note_cause(cause);
                self.record_failure(probe);
            }
            Some((Charge::Nothing, _)) => {
                if probe {
                    self.release_probe();
                }
            }
        }
    }

    /// A probe that learnt nothing about Redis (a broken key): the breaker stays half-open and
    /// the next request probes.
    fn release_probe(&self) {
        self.probe_taken.store(false, Ordering::Release);
    }

    fn record_failure(&self, probe: bool) {
        if probe {
            self.trip(BreakerState::HalfOpen);
            self.probe_taken.store(false, Ordering::Release);
            return;
        }
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if failures >= self.threshold.load(Ordering::Relaxed)
            && self.state() == BreakerState::Closed
        {
            self.trip(BreakerState::Closed);
        }
    }
}

impl Permit<'_> {
    /// Whether this is the half-open probe.
    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// Redis answered (allowed or rate limited).
    pub fn success(mut self) {
        self.settled = true;
        self.breaker.record_success(self.probe);
    }

    /// The store failed (timeout, connection error, NOSCRIPT after the reload).
    pub fn failure(mut self) {
        self.settled = true;
        self.breaker.record_failure(self.probe);
    }

    /// The call failed in a way that neither counts for nor resets the breaker (see
    /// `decision::failure`); a probe is handed to the next request.
    pub fn nothing(mut self) {
        self.settled = true;
        if self.probe {
            self.breaker.release_probe();
        }
    }

    /// Lets the permit go unsettled, for a call that outlives its borrow of the breaker:
    /// whether it was the probe. [`Breaker::settle`] settles it, and must, when it was the
    /// probe (an abandoned probe counts as a failure: the caller's guard does that).
    pub fn detach(mut self) -> bool {
        self.settled = true;
        self.probe
    }

    /// Settles the permit by a failure's [`Charge`]; `cause` is what it was, for the log
    /// line of a transition it makes.
    pub fn charge(self, charge: Charge, cause: StoreFailure) {
        match charge {
            Charge::Failure => {
                self.breaker.note_cause(cause);
                self.failure()
            }
            Charge::Nothing => self.nothing(),
        }
    }
}

impl Drop for Permit<'_> {
    /// An abandoned probe counts as a failure, so the breaker cannot be wedged half-open. Any
    /// other abandoned call (its client went away) says nothing about Redis and counts nothing.
    fn drop(&mut self) {
        if !self.settled && self.probe {
            self.breaker.record_failure(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::num::NonZeroU32;
    use std::sync::{Arc, Mutex};

    fn breaker(clock: &ManualClock) -> (Breaker, Arc<Mutex<Vec<BreakerState>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let b = Breaker::new(
            BreakerConfig {
                failure_threshold: NonZeroU32::new(5).unwrap(),
                open_for: Duration::from_secs(30),
            },
            Arc::new(clock.clone()),
            Box::new(move |_, to, _| log.lock().unwrap().push(to)),
        );
        (b, seen)
    }

    fn fail(b: &Breaker, n: usize) {
        for _ in 0..n {
            b.acquire().expect("closed").failure();
        }
    }

    #[test]
    fn trips_after_threshold_consecutive_failures_only() {
        let clock = ManualClock::default();
        let (b, _) = breaker(&clock);
        fail(&b, 4);
        b.acquire().unwrap().success();
        fail(&b, 4);
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "a success resets the count"
        );
        fail(&b, 1);
        assert_eq!(b.state(), BreakerState::Open);
        let refused = b.acquire().err().expect("open short-circuits");
        assert_eq!(refused.retry_in, Duration::from_secs(30));
    }

    #[test]
    fn half_open_lets_exactly_one_probe_through() {
        let clock = ManualClock::default();
        let (b, seen) = breaker(&clock);
        fail(&b, 5);
        clock.advance(Duration::from_secs(29));
        assert!(b.acquire().is_err(), "still in quarantine");
        clock.advance(Duration::from_secs(1));
        let probe = b.acquire().expect("one probe");
        for _ in 0..50 {
            assert!(b.acquire().is_err(), "others keep short-circuiting");
        }
        probe.success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                BreakerState::Open,
                BreakerState::HalfOpen,
                BreakerState::Closed
            ]
        );
    }

    #[test]
    fn an_idle_breaker_is_half_open_once_its_quarantine_is_over_and_the_next_request_probes() {
        let clock = ManualClock::default();
        let (b, seen) = breaker(&clock);
        fail(&b, 5);
        clock.advance(Duration::from_secs(29));
        b.refresh();
        assert_eq!(b.state(), BreakerState::Open, "still in quarantine");
        clock.advance(Duration::from_secs(1));
        b.refresh();
        b.refresh();
        assert_eq!(b.state(), BreakerState::HalfOpen);
        let probe = b.acquire().expect("the next request probes");
        assert!(b.acquire().is_err(), "only one probe");
        probe.success();
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                BreakerState::Open,
                BreakerState::HalfOpen,
                BreakerState::Closed
            ],
            "one transition to half_open, counted once"
        );
    }

    /// A permit let go by `detach` and settled later counts as the permit would have.
    #[test]
    fn a_detached_permit_settles_as_the_permit_would() {
        let clock = ManualClock::default();
        let (b, _) = breaker(&clock);
        for _ in 0..4 {
            let probe = b.acquire().unwrap().detach();
            b.settle(probe, Some((Charge::Failure, StoreFailure::Timeout)));
        }
        b.settle(b.acquire().unwrap().detach(), None);
        fail(&b, 4);
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "an answer resets the count"
        );
        let probe = b.acquire().unwrap().detach();
        b.settle(probe, Some((Charge::Failure, StoreFailure::Timeout)));
        assert_eq!(b.state(), BreakerState::Open);
        clock.advance(Duration::from_secs(30));
        let probe = b.acquire().unwrap().detach();
        assert!(probe, "the probe");
        assert!(b.acquire().is_err(), "only one");
        b.settle(
            probe,
            Some((Charge::Nothing, StoreFailure::ConnectionError)),
        );
        let probe = b.acquire().unwrap().detach();
        assert!(probe, "handed to the next call");
        b.settle(probe, Some((Charge::Failure, StoreFailure::Timeout)));
        assert_eq!(
            b.state(),
            BreakerState::Open,
            "a failed probe opens it again"
        );
        clock.advance(Duration::from_secs(30));
        b.settle(b.acquire().unwrap().detach(), None);
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "an answered probe closes it"
        );
    }

    #[test]
    fn a_failed_or_abandoned_probe_reopens_for_a_full_quarantine() {
        let clock = ManualClock::default();
        let (b, _) = breaker(&clock);
        fail(&b, 5);
        clock.advance(Duration::from_secs(30));
        b.acquire().expect("probe").failure();
        assert_eq!(b.state(), BreakerState::Open);
        assert_eq!(b.acquire().err().unwrap().retry_in, Duration::from_secs(30));
        clock.advance(Duration::from_secs(30));
        drop(b.acquire().expect("probe"));
        assert_eq!(
            b.state(),
            BreakerState::Open,
            "abandoned probe counts as failure"
        );
        clock.advance(Duration::from_secs(30));
        b.acquire().expect("probe").success();
        assert_eq!(b.state(), BreakerState::Closed);
    }

    #[test]
    fn uncounted_failures_neither_trip_nor_reset_and_hand_the_probe_on() {
        let clock = ManualClock::default();
        let (b, _) = breaker(&clock);
        fail(&b, 4);
        for _ in 0..100 {
            b.acquire().expect("closed").nothing();
        }
        for _ in 0..10 {
            drop(b.acquire().expect("closed"));
        }
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "nothing counted, abandoned calls neither"
        );
        b.count_failure();
        assert_eq!(
            b.state(),
            BreakerState::Open,
            "the count was not reset either"
        );
        clock.advance(Duration::from_secs(30));
        b.acquire().expect("probe").nothing();
        assert_eq!(b.state(), BreakerState::HalfOpen);
        let probe = b.acquire().expect("the next request probes");
        assert!(probe.is_probe());
        b.count_failure();
        assert_eq!(
            b.state(),
            BreakerState::HalfOpen,
            "a failed connection attempt does not decide a probe's breaker"
        );
        probe.charge(Charge::Failure, StoreFailure::Timeout);
        assert_eq!(b.state(), BreakerState::Open);
    }

    #[test]
    fn an_ended_quarantine_lets_the_next_request_probe_and_a_failed_probe_restarts_it() {
        let clock = ManualClock::default();
        let (b, seen) = breaker(&clock);
        b.end_quarantine();
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "a closed breaker is left alone"
        );
        fail(&b, 5);
        clock.advance(Duration::from_secs(1));
        assert!(b.acquire().is_err(), "29 s of quarantine left");
        b.end_quarantine();
        let probe = b.acquire().expect("the next request probes at once");
        assert!(probe.is_probe());
        assert!(b.acquire().is_err(), "one probe at a time");
        probe.failure();
        let Err(short) = b.acquire() else {
            panic!("open again")
        };
        assert_eq!(
            short.retry_in,
            Duration::from_secs(30),
            "a whole quarantine again"
        );
        b.end_quarantine();
        b.acquire().expect("probes again").success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(
            *seen.lock().unwrap(),
            [
                BreakerState::Open,
                BreakerState::HalfOpen,
                BreakerState::Open,
                BreakerState::HalfOpen,
                BreakerState::Closed
            ]
        );
    }

    #[test]
    fn concurrent_callers_see_one_probe() {
        let clock = ManualClock::default();
        let (b, _) = breaker(&clock);
        fail(&b, 5);
        clock.advance(Duration::from_secs(30));
        let b = Arc::new(b);
        let granted: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let b = Arc::clone(&b);
                    s.spawn(move || {
                        let mut held = Vec::new();
                        for _ in 0..100 {
                            if let Ok(p) = b.acquire() {
                                held.push(p);
                            }
                        }
                        let n = held.len();
                        std::mem::forget(held);
                        n
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(granted, 1);
    }
}
