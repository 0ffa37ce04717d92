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
pub mod snapshot;
pub mod store;
pub mod telemetry;
pub mod upstream;

/// The global allocator of the gateway's binaries (`src/main.rs`, and the bare proxy it is
/// measured against, `bench/bare_proxy.rs`): mimalloc, chosen by measurement
/// (docs/benchmarks.md, "The allocator").
pub type Allocator = mimalloc::MiMalloc;
/// The allocator's value, for `#[global_allocator]`.
pub const ALLOCATOR: Allocator = mimalloc::MiMalloc;
