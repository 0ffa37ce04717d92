//! Where a request came from, as the upstream is told: `X-Forwarded-For`, `X-Forwarded-Proto`,
//! `X-Forwarded-Host`, `X-Real-IP` and the request id. A client's own values are believed only
//! from a peer in `trusted_proxies`; from anyone else they are replaced.

use std::net::IpAddr;

use bytes::Bytes;
use http::HeaderValue;
use ipnet::IpNet;
use pingora::prelude::*;
use pingora_http::RequestHeader;
use rand::Rng;

use crate::identity;
use crate::routing::{folded_field_name, plain_field_name};

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
    /// A field name of the request may hold `_` or another character but letters, digits and
    /// `-` ([`drop_underscore_spellings`]); cleared by the pass over the request's fields that
    /// measures them, so most requests skip a second.
    pub underscored: bool,
}

static X_FORWARDED_PORT: http::HeaderName = http::HeaderName::from_static("x-forwarded-port");

/// The caller the gateway verified, on routes with `forward_identity = true`: its identity
/// string, as `/limits` takes it (`tenant:acme`, `jwt:user-42`).
pub static X_SENTINEL_IDENTITY: http::HeaderName =
    http::HeaderName::from_static("x-sentinel-identity");
/// The tier that caller counted under, on a tiered route with `forward_identity = true`.
pub static X_SENTINEL_TIER: http::HeaderName = http::HeaderName::from_static("x-sentinel-tier");

/// The fields the gateway writes or drops on every request sent upstream (the request id's
/// name is configured).
const WRITTEN: [&str; 8] = [
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-forwarded-port",
    "x-real-ip",
    "forwarded",
    "x-sentinel-identity",
    "x-sentinel-tier",
];

/// What of an identity string is written `%XX` in `X-Sentinel-Identity`: everything but
/// letters, digits, `-`, `.`, `_`, `~` and `:` (RFC 3986's unreserved characters, and the
/// colon of `tenant:acme`), so that one percent-decoding gives the identity back and the value
/// is a ready `identity=` query whatever the claim holds (`"`, `<`, `>`, `&`, `#`, spaces,
/// controls, bytes past ASCII).
const CALLER_ESCAPED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b':');

/// On a route with `forward_identity = true`, the caller the gateway verified and its tier;
/// neither when it identified none (an exempt client). (What any peer sent under these names
/// is dropped before, in [`Origin::apply`].)
pub fn tell_caller(
    upstream: &mut RequestHeader,
    caller: Option<&str>,
    tier: Option<&str>,
) -> Result<()> {
    match caller {
        Some(caller) => {
            let value = percent_encoding::utf8_percent_encode(caller, CALLER_ESCAPED).to_string();
            upstream.insert_header(X_SENTINEL_IDENTITY.clone(), value)?;
        }
        None => {
            upstream.remove_header(&X_SENTINEL_IDENTITY);
        }
    }
    match tier.filter(|_| caller.is_some()) {
        Some(tier) => upstream.insert_header(X_SENTINEL_TIER.clone(), tier)?,
        None => {
            upstream.remove_header(&X_SENTINEL_TIER);
        }
    }
    Ok(())
}

/// CGI and WSGI backends (and the frameworks on them) read `X_Real_IP` and `X-Real-IP` as one
/// variable, the values joined, and some CGI servers fold every character of a name other
/// than a letter or digit (`X-Real.IP`, `X-Real~IP`) the same way: a field so spelled where
/// one the gateway writes has `-`, or where the request also carries the `-` spelling, would
/// reach such a backend beside the gateway's value, or beside the identity the gateway
/// charged (`X_API_Key` with `X-API-Key`, which two `X-API-Key` fields could not do: 401).
/// Such fields are dropped, as nginx drops every field with `_` or another such character
/// by default. Other fields so spelled pass.
fn drop_underscore_spellings(upstream: &mut RequestHeader, request_id_header: &[u8]) {
    if upstream
        .headers
        .keys()
        .all(|k| plain_field_name(k.as_str()))
    {
        return;
    }
    let aliases: Vec<http::HeaderName> = upstream
        .headers
        .keys()
        .filter(|k| !plain_field_name(k.as_str()))
        .filter(|k| {
            let dashed = folded_field_name(k.as_str());
            WRITTEN.contains(&dashed.as_ref())
                || dashed.as_bytes() == request_id_header
                || upstream.headers.contains_key(dashed.as_ref())
        })
        .cloned()
        .collect();
    for name in aliases {
        upstream.remove_header(&name);
    }
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
            underscored: true,
        }
    }

    /// Sets the forwarded headers and the request id on the request sent upstream
    /// (`upstream` starts as a copy of the client's request). `request_id_header` is the
    /// header's name, lower case. Every value is made without the formatter and every name
    /// is static: this runs on every forwarded request.
    pub fn apply(&self, upstream: &mut RequestHeader, request_id_header: &Bytes) -> Result<()> {
        if self.underscored {
            drop_underscore_spellings(upstream, request_id_header);
        }
        // A backend behind a `forward_identity` route believes these: they are dropped from
        // every request on every route, a trusted peer's too (a load balancer trusted for its
        // `X-Forwarded-For` passes on whatever its client wrote under other names).
        for name in [&X_SENTINEL_IDENTITY, &X_SENTINEL_TIER] {
            if upstream.headers.contains_key(name) {
                upstream.remove_header(name);
            }
        }
        let Some(peer) = self.peer else {
            upstream.insert_header(request_id_header.clone(), self.request_id.as_str())?;
            return Ok(());
        };
        let peer_value = ip_value(peer);
        let xff = if self.trusted {
            // Byte for byte, whatever the trusted proxy passed on (a client's junk beside
            // the real address, non-ASCII bytes included): a field that is not text is not
            // dropped, or a client could erase the address the proxy wrote after its own.
            let mut xff = Vec::new();
            for value in upstream.headers.get_all("x-forwarded-for") {
                let field = value.as_bytes().trim_ascii();
                if !field.is_empty() {
                    xff.extend_from_slice(field);
                    xff.extend_from_slice(b", ");
                }
            }
            xff.extend_from_slice(peer_value.as_bytes());
            HeaderValue::from_bytes(&xff).or_err(
                InvalidHTTPHeader,
                "the forwarded-for chain is not a header value",
            )?
        } else {
            // What the client says of itself in the other forwarding headers is dropped too:
            // a backend that reads RFC 7239's `Forwarded` (or `X-Forwarded-Port`) would
            // believe any address, scheme or host it named.
            upstream.remove_header(&http::header::FORWARDED);
            upstream.remove_header(&X_FORWARDED_PORT);
            peer_value.clone()
        };
        upstream.insert_header("x-forwarded-for", xff)?;
        // A trusted peer's own value is kept: its first, when it sent several (the upstream
        // would read either, as the request id's first is kept).
        let keep = |name: &'static str, upstream: &mut RequestHeader| -> Result<bool> {
            if !self.trusted {
                return Ok(false);
            }
            match upstream.headers.get_all(name).iter().take(2).count() {
                0 => Ok(false),
                1 => Ok(true),
                _ => {
                    if let Some(first) = upstream.headers.get(name).cloned() {
                        upstream.insert_header(name, first)?;
                    }
                    Ok(true)
                }
            }
        };
        if !keep("x-forwarded-proto", upstream)? {
            let proto = if self.tls { "https" } else { "http" };
            upstream.insert_header("x-forwarded-proto", HeaderValue::from_static(proto))?;
        }
        if !keep("x-forwarded-host", upstream)? {
            // HTTP/2 carries the host in the authority, HTTP/1 in `Host` (or an HTTP/1.0
            // absolute-form target without one): as received ([`received_host`], without
            // copying the usual `Host`).
            let host = match upstream.uri.authority() {
                Some(authority) => HeaderValue::try_from(without_userinfo(authority)).ok(),
                None => upstream
                    .headers
                    .get(http::header::HOST)
                    .filter(|h| h.to_str().is_ok())
                    .cloned()
                    .or_else(|| {
                        absolute_form_authority(upstream)
                            .and_then(|a| HeaderValue::from_str(a).ok())
                    }),
            };
            match host {
                Some(host) => upstream.insert_header("x-forwarded-host", host)?,
                None => {
                    upstream.remove_header("x-forwarded-host");
                }
            }
        }
        match self.client {
            Some(client) if client == peer => upstream.insert_header("x-real-ip", peer_value)?,
            Some(client) => upstream.insert_header("x-real-ip", ip_value(client))?,
            None => {
                upstream.remove_header("x-real-ip");
            }
        }
        upstream.insert_header(request_id_header.clone(), self.request_id.as_str())?;
        Ok(())
    }
}

/// An address as a header value. IPv4 is written digit by digit: `Display` goes through the
/// formatter, and this runs for every forwarded request.
pub fn ip_value(ip: IpAddr) -> HeaderValue {
    let IpAddr::V4(v4) = ip else {
        return HeaderValue::try_from(ip.to_string()).unwrap_or(HeaderValue::from_static(""));
    };
    let mut text = [0u8; 15];
    let mut n = 0;
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            text[n] = b'.';
            n += 1;
        }
        if octet >= 100 {
            text[n] = b'0' + octet / 100;
            n += 1;
        }
        if octet >= 10 {
            text[n] = b'0' + octet / 10 % 10;
            n += 1;
        }
        text[n] = b'0' + octet % 10;
        n += 1;
    }
    HeaderValue::from_bytes(&text[..n]).unwrap_or(HeaderValue::from_static(""))
}

/// The authority an HTTP/1 absolute-form target names (`GET http://host:port/path`): Pingora
/// keeps it in the raw target only (its `Uri` holds the path), having checked that it agrees
/// with `Host` and carries no userinfo. `None` for the usual origin form.
pub fn absolute_form_authority(req: &RequestHeader) -> Option<&str> {
    pingora::protocols::http::authority::raw_target_authority(req.raw_path())
        .authority()
        .and_then(|a| std::str::from_utf8(a).ok())
}

/// The host the request names, as received: HTTP/2's authority, else `Host`, else an
/// HTTP/1.0 absolute-form target's authority (a request line's without `Host`).
pub fn received_host(req: &RequestHeader) -> Option<std::borrow::Cow<'_, [u8]>> {
    use std::borrow::Cow;
    match req.uri.authority() {
        Some(authority) => Some(Cow::Borrowed(without_userinfo(authority).as_bytes())),
        None => req
            .headers
            .get(http::header::HOST)
            .map(|h| Cow::Borrowed(h.as_bytes()))
            .or_else(|| absolute_form_authority(req).map(|a| Cow::Borrowed(a.as_bytes()))),
    }
}

/// An authority's `host[:port]` as sent (a port past 65535 too), without any
/// `user:password@` an absolute-form target sent.
pub fn without_userinfo(authority: &http::uri::Authority) -> &str {
    let sent = authority.as_str();
    sent.rsplit_once('@').map_or(sent, |(_, host)| host)
}

/// 1 to 128 visible ASCII characters.
fn is_request_id(v: &[u8]) -> bool {
    !v.is_empty() && v.len() <= MAX_REQUEST_ID_BYTES && v.iter().all(|b| (0x21..=0x7e).contains(b))
}

/// A new request id: 32 lower-case hex digits of randomness.
pub fn new_request_id() -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bits = rand::rng().random::<u128>();
    let mut id = [0u8; 32];
    for (i, digit) in id.iter_mut().enumerate() {
        *digit = HEX[(bits >> (4 * (31 - i))) as usize & 15];
    }
    String::from_utf8_lossy(&id).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_received_host_is_the_authority_else_host_else_the_absolute_target() {
        let host = |r: &RequestHeader| received_host(r).map(|h| h.into_owned());
        let mut absolute = RequestHeader::build("GET", b"http://a.example:81/x", None).unwrap();
        assert_eq!(host(&absolute).as_deref(), Some(&b"a.example:81"[..]));
        absolute.insert_header("host", "a.example:81").unwrap();
        assert_eq!(host(&absolute).as_deref(), Some(&b"a.example:81"[..]));
        let origin = RequestHeader::build("GET", b"/x", None).unwrap();
        assert_eq!(host(&origin), None);
        // HTTP/2's authority, as sent but for any userinfo: a port no socket has is still
        // the client's.
        let h2 = |uri: &str| {
            let mut r = RequestHeader::build("GET", b"/x", None).unwrap();
            r.set_uri(uri.parse().unwrap());
            r
        };
        let odd = h2("https://u:p@a.example:99999/x");
        assert_eq!(host(&odd).as_deref(), Some(&b"a.example:99999"[..]));
        assert_eq!(
            host(&h2("https://[::1]:8443/x")).as_deref(),
            Some(&b"[::1]:8443"[..])
        );
        assert_eq!(
            host(&h2("https://a.example/x")).as_deref(),
            Some(&b"a.example"[..])
        );
    }

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

    fn id_wire() -> Bytes {
        Bytes::from_static(b"x-request-id")
    }

    proptest::proptest! {
        #[test]
        fn addresses_read_as_display_writes_them(bits: u32, v6: u128) {
            for ip in [IpAddr::from(bits.to_be_bytes()), IpAddr::from(v6.to_be_bytes())] {
                let value = ip_value(ip);
                proptest::prop_assert_eq!(value.to_str().unwrap(), ip.to_string());
            }
        }

        #[test]
        fn request_ids_are_32_lower_case_hex_digits(_n in 0..8u8) {
            let id = new_request_id();
            proptest::prop_assert_eq!(id.len(), 32);
            proptest::prop_assert!(id.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        }
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
            ("Forwarded", "for=1.2.3.4;proto=https;host=admin.internal"),
            ("X-Forwarded-Port", "443"),
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
        origin.apply(&mut up, &id_wire()).unwrap();
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
        assert_eq!(header(&up, "forwarded"), None, "the client's own, dropped");
        assert_eq!(header(&up, "x-forwarded-port"), None);
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
            ("Forwarded", "for=1.2.3.4;proto=https"),
            ("X-Forwarded-Port", "443"),
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
        origin.apply(&mut up, &id_wire()).unwrap();
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
        assert_eq!(
            header(&up, "forwarded").as_deref(),
            Some("for=1.2.3.4;proto=https")
        );
        assert_eq!(header(&up, "x-forwarded-port").as_deref(), Some("443"));
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
        o.apply(&mut up, &id_wire()).unwrap();
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
        o.apply(&mut up, &id_wire()).unwrap();
        assert_eq!(
            header(&up, "x-real-ip"),
            None,
            "no X-Real-IP rather than a wrong one"
        );
        assert_ne!(new_request_id(), new_request_id());
    }
}
