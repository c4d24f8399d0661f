//! A bare hyper `service_fn`, wrapped by the layer.
//!
//! ```text
//! cargo run --example hyper       # REDIS_URL (default redis://127.0.0.1:6379), PORT (3001)
//! curl -si localhost:3001/hello | grep -i x-cache
//! ```
//!
//! The layer rebuilds requests for refreshes, so the request body type must have a
//! default: hyper's `Incoming` is mapped to a `BoxBody` in front of the layer.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
use tower::ServiceBuilder;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let port: u16 = std::env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(3001);

    let keys = KeySpace::builder()
        .env("local")
        .service("example-hyper")
        .secret(b"example secret, sixteen bytes or more".to_vec())
        .build()?;
    let guard = StampedeGuard::builder(RedisStore::builder(url.as_str()).build()?, keys).build()?;
    if let Err(error) = guard.ready().await {
        println!("Redis at {url} does not answer ({error}): running on the local cache only.");
    }
    let layer = guard.layer(
        Policy::builder("hello")
            .fresh_ttl(Duration::from_secs(3))
            .grace(Duration::from_secs(30))
            .build()?,
    )?;

    let calls = Arc::new(AtomicU64::new(0));
    let origin = tower::service_fn(move |request: Request<BoxBody<Bytes, hyper::Error>>| {
        let calls = calls.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let n = calls.fetch_add(1, Ordering::Relaxed) + 1;
            let body = format!("hello from {} (origin call {n})\n", request.uri().path());
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
        }
    });
    let service = ServiceBuilder::new()
        .map_request(|request: Request<Incoming>| request.map(BodyExt::boxed))
        .layer(layer)
        .service(origin);

    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on http://{addr}: try `curl -si http://{addr}/hello`");
    loop {
        let (stream, _) = listener.accept().await?;
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            if let Err(error) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                eprintln!("connection: {error}");
            }
        });
    }
}
