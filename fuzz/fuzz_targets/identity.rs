//! Identity derivation and the forwarded headers on requests of any shape: header lines of
//! arbitrary bytes (`X-Forwarded-For` among them), any peer. Never a panic; a client address
//! is the peer or one the header named; an identity string always has its kind's prefix.

#![no_main]

use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;
use libfuzzer_sys::fuzz_target;
use pingora_http::RequestHeader;
use sentinel_gateway::config::IdentitySource;
use sentinel_gateway::identity::{client_ip, identify};
use sentinel_gateway::proxy::forwarded::Origin;

fuzz_target!(|data: &[u8]| {
    let Some((&peer_byte, rest)) = data.split_first() else {
        return;
    };
    let Ok(mut req) = RequestHeader::build("GET", b"/", None) else {
        return;
    };
    let mut named = Vec::new();
    for line in rest.split(|b| *b == b'\n') {
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name),
            http::HeaderValue::from_bytes(value),
        ) else {
            continue;
        };
        if name == "x-forwarded-for" {
            named.extend(
                String::from_utf8_lossy(value.as_bytes())
                    .split(',')
                    .filter_map(|e| e.trim().parse::<IpAddr>().ok()),
            );
        }
        let _ = req.append_header(name, value);
    }
    let peer = IpAddr::V4(Ipv4Addr::new(10, 0, 0, peer_byte));
    let trusted: Vec<IpNet> = vec!["10.0.0.0/25".parse().unwrap()];
    if let Ok(ip) = client_ip(&req, peer, &trusted) {
        let canonical = |ip: IpAddr| match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        assert!(
            ip == peer || named.iter().any(|n| canonical(*n) == ip),
            "{ip} is neither the peer nor named by the header"
        );
    }
    let sources = [
        (IdentitySource::ClientIp, "ip:"),
        (IdentitySource::Global, "global"),
        (IdentitySource::Header("x-api-key".into()), "header:x-api-key:"),
    ];
    for (source, prefix) in sources {
        if let Ok(id) = identify(&source, &req, Some(peer), &trusted, None, None) {
            assert!(id.starts_with(prefix), "{id}");
        }
    }
    let id_header = http::HeaderName::from_static("x-request-id");
    let origin = Origin::of(&req, Some(peer), &trusted, &id_header, false);
    assert!(!origin.request_id.is_empty() && origin.request_id.len() <= 128);
    let mut upstream = req.clone();
    let _ = origin.apply(&mut upstream, &id_header);
});
