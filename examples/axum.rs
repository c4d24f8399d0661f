//! An axum service with two guarded routes, each with its own policy.
//!
//! ```text
//! cargo run --example axum        # REDIS_URL (default redis://127.0.0.1:6379), PORT (3000)
//! curl -si localhost:3000/items/1 | grep -i -e x-cache -e age
//! curl -si localhost:3000/report  | grep -i -e x-cache -e age   # slow: 500 ms when filled
//! ```
//!
//! `/items/{id}` is fresh for 2 s and may be served stale for 30 s more; `/report` is slow
//! to compute, fresh for 5 s, served stale for a minute, and a caller with nothing to
//! serve waits at most 1 s for another instance's fill, then gets a 503. Run it twice (on
//! two ports) against one Redis to see two instances share entries and leases. It shuts
//! down gracefully on SIGTERM or Ctrl-C, and waits for its refreshes (`drained`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::routing::get;
use stampede_guard::{ColdMiss, KeySpace, Policy, RedisStore, StampedeGuard};

#[derive(Clone, Default)]
struct Origin {
    calls: Arc<AtomicU64>,
}

async fn item(Path(id): Path<u64>, State(origin): State<Origin>) -> String {
    let n = origin.calls.fetch_add(1, Ordering::Relaxed) + 1;
    format!("item {id} (origin call {n})\n")
}

async fn report(State(origin): State<Origin>) -> String {
    tokio::time::sleep(Duration::from_millis(500)).await; // an expensive query
    let n = origin.calls.fetch_add(1, Ordering::Relaxed) + 1;
    format!("report (origin call {n})\n")
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let port: u16 = std::env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(3000);

    let keys = KeySpace::builder()
        .env("local")
        .service("example-axum")
        // In production: from your secret store, the same on every instance.
        .secret(b"example secret, sixteen bytes or more".to_vec())
        .build()?;
    let store = RedisStore::builder(url.as_str()).build()?;
    let guard = StampedeGuard::builder(store, keys).build()?;
    if let Err(error) = guard.ready().await {
        println!("Redis at {url} does not answer ({error}): running on the local cache only.");
    }

    // Both routes serve the same content whatever the Host: two instances on two local
    // ports (two different Host headers) then share entries, as they would behind one
    // public name.
    let items = guard.layer(
        Policy::builder("items")
            .fresh_ttl(Duration::from_secs(2))
            .grace(Duration::from_secs(30))
            .key_host(false)
            // `item` extracts `Path`: axum keeps path parameters in request extensions,
            // which fills carry as the handler would see them without the guard.
            .build()?,
    )?;
    let reports = guard.layer(
        Policy::builder("report")
            .fresh_ttl(Duration::from_secs(5))
            .grace(Duration::from_secs(60))
            .refresh_timeout(Duration::from_secs(3))
            .cold_wait(Duration::from_secs(1))
            .cold_miss(ColdMiss::Reject {
                retry_after: Duration::from_secs(1),
            })
            .key_host(false)
            .build()?,
    )?;

    let app = Router::new()
        .route("/items/{id}", get(item).layer(items))
        .route("/report", get(report).layer(reports))
        .with_state(Origin::default());

    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    println!("listening on http://{addr}: try `curl -si http://{addr}/items/1`");
    // On SIGTERM (what a container runtime or Kubernetes sends first) or Ctrl-C: stop
    // taking connections, answer the requests in flight, then let the refreshes and
    // fills at work end, their entries written, before the runtime goes.
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown())
        .await?;
    if !guard.drained(Duration::from_secs(10)).await {
        eprintln!("refreshes still at work after 10 s: stopped with them");
    }
    Ok(())
}

/// Resolves on Ctrl-C, or on SIGTERM.
async fn shutdown() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                terminate.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}
