//! The `stampede-sidecar` binary, black box: run as users run it, over real TCP, in front
//! of a real origin, on a real `redis-server`; one file per concept, the helpers they
//! share here (the ranges' tests are `tests/ranges.rs`).

#[path = "../support/mod.rs"]
mod support;

mod access_log;
mod headers;
mod http2;
mod life;
mod limits;
mod memory;
mod purge;
mod redis;
mod routes;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use http::{StatusCode, Uri};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::http::{fetch, fetch_from, post_json, serve};
use support::sidecar::{BIN, SECRET, Sidecar, run, text, wait_output, write_config};
use support::{HANG, Mode, Proxy, RedisServer, eventually, joined, within};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The origin: counts its calls, answers `<path> call <n>`; calls after `fast` wait for
/// `gate` to open.
#[derive(Clone)]
struct Origin {
    calls: Arc<AtomicU64>,
    fast: u64,
    gate: watch::Receiver<bool>,
}

async fn answer(State(origin): State<Origin>, uri: Uri) -> impl IntoResponse {
    let n = origin.calls.fetch_add(1, Ordering::SeqCst) + 1;
    if n > origin.fast {
        let _ = origin.gate.clone().wait_for(|open| *open).await;
    }
    // Under /max-age-60/, the origin says how long its answer is fresh, and tags it.
    let (cache_control, tags) = if uri.path().starts_with("/max-age-60/") {
        ("max-age=60", "all")
    } else {
        ("public", "")
    };
    (
        [
            (http::header::CACHE_CONTROL, cache_control),
            (http::HeaderName::from_static("surrogate-key"), tags),
        ],
        format!("{} call {n}", uri.path()),
    )
}

/// An origin on a free port whose first `fast` calls answer at once; the others wait for
/// the returned sender to send `true`.
async fn origin(fast: u64) -> (SocketAddr, Arc<AtomicU64>, watch::Sender<bool>) {
    let calls = Arc::new(AtomicU64::new(0));
    let (open, gate) = watch::channel(false);
    let app = Router::new().fallback(get(answer)).with_state(Origin {
        calls: calls.clone(),
        fast,
        gate,
    });
    (serve(app).await, calls, open)
}

/// An origin that keeps the headers of every request it gets and answers `body`,
/// fresh for a minute.
async fn recording_origin() -> (SocketAddr, Arc<Mutex<Vec<http::HeaderMap>>>) {
    let seen = Arc::new(Mutex::new(Vec::<http::HeaderMap>::new()));
    let app = Router::new().fallback({
        let seen = seen.clone();
        move |headers: http::HeaderMap| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(headers);
                ([("cache-control", "max-age=60")], "body")
            }
        }
    });
    (serve(app).await, seen)
}

/// Reads from `stream` until `want` has arrived or the stream ends; returns what came.
async fn read_until(stream: &mut TcpStream, want: &str) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(want) {
        match within(
            HANG,
            stream.read(&mut buf),
            format!("reading until {want:?}"),
        )
        .await
        {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Waits for `stream` to be closed by the sidecar (an end or a reset), and returns
/// when.
async fn closed(mut stream: TcpStream) -> Instant {
    let mut buf = [0u8; 64];
    loop {
        match within(HANG, stream.read(&mut buf), "a connection's close").await {
            Ok(0) | Err(_) => return Instant::now(),
            Ok(_) => {}
        }
    }
}

/// The value of the sidecar's counter `name` with the label `label` (`timeout="send"`),
/// 0 while it has none.
async fn counter(sidecar: &Sidecar, name: &str, label: &str) -> u64 {
    let metrics = fetch(
        sidecar.metrics.expect("a metrics listener"),
        "/metrics",
        &[],
    )
    .await;
    metrics
        .body
        .lines()
        .find(|l| l.starts_with(name) && l.contains(label))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}
