//! The admin listener: `/metrics`, `/healthz`, `/readyz` and `/reload`, apart from the proxy.
//!
//! It runs on the gateway's control runtime, not as a Pingora service, so that it keeps
//! answering (`/readyz` 503) while Pingora's listeners drain on SIGTERM.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};

use crate::config::IdentitySource;
use crate::identity::{MAX_HEADER_IDENTITY_BYTES, MAX_SUBJECT_BYTES};
use crate::lifecycle::Lifecycle;
use crate::limiter::{identity_hash, inspect};
use crate::metrics::Metrics;
use crate::reload::Reloader;
use crate::store::Store;

pub struct Admin {
    pub metrics: Arc<Metrics>,
    pub lifecycle: Arc<Lifecycle>,
    pub store: Store,
    pub reloader: Arc<Reloader>,
    pub refusals: Refusals,
    pub connections: Arc<crate::edge::connections::Connections>,
}

/// Admin requests refused for their token, logged (INFO) at most once every
/// [`Refusals::EVERY`] with how many were refused since the line before, without a token and
/// with a wrong one: someone guessing the token is seen without filling the log. The token
/// presented is never logged.
#[derive(Default)]
pub struct Refusals {
    /// When the last line was written, and the refusals since: without a token, with a
    /// wrong one.
    state: Mutex<(Option<Instant>, u64, u64)>,
}

impl Refusals {
    const EVERY: Duration = Duration::from_secs(10);

    fn note(&self, peer: SocketAddr, method: &Method, path: &str, presented: bool) {
        let (missing, wrong) = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            match presented {
                true => state.2 += 1,
                false => state.1 += 1,
            }
            let now = Instant::now();
            if state
                .0
                .is_some_and(|last| now.duration_since(last) < Self::EVERY)
            {
                return;
            }
            state.0 = Some(now);
            (std::mem::take(&mut state.1), std::mem::take(&mut state.2))
        };
        let refused = missing + wrong;
        // Of the request that wrote the line; the counts say the others.
        let token = if presented { "wrong" } else { "missing" };
        // The path only: a query may carry an identity. INFO, not WARN: what a client does
        // is never the gateway's fault, and at the default level it is still seen.
        tracing::info!(
            peer = %peer.ip(),
            method = %method,
            path,
            token,
            refused,
            wrong,
            missing,
            "admin request refused: the admin token is {token} ({refused} refused since the last such line, {wrong} with a wrong token and {missing} without one; at most one line every {} s)",
            Self::EVERY.as_secs()
        );
    }
}

type AdminResponse = Response<Full<Bytes>>;

fn reply(status: StatusCode, content_type: &str, body: String) -> AdminResponse {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

/// Whether `Accept-Encoding` takes gzip (Prometheus asks for it): `gzip` (or `x-gzip`), or
/// `*` when gzip is not named, with a weight above 0.
fn accepts_gzip(headers: &http::HeaderMap) -> bool {
    let mut named = None;
    let mut any = false;
    for value in headers.get_all(http::header::ACCEPT_ENCODING) {
        let Ok(value) = value.to_str() else { continue };
        for item in value.split(',') {
            let mut parts = item.split(';');
            let coding = parts.next().unwrap_or_default().trim();
            let weight = parts
                .filter_map(|p| p.trim().split_once('='))
                .find(|(name, _)| name.trim().eq_ignore_ascii_case("q"))
                .and_then(|(_, q)| q.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            if coding.eq_ignore_ascii_case("gzip") || coding.eq_ignore_ascii_case("x-gzip") {
                named = Some(weight > 0.0);
            } else if coding == "*" {
                any = weight > 0.0;
            }
        }
    }
    named.unwrap_or(any)
}

/// The exposition, gzipped when the scraper takes it and it is worth it (a config of
/// thousands of routes exposes megabytes, which gzip makes a tenth or less).
fn exposition(text: String, gzip: bool) -> AdminResponse {
    const CONTENT_TYPE: &str = "text/plain; version=0.0.4";
    // Either way the answer depends on `Accept-Encoding`: caches are told so.
    let plain = |text: String| {
        let mut answer = reply(StatusCode::OK, CONTENT_TYPE, text);
        answer.headers_mut().insert(
            http::header::VARY,
            http::HeaderValue::from_static("accept-encoding"),
        );
        answer
    };
    if !gzip || text.len() < 1024 {
        return plain(text);
    }
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(
        Vec::with_capacity(text.len() / 8),
        flate2::Compression::fast(),
    );
    let zipped = match encoder
        .write_all(text.as_bytes())
        .and_then(|()| encoder.finish())
    {
        Ok(zipped) => zipped,
        Err(_) => return plain(text),
    };
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", CONTENT_TYPE)
        .header("content-encoding", "gzip")
        .header("vary", "accept-encoding")
        .body(Full::new(Bytes::from(zipped)))
        .expect("static response parts are valid")
}

fn json(status: StatusCode, value: serde_json::Value) -> AdminResponse {
    reply(status, "application/json", value.to_string())
}

/// 405 with the methods the path takes.
fn not_allowed(allow: &'static str) -> AdminResponse {
    let mut answer = json(
        StatusCode::METHOD_NOT_ALLOWED,
        serde_json::json!({"detail": "method not allowed"}),
    );
    answer
        .headers_mut()
        .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
    answer
}

/// A query parameter, percent-decoded (`%XX` is a byte; `+` is a plus, as API keys hold
/// them): `Ok(None)` when absent, `Ok(Some(""))` when empty or written without `=`; an error
/// saying why when it is sent twice, holds a
/// `%` not followed by two hex digits, or is not UTF-8 once decoded.
fn query_param(query: &str, name: &str) -> Result<Option<String>, String> {
    let mut found = None;
    for pair in query.split('&') {
        // `&tier` with no `=` is sent, and empty (as browsers' `URLSearchParams` reads it).
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k != name {
            continue;
        }
        if found.is_some() {
            return Err(format!("{name} is sent more than once"));
        }
        let bytes = v.as_bytes();
        let escapes_whole = bytes.iter().enumerate().all(|(i, b)| {
            *b != b'%'
                || (bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                    && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
        });
        if !escapes_whole {
            return Err(format!(
                "{name} is not percent-encoded: a % must be followed by two hex digits (%25 for a %)"
            ));
        }
        let decoded = percent_encoding::percent_decode_str(v)
            .decode_utf8()
            .map_err(|_| format!("{name} is not UTF-8 once percent-decoded"))?;
        found = Some(decoded.into_owned());
    }
    Ok(found)
}

/// [`query_param`] of the query, when there is one.
fn param_of(query: Option<&str>, name: &str) -> Result<Option<String>, String> {
    query.map_or(Ok(None), |q| query_param(q, name))
}

/// The admin listener while the gateway starts (its Redis client, the eviction check and a
/// JWKS fetch can take seconds): `/healthz` is 200, `/readyz` 503 `"starting":true`, anything
/// else 503, so a probe sees a starting gateway rather than a refused connection. Dropped
/// when the admin proper serves the same socket.
pub struct Starting {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Starting {
    /// Serves `listener` (a clone of the admin's socket) on a thread of its own.
    pub fn serve(listener: std::net::TcpListener, places: usize) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        std::thread::Builder::new()
            .name("admin-starting".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                        return;
                    };
                    // One answer a connection: none is kept open across the handover to
                    // the admin proper.
                    let accept = answer_on(listener, false, places, |req, _| async move {
                        starting_answer(req.uri().path())
                    });
                    tokio::select! {
                        () = accept => {}
                        _ = stopped => {}
                    }
                    // Connections it took are answered before the runtime goes (one whose
                    // request comes within the second; answers being written).
                    tokio::time::sleep(Duration::from_secs(1)).await;
                });
            })?;
        Ok(Self { stop: Some(stop) })
    }
}

impl Drop for Starting {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// How long an admin connection may take to send a request's head, and stay idle between
/// requests: a connection that sends nothing is closed, and its place given to the next.
const ADMIN_HEAD_WITHIN: Duration = Duration::from_secs(10);

/// How long an admin connection is kept, however it is used: then it is closed once its
/// request in progress is answered, or [`ADMIN_LAST_ANSWER_WITHIN`] later (a client that
/// stopped reading an answer holds its place no longer).
const ADMIN_CONNECTION_FOR: Duration = Duration::from_secs(60);
const ADMIN_LAST_ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Accepts connections on `listener` until the task ends, at most `places` at once (the
/// admin's share of the descriptors kept, `edge::limits`; and the one accepted waiting for
/// a place), each answered over HTTP/1.1 by `answer` (given the peer); `keep_alive` false:
/// one request a connection. At the bound, as the proxy's listeners do, an idle connection
/// (answering nothing: silent, half a head, or between requests) is closed to make room,
/// the one idle since longest first (so a request just sent on a new connection is the last
/// to be lost that way), and a probe gets through however many idle connections are held;
/// when every one is answering, the one answering since longest is told to close once its
/// answer is out, so a client keeping them all busy holds the next one back for one answer
/// at most (the connections behind it wait in the kernel's backlog, holding no descriptor
/// of the process).
async fn answer_on<F, A>(
    listener: tokio::net::TcpListener,
    keep_alive: bool,
    places: usize,
    answer: F,
) where
    F: Fn(Request<Incoming>, SocketAddr) -> A + Clone + Send + 'static,
    A: std::future::Future<Output = AdminResponse> + Send + 'static,
{
    let places = Arc::new(tokio::sync::Semaphore::new(places));
    let open = Arc::new(Open::new());
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            // No descriptor left, say: tried again a moment later, not in a busy loop.
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let place = loop {
            if let Ok(place) = Arc::clone(&places).try_acquire_owned() {
                break place;
            }
            // The closed one's place comes back as its task ends; a finishing one's once its
            // answer is out. Looked at again a moment later (a connection turns idle without
            // a word).
            open.make_room();
            tokio::select! {
                place = Arc::clone(&places).acquire_owned() => match place {
                    Ok(place) => break place,
                    Err(_) => return,
                },
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        };
        let (id, conn) = open.add();
        let activity = Arc::clone(&conn);
        let (answer, open) = (answer.clone(), Arc::clone(&open));
        tokio::spawn(async move {
            let _place = place;
            let _open = Gone(&open, id);
            let service = service_fn(move |req| {
                let answering = Answering::begin(&activity);
                let answered = answer(req, peer);
                async move {
                    let answered = answered.await;
                    drop(answering);
                    Ok::<_, Infallible>(answered)
                }
            });
            // A client that closes its side once its request is sent (`nc -N`) is answered,
            // as on the proxy's listeners; without, its request ran but its answer was lost,
            // and so was the log line of a reset or a reload it asked for.
            let builder = http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(ADMIN_HEAD_WITHIN)
                .keep_alive(keep_alive)
                .half_close(true)
                .clone();
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let ended = tokio::select! {
                _ = connection.as_mut() => true,
                () = conn.close.notified() => true,
                () = conn.finish.notified() => false,
                () = tokio::time::sleep(ADMIN_CONNECTION_FOR) => false,
            };
            if !ended {
                connection.as_mut().graceful_shutdown();
                tokio::select! {
                    _ = tokio::time::timeout(ADMIN_LAST_ANSWER_WITHIN, connection) => {}
                    () = conn.close.notified() => {}
                }
            }
        });
    }
}

/// The admin's open connections, by the order they came: how each is used, and how to close
/// it.
struct Open {
    next: std::sync::atomic::AtomicU64,
    by_age: Mutex<std::collections::BTreeMap<u64, Arc<Conn>>>,
    /// What [`Conn::last`] counts from.
    since: Instant,
}

/// One open connection: what closes it at once, what closes it once its request in progress
/// is answered, the requests it is answering, and when it last began or ended one (or
/// opened), in milliseconds since [`Open::since`].
struct Conn {
    close: tokio::sync::Notify,
    finish: tokio::sync::Notify,
    busy: AtomicUsize,
    /// Told to close once its request in progress is answered.
    finishing: std::sync::atomic::AtomicBool,
    last: std::sync::atomic::AtomicU64,
    since: Instant,
}

impl Conn {
    fn touch(&self) {
        let now = self.since.elapsed().as_millis() as u64;
        self.last.store(now, Ordering::Release);
    }

    fn idle(&self) -> bool {
        self.busy.load(Ordering::Acquire) == 0
    }

    fn last(&self) -> u64 {
        self.last.load(Ordering::Acquire)
    }
}

impl Open {
    fn new() -> Self {
        Open {
            next: Default::default(),
            by_age: Default::default(),
            since: Instant::now(),
        }
    }

    fn add(&self) -> (u64, Arc<Conn>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            close: Default::default(),
            finish: Default::default(),
            busy: AtomicUsize::new(0),
            finishing: Default::default(),
            last: Default::default(),
            since: self.since,
        });
        conn.touch();
        let mut by_age = self.by_age.lock().unwrap_or_else(|p| p.into_inner());
        by_age.insert(id, Arc::clone(&conn));
        (id, conn)
    }

    /// Closes the connection idle since longest; with none idle, tells the one answering
    /// since longest to close once its answer is out, unless one was told already and is
    /// still answering. (A notice is kept for the task if it is between two polls.)
    fn make_room(&self) {
        let mut by_age = self.by_age.lock().unwrap_or_else(|p| p.into_inner());
        let idle = (by_age.iter())
            .filter(|(_, c)| c.idle())
            .min_by_key(|(_, c)| c.last());
        if let Some(id) = idle.map(|(id, _)| *id) {
            if let Some(conn) = by_age.remove(&id) {
                conn.close.notify_one();
            }
            return;
        }
        if (by_age.values()).any(|c| c.finishing.load(Ordering::Acquire)) {
            return;
        }
        if let Some(conn) = by_age.values().min_by_key(|c| c.last()) {
            conn.finishing.store(true, Ordering::Release);
            conn.finish.notify_one();
        }
    }
}

/// Takes a connection out of [`Open`] when its task ends.
struct Gone<'a>(&'a Open, u64);

impl Drop for Gone<'_> {
    fn drop(&mut self) {
        let mut by_age = self.0.by_age.lock().unwrap_or_else(|p| p.into_inner());
        by_age.remove(&self.1);
    }
}

/// A request being answered on a connection, which is then not idle.
struct Answering(Arc<Conn>);

impl Answering {
    fn begin(activity: &Arc<Conn>) -> Self {
        activity.busy.fetch_add(1, Ordering::AcqRel);
        activity.touch();
        Answering(Arc::clone(activity))
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.touch();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

fn starting_answer(path: &str) -> AdminResponse {
    match path {
        "/healthz" => json(StatusCode::OK, serde_json::json!({"status": "ok"})),
        "/readyz" => json(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"ready": false, "starting": true, "config_generation": 0}),
        ),
        _ => json(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"detail": "starting"}),
        ),
    }
}

impl Admin {
    /// Serves admin requests on `listener` until the process exits.
    pub async fn serve(self: Arc<Self>, listener: std::net::TcpListener, places: usize) {
        let listener = match listener
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpListener::from_std(listener))
        {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "cannot serve the admin listener");
                return;
            }
        };
        answer_on(listener, true, places, move |req, peer| {
            let admin = Arc::clone(&self);
            async move { admin.route(req, peer).await }
        })
        .await;
    }

    /// With an admin token (`admin_token_env` or `_file`), every request but the probes needs `Authorization: Bearer
    /// <token>`; the comparison is of hashes, so its time says nothing about the token.
    /// A refusal is counted and logged.
    fn authorized(&self, req: &Request<Incoming>, peer: SocketAddr) -> bool {
        if matches!(req.uri().path(), "/healthz" | "/readyz") {
            return true;
        }
        let snapshot = self.reloader.live.load();
        let Some(token) = &snapshot.config.server.admin_token else {
            return true;
        };
        let values = req.headers().get_all(http::header::AUTHORIZATION);
        let mut each = values.iter();
        let accepted = match (each.next(), each.next()) {
            (Some(value), None) => {
                let presented = crate::identity::bearer_token(value.as_bytes()).unwrap_or_default();
                Sha256::digest(presented) == Sha256::digest(&token.0)
            }
            _ => false,
        };
        if !accepted {
            self.metrics.admin_refused.inc();
            let presented = values.iter().next().is_some();
            self.refusals
                .note(peer, req.method(), req.uri().path(), presented);
        }
        accepted
    }

    async fn route(&self, req: Request<Incoming>, peer: SocketAddr) -> AdminResponse {
        if !self.authorized(&req, peer) {
            let mut answer = json(
                StatusCode::UNAUTHORIZED,
                serde_json::json!({"detail": "authentication required"}),
            );
            answer.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                http::HeaderValue::from_static("Bearer"),
            );
            return answer;
        }
        // HEAD is GET without the body (hyper writes none): load balancers probe with it.
        let method = match req.method() {
            &Method::HEAD => Method::GET,
            m => m.clone(),
        };
        match (method, req.uri().path()) {
            (Method::GET, "/metrics") => {
                self.store.refresh_breakers();
                self.metrics
                    .in_flight
                    .set(self.lifecycle.in_flight() as i64);
                self.metrics.connections(&self.connections);
                self.metrics
                    .log_dropped
                    .inc_by(crate::telemetry::newly_dropped_lines());
                for n in self.store.nodes() {
                    self.metrics.redis_node(&n.node, Some(n.connected));
                }
                self.metrics
                    .redis_up
                    .set(i64::from(self.store.is_connected()));
                let evicting = (self.store.eviction_policy()).is_some_and(|p| p != "noeviction");
                self.metrics.redis_evicting.set(i64::from(evicting));
                let snapshot = self.reloader.live.load();
                match snapshot.jwks_target() {
                    Some((url, _)) => {
                        let keys = snapshot.jwks.keys(&url).keys.len();
                        self.metrics
                            .jwks_keys
                            .with_label_values::<&str>(&[])
                            .set(keys as i64);
                    }
                    None => self.metrics.jwks_keys.reset(),
                }
                // Rendered and gzipped off this runtime, whose one thread also reads Redis's
                // answers (a config of thousands of routes renders megabytes: tens of
                // milliseconds, against a decision's budget of 20).
                // One at a time: scrapes that come together wait rather than each taking a
                // thread and megabytes.
                static RENDERING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
                let _turn = RENDERING.acquire().await;
                let gzip = accepts_gzip(req.headers());
                let metrics = Arc::clone(&self.metrics);
                tokio::task::spawn_blocking(move || exposition(metrics.render(), gzip))
                    .await
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "cannot render the metrics");
                        reply(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "text/plain",
                            String::new(),
                        )
                    })
            }
            (Method::GET, "/healthz") => json(StatusCode::OK, serde_json::json!({"status": "ok"})),
            (Method::GET, "/readyz") => self.readyz(),
            (Method::POST, "/reload") => self.reload().await,
            (method, path) if path.starts_with("/limits/") => {
                // Percent-decoded, as a client may write any of its characters so (a `.`
                // as `%2E`, which keeps `/limits/..` from being taken away by the client).
                let written = path.trim_start_matches("/limits/");
                let endpoint = percent_encoding::percent_decode_str(written)
                    .decode_utf8()
                    .map_or_else(|_| written.to_owned(), |d| d.into_owned());
                self.limits(method, &endpoint, req.uri().query()).await
            }
            (_, "/reload") => not_allowed("POST"),
            (_, "/metrics" | "/healthz" | "/readyz") => not_allowed("GET, HEAD"),
            _ => json(
                StatusCode::NOT_FOUND,
                serde_json::json!({"detail": "not found"}),
            ),
        }
    }

    /// `GET /limits/<endpoint_id>?identity=...`: the identity's buckets, read without writing;
    /// `DELETE`: deleted, so its next request starts full.
    async fn limits(
        &self,
        method: Method,
        endpoint_id: &str,
        query: Option<&str>,
    ) -> AdminResponse {
        if method != Method::GET && method != Method::DELETE {
            return not_allowed("GET, HEAD, DELETE");
        }
        let snapshot = self.reloader.live.load_full();
        let Some(endpoint) = crate::config::EndpointId::parse(endpoint_id)
            .and_then(|id| snapshot.endpoints.get(&id).cloned())
        else {
            return json(
                StatusCode::NOT_FOUND,
                serde_json::json!({"detail": "no such endpoint"}),
            );
        };
        let bad = |detail: String| {
            json(
                StatusCode::BAD_REQUEST,
                serde_json::json!({ "detail": detail }),
            )
        };
        // A parameter /limits does not take is refused, not passed over: `Tier=pro` read as
        // the default tier would answer for buckets the operator did not ask about.
        let unknown = (query.unwrap_or_default().split('&'))
            .map(|pair| pair.split_once('=').map_or(pair, |(k, _)| k))
            .find(|k| !k.is_empty() && *k != "identity" && *k != "tier");
        if let Some(name) = unknown {
            let name = name.escape_debug().to_string();
            return bad(format!(
                "unknown query parameter \"{name}\": /limits takes identity and tier"
            ));
        }
        let identity = param_of(query, "identity").map(|i| i.filter(|i| !i.is_empty()));
        // An empty `tier=` names no tier: it is unknown, not the default.
        let (identity, asked) = match (identity, param_of(query, "tier")) {
            (Ok(Some(identity)), Ok(tier)) => (identity, tier),
            (Ok(None), _) => {
                return bad("identity is required: /limits/<endpoint_id>?identity=<identity string, percent-encoded>".to_owned())
            }
            (Err(why), _) | (_, Err(why)) => return bad(why),
        };
        let ipv6_prefix = snapshot.config.server.ipv6_identity_prefix;
        let identity = as_keyed(&identity, ipv6_prefix);
        // An unlimited endpoint keys no request: any identity has no limits there, and a
        // reset deletes nothing (Redis is not asked; nothing is logged).
        if endpoint.policy.algorithm == crate::config::Algorithm::None {
            return json(
                StatusCode::OK,
                match method == Method::DELETE {
                    true => serde_json::json!({"reset": true, "keys_deleted": 0}),
                    false => serde_json::json!({
                        "endpoint_id": endpoint_id,
                        "identity_hash": identity_hash(&identity),
                        "tier": null,
                        "limits": [],
                    }),
                },
            );
        }
        // An identity string no request to the endpoint is keyed by (the raw API key pasted
        // for `tenant:<tenant>`, say) would read as a full bucket and reset nothing.
        let sources: Vec<&IdentitySource> = snapshot
            .config
            .routes
            .iter()
            .filter(|r| r.policy.endpoint_id == endpoint.policy.endpoint_id)
            .map(|r| &r.identity)
            .collect();
        let ceiling = endpoint.policy.limits.iter().any(|l| l.global);
        // `global` on a route whose callers are keyed otherwise: the ceilings alone (the
        // caller limits of an identity no request has would only ever read full).
        let ceilings_only = !sources.iter().any(|s| keys_by(s, &identity, ipv6_prefix));
        if ceilings_only && !(ceiling && identity == "global") {
            let mut kinds: Vec<String> = (sources.iter())
                .map(|s| written_as(s, ipv6_prefix))
                .collect();
            if ceiling {
                kinds.push("global".to_owned());
            }
            kinds.sort_unstable();
            kinds.dedup();
            return bad(format!(
                "no request to {endpoint_id} is keyed by this identity: its callers are {}",
                kinds.join(" or ")
            ));
        }
        let hash = identity_hash(&identity);
        // A tiered route: `tier` picks the tier to read (default: default_tier).
        let (tier, view_of) = match &endpoint.tiers {
            None if asked.is_some() => {
                return json(
                    StatusCode::BAD_REQUEST,
                    serde_json::json!({"detail": "this endpoint has no tiers"}),
                )
            }
            None => (None, Some(Arc::clone(&endpoint))),
            Some(tiers) => {
                if asked.as_deref().is_some_and(|t| !tiers.knows(t)) {
                    return json(
                        StatusCode::BAD_REQUEST,
                        serde_json::json!({"detail": "no such tier"}),
                    );
                }
                let (name, chosen) = tiers.choose(asked.as_deref());
                let view_of = match chosen {
                    None => Some(Arc::clone(&endpoint)),
                    Some(tier_endpoint) => tier_endpoint,
                };
                (Some(name), view_of)
            }
        };
        let unavailable = || {
            json(
                StatusCode::SERVICE_UNAVAILABLE,
                serde_json::json!({"detail": "rate limiter unavailable"}),
            )
        };
        if method == Method::DELETE {
            // Every tier's buckets: the caller may have changed tier since.
            return match inspect::reset(&self.store, &endpoint.with_tiers(), &hash).await {
                Ok((deleted, announced)) => {
                    let (listening, heard) = (announced.listening, announced.heard);
                    // One line a reset: a WARN when a gateway remembering denials did not say
                    // in time that it forgot the identity.
                    if matches!((listening, heard), (Some(l), Some(h)) if h < l) {
                        tracing::warn!(
                            endpoint_id,
                            identity_hash = hash.as_str(),
                            keys_deleted = deleted,
                            gateways_listening = listening,
                            gateways_heard = heard,
                            "limits reset from the admin listener; not every gateway remembering denials said it heard the reset in time: those that did not repeat their remembered denials of the identity until their subscription's check ends it (within about 6 s) or their wait ends"
                        );
                    } else {
                        tracing::info!(
                            endpoint_id,
                            identity_hash = hash.as_str(),
                            keys_deleted = deleted,
                            gateways_listening = listening,
                            gateways_heard = heard,
                            "limits reset from the admin listener"
                        );
                    }
                    let mut answer = json(
                        StatusCode::OK,
                        serde_json::json!({"reset": true, "keys_deleted": deleted}),
                    );
                    // Who forgot its remembered denials at once, for the operator's curl.
                    if let (Some(listening), Some(heard)) = (listening, heard) {
                        if let Ok(value) =
                            http::HeaderValue::from_str(&format!("{heard}/{listening}"))
                        {
                            answer
                                .headers_mut()
                                .insert("x-sentinel-gateways-heard", value);
                        }
                    }
                    answer
                }
                Err(_) => unavailable(),
            };
        }
        let peeked = match &view_of {
            Some(e) => inspect::peek(&self.store, e, &hash, ceilings_only).await,
            // An unlimited tier has no limits to show.
            None => Ok(Vec::new()),
        };
        match peeked {
            Ok(limits) => json(
                StatusCode::OK,
                serde_json::json!({
                    "endpoint_id": endpoint_id,
                    "identity_hash": hash,
                    "tier": tier.as_deref(),
                    "limits": limits,
                }),
            ),
            Err(_) => unavailable(),
        }
    }

    fn readyz(&self) -> AdminResponse {
        let ready = self.lifecycle.is_ready();
        let status = if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        let store = &self.store;
        store.refresh_breakers();
        let snapshot = self.reloader.live.load();
        let mut body = serde_json::json!({
            "ready": ready,
            "redis": if store.is_connected() { "up" } else { "down" },
            "breaker": store.breaker_state().as_str(),
            "config_generation": snapshot.generation,
            "config_hash": snapshot.config.source_hash,
            "redis_maxmemory_policy": store.eviction_policy(),
        });
        // Fields the file changes that wait for the next start, as the reload said them.
        if !snapshot.restart_required.is_empty() {
            body["restart_required"] = serde_json::json!(snapshot.restart_required);
        }
        // Not ready yet, as the early answer says (`Starting`): a JWKS fetch, the listeners.
        // Or no longer ready: draining after `SIGTERM`.
        if !ready {
            match self.lifecycle.is_draining() {
                true => body["draining"] = serde_json::json!(true),
                false => body["starting"] = serde_json::json!(true),
            }
        }
        // The store as it runs: a reload that moves to or from Sentinel needs a restart.
        if let Some((name, addr)) = store.sentinel() {
            body["redis_sentinel_master"] = serde_json::json!({
                "name": name,
                "addr": addr,
            });
        }
        let nodes = store.nodes();
        if !nodes.is_empty() {
            body["redis_nodes"] = nodes
                .iter()
                .map(|n| {
                    serde_json::json!({
                        "node": n.node,
                        "redis": if n.connected { "up" } else { "down" },
                        "breaker": n.breaker.as_str(),
                        "maxmemory_policy": n.eviction_policy.as_deref(),
                    })
                })
                .collect();
        }
        json(status, body)
    }

    async fn reload(&self) -> AdminResponse {
        match self.reloader.reload_off_thread("admin").await {
            Ok(r) => {
                let mut body =
                    serde_json::json!({"reloaded": true, "config_generation": r.generation});
                if !r.restart_required.is_empty() {
                    body["restart_required"] = serde_json::json!(r.restart_required);
                }
                json(StatusCode::OK, body)
            }
            Err(error) => json(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"reloaded": false, "error": error}),
            ),
        }
    }
}

/// An identity string as the request path writes it before hashing it into keys: a header's
/// name in lower case (`header:X-API-Key:v` is `header:x-api-key:v`), an address as the
/// `client_ip` identity writes it (an IPv4-mapped IPv6 address as IPv4). Written otherwise,
/// it would read as a bucket never used, and a `DELETE` would delete nothing.
fn as_keyed(identity: &str, ipv6_prefix: u8) -> std::borrow::Cow<'_, str> {
    if let Some(rest) = identity.strip_prefix("header:") {
        if let Some((name, value)) = rest.split_once(':') {
            if name.bytes().any(|b| b.is_ascii_uppercase()) {
                return format!("header:{}:{value}", name.to_ascii_lowercase()).into();
            }
        }
    }
    if let Some(addr) = identity.strip_prefix("ip:") {
        // An IPv6 address may come in brackets, as `X-Forwarded-For` may write it.
        let addr = (addr.strip_prefix('['))
            .and_then(|a| a.strip_suffix(']'))
            .unwrap_or(addr);
        let keyed = match (
            addr.parse::<std::net::IpAddr>(),
            addr.parse::<ipnet::Ipv6Net>(),
        ) {
            (Ok(ip), _) => Some(crate::identity::ipv6_grouped(
                format!("ip:{}", crate::identity::canonical(ip)),
                ipv6_prefix,
            )),
            // The network an IPv6 identity is keyed by, written as one.
            (_, Ok(net)) if net.prefix_len() == ipv6_prefix && ipv6_prefix < 128 => {
                Some(format!("ip:{}", net.trunc()))
            }
            _ => None,
        };
        if let Some(keyed) = keyed.filter(|k| k != identity) {
            return keyed.into();
        }
    }
    identity.into()
}

/// Whether the request path could key a caller of a route identified by `source` by
/// `identity` (written as [`as_keyed`] makes it).
fn keys_by(source: &IdentitySource, identity: &str, ipv6_prefix: u8) -> bool {
    let value = |prefix: &str| identity.strip_prefix(prefix).filter(|v| !v.is_empty());
    match source {
        // As a request can carry them: a claim of at most 256 bytes, a header value of at
        // most 1024, not blank, without spaces or tabs around it (the parser drops those) and
        // no control character but a tab.
        IdentitySource::Jwt => value("jwt:").is_some_and(|v| v.len() <= MAX_SUBJECT_BYTES),
        IdentitySource::ClientIp => value("ip:").is_some_and(|a| {
            a.parse::<std::net::IpAddr>().is_ok()
                || a.parse::<ipnet::Ipv6Net>()
                    .is_ok_and(|n| n.prefix_len() == ipv6_prefix && ipv6_prefix < 128)
        }),
        IdentitySource::Global => identity == "global",
        IdentitySource::Header(name) => value("header:")
            .and_then(|rest| rest.strip_prefix(name.as_str()))
            .and_then(|rest| rest.strip_prefix(':'))
            .is_some_and(|v| {
                v.len() <= MAX_HEADER_IDENTITY_BYTES
                    && !v.trim().is_empty()
                    && v.trim_matches([' ', '\t']) == v
                    && http::HeaderValue::from_str(v).is_ok()
            }),
        // A tenant is written as the key file allows it (`config/api_keys.rs`).
        IdentitySource::ApiKey => {
            value("tenant:").is_some_and(|t| crate::config::EndpointId::parse(t).is_some())
        }
    }
}

/// How the identity strings of a route identified by `source` are written, for a message.
fn written_as(source: &IdentitySource, ipv6_prefix: u8) -> String {
    match source {
        IdentitySource::Jwt => "jwt:<claim value>".to_owned(),
        IdentitySource::ClientIp if ipv6_prefix < 128 => {
            format!("ip:<IPv4 address> or ip:<IPv6 network>/{ipv6_prefix}")
        }
        IdentitySource::ClientIp => "ip:<address>".to_owned(),
        IdentitySource::Global => "global".to_owned(),
        IdentitySource::Header(name) => format!("header:{name}:<value>"),
        IdentitySource::ApiKey => "tenant:<tenant>".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::{as_keyed, keys_by, query_param, IdentitySource};

    #[test]
    fn identities_are_read_as_the_request_path_keys_them() {
        assert_eq!(
            as_keyed("header:X-API-Key:AbC", 128),
            "header:x-api-key:AbC"
        );
        assert_eq!(
            as_keyed("header:x-api-key:a:b", 128),
            "header:x-api-key:a:b"
        );
        assert_eq!(as_keyed("ip:::ffff:10.0.0.1", 128), "ip:10.0.0.1");
        assert_eq!(as_keyed("ip:2001:DB8::1", 128), "ip:2001:db8::1");
        assert_eq!(
            as_keyed("jwt:Tenant-7", 128),
            "jwt:Tenant-7",
            "a claim keeps its case"
        );
        assert_eq!(as_keyed("ip:not-an-address", 128), "ip:not-an-address");
        assert_eq!(as_keyed("ip:[2001:db8::1]", 128), "ip:2001:db8::1");
        // With `ipv6_identity_prefix = 64`: an address as its /64, a /64 as written, IPv4
        // as it is; another length is no identity of the route.
        assert_eq!(as_keyed("ip:2001:DB8:1:1::7", 64), "ip:2001:db8:1:1::/64");
        assert_eq!(as_keyed("ip:[2001:db8:1:1::7]", 64), "ip:2001:db8:1:1::/64");
        assert_eq!(
            as_keyed("ip:2001:db8:1:1:ffff::/64", 64),
            "ip:2001:db8:1:1::/64"
        );
        assert_eq!(as_keyed("ip:::ffff:10.0.0.1", 64), "ip:10.0.0.1");
        assert_eq!(as_keyed("ip:2001:db8::/48", 64), "ip:2001:db8::/48");
    }

    #[test]
    fn an_identity_must_be_one_the_route_keys_its_callers_by() {
        let header = IdentitySource::Header("x-api-key".to_owned());
        assert!(keys_by(&header, "header:x-api-key:k1", 128));
        assert!(
            !keys_by(&header, "header:x-api-key:", 128),
            "never sent: a 401"
        );
        assert!(!keys_by(&header, "header:x-other:k1", 128));
        assert!(!keys_by(&header, "k1", 128), "the raw value");
        assert!(keys_by(&IdentitySource::ApiKey, "tenant:acme-1.b_c", 128));
        assert!(!keys_by(&IdentitySource::ApiKey, "tenant:Acme", 128));
        assert!(!keys_by(
            &IdentitySource::ApiKey,
            "header:x-api-key:KEY",
            128
        ));
        assert!(keys_by(&IdentitySource::ClientIp, "ip:10.0.0.1", 128));
        assert!(keys_by(&IdentitySource::ClientIp, "ip:2001:db8::1", 128));
        assert!(!keys_by(&IdentitySource::ClientIp, "ip:notanip", 128));
        assert!(keys_by(&IdentitySource::ClientIp, "ip:2001:db8::/64", 64));
        assert!(!keys_by(&IdentitySource::ClientIp, "ip:2001:db8::/64", 128));
        assert!(!keys_by(&IdentitySource::ClientIp, "ip:2001:db8::/48", 64));
        assert!(keys_by(&IdentitySource::Jwt, "jwt:Alice", 128));
        assert!(!keys_by(&IdentitySource::Jwt, "jwt:", 128));
        let long = "a".repeat(257);
        assert!(
            !keys_by(&IdentitySource::Jwt, &format!("jwt:{long}"), 128),
            "no token carries a claim that long"
        );
        let header = IdentitySource::Header("x-api-key".into());
        assert!(keys_by(
            &header,
            &format!("header:x-api-key:{}", "a".repeat(1024)),
            128
        ));
        for never in [
            format!("header:x-api-key:{}", "a".repeat(1025)),
            "header:x-api-key:a\0b".to_owned(),
            "header:x-api-key:a\nb".to_owned(),
            "header:x-api-key:   ".to_owned(),
            "header:x-api-key: k".to_owned(),
        ] {
            assert!(!keys_by(&header, &never, 128), "{never:?}");
        }
        assert!(keys_by(&IdentitySource::Global, "global", 128));
        assert!(!keys_by(&IdentitySource::Global, "GLOBAL", 128));
    }

    #[test]
    fn identities_are_percent_decoded_from_the_query() {
        let identity = |q: &str| query_param(q, "identity");
        assert_eq!(
            identity("identity=header%3Ax-api-key%3Aab%2Bc&tier=pro"),
            Ok(Some("header:x-api-key:ab+c".to_owned()))
        );
        assert_eq!(
            identity("tier=pro&identity=a+b%20c"),
            Ok(Some("a+b c".to_owned()))
        );
        assert_eq!(
            identity("identity="),
            Ok(Some(String::new())),
            "empty, not absent"
        );
        assert_eq!(identity("other=x"), Ok(None));
        assert_eq!(
            identity("tier=pro&identity"),
            Ok(Some(String::new())),
            "sent without a value: empty"
        );
        assert_eq!(
            identity("identity=%ff"),
            Err("identity is not UTF-8 once percent-decoded".to_owned())
        );
        for malformed in ["identity=%ZZ", "identity=a%2", "identity=100%"] {
            assert!(
                identity(malformed).is_err_and(|e| e.contains("two hex digits")),
                "{malformed}"
            );
        }
        assert_eq!(
            identity("identity=a&identity=b"),
            Err("identity is sent more than once".to_owned())
        );
    }
}
