//! The serde mirror of `gateway.toml`: every field exactly as written, with its position.
//!
//! Nothing here is validated beyond TOML types; `validate.rs` turns this into the domain
//! config. Unknown fields are rejected so a misspelt field never silently falls back to a
//! default.

use serde::Deserialize;
use std::collections::BTreeMap;
use toml::Spanned;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub server: Option<Spanned<RawServer>>,
    pub redis: Option<Spanned<RawRedis>>,
    pub breaker: Option<Spanned<RawBreaker>>,
    pub auth: Option<Spanned<RawAuth>>,
    pub access_log: Option<Spanned<RawAccessLog>>,
    #[serde(default)]
    pub upstreams: BTreeMap<String, Spanned<RawUpstream>>,
    #[serde(default)]
    pub routes: Vec<Spanned<RawRoute>>,
}

/// `listen`: one address, or a list of them, each with its own place (an untagged enum would
/// read the entries through serde's buffer, which drops their spans).
#[derive(Debug)]
pub enum OneOrMany {
    One(String),
    Many(Vec<Spanned<String>>),
}

impl<'de> Deserialize<'de> for OneOrMany {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = OneOrMany;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "an address \"host:port\" or a list of them, e.g. listen = [\"0.0.0.0:8080\", \"[::]:8080\"]",
                )
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<OneOrMany, E> {
                Ok(OneOrMany::One(v.to_owned()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<OneOrMany, A::Error> {
                let mut all = Vec::new();
                while let Some(a) = seq.next_element()? {
                    all.push(a);
                }
                Ok(OneOrMany::Many(all))
            }
        }
        d.deserialize_any(Visitor)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: Option<Spanned<OneOrMany>>,
    pub threads: Option<Spanned<i64>>,
    pub admin_listen: Option<Spanned<String>>,
    pub trusted_proxies: Option<Spanned<Vec<Spanned<String>>>>,
    pub ipv6_identity_prefix: Option<Spanned<i64>>,
    pub grace_period_seconds: Option<Spanned<i64>>,
    pub drain_delay_seconds: Option<Spanned<i64>>,
    pub h2_stream_window_bytes: Option<Spanned<i64>>,
    pub h2_max_concurrent_streams: Option<Spanned<i64>>,
    pub h2_connection_window_bytes: Option<Spanned<i64>>,
    pub watch_config: Option<bool>,
    pub h2c: Option<bool>,
    pub max_body_bytes: Option<Spanned<i64>>,
    pub request_id_header: Option<Spanned<String>>,
    pub strict_transport_security: Option<Spanned<String>>,
    pub admin_token_env: Option<Spanned<String>>,
    pub admin_token_file: Option<Spanned<String>>,
    pub header_read_timeout_ms: Option<Spanned<i64>>,
    pub keepalive_timeout_seconds: Option<Spanned<i64>>,
    pub send_timeout_seconds: Option<Spanned<i64>>,
    pub max_connections: Option<Spanned<i64>>,
    #[serde(default)]
    pub tls: Vec<Spanned<RawTls>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub listen: Spanned<String>,
    pub cert_path: Spanned<String>,
    pub key_path: Spanned<String>,
    pub min_version: Option<Spanned<String>>,
    #[serde(default)]
    pub sni: Vec<Spanned<RawSni>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSni {
    pub server_names: Spanned<Vec<Spanned<String>>>,
    pub cert_path: Spanned<String>,
    pub key_path: Spanned<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAccessLog {
    pub path: Spanned<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRedis {
    pub url: Option<Spanned<String>>,
    pub cluster_urls: Option<Spanned<Vec<Spanned<String>>>>,
    pub timeout_ms: Option<Spanned<i64>>,
    pub key_prefix: Option<Spanned<String>>,
    pub require_noeviction: Option<bool>,
    pub dedicated_io_thread: Option<bool>,
    pub batch_max: Option<Spanned<i64>>,
    pub username: Option<Spanned<String>>,
    pub password_env: Option<Spanned<String>>,
    pub password_file: Option<Spanned<String>>,
    pub sentinel_urls: Option<Spanned<Vec<Spanned<String>>>>,
    pub sentinel_master: Option<Spanned<String>>,
    pub sentinel_password_env: Option<Spanned<String>>,
    pub sentinel_password_file: Option<Spanned<String>>,
    pub tls_ca_path: Option<Spanned<String>>,
    pub tls_cert_path: Option<Spanned<String>>,
    pub tls_key_path: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBreaker {
    pub failure_threshold: Option<Spanned<i64>>,
    pub open_seconds: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuth {
    pub jwt: Option<Spanned<RawJwt>>,
    pub api_keys: Option<Spanned<RawApiKeys>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawApiKeys {
    pub header: Option<Spanned<String>>,
    pub file: Spanned<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJwt {
    pub secret_env: Option<Spanned<String>>,
    pub secret_file: Option<Spanned<String>>,
    pub algorithms: Option<Spanned<Vec<String>>>,
    pub jwks_path: Option<Spanned<String>>,
    pub jwks_url: Option<Spanned<String>>,
    pub jwks_refresh_seconds: Option<Spanned<i64>>,
    /// One issuer or a list of them: read by the validation, which says what it is not.
    pub issuer: Option<Spanned<toml::Value>>,
    pub audiences: Option<Spanned<Vec<String>>>,
    /// Claim name -> a value or a list of values (read by the validation too).
    pub required_claims: Option<Spanned<BTreeMap<String, Spanned<toml::Value>>>>,
    pub leeway_seconds: Option<Spanned<i64>>,
    pub identity_claim: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub addrs: Spanned<Vec<Spanned<String>>>,
    pub connect_timeout_ms: Option<Spanned<i64>>,
    pub read_timeout_ms: Option<Spanned<i64>>,
    pub tls: Option<bool>,
    pub http2: Option<bool>,
    pub sni: Option<Spanned<String>>,
    pub ca_path: Option<Spanned<String>>,
    pub verify: Option<Spanned<bool>>,
    pub health_check: Option<Spanned<RawHealthCheck>>,
}

/// `health_check = { path = "/healthz", ... }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealthCheck {
    pub path: Option<Spanned<String>>,
    pub grpc_service: Option<Spanned<String>>,
    pub interval_ms: Option<Spanned<i64>>,
    pub timeout_ms: Option<Spanned<i64>>,
    pub unhealthy_after: Option<Spanned<i64>>,
    pub healthy_after: Option<Spanned<i64>>,
}

/// `identity = "client_ip"` (a name) or `{ header = "X-API-Key" }`.
#[derive(Debug)]
pub enum RawIdentity {
    Named(String),
    Header { header: String },
}

impl<'de> Deserialize<'de> for RawIdentity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        named_or_table(
            d,
            "header",
            "\"jwt\", \"api_key\", \"client_ip\", \"global\" or { header = \"<name>\" }",
        )
        .map(|v| match v {
            NamedOrTable::Named(n) => RawIdentity::Named(n),
            NamedOrTable::Table(header) => RawIdentity::Header { header },
        })
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    /// Required: missing, it is reported with the route's other problems.
    pub endpoint_id: Option<Spanned<String>>,
    pub path: Option<Spanned<String>>,
    pub path_prefix: Option<Spanned<String>>,
    pub methods: Option<Spanned<Vec<Spanned<String>>>>,
    pub host: Option<Spanned<String>>,
    /// Required, as `endpoint_id`.
    pub upstream: Option<Spanned<String>>,
    pub identity: Option<Spanned<RawIdentity>>,
    pub algorithm: Option<Spanned<String>>,
    pub limit: Option<Spanned<i64>>,
    pub window_size_micro: Option<Spanned<i64>>,
    pub capacity_micro: Option<Spanned<i64>>,
    pub refill_rate_micro_per_sec: Option<Spanned<i64>>,
    pub fail_mode: Option<Spanned<String>>,
    pub fallback_rate_per_process_micro: Option<Spanned<i64>>,
    pub fallback_rate_fleet_micro: Option<Spanned<i64>>,
    pub emergency_scope: Option<Spanned<String>>,
    pub policy_version: Option<Spanned<i64>>,
    pub ratelimit_headers: Option<Spanned<RawRateLimitHeaders>>,
    pub cost_micro: Option<Spanned<i64>>,
    pub mode: Option<Spanned<String>>,
    pub max_body_bytes: Option<Spanned<i64>>,
    pub websocket: Option<Spanned<bool>>,
    pub exempt_client_cidrs: Option<Spanned<Vec<Spanned<String>>>>,
    pub forward_identity: Option<Spanned<bool>>,
    pub cors_origins: Option<Spanned<Vec<Spanned<String>>>>,
    /// Absent, or written (`limits = []` is written, and names no limit).
    pub limits: Option<Spanned<Vec<Spanned<RawLimit>>>>,
    pub cost_from_response: Option<Spanned<RawCostFromResponse>>,
    pub tier_from: Option<Spanned<RawTierFrom>>,
    pub default_tier: Option<Spanned<String>>,
    #[serde(default)]
    pub tiers: BTreeMap<String, Spanned<RawTier>>,
}

/// `tier_from = "api_key"` or `{ claim = "plan" }`.
#[derive(Debug)]
pub enum RawTierFrom {
    Named(String),
    Claim { claim: String },
}

impl<'de> Deserialize<'de> for RawTierFrom {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        named_or_table(d, "claim", "\"api_key\" or { claim = \"<claim>\" }").map(|v| match v {
            NamedOrTable::Named(n) => RawTierFrom::Named(n),
            NamedOrTable::Table(claim) => RawTierFrom::Claim { claim },
        })
    }
}

/// `ratelimit_headers = true` (or `false`), or the name of the fields: `"ietf"`,
/// `"x-ratelimit"`, `"both"` (a name is checked with the route's other fields).
#[derive(Debug)]
pub enum RawRateLimitHeaders {
    Bool(bool),
    Named(String),
}

impl<'de> Deserialize<'de> for RawRateLimitHeaders {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = RawRateLimitHeaders;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true, false, \"ietf\", \"x-ratelimit\" or \"both\"")
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Self::Value, E> {
                Ok(RawRateLimitHeaders::Bool(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(RawRateLimitHeaders::Named(v.to_owned()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A string, or an inline table of exactly one string field.
enum NamedOrTable {
    Named(String),
    Table(String),
}

/// Reads a string or `{ <field> = "..." }`; any other key of the table is an error that
/// says what would be valid (`expecting`), as every other table's unknown fields are.
fn named_or_table<'de, D: serde::Deserializer<'de>>(
    d: D,
    field: &'static str,
    expecting: &'static str,
) -> Result<NamedOrTable, D::Error> {
    struct V {
        field: &'static str,
        expecting: &'static str,
    }
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = NamedOrTable;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str(self.expecting)
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<NamedOrTable, E> {
            Ok(NamedOrTable::Named(v.to_owned()))
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<NamedOrTable, A::Error> {
            use serde::de::Error;
            let mut value = None;
            while let Some(key) = map.next_key::<String>()? {
                if key != self.field {
                    return Err(A::Error::custom(format!(
                        "unknown field `{key}`, expected `{}`",
                        self.field
                    )));
                }
                if value.is_some() {
                    return Err(A::Error::duplicate_field(self.field));
                }
                value = Some(map.next_value::<String>()?);
            }
            value
                .map(NamedOrTable::Table)
                .ok_or_else(|| A::Error::custom(format!("expected {}", self.expecting)))
        }
    }
    d.deserialize_any(V { field, expecting })
}

/// `[routes.tiers.<name>]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTier {
    #[serde(default)]
    pub limits: Vec<Spanned<RawLimit>>,
    pub unlimited: Option<Spanned<bool>>,
}

/// `cost_from_response = { header = "...", unit_micro = ... }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCostFromResponse {
    pub header: Spanned<String>,
    pub unit_micro: Option<Spanned<i64>>,
}

/// One `[[routes.limits]]` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    pub name: Spanned<String>,
    pub identity: Option<Spanned<String>>,
    pub algorithm: Spanned<String>,
    pub limit: Option<Spanned<i64>>,
    pub window_size_micro: Option<Spanned<i64>>,
    pub capacity_micro: Option<Spanned<i64>>,
    pub refill_rate_micro_per_sec: Option<Spanned<i64>>,
}

/// The field names of a route, in the order the documentation lists them; a test keeps
/// `docs/configuration.md` in step with this list.
pub const ROUTE_FIELDS: &[&str] = &[
    "endpoint_id",
    "path",
    "path_prefix",
    "methods",
    "host",
    "upstream",
    "identity",
    "algorithm",
    "limit",
    "window_size_micro",
    "capacity_micro",
    "refill_rate_micro_per_sec",
    "cost_micro",
    "fail_mode",
    "fallback_rate_per_process_micro",
    "fallback_rate_fleet_micro",
    "emergency_scope",
    "policy_version",
    "ratelimit_headers",
    "mode",
    "max_body_bytes",
    "websocket",
    "exempt_client_cidrs",
    "forward_identity",
    "cors_origins",
    "limits",
    "cost_from_response",
    "tier_from",
    "default_tier",
    "tiers",
];
