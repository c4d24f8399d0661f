//! Test support: real Redis servers and a fault-injecting proxy. No stand-in of Redis.

#![allow(dead_code, unused_imports)] // each test or bench binary uses a part of it

pub(crate) mod http;
pub(crate) mod proxy;
pub(crate) mod server;
pub(crate) mod web;

use std::time::{Duration, Instant};

pub(crate) use self::proxy::{Mode, Proxy};
pub(crate) use self::server::RedisServer;

/// Polls `check` until it holds or `within` has passed; returns whether it held.
pub(crate) async fn eventually<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
