//! One access log line: what a request asked, who asked (as a hash), what was decided and
//! what was answered. Never the raw identity, the query string, `Authorization` or cookies.

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, SystemTime};

use pingora::prelude::*;
use serde::Serialize;

use super::RequestCtx;
use crate::decision::DecisionReason;
use crate::limiter::inspect::DEFAULT_LIMIT;

/// The line's keys, in the order the contract lists them. Serialized straight from what the
/// request already holds (borrowed), into one string: no map of values is built per line.
#[derive(Serialize)]
struct Line<'a> {
    timestamp: Timestamp,
    request_id: Option<&'a str>,
    client_ip: Option<IpAddr>,
    method: &'a str,
    host: Option<Cow<'a, str>>,
    path: Option<&'a str>,
    protocol: &'static str,
    tls: bool,
    status: u16,
    endpoint_id: Option<&'a str>,
    decision_reason: Option<&'static str>,
    allowed: Option<bool>,
    tier: Option<&'a str>,
    limit: Option<&'a str>,
    upstream: Option<&'a str>,
    upstream_addr: Option<SocketAddr>,
    duration_ms: f64,
    bytes_received: usize,
    bytes_sent: usize,
    identity_hash: Option<&'a str>,
    user_agent: Option<Cow<'a, str>>,
}

/// When the request started, written as RFC 3339 in UTC with milliseconds
/// (`2026-12-01T17:30:05.042Z`). The date and time of day are formatted once a second per
/// thread; each line adds its milliseconds.
struct Timestamp(SystemTime);

thread_local! {
    /// The second last formatted on this thread, and its `YYYY-MM-DDTHH:MM:SS.`.
    static SECOND: std::cell::RefCell<(u64, String)> = const { std::cell::RefCell::new((u64::MAX, String::new())) };
}

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let since = self
            .0
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let (secs, millis) = (since.as_secs(), since.subsec_millis());
        SECOND.with_borrow_mut(|(second, prefix)| {
            if *second != secs {
                let at = chrono::DateTime::<chrono::Utc>::from(
                    SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
                );
                *prefix = at.format("%Y-%m-%dT%H:%M:%S.").to_string();
                *second = secs;
            }
            let mut text = [0u8; 32];
            let n = prefix.len().min(27);
            text[..n].copy_from_slice(&prefix.as_bytes()[..n]);
            text[n] = b'0' + (millis / 100) as u8;
            text[n + 1] = b'0' + (millis / 10 % 10) as u8;
            text[n + 2] = b'0' + (millis % 10) as u8;
            text[n + 3] = b'Z';
            s.serialize_str(std::str::from_utf8(&text[..n + 4]).unwrap_or_default())
        })
    }
}

/// Writes the access log line of a request answered with `status`.
pub(super) fn log(log: &crate::edge::AccessLog, session: &Session, ctx: &RequestCtx, status: u16) {
    let took = ctx.started.map_or(Duration::ZERO, |s| s.elapsed());
    let started = SystemTime::now() - took;
    let req = session.req_header();
    let header = |name: http::header::HeaderName| {
        req.headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()))
    };
    let host = match req.uri.authority() {
        Some(a) => Some(Cow::Owned(super::forwarded::without_userinfo(a))),
        None => header(http::header::HOST),
    };
    let protocol = match req.version {
        http::Version::HTTP_2 => "HTTP/2",
        http::Version::HTTP_10 => "HTTP/1.0",
        _ => "HTTP/1.1",
    };
    let route = ctx.route.as_ref();
    let decision = ctx.decision.as_ref();
    let forwarded = ctx.upstream_addr.is_some();
    let origin = ctx.origin.as_ref();
    let line = Line {
        timestamp: Timestamp(started),
        request_id: origin.map(|o| o.request_id.as_str()),
        client_ip: origin.and_then(|o| o.client),
        method: req.method.as_str(),
        host,
        path: ctx.path.as_deref(),
        protocol,
        tls: origin.is_some_and(|o| o.tls),
        status,
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
            .filter(|_| forwarded)
            .map(|r| r.upstream.config.name.as_str()),
        upstream_addr: ctx.upstream_addr,
        duration_ms: took.as_secs_f64() * 1000.0,
        bytes_received: session.body_bytes_read(),
        bytes_sent: session.body_bytes_sent(),
        identity_hash: ctx.identity_hash.as_deref(),
        user_agent: header(http::header::USER_AGENT),
    };
    log.log(&line);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc_with_milliseconds_across_seconds() {
        let at = |ms: u64| {
            serde_json::to_string(&Timestamp(
                SystemTime::UNIX_EPOCH + Duration::from_millis(ms),
            ))
            .unwrap()
        };
        assert_eq!(at(1_796_146_205_042), "\"2026-12-01T17:30:05.042Z\"");
        assert_eq!(at(1_796_146_205_999), "\"2026-12-01T17:30:05.999Z\"");
        assert_eq!(at(1_796_146_206_000), "\"2026-12-01T17:30:06.000Z\"");
        assert_eq!(at(0), "\"1970-01-01T00:00:00.000Z\"");
        let now = SystemTime::now();
        let chrono_said = chrono::DateTime::<chrono::Utc>::from(now)
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        assert_eq!(
            serde_json::to_string(&Timestamp(now)).unwrap(),
            format!("\"{chrono_said}\"")
        );
    }
}
