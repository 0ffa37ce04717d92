//! `cors_origins`: a route that scripts on other origins call. The gateway does CORS for it,
//! as Envoy's and Kong's CORS filters do: it answers a listed origin's preflights itself
//! (they carry no credentials, so they meet no identity, limit, Redis call or upstream:
//! nothing unlimited reaches the upstream), and every answer to a listed origin, the
//! upstream's and the gateway's own (429, 401, 503, 502, ...), lets its script read it,
//! `Retry-After` and the RateLimit fields included.

use http::HeaderValue;
use pingora_core::Result;
use pingora_http::{RequestHeader, ResponseHeader};

use crate::config::CorsOrigins;

/// How long a browser may keep a preflight's answer, in seconds.
const MAX_AGE: &str = "600";

/// A route's CORS: its origins, and the fields a script may read, written once.
#[derive(Debug, PartialEq, Eq)]
pub struct Cors {
    origins: CorsOrigins,
    /// `Access-Control-Expose-Headers`: the fields the gateway adds beside an answer's own
    /// (a header value, so an answer takes it without a copy of its bytes).
    exposed: HeaderValue,
}

impl Cors {
    pub fn new(origins: CorsOrigins, request_id: &http::HeaderName) -> Self {
        let exposed = format!("Retry-After, RateLimit, RateLimit-Policy, X-RateLimit-Limit, X-RateLimit-Remaining, X-RateLimit-Reset, grpc-status, grpc-message, grpc-retry-pushback-ms, {request_id}");
        Self {
            origins,
            exposed: HeaderValue::from_maybe_shared(bytes::Bytes::from(exposed))
                .expect("field names and commas make a header value"),
        }
    }

    /// The request's `Origin`, when the route takes it: one field (a browser sends one);
    /// `null` (a sandboxed or file page) only by a route that takes any origin, which it
    /// answers `*`, without credentials.
    fn allowed<'r>(&self, req: &'r RequestHeader) -> Option<&'r HeaderValue> {
        let mut origins = req.headers.get_all(http::header::ORIGIN).iter();
        match (origins.next(), origins.next()) {
            (Some(o), None) if o.as_bytes() == b"null" => {
                matches!(self.origins, CorsOrigins::Any).then_some(o)
            }
            (Some(o), None) if self.origins.allows(o.as_bytes()) => Some(o),
            _ => None,
        }
    }

    /// Whether the request's `Origin` is the route's.
    pub fn takes(&self, req: &RequestHeader) -> bool {
        self.allowed(req).is_some()
    }

    /// `Access-Control-Allow-Origin` and `-Credentials` for an allowed origin: its own name
    /// with credentials when the route lists origins; `*` without them when it takes any
    /// (any site could otherwise read a signed-in user's answers).
    fn allow(&self, origin: &HeaderValue, header: &mut ResponseHeader) -> Result<()> {
        match self.origins {
            CorsOrigins::Any => {
                header.insert_header(http::header::ACCESS_CONTROL_ALLOW_ORIGIN, "*")?;
                header.remove_header(&http::header::ACCESS_CONTROL_ALLOW_CREDENTIALS);
            }
            CorsOrigins::Listed(_) => {
                header.insert_header(http::header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone())?;
                header.insert_header(http::header::ACCESS_CONTROL_ALLOW_CREDENTIALS, "true")?;
            }
        }
        Ok(())
    }

    /// A preflight (Fetch standard, 3.2.2: `OPTIONS` with `Origin` and
    /// `Access-Control-Request-Method`) from an allowed origin: the method it asks for, by
    /// which the route is found. Not one from another origin: that goes on as any request.
    pub fn preflight_method(req: &RequestHeader) -> Option<http::Method> {
        if req.method != http::Method::OPTIONS || !req.headers.contains_key(http::header::ORIGIN) {
            return None;
        }
        let asked = req
            .headers
            .get(http::header::ACCESS_CONTROL_REQUEST_METHOD)?;
        http::Method::from_bytes(asked.as_bytes()).ok()
    }

    /// The answer to an allowed origin's preflight: the method and the fields it asks for
    /// allowed (the route's own match and limits decide the request itself), kept
    /// [`MAX_AGE`] seconds. `None` when the origin is not the route's.
    pub fn preflight_answer(
        &self,
        req: &RequestHeader,
        header: &mut ResponseHeader,
    ) -> Result<Option<()>> {
        let Some(origin) = self.allowed(req) else {
            return Ok(None);
        };
        self.allow(origin, header)?;
        if let Some(method) = req.headers.get(http::header::ACCESS_CONTROL_REQUEST_METHOD) {
            header.insert_header(http::header::ACCESS_CONTROL_ALLOW_METHODS, method.clone())?;
        }
        if let Some(fields) = req
            .headers
            .get(http::header::ACCESS_CONTROL_REQUEST_HEADERS)
        {
            header.insert_header(http::header::ACCESS_CONTROL_ALLOW_HEADERS, fields.clone())?;
        }
        header.insert_header(http::header::ACCESS_CONTROL_MAX_AGE, MAX_AGE)?;
        header.insert_header(
            http::header::VARY,
            "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        )?;
        Ok(Some(()))
    }

    /// On any other answer (the upstream's or the gateway's own): `Vary: Origin`, and to an
    /// allowed origin the origin allowed and the gateway's fields exposed beside those the
    /// upstream exposes (unless it exposes every one, `*`, to a request without
    /// credentials).
    pub fn on_answer(&self, req: &RequestHeader, header: &mut ResponseHeader) -> Result<()> {
        header.append_header(http::header::VARY, "Origin")?;
        let Some(origin) = self.allowed(req) else {
            // The route's list is the policy: an upstream's own allowing of another origin
            // (one that reflects every `Origin`, say) does not reach it.
            header.remove_header(&http::header::ACCESS_CONTROL_ALLOW_ORIGIN);
            header.remove_header(&http::header::ACCESS_CONTROL_ALLOW_CREDENTIALS);
            return Ok(());
        };
        self.allow(origin, header)?;
        let name = http::header::ACCESS_CONTROL_EXPOSE_HEADERS;
        let theirs: Vec<&str> = (header.headers.get_all(&name).iter())
            .filter_map(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .collect();
        let every = matches!(self.origins, CorsOrigins::Any)
            && theirs.iter().any(|v| v.split(',').any(|f| f.trim() == "*"));
        if every {
            return Ok(());
        }
        match theirs.is_empty() {
            true => header.insert_header(name, self.exposed.clone())?,
            false => {
                let ours = self.exposed.to_str().unwrap_or_default();
                header.insert_header(name, format!("{}, {ours}", theirs.join(", ")))?
            }
        }
        Ok(())
    }
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

    fn listed() -> Cors {
        let id = http::HeaderName::from_static("x-request-id");
        Cors::new(
            CorsOrigins::Listed(vec!["https://app.example.com".to_owned()]),
            &id,
        )
    }

    #[test]
    fn a_preflight_is_options_with_origin_and_the_method_asked() {
        let origin = ("Origin", "https://app.example.com");
        let asked = ("Access-Control-Request-Method", "POST");
        let method = |m, f: &[(&str, &str)]| Cors::preflight_method(&request(m, f));
        assert_eq!(
            method("OPTIONS", &[origin, asked]),
            Some(http::Method::POST)
        );
        assert_eq!(method("OPTIONS", &[origin]), None);
        assert_eq!(method("OPTIONS", &[asked]), None);
        assert_eq!(method("POST", &[origin, asked]), None);
    }

    #[test]
    fn a_listed_origin_is_answered_and_another_is_not() {
        let cors = listed();
        let asked = [
            ("Origin", "https://APP.example.com"),
            ("Access-Control-Request-Method", "POST"),
            ("Access-Control-Request-Headers", "x-api-key, content-type"),
        ];
        let mut h = ResponseHeader::build(204, None).unwrap();
        let answered = cors.preflight_answer(&request("OPTIONS", &asked), &mut h);
        assert_eq!(answered.unwrap(), Some(()));
        assert_eq!(
            h.headers["access-control-allow-origin"],
            "https://APP.example.com"
        );
        assert_eq!(h.headers["access-control-allow-methods"], "POST");
        assert_eq!(
            h.headers["access-control-allow-headers"],
            "x-api-key, content-type"
        );
        assert_eq!(h.headers["access-control-allow-credentials"], "true");
        let other = request("OPTIONS", &[("Origin", "https://evil.example"), asked[1]]);
        let mut h = ResponseHeader::build(204, None).unwrap();
        assert_eq!(cors.preflight_answer(&other, &mut h).unwrap(), None);
    }

    #[test]
    fn the_gateways_fields_are_exposed_beside_the_upstreams() {
        let cors = listed();
        let req = request("GET", &[("Origin", "https://app.example.com")]);
        let mut theirs = ResponseHeader::build(200, None).unwrap();
        theirs
            .append_header("Access-Control-Expose-Headers", "ETag")
            .unwrap();
        cors.on_answer(&req, &mut theirs).unwrap();
        assert_eq!(
            theirs.headers["access-control-expose-headers"],
            "ETag, Retry-After, RateLimit, RateLimit-Policy, X-RateLimit-Limit, X-RateLimit-Remaining, X-RateLimit-Reset, grpc-status, grpc-message, grpc-retry-pushback-ms, x-request-id"
        );
        assert_eq!(
            theirs.headers["access-control-allow-origin"],
            "https://app.example.com"
        );
        // Another origin: `Vary` alone, an upstream's own allowing of it taken away.
        let other = request("GET", &[("Origin", "https://evil.example")]);
        let mut own = ResponseHeader::build(429, None).unwrap();
        (own.append_header("Access-Control-Allow-Origin", "https://evil.example")).unwrap();
        cors.on_answer(&other, &mut own).unwrap();
        assert!(!own.headers.contains_key("access-control-allow-origin"));
        assert_eq!(own.headers["vary"], "Origin");
        // Any origin: `*`, never with credentials.
        let id = http::HeaderName::from_static("x-request-id");
        let any = Cors::new(CorsOrigins::Any, &id);
        let mut h = ResponseHeader::build(200, None).unwrap();
        h.append_header("Access-Control-Allow-Credentials", "true")
            .unwrap();
        any.on_answer(&other, &mut h).unwrap();
        assert_eq!(h.headers["access-control-allow-origin"], "*");
        assert!(!h.headers.contains_key("access-control-allow-credentials"));
    }
}
