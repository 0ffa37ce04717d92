//! What an operator sees of, and does to, one identity's buckets (`/limits` on the admin):
//! read without writing, or deleted so the identity starts full. Off the request path.

use crate::config::{Algorithm, ONE_TOKEN_MICRO};
use crate::decision::sliding_window::{Window, WindowState};
use crate::decision::token_bucket::{Bucket, BucketState};
use crate::decision::StoreFailure;
use crate::store::Store;

use super::Endpoint;

/// A route's single limit goes by this name.
pub const DEFAULT_LIMIT: &str = "default";

/// One limit of an endpoint as one identity stands in it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LimitView {
    pub name: &'static str,
    pub algorithm: &'static str,
    /// Whole requests at the route's cost, rounded down.
    pub remaining: i64,
    /// Whole requests at the route's cost.
    pub capacity: u64,
    /// Whole seconds until full again; `None` when it never refills.
    pub reset_seconds: Option<u64>,
}

/// The identity's buckets of `endpoint`, read from Redis without writing; a bucket never
/// used reads full.
pub async fn peek(
    store: &Store,
    endpoint: &Endpoint,
    identity_hash: &str,
) -> Result<Vec<LimitView>, StoreFailure> {
    let policy = &endpoint.policy;
    let key = endpoint.bucket_key(identity_hash);
    let secs = |us: u64| us.div_ceil(1_000_000);
    let view = match policy.algorithm {
        Algorithm::None => return Ok(Vec::new()),
        Algorithm::TokenBucket {
            capacity_micro,
            refill_micro_per_sec,
        } => {
            let (fields, now) = store.read_fields(&key, &["t", "f", "ts"]).await?;
            let state = match fields[..] {
                // Read from Redis: kept within what the script could have written, so a
                // corrupted bucket reads as nonsense at worst, never overflows.
                [Some(tokens), Some(frac), Some(at_us)] => Some(BucketState {
                    tokens: tokens.min(capacity_micro),
                    frac: frac.min(999_999),
                    at_us: at_us.min(now),
                }),
                _ => None,
            };
            let bucket = Bucket {
                capacity: capacity_micro,
                rate_per_sec: refill_micro_per_sec,
            };
            let (tokens, frac) = bucket.refill(state, now);
            LimitView {
                name: DEFAULT_LIMIT,
                algorithm: "token_bucket",
                remaining: (tokens / policy.cost_micro) as i64,
                capacity: capacity_micro / policy.cost_micro,
                reset_seconds: bucket.full_in_us(tokens, frac).map(secs),
            }
        }
        Algorithm::SlidingWindow {
            limit,
            window_micro,
        } => {
            let (fields, now) = store.read_fields(&key, &["w", "c", "p"]).await?;
            let state = match fields[..] {
                [Some(index), Some(current), Some(previous)] => Some(WindowState {
                    index,
                    current: current.min(limit),
                    previous: previous.min(limit),
                }),
                _ => None,
            };
            let window = Window {
                limit,
                window_us: window_micro,
            };
            let (left, empty_in) = window.level(state, now);
            let cost = (policy.cost_micro / ONE_TOKEN_MICRO).max(1);
            LimitView {
                name: DEFAULT_LIMIT,
                algorithm: "sliding_window",
                remaining: (left / cost) as i64,
                capacity: limit / cost,
                reset_seconds: Some(secs(empty_in)),
            }
        }
    };
    Ok(vec![view])
}

/// Deletes the identity's buckets of `endpoint` (its current `policy_version`) and the
/// over-limit cache's memory of them: its next request starts full. How many keys existed.
pub async fn reset(
    store: &Store,
    endpoint: &Endpoint,
    identity_hash: &str,
) -> Result<u64, StoreFailure> {
    let key = endpoint.bucket_key(identity_hash);
    let deleted = store.delete(std::slice::from_ref(&key)).await?;
    endpoint.overlimit.forget(&key);
    Ok(deleted)
}
