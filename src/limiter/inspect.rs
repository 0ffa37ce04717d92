//! What an operator sees of, and does to, one identity's buckets (`/limits` on the admin):
//! read without writing, or deleted so the identity starts full. Off the request path.

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::{Algorithm, EndpointId, Limit, ONE_TOKEN_MICRO};
use crate::decision::sliding_window::{Window, WindowState};
use crate::decision::token_bucket::{Bucket, BucketState};
use crate::decision::StoreFailure;
use crate::store::{Announced, Store};

use super::Endpoint;

pub use crate::config::DEFAULT_LIMIT;

/// One limit of an endpoint as one identity stands in it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LimitView {
    pub name: String,
    pub algorithm: &'static str,
    /// Whole requests at the route's cost, rounded down.
    pub remaining: i64,
    /// Whole requests at the route's cost.
    pub capacity: u64,
    /// Whole seconds until full again; `None` when it never refills.
    pub reset_seconds: Option<u64>,
}

/// Every limit of `endpoint` with the key it has for the identity, in the policy's order.
fn keyed<'e>(endpoint: &'e Endpoint, identity_hash: &str) -> Vec<(&'e Limit, String)> {
    let policy = &endpoint.policy;
    let keys = if policy.several {
        endpoint.limit_keys(identity_hash)
    } else {
        vec![endpoint.bucket_key(identity_hash)]
    };
    policy.limits.iter().zip(keys).collect()
}

/// The identity's buckets of `endpoint` (its ceilings' only, with `ceilings_only`), read from
/// Redis without writing; a bucket never used reads full.
pub async fn peek(
    store: &Store,
    endpoint: &Endpoint,
    identity_hash: &str,
    ceilings_only: bool,
) -> Result<Vec<LimitView>, StoreFailure> {
    let mut views = Vec::new();
    let keyed = keyed(endpoint, identity_hash);
    for (limit, key) in keyed
        .into_iter()
        .filter(|(l, _)| l.global || !ceilings_only)
    {
        views.push(view(store, endpoint, limit, &key).await?);
    }
    Ok(views)
}

async fn view(
    store: &Store,
    endpoint: &Endpoint,
    limit: &Limit,
    key: &str,
) -> Result<LimitView, StoreFailure> {
    let policy = &endpoint.policy;
    let secs = |us: u64| us.div_ceil(1_000_000);
    Ok(match limit.algorithm {
        Algorithm::None => unreachable!("a limit always has an algorithm"),
        Algorithm::TokenBucket {
            capacity_micro,
            refill_micro_per_sec,
        } => {
            let (fields, now) = store.read_fields(key, &["t", "f", "ts"]).await?;
            // The model counts from zero; a bucket paying back a response charge holds down
            // to minus its capacity, so it is read shifted up by one capacity (refilling is
            // the same arithmetic until the bucket is full).
            let shift = capacity_micro;
            let state = match fields[..] {
                // Read from Redis: kept within what the script could have written, so a
                // corrupted bucket reads as nonsense at worst, never overflows.
                [Some(tokens), Some(frac), Some(at_us)] => Some(BucketState {
                    tokens: (tokens.clamp(-(capacity_micro as i64), capacity_micro as i64)
                        + shift as i64) as u64,
                    frac: frac.clamp(0, 999_999) as u64,
                    at_us: (at_us.max(0) as u64).min(now),
                }),
                _ => None,
            };
            let bucket = Bucket {
                capacity: capacity_micro + shift,
                rate_per_sec: refill_micro_per_sec,
            };
            // A bucket that was full stays full: the shifted one must not refill past it.
            let (shifted, frac) = bucket.refill(state, now);
            let shifted = shifted.min(capacity_micro + shift);
            let tokens = shifted as i64 - shift as i64;
            // The distance to full is the same in both; the shifted bucket is full at
            // capacity + shift.
            let reset_seconds = bucket.full_in_secs(shifted, frac);
            LimitView {
                name: limit.name.clone(),
                algorithm: "token_bucket",
                remaining: tokens.div_euclid(policy.cost_micro as i64),
                capacity: capacity_micro / policy.cost_micro,
                reset_seconds,
            }
        }
        Algorithm::SlidingWindow {
            limit: count,
            window_micro,
        } => {
            let (fields, now) = store.read_fields(key, &["w", "c", "p"]).await?;
            let state = match fields[..] {
                [Some(index), Some(current), Some(previous)] => Some(WindowState {
                    index: index.max(0) as u64,
                    current: (current.max(0) as u64).min(count),
                    previous: (previous.max(0) as u64).min(count),
                }),
                _ => None,
            };
            let window = Window {
                limit: count,
                window_us: window_micro,
            };
            let (left, empty_in) = window.level(state, now);
            let cost = (policy.cost_micro / ONE_TOKEN_MICRO).max(1);
            LimitView {
                name: limit.name.clone(),
                algorithm: "sliding_window",
                remaining: (left / cost) as i64,
                capacity: count / cost,
                reset_seconds: Some(secs(empty_in)),
            }
        }
    })
}

/// Deletes the identity's buckets of every one of `endpoints` (a route's, and each of its
/// tiers': the caller may have changed tier since) and forgets its over-limit cache entries;
/// a ceiling's buckets only when the identity is `global`. Answers how many keys existed.
pub async fn reset(
    store: &Store,
    endpoints: &[Arc<Endpoint>],
    identity_hash: &str,
) -> Result<(u64, Announced), StoreFailure> {
    let everyone = identity_hash == super::identity_hash("global");
    let mut keys: Vec<String> = endpoints
        .iter()
        .flat_map(|e| keyed(e, identity_hash))
        .filter(|(limit, _)| !limit.global || everyone)
        .map(|(_, key)| key)
        .collect();
    // A ceiling is the same key in every tier.
    keys.sort_unstable();
    keys.dedup();
    // One `DEL` for them all, so no decision runs between two of them: a request admitted
    // in between would be charged to a fresh bucket of one limit and to the old bucket of
    // another, whose charge the next `DEL` would then erase. The keys share the identity's
    // hash tag, so on a cluster too they are one slot (a single limit's keys, of the
    // unchanged format, have none: those go one `DEL` each).
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let deleted = if keys.is_empty() {
        0
    } else if store.one_call(&refs) {
        store.delete(&keys).await?
    } else {
        let mut deleted = 0;
        for key in &keys {
            deleted += store.delete(std::slice::from_ref(key)).await?;
        }
        deleted
    };
    forget_denials(endpoints, identity_hash, everyone);
    // The other gateways forget their remembered denials of it too.
    let mut announced = Announced::default();
    if let Some(endpoint) = endpoints.first() {
        let message = format!("{} {identity_hash}", endpoint.policy.endpoint_id);
        announced = store
            .announce(&reset_channel(endpoint.key_prefix()), &message)
            .await;
    }
    Ok((deleted, announced))
}

/// The channel resets are announced on: `{key_prefix}:v1:resets`, beside the keys (an ACL
/// user's channel pattern can follow its key pattern).
pub fn reset_channel(key_prefix: &str) -> String {
    format!("{key_prefix}:v1:resets")
}

/// What another gateway's reset announced (`<endpoint_id> <identity_hash>`, a line each when
/// several come together), heard: the
/// endpoint's remembered denials of that identity (its tiers' too) are forgotten. `None`:
/// the listener subscribed afresh and may have missed resets: every remembered denial is
/// forgotten.
pub fn heard_reset(endpoints: &HashMap<EndpointId, Arc<Endpoint>>, message: Option<&str>) {
    let Some(message) = message else {
        for endpoint in endpoints.values().flat_map(Endpoint::with_tiers) {
            endpoint.overlimit.clear();
        }
        return;
    };
    // One per line: a give-back's tellings go out together (`Store::tell`).
    for line in message.lines() {
        let Some((id, identity_hash)) = line.split_once(' ') else {
            continue;
        };
        let Some(endpoint) = EndpointId::parse(id).and_then(|id| endpoints.get(&id)) else {
            continue;
        };
        let everyone = identity_hash == super::identity_hash("global");
        forget_denials(&endpoint.with_tiers(), identity_hash, everyone);
    }
}

/// The over-limit cache remembers a denial under the caller's own key, and a ceiling's in a
/// place of its own. A ceiling's denial is also remembered under every caller's key it
/// refused: resetting the ceiling forgets every denial of the endpoint.
fn forget_denials(endpoints: &[Arc<Endpoint>], identity_hash: &str, everyone: bool) {
    for endpoint in endpoints {
        if everyone && endpoint.policy.has_ceilings() {
            endpoint.overlimit.clear();
        }
        for (_, key) in keyed(endpoint, identity_hash) {
            endpoint.overlimit.forget(&key);
        }
    }
}
