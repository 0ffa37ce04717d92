//! A limit's algorithm and the fields it takes.

use super::*;

/// The fields that describe one limit: the route's own, or one `[[routes.limits]]` entry's.
pub(crate) struct AlgorithmFields<'a> {
    /// `""` for the route's fields, `limits[i].` for an entry's.
    pub(crate) at: String,
    pub(crate) algorithm: &'a Spanned<String>,
    pub(crate) limit: &'a Option<Spanned<i64>>,
    pub(crate) window_size_micro: &'a Option<Spanned<i64>>,
    pub(crate) capacity_micro: &'a Option<Spanned<i64>>,
    pub(crate) refill_rate_micro_per_sec: &'a Option<Spanned<i64>>,
    pub(crate) cost_micro: &'a Option<Spanned<i64>>,
}

pub(crate) fn algorithm(
    c: &mut Collector,
    label: Option<&str>,
    r: &AlgorithmFields<'_>,
) -> Option<Algorithm> {
    let at = r.at.as_str();
    let misplaced = |c: &mut Collector, field: &str, v: &Option<Spanned<i64>>, alg: &str| {
        if let Some(v) = v {
            c.push(
                Some(&v.span()),
                label,
                format!("{at}{field} does not apply to algorithm = \"{alg}\": remove it"),
            );
        }
    };
    match r.algorithm.get_ref().as_str() {
        "none" if at.is_empty() => {
            for (f, v) in [
                ("limit", r.limit),
                ("window_size_micro", r.window_size_micro),
                ("capacity_micro", r.capacity_micro),
                ("refill_rate_micro_per_sec", r.refill_rate_micro_per_sec),
                ("cost_micro", r.cost_micro),
            ] {
                misplaced(c, f, v, "none");
            }
            Some(Algorithm::None)
        }
        "token_bucket" => {
            misplaced(c, "limit", r.limit, "token_bucket");
            misplaced(c, "window_size_micro", r.window_size_micro, "token_bucket");
            let capacity = match r.capacity_micro {
                None => {
                    c.push(Some(&r.algorithm.span()), label, format!("{at}capacity_micro is required for algorithm = \"token_bucket\": the burst in micro-tokens (1 request = 1000000)"));
                    None
                }
                Some(v) if *v.get_ref() < ONE_TOKEN_MICRO as i64 => {
                    c.push(Some(&v.span()), label, format!("{at}capacity_micro = {} can never admit a request: it must be >= 1000000 (one token)", v.get_ref()));
                    None
                }
                Some(v) => int_in(
                    c,
                    label,
                    &format!("{at}capacity_micro"),
                    Some(v),
                    0,
                    (1_000_000, MAX_CAPACITY_MICRO as i64),
                    " (10^9 requests)",
                ),
            };
            let refill = match r.refill_rate_micro_per_sec {
                None => {
                    c.push(Some(&r.algorithm.span()), label, format!("{at}refill_rate_micro_per_sec is required for algorithm = \"token_bucket\": micro-tokens added per second (0 = never refills)"));
                    None
                }
                v => {
                    let refill = int_in(
                        c,
                        label,
                        &format!("{at}refill_rate_micro_per_sec"),
                        v.as_ref(),
                        0,
                        (0, MAX_RATE_MICRO_PER_SEC as i64),
                        " (10^6 requests per second)",
                    );
                    if let (Some(rate), Some(written)) = (refill, v) {
                        slow_refill(c, label, at, rate, written);
                    }
                    refill
                }
            };
            Some(Algorithm::TokenBucket {
                capacity_micro: capacity?,
                refill_micro_per_sec: refill?,
            })
        }
        "sliding_window" => {
            misplaced(c, "capacity_micro", r.capacity_micro, "sliding_window");
            misplaced(
                c,
                "refill_rate_micro_per_sec",
                r.refill_rate_micro_per_sec,
                "sliding_window",
            );
            let limit = match r.limit {
                None => {
                    c.push(
                        Some(&r.algorithm.span()),
                        label,
                        format!("{at}limit is required for algorithm = \"sliding_window\": requests per window"),
                    );
                    None
                }
                v => int_in(
                    c,
                    label,
                    &format!("{at}limit"),
                    v.as_ref(),
                    0,
                    (1, 1_000_000_000),
                    " requests",
                ),
            };
            let window = match r.window_size_micro {
                None => {
                    c.push(Some(&r.algorithm.span()), label, format!("{at}window_size_micro is required for algorithm = \"sliding_window\": the window in microseconds (60_000_000 = one minute)"));
                    None
                }
                v => int_in(
                    c,
                    label,
                    &format!("{at}window_size_micro"),
                    v.as_ref(),
                    0,
                    (1_000, 86_400_000_000),
                    " (1 ms to 1 day)",
                ),
            };
            let (limit, window) = (limit?, window?);
            Some(Algorithm::SlidingWindow {
                limit,
                window_micro: window,
            })
        }
        other => {
            let choices = if at.is_empty() {
                "\"token_bucket\", \"sliding_window\" or \"none\""
            } else {
                "\"token_bucket\" or \"sliding_window\""
            };
            c.push(
                Some(&r.algorithm.span()),
                label,
                format!("{at}algorithm = \"{other}\" is unknown: use {choices}"),
            );
            None
        }
    }
}

/// A token bucket refilled more slowly than one token a day: `refill_rate_micro_per_sec = 10`
/// written for "10 a second", as nginx's `rate=10r/s` or Kong's `second = 10` read. Warned,
/// not refused: a quota of one request a week is a rate too.
pub(crate) fn slow_refill(
    c: &mut Collector,
    label: Option<&str>,
    at: &str,
    rate: u64,
    written: &Spanned<i64>,
) {
    const DAY_SECONDS: u64 = 86_400;
    if rate == 0 || rate * DAY_SECONDS >= ONE_TOKEN_MICRO {
        return;
    }
    let hours = ONE_TOKEN_MICRO as f64 / rate as f64 / 3600.0;
    c.warn(Some(&written.span()), label, format!("{at}refill_rate_micro_per_sec = {rate} adds one token (one request of cost 1_000_000) every {hours:.1} hours: the rate is in micro-tokens a second ({rate} requests a second is {})", rate * ONE_TOKEN_MICRO));
}
