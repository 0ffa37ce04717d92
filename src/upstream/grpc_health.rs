//! gRPC's health check (`grpc.health.v1.Health/Check`, the Health Checking Protocol), for an
//! `http2` upstream whose `health_check` names `grpc_service`: what Envoy's gRPC health check
//! asks. A gRPC server answers nothing else a plain GET could ask (grpc-go answers 415), and
//! one that answers every path (tonic: 200 with `grpc-status: 12`) says nothing of its health
//! by it.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::connectors::http::Connector;
use pingora_core::protocols::http::client::HttpSession;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorType, Result};
use pingora_http::RequestHeader;
use pingora_load_balancing::health_check::HealthCheck;
use pingora_load_balancing::Backend;

/// The path of gRPC's health check.
pub const GRPC_HEALTH_PATH: &str = "/grpc.health.v1.Health/Check";

/// `HealthCheckResponse.status`'s `SERVING`.
const SERVING: u64 = 1;

pub struct GrpcHealthCheck {
    /// The peer of every check, its address replaced by the one checked.
    pub peer: HttpPeer,
    connector: Connector,
    /// The request's `Host` (its `:authority`).
    host: String,
    /// The `HealthCheckRequest` as one gRPC message.
    request: Bytes,
    timeout: Duration,
    pub unhealthy_after: usize,
    pub healthy_after: usize,
    /// How the address is named in the lines that say its changes of health.
    pub summary: Box<dyn Fn(&Backend) -> String + Send + Sync>,
}

impl GrpcHealthCheck {
    pub fn new(peer: HttpPeer, host: &str, service: &str, timeout: Duration) -> Self {
        Self {
            peer,
            connector: Connector::new(None),
            host: host.to_owned(),
            request: message(service),
            timeout,
            unhealthy_after: 1,
            healthy_after: 1,
            summary: Box::new(|b| format!("{b:?}")),
        }
    }

    async fn ask(&self, target: &Backend) -> Result<()> {
        let mut peer = self.peer.clone();
        peer._address = target.addr.clone();
        let (session, _) = self.connector.get_http_session(&peer).await?;
        let HttpSession::H2(mut h2) = session else {
            return failed("the upstream took gRPC's health check in HTTP/1.1");
        };
        let mut req = RequestHeader::build("POST", GRPC_HEALTH_PATH.as_bytes(), None)?;
        req.insert_header(http::header::HOST, self.host.as_str())?;
        req.insert_header(http::header::CONTENT_TYPE, "application/grpc")?;
        req.insert_header(http::header::TE, "trailers")?;
        h2.write_request_header(Box::new(req), false)?;
        h2.write_request_body(self.request.clone(), true).await?;
        h2.read_response_header().await?;
        let head = h2
            .response_header()
            .map(|h| (h.status, crate::proxy::grpc::status_in(&h.headers)));
        let (status, in_head) = head.unwrap_or_default();
        if status != http::StatusCode::OK {
            return failed(&format!("health check answered {status}"));
        }
        let mut body = Vec::new();
        while let Some(chunk) = h2.read_response_body().await? {
            body.extend_from_slice(&chunk);
        }
        let trailers = h2.read_trailers().await?;
        let code = in_head.or_else(|| trailers.as_ref().and_then(crate::proxy::grpc::status_in));
        match code {
            Some(0) => {}
            Some(code) => return failed(&format!("health check answered grpc-status {code}")),
            None => return failed("health check answered no grpc-status"),
        }
        match serving_status(&body) {
            Some(SERVING) => Ok(()),
            Some(other) => failed(&format!(
                "health check answered {}",
                match other {
                    2 => "NOT_SERVING",
                    3 => "SERVICE_UNKNOWN",
                    _ => "UNKNOWN",
                }
            )),
            None => failed("health check answered no HealthCheckResponse"),
        }
    }
}

fn failed<T>(why: &str) -> Result<T> {
    Error::e_explain(ErrorType::CustomCode("unhealthy", 0), why.to_owned())
}

/// `HealthCheckRequest { service }` as one uncompressed gRPC message: field 1, a string.
fn message(service: &str) -> Bytes {
    let mut proto = Vec::new();
    if !service.is_empty() {
        proto.push(0x0a);
        varint(&mut proto, service.len() as u64);
        proto.extend_from_slice(service.as_bytes());
    }
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(proto.len() as u32).to_be_bytes());
    framed.extend_from_slice(&proto);
    Bytes::from(framed)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// `HealthCheckResponse.status` (field 1, a varint) of the one message of `body`; `0`
/// (`UNKNOWN`) when the message leaves it out, as protobuf does for a default value.
fn serving_status(body: &[u8]) -> Option<u64> {
    let (&flag, rest) = body.split_first()?;
    let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let mut proto = rest.get(4..4 + len)?;
    if flag != 0 {
        return None;
    }
    let mut status = 0;
    while let Some((&tag, rest)) = proto.split_first() {
        proto = rest;
        let value = read_varint(&mut proto)?;
        match (tag >> 3, tag & 7) {
            (1, 0) => status = value,
            // Any other field: a varint was read; a length-delimited one is skipped.
            (_, 0) => {}
            (_, 2) => proto = proto.get(value as usize..)?,
            _ => return None,
        }
    }
    Some(status)
}

fn read_varint(bytes: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = bytes.split_first()?;
        *bytes = rest;
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

#[async_trait]
impl HealthCheck for GrpcHealthCheck {
    async fn check(&self, target: &Backend) -> Result<()> {
        match tokio::time::timeout(self.timeout, self.ask(target)).await {
            Ok(checked) => checked,
            Err(_) => Error::e_explain(ErrorType::ReadTimedout, "health check timed out"),
        }
    }

    fn backend_summary(&self, target: &Backend) -> String {
        (self.summary)(target)
    }

    fn health_threshold(&self, success: bool) -> usize {
        match success {
            true => self.healthy_after,
            false => self.unhealthy_after,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_names_its_service_and_the_answer_is_read_by_its_status() {
        assert_eq!(&message("")[..], [0, 0, 0, 0, 0]);
        assert_eq!(&message("ocr.v1.Ocr")[..5], [0, 0, 0, 0, 12]);
        assert_eq!(&message("ocr.v1.Ocr")[5..7], [0x0a, 10]);
        assert_eq!(serving_status(&[0, 0, 0, 0, 2, 0x08, 1]), Some(SERVING));
        assert_eq!(serving_status(&[0, 0, 0, 0, 2, 0x08, 2]), Some(2));
        // A default status is left out: UNKNOWN.
        assert_eq!(serving_status(&[0, 0, 0, 0, 0]), Some(0));
        // An unknown string field before the status is skipped.
        assert_eq!(
            serving_status(&[0, 0, 0, 0, 5, 0x12, 1, b'x', 0x08, 1]),
            Some(SERVING)
        );
        assert_eq!(serving_status(&[0, 0, 0]), None);
        assert_eq!(
            serving_status(&[1, 0, 0, 0, 2, 0x08, 1]),
            None,
            "compressed"
        );
    }
}
