//! Who a request counts against: the identity string hashed into its bucket key.
//!
//! Identities are `global`, `ip:<address>`, `header:<lower-case name>:<value>` (and, later,
//! `jwt:<sub>`). The kind is part of the string, so two kinds never share a bucket. Raw
//! identities never leave this module except hashed.

use std::net::IpAddr;

use ipnet::IpNet;
use pingora_http::RequestHeader;

use crate::config::IdentitySource;

/// Longest header value accepted as an identity, in bytes.
pub const MAX_HEADER_IDENTITY_BYTES: usize = 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityError {
    /// The header is absent, empty, too long or not visible ASCII.
    MissingHeader,
    /// The route needs an identity this build cannot verify.
    Unsupported,
    /// The peer is not an IP socket.
    NoPeerAddress,
}

/// The identity string of a request, before hashing.
pub fn identify(
    source: &IdentitySource,
    req: &RequestHeader,
    peer: Option<IpAddr>,
    trusted_proxies: &[IpNet],
) -> Result<String, IdentityError> {
    match source {
        IdentitySource::Global => Ok("global".to_owned()),
        IdentitySource::Header(name) => {
            let value = req
                .headers
                .get(name.as_str())
                .map(|v| v.as_bytes())
                .filter(|v| !v.is_empty() && v.len() <= MAX_HEADER_IDENTITY_BYTES)
                .and_then(|v| std::str::from_utf8(v).ok())
                .filter(|v| !v.trim().is_empty())
                .ok_or(IdentityError::MissingHeader)?;
            Ok(format!("header:{name}:{value}"))
        }
        IdentitySource::ClientIp => {
            let peer = peer.ok_or(IdentityError::NoPeerAddress)?;
            Ok(format!("ip:{}", client_ip(req, peer, trusted_proxies)))
        }
        IdentitySource::Jwt => Err(IdentityError::Unsupported),
    }
}

fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
    let ip = canonical(ip);
    trusted.iter().any(|net| net.contains(&ip))
}

/// IPv4-mapped IPv6 peers count as their IPv4 address.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The socket peer, or, when the peer is a trusted proxy, the right-most `X-Forwarded-For`
/// address that is not itself trusted. A malformed header yields the peer, never a string the
/// client chose.
pub fn client_ip(req: &RequestHeader, peer: IpAddr, trusted: &[IpNet]) -> IpAddr {
    let peer = canonical(peer);
    if !is_trusted(peer, trusted) {
        return peer;
    }
    let mut hops = Vec::new();
    for value in req.headers.get_all("x-forwarded-for") {
        let Ok(text) = value.to_str() else {
            return peer;
        };
        for part in text.split(',') {
            match part.trim().parse::<IpAddr>() {
                Ok(ip) => hops.push(canonical(ip)),
                Err(_) => return peer,
            }
        }
    }
    hops.into_iter()
        .rev()
        .find(|ip| !is_trusted(*ip, trusted))
        .unwrap_or(peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(xff: &[&str], headers: &[(&str, &str)]) -> RequestHeader {
        let mut r = RequestHeader::build("GET", b"/", None).unwrap();
        for v in xff {
            r.append_header("x-forwarded-for", *v).unwrap();
        }
        for (k, v) in headers {
            r.append_header(k.to_string(), *v).unwrap();
        }
        r
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn untrusted_peer_ignores_forwarded_for() {
        let trusted = vec!["10.0.0.0/8".parse().unwrap()];
        assert_eq!(
            client_ip(&req(&["1.2.3.4"], &[]), ip("8.8.8.8"), &trusted),
            ip("8.8.8.8")
        );
    }

    #[test]
    fn trusted_peer_yields_rightmost_untrusted_hop() {
        let trusted = vec!["10.0.0.0/8".parse().unwrap()];
        let r = req(&["6.6.6.6, 1.2.3.4", "10.1.1.1"], &[]);
        assert_eq!(client_ip(&r, ip("10.0.0.1"), &trusted), ip("1.2.3.4"));
        let bad = req(&["1.2.3.4, not-an-ip"], &[]);
        assert_eq!(client_ip(&bad, ip("10.0.0.1"), &trusted), ip("10.0.0.1"));
    }

    #[test]
    fn header_identity_needs_a_non_empty_value_and_keeps_kinds_apart() {
        let src = IdentitySource::Header("x-api-key".into());
        let r = req(&[], &[("X-API-Key", "abc")]);
        assert_eq!(
            identify(&src, &r, None, &[]).unwrap(),
            "header:x-api-key:abc"
        );
        let empty = req(&[], &[("X-API-Key", "")]);
        assert_eq!(
            identify(&src, &empty, None, &[]),
            Err(IdentityError::MissingHeader)
        );
        let long = "k".repeat(MAX_HEADER_IDENTITY_BYTES + 1);
        let r = req(&[], &[("X-API-Key", long.as_str())]);
        assert_eq!(
            identify(&src, &r, None, &[]),
            Err(IdentityError::MissingHeader)
        );
        let ipid = identify(
            &IdentitySource::ClientIp,
            &req(&[], &[]),
            Some(ip("::ffff:1.2.3.4")),
            &[],
        );
        assert_eq!(ipid.unwrap(), "ip:1.2.3.4");
    }
}
