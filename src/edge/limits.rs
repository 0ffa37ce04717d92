//! The process's descriptor budget: the soft open-file limit is raised to the hard one at
//! start, and the default `max_connections` leaves room below it for everything else.

/// Descriptors kept for Redis, the admin listener, the access log, the config and key
/// files, and the listeners themselves.
const RESERVE: usize = 256;

/// The fewest downstream connections a default allows, however low the limit.
const FLOOR: usize = 64;

/// `max_connections` as configured, or derived from the open-file limit: every busy
/// downstream connection may hold an upstream connection too, so half of what is left after
/// the reserve. Raises the soft limit first; a configured bound the limit cannot carry is
/// kept, with a WARN.
pub fn max_connections(configured: Option<usize>) -> usize {
    let limit = raise_open_file_limit();
    let derived = limit.map_or(FLOOR * 16, |l| (l.saturating_sub(RESERVE) / 2).max(FLOOR));
    match configured {
        None => derived,
        Some(n) => {
            if n > derived {
                tracing::warn!(
                    max_connections = n,
                    open_file_limit = limit,
                    "server.max_connections is more than the open-file limit carries (two descriptors per busy connection): at the limit, new connections fail to accept; raise the limit (ulimit -n, LimitNOFILE=) or lower max_connections"
                );
            }
            n
        }
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
