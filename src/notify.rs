//! Instances telling each other about fills and invalidations, over Redis pub/sub.
//!
//! Every fenced write publishes `f {entry key}` and every invalidation `i {entry key}` on
//! the key space's channel (inside the same Lua script, so a notice is sent exactly when
//! the write happened). Each guard keeps one subscription: a fill notice wakes the
//! callers of this process that wait for that entry; an invalidation drops it from L1.
//!
//! A lost notice costs time, never correctness: a waiter that is not woken reads Redis
//! when its cold wait ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;

use crate::cache::{Notice, parse_notice};
use crate::guard::Shared;

/// Callers waiting for an entry to be filled elsewhere.
#[derive(Default)]
pub(crate) struct Waiters {
    map: Mutex<HashMap<Arc<str>, watch::Sender<()>>>,
}

/// One caller's wait; dropping it unregisters.
pub(crate) struct Wait {
    rx: watch::Receiver<()>,
    key: Arc<str>,
    waiters: Arc<Waiters>,
}

impl Waiters {
    /// Registers a wait for `key`. Register before asking Redis whether the entry is
    /// there: a notice sent in between is then not missed.
    pub(crate) fn register(self: &Arc<Self>, key: Arc<str>) -> Wait {
        let mut map = self.map.lock().expect("waiters lock");
        let rx = map
            .entry(key.clone())
            .or_insert_with(|| watch::channel(()).0)
            .subscribe();
        Wait {
            rx,
            key,
            waiters: self.clone(),
        }
    }

    pub(crate) fn wake(&self, key: &str) {
        if let Some(tx) = self.map.lock().expect("waiters lock").get(key) {
            tx.send_replace(());
        }
    }
}

impl Wait {
    /// Whether a notice for the key came since registration (or the last wait).
    pub(crate) fn has_notice(&self) -> bool {
        self.rx.has_changed().unwrap_or(false)
    }

    /// Resolves at the next notice for the key after registration (or the previous
    /// call).
    pub(crate) async fn notified(&mut self) {
        if self.rx.changed().await.is_err() {
            // The sender is gone only with the map entry, which this wait keeps alive.
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        let mut map = self.waiters.map.lock().expect("waiters lock");
        // This wait's own receiver is still counted.
        if map
            .get(&self.key)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            map.remove(&self.key);
        }
    }
}

/// How often the subscription is checked with a `PING`: a connection to a stalled
/// server stays open and silent, and would otherwise look subscribed forever.
const PING_EVERY: Duration = Duration::from_secs(1);

/// Keeps one subscription up for as long as the guard lives; reconnects with backoff.
///
/// Notices published while this instance is not subscribed are lost to it: entries
/// invalidated then stay in its L1 until they expire.
pub(crate) async fn listen(shared: Weak<Shared>, subscribed: watch::Sender<bool>) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let (store, channel) = match shared.upgrade() {
            Some(s) => (s.store.clone(), s.channel.clone()),
            None => return,
        };
        if store.is_local_only() {
            return; // nobody to hear, nobody to tell
        }
        let timeout = store.connect_timeout();
        if let Ok(mut pubsub) = store.pubsub(timeout).await
            && let Ok(Ok(())) = tokio::time::timeout(timeout, pubsub.subscribe(&channel)).await
        {
            drop(store);
            subscribed.send_replace(true);
            let (mut sink, mut messages) = pubsub.split();
            let mut ping = tokio::time::interval(PING_EVERY);
            ping.tick().await;
            loop {
                tokio::select! {
                    message = messages.next() => {
                        let Some(message) = message else { break };
                        let Some(shared) = shared.upgrade() else { return };
                        handle(&shared, message.get_payload_bytes()).await;
                    }
                    _ = ping.tick() => {
                        let Some(alive) = shared.upgrade() else { return };
                        // A second's tick is as good a time as any to report L1.
                        metrics::gauge!(crate::metrics::L1_ENTRIES).set(alive.l1.entry_count() as f64);
                        metrics::gauge!(crate::metrics::L1_BYTES).set(alive.l1.weighted_size() as f64);
                        drop(alive);
                        let pong = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
                        if !matches!(pong, Ok(Ok(_))) {
                            break;
                        }
                        // Healthy for a ping: only now is a reconnect quick again (a
                        // server that takes SUBSCRIBE and drops us is not retried at 20/s).
                        backoff = Duration::from_millis(50);
                    }
                }
            }
            subscribed.send_replace(false);
            tracing::warn!("stampede-guard lost its notice subscription; reconnecting");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

async fn handle(shared: &Shared, payload: &[u8]) {
    match parse_notice(payload) {
        Some((Notice::Filled, key, _)) => {
            shared.waiters.wake(key);
            shared.filled_elsewhere(key);
        }
        Some((Notice::Invalidated, key, token)) => {
            if let Some(token) = token {
                shared.tombstones.insert(key.into(), token);
            }
            shared.l1.invalidate(key);
            shared.waiters.wake(key);
        }
        None => {}
    }
}
