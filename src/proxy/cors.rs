//! `cors_origins`: a route that browsers on other origins call. Their preflights carry no
//! credentials, so they are forwarded to the upstream (which answers CORS as it does)
//! without identity, limit or Redis call; the gateway's own answers (401, 429, 503, ...)
//! let those origins' scripts read them, `Retry-After` and the RateLimit fields included;
//! and an upstream's answer that allows the origin exposes the fields the gateway added.

use pingora_core::Result;
use pingora_http::{RequestHeader, ResponseHeader};

use crate::config::CorsOrigins;

/// The fields the gateway adds that a script may read, beside the request id's.
const EXPOSED: &str = "Retry-After, RateLimit, RateLimit-Policy, X-RateLimit-Limit, X-RateLimit-Remaining, X-RateLimit-Reset";

/// A CORS preflight (Fetch standard, 3.2.2): `OPTIONS` with `Origin` and
/// `Access-Control-Request-Method`.
pub fn is_preflight(req: &RequestHeader) -> bool {
    req.method == http::Method::OPTIONS
        && req.headers.contains_key(http::header::ORIGIN)
        && (req.headers).contains_key(http::header::ACCESS_CONTROL_REQUEST_METHOD)
}

/// The request's `Origin`, when the route's origins take it.
fn allowed<'r>(cors: &CorsOrigins, req: &'r RequestHeader) -> Option<&'r http::HeaderValue> {
    let mut origins = req.headers.get_all(http::header::ORIGIN).iter();
    // One `Origin` (a browser sends one); `null` (a sandboxed or file page) is no origin.
    match (origins.next(), origins.next()) {
        (Some(o), None) if o.as_bytes() != b"null" && cors.allows(o.as_bytes()) => Some(o),
        _ => None,
    }
}

/// On the gateway's own answer to an allowed origin: the origin allowed (its own name, with
/// credentials: the answer's body is the gateway's fixed words, never a user's data) and the
/// gateway's fields exposed. `Vary: Origin` whenever the route names origins, so a cache
/// does not give one origin's answer to another.
pub fn on_own_answer(
    cors: &CorsOrigins,
    req: &RequestHeader,
    header: &mut ResponseHeader,
    request_id: &http::HeaderName,
) -> Result<()> {
    header.append_header(http::header::VARY, "Origin")?;
    let Some(origin) = allowed(cors, req) else {
        return Ok(());
    };
    header.insert_header(http::header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone())?;
    header.insert_header(http::header::ACCESS_CONTROL_ALLOW_CREDENTIALS, "true")?;
    header.insert_header(
        http::header::ACCESS_CONTROL_EXPOSE_HEADERS,
        format!("{EXPOSED}, {request_id}"),
    )?;
    Ok(())
}

/// On an upstream's answer to an allowed origin that the upstream allowed too: the gateway's
/// fields added to what it exposes (unless it exposes every field already: `*`). An upstream
/// that does not allow the origin keeps its answer closed to the script.
pub fn on_upstream_answer(
    cors: &CorsOrigins,
    req: &RequestHeader,
    header: &mut ResponseHeader,
    request_id: &http::HeaderName,
) -> Result<()> {
    let name = http::header::ACCESS_CONTROL_EXPOSE_HEADERS;
    if allowed(cors, req).is_none()
        || !(header.headers).contains_key(http::header::ACCESS_CONTROL_ALLOW_ORIGIN)
    {
        return Ok(());
    }
    let theirs: Vec<&str> = (header.headers.get_all(&name).iter())
        .filter_map(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .collect();
    let credentialed = (header
        .headers
        .get(http::header::ACCESS_CONTROL_ALLOW_CREDENTIALS))
    .is_some_and(|v| v.as_bytes() == b"true");
    // `*` exposes every field, but not to a request made with credentials.
    if !credentialed && theirs.iter().any(|v| v.split(',').any(|f| f.trim() == "*")) {
        return Ok(());
    }
    let ours = format!("{EXPOSED}, {request_id}");
    let all = match theirs.is_empty() {
        true => ours,
        false => format!("{}, {ours}", theirs.join(", ")),
    };
    header.insert_header(name, all)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: &str, fields: &[(&str, &str)]) -> RequestHeader {
        let mut req = RequestHeader::build(method, b"/api", None).unwrap();
        for (name, value) in fields {
            req.append_header(name.to_string(), *value).unwrap();
        }
        req
    }

    #[test]
    fn a_preflight_is_options_with_origin_and_the_method_asked() {
        let origin = ("Origin", "https://app.example.com");
        let asked = ("Access-Control-Request-Method", "POST");
        assert!(is_preflight(&request("OPTIONS", &[origin, asked])));
        assert!(!is_preflight(&request("OPTIONS", &[origin])));
        assert!(!is_preflight(&request("OPTIONS", &[asked])));
        assert!(!is_preflight(&request("POST", &[origin, asked])));
    }

    #[test]
    fn the_gateways_fields_are_exposed_beside_the_upstreams() {
        let cors = CorsOrigins::Listed(vec!["https://app.example.com".to_owned()]);
        let id = http::HeaderName::from_static("x-request-id");
        let req = request("GET", &[("Origin", "https://APP.example.com")]);
        let mut theirs = ResponseHeader::build(200, None).unwrap();
        theirs
            .append_header("Access-Control-Allow-Origin", "https://app.example.com")
            .unwrap();
        theirs
            .append_header("Access-Control-Expose-Headers", "ETag")
            .unwrap();
        on_upstream_answer(&cors, &req, &mut theirs, &id).unwrap();
        assert_eq!(
            theirs.headers["access-control-expose-headers"],
            "ETag, Retry-After, RateLimit, RateLimit-Policy, X-RateLimit-Limit, X-RateLimit-Remaining, X-RateLimit-Reset, x-request-id"
        );
        // An upstream that does not allow the origin: nothing added.
        let mut closed = ResponseHeader::build(200, None).unwrap();
        on_upstream_answer(&cors, &req, &mut closed, &id).unwrap();
        assert!(!closed.headers.contains_key("access-control-expose-headers"));
        // Another origin: the gateway's own answer says nothing to it but `Vary`.
        let other = request("GET", &[("Origin", "https://evil.example")]);
        let mut own = ResponseHeader::build(429, None).unwrap();
        on_own_answer(&cors, &other, &mut own, &id).unwrap();
        assert!(!own.headers.contains_key("access-control-allow-origin"));
        assert_eq!(own.headers["vary"], "Origin");
    }
}
