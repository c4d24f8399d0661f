//! What the listener knows of a request's client, for the origin: the peer's address,
//! whether it came over TLS, and why its body stopped.

use std::fmt;
use std::net::SocketAddr;

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
