//! Loading `gateway.toml`: read, parse into the raw mirror, validate into domain types.
//!
//! A `Config` can only be built through validation, so the rest of the gateway never sees an
//! invalid value.

pub mod api_keys;
mod error;
mod jwks;
pub mod raw;
pub mod tls;
mod validate;
pub(crate) use validate::key_shown;

pub use api_keys::{ApiKeyTable, KeyOwner};
pub use error::{line_col, ConfigError, ConfigErrors};
pub use tls::{CertPair, ServerName, TlsListener, TlsVersion};

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use crate::routing::{Matcher, PathMatch};

/// The environment variable that overrides `[redis] url`.
pub const REDIS_URL_ENV: &str = "SENTINEL_REDIS_URL";

/// `url` as it may be shown in a message or a log line: a password in it (`user:password@`,
/// or a `pass=`/`password=` query parameter, as redis-rs reads unix socket URLs) is written
/// `***`; the user name stays. Whatever follows the scheme up to the last `@` counts as the
/// user information, so a password holding a `/` (which makes the URL unreadable) is hidden
/// too; in text that does not start with a scheme and `://`, everything before the last `@`.
pub fn redact_url(url: &str) -> std::borrow::Cow<'_, str> {
    redacted(url, false)
}

/// As [`redact_url`], with every value of the query written `***` (and a bare token in it):
/// for URLs that may carry a secret anywhere there (a presigned URL's signature, a
/// `client_secret=`).
pub fn redact_url_and_query(url: &str) -> std::borrow::Cow<'_, str> {
    redacted(url, true)
}

/// Where the `://` after a URL's scheme is, if `text` starts with one: a scheme is letters,
/// digits, `+`, `-` and `.` (RFC 3986), so a `://` further on (inside a password, say) does
/// not make the text a URL.
pub fn scheme_end(text: &str) -> Option<usize> {
    text.find("://").filter(|&s| {
        s > 0
            && text[..s]
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b))
    })
}

fn redacted(url: &str, every_value: bool) -> std::borrow::Cow<'_, str> {
    let scheme = scheme_end(url);
    let start = scheme.map_or(0, |s| s + 3);
    let mut out = std::borrow::Cow::Borrowed(url);
    if let Some(at) = url[start..].rfind('@').map(|i| start + i) {
        if scheme.is_none() {
            // Not a URL (a mistyped scheme, say): what comes before its last `@` may hold a
            // password anywhere.
            out = format!("***{}", &url[at..]).into();
        } else if let Some(colon) = url[start..at].find(':') {
            out = format!("{}:***{}", &url[..start + colon], &url[at..]).into();
        }
    }
    if let Some(q) = out.find('?') {
        let (head, query) = out.split_at(q + 1);
        let masked: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                // The name as a client reads it: `pa%73s` is `pass`.
                Some((k, _))
                    if every_value || {
                        let k = percent_encoding::percent_decode_str(k).decode_utf8_lossy();
                        k.eq_ignore_ascii_case("pass") || k.eq_ignore_ascii_case("password")
                    } =>
                {
                    format!("{k}=***")
                }
                None if every_value && !pair.is_empty() => "***".to_owned(),
                _ => pair.to_owned(),
            })
            .collect();
        let query = masked.join("&");
        if query != out[q + 1..] {
            out = format!("{head}{query}").into();
        }
    }
    out
}

/// HTTP/2's default windows: a stream's 1 MiB (a 200 MB upload 50 ms away takes 10 s, not
/// the 160 s of the protocol's 64 KiB), a connection's twice that, so that a stream whose
/// upstream stops reading holds at most half of it and the others go on. A connection's
/// window is also the most body bytes a client can make the gateway hold before they are
/// passed on (each stream in progress holds buffers of its own besides).
pub const H2_STREAM_WINDOW: i64 = 1 << 20;
pub const H2_CONNECTION_WINDOW: i64 = 2 << 20;

/// Largest accepted `max_body_bytes` (1 TiB); 0 means no limit.
pub const MAX_BODY_BYTES: i64 = 1 << 40;

/// Shortest accepted admin token, in bytes.
pub const MIN_ADMIN_TOKEN_BYTES: usize = 16;

/// The default `request_id_header`.
pub const DEFAULT_REQUEST_ID_HEADER: &str = "x-request-id";

/// One micro-token: the cost of one request.
pub const ONE_TOKEN_MICRO: u64 = 1_000_000;

/// Largest accepted `capacity_micro` (10^9 requests); see docs/algorithms.md for why the
/// Lua arithmetic stays exact below it.
pub const MAX_CAPACITY_MICRO: u64 = 1_000_000_000_000_000;

/// Largest accepted `refill_rate_micro_per_sec` and fallback rates (10^6 requests per second).
pub const MAX_RATE_MICRO_PER_SEC: u64 = 1_000_000_000_000;

/// A file's modification time, length, status change time and inode (`None`: it cannot be
/// read): what `watch_config` compares. The status change time is the kernel's, moved by
/// every write and rename, where the modification time is whatever a tool sets it to (`cp
/// -p`, `rsync -a` and `tar` keep the old one): a change of the same length under the
/// old time was missed.
pub type FileStamp = Option<FileState>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileState {
    modified: Option<std::time::SystemTime>,
    len: u64,
    changed: (i64, i64),
    inode: (u64, u64),
}

/// `path` as it is now.
pub(crate) fn file_stamp(path: &Path) -> FileStamp {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| FileState {
        modified: m.modified().ok(),
        len: m.len(),
        changed: (m.ctime(), m.ctime_nsec()),
        inode: (m.dev(), m.ino()),
    })
}

/// What the config load running on a thread keeps beside what it reads.
struct Load {
    /// Set while [`Config::load_at_start`] reads: a FIFO's writer is waited for.
    at_start: bool,
    /// The files a config names, each stamped just before the load first read it
    /// ([`read_named`]); taken into [`Config::named_read`] when the load ends.
    named_read: Vec<(PathBuf, FileStamp)>,
    /// The files the last load that failed named and tried to read, stamped as above
    /// ([`take_refused_named`]).
    refused_named: Vec<(PathBuf, FileStamp)>,
}

thread_local! {
    static LOAD: std::cell::RefCell<Load> = const {
        std::cell::RefCell::new(Load {
            at_start: false,
            named_read: Vec::new(),
            refused_named: Vec::new(),
        })
    };
}

/// The files the last config load on this thread that failed named and tried to read (a key
/// file not there yet, say), each stamped just before: what `watch_config` watches after a
/// refused reload.
pub(crate) fn take_refused_named() -> Vec<(PathBuf, FileStamp)> {
    LOAD.with_borrow_mut(|load| std::mem::take(&mut load.refused_named))
}

/// Reads a file the config names (API keys, JWKS, a certificate or key), stamped first: a
/// change made while it is read is then a change to `watch_config`, never missed.
pub(crate) fn read_named(path: &Path) -> std::io::Result<Vec<u8>> {
    read_named_up_to(path, u64::MAX)
}

/// [`read_named`], reading at most `most` bytes and one more (so that a file longer than
/// `most` can be told from one of `most`): a secret's file named as `/dev/zero` ends.
pub(crate) fn read_named_up_to(path: &Path, most: u64) -> std::io::Result<Vec<u8>> {
    let stamp = file_stamp(path);
    LOAD.with_borrow_mut(|load| {
        if !load.named_read.iter().any(|(p, _)| p == path) {
            load.named_read.push((path.to_path_buf(), stamp));
        }
    });
    read_whole_up_to(path, most)
}

/// A file the config names that `watch_config` does not watch (a CA file, Redis's client
/// certificate): read as [`read_named`] reads, not listed among the files read.
pub(crate) fn read_unwatched(path: &Path) -> std::io::Result<Vec<u8>> {
    read_whole(path)
}

/// A file of the config, whole. At start a FIFO (a file a process writes as it is read) is
/// waited for until its writer ends, as a start waits for the access log's reader; a reload
/// does not wait for a writer that is not there (it held `POST /reload`, and every reload
/// after it, until one came): such a FIFO reads as empty, which no file of the config may be.
fn read_whole(path: &Path) -> std::io::Result<Vec<u8>> {
    read_whole_up_to(path, u64::MAX)
}

/// [`read_whole`], of at most `most` bytes and one more.
fn read_whole_up_to(path: &Path, most: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = match LOAD.with_borrow(|load| load.at_start) {
        true => std::fs::File::open(path)?,
        false => open_without_waiting(std::fs::OpenOptions::new().read(true), path)?,
    };
    let mut bytes = Vec::new();
    file.take(most.saturating_add(1)).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Opens `path` as `options` say without waiting for a FIFO's other end (a FIFO read with
/// no writer reads as empty; one written with no reader is `ENXIO`), then makes the file's
/// reads and writes wait as usual (for a peer that is there and still busy). A regular file
/// is opened as `options.open` opens it.
pub(crate) fn open_without_waiting(
    options: &mut std::fs::OpenOptions,
    path: &Path,
) -> std::io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let file = options.custom_flags(libc::O_NONBLOCK).open(path)?;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is this open file's, for the duration of the calls.
    let cleared = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Where a file's first byte that is not UTF-8 is: its line, and its column counted in
/// characters (1-based).
pub(crate) fn not_utf8_at(e: &std::string::FromUtf8Error) -> (usize, usize) {
    let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
    let valid = std::str::from_utf8(valid).unwrap_or_default();
    let line = valid.matches('\n').count() + 1;
    let column = valid
        .rsplit('\n')
        .next()
        .unwrap_or_default()
        .chars()
        .count()
        + 1;
    (line, column)
}

/// Why a file a config names was not read as text.
pub(crate) enum NotRead {
    Io(std::io::Error),
    /// Read, but not UTF-8 from this line and column on ([`not_utf8_at`]).
    NotUtf8((usize, usize)),
}

/// [`read_named`], as UTF-8: a byte that is not is said at its line and column, as any
/// other problem of the file is.
pub(crate) fn read_named_text(path: &Path) -> Result<String, NotRead> {
    let bytes = read_named(path).map_err(NotRead::Io)?;
    String::from_utf8(bytes).map_err(|e| NotRead::NotUtf8(not_utf8_at(&e)))
}

/// A validated gateway configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub source: PathBuf,
    pub server: ServerConfig,
    pub redis: RedisConfig,
    pub breaker: BreakerConfig,
    pub jwt: Option<JwtConfig>,
    pub api_keys: Option<ApiKeysConfig>,
    pub access_log: Option<AccessLogTarget>,
    pub upstreams: BTreeMap<String, Arc<UpstreamConfig>>,
    pub routes: Vec<RouteConfig>,
    /// What the file says that works, but perhaps not as meant (a CIDR with host bits set):
    /// printed by `check`, logged at start and after each reload.
    pub warnings: Vec<ConfigError>,
    /// The files it names, as they were just before this load read them.
    pub named_read: Vec<(PathBuf, FileStamp)>,
    /// The files its secrets were read from (`password_file`, `admin_token_file`,
    /// `sentinel_password_file`, `secret_file`).
    pub secret_files: Vec<PathBuf>,
    /// The first 16 hex digits of the SHA-256 of the file's text as read: which config an
    /// instance runs, alike on every gateway given the same file (`/readyz`,
    /// `sentinel_config_info`).
    pub source_hash: String,
}

/// Where `[access_log]` lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessLogTarget {
    /// `path = "-"`.
    Stdout,
    File(PathBuf),
}

/// A TOML file with nothing in it but blank lines and comments: what a truncated file, or
/// one an editor or deploy has not written yet, reads as. Never loaded.
/// Looked at line by line first: read as a TOML document, a key file of a million keys took
/// 1.4 GB only to learn it was not empty.
pub(crate) fn is_empty_toml(source: &str) -> bool {
    let text = source.strip_prefix('\u{feff}').unwrap_or(source);
    let blank_or_comments = text.lines().all(|l| {
        let l = l.trim_start();
        l.is_empty() || l.starts_with('#')
    });
    // The lines say it may be empty: TOML says whether it is (a comment with a control
    // character is an error, said as one).
    blank_or_comments && source.parse::<toml::Table>().is_ok_and(|t| t.is_empty())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub listen: Vec<SocketAddr>,
    /// `[[server.tls]]`: the TLS listeners, beside the plain ones.
    pub tls: Vec<TlsListener>,
    /// A connection whose request head is not complete by then is closed.
    pub header_read_timeout: Duration,
    /// An idle keep-alive connection is closed after this; zero: no keep-alive.
    pub keepalive_timeout: Duration,
    /// A connection whose writes to its client make no progress for this long is closed
    /// (a client that stopped reading its answer); zero: never.
    pub send_timeout: Duration,
    /// The bound on downstream connections; `None`: what the open-file limit allows.
    pub max_connections: Option<usize>,
    pub threads: usize,
    pub admin_listen: SocketAddr,
    pub trusted_proxies: Vec<IpNet>,
    /// The prefix length an IPv6 `client_ip` identity is keyed by (128: the address).
    pub ipv6_identity_prefix: u8,
    pub grace_period: Duration,
    /// On `SIGTERM`, how long the listeners go on accepting, `/readyz` unready, before they
    /// close (a load balancer's time to stop sending new connections).
    pub drain_delay: Duration,
    /// Reload when the file changes (polled, debounced).
    pub watch_config: bool,
    /// Also accept HTTP/2 with prior knowledge on the plain listeners.
    pub h2c: bool,
    /// HTTP/2 flow control: what a client may send on a stream, and on a connection, before
    /// the gateway has passed it on (the windows it announces and keeps open).
    pub h2_stream_window: u32,
    /// HTTP/2: the streams a client connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS).
    pub h2_max_streams: u32,
    pub h2_connection_window: u32,
    /// The body size of routes without their own `max_body_bytes`; `None`: no limit.
    pub max_body_bytes: Option<u64>,
    /// The request id's header, on upstream requests and on every answer.
    pub request_id_header: http::HeaderName,
    /// The same name as the bytes Pingora's `insert_header` takes without copying them.
    pub request_id_wire: bytes::Bytes,
    /// `Strict-Transport-Security` for every answer over a TLS listener (an upstream's own
    /// kept): `None`, none added.
    pub strict_transport_security: Option<http::HeaderValue>,
    /// `admin_token_env`'s (or `admin_token_file`'s) value: every admin request but `/healthz` and `/readyz` needs it
    /// as a bearer token.
    pub admin_token: Option<Secret>,
}

impl ServerConfig {
    /// `send_timeout_seconds` as Pingora's sessions take it: `None` when 0 (never).
    pub fn send_timeout_option(&self) -> Option<Duration> {
        (!self.send_timeout.is_zero()).then_some(self.send_timeout)
    }

    /// Whether the listener `addr` is bound IPv6 only: a `[::]` one beside a listener of
    /// an IPv4 address (or an IPv4-mapped one) on its port, the plain, TLS or admin ones,
    /// which takes that port's IPv4 connections (nginx binds `[::]` so always). Alone on its
    /// port, `[::]` takes IPv4 too where the host's `net.ipv6.bindv6only` is 0.
    pub fn ipv6_only(&self, addr: SocketAddr) -> bool {
        let ipv4 = |other: &SocketAddr| {
            other.port() == addr.port() && crate::identity::canonical(other.ip()).is_ipv4()
        };
        addr.is_ipv6()
            && addr.ip().is_unspecified()
            && (self.listen.iter())
                .chain(self.tls.iter().map(|t| &t.listen))
                .chain(std::iter::once(&self.admin_listen))
                .any(ipv4)
    }

    /// Binds the listener `addr` as the gateway serves it ([`Self::ipv6_only`]).
    pub fn bind(&self, addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
        let socket = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?;
        socket.set_reuse_address(true)?;
        if self.ipv6_only(addr) {
            socket.set_only_v6(true)?;
        }
        socket.bind(&addr.into())?;
        socket.listen(1024)?;
        Ok(socket.into())
    }

    /// Pingora's options for the listener `addr` ([`Self::ipv6_only`]).
    pub fn socket_options(
        &self,
        addr: SocketAddr,
    ) -> Option<pingora_core::listeners::TcpSocketOptions> {
        self.ipv6_only(addr).then(|| {
            let mut options = pingora_core::listeners::TcpSocketOptions::default();
            options.ipv6_only = Some(true);
            options
        })
    }
}

/// The largest `batch_max`: what one Redis call may decide at most.
pub const BATCH_MAX_LARGEST: i64 = 1024;
// A power of two: `sentinel_redis_batch_size`'s buckets are the powers of two up to it.
const _: () = assert!((BATCH_MAX_LARGEST as u64).is_power_of_two());

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    pub target: RedisTarget,
    pub timeout: Duration,
    pub key_prefix: String,
    pub require_noeviction: bool,
    /// Drive the Redis connections on a thread of their own rather than on the proxy's
    /// workers: a decision then never queues behind saturated workers for its reply.
    pub dedicated_io_thread: bool,
    /// The most decisions one batched call carries (at most [`BATCH_MAX_LARGEST`]); 1 sends
    /// each decision alone.
    pub batch_max: usize,
    /// Credentials and TLS, for every node.
    pub access: RedisAccess,
}

/// How every Redis node is reached: the ACL user and password (over those in a URL), and
/// TLS for `rediss://` URLs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RedisAccess {
    pub username: Option<String>,
    /// From `password_env` or `password_file`: never in the config file.
    pub password: Option<Secret>,
    /// Present exactly when the URLs are `rediss://`.
    pub tls: Option<tls::RedisTls>,
}

impl RedisAccess {
    /// The client certificate's file and the end of its validity (Unix seconds), for
    /// `sentinel_tls_cert_expiry_timestamp_seconds`.
    pub fn client_cert_expiry(&self) -> Option<(&str, i64)> {
        let tls = self.tls.as_ref()?;
        Some((tls.cert_written.as_deref()?, tls.not_after?))
    }
}

/// Where the limiter's state lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One Redis (`[redis] url`, or `SENTINEL_REDIS_URL`).
    Single(String),
    /// Redis Cluster, discovered from these seed nodes (`[redis] cluster_urls`).
    Cluster(Vec<String>),
    /// The master Redis Sentinel names (`[redis] sentinel_urls`, `sentinel_master`).
    Sentinel(SentinelTarget),
}

/// Where the sentinels are, which master to ask them for, and how to reach them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelTarget {
    pub sentinels: Vec<String>,
    pub master: String,
    /// `sentinel_password_env` or `_file`: the sentinels' own password.
    pub password: Option<Secret>,
}

impl RedisTarget {
    pub fn sentinel(&self) -> Option<&SentinelTarget> {
        match self {
            RedisTarget::Sentinel(s) => Some(s),
            _ => None,
        }
    }

    /// How the target is named in messages: the URL, or the seeds joined by commas.
    pub fn describe(&self) -> String {
        match self {
            RedisTarget::Single(url) => url.clone(),
            RedisTarget::Cluster(seeds) => format!("cluster {}", seeds.join(",")),
            RedisTarget::Sentinel(s) => {
                format!("sentinel master {} via {}", s.master, s.sentinels.join(","))
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    pub failure_threshold: NonZeroU32,
    pub open_for: Duration,
}

#[derive(Debug, Clone)]
pub struct JwtConfig {
    pub secret_env: String,
    /// A subset of [`JWT_ALGORITHMS`].
    pub algorithms: Vec<String>,
    /// Read from `secret_env` (or `secret_file`) when a route uses `identity = "jwt"` with an HS* algorithm.
    pub secret: Option<Secret>,
    /// The public keys of `jwks_path` (resolved against the config file's directory), read at
    /// load.
    pub jwks: Option<Arc<jsonwebtoken::jwk::JwkSet>>,
    pub jwks_path: Option<PathBuf>,
    /// A JWKS fetched over HTTPS (or HTTP on loopback) in the background, instead of a file.
    pub jwks_url: Option<String>,
    pub jwks_refresh: Duration,
    /// When not empty, `iss` must equal one of them.
    pub issuer: Vec<String>,
    /// Claims each token must carry with one of their values (a list claim: holding one):
    /// `token_use = "access"`, `client_id = [...]` (Cognito's access tokens have no `aud`).
    pub required_claims: Vec<(String, Vec<String>)>,
    /// When not empty, `aud` must contain one of them.
    pub audiences: Vec<String>,
    /// Clock skew tolerated on `exp` and `nbf`.
    pub leeway_secs: u64,
    /// The claim that names the caller (`sub` by default).
    pub identity_claim: String,
}

/// Every JWT algorithm a config may list: HS* verify with the shared secret, the others with keys
/// of `jwks_path`.
pub const JWT_ALGORITHMS: &[&str] = &[
    "HS256", "HS384", "HS512", "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256",
    "ES384", "EdDSA",
];

/// `[auth.api_keys]`: which header carries the key, and the keys, read from their file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKeysConfig {
    /// Lower-case header name.
    pub header: String,
    /// The key file, relative paths resolved against the config file's directory.
    pub file: PathBuf,
    pub keys: Arc<ApiKeyTable>,
}

/// The default `[auth.api_keys] header`.
pub const DEFAULT_API_KEY_HEADER: &str = "x-api-key";

/// Shortest accepted HS* shared secret, in bytes.
pub const MIN_JWT_SECRET_BYTES: usize = 32;

/// A shared secret; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub Arc<[u8]>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(<{} bytes>)", self.0.len())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamConfig {
    pub name: String,
    pub addrs: Vec<SocketAddr>,
    /// The host of each address as written (a name or an IP), in the order of `addrs`.
    pub hosts: Vec<String>,
    pub connect_timeout: Duration,
    pub read_timeout: Duration,
    /// `tls = true`: HTTPS to the upstream.
    pub tls: Option<UpstreamTls>,
    /// `http2 = true`: HTTP/2 to the upstream (h2 by ALPN over TLS, h2c with prior
    /// knowledge in plain), which a gRPC service needs; its trailers reach HTTP/2 clients.
    pub http2: bool,
    /// Active health checks of every address.
    pub health_check: Option<HealthCheck>,
    /// TLS fields written without `tls = true` (`sni`, `ca_path`, `verify = false`): they do
    /// nothing, and the start says so.
    pub inert_tls: Vec<&'static str>,
    /// Where the file writes this upstream, for `check` to say where its warnings are.
    pub written_at: WrittenAt,
}

/// A line and column in the config file. Not part of what the upstream is: two upstreams
/// written alike are equal wherever they are written (a reload that moves one keeps it).
#[derive(Debug, Clone, Copy, Default, Eq)]
pub struct WrittenAt(pub Option<(usize, usize)>);

impl PartialEq for WrittenAt {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl UpstreamConfig {
    /// What leaves this upstream unprotected, in words: `verify = false`, or TLS fields
    /// without `tls = true` (they do nothing).
    pub fn unprotected(&self) -> Option<String> {
        let name = key_shown(&self.name);
        match &self.tls {
            Some(tls) if !tls.verify => Some(format!("upstreams.{name}.verify = false: the upstream's certificate is not checked; anyone on the path can answer for it")),
            None if !self.inert_tls.is_empty() => Some(format!("upstreams.{name} has TLS fields without tls = true ({}): they do nothing, the upstream is spoken to in plain HTTP", self.inert_tls.join(", "))),
            _ => None,
        }
    }
}

/// `health_check`: a GET of `path` (or gRPC's health check) on each address, on a timer of
/// its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    /// The path asked: a GET's, or gRPC's health check (`/grpc.health.v1.Health/Check`).
    pub path: String,
    /// `grpc_service`: the check is gRPC's health check of this service (`""`: the server
    /// as a whole), passed when it answers `SERVING`.
    pub grpc_service: Option<String>,
    pub interval: Duration,
    pub timeout: Duration,
    pub unhealthy_after: u32,
    pub healthy_after: u32,
}

/// How the gateway speaks TLS to an upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamTls {
    /// The SNI name and the name the certificate must carry; `None`: each address's host.
    pub sni: Option<String>,
    /// The CA certificates (DER) of `ca_path`; `None`: the system's roots.
    pub ca: Option<Vec<Vec<u8>>>,
    /// `false` only when written: the certificate is not checked at all.
    pub verify: bool,
}

/// An endpoint id as written in the config: `^[a-z0-9._-]+$`, never derived from a URL.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointId(Arc<str>);

impl EndpointId {
    pub fn parse(s: &str) -> Option<Self> {
        let valid = !s.is_empty()
            && s.len() <= 128
            && s.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
            });
        valid.then(|| Self(Arc::from(s)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentitySource {
    Jwt,
    ClientIp,
    Global,
    /// A request header, stored lower-case.
    Header(String),
    /// A key of `[auth.api_keys]`, counted against its tenant.
    ApiKey,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    None,
    TokenBucket {
        capacity_micro: u64,
        refill_micro_per_sec: u64,
    },
    SlidingWindow {
        limit: u64,
        window_micro: u64,
    },
}

/// One named limit of a route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    pub name: String,
    pub algorithm: Algorithm,
    /// `identity = "global"`: a ceiling shared by every caller of the endpoint.
    pub global: bool,
}

/// The name of the limit the single-limit fields describe.
pub const DEFAULT_LIMIT: &str = "default";

/// Most limits on one route.
pub const MAX_LIMITS: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailMode {
    FailOpen,
    FailClosed,
}

impl FailMode {
    pub fn as_str(self) -> &'static str {
        match self {
            FailMode::FailOpen => "fail_open",
            FailMode::FailClosed => "fail_closed",
        }
    }
}

/// A route's `mode`: whether its decisions are enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforcement {
    Enforce,
    /// Decide and count as usual, but forward every request.
    Shadow,
}

/// Everything that decides one endpoint's limit. Routes sharing an endpoint id share one
/// policy, and so one bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub endpoint_id: EndpointId,
    /// The single limit's algorithm; with `[[routes.limits]]`, the first limit's.
    pub algorithm: Algorithm,
    /// Every limit, in the file's order: one named `default` for the single-limit fields
    /// (none for `algorithm = "none"`).
    pub limits: Vec<Limit>,
    /// Written as `[[routes.limits]]`: decided by the several-limits script, with keys of
    /// their own (the single-limit fields keep their key format).
    pub several: bool,
    pub cost_micro: u64,
    pub fail_mode: FailMode,
    /// The emergency limiter's capacity and refill per second, when fail-open: per process,
    /// or (with `fallback_fleet`) for the whole fleet, divided by the live instances.
    pub fallback_rate_micro: Option<u64>,
    pub fallback_fleet: bool,
    pub policy_version: u64,
    pub mode: Enforcement,
    /// The rate limit header fields sent on answers Redis decided.
    pub ratelimit_headers: RateLimitHeaders,
    /// One emergency bucket for the endpoint, or one per identity.
    pub emergency_per_identity: bool,
    /// Charge what the upstream's answer reports to the token buckets that admitted it.
    pub cost_from_response: Option<CostFromResponse>,
    /// `tier_from`: the caller's tier chooses the limits on its own identity.
    pub tiers: Option<TierPlan>,
}

/// `ratelimit_headers`: which header fields tell a caller its limits, on answers Redis
/// decided. `true` (or `"ietf"`): `RateLimit-Policy` and `RateLimit`
/// (draft-ietf-httpapi-ratelimit-headers-09); `"x-ratelimit"`: `X-RateLimit-Limit`,
/// `-Remaining` and `-Reset`, as Envoy and APISIX send them; `"both"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RateLimitHeaders {
    pub ietf: bool,
    pub x: bool,
}

impl RateLimitHeaders {
    /// Any field at all: the decision's reply is kept for them.
    pub fn any(self) -> bool {
        self.ietf || self.x
    }
}

impl Policy {
    /// Whether the endpoint decides its requests at all (not `algorithm = "none"`).
    pub fn is_limited(&self) -> bool {
        self.algorithm != Algorithm::None || self.several
    }

    /// Whether a limit has an identity of its own (a ceiling every caller shares).
    pub fn has_ceilings(&self) -> bool {
        self.limits.iter().any(|l| l.global)
    }
}

/// Where a caller's tier comes from, and what each tier gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierPlan {
    pub from: TierFrom,
    /// The tier of callers without one, or with one not listed; the name the route's own
    /// limits count under.
    pub default: String,
    pub tiers: BTreeMap<String, TierLimits>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierFrom {
    /// The key file's `tier`.
    ApiKey,
    /// A string claim of the JWT.
    Claim(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierLimits {
    /// Forwarded without any limit and without a Redis call.
    Unlimited,
    /// These replace the route's limits on the caller's identity; the route's ceilings
    /// still apply.
    Limits(Vec<Limit>),
}

/// `cost_from_response`: the header the upstream reports a cost in, and what one unit of it
/// is in micro-tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CostFromResponse {
    pub header: http::HeaderName,
    pub unit_micro: u64,
}

#[derive(Debug, Clone)]
pub struct RouteConfig {
    /// Position in the file, for messages.
    pub index: usize,
    pub path: PathMatch,
    pub methods: Option<Vec<http::Method>>,
    /// Lower-case host name without port.
    pub host: Option<String>,
    pub upstream: Arc<UpstreamConfig>,
    pub identity: IdentitySource,
    pub policy: Arc<Policy>,
    /// This route's body limit, or the server's; `None`: no limit.
    pub max_body_bytes: Option<u64>,
    /// `Upgrade` requests (WebSocket) are passed on; without it the upstream never sees one.
    pub websocket: bool,
    /// Clients (as `client_ip` derives them) forwarded without identity, limit or Redis call.
    pub exempt_client_cidrs: Vec<IpNet>,
    /// `forward_identity = true`: the upstream is told the caller the gateway verified
    /// (`X-Sentinel-Identity`) and, on a tiered route, its tier (`X-Sentinel-Tier`).
    pub forward_identity: bool,
    /// `cors_origins`: the browser origins whose scripts may read the gateway's own answers.
    pub cors: Option<CorsOrigins>,
}

/// `cors_origins`: every origin (`["*"]`), or those listed, as a browser writes `Origin`
/// (`https://app.example.com`, lower-case, without a default port).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CorsOrigins {
    Any,
    Listed(Vec<String>),
}

impl CorsOrigins {
    /// Whether a request's `Origin` is one of them.
    pub fn allows(&self, origin: &[u8]) -> bool {
        match self {
            CorsOrigins::Any => true,
            CorsOrigins::Listed(list) => list
                .iter()
                .any(|o| o.as_bytes().eq_ignore_ascii_case(origin)),
        }
    }
}

impl RouteConfig {
    /// What the route table matches this route on.
    pub fn matcher(&self) -> Matcher {
        Matcher {
            path: self.path.clone(),
            host: self.host.clone(),
            methods: self.methods.clone(),
        }
    }
}

impl Config {
    /// Every warning in words, the file's own (with their place) and the upstreams' settings.
    pub fn warnings_in_words(&self) -> Vec<String> {
        let own = self.warnings.iter().map(ToString::to_string);
        let source = self.source.display();
        let upstreams = self.upstreams.values().filter_map(|u| {
            let words = u.unprotected()?;
            Some(match u.written_at.0 {
                Some((line, column)) => format!("{source}:{line}:{column}: {words}"),
                None => format!("{source}: {words}"),
            })
        });
        own.chain(upstreams)
            .chain(self.out_of_date_certificates())
            .collect()
    }

    /// What is wrong with each certificate a TLS listener serves out of its validity, by
    /// field: such a certificate is served (refused, it would stop a start or a reload of any
    /// field, for every client), and every client that checks it refuses the handshake.
    pub fn out_of_date_certificates(&self) -> Vec<String> {
        let mut said = Vec::new();
        for (i, listener) in self.server.tls.iter().enumerate() {
            let pairs = std::iter::once((format!("server.tls[{i}]"), &listener.default)).chain(
                listener
                    .sni
                    .iter()
                    .enumerate()
                    .map(move |(j, s)| (format!("server.tls[{i}].sni[{j}]"), &s.pair)),
            );
            for (field, pair) in pairs {
                if let Some(why) = &pair.out_of_date {
                    said.push(format!(
                        "{field}.cert_path ({}) {why}: it is served, and every client that checks it refuses the handshake",
                        pair.cert_path.display()
                    ));
                }
            }
        }
        said
    }

    /// Logs every warning: at start and after every reload that took effect, whether or not
    /// the part warned of changed.
    pub fn log_warnings(&self) {
        // The file's own at INFO: they describe a config that works as loaded, and WARN is
        // kept for what goes wrong at run time (and for `verify = false`, as promised).
        for w in &self.warnings {
            tracing::info!(config = %self.source.display(), "config warning: {w}");
        }
        for why in self.out_of_date_certificates() {
            tracing::error!(config = %self.source.display(), "{why}");
        }
        for up in self.upstreams.values() {
            if let Some(words) = up.unprotected() {
                if up.inert_tls.is_empty() {
                    tracing::warn!(upstream = up.name.as_str(), "{words}");
                } else {
                    tracing::warn!(upstream = up.name.as_str(), fields = ?up.inert_tls, "{words}");
                }
            }
        }
    }

    /// The files this config names and reads (key file, JWKS, certificates and keys): a
    /// change to one of them is a change to the config.
    pub fn named_files(&self) -> Vec<PathBuf> {
        let mut files = Vec::new();
        files.extend(self.api_keys.as_ref().map(|k| k.file.clone()));
        files.extend(self.jwt.as_ref().and_then(|j| j.jwks_path.clone()));
        files.extend(self.secret_files.iter().cloned());
        for t in &self.server.tls {
            for pair in std::iter::once(&t.default).chain(t.sni.iter().map(|s| &s.pair)) {
                files.push(pair.cert_path.clone());
                files.push(pair.key_path.clone());
            }
        }
        files
    }

    /// [`load`](Self::load) for a start or `check`: a FIFO among the files waits for its
    /// writer.
    pub fn load_at_start(path: &Path) -> Result<Config, ConfigErrors> {
        /// Unsets [`Load::at_start`] however the load ends.
        struct Unset;
        impl Drop for Unset {
            fn drop(&mut self) {
                LOAD.with_borrow_mut(|load| load.at_start = false);
            }
        }
        LOAD.with_borrow_mut(|load| load.at_start = true);
        let _unset = Unset;
        Self::load(path)
    }

    /// Reads, parses and validates `path`; `SENTINEL_REDIS_URL` overrides `[redis] url`.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let error = |position, message| {
            ConfigErrors(vec![ConfigError {
                file: path.to_path_buf(),
                position,
                route: None,
                message,
            }])
        };
        let bytes = read_whole(path)
            .map_err(|e| error(None, format!("cannot read the config file: {e}")))?;
        let source = String::from_utf8(bytes).map_err(|e| {
            error(
                Some(not_utf8_at(&e)),
                "the config file is not UTF-8 here: TOML is UTF-8 (re-save it so)".into(),
            )
        })?;
        // Set but empty is unset, as shells and orchestrators leave a variable they blank.
        let redis_url = std::env::var(REDIS_URL_ENV).ok().filter(|u| !u.is_empty());
        Self::from_source(path, &source, redis_url.as_deref())
    }

    /// Validates a config held in memory; `path` is only used in messages.
    pub fn from_source(
        path: &Path,
        source: &str,
        redis_url_override: Option<&str>,
    ) -> Result<Config, ConfigErrors> {
        LOAD.with_borrow_mut(|load| load.named_read.clear());
        let config = validate::validate(path, source, redis_url_override);
        let named_read = LOAD.with_borrow_mut(|load| std::mem::take(&mut load.named_read));
        match config {
            Ok(config) => Ok(Config {
                named_read,
                source_hash: {
                    use sha2::Digest;
                    let digest = sha2::Sha256::digest(source.as_bytes());
                    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
                },
                ..config
            }),
            Err(errors) => {
                LOAD.with_borrow_mut(|load| load.refused_named = named_read);
                Err(errors)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_fields_list_matches_the_raw_struct() {
        let src = "[upstreams.a]\naddrs = [\"127.0.0.1:1\"]\n[[routes]]\nendpoint_id = \"x\"\nnot_a_field = 1\n";
        let err = Config::from_source(Path::new("t.toml"), src, None).unwrap_err();
        let msg = &err.0[0].message;
        let listed: std::collections::BTreeSet<&str> = msg.split('`').skip(3).step_by(2).collect();
        let documented: std::collections::BTreeSet<&str> =
            raw::ROUTE_FIELDS.iter().copied().collect();
        assert_eq!(listed, documented, "{msg}");
    }

    #[test]
    fn a_route_lists_tiers_as_long_as_a_key_file_names() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("keys.toml"),
            format!(
                "[[keys]]\nsha256 = \"{}\"\ntenant = \"t\"\n",
                "a".repeat(64)
            ),
        )
        .unwrap();
        let with_tier = |name: &str| {
            let src = format!(
                "[upstreams.a]\naddrs = [\"127.0.0.1:1\"]\n[auth.api_keys]\nfile = \"keys.toml\"\n\
                 [[routes]]\nendpoint_id = \"x\"\npath_prefix = \"/\"\nupstream = \"a\"\n\
                 identity = \"api_key\"\ntier_from = \"api_key\"\ndefault_tier = \"free\"\n\
                 algorithm = \"token_bucket\"\ncapacity_micro = 1000000\nrefill_rate_micro_per_sec = 1\n\
                 [routes.tiers.{name}]\nunlimited = true\n"
            );
            let path = dir.path().join("gateway.toml");
            Config::from_source(&path, &src, Some("redis://127.0.0.1:1/0"))
                .map(|_| ())
                .map_err(|e| e.0[0].message.clone())
        };
        assert_eq!(with_tier(&"p".repeat(128)), Ok(()));
        let too_long = with_tier(&"p".repeat(129)).unwrap_err();
        assert!(too_long.contains("use 1 to 128 of a-z"), "{too_long}");
    }
}
