//! The breakers of every Redis node the store talks to, summed into one process state for
//! `sentinel_breaker_state` and `/readyz`; each transition is counted and logged once.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use crate::clock::SharedClock;
use crate::config::BreakerConfig;
use crate::decision::breaker::{Breaker, BreakerState, TransitionHook};
use crate::decision::StoreFailure;
use crate::metrics::Metrics;

/// Every breaker's transitions, summed into `sentinel_breaker_state`: with one Redis its
/// breaker's state; in a cluster open when any primary's is open, else half_open when any
/// is, else closed.
pub(super) struct BreakerBoard {
    /// What new breakers start with; a reload changes it.
    config: Mutex<BreakerConfig>,
    clock: SharedClock,
    open: AtomicI64,
    half_open: AtomicI64,
    metrics: Arc<Metrics>,
}

impl BreakerBoard {
    pub(super) fn new(config: BreakerConfig, clock: SharedClock, metrics: Arc<Metrics>) -> Self {
        Self {
            config: Mutex::new(config),
            clock,
            open: AtomicI64::new(0),
            half_open: AtomicI64::new(0),
            metrics,
        }
    }

    /// A new breaker whose transitions are summed here; `node` names a cluster primary.
    pub(super) fn breaker(self: &Arc<Self>, node: Option<String>) -> Breaker {
        let config = *self.config.lock().expect("breaker config lock");
        let board = Arc::clone(self);
        let hook: TransitionHook =
            Box::new(move |from, to, cause| board.transition(node.as_deref(), from, to, cause));
        Breaker::new(config, Arc::clone(&self.clock), hook)
    }

    pub(super) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// A reload changes the thresholds of breakers made from now on (the caller
    /// reconfigures the existing ones).
    pub(super) fn reconfigure(&self, config: BreakerConfig) {
        *self.config.lock().expect("breaker config lock") = config;
    }

    fn count(&self, state: BreakerState) -> Option<&AtomicI64> {
        match state {
            BreakerState::Open => Some(&self.open),
            BreakerState::HalfOpen => Some(&self.half_open),
            BreakerState::Closed => None,
        }
    }

    fn transition(
        &self,
        node: Option<&str>,
        from: BreakerState,
        to: BreakerState,
        cause: StoreFailure,
    ) {
        if let Some(c) = self.count(from) {
            c.fetch_sub(1, Ordering::AcqRel);
        }
        if let Some(c) = self.count(to) {
            c.fetch_add(1, Ordering::AcqRel);
        }
        self.metrics.breaker_transition(
            to.as_str(),
            self.state() as i64,
            node.map(|n| (n, to as i64)),
        );
        // Opening, the line says what failed (a Redis that stopped answering logs nothing
        // else: no error reply, no lost connection).
        let cause = (to == BreakerState::Open).then(|| cause.as_str());
        match node {
            Some(node) => tracing::warn!(
                node,
                from = from.as_str(),
                to = to.as_str(),
                cause,
                "circuit breaker transition"
            ),
            None => tracing::warn!(
                from = from.as_str(),
                to = to.as_str(),
                cause,
                "circuit breaker transition"
            ),
        }
    }

    /// A breaker that is going away (its node left the cluster's slot map, a failover say)
    /// no longer counts. One not closed ends its quarantine here: said and counted as a
    /// transition to closed, so that every opening has its end in the log and the counter.
    pub(super) fn forget(&self, node: &str, state: BreakerState) {
        let Some(c) = self.count(state) else {
            return;
        };
        c.fetch_sub(1, Ordering::AcqRel);
        let closed = BreakerState::Closed;
        self.metrics.breaker_transition(
            closed.as_str(),
            self.state() as i64,
            Some((node, closed as i64)),
        );
        tracing::warn!(
            node,
            from = state.as_str(),
            to = closed.as_str(),
            reason = "the node left the gateway's map of the cluster (no longer a primary, or new seeds)",
            "circuit breaker transition"
        );
    }

    pub(super) fn state(&self) -> BreakerState {
        if self.open.load(Ordering::Acquire) > 0 {
            BreakerState::Open
        } else if self.half_open.load(Ordering::Acquire) > 0 {
            BreakerState::HalfOpen
        } else {
            BreakerState::Closed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::num::NonZeroU32;
    use std::time::Duration;

    fn fail(b: &Breaker, n: usize) {
        for _ in 0..n {
            b.acquire().expect("closed").failure();
        }
    }

    #[test]
    fn the_board_shows_the_most_severe_primary_and_forgets_departed_ones() {
        let clock = ManualClock::default();
        let metrics = Arc::new(Metrics::new());
        let board = Arc::new(BreakerBoard::new(
            BreakerConfig {
                failure_threshold: NonZeroU32::new(5).unwrap(),
                open_for: Duration::from_secs(30),
            },
            Arc::new(clock.clone()),
            Arc::clone(&metrics),
        ));
        let a = board.breaker(Some("10.0.0.1:6379".into()));
        let b = board.breaker(Some("10.0.0.2:6379".into()));
        assert_eq!(board.state(), BreakerState::Closed);
        fail(&a, 5);
        assert_eq!(board.state(), BreakerState::Open, "one open primary");
        assert_eq!(metrics.breaker_state.get(), 1);
        fail(&b, 5);
        clock.advance(Duration::from_secs(30));
        let probe = a.acquire().expect("the probe");
        assert_eq!(board.state(), BreakerState::Open, "b is still open");
        board.forget("10.0.0.2:6379", b.retire());
        assert_eq!(board.state(), BreakerState::HalfOpen, "b left the cluster");
        assert_eq!(metrics.breaker_state.get(), 2);
        // What still holds the retired breaker moves nothing: no transition, no count.
        fail(&b, 5);
        assert_eq!(b.retire(), BreakerState::Closed, "said once");
        assert_eq!(board.state(), BreakerState::HalfOpen);
        // Its quarantine ended there: one transition to closed.
        assert!(metrics
            .render()
            .contains(r#"sentinel_breaker_transitions_total{to="closed"} 1"#));
        // A closed breaker leaving is no transition.
        board.forget("10.0.0.3:6379", BreakerState::Closed);
        probe.success();
        assert_eq!(board.state(), BreakerState::Closed);
        assert_eq!(metrics.breaker_state.get(), 0);
        let text = metrics.render();
        assert!(
            text.contains(r#"sentinel_redis_node_breaker_state{node="10.0.0.1:6379"} 0"#),
            "{text}"
        );
        assert!(text.contains(r#"sentinel_breaker_transitions_total{to="open"} 2"#));
        assert!(text.contains(r#"sentinel_breaker_transitions_total{to="closed"} 2"#));
    }
}
