//! A small backend for the demo, the tests and the benchmarks. It answers every request with
//! JSON describing what it received (method, path, query, headers, body size),
//! `/slow?ms=N` waits N milliseconds first, and a path ending in `/status/N` is answered
//! with status N (a backend whose health check fails, say). A request header `X-Demo-Reply-<Name>: <value>`
//! comes back as the answer's header `<Name>: <value>` (to play a backend that reports a
//! cost, such as `X-OCR-Pages`).
//!
//! Usage: `demo-upstream [ADDR] [NAME]` (default `127.0.0.1:9001`, name `demo`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

async fn handle(
    name: &'static str,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    if parts.uri.path() == "/slow" || parts.uri.path().ends_with("/slow") {
        let ms = parts
            .uri
            .query()
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("ms=")))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(1000);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let headers: serde_json::Map<String, serde_json::Value> = parts
        .headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into(),
            )
        })
        .collect();
    let answer = serde_json::json!({
        "upstream": name,
        "method": parts.method.as_str(),
        "path": parts.uri.path(),
        "query": parts.uri.query(),
        "headers": headers,
        "body_bytes": body.len(),
        "body": String::from_utf8_lossy(&body),
    });
    let mut resp = Response::new(Full::new(Bytes::from(answer.to_string())));
    if let Some(status) = (parts.uri.path().rsplit_once("/status/"))
        .and_then(|(_, n)| n.parse::<u16>().ok())
        .and_then(|n| hyper::StatusCode::from_u16(n).ok())
    {
        *resp.status_mut() = status;
    }
    resp.headers_mut()
        .insert("content-type", "application/json".parse().expect("valid"));
    resp.headers_mut().insert(
        "x-upstream",
        name.parse().expect("name is a valid header value"),
    );
    for (k, v) in &parts.headers {
        if let Some(reply) = k.as_str().strip_prefix("x-demo-reply-") {
            if let Ok(reply) = hyper::header::HeaderName::from_bytes(reply.as_bytes()) {
                resp.headers_mut().append(reply, v.clone());
            }
        }
    }
    Ok(resp)
}

const USAGE: &str = "usage: demo-upstream [ADDR] [NAME]   (default 127.0.0.1:9001, demo)\n\
answers every request with JSON describing it; /slow?ms=N waits N ms first; .../status/N is\n\
answered with status N; a request header\n\
X-Demo-Reply-<Name>: <value> comes back as the answer's header <Name>: <value>";

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1).peekable();
    if args
        .peek()
        .is_some_and(|a| matches!(a.as_str(), "-h" | "--help"))
    {
        println!("{USAGE}");
        return Ok(());
    }
    let addr: SocketAddr = args
        .next()
        .unwrap_or_else(|| "127.0.0.1:9001".to_owned())
        .parse()
        .map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("ADDR is not an IP:port ({e})\n{USAGE}"),
            )
        })?;
    let name: &'static str = Box::leak(
        args.next()
            .unwrap_or_else(|| "demo".to_owned())
            .into_boxed_str(),
    );
    let listener = TcpListener::bind(addr).await?;
    println!(
        "demo-upstream {name} listening on {}",
        listener.local_addr()?
    );
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(async move {
            let service = service_fn(move |req| handle(name, req));
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
