//! One access log line: what a request asked, who asked (as a hash), what was decided and
//! what was answered. Never the raw identity, the query string, `Authorization` or cookies.

use std::time::SystemTime;

use pingora::prelude::*;

use super::RequestCtx;
use crate::decision::DecisionReason;
use crate::edge::access_log::{Line, Lossy, Timestamp};
use crate::limiter::inspect::DEFAULT_LIMIT;

/// Writes the access log line of a request head the HTTP/1 parser refused: only what the
/// connection knows.
pub fn bad_head(log: &crate::edge::AccessLog, head: &crate::edge::connections::BadHead<'_>) {
    let now = SystemTime::now();
    log.log(&Line {
        timestamp: Timestamp::of(now.checked_sub(head.took).unwrap_or(now)),
        request_id: Some(head.request_id),
        client_ip: head.peer,
        method: None,
        host: None,
        path: None,
        protocol: head.protocol,
        tls: head.tls,
        status: head.status,
        grpc_status: None,
        endpoint_id: None,
        decision_reason: None,
        allowed: None,
        tier: None,
        limit: None,
        upstream: None,
        upstream_addr: None,
        duration_ms: millis(head.took),
        bytes_received: 0,
        bytes_sent: head.bytes_sent,
        identity_hash: None,
        user_agent: None,
        // A 431 is a limit the gateway keeps, as a 413 is; the others are the client's.
        error: match head.status {
            408 => Some(super::Failure::CLIENT_TIMEOUT),
            431 => None,
            _ => Some(super::Failure::CLIENT_ERROR),
        },
    });
}

/// Writes the access log line of a request answered with `status`.
pub(super) fn log(log: &crate::edge::AccessLog, session: &Session, ctx: &RequestCtx, status: u16) {
    let elapsed = ctx.started.map(|s| s.elapsed()).unwrap_or_default();
    let took = ctx.took.unwrap_or(elapsed);
    // When it came: a body read on after the answer ([`super::linger`]) is no later arrival.
    let started = SystemTime::now() - elapsed;
    let req = session.req_header();
    let header =
        |name: http::header::HeaderName| req.headers.get(name).map(|v| Lossy(v.as_bytes()));
    let route = ctx.route.as_ref();
    let hidden = |field: &str| identity_in(ctx, field);
    // A `Host` that is no authority (answered 400) may be anything a client sent, a
    // credential of a head whose line breaks were lost among it: not written.
    let received = super::forwarded::received_host(req)
        .filter(|_| !hidden("host"))
        .filter(|h| super::head::is_authority(h));
    let host = received.as_deref().map(Lossy);
    // A `CONNECT` names an authority, no path.
    let path = ctx
        .path
        .as_deref()
        .filter(|_| req.method != http::Method::CONNECT)
        // Without its parameters: a session id there is a cookie's equal.
        .map(crate::routing::parameters_dropped);
    let protocol = match req.version {
        http::Version::HTTP_2 => "HTTP/2",
        http::Version::HTTP_10 => "HTTP/1.0",
        _ => "HTTP/1.1",
    };
    let decision = ctx.decision.as_ref();
    // Sent upstream, or an upstream connection tried for it (a 502's address is the one that
    // failed).
    let forwarded = (ctx.forwarded || ctx.connect_failed) && ctx.upstream_addr.is_some();
    let origin = ctx.origin.as_ref();
    let line = Line {
        timestamp: Timestamp::of(started),
        request_id: origin.map(|o| o.request_id.as_str()),
        // A trusted proxy that named no usable client: the proxy, as nginx's `$remote_addr`.
        client_ip: origin.and_then(|o| o.client.or(o.peer)),
        method: Some(req.method.as_str()),
        host,
        path: path.as_deref(),
        protocol,
        tls: origin.is_some_and(|o| o.tls),
        status,
        grpc_status: ctx.grpc_status,
        endpoint_id: route.map(|r| r.endpoint.policy.endpoint_id.as_str()),
        decision_reason: decision.map(|d| d.reason().as_str()),
        allowed: decision.map(|d| d.allowed()),
        tier: ctx.tier.as_deref(),
        limit: route.and_then(|r| ctx.denied_limit(r)).or_else(|| {
            // A denial the over-limit cache repeated: a single-limit route has one limit.
            decision
                .filter(|d| d.reason() == DecisionReason::RateLimited)
                .and(route)
                .filter(|r| !r.endpoint.policy.several)
                .map(|_| DEFAULT_LIMIT)
        }),
        upstream: route
            .filter(|_| forwarded || ctx.no_address)
            .map(|r| r.upstream.config.name.as_str()),
        upstream_addr: ctx.upstream_addr.filter(|_| forwarded),
        duration_ms: millis(took),
        bytes_received: session.body_bytes_read() as u64,
        bytes_sent: session.body_bytes_sent() as u64,
        identity_hash: ctx.identity_hash.as_deref(),
        user_agent: header(http::header::USER_AGENT).filter(|_| !hidden("user-agent")),
        error: ctx.failure,
    };
    log.log(&line);
}

/// Whether the request's `field` (`host`, `user-agent`) may be its raw identity, which no
/// line carries (its hash does): its route reads the identity from it (`identity = { header
/// = ... }`, or `api_key` with `[auth.api_keys] header`), or, before its route was known
/// (`TRACE`'s 405, a 431), any route does.
pub(super) fn identity_in(ctx: &RequestCtx, field: &str) -> bool {
    let snapshot = ctx.snapshot.as_ref();
    let api_keys = snapshot.and_then(|s| s.config.api_keys.as_ref());
    match &ctx.route {
        Some(r) => r.identity_header(api_keys) == Some(field),
        None => snapshot.is_some_and(|s| s.identity_fields.iter().any(|f| f == field)),
    }
}

/// `took` in milliseconds, to the microsecond: `0.868`, not `0.8684419999999999`, the noise
/// of a double made from seconds.
fn millis(took: std::time::Duration) -> f64 {
    took.as_micros() as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn a_path_is_written_without_its_parameters() {
        for (path, written) in [
            ("/api/v1", "/api/v1"),
            ("/shop;jsessionid=A1B2/cart", "/shop/cart"),
            ("/api/v1;jsessionid=A1B2", "/api/v1"),
            ("/a;x;y=1/b;SECRET/", "/a/b/"),
            ("/;p", "/"),
            ("/a%3Bb", "/a%3Bb"),
        ] {
            assert_eq!(crate::routing::parameters_dropped(path), written, "{path}");
        }
    }

    #[test]
    fn durations_are_written_in_milliseconds_to_the_microsecond() {
        let written = |took| serde_json::to_string(&super::millis(took)).unwrap();
        assert_eq!(written(Duration::from_nanos(868_442_999)), "868.442");
        assert_eq!(written(Duration::from_nanos(868_442)), "0.868");
        assert_eq!(written(Duration::from_micros(1)), "0.001");
        assert_eq!(written(Duration::ZERO), "0.0");
        assert_eq!(written(Duration::from_secs(3)), "3000.0");
    }
}
