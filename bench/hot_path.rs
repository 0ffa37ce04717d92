//! Micro-benchmarks of the request path's local work: path normalization, route matching,
//! key building, the decision with the breaker open, the emergency limiter, answer headers,
//! a batch's command and answer, the forwarded headers on the request sent upstream, a
//! denial remembered in a full over-limit cache, and a JWT's signature verified with ring
//! (the gateway's) and with `jsonwebtoken`'s pure-Rust backend.
//! Compare them as ratios within one run; absolute numbers depend on the machine.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use http::Method;
use sentinel_gateway::clock::{MonotonicClock, SharedClock};
use sentinel_gateway::config::AccessLogTarget;
use sentinel_gateway::config::{BreakerConfig, FailMode};
use sentinel_gateway::decision::emergency::{Emergency, EmergencyBucket};
use sentinel_gateway::decision::{degrade, Breaker, Degradation, ScriptReply};
use sentinel_gateway::edge::access_log::{Line, Lossy, Timestamp};
use sentinel_gateway::edge::AccessLog;
use sentinel_gateway::limiter::identity_hash;
use sentinel_gateway::proxy::respond::Answer;
use sentinel_gateway::routing::{normalize_path, Matcher, PathMatch, RouteTable};

fn routing(c: &mut Criterion) {
    c.bench_function("normalize_path", |b| {
        b.iter(|| normalize_path(black_box("/resumint//tailor/./v2/%7Euser/../jobs?x")))
    });
    let entries = (0..50).map(|i| {
        let m = Matcher {
            path: PathMatch::Prefix(format!("/svc{i}/api")),
            host: None,
            methods: None,
        };
        (m, i)
    });
    let table = RouteTable::new(entries);
    c.bench_function("route_match_50_routes", |b| {
        b.iter(|| table.find(None, &Method::GET, black_box("/svc42/api/jobs/7")))
    });
}

fn keys(c: &mut Criterion) {
    c.bench_function("identity_hash", |b| {
        b.iter(|| identity_hash(black_box("header:x-api-key:0123456789abcdef")))
    });
    c.bench_function("script_reply_parse", |b| {
        b.iter(|| ScriptReply::parse(black_box(b"1 999999999000000 0 2 1764470000123456 0")))
    });
}

fn failure_path(c: &mut Criterion) {
    let clock: SharedClock = Arc::new(MonotonicClock::default());
    let breaker = Breaker::new(
        BreakerConfig {
            failure_threshold: NonZeroU32::new(1).expect("non-zero"),
            open_for: Duration::from_secs(3600),
        },
        Arc::clone(&clock),
        Box::new(|_, _, _| {}),
    );
    breaker.acquire().expect("closed").failure();
    let bucket = Emergency::Endpoint(EmergencyBucket::new(1_000_000_000_000, Arc::clone(&clock)));
    c.bench_function("decision_breaker_open_fail_closed", |b| {
        b.iter(|| {
            let short = breaker.acquire().err().expect("open");
            degrade(
                Degradation::BreakerOpen {
                    retry_in: short.retry_in,
                },
                FailMode::FailClosed,
                None,
                "identity-hash",
                breaker.state(),
            )
        })
    });
    c.bench_function("decision_breaker_open_fail_open", |b| {
        b.iter(|| {
            let short = breaker.acquire().err().expect("open");
            degrade(
                Degradation::BreakerOpen {
                    retry_in: short.retry_in,
                },
                FailMode::FailOpen,
                Some(&bucket),
                "identity-hash",
                breaker.state(),
            )
        })
    });
    c.bench_function("emergency_try_admit", |b| {
        b.iter(|| bucket.try_admit(black_box("identity-hash")))
    });
}

fn answers(c: &mut Criterion) {
    c.bench_function("answer_429_header", |b| {
        b.iter(|| {
            Answer::RateLimited {
                retry_after_secs: black_box(3),
            }
            .header()
        })
    });
}

/// A batch of 32 decisions: the command that carries it, and reading its answer.
fn batches(c: &mut Criterion) {
    use sentinel_gateway::store::batch::{answer_parts, command, Argv};
    let keys: Vec<String> = (0..32)
        .map(|i| {
            format!(
                "sentinel:v1:{}:pdftalk.ingest:1",
                identity_hash(&format!("k{i}"))
            )
        })
        .collect();
    let args: Vec<[u64; 4]> = (0..32)
        .map(|_| [1, 1_000_000_000_000_000, 1_000_000_000_000, 1_000_000])
        .collect();
    let mut out = Vec::new();
    let mut argv = Argv::default();
    c.bench_function("batch_command_32", |b| {
        b.iter(|| {
            out.clear();
            command(
                &mut out,
                black_box("f5fcfa7a7caeeac3195be4e8e4aa698b45499974"),
                keys.iter().map(|k| k.as_bytes()),
                argv.of(args.iter().map(|a| &a[..])),
                false,
            );
            black_box(out.len())
        })
    });
    let answer = vec!["1 999999999000000 0 2 1764470000123456 0"; 32].join("\n");
    c.bench_function("batch_answer_32", |b| {
        b.iter(|| {
            let bytes = black_box(answer.as_bytes());
            let parts = answer_parts(bytes, 32).expect("32 parts");
            parts.filter_map(|r| ScriptReply::parse(&bytes[r])).count()
        })
    });
}

fn access_log(c: &mut Criterion) {
    let dropped = prometheus::IntCounter::new("d", "d").unwrap();
    let log = AccessLog::start(Some(&AccessLogTarget::File("/dev/null".into())), dropped).unwrap();
    let hash = identity_hash("k1");
    // What a request's worker does for its line: build it and hand it over. The writer's
    // share (the JSON, the write) is read from /proc by bench/access_log.sh's runs.
    c.bench_function("access_log_line", |b| {
        b.iter(|| {
            log.log(&Line {
                timestamp: Timestamp::of(std::time::SystemTime::now()),
                request_id: Some("4bf92f3577b34da6a3ce929d0e0e4736"),
                client_ip: Some(std::net::Ipv4Addr::LOCALHOST.into()),
                method: Some("POST"),
                host: Some(Lossy(b"api.pdftalk.example")),
                path: Some(black_box("/pdftalk/ingest/doc")),
                protocol: "HTTP/1.1",
                tls: true,
                status: 200,
                grpc_status: None,
                endpoint_id: Some("pdftalk.ingest"),
                decision_reason: Some("allowed"),
                allowed: Some(true),
                tier: Some("pro"),
                limit: None,
                upstream: Some("pdftalk"),
                upstream_addr: Some("127.0.0.1:9001".parse().unwrap()),
                duration_ms: 1.234,
                bytes_received: 5120,
                bytes_sent: 312,
                identity_hash: Some(hash.as_str()),
                user_agent: Some(Lossy(b"curl/8.5.0")),
                error: None,
            })
        })
    });
}

/// The forwarded headers and request id written on a request sent upstream (the clone of
/// the client's request included, as the proxy makes it), against the clone alone.
fn forwarded(c: &mut Criterion) {
    use sentinel_gateway::proxy::forwarded::Origin;
    let mut client = pingora_http::RequestHeader::build("GET", b"/api/ingest", None).unwrap();
    client.append_header("Host", "127.0.0.1:8080").unwrap();
    client.append_header("X-API-Key", "key-00042").unwrap();
    let origin = Origin {
        peer: Some("127.0.0.1".parse().unwrap()),
        trusted: false,
        client: Some("127.0.0.1".parse().unwrap()),
        request_id: "0169b25b3a4040522ac1d546c6a1b250".into(),
        tls: false,
        underscored: false,
    };
    let id = bytes::Bytes::from_static(b"x-request-id");
    c.bench_function("upstream_request_clone", |b| {
        b.iter(|| black_box(client.clone()))
    });
    c.bench_function("upstream_request_clone_and_forwarded_headers", |b| {
        b.iter(|| {
            let mut upstream = client.clone();
            origin.apply(&mut upstream, &id).unwrap();
            black_box(upstream)
        })
    });
}

/// Whether room made in advance in the upstream request's header maps would pay (a `reserve`
/// Pingora's `RequestHeader` does not offer): `http`'s map in the proxy's shape, the client's
/// two fields and six the gateway writes (a `forward_identity` route's), written after a plain clone, after a clone and
/// a `reserve`, and into a map built with room (docs/benchmarks.md, "The headers' cost in
/// isolation").
fn header_map_room(c: &mut Criterion) {
    use http::{HeaderMap, HeaderValue};
    let mut client = HeaderMap::new();
    client.append("host", HeaderValue::from_static("127.0.0.1:8080"));
    client.append("x-api-key", HeaderValue::from_static("key-00042"));
    let written = [
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-real-ip",
        "x-request-id",
        "x-sentinel-identity",
    ];
    let write = |mut map: HeaderMap| {
        for name in written {
            map.insert(name, HeaderValue::from_static("127.0.0.1"));
        }
        map
    };
    c.bench_function("header_map_room_clone", |b| {
        b.iter(|| black_box(write(client.clone())))
    });
    c.bench_function("header_map_room_clone_and_reserve", |b| {
        b.iter(|| {
            let mut map = client.clone();
            map.reserve(written.len());
            black_box(write(map))
        })
    });
    c.bench_function("header_map_room_built_with_room", |b| {
        b.iter(|| {
            let mut map = HeaderMap::with_capacity(client.len() + written.len());
            for (name, value) in &client {
                map.append(name.clone(), value.clone());
            }
            black_box(write(map))
        })
    });
}

/// A new denial remembered while the over-limit cache is full of denials that have not
/// ended (made-up identities denied once each): what choosing the entry it replaces costs.
fn overlimit_full(c: &mut Criterion) {
    use sentinel_gateway::decision::overlimit::{OverlimitCache, CAPACITY};
    let cache = OverlimitCache::new(Arc::new(MonotonicClock::default()));
    let wait = 3_600_000_000;
    for i in 0..CAPACITY * 2 {
        cache.remember(0, &format!("filler-{i}"), wait, (0, None));
    }
    let mut n = 0u64;
    c.bench_function("overlimit_remember_full", |b| {
        b.iter(|| {
            n += 1;
            cache.remember(0, black_box(&format!("new-{n}")), wait, (0, None));
        })
    });
}

/// One token's signature checked, as a JWT route checks each request's: as the gateway does
/// (`src/signatures.rs`: ring, but for EdDSA) and with the crate's pure-Rust verifiers, for
/// each kind of key of the tests' JWKS (ES384's key is its own file).
fn jwt_signatures(c: &mut Criterion) {
    use jsonwebtoken::jwk::{Jwk, JwkSet};
    use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header};
    let fixture = |name: &str| {
        std::fs::read(format!(
            "{}/tests/fixtures/jwt/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    };
    let set: JwkSet = serde_json::from_slice(&fixture("jwks.json")).unwrap();
    let ec384: Jwk = serde_json::from_slice(&fixture("ec384.jwk.json")).unwrap();
    sentinel_gateway::signatures::install();
    let crate_own = &jsonwebtoken::crypto::rust_crypto::DEFAULT_PROVIDER;
    for (alg, kid, der) in [
        (Algorithm::RS256, "rsa-1", "rsa.der"),
        (Algorithm::ES256, "ec-1", "ec.der"),
        (Algorithm::ES384, "", "ec384.der"),
        (Algorithm::EdDSA, "ed-1", "ed.der"),
    ] {
        let jwk = match kid {
            "" => ec384.clone(),
            kid => set.find(kid).unwrap().clone(),
        };
        let key = DecodingKey::from_jwk(&jwk).unwrap();
        let der = fixture(der);
        let signing = match alg {
            Algorithm::ES256 | Algorithm::ES384 => EncodingKey::from_ec_der(&der),
            Algorithm::EdDSA => EncodingKey::from_ed_der(&der),
            _ => EncodingKey::from_rsa_der(&der),
        };
        let claims = serde_json::json!({ "sub": "bench", "exp": 4_000_000_000u64 });
        let token = jsonwebtoken::encode(&Header::new(alg), &claims, &signing).unwrap();
        let (message, signature) = token.rsplit_once('.').unwrap();
        assert_eq!(
            jsonwebtoken::crypto::verify(signature, message.as_bytes(), &key, alg).ok(),
            Some(true)
        );
        // What the gateway does (ring, but for EdDSA), and the crate's own verifier: each
        // reads the signature's base64 and checks it.
        c.bench_function(&format!("jwt_verify_{alg:?}"), |b| {
            b.iter(|| {
                jsonwebtoken::crypto::verify(black_box(signature), message.as_bytes(), &key, alg)
            })
        });
        c.bench_function(&format!("jwt_verify_{alg:?}_pure_rust"), |b| {
            b.iter(|| {
                let verifier = (crate_own.verifier_factory)(&alg, &key).unwrap();
                let bytes = base64_decode(black_box(signature));
                verifier.verify(message.as_bytes(), &bytes).is_ok()
            })
        });
    }
}

/// A JWT signature's bytes (base64url, no padding).
fn base64_decode(text: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(text)
        .unwrap()
}

criterion_group!(
    benches,
    jwt_signatures,
    overlimit_full,
    forwarded,
    header_map_room,
    routing,
    keys,
    failure_path,
    answers,
    batches,
    access_log
);
criterion_main!(benches);
