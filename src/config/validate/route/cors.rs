//! `cors_origins`: the origins a route answers browsers for, kept as a browser writes them.

use super::*;

/// `cors_origins`: `["*"]`, or origins as a browser writes them in `Origin`: `http` or
/// `https`, `://`, a host and perhaps a port, nothing after (`https://app.example.com`).
/// `None`: an error was said.
pub(crate) fn cors_origins(
    c: &mut Collector,
    label: Option<&str>,
    r: &RawRoute,
) -> Option<Option<CorsOrigins>> {
    let Some(list) = &r.cors_origins else {
        return Some(None);
    };
    if list.get_ref().is_empty() {
        c.push(Some(&list.span()), label, "cors_origins is empty: list the origins whose scripts may read the answers (\"https://app.example.com\"), or [\"*\"] for any, or leave it out".into());
        return None;
    }
    let any = list.get_ref().iter().any(|o| o.get_ref() == "*");
    if any {
        if list.get_ref().len() > 1 {
            c.push(Some(&list.span()), label, "cors_origins holds \"*\" beside other origins: \"*\" is every origin; write it alone, or list the origins".into());
            return None;
        }
        return Some(Some(CorsOrigins::Any));
    }
    let before = c.errors.len();
    let mut origins: Vec<String> = Vec::new();
    for (i, o) in list.get_ref().iter().enumerate() {
        let written = o.get_ref();
        match origin(written) {
            Ok(origin) if origins.contains(&origin) => c.warn(Some(&o.span()), label, format!("cors_origins[{i}] = \"{written}\" is listed already: keep one")),
            Ok(origin) => origins.push(origin),
            Err(why) => c.push(Some(&o.span()), label, format!("cors_origins[{i}] = \"{}\" is not an origin as a browser sends it: {why} (such as \"https://app.example.com\" or \"http://localhost:3000\")", crate::config::redact_url_and_query(written))),
        }
    }
    (c.errors.len() == before).then_some(Some(CorsOrigins::Listed(origins)))
}

/// An origin as a browser serializes it: `scheme://host[:port]`, lower-case, without the
/// scheme's default port.
pub(crate) fn origin(written: &str) -> Result<String, &'static str> {
    let (scheme, rest) = written
        .split_once("://")
        .ok_or("no scheme (http:// or https://)")?;
    let scheme = scheme.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "http" => "80",
        "https" => "443",
        _ => return Err("its scheme is not http or https"),
    };
    if rest.contains(['/', '?', '#']) {
        return Err("an origin has no path, query or fragment (nor a trailing /)");
    }
    if rest.contains('@') {
        return Err("an origin has no user or password");
    }
    let (host, port) = match rest.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, Some(port)),
        _ => (rest, None),
    };
    // As a browser serializes the host (the URL standard): an IPv6 address compressed and
    // in lower case, an IPv4 address in its four decimal parts, a name's labels whole.
    let host = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => match v6.parse::<std::net::Ipv6Addr>() {
            Ok(a) if a.to_ipv4_mapped().is_some() => {
                return Err("an IPv4-mapped IPv6 host: write the IPv4 address itself");
            }
            Ok(a) => format!("[{a}]"),
            Err(_) => return Err("its host is not a host name or an address"),
        },
        None => {
            let labels_ok = !host.is_empty()
                && (host.bytes()).all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
                && host
                    .split('.')
                    .all(|l| !l.is_empty() && !l.starts_with('-') && !l.ends_with('-'));
            // A last label of digits is an IPv4 address's (`1.2.3` and `0x7f.0.0.1` are
            // written otherwise by a browser).
            let numeric = host
                .rsplit('.')
                .next()
                .is_some_and(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()));
            if !labels_ok || (numeric && host.parse::<std::net::Ipv4Addr>().is_err()) {
                return Err("its host is not a host name or an address");
            }
            host.to_ascii_lowercase()
        }
    };
    let port = match port {
        None => None,
        Some(p) if p == default_port => None,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 && !p.starts_with('0') && p.bytes().all(|b| b.is_ascii_digit()) => {
                Some(p)
            }
            _ => return Err("its port is not a number from 1 to 65535"),
        },
    };
    Ok(match port {
        Some(p) => format!("{scheme}://{host}:{p}"),
        None => format!("{scheme}://{host}"),
    })
}

#[cfg(test)]
mod tests {
    use super::super::origin;

    #[test]
    fn an_origin_is_kept_as_a_browser_writes_it() {
        let o = |w: &str| origin(w).unwrap();
        assert_eq!(o("HTTPS://App.Example.com:443"), "https://app.example.com");
        assert_eq!(o("http://localhost:80"), "http://localhost");
        assert_eq!(o("http://localhost:3000"), "http://localhost:3000");
        assert_eq!(o("https://[0:0::1]:3000"), "https://[::1]:3000");
        assert_eq!(o("https://[2001:DB8::A]"), "https://[2001:db8::a]");
        assert_eq!(o("https://127.0.0.1:8443"), "https://127.0.0.1:8443");
        for wrong in [
            "https://0x7f.0.0.1",
            "https://01.2.3.4",
            "https://a-.example",
            "https://x:0",
        ] {
            assert!(origin(wrong).is_err(), "{wrong}");
        }
    }
}
