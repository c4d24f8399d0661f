//! The layer the way users run it: on axum routes served by `axum::serve` over real TCP,
//! every request on a connection of its own.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::StatusCode;
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
use support::RedisServer;
use support::http::{fetch, serve};
use tokio::sync::Barrier;

fn keys() -> KeySpace {
    KeySpace::builder()
        .env("test")
        .service("catalog")
        .secret(b"a test secret of more than sixteen bytes".to_vec())
        .build()
        .unwrap()
}

/// The README's shape: a guard, a layer with the route's policy, on an axum route. The
/// handler counts its calls and takes `delay`.
fn readme_app(guard: &StampedeGuard, calls: Arc<AtomicU64>, delay: Duration) -> Router {
    let items = guard
        .layer(
            Policy::builder("items")
                .fresh_ttl(Duration::from_secs(5))
                .grace(Duration::from_secs(60))
                .build()
                .unwrap(),
        )
        .unwrap();
    let handler = move || {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(delay).await;
            format!("item (call {n})")
        }
    };
    Router::new().route("/items/{id}", get(handler).layer(items))
}

/// 200 requests at once on a cold key, each on its own connection.
async fn cold_burst(addr: std::net::SocketAddr) -> Vec<support::web::Got> {
    let barrier = Arc::new(Barrier::new(200));
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            fetch(addr, "/items/1", &[]).await
        }));
    }
    support::web::all_within(tasks, Duration::from_secs(60), "the burst did not end").await
}

/// axum applies a route's layer again for every connection: the cold fill's
/// single-flight must still be one per process. Redis is down (killed), so only the
/// local single-flight stands between the burst and the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_readme_shape_fills_a_cold_key_once_with_redis_down() {
    let mut server = RedisServer::start();
    let url = server.url();
    server.kill();
    let store = RedisStore::builder(url).build().unwrap();
    let guard = StampedeGuard::builder(store, keys()).build().unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let addr = serve(readme_app(&guard, calls.clone(), Duration::from_secs(1))).await;

    let responses = cold_burst(addr).await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "handler calls");
    for got in &responses {
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(got.body, "item (call 1)");
    }
}

/// The same with Redis up and an origin slower than the cold wait of earlier defaults
/// (2 s): every connection's request joins the one fill of the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_readme_shape_fills_a_cold_key_once_with_redis_up_and_a_slow_origin() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().unwrap();
    let guard = StampedeGuard::builder(store, keys()).build().unwrap();
    guard.ready().await.unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let addr = serve(readme_app(&guard, calls.clone(), Duration::from_secs(3))).await;

    let responses = cold_burst(addr).await;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "handler calls");
    for got in &responses {
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(got.body, "item (call 1)");
    }
    // And the entry is shared: a new connection gets a hit.
    let again = fetch(addr, "/items/1", &[]).await;
    assert_eq!(
        (again.body.as_str(), again.x_cache()),
        ("item (call 1)", "hit")
    );
}

/// A gate the slow handler waits at, and a signal that it got there.
#[derive(Clone, Default)]
struct Gate {
    open: Arc<tokio::sync::Notify>,
    entered: Arc<tokio::sync::Notify>,
}

/// A `ConcurrencyLimit(1)` inside the guard: the origin takes one request at a time, the
/// guard is always ready. While a slow cold fill holds the origin's only slot (held at a
/// gate that opens only after), hits on another key are answered, each on its own
/// connection; a hit that waited for the origin's readiness would never come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_concurrency_limit_inside_the_guard_bounds_the_origin_not_the_hits() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().unwrap();
    let guard = StampedeGuard::builder(store, keys()).build().unwrap();
    guard.ready().await.unwrap();
    // The handler reads the path through axum's `Path`: the route forwards extensions.
    let items = guard
        .layer(
            Policy::builder("items")
                .forward_extensions(true)
                .build()
                .unwrap(),
        )
        .unwrap();
    let (gate, calls) = (Gate::default(), Arc::new(AtomicU64::new(0)));
    let handler = {
        let (gate, calls) = (gate.clone(), calls.clone());
        move |axum::extract::Path(id): axum::extract::Path<String>| {
            let (gate, calls) = (gate.clone(), calls.clone());
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                if id == "slow" {
                    let opened = gate.open.notified();
                    gate.entered.notify_one();
                    opened.await;
                } else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                format!("item {id}")
            }
        }
    };
    let app = Router::new().route(
        "/items/{id}",
        // The guard outside, the limit inside (next to the handler).
        get(handler).layer(
            tower::ServiceBuilder::new()
                .layer(items)
                .concurrency_limit(1),
        ),
    );
    let addr = serve(app).await;

    let first = fetch(addr, "/items/fast", &[]).await;
    assert_eq!(
        (first.body.as_str(), first.x_cache()),
        ("item fast", "miss")
    );
    let second = fetch(addr, "/items/fast", &[]).await;
    assert_eq!(
        (second.body.as_str(), second.x_cache()),
        ("item fast", "hit")
    );

    let entered = gate.entered.notified();
    let slow = tokio::spawn(async move { fetch(addr, "/items/slow", &[]).await });
    entered.await; // the origin's one slot is taken, until the gate opens
    let mut hits = Vec::new();
    for _ in 0..20 {
        hits.push(tokio::spawn(async move {
            fetch(addr, "/items/fast", &[]).await
        }));
    }
    let hits = support::web::all_within(
        hits,
        Duration::from_secs(20),
        "hits waited for the saturated origin",
    )
    .await;
    for got in hits {
        assert_eq!((got.body.as_str(), got.x_cache()), ("item fast", "hit"));
    }
    gate.open.notify_one();
    let slow = tokio::time::timeout(Duration::from_secs(20), slow)
        .await
        .expect("the slow fill was starved")
        .unwrap();
    assert_eq!((slow.body.as_str(), slow.x_cache()), ("item slow", "miss"));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
