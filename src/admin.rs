//! The admin listener: `/metrics`, `/healthz`, `/readyz` and `/reload`, apart from the proxy.

use std::sync::Arc;

use async_trait::async_trait;
use http::{Method, Response, StatusCode};
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;

use crate::lifecycle::Lifecycle;
use crate::limiter::Limiter;
use crate::metrics::Metrics;
use crate::reload::Reloader;

pub struct Admin {
    pub metrics: Arc<Metrics>,
    pub lifecycle: Arc<Lifecycle>,
    pub limiter: Arc<Limiter>,
    pub reloader: Arc<Reloader>,
}

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Vec<u8>> {
    let body = body.into_bytes();
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("content-length", body.len())
        .body(body)
        .expect("static response parts are valid")
}

fn json(status: StatusCode, value: serde_json::Value) -> Response<Vec<u8>> {
    reply(status, "application/json", value.to_string())
}

impl Admin {
    fn readyz(&self) -> Response<Vec<u8>> {
        let ready = self.lifecycle.is_ready();
        let status = if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        json(
            status,
            serde_json::json!({
                "ready": ready,
                "redis": if self.limiter.store.is_connected() { "up" } else { "down" },
                "breaker": self.limiter.breaker.state().as_str(),
                "config_generation": self.reloader.live.load().generation,
            }),
        )
    }

    async fn reload(&self) -> Response<Vec<u8>> {
        let reloader = Arc::clone(&self.reloader);
        let result = tokio::task::spawn_blocking(move || reloader.reload())
            .await
            .unwrap_or_else(|e| Err(format!("reload task failed: {e}")));
        match result {
            Ok(generation) => json(
                StatusCode::OK,
                serde_json::json!({"reloaded": true, "config_generation": generation}),
            ),
            Err(error) => json(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"reloaded": false, "error": error}),
            ),
        }
    }
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        let req = session.req_header();
        let method = req.method.clone();
        let path = req.uri.path().to_owned();
        match (method, path.as_str()) {
            (Method::GET, "/metrics") => reply(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                self.metrics.render(),
            ),
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
}
