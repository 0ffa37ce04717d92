//! The gateway's edge towards clients: their connections and the TLS listeners'
//! certificates, and what is written about every request they send (the access log).

pub mod access_log;
pub mod connections;
pub mod limits;
pub mod tls;

pub use access_log::AccessLog;

use std::sync::Arc;

/// What a reload changes at the edge besides the snapshot.
pub struct Edge {
    pub access_log: Arc<AccessLog>,
    /// The TLS listeners' certificates, swapped on every reload.
    pub certificates: Arc<tls::Certificates>,
    pub connections: Arc<connections::Connections>,
}
