//! SIGTERM and SIGINT: the drain, and what it waits for.
//!
//! On the first signal the sidecar stops accepting connections and `/readyz` answers
//! 503; requests in flight finish, then the guard's refreshes and fills (which run in
//! tasks of their own, and write to Redis when their origin call ends), all within the
//! drain timeout. A second signal ends the drain at once.

use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;

/// Whether the drain has started, for whoever asks.
#[derive(Clone, Debug)]
pub(crate) struct Shutdown {
    draining: watch::Sender<bool>,
}

impl Shutdown {
    pub(crate) fn new() -> Self {
        Self {
            draining: watch::Sender::new(false),
        }
    }

    pub(crate) fn start_draining(&self) {
        self.draining.send_replace(true);
    }

    pub(crate) fn is_draining(&self) -> bool {
        *self.draining.borrow()
    }

    /// Ends when the drain starts.
    pub(crate) fn started(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut draining = self.draining.subscribe();
        async move {
            let _ = draining.wait_for(|d| *d).await;
        }
    }
}

/// The process's termination signals, listened for from startup (so that none is missed
/// while the sidecar starts).
#[derive(Debug)]
pub(crate) struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    pub(crate) fn listen() -> std::io::Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// The next SIGTERM or SIGINT, by name.
    pub(crate) async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}
