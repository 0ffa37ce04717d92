//! Raw config -> domain config. Every problem is collected, never just the first.
//!
//! `sections.rs` checks `[server]`, `[redis]`, `[breaker]`, `[auth.jwt]` and `[upstreams]`;
//! `route.rs` checks each `[[routes]]` entry and the rules between routes.

mod route;
mod sections;
mod tls;

use std::path::Path;
use std::sync::Arc;

use toml::Spanned;

use super::error::{Collector, ConfigErrors};
use super::raw::RawConfig;
use super::*;
use crate::routing;

pub fn validate(
    path: &Path,
    source: &str,
    redis_url_override: Option<&str>,
) -> Result<Config, ConfigErrors> {
    let mut c = Collector::new(path, source);
    let raw: RawConfig = match toml::from_str(source) {
        Ok(raw) => raw,
        Err(e) => {
            let route = e.span().and_then(|s| route_at(source, s.start));
            let message = e.message().trim().to_owned();
            c.push(e.span().as_ref(), route.as_deref(), message);
            return Err(ConfigErrors(c.errors));
        }
    };

    let server = sections::server(&mut c, &raw, path);
    let redis = sections::redis(&mut c, &raw, redis_url_override, path);
    let breaker = sections::breaker(&mut c, &raw);
    let jwt = sections::jwt(&mut c, &raw, path);
    let access_log = sections::access_log(&mut c, &raw, path);
    let api_keys = sections::api_keys(&mut c, &raw, path);
    let upstreams: BTreeMap<String, Arc<UpstreamConfig>> = raw
        .upstreams
        .iter()
        .filter_map(|(name, up)| {
            sections::upstream(&mut c, name, up, path).map(|u| (name.clone(), Arc::new(u)))
        })
        .collect();
    let mut routes = Vec::new();
    for (index, r) in raw.routes.iter().enumerate() {
        let server_body = server.as_ref().and_then(|s| s.max_body_bytes);
        if let Some(route) = route::route(&mut c, index, r, &raw, &upstreams, server_body) {
            routes.push((r.span(), route));
        }
    }
    route::shared_endpoints(&mut c, &routes);
    for conflict in routing::ambiguities(routes.iter().map(|(_, r)| (r.matcher(), r))) {
        let (a, b) = conflict;
        let span = routes
            .iter()
            .find(|(_, r)| r.index == b.index)
            .map(|(s, _)| s);
        c.push(
            span,
            Some(&route_label(b.index, b.policy.endpoint_id.as_str())),
            format!(
                "matches the same requests as {} with equal specificity: give one of them a \
                 host, methods or a more specific path",
                route_label(a.index, a.policy.endpoint_id.as_str())
            ),
        );
    }

    if !c.errors.is_empty() {
        return Err(ConfigErrors(c.errors));
    }
    Ok(Config {
        source: path.to_path_buf(),
        server: server.expect("no errors means a server section"),
        redis: redis.expect("no errors means a redis section"),
        breaker: breaker.expect("no errors means a breaker section"),
        jwt,
        api_keys,
        access_log,
        upstreams,
        routes: routes.into_iter().map(|(_, r)| r).collect(),
    })
}

pub(super) fn route_label(index: usize, endpoint_id: &str) -> String {
    format!("routes[{index}] ({endpoint_id})")
}

/// Names the route whose table holds byte `offset`, for parse errors inside a route.
fn route_at(source: &str, offset: usize) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Loose {
        #[serde(default)]
        routes: Vec<Spanned<toml::Table>>,
    }
    let loose: Loose = toml::from_str(source).ok()?;
    let header_starts: Vec<usize> = source
        .match_indices("[[routes]]")
        .map(|(i, _)| i)
        .filter(|&i| i == 0 || source.as_bytes()[i - 1] == b'\n')
        .collect();
    let index = header_starts.iter().rposition(|&start| start <= offset)?;
    let id = loose
        .routes
        .get(index)
        .and_then(|t| t.get_ref().get("endpoint_id")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned());
    Some(route_label(index, &id))
}

/// Reads an optional integer within `lo..=hi`, naming the field and the valid range.
pub(super) fn int_in(
    c: &mut Collector,
    route: Option<&str>,
    field: &str,
    value: Option<&Spanned<i64>>,
    default: i64,
    (lo, hi): (i64, i64),
    unit: &str,
) -> Option<u64> {
    let Some(v) = value else {
        return Some(default as u64);
    };
    let n = *v.get_ref();
    if n < lo || n > hi {
        c.push(
            Some(&v.span()),
            route,
            format!("{field} = {n} is out of range: it must be between {lo} and {hi}{unit}"),
        );
        return None;
    }
    Some(n as u64)
}
