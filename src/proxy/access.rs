//! One access log line: what a request asked, who asked (as a hash), what was decided and
//! what was answered. Never the raw identity, the query string, `Authorization` or cookies.

use std::time::{Duration, SystemTime};

use pingora::prelude::*;
use serde_json::{json, Value};

use super::RequestCtx;
use crate::decision::DecisionReason;
use crate::limiter::inspect::DEFAULT_LIMIT;

/// The JSON line (without its newline) for a request answered with `status`.
pub(super) fn line(session: &Session, ctx: &RequestCtx, status: u16) -> String {
    let took = ctx.started.map_or(Duration::ZERO, |s| s.elapsed());
    let started: chrono::DateTime<chrono::Utc> = (SystemTime::now() - took).into();
    let req = session.req_header();
    let header = |name: http::header::HeaderName| -> Value {
        req.headers.get(name).map_or(Value::Null, |v| {
            String::from_utf8_lossy(v.as_bytes()).into()
        })
    };
    let host = req
        .uri
        .authority()
        .map(|a| Value::from(super::forwarded::without_userinfo(a)))
        .unwrap_or_else(|| header(http::header::HOST));
    let protocol = match req.version {
        http::Version::HTTP_2 => "HTTP/2",
        http::Version::HTTP_10 => "HTTP/1.0",
        _ => "HTTP/1.1",
    };
    let route = ctx.route.as_ref();
    let decision = ctx.decision.as_ref();
    let forwarded = ctx.upstream_addr.is_some();
    let origin = ctx.origin.as_ref();
    json!({
        "timestamp": started.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        "request_id": origin.map(|o| o.request_id.as_str()),
        "client_ip": origin.and_then(|o| o.client).map(|ip| ip.to_string()),
        "method": req.method.as_str(),
        "host": host,
        "path": ctx.path.as_deref(),
        "protocol": protocol,
        "tls": origin.is_some_and(|o| o.tls),
        "status": status,
        "endpoint_id": route.map(|r| r.endpoint.policy.endpoint_id.as_str()),
        "decision_reason": decision.map(|d| d.reason().as_str()),
        "allowed": decision.map(|d| d.allowed()),
        "tier": ctx.tier.as_deref(),
        "limit": route.and_then(|r| ctx.denied_limit(r)).or_else(|| {
            // A denial the over-limit cache repeated: a single-limit route has one limit.
            decision
                .filter(|d| d.reason() == DecisionReason::RateLimited)
                .and(route)
                .filter(|r| !r.endpoint.policy.several)
                .map(|_| DEFAULT_LIMIT)
        }),
        "upstream": route.filter(|_| forwarded).map(|r| r.upstream.config.name.as_str()),
        "upstream_addr": ctx.upstream_addr.map(|a| a.to_string()),
        "duration_ms": took.as_secs_f64() * 1000.0,
        "bytes_received": session.body_bytes_read(),
        "bytes_sent": session.body_bytes_sent(),
        "identity_hash": ctx.identity_hash.as_deref(),
        "user_agent": header(http::header::USER_AGENT),
    })
    .to_string()
}
