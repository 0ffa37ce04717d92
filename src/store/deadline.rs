//! A decision's deadline, sent in the node's own time, so that a script Redis runs only after
//! the gateway stopped waiting for it writes nothing.
//!
//! A command can reach Redis and wait there (`CLIENT PAUSE`, a slow command ahead of it, a
//! Redis descheduled): the gateway answers at its budget by the fail mode (a 503, say), and
//! Redis would otherwise run the decision afterwards and charge a request that was never
//! admitted. So each decision carries its deadline, and the scripts answer a decision whose
//! deadline passed before Redis's `TIME` with `EXPIRED` instead of deciding it.
//!
//! Redis's `TIME` is its host's wall clock; the deadline is this process's monotonic clock
//! plus an offset read from the answers: an answer written at the node's time `now` to a call
//! sent at local time `t` gives `now - t`, never less than the true offset (Redis ran the call
//! after it was sent; the connector reads `TIME` once when it connects). The offset is the
//! smallest such sample of the last one to two seconds of samples, and the deadline sent is
//! the local one plus that offset plus a margin for the two clocks' drift since the last
//! sample: [`MARGIN_US`], and 1 ms for each second without one (two clocks slewed by NTP
//! drift apart by less). So Redis never refuses a decision it runs before the gateway's own
//! deadline, and one it runs later than the margin (and the best sample's round trip) after
//! it is never written. A clock that jumps ahead (a VM resumed, a node's clock stepped) is
//! caught by the first decision it makes expire: the expiry carries the node's `now`, and an
//! offset it proves too small is replaced at once. A new connection starts the offset afresh
//! (a failover reaches another host's clock).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// Added to every deadline, besides 1 ms for each second since the last sample.
pub const MARGIN_US: u64 = 2_000;
/// The offset is the smallest sample of the current window of this length and of the one
/// before: a node's clock stepped ahead is followed within two windows.
const WINDOW_US: u64 = 1_000_000;
const NONE: i64 = i64::MAX;
/// No node's `TIME` is later (the year 10000): an answer that says so is no clock, and is
/// not taken as one (its offset would not fit the arithmetic).
const LATEST_NOW_US: u64 = 253_402_300_800_000_000;

/// Microseconds on this process's monotonic clock (from its first use, plus one, so that 0
/// can mean "never").
pub fn mono_us() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_micros() as u64 + 1
}

/// Whether a line said at most once every `secs` seconds may be said now (`last`: when it
/// was last, in [`mono_us`]; 0: never), marking it said.
pub fn once_every(last: &std::sync::atomic::AtomicU64, secs: u64) -> bool {
    use std::sync::atomic::Ordering;
    let (now, was) = (mono_us(), last.load(Ordering::Relaxed));
    (was == 0 || now >= was + secs * 1_000_000)
        && last
            .compare_exchange(was, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// A `TIME` reply's seconds and microseconds as microseconds (saturated: a reply of a broken
/// node is no overflow).
pub fn time_us(secs: u64, micros: u64) -> u64 {
    secs.saturating_mul(1_000_000).saturating_add(micros)
}

/// One node's `TIME` against this process's monotonic clock.
#[derive(Debug)]
pub struct RedisClock {
    current: AtomicI64,
    previous: AtomicI64,
    window: AtomicU64,
    last_us: AtomicU64,
}

impl Default for RedisClock {
    fn default() -> Self {
        Self {
            current: AtomicI64::new(NONE),
            previous: AtomicI64::new(NONE),
            window: AtomicU64::new(0),
            last_us: AtomicU64::new(0),
        }
    }
}

impl RedisClock {
    /// The node's `now` (microseconds), read in the answer to a call sent at local time
    /// `sent_us`.
    pub fn sample(&self, redis_now_us: u64, sent_us: u64) {
        if redis_now_us > LATEST_NOW_US || sent_us > LATEST_NOW_US {
            return;
        }
        let offset = redis_now_us as i64 - sent_us as i64;
        let window = sent_us / WINDOW_US;
        let seen = self.window.load(Ordering::Relaxed);
        if window > seen
            && self
                .window
                .compare_exchange(seen, window, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let ended = self.current.swap(offset, Ordering::Relaxed);
            let kept = if window == seen + 1 { ended } else { NONE };
            self.previous.store(kept, Ordering::Relaxed);
        } else {
            self.current.fetch_min(offset, Ordering::Relaxed);
        }
        self.last_us.fetch_max(sent_us, Ordering::Relaxed);
    }

    /// An `EXPIRED` answer's `now`, to a call sent at `sent_us`: when it shows the offset used was too small by more than the margin (the
    /// node's clock jumped ahead of this one), the offset starts again from it.
    pub fn expired(&self, redis_now_us: u64, sent_us: u64) {
        if redis_now_us > LATEST_NOW_US || sent_us > LATEST_NOW_US {
            return;
        }
        let offset = redis_now_us as i64 - sent_us as i64;
        if self
            .offset()
            .is_some_and(|known| offset > known.saturating_add(MARGIN_US as i64))
        {
            self.reset();
        }
        self.sample(redis_now_us, sent_us);
    }

    /// One decision's answer (`allowed left retry reset now wait`, or a batch's `E EXPIRED
    /// now ...`) to a call sent at `sent_us`, when it carries the node's `now`.
    pub fn note(&self, answer: &[u8], sent_us: u64) -> bool {
        let Some(now) = redis_now_of(answer) else {
            return false;
        };
        match answer.starts_with(b"E EXPIRED ") {
            true => self.expired(now, sent_us),
            false => self.sample(now, sent_us),
        }
        true
    }

    /// Forgets every sample (a new connection, perhaps to another host).
    pub fn reset(&self) {
        self.current.store(NONE, Ordering::Relaxed);
        self.previous.store(NONE, Ordering::Relaxed);
        self.last_us.store(0, Ordering::Relaxed);
    }

    fn offset(&self) -> Option<i64> {
        let known = |o: i64| (o != NONE).then_some(o);
        match (
            known(self.current.load(Ordering::Relaxed)),
            known(self.previous.load(Ordering::Relaxed)),
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// `local_deadline_us` in the node's time at `local_now_us`, margin included; 0 (no
    /// deadline) before the first sample.
    pub fn deadline(&self, local_deadline_us: u64, local_now_us: u64) -> u64 {
        let last = self.last_us.load(Ordering::Relaxed);
        if local_deadline_us == 0 || last == 0 {
            return 0;
        }
        let Some(offset) = self.offset() else {
            return 0;
        };
        let drift = local_now_us.saturating_sub(last) / 1_000;
        (local_deadline_us as i64)
            .saturating_add(offset)
            .saturating_add((MARGIN_US + drift) as i64)
            .max(1) as u64
    }
}

/// The node's `now` in one decision's answer: the fifth number of `allowed left retry reset
/// now wait` (the first group's, with several limits), or the one `EXPIRED` carries.
pub fn redis_now_of(part: &[u8]) -> Option<u64> {
    let nth = if part.starts_with(b"E EXPIRED ") {
        2
    } else if part.starts_with(b"E ") {
        return None;
    } else {
        4
    };
    let field = part.split(|b| *b == b' ').nth(nth)?;
    std::str::from_utf8(field).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_is_the_local_one_in_the_nodes_time_plus_the_margin() {
        let clock = RedisClock::default();
        assert_eq!(clock.deadline(5_000, 1_000), 0, "no sample yet");
        // Redis is 1 000 000 us ahead; it ran the calls 300 and 100 us after they were sent.
        clock.sample(1_001_000 + 300, 1_000);
        clock.sample(1_002_000 + 100, 2_000);
        assert_eq!(
            clock.deadline(20_000, 2_500),
            20_000 + 1_000_100 + MARGIN_US
        );
        assert_eq!(clock.deadline(0, 2_500), 0, "a call without a deadline");
        // A slow answer (a busy worker, a long batch) makes the offset no smaller: the
        // deadline never comes early.
        clock.sample(1_003_000 + 40_000, 3_000);
        assert_eq!(
            clock.deadline(20_000, 3_000),
            20_000 + 1_000_100 + MARGIN_US
        );
        // A quiet minute: 60 ms more for the drift the clocks may have had meanwhile.
        assert_eq!(
            clock.deadline(60_003_000, 60_003_000),
            60_003_000 + 1_000_100 + MARGIN_US + 60_000
        );
    }

    #[test]
    fn a_node_clock_stepped_back_is_followed_at_once_and_one_ahead_by_its_first_expiry() {
        let clock = RedisClock::default();
        clock.sample(10_000_000, 100);
        // Back by 5 s: the smaller offset is taken at once.
        clock.sample(5_000_000 + 1_000_000, 1_000_000);
        assert_eq!(
            clock.deadline(1_000_000, 1_000_000),
            1_000_000 + 5_000_000 + MARGIN_US
        );
        // Ahead by 3 s: the first decision it makes expire carries the new offset.
        clock.expired(8_000_000 + 1_100_000, 1_100_000);
        assert_eq!(
            clock.deadline(1_100_000, 1_100_000),
            1_100_000 + 8_000_000 + MARGIN_US
        );
        // An expiry within the margin says nothing new.
        clock.expired(8_000_000 + 1_200_000 + 500, 1_200_000);
        assert_eq!(
            clock.deadline(1_200_000, 1_200_000),
            1_200_000 + 8_000_000 + MARGIN_US
        );
        clock.reset();
        assert_eq!(clock.deadline(1_300_000, 1_300_000), 0, "a new connection");
    }

    #[test]
    fn a_time_no_clock_gives_is_not_taken() {
        let clock = RedisClock::default();
        clock.sample(10_000_000, 100);
        // Past `i64`, or past the year 10000: a broken or hostile node's answer.
        for now in [u64::MAX, 1 << 63, LATEST_NOW_US + 1] {
            clock.sample(now, 200);
            clock.expired(now, 300);
        }
        assert_eq!(
            clock.deadline(1_000, 1_000),
            1_000 + 10_000_000 - 100 + MARGIN_US
        );
        assert_eq!(
            redis_now_of(b"1 0 0 0 18446744073709551615 0"),
            Some(u64::MAX)
        );
    }

    #[test]
    fn the_nodes_now_is_read_from_answers_and_expiries() {
        assert_eq!(
            redis_now_of(b"1 5 0 3 1700000000000123 0"),
            Some(1_700_000_000_000_123)
        );
        assert_eq!(
            redis_now_of(b"1 5 0 3 17 0 0 2 -1 4 17 9"),
            Some(17),
            "several limits: the first group's"
        );
        assert_eq!(redis_now_of(b"E EXPIRED 42 the deadline passed"), Some(42));
        assert_eq!(redis_now_of(b"E WRONGTYPE Operation against a key"), None);
        assert_eq!(redis_now_of(b"1 2"), None);
    }
}
