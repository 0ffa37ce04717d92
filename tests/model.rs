//! The Lua scripts against the Rust reference model, on a real redis-server: the same
//! generated request sequences must give the same decisions, Retry-After, remaining counts
//! and stored state. The model is fed the Redis `TIME` each script reports, so nothing in
//! the production scripts is faked.

mod common;

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use sentinel_gateway::decision::sliding_window::{Outcome, Window, WindowState};
use sentinel_gateway::decision::token_bucket::{Bucket, BucketState, Take};
use sentinel_gateway::decision::ScriptReply;
use sentinel_gateway::store::batch::Argv;
use sentinel_gateway::store::script::{
    BATCH_CLUSTER_LUA, BATCH_LUA, LIMITS_LUA, SLIDING_WINDOW_LUA, TOKEN_BUCKET_LUA,
};

/// Runs a script and returns its six integers; the gateway's parser must read the same answer.
fn eval(conn: &mut redis::Connection, script: &str, key: &str, args: [u64; 3]) -> Vec<i64> {
    let reply: String = redis::cmd("EVAL")
        .arg(script)
        .arg(1)
        .arg(key)
        .arg(&args[..])
        .query(conn)
        .expect("script runs");
    let fields: Vec<i64> = reply
        .split(' ')
        .map(|f| f.parse().expect("an integer"))
        .collect();
    assert_eq!(fields.len(), 6, "six integers: {reply:?}");
    assert!(
        ScriptReply::parse(reply.as_bytes()).is_some(),
        "the gateway reads {reply:?}"
    );
    fields
}

#[derive(Debug, Clone)]
struct Step {
    pause_us: u64,
    cost: u64,
}

fn steps(max_cost: u64) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (prop_oneof![Just(0u64), 0u64..3_000], 1..=max_cost)
            .prop_map(|(pause_us, cost)| Step { pause_us, cost }),
        1..25,
    )
}

/// A key's every field and the moment it ends (`EXPIRETIME`, Redis 7), to compare.
fn written(conn: &mut redis::Connection, key: &str) -> (Vec<(String, String)>, i64) {
    let mut fields: Vec<(String, String)> = redis::cmd("HGETALL").arg(key).query(conn).unwrap();
    fields.sort();
    let ends: i64 = redis::cmd("EXPIRETIME").arg(key).query(conn).unwrap();
    (fields, ends)
}

#[test]
fn token_bucket_script_equals_the_model() {
    let redis = common::Redis::start();
    let conn = std::cell::RefCell::new(redis.conn());
    let mut runner = TestRunner::new(Config {
        cases: 96,
        ..Config::default()
    });
    let strategy = (
        1_000_000u64..50_000_000,
        prop_oneof![Just(0u64), 1u64..5_000_000, 1_000_000u64..1_000_000_000_000],
        steps(1),
    )
        .prop_flat_map(|(capacity, rate, _)| (Just(capacity), Just(rate), steps(capacity)));
    let case = std::cell::Cell::new(0u64);
    runner
        .run(&strategy, |(capacity, rate, steps)| {
            case.set(case.get() + 1);
            let mut conn = conn.borrow_mut();
            let key = format!("model:tb:{}", case.get());
            let bucket = Bucket {
                capacity,
                rate_per_sec: rate,
            };
            let mut state: Option<BucketState> = None;
            for step in &steps {
                std::thread::sleep(Duration::from_micros(step.pause_us));
                // The key whole, and when it ends: what a denial must leave as it was.
                let before = written(&mut conn, &key);
                let reply = eval(
                    &mut conn,
                    TOKEN_BUCKET_LUA,
                    &key,
                    [capacity, rate, step.cost],
                );
                let now = reply[4] as u64;
                match bucket.take(state, step.cost, now) {
                    Take::Admitted { state: next } => {
                        prop_assert_eq!(reply[0], 1, "model admits at {}", now);
                        prop_assert_eq!(reply[1] as u64, next.tokens);
                        state = Some(next);
                        let stored: (u64, u64, u64) = redis::cmd("HMGET")
                            .arg(&key)
                            .arg(&["t", "f", "ts"])
                            .query(&mut conn)
                            .unwrap();
                        prop_assert_eq!(stored, (next.tokens, next.frac, next.at_us));
                    }
                    Take::Denied {
                        tokens,
                        retry_after_secs,
                    } => {
                        prop_assert_eq!(reply[0], 0, "model denies at {}", now);
                        prop_assert_eq!(reply[1] as u64, tokens);
                        prop_assert_eq!(reply[2], retry_after_secs.map_or(-1, |s| s as i64));
                        let stored: (Option<u64>, Option<u64>, Option<u64>) = redis::cmd("HMGET")
                            .arg(&key)
                            .arg(&["t", "f", "ts"])
                            .query(&mut *conn)
                            .unwrap();
                        prop_assert_eq!(
                            stored,
                            (
                                state.map(|s| s.tokens),
                                state.map(|s| s.frac),
                                state.map(|s| s.at_us)
                            ),
                            "a denial writes nothing"
                        );
                        prop_assert_eq!(
                            written(&mut conn, &key),
                            before,
                            "a denial writes nothing, not even the key's time to live"
                        );
                        // The exact wait the over-limit cache relies on.
                        let (_, frac) = bucket.refill(state, now);
                        let wait = (rate > 0)
                            .then(|| ((step.cost - tokens) * 1_000_000 - frac).div_ceil(rate));
                        prop_assert_eq!(reply[5], wait.map_or(-1, |w| w as i64));
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn sliding_window_script_equals_the_model() {
    let redis = common::Redis::start();
    let conn = std::cell::RefCell::new(redis.conn());
    let mut runner = TestRunner::new(Config {
        cases: 96,
        ..Config::default()
    });
    let strategy = (1u64..20, 1_000u64..40_000)
        .prop_flat_map(|(limit, window)| (Just(limit), Just(window), steps(limit)));
    let case = std::cell::Cell::new(0u64);
    runner
        .run(&strategy, |(limit, window_us, steps)| {
            case.set(case.get() + 1);
            let mut conn = conn.borrow_mut();
            let key = format!("model:sw:{}", case.get());
            let window = Window { limit, window_us };
            let mut state: Option<WindowState> = None;
            // When the last admission wrote the key, and how long the script let it live.
            let mut written: Option<(std::time::Instant, u64)> = None;
            for step in &steps {
                std::thread::sleep(Duration::from_micros(step.pause_us));
                // Redis set the expiry during the call, so no earlier than this: a key can
                // only have expired once its lifetime has passed since.
                let answered = std::time::Instant::now();
                let reply = eval(
                    &mut conn,
                    SLIDING_WINDOW_LUA,
                    &key,
                    [limit, window_us, step.cost],
                );
                let now = reply[4] as u64;
                match window.take(state, step.cost, now) {
                    Outcome::Admitted {
                        state: next,
                        left,
                        reset_secs,
                    } => {
                        prop_assert_eq!(reply[0], 1, "model admits at {}", now);
                        prop_assert_eq!(reply[1] as u64, left);
                        // `t`: never before another request of this cost is admitted.
                        prop_assert_eq!(reply[3] as u64, reset_secs, "reset at {}", now);
                        state = Some(next);
                        let stored: (Option<u64>, Option<u64>, Option<u64>) = redis::cmd("HMGET")
                            .arg(&key)
                            .arg(&["w", "c", "p"])
                            .query(&mut conn)
                            .unwrap();
                        // The script lets the key expire two windows after its window began:
                        // with millisecond windows a busy machine can read it back too late.
                        let expiry_us = (2 * window_us - now % window_us).div_ceil(1000) * 1000;
                        written = Some((answered, expiry_us));
                        let may_have_expired = answered.elapsed() + Duration::from_millis(1)
                            >= Duration::from_micros(expiry_us);
                        if !(stored == (None, None, None) && may_have_expired) {
                            prop_assert_eq!(
                                stored,
                                (Some(next.index), Some(next.current), Some(next.previous))
                            );
                        }
                    }
                    Outcome::Denied {
                        retry_after_secs,
                        wait_us,
                    } => {
                        prop_assert_eq!(reply[0], 0, "model denies at {}", now);
                        prop_assert_eq!(reply[2] as u64, retry_after_secs);
                        prop_assert_eq!(reply[5] as u64, wait_us);
                        let stored: (Option<u64>, Option<u64>, Option<u64>) = redis::cmd("HMGET")
                            .arg(&key)
                            .arg(&["w", "c", "p"])
                            .query(&mut *conn)
                            .unwrap();
                        // As above: a key written a few milliseconds ago may have expired.
                        let expired = written.is_some_and(|(at, expiry_us)| {
                            at.elapsed() + Duration::from_millis(1)
                                >= Duration::from_micros(expiry_us)
                        });
                        if !(stored == (None, None, None) && expired) {
                            prop_assert_eq!(
                                stored,
                                (
                                    state.map(|s| s.index),
                                    state.map(|s| s.current),
                                    state.map(|s| s.previous)
                                ),
                                "a denial writes nothing"
                            );
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
}

/// The several-limits script (a token bucket, a second token bucket and a sliding window
/// on three keys) against the models run side by side: a request is admitted only when all
/// three models admit it, and then every state moves; otherwise none does.
#[test]
fn several_limits_script_equals_the_models_all_or_nothing() {
    let redis = common::Redis::start();
    let conn = std::cell::RefCell::new(redis.conn());
    let mut runner = TestRunner::new(Config {
        cases: 64,
        ..Config::default()
    });
    let strategy = (
        (1u64..6, prop_oneof![Just(0u64), 1u64..2_000_000_000]),
        (1u64..10, prop_oneof![Just(0u64), 1u64..500_000_000]),
        (1u64..8, 1_000u64..40_000),
        steps(1),
    );
    let case = std::cell::Cell::new(0u64);
    runner
        .run(
            &strategy,
            |((c1, r1), (c2, r2), (limit, window_us), steps)| {
                case.set(case.get() + 1);
                let mut conn = conn.borrow_mut();
                let keys: Vec<String> = (0..3)
                    .map(|i| format!("model:multi:{{{}}}:{i}", case.get()))
                    .collect();
                let b1 = Bucket {
                    capacity: c1 * 1_000_000,
                    rate_per_sec: r1,
                };
                let b2 = Bucket {
                    capacity: c2 * 1_000_000,
                    rate_per_sec: r2,
                };
                let w = Window { limit, window_us };
                let (mut s1, mut s2, mut s3): (
                    Option<BucketState>,
                    Option<BucketState>,
                    Option<WindowState>,
                ) = (None, None, None);
                for step in &steps {
                    std::thread::sleep(Duration::from_micros(step.pause_us));
                    let cost = 1_000_000;
                    let args: Vec<u64> = vec![
                        0,
                        1,
                        b1.capacity,
                        r1,
                        cost,
                        1,
                        b2.capacity,
                        r2,
                        cost,
                        2,
                        limit,
                        window_us,
                        1,
                    ];
                    let reply: String = redis::cmd("EVAL")
                        .arg(LIMITS_LUA)
                        .arg(3)
                        .arg(&keys)
                        .arg(&args)
                        .query(&mut *conn)
                        .expect("script runs");
                    let parsed = ScriptReply::parse_many(reply.as_bytes(), 3)
                        .unwrap_or_else(|| panic!("the gateway reads {reply:?}"));
                    let now = parsed[0].now_us;
                    let t1 = b1.take(s1, cost, now);
                    let t2 = b2.take(s2, cost, now);
                    let t3 = w.take(s3, 1, now);
                    let each = [
                        matches!(t1, Take::Admitted { .. }),
                        matches!(t2, Take::Admitted { .. }),
                        matches!(t3, Outcome::Admitted { .. }),
                    ];
                    for (i, admitted) in each.iter().enumerate() {
                        prop_assert_eq!(parsed[i].allowed, *admitted, "limit {} at {}", i, now);
                    }
                    // A bucket that would have admitted a denied request reports what it has
                    // now, and when that is full again: nothing was taken from it.
                    if !each.iter().all(|a| *a) {
                        for (i, (bucket, state)) in [(b1, s1), (b2, s2)].into_iter().enumerate() {
                            if each[i] {
                                let (tokens, _) = bucket.refill(state, now);
                                let full = (tokens < bucket.capacity).then(|| {
                                    (bucket.rate_per_sec > 0).then(|| {
                                        (bucket.capacity - tokens).div_ceil(bucket.rate_per_sec)
                                    })
                                });
                                prop_assert_eq!(
                                    parsed[i].remaining,
                                    tokens as i64,
                                    "limit {} left",
                                    i
                                );
                                prop_assert_eq!(
                                    parsed[i].reset,
                                    full.unwrap_or(Some(0)),
                                    "limit {} full again in",
                                    i
                                );
                            }
                        }
                    }
                    if each.iter().all(|a| *a) {
                        if let Take::Admitted { state } = t1 {
                            s1 = Some(state);
                        }
                        if let Take::Admitted { state } = t2 {
                            s2 = Some(state);
                        }
                        if let Outcome::Admitted { state, .. } = t3 {
                            s3 = Some(state);
                        }
                    }
                    let tokens = |key: &str, conn: &mut redis::Connection| -> Option<u64> {
                        redis::cmd("HGET").arg(key).arg("t").query(conn).unwrap()
                    };
                    prop_assert_eq!(
                        tokens(&keys[0], &mut conn),
                        s1.map(|s| s.tokens),
                        "limit 0's stored state"
                    );
                    prop_assert_eq!(
                        tokens(&keys[1], &mut conn),
                        s2.map(|s| s.tokens),
                        "limit 1's stored state"
                    );
                    let count: Option<u64> = redis::cmd("HGET")
                        .arg(&keys[2])
                        .arg("c")
                        .query(&mut *conn)
                        .unwrap();
                    if let (Some(state), Some(count)) = (s3, count) {
                        if state.index == now / window_us {
                            prop_assert_eq!(count, state.current, "limit 2's count");
                        }
                    }
                }
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn scripts_stay_exact_at_the_configured_bounds() {
    let redis = common::Redis::start();
    let mut conn = redis.conn();
    // Token bucket at its bounds: capacity 10^15, refill 10^12 per second.
    let (cap, rate) = (1_000_000_000_000_000u64, 1_000_000_000_000u64);
    let bucket = Bucket {
        capacity: cap,
        rate_per_sec: rate,
    };
    let first = eval(
        &mut conn,
        TOKEN_BUCKET_LUA,
        "bound:tb",
        [cap, rate, cap - 7],
    );
    let Take::Admitted { state } = bucket.take(None, cap - 7, first[4] as u64) else {
        panic!("admits")
    };
    assert_eq!(first[1] as u64, state.tokens);
    std::thread::sleep(Duration::from_millis(3));
    let second = eval(&mut conn, TOKEN_BUCKET_LUA, "bound:tb", [cap, rate, 1]);
    let Take::Admitted { state: s2 } = bucket.take(Some(state), 1, second[4] as u64) else {
        panic!("admits")
    };
    assert_eq!(second[1] as u64, s2.tokens);
    // Sliding window at its bounds: 10^9 requests a day, a product of 8.64 x 10^19.
    let (limit, window) = (1_000_000_000u64, 86_400_000_000u64);
    let w = Window {
        limit,
        window_us: window,
    };
    let r = eval(
        &mut conn,
        SLIDING_WINDOW_LUA,
        "bound:sw",
        [limit, window, limit],
    );
    let Outcome::Admitted { left, state, .. } = w.take(None, limit, r[4] as u64) else {
        panic!("admits")
    };
    assert_eq!((r[0], r[1] as u64), (1, left));
    let r = eval(
        &mut conn,
        SLIDING_WINDOW_LUA,
        "bound:sw",
        [limit, window, 1],
    );
    let Outcome::Denied {
        retry_after_secs,
        wait_us,
    } = w.take(Some(state), 1, r[4] as u64)
    else {
        panic!("denies")
    };
    assert_eq!(
        (r[0], r[2] as u64, r[5] as u64),
        (0, retry_after_secs, wait_us),
        "the wait of a full window of 10^9 requests a day"
    );
}

/// `mul_div` (lua/limits.lua), the sliding window's product of a count and a time divided
/// exactly, against 128-bit integers: at its bounds, on exact multiples (where a double's
/// rounding would be off by one) and at random.
#[test]
fn the_scripts_wide_product_divides_exactly() {
    let redis = common::Redis::start();
    let mut conn = redis.conn();
    let script = concat!(
        include_str!("../lua/int.lua"),
        include_str!("../lua/limits.lua"),
        "local out = {}\n",
        "for i = 1, #ARGV, 3 do\n",
        "  local q, r = mul_div(tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]))\n",
        "  out[#out + 1] = format('%.0f %.0f', q, r)\n",
        "end\n",
        "return table.concat(out, ' ')\n"
    );
    let (limit, day) = (1_000_000_000u64, 86_400_000_000u64);
    let mut cases = vec![
        [limit - 1, day, day],
        [limit - 1, day - 1, day],
        [limit - 1, day, limit - 1],
        [999_999_937, 86_399_999_999, 86_399_999_999],
        [999_999_937, 86_399_999_999, 999_999_937],
        [999_999_937, 86_399_999_999, 3],
        [0, day, day],
        [1, 1, day],
    ];
    use proptest::strategy::ValueTree;
    let mut runner = TestRunner::new(Config::default());
    for _ in 0..500 {
        let a = (1..limit).new_tree(&mut runner).unwrap().current();
        let t = (1..=day).new_tree(&mut runner).unwrap().current();
        // A divisor that divides the product exactly, every other time.
        let d = match a % 2 {
            0 => (1..=day).new_tree(&mut runner).unwrap().current(),
            _ => t,
        };
        cases.push([a, t, d]);
    }
    let args: Vec<u64> = cases.iter().flatten().copied().collect();
    let reply: String = redis::cmd("EVAL")
        .arg(script)
        .arg(0)
        .arg(&args)
        .query(&mut conn)
        .expect("the script runs");
    let got: Vec<u128> = reply.split(' ').map(|n| n.parse().unwrap()).collect();
    for (case, qr) in cases.iter().zip(got.chunks(2)) {
        let [a, t, d] = case.map(u128::from);
        let want = (a * t / d, a * t % d);
        if want.0 < 1 << 53 {
            assert_eq!((qr[0], qr[1]), want, "{case:?}");
        }
    }
}

/// The sliding window where its products pass 2^53 (a count times a time: up to 10^9
/// requests a window of up to a day), from any stored counts: the script decides as the
/// model does in 128 bits, its answer, requests left and wait included, and so does a refund.
#[test]
fn sliding_window_past_2_pow_53_equals_the_model() {
    let redis = common::Redis::start();
    let conn = std::cell::RefCell::new(redis.conn());
    let mut runner = TestRunner::new(Config {
        cases: 256,
        ..Config::default()
    });
    let strategy = (
        prop_oneof![1u64..=1_000_000_000, 999_000_000u64..=1_000_000_000],
        prop_oneof![1_000_000_000u64..=86_400_000_000, Just(86_400_000_000)],
        (0u64..=1_000_000, 0u64..=1_000_000, 1u64..=1_000),
    );
    runner
        .run(&strategy, |(limit, window, (p_ppm, c_ppm, cost))| {
            let mut conn = conn.borrow_mut();
            let cost = cost.min(limit);
            // Stored counts anywhere from none to the limit.
            let previous = limit / 1_000_000 * p_ppm + limit % 1_000_000 * p_ppm / 1_000_000;
            let current = limit / 1_000_000 * c_ppm + limit % 1_000_000 * c_ppm / 1_000_000;
            let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut *conn).unwrap();
            let index = (secs * 1_000_000 + micros) / window;
            let key = "model:sw:wide";
            let _: () = redis::cmd("HSET")
                .arg(key)
                .arg(&[("w", index), ("c", current), ("p", previous)])
                .query(&mut *conn)
                .unwrap();
            let r = eval(&mut conn, SLIDING_WINDOW_LUA, key, [limit, window, cost]);
            let at = r[4] as u64;
            prop_assume!(at / window == index, "the window turned meanwhile");
            let model = Window {
                limit,
                window_us: window,
            };
            let state = WindowState {
                index,
                current,
                previous,
            };
            match model.take(Some(state), cost, at) {
                Outcome::Admitted { left, .. } => {
                    prop_assert_eq!((r[0], r[1] as u64), (1, left), "admitted");
                }
                Outcome::Denied {
                    retry_after_secs,
                    wait_us,
                } => {
                    prop_assert_eq!(
                        (r[0], r[2] as u64, r[5] as u64),
                        (0, retry_after_secs, wait_us),
                        "denied"
                    );
                }
            }
            // A refund of one request from the stored counts: what is left after it.
            let _: () = redis::cmd("HSET")
                .arg(key)
                .arg(&[("w", index), ("c", current), ("p", previous)])
                .query(&mut *conn)
                .unwrap();
            let refund: String = redis::cmd("EVAL")
                .arg(LIMITS_LUA)
                .arg(1)
                .arg(key)
                .arg(&[1, 2, limit, window, 1, 0][..])
                .query(&mut *conn)
                .unwrap();
            let given = ScriptReply::parse(refund.as_bytes()).expect("one reply");
            let at = given.now_us;
            prop_assume!(at / window == index);
            let back = match current {
                0 => WindowState {
                    previous: previous.saturating_sub(1),
                    ..state
                },
                c => WindowState {
                    current: c - 1,
                    ..state
                },
            };
            let (left, _) = model.level(Some(back), at);
            prop_assert_eq!(given.remaining as u64, left, "left after a refund");
            Ok(())
        })
        .unwrap();
}

/// A sliding window's refund whose charge's Redis time is known (mode `REFUND_AT` + the
/// time) takes the request back from the window it was charged in: this window's count, the
/// previous one's, or nothing for an older one (or one later than now); never below zero.
#[test]
fn a_refund_takes_from_the_window_its_charge_was_made_in() {
    let redis = common::Redis::start();
    let mut conn = redis.conn();
    let window: u64 = 86_400_000_000;
    let key = "model:sw:refund";
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
    let now = secs * 1_000_000 + micros;
    let index = now / window;
    let counts = |conn: &mut redis::Connection| -> (u64, u64) {
        redis::cmd("HMGET")
            .arg(key)
            .arg(&["c", "p"])
            .query(conn)
            .unwrap()
    };
    // The counts `c` and `p` refunded `cost` of a charge made at `charged_at`: what is left.
    let mut refunded = |(c, p): (u64, u64), charged_at: u64, cost: u64| {
        let _: () = redis::cmd("HSET")
            .arg(key)
            .arg(&[("w", index), ("c", c), ("p", p)])
            .query(&mut conn)
            .unwrap();
        let mode = sentinel_gateway::limiter::mode::refund(charged_at);
        let _: String = redis::cmd("EVAL")
            .arg(LIMITS_LUA)
            .arg(1)
            .arg(key)
            .arg(&[mode, 2, 10, window, cost, 0][..])
            .query(&mut conn)
            .unwrap();
        counts(&mut conn)
    };
    for (charged_at, after) in [
        (now, (4, 5)),
        (now - window, (5, 4)),
        (now - 2 * window, (5, 5)),
        // Later than Redis's now (a clock stepped back): not this window's to take from.
        (now + window, (5, 5)),
        (0, (4, 5)),
    ] {
        assert_eq!(
            refunded((5, 5), charged_at, 1),
            after,
            "charged at {charged_at}"
        );
    }
    assert_eq!(
        refunded((0, 0), now - window, 3),
        (0, 0),
        "never below zero"
    );
}

/// One decision of a batch in the batch test: which of the two token buckets, the sliding
/// window, or both buckets together as a several-limits decision, and its cost in requests.
#[derive(Debug, Clone, Copy)]
enum Member {
    Bucket(usize, u64),
    Window(u64),
    Both,
    /// A key that holds a string: its decision fails alone.
    Broken,
}

fn member() -> impl Strategy<Value = Member> {
    prop_oneof![
        4 => (0usize..2, 1u64..3).prop_map(|(b, c)| Member::Bucket(b, c)),
        2 => (1u64..3).prop_map(Member::Window),
        2 => Just(Member::Both),
        1 => Just(Member::Broken),
    ]
}

/// The batch script against the models: decisions that waited together are decided in
/// order at one Redis TIME, each as its own script would have (several-limits all or
/// nothing included), and a broken key fails its own decision only; as one Redis runs it
/// and as a Redis Cluster node does.
#[test]
fn batch_script_decides_in_order_as_the_models() {
    let redis = common::Redis::start();
    let conn = std::cell::RefCell::new(redis.conn());
    let mut runner = TestRunner::new(Config {
        cases: 64,
        ..Config::default()
    });
    let strategy = (
        (1u64..8, prop_oneof![Just(0u64), 1u64..3_000_000_000]),
        (1u64..8, 1_000u64..40_000),
        prop::collection::vec((0u64..3_000, prop::collection::vec(member(), 1..12)), 1..8),
    );
    let case = std::cell::Cell::new(0u64);
    runner
        .run(
            &strategy,
            |((capacity, rate), (limit, window_us), batches)| {
                case.set(case.get() + 1);
                let mut conn = conn.borrow_mut();
                let key = |name: &str| format!("model:batch:{}:{name}", case.get());
                let (buckets, window, broken) = ([key("b0"), key("b1")], key("w"), key("x"));
                let _: () = redis::cmd("SET")
                    .arg(&broken)
                    .arg("x")
                    .query(&mut *conn)
                    .unwrap();
                let bucket = Bucket {
                    capacity: capacity * 1_000_000,
                    rate_per_sec: rate,
                };
                let model_window = Window { limit, window_us };
                let mut states: [Option<BucketState>; 2] = [None, None];
                let mut window_state: Option<WindowState> = None;
                for (pause_us, members) in &batches {
                    // Costs within the limits, as the config's checks keep them.
                    let members: Vec<Member> = members
                        .iter()
                        .map(|m| match *m {
                            Member::Bucket(b, cost) => Member::Bucket(b, cost.min(capacity)),
                            Member::Window(cost) => Member::Window(cost.min(limit)),
                            other => other,
                        })
                        .collect();
                    let members = &members;
                    std::thread::sleep(Duration::from_micros(*pause_us));
                    // Each decision's arguments as the gateway's queue keeps them (kind first); the
                    // batch's arguments are put together from them as the gateway does.
                    let (mut keys, mut each): (Vec<&str>, Vec<Vec<u64>>) = (Vec::new(), Vec::new());
                    for m in members {
                        match *m {
                            Member::Bucket(b, cost) => {
                                keys.push(&buckets[b]);
                                each.push(vec![1, bucket.capacity, rate, cost * 1_000_000]);
                            }
                            Member::Window(cost) => {
                                keys.push(&window);
                                each.push(vec![2, limit, window_us, cost]);
                            }
                            Member::Both => {
                                keys.extend([buckets[0].as_str(), buckets[1].as_str()]);
                                let limit = [1, bucket.capacity, rate, 1_000_000];
                                each.push([&[3, 2, 0][..], &limit, &limit].concat());
                            }
                            Member::Broken => {
                                keys.push(&broken);
                                each.push(vec![1, bucket.capacity, rate, 1_000_000]);
                            }
                        }
                    }
                    let args = Argv::default().of(each.iter().map(Vec::as_slice)).to_vec();
                    // Every other case as a Redis Cluster node's batch runs: no key declared,
                    // their number and the keys leading the arguments.
                    let mut eval = redis::cmd("EVAL");
                    if case.get().is_multiple_of(2) {
                        eval.arg(BATCH_LUA).arg(keys.len()).arg(&keys);
                    } else {
                        eval.arg(BATCH_CLUSTER_LUA)
                            .arg(0)
                            .arg(keys.len())
                            .arg(&keys);
                    }
                    let reply: String = eval
                        .arg(&args)
                        .query(&mut *conn)
                        .expect("the batch script runs");
                    let answers: Vec<&str> = reply.split('\n').collect();
                    prop_assert_eq!(
                        answers.len(),
                        members.len(),
                        "one answer per decision: {:?}",
                        reply
                    );
                    let mut now = None;
                    for (m, answer) in members.iter().zip(&answers) {
                        if let Member::Broken = m {
                            prop_assert!(answer.starts_with("E WRONGTYPE"), "{}", answer);
                            continue;
                        }
                        let n = if let Member::Both = m { 2 } else { 1 };
                        let parsed = ScriptReply::parse_many(answer.as_bytes(), n)
                            .unwrap_or_else(|| panic!("the gateway reads {answer:?}"));
                        let at = parsed[0].now_us;
                        prop_assert!(now.is_none_or(|t| t == at), "one TIME for the batch");
                        now = Some(at);
                        match *m {
                            Member::Bucket(b, cost) => {
                                match bucket.take(states[b], cost * 1_000_000, at) {
                                    Take::Admitted { state } => {
                                        prop_assert!(parsed[0].allowed, "bucket {} admits", b);
                                        prop_assert_eq!(parsed[0].remaining, state.tokens as i64);
                                        states[b] = Some(state);
                                    }
                                    Take::Denied { tokens, .. } => {
                                        prop_assert!(!parsed[0].allowed, "bucket {} denies", b);
                                        prop_assert_eq!(parsed[0].remaining, tokens as i64);
                                    }
                                }
                            }
                            Member::Window(cost) => match model_window.take(window_state, cost, at)
                            {
                                Outcome::Admitted {
                                    state,
                                    left,
                                    reset_secs,
                                } => {
                                    prop_assert!(parsed[0].allowed, "the window admits");
                                    prop_assert_eq!(parsed[0].remaining, left as i64);
                                    prop_assert_eq!(parsed[0].reset, Some(reset_secs));
                                    window_state = Some(state);
                                }
                                Outcome::Denied { .. } => {
                                    prop_assert!(!parsed[0].allowed, "the window denies")
                                }
                            },
                            Member::Both => {
                                let t = [
                                    bucket.take(states[0], 1_000_000, at),
                                    bucket.take(states[1], 1_000_000, at),
                                ];
                                let all = t.iter().all(|t| matches!(t, Take::Admitted { .. }));
                                for (i, t) in t.iter().enumerate() {
                                    prop_assert_eq!(
                                        parsed[i].allowed,
                                        matches!(t, Take::Admitted { .. })
                                    );
                                    if let (true, Take::Admitted { state }) = (all, t) {
                                        states[i] = Some(*state);
                                    }
                                }
                            }
                            Member::Broken => unreachable!(),
                        }
                    }
                    for (b, key) in buckets.iter().enumerate() {
                        let stored: Option<u64> = redis::cmd("HGET")
                            .arg(key)
                            .arg("t")
                            .query(&mut *conn)
                            .unwrap();
                        prop_assert_eq!(
                            stored,
                            states[b].map(|s| s.tokens),
                            "bucket {}'s stored state",
                            b
                        );
                    }
                }
                Ok(())
            },
        )
        .unwrap();
}

/// A token bucket's key lives at least until the bucket is full again (a key that expired
/// early would hand out a full bucket), and at most a quarter longer (plus the second's
/// rounding): the room that lets most writes skip their EXPIRE.
#[test]
fn a_bucket_key_lives_until_full_and_not_much_longer() {
    let redis = common::Redis::start();
    let mut conn = redis.conn();
    let (capacity, rate) = (40_000_000u64, 1_000_000u64);
    for (i, cost) in [1u64, 5, 1, 1, 10, 2, 20].into_iter().enumerate() {
        let reply = eval(
            &mut conn,
            TOKEN_BUCKET_LUA,
            "model:ttl",
            [capacity, rate, cost * 1_000_000],
        );
        assert_eq!(reply[0], 1, "step {i} admitted");
        let full = reply[3];
        let ttl: i64 = redis::cmd("TTL").arg("model:ttl").query(&mut conn).unwrap();
        assert!(ttl >= full, "step {i}: ttl {ttl} < {full} s until full");
        assert!(
            ttl <= full + 2 + (full / 4).max(1),
            "step {i}: ttl {ttl} far beyond {full} s until full"
        );
    }
}

/// An error whose text runs over several lines (a Lua error can; a Redis error reply cannot)
/// still fails its own decision only: the batch's answer keeps one line per decision.
#[test]
fn a_multi_line_error_in_a_batch_keeps_one_answer_per_decision() {
    let redis = common::Redis::start();
    let mut conn = redis.conn();
    // The batch script as the gateway runs it, with `decide` shadowed for one key so that
    // it fails with a message of three lines.
    let (prelude, batch) = BATCH_LUA
        .rsplit_once("local t = redis.call('TIME')")
        .expect("the batch's loop");
    let script = format!(
        "{prelude}local real_decide = decide\n\
         local function decide(kind, key, ...)\n\
           if key == 'model:multi:bad' then error('one\\ntwo\\nthree') end\n\
           return real_decide(kind, key, ...)\n\
         end\n\
         local t = redis.call('TIME'){batch}"
    );
    let keys = ["model:multi:a", "model:multi:bad", "model:multi:b"];
    // One limit, named by each of the three decisions (each after its deadline: 0, none).
    let args = [1u64, 1, 5_000_000, 0, 1_000_000, 0, 1, 0, 1, 0, 1];
    let reply: String = redis::cmd("EVAL")
        .arg(&script)
        .arg(keys.len())
        .arg(&keys[..])
        .arg(&args)
        .query(&mut conn)
        .expect("the batch script runs");
    let answers: Vec<&str> = reply.split('\n').collect();
    assert_eq!(answers.len(), 3, "one answer per decision: {reply:?}");
    assert!(
        answers[1].starts_with("E ERR Error running script: ")
            && answers[1].contains("one two three"),
        "{reply:?}"
    );
    for i in [0, 2] {
        let parsed = ScriptReply::parse(answers[i].as_bytes()).expect("the gateway reads it");
        assert!(parsed.allowed, "decision {i} decided beside the error");
    }
}

/// Decisions past their deadline (`store/deadline.rs`) are answered `EXPIRED` and write
/// nothing, single and several limits alike; the decisions around them, in time or without a
/// deadline, are made and written as usual, each on its own keys.
#[test]
fn a_batch_skips_the_decisions_past_their_deadline_and_makes_the_others() {
    let redis = common::Redis::start();
    let mut conn = redis.conn();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query(&mut conn).unwrap();
    let now = secs * 1_000_000 + micros;
    let (past, ahead) = (now - 1_000_000, now + 60_000_000);
    let keys = [
        "model:late:a",
        "model:late:b",
        "model:late:c1",
        "model:late:c2",
        "model:late:d",
        "model:late:e1",
        "model:late:e2",
    ];
    // One limit (a bucket of 5); then, each after its deadline: a single limit, late; one
    // without a deadline; two limits, late; one in time; two limits without a deadline.
    let args = [
        1u64, 1, 5_000_000, 0, 1_000_000, //
        past, 1, //
        0, 1, //
        past, 0, 0, 2, 1, 1, //
        ahead, 1, //
        0, 0, 0, 2, 1, 1,
    ];
    let reply: String = redis::cmd("EVAL")
        .arg(BATCH_LUA)
        .arg(keys.len())
        .arg(&keys[..])
        .arg(&args[..])
        .query(&mut conn)
        .expect("the batch script runs");
    let answers: Vec<&str> = reply.split('\n').collect();
    assert_eq!(answers.len(), 5, "{reply:?}");
    for late in [0, 2] {
        assert!(answers[late].starts_with("E EXPIRED "), "{reply:?}");
    }
    assert!(ScriptReply::parse(answers[1].as_bytes()).is_some_and(|r| r.allowed));
    assert!(ScriptReply::parse(answers[3].as_bytes()).is_some_and(|r| r.allowed));
    let several = ScriptReply::parse_many(answers[4].as_bytes(), 2).expect("two replies");
    assert!(several.iter().all(|r| r.allowed), "{reply:?}");
    let exists = |key: &str| -> bool {
        redis::cmd("EXISTS")
            .arg(key)
            .query(&mut redis.conn())
            .unwrap()
    };
    for (key, written) in keys
        .iter()
        .zip([false, true, false, false, true, true, true])
    {
        assert_eq!(exists(key), written, "{key}");
    }
}
