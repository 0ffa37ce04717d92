//! `[server]`, `[redis]`, `[breaker]`, `[auth.jwt]` and `[upstreams]`.

use std::net::{SocketAddr, ToSocketAddrs};
use std::num::NonZeroU32;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use rustls::pki_types::pem::PemObject;
use toml::Spanned;

use super::int_in;
use crate::config::error::Collector;
use crate::config::raw::{OneOrMany, RawConfig, RawIdentity, RawUpstream};
use crate::config::*;

/// What two listen addresses that [`overlap`] are told.
pub(super) const SHARED: &str = "share a port on one address (or one of them is the wildcard that takes the other's): only one could be bound";

/// What a listen address of port 0 is told: the system would choose a port no client knows.
pub(super) const PORT_ZERO: &str = "has port 0, which lets the system choose a port no client would know: write a port from 1 to 65535";

/// Whether two listen addresses cannot both be bound: one port on the same address (an
/// IPv4-mapped one as IPv4), or one of them the wildcard of the other's family.
pub(super) fn overlap(a: SocketAddr, b: SocketAddr) -> bool {
    if a.port() != b.port() || a.port() == 0 {
        return false;
    }
    let (a, b) = (
        crate::identity::canonical(a.ip()),
        crate::identity::canonical(b.ip()),
    );
    // Of one family only: a `[::]` listener beside an IPv4 one on its port is bound IPv6
    // only (`ServerConfig::ipv6_only`), as nginx binds `[::]`.
    let takes =
        |w: std::net::IpAddr, o: std::net::IpAddr| w.is_unspecified() && w.is_ipv6() == o.is_ipv6();
    a == b || takes(a, b) || takes(b, a)
}

pub(super) fn server(c: &mut Collector, raw: &RawConfig, config: &Path) -> Option<ServerConfig> {
    let s = raw.server.as_ref().map(|s| s.get_ref());
    let mut ok = true;
    // Each address with where it is written (none for the default).
    let (listen, listen_at): (Vec<SocketAddr>, Vec<Option<Range<usize>>>) = match s
        .and_then(|s| s.listen.as_ref())
    {
        None => (
            vec!["0.0.0.0:8080".parse().expect("valid default")],
            vec![None],
        ),
        Some(l) => {
            // Each address with the place it is written (a lone one: the value's own).
            let (list, listed) = match l.get_ref() {
                OneOrMany::One(a) => (vec![Spanned::new(l.span(), a.clone())], false),
                OneOrMany::Many(v) => (v.clone(), true),
            };
            if list.is_empty() {
                c.push(
                    Some(&l.span()),
                    None,
                    "server.listen is empty: give at least one address such as \"0.0.0.0:8080\""
                        .into(),
                );
                ok = false;
            }
            let mut seen: Vec<SocketAddr> = Vec::new();
            (list.iter().enumerate())
                .filter_map(|(i, a)| match a.get_ref().parse::<SocketAddr>() {
                    Ok(addr) if addr.port() == 0 => {
                        let at = if listed { format!("[{i}]") } else { String::new() };
                        c.push(Some(&a.span()), None, format!("server.listen{at} = \"{addr}\" {PORT_ZERO}"));
                        ok = false;
                        None
                    }
                    Ok(addr) => {
                        if let Some(other) = seen.iter().find(|o| overlap(**o, addr)) {
                            c.push(Some(&a.span()), None, format!("server.listen: \"{addr}\" and \"{other}\" {SHARED}"));
                            ok = false;
                        }
                        seen.push(addr);
                        Some((addr, Some(a.span())))
                    }
                    Err(_) => {
                        let at = if listed { format!("[{i}]") } else { String::new() };
                        let at_place = a.span();
                        let a = a.get_ref();
                        c.push(Some(&at_place), None, format!("server.listen{at} = \"{a}\" is not an address: write IP:port, such as \"0.0.0.0:8080\""));
                        ok = false;
                        None
                    }
                })
                .unzip()
        }
    };
    let threads = int_in(
        c,
        None,
        "server.threads",
        s.and_then(|s| s.threads.as_ref()),
        2,
        (1, 256),
        "",
    );
    let admin_listen = match s.and_then(|s| s.admin_listen.as_ref()) {
        None => Some("127.0.0.1:9090".parse().expect("valid default")),
        Some(a) => match a.get_ref().parse::<SocketAddr>() {
            Ok(addr) if addr.port() == 0 => {
                c.push(
                    Some(&a.span()),
                    None,
                    format!("server.admin_listen = \"{addr}\" {PORT_ZERO}"),
                );
                None
            }
            Ok(addr) => Some(addr),
            Err(_) => {
                c.push(Some(&a.span()), None, format!("server.admin_listen = \"{}\" is not an address: write IP:port, such as \"127.0.0.1:9090\"", a.get_ref()));
                None
            }
        },
    };
    // The default admin address too: `listen = "0.0.0.0:9090"` takes it (pointed at there).
    let admin_span = s.and_then(|s| s.admin_listen.as_ref().map(|a| a.span()));
    if let Some(admin) = admin_listen {
        if let Some((other, at)) =
            (listen.iter().zip(&listen_at)).find(|(l, _)| overlap(**l, admin))
        {
            let admin_span = admin_span.clone().or_else(|| at.clone());
            let shared = if *other == admin {
                "is also in server.listen".to_owned()
            } else {
                format!("and server.listen's \"{other}\" {SHARED}")
            };
            c.push(admin_span.as_ref(), None, format!("server.admin_listen = \"{admin}\" {shared}: the admin listener needs an address of its own"));
            ok = false;
        }
    }
    let trusted_proxies = cidrs(
        c,
        None,
        "server.trusted_proxies",
        s.and_then(|s| s.trusted_proxies.as_ref()),
    );
    let ipv6_identity_prefix = int_in(
        c,
        None,
        "server.ipv6_identity_prefix",
        s.and_then(|s| s.ipv6_identity_prefix.as_ref()),
        128,
        (1, 128),
        "",
    );
    if let (Some(prefix @ 1..48), Some(at)) = (
        ipv6_identity_prefix,
        s.and_then(|s| s.ipv6_identity_prefix.as_ref()),
    ) {
        c.warn(Some(&at.span()), None, format!("server.ipv6_identity_prefix = {prefix} keys IPv6 clients by networks of {prefix} bits, each a provider's many customers (a site has a /48, a home line or an instance a /64): every client of one shares its bucket"));
    }
    let grace = int_in(
        c,
        None,
        "server.grace_period_seconds",
        s.and_then(|s| s.grace_period_seconds.as_ref()),
        10,
        (0, 3600),
        " seconds",
    );
    let drain_delay = int_in(
        c,
        None,
        "server.drain_delay_seconds",
        s.and_then(|s| s.drain_delay_seconds.as_ref()),
        0,
        (0, 300),
        " seconds",
    );
    // HTTP/2's windows: the protocol's own bounds (RFC 9113, 6.9.2).
    let h2_stream_window = int_in(
        c,
        None,
        "server.h2_stream_window_bytes",
        s.and_then(|s| s.h2_stream_window_bytes.as_ref()),
        H2_STREAM_WINDOW,
        (65_535, 2_147_483_647),
        " bytes",
    );
    let h2_connection_window = int_in(
        c,
        None,
        "server.h2_connection_window_bytes",
        s.and_then(|s| s.h2_connection_window_bytes.as_ref()),
        H2_CONNECTION_WINDOW,
        (65_535, 2_147_483_647),
        " bytes",
    );
    if let (Some(stream), Some(connection)) = (h2_stream_window, h2_connection_window) {
        if connection < stream {
            let at = s
                .and_then(|s| s.h2_connection_window_bytes.as_ref())
                .or_else(|| s.and_then(|s| s.h2_stream_window_bytes.as_ref()))
                .map(|v| v.span());
            c.warn(at.as_ref(), None, format!("server.h2_connection_window_bytes = {connection} is below h2_stream_window_bytes = {stream}: one stream whose upstream stops reading can hold the whole connection's window, and its other uploads wait for it"));
        }
    }
    let max_body_bytes = body_limit(
        c,
        None,
        "server.max_body_bytes",
        s.and_then(|s| s.max_body_bytes.as_ref()),
    );
    let request_id_header = match s.and_then(|s| s.request_id_header.as_ref()) {
        None => Some(http::HeaderName::from_static(DEFAULT_REQUEST_ID_HEADER)),
        Some(h) => match http::HeaderName::from_bytes(h.get_ref().as_bytes()) {
            Ok(_) if h.get_ref().contains('_') => {
                c.push(Some(&h.span()), None, format!("server.request_id_header = \"{}\" has '_': use letters, digits and '-', such as \"X-Request-Id\" (a backend behind CGI or WSGI reads '_' and '-' as one name, and a client's field of the other spelling would reach it beside the gateway's)", h.get_ref()));
                None
            }
            Ok(name) if RESERVED_REQUEST_ID_HEADERS.contains(&name.as_str()) => {
                c.push(Some(&h.span()), None, format!("server.request_id_header = \"{}\" is a header the gateway or HTTP itself uses: choose another, such as \"X-Request-Id\"", h.get_ref()));
                None
            }
            Ok(name) if crate::routing::plain_field_name(name.as_str()) => Some(name),
            // A name of other token characters (`X.Id`, `X+Id`): HTTP takes it, but a name
            // of letters, digits and `-` is what every backend and log pipeline reads.
            _ => {
                c.push(Some(&h.span()), None, format!("server.request_id_header = \"{}\" is not a header name of letters, digits and '-': use one such as \"X-Request-Id\"", h.get_ref()));
                None
            }
        },
    };
    let admin_token = match super::secret(
        c,
        "server.admin_token",
        s.and_then(|s| s.admin_token_env.as_ref()),
        s.and_then(|s| s.admin_token_file.as_ref()),
        None,
        config,
    ) {
        Err(()) => None,
        Ok(None) => Some(None),
        Ok(Some(read)) => {
            let (field, from, span) = (&read.field, &read.from, Some(&read.span));
            match read.value {
                // Sent as `Authorization: Bearer <token>`, which carries visible ASCII only.
                Some(v) if !v.iter().all(u8::is_ascii_graphic) => {
                    c.push(span, None, format!("{field}: {from} holds a space, a control character or a byte past ASCII: the admin token must be visible ASCII (it is sent in an Authorization header)"));
                    None
                }
                Some(v) if v.len() >= MIN_ADMIN_TOKEN_BYTES => {
                    Some(Some(Secret(Arc::from(v.as_slice()))))
                }
                Some(v) => {
                    c.push(span, None, format!("{field}: {from} holds {} bytes: the admin token must be at least {MIN_ADMIN_TOKEN_BYTES} bytes", v.len()));
                    None
                }
                None => {
                    c.push(span, None, format!("{field}: {from} is not set: set it to the admin token (at least {MIN_ADMIN_TOKEN_BYTES} bytes)"));
                    None
                }
            }
        }
    };
    // Reachable from elsewhere and open to anyone: `/reload`, `DELETE /limits` and
    // `/metrics` for whoever reaches the address.
    if let (Some(admin), Some(None)) = (admin_listen, &admin_token) {
        if !crate::identity::canonical(admin.ip()).is_loopback() {
            c.warn(admin_span.as_ref(), None, format!("server.admin_listen = \"{admin}\" is reachable from other hosts and no admin_token_env (or admin_token_file) is set: anyone who reaches it can reload the config, reset limits and read the metrics; set admin_token_env, or listen on a loopback address"));
        }
    }
    let header_read_timeout = int_in(
        c,
        None,
        "server.header_read_timeout_ms",
        s.and_then(|s| s.header_read_timeout_ms.as_ref()),
        10_000,
        (100, 600_000),
        " ms",
    );
    let keepalive_timeout = int_in(
        c,
        None,
        "server.keepalive_timeout_seconds",
        s.and_then(|s| s.keepalive_timeout_seconds.as_ref()),
        60,
        (0, 3600),
        " seconds (0: no keep-alive)",
    );
    let send_timeout = int_in(
        c,
        None,
        "server.send_timeout_seconds",
        s.and_then(|s| s.send_timeout_seconds.as_ref()),
        60,
        (0, 3600),
        " seconds (0: never)",
    );
    let max_connections = match s.and_then(|s| s.max_connections.as_ref()) {
        None => Some(None),
        Some(v) => int_in(
            c,
            None,
            "server.max_connections",
            Some(v),
            0,
            (1, 10_000_000),
            "",
        )
        .map(|n| Some(n as usize)),
    };
    let tls = super::tls::listeners(
        c,
        s.map(|s| s.tls.as_slice()).unwrap_or_default(),
        &listen,
        config,
    );
    // A `[::]:P` beside an IPv4 listener of its port is bound IPv6 only: without the IPv4
    // wildcard on that port too, IPv4 clients of the host's other addresses are not taken.
    let raw_tls = s.map(|s| s.tls.as_slice()).unwrap_or_default();
    let every: Vec<(String, SocketAddr, Option<Range<usize>>)> = (listen.iter().zip(&listen_at))
        .map(|(a, at)| ("server.listen".to_owned(), *a, at.clone()))
        .chain(
            (tls.iter().flatten())
                .zip(raw_tls)
                .enumerate()
                .map(|(i, (t, raw))| {
                    (
                        format!("server.tls[{i}].listen"),
                        t.listen,
                        Some(raw.get_ref().listen.span()),
                    )
                }),
        )
        .chain(admin_listen.map(|a| ("server.admin_listen".to_owned(), a, admin_span.clone())))
        .collect();
    for (field, wildcard, at) in &every {
        if !(wildcard.is_ipv6() && wildcard.ip().is_unspecified()) {
            continue;
        }
        let port = wildcard.port();
        let ipv4: Vec<SocketAddr> = (every.iter())
            .map(|(_, a, _)| *a)
            .filter(|a| a.port() == port && crate::identity::canonical(a.ip()).is_ipv4())
            .collect();
        let taken = ipv4
            .iter()
            .any(|a| crate::identity::canonical(a.ip()).is_unspecified());
        if let (Some(first), false) = (ipv4.first(), taken) {
            c.warn(at.as_ref(), None, format!("{field} = \"{wildcard}\" is bound IPv6 only beside the IPv4 listener \"{first}\" of its port: IPv4 clients of the host's other addresses are not taken on port {port} (add \"0.0.0.0:{port}\", or give that listener another port)"));
        }
    }
    // An address this host does not have is no error of the file (it may be meant for
    // another host), but a start here would fail to bind it: said before it does.
    let mut looked: Vec<std::net::IpAddr> = Vec::new();
    for (field, addr, at) in &every {
        let ip = addr.ip();
        if ip.is_unspecified() || ip.is_loopback() || looked.contains(&ip) {
            continue;
        }
        looked.push(ip);
        if let Err(e) = std::net::TcpListener::bind((ip, 0)) {
            if e.kind() == std::io::ErrorKind::AddrNotAvailable {
                c.warn(at.as_ref(), None, format!("{field} = \"{addr}\": {ip} is not an address of this host, so a start here would fail to bind it (fine if the file is for another host)"));
            }
        }
    }
    if let (Some(admin), Some(tls)) = (admin_listen, tls.as_ref()) {
        if let Some(other) = tls.iter().find(|t| overlap(t.listen, admin)) {
            let shared = if other.listen == admin {
                "is also a server.tls listener".to_owned()
            } else {
                format!("and server.tls's \"{}\" {SHARED}", other.listen)
            };
            c.push(s.and_then(|s| s.admin_listen.as_ref()).map(|a| a.span()).as_ref(), None, format!("server.admin_listen = \"{admin}\" {shared}: the admin listener needs an address of its own"));
            ok = false;
        }
    }
    Some(ServerConfig {
        listen,
        tls: tls?,
        header_read_timeout: Duration::from_millis(header_read_timeout?),
        keepalive_timeout: Duration::from_secs(keepalive_timeout?),
        send_timeout: Duration::from_secs(send_timeout?),
        max_connections: max_connections?,
        threads: threads? as usize,
        admin_listen: admin_listen?,
        trusted_proxies: trusted_proxies?,
        ipv6_identity_prefix: ipv6_identity_prefix? as u8,
        grace_period: Duration::from_secs(grace?),
        drain_delay: Duration::from_secs(drain_delay?),
        watch_config: s.and_then(|s| s.watch_config).unwrap_or(false),
        h2c: s.and_then(|s| s.h2c).unwrap_or(false),
        h2_stream_window: h2_stream_window? as u32,
        h2_connection_window: h2_connection_window? as u32,
        max_body_bytes: max_body_bytes?,
        request_id_wire: request_id_header
            .as_ref()
            .map(|h| bytes::Bytes::copy_from_slice(h.as_str().as_bytes()))?,
        request_id_header: request_id_header?,
        strict_transport_security: strict_transport_security(c, s, s.map_or(0, |s| s.tls.len()))?,
        admin_token: admin_token?,
    })
    .filter(|_| ok)
}

/// `server.strict_transport_security`: a value RFC 6797 gives (`max-age=<seconds>`, then
/// `includeSubDomains` or `preload` if wanted), sent over TLS listeners only; without one,
/// said to go nowhere.
fn strict_transport_security(
    c: &mut Collector,
    s: Option<&crate::config::raw::RawServer>,
    tls_listeners: usize,
) -> Option<Option<http::HeaderValue>> {
    let Some(v) = s.and_then(|s| s.strict_transport_security.as_ref()) else {
        return Some(None);
    };
    let text = v.get_ref().trim();
    // Directive names in any case, a value quoted or not, each directive once: a browser
    // ignores the whole field otherwise (RFC 6797, 6.1).
    let names: Vec<String> = (text.split(';'))
        .map(|d| {
            d.split('=')
                .next()
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
        })
        .filter(|n| !n.is_empty())
        .collect();
    let once = (names.iter()).all(|n| names.iter().filter(|m| *m == n).count() == 1);
    let max_age = (text.split(';'))
        .filter_map(|d| d.split_once('='))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("max-age"))
        .map(|(_, age)| age.trim().trim_matches('"'))
        .is_some_and(|age| !age.is_empty() && age.bytes().all(|b| b.is_ascii_digit()));
    let value = http::HeaderValue::from_str(text)
        .ok()
        .filter(|_| max_age && once);
    let Some(value) = value else {
        c.push(Some(&v.span()), None, format!("server.strict_transport_security = \"{}\" is not a Strict-Transport-Security value a browser takes: write \"max-age=<seconds>\" and each directive once, such as \"max-age=31536000; includeSubDomains\"", v.get_ref().escape_debug()));
        return None;
    };
    if tls_listeners == 0 {
        c.warn(Some(&v.span()), None, "server.strict_transport_security is sent over TLS listeners only, and there is no [[server.tls]]: it is sent nowhere".into());
    }
    Some(Some(value))
}

/// Headers that cannot carry the request id: every field HTTP gives a meaning of its own (the
/// `http` crate's standard names: an id written over `Cache-Control`, `Range` or `Vary`
/// would change what the request asks or what caches do with the answer), and those the
/// gateway sets or drops.
const RESERVED_REQUEST_ID_HEADERS: &[&str] = &[
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "access-control-allow-credentials",
    "access-control-allow-headers",
    "access-control-allow-methods",
    "access-control-allow-origin",
    "access-control-expose-headers",
    "access-control-max-age",
    "access-control-request-headers",
    "access-control-request-method",
    "age",
    "allow",
    "alt-svc",
    "authorization",
    "cache-control",
    "cache-status",
    "cdn-cache-control",
    "connection",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-range",
    "content-security-policy",
    "content-security-policy-report-only",
    "content-type",
    "cookie",
    "date",
    "dnt",
    "etag",
    "expect",
    "expires",
    "forwarded",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "link",
    "location",
    "max-forwards",
    "origin",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "public-key-pins",
    "public-key-pins-report-only",
    "range",
    "referer",
    "referrer-policy",
    "refresh",
    "retry-after",
    "sec-websocket-accept",
    "sec-websocket-extensions",
    "sec-websocket-key",
    "sec-websocket-protocol",
    "sec-websocket-version",
    "server",
    "set-cookie",
    "strict-transport-security",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "upgrade-insecure-requests",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "x-content-type-options",
    "x-dns-prefetch-control",
    "x-frame-options",
    "x-xss-protection",
    // Standard too, beyond the `http` crate's list: authentication, HTTP/2's upgrade,
    // priorities, digests and signatures, preferences, what a server tells a browser.
    "authentication-info",
    "http2-settings",
    "priority",
    "early-data",
    "prefer",
    "proxy-status",
    "alt-used",
    "accept-ch",
    "content-digest",
    "repr-digest",
    "want-digest",
    "want-content-digest",
    "want-repr-digest",
    "signature",
    "signature-input",
    "server-timing",
    "clear-site-data",
    // W3C trace context has a format of its own, which an id of 32 hex digits is not.
    "traceparent",
    "tracestate",
    // Hop by hop: a proxy does not pass these on as they came.
    "proxy-connection",
    "keep-alive",
    // What the gateway sets, drops or answers with.
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-forwarded-port",
    "x-real-ip",
    "x-sentinel-identity",
    "x-sentinel-tier",
    "ratelimit",
    "ratelimit-policy",
];

/// A list of CIDRs (or plain addresses, as /32 and /128), each checked; `field` names it.
/// A network written with host bits set (`10.0.0.1/8`) is taken as its network, with a
/// warning: the written address alone was perhaps meant.
pub(super) fn cidrs(
    c: &mut Collector,
    route: Option<&str>,
    field: &str,
    list: Option<&Spanned<Vec<Spanned<String>>>>,
) -> Option<Vec<IpNet>> {
    let mut ok = true;
    let mut nets = Vec::new();
    for p in list.map(|l| l.get_ref().as_slice()).unwrap_or_default() {
        let text = p.get_ref();
        let parsed = text
            .parse::<IpNet>()
            .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from));
        match parsed {
            Ok(net) => {
                // Every address of a family: said, as it is seldom meant. `::ffff:0:0/96`
                // is every IPv4 address too (IPv4 clients are read as IPv4).
                let family_net = as_ipv4(net.trunc());
                if family_net.prefix_len() == 0 {
                    let family = if family_net.addr().is_ipv4() {
                        "IPv4"
                    } else {
                        "IPv6"
                    };
                    let what = match field.ends_with("trusted_proxies") {
                        true => "every peer may then say which client it forwards for (X-Forwarded-For): a client_ip identity, an exemption and the access log's client address are each client's own to choose",
                        false => "every client of that family then goes without a limit",
                    };
                    c.warn(
                        Some(&p.span()),
                        route,
                        format!("{field} entry \"{text}\" is every {family} address: {what}"),
                    );
                }
                // Wider than the IPv4-mapped range and holding it: IPv4 clients are read as
                // IPv4, so none of them is in it.
                if let IpNet::V6(v6) = net.trunc() {
                    let mapped: ipnet::Ipv6Net = "::ffff:0:0/96".parse().expect("valid");
                    if (1..96).contains(&v6.prefix_len()) && v6.contains(&mapped) {
                        c.warn(Some(&p.span()), route, format!("{field} entry \"{text}\" holds the IPv4-mapped addresses (::ffff:0:0/96), but IPv4 clients are read as IPv4: it matches none of them (write the IPv4 networks meant beside it, \"0.0.0.0/0\" for all)"));
                    }
                }
                let network = net.trunc();
                if network != net {
                    c.warn(Some(&p.span()), route, format!("{field} entry \"{text}\" has host bits set: it is taken as the network \"{network}\" (write \"{}\" for the one address)", IpNet::from(net.addr())));
                }
                let network = as_ipv4(network);
                if nets.contains(&network) {
                    c.warn(Some(&p.span()), route, format!("{field} entry \"{text}\" is the network \"{network}\" listed already: keep one"));
                }
                nets.push(network);
            }
            Err(_) => {
                c.push(Some(&p.span()), route, format!("{field} entry \"{text}\" is not a CIDR: write an address or a network such as \"10.0.0.0/8\""));
                ok = false;
            }
        }
    }
    ok.then_some(nets)
}

/// An IPv4-mapped IPv6 network (`::ffff:10.0.0.0/104`) as the IPv4 network it is: peers and
/// `X-Forwarded-For` entries are compared as IPv4 once mapped, so the written form would
/// never match.
fn as_ipv4(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).map_or(net, IpNet::V4),
            None => net,
        },
        _ => net,
    }
}

/// A `max_body_bytes` field: `Some(None)` for no limit (absent or 0), `None` when invalid.
pub(super) fn body_limit(
    c: &mut Collector,
    route: Option<&str>,
    field: &str,
    value: Option<&Spanned<i64>>,
) -> Option<Option<u64>> {
    let n = int_in(
        c,
        route,
        field,
        value,
        0,
        (0, MAX_BODY_BYTES),
        " bytes (0: no limit)",
    )?;
    Some((n > 0).then_some(n))
}

/// The headers a `forward_identity` route tells its upstream the caller in, which the gateway
/// drops from every request: no caller can be read from them.
pub(super) fn is_the_gateways_caller_header(name: &str) -> bool {
    // Its other spellings too (`_`, `.`): dropped beside the gateway's own.
    matches!(
        crate::routing::folded_field_name(name).as_ref(),
        "x-sentinel-identity" | "x-sentinel-tier"
    )
}

pub(super) const CALLER_HEADER_TAKEN: &str = "is a header the gateway writes itself (forward_identity tells the upstream the caller in it) and drops from every request: choose another, such as \"X-API-Key\"";

/// `[auth.api_keys]`: the header, and the keys read from their file (its problems are
/// reported with the key file's own positions).
pub(super) fn api_keys(c: &mut Collector, raw: &RawConfig, config: &Path) -> Option<ApiKeysConfig> {
    let k = raw.auth.as_ref()?.get_ref().api_keys.as_ref()?.get_ref();
    let header = match &k.header {
        None => Some(DEFAULT_API_KEY_HEADER.to_owned()),
        Some(h) => match http::HeaderName::from_bytes(h.get_ref().as_bytes()) {
            Ok(name) if is_the_gateways_caller_header(name.as_str()) => {
                c.push(
                    Some(&h.span()),
                    None,
                    format!(
                        "auth.api_keys.header = \"{}\" {CALLER_HEADER_TAKEN}",
                        h.get_ref()
                    ),
                );
                None
            }
            Ok(name) => Some(name.as_str().to_owned()),
            Err(_) => {
                c.push(
                    Some(&h.span()),
                    None,
                    format!(
                        "auth.api_keys.header = \"{}\" is not a header name: use letters, digits and '-', such as \"X-API-Key\"",
                        h.get_ref()
                    ),
                );
                None
            }
        },
    };
    let written = k.file.get_ref();
    if written.is_empty() {
        c.push(
            Some(&k.file.span()),
            None,
            "auth.api_keys.file is empty: name the key file".into(),
        );
        return None;
    }
    let file = config
        .parent()
        .map_or_else(|| PathBuf::from(written), |dir| dir.join(written));
    let keys = match api_keys::load(&file) {
        Ok(keys) => Some(keys),
        Err(errors) => {
            if errors.iter().all(|e| e.position.is_none()) {
                // The file could not be read: say where it was named.
                c.push(
                    Some(&k.file.span()),
                    None,
                    format!("auth.api_keys.file = \"{written}\": {}", errors[0].message),
                );
            } else {
                c.errors.extend(errors);
            }
            None
        }
    };
    Some(ApiKeysConfig {
        header: header?,
        file,
        keys: Arc::new(keys?),
    })
}

/// `[access_log]`: where the lines go.
pub(super) fn access_log(
    c: &mut Collector,
    raw: &RawConfig,
    config: &Path,
) -> Option<AccessLogTarget> {
    let path = &raw.access_log.as_ref()?.get_ref().path;
    match path.get_ref().as_str() {
        "" => {
            c.push(
                Some(&path.span()),
                None,
                "access_log.path is empty: give a file, or \"-\" for stdout".into(),
            );
            None
        }
        "-" => Some(AccessLogTarget::Stdout),
        p => {
            let file = config
                .parent()
                .map_or_else(|| PathBuf::from(p), |dir| dir.join(p));
            // What `check` can tell without writing anything: the file is made at start if
            // missing, in a directory that must be there, and the process may write either
            // (a read-only file system, a directory of another user's: the start would fail).
            let dir = file.parent().filter(|d| !d.as_os_str().is_empty());
            let written = if file.exists() {
                file.clone()
            } else {
                dir.map_or_else(|| PathBuf::from("."), Path::to_path_buf)
            };
            let problem = if file.is_dir() {
                Some("is a directory: name a file in it".to_owned())
            } else if let Some(dir) = dir.filter(|d| !d.is_dir()) {
                let why = match dir.exists() {
                    true => "is not a directory",
                    false => "does not exist",
                };
                Some(format!("cannot be made: {} {why}", dir.display()))
            } else if let Err(e) = may_write(&written, file.exists()) {
                let said = format!(
                    "cannot be written by this process: {}: {e}",
                    written.display()
                );
                // A permission is this user's, and `check` may run as another (a CI job, an
                // operator's shell) than the gateway's: said, not refused (the start says it
                // again, and exits). Anything else (a read-only file system, a path too long
                // or looping) is the host's for everyone: refused.
                let permission = matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM));
                if !permission {
                    Some(said)
                } else {
                    // SAFETY: no arguments; reads the process's real user.
                    let uid = unsafe { libc::getuid() };
                    c.warn(Some(&path.span()), None, format!("access_log.path = \"{}\" {said} (user {uid}): a start as this user would exit 1", path.get_ref()));
                    None
                }
            } else if let Some((read, _)) = read_files(raw, config)
                .into_iter()
                .find(|(_, f)| same_file(f, &file))
            {
                Some(format!("is {read}, which the gateway reads: its lines would be written into it; name a file of its own"))
            } else {
                None
            };
            match problem {
                Some(problem) => {
                    c.push(
                        Some(&path.span()),
                        None,
                        format!("access_log.path = \"{}\" {problem}", path.get_ref()),
                    );
                    None
                }
                None => Some(AccessLogTarget::File(file)),
            }
        }
    }
}

/// A secret's file that is one the gateway reads for another end (the config, a
/// certificate, a JWKS, the key file) is refused: those are no secret (a certificate is sent
/// in every handshake, a JWKS published), and anyone holding one could sign tokens with it
/// as the HS* secret, or present it as the admin token.
pub(super) fn secrets_of_their_own(c: &mut Collector, raw: &RawConfig, config: &Path) {
    let others = read_for_other_ends(raw, config);
    for (field, p) in secret_files(raw) {
        let path = resolved(config, p.get_ref());
        if let Some((other, _)) = others.iter().find(|(_, o)| same_file(&path, o)) {
            c.push(Some(&p.span()), None, format!("{field} = \"{}\" is {other}, which the gateway reads for another end and others may read (a certificate is sent in every handshake): a secret needs a file of its own", p.get_ref()));
        }
    }
}

/// Whether this process may write `path` (a file, or a directory to make one in), as the
/// kernel says without writing: `EACCES` for another user's, `EROFS` on a read-only file
/// system.
fn may_write(path: &Path, is_file: bool) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // A file is made in a directory the process may write and enter.
    let mode = match is_file {
        true => libc::W_OK,
        false => libc::W_OK | libc::X_OK,
    };
    // SAFETY: `c_path` is a NUL-terminated string that outlives the call.
    match unsafe { libc::access(c_path.as_ptr(), mode) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// The files the config names for the gateway to read (and itself), each with what it is,
/// resolved as they are read.
fn read_files(raw: &RawConfig, config: &Path) -> Vec<(String, PathBuf)> {
    let mut files = read_for_other_ends(raw, config);
    files.extend((secret_files(raw)).map(|(field, p)| {
        let path = resolved(config, p.get_ref());
        (format!("{field} = \"{}\"", p.get_ref()), path)
    }));
    files
}

/// The secrets' files the config names, each with its field.
fn secret_files(raw: &RawConfig) -> impl Iterator<Item = (&'static str, &Spanned<String>)> {
    let server = raw.server.as_ref().map(|s| s.get_ref());
    let redis = raw.redis.as_ref().map(|r| r.get_ref());
    let jwt = (raw.auth.as_ref()).and_then(|a| a.get_ref().jwt.as_ref().map(|j| j.get_ref()));
    [
        (
            "server.admin_token_file",
            server.and_then(|s| s.admin_token_file.as_ref()),
        ),
        (
            "redis.password_file",
            redis.and_then(|r| r.password_file.as_ref()),
        ),
        (
            "redis.sentinel_password_file",
            redis.and_then(|r| r.sentinel_password_file.as_ref()),
        ),
        (
            "auth.jwt.secret_file",
            jwt.and_then(|j| j.secret_file.as_ref()),
        ),
    ]
    .into_iter()
    .filter_map(|(field, p)| p.map(|p| (field, p)))
}

/// `written`, relative to the config file's directory.
fn resolved(config: &Path, written: &str) -> PathBuf {
    config
        .parent()
        .map_or_else(|| PathBuf::from(written), |d| d.join(written))
}

/// The files the config names for the gateway to read but its secrets (and itself).
fn read_for_other_ends(raw: &RawConfig, config: &Path) -> Vec<(String, PathBuf)> {
    let at = |p: &str| resolved(config, p);
    let mut files = vec![("the config file itself".to_owned(), config.to_path_buf())];
    let mut add = |what: String, p: Option<&Spanned<String>>| {
        files.extend(p.map(|p| (format!("{what} = \"{}\"", p.get_ref()), at(p.get_ref()))));
    };
    if let Some(server) = &raw.server {
        for (i, t) in server.get_ref().tls.iter().enumerate() {
            let t = t.get_ref();
            add(format!("server.tls[{i}].cert_path"), Some(&t.cert_path));
            add(format!("server.tls[{i}].key_path"), Some(&t.key_path));
            for (j, n) in t.sni.iter().enumerate() {
                add(
                    format!("server.tls[{i}].sni[{j}].cert_path"),
                    Some(&n.get_ref().cert_path),
                );
                add(
                    format!("server.tls[{i}].sni[{j}].key_path"),
                    Some(&n.get_ref().key_path),
                );
            }
        }
    }
    if let Some(auth) = &raw.auth {
        let auth = auth.get_ref();
        add(
            "auth.api_keys.file".into(),
            auth.api_keys.as_ref().map(|k| &k.get_ref().file),
        );
        let jwks = auth
            .jwt
            .as_ref()
            .and_then(|j| j.get_ref().jwks_path.as_ref());
        add("auth.jwt.jwks_path".into(), jwks);
    }
    if let Some(redis) = &raw.redis {
        let r = redis.get_ref();
        add("redis.tls_ca_path".into(), r.tls_ca_path.as_ref());
        add("redis.tls_cert_path".into(), r.tls_cert_path.as_ref());
        add("redis.tls_key_path".into(), r.tls_key_path.as_ref());
    }
    for (name, u) in &raw.upstreams {
        add(
            format!("upstreams.{name}.ca_path"),
            u.get_ref().ca_path.as_ref(),
        );
    }
    files
}

/// Whether two paths name one file that exists (through symbolic or hard links, `..` or
/// another spelling): the same device and inode.
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

pub(super) fn redis(
    c: &mut Collector,
    raw: &RawConfig,
    url_override: Option<&str>,
    config: &Path,
) -> Option<RedisConfig> {
    let r = raw.redis.as_ref().map(|r| r.get_ref());
    let url = r.and_then(|r| r.url.as_ref());
    let cluster = r.and_then(|r| r.cluster_urls.as_ref());
    let sentinel = r.and_then(|r| r.sentinel_urls.as_ref());
    if let (Some(s), true) = (sentinel, url.is_some() || cluster.is_some()) {
        c.push(Some(&s.span()), None, "redis.sentinel_urls is set beside redis.url or redis.cluster_urls: keep exactly one of the three".into());
        return None;
    }
    if let (None, Some(m)) = (sentinel, r.and_then(|r| r.sentinel_master.as_ref())) {
        c.push(
            Some(&m.span()),
            None,
            "redis.sentinel_master is set without redis.sentinel_urls: list the sentinels to ask"
                .into(),
        );
        return None;
    }
    let target = match (url_override, url, cluster) {
        (None, None, None) if sentinel.is_some() => {
            sentinel_target(c, r.expect("a [redis] section"), config)
        }
        (Some(env), file_url, file_seeds) => {
            // The environment's URL is used; the file's are checked all the same (no password
            // in them, and each as it would be read without the variable), so that a file
            // that passes now still loads once the variable is gone.
            if let Some(u) = file_url {
                check_redis_url(
                    c,
                    Some(&u.span()),
                    u.get_ref(),
                    &format!("redis.url \"{}\"", redact_url(u.get_ref())),
                    Some("redis.password"),
                    SINGLE_FORM,
                );
            }
            if let Some(seeds) = file_seeds {
                let _ = cluster_urls(c, seeds);
            }
            if let (Some(_), Some(r)) = (sentinel, r) {
                let _ = sentinel_target(c, r, config);
            }
            check_redis_url(
                c,
                None,
                env,
                &format!("{REDIS_URL_ENV} = \"{}\"", env_url_shown(env)),
                None,
                SINGLE_FORM,
            )
            .map(RedisTarget::Single)
        }
        (None, Some(u), Some(_)) => {
            c.push(
                Some(&u.span()),
                None,
                "redis.url and redis.cluster_urls are both set: keep exactly one (url for one Redis, cluster_urls for Redis Cluster)".into(),
            );
            None
        }
        (None, Some(u), None) => check_redis_url(
            c,
            Some(&u.span()),
            u.get_ref(),
            &format!("redis.url = \"{}\"", redact_url(u.get_ref())),
            Some("redis.password"),
            SINGLE_FORM,
        )
        .map(RedisTarget::Single),
        (None, None, Some(seeds)) => cluster_urls(c, seeds),
        (None, None, None) => Some(RedisTarget::Single("redis://127.0.0.1:6379/0".to_owned())),
    };
    let timeout = int_in(
        c,
        None,
        "redis.timeout_ms",
        r.and_then(|r| r.timeout_ms.as_ref()),
        20,
        (1, 10_000),
        " ms",
    );
    let key_prefix = match r.and_then(|r| r.key_prefix.as_ref()) {
        None => Some("sentinel".to_owned()),
        Some(p) => {
            let v = p.get_ref();
            let valid = !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
            if !valid {
                c.push(Some(&p.span()), None, format!("redis.key_prefix = \"{}\" is not usable: use 1 to 64 of a-z, A-Z, 0-9, '.', '_', '-'", super::cut(v)));
            }
            valid.then(|| v.clone())
        }
    };
    let require_noeviction = r.and_then(|r| r.require_noeviction).unwrap_or(true);
    let dedicated_io_thread = r.and_then(|r| r.dedicated_io_thread).unwrap_or(true);
    let batch_max = int_in(
        c,
        None,
        "redis.batch_max",
        r.and_then(|r| r.batch_max.as_ref()),
        256,
        (1, crate::config::BATCH_MAX_LARGEST),
        " decisions per call (1 sends each decision alone)",
    )
    .map(|n| n as usize);
    let access = target
        .as_ref()
        .and_then(|t| redis_access(c, r, t, url_override, config));
    // Said by `check`, and logged at every start and reload with the file's other warnings.
    let overridden = match (url_override, cluster, sentinel) {
        (Some(_), Some(_), _) => Some("redis.cluster_urls"),
        (Some(_), None, Some(_)) => Some("redis.sentinel_urls"),
        _ => None,
    };
    if let Some(field) = overridden {
        c.warn(
            None,
            None,
            format!(
                "{REDIS_URL_ENV} is set: it overrides {field}, and the gateway uses that one Redis"
            ),
        );
    }
    Some(RedisConfig {
        target: target?,
        timeout: Duration::from_millis(timeout?),
        key_prefix: key_prefix?,
        require_noeviction,
        dedicated_io_thread,
        batch_max: batch_max?,
        access: access?,
    })
}

/// A password Redis (or a sentinel) is given, from `<field>_env` or `<field>_file`: `Ok(None)`
/// when neither is written, `Err` once a problem is said (not set, empty, not UTF-8).
fn redis_password(
    c: &mut Collector,
    field: &str,
    what: &str,
    env: Option<&Spanned<String>>,
    file: Option<&Spanned<String>>,
    config: &Path,
) -> Result<Option<Secret>, ()> {
    let Some(read) = super::secret(c, field, env, file, None, config)? else {
        return Ok(None);
    };
    let unset = read.unset();
    let super::SecretRead {
        field,
        from,
        span,
        value,
        ..
    } = read;
    match value.map(String::from_utf8) {
        // A line break or a NUL left in (a file ending in two line breaks) is no password
        // anyone meant: every connection would be refused. (Redis takes any other byte.)
        Some(Ok(v)) if v.contains(['\r', '\n', '\0']) => {
            c.push(Some(&span), None, format!("{field}: {from} holds a line break or a NUL (one last line break is not part of it): write the password alone"));
            Err(())
        }
        Some(Ok(v)) if !v.is_empty() => Ok(Some(Secret(Arc::from(v.as_bytes())))),
        Some(Err(_)) => {
            c.push(Some(&span), None, format!("{field}: {from} is not UTF-8"));
            Err(())
        }
        _ => {
            c.push(
                Some(&span),
                None,
                format!("{field}: {from} {unset}: set it to {what}"),
            );
            Err(())
        }
    }
}

/// `username`, `password_env` and the TLS files of `[redis]`, checked against the URLs: TLS
/// settings without a `rediss://` URL, or a mix of `redis://` and `rediss://` seeds, are
/// errors rather than a silent plain-text connection.
fn redis_access(
    c: &mut Collector,
    r: Option<&crate::config::raw::RawRedis>,
    target: &RedisTarget,
    url_override: Option<&str>,
    config: &Path,
) -> Option<RedisAccess> {
    let urls = match target {
        RedisTarget::Single(u) => std::slice::from_ref(u),
        RedisTarget::Cluster(seeds) => seeds.as_slice(),
        // `rediss://` sentinels: the sentinels and the master they name are reached over TLS.
        RedisTarget::Sentinel(s) => s.sentinels.as_slice(),
    };
    let tls_urls = urls.iter().filter(|u| u.starts_with("rediss://")).count();
    let mut ok = true;
    if tls_urls != 0 && tls_urls != urls.len() {
        let (field, what) = match target {
            RedisTarget::Sentinel(_) => ("sentinel_urls", "sentinels"),
            _ => ("cluster_urls", "seeds"),
        };
        let span = r
            .and_then(|r| match target {
                RedisTarget::Sentinel(_) => r.sentinel_urls.as_ref(),
                _ => r.cluster_urls.as_ref(),
            })
            .map(|s| s.span());
        c.push(span.as_ref(), None, format!("redis.{field} mixes redis:// and rediss:// {what}: they are reached one way, write every one with the same scheme"));
        ok = false;
    }
    let username = match r.and_then(|r| r.username.as_ref()) {
        None => None,
        Some(u)
            if u.get_ref().is_empty()
                || u.get_ref().chars().any(char::is_whitespace)
                || super::unprintable(u.get_ref()) =>
        {
            c.push(Some(&u.span()), None, format!("redis.username = \"{}\" is not an ACL user name: write one word, such as \"gateway\"", u.get_ref().escape_debug()));
            ok = false;
            None
        }
        Some(u) => Some(u.get_ref().clone()),
    };
    let password = redis_password(
        c,
        "redis.password",
        "the Redis password",
        r.and_then(|r| r.password_env.as_ref()),
        r.and_then(|r| r.password_file.as_ref()),
        config,
    )
    .unwrap_or_else(|()| {
        ok = false;
        None
    });
    let resolve = |p: &Spanned<String>| {
        let written = p.get_ref();
        config
            .parent()
            .map_or_else(|| PathBuf::from(written), |dir| dir.join(written))
    };
    let ca = r.and_then(|r| r.tls_ca_path.as_ref());
    let cert = r.and_then(|r| r.tls_cert_path.as_ref());
    let key = r.and_then(|r| r.tls_key_path.as_ref());
    if tls_urls == 0 {
        for (field, value) in [
            ("tls_ca_path", ca),
            ("tls_cert_path", cert),
            ("tls_key_path", key),
        ] {
            if let Some(v) = value {
                let url = match url_override {
                    Some(_) => format!("{REDIS_URL_ENV}, which overrides the file's Redis,"),
                    None => "the Redis URL".to_owned(),
                };
                c.push(Some(&v.span()), None, format!("redis.{field} is set but {url} is not rediss://: write rediss://host:port to use TLS, or remove {field}"));
                ok = false;
            }
        }
        return ok.then_some(RedisAccess {
            username,
            password,
            tls: None,
        });
    }
    let client = match (cert, key) {
        (Some(c), Some(k)) => Some((resolve(c), resolve(k))),
        (None, None) => None,
        (Some(one), None) | (None, Some(one)) => {
            c.push(Some(&one.span()), None, "redis.tls_cert_path and redis.tls_key_path go together: give both for a client certificate (mutual TLS), or neither".into());
            return None;
        }
    };
    let ca_path = ca.map(resolve);
    let tls = match crate::config::tls::RedisTls::load(
        ca_path.as_deref(),
        client.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
    ) {
        Ok(mut tls) => {
            tls.cert_written = cert
                .filter(|_| client.is_some())
                .map(|c| c.get_ref().clone());
            Some(tls)
        }
        Err(e) => {
            let (field, value, why) = match e {
                crate::config::tls::RedisTlsError::Ca(why) => ("tls_ca_path", ca, why),
                crate::config::tls::RedisTlsError::Cert(why) => ("tls_cert_path", cert, why),
                crate::config::tls::RedisTlsError::Key(why) => ("tls_key_path", key, why),
            };
            let written = value.map(|v| v.get_ref().as_str()).unwrap_or_default();
            c.push(
                value.map(|v| v.span()).as_ref(),
                None,
                format!("redis.{field} = \"{written}\" {why}"),
            );
            None
        }
    };
    (ok && tls.is_some()).then_some(RedisAccess {
        username,
        password,
        tls,
    })
}

/// Whether a URL says more than where to connect: a database (`/3`) or options (`?...`).
fn beyond_the_address(url: &str) -> bool {
    // Userinfo holds none of `/`, `?`, `#` unencoded: the first of them ends the address.
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    match rest.find(['/', '?', '#']) {
        None => false,
        Some(at) => !matches!(&rest[at..], "/" | "/0"),
    }
}

/// Whether the URL's address names no port (`redis://host`): `redis` has no port of its
/// own to the URL parser, so one is named exactly when it is written.
fn without_port(url: &str) -> bool {
    reqwest::Url::parse(url).is_ok_and(|u| u.port().is_none())
}

/// `SENTINEL_REDIS_URL`'s value as messages show it: a URL without its password, and
/// anything else not at all (a password pasted into the variable by mistake, say).
fn env_url_shown(value: &str) -> std::borrow::Cow<'_, str> {
    if crate::config::scheme_end(value).is_some() {
        redact_url(value)
    } else {
        "***".into()
    }
}

/// The form of a URL of one Redis, said when one is not a URL.
const SINGLE_FORM: &str =
    "redis://host:port/db (rediss:// for TLS; an IPv6 address in brackets: redis://[::1]:6379/0)";

/// `sentinel_urls`, `sentinel_master` and `sentinel_password_env`.
fn sentinel_target(
    c: &mut Collector,
    r: &crate::config::raw::RawRedis,
    config: &Path,
) -> Option<RedisTarget> {
    let urls = r.sentinel_urls.as_ref()?;
    let mut ok = true;
    if urls.get_ref().is_empty() || urls.get_ref().len() > 16 {
        c.push(
            Some(&urls.span()),
            None,
            "redis.sentinel_urls must list 1 to 16 sentinels, such as [\"redis://10.0.1.1:26379\"]"
                .into(),
        );
        ok = false;
    }
    repeated(c, "redis.sentinel_urls", urls.get_ref());
    let mut sentinels = Vec::new();
    for u in urls.get_ref() {
        let what = format!("redis.sentinel_urls entry \"{}\"", redact_url(u.get_ref()));
        match check_redis_url(
            c,
            Some(&u.span()),
            u.get_ref(),
            &what,
            Some("redis.sentinel_password"),
            "redis://host:port (rediss:// for TLS)",
        ) {
            Some(url) => {
                let why = if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
                    Some("a sentinel is reached as redis://host:port (rediss:// for TLS)")
                } else if beyond_the_address(&url) {
                    Some("a sentinel is reached as redis://host:port, with no database but 0 and no options (the master's database 0 holds the limits)")
                } else if without_port(&url) {
                    Some("name the sentinel's port, redis://host:26379 as a rule (without one, the URL means Redis's 6379)")
                } else {
                    None
                };
                match why {
                    None => sentinels.push(url),
                    Some(why) => {
                        c.push(Some(&u.span()), None, format!("{what}: {why}"));
                        ok = false;
                    }
                }
            }
            None => ok = false,
        }
    }
    let master = match &r.sentinel_master {
        None => {
            c.push(Some(&urls.span()), None, "redis.sentinel_urls needs redis.sentinel_master: the name the sentinels monitor the master under".into());
            None
        }
        Some(m)
            if m.get_ref().is_empty()
                || m.get_ref().chars().any(char::is_whitespace)
                || super::unprintable(m.get_ref()) =>
        {
            c.push(
                Some(&m.span()),
                None,
                format!(
                    "redis.sentinel_master = \"{}\" is not a master name",
                    m.get_ref().escape_debug()
                ),
            );
            None
        }
        Some(m) => Some(m.get_ref().clone()),
    };
    let password = redis_password(
        c,
        "redis.sentinel_password",
        "the sentinels' password",
        r.sentinel_password_env.as_ref(),
        r.sentinel_password_file.as_ref(),
        config,
    )
    .ok();
    let target = RedisTarget::Sentinel(crate::config::SentinelTarget {
        sentinels,
        master: master?,
        password: password?,
    });
    ok.then_some(target)
}

/// Warns of each URL of `list` written as an earlier one (letters' case aside): listed
/// twice, it is still one node asked (said by index: a URL may hold a user name).
fn repeated(c: &mut Collector, field: &str, list: &[Spanned<String>]) {
    for (i, j) in super::listed_again(list, |u| u.get_ref().trim().to_ascii_lowercase()) {
        c.warn(
            Some(&list[i].span()),
            None,
            format!(
                "{field}[{i}] is {field}[{j}] again: a node listed twice is still one; keep one"
            ),
        );
    }
}

/// Seed nodes of a Redis Cluster: 1 to 64 `redis://host:port` URLs, database 0 (a cluster
/// has no other).
fn cluster_urls(c: &mut Collector, seeds: &Spanned<Vec<Spanned<String>>>) -> Option<RedisTarget> {
    let list = seeds.get_ref();
    if list.is_empty() || list.len() > 64 {
        c.push(
            Some(&seeds.span()),
            None,
            format!(
                "redis.cluster_urls has {} entries: list 1 to 64 seed nodes, such as [\"redis://10.0.0.1:6379\"]",
                list.len()
            ),
        );
        return None;
    }
    repeated(c, "redis.cluster_urls", list);
    let mut ok = true;
    let mut urls = Vec::with_capacity(list.len());
    for seed in list {
        let text = seed.get_ref();
        let what = format!("redis.cluster_urls entry \"{}\"", redact_url(text));
        let Some(url) = check_redis_url(
            c,
            Some(&seed.span()),
            text,
            &what,
            Some("redis.password"),
            "redis://host:port (rediss:// for TLS)",
        ) else {
            ok = false;
            continue;
        };
        let info = redis::IntoConnectionInfo::into_connection_info(
            url.replacen("rediss://", "redis://", 1).as_str(),
        );
        match info {
            Ok(info) if !matches!(info.addr(), redis::ConnectionAddr::Tcp(..)) => {
                c.push(Some(&seed.span()), None, format!("{what} is not a TCP address: cluster nodes are reached as redis://host:port"));
                ok = false;
            }
            Ok(info) if info.redis_settings().db() != 0 => {
                c.push(
                    Some(&seed.span()),
                    None,
                    format!(
                        "{what} selects database {}: Redis Cluster has only database 0",
                        info.redis_settings().db()
                    ),
                );
                ok = false;
            }
            _ => urls.push(url),
        }
    }
    ok.then_some(RedisTarget::Cluster(urls))
}

/// A Redis URL named `what` (the URL in it already without its password). `in_file`: the
/// URL was written in the file, which must not hold a password (contract section 11): the
/// field to name instead. `form`: the URL's form, said when it is not one.
fn check_redis_url(
    c: &mut Collector,
    span: Option<&Range<usize>>,
    url: &str,
    what: &str,
    in_file: Option<&str>,
    form: &str,
) -> Option<String> {
    // rediss:// is parsed as its redis:// twin: the store makes the TLS handshake itself.
    let plain = match url.strip_prefix("rediss://") {
        Some(rest) => format!("redis://{rest}"),
        None => url.to_owned(),
    };
    // A password in the query (`?password=`, `?pass=`; the name percent-decoded, as the
    // client reads it): redis-rs reads one there only as a socket's `?pass=`, but it is a
    // secret written in the file all the same.
    let named = |wanted: &[&str]| {
        url.split_once('?').is_some_and(|(_, query)| {
            query.split('&').any(|pair| {
                let key = pair.split('=').next().unwrap_or_default();
                let key = percent_encoding::percent_decode_str(key).decode_utf8_lossy();
                wanted.iter().any(|w| key.eq_ignore_ascii_case(w))
            })
        })
    };
    let in_query = named(&["password", "pass"]);
    let socket = url.starts_with("unix://") || url.starts_with("redis+unix://");
    // What the client would not read: `?password=` anywhere, `?pass=` but in a socket's.
    let unread = named(&["password"]) || (!socket && named(&["pass"]));
    match redis::Client::open(plain.as_str()) {
        Ok(client)
            if in_file.is_some()
                && (in_query
                    || client
                        .get_connection_info()
                        .redis_settings()
                        .password()
                        .is_some()) =>
        {
            c.push(
                span,
                None,
                format!(
                    "{what} holds a password, which the file must not: put it in an environment variable named in {field}_env, or in a file of its own named in {field}_file (the user name may stay in the URL)",
                    field = in_file.unwrap_or_default()
                ),
            );
            None
        }
        // `SENTINEL_REDIS_URL` may carry a password, but one the client does not read in
        // the query would have Redis answer every call `NOAUTH`: said now, not at the first.
        // Redis numbers its databases from 0, and takes an index that fits 32 bits: another
        // is refused at every decision.
        Ok(client)
            if i32::try_from(client.get_connection_info().redis_settings().db())
                .map_or(true, |db| db < 0) =>
        {
            c.push(
                span,
                None,
                format!(
                    "{what} selects database {}: Redis numbers its databases from 0 (the path's /0, /1, ... up to the server's `databases` less one)",
                    client.get_connection_info().redis_settings().db()
                ),
            );
            None
        }
        // The client reads a database in the query of a socket's URL only: in a TCP one it
        // would be passed over, and the buckets kept in database 0.
        Ok(_) if !socket && named(&["db"]) => {
            c.push(
                span,
                None,
                format!(
                    "{what}: a database in the query is not read by the Redis client (only a unix:// URL's ?db= is); write it as the path, redis://host:port/2"
                ),
            );
            None
        }
        Ok(_) if unread => {
            c.push(
                span,
                None,
                format!(
                    "{what}: a password in the query is not read by the Redis client (only ?pass= in a unix:// URL is); write it before the host, redis://user:password@host:port"
                ),
            );
            None
        }
        Ok(_)
            if url.starts_with("redis://")
                || url.starts_with("rediss://")
                || url.starts_with("redis+unix://")
                || url.starts_with("unix://") =>
        {
            Some(url.to_owned())
        }
        Ok(_) => {
            c.push(
                span,
                None,
                format!("{what} is not supported: use a redis://, rediss:// or unix:// URL"),
            );
            None
        }
        Err(e) => {
            c.push(
                span,
                None,
                format!("{what} is not a Redis URL ({e}): write {form}"),
            );
            None
        }
    }
}

pub(super) fn breaker(c: &mut Collector, raw: &RawConfig) -> Option<BreakerConfig> {
    let b = raw.breaker.as_ref().map(|b| b.get_ref());
    let threshold = int_in(
        c,
        None,
        "breaker.failure_threshold",
        b.and_then(|b| b.failure_threshold.as_ref()),
        5,
        (1, 1_000_000),
        "",
    );
    let open = int_in(
        c,
        None,
        "breaker.open_seconds",
        b.and_then(|b| b.open_seconds.as_ref()),
        30,
        (1, 3600),
        " seconds",
    );
    Some(BreakerConfig {
        failure_threshold: NonZeroU32::new(threshold? as u32)?,
        open_for: Duration::from_secs(open?),
    })
}

/// Whether `value`, written for `auth.jwt.<field>`, is one a token's claim can hold: not
/// empty, no control character nor one that turns the text's direction (said when not).
/// `alone`: the field's whole value, not one of a list's.
fn claim_value(
    c: &mut Collector,
    field: &str,
    value: &str,
    at: &Range<usize>,
    alone: bool,
) -> bool {
    let problem = if value.is_empty() {
        match alone {
            true => "is empty: leave it out, or give a value".to_owned(),
            false => "holds an empty value: leave it out, or give a value".to_owned(),
        }
    } else if super::unprintable(value) {
        format!("= \"{}\" holds a control character or one that turns the text's direction: no token's claim is written so", value.escape_debug())
    } else {
        return true;
    };
    c.push(Some(at), None, format!("auth.jwt.{field} {problem}"));
    false
}

/// `auth.jwt.<field>` written as a string or a list of them, each a claim's possible value
/// (a claim's may be a boolean, `email_verified = true`, kept as its text; an issuer's not).
fn claim_values(c: &mut Collector, field: &str, v: &Spanned<toml::Value>) -> Option<Vec<String>> {
    let (example, booleans) = match field {
        "issuer" => (
            "\"https://idp.example/\" or [\"https://idp.example/\", \"idp.example\"]",
            "",
        ),
        _ => ("\"access\" or [\"app-a\", \"app-b\"]", ", a boolean"),
    };
    let one = |v: &toml::Value| match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Boolean(b) if field != "issuer" => Some(b.to_string()),
        _ => None,
    };
    let (values, alone) = match v.get_ref() {
        toml::Value::Array(a) if !a.is_empty() => (a.iter().map(one).collect(), false),
        toml::Value::Array(_) => (None, false),
        single => (one(single).map(|s| vec![s]), true),
    };
    let Some(values) = values else {
        c.push(Some(&v.span()), None, format!("auth.jwt.{field} must be a string{booleans} or a non-empty list of them, such as {example}"));
        return None;
    };
    let mut ok = true;
    for value in &values {
        ok &= claim_value(c, field, value, &v.span(), alone);
    }
    ok.then_some(values)
}

/// A shared JWT secret holds at least this many different bytes.
const MIN_JWT_SECRET_DISTINCT: usize = 8;

/// How many different byte values `bytes` holds.
fn distinct_bytes(bytes: &[u8]) -> usize {
    let mut seen = [false; 256];
    bytes.iter().for_each(|b| seen[*b as usize] = true);
    seen.iter().filter(|s| **s).count()
}

/// `auth.jwt.required_claims`, in the file's order (the table is read sorted by name): each
/// claim with its values. The claims other fields check (`iss`, `aud`) or the clock does are
/// refused here.
fn required_claims(
    c: &mut Collector,
    j: &crate::config::raw::RawJwt,
) -> Vec<(String, Vec<String>)> {
    let mut written: Vec<_> = j.required_claims.iter().flat_map(|t| t.get_ref()).collect();
    written.sort_by_key(|(_, v)| v.span().start);
    let mut required = Vec::new();
    for (name, value) in written {
        let field = format!("required_claims.{}", super::shape::key_shown(name));
        let own = match name.as_str() {
            "iss" => Some("by auth.jwt.issuer"),
            "aud" => Some("by auth.jwt.audiences"),
            "exp" | "nbf" | "iat" => Some("against the clock, with auth.jwt.leeway_seconds"),
            _ => None,
        };
        if let Some(own) = own {
            c.push(
                Some(&value.span()),
                None,
                format!("auth.jwt.{field} is checked {own}, not here"),
            );
        } else if name.is_empty() {
            c.push(
                Some(&value.span()),
                None,
                "auth.jwt.required_claims names an empty claim".into(),
            );
        } else if let Some(values) = claim_values(c, &field, value) {
            required.push((name.clone(), values));
        }
    }
    required
}

pub(super) fn jwt(c: &mut Collector, raw: &RawConfig, config: &Path) -> Option<JwtConfig> {
    let spanned = raw.auth.as_ref()?.get_ref().jwt.as_ref()?;
    let j = spanned.get_ref();
    let secret_env = j
        .secret_env
        .as_ref()
        .map_or("SENTINEL_JWT_SECRET".to_owned(), |s| s.get_ref().clone());
    let accepted = JWT_ALGORITHMS.join(", ");
    let mut algorithms = vec!["HS256".to_owned()];
    if let Some(a) = j.algorithms.as_ref() {
        for alg in a.get_ref() {
            if !JWT_ALGORITHMS.contains(&alg.as_str()) {
                c.push(Some(&a.span()), None, format!("auth.jwt.algorithms: \"{alg}\" is not accepted: use a subset of {accepted}"));
            }
        }
        if a.get_ref().is_empty() {
            c.push(
                Some(&a.span()),
                None,
                format!("auth.jwt.algorithms is empty: use a subset of {accepted}"),
            );
        }
        for (i, j) in super::listed_again(a.get_ref(), String::clone) {
            let alg = &a.get_ref()[i];
            c.warn(Some(&a.span()), None, format!("auth.jwt.algorithms[{i}] = \"{alg}\" is listed already as auth.jwt.algorithms[{j}]: keep one"));
        }
        // Those not accepted are said above, once: the checks below look at the rest.
        algorithms = (a.get_ref().iter())
            .filter(|alg| JWT_ALGORITHMS.contains(&alg.as_str()))
            .cloned()
            .collect();
    }
    let symmetric = algorithms.iter().any(|a| a.starts_with("HS"));
    let asymmetric = algorithms.iter().any(|a| !a.starts_with("HS"));
    let used = raw.routes.iter().any(|r| {
        matches!(r.get_ref().identity.as_ref().map(|i| i.get_ref()), Some(RawIdentity::Named(n)) if n == "jwt")
    });
    if !used {
        c.warn(Some(&spanned.span()), None, "[auth.jwt] is set but no route has identity = \"jwt\": its secret and keys are not checked until one does".into());
    }
    // Said whether or not the secret is read now (no HS* algorithm, no jwt route yet).
    let both = j.secret_env.is_some() && j.secret_file.is_some();
    if both && !(used && symmetric) {
        let _ = super::secret(
            c,
            "auth.jwt.secret",
            j.secret_env.as_ref(),
            j.secret_file.as_ref(),
            None,
            config,
        );
    }
    let secret = if used && symmetric {
        let read = super::secret(
            c,
            "auth.jwt.secret",
            j.secret_env.as_ref(),
            j.secret_file.as_ref(),
            Some((secret_env.as_str(), spanned.span())),
            config,
        );
        match read {
            Err(()) | Ok(None) => None,
            Ok(Some(read)) => {
                let (field, from, span) = (&read.field, &read.from, Some(&read.span));
                match read.value {
                    None => {
                        c.push(span, None, format!("{field}: {from} is not set: set it to a shared secret of at least {MIN_JWT_SECRET_BYTES} bytes"));
                        None
                    }
                    Some(v) if v.len() < MIN_JWT_SECRET_BYTES => {
                        c.push(span, None, format!("{field}: {from} holds {} bytes: the secret must be at least {MIN_JWT_SECRET_BYTES} bytes", v.len()));
                        None
                    }
                    // 32 spaces or zeros are 32 bytes, and no secret: anyone guesses them.
                    Some(v) if distinct_bytes(&v) < MIN_JWT_SECRET_DISTINCT => {
                        c.push(span, None, format!("{field}: {from} holds {} different bytes: a secret of so few is guessed; write a random one (`openssl rand -base64 48`)", distinct_bytes(&v)));
                        None
                    }
                    Some(v) => Some(Secret(Arc::from(v.as_slice()))),
                }
            }
        }
    } else {
        None
    };
    let jwks_path = j.jwks_path.as_ref().map(|p| {
        config
            .parent()
            .map_or_else(|| PathBuf::from(p.get_ref()), |dir| dir.join(p.get_ref()))
    });
    let jwks_url = match (&j.jwks_url, &j.jwks_path) {
        (Some(u), Some(_)) => {
            c.push(Some(&u.span()), None, "auth.jwt.jwks_url and auth.jwt.jwks_path are both set: keep one (a file, or the identity provider's URL)".into());
            None
        }
        (Some(u), None) => {
            let text = u.get_ref();
            let usable = reqwest::Url::parse(text)
                .ok()
                .is_some_and(|url| crate::remote_jwks::usable_url(&url));
            if !usable {
                c.push(Some(&u.span()), None, format!("auth.jwt.jwks_url = \"{}\" is not usable: give an https:// URL (http:// only to a loopback address)", crate::remote_jwks::shown(text)));
                None
            } else {
                Some(text.clone())
            }
        }
        (None, _) => None,
    };
    let jwks_refresh = int_in(
        c,
        None,
        "auth.jwt.jwks_refresh_seconds",
        j.jwks_refresh_seconds.as_ref(),
        300,
        (10, 86_400),
        " seconds",
    );
    let jwks = match (&j.jwks_path, &jwks_path) {
        _ if j.jwks_url.is_some() => None,
        (Some(p), Some(file)) => match super::super::jwks::load(file, &algorithms) {
            Ok((set, warnings)) => {
                c.warnings.extend(warnings);
                Some(Arc::new(set))
            }
            Err(errors) => {
                if errors
                    .iter()
                    .all(|e| e.position.is_none() && e.route.is_none())
                {
                    c.push(
                        Some(&p.span()),
                        None,
                        format!(
                            "auth.jwt.jwks_path = \"{}\": {}",
                            p.get_ref(),
                            errors[0].message
                        ),
                    );
                } else {
                    c.errors.extend(errors);
                }
                None
            }
        },
        _ if asymmetric => {
            let at = j.algorithms.as_ref().map_or(spanned.span(), |a| a.span());
            c.push(
                Some(&at),
                None,
                format!(
                    "auth.jwt.algorithms lists {} but neither jwks_path nor jwks_url gives their public keys",
                    algorithms
                        .iter()
                        .filter(|a| !a.starts_with("HS"))
                        .cloned()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
            None
        }
        _ => None,
    };
    let text = |field: &str, v: &Spanned<String>, c: &mut Collector| {
        claim_value(c, field, v.get_ref(), &v.span(), true).then(|| v.get_ref().clone())
    };
    let issuer = match &j.issuer {
        None => Some(Vec::new()),
        Some(i) => claim_values(c, "issuer", i),
    };
    let required_claims = required_claims(c, j);
    let mut audiences = Vec::new();
    if let Some(a) = &j.audiences {
        if a.get_ref().is_empty()
            || a.get_ref()
                .iter()
                .any(|a| a.is_empty() || super::unprintable(a))
        {
            c.push(
                Some(&a.span()),
                None,
                "auth.jwt.audiences must list non-empty audiences without control characters: leave it out to accept any"
                    .into(),
            );
        }
        for (i, j) in super::listed_again(a.get_ref(), String::clone) {
            c.warn(Some(&a.span()), None, format!("auth.jwt.audiences[{i}] is listed already as auth.jwt.audiences[{j}]: keep one"));
        }
        audiences = a.get_ref().clone();
    }
    let leeway = int_in(
        c,
        None,
        "auth.jwt.leeway_seconds",
        j.leeway_seconds.as_ref(),
        30,
        (0, 3600),
        " seconds",
    );
    let identity_claim = match &j.identity_claim {
        None => Some("sub".to_owned()),
        Some(claim) => text("identity_claim", claim, c),
    };
    Some(JwtConfig {
        secret_env,
        algorithms,
        secret,
        jwks,
        jwks_path,
        jwks_url,
        jwks_refresh: Duration::from_secs(jwks_refresh?),
        issuer: issuer?,
        audiences,
        required_claims,
        leeway_secs: leeway?,
        identity_claim: identity_claim?,
    })
}

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
            let path = h.path.get_ref();
            let path_ok = path.starts_with('/') && path.parse::<http::Uri>().is_ok();
            if !path_ok {
                c.push(
                    Some(&h.path.span()),
                    None,
                    format!(
                        "{}.path = \"{path}\" is not a path: write one such as \"/healthz\"",
                        field("health_check")
                    ),
                );
            }
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
                (true, Some(i), Some(t), Some(u), Some(h)) => Some(Some(HealthCheck {
                    path: path.clone(),
                    interval: Duration::from_millis(i),
                    timeout: Duration::from_millis(t),
                    unhealthy_after: u as u32,
                    healthy_after: h as u32,
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
        name: name.to_owned(),
        addrs,
        hosts,
        connect_timeout: Duration::from_millis(connect?),
        read_timeout: Duration::from_millis(read?),
        tls: tls?,
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

#[cfg(test)]
mod tests {
    use super::{as_ipv4, overlap};

    #[test]
    fn a_mapped_network_is_the_ipv4_network_it_names() {
        let v4 = |t: &str| as_ipv4(t.parse().unwrap()).to_string();
        assert_eq!(v4("::ffff:127.0.0.3/128"), "127.0.0.3/32");
        assert_eq!(v4("::ffff:127.0.4.0/120"), "127.0.4.0/24");
        assert_eq!(v4("::ffff:0.0.0.0/96"), "0.0.0.0/0");
        // Wider than the mapped block, or not mapped: as written.
        assert_eq!(v4("::/0"), "::/0");
        assert_eq!(v4("2001:db8::/32"), "2001:db8::/32");
        assert_eq!(v4("10.0.0.0/8"), "10.0.0.0/8");
    }

    #[test]
    fn listeners_that_cannot_both_be_bound() {
        let o = |a: &str, b: &str| overlap(a.parse().unwrap(), b.parse().unwrap());
        assert!(o("127.0.0.1:80", "127.0.0.1:80"));
        assert!(o("0.0.0.0:80", "127.0.0.1:80"));
        assert!(o("127.0.0.1:80", "0.0.0.0:80"));
        assert!(
            !o("[::]:80", "0.0.0.0:80"),
            "[::] is bound IPv6 only beside an IPv4 listener of its port"
        );
        assert!(o("[::1]:80", "[::]:80"));
        assert!(
            o("[::ffff:127.0.0.1]:80", "127.0.0.1:80"),
            "a mapped address is IPv4"
        );
        assert!(!o("0.0.0.0:80", "[::1]:80"), "0.0.0.0 takes no IPv6");
        assert!(!o("127.0.0.1:80", "127.0.0.2:80"));
        assert!(!o("0.0.0.0:80", "0.0.0.0:81"));
    }
}
