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

/// The gRPC status codes the gateway's own answers use (gRPC's `statuscodes.md`).
pub mod code {
    pub const CANCELLED: u8 = 1;
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

/// Makes `header`, an answer built for HTTP clients, the Trailers-Only answer of a gRPC call
/// of type `call_type` with the status `code` and `message`: written as a head that ends the
/// stream.
pub fn trailers_only(
    header: &mut ResponseHeader,
    call_type: HeaderValue,
    code: u8,
    message: &'static str,
) -> Result<()> {
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
    Ok(())
}

/// The `grpc-status` an upstream's answer carries in its head (a Trailers-Only answer) or
/// its trailers; `None` when absent or not one of gRPC's codes (0 to 16).
pub fn status_in(fields: &http::HeaderMap) -> Option<u8> {
    let code: u8 = fields
        .get("grpc-status")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (code <= code::UNAUTHENTICATED).then_some(code)
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
    fn a_trailers_only_answer_says_the_status_and_the_wait_as_pushback() {
        let mut header = ResponseHeader::build(429, None).unwrap();
        header.insert_header("retry-after", "3").unwrap();
        header
            .insert_header("content-type", "application/json")
            .unwrap();
        let call = HeaderValue::from_static("application/grpc+proto");
        trailers_only(
            &mut header,
            call,
            code::RESOURCE_EXHAUSTED,
            "rate limit exceeded",
        )
        .unwrap();
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
    fn only_grpcs_codes_are_read_as_a_status() {
        let status = |v: &str| {
            let mut fields = http::HeaderMap::new();
            fields.insert("grpc-status", v.parse().unwrap());
            status_in(&fields)
        };
        assert_eq!(status("0"), Some(0));
        assert_eq!(status(" 16 "), Some(16));
        for not in ["17", "255", "-1", "x", ""] {
            assert_eq!(status(not), None, "{not}");
        }
    }
}
