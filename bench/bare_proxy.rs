//! The floor the gateway is measured against (`bench/run.sh`, cell 2b): a Pingora proxy that
//! does nothing but pick its one upstream, with Pingora's default settings, built with the
//! same Pingora version, build profile and global allocator as the gateway.
//!
//!   bare-proxy <listen addr> <upstream addr> [threads]

use async_trait::async_trait;
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::Server;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_proxy::{ProxyHttp, Session};

#[global_allocator]
static ALLOCATOR: sentinel_gateway::Allocator = sentinel_gateway::ALLOCATOR;

struct Bare {
    upstream: String,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut (),
    ) -> pingora_core::Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(
            &self.upstream,
            false,
            String::new(),
        )))
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: bare-proxy <listen addr> <upstream addr> [threads]");
        std::process::exit(2);
    };
    let threads = args.next().and_then(|t| t.parse().ok()).unwrap_or(2);
    // Serving settings are Pingora's defaults; a SIGTERM ends it at once (the benchmark's
    // cleanup waits for it, and Pingora's default drain is five minutes).
    let conf = ServerConf {
        threads,
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(1),
        ..ServerConf::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = pingora_proxy::http_proxy_service(&server.configuration, Bare { upstream });
    proxy.add_tcp(&listen);
    server.add_service(proxy);
    server.run_forever();
}
