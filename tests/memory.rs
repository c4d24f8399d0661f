//! L1 holds what it is configured to hold, measured as the process's real memory.
//!
//! Many small entries are filled through a real hyper client (as the sidecar does): a
//! client's header values are slices of its read buffer, and an entry that keeps one
//! keeps the whole buffer alive. Each entry is read again right after its fill: a hit,
//! answered by L1's front, which holds a second pointer to every entry and must let go
//! of those L1 evicts. The process's resident memory may grow by at most the configured
//! L1 capacity plus 25 %.
//!
//! One test in this file: it measures the whole process.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::server::conn::http1;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use stampede_guard::metrics::Event;
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
use tower::{Layer, ServiceExt};

const CAPACITY: u64 = 16 * 1024 * 1024;
/// Enough small entries to fill L1 about three times over.
const ENTRIES: u64 = 60_000;

/// The process's resident memory, in bytes.
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// An origin on real TCP: 14-byte bodies with the headers a real one sends.
async fn origin() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(|request: Request<hyper::body::Incoming>| {
                        let path = request.uri().path().to_owned();
                        async move {
                            let response = Response::builder()
                                .header("content-type", "text/plain; charset=utf-8")
                                .header("cache-control", "public, max-age=60")
                                .header("x-request-path", path)
                                .header("x-served-by", "origin-7f8c9d")
                                .body(Full::new(Bytes::from_static(b"small response")))
                                .unwrap();
                            Ok::<_, Infallible>(response)
                        }
                    });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

type Body = BoxBody<Bytes, hyper::Error>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_memory_stays_within_its_capacity_for_entries_filled_through_a_hyper_client() {
    let origin = origin().await;
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let upstream = tower::service_fn(move |request: Request<Empty<Bytes>>| {
        let client = client.clone();
        async move {
            let uri = format!("http://{origin}{}", request.uri().path());
            let (mut parts, body) = request.into_parts();
            parts.uri = uri.parse().unwrap();
            let response = client
                .request(Request::from_parts(parts, body))
                .await
                .unwrap();
            Ok::<_, Infallible>(response.map(|b| -> Body { b.boxed() }))
        }
    });
    let keys = KeySpace::builder()
        .env("test")
        .service("memory")
        .secret(b"a test secret of more than sixteen bytes".to_vec())
        .build()
        .unwrap();
    let guard = StampedeGuard::builder(RedisStore::local_only(), keys)
        .l1_capacity(CAPACITY)
        .build()
        .unwrap();
    let layer = guard
        .layer(
            Policy::builder("items")
                .fresh_ttl(Duration::from_secs(600))
                .build()
                .unwrap(),
        )
        .unwrap();
    let service = layer.layer(upstream);
    let fill = |from: u64, to: u64| {
        let service = service.clone();
        async move {
            let workers: Vec<_> = (0..16)
                .map(|w| {
                    let service = service.clone();
                    tokio::spawn(async move {
                        for n in (from + w..to).step_by(16) {
                            // The fill, then a hit (unless L1 did not keep the entry).
                            for _ in 0..2 {
                                let request = Request::get(format!("/items/{n}"))
                                    .header("host", "shop.example")
                                    .body(Empty::<Bytes>::new())
                                    .unwrap();
                                let response = service.clone().oneshot(request).await.unwrap();
                                let body = response.into_body().collect().await.unwrap();
                                assert_eq!(body.to_bytes().len(), 14);
                            }
                        }
                    })
                })
                .collect();
            let what = format!("filling entries {from} to {to}");
            support::web::all_within(workers, Duration::from_secs(120), &what).await;
        }
    };
    // Warm the runtime, the client's pool and the allocator with a few entries.
    fill(0, 2_000).await;
    let before = resident();
    fill(2_000, ENTRIES).await;
    let after = resident();
    let grown = after.saturating_sub(before);
    let bound = CAPACITY + CAPACITY / 4;
    eprintln!(
        "{ENTRIES} entries: L1 holds {} entries weighing {} bytes (capacity {CAPACITY}); \
         the process grew by {grown} bytes ({:.2}x the capacity; bound {bound})",
        guard.l1_entries(),
        guard.l1_bytes(),
        grown as f64 / CAPACITY as f64,
    );
    assert!(
        guard.l1_bytes() <= CAPACITY,
        "L1 weighs more than its capacity"
    );
    assert!(
        guard.l1_entries() < ENTRIES / 2,
        "L1 did not have to evict: the test proves nothing"
    );
    let hits = layer.stats().get(Event::Hit);
    assert!(
        hits >= ENTRIES / 2,
        "{hits} hits: too few entries were read back from L1"
    );
    assert!(
        grown <= bound,
        "the process grew by {grown} bytes, bound {bound}"
    );
    drop(Arc::new(()));
}
