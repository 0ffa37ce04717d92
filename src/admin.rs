//! The admin listener: `/metrics`, `/healthz`, `/readyz` and `/reload`, apart from the proxy.
//!
//! It runs on the gateway's control runtime, not as a Pingora service, so that it keeps
//! answering (`/readyz` 503) while Pingora's listeners drain on SIGTERM.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};

use crate::lifecycle::Lifecycle;
use crate::metrics::Metrics;
use crate::reload::Reloader;
use crate::store::Store;

pub struct Admin {
    pub metrics: Arc<Metrics>,
    pub lifecycle: Arc<Lifecycle>,
    pub store: Store,
    pub reloader: Arc<Reloader>,
}

type AdminResponse = Response<Full<Bytes>>;

fn reply(status: StatusCode, content_type: &str, body: String) -> AdminResponse {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

fn json(status: StatusCode, value: serde_json::Value) -> AdminResponse {
    reply(status, "application/json", value.to_string())
}

impl Admin {
    /// Serves admin requests on `listener` until the process exits.
    pub async fn serve(self: Arc<Self>, listener: std::net::TcpListener) {
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
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let admin = Arc::clone(&self);
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let admin = Arc::clone(&admin);
                    async move { Ok::<_, Infallible>(admin.route(req).await) }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    }

    /// With `admin_token_env`, every request but the probes needs `Authorization: Bearer
    /// <token>`; the comparison is of hashes, so its time says nothing about the token.
    fn authorized(&self, req: &Request<Incoming>) -> bool {
        if matches!(req.uri().path(), "/healthz" | "/readyz") {
            return true;
        }
        let snapshot = self.reloader.live.load();
        let Some(token) = &snapshot.config.server.admin_token else {
            return true;
        };
        let mut values = req.headers().get_all(http::header::AUTHORIZATION).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            return false;
        };
        let presented = value
            .as_bytes()
            .strip_prefix(b"Bearer ")
            .or_else(|| value.as_bytes().strip_prefix(b"bearer "))
            .unwrap_or_default();
        Sha256::digest(presented) == Sha256::digest(&token.0)
    }

    async fn route(&self, req: Request<Incoming>) -> AdminResponse {
        if !self.authorized(&req) {
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
        match (req.method().clone(), req.uri().path()) {
            (Method::GET, "/metrics") => {
                self.metrics
                    .in_flight
                    .set(self.lifecycle.in_flight() as i64);
                for n in self.store.nodes() {
                    self.metrics.redis_node(&n.node, Some(n.connected));
                }
                reply(
                    StatusCode::OK,
                    "text/plain; version=0.0.4",
                    self.metrics.render(),
                )
            }
            (Method::GET, "/healthz") => json(StatusCode::OK, serde_json::json!({"status": "ok"})),
            (Method::GET, "/readyz") => self.readyz(),
            (Method::POST, "/reload") => self.reload().await,
            (_, "/metrics" | "/healthz" | "/readyz" | "/reload") => json(
                StatusCode::METHOD_NOT_ALLOWED,
                serde_json::json!({"detail": "method not allowed"}),
            ),
            _ => json(
                StatusCode::NOT_FOUND,
                serde_json::json!({"detail": "not found"}),
            ),
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
        let mut body = serde_json::json!({
            "ready": ready,
            "redis": if store.is_connected() { "up" } else { "down" },
            "breaker": store.breaker_state().as_str(),
            "config_generation": self.reloader.live.load().generation,
            "redis_maxmemory_policy": store.eviction_policy(),
        });
        let nodes = store.nodes();
        if !nodes.is_empty() {
            body["redis_nodes"] = nodes
                .iter()
                .map(|n| {
                    serde_json::json!({
                        "node": n.node,
                        "redis": if n.connected { "up" } else { "down" },
                        "breaker": n.breaker.as_str(),
                    })
                })
                .collect();
        }
        json(status, body)
    }

    async fn reload(&self) -> AdminResponse {
        match self.reloader.reload_off_thread().await {
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
