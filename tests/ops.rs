//! The operator's kit stays true to the metrics: the alert rules pass `promtool test rules`,
//! and the alerts and the Grafana dashboard only name metrics the gateway exports.

use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `sentinel_*` metric name the gateway registers.
fn exported() -> Vec<String> {
    let metrics = sentinel_gateway::metrics::Metrics::new();
    // Labelled families appear once they have a series, as they do for each endpoint.
    let _endpoint = metrics.endpoint(
        "any",
        sentinel_gateway::config::FailMode::FailOpen,
        sentinel_gateway::config::Enforcement::Shadow,
        &["default"],
        true,
    );
    metrics.tls_certs([("tls/default.pem", 0)]);
    metrics.jwks_keys.with_label_values::<&str>(&[]).set(0);
    metrics
        .registry
        .gather()
        .iter()
        .map(|f| f.name().to_owned())
        .collect()
}

fn names_in(text: &str) -> Vec<String> {
    let mut names: Vec<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("sentinel_"))
        .map(|w| {
            w.trim_end_matches("_bucket")
                .trim_end_matches("_count")
                .trim_end_matches("_sum")
                .to_owned()
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn alert_rules_pass_promtool() {
    let out = Command::new("promtool")
        .args(["test", "rules"])
        .arg(root().join("docs/alerts.test.yml"))
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run promtool ({e}): install it with `apt-get install -y prometheus`")
        });
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn alerts_and_dashboard_name_only_exported_metrics() {
    let exported = exported();
    let alerts = std::fs::read_to_string(root().join("docs/alerts.yml")).unwrap();
    let dashboard = std::fs::read_to_string(root().join("docs/grafana-dashboard.json")).unwrap();
    let parsed: serde_json::Value =
        serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    assert!(parsed["panels"].as_array().is_some_and(|p| p.len() >= 6));
    for (file, text) in [("alerts", &alerts), ("dashboard", &dashboard)] {
        for name in names_in(text) {
            assert!(
                exported.contains(&name),
                "{file} names {name}, which the gateway does not export"
            );
        }
    }
    for must in [
        "sentinel_decisions_total",
        "sentinel_degraded_decisions_total",
        "sentinel_breaker_state",
        "sentinel_redis_duration_seconds",
        "sentinel_requests_total",
    ] {
        assert!(
            names_in(&dashboard).contains(&must.to_owned()),
            "the dashboard lacks {must}"
        );
    }
}
