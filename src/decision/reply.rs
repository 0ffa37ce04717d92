//! What a limiter script answers: the verdict of one Redis decision, as the scripts in `lua/`
//! write it and as the Rust models reproduce it.

/// A limiter script's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScriptReply {
    pub allowed: bool,
    /// What is left after this request: micro-tokens (token bucket; negative while a
    /// response charge is being paid back) or requests (window).
    pub remaining: i64,
    /// Seconds until the cost is available; `None` when the bucket never refills.
    pub retry_after: Option<u64>,
    /// Seconds until the bucket is full or the window ends; `None` when never.
    pub reset: Option<u64>,
    /// Redis `TIME` of the decision, in microseconds.
    pub now_us: u64,
    /// On a denial, microseconds until the request would be admitted, when known exactly.
    pub wait_us: Option<u64>,
}

impl ScriptReply {
    /// Reads a script's answer: six integers separated by single spaces (see `reply` in
    /// lua/int.lua). Anything else is `None`.
    pub fn parse(reply: &[u8]) -> Option<Self> {
        let mut fields = reply.split(|b| *b == b' ').map(integer);
        let mut next = || fields.next().flatten();
        let [allowed, remaining, retry, reset, now, wait] =
            [next()?, next()?, next()?, next()?, next()?, next()?];
        if fields.next().is_some() {
            return None;
        }
        let opt = |x: i64| u64::try_from(x).ok();
        Some(Self {
            allowed: allowed == 1,
            remaining,
            retry_after: opt(retry),
            reset: opt(reset),
            now_us: opt(now)?,
            wait_us: opt(wait).filter(|w| *w > 0),
        })
    }
}

impl ScriptReply {
    /// Reads the several-limits script's answer: `n` groups of six integers, one per key, in
    /// the order of the keys.
    pub fn parse_many(reply: &[u8], n: usize) -> Option<Vec<Self>> {
        let mut out = Vec::with_capacity(n);
        let mut rest = reply;
        for i in 0..n {
            let mut end = 0;
            let mut spaces = 0;
            while end < rest.len() {
                if rest[end] == b' ' {
                    spaces += 1;
                    if spaces == 6 {
                        break;
                    }
                }
                end += 1;
            }
            let (group, tail) = rest.split_at(end);
            if i + 1 < n && tail.is_empty() {
                return None;
            }
            out.push(Self::parse(group)?);
            rest = tail.strip_prefix(b" ").unwrap_or(tail);
        }
        rest.is_empty().then_some(out)
    }
}

/// A decimal integer, `-` allowed, as Lua's `%d` writes it; read on every limited request.
fn integer(digits: &[u8]) -> Option<i64> {
    let (negative, digits) = match digits.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, digits),
    };
    if digits.is_empty() || digits.len() > 18 {
        return None;
    }
    let mut n: i64 = 0;
    for d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        n = n * 10 + i64::from(d - b'0');
    }
    Some(if negative { -n } else { n })
}

#[cfg(test)]
mod tests {
    use super::ScriptReply;

    #[test]
    fn reads_the_six_integers_of_a_script_answer() {
        let r = ScriptReply::parse(b"1 999000000 0 4 1764470000123456 0").unwrap();
        assert!(r.allowed);
        assert_eq!(r.remaining, 999_000_000);
        assert_eq!((r.retry_after, r.reset), (Some(0), Some(4)));
        assert_eq!(r.now_us, 1_764_470_000_123_456);
        assert_eq!(r.wait_us, None);
        // A bucket that never refills: no Retry-After, no reset, no exact wait.
        let r = ScriptReply::parse(b"0 0 -1 -1 1764470000123456 -1").unwrap();
        assert!(!r.allowed);
        assert_eq!((r.retry_after, r.reset, r.wait_us), (None, None, None));
        let r = ScriptReply::parse(b"0 5 2 9 1764470000123456 1500000").unwrap();
        assert_eq!(r.wait_us, Some(1_500_000));
    }

    #[test]
    fn a_bucket_in_debt_reads_negative() {
        let r = ScriptReply::parse(b"0 -2000000 3 4 5 6").unwrap();
        assert_eq!(r.remaining, -2_000_000);
    }

    #[test]
    fn refuses_any_other_shape() {
        for bad in [
            &b""[..],
            b"1 2 3 4 5",
            b"1 2 3 4 5 6 7",
            b"1 2 3 4 5 6 ",
            b"1  2 3 4 5 6",
            b"1 2 3 4 x 6",
            b"1 2 3 4 -5 6",
            b"1 2 3 4 - 6",
            b"1 2 3 4 +5 6",
            b"1 2 3 4 5 1234567890123456789",
        ] {
            assert_eq!(
                ScriptReply::parse(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
