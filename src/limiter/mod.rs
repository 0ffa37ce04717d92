//! The limiter: one limited request's decision, from its endpoint and identity to one of the
//! eight reasons. [`decide`] reads top to bottom: the over-limit cache, the store (through
//! the node's breaker, within the budget), and when Redis did not decide, the fail mode's row
//! of the decision table (`crate::decision::degrade`).
//!
//! The limiter owns no connection and no clock: the store brings Redis's answer, the
//! decision room turns answers and failures into a [`Decision`].

pub mod endpoint;
pub mod heartbeat;
pub mod in_flight;
pub mod inspect;

pub use endpoint::{bucket_key, identity_hash, limit_keys, Endpoint};

use crate::config::{Algorithm, Enforcement, FailMode, Limit, Policy, ONE_TOKEN_MICRO};
use crate::decision::overlimit::OverlimitCache;
use crate::decision::{degrade, Decision, ScriptReply};
use crate::store::{Evaluation, IfLate, ScriptKind, Store};
use in_flight::Ticket;

/// The several-limits script's modes (`lua/limits_multi.lua`).
pub mod mode {
    pub const DECIDE: u64 = 0;
    /// Gives a charge back, its time not known: a sliding window takes it from its current
    /// window, else from the previous one.
    pub const REFUND: u64 = 1;
    pub const CHARGE: u64 = 2;
    /// Decides without writing anything, whatever the outcome.
    pub const PEEK: u64 = 3;
    /// Above this, a refund of a charge made at Redis time `mode - REFUND_AT` (microseconds,
    /// the charging answer's `now`): a sliding window takes it from the window it was charged
    /// in (lua/limits_multi.lua).
    pub const REFUND_AT: u64 = 16;

    /// The mode of a refund of a charge Redis made at `charged_at_us` (0: not known).
    pub fn refund(charged_at_us: u64) -> u64 {
        match charged_at_us {
            0 => REFUND,
            at => REFUND_AT + at,
        }
    }
}

/// What becomes of `policy`'s admission whose answer came too late: a request the fail mode
/// refuses (`fail_closed`, enforced) was not served, and gets its charge back; one that
/// `fail_open` or shadow mode served keeps it.
fn if_late(policy: &Policy) -> IfLate {
    match (policy.fail_mode, policy.mode) {
        (FailMode::FailClosed, Enforcement::Enforce) => IfLate::GivenBack,
        _ => IfLate::Stands,
    }
}

/// The script arguments of one limit at `cost_micro`: its kind, then as the single-limit
/// scripts take them.
pub fn limit_args(limit: &Limit, cost_micro: u64) -> [u64; 4] {
    match limit.algorithm {
        Algorithm::TokenBucket {
            capacity_micro,
            refill_micro_per_sec,
        } => [1, capacity_micro, refill_micro_per_sec, cost_micro],
        Algorithm::SlidingWindow {
            limit,
            window_micro,
        } => [2, limit, window_micro, cost_micro / ONE_TOKEN_MICRO],
        // Never a limit of its own: validation keeps "none" out of [[routes.limits]].
        Algorithm::None => [1, u64::MAX, 0, 0],
    }
}

/// A several-limits decision: the decision, and what Redis said of each limit (in the
/// policy's order; empty when Redis did not decide).
#[derive(Debug, Clone)]
pub struct Several {
    pub decision: Decision,
    pub replies: Vec<ScriptReply>,
    /// The index of the limit that denied (the one with the longest wait).
    pub denied_by: Option<usize>,
}

impl Several {
    fn of(decision: Decision) -> Self {
        Self {
            decision,
            replies: Vec::new(),
            denied_by: None,
        }
    }
}

/// One reply for the whole request: admitted when every limit admitted; a denial waits
/// for the denying limit that takes longest (`None`: one never refills).
fn combine(replies: &[ScriptReply]) -> (ScriptReply, Option<usize>) {
    let mut combined = replies[0];
    combined.allowed = replies.iter().all(|r| r.allowed);
    let mut denied_by = None;
    if !combined.allowed {
        // A limit that never refills says a day (as it does alone); a longer finite wait of
        // another denying limit is the longer one.
        let wait_of = |r: &ScriptReply| {
            r.retry_after
                .unwrap_or(crate::decision::NEVER_REFILLS_RETRY_AFTER_SECS)
        };
        let (index, longest) = replies
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.allowed)
            .max_by_key(|(_, r)| wait_of(r))
            .expect("a denying limit");
        denied_by = Some(index);
        combined.retry_after = longest.retry_after;
        combined.remaining = 0;
        combined.wait_us = replies
            .iter()
            .filter(|r| !r.allowed)
            .map(|r| r.wait_us)
            .try_fold(0, |max, w| w.map(|w| w.max(max)));
    }
    combined.reset = replies
        .iter()
        .map(|r| r.reset)
        .try_fold(0, |max, t| t.map(|t| t.max(max)));
    (combined, denied_by)
}

/// Decides one request against every limit of an endpoint with `[[routes.limits]]`: one
/// `EVALSHA` when the keys share a node (always on one Redis, and on a cluster for the
/// limits of one identity, which share a hash tag); otherwise the caller's own limits first,
/// then the ceilings, and a refund of the caller's limits when a ceiling denies (see
/// docs/algorithms.md). Never waits longer than the budget per call; never fails.
pub async fn decide_limits(store: &Store, endpoint: &Endpoint, identity_hash: &str) -> Several {
    let policy = &endpoint.policy;
    let keys = endpoint.limit_keys(identity_hash);
    // A denial is remembered under the caller's own key, so that it is repeated to that
    // caller only (a ceiling's denial, everyone's, has a place of its own: `across_slots`).
    // Where every limit is a ceiling, any denial is everyone's, and the first key is as good
    // as any.
    let own = policy.limits.iter().position(|l| !l.global).unwrap_or(0);
    let since = endpoint.overlimit.epoch();
    if let Some((denied, replies)) = endpoint.overlimit.denied_with_replies(&keys[own]) {
        let (denied, replies) = with_ceilings_denial(policy, &endpoint.overlimit, denied, replies);
        let mut cached = Several::of(Decision::cached_denial(denied, store.breaker_state()));
        cached.denied_by = Some(denied.limit);
        cached.replies = replies;
        return cached;
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let args_of = |indices: &[usize], mode: u64| {
        let mut args = Vec::with_capacity(1 + 4 * indices.len());
        args.push(mode);
        for i in indices {
            args.extend(limit_args(&policy.limits[*i], policy.cost_micro));
        }
        args
    };
    let across = !store.one_call(&refs);
    let (replies, doubtful) = if !across {
        let all: Vec<usize> = (0..keys.len()).collect();
        let args = args_of(&all, mode::DECIDE);
        let evaluation = store
            .evaluate_limits(&refs, &args, None, if_late(policy))
            .await;
        if let (Ok(replies), true) = (&evaluation.outcome, policy.has_ceilings()) {
            let theirs = (replies.iter().zip(&policy.limits))
                .filter(|(_, l)| l.global)
                .map(|(r, _)| r);
            note_ceilings(&endpoint.overlimit, since, theirs);
        }
        (replies_of(evaluation), false)
    } else {
        decide_across(store, endpoint, &refs, &args_of, since, own).await
    };
    match replies {
        Ok((replies, breaker)) => {
            let (combined, denied_by) = combine(&replies);
            if let (false, Some(wait), Some(limit), false) =
                (combined.allowed, combined.wait_us, denied_by, doubtful)
            {
                // Across nodes, a caller's own denial is repeated for a second at most too:
                // another gateway's charge given back a moment later can make one, which
                // this process cannot see (`in_flight` sees its own).
                let briefly = policy.limits[limit].global || across;
                endpoint.overlimit.remember_several(
                    since,
                    &keys[own],
                    (wait, briefly),
                    limit,
                    &replies,
                );
            }
            Several {
                decision: Decision::by_redis(combined, breaker),
                replies,
                denied_by,
            }
        }
        Err((cause, breaker)) => Several::of(degrade(
            cause,
            policy.fail_mode,
            endpoint.emergency.as_deref(),
            identity_hash,
            breaker,
        )),
    }
}

type Replies = Result<
    (Vec<ScriptReply>, crate::decision::BreakerState),
    (crate::decision::Degradation, crate::decision::BreakerState),
>;

fn replies_of(evaluation: Evaluation<Vec<ScriptReply>>) -> Replies {
    match evaluation.outcome {
        Ok(replies) => Ok((replies, evaluation.breaker)),
        Err(cause) => Err((cause, evaluation.breaker)),
    }
}

/// Whether Redis's replies have one of the caller's own limits denying.
fn own_denied(policy: &Policy, replies: &Replies) -> bool {
    replies.as_ref().is_ok_and(|(replies, _)| {
        replies
            .iter()
            .zip(&policy.limits)
            .any(|(r, l)| !l.global && !r.allowed)
    })
}

/// [`across_slots`], with a denial by the caller's own limits believed only when no charge
/// of the caller that was given back could have made it ([`in_flight`]): when one may have,
/// the denial waits for the caller's charges begun before it to settle and, when one was
/// given back, the request is decided once more, within the one budget. `true` beside the
/// replies: a denial still in doubt, answered but not remembered.
async fn decide_across(
    store: &Store,
    endpoint: &Endpoint,
    keys: &[&str],
    args_of: &impl Fn(&[usize], u64) -> Vec<u64>,
    since: u64,
    own: usize,
) -> (Replies, bool) {
    let policy = &endpoint.policy;
    let started = std::time::Instant::now();
    let mut ticket = endpoint.in_flight.begin(keys[own]);
    let overlimit = (&endpoint.overlimit, since);
    let left = || store.budget().saturating_sub(started.elapsed());
    // Decided once more at most.
    let mut again = false;
    loop {
        let replies = across_slots(
            store,
            policy,
            keys,
            args_of,
            overlimit,
            &mut ticket,
            started,
        )
        .await;
        let doubt = match own_denied(policy, &replies) {
            true => ticket.doubt(),
            false => None,
        };
        let Some(doubt) = doubt else {
            return (replies, false);
        };
        if again || !ticket.settle(doubt, Store::timer_within(left())).await {
            return (replies, true);
        }
        if !ticket.given_back_since() {
            // The charges beside it were kept: the denial was the caller's own.
            return (replies, false);
        }
        if left() < store.budget() / 4 {
            return (replies, true);
        }
        ticket.renew();
        again = true;
    }
}

/// A cluster where the ceilings lie in another slot than the caller's limits. While the
/// ceilings cannot admit anyone (their denial remembered, or their node short-circuiting),
/// every caller is refused after one read of its own limits ([`refused_by_ceilings`]).
/// Otherwise, when one primary holds both, one call decides them in that node's batch;
/// else, or when that call cannot go, [`two_calls`].
async fn across_slots(
    store: &Store,
    policy: &Policy,
    keys: &[&str],
    args_of: &impl Fn(&[usize], u64) -> Vec<u64>,
    (overlimit, since): (&OverlimitCache, u64),
    ticket: &mut Ticket,
    started: std::time::Instant,
) -> Replies {
    let left = || store.budget().saturating_sub(started.elapsed());
    let (own, ceilings): (Vec<usize>, Vec<usize>) =
        (0..keys.len()).partition(|i| !policy.limits[*i].global);
    let pick = |indices: &[usize]| indices.iter().map(|i| keys[*i]).collect::<Vec<&str>>();
    // The ceilings cannot admit the request: their denial is remembered, or their node
    // short-circuits (its breaker open). The caller's limits are read then, not charged and
    // given back a moment later for nothing (which its concurrent requests would take for
    // their own limit's denial), and the ceilings' node is not asked.
    let refusal = match overlimit.ceiling_denied() {
        Some(denial) => Some(Ceilings::Denied(denial)),
        None => store
            .short_circuited(keys[ceilings[0]])
            .map(Ceilings::ShortCircuit),
    };
    if let Some(refusal) = refusal {
        let peeked = store
            .evaluate_limits(
                &pick(&own),
                &args_of(&own, mode::PEEK),
                Some(left()),
                IfLate::Stands,
            )
            .await;
        return refused_by_ceilings(policy, &own, &ceilings, peeked, refusal);
    }
    // The ceilings and the caller's limits on one primary: still one call, in that node's
    // batch, unless it cannot take it now.
    if store.one_node(keys) {
        let all: Vec<usize> = (0..keys.len()).collect();
        let args = args_of(&all, mode::DECIDE);
        let across = store.evaluate_limits_across(keys, &args, left(), if_late(policy));
        if let Some(evaluation) = across.await {
            if let Ok(replies) = &evaluation.outcome {
                note_ceilings(overlimit, since, ceilings.iter().map(|i| &replies[*i]));
            }
            return replies_of(evaluation);
        }
    }
    let split = (&own[..], &ceilings[..]);
    two_calls(
        store,
        policy,
        keys,
        split,
        args_of,
        (overlimit, since),
        (ticket, started),
    )
    .await
}

/// The caller's limits are decided (and charged) first; when they admit, the ceilings are
/// decided; when a ceiling denies or cannot answer, the caller's limits get their cost back
/// before the answer, while the budget lasts. A ceiling's denial is remembered until Redis
/// said it would admit again, and repeated to every caller meanwhile.
async fn two_calls(
    store: &Store,
    policy: &Policy,
    keys: &[&str],
    (own, ceilings): (&[usize], &[usize]),
    args_of: &impl Fn(&[usize], u64) -> Vec<u64>,
    (overlimit, since): (&OverlimitCache, u64),
    (ticket, started): (&mut Ticket, std::time::Instant),
) -> Replies {
    let pick = |indices: &[usize]| indices.iter().map(|i| keys[*i]).collect::<Vec<&str>>();
    let mut replies = vec![None; keys.len()];
    // The decision's one budget, part of which a call across slots may have spent before it
    // had to be split.
    let within = store.budget().saturating_sub(started.elapsed());
    ticket.charging();
    let first = store
        .evaluate_limits(
            &pick(own),
            &args_of(own, mode::DECIDE),
            Some(within),
            if_late(policy),
        )
        .await;
    let first_replies = match first.outcome {
        Ok(replies) => replies,
        Err(cause) => {
            ticket.settled();
            return Err((cause, first.breaker));
        }
    };
    let admitted = first_replies.iter().all(|r| r.allowed);
    if !admitted {
        ticket.settled();
    }
    // When Redis charged the caller's limits (one call, one time): a refund takes the charge
    // from the window it was made in.
    let charged_at = first_replies.first().map_or(0, |r| r.now_us);
    for (i, r) in own.iter().zip(first_replies) {
        replies[*i] = Some(r);
    }
    if !admitted {
        // Denied by the caller's own limits: nothing was charged, and the ceilings are not
        // asked to decide. What they would say is read without writing, with what the
        // first call left of the budget, for the 429's items; a read that fails leaves their
        // items out.
        // With less than a quarter of the budget left, not asked: a read that could only time
        // out would count against the ceiling's node for nothing.
        let left = store.budget().saturating_sub(started.elapsed());
        let peeked = match left >= store.budget() / 4 {
            true => store
                .evaluate_limits(
                    &pick(ceilings),
                    &args_of(ceilings, mode::PEEK),
                    Some(left),
                    IfLate::Stands,
                )
                .await
                .outcome
                .ok(),
            false => None,
        };
        if let Some(peeked) = &peeked {
            note_ceilings(overlimit, since, peeked.iter());
        }
        for (k, i) in ceilings.iter().enumerate() {
            replies[*i] = Some(
                peeked
                    .as_ref()
                    .and_then(|p| p.get(k).copied())
                    .unwrap_or_else(|| untouched(&policy.limits[*i])),
            );
        }
        return Ok((
            replies.into_iter().map(Option::unwrap).collect(),
            first.breaker,
        ));
    }
    // The second call has what the first left of the one budget.
    let left = store.budget().saturating_sub(started.elapsed());
    let second = store
        .evaluate_limits(
            &pick(ceilings),
            &args_of(ceilings, mode::DECIDE),
            Some(left),
            if_late(policy),
        )
        .await;
    // The refund is its own task, so that it is sent whatever becomes of this request; the
    // answer waits for it while the budget lasts, so that the caller's next request (and an
    // admin read) finds the cost given back. Its replies, when in time, are what the
    // caller's limits hold after it.
    let refund = |store: &Store, ticket: &mut Ticket| {
        let giving_back = ticket.giving_back();
        let store = store.clone();
        let keys: Vec<String> = pick(own).into_iter().map(str::to_owned).collect();
        let args = args_of(own, mode::refund(charged_at));
        let left = store.budget().saturating_sub(started.elapsed());
        let task = tokio::spawn(async move {
            // The caller's concurrent denials wait for this to be over.
            let _giving_back = giving_back;
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            match store.evaluate_limits_late(&refs, &args).await.outcome {
                Ok(replies) => Some(replies),
                Err(e) => {
                    tracing::warn!(cause = ?e, "could not give a denied request's cost back to its own limits");
                    None
                }
            }
        });
        async move {
            tokio::time::timeout(Store::timer_within(left), task)
                .await
                .ok()
                .and_then(Result::ok)
                .flatten()
        }
    };
    match second.outcome {
        Ok(second_replies) => {
            note_ceilings(overlimit, since, second_replies.iter());
            if second_replies.iter().all(|r| r.allowed) {
                ticket.settled();
            } else {
                if let Some(refunded) = refund(store, ticket).await {
                    for (i, mut r) in own.iter().zip(refunded) {
                        r.allowed = true;
                        replies[*i] = Some(r);
                    }
                }
            }
            for (i, r) in ceilings.iter().zip(second_replies) {
                replies[*i] = Some(r);
            }
            Ok((
                replies.into_iter().map(Option::unwrap).collect(),
                second.breaker,
            ))
        }
        Err(cause) => {
            refund(store, ticket).await;
            Err((cause, second.breaker))
        }
    }
}

/// What the ceilings said (`replies` are theirs, in their order): a denial is remembered
/// until the longest wait of those that denied, when Redis said each exactly; an admission by
/// every one forgets a denial remembered before. An admission, and a denial already
/// remembered, cost no allocation and no lock.
fn note_ceilings<'a>(
    overlimit: &OverlimitCache,
    since: u64,
    replies: impl Iterator<Item = &'a ScriptReply> + Clone,
) {
    let mut longest: Option<(usize, u64)> = None;
    for (i, r) in replies.clone().enumerate().filter(|(_, r)| !r.allowed) {
        // A denial without its exact wait is not remembered.
        let Some(wait) = r.wait_us else { return };
        if longest.is_none_or(|(_, w)| wait > w) {
            longest = Some((i, wait));
        }
    }
    match longest {
        None => overlimit.ceiling_admits(),
        Some((_, wait)) if overlimit.ceiling_known(wait) => {}
        Some((limit, wait)) => {
            let replies: Vec<ScriptReply> = replies.copied().collect();
            overlimit.remember_ceiling(since, wait, limit, &replies);
        }
    }
}

/// A caller's own remembered denial, with what the ceilings' remembered denial adds while its
/// wait lasts ([`OverlimitCache::ceiling_denying`]): their items as that denial has them and,
/// when a ceiling's wait is the longer, its wait and its name, so that the repeated 429's
/// `Retry-After` is the wait until every limit known to deny admits again (contract
/// section 13). Without a known ceiling denial, the caller's own as remembered.
fn with_ceilings_denial(
    policy: &Policy,
    overlimit: &OverlimitCache,
    mut denied: crate::decision::overlimit::Denied,
    mut replies: Vec<ScriptReply>,
) -> (crate::decision::overlimit::Denied, Vec<ScriptReply>) {
    if !policy.has_ceilings() {
        return (denied, replies);
    }
    let Some((ceiling, theirs)) = overlimit.ceiling_denying() else {
        return (denied, replies);
    };
    let ceilings = || {
        (policy.limits.iter().enumerate())
            .filter(|(_, l)| l.global)
            .map(|(i, _)| i)
    };
    if replies.len() == policy.limits.len() {
        for (i, r) in ceilings().zip(theirs) {
            replies[i] = r;
        }
    }
    if ceiling.left_us > denied.left_us {
        if let Some(limit) = ceilings().nth(ceiling.limit) {
            denied = crate::decision::overlimit::Denied { limit, ..ceiling };
        }
    }
    (denied, replies)
}

/// Why the ceilings cannot admit a request without asking them.
enum Ceilings {
    /// Their denial is remembered, and what each said in it.
    Denied((crate::decision::overlimit::Denied, Vec<ScriptReply>)),
    /// Their node's breaker short-circuits: the quarantine left, and its state.
    ShortCircuit((std::time::Duration, crate::decision::BreakerState)),
}

/// The answer to a request the ceilings cannot admit, with the caller's own limits as Redis
/// read them without writing (`peeked`; when it could not, they are left out of the
/// answer's items). Remembered denial: the ceilings as the memory has them, the one that
/// denied with what is left of its wait. Short-circuit: the caller's own limits' 429 when
/// they refuse, else the ceilings' `circuit_open`.
fn refused_by_ceilings(
    policy: &Policy,
    own: &[usize],
    ceilings: &[usize],
    peeked: crate::store::Evaluation<Vec<ScriptReply>>,
    refusal: Ceilings,
) -> Replies {
    let mut replies: Vec<ScriptReply> = policy.limits.iter().map(untouched).collect();
    let mine = peeked.outcome;
    if let Ok(mine) = &mine {
        for (i, r) in own.iter().zip(mine) {
            replies[*i] = *r;
        }
    }
    let (denied, remembered) = match refusal {
        Ceilings::Denied(denial) => denial,
        Ceilings::ShortCircuit((retry_in, state)) => {
            return match mine {
                Ok(mine) if !mine.iter().all(|r| r.allowed) => Ok((replies, peeked.breaker)),
                Ok(_) => Err((
                    crate::decision::Degradation::BreakerOpen { retry_in },
                    state,
                )),
                Err(cause) => Err((cause, peeked.breaker)),
            }
        }
    };
    for (k, i) in ceilings.iter().enumerate() {
        if let Some(r) = remembered.get(k) {
            replies[*i] = ScriptReply {
                allowed: true,
                ..*r
            };
        }
    }
    // The one that denied is refused whatever the memory kept of the others.
    let k = denied.limit.min(ceilings.len() - 1);
    let refused = &mut replies[ceilings[k]];
    refused.allowed = false;
    refused.remaining = refused.remaining.min(0);
    refused.retry_after = Some(denied.left_us.div_ceil(1_000_000));
    refused.wait_us = Some(denied.left_us);
    Ok((replies, peeked.breaker))
}

/// Charges `micro` micro-tokens, a cost the upstream reported for a request that was
/// admitted, to every token-bucket limit of `endpoint` for the caller: one `EVALSHA`
/// (two on a cluster where a ceiling lives on another slot than the caller's limits). A
/// bucket may go down to minus its capacity. Goes through the node's breaker as a decision
/// does; a failure is not retried.
pub async fn charge(
    store: &Store,
    endpoint: &Endpoint,
    identity_hash: &str,
    micro: u64,
) -> Result<(), crate::decision::Degradation> {
    let policy = &endpoint.policy;
    let keys = if policy.several {
        endpoint.limit_keys(identity_hash)
    } else {
        vec![endpoint.bucket_key(identity_hash)]
    };
    let buckets: Vec<usize> = (0..policy.limits.len())
        .filter(|i| matches!(policy.limits[*i].algorithm, Algorithm::TokenBucket { .. }))
        .collect();
    let (own, ceilings): (Vec<usize>, Vec<usize>) =
        buckets.iter().partition(|i| !policy.limits[**i].global);
    let all_keys: Vec<&str> = buckets.iter().map(|i| keys[*i].as_str()).collect();
    let groups = if store.one_call(&all_keys) {
        vec![buckets]
    } else {
        vec![own, ceilings]
    };
    for group in groups.iter().filter(|g| !g.is_empty()) {
        let refs: Vec<&str> = group.iter().map(|i| keys[*i].as_str()).collect();
        let mut args = Vec::with_capacity(1 + 4 * group.len());
        args.push(mode::CHARGE);
        for i in group {
            args.extend(limit_args(&policy.limits[*i], micro));
        }
        store
            .evaluate_limits(&refs, &args, None, IfLate::Stands)
            .await
            .outcome?;
    }
    Ok(())
}

/// The item of a limit that was not asked: admitted, full, nothing known.
fn untouched(limit: &Limit) -> ScriptReply {
    let remaining = match limit.algorithm {
        Algorithm::TokenBucket { capacity_micro, .. } => capacity_micro as i64,
        Algorithm::SlidingWindow { limit, .. } => limit as i64,
        Algorithm::None => 0,
    };
    ScriptReply {
        allowed: true,
        remaining,
        retry_after: Some(0),
        reset: Some(0),
        now_us: 0,
        wait_us: None,
    }
}

/// Which script decides `policy`, and its arguments; `None` for `algorithm = "none"`.
fn script_call(policy: &Policy) -> Option<(ScriptKind, [u64; 3])> {
    match policy.algorithm {
        Algorithm::TokenBucket {
            capacity_micro,
            refill_micro_per_sec,
        } => Some((
            ScriptKind::TokenBucket,
            [capacity_micro, refill_micro_per_sec, policy.cost_micro],
        )),
        Algorithm::SlidingWindow {
            limit,
            window_micro,
        } => Some((
            ScriptKind::SlidingWindow,
            [limit, window_micro, policy.cost_micro / ONE_TOKEN_MICRO],
        )),
        Algorithm::None => None,
    }
}

/// Decides one request for `endpoint` by the caller whose identity hashes to
/// `identity_hash`. Never waits longer than the store's budget; never fails.
pub async fn decide(store: &Store, endpoint: &Endpoint, identity_hash: &str) -> Decision {
    let Some((kind, args)) = script_call(&endpoint.policy) else {
        return Decision::unlimited(store.breaker_state());
    };
    let key = endpoint.bucket_key(identity_hash);
    if let Some(denied) = endpoint.overlimit.denied_for(&key) {
        return Decision::cached_denial(denied, store.breaker_state());
    }
    let since = endpoint.overlimit.epoch();
    let evaluation = store
        .evaluate(kind, &key, args, if_late(&endpoint.policy))
        .await;
    match evaluation.outcome {
        Ok(reply) => {
            if let (false, Some(wait)) = (reply.allowed, reply.wait_us) {
                let limit = (0, reply.reset);
                endpoint.overlimit.remember(since, &key, wait, limit);
            }
            Decision::by_redis(reply, evaluation.breaker)
        }
        Err(cause) => degrade(
            cause,
            endpoint.policy.fail_mode,
            endpoint.emergency.as_deref(),
            identity_hash,
            evaluation.breaker,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(allowed: bool, retry_after: Option<u64>) -> ScriptReply {
        ScriptReply {
            allowed,
            remaining: 0,
            retry_after,
            reset: retry_after,
            now_us: 0,
            wait_us: None,
        }
    }

    #[test]
    fn a_denial_waits_for_the_denying_limit_that_takes_longest() {
        let admitted = reply(true, None);
        // A limit that never refills counts as a day: a longer finite wait wins.
        for (limits, retry, by) in [
            (
                vec![admitted, reply(false, Some(30)), reply(false, Some(7))],
                Some(30),
                1,
            ),
            (vec![reply(false, Some(30)), reply(false, None)], None, 1),
            (
                vec![reply(false, None), reply(false, Some(200_000))],
                Some(200_000),
                1,
            ),
            (
                vec![reply(false, Some(200_000)), admitted, reply(false, None)],
                Some(200_000),
                0,
            ),
        ] {
            let (combined, denied_by) = combine(&limits);
            assert!(!combined.allowed);
            assert_eq!(
                (combined.retry_after, denied_by),
                (retry, Some(by)),
                "{limits:?}"
            );
        }
        let (combined, denied_by) = combine(&[admitted, admitted]);
        assert!(combined.allowed && denied_by.is_none());
    }
}
