//! The gateway's request path, top to bottom: route -> identity -> decide -> answer or
//! forward. Each hook below says when Pingora calls it and what its result means.

pub mod access;
pub mod cors;
pub mod forwarded;
pub(crate) mod grpc;
mod head;
mod headers;
mod hop;
mod outgoing;
pub mod respond;

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::prelude::*;
use pingora::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorSource, ErrorType};
use pingora_http::RequestHeader;
use pingora_proxy::{FailToProxy, ProxyWarnLogContext};

use crate::config::{Enforcement, IdentitySource};
use crate::decision::{overlimit, Decision, DecisionReason};
use crate::edge::connections::Guarded;
use crate::edge::AccessLog;
use crate::identity;
use crate::lifecycle::{InFlight, Lifecycle};
use crate::limiter::{self, identity_hash};
use crate::routing::{normalized, request_host};
use crate::snapshot::{Route, Snapshot};
use crate::store::Store;
use forwarded::Origin;
use respond::Answer;

/// The status counted for a request whose client left before any final answer (nginx's 499).
const CLIENT_CLOSED: u16 = 499;

/// The proxy: shared by every worker thread.
pub struct Gateway {
    pub live: Arc<ArcSwap<Snapshot>>,
    pub store: Store,
    pub lifecycle: Arc<Lifecycle>,
    pub access_log: Arc<AccessLog>,
    pub connections: Arc<crate::edge::connections::Connections>,
}

/// Most segments of a request path holding path parameters (`;`); past it the path is 400.
const MAX_PARAMETER_SEGMENTS: usize = 16;

/// One request's state across the hooks. The snapshot loaded first is the one the whole
/// request runs under, whatever reloads happen meanwhile.
#[derive(Default)]
pub struct RequestCtx {
    started: Option<Instant>,
    snapshot: Option<Arc<Snapshot>>,
    /// Where the request came from, and its request id.
    origin: Option<Origin>,
    /// The normalized path, once it is known to be usable.
    path: Option<String>,
    route: Option<Arc<Route>>,
    /// The CORS of the route the request's path and method found, from the moment it was
    /// found: the answers written before the route is the request's (a refused override or
    /// path reading) are readable by a listed origin too.
    cors: Option<Arc<cors::Cors>>,
    identity_hash: Option<String>,
    /// Normalized path and query, when normalization changed the path.
    upstream_uri: Option<String>,
    decision: Option<Decision>,
    /// The index (in the policy's limits) of the limit that denied, when Redis said.
    denied_by: Option<usize>,
    decision_time: Duration,
    /// `RateLimit-Policy` and `RateLimit`, when the route sends them and Redis decided.
    ratelimit: Option<headers::RateLimitFields>,
    /// Status of an answer the gateway wrote itself.
    answered: Option<u16>,
    /// A gRPC call's status: the gateway's own answer's, or the upstream's (its head's or
    /// its trailers').
    grpc_status: Option<u8>,
    /// Its upstream had no address to try (a name that does not resolve yet).
    no_address: bool,
    /// What ended the request otherwise than with a whole answer (the access log's `error`):
    /// one of [`Failure`]'s words, set where the failure is read.
    failure: Option<&'static str>,
    connect_attempts: usize,
    /// The request was sent again after a kept-alive upstream connection failed under it.
    resent: bool,
    /// The rotation's place of the first attempt, and how many addresses it held at the last:
    /// a failed connect is retried while untried addresses remain.
    first_place: Option<usize>,
    rotation: usize,
    /// The upstream address the request was last sent to (connected to: `forwarded` says
    /// whether its head was then written).
    upstream_addr: Option<std::net::SocketAddr>,
    /// The request's head reached `upstream_request_filter`, after Pingora's own checks of it
    /// (a `Connection` header naming a protected field is refused before).
    forwarded: bool,
    /// The request sent upstream asks to switch protocols: an `Upgrade` Pingora and the route
    /// let through (only `websocket`, on a `websocket = true` route). A `101` to anything
    /// else is the upstream's fault.
    upgrade_sent: bool,
    /// A connection to the upstream was tried and failed: the access log names the upstream
    /// and the address that failed, as one the request reached.
    connect_failed: bool,
    /// Request body bytes passed upstream so far, and whether the body outgrew its limit.
    body_bytes: u64,
    body_too_large: bool,
    /// Forwarded unlimited: the client is in the route's `exempt_client_cidrs`.
    exempt: bool,
    /// Forwarded unlimited: the caller's tier is `unlimited = true`.
    unlimited_tier: bool,
    /// `cost_from_response`: the charge of the cost the upstream's answer reported, sent as
    /// its head came; the request ends once it is made.
    charging: Option<tokio::task::JoinHandle<()>>,
    /// A tiered route: the tier the caller counted under, and that tier's endpoint when it
    /// is not the route's own.
    tier: Option<Arc<str>>,
    tier_endpoint: Option<Arc<limiter::Endpoint>>,
    /// The identity string of the caller, kept on a route with `forward_identity = true`.
    caller: Option<String>,
    _in_flight: Option<InFlight>,
    /// How long the request took until its answer, when the gateway went on reading the
    /// body after it ([`linger`]); else it is over when it is logged.
    took: Option<Duration>,
    /// More requests were in flight with this one than `max_connections`.
    over_capacity: bool,
    /// An HTTP/2 stream, counted on its connection while the request lasts.
    h2_stream: Option<crate::edge::connections::StreamSlot>,
}

impl RequestCtx {
    /// The endpoint that decided: a tier's, or the route's.
    fn deciding<'r>(&'r self, route: &'r Route) -> &'r Arc<limiter::Endpoint> {
        self.tier_endpoint.as_ref().unwrap_or(&route.endpoint)
    }

    /// The name of the limit that denied, when Redis said which.
    pub(super) fn denied_limit<'r>(&'r self, route: &'r Route) -> Option<&'r str> {
        let limits = &self.deciding(route).policy.limits;
        self.denied_by
            .and_then(|i| limits.get(i))
            .map(|l| l.name.as_str())
    }

    fn request_id(&self) -> &str {
        self.origin.as_ref().map_or("", |o| o.request_id.as_str())
    }

    /// Puts the request id on an answer to the client.
    fn tag(&self, header: &mut pingora_http::ResponseHeader) -> Result<()> {
        if let (Some(o), Some(s)) = (&self.origin, &self.snapshot) {
            header.insert_header(
                s.config.server.request_id_wire.clone(),
                o.request_id.as_str(),
            )?;
            // Over TLS only (RFC 6797, 7.2: a browser ignores it over plain HTTP); an
            // upstream that says its own keeps it.
            if let (true, Some(hsts)) = (o.tls, &s.config.server.strict_transport_security) {
                let name = http::header::STRICT_TRANSPORT_SECURITY;
                if !header.headers.contains_key(&name) {
                    header.insert_header(name, hsts.clone())?;
                }
            }
        }
        Ok(())
    }
}

/// The log target of the lines an upstream's failures write, one a request (a backend down
/// under load writes tens of thousands a second): filtered apart as the denials' are
/// (`RUST_LOG=info,sentinel_gateway::upstream_failures=error`), the metrics and the access
/// log's `error` still saying each.
const UPSTREAM_FAILURES: &str = "sentinel_gateway::upstream_failures";

/// After an answer to a request whose body was not all read (the gateway's own, or an
/// upstream's early answer to an HTTP/2 client): its duration is taken as answered, then the
/// rest of the body is read and thrown away ([`respond::linger`]). The request stays in
/// flight meanwhile (at most 2 s), so that its metrics and access-log line, written when it
/// ends, are there once none is in flight. An HTTP/1 body not read to its end then closes
/// the connection (Pingora would read on, unbounded, to keep it).
async fn linger(session: &mut Session, ctx: &mut RequestCtx) {
    if session.is_body_done() {
        return;
    }
    ctx.took = ctx.started.map(|s| s.elapsed());
    if !Box::pin(respond::linger(session)).await {
        session.set_keepalive(None);
    }
}

/// The gateway's own answer could not be written: the client reset its connection (or its
/// HTTP/2 stream) first. The client's doing, so DEBUG (contract section 8), and counted and
/// logged as 499 like any request whose client left before its answer; the connection is not
/// kept.
fn client_left(session: &mut Session, ctx: &mut RequestCtx, error: &Error) {
    tracing::debug!(error = %crate::telemetry::Redacted(error), request_id = ctx.request_id(), "the client left before its answer was written");
    ctx.answered = Some(CLIENT_CLOSED);
    session.set_keepalive(None);
}

/// Pingora's own bodiless answer with `code` (what `respond_error` writes), with the request id
/// on it: every answer carries it (contract section 9), these too. The connection is not
/// reused.
async fn respond_bare(session: &mut Session, ctx: &RequestCtx, code: u16) {
    let mut header = pingora_core::protocols::http::ServerSession::generate_error(code);
    let written = match ctx.tag(&mut header) {
        Ok(()) => {
            session
                .write_error_response(header, bytes::Bytes::new())
                .await
        }
        Err(e) => Err(e),
    };
    written.unwrap_or_else(|e| tracing::debug!(error = %e, "cannot answer"));
}

/// Micro-tokens of a reported cost: a non-negative decimal integer of units, at most twice
/// the largest capacity in all, which takes a full bucket of any capacity to minus its
/// capacity (where the script stops it), and stays exact in Lua's doubles; `None` for
/// anything else.
fn charge_of(value: &[u8], unit_micro: u64) -> Option<u64> {
    let digits = value.trim_ascii();
    if digits.is_empty() || digits.len() > 18 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let units: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(
        units
            .saturating_mul(unit_micro)
            .min(2 * crate::config::MAX_CAPACITY_MICRO),
    )
}

impl Gateway {
    /// Charges a reported cost (`None`: a malformed value) in a task of its own, sent as the
    /// answer's head passes on: the answer never waits for it, and the caller's next request
    /// finds it made ([`Gateway::charged`]).
    fn charge(
        &self,
        route: &Route,
        ctx: &RequestCtx,
        charge: Option<u64>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let endpoint = Arc::clone(ctx.deciding(route));
        let counters = endpoint.metrics.charges.clone();
        let (Some(micro), Some(hash)) = (charge, ctx.identity_hash.clone()) else {
            counters.invalid.inc();
            return None;
        };
        if micro == 0 {
            counters.charged.inc();
            return None;
        }
        let store = self.store.clone();
        Some(tokio::spawn(async move {
            match limiter::charge(&store, &endpoint, &hash, micro).await {
                Ok(()) => counters.charged.inc(),
                Err(cause) => {
                    tracing::debug!(cause = ?cause, endpoint_id = endpoint.policy.endpoint_id.as_str(), "a reported cost could not be charged");
                    counters.failed.inc()
                }
            }
        }))
    }

    /// Waits, once the answer has gone, for the charge of its reported cost: the request is
    /// not over (nor its connection's next request read) until the charge is made, so that
    /// the caller's next request, pipelined or sent the moment the answer came, is decided
    /// with it. Within the charge's own budget (two calls on a cluster whose ceiling lives
    /// in another slot), and usually no wait at all: it went out with the answer's head.
    /// The task keeps that budget itself; the bound here is only a backstop, with room for a
    /// loaded machine's late start of the task (a charge not yet sent when the next request
    /// is decided would let that request pass on the debt).
    async fn charged(&self, ctx: &mut RequestCtx) {
        if let Some(task) = ctx.charging.take() {
            let bound = 2 * self.store.budget() + Duration::from_millis(100);
            let _ = tokio::time::timeout(bound, task).await;
        }
    }

    async fn answer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        answer: Answer,
    ) -> Result<bool> {
        ctx.answered = Some(answer.status());
        // Answered before the route was looked for (431, 503 at capacity, a request without
        // `Host`): the access log still names a usable path.
        if ctx.path.is_none()
            && ctx
                .snapshot
                .as_ref()
                .is_some_and(|s| s.config.access_log.is_some())
        {
            if let Ok(path) = normalized(session.req_header().uri.path()) {
                ctx.path = Some(path.into_owned());
            }
        }
        let mut header = answer.header()?;
        ctx.tag(&mut header)?;
        if let Some(f) = &ctx.ratelimit {
            f.set_on(&mut header)?;
        }
        if let Some(cors) = ctx.cors.as_deref() {
            match answer {
                Answer::Preflight => {
                    cors.preflight_answer(session.req_header(), &mut header)?;
                }
                _ => cors.on_answer(session.req_header(), &mut header)?,
            }
        }
        // At capacity, nothing more is spent on the request; a broken request's body may be
        // framed otherwise than Pingora reads it, and is not read. Nor is the connection kept:
        // its next request would be read from where that body begins.
        let lingers = !matches!(answer, Answer::AtCapacity | Answer::BadRequest);
        if !lingers {
            session.set_keepalive(None);
        }
        self.close_when_draining(session);
        match respond::write_with(session, answer, header).await {
            Ok((status, grpc)) => {
                ctx.answered = Some(status);
                ctx.grpc_status = grpc;
            }
            Err(e) => {
                client_left(session, ctx, &e);
                return Ok(true);
            }
        }
        if lingers {
            linger(session, ctx).await;
        }
        Ok(true)
    }

    /// An HTTP/1 answer written while the gateway drains says `Connection: close`, as
    /// nginx's do in a graceful stop: the client sends its next request elsewhere rather
    /// than into a connection about to close. (HTTP/2 connections get Pingora's `GOAWAY`.)
    fn close_when_draining(&self, session: &mut Session) {
        if self.lifecycle.is_draining() {
            session.set_keepalive(None);
        }
    }

    /// The route of a normal path holding path parameters, when every reading of them
    /// ([`Self::request_filter`]) is served alike by it; `found` is the path's own. A reading
    /// that keeps a segment's parameter can match a prefix route only up to that segment (no
    /// route's path holds a `;`), so each segment holding one stands for the readings that
    /// keep it, looked up as the path before it and a segment with a `;`. At most
    /// [`MAX_PARAMETER_SEGMENTS`] such segments, or the lookups a request costs grow with it.
    fn route_of_parameters<'s>(
        &self,
        snapshot: &'s Snapshot,
        host: Option<&str>,
        method: &http::Method,
        path: &str,
        found: Option<&'s Arc<Route>>,
    ) -> std::result::Result<Option<&'s Arc<Route>>, ()> {
        let without = crate::routing::without_parameters(path).map_err(drop)?;
        let find = |p: &str| snapshot.routes.find(host, method, p);
        let bare: Vec<&str> = without.split('/').skip(1).collect();
        let kept: Vec<usize> = (path.split('/').skip(1).enumerate())
            .filter(|(_, segment)| segment.contains(';'))
            .map(|(i, _)| i)
            .collect();
        if kept.len() > MAX_PARAMETER_SEGMENTS {
            return Err(());
        }
        let keeping = kept.iter().map(|&at| {
            let mut before: String = bare[..at].iter().flat_map(|s| ["/", s]).collect();
            before.push_str("/;");
            find(&before)
        });
        let cut = find(crate::routing::before_parameters(path));
        let Some(route) = find(&without) else {
            // No route without parameters: none with them either, or the path reaches
            // what no route exposes on a backend that drops them.
            let none = found.is_none() && cut.is_none() && keeping.clone().all(|r| r.is_none());
            return if none { Ok(None) } else { Err(()) };
        };
        let alike = |other: Option<&Arc<Route>>| other.is_none_or(|o| o.serves_alike(route));
        if alike(cut) && alike(found) && keeping.clone().all(alike) {
            Ok(Some(found.unwrap_or(route)))
        } else {
            Err(())
        }
    }

    /// Whether every method and path the request's override fields (and `_method`
    /// parameters) could make a backend read, each with each, is served alike by `route`,
    /// the route of its own method and path. A backend that takes its method from
    /// `X-HTTP-Method-Override` serves `GET /ocr` sent with `POST` there as the `POST`
    /// a route limits, and one behind IIS serves `GET /free` with `X-Original-URL: /ocr`
    /// as `/ocr`: either would pass the limit on the route the gateway found. Each path is
    /// read as written and as Windows trims it ([`crate::routing::without_trailing_dots`]).
    /// A value that is no method or path is refused, as are two different methods or two
    /// different paths (no client sends them, and each would multiply the lookups); an
    /// empty one is read as none, as backends do. At most two methods by four paths.
    fn overrides_alike(
        &self,
        snapshot: &Snapshot,
        host: Option<&str>,
        req: &RequestHeader,
        path: &str,
        route: &Arc<Route>,
    ) -> bool {
        let (mut method, mut named) = (None, None);
        for (name, value) in &req.headers {
            let one = match head::override_of(name.as_str()) {
                Some(head::Override::Method) => head::override_method(value.as_bytes())
                    .is_some_and(|m| m.is_none_or(|m| only(&mut method, m))),
                Some(head::Override::Path) => head::override_path(value.as_bytes())
                    .is_some_and(|p| p.is_none_or(|p| only(&mut named, p))),
                None => true,
            };
            if !one {
                return false;
            }
        }
        let query = req.uri.query().unwrap_or_default();
        for value in query.split(['&', ';']).filter_map(method_parameter) {
            let one = head::override_method(value.as_bytes())
                .is_some_and(|m| m.is_none_or(|m| only(&mut method, m)));
            if !one {
                return false;
            }
        }
        let methods = std::iter::once(&req.method).chain(method.as_ref());
        let mut paths = vec![path.to_owned()];
        paths.extend(named);
        for at in 0..paths.len() {
            match crate::routing::without_trailing_dots(&paths[at]) {
                Ok(trimmed) => paths.extend(trimmed),
                Err(_) => return false,
            }
        }
        methods.into_iter().all(|method| {
            paths.iter().all(|p| {
                (*method == req.method && p == path)
                    || self.reading_alike(snapshot, host, method, p, route)
            })
        })
    }

    /// Whether the request read as `method` and the normal path `path` is served alike by
    /// `route`: its route there (one every reading of its path parameters agrees on) is one.
    fn reading_alike(
        &self,
        snapshot: &Snapshot,
        host: Option<&str>,
        method: &http::Method,
        path: &str,
        route: &Route,
    ) -> bool {
        let found = snapshot.routes.find(host, method, path);
        let other = match path.contains(';') {
            true => self.route_of_parameters(snapshot, host, method, path, found),
            false => Ok(found),
        };
        other.is_ok_and(|o| o.is_some_and(|o| o.serves_alike(route)))
    }

    /// Decides one limited request and returns the answer that denies it, if any.
    async fn limit(
        &self,
        session: &Session,
        ctx: &mut RequestCtx,
        snapshot: &Snapshot,
        route: &Route,
    ) -> Option<Answer> {
        let peer = ctx.origin.as_ref().and_then(|o| o.peer);
        let trusted = &snapshot.config.server.trusted_proxies;
        let tiers = route.endpoint.tiers.as_ref();
        let identify = || {
            identity::identify_with_tier(
                &route.identity,
                session.req_header(),
                peer,
                trusted,
                snapshot.jwt.as_ref(),
                snapshot.config.api_keys.as_ref(),
                tiers.map(|t| &t.from),
            )
        };
        let mut identified = identify();
        if let (Err(identity::IdentityError::UnknownKid), Some(jwt)) =
            (&identified, snapshot.jwt.as_ref())
        {
            // The provider may have rotated its keys: fetch them (at most once per 10 s)
            // and verify again; a kid still unknown is refused below.
            jwt.unknown_kid().await;
            identified = identify();
        }
        let (identity, caller_tier) = match identified {
            Ok((id, tier)) if route.identity == IdentitySource::ClientIp => {
                let prefix = snapshot.config.server.ipv6_identity_prefix;
                (identity::ipv6_grouped(id, prefix), tier)
            }
            Ok(found) => found,
            Err(e) => {
                use identity::IdentityError::{InvalidToken, UnknownKid};
                if let (InvalidToken | UnknownKid, Some(jwt)) = (e, snapshot.jwt.as_ref()) {
                    identity::note_refused(session.req_header(), jwt);
                }
                if tracing::enabled!(tracing::Level::DEBUG) {
                    let reason = identity::refusal(session.req_header(), snapshot.jwt.as_ref(), e);
                    tracing::debug!(
                        endpoint_id = %route.endpoint.policy.endpoint_id,
                        request_id = ctx.request_id(),
                        reason,
                        "request refused: no usable identity"
                    );
                }
                return Some(match e {
                    identity::IdentityError::UnusableForwardedFor => Answer::BadRequest,
                    _ => Answer::Unauthenticated {
                        bearer: route.identity == IdentitySource::Jwt,
                    },
                });
            }
        };
        let hash = identity_hash(&identity);
        if route.forward_identity {
            ctx.caller = Some(identity);
        }
        // A tiered route: the caller's tier picks the limits (an unlimited tier: none).
        let mut endpoint = Arc::clone(&route.endpoint);
        if let Some(tiers) = tiers {
            let (tier, chosen) = tiers.choose(caller_tier.as_deref());
            ctx.tier = Some(tier);
            match chosen {
                None => {}
                Some(Some(e)) => {
                    endpoint = Arc::clone(&e);
                    ctx.tier_endpoint = Some(e);
                }
                Some(None) => {
                    // No limit and no Redis call: no decision either, as for an exempt
                    // client; the tier's own counter still counts it admitted.
                    ctx.unlimited_tier = true;
                    if snapshot.config.access_log.is_some() {
                        ctx.identity_hash = Some(hash);
                    }
                    return None;
                }
            }
        }
        let started = Instant::now();
        let policy = &endpoint.policy;
        let decision = if policy.several {
            let several = limiter::decide_limits(&self.store, &endpoint, &hash).await;
            ctx.denied_by = several.denied_by;
            if policy.ratelimit_headers.any() {
                ctx.ratelimit = match (several.decision.reply(), several.denied_by) {
                    (Some(repeated), Some(limit))
                        if several.decision.cached() && several.replies.is_empty() =>
                    {
                        headers::one(policy, limit, repeated)
                    }
                    _ => headers::several(policy, &several.replies),
                };
            }
            several.decision
        } else {
            let decision = limiter::decide(&self.store, &endpoint, &hash).await;
            // Redis's denial or the over-limit cache's repeat of it: the one limit denied.
            if decision.reason() == DecisionReason::RateLimited {
                ctx.denied_by = Some(0);
            }
            if policy.ratelimit_headers.any() {
                ctx.ratelimit = decision.reply().and_then(|r| headers::fields(policy, r));
            }
            decision
        };
        if decision.reason() == DecisionReason::RateLimited && !overlimit::hearing() {
            // The process's first remembered denial (or its repeat from the cache, or another
            // Redis gave meanwhile): answered once the process has tried to listen for other
            // gateways' resets (within the budget), so that one made after the client has
            // this answer is heard here.
            overlimit::until_hearing(self.store.budget().saturating_sub(started.elapsed())).await;
        }
        ctx.decision_time = started.elapsed();
        // Kept only for the access log and response charges: no copy per request without.
        if snapshot.config.access_log.is_some() || policy.cost_from_response.is_some() {
            ctx.identity_hash = Some(hash.clone());
        }
        ctx.decision = Some(decision);
        if decision.allowed() {
            return None;
        }
        let answer = match decision.deny_status() {
            429 => Answer::RateLimited {
                retry_after_secs: decision.retry_after_secs(),
            },
            _ => Answer::LimiterUnavailable {
                retry_after_base_secs: decision.retry_after_secs(),
            },
        };
        let shadow = route.endpoint.policy.mode == Enforcement::Shadow;
        // A target of their own: under a flood they are most of the log, and an operator may
        // filter them apart from the rest (`RUST_LOG=info,sentinel_gateway::denials=error`).
        tracing::warn!(
            target: "sentinel_gateway::denials",
            endpoint_id = route.endpoint.policy.endpoint_id.as_str(),
            decision_reason = decision.reason().as_str(),
            identity_hash = hash.as_str(),
            latency_us = ctx.decision_time.as_micros() as u64,
            breaker_state = decision.breaker().as_str(),
            status = answer.status(),
            shadow,
            limit = ctx.denied_limit(route),
            tier = ctx.tier.as_deref(),
            request_id = ctx.request_id(),
            "request denied"
        );
        (!shadow).then_some(answer)
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        let (in_flight, nth) = self.lifecycle.track();
        RequestCtx {
            started: Some(Instant::now()),
            _in_flight: Some(in_flight),
            over_capacity: nth > self.connections.max(),
            ..RequestCtx::default()
        }
    }

    /// Runs first for every request. Answers 400, 404, 401, 429 and 503 itself and returns
    /// `Ok(true)`; returns `Ok(false)` to forward. Nothing here touches Redis unless a limited
    /// route matched and the identity is valid.
    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let snapshot = self.live.load_full();
        ctx.snapshot = Some(Arc::clone(&snapshot));
        let server = &snapshot.config.server;
        if let Some(connection) = Guarded::of(session.stream()) {
            connection.head_complete();
        }
        // Pipelined HTTP/1.1 requests are answered one after another, in order (RFC 9112,
        // 9.3.2); without it, a request sent while the one before it was being proxied made
        // Pingora drop that one's answer. It carries over to the connection's next requests.
        // A client that closes its side once its requests are sent (a half-close: `nc -N`,
        // `shutdown(SHUT_WR)`) still reads the answer (9.6): Pingora would take the end of
        // its side for a client gone and answer nothing to a request already forwarded and
        // charged. A client truly gone is found when the answer cannot be written.
        match &mut *session.downstream_session {
            pingora_core::protocols::http::ServerSession::H1(h1) => {
                if !h1.pipelining_enabled() {
                    h1.set_pipelining_enabled(true);
                }
                h1.set_abort_on_close(false);
                // An HTTP/1.0 client is sent no interim answer (RFC 9110, 15.2): the
                // upstream's `100` or `103` ends here.
                if h1.req_header().version == http::Version::HTTP_10 {
                    h1.set_ignore_info_resp(true);
                }
            }
            // An HTTP/2 stream is its connection's request in progress, which is then not
            // idle (`max_connections` makes room with idle ones only).
            pingora_core::protocols::http::ServerSession::H2(_) => {
                if let Some(digest) = session.digest().and_then(|d| d.socket_digest.as_ref()) {
                    ctx.h2_stream = self.connections.stream_started(digest);
                    ctx.over_capacity |= ctx.h2_stream.as_ref().is_some_and(|s| s.over_share());
                }
            }
            _ => {}
        }
        // `keepalive_timeout_seconds` is kept by the connection watch (edge/connections.rs)
        // as the process started with it (a reload's needs a restart, as the answer says);
        // 0: no keep-alive.
        if self.connections.keepalive_off() {
            session.set_keepalive(None);
        }
        // `send_timeout_seconds`: each write to the client (a body chunk, a head; an HTTP/2
        // stream's wait for its window too) must be taken within it, or the request ends
        // and its connection closes. Pingora's timer starts only when a write waits.
        session.set_write_timeout(server.send_timeout_option());
        let peer = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip());
        let tls = session.digest().is_some_and(|d| d.ssl_digest.is_some());
        ctx.origin = Some(Origin::of(
            session.req_header(),
            peer,
            &server.trusted_proxies,
            &server.request_id_header,
            tls,
        ));
        // Each request in flight holds an upstream connection: with HTTP/2's streams they
        // could outnumber the connections `max_connections` bounds and take the
        // descriptors Redis, the upstreams and the admin need. One HTTP/1 connection
        // carries one at a time, so only streams meet this in practice.
        if ctx.over_capacity {
            self.connections.request_refused();
            return self.answer(session, ctx, Answer::AtCapacity).await;
        }
        let req = session.req_header();
        let (mut header_bytes, mut underscored, mut overriding) = (0, false, false);
        for (k, v) in &req.headers {
            header_bytes += k.as_str().len() + v.len();
            underscored |= !crate::routing::plain_field_name(k.as_str());
            overriding |= head::override_of(k.as_str()).is_some();
        }
        overriding |= req.uri.query().is_some_and(query_may_name_a_method);
        if let Some(origin) = &mut ctx.origin {
            origin.underscored = underscored;
        }
        if header_bytes > respond::MAX_HEADER_BYTES {
            return self.answer(session, ctx, Answer::HeadersTooLarge).await;
        }
        // RFC 9112, 3.2: an HTTP/1.1 request without `Host` is a 400 (HTTP/1.0 may omit it;
        // HTTP/2 carries `:authority`).
        let hostless =
            req.version == http::Version::HTTP_11 && !req.headers.contains_key(http::header::HOST);
        if hostless {
            return self.answer(session, ctx, Answer::BadRequest).await;
        }
        // A head whose framing or `Host` the upstream could read otherwise than the gateway
        // did: refused, the body not read, the connection closed after the answer.
        let Some(announced) = head::announced_length(req) else {
            session.set_keepalive(None);
            return self.answer(session, ctx, Answer::BadRequest).await;
        };
        // Pingora would answer CONNECT with a bare 405 before any hook; the server options
        // let it through to here, where it gets the gateway's own answer. TRACE is refused
        // as nginx refuses it: a backend that echoes it would hand a page's script the
        // cookies and credentials the request carried (cross-site tracing).
        if req.method == http::Method::CONNECT || req.method == http::Method::TRACE {
            session.set_keepalive(None);
            return self.answer(session, ctx, Answer::MethodNotAllowed).await;
        }
        if !crate::routing::plain_method(&req.method) || head::connection_refused(req) {
            session.set_keepalive(None);
            return self.answer(session, ctx, Answer::BadRequest).await;
        }
        // A target neither in origin form (`/path`) nor in absolute form (`http://host/path`),
        // such as `GET free`, whose URI Pingora reads as the path `/`, is not a request for it.
        if req.raw_path().first() != Some(&b'/')
            && req.uri.authority().is_none()
            && forwarded::absolute_form_authority(req).is_none()
        {
            session.set_keepalive(None);
            return self.answer(session, ctx, Answer::BadRequest).await;
        }
        let Ok(path) = normalized(req.uri.path()) else {
            return self.answer(session, ctx, Answer::BadRequest).await;
        };
        if snapshot.config.access_log.is_some() {
            ctx.path = Some(path.clone().into_owned());
        }
        let host_header = req
            .headers
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok());
        let target_host = req
            .uri
            .host()
            .or_else(|| forwarded::absolute_form_authority(req));
        let host = request_host(target_host, host_header);
        let mut found = snapshot.routes.find(host.as_deref(), &req.method, &path);
        ctx.cors = found.and_then(|r| r.cors.clone());
        // A listed origin's preflight is the gateway's to answer (it carries no credentials:
        // nothing of it goes on, unlimited, to the upstream), by the route of the method it
        // asks for (a `methods = ["POST"]` route matches no `OPTIONS` of its own).
        if let Some(asked) = cors::Cors::preflight_method(req) {
            let route = snapshot.routes.find(host.as_deref(), &asked, &path);
            if let Some(route) = route.filter(|r| r.cors.as_ref().is_some_and(|c| c.takes(req))) {
                ctx.route = Some(Arc::clone(route));
                ctx.cors = route.cors.clone();
                return self.answer(session, ctx, Answer::Preflight).await;
            }
        }
        // Path parameters (`;` to a segment's end): backends read them in several ways.
        // Most read the path as written; Tomcat, Jetty and Spring drop every parameter;
        // Spring with matrix variables drops some (a session id) and keeps others; older
        // Undertow ends the path at its first `;`. A path whose route those readings decide
        // (`/api;x/ocr` is `/api;x/...` to one backend and `/api/ocr` to another) could pass a
        // limit on one of them: refused. One that only readings without parameters route
        // (no route, not even a catch-all, takes it as written) goes to that route, limited
        // there either way. Forwarded, a path keeps its parameters.
        if path.contains(';') {
            match self.route_of_parameters(&snapshot, host.as_deref(), &req.method, &path, found) {
                Ok(route) => found = route,
                Err(()) => return self.answer(session, ctx, Answer::BadRequest).await,
            }
        }
        // Windows servers trim each segment's trailing dots and spaces (`/ingest.` is
        // `/ingest` to IIS): refused when that reading's route serves otherwise.
        match crate::routing::without_trailing_dots(&path) {
            Ok(None) => {}
            Ok(Some(trimmed)) => {
                let alike = found.is_none_or(|route| {
                    self.reading_alike(&snapshot, host.as_deref(), &req.method, &trimmed, route)
                });
                if !alike {
                    return self.answer(session, ctx, Answer::BadRequest).await;
                }
            }
            Err(_) => return self.answer(session, ctx, Answer::BadRequest).await,
        }
        // A method or path some backends take from a field (or `_method`) instead of the
        // request's own: refused when the route it would pick serves otherwise.
        if let Some(route) = found.filter(|_| overriding) {
            let alike = self.overrides_alike(&snapshot, host.as_deref(), req, &path, route);
            if !alike {
                return self.answer(session, ctx, Answer::BadRequest).await;
            }
        }
        let Some(route) = found.cloned() else {
            return self.answer(session, ctx, Answer::NoRoute).await;
        };
        // The upstream gets the normalized path, in origin form; rewrite the URI only when
        // it differs (or the target carries an authority).
        if path != req.uri.path() || target_host.is_some() {
            ctx.upstream_uri = Some(match req.uri.query() {
                Some(q) => format!("{path}?{q}"),
                None => path.into_owned(),
            });
        }
        ctx.route = Some(Arc::clone(&route));
        ctx.cors = route.cors.clone();
        // A body announced too large is refused before identity, limiter and upstream.
        if let Some(limit) = route.max_body_bytes {
            if announced.is_some_and(|n| n > limit) {
                // The connection closes after the answer (and what comes of the body, read
                // and thrown away for a while so that the answer is not reset away).
                session.set_keepalive(None);
                return self.answer(session, ctx, Answer::BodyTooLarge).await;
            }
        }
        // A client a trusted proxy's `X-Forwarded-For` cannot name is not exempt: it is limited
        // under its own identity (on a `client_ip` route, 400 there).
        let client = ctx.origin.as_ref().and_then(|o| o.client);
        if client.is_some_and(|ip| route.exempt_client_cidrs.iter().any(|n| n.contains(&ip))) {
            ctx.exempt = true;
            return Ok(false);
        }
        if route.endpoint.policy.algorithm == crate::config::Algorithm::None {
            return Ok(false);
        }
        // Boxed: the decision's future is large, and only limited routes need it; inline,
        // every request's filter future would carry (and copy) its size.
        match Box::pin(self.limit(session, ctx, &snapshot, &route)).await {
            Some(answer) => self.answer(session, ctx, answer).await,
            None => Ok(false),
        }
    }

    /// Picks the upstream address by round robin, with the upstream's timeouts.
    async fn upstream_peer(
        &self,
        _session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        let route = ctx
            .route
            .as_ref()
            .ok_or_else(|| Error::new(ErrorType::InternalError))?;
        let pool = &route.upstream;
        // A retry goes on from the place the request's first attempt took.
        let after = ctx
            .first_place
            .map(|p| p.wrapping_add(ctx.connect_attempts));
        let turn = pool
            .select_turn(after)
            // The pool said it once (`select_turn`): not a line a request.
            .ok_or_else(|| {
                Error::explain(ErrorType::ConnectNoRoute, "no upstream address").into_up()
            });
        // Its 502 names the upstream that had no address (and no address tried).
        ctx.no_address = turn.is_err();
        let turn = turn?;
        ctx.first_place.get_or_insert(turn.place);
        ctx.rotation = turn.of;
        let backend = turn.pick;
        ctx.connect_attempts += 1;
        ctx.upstream_addr = backend.addr.as_inet().copied();
        // Each attempt sends the body from its start (Pingora's retry buffer passes it through
        // `request_body_filter` again): only one attempt's bytes count against the limit.
        ctx.body_bytes = 0;
        let mut peer = match (&pool.tls, backend.addr.as_inet()) {
            (Some(tls), Some(_)) => {
                let mut peer = HttpPeer::new(backend.addr.clone(), true, tls.sni_for(&backend));
                peer.options.verify_cert = tls.verify;
                peer.options.verify_hostname = tls.verify;
                peer.options.ca = tls.ca.clone();
                peer.group_key = tls.pool_key;
                peer
            }
            _ => HttpPeer::new(backend.addr.clone(), false, String::new()),
        };
        let up = &pool.config;
        if up.http2 {
            // Over TLS, ALPN offers `h2` first and `http/1.1` (an upstream that picks it is
            // spoken to so, its connections kept); in plain, h2c with prior knowledge.
            // Requests share a connection as its SETTINGS allow, up to `H2_STREAMS` at once.
            let min = if pool.tls.is_some() { 1 } else { 2 };
            peer.options.set_http_version(2, min);
            peer.options.max_h2_streams = crate::upstream::H2_STREAMS;
        }
        peer.options.connection_timeout = Some(up.connect_timeout);
        peer.options.total_connection_timeout = Some(up.connect_timeout);
        peer.options.read_timeout = Some(up.read_timeout);
        peer.options.write_timeout = Some(up.read_timeout);
        Ok(Box::new(peer))
    }

    /// The upstream receives the normalized path with the original query, the forwarded
    /// headers and the request id.
    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        ctx.forwarded = true;
        if let (Some(origin), Some(snapshot)) = (&ctx.origin, &ctx.snapshot) {
            origin.apply(upstream_request, &snapshot.config.server.request_id_wire)?;
        }
        if ctx.route.as_ref().is_some_and(|r| r.forward_identity) {
            forwarded::tell_caller(upstream_request, ctx.caller.as_deref(), ctx.tier.as_deref())?;
        }
        if !ctx.route.as_ref().is_some_and(|r| r.websocket) {
            outgoing::drop_upgrade(upstream_request);
        }
        ctx.upgrade_sent = upstream_request.headers.contains_key(http::header::UPGRADE);
        // A cost the upstream will report is charged though the client resets meanwhile
        // (never for a tunnel, which a reset ends).
        let charges = ctx.route.as_ref().is_some_and(|r| {
            r.endpoint.policy.cost_from_response.is_some()
                && ctx.decision.is_some_and(|d| d.admitted_by_redis())
        });
        if charges && !upstream_request.headers.contains_key(http::header::UPGRADE) {
            if let Some(connection) = Guarded::of(session.stream()) {
                connection.read_through_a_reset();
            }
        }
        let version = session.req_header().version;
        if version == http::Version::HTTP_2 {
            outgoing::join_cookies(upstream_request)?;
        }
        let host = (version == http::Version::HTTP_10)
            .then(|| outgoing::host_for_http_1_0(upstream_request, ctx.upstream_addr))
            .flatten();
        if ctx.route.as_ref().is_some_and(|r| r.upstream.config.http2) {
            outgoing::authority_for_http2(upstream_request, ctx.upstream_addr)?;
        }
        if let Some(uri) = ctx.upstream_uri.as_deref() {
            let uri = uri
                .parse::<http::Uri>()
                .map_err(|e| Error::because(ErrorType::InvalidHTTPHeader, "normalized path", e))?;
            upstream_request.set_uri(uri);
        }
        if let Some(host) = host {
            upstream_request.insert_header(http::header::HOST, host)?;
        }
        outgoing::answer_expect(session, upstream_request).await
    }

    /// A 101 is an upstream's answer only to a request that asked to switch (an `Upgrade`
    /// passed on by a `websocket = true` route): any other would be passed on as an interim
    /// answer, and a second answer written after it once the read timeout passed. It is the
    /// upstream's fault: 502.
    async fn upstream_response_filter(
        &self,
        _session: &mut Session,
        upstream_response: &mut pingora_http::ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if upstream_response.status == http::StatusCode::SWITCHING_PROTOCOLS && !ctx.upgrade_sent {
            return Err(Error::explain(
                ErrorType::InvalidHTTPHeader,
                "the upstream switched protocols for a request that asked for no upgrade",
            )
            .into_up());
        }
        // An answer head past what a request's may hold is the upstream's fault: 502, as
        // nginx's "upstream sent too big header" (Pingora reads up to 1 MiB of it).
        if respond::fields_bytes(&upstream_response.headers) > respond::MAX_HEADER_BYTES {
            return Err(Error::explain(
                ErrorType::InvalidHTTPHeader,
                "the upstream's answer head is larger than 64 KiB",
            )
            .into_up());
        }
        hop::end_at_this_hop(upstream_response);
        hop::one_content_length(upstream_response);
        Ok(())
    }

    /// Counts the request body on its way upstream and stops it at the route's limit: the
    /// upstream never receives more than `max_body_bytes`.
    async fn request_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<bytes::Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let Some(chunk) = body else {
            return Ok(());
        };
        // A tunnel's bytes (after a `101`) are no request body: `max_body_bytes` cut a
        // WebSocket once its client had sent that much through it in all.
        if session.was_upgraded() {
            return Ok(());
        }
        // An HTTP/2 body of unknown length may end with an empty DATA frame. Pingora writes
        // an empty last chunk upstream as chunked's terminator and then the terminator again,
        // which the upstream reads as the start of another request and answers on the
        // pooled connection, to whichever client's request comes next. No chunk at all
        // ends the body with one terminator.
        if chunk.is_empty() {
            if end_of_stream {
                *body = None;
            }
            return Ok(());
        }
        ctx.body_bytes += chunk.len() as u64;
        let limit = ctx.route.as_ref().and_then(|r| r.max_body_bytes);
        if limit.is_some_and(|limit| ctx.body_bytes > limit) {
            ctx.body_too_large = true;
            *body = None;
            return Err(Error::explain(
                ErrorType::Custom("body too large"),
                "the request body outgrew max_body_bytes",
            ));
        }
        Ok(())
    }

    /// Adds the request id, and the RateLimit fields to an upstream's answer to an admitted
    /// request.
    async fn response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut pingora_http::ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        ctx.tag(upstream_response)?;
        self.close_when_draining(session);
        outgoing::as_own(upstream_response);
        outgoing::frame_for_http_1_0(session, upstream_response);
        if let Some(f) = &ctx.ratelimit {
            f.merge_onto(upstream_response)?;
        }
        if let Some(cors) = ctx.cors.as_deref() {
            cors.on_answer(session.req_header(), upstream_response)?;
        }
        // A call's status, when an HTTP/2 upstream answered it with a head alone
        // (Trailers-Only).
        let http2 = ctx.route.as_ref().is_some_and(|r| r.upstream.config.http2);
        if http2 && grpc::call_type(session.req_header()).is_some() {
            ctx.grpc_status = grpc::status_in(&upstream_response.headers);
        }
        let cost = ctx
            .route
            .as_ref()
            .and_then(|r| r.endpoint.policy.cost_from_response.clone());
        if let Some(cost) = cost {
            // Sent more than once, the cost is not one number: charged as malformed.
            let fields = upstream_response
                .headers
                .get_all(cost.header.as_str())
                .iter()
                .count();
            // Never shown to the client, charged or not.
            let reported = upstream_response.remove_header(&cost.header);
            let admitted_by_redis = ctx.decision.is_some_and(|d| d.admitted_by_redis());
            // A final answer's: an interim one (`103 Early Hints`) charges nothing.
            let fin = upstream_response.status.as_u16() >= 200;
            if let (Some(value), true, true, Some(route)) =
                (reported, admitted_by_redis, fin, &ctx.route)
            {
                let charge = match fields {
                    1 => charge_of(value.as_bytes(), cost.unit_micro),
                    _ => None,
                };
                ctx.charging = self.charge(route, ctx, charge);
            }
        }
        Ok(())
    }

    /// An `http2` upstream's trailers pass on to an HTTP/2 client as they come (an HTTP/1.1
    /// client's answer has none); a gRPC call's status there is the access log's.
    async fn response_trailer_filter(
        &self,
        session: &mut Session,
        upstream_trailers: &mut http::HeaderMap,
        ctx: &mut RequestCtx,
    ) -> Result<Option<bytes::Bytes>> {
        if grpc::call_type(session.req_header()).is_some() {
            if let Some(code) = grpc::status_in(upstream_trailers) {
                ctx.grpc_status = Some(code);
            }
        }
        Ok(None)
    }

    /// A failed connect is retried on the next address while untried addresses remain.
    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut RequestCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        ctx.connect_failed = true;
        if ctx.connect_attempts < ctx.rotation {
            e.set_retry(true);
        }
        e
    }

    /// A failure on an upstream connection taken from the pool (closed by the upstream as it
    /// was sent, say) sends an idempotent request once more, on another connection, as
    /// Pingora does; never a second time: an upstream that drops every connection it is
    /// asked this request on (a request that crashes it) would otherwise receive it once per
    /// kept connection.
    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut RequestCtx,
        reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        // An HTTP/2 upstream that refused the stream (`REFUSED_STREAM`) or left it out of its
        // `GOAWAY` did not process the request: sent again whatever its method (RFC 9113,
        // 8.7), as a gRPC call (a POST) to a backend restarting must be.
        let unprocessed = matches!(e.retry, pingora_core::RetryType::Decided(true));
        let resendable = (session.req_header().method.is_idempotent() || unprocessed)
            && !session.as_ref().retry_buffer_truncated();
        if resendable && !ctx.resent {
            e.retry.decide_reuse(reused);
            ctx.resent = e.retry();
        } else {
            e.set_retry(false);
        }
        e
    }

    /// A request that failed while proxying: upstream trouble is 502 or 504 JSON, a client
    /// that sent garbage gets 400, anything else 500.
    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
        // A tunnel (`101` went out) carries the peers' bytes alone: however it ends (idle past
        // the upstream's read timeout, as nginx's `proxy_read_timeout` ends one; a peer gone),
        // it is closed with nothing of the gateway's written into it (a JSON 408 or 400 was,
        // a `101` being an interim status). Idle, or ended by the client: as it should, at
        // DEBUG; an upstream that failed under it (a reset, a crash) is a WARN, as before.
        if session
            .response_written()
            .is_some_and(|r| r.status == http::StatusCode::SWITCHING_PROTOCOLS)
        {
            let failed = matches!(e.esource(), ErrorSource::Upstream)
                && !matches!(e.etype(), ErrorType::ReadTimedout);
            // Cut for the upstream's silence past its read timeout (as an event stream is),
            // or by its failure; a peer closing its side is the tunnel's end.
            let timed_out = matches!(e.esource(), ErrorSource::Upstream)
                && matches!(e.etype(), ErrorType::ReadTimedout);
            ctx.failure = match (failed, timed_out) {
                (true, _) => Some(Failure::UPSTREAM_FAILED),
                (_, true) => Some(Failure::UPSTREAM_TIMEOUT),
                _ => None,
            };
            if let (true, Some(route)) = (failed, &ctx.route) {
                tracing::warn!(
                    endpoint_id = route.endpoint.policy.endpoint_id.as_str(),
                    upstream = route.upstream.config.name.as_str(),
                    error = %crate::telemetry::Redacted(e),
                    request_id = ctx.request_id(),
                    "the upstream failed under a websocket tunnel; closed"
                );
            } else {
                tracing::debug!(
                    request_id = ctx.request_id(),
                    error = %crate::telemetry::Redacted(e),
                    "the websocket tunnel ended"
                );
            }
            return FailToProxy {
                error_code: 101,
                can_reuse_downstream: false,
            };
        }
        // The upstream waited past its read timeout for a body the client announced and held
        // back (or sends too slowly): the client's doing, not the upstream's (nginx's
        // `client_body_timeout`), however much of it came first. The upstream's read timeout
        // runs only while every byte taken from the client has been written to it (a write
        // the upstream does not take holds the proxy there, and ends in a write timeout: an
        // upstream that stopped reading the body is a 504, its own); bytes taken and not yet
        // written (the body's last, say) came as the timeout passed, and are the client's too.
        let unwritten = session
            .upstream_body_bytes_sent()
            .is_some_and(|sent| sent < session.body_bytes_read());
        let body_withheld = matches!(e.esource(), ErrorSource::Upstream)
            && matches!(e.etype(), ErrorType::ReadTimedout)
            && session
                .response_written()
                .is_none_or(|r| r.status.is_informational())
            && (!session.is_body_done() || unwritten);
        if body_withheld {
            tracing::debug!(
                request_id = ctx.request_id(),
                received = session.body_bytes_read(),
                "the client held back the body it announced until the upstream's read timeout: 408"
            );
        }
        let answer = match (e.esource(), e.etype()) {
            _ if ctx.body_too_large => Some(Answer::BodyTooLarge),
            _ if body_withheld => Some(Answer::BodyTimeout),
            (_, ErrorType::HTTPStatus(code)) => {
                let code = *code;
                if code > 0 {
                    respond_bare(session, ctx, code).await;
                }
                return FailToProxy {
                    error_code: code,
                    can_reuse_downstream: false,
                };
            }
            (
                ErrorSource::Upstream,
                ErrorType::ConnectTimedout | ErrorType::ReadTimedout | ErrorType::WriteTimedout,
            ) => Some(Answer::UpstreamTimeout),
            (ErrorSource::Upstream, _) => Some(Answer::UpstreamUnavailable),
            // The client left, or reset its HTTP/2 stream (which no answer can reach).
            (
                ErrorSource::Downstream,
                ErrorType::ReadError
                | ErrorType::WriteError
                | ErrorType::ConnectionClosed
                | ErrorType::H2Error,
            ) => None,
            (ErrorSource::Downstream, _) => Some(Answer::BadRequest),
            (ErrorSource::Internal | ErrorSource::Unset, ErrorType::ConnectTimedout) => {
                Some(Answer::UpstreamTimeout)
            }
            (
                ErrorSource::Internal | ErrorSource::Unset,
                ErrorType::ConnectRefused | ErrorType::ConnectNoRoute | ErrorType::ConnectError,
            ) => Some(Answer::UpstreamUnavailable),
            _ => None,
        };
        // A `100 Continue` passed on from the upstream is not an answer yet.
        let answering = session
            .response_written()
            .is_none_or(|r| r.status.is_informational());
        ctx.failure = Failure::of(e, answer, answering);
        if matches!(e.esource(), ErrorSource::Upstream) && !body_withheld {
            if let Some(route) = &ctx.route {
                // Once the upstream's own head went out, the client keeps its status and sees
                // the body cut short: the line says that status, not the one not sent.
                let (status, message) = match session.response_written() {
                    Some(r) if !answering => (
                        r.status.as_u16(),
                        "upstream failed after its answer began; the body was cut short",
                    ),
                    _ => (answer.map_or(0, Answer::status), "upstream failed"),
                };
                tracing::warn!(
                    target: UPSTREAM_FAILURES,
                    endpoint_id = route.endpoint.policy.endpoint_id.as_str(),
                    upstream = route.upstream.config.name.as_str(),
                    status,
                    error = %crate::telemetry::Redacted(e),
                    request_id = ctx.request_id(),
                    message
                );
            }
        }
        let code = match answer {
            Some(answer) if answering => {
                // The connection is not reused after a failed proxy attempt: say so, so the
                // client does not send its next request into a closing socket.
                session.set_keepalive(None);
                ctx.answered = Some(answer.status());
                let cors = ctx.cors.clone();
                let header = (answer.header())
                    .and_then(|mut h| ctx.tag(&mut h).map(|()| h))
                    .and_then(|mut h| match &cors {
                        Some(cors) => cors.on_answer(session.req_header(), &mut h).map(|()| h),
                        None => Ok(h),
                    });
                let written = match header {
                    Ok(header) => respond::write_with(session, answer, header).await,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot make the error answer: this is a bug");
                        Ok((answer.status(), None))
                    }
                };
                match written {
                    Ok((status, grpc)) => {
                        ctx.answered = Some(status);
                        ctx.grpc_status = grpc;
                        // A client holding its body back is not waited for again.
                        if answer != Answer::BodyTimeout {
                            linger(session, ctx).await;
                        }
                        status
                    }
                    Err(err) => {
                        client_left(session, ctx, &err);
                        CLIENT_CLOSED
                    }
                }
            }
            // A gRPC call whose answer began, cut by its upstream: its end said as gRPC says
            // it, in trailers (`UNAVAILABLE`), where a reset stream reads to the client as
            // its own cancel (`CANCELLED`), which no retry policy retries.
            Some(answer)
                if session.downstream_session.is_http2()
                    && grpc::call_type(session.req_header()).is_some() =>
            {
                let (code, message) = answer.grpc_status();
                let mut trailers = http::HeaderMap::new();
                trailers.insert("grpc-status", http::HeaderValue::from(u16::from(code)));
                trailers.insert("grpc-message", http::HeaderValue::from_static(message));
                let end =
                    pingora_core::protocols::http::HttpTask::Trailer(Some(Box::new(trailers)));
                if session.write_response_tasks(vec![end]).await.is_ok() {
                    ctx.grpc_status = Some(code);
                }
                answer.status()
            }
            Some(answer) => answer.status(),
            None if answering && !matches!(e.esource(), ErrorSource::Downstream) => {
                respond_bare(session, ctx, 500).await;
                500
            }
            None => 0,
        };
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    /// Upstream failures are logged by `fail_to_proxy` as one structured WARN line with the
    /// endpoint; Pingora's own free-text ERROR line for them is suppressed. So is the line for
    /// what a client did (closed early, sent a broken body, outgrew the body limit): that is
    /// not the gateway's fault, and is logged at DEBUG.
    fn suppress_error_log(&self, _session: &Session, ctx: &RequestCtx, error: &Error) -> bool {
        let by_client = ctx.body_too_large || matches!(error.esource(), ErrorSource::Downstream);
        if by_client {
            tracing::debug!(error = %crate::telemetry::Redacted(error), request_id = ctx.request_id(), "the client ended the request");
        }
        by_client || matches!(error.esource(), ErrorSource::Upstream)
    }

    /// An upstream attempt that failed and is tried again (the next address after a refused
    /// connect, or once more after a kept connection failed) is one structured WARN line
    /// with the request id, in place of Pingora's free-text one, which quotes the query
    /// string.
    fn suppress_proxy_warn_log(
        &self,
        _session: &Session,
        ctx: &RequestCtx,
        error: &Error,
        context: ProxyWarnLogContext,
    ) -> bool {
        if let (ProxyWarnLogContext::UpstreamRetry, Some(route)) = (context, &ctx.route) {
            tracing::warn!(
                target: UPSTREAM_FAILURES,
                endpoint_id = route.endpoint.policy.endpoint_id.as_str(),
                upstream = route.upstream.config.name.as_str(),
                addr = ctx.upstream_addr.map(|a| a.to_string()),
                error = %crate::telemetry::Redacted(error),
                request_id = ctx.request_id(),
                "an upstream attempt failed; the request is tried again"
            );
            return true;
        }
        false
    }

    /// What Pingora's own log lines say of a request: method, path without the query (which
    /// may carry tokens), host and request id.
    fn request_summary(&self, session: &Session, ctx: &RequestCtx) -> String {
        let req = session.req_header();
        // A route limited by `Host`: the raw identity, which no line shows.
        let hidden = access::identity_in(ctx, "host");
        let host = req
            .headers
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .or_else(|| req.uri.host())
            .filter(|_| !hidden)
            .unwrap_or("-");
        format!(
            "{} {}, Host: {host}, request_id: {}",
            req.method,
            req.uri.path(),
            ctx.request_id()
        )
    }

    /// Called once per request at its end: the one place metrics are recorded.
    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        // The upstream's whole answer went to an HTTP/2 client before its request's body had
        // all come: the proxy stopped passing the body on (the upstream connection is closed).
        // The rest is read as after the gateway's own answers, so that a client still sending
        // ends its stream itself; one that stopped is reset after a quarter of a second.
        if e.is_none()
            && ctx.answered.is_none()
            && session.downstream_session.is_http2()
            && session.response_written().is_some()
        {
            linger(session, ctx).await;
        }
        if let Some(connection) = Guarded::of(session.stream()) {
            connection.answered();
        }
        // Nothing was answered: the client left first (or its connection broke before the
        // answer's head went out, or it reset the connection before the upstream's answer,
        // read for its reported cost, came). Counted and logged as nginx's 499, "client
        // closed request". An interim answer alone (`100 Continue`) is no answer; `101` ends
        // the exchange.
        // An upstream's answer whose head was still in Pingora's buffer (it goes out with the
        // first bytes of the body) when the reset came never reached the client either.
        let reset_first = ctx.answered.is_none()
            && session.body_bytes_sent() == 0
            && Guarded::of(session.stream()).is_some_and(Guarded::was_reset);
        let status = ctx
            .answered
            .or_else(|| session.response_written().map(|r| r.status.as_u16()))
            .filter(|s| *s == 101 || (*s >= 200 && !reset_first))
            .unwrap_or(CLIENT_CLOSED);
        if status == CLIENT_CLOSED && ctx.failure.is_none() {
            ctx.failure = Some(Failure::CLIENT_CLOSED);
        }
        // A call its client cancelled (or let pass its deadline) before its end: `CANCELLED`,
        // as gRPC says it, unless a status came first (the upstream's own deadline's, say).
        if ctx.failure == Some(Failure::CLIENT_CLOSED)
            && ctx.grpc_status.is_none()
            && grpc::call_type(session.req_header()).is_some()
        {
            ctx.grpc_status = Some(grpc::code::CANCELLED);
        }
        if let Some(snapshot) = &ctx.snapshot {
            if snapshot.config.access_log.is_some() {
                access::log(&self.access_log, session, ctx, status);
            }
        }
        let Some(route) = &ctx.route else {
            if let Some(s) = &ctx.snapshot {
                s.unmatched.inc(status);
            }
            return;
        };
        let m = &route.endpoint.metrics;
        m.requests.inc(status);
        if let Some(code) = ctx.grpc_status {
            m.grpc.inc(code);
        }
        if ctx.exempt {
            m.exempt.inc();
        }
        if ctx.unlimited_tier {
            if let (Some(tier), Some(tiers)) = (&ctx.tier, &route.endpoint.tiers) {
                if let Some(counters) = tiers.decisions.get(tier) {
                    counters[1].inc();
                }
            }
        }
        if let Some(d) = ctx.decision {
            m.count_decision(d.reason(), d.allowed());
            m.decision_duration.observe(ctx.decision_time.as_secs_f64());
            if !d.reason().by_redis() {
                m.degraded.inc();
            }
            if d.cached() {
                m.overlimit_hits.inc();
            }
            let deciding = &ctx.deciding(route).metrics;
            if let Some(denials) = ctx.denied_by.and_then(|i| deciding.limit_denials.get(i)) {
                denials.inc();
            }
            if let (Some(tier), Some(tiers)) = (&ctx.tier, &route.endpoint.tiers) {
                if let Some(counters) = tiers.decisions.get(tier) {
                    counters[usize::from(d.allowed())].inc();
                }
            }
            if !d.allowed() && route.endpoint.policy.mode == Enforcement::Shadow {
                m.shadow_denials.inc();
            }
        }
        self.charged(ctx).await;
    }
}

/// What ended a request otherwise than with a whole answer, as the access log's `error` says
/// it: the status alone cannot (an upstream's `200` whose body its read timeout cut, a `499`
/// whose upstream had timed out first).
pub(crate) struct Failure;

impl Failure {
    /// The upstream did not answer in time (connect, read or write): a 504, or its answer's
    /// body cut short.
    const UPSTREAM_TIMEOUT: &'static str = "upstream_timeout";
    /// The upstream refused, reset or closed its connection: a 502, or its body cut short.
    const UPSTREAM_FAILED: &'static str = "upstream_failed";
    /// The client left or reset its stream: a 499, or the answer's body cut short.
    const CLIENT_CLOSED: &'static str = "client_closed";
    /// The client held back the body it announced (408).
    const CLIENT_TIMEOUT: &'static str = "client_timeout";
    /// The client sent what cannot be read (a broken body, say: 400).
    const CLIENT_ERROR: &'static str = "client_error";
    /// The request's body outgrew `max_body_bytes` after the upstream's answer began: that
    /// answer was cut (before it began, the 413 is a whole answer).
    const REQUEST_TOO_LARGE: &'static str = "request_too_large";
    /// The gateway failed itself (its own 500).
    const INTERNAL: &'static str = "internal";

    /// The failure `e` is, from what `fail_to_proxy` answers for it (`answer`; `answering`:
    /// no answer began yet); none for the gateway's own whole answers (a 413).
    fn of(e: &Error, answer: Option<Answer>, answering: bool) -> Option<&'static str> {
        match answer {
            Some(Answer::BodyTimeout) => Some(Self::CLIENT_TIMEOUT),
            Some(Answer::UpstreamTimeout) => Some(Self::UPSTREAM_TIMEOUT),
            Some(Answer::UpstreamUnavailable) => Some(Self::UPSTREAM_FAILED),
            Some(Answer::BadRequest) => Some(Self::CLIENT_ERROR),
            // The gateway's limit: a whole 413, or the upstream's answer cut for it.
            Some(Answer::BodyTooLarge) => (!answering).then_some(Self::REQUEST_TOO_LARGE),
            Some(_) => None,
            // No answer reaches a client that left; anything else is the gateway's own 500.
            None if matches!(e.esource(), ErrorSource::Downstream) => Some(Self::CLIENT_CLOSED),
            None => Some(Self::INTERNAL),
        }
    }
}

/// Sets `slot` to `value`, or says whether it holds it already: one value besides the
/// request's own.
fn only<T: PartialEq>(slot: &mut Option<T>, value: T) -> bool {
    match slot {
        Some(held) => *held == value,
        None => {
            *slot = Some(value);
            true
        }
    }
}

/// Whether a query may hold a `_method` parameter (Symfony, Laravel and Express read the
/// method from one): a name with `method` in it, or any percent-encoding.
fn query_may_name_a_method(query: &str) -> bool {
    query.contains("ethod") || query.contains('%')
}

/// The value of a query's pair when its name is `_method` as PHP and Node read names:
/// percent-decoded (`+` a space), leading spaces dropped, and (PHP) `.`, a space and `[`
/// read as `_`, so `.method`, `[method`, `+_method` and `_m%65thod` are `_method` too. The value
/// percent-decoded.
fn method_parameter(pair: &str) -> Option<String> {
    let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
    if !name.contains("ethod") && !name.contains('%') {
        return None;
    }
    let decoded = |text: &str| {
        let text = text.replace('+', " ");
        percent_encoding::percent_decode_str(&text)
            .decode_utf8_lossy()
            .into_owned()
    };
    let name = decoded(name);
    let name = name.trim_start_matches(' ');
    let folded = name.bytes().map(|b| match b {
        b'.' | b' ' | b'[' => b'_',
        b => b,
    });
    folded.eq(*b"_method").then(|| decoded(value))
}

#[cfg(test)]
mod tests {
    use super::charge_of;
    use crate::config::MAX_CAPACITY_MICRO;

    #[test]
    fn a_reported_cost_is_whole_units_and_can_empty_any_bucket_twice_over() {
        assert_eq!(charge_of(b" 3 ", 1_000_000), Some(3_000_000));
        assert_eq!(charge_of(b"0", 1_000_000), Some(0));
        for bad in [
            &b""[..],
            b"-1",
            b"+3",
            b"3.0",
            b"1e3",
            b"abc",
            b"1234567890123456789",
        ] {
            assert_eq!(charge_of(bad, 1_000_000), None, "{bad:?}");
        }
        // From full to minus the capacity is twice the capacity: the largest one too.
        assert_eq!(
            charge_of(b"2000000000", 1_000_000),
            Some(2 * MAX_CAPACITY_MICRO)
        );
        const { assert!(2 * MAX_CAPACITY_MICRO < 1 << 53, "exact in Lua's doubles") };
    }
}
