//! Test support: real Redis servers and a fault-injecting proxy. No stand-in of Redis.

#![allow(dead_code, unused_imports)] // each test or bench binary uses a part of it

pub(crate) mod app;
pub(crate) mod backend;
pub(crate) mod chunked;
pub(crate) mod cluster;
pub(crate) mod http;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
pub(crate) mod proxy;
pub(crate) mod sentinel;
pub(crate) mod server;
#[cfg(feature = "sidecar")]
pub(crate) mod sidecar;
pub(crate) mod tls;
pub(crate) mod web;

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

pub(crate) use self::backend::{Redis, Store};
pub(crate) use self::cluster::RedisCluster;
pub(crate) use self::proxy::{Mode, Proxy};
pub(crate) use self::server::RedisServer;
pub(crate) use self::tls::TlsServer;

/// The command timeout of the tests' stores: far past what a command takes, on a
/// machine whose cores other tests load.
pub(crate) const TIMEOUT: Duration = Duration::from_millis(250);

/// How long one request, one spawned task or one origin start may take before a test
/// calls it a hang: far past anything a test waits for on purpose, so that only a hang
/// (or a machine stalled for that long) reaches it.
pub(crate) const HANG: Duration = Duration::from_secs(30);

/// Awaits `future` for at most `limit`, and panics naming `what` if it has not ended by
/// then: a hang fails the test that hung, saying what hung, instead of hanging the whole
/// binary.
pub(crate) async fn within<F: Future>(limit: Duration, future: F, what: impl Display) -> F::Output {
    match tokio::time::timeout(limit, future).await {
        Ok(output) => output,
        Err(_) => panic!("hung: {what} (not done within {limit:?})"),
    }
}

/// Awaits a spawned task, at most `limit`; panics naming `what` if it is not done by
/// then, and with the task's own panic if it panicked.
pub(crate) async fn joined<T>(
    task: tokio::task::JoinHandle<T>,
    limit: Duration,
    what: impl Display,
) -> T {
    match within(limit, task, what).await {
        Ok(output) => output,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(error) => panic!("{error}"),
    }
}

/// Polls `check` until it holds or `within` has passed; returns whether it held. A check
/// that itself hangs (past the deadline, and at least 5 s) panics.
pub(crate) async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if self::within(
            left.max(Duration::from_secs(5)),
            check(),
            "a check polled by `eventually`",
        )
        .await
        {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
