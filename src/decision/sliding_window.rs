//! The sliding window's arithmetic, exactly as `lua/sliding_window.lua` computes it.
//!
//! Fixed windows aligned on Redis `TIME`; the estimate is the current window's count plus
//! the previous window's count weighted by the part of it still inside the sliding window.
//! Counts are whole requests. The approximation: requests are assumed evenly spread over the
//! previous window, so a burst at its very end is forgiven faster than a log would; the
//! window never admits more than `limit` within one fixed window.

/// Window parameters: `limit` requests per `window_us` microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub limit: u64,
    pub window_us: u64,
}

/// What is stored after an admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowState {
    pub index: u64,
    pub current: u64,
    pub previous: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// `reset_secs`: seconds until the current window ends, or, when `left` has no room
    /// for another request of this cost, until there is (the `t` of the RateLimit fields).
    Admitted {
        state: WindowState,
        left: u64,
        reset_secs: u64,
    },
    /// `wait_us`: microseconds until the estimate admits the request.
    Denied { retry_after_secs: u64, wait_us: u64 },
}

impl Window {
    /// At `now_us`: the fixed window's index, the time elapsed in it, and the current and
    /// previous windows' counts as the stored state says.
    fn counts(&self, state: Option<WindowState>, now_us: u64) -> (u64, u64, u64, u64) {
        let index = now_us / self.window_us;
        let elapsed = now_us - index * self.window_us;
        let (c, p) = match state {
            Some(s) if s.index == index => (s.current, s.previous),
            Some(s) if s.index + 1 == index => (0, s.current),
            _ => (0, 0),
        };
        (index, elapsed, c, p)
    }

    /// What the window still admits at `now_us`, in requests, and the microseconds until it
    /// is empty (both fixed windows it looks at passed), without deciding anything.
    pub fn level(&self, state: Option<WindowState>, now_us: u64) -> (u64, u64) {
        let w = self.window_us;
        let (_, elapsed, c, p) = self.counts(state, now_us);
        let left = self
            .limit
            .saturating_sub(c)
            .saturating_sub(weight(p, w, elapsed));
        let empty_in = if c > 0 {
            2 * w - elapsed
        } else if p > 0 {
            w - elapsed
        } else {
            0
        };
        (left, empty_in)
    }

    /// Decides `cost` requests at `now_us` from the stored state.
    pub fn take(&self, state: Option<WindowState>, cost: u64, now_us: u64) -> Outcome {
        let w = self.window_us;
        let (index, elapsed, c, p) = self.counts(state, now_us);
        let limit = self.limit;
        // What the limit has left for this window's requests once the previous window's
        // weight is taken.
        let room = limit.checked_sub(c + cost);
        let weight = weight(p, w, elapsed);
        if let Some(left) = room.and_then(|room| room.checked_sub(weight)) {
            let c = c + cost;
            let window_end = (w - elapsed).div_ceil(1_000_000);
            let reset_secs = match left < cost {
                true => self.wait(elapsed, c, p, cost).div_ceil(1_000_000),
                false => window_end,
            };
            return Outcome::Admitted {
                state: WindowState {
                    index,
                    current: c,
                    previous: p,
                },
                left,
                reset_secs,
            };
        }
        let wait = self.wait(elapsed, c, p, cost);
        Outcome::Denied {
            retry_after_secs: wait.div_ceil(1_000_000).max(1),
            wait_us: wait,
        }
    }
}

impl Window {
    /// Microseconds from `elapsed` until the estimate admits `cost` with this window's count
    /// `c` and the previous one's `p`, for a request it does not admit now.
    fn wait(&self, elapsed: u64, c: u64, p: u64, cost: u64) -> u64 {
        let w = self.window_us;
        match self.limit.checked_sub(c + cost) {
            // Later in this window, once the previous window's weight has decayed enough.
            Some(room) => w - mul_div(room, w, p) - elapsed,
            // In the next window, where this window's count becomes the previous one.
            None => {
                let at = match c {
                    0 => 0,
                    c => w.saturating_sub(mul_div(self.limit - cost, w, c)),
                };
                w - elapsed + at
            }
        }
    }
}

/// `floor(a x t / d)` (at most `u64::MAX`): a count times a time reaches 10^9 x 86400 x
/// 10^6, past `u64`.
fn mul_div(a: u64, t: u64, d: u64) -> u64 {
    u64::try_from(u128::from(a) * u128::from(t) / u128::from(d)).unwrap_or(u64::MAX)
}

/// The previous window's count `p` weighted by the part of it still inside the sliding
/// window, in whole requests, rounded up: what the estimate counts of it.
fn weight(p: u64, w: u64, elapsed: u64) -> u64 {
    let weight = (u128::from(p) * u128::from(w - elapsed)).div_ceil(u128::from(w));
    u64::try_from(weight).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000;

    #[test]
    fn the_last_admission_of_a_window_says_when_the_next_one_comes() {
        // 5 a 10 s window, all 5 taken 1 s into it: the window ends in 9 s, but the next
        // window weighs these 5 fully at first, and admits again only 2 s into it.
        let w = Window {
            limit: 5,
            window_us: 10_000_000,
        };
        let mut state = None;
        let mut resets = Vec::new();
        for _ in 0..5 {
            let Outcome::Admitted {
                state: s,
                reset_secs,
                ..
            } = w.take(state, 1, 1_000_000)
            else {
                panic!("admitted")
            };
            state = Some(s);
            resets.push(reset_secs);
        }
        assert_eq!(resets, [9, 9, 9, 9, 11]);
        // Or long before the window ends: 10 in the last window, one request 1 s into this
        // one takes the last room; the last window's weight lets the next in 1 s, not 9.
        let w10 = Window {
            limit: 10,
            window_us: 10_000_000,
        };
        let last = Some(WindowState {
            index: 0,
            current: 10,
            previous: 0,
        });
        let Outcome::Admitted {
            state: after,
            left: 0,
            reset_secs: 1,
        } = w10.take(last, 1, 11_000_000)
        else {
            panic!("admitted, no room left, the next in 1 s")
        };
        let admits = |now| matches!(w10.take(Some(after), 1, now), Outcome::Admitted { .. });
        assert!(!admits(11_500_000) && admits(12_000_000));
        let denied = |now: u64| matches!(w.take(state, 1, now), Outcome::Denied { .. });
        assert!(
            denied(1_000_000 + 9_000_000),
            "at the window's end, still refused"
        );
        assert!(!denied(1_000_000 + 11_000_000), "at t, admitted");
    }

    #[test]
    fn the_level_is_what_take_would_still_admit() {
        let w = Window {
            limit: 10,
            window_us: 1_000_000,
        };
        assert_eq!(w.level(None, 5_500_000), (10, 0), "never used: full");
        let state = WindowState {
            index: 5,
            current: 4,
            previous: 6,
        };
        // Half the previous window (6) still weighs 3: 10 - 3 - 4 = 3 left.
        assert_eq!(w.level(Some(state), 5_500_000), (3, 1_500_000));
        // One window later the 4 are the previous window's, at three quarters' weight.
        assert_eq!(w.level(Some(state), 6_250_000).0, 7);
        assert_eq!(w.level(Some(state), 7_000_000), (10, 0));
        // What level says is left, take admits, one at a time.
        let mut s = Some(state);
        let mut admitted = 0;
        while let Outcome::Admitted { state, .. } = w.take(s, 1, 5_500_000) {
            s = Some(state);
            admitted += 1;
        }
        assert_eq!(admitted, 3);
    }

    #[test]
    fn admits_the_limit_in_a_window_then_weights_the_previous_one() {
        let win = Window {
            limit: 10,
            window_us: 10 * SEC,
        };
        let mut state = None;
        for i in 0..10 {
            match win.take(state, 1, i) {
                Outcome::Admitted { state: s, left, .. } => {
                    assert_eq!(left, 9 - i);
                    state = Some(s);
                }
                d => panic!("denied at {i}: {d:?}"),
            }
        }
        // Full: the next request waits for the next window, where 10 previous requests
        // weigh 10 x (1 - e/W); one fits once e >= W/10, i.e. 1 s into it.
        assert_eq!(
            win.take(state, 1, 5 * SEC),
            Outcome::Denied {
                retry_after_secs: 6,
                wait_us: 6 * SEC
            }
        );
        assert!(matches!(
            win.take(state, 1, 10 * SEC),
            Outcome::Denied { .. }
        ));
        assert!(matches!(
            win.take(state, 1, 11 * SEC),
            Outcome::Admitted { left: 0, .. }
        ));
    }

    #[test]
    fn the_estimate_never_exceeds_the_limit() {
        let win = Window {
            limit: 7,
            window_us: 3 * SEC,
        };
        let mut state = None;
        let mut admitted_at = Vec::new();
        for now in (0..30 * SEC).step_by(37_000) {
            if let Outcome::Admitted { state: s, .. } = win.take(state, 1, now) {
                state = Some(s);
                admitted_at.push(now);
            }
        }
        for (i, &t) in admitted_at.iter().enumerate() {
            let in_window = admitted_at[..=i]
                .iter()
                .filter(|&&a| a + 3 * SEC > t)
                .count();
            assert!(
                in_window <= 14,
                "a sliding window of 3 s never holds more than 2 x limit"
            );
        }
        let per_fixed = |k: u64| admitted_at.iter().filter(|&&a| a / (3 * SEC) == k).count();
        assert!((0..10).all(|k| per_fixed(k) <= 7));
    }
}
