//! The Lua scripts the store runs: their bodies, which one a decision needs, and loading them.
//! Their answer is read by [`crate::decision::ScriptReply`].

use redis::aio::MultiplexedConnection;

pub const TOKEN_BUCKET_LUA: &str = concat!(
    include_str!("../../lua/int.lua"),
    include_str!("../../lua/limits.lua"),
    include_str!("../../lua/token_bucket.lua")
);
pub const SLIDING_WINDOW_LUA: &str = concat!(
    include_str!("../../lua/int.lua"),
    include_str!("../../lua/limits.lua"),
    include_str!("../../lua/sliding_window.lua")
);
pub const LIMITS_LUA: &str = concat!(
    include_str!("../../lua/int.lua"),
    include_str!("../../lua/limits.lua"),
    include_str!("../../lua/limits_multi.lua")
);
/// The batch script: its keys declared (`KEYS`), its arguments in `ARGV` from the first.
pub const BATCH_LUA: &str = concat!(
    include_str!("../../lua/int.lua"),
    include_str!("../../lua/limits.lua"),
    "local keys, ko, ao = KEYS, 0, 0\n",
    include_str!("../../lua/batch.lua")
);
/// The batch script of a Redis Cluster node: no key declared (Redis refuses declared keys of
/// several slots in one call, whatever the flags say), `ARGV` led by the keys' number and the
/// keys; the flag lets it touch keys of several slots the node serves.
pub const BATCH_CLUSTER_LUA: &str = concat!(
    "#!lua flags=allow-cross-slot-keys\n",
    include_str!("../../lua/int.lua"),
    include_str!("../../lua/limits.lua"),
    "local keys, ko, ao = ARGV, 1, 1 + tonumber(ARGV[1])\n",
    include_str!("../../lua/batch.lua")
);
pub const HEARTBEAT_LUA: &str = include_str!("../../lua/heartbeat.lua");
pub const PERMISSIONS_LUA: &str = include_str!("../../lua/permissions.lua");

/// The limiter scripts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptKind {
    /// Args: capacity, refill per second, cost (micro-tokens).
    TokenBucket,
    /// Args: limit, window in microseconds, cost (requests).
    SlidingWindow,
    /// Several limits (`lua/limits_multi.lua`): a mode, then four args per key.
    Limits,
}

#[derive(Clone)]
pub(super) struct Script {
    pub(super) sha: String,
    body: &'static str,
}

/// The limiter scripts, their hashes computed once.
#[derive(Clone)]
pub(super) struct Scripts {
    pub(super) token_bucket: Script,
    pub(super) sliding_window: Script,
    pub(super) limits: Script,
    batch: Script,
    batch_cluster: Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Self {
            token_bucket: Script::new(TOKEN_BUCKET_LUA),
            sliding_window: Script::new(SLIDING_WINDOW_LUA),
            limits: Script::new(LIMITS_LUA),
            batch: Script::new(BATCH_LUA),
            batch_cluster: Script::new(BATCH_CLUSTER_LUA),
        }
    }

    /// `lua/batch.lua`, as one Redis (or a Sentinel's master) runs it, or a cluster node.
    pub(super) fn batch(&self, in_cluster: bool) -> &Script {
        match in_cluster {
            false => &self.batch,
            true => &self.batch_cluster,
        }
    }

    pub(super) fn get(&self, kind: ScriptKind) -> &Script {
        match kind {
            ScriptKind::TokenBucket => &self.token_bucket,
            ScriptKind::SlidingWindow => &self.sliding_window,
            ScriptKind::Limits => &self.limits,
        }
    }
}

impl Script {
    fn new(body: &'static str) -> Self {
        Self {
            sha: redis::Script::new(body).get_hash().to_owned(),
            body,
        }
    }

    /// The script's source, as `SCRIPT LOAD` takes it.
    pub(super) fn body(&self) -> &'static str {
        self.body
    }

    /// `SCRIPT LOAD` on one connection.
    pub(super) async fn load(&self, conn: &mut MultiplexedConnection) -> redis::RedisResult<()> {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(self.body)
            .query_async::<String>(conn)
            .await
            .map(drop)
    }
}
