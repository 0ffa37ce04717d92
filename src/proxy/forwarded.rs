//! Where a request came from, as the upstream is told: `X-Forwarded-For`, `X-Forwarded-Proto`,
//! `X-Forwarded-Host`, `X-Real-IP` and the request id. A client's own values are believed only
//! from a peer in `trusted_proxies`; from anyone else they are replaced.

use std::fmt::Write as _;
use std::net::IpAddr;

use ipnet::IpNet;
use pingora::prelude::*;
use pingora_http::RequestHeader;
use rand::Rng;

use crate::identity;

/// Longest request id kept from a trusted peer, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 128;

/// What is known of a request's origin, worked out once when it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The socket peer (IPv4-mapped addresses as IPv4), when it is an IP socket.
    pub peer: Option<IpAddr>,
    /// The peer is in `trusted_proxies`.
    pub trusted: bool,
    /// The client as the `client_ip` identity derives it; `None` when a trusted proxy's
    /// `X-Forwarded-For` does not name one usably (never the proxy's own address).
    pub client: Option<IpAddr>,
    /// The request id: a trusted peer's, or a new one.
    pub request_id: String,
    /// The connection is TLS.
    pub tls: bool,
}

impl Origin {
    pub fn of(
        req: &RequestHeader,
        peer: Option<IpAddr>,
        trusted_proxies: &[IpNet],
        request_id_header: &http::HeaderName,
        tls: bool,
    ) -> Origin {
        let peer = peer.map(identity::canonical);
        let trusted = peer.is_some_and(|p| identity::is_trusted(p, trusted_proxies));
        let client = peer.and_then(|p| identity::client_ip(req, p, trusted_proxies).ok());
        let kept = trusted
            .then(|| req.headers.get(request_id_header))
            .flatten()
            .filter(|v| is_request_id(v.as_bytes()))
            .and_then(|v| v.to_str().ok());
        Origin {
            peer,
            trusted,
            client,
            request_id: kept.map_or_else(new_request_id, str::to_owned),
            tls,
        }
    }

    /// Sets the forwarded headers and the request id on the request sent upstream
    /// (`upstream` starts as a copy of the client's request).
    pub fn apply(
        &self,
        upstream: &mut RequestHeader,
        request_id_header: &http::HeaderName,
    ) -> Result<()> {
        let Some(peer) = self.peer else {
            upstream.insert_header(request_id_header.clone(), self.request_id.as_str())?;
            return Ok(());
        };
        let mut xff = String::new();
        if self.trusted {
            for value in upstream.headers.get_all("x-forwarded-for") {
                if let Ok(text) = value.to_str() {
                    let text = text.trim();
                    if !text.is_empty() {
                        xff.push_str(text);
                        xff.push_str(", ");
                    }
                }
            }
        }
        let _ = write!(xff, "{peer}");
        upstream.insert_header("x-forwarded-for", xff)?;
        let keep = |name: &str, upstream: &RequestHeader| {
            self.trusted && upstream.headers.get(name).is_some()
        };
        if !keep("x-forwarded-proto", upstream) {
            let proto = if self.tls { "https" } else { "http" };
            upstream.insert_header("x-forwarded-proto", proto)?;
        }
        if !keep("x-forwarded-host", upstream) {
            // HTTP/2 carries the host in the authority, HTTP/1 in `Host`: as received.
            let host = upstream.uri.authority().map(without_userinfo).or_else(|| {
                upstream
                    .headers
                    .get(http::header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_owned)
            });
            match host {
                Some(host) => upstream.insert_header("x-forwarded-host", host)?,
                None => {
                    upstream.remove_header("x-forwarded-host");
                }
            }
        }
        match self.client {
            Some(client) => upstream.insert_header("x-real-ip", client.to_string())?,
            None => {
                upstream.remove_header("x-real-ip");
            }
        }
        upstream.insert_header(request_id_header.clone(), self.request_id.as_str())?;
        Ok(())
    }
}

/// An authority's `host[:port]`, without any `user:password@` an absolute-form target sent.
pub fn without_userinfo(authority: &http::uri::Authority) -> String {
    match authority.port() {
        Some(port) => format!("{}:{port}", authority.host()),
        None => authority.host().to_owned(),
    }
}

/// 1 to 128 visible ASCII characters.
fn is_request_id(v: &[u8]) -> bool {
    !v.is_empty() && v.len() <= MAX_REQUEST_ID_BYTES && v.iter().all(|b| (0x21..=0x7e).contains(b))
}

/// A new request id: 32 lower-case hex digits of randomness.
pub fn new_request_id() -> String {
    format!("{:032x}", rand::rng().random::<u128>())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(headers: &[(&str, &str)]) -> RequestHeader {
        let mut r = RequestHeader::build("GET", b"/x", None).unwrap();
        for (k, v) in headers {
            r.append_header(k.to_string(), *v).unwrap();
        }
        r
    }

    fn header(r: &RequestHeader, name: &str) -> Option<String> {
        let all: Vec<&str> = r
            .headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        (!all.is_empty()).then(|| all.join(" | "))
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn id_header() -> http::HeaderName {
        http::HeaderName::from_static("x-request-id")
    }

    #[test]
    fn an_untrusted_peers_own_words_are_replaced() {
        let trusted: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
        let client = req(&[
            ("Host", "api.example.com:8080"),
            ("X-Forwarded-For", "1.2.3.4"),
            ("X-Forwarded-Proto", "https"),
            ("X-Forwarded-Host", "evil.example"),
            ("X-Real-IP", "1.2.3.4"),
            ("X-Request-Id", "chosen-by-the-client"),
        ]);
        let origin = Origin::of(
            &client,
            Some(ip("203.0.113.9")),
            &trusted,
            &id_header(),
            false,
        );
        assert!(!origin.trusted);
        assert_eq!(origin.request_id.len(), 32);
        assert!(origin
            .request_id
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        let mut up = client.clone();
        origin.apply(&mut up, &id_header()).unwrap();
        assert_eq!(
            header(&up, "x-forwarded-for").as_deref(),
            Some("203.0.113.9")
        );
        assert_eq!(header(&up, "x-forwarded-proto").as_deref(), Some("http"));
        assert_eq!(
            header(&up, "x-forwarded-host").as_deref(),
            Some("api.example.com:8080")
        );
        assert_eq!(header(&up, "x-real-ip").as_deref(), Some("203.0.113.9"));
        assert_eq!(header(&up, "x-request-id"), Some(origin.request_id.clone()));
    }

    #[test]
    fn a_trusted_proxys_words_are_kept_and_extended() {
        let trusted: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
        let via_proxy = req(&[
            ("Host", "internal:80"),
            ("X-Forwarded-For", "1.2.3.4"),
            ("X-Forwarded-For", "10.0.0.7"),
            ("X-Forwarded-Proto", "https"),
            ("X-Forwarded-Host", "api.example.com"),
            ("X-Request-Id", "edge-4711"),
        ]);
        let origin = Origin::of(
            &via_proxy,
            Some(ip("10.0.0.1")),
            &trusted,
            &id_header(),
            false,
        );
        assert_eq!(origin.client, Some(ip("1.2.3.4")));
        assert_eq!(origin.request_id, "edge-4711");
        let mut up = via_proxy.clone();
        origin.apply(&mut up, &id_header()).unwrap();
        assert_eq!(
            header(&up, "x-forwarded-for").as_deref(),
            Some("1.2.3.4, 10.0.0.7, 10.0.0.1")
        );
        assert_eq!(header(&up, "x-forwarded-proto").as_deref(), Some("https"));
        assert_eq!(
            header(&up, "x-forwarded-host").as_deref(),
            Some("api.example.com")
        );
        assert_eq!(header(&up, "x-real-ip").as_deref(), Some("1.2.3.4"));
        assert_eq!(header(&up, "x-request-id").as_deref(), Some("edge-4711"));
    }

    #[test]
    fn request_ids_from_a_trusted_peer_must_be_visible_ascii_up_to_128() {
        let trusted: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
        let long = "a".repeat(129);
        for bad in ["", "has space", long.as_str()] {
            let r = req(&[("X-Request-Id", bad)]);
            let o = Origin::of(&r, Some(ip("10.0.0.1")), &trusted, &id_header(), true);
            assert_eq!(o.request_id.len(), 32, "{bad:?} replaced");
        }
        let r = req(&[("X-Request-Id", &long[..128])]);
        let o = Origin::of(&r, Some(ip("10.0.0.1")), &trusted, &id_header(), true);
        assert_eq!(o.request_id, &long[..128]);
        let mut up = r.clone();
        o.apply(&mut up, &id_header()).unwrap();
        assert_eq!(header(&up, "x-forwarded-proto").as_deref(), Some("https"));
    }

    #[test]
    fn a_client_the_header_cannot_name_is_nobody_not_the_proxy() {
        let trusted: Vec<IpNet> = vec!["10.0.0.0/8".parse().unwrap()];
        let r = req(&[
            ("X-Forwarded-For", "1.2.3.4, garbage"),
            ("X-Real-IP", "10.9.9.9"),
        ]);
        let o = Origin::of(&r, Some(ip("10.0.0.1")), &trusted, &id_header(), false);
        assert_eq!(o.client, None);
        let mut up = r.clone();
        o.apply(&mut up, &id_header()).unwrap();
        assert_eq!(
            header(&up, "x-real-ip"),
            None,
            "no X-Real-IP rather than a wrong one"
        );
        assert_ne!(new_request_id(), new_request_id());
    }
}
