//! JWTs from an identity provider, against the binary: RS256 / ES256 / ES384 / EdDSA tokens verified
//! with the keys of a JWKS file (`tests/fixtures/jwt`: test keys made for this suite), the
//! `kid` picking the key, `iss` and `aud` checked, the bucket named by `identity_claim`.

mod common;

use std::path::{Path, PathBuf};

use common::config::{quoted, GatewayConfig, Route};
use common::{client, Redis, Upstream};
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use sentinel_gateway::limiter::bucket_key;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/jwt")
        .join(name)
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn token(alg: Algorithm, kid: Option<&str>, key_file: &str, claims: serde_json::Value) -> String {
    let der = std::fs::read(fixture(key_file)).unwrap();
    let key = match alg {
        Algorithm::ES256 | Algorithm::ES384 => EncodingKey::from_ec_der(&der),
        Algorithm::EdDSA => EncodingKey::from_ed_der(&der),
        _ => EncodingKey::from_rsa_der(&der),
    };
    let mut header = Header::new(alg);
    header.kid = kid.map(str::to_owned);
    encode(&header, &claims, &key).unwrap()
}

fn jwt_section(extra: &str) -> String {
    format!(
        "[auth.jwt]\nalgorithms = [\"RS256\", \"ES256\", \"EdDSA\"]\njwks_path = {}\nissuer = \"https://idp.example/\"\naudiences = [\"pdftalk-api\"]\nidentity_claim = \"org_id\"\n{extra}",
        quoted(fixture("jwks.json").to_str().unwrap())
    )
}

/// A gateway whose `/api` route is limited by the JWT's identity, with `jwt` as its
/// `[auth.jwt]` section.
fn start(redis: &Redis, up: &Upstream, jwt: &str) -> common::Gateway {
    GatewayConfig::new(&redis.url())
        .section(jwt)
        .upstream("app", &[up.addr()])
        .route(
            Route::new("j.api")
                .prefix("/api")
                .identity("jwt")
                .token_bucket(100_000_000, 0),
        )
        .start()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_of_an_identity_provider_are_verified_with_its_jwks() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let gw = start(&redis, &up, &jwt_section(""));
    let http = client();
    let claims = |org: &str, aud: &str| serde_json::json!({"org_id": org, "sub": "user-1", "iss": "https://idp.example/", "aud": aud, "exp": now() + 60});
    for (alg, kid, key, org) in [
        (Algorithm::RS256, Some("rsa-1"), "rsa.der", "org-rsa"),
        (Algorithm::RS256, None, "rsa2.der", "org-rsa2"),
        (Algorithm::ES256, Some("ec-1"), "ec.der", "org-ec"),
        (Algorithm::EdDSA, Some("ed-1"), "ed.der", "org-ed"),
    ] {
        let r = http
            .get(gw.url("/api"))
            .bearer_auth(token(alg, kid, key, claims(org, "pdftalk-api")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{alg:?} {kid:?}");
    }
    let mut want: Vec<String> = ["org-rsa", "org-rsa2", "org-ec", "org-ed"]
        .iter()
        .map(|org| bucket_key("sentinel", &format!("jwt:{org}"), "j.api", 1))
        .collect();
    want.sort();
    assert_eq!(
        redis.keys("sentinel:*"),
        want,
        "one bucket per identity_claim value"
    );

    redis.reset_stats();
    let refused = [
        token(
            Algorithm::RS256,
            Some("rsa-1"),
            "other-rsa.der",
            claims("x", "pdftalk-api"),
        ),
        token(
            Algorithm::RS256,
            Some("unknown"),
            "rsa.der",
            claims("x", "pdftalk-api"),
        ),
        token(
            Algorithm::RS256,
            Some("rsa-1"),
            "rsa.der",
            claims("x", "another-api"),
        ),
        token(
            Algorithm::PS256,
            Some("rsa-2"),
            "rsa2.der",
            claims("x", "pdftalk-api"),
        ),
    ];
    for t in refused {
        let r = http
            .get(gw.url("/api"))
            .bearer_auth(t)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
        assert_eq!(r.headers()["www-authenticate"], "Bearer");
    }
    assert_eq!(redis.limiter_calls(), 0, "refused before Redis");
}

/// Every RSA algorithm the contract names is taken with a key whose use the set does not pin,
/// when listed; one not listed is 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_listed_rsa_algorithm_is_taken_with_an_unpinned_key() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let section = jwt_section("").replace(
        "algorithms = [\"RS256\", \"ES256\", \"EdDSA\"]",
        "algorithms = [\"RS384\", \"RS512\", \"PS256\", \"PS384\", \"PS512\"]",
    );
    assert!(section.contains("PS512"), "{section}");
    let gw = start(&redis, &up, &section);
    let http = client();
    let claims = serde_json::json!({"org_id": "o", "iss": "https://idp.example/", "aud": "pdftalk-api", "exp": now() + 60});
    for (alg, want) in [
        (Algorithm::RS384, 200),
        (Algorithm::RS512, 200),
        (Algorithm::PS256, 200),
        (Algorithm::PS384, 200),
        (Algorithm::PS512, 200),
        (Algorithm::RS256, 401),
    ] {
        let t = token(alg, Some("rsa-2"), "rsa2.der", claims.clone());
        let status =
            common::status_past_a_busy_start(|| http.get(gw.url("/api")).bearer_auth(&t)).await;
        assert_eq!(status, want, "{alg:?}");
    }
}

/// An ES384 token, signed with a P-384 key of the set, is taken while ES384 is listed, and
/// refused once a reload lists ES256 alone; a token whose header names ES384 with the P-256
/// key's kid is refused (the key's curve is P-256), as is one naming ES256 with the P-384
/// key's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn es384_tokens_are_verified_with_a_p384_key_while_listed() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let mut set: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("jwks.json")).unwrap()).unwrap();
    let p384: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("ec384.jwk.json")).unwrap()).unwrap();
    set["keys"].as_array_mut().unwrap().push(p384);
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, set.to_string()).unwrap();
    let section = |algorithms: &str| {
        format!(
            "[auth.jwt]\nalgorithms = [{algorithms}]\njwks_path = {}\nidentity_claim = \"org_id\"\n",
            quoted(jwks.to_str().unwrap())
        )
    };
    let gw = start(&redis, &up, &section(r#""ES256", "ES384""#));
    let http = client();
    let claims = serde_json::json!({"org_id": "o", "exp": now() + 60});
    let status = |alg, kid, key| {
        let t = token(alg, Some(kid), key, claims.clone());
        let request = http.get(gw.url("/api")).bearer_auth(t).send();
        async move { request.await.unwrap().status().as_u16() }
    };
    assert_eq!(status(Algorithm::ES384, "ec-384", "ec384.der").await, 200);
    assert_eq!(status(Algorithm::ES256, "ec-1", "ec.der").await, 200);
    assert_eq!(status(Algorithm::ES384, "ec-1", "ec384.der").await, 401);
    assert_eq!(status(Algorithm::ES256, "ec-384", "ec.der").await, 401);

    let config = std::fs::read_to_string(&gw.config_path).unwrap();
    gw.rewrite_config(&config.replace(r#""ES256", "ES384""#, r#""ES256""#));
    assert_eq!(gw.reload(), 200);
    assert_eq!(status(Algorithm::ES384, "ec-384", "ec384.der").await, 401);
    assert_eq!(status(Algorithm::ES256, "ec-1", "ec.der").await, 200);
}

/// A `jwks_path` is read again on every reload: a key the identity provider took out of the
/// set is refused from then on, the others still taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_taken_out_of_the_jwks_file_is_refused_after_a_reload() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::copy(fixture("jwks.json"), &jwks).unwrap();
    let section = jwt_section("").replace(
        &quoted(fixture("jwks.json").to_str().unwrap()),
        &quoted(jwks.to_str().unwrap()),
    );
    let gw = start(&redis, &up, &section);
    let http = client();
    let claims = serde_json::json!({"org_id": "o", "iss": "https://idp.example/", "aud": "pdftalk-api", "exp": now() + 60});
    let status = |alg, kid, key| {
        let request = http
            .get(gw.url("/api"))
            .bearer_auth(token(alg, Some(kid), key, claims.clone()))
            .send();
        async move { request.await.unwrap().status().as_u16() }
    };
    assert_eq!(status(Algorithm::RS256, "rsa-1", "rsa.der").await, 200);
    let mut set: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&jwks).unwrap()).unwrap();
    set["keys"]
        .as_array_mut()
        .unwrap()
        .retain(|k| k["kid"] != "rsa-1");
    std::fs::write(&jwks, set.to_string()).unwrap();
    assert_eq!(gw.reload(), 200);
    assert_eq!(status(Algorithm::RS256, "rsa-1", "rsa.der").await, 401);
    assert_eq!(status(Algorithm::ES256, "ec-1", "ec.der").await, 200);
}

#[test]
fn a_jwks_that_cannot_serve_is_a_config_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("jwks.json");
    std::fs::write(
        &bad,
        r#"{"keys": [{"kty": "oct", "kid": "s", "k": "c2VjcmV0"}]}"#,
    )
    .unwrap();
    let route = Route::new("j.api")
        .prefix("/api")
        .identity("jwt")
        .token_bucket(100_000_000, 0);
    let with = |section: &str| {
        GatewayConfig::new("redis://127.0.0.1:6379/0")
            .section(section)
            .upstream("app", &["127.0.0.1:9"])
            .route(route.clone())
            .render(1, 2)
    };
    let path = dir.path().join("gateway.toml");
    let check = |config: String| {
        std::fs::write(&path, config).unwrap();
        let out = common::check_config(&path, &[("SENTINEL_REDIS_URL", None)]);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let with_bad = || {
        with(&format!(
            "[auth.jwt]\nalgorithms = [\"RS256\"]\njwks_path = {}\n",
            quoted(bad.to_str().unwrap())
        ))
    };
    let (code, err) = check(with_bad());
    assert_eq!(code, Some(2));
    assert!(
        err.contains(&format!(
            "{}: keys[0] (kid \"s\"): a symmetric key",
            bad.display()
        )),
        "{err}"
    );
    // A byte that is not UTF-8: said at the JWKS's own line and column, as a JSON error is.
    std::fs::write(
        &bad,
        b"{\"keys\": [\n  {\"kty\": \"RSA\", \"n\": \"caf\xe9\"}\n]}\n",
    )
    .unwrap();
    let (code, err) = check(with_bad());
    assert_eq!(code, Some(2));
    assert!(
        err.contains(&format!(
            "{}:2:27: the JWKS file is not UTF-8 here",
            bad.display()
        )),
        "{err}"
    );
    let (code, err) = check(with("[auth.jwt]\nalgorithms = [\"RS256\"]\n"));
    assert_eq!(code, Some(2));
    assert!(
        err.contains("auth.jwt.algorithms lists RS256 but neither jwks_path nor jwks_url gives their public keys"),
        "{err}"
    );
    std::fs::write(&path, with(&jwt_section(""))).unwrap();
    let out = common::check_config(&path, &[("SENTINEL_REDIS_URL", None)]);
    assert_eq!(out.status.code(), Some(0), "the fixture JWKS is accepted");
    // The plain words name the claim that names the caller.
    let described = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(described.contains(", per JWT org_id claim;"), "{described}");
}

/// A set published without kids (some providers do) beside tokens that name one: the token's
/// kid picks the key (contract section 12), so each is 401 as of an unknown kid, and the
/// cause is said once at INFO, so the operator is not left with 401s alone; a token without a
/// kid is verified by the same key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_without_kids_beside_tokens_naming_one_is_said_once() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let dir = tempfile::tempdir().unwrap();
    let mut set: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture("jwks.json")).unwrap()).unwrap();
    for key in set["keys"].as_array_mut().unwrap() {
        key.as_object_mut().unwrap().remove("kid");
    }
    let path = dir.path().join("jwks.json");
    std::fs::write(&path, set.to_string()).unwrap();
    let jwt = format!(
        "[auth.jwt]\nalgorithms = [\"RS256\"]\njwks_path = {}\n",
        quoted(path.to_str().unwrap())
    );
    let gw = start(&redis, &up, &jwt);
    let http = client();
    let claims = serde_json::json!({"sub": "user-1", "exp": now() + 60});
    let signed = |kid: Option<&'static str>, key: &'static str| {
        let t = token(Algorithm::RS256, kid, key, claims.clone());
        let (http, url) = (http.clone(), gw.url("/api"));
        async move { http.get(url).bearer_auth(t).send().await.unwrap().status() }
    };
    let status = |kid: Option<&'static str>| signed(kid, "rsa.der");
    assert_eq!(status(None).await, 200);
    // A client's made-up kid on a token no key of the set signed uses nothing up.
    for _ in 0..3 {
        assert_eq!(signed(Some("another"), "other-rsa.der").await, 401);
    }
    // Log lines are written off the request path: time for one to come (it would have
    // in well under this on a loaded machine).
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(
        gw.logs()
            .matches("signed by a JWKS key that has no kid")
            .count(),
        0,
        "{}",
        gw.logs()
    );
    assert_eq!(status(Some("rsa-1")).await, 401);
    assert_eq!(status(Some("another")).await, 401);
    let said = |logs: &str| {
        let lines: Vec<&str> = (logs.lines())
            .filter(|l| l.contains("signed by a JWKS key that has no kid"))
            .collect();
        for line in &lines {
            assert!(line.contains(r#""level":"INFO""#), "{line}");
            assert!(
                !line.contains("another") && !line.contains("rsa-1"),
                "{line}"
            );
        }
        lines.len()
    };
    assert_eq!(said(&gw.logs()), 1, "once: {}", gw.logs());
    // A reload (the set may be another) says it again, once.
    let r = http.post(gw.admin("/reload")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(status(Some("rsa-1")).await, 401);
    assert_eq!(status(Some("another")).await, 401);
    assert_eq!(said(&gw.logs()), 2, "{}", gw.logs());
}
