//! Logs: one JSON object per line on stdout; `RUST_LOG` filters; Pingora's `log` output is
//! bridged in, with what a client causes turned down to DEBUG.
//!
//! A stdout that does not drain (a pipe whose reader stopped, a stalled log collector) never
//! blocks the thread that logs: lines it would wait for go to a thread of their own, and past
//! a few megabytes are dropped and counted (`sentinel_log_dropped_total`), as the access
//! log's are ([`crate::stdout_log`]).
//!
//! No line carries what a request or an answer carried: Pingora's errors quote the bytes of
//! a head they could not parse (`buf: ...`), which may hold a key, a token or a cookie, and
//! are logged with those bytes left out ([`Redacted`], [`redact_buf`]). Pingora's own DEBUG
//! and TRACE lines print whole headers and bodies; they are passed on only when `RUST_LOG`
//! names a `pingora` target itself (`RUST_LOG=debug` alone does not), and then cut before
//! the first value that may quote what a request or an answer carried ([`redact_values`]).
//! The `h2` library's WARN lines are about what clients did (a flood of resets, say), and so
//! are rustls's (an address sent as the SNI name, an unexpected alert): both are kept to ERROR
//! unless `RUST_LOG` names them.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use tracing_log::AsLog;
use tracing_subscriber::EnvFilter;

pub fn init() {
    let asked = std::env::var("RUST_LOG").unwrap_or_default();
    // Set but blank is unset (as a blanked `SENTINEL_REDIS_URL` is): an empty filter would
    // pass nothing at all.
    // (A list of nothing, `,` say, too.)
    let (mut filter, refused) = if asked.split(',').all(|d| d.trim().is_empty()) {
        (EnvFilter::new("info"), None)
    } else {
        match EnvFilter::try_new(&asked) {
            Ok(filter) => (filter, None),
            Err(e) => (EnvFilter::new("info"), Some(e)),
        }
    };
    for chatty in ["h2", "rustls"] {
        if !asked.contains(chatty) {
            if let Ok(quiet) = format!("{chatty}=error").parse() {
                filter = filter.add_directive(quiet);
            }
        }
    }
    let subscriber = tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(false)
        .with_span_list(false)
        .with_env_filter(filter)
        .with_writer(crate::stdout_log::MakeLineWriter)
        .finish();
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        return;
    }
    if let Some(e) = refused {
        // The value itself is the operator's own setting (no secret), shown to be fixed.
        tracing::warn!(rust_log = %asked, error = %e, "RUST_LOG is not a valid filter; logging at info (write e.g. RUST_LOG=info,sentinel_gateway=debug)");
    }
    let pingora_debug = asked.contains("pingora");
    if log::set_boxed_logger(Box::new(PingoraLog(
        tracing_log::LogTracer::new(),
        pingora_debug,
    )))
    .is_ok()
    {
        log::set_max_level(tracing::level_filters::LevelFilter::current().as_log());
    }
}

/// Log lines dropped because stdout could not take them, since the last call.
pub fn newly_dropped_lines() -> u64 {
    crate::stdout_log::stdout().newly_dropped()
}

/// Writes out the lines still waiting for stdout, before the process exits: waits for them
/// at most a second and a half (a stdout nobody reads must not hold the exit).
pub fn flush() {
    crate::stdout_log::stdout().flush(Duration::from_millis(1_500));
}

/// Pingora logs at ERROR what a client alone causes: a connection closed in the middle of a
/// request head, a reset, a failed TLS or HTTP/2 handshake, a malformed chunk. A client can
/// produce those at will, so they would drown the lines that need an operator; they are
/// passed on at DEBUG, as is one line about Pingora's own upstream pool that is no fault (see
/// [`client_caused`]). Everything else from Pingora keeps its level, with the bytes it
/// quotes left out. The flag: whether `RUST_LOG` names a `pingora` target, which lets
/// Pingora's own DEBUG and TRACE lines through.
struct PingoraLog(tracing_log::LogTracer, bool);

impl log::Log for PingoraLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        let pingora = metadata.target().starts_with("pingora");
        if pingora && metadata.level() >= log::Level::Debug && !self.1 {
            return false;
        }
        // A record that may be turned down is let through here and filtered once its level
        // is known.
        self.0.enabled(metadata) || pingora
    }

    fn log(&self, record: &log::Record<'_>) {
        if !record.target().starts_with("pingora") {
            if self.0.enabled(record.metadata()) {
                self.0.log(record);
            }
            return;
        }
        if record.level() >= log::Level::Debug && !self.1 {
            return;
        }
        let message = record.args().to_string();
        let level = if record.level() <= log::Level::Warn && client_caused(&message) {
            log::Level::Debug
        } else if message.starts_with("Graceful shutdown: grace period") {
            // Pingora's grace is set a second past the gateway's own (which ends the drain
            // and is said at the signal): its "grace period 6s starts" would contradict it,
            // and its "grace period ends" comes after the gateway's own end, if at all.
            log::Level::Debug
        } else {
            record.level()
        };
        let metadata = log::Metadata::builder()
            .level(level)
            .target(record.target())
            .build();
        if !self.0.enabled(&metadata) {
            return;
        }
        let message = redact_buf(&message);
        // Pingora's own DEBUG and TRACE lines format whole header maps, heads and bodies
        // (`Request header: Parts { .. }`, `Response body: Some(b".."))`): a line that
        // formats values keeps its words up to the first value that may quote one.
        let message = match record.level() >= log::Level::Debug && record.args().as_str().is_none()
        {
            true => redact_values(message),
            false => message,
        };
        // Without the source file and line: a path on the machine the binary was built on,
        // which says nothing to an operator (the module path names the place).
        self.0.log(
            &log::Record::builder()
                .args(format_args!("{message}"))
                .metadata(metadata)
                .module_path(record.module_path())
                .build(),
        );
    }

    fn flush(&self) {}
}

/// Whether a Pingora message is about something the client did: Pingora marks errors that
/// come from the downstream side with "Downstream", and names the handshakes. Also "failed to
/// acquire reusable stream": an idle upstream connection that Pingora's pool was still
/// watching when a request asked for it; the request opens a new one and nothing fails. And
/// an upstream that closed while a request's body was sent to it (it answered before the
/// body's end and closed, as HTTP lets it): its answer still reaches the client, and an
/// upstream that failed without one has the gateway's own line, with the request id this one
/// lacks. Any other failure to send a body (a write timeout, a body cut short) keeps its WARN.
fn client_caused(message: &str) -> bool {
    if let Some(why) = message.strip_prefix(SEND_ERROR) {
        return why.contains("Broken pipe") || why.contains("Connection reset");
    }
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

/// `message` up to the first character that begins what may quote a request or an answer
/// (`{` of a structure, `[` of a list of bytes, `"` of a string or bytes, `?` of a query),
/// the rest `(not logged)`.
pub fn redact_values(message: Cow<'_, str>) -> Cow<'_, str> {
    match message.find(['{', '[', '"', '?']) {
        Some(at) => Cow::Owned(format!("{}(not logged)", &message[..at])),
        None => message,
    }
}

/// How Pingora's line about a request body it could not send upstream begins (its error
/// follows, which quotes no bytes of a head).
const SEND_ERROR: &str = "send error, draining read buf: ";

/// `message` without the bytes Pingora quotes after `buf: ` (a request or response head it
/// could not parse, which may hold credentials): from there to its end.
pub fn redact_buf(message: &str) -> Cow<'_, str> {
    match message.find("buf: ") {
        Some(at) if !message.starts_with(SEND_ERROR) => {
            Cow::Owned(format!("{}buf: (not logged)", &message[..at]))
        }
        _ => Cow::Borrowed(message),
    }
}

/// A Pingora error displayed as Pingora does (source, type, context, then its causes), with
/// any context that quotes a head's bytes (`buf: ...`) left out.
pub struct Redacted<'a>(pub &'a pingora_core::Error);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut error = self.0;
        write!(f, "{} {}", error.esource.as_str(), error.etype.as_str())?;
        loop {
            if let Some(context) = &error.context {
                write!(f, " context: {}", redact_buf(context.as_str()))?;
            }
            let Some(cause) = &error.cause else {
                return Ok(());
            };
            match cause.downcast_ref::<Box<pingora_core::Error>>() {
                Some(next) => {
                    write!(
                        f,
                        " cause: {} {}",
                        next.esource.as_str(),
                        next.etype.as_str()
                    )?;
                    error = next;
                }
                None => return write!(f, " cause: {}", redact_buf(&cause.to_string())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{client_caused, redact_buf, redact_values, Redacted};

    #[test]
    fn quoted_bytes_never_reach_a_line() {
        use pingora_core::{Error, ErrorType};
        let parse = Error::because(
            ErrorType::InvalidHTTPHeader,
            "buf: HTTP/1.1 200 OK\\r\\nSet-Cookie: session=SECRET\\r\\n",
            "invalid header value",
        );
        let error = Error::because(ErrorType::ReadError, "while reading the response", parse);
        let shown = Redacted(&error).to_string();
        assert!(!shown.contains("SECRET"), "{shown}");
        assert_eq!(
            shown,
            " ReadError context: while reading the response cause:  InvalidHTTPHeader context: buf: (not logged) cause: invalid header value"
        );
        assert_eq!(
            redact_buf(
                "Fail to proxy: Downstream InvalidHTTPHeader context: buf: GET / X-API-Key: k"
            ),
            "Fail to proxy: Downstream InvalidHTTPHeader context: buf: (not logged)"
        );
        assert_eq!(redact_buf("nothing quoted"), "nothing quoted");
        for (line, kept) in [
            (
                r#"Request header: Parts { method: GET, uri: /k?token=T, headers: {"x-api-key": "K"} }"#,
                "Request header: Parts (not logged)",
            ),
            (
                r#"Writing request header: b"GET / HTTP/1.1\r\nCookie: c=C\r\n""#,
                "Writing request header: b(not logged)",
            ),
            (
                "Response body: [107, 101, 121]",
                "Response body: (not logged)",
            ),
            ("GET /k?token=T, Host: a", "GET /k(not logged)"),
            (
                "Write 5 bytes body to upstream",
                "Write 5 bytes body to upstream",
            ),
        ] {
            assert_eq!(redact_values(line.into()), kept);
        }
    }

    #[test]
    fn what_clients_cause_and_what_they_do_not() {
        for m in [
            "Fail to proxy: Downstream ConnectionClosed context: while reading request headers, bytes already read: 5",
            "Downstream handshake error from 127.0.0.1:45012:  TLSHandshakeFailure",
            "H2 handshake error  HandshakeError context: while h2 handshaking with client cause: Broken pipe",
            "failed to send error response to downstream: Broken pipe",
            "failed to acquire reusable stream",
            "send error, draining read buf: Upstream WriteError context: writing body cause: Broken pipe (os error 32)",
        ] {
            assert!(client_caused(m), "{m}");
        }
        for m in [
            "Fail to proxy: Upstream ConnectRefused context: Peer: addr: 127.0.0.1:9",
            "send error, draining read buf: Upstream WriteTimedout context: writing body",
            "Failed to bind listener",
        ] {
            assert!(!client_caused(m), "{m}");
        }
    }
}
