//! The upstream's answer loses the fields of its own connection before it is passed on
//! (RFC 9110, 7.6.1), as nginx and Envoy do: those its `Connection` names, and `Keep-Alive`,
//! `Proxy-Connection`, `TE` and `Upgrade` (kept on a `101`, whose tunnel they describe).
//! The client's connection gets the gateway's own `Connection`. `Trailer` goes too: the
//! trailer fields an HTTP/1.1 upstream sends after a chunked body are not passed on (as
//! nginx's proxy does not), so the answer does not announce fields that never come; an
//! HTTP/2 upstream's trailers reach HTTP/2 clients without it.

use http::header::{CONNECTION, TE, TRAILER, UPGRADE};
use http::{HeaderName, StatusCode};
use pingora_http::ResponseHeader;

fn is_hop_by_hop(name: &HeaderName) -> bool {
    *name == CONNECTION
        || *name == TE
        || *name == UPGRADE
        || *name == TRAILER
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Removes the hop-by-hop fields of `answer`; one pass over its names when it has none.
pub fn end_at_this_hop(answer: &mut ResponseHeader) {
    if !answer.headers.keys().any(is_hop_by_hop) {
        return;
    }
    let tunnel = answer.status == StatusCode::SWITCHING_PROTOCOLS;
    let named: Vec<HeaderName> = answer
        .headers
        .get_all(CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .filter_map(|token| HeaderName::from_bytes(token.trim_ascii()).ok())
        .filter(|name| !(tunnel && *name == UPGRADE))
        .collect();
    for name in named {
        answer.remove_header(&name);
    }
    for name in ["keep-alive", "proxy-connection", "te", "trailer"] {
        answer.remove_header(name);
    }
    if !tunnel {
        answer.remove_header(&UPGRADE);
        answer.remove_header(&CONNECTION);
    }
}

/// An upstream's `Content-Length` given twice with one value (two fields, or a list: `5, 5`)
/// is sent on once, as `5` (Pingora refuses differing values with a 502): HTTP/2 clients
/// refuse a stream whose head carries two or a list (`PROTOCOL_ERROR`), where HTTP/1.1
/// clients read them. As nginx does.
pub fn one_content_length(answer: &mut ResponseHeader) {
    let mut fields = answer.headers.get_all(http::header::CONTENT_LENGTH).iter();
    let Some(first) = fields.next() else {
        return;
    };
    let listed = |v: &http::HeaderValue| v.as_bytes().contains(&b',');
    if fields.next().is_none() && !listed(first) {
        return;
    }
    // Compared as numbers, as Pingora does (`05, 5` is 5).
    let mut values = (answer.headers.get_all(http::header::CONTENT_LENGTH).iter())
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(|v| {
            std::str::from_utf8(v.trim_ascii())
                .ok()?
                .parse::<u64>()
                .ok()
        });
    let Some(Some(one)) = values.next() else {
        return;
    };
    if values.all(|v| v == Some(one)) {
        // Replaces every field of the name.
        let _ = answer.insert_header(http::header::CONTENT_LENGTH, one.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, fields: &[(&str, &str)]) -> ResponseHeader {
        let mut r = ResponseHeader::build(status, None).unwrap();
        for (k, v) in fields {
            r.append_header(k.to_string(), *v).unwrap();
        }
        r
    }

    fn names(r: &ResponseHeader) -> Vec<String> {
        let mut n: Vec<String> = r.headers.keys().map(|k| k.to_string()).collect();
        n.sort();
        n
    }

    #[test]
    fn the_upstreams_connection_fields_end_at_the_gateway() {
        let mut r = answer(
            200,
            &[
                ("Content-Type", "text/plain"),
                ("Connection", "X-Private, keep-alive"),
                ("Connection", "x-other"),
                ("X-Private", "secret"),
                ("X-Other", "1"),
                ("Keep-Alive", "timeout=5"),
                ("Proxy-Connection", "close"),
                ("Upgrade", "h2c"),
                ("TE", "trailers"),
                ("Trailer", "X-Checksum"),
                ("X-Kept", "yes"),
            ],
        );
        end_at_this_hop(&mut r);
        assert_eq!(names(&r), ["content-type", "x-kept"]);
    }

    #[test]
    fn a_switch_of_protocols_keeps_what_its_tunnel_needs() {
        let mut r = answer(
            101,
            &[
                ("Connection", "Upgrade"),
                ("Upgrade", "websocket"),
                ("Sec-WebSocket-Accept", "x"),
                ("Keep-Alive", "timeout=5"),
            ],
        );
        end_at_this_hop(&mut r);
        assert_eq!(names(&r), ["connection", "sec-websocket-accept", "upgrade"]);
    }

    #[test]
    fn an_answer_without_them_is_left_as_it_is() {
        let mut r = answer(200, &[("Content-Type", "text/plain"), ("X-A", "1")]);
        end_at_this_hop(&mut r);
        assert_eq!(names(&r), ["content-type", "x-a"]);
    }
}
