//! The live configuration as the request path uses it: the route table, each endpoint's
//! runtime state and each upstream's pool. One request loads one snapshot and keeps it.
//!
//! A reload builds a new snapshot from the previous one so that state survives where the
//! config allows: an endpoint's emergency bucket carries over unless its fallback rate
//! changed.

use std::collections::HashMap;
use std::sync::Arc;

use crate::clock::SharedClock;
use crate::config::{Config, EndpointId, IdentitySource, Policy, TierLimits};
use crate::decision::emergency::{
    Emergency, EmergencyBucket, IdentityBuckets, Rate, IDENTITY_CAPACITY,
};
use crate::decision::fleet::Fleet;
use crate::identity::JwtVerifier;
use crate::limiter::endpoint::Tiers;
use crate::limiter::Endpoint;
use crate::metrics::{Metrics, RequestCounters, UNMATCHED};
use crate::remote_jwks::JwksCache;
use crate::routing::RouteTable;
pub use crate::upstream::UpstreamPool;

/// A matched route: whose bucket, keyed by what, forwarded where.
pub struct Route {
    pub endpoint: Arc<Endpoint>,
    pub identity: IdentitySource,
    pub upstream: Arc<UpstreamPool>,
    /// The route's body limit, or the server's.
    pub max_body_bytes: Option<u64>,
    /// `websocket = true`: `Upgrade` requests are passed on.
    pub websocket: bool,
    /// Clients forwarded without identity, limit or Redis call.
    pub exempt_client_cidrs: Vec<ipnet::IpNet>,
    /// The upstream is told the verified caller and its tier.
    pub forward_identity: bool,
    /// `cors_origins`: the gateway does CORS for the route's listed origins.
    pub cors: Option<Arc<crate::proxy::cors::Cors>>,
}

impl Route {
    /// Whether a request is served alike by either route: the same bucket, upstream and
    /// request handling, the two differing in what they match only (routes that share an
    /// `endpoint_id`, or one route).
    pub fn serves_alike(&self, other: &Route) -> bool {
        std::ptr::eq(self, other)
            || (Arc::ptr_eq(&self.endpoint, &other.endpoint)
                && Arc::ptr_eq(&self.upstream, &other.upstream)
                && self.identity == other.identity
                && self.max_body_bytes == other.max_body_bytes
                && self.websocket == other.websocket
                && self.exempt_client_cidrs == other.exempt_client_cidrs
                && self.forward_identity == other.forward_identity
                && self.cors == other.cors)
    }

    /// The request header the route's callers are told apart by, lower-case (`api_keys`:
    /// `[auth.api_keys] header`): a field a line would otherwise show (`Host`,
    /// `User-Agent`) is then left out, as the raw identity.
    pub fn identity_header<'a>(
        &'a self,
        api_keys: Option<&'a crate::config::ApiKeysConfig>,
    ) -> Option<&'a str> {
        match &self.identity {
            IdentitySource::Header(name) => Some(name.as_str()),
            IdentitySource::ApiKey => api_keys.map(|k| k.header.as_str()),
            _ => None,
        }
    }
}

pub struct Snapshot {
    pub generation: u64,
    pub config: Arc<Config>,
    pub routes: RouteTable<Arc<Route>>,
    pub endpoints: HashMap<EndpointId, Arc<Endpoint>>,
    /// `sentinel_requests_total{endpoint_id="_unmatched"}`.
    pub unmatched: RequestCounters,
    pub jwt: Option<JwtVerifier>,
    /// Every upstream's pool, by name.
    pub upstreams: HashMap<String, Arc<UpstreamPool>>,
    /// The keys fetched from `[auth.jwt] jwks_url`, carried from snapshot to snapshot.
    pub jwks: Arc<JwksCache>,
    /// Some route has a fleet-wide emergency rate: the heartbeat runs.
    pub uses_fleet: bool,
    /// The request fields some route reads an identity from (`host`, `user-agent`): the
    /// access log line of a request refused before its route was known leaves them out.
    pub identity_fields: Vec<String>,
    /// The fields this config changes that take effect only at the next start (the reload's
    /// `restart_required`): empty at the start and once the file is back to the running ones.
    pub restart_required: Vec<&'static str>,
}

impl Snapshot {
    /// Where the JWKS is fetched from and how often (`[auth.jwt] jwks_url`), if it is.
    pub fn jwks_target(&self) -> Option<(String, std::time::Duration)> {
        let jwt = self.config.jwt.as_ref()?;
        Some((jwt.jwks_url.clone()?, jwt.jwks_refresh))
    }

    pub fn build(
        config: Config,
        generation: u64,
        metrics: &Metrics,
        clock: &SharedClock,
        fleet: &Arc<Fleet>,
        previous: Option<&Snapshot>,
    ) -> std::io::Result<Snapshot> {
        // The fetched JWKS outlives every snapshot: a reload that keeps `jwks_url` keeps the
        // last good keys (the verifier takes only keys fetched from the URL it names).
        let jwks = previous.map_or_else(Default::default, |p| Arc::clone(&p.jwks));
        let mut pools = HashMap::new();
        for (name, up) in &config.upstreams {
            // An upstream the reload did not change keeps its pool: its health, its
            // resolved addresses and its connections.
            let kept = previous
                .and_then(|p| p.upstreams.get(name))
                .filter(|pool| *pool.config == **up)
                .cloned();
            let pool = match kept {
                Some(pool) => pool,
                None => Arc::new(UpstreamPool::new(up)?),
            };
            pools.insert(name.clone(), pool);
        }
        let mut endpoints: HashMap<EndpointId, Arc<Endpoint>> = HashMap::new();
        let mut entries = Vec::new();
        for rc in &config.routes {
            let policy = &rc.policy;
            let endpoint = endpoints
                .entry(policy.endpoint_id.clone())
                .or_insert_with(|| {
                    let rate = policy.fallback_rate_micro.map(|r| {
                        if policy.fallback_fleet {
                            Rate::Fleet {
                                total: r,
                                fleet: Arc::clone(fleet),
                            }
                        } else {
                            Rate::PerProcess(r)
                        }
                    });
                    let kept = previous
                        .and_then(|p| p.endpoints.get(&policy.endpoint_id))
                        .and_then(|e| e.emergency.clone())
                        .filter(|b| {
                            Some(b.configured()) == rate.as_ref().map(Rate::configured)
                                && b.per_identity() == policy.emergency_per_identity
                        });
                    let emergency = kept.or_else(|| {
                        rate.map(|rate| {
                            let clock = Arc::clone(clock);
                            Arc::new(if policy.emergency_per_identity {
                                Emergency::Identity(IdentityBuckets::new(
                                    rate,
                                    IDENTITY_CAPACITY,
                                    clock,
                                ))
                            } else {
                                Emergency::Endpoint(EmergencyBucket::with_rate(rate, clock))
                            })
                        })
                    });
                    let handles = |p: &Policy| {
                        metrics.endpoint(
                            p.endpoint_id.as_str(),
                            p.fail_mode,
                            p.mode,
                            &p.limits.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
                            p.cost_from_response.is_some(),
                        )
                    };
                    let mut endpoint = Endpoint::new(
                        Arc::clone(policy),
                        &config.redis.key_prefix,
                        emergency.clone(),
                        handles(policy),
                        Arc::clone(clock),
                    );
                    if let Some(plan) = &policy.tiers {
                        let choices = plan
                            .tiers
                            .iter()
                            .map(|(name, limits)| {
                                let tier_endpoint = match limits {
                                    TierLimits::Unlimited => None,
                                    TierLimits::Limits(own) => {
                                        let mut limits = own.clone();
                                        limits.extend(
                                            policy.limits.iter().filter(|l| l.global).cloned(),
                                        );
                                        let tier_policy = Arc::new(Policy {
                                            limits,
                                            several: true,
                                            tiers: None,
                                            ..(**policy).clone()
                                        });
                                        Some(Arc::new(Endpoint::for_tier(
                                            Arc::clone(&tier_policy),
                                            name,
                                            &config.redis.key_prefix,
                                            emergency.clone(),
                                            handles(&tier_policy),
                                            Arc::clone(clock),
                                        )))
                                    }
                                };
                                (name.clone(), tier_endpoint)
                            })
                            .collect();
                        let id = policy.endpoint_id.as_str();
                        let decisions = std::iter::once(plan.default.as_str())
                            .chain(plan.tiers.keys().map(String::as_str))
                            .map(|t| (Arc::from(t), metrics.tier_decisions(id, t)))
                            .collect();
                        endpoint.tiers = Some(Tiers::new(
                            plan.from.clone(),
                            &plan.default,
                            choices,
                            decisions,
                        ));
                    }
                    Arc::new(endpoint)
                })
                .clone();
            let route = Route {
                endpoint,
                identity: rc.identity.clone(),
                upstream: Arc::clone(&pools[&rc.upstream.name]),
                max_body_bytes: rc.max_body_bytes,
                websocket: rc.websocket,
                exempt_client_cidrs: rc.exempt_client_cidrs.clone(),
                cors: (rc.cors.clone()).map(|origins| {
                    Arc::new(crate::proxy::cors::Cors::new(
                        origins,
                        &config.server.request_id_header,
                    ))
                }),
                forward_identity: rc.forward_identity,
            };
            entries.push((rc.matcher(), Arc::new(route)));
        }
        Ok(Snapshot {
            restart_required: Vec::new(),
            // (Not for a route that decides nothing, which has no emergency either.)
            uses_fleet: (config.routes.iter())
                .any(|r| r.policy.fallback_fleet && r.policy.is_limited()),
            identity_fields: (config.routes.iter())
                .filter_map(|r| match &r.identity {
                    IdentitySource::Header(name) => Some(name.clone()),
                    IdentitySource::ApiKey => config.api_keys.as_ref().map(|k| k.header.clone()),
                    _ => None,
                })
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect(),
            jwt: config
                .jwt
                .as_ref()
                .and_then(|j| JwtVerifier::new(j, Some(&jwks))),
            jwks,
            upstreams: pools,
            generation,
            routes: RouteTable::new(entries),
            endpoints,
            unmatched: metrics.requests(UNMATCHED),
            config: Arc::new(config),
        })
    }
}
