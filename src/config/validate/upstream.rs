//! `[upstreams.<name>]`: addresses, timeouts, health checks and TLS to the upstream.

use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use toml::Spanned;

use super::int_in;
use crate::config::error::Collector;
use crate::config::raw::RawUpstream;
use crate::config::*;

pub(super) fn upstream(
    c: &mut Collector,
    name: &str,
    up: &Spanned<RawUpstream>,
    config: &Path,
) -> Option<UpstreamConfig> {
    let u = up.get_ref();
    if name.trim().is_empty() {
        // Every log line and metric names the upstream by it.
        c.push(
            Some(&up.span()),
            None,
            format!(
                "upstreams.{}: an upstream's name is empty or blank: give it one, such as [upstreams.api]",
                super::shape::key_shown(name)
            ),
        );
    }
    // A name TOML must quote is quoted, as the file writes it: `upstreams."api v2".addrs`.
    let raw_name = name;
    let name = &super::shape::key_shown(name);
    let field = |f: &str| format!("upstreams.{name}.{f}");
    let mut addrs = Vec::new();
    let mut hosts = Vec::new();
    if u.addrs.get_ref().is_empty() {
        c.push(
            Some(&u.addrs.span()),
            None,
            format!(
                "{} is empty: give at least one \"host:port\"",
                field("addrs")
            ),
        );
    }
    // Names written, lower case, with their ports: an entry written twice is said once.
    let mut names: Vec<(String, u16)> = Vec::new();
    for a in u.addrs.get_ref() {
        let written = a.get_ref();
        match host_and_port(written) {
            // Port 0 is no port to connect to: every request would be a 502.
            Some((_, 0)) => c.push(
                Some(&a.span()),
                None,
                format!(
                    "{} entry \"{written}\" has port 0, which no upstream listens on: write \"host:port\"",
                    field("addrs"),
                ),
            ),
            Some((Host::Ip(ip), port)) => {
                let addr = SocketAddr::new(ip, port);
                if addrs.contains(&addr) {
                    c.warn(Some(&a.span()), None, format!("{} entry \"{written}\" is {addr} again: an address listed twice is still one address, with one share of the requests (weights are not written this way)", field("addrs")));
                }
                addrs.push(addr);
                hosts.push(ip.to_string());
            }
            Some((Host::Name(name), port)) => {
                // Resolved by the upstream's pool, at start and every 30 s: a name that does
                // not resolve now is an outage of the resolver or of the upstream, not a
                // mistake in the file (as a Redis that does not answer at start).
                let resolves = (name.as_str(), port)
                    .to_socket_addrs()
                    .is_ok_and(|mut found| found.next().is_some());
                if !resolves {
                    c.warn(Some(&a.span()), None, format!("{} entry \"{written}\" does not resolve now: an upstream new to the process starts without its addresses (one running keeps those it resolved last), and the name is resolved again every second until it has one (then every 30 s); meanwhile a request the upstream has no address for is answered 502", field("addrs")));
                }
                let key = (name.to_ascii_lowercase(), port);
                if names.contains(&key) {
                    c.warn(Some(&a.span()), None, format!("{} entry \"{written}\" is listed twice: a name listed twice is still its addresses once, with one share of the requests each (weights are not written this way)", field("addrs")));
                }
                names.push(key);
                // The address is the pool's to find; the port is what the entry gives it.
                addrs.push(SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), port));
                hosts.push(name);
            }
            // Shown without what may be a password (`user:password@host:port`, a URL's).
            None => c.push(
                Some(&a.span()),
                None,
                format!(
                    "{} entry \"{}\" {}",
                    field("addrs"),
                    crate::config::redact_url_and_query(written),
                    why_not_an_address(written)
                ),
            ),
        }
    }
    let connect = int_in(
        c,
        None,
        &field("connect_timeout_ms"),
        u.connect_timeout_ms.as_ref(),
        1000,
        (1, 3_600_000),
        " ms",
    );
    let read = int_in(
        c,
        None,
        &field("read_timeout_ms"),
        u.read_timeout_ms.as_ref(),
        60_000,
        (1, 3_600_000),
        " ms",
    );
    let tls = upstream_tls(c, name, u, config);
    let health_check = match &u.health_check {
        None => Some(None),
        Some(hc) => {
            let h = hc.get_ref();
            let (path, path_ok) = match (&h.path, &h.grpc_service) {
                (Some(path), None) => {
                    let ok = path.get_ref().starts_with('/')
                        && path.get_ref().parse::<http::Uri>().is_ok();
                    if !ok {
                        c.push(
                            Some(&path.span()),
                            None,
                            format!(
                                "{}.path = \"{}\" is not a path: write one such as \"/healthz\"",
                                field("health_check"),
                                path.get_ref()
                            ),
                        );
                    }
                    (path.get_ref().clone(), ok)
                }
                (None, Some(service)) => {
                    let ok = u.http2 == Some(true);
                    if !ok {
                        c.push(Some(&service.span()), None, format!("{}.grpc_service asks gRPC's health check, which needs http2 = true on the upstream", field("health_check")));
                    }
                    (crate::upstream::GRPC_HEALTH_PATH.to_owned(), ok)
                }
                (Some(path), Some(_)) => {
                    c.push(Some(&path.span()), None, format!("{}: path and grpc_service are both set: a check is an HTTP GET of path or gRPC's health check of grpc_service, not both", field("health_check")));
                    (String::new(), false)
                }
                (None, None) => {
                    c.push(Some(&hc.span()), None, format!("{} needs path = \"/healthz\" (an HTTP GET) or grpc_service = \"\" (gRPC's health check, of the server or of the service named)", field("health_check")));
                    (String::new(), false)
                }
            };
            let n = |c: &mut Collector,
                     f: &str,
                     v: &Option<Spanned<i64>>,
                     d: i64,
                     r: (i64, i64),
                     unit: &str| {
                int_in(
                    c,
                    None,
                    &format!("{}.{f}", field("health_check")),
                    v.as_ref(),
                    d,
                    r,
                    unit,
                )
            };
            let interval = n(
                c,
                "interval_ms",
                &h.interval_ms,
                2000,
                (100, 3_600_000),
                " ms",
            );
            let timeout = n(c, "timeout_ms", &h.timeout_ms, 1000, (10, 60_000), " ms");
            let unhealthy = n(
                c,
                "unhealthy_after",
                &h.unhealthy_after,
                3,
                (1, 100),
                " checks",
            );
            let healthy = n(c, "healthy_after", &h.healthy_after, 2, (1, 100), " checks");
            if let (Some(i), Some(t), Some(at)) = (interval, timeout, &h.timeout_ms) {
                if t > i {
                    c.warn(Some(&at.span()), None, format!("{}.timeout_ms = {t} is longer than its interval_ms = {i}: a check that waits that long delays the next, so an address is judged less often than written", field("health_check")));
                }
            }
            match (path_ok, interval, timeout, unhealthy, healthy) {
                (true, Some(i), Some(t), Some(u), Some(hy)) => Some(Some(HealthCheck {
                    path,
                    grpc_service: h.grpc_service.as_ref().map(|s| s.get_ref().clone()),
                    interval: Duration::from_millis(i),
                    timeout: Duration::from_millis(t),
                    unhealthy_after: u as u32,
                    healthy_after: hy as u32,
                })),
                _ => None,
            }
        }
    };
    (addrs.len() == u.addrs.get_ref().len() && !addrs.is_empty()).then_some(())?;
    // TLS fields that do nothing without `tls = true`, each where it is written.
    let verify_off = u.verify.as_ref().filter(|v| !*v.get_ref());
    let inert: Vec<(&str, Range<usize>)> = match u.tls == Some(true) {
        true => Vec::new(),
        false => [
            ("sni", u.sni.as_ref().map(|v| v.span())),
            ("ca_path", u.ca_path.as_ref().map(|v| v.span())),
            ("verify = false", verify_off.map(|v| v.span())),
        ]
        .into_iter()
        .filter_map(|(field, at)| Some((field, at?)))
        .collect(),
    };
    // What the upstream's warning points at: `verify = false`, or the first inert field.
    let warned_at = match (&tls, verify_off) {
        (Some(Some(_)), Some(v)) => v.span(),
        _ => (inert.iter().map(|(_, at)| at.clone()))
            .min_by_key(|at| at.start)
            .unwrap_or_else(|| up.span()),
    };
    Some(UpstreamConfig {
        // As written: the routes name it so, and the pools are keyed by it.
        name: raw_name.to_owned(),
        addrs,
        hosts,
        connect_timeout: Duration::from_millis(connect?),
        read_timeout: Duration::from_millis(read?),
        tls: tls?,
        http2: u.http2.unwrap_or(false),
        health_check: health_check?,
        inert_tls: inert.iter().map(|(field, _)| *field).collect(),
        written_at: crate::config::WrittenAt(Some(c.position(&warned_at))),
    })
}

/// Why an upstream address as written is none, and how to write one.
fn why_not_an_address(written: &str) -> String {
    let how = "write \"host:port\", an IPv6 address in brackets (\"[::1]:8080\")";
    if written.contains("://") {
        return format!("is a URL, not an address: {how}");
    }
    if written.contains('@') {
        return format!("holds a user (and perhaps a password) before '@', which an address has not: {how}: the gateway sends an upstream no credentials of its own");
    }
    if !written.starts_with('[') && written.matches(':').count() > 1 {
        return format!("is an IPv6 address without brackets: {how}");
    }
    match written.rsplit_once(':') {
        None => format!("has no port: {how}"),
        Some((_, port)) if port.parse::<u16>().is_err() => {
            format!("has no port from 1 to 65535: {how}")
        }
        Some((host, _)) if ends_in_digits(host) => {
            format!("is not an IPv4 address (four numbers from 0 to 255): {how}")
        }
        Some(_) => format!("is neither a host name nor an IP address: {how}"),
    }
}

/// The host of an upstream address as written.
enum Host {
    Ip(std::net::IpAddr),
    Name(String),
}

/// `host:port`, `ip:port` or `[ipv6]:port`, as written; `None` when it is none of them (an
/// IPv6 address without brackets, a URL, a name with characters no host name has).
fn host_and_port(written: &str) -> Option<(Host, u16)> {
    let (host, port) = written.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    if let Some(inner) = host.strip_prefix('[') {
        let ip: std::net::Ipv6Addr = inner.strip_suffix(']')?.parse().ok()?;
        return Some((Host::Ip(ip.into()), port));
    }
    if let Ok(ip) = host.parse::<std::net::Ipv4Addr>() {
        return Some((Host::Ip(ip.into()), port));
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    let valid = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
        });
    (valid && !ends_in_digits(name)).then(|| (Host::Name(host.to_owned()), port))
}

/// A last label of digits: an IPv4 address mistyped (`10.0.0.256`), or one the C resolver
/// would read in its old forms (`0177.0.0.1`, `2130706433`), never a host name.
fn ends_in_digits(host: &str) -> bool {
    host.rsplit('.')
        .next()
        .is_some_and(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()))
}

/// `tls`, `sni`, `ca_path` and `verify` of one upstream: `Some(None)` without TLS.
fn upstream_tls(
    c: &mut Collector,
    name: &str,
    u: &RawUpstream,
    config: &Path,
) -> Option<Option<UpstreamTls>> {
    // Without TLS, `sni`, `ca_path` and `verify` do nothing (the contract's own example
    // writes them beside `tls = false`, ready to switch on): the start logs them at WARN,
    // and `ca_path` is not read.
    if u.tls != Some(true) {
        return Some(None);
    }
    let sni = match &u.sni {
        Some(s) if s.get_ref().is_empty() => {
            c.push(
                Some(&s.span()),
                None,
                format!("upstreams.{name}.sni is empty: leave it out to send each address's host"),
            );
            return None;
        }
        // What the TLS handshake can send as a server name: a DNS name or an address.
        Some(s) if rustls::pki_types::ServerName::try_from(s.get_ref().as_str()).is_err() => {
            c.push(
                Some(&s.span()),
                None,
                format!(
                    "upstreams.{name}.sni = \"{}\" is not a host name or an address, such as \"api.internal.example\"",
                    s.get_ref()
                ),
            );
            return None;
        }
        Some(s) => Some(s.get_ref().clone()),
        None => None,
    };
    let ca = match &u.ca_path {
        None => None,
        Some(p) => {
            let file = config
                .parent()
                .map_or_else(|| PathBuf::from(p.get_ref()), |dir| dir.join(p.get_ref()));
            let read =
                crate::config::read_unwatched(&file).map_err(|e| format!("cannot be read: {e}"));
            let certs = read.and_then(|pem| {
                rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
                    .map(|c| c.map(|c| c.to_vec()))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| {
                        format!(
                            "is not a PEM certificate file: {}",
                            crate::config::tls::pem_error(&e)
                        )
                    })
            });
            let certs = certs.and_then(|certs| {
                if certs.is_empty() {
                    return Err("holds no certificate".to_owned());
                }
                for der in &certs {
                    x509_parser::parse_x509_certificate(der)
                        .map_err(|e| format!("holds a certificate that cannot be parsed: {e}"))?;
                }
                Ok(certs)
            });
            match certs {
                Ok(certs) => Some(certs),
                Err(why) => {
                    c.push(
                        Some(&p.span()),
                        None,
                        format!("upstreams.{name}.ca_path = \"{}\" {why}", p.get_ref()),
                    );
                    return None;
                }
            }
        }
    };
    Some(Some(UpstreamTls {
        sni,
        ca,
        verify: u.verify.as_ref().is_none_or(|v| *v.get_ref()),
    }))
}
