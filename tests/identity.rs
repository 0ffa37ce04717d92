//! Identity and hostile input: forged tokens, spoofed X-Forwarded-For and path tricks get
//! 401, 400 or the same bucket as the honest request, never an unlimited pass.

mod common;

use common::config::{GatewayConfig, Route};
use common::{client, raw_request, Gateway, Redis, Upstream};
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use sentinel_gateway::limiter::bucket_key;

const SECRET: &str = "0123456789abcdef0123456789abcdef";

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn jwt(sub: &str, key: &str) -> String {
    let claims = serde_json::json!({"sub": sub, "exp": now() + 300});
    encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(key.as_bytes()).unwrap(),
    )
    .unwrap()
}

/// Gateway defaults but for HS256 JWTs signed with `SECRET`, the upstream `app` at `up`,
/// and the `[server]` fields in `server` (name and TOML literal).
fn start(redis: &Redis, up: &Upstream, server: &[(&str, &str)], routes: &[Route]) -> Gateway {
    let mut config = GatewayConfig::bare(&redis.url());
    for (field, literal) in server {
        config = config.server(field, *literal);
    }
    config = config
        .section("[auth.jwt]\nsecret_env = \"SENTINEL_JWT_SECRET\"\nalgorithms = [\"HS256\"]\n")
        .upstream("app", &[up.addr()]);
    for route in routes {
        config = config.route(route.clone());
    }
    config.start_with_env(&[("SENTINEL_JWT_SECRET", SECRET)])
}

/// Sends `GET <target>` as raw bytes (a URL library would normalize it first).
fn get_target(port: u16, target: &[u8]) -> Option<u16> {
    let mut req = b"GET ".to_vec();
    req.extend_from_slice(target);
    req.extend_from_slice(b" HTTP/1.1\r\nHost: x\r\nX-API-Key: k\r\nConnection: close\r\n\r\n");
    raw_request(port, &req)
}

/// A token bucket of 100 requests that never refills: room for every request these tests send.
fn limited(id: &str, prefix: &str) -> Route {
    Route::new(id).prefix(prefix).token_bucket(100_000_000, 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwt_subjects_get_their_own_buckets_and_forgeries_get_401_without_redis() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = start(
        &redis,
        &up,
        &[],
        &[limited("t.jwt", "/api").identity("jwt")],
    );
    let http = client();
    for sub in ["tenant-a", "tenant-b"] {
        let r = http
            .get(gw.url("/api/x"))
            .bearer_auth(jwt(sub, SECRET))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let mut keys = vec![
        bucket_key("sentinel", "jwt:tenant-a", "t.jwt", 1),
        bucket_key("sentinel", "jwt:tenant-b", "t.jwt", 1),
    ];
    keys.sort();
    assert_eq!(redis.keys("sentinel:*"), keys);

    redis.reset_stats();
    let forged = [
        format!(
            "Bearer {}",
            jwt("tenant-a", "wrong-secret-wrong-secret-wrong-secret")
        ),
        "Bearer eyJhbGciOiJub25lIn0.eyJzdWIiOiJ4IiwiZXhwIjo5OTk5OTk5OTk5fQ.".to_owned(),
        "Bearer garbage".to_owned(),
        format!("Basic {}", jwt("tenant-a", SECRET)),
        format!("Bearer {}", "a".repeat(20_000)),
    ];
    for auth in &forged {
        let r = http
            .get(gw.url("/api/x"))
            .header("authorization", auth.as_str())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{}", &auth[..auth.len().min(40)]);
        assert_eq!(r.headers()["www-authenticate"], "Bearer");
        assert_eq!(
            r.text().await.unwrap(),
            r#"{"detail":"authentication required"}"#
        );
    }
    let r = http.get(gw.url("/api/x")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        redis.limiter_calls(),
        0,
        "no Redis call for a refused token"
    );
    assert_eq!(
        gw.metric(r#"sentinel_requests_total{endpoint_id="t.jwt",status="401"}"#),
        forged.len() as f64 + 1.0
    );
}

/// The HMAC algorithms listed are each taken; one not listed is 401, whatever its signature.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_listed_hmac_algorithm_is_taken_and_no_other() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::bare(&redis.url())
        .section(
            "[auth.jwt]\nsecret_env = \"SENTINEL_JWT_SECRET\"\nalgorithms = [\"HS384\", \"HS512\"]\n",
        )
        .upstream("app", &[up.addr()])
        .route(limited("t.jwt", "/api").identity("jwt"))
        .start_with_env(&[("SENTINEL_JWT_SECRET", SECRET)]);
    let http = client();
    for (alg, want) in [
        (Algorithm::HS384, 200),
        (Algorithm::HS512, 200),
        (Algorithm::HS256, 401),
    ] {
        let claims = serde_json::json!({"sub": format!("{alg:?}"), "exp": now() + 300});
        let token = encode(
            &Header::new(alg),
            &claims,
            &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
        )
        .unwrap();
        let status =
            common::status_past_a_busy_start(|| http.get(gw.url("/api/x")).bearer_auth(&token))
                .await;
        assert_eq!(status, want, "{alg:?}");
    }
}

/// `[auth.jwt]`'s `issuer` (two of them), `audiences`, `required_claims` and
/// `leeway_seconds` as written in gateway.toml: a token of another issuer or audience,
/// without a required claim's value, expired or not yet valid past the leeway, is 401 before
/// any Redis call; one within the leeway is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_issuer_audience_and_leeway_of_the_file_are_checked() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = GatewayConfig::bare(&redis.url())
        .section(
            "[auth.jwt]\nsecret_env = \"SENTINEL_JWT_SECRET\"\nalgorithms = [\"HS256\"]\n\
             issuer = [\"https://idp.example/\", \"idp.example\"]\naudiences = [\"pdftalk-api\"]\n\
             required_claims = { token_use = \"access\" }\nleeway_seconds = 30\n",
        )
        .upstream("app", &[up.addr()])
        .route(limited("t.jwt", "/api").identity("jwt"))
        .start_with_env(&[("SENTINEL_JWT_SECRET", SECRET)]);
    let token = |claims: serde_json::Value| {
        encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
        )
        .unwrap()
    };
    let (iss, aud, t) = ("https://idp.example/", "pdftalk-api", now());
    let cases = [
        (
            serde_json::json!({"sub": "a", "iss": iss, "aud": aud, "exp": t + 300}),
            200,
        ),
        (
            serde_json::json!({"sub": "a", "iss": "idp.example", "aud": aud, "exp": t + 300}),
            200,
        ),
        (
            serde_json::json!({"sub": "a", "iss": iss, "aud": aud, "exp": t + 300, "token_use": "id"}),
            401,
        ),
        (
            serde_json::json!({"sub": "a", "iss": "https://other.example/", "aud": aud, "exp": t + 300}),
            401,
        ),
        (
            serde_json::json!({"sub": "a", "aud": aud, "exp": t + 300}),
            401,
        ),
        (
            serde_json::json!({"sub": "a", "iss": iss, "aud": "another-api", "exp": t + 300}),
            401,
        ),
        // Expired 10 s ago: within the leeway. 90 s ago: past it.
        (
            serde_json::json!({"sub": "a", "iss": iss, "aud": aud, "exp": t - 10}),
            200,
        ),
        (
            serde_json::json!({"sub": "a", "iss": iss, "aud": aud, "exp": t - 90}),
            401,
        ),
        // Valid from 10 s on: within the leeway. From 90 s on: not yet.
        (
            serde_json::json!({"sub": "a", "iss": iss, "aud": aud, "exp": t + 300, "nbf": t + 10}),
            200,
        ),
        (
            serde_json::json!({"sub": "a", "iss": iss, "aud": aud, "exp": t + 300, "nbf": t + 90}),
            401,
        ),
    ];
    // Each an access token but where it says otherwise.
    let cases = cases.map(|(mut claims, want)| {
        if claims.get("token_use").is_none() {
            claims["token_use"] = serde_json::json!("access");
        }
        (claims, want)
    });
    let http = client();
    // A first decision moves the gateway's Redis connection to the proxy's workers, which a
    // loaded machine can stretch past the budget: made first, until admitted.
    let warm = token(
        serde_json::json!({"sub": "warm", "iss": iss, "aud": aud, "exp": t + 300, "token_use": "access"}),
    );
    common::wait_until(
        std::time::Duration::from_secs(10),
        "a first admission",
        || {
            let rt = tokio::runtime::Handle::current();
            tokio::task::block_in_place(|| {
                rt.block_on(http.get(gw.url("/api/x")).bearer_auth(&warm).send())
            })
            .is_ok_and(|r| r.status() == 200)
        },
    );
    redis.reset_stats();
    for (claims, want) in &cases {
        let r = http
            .get(gw.url("/api/x"))
            .bearer_auth(token(claims.clone()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), *want, "{claims}");
    }
    let admitted = cases.iter().filter(|(_, w)| *w == 200).count() as u64;
    assert_eq!(
        redis.command_calls("evalsha"),
        admitted,
        "only the taken ones reach Redis"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_for_counts_only_from_trusted_proxies() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let untrusted = start(
        &redis,
        &up,
        &[],
        &[limited("t.ip", "/ip").identity("client_ip")],
    );
    let http = client();
    for xff in ["1.1.1.1", "2.2.2.2", "3.3.3.3, 4.4.4.4"] {
        let r = http
            .get(untrusted.url("/ip"))
            .header("x-forwarded-for", xff)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    assert_eq!(
        redis.keys("sentinel:*"),
        vec![bucket_key("sentinel", "ip:127.0.0.1", "t.ip", 1)],
        "spoofing changed nothing"
    );
    drop(untrusted);

    let redis = Redis::start();
    let trusted = start(
        &redis,
        &up,
        // Written as IPv4-mapped IPv6 (a dual-stack habit): they are the IPv4 networks.
        &[(
            "trusted_proxies",
            "[\"::ffff:127.0.0.0/104\", \"::ffff:10.0.0.5\"]",
        )],
        &[limited("t.ip", "/ip").identity("client_ip")],
    );
    for (xff, want) in [("9.9.9.9, 1.1.1.1, 10.0.0.5", 200), ("not-an-ip", 400)] {
        let r = http
            .get(trusted.url("/ip"))
            .header("x-forwarded-for", xff)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), want, "{xff}");
    }
    let r = http.get(trusted.url("/ip")).send().await.unwrap();
    assert_eq!(r.status(), 200, "no header: the peer");
    let mut want = vec![
        bucket_key("sentinel", "ip:1.1.1.1", "t.ip", 1),
        bucket_key("sentinel", "ip:127.0.0.1", "t.ip", 1),
    ];
    want.sort();
    assert_eq!(
        redis.keys("sentinel:*"),
        want,
        "right-most untrusted hop; the peer without a header; an unusable one charges nobody"
    );
}

/// With `ipv6_identity_prefix = 64`, an IPv6 client is keyed by its /64 (a home line or a
/// cloud instance holds 2^64 addresses: each was a bucket of its own), an IPv4 client by its
/// address as before; `/limits` reads an address of the network as the network.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_client_is_one_caller_for_its_whole_prefix() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = start(
        &redis,
        &up,
        &[
            ("trusted_proxies", "[\"127.0.0.1/32\"]"),
            ("ipv6_identity_prefix", "64"),
        ],
        &[Route::new("t.ip")
            .prefix("/ip")
            .identity("client_ip")
            .token_bucket(2_000_000, 0)],
    );
    let http = client();
    let mut statuses = Vec::new();
    for client in [
        "2001:db8:1:1::1",
        "2001:db8:1:1::2",
        "[2001:db8:1:1:ffff::9]:4711",
        "2001:db8:1:2::1",
        "10.0.0.1",
        "10.0.0.2",
    ] {
        let r = http
            .get(gw.url("/ip"))
            .header("x-forwarded-for", client)
            .send()
            .await
            .unwrap();
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 200, 200, 200]);
    let mut want = vec![
        bucket_key("sentinel", "ip:2001:db8:1:1::/64", "t.ip", 1),
        bucket_key("sentinel", "ip:2001:db8:1:2::/64", "t.ip", 1),
        bucket_key("sentinel", "ip:10.0.0.1", "t.ip", 1),
        bucket_key("sentinel", "ip:10.0.0.2", "t.ip", 1),
    ];
    want.sort();
    assert_eq!(redis.keys("sentinel:*"), want);
    let (status, body) =
        common::blocking_get(&gw.admin("/limits/t.ip?identity=ip%3A2001%3Adb8%3A1%3A1%3A%3A77"))
            .unwrap();
    assert_eq!(status, 200, "{body}");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(view["limits"][0]["remaining"], 0, "{view}");
    // A reload to another length moves every IPv6 caller to a fresh bucket: said.
    let text = std::fs::read_to_string(&gw.config_path).unwrap();
    let text = text.replace("ipv6_identity_prefix = 64", "ipv6_identity_prefix = 56");
    std::fs::write(&gw.config_path, text).unwrap();
    let (status, body) = gw.reload_answer();
    assert_eq!(status, 200, "{body}");
    let logs = gw.logs();
    let said = logs
        .lines()
        .find(|l| l.contains("changed server.ipv6_identity_prefix from 64 to 56"))
        .unwrap_or_else(|| panic!("{logs}"));
    assert!(said.contains(r#""level":"WARN""#), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_tricks_hit_the_same_bucket_or_get_400() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let routes = [
        limited("t.api", "/api/v1").identity_header("X-API-Key"),
        Route::new("t.login")
            .path("/login")
            .token_bucket(100_000_000, 0)
            .identity_header("X-API-Key"),
        Route::new("t.rest").prefix("/").unlimited(),
    ];
    let gw = start(&redis, &up, &[], &routes);
    let tricks: &[&[u8]] = &[
        b"/api/v1/doc",
        b"//api/v1/doc",
        b"/api//v1///doc",
        b"/./api/./v1/doc",
        b"/x/../api/v1/doc",
        b"/x/%2e%2e/api/v1/doc",
        b"/%61pi/v1/%64oc",
        b"/api/v1/doc/",
        b"/api/v1/doc/.",
        b"http://x/api/v1/doc",
        // Path parameters that do not change the route, with them or without (as Java
        // backends read a path).
        b"/api/v1/doc;x",
        b"/api/v1/doc;jsessionid=1/more",
        // A parameter on the last segment, emptied: a trailing slash to every reader.
        b"/api/v1/;jsessionid=1",
        // Trailing dots and spaces that do not change the route, with them or without (as
        // Windows servers read a path).
        b"/api/v1/doc.",
        b"/api/v1/doc%20",
        b"/api/v1/doc.%20./more",
    ];
    for path in tricks {
        assert_eq!(
            get_target(gw.port, path),
            Some(200),
            "{}",
            String::from_utf8_lossy(path)
        );
    }
    assert_eq!(
        gw.metric(r#"sentinel_decisions_total{allowed="true",decision_reason="allowed",endpoint_id="t.api"}"#),
        tricks.len() as f64,
        "every variant was decided on the limited route's bucket"
    );
    assert_eq!(redis.keys("sentinel:*").len(), 1);
    // Forwarded with its parameters: the normalized path, as every path.
    let r = client()
        .get(gw.url("/api/v1/doc;x"))
        .header("X-API-Key", "k")
        .send()
        .await
        .unwrap();
    let echo: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
    assert_eq!(echo["path"], "/api/v1/doc;x");
    let bad: &[&[u8]] = &[
        b"http://evil.example/api/v1/doc",
        b"/api/v1/..%2f..%2fdoc",
        b"/api%2fv1/doc",
        b"/api/v1/%5c",
        b"/api/v1/%00",
        b"/api/v1/%c0%af",
        b"/../api/v1",
        // Path parameters that do change it: a backend that reads them (most) and one that
        // drops them (Java's) would serve different routes' paths.
        b"/api;x/v1/doc",
        b"/api/v1;jsessionid=1/doc",
        b"/x/..;/api/v1/doc",
        b"/;x/api/v1/doc",
        b"/api/v1/..;/doc",
        b"/..;/api/v1",
        // A parameter on an empty or dot segment, which Java backends read in two ways
        // (Tomcat drops the emptied segment, Jetty keeps it: `/api/v1/doc` to Jetty).
        b"/api/v1;/;/..;/doc",
        b"/api/v1/;x/doc",
        // Older Undertow ends the path at its first `;`: `/login` to it.
        b"/login;x/foo",
        // Windows servers trim a segment's trailing dots and spaces: `/login` and
        // `/api/v1/...` to them, the catch-all's as written.
        b"/login.",
        b"/login%20",
        b"/login..%20",
        // With a parameter after them: `/login.` to a Java reading, `/login` to Windows.
        b"/login.;x",
        b"/login%20;jsessionid=1",
        b"/api./v1/doc",
        b"/api/v1%20/doc",
        // A segment of dots and spaces only: nothing to a Windows server.
        b"/x/.../api",
        b"/x/.%20/api",
    ];
    for path in bad {
        assert_eq!(
            get_target(gw.port, path),
            Some(400),
            "{}",
            String::from_utf8_lossy(path)
        );
    }
    let long = format!(
        "GET /api/v1/{} HTTP/1.1\r\nHost: x\r\nX-API-Key: k\r\n\r\n",
        "a".repeat(9000)
    );
    assert_eq!(raw_request(gw.port, long.as_bytes()), Some(400));
    // Without a catch-all, a path that only the reading without parameters routes (a Java
    // session id on the route's own last segment) goes to that route, and is charged there.
    // Two routes of one endpoint serve alike, whichever of them a reading picks.
    let bare = start(
        &redis,
        &up,
        &[],
        &[
            limited("t.bare", "/api/v1").identity_header("X-API-Key"),
            limited("t.shop", "/shop").identity_header("X-API-Key"),
            limited("t.shop", "/shop/cart").identity_header("X-API-Key"),
        ],
    );
    assert_eq!(get_target(bare.port, b"/api/v1;jsessionid=A1"), Some(200));
    assert_eq!(get_target(bare.port, b"/api;x/v2"), Some(404));
    // Older Undertow's `/api` has no route either: as the path as written.
    assert_eq!(get_target(bare.port, b"/api;jsessionid=A1/v1"), Some(200));
    assert_eq!(
        get_target(bare.port, b"/shop/cart;jsessionid=A1"),
        Some(200)
    );
    for (endpoint, admitted) in [("t.bare", 2.0), ("t.shop", 1.0)] {
        assert_eq!(
            bare.metric(&format!(r#"sentinel_decisions_total{{allowed="true",decision_reason="allowed",endpoint_id="{endpoint}"}}"#)),
            admitted,
            "{endpoint}"
        );
    }
    let huge_header = format!(
        "GET /api/v1/doc HTTP/1.1\r\nHost: x\r\nX-API-Key: k\r\nX-Big: {}\r\n\r\n",
        "b".repeat(200_000)
    );
    assert_eq!(raw_request(gw.port, huge_header.as_bytes()), Some(431));
    let giant_header = format!(
        "GET /api/v1/doc HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "b".repeat(2_000_000)
    );
    let status = raw_request(gw.port, giant_header.as_bytes());
    assert!(
        status.is_none_or(|s| (400..500).contains(&s)),
        "2 MB header: {status:?}"
    );
    // Still alive and still limiting.
    assert_eq!(
        raw_request(
            gw.port,
            b"GET /api/v1/doc HTTP/1.1\r\nHost: x\r\nX-API-Key: k\r\nConnection: close\r\n\r\n"
        ),
        Some(200)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_identities_keep_process_memory_flat() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    // Memory is what is measured here, not latency: 8 busy clients against a debug build on
    // two shared cores can hold a decision past the 20 ms default, so the budget is wide.
    let gw = GatewayConfig::bare(&redis.url())
        .redis("timeout_ms", "1000")
        .upstream("app", &[up.addr()])
        .route(limited("t.many", "/m").identity_header("X-API-Key"))
        .start();
    let http = client();
    let send_batch = |from: usize, n: usize| {
        let (http, url) = (http.clone(), gw.url("/m"));
        async move {
            let tasks: Vec<_> = (0..8)
                .map(|w| {
                    let (http, url) = (http.clone(), url.clone());
                    tokio::spawn(async move {
                        for i in (from + w..from + n).step_by(8) {
                            let r = http
                                .get(&url)
                                .header("X-API-Key", format!("key-{i}"))
                                .send()
                                .await
                                .unwrap();
                            assert_eq!(r.status(), 200);
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        }
    };
    send_batch(0, 2_000).await;
    let before = gw.rss_kib();
    send_batch(2_000, 20_000).await;
    let after = gw.rss_kib();
    assert_eq!(redis.keys("sentinel:*").len(), 22_000);
    // No per-identity state in the process: 20 000 new identities may not grow it by 8 MiB
    // (allocator noise is well under that; per-identity state would be far over it).
    assert!(
        after < before + 8 * 1024,
        "RSS grew from {before} KiB to {after} KiB"
    );
}

/// `forward_identity = true` on a JWT route: the upstream is told the verified claim as the
/// identity string `/limits` takes, `%XX` where a field value could not carry it as is or a
/// query would read it otherwise (one percent-decoding gives it back, so it is a ready
/// `identity=` query); the client's own word under those names is dropped on every route,
/// from a trusted peer too (a load balancer passes on what its client wrote).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_is_told_the_verified_subject() {
    let (redis, up) = (Redis::start(), Upstream::start("app"));
    let routes = [
        limited("i.fwd", "/fwd")
            .identity("jwt")
            .set("forward_identity", "true"),
        limited("i.plain", "/plain").identity("jwt"),
        Route::new("i.open").prefix("/open").unlimited(),
    ];
    let untrusted = start(&redis, &up, &[("h2c", "true")], &routes);
    let trusted = start(
        &redis,
        &up,
        &[("trusted_proxies", "[\"127.0.0.1/32\"]"), ("h2c", "true")],
        &routes,
    );
    let subject = "José Q. 50%\u{1}&tier=pro#x+y?\"<a>@b";
    let token = jwt(subject, SECRET);
    // Over HTTP/1.1 (the gateway's own value not to be taken away by the hop-by-hop rule)
    // and h2c alike.
    let told = |gw: &Gateway, path: &str| {
        let (url, token) = (gw.url(path), token.clone());
        async move {
            let mut seen = Vec::new();
            for h2 in [false, true] {
                let request = match h2 {
                    false => client()
                        .get(&url)
                        .header("Connection", "X-Sentinel-Identity, X-Sentinel-Tier"),
                    true => common::h2c_client().get(&url),
                };
                seen.push(told_by(request, &token).await);
            }
            assert_eq!(seen[0], seen[1], "HTTP/1.1 and h2c alike");
            seen.remove(0)
        }
    };
    async fn told_by(
        request: reqwest::RequestBuilder,
        token: &str,
    ) -> (Option<String>, Option<String>) {
        {
            let r = request
                .bearer_auth(token)
                .header("X-Sentinel-Identity", "jwt:admin")
                .header("X-Sentinel-Tier", "gold")
                .header("X_Sentinel_Identity", "jwt:admin")
                .header("X-Sentinel.Tier", "gold")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let echo: serde_json::Value = serde_json::from_str(&r.text().await.unwrap()).unwrap();
            let field = |n: &str| echo["headers"][n].as_str().map(str::to_owned);
            assert_eq!(field("x_sentinel_identity"), None);
            assert_eq!(field("x-sentinel.tier"), None, "a spelling CGI folds alike");
            (field("x-sentinel-identity"), field("x-sentinel-tier"))
        }
    }
    let sent = "jwt:Jos%C3%A9%20Q.%2050%25%01%26tier%3Dpro%23x%2By%3F%22%3Ca%3E%40b".to_owned();
    assert_eq!(told(&untrusted, "/fwd/a").await, (Some(sent.clone()), None));
    assert_eq!(told(&untrusted, "/plain/a").await, (None, None));
    assert_eq!(told(&untrusted, "/open/a").await, (None, None));
    assert_eq!(told(&trusted, "/fwd/a").await, (Some(sent.clone()), None));
    assert_eq!(
        told(&trusted, "/plain/a").await,
        (None, None),
        "what a trusted proxy passes on under these names is its client's word"
    );

    // The value is the query `/limits` takes for the bucket the request spent.
    let limits = client()
        .get(untrusted.admin(&format!("/limits/i.fwd?identity={sent}")))
        .send()
        .await
        .unwrap();
    assert_eq!(limits.status(), 200);
    let limits: serde_json::Value = serde_json::from_str(&limits.text().await.unwrap()).unwrap();
    assert_eq!(
        limits["identity_hash"],
        sentinel_gateway::limiter::identity_hash(&format!("jwt:{subject}")).as_str()
    );
}
