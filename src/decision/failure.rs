//! What a store failure is: every way an evaluation can fail, the row of the decision table
//! it ends in, and how it counts for its node's breaker. The store says what happened; this
//! file alone says what that means.
//!
//! - Every timeout is one failure.
//! - A lost connection is one failure for all the requests in flight on it: the loss is
//!   counted once, when the connection is forgotten (by the request or the socket watch that
//!   sees it first), and the requests that fail with it count nothing more.
//! - While the connection is being made again, requests fail at once and count nothing; each
//!   failed connection attempt counts one, once a request has found the node down (a node
//!   that goes down while nothing asks for it opens no breaker: the first requests to find it
//!   down are `redis_connection_error`). A connection killed once and made again within
//!   milliseconds never opens the breaker.
//! - An error reply that says the store cannot serve (`OOM`, `LOADING`, `BUSY`,
//!   `MASTERDOWN`, `READONLY`, `CLUSTERDOWN`, `TRYAGAIN`, `MISCONF`, `NOPERM` and an ACL
//!   refusal inside a script, and any other the gateway does not know) is one failure.
//! - An error reply about one key's data (`WRONGTYPE`, a script error on a corrupted bucket)
//!   fails that decision by its fail mode but neither counts for nor resets the breaker: a
//!   broken key harms its own identity only.
//! - `NOSCRIPT` after the one `SCRIPT LOAD`, and a command Redis rejects as malformed (a bug
//!   on our side), are one failure each.
//!
//! A half-open probe is different: it is the one request asked to find out whether Redis
//! serves, so every failure of a probe re-opens the breaker, except a broken key, which says
//! nothing about Redis and hands the probe to the next request.

use super::StoreFailure;

/// One way an evaluation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The budget ran out.
    Timeout,
    /// The connection broke under the evaluation (its loss is counted when it is forgotten).
    ConnectionLost,
    /// There was no connection to use: it is being made again.
    NotConnected,
    /// Redis answered that it cannot serve now.
    Unavailable,
    /// Redis could not run the script on this key's data.
    BrokenKey,
    /// The script is still missing after the one `SCRIPT LOAD`.
    Noscript,
    /// Redis refused the command itself, or answered a shape no script writes: a bug.
    Rejected,
    /// A decision whose keys lie in several slots of one cluster node could not be decided
    /// in that node's batch (it would have to go on its own, where Redis refuses keys of
    /// several slots): nothing was written, and the decision is made slot by slot instead.
    /// No failure of Redis: it never reaches the decision table.
    Split,
    /// The node a `MOVED` or `ASK` named has its breaker open (this much of its quarantine
    /// left): the call goes no further, and the decision is that node's short-circuit
    /// (`circuit_open`), as for a node asked first. No failure of Redis either.
    Quarantined(std::time::Duration),
}

/// What a failed evaluation does to its node's breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charge {
    /// One more consecutive failure (for a probe: the breaker opens again).
    Failure,
    /// Nothing: the failure count is neither raised nor reset (a probe is handed on).
    Nothing,
}

impl Failure {
    /// The decision table's row.
    pub fn cause(self) -> StoreFailure {
        match self {
            Failure::Timeout => StoreFailure::Timeout,
            Failure::Noscript => StoreFailure::Noscript,
            Failure::ConnectionLost
            | Failure::NotConnected
            | Failure::Unavailable
            | Failure::BrokenKey
            | Failure::Rejected
            | Failure::Split
            | Failure::Quarantined(_) => StoreFailure::ConnectionError,
        }
    }

    /// How it counts for the breaker; `probe`: the evaluation was the half-open probe.
    pub fn charge(self, probe: bool) -> Charge {
        match self {
            Failure::BrokenKey | Failure::Split | Failure::Quarantined(_) => Charge::Nothing,
            Failure::ConnectionLost | Failure::NotConnected if !probe => Charge::Nothing,
            _ => Charge::Failure,
        }
    }

    /// The failure an error reply stands for, by its code (the reply's first word) and the
    /// rest of its text.
    pub fn of_reply(code: &str, detail: &str) -> Failure {
        match code {
            // The ACL user may not run a command, or touch a key, a script needs: no decision
            // can be made, as with `OOM`. Inside a script Redis says so in an `ERR`, in its
            // own words by version (`NOPERM` is the code of the same refusal outside one).
            "ERR" if is_acl_refusal(detail) => Failure::Unavailable,
            // A cluster batch (its keys not declared) in a cluster that lost its quorum or
            // slots: what `CLUSTERDOWN` says of a call of its own.
            "ERR" if detail.contains("while the cluster is down") => Failure::Unavailable,
            "NOSCRIPT" => Failure::Noscript,
            // The script ran after the decision's deadline and wrote nothing
            // (`store/deadline.rs`): the budget was spent.
            "EXPIRED" => Failure::Timeout,
            "WRONGTYPE" => Failure::BrokenKey,
            // Redis 6 wraps an error a command inside the script got (`-OOM ...`) in its own
            // `ERR Error running script ...`: that inner error is what happened.
            "ERR" if is_script_runtime_error(detail) => match inner_code(detail) {
                Some(inner) if inner != "ERR" => Failure::of_reply(inner, detail),
                // A script that fails on its own ran into data it cannot read: the key's
                // fields were written by something else.
                _ => Failure::BrokenKey,
            },
            // Other `ERR`s are about the command.
            "ERR" => Failure::Rejected,
            _ => Failure::Unavailable,
        }
    }
}

/// The code of an error reply a script relayed (`... @user_script:1: -OOM command not
/// allowed ...`): the upper-case word after the first ` -`.
fn inner_code(detail: &str) -> Option<&str> {
    let (_, rest) = detail.split_once(" -")?;
    let code = rest.split(|c: char| !c.is_ascii_uppercase()).next()?;
    (!code.is_empty()).then_some(code)
}

/// An ACL refusal of a command inside a script: Redis 6.x and 7.0-7.1 ("The user executing
/// the script can't run this command or subcommand", "... can't access at least one of the
/// keys ..."), Redis 7.2+ and Valkey ("ACL failure in script: User x has no permissions to
/// run the 'hset' command"), relayed plain or inside a script error.
pub fn is_acl_refusal(detail: &str) -> bool {
    detail.contains("The user executing the script can't")
        || detail.contains("ACL failure in script")
        || detail.contains("has no permissions to")
        || detail.contains("No permissions to access")
}

/// Redis 7 writes `user_script:<line>: <what>`, Redis 6 `Error running script (call to
/// f_<sha>): @user_script:<line>: <what>`.
fn is_script_runtime_error(detail: &str) -> bool {
    detail.contains("user_script:") || detail.starts_with("Error running script")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reply_prefix_of_the_contract_has_its_row_and_charge() {
        for code in [
            "OOM",
            "LOADING",
            "BUSY",
            "MASTERDOWN",
            "READONLY",
            "CLUSTERDOWN",
            "TRYAGAIN",
            "MISCONF",
            "NOPERM",
            "SOMETHINGNEW",
        ] {
            let f = Failure::of_reply(code, "anything");
            assert_eq!(f, Failure::Unavailable, "{code}");
            assert_eq!(f.cause(), StoreFailure::ConnectionError, "{code}");
            assert_eq!(f.charge(false), Charge::Failure, "{code}: one failure");
        }
        let broken = [
            ("WRONGTYPE", "Operation against a key holding the wrong kind of value"),
            (
                "ERR",
                "user_script:31: attempt to perform arithmetic on a nil value script: 9f1c, on @user_script:31.",
            ),
            (
                "ERR",
                "Error running script (call to f_9f1c): @user_script:31: attempt to compare nil with number",
            ),
        ];
        for (code, detail) in broken {
            let f = Failure::of_reply(code, detail);
            assert_eq!(f, Failure::BrokenKey, "{code} {detail}");
            assert_eq!(f.cause(), StoreFailure::ConnectionError);
            assert_eq!(f.charge(false), Charge::Nothing, "harms its own key only");
            assert_eq!(f.charge(true), Charge::Nothing, "a probe is handed on");
        }
        // Redis 6 relays the inner error inside its own ERR.
        for (detail, want) in [
            ("Error running script (call to f_9f1c): @user_script:27: @user_script: 27: -OOM command not allowed when used memory > 'maxmemory'.", Failure::Unavailable),
            ("Error running script (call to f_9f1c): @user_script:27: @user_script: 27: -READONLY You can't write against a read only replica.", Failure::Unavailable),
            ("Error running script (call to f_9f1c): @user_script:27: @user_script: 27: -WRONGTYPE Operation against a key holding the wrong kind of value", Failure::BrokenKey),
            ("Error running script (call to f_9f1c): @user_script:31: user_script:31: attempt to compare nil with number", Failure::BrokenKey),
        ] {
            assert_eq!(Failure::of_reply("ERR", detail), want, "{detail}");
        }
        // A command or key the ACL user may not use, inside a script (Redis 7.0), plain and
        // as the batch script relays it.
        for detail in [
            "The user executing the script can't run this command or subcommand script: 2248ea7f, on @user_script:1.",
            "The user executing the script can't run this command or subcommand",
            "The user executing the script can't access at least one of the keys mentioned in the command script: 2248ea7f, on @user_script:1.",
            // Redis 7.2+ and Valkey, plain and as the batch script relays it.
            "ACL failure in script: User gateway has no permissions to run the 'hset' command script: 2248ea7f, on @user_script:17.",
            "ACL failure in script: User gateway has no permissions to run the 'hset' command",
            "ACL failure in script: No permissions to access a key script: 2248ea7f, on @user_script:17.",
            // Redis 6 wraps it in its own script error.
            "Error running script (call to f_2248ea7f): @user_script:17: @user_script: 17: The user executing the script can't run this command or subcommand",
        ] {
            assert_eq!(Failure::of_reply("ERR", detail), Failure::Unavailable, "{detail}");
        }
        let noscript = Failure::of_reply("NOSCRIPT", "No matching script.");
        assert_eq!(
            (noscript, noscript.cause(), noscript.charge(false)),
            (Failure::Noscript, StoreFailure::Noscript, Charge::Failure)
        );
        let bug = Failure::of_reply("ERR", "wrong number of arguments for 'evalsha' command");
        assert_eq!(
            (bug, bug.charge(false)),
            (Failure::Rejected, Charge::Failure)
        );
    }

    #[test]
    fn a_decision_split_across_slots_counts_nothing() {
        // Never asked of Redis: neither for nor against the breaker, a probe handed on.
        assert_eq!(Failure::Split.charge(false), Charge::Nothing);
        assert_eq!(Failure::Split.charge(true), Charge::Nothing);
    }

    #[test]
    fn a_lost_connection_counts_once_and_only_probes_fail_on_it() {
        for f in [Failure::ConnectionLost, Failure::NotConnected] {
            assert_eq!(f.cause(), StoreFailure::ConnectionError);
            assert_eq!(f.charge(false), Charge::Nothing, "{f:?}");
            assert_eq!(f.charge(true), Charge::Failure, "{f:?} fails the probe");
        }
        assert_eq!(Failure::Timeout.cause(), StoreFailure::Timeout);
        assert_eq!(Failure::Timeout.charge(false), Charge::Failure);
    }
}
