//! The over-limit cache: when Redis denies a bucket and says exactly when the request would
//! next be admitted, that bucket's requests are denied locally until then, without a Redis
//! call. It only ever repeats a denial Redis gave; it never admits.
//!
//! Exact for the token bucket up to one round trip: a denial never changes the bucket, and
//! only time refills it, so no request another gateway decides can make a token appear
//! sooner. An operator's reset can: the gateway it is sent to forgets the identity here, and
//! announces it to the others (`store/channel.rs`). The
//! deadline is taken on the local monotonic clock when the answer arrives, which is after
//! Redis evaluated: a client may be refused up to one round trip after its token appeared,
//! never before. The sliding window uses the moment its estimate would admit the request.
//!
//! Bounded: a fixed number of keys per endpoint; when full, a new denial replaces the least
//! asked of a few entries spread over the full part by the clock, an ended one first, and
//! ended entries are dropped at most once a second. Each endpoint has its own cache, rebuilt
//! on every reload, so a reload or a new `policy_version` starts with an empty one.
//!
//! A ceiling's denial (on a cluster, where the ceilings live on another slot than the
//! callers' limits) is everyone's: it has a place of its own, never short of room, read
//! without a lock while none holds. An operator's reset ([`OverlimitCache::forget`],
//! [`OverlimitCache::clear`]) starts a new epoch: a denial Redis gave before it, remembered
//! after it, is dropped (`since`).

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;
use indexmap::IndexMap;

use crate::clock::SharedClock;
use crate::decision::ScriptReply;

/// Whether any cache of the process ever remembered a denial ([`first_remembered`]).
static REMEMBERED: AtomicBool = AtomicBool::new(false);
static FIRST_REMEMBERED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Done once any over-limit cache of the process has remembered a denial: from then on the
/// process listens for other gateways' resets (`store/channel.rs`).
pub async fn first_remembered() {
    loop {
        let notified = FIRST_REMEMBERED.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if REMEMBERED.load(Ordering::Relaxed) {
            return;
        }
        notified.await;
    }
}

/// Whether the process's first attempt to listen for other gateways' resets, made at its
/// first remembered denial, has ended (subscribed, refused or failed): until then a denial
/// Redis gave is answered only once it has ([`until_hearing`]).
static TRIED: AtomicBool = AtomicBool::new(false);
static TRIED_NOW: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Says the first attempt to listen for resets has ended, whatever became of it.
pub fn tried_listening() {
    if !TRIED.swap(true, Ordering::Relaxed) {
        TRIED_NOW.notify_waiters();
    }
}

/// Whether a denial Redis gave can be answered at once: the process has not remembered one
/// yet (it does not listen, and needs not), or has tried to listen.
pub fn hearing() -> bool {
    TRIED.load(Ordering::Relaxed) || !REMEMBERED.load(Ordering::Relaxed)
}

/// Waits, up to `left`, until the first attempt to listen for resets has ended. A gateway's
/// first remembered denial starts it listening; its answer waits so that a reset made on
/// another gateway once the client has it (the next thing a client that was refused may
/// ask an operator for) is heard here: a denial remembered before the subscription could not
/// hear it.
pub async fn until_hearing(left: std::time::Duration) {
    let tried = TRIED_NOW.notified();
    tokio::pin!(tried);
    tried.as_mut().enable();
    if TRIED.load(Ordering::Relaxed) {
        return;
    }
    let _ = tokio::time::timeout(left, tried).await;
}

/// The process listened for other gateways' resets and lost its subscription: until it
/// listens again, no denial is remembered (one remembered then could outlive a reset it
/// cannot hear).
static DEAF: AtomicBool = AtomicBool::new(false);

/// Says whether the process lost its subscription to the resets channel (`true`) or holds
/// one again, or gave it up for good (`false`); losing it also forgets every remembered
/// denial (the caller does).
pub fn set_deaf(deaf: bool) {
    DEAF.store(deaf, Ordering::Relaxed);
}

/// Notes that a denial is to be remembered (the first one wakes [`first_remembered`]):
/// false while the process cannot hear resets.
fn remembering() -> bool {
    if !REMEMBERED.load(Ordering::Relaxed) && !REMEMBERED.swap(true, Ordering::Relaxed) {
        FIRST_REMEMBERED.notify_waiters();
    }
    !DEAF.load(Ordering::Relaxed)
}

/// Keys remembered per endpoint per process.
pub const CAPACITY: usize = 16_384;
const SHARDS: usize = 16;

/// A remembered denial, as the cache repeats it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denied {
    /// Microseconds until the request could be admitted.
    pub left_us: u64,
    /// The index of the limit that denied.
    pub limit: usize,
    /// Whole seconds until that limit is full again, rounded up (`None`: never), for the
    /// `RateLimit` field of the repeated 429.
    pub full_in_s: Option<u64>,
}

/// Never full again, in an entry.
const NEVER: u64 = u64::MAX;

/// How long a ceiling's denial is repeated before Redis is asked again, whatever its wait: a
/// ceiling is everyone's, and a give-back (a `fail_closed` admission answered too late), an
/// operator's reset on another gateway or a `FLUSHALL` can make room before the wait ends.
/// Its `Retry-After` is still the whole wait.
pub const CEILING_KEPT_US: u64 = 1_000_000;

/// Two readings of one ceilings' denial, from answers Redis gave at different moments, end
/// within this of each other ([`OverlimitCache::ceiling_known`]).
const KNOWN_WITHIN_US: u64 = 100_000;

/// A remembered denial, times in microseconds of the local clock.
struct Entry {
    /// Denied until then.
    until: u64,
    /// Repeated until then (at most `until`): a denial of everyone's is asked again sooner.
    kept: u64,
    /// When the limit that denied is full again, or `NEVER`.
    full_at: u64,
    /// The index of the limit that denied.
    limit: u8,
    /// The requests it answered: when the cache is full, a new denial takes the place of
    /// the least asked of a few ([`insert`]), so that identities made up to fill it (each
    /// denied once) cannot keep a hot one out.
    hits: u32,
    /// With several limits, what each said ([`Other`]), for the `RateLimit` fields of the
    /// repeated 429, which carry one item per limit.
    limits: Option<Box<[Other]>>,
}

/// One limit's answer in a denial of several limits.
struct Other {
    remaining: i64,
    /// When it is full again, or `NEVER`.
    full_at: u64,
    /// Redis was asked about it (a ceiling after the caller's own limits denied, on a
    /// cluster, is not).
    asked: bool,
}

/// A part of the cache under one lock: its entries, in a map with places by index (so that
/// a full one looks at a few places in constant time), and when its ended entries were last
/// dropped.
#[derive(Default)]
struct Entries {
    map: IndexMap<String, Entry>,
    swept_at: u64,
    /// Replacements made: with the clock, where the next one looks.
    turns: u64,
}

type Shard = Mutex<Entries>;

pub struct OverlimitCache {
    shards: Vec<Shard>,
    hasher: RandomState,
    clock: SharedClock,
    /// Until when the ceiling's denial is repeated (local clock, microseconds; 0: none), read
    /// before it.
    ceiling_until: AtomicU64,
    /// Until when the ceiling's remembered denial said it would deny (its whole wait; 0:
    /// none, or it admitted since), read before it.
    ceiling_denies_until: AtomicU64,
    /// Read without a lock; written under `ceiling_writes`, which orders a write against a
    /// reset's new epoch.
    ceiling: ArcSwapOption<Entry>,
    ceiling_writes: Mutex<()>,
    /// Raised by every reset.
    epoch: AtomicU64,
}

/// Whole seconds from `now` until `at`, rounded up; `None` for `NEVER`.
fn seconds_until(at: u64, now: u64) -> Option<u64> {
    (at != NEVER).then(|| at.saturating_sub(now).div_ceil(1_000_000))
}

impl OverlimitCache {
    pub fn new(clock: SharedClock) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            clock,
            ceiling_until: AtomicU64::new(0),
            ceiling_denies_until: AtomicU64::new(0),
            ceiling: ArcSwapOption::empty(),
            ceiling_writes: Mutex::new(()),
            epoch: AtomicU64::new(0),
        }
    }

    /// The current epoch: read before asking Redis, handed to a `remember` after.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    fn shard(&self, key: &str) -> &Shard {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// The remembered denial of `key`, if it still holds.
    pub fn denied_for(&self, key: &str) -> Option<Denied> {
        self.lookup(key, |_, _| ()).map(|(denied, ())| denied)
    }

    /// The remembered denial of `key` and, when it was remembered with several limits,
    /// each limit's answer as Redis gave it, its reset counted down to now.
    pub fn denied_with_replies(&self, key: &str) -> Option<(Denied, Vec<ScriptReply>)> {
        self.lookup(key, replies_of)
    }

    /// The ceilings' remembered denial, as [`denied_with_replies`](Self::denied_with_replies)
    /// gives a caller's.
    pub fn ceiling_denied(&self) -> Option<(Denied, Vec<ScriptReply>)> {
        self.ceiling_while(&self.ceiling_until, |e| e.kept)
    }

    /// The ceilings' last denial while its wait lasts (past the moment it stops being
    /// repeated, [`CEILING_KEPT_US`]) and no admission by them was seen since: what a
    /// caller's own remembered denial adds to its answer, so that its `Retry-After` is the
    /// wait until every limit known to deny admits again. `Denied::limit` counts among the
    /// ceilings.
    pub fn ceiling_denying(&self) -> Option<(Denied, Vec<ScriptReply>)> {
        self.ceiling_while(&self.ceiling_denies_until, |e| e.until)
    }

    /// The ceilings' remembered denial while `end` of it is to come (`until`, its atomic copy).
    fn ceiling_while(
        &self,
        until: &AtomicU64,
        end: impl Fn(&Entry) -> u64,
    ) -> Option<(Denied, Vec<ScriptReply>)> {
        let now = self.clock.now_us();
        if until.load(Ordering::Relaxed) <= now {
            return None;
        }
        let ceiling = self.ceiling.load();
        let entry = ceiling.as_deref().filter(|e| end(e) > now)?;
        Some((denied_of(entry, now), replies_of(entry, now)))
    }

    /// Whether a ceilings' denial of `wait_us` from now is the one remembered, still repeated
    /// for half of [`CEILING_KEPT_US`] or more: remembering it again would change nothing but
    /// a moment (under a flood every refused request says it).
    pub fn ceiling_known(&self, wait_us: u64) -> bool {
        let now = self.clock.now_us();
        self.ceiling_until.load(Ordering::Relaxed) >= now + CEILING_KEPT_US / 2
            && (self.ceiling_denies_until.load(Ordering::Relaxed)).abs_diff(now + wait_us)
                <= KNOWN_WITHIN_US
    }

    /// The ceilings admitted a request (a give-back, a reset elsewhere, or time made room):
    /// their remembered denial is forgotten.
    pub fn ceiling_admits(&self) {
        if self.ceiling_denies_until.load(Ordering::Relaxed) > self.clock.now_us() {
            self.drop_ceiling();
        }
    }

    fn drop_ceiling(&self) {
        let _writing = self
            .ceiling_writes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        self.ceiling_until.store(0, Ordering::Relaxed);
        self.ceiling_denies_until.store(0, Ordering::Relaxed);
        self.ceiling.store(None);
    }

    fn lookup<T>(&self, key: &str, also: impl FnOnce(&Entry, u64) -> T) -> Option<(Denied, T)> {
        let now = self.clock.now_us();
        let mut shard = self.shard(key).lock().unwrap_or_else(|p| p.into_inner());
        match shard.map.get_mut(key) {
            Some(entry) if entry.kept > now => {
                entry.hits = entry.hits.saturating_add(1);
                Some((denied_of(entry, now), also(entry, now)))
            }
            Some(_) => {
                shard.map.swap_remove(key);
                None
            }
            None => None,
        }
    }

    /// Remembers that Redis denied `key` for the next `wait_us` microseconds, by the limit
    /// of index `limit`, which is full again in `full_in_s` seconds (`None`: never), Redis
    /// having been asked in epoch `since` (a reset or a give-back since: not remembered).
    pub fn remember(
        &self,
        since: u64,
        key: &str,
        wait_us: u64,
        (limit, full_in_s): (usize, Option<u64>),
    ) {
        let now = self.clock.now_us();
        let mut entry = entry(now, wait_us, limit, &[]);
        entry.full_at = at(now, full_in_s);
        let mut shard = self.shard(key).lock().unwrap_or_else(|p| p.into_inner());
        if self.epoch() == since {
            insert(&mut shard, key, entry, now);
        }
    }

    /// [`remember`](Self::remember) with every limit's answer of a route with several, Redis
    /// having been asked in epoch `since`; `briefly`: the denial is repeated for
    /// [`CEILING_KEPT_US`] at most (the limit that denied is everyone's, or its limits live
    /// on several nodes, where another gateway's charge given back can make a denial).
    pub fn remember_several(
        &self,
        since: u64,
        key: &str,
        (wait_us, briefly): (u64, bool),
        limit: usize,
        replies: &[ScriptReply],
    ) {
        let now = self.clock.now_us();
        let mut entry = entry(now, wait_us, limit, replies);
        if briefly {
            entry.kept = entry.kept.min(now + CEILING_KEPT_US);
        }
        let mut shard = self.shard(key).lock().unwrap_or_else(|p| p.into_inner());
        if self.epoch() == since {
            insert(&mut shard, key, entry, now);
        }
    }

    /// Remembers the ceilings' denial: `replies` are theirs, in their order, Redis having been
    /// asked in epoch `since`.
    pub fn remember_ceiling(
        &self,
        since: u64,
        wait_us: u64,
        limit: usize,
        replies: &[ScriptReply],
    ) {
        let now = self.clock.now_us();
        let mut entry = entry(now, wait_us, limit, replies);
        entry.kept = entry.kept.min(now + CEILING_KEPT_US);
        let _writing = self
            .ceiling_writes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if self.epoch() == since && remembering() {
            self.ceiling_until.store(entry.kept, Ordering::Relaxed);
            self.ceiling_denies_until
                .store(entry.until, Ordering::Relaxed);
            self.ceiling.store(Some(Arc::new(entry)));
        }
    }

    /// Forgets a remembered denial of `key` (an operator reset the bucket, or a charge
    /// answered too late was given back to it: a denial read before the give-back may have
    /// been made by that charge), and the ceilings' (the charge given back may have been
    /// theirs).
    pub fn forget(&self, key: &str) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.shard(key)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .swap_remove(key);
        self.drop_ceiling();
    }

    /// Forgets every remembered denial, the ceilings' too (an operator reset a ceiling every
    /// caller shares).
    pub fn clear(&self) {
        self.epoch.fetch_add(1, Ordering::SeqCst);
        for shard in &self.shards {
            shard.lock().unwrap_or_else(|p| p.into_inner()).map.clear();
        }
        self.drop_ceiling();
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).map.len())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The microseconds of the local clock `s` seconds after `now`; `NEVER` for `None`.
fn at(now: u64, s: Option<u64>) -> u64 {
    s.map_or(NEVER, |s| now.saturating_add(s.saturating_mul(1_000_000)))
}

/// A denial for `wait_us` from `now` by the limit of index `limit`, with every limit's answer
/// (none for a single limit).
fn entry(now: u64, wait_us: u64, limit: usize, replies: &[ScriptReply]) -> Entry {
    let limits = (!replies.is_empty()).then(|| {
        replies
            .iter()
            .map(|r| Other {
                remaining: r.remaining,
                full_at: at(now, r.reset),
                asked: r.now_us > 0,
            })
            .collect()
    });
    Entry {
        until: now + wait_us,
        kept: now + wait_us,
        full_at: at(now, replies.get(limit).and_then(|r| r.reset)),
        limit: u8::try_from(limit).unwrap_or(u8::MAX),
        hits: 0,
        limits,
    }
}

/// How many entries a full shard compares to choose the one a new denial replaces.
const EVICTION_SAMPLE: usize = 8;
const _: () = assert!(CAPACITY / SHARDS >= EVICTION_SAMPLE);

/// How often a full shard drops its ended entries (microseconds).
const SWEEP_EVERY_US: u64 = 1_000_000;

/// Puts `entry` in `shard`. A full shard drops its ended entries (once a second at most: a
/// pass over all of them), and when still full, the new denial takes the place of the least
/// asked of [`EVICTION_SAMPLE`] entries spread over the shard ([`victim`]: an ended one
/// first, then the one ending soonest among equals): a cache filled with identities denied
/// once, never asked again, took no new denial until theirs ended, a hot identity's
/// included; and a pass over the shard at every new denial cost a flood of them 4.7 us
/// each, the sample 0.35 us, the new key's allocation included (`cargo bench --bench
/// hot_path overlimit_remember_full`).
fn insert(shard: &mut Entries, key: &str, entry: Entry, now: u64) {
    if !remembering() {
        return;
    }
    if let Some(old) = shard.map.get_mut(key) {
        *old = entry;
        return;
    }
    if shard.map.len() >= CAPACITY / SHARDS && now >= shard.swept_at + SWEEP_EVERY_US {
        shard.swept_at = now;
        shard.map.retain(|_, e| e.kept > now);
    }
    if shard.map.len() >= CAPACITY / SHARDS {
        shard.turns += 1;
        if let Some(i) = victim(&shard.map, now, now ^ shard.turns.rotate_left(40)) {
            shard.map.swap_remove_index(i);
        }
    }
    shard.map.insert(key.to_owned(), entry);
}

/// Which of `entries` a new denial replaces (`now`: the clock; `seed`: it, told apart from
/// the shard's earlier replacements): of [`EVICTION_SAMPLE`] places the seed spreads over
/// them (no random source: the same seed chooses the same), an entry ended by `now` first,
/// then the least asked, then the one ending soonest.
fn victim(entries: &IndexMap<String, Entry>, now: u64, seed: u64) -> Option<usize> {
    let len = entries.len() as u64;
    let mut x = seed;
    (0..EVICTION_SAMPLE)
        .map(|_| {
            // SplitMix64's step: places far apart for clocks a microsecond apart.
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) % len.max(1)) as usize
        })
        .filter(|&i| i < entries.len())
        .min_by_key(|&i| {
            let e = &entries[i];
            (e.kept > now, e.hits, e.kept)
        })
}

fn denied_of(entry: &Entry, now: u64) -> Denied {
    Denied {
        left_us: entry.until - now,
        limit: usize::from(entry.limit),
        full_in_s: seconds_until(entry.full_at, now),
    }
}

/// Each limit's answer as the entry kept it, its reset counted down to `now`; the denying
/// limit's with the wait left (its `RateLimit` item's `t` is never below it).
fn replies_of(entry: &Entry, now: u64) -> Vec<ScriptReply> {
    let Some(limits) = &entry.limits else {
        return Vec::new();
    };
    let denying = usize::from(entry.limit);
    limits
        .iter()
        .enumerate()
        .map(|(i, l)| ScriptReply {
            allowed: false,
            remaining: l.remaining,
            retry_after: (i == denying).then(|| (entry.until - now).div_ceil(1_000_000)),
            reset: seconds_until(l.full_at, now),
            now_us: u64::from(l.asked),
            wait_us: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn repeats_a_denial_until_its_deadline_only() {
        let clock = ManualClock::default();
        let cache = OverlimitCache::new(Arc::new(clock.clone()));
        assert_eq!(cache.denied_for("k"), None);
        cache.remember(cache.epoch(), "k", 1_500_000, (2, Some(10)));
        let denied = |left_us, full_in_s| {
            Some(Denied {
                left_us,
                limit: 2,
                full_in_s,
            })
        };
        assert_eq!(cache.denied_for("k"), denied(1_500_000, Some(10)));
        clock.advance(Duration::from_millis(1_499));
        assert_eq!(
            cache.denied_for("k"),
            denied(1_000, Some(9)),
            "9.0015 s: 9 s"
        );
        clock.advance(Duration::from_millis(1));
        assert_eq!(
            cache.denied_for("k"),
            None,
            "expired exactly at the deadline"
        );
        assert!(cache.is_empty());
    }

    #[test]
    fn a_denial_of_several_limits_keeps_each_answer_and_counts_its_reset_down() {
        let clock = ManualClock::default();
        let cache = OverlimitCache::new(Arc::new(clock.clone()));
        let reply = |remaining, reset, now_us| ScriptReply {
            allowed: false,
            remaining,
            retry_after: None,
            reset,
            now_us,
            wait_us: None,
        };
        let given = [
            reply(0, Some(300), 7),
            reply(2_000_000, Some(40), 7),
            reply(0, None, 0),
        ];
        cache.remember_several(cache.epoch(), "k", (60_000_000, false), 0, &given);
        clock.advance(Duration::from_secs(10));
        let (denied, replies) = cache.denied_with_replies("k").unwrap();
        assert_eq!((denied.limit, denied.full_in_s), (0, Some(290)));
        let seen: Vec<_> = replies
            .iter()
            .map(|r| (r.remaining, r.reset, r.now_us > 0, r.retry_after))
            .collect();
        // The denying limit (the first) says the wait left, 50 s of the 60: its RateLimit
        // item's `t` is never below it.
        assert_eq!(
            seen,
            [
                (0, Some(290), true, Some(50)),
                (2_000_000, Some(30), true, None),
                (0, None, false, None)
            ]
        );
        // A single limit's denial has no list.
        cache.remember(cache.epoch(), "one", 5_000_000, (0, Some(3)));
        assert!(cache.denied_with_replies("one").unwrap().1.is_empty());
    }

    /// A ceiling's denial for 30 s, as Redis gives it.
    fn ceiling_denial() -> ScriptReply {
        ScriptReply {
            allowed: false,
            remaining: 0,
            retry_after: Some(30),
            reset: Some(60),
            now_us: 7,
            wait_us: Some(30_000_000),
        }
    }

    #[test]
    fn a_ceilings_denial_holds_until_its_wait_and_an_operators_reset_wins_over_a_late_one() {
        let clock = ManualClock::default();
        let cache = OverlimitCache::new(Arc::new(clock.clone()));
        let reply = ceiling_denial();
        assert!(cache.ceiling_denied().is_none());
        cache.remember_ceiling(cache.epoch(), 30_000_000, 0, &[reply]);
        clock.advance(Duration::from_millis(400));
        let (denied, replies) = cache.ceiling_denied().unwrap();
        assert_eq!(
            (denied.left_us, denied.limit),
            (29_600_000, 0),
            "the whole wait"
        );
        assert_eq!(replies[0].reset, Some(60), "counted down");
        clock.advance(Duration::from_millis(600));
        assert!(
            cache.ceiling_denied().is_none(),
            "asked again after a second"
        );
        // A caller's memory of a ceiling's denial too; of its own limit's, the whole wait.
        cache.remember_several(cache.epoch(), "by-ceiling", (30_000_000, true), 0, &[reply]);
        cache.remember_several(cache.epoch(), "by-own", (30_000_000, false), 0, &[reply]);
        clock.advance(Duration::from_secs(1));
        assert!(cache.denied_for("by-ceiling").is_none());
        assert_eq!(cache.denied_for("by-own").unwrap().left_us, 29_000_000);

        // Asked before a reset, answered after it: not remembered.
        cache.remember_ceiling(cache.epoch(), 30_000_000, 0, &[reply]);
        let since = cache.epoch();
        cache.clear();
        assert!(cache.ceiling_denied().is_none(), "cleared");
        cache.remember_ceiling(since, 30_000_000, 0, &[reply]);
        cache.remember_several(since, "own", (30_000_000, false), 0, &[reply]);
        assert!(
            cache.ceiling_denied().is_none(),
            "a denial from before the reset"
        );
        assert!(cache.denied_for("own").is_none());
        // A caller's reset starts a new epoch too.
        let since = cache.epoch();
        cache.forget("someone");
        cache.remember_several(since, "own", (30_000_000, false), 0, &[reply]);
        assert!(cache.denied_for("own").is_none());
        // Callers' entries leave the ceiling's room alone.
        for i in 0..2 * CAPACITY {
            cache.remember(cache.epoch(), &format!("key-{i}"), 60_000_000, (0, None));
        }
        cache.remember_ceiling(cache.epoch(), 30_000_000, 0, &[reply]);
        assert!(cache.ceiling_denied().is_some(), "never short of room");
    }

    /// What a caller's own remembered denial adds of the ceilings': their denial while its
    /// whole wait lasts (not only the second it is repeated to everyone), until they admit.
    #[test]
    fn a_ceilings_denial_is_known_for_its_whole_wait_until_they_admit() {
        let clock = ManualClock::default();
        let cache = OverlimitCache::new(Arc::new(clock.clone()));
        let reply = ceiling_denial();
        cache.ceiling_admits();
        assert!(cache.ceiling_denying().is_none());
        cache.remember_ceiling(cache.epoch(), 30_000_000, 0, &[reply]);
        clock.advance(Duration::from_secs(10));
        assert!(cache.ceiling_denied().is_none(), "no longer repeated");
        let (denied, replies) = cache.ceiling_denying().unwrap();
        assert_eq!(denied.left_us, 20_000_000);
        assert_eq!((replies[0].remaining, replies[0].reset), (0, Some(50)));
        clock.advance(Duration::from_secs(20));
        assert!(cache.ceiling_denying().is_none(), "its wait is over");
        // An admission by the ceilings forgets it, as a reset does.
        cache.remember_ceiling(cache.epoch(), 30_000_000, 0, &[reply]);
        cache.ceiling_admits();
        assert!(cache.ceiling_denying().is_none() && cache.ceiling_denied().is_none());
        cache.remember_ceiling(cache.epoch(), 30_000_000, 0, &[reply]);
        cache.clear();
        assert!(cache.ceiling_denying().is_none());
        // A give-back (or a caller's reset) forgets it too: the charge may have been theirs.
        cache.remember_ceiling(cache.epoch(), 30_000_000, 0, &[reply]);
        cache.forget("a-caller");
        assert!(cache.ceiling_denying().is_none() && cache.ceiling_denied().is_none());
    }

    /// The same denial said again (every refused request of a flood says it) is known: not
    /// written again while it is repeated for half a second more and ends within 100 ms of it.
    #[test]
    fn a_ceilings_denial_said_again_is_known() {
        let clock = ManualClock::default();
        let cache = OverlimitCache::new(Arc::new(clock.clone()));
        assert!(!cache.ceiling_known(30_000_000), "nothing remembered");
        cache.remember_ceiling(cache.epoch(), 30_000_000, 0, &[]);
        clock.advance(Duration::from_millis(200));
        assert!(cache.ceiling_known(29_800_000), "the same end");
        assert!(cache.ceiling_known(29_750_000), "within 100 ms of it");
        assert!(!cache.ceiling_known(29_000_000), "sooner: room was made");
        assert!(!cache.ceiling_known(31_000_000), "later");
        clock.advance(Duration::from_millis(400));
        assert!(
            !cache.ceiling_known(29_400_000),
            "repeated for less than half a second more"
        );
    }

    #[test]
    fn stays_bounded() {
        let clock = ManualClock::default();
        let cache = OverlimitCache::new(Arc::new(clock.clone()));
        for i in 0..3 * CAPACITY {
            cache.remember(cache.epoch(), &format!("key-{i}"), 60_000_000, (0, None));
        }
        assert!(cache.len() <= CAPACITY);
        clock.advance(Duration::from_secs(61));
        cache.remember(cache.epoch(), "fresh", 1_000_000, (0, None));
        assert_eq!(
            cache.denied_for("fresh").map(|d| (d.left_us, d.full_in_s)),
            Some((1_000_000, None)),
            "expired entries make room"
        );
    }

    /// Full of identities denied once and never asked again (made up to fill it), the cache
    /// still takes a new denial, and keeps the ones asked often: it took none until theirs
    /// ended, 1000 s here.
    #[test]
    fn full_of_denials_never_asked_again_it_takes_new_ones_and_keeps_hot_ones() {
        let clock = ManualClock::default();
        let cache = OverlimitCache::new(Arc::new(clock.clone()));
        let fill = |from: usize| {
            for i in from..from + 2 * CAPACITY {
                cache.remember(
                    cache.epoch(),
                    &format!("once-{i}"),
                    1_000_000_000,
                    (0, None),
                );
            }
        };
        cache.remember(cache.epoch(), "hot", 1_000_000_000, (0, None));
        for _ in 0..100 {
            assert!(cache.denied_for("hot").is_some());
        }
        fill(0);
        assert!(cache.len() <= CAPACITY);
        cache.remember(cache.epoch(), "new", 1_000_000_000, (0, None));
        assert!(cache.denied_for("new").is_some(), "a new denial taken");
        fill(2 * CAPACITY);
        assert!(cache.denied_for("hot").is_some(), "the hot one kept");
        assert!(cache.len() <= CAPACITY);
    }

    /// A full shard drops its ended entries at most once a second (a pass over all of them
    /// at every new denial cost a flood of them 4.7 us each).
    #[test]
    fn a_full_shard_drops_its_ended_entries_once_a_second() {
        let clock = ManualClock::default();
        clock.advance(std::time::Duration::from_secs(2));
        let cache = OverlimitCache::new(Arc::new(clock.clone()));
        for i in 0..2 * CAPACITY {
            cache.remember(cache.epoch(), &format!("brief-{i}"), 500_000, (0, None));
        }
        assert_eq!(cache.len(), CAPACITY);
        clock.advance(std::time::Duration::from_millis(600));
        cache.remember(cache.epoch(), "later", 500_000, (0, None));
        assert_eq!(
            cache.len(),
            CAPACITY,
            "swept less than a second ago: one replaced"
        );
        clock.advance(std::time::Duration::from_millis(500));
        cache.remember(cache.epoch(), "after", 500_000, (0, None));
        assert!(
            cache.len() < CAPACITY - CAPACITY / SHARDS / 2,
            "the new denial's shard swept: {}",
            cache.len()
        );
    }

    /// A new denial takes an ended entry's place before a live one's, however often the
    /// ended one was asked.
    #[test]
    fn a_replacement_takes_an_ended_entry_before_a_live_one() {
        let mut entries = IndexMap::new();
        for i in 0..1024 {
            let mut e = entry(0, 100, 0, &[]);
            e.hits = 5;
            if i == 512 {
                e = entry(0, 1_000_000_000, 0, &[]);
            }
            entries.insert(format!("k{i}"), e);
        }
        for seed in 0..2_000 {
            let i = victim(&entries, 1_000, seed).expect("a victim");
            assert_ne!(i, 512, "seed {seed}");
        }
    }
}
