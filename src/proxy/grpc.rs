//! gRPC calls: a request whose `Content-Type` is `application/grpc` (`+proto`, `+json`, and
//! gRPC-Web's `application/grpc-web...` alike).
//!
//! The upstream's answers pass as they come, trailers included (an `http2` upstream, an
//! HTTP/2 client). The gateway's own answers to a call (a 429, 503, 401, 404, 413, 502, 504)
//! are said as gRPC says them, as Envoy's local replies are: a head alone, ending the stream,
//! with `:status` 200, the call's `Content-Type`, `grpc-status` and `grpc-message` (gRPC's
//! "Trailers-Only" answer), and no body; a JSON body would be read as a broken message.
//! A client reads `grpc-status` whatever `:status` says only by the letter of gRPC's
//! mapping; some (grpc-go) take any status but 200 as the HTTP status alone, so a 429 became
//! `UNAVAILABLE`, which their retry policies retry at once. The other fields of the answer
//! (`Retry-After`, the RateLimit fields, the request id) stay, as the call's metadata;
//! a `Retry-After` is also said as `grpc-retry-pushback-ms`, the wait gRPC's retries obey.

use http::HeaderValue;
use pingora::prelude::*;
use pingora_http::{RequestHeader, ResponseHeader};

use super::respond::Answer;

/// The gRPC status codes the gateway's own answers use (gRPC's `statuscodes.md`).
pub mod code {
    pub const DEADLINE_EXCEEDED: u8 = 4;
    pub const RESOURCE_EXHAUSTED: u8 = 8;
    pub const UNIMPLEMENTED: u8 = 12;
    pub const INTERNAL: u8 = 13;
    pub const UNAVAILABLE: u8 = 14;
    pub const UNAUTHENTICATED: u8 = 16;
}

/// The call's `Content-Type`, when the request is a gRPC call.
pub fn call_type(req: &RequestHeader) -> Option<&HeaderValue> {
    let value = req.headers.get(http::header::CONTENT_TYPE)?;
    let bytes = value.as_bytes();
    let prefix = b"application/grpc";
    let is_call = bytes.len() >= prefix.len()
        && bytes[..prefix.len()].eq_ignore_ascii_case(prefix)
        && matches!(bytes.get(prefix.len()), None | Some(b'+' | b'-' | b';'));
    is_call.then_some(value)
}

/// The gRPC status of one of the gateway's own answers, and its message. HTTP statuses as
/// gRPC's `http-grpc-status-mapping.md` maps them, but for the limits: a rate limit and a
/// body or head too large are `RESOURCE_EXHAUSTED`, as gRPC's own servers say them.
pub fn status_of(answer: Answer) -> (u8, &'static str) {
    match answer {
        Answer::RateLimited { .. } => (code::RESOURCE_EXHAUSTED, "rate limit exceeded"),
        Answer::BodyTooLarge => (code::RESOURCE_EXHAUSTED, "request body too large"),
        Answer::HeadersTooLarge => (code::RESOURCE_EXHAUSTED, "request header fields too large"),
        Answer::LimiterUnavailable { .. } => (code::UNAVAILABLE, "rate limiter unavailable"),
        Answer::AtCapacity => (code::UNAVAILABLE, "gateway at capacity"),
        Answer::UpstreamUnavailable => (code::UNAVAILABLE, "upstream unavailable"),
        Answer::UpstreamTimeout => (code::UNAVAILABLE, "upstream timeout"),
        Answer::BodyTimeout => (code::DEADLINE_EXCEEDED, "request body timeout"),
        Answer::Unauthenticated { .. } => (code::UNAUTHENTICATED, "authentication required"),
        Answer::NoRoute => (code::UNIMPLEMENTED, "no route"),
        Answer::MethodNotAllowed => (code::UNIMPLEMENTED, "method not allowed"),
        Answer::BadRequest | Answer::Preflight => (code::INTERNAL, "bad request"),
    }
}

/// Makes `header`, an answer built for HTTP clients, the Trailers-Only answer of a gRPC call
/// of type `call_type`: written as a head that ends the stream. Its gRPC status.
pub fn trailers_only(
    answer: Answer,
    header: &mut ResponseHeader,
    call_type: HeaderValue,
) -> Result<u8> {
    let (code, message) = status_of(answer);
    header.set_status(200)?;
    header.insert_header(http::header::CONTENT_TYPE, call_type)?;
    // No body: HTTP/1.1 (gRPC-Web) needs the length said; HTTP/2 ends the stream with the head.
    header.insert_header(http::header::CONTENT_LENGTH, "0")?;
    header.insert_header("grpc-status", code.to_string())?;
    header.insert_header("grpc-message", message)?;
    let pushback = header
        .headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(secs) = pushback {
        header.insert_header("grpc-retry-pushback-ms", (secs * 1000).to_string())?;
    }
    Ok(code)
}

/// The `grpc-status` an upstream's answer carries in its head (a Trailers-Only answer) or
/// its trailers; `None` when absent or not a number.
pub fn status_in(fields: &http::HeaderMap) -> Option<u8> {
    fields
        .get("grpc-status")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(content_type: &str) -> RequestHeader {
        let mut req = RequestHeader::build("POST", b"/pkg.Svc/Call", None).unwrap();
        req.insert_header("content-type", content_type).unwrap();
        req
    }

    #[test]
    fn a_call_is_known_by_its_content_type() {
        for call in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC+json",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "application/grpc;charset=utf-8",
        ] {
            assert!(call_type(&request(call)).is_some(), "{call}");
        }
        for other in ["application/json", "application/grpcx", "text/grpc", ""] {
            assert!(call_type(&request(other)).is_none(), "{other}");
        }
        let plain = RequestHeader::build("POST", b"/", None).unwrap();
        assert!(call_type(&plain).is_none());
    }

    #[test]
    fn a_rate_limit_is_resource_exhausted_with_the_wait_as_pushback() {
        let answer = Answer::RateLimited {
            retry_after_secs: 3,
        };
        let mut header = answer.header().unwrap();
        let code = trailers_only(
            answer,
            &mut header,
            HeaderValue::from_static("application/grpc+proto"),
        )
        .unwrap();
        assert_eq!(code, code::RESOURCE_EXHAUSTED);
        assert_eq!(header.status.as_u16(), 200);
        let field = |name: &str| header.headers.get(name).unwrap().to_str().unwrap();
        assert_eq!(field("content-type"), "application/grpc+proto");
        assert_eq!(field("content-length"), "0");
        assert_eq!(field("grpc-status"), "8");
        assert_eq!(field("grpc-message"), "rate limit exceeded");
        assert_eq!(field("retry-after"), "3");
        assert_eq!(field("grpc-retry-pushback-ms"), "3000");
    }

    #[test]
    fn the_gateways_failures_are_unavailable_and_a_missing_key_unauthenticated() {
        let unavailable = [
            Answer::LimiterUnavailable {
                retry_after_base_secs: 1,
            },
            Answer::AtCapacity,
            Answer::UpstreamUnavailable,
            Answer::UpstreamTimeout,
        ];
        for answer in unavailable {
            assert_eq!(status_of(answer).0, code::UNAVAILABLE, "{answer:?}");
        }
        let missing = Answer::Unauthenticated { bearer: true };
        assert_eq!(status_of(missing).0, code::UNAUTHENTICATED);
        assert_eq!(status_of(Answer::NoRoute).0, code::UNIMPLEMENTED);
        assert_eq!(status_of(Answer::BodyTooLarge).0, code::RESOURCE_EXHAUSTED);
    }
}
