//! The request sent upstream, beside the forwarded headers: what the hop from the client's
//! protocol (HTTP/1.0, HTTP/2) to the upstream's (HTTP/1.1, or HTTP/2 with `http2`) and the
//! route's settings require.

use http::HeaderValue;
use pingora::prelude::*;
use pingora_core::protocols::http::v1::common::is_expect_continue_req;
use pingora_core::protocols::http::ServerSession;
use pingora_http::RequestHeader;

use super::forwarded;

/// A route without `websocket = true` is never a tunnel: an `Upgrade` request reaches the
/// upstream as a plain one (as nginx without its upgrade settings), so a client cannot turn
/// one decision into an unlimited connection.
pub fn drop_upgrade(req: &mut RequestHeader) {
    // One lookup in the usual case (a removal looks in both of Pingora's header maps).
    if !req.headers.contains_key(http::header::UPGRADE) {
        return;
    }
    req.remove_header(&http::header::UPGRADE);
    let names_upgrade = req
        .headers
        .get_all(http::header::CONNECTION)
        .iter()
        .any(|v| {
            v.as_bytes()
                .split(|b| *b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"upgrade"))
        });
    if names_upgrade {
        req.remove_header(&http::header::CONNECTION);
    }
}

/// `Expect` is the gateway's to answer, as nginx and Envoy answer it, not the upstream's: an
/// HTTP/1.1 client that asks `100-continue` before its body is told to send it once its
/// request is admitted and its upstream connection made (a denied or refused one is answered
/// without its body sent), and the field is not passed on. Passed on, a client whose upstream
/// does not answer it waited its own timeout (curl's second) before each upload. An HTTP/2
/// client waits that timeout still: Pingora's HTTP/2 server sends no interim answer. Called
/// last in the upstream request's hook, so that nothing of the gateway's fails after it.
pub async fn answer_expect(session: &mut Session, req: &mut RequestHeader) -> Result<()> {
    // One lookup in the usual case.
    if !req.headers.contains_key(http::header::EXPECT) {
        return Ok(());
    }
    req.remove_header(&http::header::EXPECT);
    // RFC 9110, 10.1.1: none is owed to HTTP/1.0 (Pingora's rule), nor where the framing says
    // no body follows.
    let asks = is_expect_continue_req(session.req_header()) && !session.is_body_empty();
    if let (true, ServerSession::H1(h1)) = (asks, &mut *session.downstream_session) {
        // Pingora ends the connection's keep-alive at any answer written before the body is
        // read, this interim one too: the final answer would say `Connection: close`. Its
        // default (which the gateway keeps) is put back after.
        h1.set_close_on_response_before_downstream_finish(false);
        let written = h1.write_continue_response().await;
        h1.set_close_on_response_before_downstream_finish(true);
        // A client gone meanwhile is the client's doing, as any write to it that fails.
        written.map_err(|e| e.into_down())?;
    }
    Ok(())
}

/// The `Host` an HTTP/1.0 request without one is sent with: HTTP/1.1 must carry one (RFC
/// 9112, 3.2): its absolute-form authority, else the upstream's address, as nginx's
/// `$proxy_host`. (HTTP/1.1 without it was a 400, HTTP/2 has its authority.)
pub fn host_for_http_1_0(
    req: &RequestHeader,
    upstream_addr: Option<std::net::SocketAddr>,
) -> Option<String> {
    if req.headers.contains_key(http::header::HOST) {
        return None;
    }
    forwarded::absolute_form_authority(req)
        .map(str::to_owned)
        .or_else(|| upstream_addr.map(|a| a.to_string()))
}

/// An answer to an HTTP/1.0 request whose length is not known ahead: Pingora frames it
/// `chunked`, which HTTP/1.0 does not know (RFC 9112, 6.1: never sent to a 1.0 client), so
/// the client read the chunk sizes as body bytes, or waited on a kept-alive connection for
/// an end that never came. It is sent as nginx sends it: until the connection closes.
pub fn frame_for_http_1_0(session: &mut Session, answer: &mut pingora_http::ResponseHeader) {
    if session.req_header().version != http::Version::HTTP_10
        || !answer.headers.contains_key(http::header::TRANSFER_ENCODING)
    {
        return;
    }
    answer.remove_header(&http::header::TRANSFER_ENCODING);
    // An answer without a body (to HEAD, a 204 or 304, an interim one: an upstream may still
    // name its coding) needs no close to end it.
    let bodiless = session.req_header().method == http::Method::HEAD
        || matches!(answer.status.as_u16(), 204 | 304)
        || answer.status.is_informational();
    if !bodiless {
        session.set_keepalive(None);
    }
}

/// An upstream's answer as the gateway's own: in the gateway's HTTP version (RFC 9110, 6.2:
/// an intermediary sends its own; an HTTP/1.0 upstream's `HTTP/1.0 200` told HTTP/1.1 clients
/// it could not take chunked uploads), and a 204 or an interim answer without the length
/// fields it may not carry (RFC 9110, 8.6; 9112, 6.1): an HTTP/2 client refuses the whole
/// answer for a `Content-Length` on a 204, where an HTTP/1.1 one ignored it.
pub fn as_own(answer: &mut pingora_http::ResponseHeader) {
    if matches!(
        answer.version,
        http::Version::HTTP_09 | http::Version::HTTP_10
    ) {
        answer.set_version(http::Version::HTTP_11);
    }
    if answer.status == http::StatusCode::NO_CONTENT || answer.status.is_informational() {
        answer.remove_header(&http::header::CONTENT_LENGTH);
        answer.remove_header(&http::header::TRANSFER_ENCODING);
    }
}

/// An HTTP/2 client may split `Cookie` into one field per cookie (browsers do, for header
/// compression); an HTTP/1.1 hop must get them as one field joined by "; " (RFC 9113,
/// 8.2.3): a backend reading one field would lose the others.
pub fn join_cookies(req: &mut RequestHeader) -> Result<()> {
    let mut fields = req.headers.get_all(http::header::COOKIE).iter();
    let (Some(first), Some(second)) = (fields.next(), fields.next()) else {
        return Ok(());
    };
    let mut joined = first.as_bytes().to_vec();
    for field in std::iter::once(second).chain(fields) {
        joined.extend_from_slice(b"; ");
        joined.extend_from_slice(field.as_bytes());
    }
    let joined = HeaderValue::from_bytes(&joined).or_err(
        ErrorType::InvalidHTTPHeader,
        "the joined cookie fields are not a header value",
    )?;
    req.insert_header(http::header::COOKIE, joined)
}

/// The `Host` of a request going on to an HTTP/2 upstream, whose `:authority` Pingora makes
/// of it: an HTTP/2 client's authority (in its request's target, which the gateway rewrites
/// to origin form) is kept as `Host`; an empty `Host` (which HTTP/1.1 allows, and which no
/// `:authority` may be) is the upstream's address, as for an HTTP/1.0 request without one.
pub fn authority_for_http2(
    req: &mut RequestHeader,
    upstream: Option<std::net::SocketAddr>,
) -> Result<()> {
    let host = req.headers.get(http::header::HOST);
    if host.is_some_and(|h| !h.as_bytes().trim_ascii().is_empty()) {
        return Ok(());
    }
    let authority = match (host, req.uri.authority()) {
        (None, Some(authority)) => authority.as_str().to_owned(),
        _ => match upstream {
            Some(addr) => addr.to_string(),
            None => return Ok(()),
        },
    };
    req.insert_header(http::header::HOST, authority)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(fields: &[(&str, &str)]) -> RequestHeader {
        let mut req = RequestHeader::build("GET", b"/", None).unwrap();
        for (name, value) in fields {
            req.append_header(name.to_string(), *value).unwrap();
        }
        req
    }

    fn values(req: &RequestHeader, name: &str) -> Vec<String> {
        req.headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn split_cookie_fields_are_joined_into_one() {
        let mut req = request(&[("cookie", "a=1"), ("x-other", "o"), ("cookie", "b=2; c=3")]);
        join_cookies(&mut req).unwrap();
        assert_eq!(values(&req, "cookie"), ["a=1; b=2; c=3"]);
        assert_eq!(values(&req, "x-other"), ["o"]);
        let mut one = request(&[("cookie", "a=1")]);
        join_cookies(&mut one).unwrap();
        assert_eq!(values(&one, "cookie"), ["a=1"]);
    }

    #[test]
    fn an_upgrade_is_dropped_with_the_connection_field_naming_it() {
        let mut req = request(&[
            ("upgrade", "websocket"),
            ("connection", "keep-alive, Upgrade"),
        ]);
        drop_upgrade(&mut req);
        assert!(values(&req, "upgrade").is_empty());
        assert!(values(&req, "connection").is_empty());
        let mut plain = request(&[("connection", "keep-alive")]);
        drop_upgrade(&mut plain);
        assert_eq!(
            values(&plain, "connection"),
            ["keep-alive"],
            "kept without an Upgrade"
        );
    }

    #[test]
    fn an_http_1_0_request_gets_its_target_authority_or_the_upstream_as_host() {
        let upstream = Some("10.0.0.2:8080".parse().unwrap());
        let origin = request(&[]);
        assert_eq!(
            host_for_http_1_0(&origin, upstream).as_deref(),
            Some("10.0.0.2:8080")
        );
        let with_host = request(&[("host", "a.example")]);
        assert_eq!(host_for_http_1_0(&with_host, upstream), None);
    }
}
