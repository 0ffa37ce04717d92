//! The gateway's edge towards clients: what is written about every request they send (the
//! access log).

pub mod access_log;

pub use access_log::AccessLog;
