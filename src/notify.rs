//! Instances telling each other about fills and invalidations, over Redis pub/sub.
//!
//! Every fenced write publishes a fill notice and every invalidation an invalidation
//! notice on the key space's channel (inside the same Lua script, so a notice is sent
//! exactly when the write happened); a fill whose lease ends without a write says so,
//! and so does a route that learned a `Vary` header. The wire format is
//! [`Notice`]'s. Each guard keeps one subscription:
//!
//! * a fill notice wakes the callers of this process that wait for that entry;
//! * an invalidation drops the entry from L1 and leaves a tombstone;
//! * a fill that ended without a write marks the key (pass it through, or serve stale
//!   at once: see `guard::marks`) and wakes its waiters, who then look again instead of
//!   waiting out their cold wait;
//! * a learned `Vary` teaches the route of this process the same header names.
//!
//! A lost notice costs time, never correctness: a waiter that is not woken reads Redis
//! when its cold wait ends. When the subscription is lost and comes back, invalidations
//! sent meanwhile are lost with it: every entry L1 held then is no longer served as
//! fresh, but as stale while a refresh reads it again from Redis.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;

use crate::cache::{Ending, Notice};
use crate::guard::Shared;
use crate::guard::marks::Mark;

/// Callers waiting for an entry to be filled elsewhere.
#[derive(Default)]
pub(crate) struct Waiters {
    /// Per key, the channel its waits listen on and how many waits there are: counted
    /// here, under the lock, and not read off the channel's receivers, which are
    /// dropped after the lock is let go.
    map: Mutex<HashMap<Arc<str>, (watch::Sender<()>, usize)>>,
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
        let (tx, waits) = map
            .entry(key.clone())
            .or_insert_with(|| (watch::channel(()).0, 0));
        *waits += 1;
        Wait {
            rx: tx.subscribe(),
            key,
            waiters: self.clone(),
        }
    }

    pub(crate) fn wake(&self, key: &str) {
        if let Some((tx, _)) = self.map.lock().expect("waiters lock").get(key) {
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
        if let Some((_, waits)) = map.get_mut(&self.key) {
            *waits -= 1;
            if *waits == 0 {
                map.remove(&self.key);
            }
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
            // Invalidations sent while this instance was not subscribed (or before it
            // first was) did not reach it: what L1 holds may be invalidated. A new epoch
            // makes those entries stale: served while a refresh reads Redis again.
            if let Some(shared) = shared.upgrade() {
                shared
                    .epoch
                    .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            }
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
    match Notice::parse(payload) {
        Some(Notice::Filled(key)) => {
            shared.marks.clear(key);
            shared.waiters.wake(key);
            shared.filled_elsewhere(key);
        }
        Some(Notice::Invalidated(key, token)) => {
            shared
                .tombstones
                .insert(crate::keys::primary_of(key).into(), token);
            crate::cache::l1_invalidate_response(&shared.l1, crate::keys::primary_of(key));
            shared.waiters.wake(key);
        }
        Some(Notice::Ended(key, ending, lasting)) => {
            match ending {
                Ending::Pass => shared.marks.set(key, Mark::Pass, lasting),
                Ending::Error => shared.marks.set(key, Mark::BackOff, lasting),
                Ending::Gone => {}
            }
            shared.waiters.wake(key);
        }
        Some(Notice::Learned(route, names)) => {
            if let Some(learned) = shared.learned(route) {
                let names: Vec<http::HeaderName> = names
                    .iter()
                    .filter_map(|n| http::HeaderName::from_bytes(n.as_bytes()).ok())
                    .collect();
                let _ = learned.learn(&names);
            }
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two waits of one key dropped at once, over and over: after each round the key
    /// is gone from the map (a key left with no receiver would never be removed).
    #[test]
    fn the_map_keeps_no_key_without_a_wait() {
        const ROUNDS: usize = 5_000;
        let waiters = Arc::new(Waiters::default());
        let key: Arc<str> = Arc::from("k");
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let leaks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let threads: Vec<_> = (0..2)
            .map(|me| {
                let (waiters, key) = (waiters.clone(), key.clone());
                let (barrier, leaks) = (barrier.clone(), leaks.clone());
                std::thread::spawn(move || {
                    for _ in 0..ROUNDS {
                        let wait = waiters.register(key.clone());
                        barrier.wait();
                        drop(wait);
                        barrier.wait();
                        if me == 0 && !waiters.map.lock().unwrap().is_empty() {
                            leaks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            waiters.map.lock().unwrap().clear();
                        }
                        barrier.wait();
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        assert_eq!(
            leaks.load(std::sync::atomic::Ordering::Relaxed),
            0,
            "rounds that leaked"
        );
    }
}
