//! An endpoint at run time: its policy, the fixed part of its bucket keys, its emergency
//! bucket and its metric handles.

use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::clock::SharedClock;
use crate::config::{FailMode, Policy};
use crate::decision::emergency::Emergency;
use crate::decision::overlimit::OverlimitCache;
use crate::metrics::EndpointMetrics;

pub struct Endpoint {
    pub policy: Arc<Policy>,
    /// With `tier_from`: which limits each tier gets.
    pub tiers: Option<Tiers>,
    /// `{key_prefix}:v1:`
    key_head: String,
    /// `:{endpoint_id}:{policy_version}`
    key_tail: String,
    /// With `[[routes.limits]]`: `:{endpoint_id}:{policy_version}:{limit name}` per limit.
    limit_tails: Vec<String>,
    /// The hash of the identity string `global`, for ceilings.
    global_hash: String,
    pub emergency: Option<Arc<Emergency>>,
    pub overlimit: OverlimitCache,
    /// Charges of callers' own limits that a ceiling on another node may still see given
    /// back (Redis Cluster).
    pub in_flight: Arc<super::in_flight::InFlight>,
    pub metrics: EndpointMetrics,
}

impl Endpoint {
    pub fn new(
        policy: Arc<Policy>,
        key_prefix: &str,
        emergency: Option<Arc<Emergency>>,
        metrics: EndpointMetrics,
        clock: SharedClock,
    ) -> Self {
        let emergency = emergency.filter(|_| policy.fail_mode == FailMode::FailOpen);
        let limit_tails = policy
            .limits
            .iter()
            .map(|l| {
                format!(
                    ":{}:{}:{}",
                    policy.endpoint_id, policy.policy_version, l.name
                )
            })
            .collect();
        Self {
            tiers: None,
            key_head: format!("{key_prefix}:v1:"),
            key_tail: format!(":{}:{}", policy.endpoint_id, policy.policy_version),
            limit_tails,
            global_hash: identity_hash("global"),
            policy,
            emergency,
            overlimit: OverlimitCache::new(clock),
            in_flight: Arc::default(),
            metrics,
        }
    }

    /// `[redis] key_prefix` as the endpoint was made with.
    pub fn key_prefix(&self) -> &str {
        self.key_head.strip_suffix(":v1:").unwrap_or(&self.key_head)
    }

    /// Forgets a remembered denial of `key`, in this endpoint's over-limit cache and its
    /// tiers' (the key says whose it is).
    pub fn forget_denial(self: &Arc<Self>, key: &str) {
        for endpoint in self.with_tiers() {
            endpoint.overlimit.forget(key);
        }
    }

    /// This endpoint and each of its tiers' (a tier without limits has none).
    pub fn with_tiers(self: &Arc<Self>) -> Vec<Arc<Endpoint>> {
        let mut all = vec![Arc::clone(self)];
        if let Some(tiers) = &self.tiers {
            all.extend(tiers.endpoints());
        }
        all
    }

    /// `{key_prefix}:v1:{sha256_hex(identity)}:{endpoint_id}:{policy_version}`
    pub fn bucket_key(&self, identity_hash: &str) -> String {
        let mut key =
            String::with_capacity(self.key_head.len() + identity_hash.len() + self.key_tail.len());
        key.push_str(&self.key_head);
        key.push_str(identity_hash);
        key.push_str(&self.key_tail);
        key
    }
}

/// A tiered endpoint's tiers: where a caller's tier comes from, and what each one gets.
pub struct Tiers {
    pub from: crate::config::TierFrom,
    /// The tier of callers without one, or with one not listed.
    pub default: Arc<str>,
    choices: std::collections::HashMap<String, (Arc<str>, Option<Arc<Endpoint>>)>,
    /// `sentinel_tier_decisions_total` by tier name, then by allowed.
    pub decisions: std::collections::HashMap<Arc<str>, [prometheus::IntCounter; 2]>,
}

impl Tiers {
    pub fn new(
        from: crate::config::TierFrom,
        default: &str,
        choices: Vec<(String, Option<Arc<Endpoint>>)>,
        decisions: std::collections::HashMap<Arc<str>, [prometheus::IntCounter; 2]>,
    ) -> Self {
        Self {
            from,
            default: Arc::from(default),
            choices: choices
                .into_iter()
                .map(|(name, e)| {
                    let shared: Arc<str> = Arc::from(name.as_str());
                    (name, (shared, e))
                })
                .collect(),
            decisions,
        }
    }

    /// Whether `tier` is the default or listed.
    pub fn knows(&self, tier: &str) -> bool {
        tier == &*self.default || self.choices.contains_key(tier)
    }

    /// The endpoints of the listed tiers that have limits.
    pub fn endpoints(&self) -> Vec<Arc<Endpoint>> {
        self.choices
            .values()
            .filter_map(|(_, e)| e.clone())
            .collect()
    }

    /// The tier a caller with `tier` counts under (the default when it has none or one
    /// not listed), and its endpoint: `Some(None)` for an unlimited tier, `None` for the
    /// route's own limits (the default tier, when it is not listed).
    pub fn choose(&self, tier: Option<&str>) -> (Arc<str>, Option<Option<Arc<Endpoint>>>) {
        let listed = tier
            .and_then(|t| self.choices.get(t))
            .or_else(|| self.choices.get(&*self.default));
        match listed {
            Some((name, endpoint)) => (Arc::clone(name), Some(endpoint.clone())),
            None => (Arc::clone(&self.default), None),
        }
    }
}

impl Endpoint {
    /// The endpoint of one tier's limits: `policy` holds the tier's limits and the route's
    /// ceilings; the keys of the tier's own limits carry the tier's name, so that tiers never
    /// share a bucket, while the ceilings' keys are the route's.
    pub fn for_tier(
        policy: Arc<Policy>,
        tier: &str,
        key_prefix: &str,
        emergency: Option<Arc<Emergency>>,
        metrics: EndpointMetrics,
        clock: SharedClock,
    ) -> Self {
        let mut endpoint = Self::new(Arc::clone(&policy), key_prefix, emergency, metrics, clock);
        endpoint.limit_tails = policy
            .limits
            .iter()
            .map(|l| {
                if l.global {
                    format!(
                        ":{}:{}:{}",
                        policy.endpoint_id, policy.policy_version, l.name
                    )
                } else {
                    format!(
                        ":{}:{}:{tier}:{}",
                        policy.endpoint_id, policy.policy_version, l.name
                    )
                }
            })
            .collect();
        endpoint
    }

    /// With `[[routes.limits]]`, each limit's key, in the policy's order:
    /// `{key_prefix}:v1:{<hash>}:{endpoint_id}:{policy_version}:{limit}`, the hash the
    /// caller's, or that of `global` for a ceiling. The braces are a Redis Cluster hash tag:
    /// the limits of one identity live in one slot, and are decided by one script call.
    pub fn limit_keys(&self, identity_hash: &str) -> Vec<String> {
        self.policy
            .limits
            .iter()
            .zip(&self.limit_tails)
            .map(|(limit, tail)| {
                let hash = if limit.global {
                    self.global_hash.as_str()
                } else {
                    identity_hash
                };
                format!("{}{{{hash}}}{tail}", self.key_head)
            })
            .collect()
    }
}

/// The `endpoint_id` a bucket key names: `{key_prefix}:v1:{hash}:{endpoint_id}:...`, the
/// hash in braces (a cluster hash tag) for `[[routes.limits]]`.
pub fn endpoint_of_key(key: &str) -> Option<&str> {
    let rest = hashed_part(key)?.get(64..)?;
    let rest = rest.strip_prefix('}').unwrap_or(rest).strip_prefix(':')?;
    rest.split(':').next().filter(|id| !id.is_empty())
}

/// The identity hash a bucket key names (`{key_prefix}:v1:{hash}:...`, the hash in braces
/// for `[[routes.limits]]`).
pub fn identity_hash_of_key(key: &str) -> Option<&str> {
    hashed_part(key)?.get(..64)
}

/// A bucket key from its identity hash on (past `:v1:` and the hash tag's brace).
fn hashed_part(key: &str) -> Option<&str> {
    let (_, rest) = key.split_once(":v1:")?;
    Some(rest.strip_prefix('{').unwrap_or(rest))
}

/// The keys of every limit of a several-limits endpoint for `identity` (an identity
/// string, not its hash), as [`Endpoint::limit_keys`] builds them on the request path.
pub fn limit_keys(
    key_prefix: &str,
    identity: &str,
    endpoint_id: &str,
    policy_version: u64,
    limits: &[crate::config::Limit],
) -> Vec<String> {
    limits
        .iter()
        .map(|l| {
            let who = if l.global { "global" } else { identity };
            format!(
                "{key_prefix}:v1:{{{}}}:{endpoint_id}:{policy_version}:{}",
                identity_hash(who),
                l.name
            )
        })
        .collect()
}

/// The bucket key of `identity` (an identity string such as `header:x-api-key:abc`, not its
/// hash) on one endpoint: `{key_prefix}:v1:{sha256_hex(identity)}:{endpoint_id}:{policy_version}`.
/// The request path builds the same key from parts made once per endpoint
/// ([`Endpoint::bucket_key`]).
pub fn bucket_key(
    key_prefix: &str,
    identity: &str,
    endpoint_id: &str,
    policy_version: u64,
) -> String {
    format!(
        "{key_prefix}:v1:{}:{endpoint_id}:{policy_version}",
        identity_hash(identity)
    )
}

/// Lower-case hex SHA-256 of an identity string such as `header:x-api-key:abc`.
pub fn identity_hash(identity: &str) -> String {
    let mut hex = [0u8; 64];
    // 32 bytes always fit 64 hex digits; encoding into a buffer skips a per-digit push.
    hex::encode_to_slice(Sha256::digest(identity.as_bytes()), &mut hex).expect("64 digits");
    std::str::from_utf8(&hex).expect("hex digits").to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_key_names_its_endpoint() {
        let hash = identity_hash("header:x-api-key:k");
        let single = format!("sentinel:v1:{hash}:pdftalk.ingest:3");
        let several = format!("sentinel:v1:{{{hash}}}:v1:1:pro:burst");
        assert_eq!(endpoint_of_key(&single), Some("pdftalk.ingest"));
        assert_eq!(endpoint_of_key(&several), Some("v1"));
        for junk in ["", "sentinel:v1:", "sentinel:v1:abc:e:1", "no-marker"] {
            assert_eq!(endpoint_of_key(junk), None, "{junk}");
        }
    }

    #[test]
    fn the_request_path_builds_the_documented_key() {
        use crate::config::{Algorithm, EndpointId, Enforcement};
        let policy = Policy {
            endpoint_id: EndpointId::parse("pdftalk.ingest").unwrap(),
            algorithm: Algorithm::None,
            limits: Vec::new(),
            several: false,
            cost_micro: 1_000_000,
            fail_mode: FailMode::FailClosed,
            fallback_rate_micro: None,
            fallback_fleet: false,
            policy_version: 3,
            mode: Enforcement::Enforce,
            ratelimit_headers: Default::default(),
            emergency_per_identity: false,
            cost_from_response: None,
            tiers: None,
        };
        let metrics = crate::metrics::Metrics::new();
        let endpoint = Endpoint::new(
            std::sync::Arc::new(policy),
            "edge",
            None,
            metrics.endpoint(
                "pdftalk.ingest",
                FailMode::FailClosed,
                Enforcement::Enforce,
                &[],
                false,
            ),
            std::sync::Arc::new(crate::clock::ManualClock::default()),
        );
        let identity = "header:x-api-key:k1";
        assert_eq!(
            endpoint.bucket_key(&identity_hash(identity)),
            bucket_key("edge", identity, "pdftalk.ingest", 3)
        );
        assert_eq!(
            bucket_key("edge", "global", "a", 1),
            format!("edge:v1:{}:a:1", identity_hash("global"))
        );
    }

    #[test]
    fn identity_hash_is_sha256_hex() {
        assert_eq!(
            identity_hash(""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
