//! `[server]`: listeners, trusted proxies, request ids, limits of the connection layer, and
//! `[auth.api_keys]`.

use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use toml::Spanned;

use super::int_in;
use crate::config::error::Collector;
use crate::config::raw::{OneOrMany, RawConfig};
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
    let h2_max_streams = int_in(
        c,
        None,
        "server.h2_max_concurrent_streams",
        s.and_then(|s| s.h2_max_concurrent_streams.as_ref()),
        100,
        (1, 10_000),
        " streams",
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
        h2_max_streams: h2_max_streams? as u32,
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
