//! What a request carries between the listener, the access log and the origin's
//! client: the peer's address, whether it came over TLS, why its body stopped, and how
//! long the origin took.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The connection a request came on, as a request extension (a fill made for another
/// caller carries that caller's).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Peer {
    pub(crate) addr: SocketAddr,
    /// Whether the sidecar terminated TLS for it (`X-Forwarded-Proto: https`).
    pub(crate) tls: bool,
}

/// A request body that did not arrive within `--request-body-timeout`: the error its
/// body ends with, which the origin's client passes on, and which is answered 408.
#[derive(Debug)]
pub(crate) struct RequestBodyTimeout;

impl fmt::Display for RequestBodyTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the request body did not arrive in time")
    }
}

impl std::error::Error for RequestBodyTimeout {}

/// How long the origin took to send its response headers for a request, when the
/// request called it: a slot the access log puts in the request's extensions and the
/// origin's client fills (a fill made for the request carries it too).
#[derive(Clone, Debug, Default)]
pub(crate) struct OriginTime(Arc<AtomicU64>);

impl OriginTime {
    pub(crate) fn set(&self, took: Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX - 1);
        // 0 means "not called".
        self.0.store(nanos.saturating_add(1), Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> Option<Duration> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            n => Some(Duration::from_nanos(n - 1)),
        }
    }
}
