//! The Lua scripts the store runs, and the vocabulary of their answers: which script, its
//! reply, and how a call can fail.

use redis::aio::MultiplexedConnection;

pub const TOKEN_BUCKET_LUA: &str = concat!(
    include_str!("../../lua/int.lua"),
    include_str!("../../lua/token_bucket.lua")
);
pub const SLIDING_WINDOW_LUA: &str = concat!(
    include_str!("../../lua/int.lua"),
    include_str!("../../lua/sliding_window.lua")
);
pub const HEARTBEAT_LUA: &str = include_str!("../../lua/heartbeat.lua");

/// The limiter scripts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptKind {
    /// Args: capacity, refill per second, cost (micro-tokens).
    TokenBucket,
    /// Args: limit, window in microseconds, cost (requests).
    SlidingWindow,
}

/// How a store call failed; the three causes of the decision table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFailure {
    Timeout,
    ConnectionError,
    Noscript,
}

impl StoreFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            StoreFailure::Timeout => "timeout",
            StoreFailure::ConnectionError => "connection_error",
            StoreFailure::Noscript => "noscript",
        }
    }
}

/// A limiter script's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScriptReply {
    pub allowed: bool,
    /// What is left after this request: micro-tokens (token bucket) or requests (window).
    pub remaining: u64,
    /// Seconds until the cost is available; `None` when the bucket never refills.
    pub retry_after: Option<u64>,
    /// Seconds until the bucket is full or the window ends; `None` when never.
    pub reset: Option<u64>,
    /// Redis `TIME` of the decision, in microseconds.
    pub now_us: u64,
    /// On a denial, microseconds until the request would be admitted, when known exactly.
    pub wait_us: Option<u64>,
}

impl ScriptReply {
    pub(crate) fn parse(v: &[i64]) -> Option<Self> {
        let [allowed, remaining, retry, reset, now, wait] = *v else {
            return None;
        };
        let opt = |x: i64| u64::try_from(x).ok();
        Some(Self {
            allowed: allowed == 1,
            remaining: opt(remaining)?,
            retry_after: opt(retry),
            reset: opt(reset),
            now_us: opt(now)?,
            wait_us: opt(wait).filter(|w| *w > 0),
        })
    }

    /// Whole seconds for `Retry-After` on a denial: at least 1, at most a day.
    pub fn retry_after_secs(&self) -> u64 {
        if self.allowed {
            return 0;
        }
        self.retry_after
            .unwrap_or(super::MAX_RETRY_AFTER_SECS)
            .clamp(1, super::MAX_RETRY_AFTER_SECS)
    }
}

pub(crate) struct Script {
    pub(crate) sha: String,
    pub(crate) body: &'static str,
}

impl Script {
    pub(crate) fn new(body: &'static str) -> Self {
        Self {
            sha: redis::Script::new(body).get_hash().to_owned(),
            body,
        }
    }

    /// `SCRIPT LOAD` on one connection.
    pub(crate) async fn load(&self, conn: &mut MultiplexedConnection) -> redis::RedisResult<()> {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(self.body)
            .query_async::<String>(conn)
            .await
            .map(drop)
    }
}
