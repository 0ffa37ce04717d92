//! `sentinel-gateway check`: one fixture per config error, each asserting the exact message,
//! and the shipped configs pass.

mod common;

use std::path::Path;

use common::config::Route;

fn check(path: &Path) -> (i32, String, String) {
    let out = common::check_config(
        path,
        &[("SENTINEL_REDIS_URL", None), ("SENTINEL_JWT_SECRET", None)],
    );
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_invalid_fixture_fails_with_its_exact_messages() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/config/invalid");
    let mut fixtures: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    fixtures.sort();
    assert!(fixtures.len() >= 20, "fixtures missing");
    for path in fixtures {
        let text = std::fs::read_to_string(&path).unwrap();
        let expected: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# expect: "))
            .map(|e| format!("{}:{e}", path.display()))
            .collect();
        assert!(
            !expected.is_empty(),
            "{} has no '# expect:' line",
            path.display()
        );
        let (code, stdout, stderr) = check(&path);
        assert_eq!(code, 2, "{}: exit code", path.display());
        assert_eq!(stdout, "", "{}: nothing on stdout", path.display());
        let mut lines: Vec<&str> = stderr.lines().collect();
        let summary = lines.pop().unwrap_or_default();
        assert_eq!(
            summary,
            format!(
                "{}: {} error(s); the config was not loaded",
                path.display(),
                expected.len()
            )
        );
        assert_eq!(lines, expected, "{}", path.display());
    }
}

#[test]
fn shipped_configs_are_valid_and_described_in_plain_words() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (code, stdout, stderr) = check(&root.join("gateway.toml"));
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stderr, "", "the shipped config warns of nothing");
    assert!(stdout.contains("pdftalk.ingest: POST /pdftalk/ingest/** -> pdftalk; token bucket of 5 requests, refilled at 0.1 requests per second, per x-api-key header; fail_closed; policy v1"), "{stdout}");
    assert!(
        stdout.contains("resumint.tailor: any method /resumint/tailor/** -> resumint;"),
        "{stdout}"
    );
    assert!(
        stdout.contains("fail_open (emergency cap 5 requests per second per process)"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "health: GET,HEAD /healthz -> pdftalk; not limited; fail_closed (unused); policy v1"
        ),
        "{stdout}"
    );
    for entry in std::fs::read_dir(root.join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = common::check_config(
                &path,
                &[
                    ("SENTINEL_REDIS_URL", None),
                    (
                        "SENTINEL_JWT_SECRET",
                        Some("example-secret-example-secret-0123"),
                    ),
                    ("SENTINEL_REDIS_PASSWORD", Some("example-password")),
                ],
            );
            let (code, stderr) = (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stderr),
            );
            assert_eq!(code, 0, "{}: {stderr}", path.display());
            assert_eq!(
                stderr,
                "",
                "{}: a shipped config warns of nothing",
                path.display()
            );
            // A cost the upstream reports is part of the route's line.
            if path.ends_with("pdftalk-plan.toml") {
                let stdout = String::from_utf8_lossy(&out.stdout);
                assert!(
                    stdout.contains(
                        "; charged 1 request per unit of the answer's x-ocr-pages header;"
                    ),
                    "{stdout}"
                );
            }
            // A GET route matches HEAD too, and its line says so.
            if path.ends_with("tls.toml") {
                let stdout = String::from_utf8_lossy(&out.stdout);
                assert!(
                    stdout.contains("health: GET,HEAD /healthz -> pdftalk;"),
                    "{stdout}"
                );
            }
            // An emergency bucket per identity is said so (it once read as one per process).
            if path.ends_with("cluster.toml") {
                let stdout = String::from_utf8_lossy(&out.stdout);
                assert!(
                    stdout.contains("fail_open (emergency cap 50 requests per second per identity for the whole fleet)"),
                    "{stdout}"
                );
            }
        }
    }
}

#[test]
fn bounds_at_the_limit_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    // Only the sections under test: `check` needs no [server] or [redis].
    let route = Route::new("big")
        .path("/big")
        .identity("global")
        .token_bucket(1_000_000_000_000_000, 1_000_000_000_000)
        .set("cost_micro", "1_000_000_000_000_000")
        // Said in the bucket's unit, tokens here (it said "requests").
        .set(
            "cost_from_response",
            "{ header = \"X-Cost\", unit_micro = 250_000 }",
        );
    // A sliding window of 10^9 requests a day: its products pass 2^53, and are exact.
    let daily = Route::new("daily")
        .path("/daily")
        .identity("global")
        .set("algorithm", "\"sliding_window\"")
        .set("limit", "1_000_000_000")
        .set("window_size_micro", "86_400_000_000")
        .set("cost_micro", "4_000_000");
    std::fs::write(
        &path,
        format!(
            "\n[upstreams.app]\naddrs = [\"127.0.0.1:9001\"]\n{}{}",
            route.toml(),
            daily.toml()
        ),
    )
    .unwrap();
    let (code, stdout, stderr) = check(&path);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("token bucket of 1000000000 tokens (1 request at 1000000000 tokens each), refilled at 1000000 tokens per second"), "{stdout}");
    assert!(
        stdout.contains("; charged 0.25 tokens per unit of the answer's x-cost header"),
        "{stdout}"
    );
    assert!(
        stdout.contains("sliding window of 1000000000 requests per 86400 seconds, each call counting as 4 requests (250000000 calls)"),
        "{stdout}"
    );
}

/// A network written with host bits set works (as its network) but is said: the one address
/// was perhaps meant, and `10.0.0.1/8` trusts sixteen million. `verify = false` is said too,
/// and so are a method listed twice, a network of every address (trusted, or exempt) and an
/// upstream no route names.
#[test]
fn check_warns_of_what_works_but_perhaps_not_as_meant() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    // A method no request can carry past the edge (a digit: answered 400 before any route).
    let route = Route::new("x.api")
        .prefix("/x")
        .methods(&["GET", "X1", "get", "POTS", "PROPFIND"])
        .identity("client_ip")
        .token_bucket(5_000_000, 1_000_000)
        .set(
            "exempt_client_cidrs",
            r#"["10.1.2.3/16", "10.9.0.0/16", "::/0", "::ffff:0:0/96", "::/8"]"#,
        );
    // An emergency bucket per value of a header the client writes as it likes.
    let made_up = Route::new("y.api")
        .prefix("/y")
        .identity_header("X-Key")
        .token_bucket(5_000_000, 1_000_000)
        .fail_open(1_000_000)
        .set("emergency_scope", "\"identity\"");
    // A limited route's fields on one that is not limited (its identity is kept quiet: a
    // `Host` or `User-Agent` one keeps that field out of the access log).
    let open = Route::new("z.open")
        .prefix("/z")
        .unlimited()
        .identity("global")
        .fail_closed()
        .policy_version(4)
        .set("fallback_rate_fleet_micro", "3_000_000");
    // A header the client writes as an identity, and a rate written in requests (11 a
    // second meant; one request in 25 hours written).
    let spoofable = Route::new("w.api")
        .prefix("/w")
        .identity_header("X-Forwarded-For")
        .token_bucket(5_000_000, 11);
    // A quota that never refills, per value of a header the client writes: keys kept for good.
    let quota = Route::new("v.quota")
        .prefix("/v")
        .identity_header("X-User")
        .token_bucket(3_000_000, 0);
    std::fs::write(
        &path,
        format!(
            "[server]\ntrusted_proxies = [\"127.0.0.0/8\", \"192.168.7.9/24\", \"0.0.0.0/0\", \"127.0.0.0/8\"]\n\
             h2_connection_window_bytes = 100_000\n\
             [auth.jwt]\nsecret_env = \"SENTINEL_TEST_UNSET_SECRET\"\nalgorithms = [\"HS256\", \"HS256\"]\n\
             [upstreams.app]\naddrs = [\"127.0.0.1:9001\"]\ntls = true\nverify = false\n\
             [upstreams.spare]\naddrs = [\"127.0.0.1:9002\"]\n{}{}{}{}{}",
            route.toml(),
            made_up.toml(),
            open.toml(),
            spoofable.toml(),
            quota.toml()
        ),
    )
    .unwrap();
    let (code, stdout, stderr) = check(&path);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("ok, 5 route(s)"), "{stdout}");
    // A method listed twice is said once in the route's line.
    assert!(
        stdout.contains("x.api: GET,HEAD,X1,POTS,PROPFIND "),
        "{stdout}"
    );
    let file = path.display();
    // The quota's `0`, past `refill_rate_micro_per_sec = `.
    let zero = position_of(&path, "_per_sec = 0\n");
    let zero = zero
        .split_once(':')
        .map(|(l, c)| format!("{l}:{}", c.parse::<usize>().unwrap() + 11))
        .unwrap();
    let warnings: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        warnings,
        [
            format!("warning: {file}:{}: server.trusted_proxies entry \"192.168.7.9/24\" has host bits set: it is taken as the network \"192.168.7.0/24\" (write \"192.168.7.9/32\" for the one address)", position_of(&path, "\"192.168.7.9/24\"")),
            format!("warning: {file}:{}: server.trusted_proxies entry \"0.0.0.0/0\" is every IPv4 address: every peer may then say which client it forwards for (X-Forwarded-For): a client_ip identity, an exemption and the access log's client address are each client's own to choose", position_of(&path, "\"0.0.0.0/0\"")),
            format!("warning: {file}:{}: server.trusted_proxies entry \"127.0.0.0/8\" is the network \"127.0.0.0/8\" listed already: keep one", position_of(&path, "\"127.0.0.0/8\"]")),
            format!("warning: {file}:{}: server.h2_connection_window_bytes = 100000 is below h2_stream_window_bytes = 1048576: one stream whose upstream stops reading can hold the whole connection's window, and its other uploads wait for it", position_of(&path, "100_000")),
            format!("warning: {file}:{}: auth.jwt.algorithms[1] = \"HS256\" is listed already as auth.jwt.algorithms[0]: keep one", position_of(&path, "[\"HS256\"")),
            format!("warning: {file}:{}: [auth.jwt] is set but no route has identity = \"jwt\": its secret and keys are not checked until one does", position_of(&path, "[auth.jwt]")),
            format!("warning: {file}:{}: routes[0] (x.api): methods[1] = \"X1\" never reaches a route: requests whose method holds more than letters, '-' and '_' are answered 400", position_of(&path, "\"X1\"")),
            format!("warning: {file}:{}: routes[0] (x.api): methods[2] = \"get\" is listed already as methods[0]: keep one", position_of(&path, "\"get\"")),
            // A misspelling leaves POST to another route; a WebDAV method is registered.
            format!("warning: {file}:{}: routes[0] (x.api): methods[3] = \"POTS\" is no registered HTTP method (IANA's registry, or PURGE): if it is a misspelling, the method meant goes to another route (a catch-all's limit, or none); keep it if clients send it", position_of(&path, "\"POTS\"")),
            format!("warning: {file}:{}: routes[0] (x.api): exempt_client_cidrs entry \"10.1.2.3/16\" has host bits set: it is taken as the network \"10.1.0.0/16\" (write \"10.1.2.3/32\" for the one address)", position_of(&path, "\"10.1.2.3/16\"")),
            format!("warning: {file}:{}: routes[0] (x.api): exempt_client_cidrs entry \"::/0\" is every IPv6 address: every client of that family then goes without a limit", position_of(&path, "\"::/0\"")),
            // IPv4 clients are read as IPv4: the mapped network of them all is every one.
            format!("warning: {file}:{}: routes[0] (x.api): exempt_client_cidrs entry \"::ffff:0:0/96\" is every IPv4 address: every client of that family then goes without a limit", position_of(&path, "\"::ffff:0:0/96\"")),
            // Wider than the mapped range: no IPv4 client is in it.
            format!("warning: {file}:{}: routes[0] (x.api): exempt_client_cidrs entry \"::/8\" holds the IPv4-mapped addresses (::ffff:0:0/96), but IPv4 clients are read as IPv4: it matches none of them (write the IPv4 networks meant beside it, \"0.0.0.0/0\" for all)", position_of(&path, "\"::/8\"")),
            format!("warning: {file}:{}: routes[1] (y.api): emergency_scope = \"identity\" with identity = {{ header = \"x-key\" }}: a client chooses its own header value, and each value gets an emergency bucket of its own, so during an outage a client sending new values is limited only by the 10 000 buckets kept (use api_key or jwt, whose identities a client cannot make up)", position_of(&path, "\"identity\"\n")),
            format!("warning: {file}:{}: routes[2] (z.open): fallback_rate_fleet_micro on a route that is not limited (algorithm = \"none\") has no emergency to share: the fleet is not counted for it", position_of(&path, "3_000_000")),
            format!("warning: {file}:{}: routes[2] (z.open): fail_mode, policy_version on a route that is not limited (algorithm = \"none\") change nothing: its requests are forwarded without a decision", position_of(&path, "\"fail_closed\"")),
            format!("warning: {file}:{}: routes[3] (w.api): refill_rate_micro_per_sec = 11 adds one token (one request of cost 1_000_000) every 25.3 hours: the rate is in micro-tokens a second (11 requests a second is 11000000)", position_of(&path, "11\n")),
            format!("warning: {file}:{}: routes[3] (w.api): identity = {{ header = \"X-Forwarded-For\" }}: the client writes this header itself, so every value it makes up is a bucket of its own; for the client's address behind a load balancer use identity = \"client_ip\" with [server] trusted_proxies, which reads X-Forwarded-For from the right, past your proxies", position_of(&path, "{ header = \"X-Forwarded-For\"")),
            format!("warning: {file}:{}: routes[4] (v.quota): refill_rate_micro_per_sec = 0: the bucket never refills, so its Redis key never expires (a fixed quota, renewed only by a new policy_version, whose old keys stay too), and with identity = {{ header = \"x-user\" }} every value a client makes up is a key kept for good: a noeviction Redis fills up; give it a refill, however slow, or key it by api_key or jwt", zero),
            format!("warning: {file}:{}: upstreams.spare is named by no route: no request goes to it", position_of(&path, "[upstreams.spare]")),
            // Pointed at the value that turns the check off.
            format!("warning: {file}:{}: upstreams.app.verify = false: the upstream's certificate is not checked; anyone on the path can answer for it", position_of(&path, "false\n")),
        ],
        "{stderr}"
    );
}

/// Two routes of one `endpoint_id` that differ in their tiers: the error is at what the
/// later route writes otherwise (the tier whose limits differ, not the first tier table; the
/// `default_tier`; `ratelimit_headers`), naming it.
#[test]
fn a_shared_endpoint_differing_in_tiers_is_pointed_at_the_tier() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keys.toml"), "keys = []\n").unwrap();
    let path = dir.path().join("gateway.toml");
    let route = |prefix: &str, default: &str, pro: u64, headers: bool| {
        format!(
            "[[routes]]\nendpoint_id = \"a.same\"\npath_prefix = \"{prefix}\"\nupstream = \"app\"\n\
             identity = \"api_key\"\ntier_from = \"api_key\"\ndefault_tier = \"{default}\"\n\
             ratelimit_headers = {headers}\n\
             algorithm = \"token_bucket\"\ncapacity_micro = 5_000_000\nrefill_rate_micro_per_sec = 100_000\n\
             [routes.tiers.gold]\nunlimited = true\n\
             [[routes.tiers.pro.limits]]\nname = \"burst\"\nalgorithm = \"token_bucket\"\n\
             capacity_micro = {pro}\nrefill_rate_micro_per_sec = 1_000_000\n"
        )
    };
    let error = |second: String| {
        std::fs::write(
            &path,
            format!(
                "[auth.api_keys]\nfile = \"keys.toml\"\n[upstreams.app]\naddrs = [\"127.0.0.1:9001\"]\n{}{second}",
                route("/a", "free", 30_000_000, false)
            ),
        )
        .unwrap();
        let (code, _, stderr) = check(&path);
        assert_eq!(code, 2, "{stderr}");
        stderr.lines().next().unwrap().to_owned()
    };
    let at = |needle: &str, nth: usize| {
        let text = std::fs::read_to_string(&path).unwrap();
        let offset = text.match_indices(needle).nth(nth).unwrap().0;
        let line = text[..offset].matches('\n').count() + 1;
        let column = offset - text[..offset].rfind('\n').map_or(0, |i| i + 1) + 1;
        format!("{line}:{column}")
    };
    let said = error(route("/b", "free", 40_000_000, false));
    assert!(said.contains(&format!(":{}: routes[1] (a.same): shares endpoint_id with routes[0] (line 5) but not its limit fields (different: tiers)", at("pro.limits", 1))), "{said}");
    let said = error(route("/b", "basic", 30_000_000, false));
    assert!(said.contains(&format!(":{}: routes[1] (a.same): shares endpoint_id with routes[0] (line 5) but not its limit fields (different: default_tier)", at("\"basic\"", 0))), "{said}");
    let said = error(route("/b", "free", 30_000_000, true));
    assert!(said.contains(&format!(":{}: routes[1] (a.same): shares endpoint_id with routes[0] (line 5) but not its limit fields (different: ratelimit_headers)", at("true", 1))), "{said}");
}

/// `line:column` of the first occurrence of `needle` in the file.
fn position_of(path: &Path, needle: &str) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let offset = text.find(needle).unwrap();
    let line = text[..offset].matches('\n').count() + 1;
    let column = offset - text[..offset].rfind('\n').map_or(0, |i| i + 1) + 1;
    format!("{line}:{column}")
}

#[test]
fn the_redis_url_variable_is_validated_too() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = common::check_config(
        &root.join("gateway.toml"),
        &[("SENTINEL_REDIS_URL", Some("http://nope"))],
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("SENTINEL_REDIS_URL = \"http://nope\" is not a Redis URL"),
        "{stderr}"
    );
    // A value that is no URL at all (a password pasted into the variable) is not shown.
    let out = common::check_config(
        &root.join("gateway.toml"),
        &[("SENTINEL_REDIS_URL", Some("Hunter2-pw"))],
    );
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("SENTINEL_REDIS_URL = \"***\" is not a Redis URL")
            && !stderr.contains("Hunter2"),
        "{stderr}"
    );
    // A password in a TCP URL's query is not read by the client (Redis would answer every
    // call NOAUTH): refused at once, without the password; one before the host is taken.
    for url in [
        "redis://127.0.0.1:6379/0?password=Hunter2-pw",
        "rediss://app@127.0.0.1:6380?PASS=Hunter2-pw",
        "redis://:other@127.0.0.1:6379/0?pa%73sword=Hunter2-pw",
        "unix:///run/redis.sock?password=Hunter2-pw",
    ] {
        let out = common::check_config(
            &root.join("gateway.toml"),
            &[("SENTINEL_REDIS_URL", Some(url))],
        );
        assert_eq!(out.status.code(), Some(2), "{url}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("a password in the query is not read by the Redis client")
                && !stderr.contains("Hunter2"),
            "{stderr}"
        );
    }
    for url in [
        "redis://:Hunter2-pw@127.0.0.1:6379/0",
        "unix:///run/redis.sock?pass=Hunter2-pw",
    ] {
        let out = common::check_config(
            &root.join("gateway.toml"),
            &[("SENTINEL_REDIS_URL", Some(url))],
        );
        assert_eq!(out.status.code(), Some(0), "{url}: {out:?}");
    }
}

#[test]
fn a_missing_file_is_an_invalid_config() {
    let (code, _, stderr) = check(Path::new("/nonexistent/gateway.toml"));
    assert_eq!(code, 2);
    assert!(
        stderr.starts_with("/nonexistent/gateway.toml: cannot read the config file:"),
        "{stderr}"
    );
}

/// A byte that is not UTF-8 (a file saved as Latin-1) is named by its line and column.
#[test]
fn a_file_that_is_not_utf8_says_where() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(
        &path,
        b"[upstreams.a]\naddrs = [\"127.0.0.1:9\"] # caf\xe9\n",
    )
    .unwrap();
    let (code, _, stderr) = check(&path);
    assert_eq!(code, 2);
    assert!(
        stderr.starts_with(&format!(
            "{}:2:30: the config file is not UTF-8 here",
            path.display()
        )),
        "{stderr}"
    );
}

/// Started (not `check`), an invalid config is also one JSON ERROR line on stdout, as the
/// log's config errors are (contract section 8), besides the plain text on stderr.
#[test]
fn an_invalid_config_at_start_is_logged_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, "[server]\nlisten = \"127.0.0.1:1\"\nbogus = 1\n").unwrap();
    let out = common::run_binary(
        &[std::ffi::OsStr::new("--config"), path.as_os_str()],
        &[("SENTINEL_REDIS_URL", None)],
    );
    assert_eq!(out.status.code(), Some(2));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    assert_eq!(line["level"], "ERROR");
    assert_eq!(line["message"], "the config is invalid; not started");
    assert!(
        line["errors"]
            .as_str()
            .unwrap()
            .contains("3:1: server: unknown field `bogus`"),
        "{line}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("1 error(s); the config was not loaded"),
        "{stderr}"
    );
}

#[test]
fn every_route_field_is_documented() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"),
    )
    .unwrap();
    for field in sentinel_gateway::config::raw::ROUTE_FIELDS {
        assert!(
            doc.contains(&format!("| `{field}` |")),
            "docs/configuration.md lacks a row for `{field}`"
        );
    }
}

#[test]
fn a_short_jwt_secret_is_named_and_refused() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/config/invalid/jwt_secret_missing.toml");
    let out = common::check_config(&path, &[("SENTINEL_JWT_SECRET", Some("too-short"))]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("auth.jwt.secret_env: the environment variable SENTINEL_JWT_SECRET holds 9 bytes: the secret must be at least 32 bytes"),
        "{stderr}"
    );
    // Long enough, and guessed all the same.
    let spaces = " ".repeat(40);
    let out = common::check_config(&path, &[("SENTINEL_JWT_SECRET", Some(spaces.as_str()))]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("holds 1 different bytes: a secret of so few is guessed"),
        "{stderr}"
    );
    let ok = common::check_config(
        &path,
        &[(
            "SENTINEL_JWT_SECRET",
            Some("0123456789abcdef0123456789abcdef"),
        )],
    );
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}

/// An address listed twice, or a health check that waits longer than its interval, works
/// but not as written: said, with the place.
#[test]
fn check_warns_of_an_upstream_written_twice_over() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, out) = common::check_body(
        dir.path(),
        "[redis]\nurl = \"redis://127.0.0.1:1\"\n\
         [upstreams.app]\naddrs = [\"127.0.0.1:9001\", \"127.0.0.1:9001\"]\n\
         health_check = { path = \"/h\", interval_ms = 200, timeout_ms = 5000 }\n\
         [[routes]]\nendpoint_id = \"a.open\"\npath_prefix = \"/a\"\nupstream = \"app\"\nalgorithm = \"none\"\n",
        &[],
    );
    assert!(ok, "{out}");
    assert!(
        out.contains(":6:28: upstreams.app.addrs entry \"127.0.0.1:9001\" is 127.0.0.1:9001 again"),
        "{out}"
    );
    assert!(
        out.contains(":7:63: upstreams.app.health_check.timeout_ms = 5000 is longer than its interval_ms = 200"),
        "{out}"
    );
}

/// An admin listener other hosts can reach, without a token: `/reload`, `DELETE /limits` and
/// `/metrics` for anyone, which `check` says (it is not refused: a firewall may stand in
/// front). A `SENTINEL_REDIS_URL` set but empty counts as unset.
#[test]
fn an_open_admin_listener_is_warned_of_and_an_empty_redis_url_is_unset() {
    let dir = tempfile::tempdir().unwrap();
    let routes = "[upstreams.a]\naddrs = [\"127.0.0.1:9\"]\n[[routes]]\nendpoint_id = \"x\"\npath = \"/x\"\nupstream = \"a\"\nalgorithm = \"none\"\n";
    let open = format!(
        "admin_listen = \"0.0.0.0:{}\"\n{routes}",
        common::free_port()
    );
    let (ok, out) = common::check_body(dir.path(), &open, &[]);
    assert!(ok, "{out}");
    assert!(
        out.contains(
            "is reachable from other hosts and no admin_token_env (or admin_token_file) is set"
        ),
        "{out}"
    );
    // An IPv4-mapped loopback address is loopback.
    let mapped = format!(
        "admin_listen = \"[::ffff:127.0.0.1]:{}\"\n{routes}",
        common::free_port()
    );
    let (ok, out) = common::check_body(dir.path(), &mapped, &[]);
    assert!(ok && !out.contains("reachable from other hosts"), "{out}");
    let (ok, out) = common::check_body(dir.path(), routes, &[("SENTINEL_REDIS_URL", Some(""))]);
    assert!(ok, "{out}");
    assert!(
        !out.contains("warn") && !out.contains("SENTINEL_REDIS_URL"),
        "{out}"
    );
}

/// Without `--config`, the gateway reads `./gateway.toml`: `check` with no flag, run where the
/// file is, checks it (and names it).
#[test]
fn without_config_the_file_is_gateway_toml_here() {
    let dir = tempfile::tempdir().unwrap();
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/single-api.toml");
    std::fs::copy(&shipped, dir.path().join("gateway.toml")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sentinel-gateway"))
        .arg("check")
        .current_dir(dir.path())
        .env_remove("SENTINEL_REDIS_URL")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout
            .lines()
            .last()
            .is_some_and(|l| l.starts_with("gateway.toml: ok, ")),
        "{stdout}"
    );
    // And an empty folder has none to read: exit 2, naming it.
    let empty = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sentinel-gateway"))
        .arg("check")
        .current_dir(empty.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("gateway.toml"));
}

/// An SNI name its certificate does not carry is served all the same (the file loads) and
/// said where it is written, with the names the certificate does carry: every client that
/// checks the certificate would refuse the handshake.
#[test]
fn an_sni_name_its_certificate_does_not_carry_is_said() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tls.toml");
    let written = std::fs::read_to_string(root.join("examples/tls.toml"))
        .unwrap()
        .replace(
            "\"tls/",
            &format!("\"{}/", root.join("examples/tls").display()),
        )
        .replace(
            r#"server_names = ["api.pdftalk.example"]"#,
            r#"server_names = ["api.pdftalk.example", "eu.resumint.example"]"#,
        );
    std::fs::write(&path, written).unwrap();
    let (code, stdout, stderr) = check(&path);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("ok, "), "{stdout}");
    let warning = format!(
        "warning: {}:{}: server.tls[0].sni[0].server_names: \"eu.resumint.example\" is not among the names of its certificate (cert_path = \"{}/pdftalk.pem\" names api.pdftalk.example): a client that checks the certificate refuses the handshake",
        path.display(),
        position_of(&path, "\"eu.resumint.example\""),
        root.join("examples/tls").display()
    );
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        [warning.as_str()],
        "{stderr}"
    );
}

/// An access log in a directory this process may not write (another user's) is warned of by
/// `check`, with the user it runs as (the gateway's may differ), rather than found by a start
/// that exits 1.
#[test]
fn an_access_log_the_process_may_not_write_is_warned_of() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    std::fs::create_dir(&logs).unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(
        &path,
        "[upstreams.app]\naddrs = [\"127.0.0.1:9001\"]\n[access_log]\npath = \"logs/access.log\"\n\
         [[routes]]\nendpoint_id = \"a\"\npath_prefix = \"/\"\nupstream = \"app\"\nalgorithm = \"none\"\n",
    )
    .unwrap();
    let open = std::fs::Permissions::from_mode(0o755);
    std::fs::set_permissions(dir.path(), open.clone()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    // Root may write anywhere: the check is run as `nobody` then; otherwise the directory is
    // made read-only to its owner.
    // SAFETY: no arguments; reads the process's effective user.
    let root = unsafe { libc::geteuid() } == 0;
    let uid = if root {
        65534
    } else {
        unsafe { libc::getuid() }
    };
    let out = if root {
        std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(env!("CARGO_BIN_EXE_sentinel-gateway"))
            .args(["check", "--config"])
            .arg(&path)
            .env_remove("SENTINEL_REDIS_URL")
            .output()
            .expect("setpriv (util-linux) runs, to check as another user than root")
    } else {
        std::fs::set_permissions(&logs, std::fs::Permissions::from_mode(0o555)).unwrap();
        common::check_config(&path, &[("SENTINEL_REDIS_URL", None)])
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!(
            ":4:8: access_log.path = \"logs/access.log\" cannot be written by this process: {}: Permission denied (os error 13) (user {uid}): a start as this user would exit 1",
            logs.display()
        )),
        "{stderr}"
    );
    std::fs::set_permissions(&logs, open).unwrap();
}

/// An access log named as a file the gateway reads is refused however it is named: here a
/// hard link to the config file itself, into which its lines would be written.
#[test]
fn an_access_log_at_a_hard_link_of_the_config_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(
        &path,
        "[upstreams.app]\naddrs = [\"127.0.0.1:9001\"]\n[access_log]\npath = \"linked.log\"\n\
         [[routes]]\nendpoint_id = \"a\"\npath_prefix = \"/\"\nupstream = \"app\"\nalgorithm = \"none\"\n",
    )
    .unwrap();
    std::fs::hard_link(&path, dir.path().join("linked.log")).unwrap();
    let (code, _, stderr) = check(&path);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains(":4:8: access_log.path = \"linked.log\" is the config file itself, which the gateway reads"),
        "{stderr}"
    );
}

/// A `[::]:P` listener is bound IPv6 only beside an IPv4 listener of its port (nginx's
/// `0.0.0.0:P` and `[::]:P` pair starts so); beside a single IPv4 address, the host's other
/// IPv4 addresses are then served on that port by no listener: said, where the pair with the
/// IPv4 wildcard is not.
#[test]
fn listen_addresses_that_would_not_serve_as_meant_are_warned_of() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    let rest = "[upstreams.app]\naddrs = [\"127.0.0.1:9001\"]\n\
                [[routes]]\nendpoint_id = \"e\"\npath_prefix = \"/\"\nupstream = \"app\"\nalgorithm = \"none\"\n";
    std::fs::write(
        &path,
        format!("[server]\nlisten = [\"[::]:8080\", \"127.0.0.1:8080\"]\n{rest}"),
    )
    .unwrap();
    let (code, _, stderr) = check(&path);
    assert_eq!(code, 0, "{stderr}");
    let file = path.display();
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        [format!("warning: {file}:{}: server.listen = \"[::]:8080\" is bound IPv6 only beside the IPv4 listener \"127.0.0.1:8080\" of its port: IPv4 clients of the host's other addresses are not taken on port 8080 (add \"0.0.0.0:8080\", or give that listener another port)", position_of(&path, "\"[::]:8080\""))]
    );
    std::fs::write(
        &path,
        format!("[server]\nlisten = [\"0.0.0.0:8080\", \"[::]:8080\"]\n{rest}"),
    )
    .unwrap();
    let (code, _, stderr) = check(&path);
    assert_eq!((code, stderr.as_str()), (0, ""));
    // An address the host does not have (TEST-NET-1): the start would fail to bind it.
    std::fs::write(
        &path,
        format!("[server]\nlisten = [\"192.0.2.1:8080\", \"127.0.0.1:8081\"]\n{rest}"),
    )
    .unwrap();
    let (code, _, stderr) = check(&path);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        [format!("warning: {file}:{}: server.listen = \"192.0.2.1:8080\": 192.0.2.1 is not an address of this host, so a start here would fail to bind it (fine if the file is for another host)", position_of(&path, "\"192.0.2.1:8080\""))]
    );
    // An IPv6 identity keyed by a network wider than a site's.
    std::fs::write(
        &path,
        format!("[server]\nipv6_identity_prefix = 32\n{rest}"),
    )
    .unwrap();
    let (code, _, stderr) = check(&path);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains(
            ":2:24: server.ipv6_identity_prefix = 32 keys IPv6 clients by networks of 32 bits"
        ),
        "{stderr}"
    );
}

/// A `Strict-Transport-Security` value is taken as browsers take it: directive names in any
/// case, a quoted max-age; a directive written twice makes browsers ignore the field, so it
/// is refused.
#[test]
fn a_strict_transport_security_value_is_read_as_browsers_read_it() {
    let dir = tempfile::tempdir().unwrap();
    for (value, taken) in [
        ("MAX-AGE=10; INCLUDESUBDOMAINS", true),
        ("max-age=\\\"31536000\\\"; preload", true),
        ("max-age=1; max-age=2", false),
        ("max-age=1; includeSubDomains; includesubdomains", false),
        ("max-age=-1", false),
    ] {
        let (ok, out) = common::check_body(
            dir.path(),
            &format!("strict_transport_security = \"{value}\""),
            &[],
        );
        assert_eq!(ok, taken, "{value}: {out}");
        // No TLS listener here: said to go nowhere.
        if taken {
            assert!(
                out.contains("there is no [[server.tls]]: it is sent nowhere"),
                "{out}"
            );
        }
    }
}

/// A never-refilled quota keyed by `client_ip` is warned of while IPv6 clients are keyed by
/// more than a /64 (every address a client's /64 holds is a key kept for good), and not
/// once they are keyed by their /64.
#[test]
fn a_quota_keyed_by_whole_ipv6_addresses_is_warned_of() {
    let dir = tempfile::tempdir().unwrap();
    let route = Route::new("q.quota")
        .prefix("/q")
        .identity("client_ip")
        .token_bucket(3_000_000, 0)
        .toml();
    let body =
        |prefix: &str| format!("{prefix}[upstreams.app]\naddrs = [\"127.0.0.1:9001\"]\n{route}");
    let (ok, out) = common::check_body(dir.path(), &body(""), &[]);
    assert!(ok, "{out}");
    assert!(
        out.contains("with identity = \"client_ip\" keyed by IPv6 addresses of 128 bits (server.ipv6_identity_prefix) every address of a client's /64 is a key kept for good"),
        "{out}"
    );
    let (ok, out) = common::check_body(dir.path(), &body("ipv6_identity_prefix = 64\n"), &[]);
    assert!(ok && !out.contains("never refills"), "{out}");
}

/// `check`'s line for a route that does CORS names its origins, as a browser writes them.
#[test]
fn a_routes_line_names_its_cors_origins() {
    let dir = tempfile::tempdir().unwrap();
    let route = Route::new("c.api")
        .prefix("/c")
        .identity("client_ip")
        .token_bucket(3_000_000, 1_000_000)
        .set(
            "cors_origins",
            r#"["HTTPS://App.Example.com:443", "http://localhost:3000"]"#,
        )
        .toml();
    let body = format!("[upstreams.app]\naddrs = [\"127.0.0.1:9001\"]\n{route}");
    let (ok, out) = common::check_body(dir.path(), &body, &[]);
    assert!(ok, "{out}");
    assert!(
        out.contains("; CORS for https://app.example.com, http://localhost:3000; policy v1"),
        "{out}"
    );
}

/// A route's line says its upstream is spoken to over HTTP/2 (`http2 = true`), and `check`
/// warns when no listener takes HTTP/2 from the gRPC clients such an upstream is for.
#[test]
fn a_routes_line_says_an_http2_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let route = Route::new("g.echo").prefix("/echo.Echo").unlimited().toml();
    let body = format!("[upstreams.app]\naddrs = [\"127.0.0.1:50051\"]\nhttp2 = true\n{route}");
    let (ok, out) = common::check_body(dir.path(), &body, &[]);
    assert!(ok, "{out}");
    assert!(
        out.contains("g.echo: any method /echo.Echo/** -> app (HTTP/2); not limited"),
        "{out}"
    );
    let warned = "upstreams.app has http2 = true, but no listener takes HTTP/2 from clients";
    assert!(out.contains(warned), "{out}");
    let (ok, out) = common::check_body(dir.path(), &format!("h2c = true\n{body}"), &[]);
    assert!(ok && !out.contains(warned), "{out}");
}
