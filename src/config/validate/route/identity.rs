//! A route's `identity`: whom its limit counts.

use super::*;

/// Headers that carry a client's address as a proxy wrote it, or as the client did: an
/// identity read from one is the client's own choice (`client_ip` reads them past the
/// trusted proxies).
pub(crate) const ADDRESS_HEADERS: [&str; 3] = ["x-forwarded-for", "forwarded", "x-real-ip"];

pub(crate) fn identity(
    c: &mut Collector,
    label: Option<&str>,
    route: &Spanned<RawRoute>,
    limited: bool,
    raw: &RawConfig,
) -> Option<IdentitySource> {
    let r = route.get_ref();
    let Some(spanned) = &r.identity else {
        if limited {
            let at = r.endpoint_id.as_ref().map_or(route.span(), |v| v.span());
            c.push(Some(&at), label, "identity is required for a limited route: use \"jwt\", \"api_key\", \"client_ip\", \"global\" or { header = \"X-API-Key\" }".into());
            return None;
        }
        return Some(IdentitySource::Global);
    };
    let span = spanned.span();
    match spanned.get_ref() {
        RawIdentity::Named(n) if n == "global" => Some(IdentitySource::Global),
        RawIdentity::Named(n) if n == "client_ip" => Some(IdentitySource::ClientIp),
        RawIdentity::Named(n) if n == "jwt" => {
            if raw
                .auth
                .as_ref()
                .and_then(|a| a.get_ref().jwt.as_ref())
                .is_none()
            {
                c.push(
                    Some(&span),
                    label,
                    "identity = \"jwt\" needs an [auth.jwt] section".into(),
                );
                return None;
            }
            Some(IdentitySource::Jwt)
        }
        RawIdentity::Named(n) if n == "api_key" => {
            if raw
                .auth
                .as_ref()
                .and_then(|a| a.get_ref().api_keys.as_ref())
                .is_none()
            {
                c.push(
                    Some(&span),
                    label,
                    "identity = \"api_key\" needs an [auth.api_keys] section".into(),
                );
                return None;
            }
            Some(IdentitySource::ApiKey)
        }
        RawIdentity::Named(n) => {
            c.push(Some(&span), label, format!("identity = \"{n}\" is unknown: use \"jwt\", \"api_key\", \"client_ip\", \"global\" or {{ header = \"X-API-Key\" }}"));
            None
        }
        RawIdentity::Header { header } => match http::HeaderName::from_bytes(header.as_bytes()) {
            Ok(name) if super::super::sections::is_the_gateways_caller_header(name.as_str()) => {
                c.push(
                    Some(&span),
                    label,
                    format!(
                        "identity = {{ header = \"{header}\" }} {}",
                        super::super::sections::CALLER_HEADER_TAKEN
                    ),
                );
                None
            }
            Ok(name) => {
                if ADDRESS_HEADERS.contains(&name.as_str()) {
                    c.warn(Some(&span), label, format!("identity = {{ header = \"{header}\" }}: the client writes this header itself, so every value it makes up is a bucket of its own; for the client's address behind a load balancer use identity = \"client_ip\" with [server] trusted_proxies, which reads X-Forwarded-For from the right, past your proxies"));
                }
                Some(IdentitySource::Header(name.as_str().to_owned()))
            }
            Err(_) => {
                c.push(
                    Some(&span),
                    label,
                    format!("identity = {{ header = \"{header}\" }} is not a header name: use letters, digits and '-', such as \"X-API-Key\""),
                );
                None
            }
        },
    }
}
