//! Every metric of the gateway, defined once. Per-endpoint handles are resolved when a config
//! is loaded, so the request path never formats a label.

use std::collections::HashMap;

use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry,
};

use crate::config::{Enforcement, FailMode};
use crate::decision::DecisionReason;

/// Histogram buckets from 10 us to about 1.3 s, doubling, plus 5, 15, 20, 25 and 30 ms so
/// that the share of decisions within a usual budget can be read off directly.
fn latency_buckets() -> Vec<f64> {
    let mut buckets = exponential_buckets(0.000_01, 2.0, 18).expect("valid buckets");
    buckets.extend([0.005, 0.015, 0.02, 0.025, 0.03]);
    buckets.sort_by(f64::total_cmp);
    buckets
}

/// `sentinel_tls_handshakes_total`'s results.
const HANDSHAKE_RESULTS: [(&str, crate::edge::connections::Handshake); 3] = {
    use crate::edge::connections::Handshake;
    [
        ("success", Handshake::Success),
        ("failure", Handshake::Failure),
        ("timeout", Handshake::Timeout),
    ]
};

/// Statuses whose request counters are resolved ahead of time.
const COMMON_STATUSES: &[u16] = &[200, 201, 204, 400, 401, 404, 413, 429, 500, 502, 503, 504];
/// Those of requests no route matched, which no upstream or decision answers.
const UNMATCHED_STATUSES: &[u16] = &[400, 404];
/// The others such requests have, resolved at their first (a 503 at capacity is counted
/// under `_unmatched` when the gateway is busiest): shown once they happen.
const UNMATCHED_LATER: &[u16] = &[405, 408, 431, 499, 503];

pub const UNMATCHED: &str = "_unmatched";

pub struct Metrics {
    pub registry: Registry,
    decisions: IntCounterVec,
    decision_duration: HistogramVec,
    degraded: IntCounterVec,
    store_errors: IntCounterVec,
    pub redis_duration: Histogram,
    pub redis_batch_size: Histogram,
    pub breaker_state: IntGauge,
    breaker_transitions: IntCounterVec,
    requests: IntCounterVec,
    grpc_status: IntCounterVec,
    config_reloads: IntCounterVec,
    pub config_generation: IntGauge,
    config_info: IntGaugeVec,
    config_restart_required: IntGauge,
    shadow_denials: IntCounterVec,
    overlimit_hits: IntCounterVec,
    exempt_requests: IntCounterVec,
    limit_denials: IntCounterVec,
    response_charges: IntCounterVec,
    tier_decisions: IntCounterVec,
    pub jwks_refresh: crate::remote_jwks::RefreshCounters,
    /// `sentinel_jwks_keys`: set when scraped, and shown only while `jwks_url` is set (its
    /// one series, without labels).
    pub jwks_keys: IntGaugeVec,
    /// Requests between their start and the end of their `logging()`; set at scrape time.
    pub in_flight: IntGauge,
    /// Downstream connections open, and the bound on them; set at scrape time.
    pub connections_open: IntGauge,
    /// `/readyz`'s `redis`: 1 while the gateway holds its Redis connections.
    pub redis_up: IntGauge,
    /// 1 while a Redis the gateway uses reads an evicting `maxmemory-policy`; set at scrape
    /// time.
    pub redis_evicting: IntGauge,
    pub connections_max: IntGauge,
    /// What the bound did, by `action` (`closed_idle`, `refused`, `request_refused`); set at scrape time.
    connections_shed: IntCounterVec,
    tls_handshakes: IntCounterVec,
    pub fleet_instances: IntGauge,
    /// Access log lines dropped because the writer could not keep up (or could not write).
    pub access_log_dropped: IntCounter,
    /// Log lines (stdout) dropped rather than slowing requests; set at scrape time.
    pub log_dropped: IntCounter,
    pub admin_refused: IntCounter,
    endpoint_mode: IntGaugeVec,
    /// Redis Cluster only: each primary's breaker state, labelled by `node` (`host:port`).
    redis_node_breaker_state: IntGaugeVec,
    /// Redis Cluster only: 1 while the gateway holds a connection to the primary, else 0.
    redis_node_up: IntGaugeVec,
    /// `sentinel_upstream_healthy{upstream, addr}`: 1 or 0, for upstreams with health checks.
    pub upstream_healthy: IntGaugeVec,
    /// `sentinel_tls_cert_expiry_timestamp_seconds{cert_path}`: when each served
    /// certificate's validity ends.
    tls_cert_expiry: IntGaugeVec,
}

/// Store error counters by cause.
#[derive(Clone)]
pub struct StoreErrorCounters {
    pub timeout: IntCounter,
    pub connection_error: IntCounter,
    pub noscript: IntCounter,
}

/// One endpoint's handles.
#[derive(Clone)]
pub struct EndpointMetrics {
    /// Indexed by `DecisionReason as usize`, then by allowed: the pairs the endpoint can
    /// give, made ahead ([`possible`]); `None` for the others, made if one ever comes.
    decisions: Vec<[Option<IntCounter>; 2]>,
    /// `sentinel_decisions_total`, and the endpoint's label in it, for a pair not made ahead.
    decisions_vec: IntCounterVec,
    endpoint_id: String,
    pub decision_duration: Histogram,
    pub degraded: IntCounter,
    pub shadow_denials: IntCounter,
    pub overlimit_hits: IntCounter,
    /// Requests forwarded unlimited because the client is in `exempt_client_cidrs`.
    pub exempt: IntCounter,
    /// `sentinel_limit_denials_total`, by the index of the limit in the policy.
    pub limit_denials: Vec<IntCounter>,
    pub charges: ResponseCharges,
    pub requests: RequestCounters,
    pub grpc: GrpcCounters,
}

/// `sentinel_grpc_status_total` of one endpoint: its gRPC calls by their status (the
/// gateway's own answer's, or the upstream's), which `sentinel_requests_total` counts under
/// the HTTP status they were sent with (200). Series made at a status's first call.
#[derive(Clone)]
pub struct GrpcCounters {
    label: String,
    vec: IntCounterVec,
}

impl GrpcCounters {
    pub fn inc(&self, code: u8) {
        const CODES: [&str; 17] = [
            "0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15",
            "16",
        ];
        if let Some(code) = CODES.get(usize::from(code)) {
            self.vec
                .with_label_values(&[self.label.as_str(), code])
                .inc();
        }
    }
}

/// `sentinel_response_charges_total` of one endpoint.
#[derive(Clone)]
pub struct ResponseCharges {
    pub charged: IntCounter,
    pub invalid: IntCounter,
    pub failed: IntCounter,
}

impl EndpointMetrics {
    /// Counts a decision in `sentinel_decisions_total`.
    pub fn count_decision(&self, reason: DecisionReason, allowed: bool) {
        match &self.decisions[reason as usize][usize::from(allowed)] {
            Some(counter) => counter.inc(),
            None => self
                .decisions_vec
                .with_label_values(&[&self.endpoint_id, reason.as_str(), bool_label(allowed)])
                .inc(),
        }
    }
}

/// A counter of no registry: what a route that decides nothing holds in place of a series.
fn unexported_counter() -> IntCounter {
    IntCounter::new("unexported", "-").expect("a counter's name")
}

fn bool_label(b: bool) -> &'static str {
    if b {
        "true"
    } else {
        "false"
    }
}

/// Whether an endpoint failing by `fail_mode` can give the decision `reason` with `allowed`
/// (the decision table): Redis's two; on `fail_open`, the emergency limiter's admissions by
/// each cause of failure and its denial; on `fail_closed`, the two denials. Only those are
/// shown at zero before the first one, so a dashboard is not filled with pairs that cannot
/// occur (a `fail_closed` admitted).
fn possible(reason: DecisionReason, allowed: bool, fail_mode: FailMode) -> bool {
    let open = fail_mode == FailMode::FailOpen;
    match reason {
        DecisionReason::Allowed => allowed,
        DecisionReason::RateLimited => !allowed,
        DecisionReason::RedisTimeout
        | DecisionReason::RedisConnectionError
        | DecisionReason::RedisNoscriptRetry => allowed && open,
        DecisionReason::EmergencyLocalLimit => !allowed && open,
        DecisionReason::CircuitOpen => allowed == open,
        DecisionReason::FailClosed => !allowed && !open,
    }
}

/// `sentinel_requests_total` for one endpoint label, common statuses resolved ahead.
#[derive(Clone)]
pub struct RequestCounters {
    label: String,
    common: HashMap<u16, IntCounter>,
    /// Resolved at their first request, so that their series shows only once it happens.
    later: Vec<(u16, std::sync::OnceLock<IntCounter>)>,
    vec: IntCounterVec,
}

impl RequestCounters {
    pub fn inc(&self, status: u16) {
        if let Some(c) = self.common.get(&status) {
            return c.inc();
        }
        let resolve = || {
            self.vec
                .with_label_values(&[self.label.as_str(), &status.to_string()])
        };
        match self.later.iter().find(|(s, _)| *s == status) {
            Some((_, c)) => c.get_or_init(resolve).inc(),
            None => resolve().inc(),
        }
    }
}

fn register<T: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: T) -> T {
    registry
        .register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            register(
                &r,
                IntCounterVec::new(Opts::new(name, help), labels).expect("valid"),
            )
        };
        let decisions = counter(
            "sentinel_decisions_total",
            "Limiter decisions by endpoint, reason and outcome.",
            &["endpoint_id", "decision_reason", "allowed"],
        );
        let degraded = counter(
            "sentinel_degraded_decisions_total",
            "Decisions not made by Redis, by endpoint and fail mode.",
            &["endpoint_id", "fail_mode"],
        );
        let store_errors = counter(
            "sentinel_store_errors_total",
            "Redis store failures by cause.",
            &["cause"],
        );
        let breaker_transitions = counter(
            "sentinel_breaker_transitions_total",
            "Circuit breaker transitions by target state.",
            &["to"],
        );
        let requests = counter(
            "sentinel_requests_total",
            "Requests answered, by endpoint and status.",
            &["endpoint_id", "status"],
        );
        let grpc_status = counter(
            "sentinel_grpc_status_total",
            "gRPC calls answered, by endpoint and gRPC status (the gateway's own or the upstream's; sentinel_requests_total counts them under the HTTP status 200 they are sent with).",
            &["endpoint_id", "grpc_status"],
        );
        let config_reloads = counter(
            "sentinel_config_reloads_total",
            "Config reloads by result.",
            &["result"],
        );
        let shadow_denials = counter(
            "sentinel_shadow_denials_total",
            "Requests a shadow-mode route forwarded although the decision denied them.",
            &["endpoint_id"],
        );
        let overlimit_hits = counter(
            "sentinel_overlimit_cache_hits_total",
            "Denials answered from the local over-limit cache.",
            &["endpoint_id"],
        );
        let exempt_requests = counter(
            "sentinel_exempt_requests_total",
            "Requests forwarded without identity, limit or Redis call: the client is in exempt_client_cidrs.",
            &["endpoint_id"],
        );
        let limit_denials = counter(
            "sentinel_limit_denials_total",
            "Requests Redis denied, by endpoint and the limit that denied them (the one with the longest wait); a single-limit route's limit is \"default\".",
            &["endpoint_id", "limit"],
        );
        let response_charges = counter(
            "sentinel_response_charges_total",
            "Costs reported by upstream answers (cost_from_response): charged, invalid (a malformed value: nothing charged) or failed (Redis could not take it).",
            &["endpoint_id", "result"],
        );
        let tier_decisions = counter(
            "sentinel_tier_decisions_total",
            "Decisions on tiered routes, by endpoint, the tier the caller counted under, and outcome.",
            &["endpoint_id", "tier", "allowed"],
        );
        let jwks_refreshes = counter(
            "sentinel_jwks_refresh_total",
            "Fetches of [auth.jwt] jwks_url, by result (success, failure: the last good keys stay in use).",
            &["result"],
        );
        let jwks_refresh = crate::remote_jwks::RefreshCounters {
            success: jwks_refreshes.with_label_values(&["success"]),
            failure: jwks_refreshes.with_label_values(&["failure"]),
        };
        let jwks_keys = register(
            &r,
            IntGaugeVec::new(
                Opts::new(
                    "sentinel_jwks_keys",
                    "Keys of [auth.jwt] jwks_url's last good fetch that verify tokens now: 0 before the first fetch succeeds (every token 401); no series without jwks_url.",
                ),
                &[],
            )
            .expect("valid"),
        );
        let decision_duration = register(
            &r,
            HistogramVec::new(
                HistogramOpts::new(
                    "sentinel_decision_duration_seconds",
                    "Time spent deciding one limited request.",
                )
                .buckets(latency_buckets()),
                &["endpoint_id"],
            )
            .expect("valid"),
        );
        let redis_duration = register(
            &r,
            Histogram::with_opts(
                HistogramOpts::new(
                    "sentinel_redis_duration_seconds",
                    "Time of one Redis script evaluation, NOSCRIPT reload included.",
                )
                .buckets(latency_buckets()),
            )
            .expect("valid"),
        );
        let redis_batch_size = register(
            &r,
            Histogram::with_opts(
                HistogramOpts::new(
                    "sentinel_redis_batch_size",
                    "Decisions carried by one batched Redis call.",
                )
                // Powers of two, up to the largest `batch_max`.
                .buckets(
                    prometheus::exponential_buckets(
                        1.0,
                        2.0,
                        crate::config::BATCH_MAX_LARGEST.ilog2() as usize + 1,
                    )
                    .expect("valid"),
                ),
            )
            .expect("valid"),
        );
        let breaker_state = register(
            &r,
            IntGauge::new(
                "sentinel_breaker_state",
                "Circuit breaker state: 0 closed, 1 open, 2 half_open.",
            )
            .expect("valid"),
        );
        let config_generation = register(
            &r,
            IntGauge::new(
                "sentinel_config_generation",
                "Generation of the config serving requests; +1 per successful reload.",
            )
            .expect("valid"),
        );
        let config_info = register(
            &r,
            IntGaugeVec::new(
                Opts::new(
                    "sentinel_config_info",
                    "1 for the config serving requests, by config_hash: the first 16 hex digits of the SHA-256 of its file's text, alike on every gateway given the same file.",
                ),
                &["config_hash"],
            )
            .expect("valid"),
        );
        let config_restart_required = register(
            &r,
            IntGauge::new(
                "sentinel_config_restart_required",
                "How many fields of the config serving requests take effect only at the next start (a reload's restart_required); 0 when none.",
            )
            .expect("valid"),
        );
        let in_flight = register(
            &r,
            IntGauge::new(
                "sentinel_requests_in_flight",
                "Proxy requests in progress, their metrics not yet recorded.",
            )
            .expect("valid"),
        );
        let redis_up = register(
            &r,
            IntGauge::new(
                "sentinel_redis_up",
                "1 while the gateway holds a connection to Redis (with Sentinel, to the master; with Redis Cluster, to every primary), as /readyz's redis field; set when scraped.",
            )
            .expect("valid"),
        );
        let redis_evicting = register(
            &r,
            IntGauge::new(
                "sentinel_redis_evicting",
                "1 while a Redis the gateway uses (any primary of a cluster) reads a maxmemory-policy that may evict keys, whose buckets then start full again; 0 when every one reads noeviction or cannot be read (CONFIG not permitted); as /readyz's redis_maxmemory_policy, set when scraped.",
            )
            .expect("valid"),
        );
        let connections_open = register(
            &r,
            IntGauge::new(
                "sentinel_connections_open",
                "Downstream connections open (plain, TLS and HTTP/2 together).",
            )
            .expect("valid"),
        );
        let connections_max = register(
            &r,
            IntGauge::new(
                "sentinel_connections_max",
                "The bound on downstream connections in force (server.max_connections, or what the open-file limit carries).",
            )
            .expect("valid"),
        );
        let connections_shed = register(
            &r,
            IntCounterVec::new(
                Opts::new(
                    "sentinel_connections_shed_total",
                    "Connections the bound shed: closed_idle (an idle one closed, or an idle HTTP/2 one sent a GOAWAY, to make room), refused (a new one closed at once: every connection busy), request_refused (a request answered 503 at capacity).",
                ),
                &["action"],
            )
            .expect("valid"),
        );
        for action in ["closed_idle", "refused", "request_refused"] {
            connections_shed.with_label_values(&[action]);
        }
        let tls_handshakes = register(
            &r,
            IntCounterVec::new(
                Opts::new(
                    "sentinel_tls_handshakes_total",
                    "TLS handshakes on the listeners by result: success, failure (refused: no version, cipher or certificate in common, not TLS, closed in it), timeout (not complete within header_read_timeout_ms).",
                ),
                &["result"],
            )
            .expect("valid"),
        );
        for result in HANDSHAKE_RESULTS.map(|(result, _)| result) {
            tls_handshakes.with_label_values(&[result]);
        }
        let fleet_instances = register(
            &r,
            IntGauge::new(
                "sentinel_fleet_instances",
                "Live gateway instances last counted by the fleet heartbeat (1 until counted).",
            )
            .expect("valid"),
        );
        fleet_instances.set(1);
        let access_log_dropped = register(
            &r,
            IntCounter::new(
                "sentinel_access_log_dropped_total",
                "Access log lines dropped rather than slowing requests: the writer could not keep up or write.",
            )
            .expect("valid"),
        );
        let log_dropped = register(
            &r,
            IntCounter::new(
                "sentinel_log_dropped_total",
                "Log lines dropped rather than slowing requests: stdout could not take them (a pipe nobody reads).",
            )
            .expect("valid"),
        );
        let admin_refused = register(
            &r,
            IntCounter::new(
                "sentinel_admin_refused_total",
                "Admin requests refused for a missing or wrong admin token (admin_token_env or admin_token_file).",
            )
            .expect("valid"),
        );
        let endpoint_mode = register(
            &r,
            IntGaugeVec::new(
                Opts::new(
                    "sentinel_endpoint_mode",
                    "1 for each endpoint's current mode (enforce or shadow), 0 for the other.",
                ),
                &["endpoint_id", "mode"],
            )
            .expect("valid"),
        );
        let redis_node_breaker_state = register(
            &r,
            IntGaugeVec::new(
                Opts::new(
                    "sentinel_redis_node_breaker_state",
                    "Redis Cluster: each primary's circuit breaker, 0 closed, 1 open, 2 half_open.",
                ),
                &["node"],
            )
            .expect("valid"),
        );
        let redis_node_up = register(
            &r,
            IntGaugeVec::new(
                Opts::new(
                    "sentinel_redis_node_up",
                    "Redis Cluster: 1 while connected to the primary, 0 while not.",
                ),
                &["node"],
            )
            .expect("valid"),
        );
        let tls_cert_expiry = register(
            &r,
            IntGaugeVec::new(
                Opts::new(
                    "sentinel_tls_cert_expiry_timestamp_seconds",
                    "When the validity of each certificate the TLS listeners serve ends (Unix time), by its cert_path; set at start and on every reload.",
                ),
                &["cert_path"],
            )
            .expect("valid"),
        );
        let upstream_healthy = register(
            &r,
            IntGaugeVec::new(
                Opts::new(
                    "sentinel_upstream_healthy",
                    "Upstreams with health_check: 1 while the address passes its checks (in rotation), 0 while not.",
                ),
                &["upstream", "addr"],
            )
            .expect("valid"),
        );
        for cause in ["timeout", "connection_error", "noscript"] {
            store_errors.with_label_values(&[cause]);
        }
        for to in ["closed", "open", "half_open"] {
            breaker_transitions.with_label_values(&[to]);
        }
        for result in ["success", "failure"] {
            config_reloads.with_label_values(&[result]);
        }
        Self {
            registry: r,
            decisions,
            decision_duration,
            degraded,
            store_errors,
            redis_duration,
            redis_batch_size,
            breaker_state,
            breaker_transitions,
            redis_node_breaker_state,
            redis_node_up,
            upstream_healthy,
            tls_cert_expiry,
            requests,
            grpc_status,
            config_reloads,
            config_generation,
            config_info,
            config_restart_required,
            shadow_denials,
            overlimit_hits,
            exempt_requests,
            limit_denials,
            response_charges,
            tier_decisions,
            jwks_refresh,
            jwks_keys,
            in_flight,
            connections_open,
            redis_up,
            redis_evicting,
            connections_max,
            connections_shed,
            tls_handshakes,
            fleet_instances,
            access_log_dropped,
            log_dropped,
            admin_refused,
            endpoint_mode,
        }
    }

    pub fn endpoint(
        &self,
        endpoint_id: &str,
        fail_mode: FailMode,
        mode: Enforcement,
        limits: &[&str],
        reports_costs: bool,
    ) -> EndpointMetrics {
        for (name, current) in [
            ("enforce", mode == Enforcement::Enforce),
            ("shadow", mode == Enforcement::Shadow),
        ] {
            self.endpoint_mode
                .with_label_values(&[endpoint_id, name])
                .set(i64::from(current));
        }
        // A route without limits (`algorithm = "none"`) decides nothing.
        let limited = !limits.is_empty();
        let decisions = DecisionReason::ALL
            .iter()
            .map(|&reason| {
                [false, true].map(|allowed| {
                    (limited && possible(reason, allowed, fail_mode)).then(|| {
                        self.decisions.with_label_values(&[
                            endpoint_id,
                            reason.as_str(),
                            bool_label(allowed),
                        ])
                    })
                })
            })
            .collect();
        // Nor is it waited for, degraded, denied or charged: its series of those are not made
        // (a dashboard summing them by `fail_mode` would list it under a mode it does not
        // have), and what it holds in their place is never exported. (Its exempt clients
        // are counted, as they were.)
        let counter = |vec: &IntCounterVec, labels: &[&str]| match limited {
            true => vec.with_label_values(labels),
            false => unexported_counter(),
        };
        EndpointMetrics {
            decisions,
            decisions_vec: self.decisions.clone(),
            endpoint_id: endpoint_id.to_owned(),
            decision_duration: match limited {
                true => self.decision_duration.with_label_values(&[endpoint_id]),
                false => Histogram::with_opts(HistogramOpts::new("unexported", "-"))
                    .expect("a histogram's options"),
            },
            degraded: counter(&self.degraded, &[endpoint_id, fail_mode.as_str()]),
            // Only where they can move: a route in shadow mode, one whose upstream reports
            // costs (a platform's thousands of endpoints would show three charge series and a
            // shadow one each, always 0).
            shadow_denials: match mode {
                Enforcement::Shadow => counter(&self.shadow_denials, &[endpoint_id]),
                Enforcement::Enforce => unexported_counter(),
            },
            overlimit_hits: counter(&self.overlimit_hits, &[endpoint_id]),
            exempt: self.exempt_requests.with_label_values(&[endpoint_id]),
            charges: match reports_costs {
                true => ResponseCharges {
                    charged: counter(&self.response_charges, &[endpoint_id, "charged"]),
                    invalid: counter(&self.response_charges, &[endpoint_id, "invalid"]),
                    failed: counter(&self.response_charges, &[endpoint_id, "failed"]),
                },
                false => ResponseCharges {
                    charged: unexported_counter(),
                    invalid: unexported_counter(),
                    failed: unexported_counter(),
                },
            },
            limit_denials: limits
                .iter()
                .map(|limit| self.limit_denials.with_label_values(&[endpoint_id, limit]))
                .collect(),
            requests: self.requests(endpoint_id),
            grpc: GrpcCounters {
                label: endpoint_id.to_owned(),
                vec: self.grpc_status.clone(),
            },
        }
    }

    /// `sentinel_tls_cert_expiry_timestamp_seconds` of these certificates (their file, and the
    /// end of their validity in Unix seconds), and of no others: a reload that drops a
    /// certificate drops its series.
    pub fn tls_certs<'a>(&self, certs: impl IntoIterator<Item = (&'a str, i64)>) {
        self.tls_cert_expiry.reset();
        for (path, not_after) in certs {
            self.tls_cert_expiry
                .with_label_values(&[path])
                .set(not_after);
        }
    }

    /// An endpoint a reload removed: its `sentinel_endpoint_mode` series go, so that no
    /// gauge says a route that no longer exists is enforced. Its counters stay (a rate over
    /// them would otherwise lose the requests it had until the reload).
    pub fn endpoint_removed(&self, endpoint_id: &str) {
        for mode in ["enforce", "shadow"] {
            let _ = self.endpoint_mode.remove_label_values(&[endpoint_id, mode]);
        }
    }

    /// `sentinel_tier_decisions_total` of one tier: denied, then allowed.
    pub fn tier_decisions(&self, endpoint_id: &str, tier: &str) -> [IntCounter; 2] {
        ["false", "true"].map(|allowed| {
            self.tier_decisions
                .with_label_values(&[endpoint_id, tier, allowed])
        })
    }

    pub fn requests(&self, endpoint_label: &str) -> RequestCounters {
        RequestCounters {
            label: endpoint_label.to_owned(),
            common: (if endpoint_label == UNMATCHED {
                UNMATCHED_STATUSES
            } else {
                COMMON_STATUSES
            })
            .iter()
            .map(|&s| {
                let c = self
                    .requests
                    .with_label_values(&[endpoint_label, &s.to_string()]);
                (s, c)
            })
            .collect(),
            later: (if endpoint_label == UNMATCHED {
                UNMATCHED_LATER
            } else {
                &[]
            })
            .iter()
            .map(|&s| (s, std::sync::OnceLock::new()))
            .collect(),
            vec: self.requests.clone(),
        }
    }

    /// The config serving requests now: its generation and its hash, one series alone.
    /// `restart_required`: how many of the serving config's fields wait for the next start.
    pub fn config_loaded(&self, generation: u64, hash: &str, restart_required: usize) {
        self.config_generation.set(generation as i64);
        self.config_restart_required.set(restart_required as i64);
        self.config_info.reset();
        self.config_info.with_label_values(&[hash]).set(1);
    }

    pub fn store_errors(&self) -> StoreErrorCounters {
        let c = |cause| self.store_errors.with_label_values(&[cause]);
        StoreErrorCounters {
            timeout: c("timeout"),
            connection_error: c("connection_error"),
            noscript: c("noscript"),
        }
    }

    /// One breaker changed state. `process_state` is the value of `sentinel_breaker_state`
    /// after it: the breaker's own with one Redis, the most severe of all primaries' in a
    /// cluster, where `node` names the one that changed.
    pub fn breaker_transition(&self, to: &str, process_state: i64, node: Option<(&str, i64)>) {
        self.breaker_transitions.with_label_values(&[to]).inc();
        self.breaker_state.set(process_state);
        if let Some((node, value)) = node {
            self.redis_node_breaker_state
                .with_label_values(&[node])
                .set(value);
        }
    }

    /// A cluster primary joined (`Some(up)`) or left (`None`) the gateway's view.
    /// The downstream connections as the scrape finds them.
    pub fn connections(&self, connections: &crate::edge::connections::Connections) {
        use crate::edge::connections::Shed;
        self.connections_open.set(connections.open() as i64);
        self.connections_max.set(connections.max() as i64);
        for (action, how) in [
            ("closed_idle", Shed::ClosedIdle),
            ("refused", Shed::Refused),
            ("request_refused", Shed::RequestRefused),
        ] {
            let counter = self.connections_shed.with_label_values(&[action]);
            counter.inc_by(connections.shed(how).saturating_sub(counter.get()));
        }
        for (result, how) in HANDSHAKE_RESULTS {
            let counter = self.tls_handshakes.with_label_values(&[result]);
            counter.inc_by(connections.handshakes(how).saturating_sub(counter.get()));
        }
    }

    pub fn redis_node(&self, node: &str, up: Option<bool>) {
        match up {
            Some(up) => {
                self.redis_node_up.with_label_values(&[node]).set(up as i64);
                self.redis_node_breaker_state.with_label_values(&[node]);
            }
            None => {
                let _ = self.redis_node_up.remove_label_values(&[node]);
                let _ = self.redis_node_breaker_state.remove_label_values(&[node]);
            }
        }
    }

    pub fn config_reload(&self, ok: bool) {
        let result = if ok { "success" } else { "failure" };
        self.config_reloads.with_label_values(&[result]).inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus::TextEncoder::new()
            .encode_utf8(&self.registry.gather(), &mut out)
            .unwrap_or_else(|e| tracing::error!(error = %e, "cannot encode metrics"));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sentinel_decisions_total`'s series of `endpoint`, as `reason/allowed = value`.
    fn decisions(m: &Metrics, endpoint: &str) -> Vec<String> {
        let label = format!("endpoint_id=\"{endpoint}\"");
        let mut found: Vec<String> = m
            .render()
            .lines()
            .filter(|l| l.starts_with("sentinel_decisions_total{") && l.contains(&label))
            .map(|l| {
                let field = |name: &str| {
                    let at = l.find(&format!("{name}=\"")).unwrap() + name.len() + 2;
                    l[at..].split('"').next().unwrap().to_owned()
                };
                let value = l.rsplit(' ').next().unwrap();
                format!(
                    "{}/{} = {value}",
                    field("decision_reason"),
                    field("allowed")
                )
            })
            .collect();
        found.sort();
        found
    }

    /// `sentinel_requests_total`'s statuses of `endpoint`, in the exposition's order.
    fn statuses(m: &Metrics, endpoint: &str) -> Vec<String> {
        let label = format!("sentinel_requests_total{{endpoint_id=\"{endpoint}\",status=\"");
        (m.render().lines())
            .filter_map(|l| l.strip_prefix(&label))
            .map(|rest| rest.split('"').next().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn requests_no_route_matched_show_only_the_statuses_they_can_have_before_the_first() {
        let m = Metrics::new();
        let unmatched = m.requests(UNMATCHED);
        let _ = m.requests("e.api");
        assert_eq!(statuses(&m, UNMATCHED), ["400", "404"]);
        assert_eq!(statuses(&m, "e.api").len(), COMMON_STATUSES.len());
        unmatched.inc(503);
        assert_eq!(statuses(&m, UNMATCHED), ["400", "404", "503"]);
    }

    #[test]
    fn only_the_decisions_an_endpoint_can_give_are_shown_before_the_first() {
        let m = Metrics::new();
        let enforce = Enforcement::Enforce;
        let closed = m.endpoint(
            "e.closed",
            FailMode::FailClosed,
            enforce,
            &["default"],
            false,
        );
        m.endpoint(
            "e.open",
            FailMode::FailOpen,
            enforce,
            &["burst", "daily"],
            false,
        );
        m.endpoint("e.none", FailMode::FailOpen, enforce, &[], false);
        m.endpoint(
            "e.costs",
            FailMode::FailOpen,
            Enforcement::Shadow,
            &["default"],
            true,
        );
        assert_eq!(
            decisions(&m, "e.closed"),
            [
                "allowed/true = 0",
                "circuit_open/false = 0",
                "fail_closed/false = 0",
                "rate_limited/false = 0"
            ]
        );
        assert_eq!(
            decisions(&m, "e.open"),
            [
                "allowed/true = 0",
                "circuit_open/true = 0",
                "emergency_local_limit/false = 0",
                "rate_limited/false = 0",
                "redis_connection_error/true = 0",
                "redis_noscript_retry/true = 0",
                "redis_timeout/true = 0"
            ]
        );
        assert_eq!(decisions(&m, "e.none"), Vec::<String>::new());
        // Shadow denials and reported costs only where a route can have them.
        let text = m.render();
        let series = |name: &str| -> Vec<&str> {
            (text.lines())
                .filter(|l| l.starts_with(name))
                .map(|l| l.split('"').nth(1).unwrap_or_default())
                .collect()
        };
        assert_eq!(series("sentinel_shadow_denials_total{"), ["e.costs"]);
        assert_eq!(
            series("sentinel_response_charges_total{"),
            ["e.costs", "e.costs", "e.costs"]
        );
        // Counted where made ahead; a pair not made ahead is made when it comes.
        closed.count_decision(DecisionReason::FailClosed, false);
        closed.count_decision(DecisionReason::RedisTimeout, true);
        assert_eq!(
            decisions(&m, "e.closed"),
            [
                "allowed/true = 0",
                "circuit_open/false = 0",
                "fail_closed/false = 1",
                "rate_limited/false = 0",
                "redis_timeout/true = 1"
            ]
        );
    }
}
