//! How a node is reached: its connection info with `[redis]`'s credentials applied, and the
//! TLS settings for `rediss://`.
//!
//! The store opens every socket itself (the socket watch of `connect.rs` sits under the
//! Redis protocol), so the TLS handshake is made here with tokio-rustls, over the TCP socket,
//! before redis-rs sees the stream. redis-rs parses the URL in its `redis://` form.

use std::io;
use std::sync::Arc;

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

use crate::config::RedisAccess;

#[derive(Clone)]
pub(super) struct Dial {
    pub(super) info: ConnectionInfo,
    /// `rediss://`: the handshake's settings.
    pub(super) tls: Option<Arc<rustls::ClientConfig>>,
    /// Why there is no address to dial ([`Dial::nowhere`]); every attempt fails with it.
    pub(super) nowhere: Option<&'static str>,
}

impl Dial {
    /// The node of `url`, reached with `access` (its user and password win over the URL's).
    pub(super) fn new(url: &str, access: &RedisAccess) -> io::Result<Self> {
        let invalid = |e: String| io::Error::new(io::ErrorKind::InvalidInput, e);
        let (tls, plain) = match url.strip_prefix("rediss://") {
            Some(rest) => (true, format!("redis://{rest}")),
            None => (false, url.to_owned()),
        };
        let info = plain
            .as_str()
            .into_connection_info()
            .map_err(|e| invalid(e.to_string()))?;
        let tls = match (tls, &access.tls) {
            (false, _) => None,
            (true, Some(t)) => Some(Arc::clone(&t.client)),
            (true, None) => return Err(invalid("rediss:// without TLS settings".into())),
        };
        Ok(Self {
            info: with_access(info, access),
            tls,
            nowhere: None,
        })
    }

    /// No node to reach yet (no sentinel names a master): every attempt fails at once with
    /// `why`, counted as a failed connection attempt, and nothing is dialled.
    pub(super) fn nowhere(why: &'static str) -> Self {
        Self {
            info: "redis://127.0.0.1:1/0"
                .into_connection_info()
                .expect("a valid URL"),
            tls: None,
            nowhere: Some(why),
        }
    }

    /// The same settings at another address (a cluster node the seeds named).
    pub(super) fn at(&self, host: &str, port: u16) -> Self {
        Self {
            info: self
                .info
                .clone()
                .set_addr(ConnectionAddr::Tcp(host.to_owned(), port)),
            tls: self.tls.clone(),
            nowhere: None,
        }
    }
}

fn with_access(info: ConnectionInfo, access: &RedisAccess) -> ConnectionInfo {
    let mut settings = info.redis_settings().clone();
    if let Some(user) = &access.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = &access.password {
        // Checked to be UTF-8 when the config was loaded.
        settings = settings.set_password(String::from_utf8_lossy(&password.0));
    }
    info.set_redis_settings(settings)
}
