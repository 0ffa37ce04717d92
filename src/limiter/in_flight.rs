//! Charges of a caller's own limits that may still be given back, per caller, in this
//! process.
//!
//! On Redis Cluster a ceiling (`identity = "global"`) may live on another primary than the
//! caller's own limits; then the caller's limits are charged first and given back when the
//! ceiling denies (`two_calls` in the limiter). Between the charge and its give-back, the
//! caller's concurrent requests read their own limits with that charge in them: a limit of
//! one request denies them, with the wait of a whole refill, and the over-limit cache would
//! repeat that for the whole wait, though the caller never spent a token.
//!
//! A decision across nodes takes a [`Ticket`] under the caller's key and says so before each
//! call that may charge ([`Ticket::charging`]). A decision whose reply has the caller's own
//! limits denying asks [`Ticket::doubt`]: whether a charge of another of the caller's
//! decisions that began before that reply is still open, or one was given back since the
//! ticket began. Then it waits for those charges to settle and, when one was given back,
//! decides once more; a denial still in doubt is answered but not remembered.
//!
//! Bounded by the requests in flight: an entry lives while a ticket or a give-back under way
//! holds it. Only decisions across nodes touch it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

#[derive(Default)]
pub struct InFlight {
    callers: Mutex<HashMap<String, Caller>>,
}

struct Caller {
    /// Tickets and give-backs under way that hold the entry.
    holders: usize,
    /// The next decision's number.
    next: u64,
    /// The decisions whose charge may still be given back, by number.
    open: Vec<u64>,
    /// Charges given back while the entry lived.
    given_back: u64,
    settled: Arc<Notify>,
}

impl InFlight {
    /// A ticket for one decision of the caller whose own limits' key is `key`.
    pub fn begin(self: &Arc<Self>, key: &str) -> Ticket {
        let mut callers = self.lock();
        let caller = callers.entry(key.to_owned()).or_insert_with(|| Caller {
            holders: 0,
            next: 0,
            open: Vec::new(),
            given_back: 0,
            settled: Arc::new(Notify::new()),
        });
        caller.holders += 1;
        let number = caller.next;
        caller.next += 1;
        Ticket {
            in_flight: Arc::clone(self),
            key: key.to_owned(),
            number,
            given_back_at: caller.given_back,
            open: false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Caller>> {
        self.callers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Closes decision `number`'s charge (kept, or `given_back`) and lets one holder go.
    fn close(&self, key: &str, number: Option<u64>, given_back: bool, release: bool) {
        let mut callers = self.lock();
        let Some(caller) = callers.get_mut(key) else {
            return;
        };
        if let Some(number) = number {
            caller.open.retain(|n| *n != number);
            caller.settled.notify_waiters();
        }
        if given_back {
            caller.given_back += 1;
        }
        if release {
            caller.holders -= 1;
            if caller.holders == 0 {
                callers.remove(key);
            }
        }
    }

    #[cfg(test)]
    fn callers(&self) -> usize {
        self.lock().len()
    }
}

/// One decision's place among its caller's. Dropped, it closes its charge as kept.
pub struct Ticket {
    in_flight: Arc<InFlight>,
    key: String,
    number: u64,
    /// The caller's give-backs when the ticket began (or was renewed).
    given_back_at: u64,
    /// A charge of this decision may still be given back.
    open: bool,
}

/// What a denial by the caller's own limits waits for before it is believed.
pub struct Doubt {
    settled: Arc<Notify>,
    /// The caller's decisions numbered below this began before the denial was read: one of
    /// their charges may be in it.
    horizon: u64,
}

impl Ticket {
    /// Before a call that charges the caller's own limits.
    pub fn charging(&mut self) {
        let mut callers = self.in_flight.lock();
        if let Some(caller) = callers.get_mut(&self.key) {
            caller.open.push(self.number);
            self.open = true;
        }
    }

    /// The charge is kept (the ceilings admitted), or was never made (the call denied).
    pub fn settled(&mut self) {
        if std::mem::take(&mut self.open) {
            self.in_flight
                .close(&self.key, Some(self.number), false, false);
        }
    }

    /// The charge is being given back: the returned handle closes it when the give-back is
    /// over, however long that takes after this decision is answered.
    pub fn giving_back(&mut self) -> GiveBack {
        let number = std::mem::take(&mut self.open).then_some(self.number);
        if let Some(caller) = self.in_flight.lock().get_mut(&self.key) {
            caller.holders += 1;
        }
        GiveBack {
            in_flight: Arc::clone(&self.in_flight),
            key: self.key.clone(),
            number,
        }
    }

    /// Whether a denial by the caller's own limits, read now, may have been made by a
    /// charge that is given back: another decision of the caller has one open (begun before
    /// or after this one: their calls reach Redis in either order), or one was given back
    /// since this ticket began.
    pub fn doubt(&self) -> Option<Doubt> {
        let callers = self.in_flight.lock();
        let caller = callers.get(&self.key)?;
        let open = caller.open.iter().any(|n| *n != self.number);
        (open || caller.given_back != self.given_back_at).then(|| Doubt {
            settled: Arc::clone(&caller.settled),
            horizon: caller.next,
        })
    }

    /// Whether a charge of the caller was given back since this ticket began.
    pub fn given_back_since(&self) -> bool {
        self.in_flight
            .lock()
            .get(&self.key)
            .is_some_and(|c| c.given_back != self.given_back_at)
    }

    /// Waits, at most `within`, until no other decision of the caller that began before
    /// the denial was read has a charge open. `false` when the time ran out first.
    pub async fn settle(&self, doubt: Doubt, within: Duration) -> bool {
        let (horizon, own) = (doubt.horizon, self.number);
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = doubt.settled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let open = self
                .in_flight
                .lock()
                .get(&self.key)
                .is_some_and(|c| c.open.iter().any(|n| *n < horizon && *n != own));
            if !open {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }

    /// Starts the ticket afresh, for a second decision of the same request.
    pub fn renew(&mut self) {
        self.settled();
        let mut callers = self.in_flight.lock();
        if let Some(caller) = callers.get_mut(&self.key) {
            self.number = caller.next;
            caller.next += 1;
            self.given_back_at = caller.given_back;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let number = std::mem::take(&mut self.open).then_some(self.number);
        self.in_flight.close(&self.key, number, false, true);
    }
}

/// A give-back under way (see [`Ticket::giving_back`]).
pub struct GiveBack {
    in_flight: Arc<InFlight>,
    key: String,
    number: Option<u64>,
}

impl Drop for GiveBack {
    fn drop(&mut self) {
        self.in_flight
            .close(&self.key, self.number.take(), true, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_denial_read_beside_an_open_charge_is_in_doubt_until_it_settles() {
        let in_flight = Arc::new(InFlight::default());
        let mut first = in_flight.begin("k");
        first.charging();
        let second = in_flight.begin("k");
        assert!(second.doubt().is_some(), "the first's charge is open");
        first.settled();
        assert!(second.doubt().is_none(), "kept: the denial stands");
        drop((first, second));
        assert_eq!(in_flight.callers(), 0);
    }

    #[test]
    fn a_give_back_puts_the_denials_read_before_it_in_doubt() {
        let in_flight = Arc::new(InFlight::default());
        let mut first = in_flight.begin("k");
        let mut second = in_flight.begin("k");
        first.charging();
        let give_back = first.giving_back();
        drop(first);
        assert!(second.doubt().is_some());
        assert!(!second.given_back_since(), "not over yet");
        drop(give_back);
        assert!(second.given_back_since());
        second.renew();
        assert!(
            second.doubt().is_none(),
            "a fresh read after it is believed"
        );
        drop(second);
        assert_eq!(
            in_flight.callers(),
            0,
            "the give-back held the entry, then let it go"
        );
        let other = in_flight.begin("other");
        assert!(other.doubt().is_none(), "callers are apart");
    }

    /// Two decisions of one caller reach Redis in either order: the later one's charge,
    /// made first, may be what denied the earlier.
    #[test]
    fn a_later_decisions_open_charge_puts_an_earlier_denial_in_doubt() {
        let in_flight = Arc::new(InFlight::default());
        let first = in_flight.begin("k");
        let mut second = in_flight.begin("k");
        second.charging();
        assert!(first.doubt().is_some(), "the second's charge is open");
        second.settled();
        assert!(first.doubt().is_none(), "kept: the denial stands");
    }

    #[tokio::test]
    async fn settling_waits_for_the_charges_begun_before_the_denial_only() {
        let in_flight = Arc::new(InFlight::default());
        let mut first = in_flight.begin("k");
        first.charging();
        let second = in_flight.begin("k");
        let doubt = second.doubt().expect("open charge");
        let waiting = tokio::spawn(async move {
            let settled = second.settle(doubt, Duration::from_secs(5)).await;
            (settled, second)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // A charge begun after the wait began is not waited for.
        let mut third = in_flight.begin("k");
        third.charging();
        first.settled();
        let (settled, _second) = waiting.await.unwrap();
        assert!(settled);
        let fourth = in_flight.begin("k");
        let doubt = fourth.doubt().expect("the third's charge is open");
        assert!(
            !fourth.settle(doubt, Duration::from_millis(30)).await,
            "time ran out"
        );
        drop(third);
    }
}
