//! sentinel-gateway: a Pingora reverse proxy that enforces distributed rate limits kept in
//! Redis, and decides per route what happens when Redis cannot answer.

pub mod admin;
pub mod cli;
pub mod clock;
pub mod config;
pub mod decision;
pub mod edge;
pub mod identity;
pub mod lifecycle;
pub mod limiter;
pub mod metrics;
pub mod proxy;
pub mod reload;
pub mod remote_jwks;
pub mod routing;
pub mod server;
pub mod signatures;
pub mod snapshot;
mod stdout_log;
pub mod store;
pub mod telemetry;
pub mod upstream;

/// The global allocator of the gateway's binaries (`src/main.rs`, and the bare proxy it is
/// measured against, `bench/bare_proxy.rs`): jemalloc, with [`JEMALLOC_CONF`], chosen by
/// measurement (docs/benchmarks.md, "The allocator"): as fast as mimalloc on the proxy path,
/// and the only one of glibc, mimalloc and jemalloc that gives the memory of 10 000 closed
/// connections back (within 2 s; the others kept 360-950 MB of it).
pub type Allocator = tikv_jemallocator::Jemalloc;
/// The allocator's value, for `#[global_allocator]`.
pub const ALLOCATOR: Allocator = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its start: a background thread returns freed pages to the
/// system a second after they go unused (`dirty_decay_ms`), at once past that
/// (`muzzy_decay_ms = 0`), whichever thread freed them; without it, pages freed while a
/// worker thread is idle stay with it. `_RJEM_MALLOC_CONF` in the environment still applies
/// over these.
#[export_name = "_rjem_malloc_conf"]
#[used]
pub static JEMALLOC_CONF: &[u8; 60] =
    b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0";
