//! A fleet of gateways on one Redis: the fleet-wide emergency rate is split among the live
//! instances, so an outage admits the fleet rate, not N times it.

mod common;

use std::time::{Duration, Instant};

use common::config::{GatewayConfig, Route};
use common::{client, wait_until, Gateway, Redis, Upstream};

/// The emergency rate during the outage, in micro-requests per second.
enum Fallback {
    /// Split among the live instances of the fleet.
    Fleet(u64),
    /// Each process's own.
    PerProcess(u64),
}

fn config(redis_url: &str, upstream: &str, fallback: &Fallback) -> GatewayConfig {
    let route = Route::new("f.open")
        .path("/open")
        .identity("global")
        .token_bucket(1_000_000_000, 1_000_000_000);
    let route = match *fallback {
        Fallback::Fleet(rate) => route.fail_open_fleet(rate),
        Fallback::PerProcess(rate) => route.fail_open(rate),
    };
    GatewayConfig::new(redis_url)
        .upstream("app", &[upstream])
        .route(route)
}

/// Admissions by three gateways hammered for `secs` while their Redis is dead.
async fn outage_admissions(fallback: Fallback, secs: u64) -> (u64, f64) {
    let mut redis = Redis::start();
    let up = Upstream::start("app");
    let gateways: Vec<Gateway> = (0..3)
        .map(|_| config(&redis.url(), &up.addr(), &fallback).start())
        .collect();
    if matches!(fallback, Fallback::Fleet(_)) {
        for gw in &gateways {
            wait_until(
                Duration::from_secs(10),
                "every gateway to count the fleet",
                || gw.metric("sentinel_fleet_instances") == 3.0,
            );
        }
    }
    redis.proc.signal("KILL");
    redis
        .proc
        .wait_exit(Duration::from_secs(5))
        .expect("redis died");
    let started = Instant::now();
    let tasks: Vec<_> = gateways
        .iter()
        .map(|gw| {
            let url = gw.url("/open");
            tokio::spawn(async move {
                let http = client();
                let mut admitted = 0u64;
                while started.elapsed() < Duration::from_secs(secs) {
                    let status = http
                        .get(&url)
                        .send()
                        .await
                        .expect("gateway answers")
                        .status()
                        .as_u16();
                    assert!(status == 200 || status == 429, "status {status}");
                    admitted += u64::from(status == 200);
                }
                admitted
            })
        })
        .collect();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    (total, started.elapsed().as_secs_f64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_rate_holds_for_the_whole_fleet_during_an_outage() {
    // Fleet rate 6/s over 3 instances: each runs at 2/s with a burst of 2.
    let (fleet, elapsed) = outage_admissions(Fallback::Fleet(6_000_000), 3).await;
    let allowance = 6.0 + 6.0 * elapsed;
    assert!(
        fleet as f64 <= allowance + 3.0,
        "fleet admitted {fleet}, allowance {allowance:.1}"
    );
    assert!(
        fleet as f64 >= allowance - 6.0,
        "fleet admitted {fleet}, allowance {allowance:.1}"
    );

    // The same rate per process: three times as much.
    let (per_process, elapsed) = outage_admissions(Fallback::PerProcess(6_000_000), 3).await;
    let allowance = 3.0 * (6.0 + 6.0 * elapsed);
    assert!(
        (per_process as f64 - allowance).abs() <= 9.0,
        "per-process admitted {per_process}, expected ~{allowance:.1}"
    );
    assert!(
        per_process >= 2 * fleet,
        "per-process {per_process} vs fleet {fleet}"
    );
}

/// A Redis back without its data (here `FLUSHALL`: a restart without persistence, a failover
/// to an empty replica) has no fleet set: the first instance to beat makes it again alone.
/// The count only grows until the set is one heartbeat's life old, so no instance takes the
/// whole fleet rate meanwhile (its breaker may still send every decision to the emergency
/// buckets).
#[test]
fn a_fleet_set_lost_with_redis_data_never_shrinks_the_count_while_it_fills_again() {
    let redis = Redis::start();
    let up = Upstream::start("app");
    let fallback = Fallback::Fleet(6_000_000);
    let gateways: Vec<Gateway> = (0..2)
        .map(|_| config(&redis.url(), &up.addr(), &fallback).start())
        .collect();
    for gw in &gateways {
        wait_until(Duration::from_secs(10), "both gateways counted", || {
            gw.metric("sentinel_fleet_instances") == 2.0
        });
    }
    let _: () = redis::cmd("FLUSHALL").query(&mut redis.conn()).unwrap();
    // Past the set's rebirth and every instance's next beats (2 s apart).
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        for gw in &gateways {
            assert_eq!(gw.metric("sentinel_fleet_instances"), 2.0, "{}", gw.logs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let members: u64 = redis::cmd("ZCARD")
        .arg("sentinel:v1:fleet")
        .query(&mut redis.conn())
        .unwrap();
    assert_eq!(members, 3, "two instances and the set's birth");
}
