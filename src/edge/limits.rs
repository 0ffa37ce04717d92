//! The process's descriptor budget: the soft open-file limit is raised to the hard one at
//! start, and the default `max_connections` leaves room below it for everything else.

/// Descriptors kept for Redis, the admin listener, the access log, the config and key
/// files, and the listeners themselves.
const RESERVE: usize = 256;

/// The least of the reserve, under a low limit (where a quarter of the limit is kept): the
/// process holds about 25 descriptors idle (its runtimes' `epoll` and `eventfd`, listeners,
/// Redis, files), and a burst of new connections at the bound holds one each until it is
/// closed.
const LEAST_RESERVE: usize = 48;

/// The bound when the open-file limit is not known.
const UNKNOWN_LIMIT_BOUND: usize = 1024;

/// Idle upstream connections kept for reuse, every worker's together, at most: Pingora's own
/// default at two workers (128 a worker), and never more than an eighth of the open-file
/// limit (at least 8).
const UPSTREAM_POOL_AT_MOST: usize = 256;

/// Admin connections at once, at most: a quarter of the reserve, 4 to 64 (the rest of the
/// reserve is the process's own descriptors, Redis's connections and files).
const ADMIN_CONNECTIONS_AT_MOST: usize = 64;

/// How the process's descriptors are shared out.
#[derive(Debug, PartialEq, Eq)]
pub struct Budget {
    /// Downstream connections at once.
    pub max_connections: usize,
    /// Idle upstream connections kept for reuse, a worker's share: Pingora keeps this many
    /// for each worker thread, in one pool.
    pub upstream_pool_per_worker: usize,
    /// Admin connections open at once (more wait in the kernel's backlog).
    pub admin_connections: usize,
}

/// `max_connections` as configured, or derived from the open-file limit: every busy
/// downstream connection may hold an upstream connection too, so half of what is left after
/// the reserve and the idle upstream connections kept for reuse. Raises the soft limit
/// first; a configured bound the limit cannot carry is lowered to what it carries, with a
/// WARN: the admin listener, Redis and the upstreams never starve for descriptors.
pub fn budget(configured: Option<usize>, threads: usize) -> Budget {
    let limit = raise_open_file_limit();
    let budget = bounded(configured, threads, limit);
    let bound = budget.max_connections;
    if let Some(n) = configured.filter(|n| *n > bound) {
        tracing::warn!(
            max_connections = n,
            open_file_limit = limit,
            used = bound,
            "server.max_connections is more than the open-file limit carries (two descriptors per busy connection, the idle upstream connections kept for reuse, and a reserve for Redis, the upstreams and the admin listener): the lower bound is used; raise the limit (ulimit -n, LimitNOFILE=) for more"
        );
    }
    budget
}

/// The downstream bound `configured` puts in force with `threads` workers under this
/// process's open-file limit: what a reload compares, so that a file writing out the bound
/// the default derived (`max_connections = 9744`) changes nothing.
pub fn in_force(configured: Option<usize>, threads: usize) -> usize {
    bounded(configured, threads, raise_open_file_limit()).max_connections
}

/// The bound in force: `configured`, but never more than `limit` (the open-file limit, when
/// known) carries; without one configured, what it carries (1024 when it is not known).
fn bounded(configured: Option<usize>, threads: usize, limit: Option<usize>) -> Budget {
    let threads = threads.max(1);
    // A worker's share, at least one: with more workers than the pool's share, the pool
    // Pingora keeps is one a worker.
    let per_worker = |pool: usize| (pool / threads).max(1);
    let Some(limit) = limit else {
        return Budget {
            max_connections: configured.unwrap_or(UNKNOWN_LIMIT_BOUND),
            upstream_pool_per_worker: per_worker(UPSTREAM_POOL_AT_MOST),
            admin_connections: ADMIN_CONNECTIONS_AT_MOST,
        };
    };
    let reserve = RESERVE.min((limit / 4).max(LEAST_RESERVE));
    let upstream_pool_per_worker = per_worker((limit / 8).clamp(8, UPSTREAM_POOL_AT_MOST));
    let pooled = upstream_pool_per_worker * threads;
    let carried = (limit.saturating_sub(reserve + pooled) / 2).max(1);
    Budget {
        max_connections: configured.map_or(carried, |n| n.min(carried)),
        upstream_pool_per_worker,
        admin_connections: (reserve / 4).clamp(4, ADMIN_CONNECTIONS_AT_MOST),
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard one; returns the soft limit now in force.
fn raise_open_file_limit() -> Option<usize> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed to them.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    Some(usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_the_open_file_limit_cannot_carry_is_lowered_to_what_it_carries() {
        let bound = |configured, limit| bounded(configured, 2, limit).max_connections;
        let pool = |limit| bounded(None, 2, Some(limit)).upstream_pool_per_worker * 2;
        // 1024 descriptors: 256 kept, 128 idle upstream connections, two per busy connection.
        assert_eq!((bound(None, Some(1024)), pool(1024)), (320, 128));
        assert_eq!(bound(Some(100), Some(1024)), 100);
        assert_eq!(bound(Some(5_000), Some(1024)), 320);
        // The pool is Pingora's default at two workers, 256, from 2048 descriptors on.
        assert_eq!((bound(None, Some(20_000)), pool(20_000)), (9_744, 256));
        // Under a low limit a quarter of it is kept, never under 48, and an eighth pooled
        // (at least 8): what the rest carries, two descriptors a busy connection.
        assert_eq!((bound(None, Some(300)), pool(300)), (94, 36));
        assert_eq!(bound(Some(5_000), Some(300)), 94);
        assert_eq!(bound(Some(10), Some(300)), 10);
        assert_eq!((bound(None, Some(100)), pool(100)), (20, 12));
        assert_eq!(bound(None, Some(20)), 1);
        // A limit that cannot be read: the configured bound, or 1024.
        assert_eq!(bound(None, None), 1024);
        assert_eq!(bound(Some(5_000), None), 5_000);
    }

    #[test]
    fn the_pool_and_the_admin_fit_what_is_kept_whatever_the_workers() {
        // More workers than the pool's share: one idle upstream connection a worker, all
        // counted (256 workers at 1024 descriptors keep 256, not the 128 an eighth is).
        let many = bounded(None, 256, Some(1024));
        assert_eq!(many.upstream_pool_per_worker, 1);
        assert_eq!(many.max_connections, (1024 - 256 - 256) / 2);
        let one = bounded(None, 1, Some(1024));
        assert_eq!(
            (one.upstream_pool_per_worker, one.max_connections),
            (128, 320)
        );
        // The admin's connections are a quarter of what is kept: 64, and 12 at a limit of
        // 100 (48 kept: about 25 the process holds idle, Redis's and files' the rest).
        assert_eq!(bounded(None, 2, Some(20_000)).admin_connections, 64);
        assert_eq!(bounded(None, 2, Some(100)).admin_connections, 12);
        assert_eq!(bounded(None, 2, None).admin_connections, 64);
    }
}
