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

/// Keeps one subscription up for as long as the guard lives; reconnects with backoff.
pub(crate) async fn listen(shared: Weak<Shared>, subscribed: watch::Sender<bool>) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let (store, channel) = match shared.upgrade() {
            Some(s) => (s.store.clone(), s.channel.clone()),
            None => return,
        };
        if let Ok(mut pubsub) = store.pubsub(store.connect_timeout()).await {
            let subscribe =
                tokio::time::timeout(store.connect_timeout(), pubsub.subscribe(&channel)).await;
            if let Ok(Ok(())) = subscribe {
                backoff = Duration::from_millis(50);
                subscribed.send_replace(true);
                let mut messages = pubsub.into_on_message();
                while let Some(message) = messages.next().await {
                    let Some(shared) = shared.upgrade() else {
                        return;
                    };
                    match parse_notice(message.get_payload_bytes()) {
                        Some((Notice::Filled, key)) => {
                            shared.waiters.wake(key);
                            shared.filled_elsewhere(key);
                        }
                        Some((Notice::Invalidated, key)) => {
                            shared.l1.invalidate(key).await;
                            shared.waiters.wake(key);
                        }
                        None => {}
                    }
                }
                subscribed.send_replace(false);
                tracing::warn!("stampede-guard lost its notice subscription; reconnecting");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}
