//! Path normalization and route matching on arbitrary request targets.
//!
//! Checks, for every input: no panic; a normalized path is absolute, a fixed point of
//! normalization, free of `.`/`..`/empty segments and of encoded separators; and matching
//! it finds the same route as matching its normal form again.

#![no_main]

use http::Method;
use libfuzzer_sys::fuzz_target;
use sentinel_gateway::routing::{normalize_path, Matcher, PathMatch, RouteTable};

fn table() -> RouteTable<&'static str> {
    let prefix = |p: &str| PathMatch::Prefix(p.to_owned());
    let m = |path, host: Option<&str>, methods: Option<Vec<Method>>| Matcher {
        path,
        host: host.map(str::to_owned),
        methods,
    };
    RouteTable::new([
        (m(prefix("/"), None, None), "root"),
        (m(prefix("/api"), None, None), "api"),
        (
            m(prefix("/api/v1"), None, Some(vec![Method::POST])),
            "api-post",
        ),
        (
            m(PathMatch::Exact("/api/v1/login".into()), None, None),
            "login",
        ),
        (m(prefix("/api"), Some("h.example"), None), "host"),
    ])
}

fuzz_target!(|data: &[u8]| {
    let Ok(raw) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(normal) = normalize_path(raw) else {
        return;
    };
    assert!(normal.starts_with('/'), "{raw:?} -> {normal:?}");
    assert_eq!(
        normalize_path(&normal).as_deref(),
        Ok(normal.as_str()),
        "{raw:?}"
    );
    let lower = normal.to_ascii_lowercase();
    assert!(!lower.contains("%2f") && !lower.contains("%5c") && !lower.contains("%00"));
    for seg in normal.trim_end_matches('/').split('/').skip(1) {
        assert!(
            !seg.is_empty() && seg != "." && seg != "..",
            "{raw:?} -> {normal:?}"
        );
    }
    let table = table();
    for method in [Method::GET, Method::POST] {
        for host in [None, Some("h.example")] {
            let first = table.find(host, &method, &normal);
            assert!(first.is_some(), "the root prefix matches everything");
            assert_eq!(
                first,
                table.find(host, &method, &normalize_path(&normal).unwrap())
            );
        }
    }
});
