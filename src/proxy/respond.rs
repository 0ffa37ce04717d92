//! The answers the gateway writes itself: JSON bodies, their statuses and headers; to a gRPC
//! call, its Trailers-Only answer ([`grpc`]).
//!
//! Written from `request_filter` (or `fail_to_proxy`), header with Content-Length first,
//! then the body; these answers skip `response_filter`.

use bytes::Bytes;
use pingora::prelude::*;
use pingora_http::ResponseHeader;
use rand::Rng;

use super::grpc;

/// Largest total size of a request's header names and values accepted, in bytes.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// The total size of a head's field names and values, as [`MAX_HEADER_BYTES`] bounds it.
pub fn fields_bytes(headers: &http::HeaderMap) -> usize {
    headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum()
}

/// Every answer that does not come from an upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    BadRequest,
    /// The request's headers together exceed [`MAX_HEADER_BYTES`].
    HeadersTooLarge,
    /// The body is larger than the route's `max_body_bytes`.
    BodyTooLarge,
    NoRoute,
    /// `CONNECT` (the gateway is no tunnel) and `TRACE` (never echoed by a backend).
    MethodNotAllowed,
    /// `bearer`: the route reads a JWT, so the answer names the scheme.
    Unauthenticated {
        bearer: bool,
    },
    /// 429 from Redis or the emergency limiter.
    RateLimited {
        retry_after_secs: u64,
    },
    /// 503: the limiter could not decide and the route fails closed (or the breaker is open).
    LimiterUnavailable {
        retry_after_base_secs: u64,
    },
    UpstreamUnavailable,
    UpstreamTimeout,
    /// 408: the upstream timed out waiting for a body the client announced and did not send.
    BodyTimeout,
    /// 503: as many requests are in flight as `max_connections` allows (HTTP/2 streams).
    AtCapacity,
    /// 204: a listed origin's CORS preflight, answered by the gateway (`cors_origins`).
    Preflight,
}

impl Answer {
    pub fn status(self) -> u16 {
        match self {
            Answer::BadRequest => 400,
            Answer::HeadersTooLarge => 431,
            Answer::BodyTooLarge => 413,
            Answer::NoRoute => 404,
            Answer::MethodNotAllowed => 405,
            Answer::Unauthenticated { .. } => 401,
            Answer::RateLimited { .. } => 429,
            Answer::LimiterUnavailable { .. } => 503,
            Answer::UpstreamUnavailable => 502,
            Answer::UpstreamTimeout => 504,
            Answer::BodyTimeout => 408,
            Answer::AtCapacity => 503,
            Answer::Preflight => 204,
        }
    }

    pub fn body(self) -> &'static str {
        match self {
            Answer::BadRequest => r#"{"detail":"bad request"}"#,
            Answer::HeadersTooLarge => r#"{"detail":"request header fields too large"}"#,
            Answer::BodyTooLarge => r#"{"detail":"request body too large"}"#,
            Answer::NoRoute => r#"{"detail":"no route"}"#,
            Answer::MethodNotAllowed => r#"{"detail":"method not allowed"}"#,
            Answer::Unauthenticated { .. } => r#"{"detail":"authentication required"}"#,
            Answer::RateLimited { .. } => r#"{"detail":"rate limit exceeded"}"#,
            Answer::LimiterUnavailable { .. } => r#"{"detail":"rate limiter unavailable"}"#,
            Answer::UpstreamUnavailable => r#"{"detail":"upstream unavailable"}"#,
            Answer::UpstreamTimeout => r#"{"detail":"upstream timeout"}"#,
            Answer::BodyTimeout => r#"{"detail":"request body timeout"}"#,
            Answer::AtCapacity => r#"{"detail":"gateway at capacity"}"#,
            Answer::Preflight => "",
        }
    }

    /// The `Retry-After` value, if the answer carries one. A 503's is jittered between the
    /// base and one and a half times it, so clients do not come back in lockstep.
    pub fn retry_after(self) -> Option<u64> {
        match self {
            Answer::RateLimited { retry_after_secs } => Some(retry_after_secs.max(1)),
            Answer::LimiterUnavailable {
                retry_after_base_secs,
            } => {
                let base = retry_after_base_secs.max(1);
                Some(base + rand::rng().random_range(0..=(base / 2).max(1)))
            }
            Answer::AtCapacity => Some(1),
            _ => None,
        }
    }

    /// The answer's gRPC status and message, for a gRPC call ([`grpc`]): HTTP statuses as
    /// gRPC's `http-grpc-status-mapping.md` maps them, but for the limits: a rate limit and a
    /// body or head too large are `RESOURCE_EXHAUSTED`, as gRPC's own servers say them.
    pub fn grpc_status(self) -> (u8, &'static str) {
        use grpc::code;
        let code = match self {
            Answer::RateLimited { .. } | Answer::BodyTooLarge | Answer::HeadersTooLarge => {
                code::RESOURCE_EXHAUSTED
            }
            Answer::LimiterUnavailable { .. }
            | Answer::AtCapacity
            | Answer::UpstreamUnavailable
            | Answer::UpstreamTimeout => code::UNAVAILABLE,
            Answer::BodyTimeout => code::DEADLINE_EXCEEDED,
            Answer::Unauthenticated { .. } => code::UNAUTHENTICATED,
            Answer::NoRoute | Answer::MethodNotAllowed => code::UNIMPLEMENTED,
            // A preflight is no call (`OPTIONS`): never said so.
            Answer::BadRequest | Answer::Preflight => code::INTERNAL,
        };
        (code, self.detail())
    }

    /// The `detail` of the answer's body, as words (`rate limit exceeded`).
    fn detail(self) -> &'static str {
        let body = self.body();
        body.strip_prefix(r#"{"detail":""#)
            .and_then(|rest| rest.strip_suffix(r#""}"#))
            .unwrap_or("")
    }

    /// The complete response header.
    pub fn header(self) -> Result<ResponseHeader> {
        let body = self.body();
        let mut h = ResponseHeader::build(self.status(), Some(5))?;
        // A 204 has neither (RFC 9110, 8.6).
        if self != Answer::Preflight {
            h.insert_header("content-type", "application/json")?;
            h.insert_header("content-length", body.len().to_string())?;
        }
        if let Some(secs) = self.retry_after() {
            h.insert_header("retry-after", secs.to_string())?;
        }
        if self == (Answer::Unauthenticated { bearer: true }) {
            h.insert_header("www-authenticate", "Bearer")?;
        }
        if self == Answer::MethodNotAllowed {
            h.insert_header("allow", "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")?;
        }
        Ok(h)
    }
}

/// Writes `answer` with a header built, and perhaps extended, by the caller; a gRPC call's
/// as gRPC says it ([`super::grpc`]). The status written, and the gRPC status when so.
pub async fn write_with(
    session: &mut Session,
    answer: Answer,
    mut header: ResponseHeader,
) -> Result<(u16, Option<u8>)> {
    let call = grpc::call_type(session.req_header()).filter(|_| answer != Answer::Preflight);
    if let Some(call) = call.cloned() {
        let (code, message) = answer.grpc_status();
        grpc::trailers_only(&mut header, call, code, message)?;
        // A head that ends the stream (`write_response_header` would end it with an empty
        // DATA frame, which a client reads as a body: the status then waits for trailers).
        let head = pingora_core::protocols::http::HttpTask::Header(Box::new(header), true);
        session.write_response_tasks(vec![head]).await?;
        return Ok((200, Some(code)));
    }
    // The answer to HEAD has the headers of the answer to GET and no body (RFC 9110, 9.3.2):
    // HTTP/1.1 leaves it out by itself; an HTTP/2 stream would carry it, which clients
    // reset as malformed.
    let body = match session.req_header().method == http::Method::HEAD {
        true => None,
        false => Some(Bytes::from_static(answer.body().as_bytes())),
    };
    session
        .write_response_header(Box::new(header), false)
        .await?;
    session.write_response_body(body, true).await?;
    Ok((answer.status(), None))
}

/// Longest a request body is read and thrown away after the gateway answered it.
const LINGER_FOR: std::time::Duration = std::time::Duration::from_secs(2);
/// Longest wait for the next part of a body being thrown away.
const LINGER_IDLE: std::time::Duration = std::time::Duration::from_millis(250);
/// Most bytes of a body thrown away.
const LINGER_BYTES: u64 = 16 << 20;

/// After an answer written before the request's body was read (a 413, a 401 or 429 to a
/// POST), reads the rest of the body and throws it away, for a bounded time, as nginx's
/// lingering close does: closing an HTTP/1 connection with the client's bytes unread makes
/// the kernel reset it, which can destroy the answer before the client reads it, and an
/// HTTP/2 stream ended before its body is reset, which some clients take as the answer's
/// loss. A client that stops sending (it waited for `100 Continue`) is left after a quarter
/// of a second. Whether the body was read to its end.
pub async fn linger(session: &mut Session) -> bool {
    let drain = async {
        let mut thrown = 0u64;
        while thrown < LINGER_BYTES {
            match tokio::time::timeout(LINGER_IDLE, session.read_request_body()).await {
                Ok(Ok(Some(chunk))) => thrown += chunk.len() as u64,
                Ok(Ok(None)) => return true,
                _ => return false,
            }
        }
        false
    };
    tokio::time::timeout(LINGER_FOR, drain)
        .await
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_retry_after_is_jittered_around_the_base() {
        let seen: std::collections::BTreeSet<u64> = (0..200)
            .filter_map(|_| {
                Answer::LimiterUnavailable {
                    retry_after_base_secs: 10,
                }
                .retry_after()
            })
            .collect();
        assert!(seen.iter().all(|s| (10..=15).contains(s)), "{seen:?}");
        assert!(seen.len() > 1, "no jitter: {seen:?}");
    }

    #[test]
    fn a_calls_answers_are_grpc_statuses_with_the_bodys_words() {
        use crate::proxy::grpc::code;
        let limited = Answer::RateLimited {
            retry_after_secs: 3,
        };
        assert_eq!(
            limited.grpc_status(),
            (code::RESOURCE_EXHAUSTED, "rate limit exceeded")
        );
        let unavailable = [
            Answer::LimiterUnavailable {
                retry_after_base_secs: 1,
            },
            Answer::AtCapacity,
            Answer::UpstreamUnavailable,
            Answer::UpstreamTimeout,
        ];
        for answer in unavailable {
            assert_eq!(answer.grpc_status().0, code::UNAVAILABLE, "{answer:?}");
        }
        let missing = Answer::Unauthenticated { bearer: true };
        assert_eq!(
            missing.grpc_status(),
            (code::UNAUTHENTICATED, "authentication required")
        );
        assert_eq!(
            Answer::NoRoute.grpc_status(),
            (code::UNIMPLEMENTED, "no route")
        );
        assert_eq!(
            Answer::BodyTooLarge.grpc_status().0,
            code::RESOURCE_EXHAUSTED
        );
    }

    #[test]
    fn rate_limited_header_carries_json_and_retry_after() {
        let h = Answer::RateLimited {
            retry_after_secs: 0,
        }
        .header()
        .unwrap();
        assert_eq!(h.status.as_u16(), 429);
        assert_eq!(h.headers["content-type"], "application/json");
        assert_eq!(h.headers["retry-after"], "1");
        assert_eq!(h.headers["content-length"], "32");
    }
}
