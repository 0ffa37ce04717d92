//! Tiers against the real binary and a real redis-server: the key file's `tier` picks the
//! limits on the caller's own identity, `default_tier` stands for callers without one (or
//! with one not listed), an `unlimited` tier makes no Redis call, ceilings apply to every
//! tier, and tiers never share a bucket.

mod common;

use common::config::{quoted, GatewayConfig, Route};
use common::{blocking_get, client, Redis, Upstream};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn entry(key: &str, tenant: &str, tier: Option<&str>) -> String {
    let sha = hex::encode(Sha256::digest(key.as_bytes()));
    let tier = tier.map_or(String::new(), |t| format!("tier = \"{t}\"\n"));
    format!("[[keys]]\nsha256 = \"{sha}\"\ntenant = \"{tenant}\"\n{tier}")
}

/// free (the route's own): burst 2; pro: burst 4; internal: unlimited; a ceiling of 9 a
/// minute for everyone.
fn tiered() -> Route {
    Route::new("t.ocr")
        .prefix("/ocr")
        .identity("api_key")
        .fail_closed()
        .set("tier_from", quoted("api_key"))
        .set("default_tier", quoted("free"))
        .bucket_limit("burst", 2, 0)
        .limit(
            "backend",
            "identity = \"global\"\nalgorithm = \"sliding_window\"\nlimit = 9\nwindow_size_micro = 60_000_000",
        )
}

const TIERS: &str = "
[[routes.tiers.pro.limits]]
name = \"burst\"
algorithm = \"token_bucket\"
capacity_micro = 4_000_000
refill_rate_micro_per_sec = 0

[routes.tiers.internal]
unlimited = true
";

/// Tenant a without a tier (free), b pro, c internal (unlimited), d gold (a tier no route
/// lists): each by the key named after its tier.
fn one_tenant_a_tier() -> Vec<String> {
    vec![
        entry("free-key", "a", None),
        entry("pro-key", "b", Some("pro")),
        entry("internal-key", "c", Some("internal")),
        entry("gold-key", "d", Some("gold")),
    ]
}

/// A config with the key file of `entries` (written in `dir`) and the upstream `app` at `up`.
fn with_keys(
    redis: &Redis,
    up: &Upstream,
    dir: &std::path::Path,
    entries: &[String],
) -> GatewayConfig {
    let keys = dir.join("keys.toml");
    std::fs::write(&keys, entries.join("\n")).unwrap();
    GatewayConfig::new(&redis.url())
        .section(&format!(
            "[auth.api_keys]\nfile = {}\n",
            quoted(keys.to_str().unwrap())
        ))
        .upstream("app", &[up.addr()])
}

async fn admitted(gw: &common::Gateway, key: &str, n: usize) -> usize {
    let http = client();
    let mut ok = 0;
    for _ in 0..n {
        let r = http
            .get(gw.url("/ocr/doc"))
            .header("X-API-Key", key)
            .send()
            .await
            .unwrap();
        ok += usize::from(r.status() == 200);
    }
    ok
}

/// A `default_tier` listed under `tiers`: a caller without a tier (or with one no route lists)
/// gets that tier's limits, not the route's own; an unlimited one forwards without a Redis
/// call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_default_tier_applies_to_callers_without_a_tier() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    for (default, want) in [("pro", 4), ("internal", 6)] {
        let dir = tempfile::tempdir().unwrap();
        let gw = with_keys(&redis, &up, dir.path(), &one_tenant_a_tier())
            .route(tiered().set("default_tier", quoted(default)))
            .section(TIERS)
            .start();
        redis.reset_stats();
        for key in ["free-key", "gold-key"] {
            assert_eq!(admitted(&gw, key, 6).await, want, "{default}: {key}");
        }
        let calls = redis.command_calls("evalsha");
        match default {
            "internal" => assert_eq!(calls, 0, "unlimited: no Redis call"),
            _ => assert!(calls > 0),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tier_gets_its_limits_and_the_ceiling_still_applies() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let dir = tempfile::tempdir().unwrap();
    let gw = with_keys(
        &redis,
        &up,
        dir.path(),
        &[
            one_tenant_a_tier(),
            vec![
                entry("x-free-key", "x", None),
                entry("x-pro-key", "x", Some("pro")),
            ],
        ]
        .concat(),
    )
    .route(tiered())
    .section(TIERS)
    .start();

    assert_eq!(
        admitted(&gw, "free-key", 3).await,
        2,
        "free: the route's own burst"
    );
    assert_eq!(admitted(&gw, "pro-key", 5).await, 4, "pro: its own burst");
    // Each denial's log line names the tier it counted under; the route's own limits count
    // as `default_tier`.
    common::wait_until(
        std::time::Duration::from_secs(2),
        "the tiers in the deny lines",
        || {
            let logs = gw.logs();
            let denied: Vec<&str> = logs
                .lines()
                .filter(|l| l.contains("request denied"))
                .collect();
            denied.len() == 2
                && denied[0].contains(r#""tier":"free""#)
                && denied[1].contains(r#""tier":"pro""#)
        },
    );
    assert_eq!(
        admitted(&gw, "gold-key", 3).await,
        2,
        "an unlisted tier counts as free"
    );

    // Unlimited: forwarded without a Redis call, and not counted by the ceiling. No
    // decision either: `allowed` is Redis's answer, and Redis was not asked.
    redis.reset_stats();
    let decided =
        r#"sentinel_decisions_total{allowed="true",decision_reason="allowed",endpoint_id="t.ocr"}"#;
    let before = gw.metric(decided);
    assert_eq!(admitted(&gw, "internal-key", 12).await, 12);
    assert_eq!(redis.limiter_calls(), 0);
    assert_eq!(gw.metric(decided), before);

    // One tenant, two keys of two tiers: two buckets.
    assert_eq!(admitted(&gw, "x-free-key", 1).await, 1);
    // The ceiling (9 a minute for everyone, 8 + 1 spent) now denies every tier.
    assert_eq!(admitted(&gw, "x-pro-key", 2).await, 0);
    assert_eq!(
        gw.metric(
            "sentinel_tier_decisions_total{allowed=\"true\",endpoint_id=\"t.ocr\",tier=\"pro\"}"
        ),
        4.0
    );
    assert_eq!(
        gw.metric(
            "sentinel_tier_decisions_total{allowed=\"true\",endpoint_id=\"t.ocr\",tier=\"free\"}"
        ),
        5.0
    );
    assert_eq!(
        gw.metric("sentinel_tier_decisions_total{allowed=\"true\",endpoint_id=\"t.ocr\",tier=\"internal\"}"),
        12.0
    );
    // Denials by tier: pro's fifth request, and x-pro-key's two the ceiling refused.
    assert_eq!(
        gw.metric(
            "sentinel_tier_decisions_total{allowed=\"false\",endpoint_id=\"t.ocr\",tier=\"pro\"}"
        ),
        3.0
    );

    // /limits per tier.
    let view = |query: &str| {
        let (status, body) =
            blocking_get(&gw.admin(&format!("/limits/t.ocr?identity=tenant%3Ab{query}"))).unwrap();
        (
            status,
            serde_json::from_str::<Value>(&body).unwrap_or(Value::Null),
        )
    };
    let (status, pro) = view("&tier=pro");
    assert_eq!(status, 200);
    assert_eq!(pro["tier"], "pro");
    let burst = &pro["limits"][0];
    assert_eq!(
        (
            burst["name"].as_str(),
            burst["capacity"].as_u64(),
            burst["remaining"].as_i64()
        ),
        (Some("burst"), Some(4), Some(0)),
        "{pro}"
    );
    let (_, free) = view("");
    assert_eq!(free["tier"], "free");
    assert_eq!(free["limits"][0]["capacity"], 2, "{free}");
    assert_eq!(view("&tier=platinum").0, 400);
    assert_eq!(view("&tier=").0, 400, "an empty tier names none");
    assert_eq!(view("&tier").0, 400, "nor does one without a value");

    // A reset deletes the caller's buckets of every tier (it may have changed tier since) in
    // one command, so that no decision runs between two of them.
    redis.reset_stats();
    let r = client()
        .delete(gw.admin("/limits/t.ocr?identity=tenant%3Ab"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(body["keys_deleted"], 1, "the pro bucket: {body}");
    assert_eq!(redis.command_calls("del"), 1, "one DEL for every tier");
    assert_eq!(view("&tier=pro").1["limits"][0]["remaining"], 4);
}

#[test]
fn check_refuses_tiers_that_cannot_work() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keys.toml"), entry("k", "a", None)).unwrap();
    let run = |route: &str| {
        common::check_body(
            dir.path(),
            &format!("[redis]\nurl = \"redis://127.0.0.1:1\"\n[auth.api_keys]\nfile = \"keys.toml\"\n[upstreams.app]\naddrs = [\"127.0.0.1:1\"]\n{route}"),
            &[],
        )
    };
    let (ok, out) = run(&(tiered().toml() + TIERS));
    assert!(ok, "{out}");
    assert!(!out.contains("is listed by no route"), "{out}");
    assert!(!out.contains("warning"), "{out}");
    // A tier no route lists (misspelt, say): its callers count as the default tier, and
    // `check` says so.
    std::fs::write(
        dir.path().join("keys.toml"),
        entry("k", "a", None) + "\n" + &entry("g", "b", Some("gold")),
    )
    .unwrap();
    let (ok, out) = run(&(tiered().toml() + TIERS));
    assert!(
        ok && out.contains(
            "tier = \"gold\" (1 key(s)) is listed by no route with tier_from = \"api_key\""
        ),
        "{out}"
    );
    // A tenant whose keys name two tiers has both tiers' buckets: said, as a tenant moved to
    // a new tier by a new key with its old key kept would spend both allowances.
    std::fs::write(
        dir.path().join("keys.toml"),
        entry("k", "a", None) + "\n" + &entry("p", "a", Some("pro")),
    )
    .unwrap();
    let (ok, out) = run(&(tiered().toml() + TIERS));
    assert!(
        ok && out
            .contains("tenant \"a\" holds keys of several tiers of routes[0] (t.ocr) (free, pro)"),
        "{out}"
    );
    // Keys whose tiers the route reads as one (none and the default's name; a tier it does
    // not list) share one set of buckets: nothing to say.
    for other in [Some("free"), Some("gold")] {
        std::fs::write(
            dir.path().join("keys.toml"),
            entry("k", "a", None) + "\n" + &entry("p", "a", other),
        )
        .unwrap();
        let (ok, out) = run(&(tiered().toml() + TIERS));
        assert!(ok && !out.contains("several tiers"), "{other:?}: {out}");
    }
    std::fs::write(dir.path().join("keys.toml"), entry("k", "a", None)).unwrap();
    // The plain words say whose the route's own limits are.
    assert!(
        out.contains("; tiers from the key file (the limits above are tier free's, and a caller's without a listed tier); internal: not limited; pro: limit burst: token bucket of 4 requests, never refilled"),
        "{out}"
    );
    // A default tier with limits of its own: they, not the route's, are a tierless caller's.
    let (ok, out) = run(&(tiered().set("default_tier", "\"internal\"").toml() + TIERS));
    assert!(
        ok && out.contains(
            "; tiers from the key file (a caller without a listed tier is tier internal); internal: "
        ),
        "{out}"
    );
    // The route's own limits then apply to no caller: said, as written in vain.
    let in_vain = "default_tier = \"internal\" is listed under tiers, so callers without a tier get tiers.internal's limits: the route's own limits (those on the caller's identity) apply to no caller";
    assert!(out.contains(in_vain), "{out}");

    // No tier listed: every caller has the route's own limits, and the line says no more.
    let (ok, out) = run(&tiered().toml());
    let after = out
        .split("(the limits above are tier free's, and a caller's without a listed tier)")
        .nth(1);
    assert!(
        ok && after.is_some_and(|rest| rest.starts_with("; fail_closed")),
        "{out}"
    );

    let no_default = tiered().set("default_tier", "\"\"").toml();
    let (ok, out) = run(&no_default);
    assert!(
        !ok && out.contains("default_tier = \"\" is not a tier name"),
        "{out}"
    );

    let claim_on_keys = tiered().set("tier_from", "{ claim = \"plan\" }").toml();
    let (ok, out) = run(&claim_on_keys);
    assert!(!ok && out.contains("needs identity = \"jwt\""), "{out}");

    let ceiling_in_tier = tiered().toml()
        + "\n[[routes.tiers.pro.limits]]\nname = \"c\"\nidentity = \"global\"\nalgorithm = \"token_bucket\"\ncapacity_micro = 1_000_000\nrefill_rate_micro_per_sec = 0\n";
    let (ok, out) = run(&ceiling_in_tier);
    assert!(
        !ok && out.contains("tiers.pro.limits[0] (c).identity is set"),
        "{out}"
    );

    let both = tiered().toml() + "\n[routes.tiers.pro]\nunlimited = true\n[[routes.tiers.pro.limits]]\nname = \"b\"\nalgorithm = \"token_bucket\"\ncapacity_micro = 1_000_000\nrefill_rate_micro_per_sec = 0\n";
    let (ok, out) = run(&both);
    assert!(
        !ok && out.contains("tiers.pro is unlimited and has limits"),
        "{out}"
    );

    // A tier limit the route's cost can never fit.
    let too_small = tiered().set("cost_micro", "2_000_000").toml() + "\n[[routes.tiers.pro.limits]]\nname = \"b\"\nalgorithm = \"token_bucket\"\ncapacity_micro = 1_000_000\nrefill_rate_micro_per_sec = 0\n";
    let (ok, out) = run(&too_small);
    assert!(
        !ok && out.contains("can never be admitted by tiers.pro.limits[0] (b):"),
        "{out}"
    );

    // A tier's limit named as the route's ceiling, which applies to the tier too: two limits
    // of one name in the RateLimit fields, `/limits`, the metrics and the logs.
    let shadowing = tiered().toml() + "\n[[routes.tiers.pro.limits]]\nname = \"backend\"\nalgorithm = \"token_bucket\"\ncapacity_micro = 1_000_000\nrefill_rate_micro_per_sec = 0\n";
    let (ok, out) = run(&shadowing);
    assert!(
        !ok && out
            .contains("tiers.pro.limits[0].name = \"backend\" is the name of the route's ceiling"),
        "{out}"
    );
}

/// A tiered route with the single-limit fields: its own limit is the one named `default`
/// (section 13), in the RateLimit fields too, so a caller sees one name whatever its tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tiered_single_limit_routes_item_is_named_default_in_every_tier() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    let both = [
        entry("free-key", "a", None),
        entry("pro-key", "b", Some("pro")),
    ];
    std::fs::write(&keys, both.join("\n")).unwrap();
    let gw = GatewayConfig::new(&redis.url())
        .section(&format!(
            "[auth.api_keys]\nfile = {}\n",
            quoted(keys.to_str().unwrap())
        ))
        .upstream("app", &[up.addr()])
        .route(
            Route::new("t.single")
                .prefix("/ocr")
                .identity("api_key")
                .fail_closed()
                .set("tier_from", quoted("api_key"))
                .set("default_tier", quoted("free"))
                .set("ratelimit_headers", "true")
                .token_bucket(2_000_000, 0),
        )
        .section("\n[[routes.tiers.pro.limits]]\nname = \"default\"\nalgorithm = \"token_bucket\"\ncapacity_micro = 4_000_000\nrefill_rate_micro_per_sec = 0\n")
        .start();
    let http = client();
    for (key, policy) in [
        ("free-key", "\"default\";q=2"),
        ("pro-key", "\"default\";q=4"),
    ] {
        let r = http
            .get(gw.url("/ocr/doc"))
            .header("X-API-Key", key)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["ratelimit-policy"], policy, "{key}");
        assert!(
            r.headers()["ratelimit"]
                .to_str()
                .unwrap()
                .starts_with("\"default\";r="),
            "{key}: {:?}",
            r.headers()["ratelimit"]
        );
    }
}

/// `tier_from = { claim = "plan" }`: the token's string claim picks the tier; a token
/// without it, or with a plan not listed (a number is its digits; `7` names no tier here),
/// counts as the default tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_claim_picks_the_tier() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let secret = "tier-test-secret-tier-test-secret-0123";
    let gw = GatewayConfig::new(&redis.url())
        .section("[auth.jwt]\nalgorithms = [\"HS256\"]\nsecret_env = \"TEST_TIER_JWT_SECRET\"\n")
        .upstream("app", &[up.addr()])
        .route(
            Route::new("t.jwt")
                .prefix("/ocr")
                .identity("jwt")
                .fail_closed()
                .set("tier_from", "{ claim = \"plan\" }")
                .set("default_tier", quoted("free"))
                .bucket_limit("burst", 2, 0),
        )
        .section(TIERS)
        .start_with_env(&[("TEST_TIER_JWT_SECRET", secret)]);
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 300;
    let token = |sub: &str, plan: serde_json::Value| {
        let mut claims = serde_json::json!({"sub": sub, "exp": exp});
        if !plan.is_null() {
            claims["plan"] = plan;
        }
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).unwrap(),
        )
        .unwrap()
    };
    let admitted = |t: String| {
        let gw = &gw;
        async move {
            let http = client();
            let mut ok = 0;
            for _ in 0..6 {
                let r = http
                    .get(gw.url("/ocr/doc"))
                    .bearer_auth(&t)
                    .send()
                    .await
                    .unwrap();
                ok += usize::from(r.status() == 200);
            }
            ok
        }
    };
    assert_eq!(admitted(token("u1", serde_json::json!("pro"))).await, 4);
    assert_eq!(admitted(token("u2", Value::Null)).await, 2);
    assert_eq!(
        admitted(token("u3", serde_json::json!("platinum"))).await,
        2
    );
    assert_eq!(admitted(token("u4", serde_json::json!(7))).await, 2);
    assert_eq!(
        admitted(token("u5", serde_json::json!("internal"))).await,
        6
    );
}

/// A tenant moved to another tier in the key file counts under the new tier after a reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_in_the_key_file_takes_effect_on_reload() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, entry("tenant-key", "a", None)).unwrap();
    let config = |tiers: &str| {
        GatewayConfig::new(&redis.url())
            .section(&format!(
                "[auth.api_keys]\nfile = {}\n",
                quoted(keys.to_str().unwrap())
            ))
            .upstream("app", &[up.addr()])
            .route(tiered())
            .section(tiers)
    };
    let gw = config(TIERS).start();
    assert_eq!(admitted(&gw, "tenant-key", 3).await, 2, "free");
    std::fs::write(&keys, entry("tenant-key", "a", Some("pro"))).unwrap();
    assert_eq!(gw.reload(), 200);
    assert_eq!(
        admitted(&gw, "tenant-key", 5).await,
        4,
        "pro: a bucket of its own"
    );
    // A tier's limit whose algorithm changes under the same policy_version moves its
    // buckets as a route's own does: said at WARN, naming the tier.
    let window = TIERS.replace(
        "algorithm = \"token_bucket\"\ncapacity_micro = 4_000_000\nrefill_rate_micro_per_sec = 0",
        "algorithm = \"sliding_window\"\nlimit = 4\nwindow_size_micro = 60_000_000",
    );
    gw.rewrite_config(&config(&window).render(gw.port, gw.admin_port));
    assert_eq!(gw.reload(), 200);
    common::wait_until(std::time::Duration::from_secs(3), "the warning", || {
        gw.logs().contains(
            "a reload changed limit burst of tier pro from token_bucket to sliding_window under the same policy_version",
        )
    });
}

/// A caller on an `unlimited` tier of a route whose upstream reports costs: the reported cost
/// is stripped from the answer and charged to nothing (no limit of any tier, no ceiling, no
/// Redis call), also with the access log on (which keeps the caller's identity hash).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlimited_tier_is_never_charged_a_reported_cost() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(
        &keys,
        [
            entry("internal-key", "c", Some("internal")),
            entry("free-key", "c", None),
        ]
        .join("\n"),
    )
    .unwrap();
    let log = dir.path().join("access.log");
    let gw = GatewayConfig::new(&redis.url())
        .section(&format!(
            "[auth.api_keys]\nfile = {}\n",
            quoted(keys.to_str().unwrap())
        ))
        .access_log(&log)
        .upstream("app", &[up.addr()])
        .route(tiered().set(
            "cost_from_response",
            "{ header = \"X-OCR-Pages\", unit_micro = 1_000_000 }",
        ))
        .section(TIERS)
        .start();
    // One request with its key, the upstream reporting `pages`.
    let call = |key: &'static str, pages: &'static str| {
        client()
            .get(gw.url("/ocr/doc"))
            .header("X-API-Key", key)
            .header("X-Demo-Reply-X-OCR-Pages", pages)
            .send()
    };
    redis.reset_stats();
    for _ in 0..3 {
        let r = call("internal-key", "50").await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(!r.headers().contains_key("x-ocr-pages"), "never shown");
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(redis.limiter_calls(), 0, "no decision, no charge");
    // A free caller's charge afterwards shows the charge path is alive and shows nothing
    // of the unlimited calls: the tenant's free bucket is 2 - 1 - 1 = 0, not in debt.
    assert_eq!(call("free-key", "1").await.unwrap().status(), 200);
    common::wait_until(
        std::time::Duration::from_secs(2),
        "the free caller's charge",
        || {
            gw.metric("sentinel_response_charges_total{endpoint_id=\"t.ocr\",result=\"charged\"}")
                == 1.0
        },
    );
    std::thread::sleep(std::time::Duration::from_millis(200));
    for result in ["charged", "invalid", "failed"] {
        let want = if result == "charged" { 1.0 } else { 0.0 };
        assert_eq!(
            gw.metric(&format!(
                "sentinel_response_charges_total{{endpoint_id=\"t.ocr\",result=\"{result}\"}}"
            )),
            want,
            "{result}: only the free caller's one charge"
        );
    }
    let (status, body) = blocking_get(&gw.admin("/limits/t.ocr?identity=tenant%3Ac")).unwrap();
    assert_eq!(status, 200, "{body}");
    let view: Value = serde_json::from_str(&body).unwrap();
    let burst = view["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "burst")
        .expect("the burst limit");
    assert_eq!(burst["remaining"], 0, "{body}");
    // The free caller's next request is refused by its tier's burst: its access-log line names
    // the tier and the limit; the unlimited tier's lines name their tier and no decision.
    assert_eq!(call("free-key", "1").await.unwrap().status(), 429);
    let mut lines = Vec::new();
    common::wait_until(std::time::Duration::from_secs(5), "five lines", || {
        lines = common::access_lines(&log);
        lines.len() == 5
    });
    for line in &lines[..3] {
        assert_eq!(
            (&line["tier"], &line["limit"], &line["decision_reason"]),
            (&"internal".into(), &Value::Null, &Value::Null),
            "{line}"
        );
        assert_eq!(line["tls"], false, "{line}");
    }
    let denied = &lines[4];
    assert_eq!(
        (&denied["status"], &denied["tier"], &denied["limit"]),
        (&429.into(), &"free".into(), &"burst".into()),
        "{denied}"
    );
    assert_eq!(denied["decision_reason"], "rate_limited", "{denied}");
}

/// Sends one request with `key` and the client's own claims to be someone else, and returns
/// the status and what the upstream was told of the caller (`x-sentinel-identity`,
/// `x-sentinel-tier`, and the `_` spelling of the first).
async fn told(gw: &common::Gateway, path: &str, key: &str) -> (u16, [Option<String>; 3]) {
    let r = client()
        .get(gw.url(path))
        .header("X-API-Key", key)
        .header("X-Sentinel-Identity", "tenant:root")
        .header("X-Sentinel-Tier", "internal")
        .header("X_Sentinel_Identity", "tenant:root")
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body = r.text().await.unwrap();
    let echo: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let field = |name: &str| echo["headers"][name].as_str().map(str::to_owned);
    (
        status,
        [
            field("x-sentinel-identity"),
            field("x-sentinel-tier"),
            field("x_sentinel_identity"),
        ],
    )
}

/// `forward_identity = true`: the upstream is told the tenant the key file maps the key to and
/// the tier it counted under (an unlisted tier as `default_tier`, an unlimited tier too);
/// what a client says under those names never reaches an upstream, on any route; an exempt
/// client, whom the gateway does not identify, is told of as no one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_is_told_the_tenant_and_tier_the_gateway_found() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let dir = tempfile::tempdir().unwrap();
    let gw = with_keys(&redis, &up, dir.path(), &one_tenant_a_tier())
        .route(
            Route::new("t.plain")
                .prefix("/plain")
                .identity("api_key")
                .token_bucket(100_000_000, 0),
        )
        .route(
            Route::new("t.exempt")
                .prefix("/exempt")
                .identity("api_key")
                .token_bucket(100_000_000, 0)
                .set("exempt_client_cidrs", "[\"127.0.0.1/32\"]")
                .set("forward_identity", "true"),
        )
        .route(tiered().set("forward_identity", "true"))
        .section(TIERS)
        .start();

    let (free, pro, internal, gold) = (
        told(&gw, "/ocr/x", "free-key").await,
        told(&gw, "/ocr/x", "pro-key").await,
        told(&gw, "/ocr/x", "internal-key").await,
        told(&gw, "/ocr/x", "gold-key").await,
    );
    let caller = |tenant: &str, tier: &str| {
        (
            200,
            [
                Some(format!("tenant:{tenant}")),
                Some(tier.to_owned()),
                None,
            ],
        )
    };
    assert_eq!(free, caller("a", "free"));
    assert_eq!(pro, caller("b", "pro"));
    assert_eq!(internal, caller("c", "internal"), "an unlimited tier");
    assert_eq!(gold, caller("d", "free"), "an unlisted tier is the default");
    assert_eq!(
        told(&gw, "/plain/x", "pro-key").await,
        (200, [None, None, None]),
        "a route without forward_identity tells nothing, and passes no client's word on"
    );
    assert_eq!(
        told(&gw, "/exempt/x", "no-such-key").await,
        (200, [None, None, None]),
        "an exempt client is identified as no one"
    );
    // A refused key is refused before anything is forwarded.
    assert_eq!(told(&gw, "/ocr/x", "no-such-key").await.0, 401);
}
