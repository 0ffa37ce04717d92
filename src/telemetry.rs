//! Logs: one JSON object per line on stdout; `RUST_LOG` filters; Pingora's `log` output is
//! bridged in, with what a client causes turned down to DEBUG.

use tracing_log::AsLog;
use tracing_subscriber::EnvFilter;

pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let subscriber = tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_span_list(false)
        .with_env_filter(filter)
        .with_writer(std::io::stdout)
        .finish();
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        return;
    }
    if log::set_boxed_logger(Box::new(PingoraLog(tracing_log::LogTracer::new()))).is_ok() {
        log::set_max_level(tracing::level_filters::LevelFilter::current().as_log());
    }
}

/// Pingora logs at ERROR what a client alone causes: a connection closed in the middle of a
/// request head, a reset, a failed TLS or HTTP/2 handshake, a malformed chunk. A client can
/// produce those at will, so they would drown the lines that need an operator; they are
/// passed on at DEBUG, as is one line about Pingora's own upstream pool that is no fault (see
/// [`client_caused`]). Everything else from Pingora keeps its level.
struct PingoraLog(tracing_log::LogTracer);

impl log::Log for PingoraLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        // A record that may be turned down is let through here and filtered once its level
        // is known.
        self.0.enabled(metadata) || metadata.target().starts_with("pingora")
    }

    fn log(&self, record: &log::Record<'_>) {
        if record.level() <= log::Level::Warn
            && record.target().starts_with("pingora")
            && client_caused(&record.args().to_string())
        {
            self.0.log(
                &log::Record::builder()
                    .args(*record.args())
                    .level(log::Level::Debug)
                    .target(record.target())
                    .module_path(record.module_path())
                    .file(record.file())
                    .line(record.line())
                    .build(),
            );
            return;
        }
        if self.0.enabled(record.metadata()) {
            self.0.log(record);
        }
    }

    fn flush(&self) {}
}

/// Whether a Pingora message is about something the client did: Pingora marks errors that
/// come from the downstream side with "Downstream", and names the handshakes. Also "failed to
/// acquire reusable stream": an idle upstream connection that Pingora's pool was still
/// watching when a request asked for it; the request opens a new one and nothing fails.
fn client_caused(message: &str) -> bool {
    const CLIENT: &[&str] = &[
        "failed to acquire reusable stream",
        "Downstream ",
        "downstream handshake",
        "Downstream handshake",
        "H2 handshake error",
        "to downstream",
        "while reading request headers",
    ];
    CLIENT.iter().any(|m| message.contains(m))
}

#[cfg(test)]
mod tests {
    use super::client_caused;

    #[test]
    fn what_clients_cause_and_what_they_do_not() {
        for m in [
            "Fail to proxy: Downstream ConnectionClosed context: while reading request headers, bytes already read: 5",
            "Downstream handshake error from 127.0.0.1:45012:  TLSHandshakeFailure",
            "H2 handshake error  HandshakeError context: while h2 handshaking with client cause: Broken pipe",
            "failed to send error response to downstream: Broken pipe",
            "failed to acquire reusable stream",
        ] {
            assert!(client_caused(m), "{m}");
        }
        for m in [
            "Fail to proxy: Upstream ConnectRefused context: Peer: addr: 127.0.0.1:9",
            "Failed to bind listener",
        ] {
            assert!(!client_caused(m), "{m}");
        }
    }
}
