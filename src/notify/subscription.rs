//! The subscription: one connection per guard, pinged, reconnected with backoff; the
//! buckets of interest subscribed and let go on it; the callers waiting for a key;
//! notices delivered to the guard (see the module docs of `notify`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::interest::{Interest, Interests, bucket_of, channel_of};
use super::message::{Ending, Notice};
use super::purge_records::{Purge, ReadBack, Recorded};
use crate::keys::LocalKey;
use crate::lease::FencingToken;
use crate::store::{Operation, RedisStore, Request, StoreError};

/// What the guard does with what it hears. Called from the subscription's task.
pub(crate) trait Hears: Send + Sync + 'static {
    /// Another instance (or this one) wrote the entry at `key` (`local` in L1; `None`
    /// from a version that did not name it).
    fn filled(&self, key: &str, local: Option<LocalKey>);
    /// The response at `key` (`local` in L1; `None` from a version that did not name
    /// it) was invalidated, with its tombstone's token. Every variant of it goes: the
    /// hearer knows whether it keeps variants, the sender may not.
    fn invalidated(&self, local: Option<LocalKey>, token: FencingToken);
    /// A fill's lease ended without a write, and what to make of the key for `lasting`.
    fn ended(&self, key: &str, ending: Ending, lasting: Duration);
    /// A URL of route `route` (the response with local key `response`) learned that its
    /// responses vary on `names`.
    fn learned(&self, route: &str, response: u128, names: &[&str]);
    /// Tags (by id) were purged, at `at` µs of the Redis server's clock.
    fn purged(&self, how: Purge, at: u64, ids: &[&str]);
    /// The subscription came up (again): notices sent before may have been missed, and
    /// the purges recorded meanwhile are owed. Returns what to read back.
    fn subscribed(&self) -> Owed;
    /// A batch of the purges recorded in Redis, read back.
    fn purges_recorded(&self, records: &[Recorded]);
    /// Every purge recorded was read back, for the read-back `episode` (an older one
    /// settles nothing).
    fn purges_caught_up(&self, episode: u64);
    /// Once a second while subscribed (for reporting gauges).
    fn tick(&self);
}

/// A read-back owed: the records scored from `since` µs on, for `episode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owed {
    pub(crate) episode: u64,
    pub(crate) since: u64,
}

/// One guard's notices: its channels, its subscription and its waiting callers.
pub(crate) struct Notices {
    /// The broadcast channel; the interest channels are named after it.
    channel: String,
    /// Where purges are recorded by time, read back when the subscription comes up.
    purges_key: String,
    waiters: Arc<Waiters>,
    /// The buckets of keys whose fill notices this process wants, shared with the
    /// subscription's task, which subscribes them.
    interests: Arc<Interests>,
    /// Shared with the subscription's task, which holds it weakly.
    state: Arc<State>,
    listener: Mutex<Option<JoinHandle<()>>>,
}

struct State {
    /// Whether the subscription's task runs (it is started again if its runtime went).
    listening: AtomicBool,
    /// Whether the subscription is up now.
    subscribed: watch::Sender<bool>,
    /// Whether the last read-back failed, so that the log says it once per episode.
    read_back_failed: AtomicBool,
}

impl Drop for Notices {
    fn drop(&mut self) {
        if let Some(listener) = self.listener.lock().expect("listener lock").take() {
            listener.abort();
        }
    }
}

impl Notices {
    pub(crate) fn new(channel: String, purges_key: String) -> Self {
        Self {
            channel,
            purges_key,
            waiters: Arc::default(),
            interests: Arc::default(),
            state: Arc::new(State {
                listening: AtomicBool::new(false),
                subscribed: watch::channel(false).0,
                read_back_failed: AtomicBool::new(false),
            }),
            listener: Mutex::default(),
        }
    }

    /// The broadcast channel: the notices every instance hears.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// The interest channel the fill notices of `entry_key` go on.
    pub(crate) fn fill_channel(&self, entry_key: &str) -> String {
        channel_of(&self.channel, bucket_of(entry_key))
    }

    /// Registers a wait for `key` (see [`Waiters::register`]). It hears the notices of
    /// the broadcast channel; for fill notices too, [`listen`](Self::listen).
    pub(crate) fn wait_for(&self, key: Arc<str>) -> Wait {
        self.waiters.register(key)
    }

    /// Makes the fill notices of `wait`'s key reach this process for as long as the wait
    /// lives: subscribes the key's bucket, unless it is already. Call it before looking
    /// at the lease or the entry again, so that a fill between the look and the wait is
    /// heard. Returns whether the notices reach this process now: not while the
    /// subscription is down, nor when the bucket could not be had or was not confirmed
    /// within `within`; the caller then looks for itself.
    pub(crate) async fn listen(&self, wait: &mut Wait, within: Duration) -> bool {
        let bucket = bucket_of(&wait.key);
        if wait.interest.is_none() {
            wait.interest = self.interests.take(bucket);
            if wait.interest.is_none() {
                return false;
            }
        }
        self.is_subscribed() && self.interests.confirmed(bucket, within).await
    }

    /// Makes the fill notices of `entry_key` reach this process for as long as the
    /// returned interest lives (`None`: the bucket could not be had), without a wait (a
    /// refresh held off while another instance holds the lease). And whether they do
    /// now, as [`listen`](Self::listen) says.
    pub(crate) async fn interest(
        &self,
        entry_key: &str,
        within: Duration,
    ) -> (Option<Interest>, bool) {
        let bucket = bucket_of(entry_key);
        let Some(interest) = self.interests.take(bucket) else {
            return (None, false);
        };
        let heard = self.is_subscribed() && self.interests.confirmed(bucket, within).await;
        (Some(interest), heard)
    }

    /// Whether the subscription is up now.
    pub(crate) fn is_subscribed(&self) -> bool {
        *self.state.subscribed.borrow()
    }

    /// Follows the subscription's state.
    pub(crate) fn subscription(&self) -> watch::Receiver<bool> {
        self.state.subscribed.subscribe()
    }

    /// Starts the subscription on first use (a runtime is needed for it), and again if
    /// its task ended (its runtime went away). One atomic load when it runs.
    pub(crate) fn ensure_listening(
        &self,
        store: &RedisStore,
        hears: impl FnOnce() -> Weak<dyn Hears>,
    ) {
        if self.state.listening.load(Ordering::Acquire) || store.is_local_only() {
            return;
        }
        let mut listener = self.listener.lock().expect("listener lock");
        if self.state.listening.swap(true, Ordering::AcqRel) {
            return;
        }
        let running = Running(Arc::downgrade(&self.state));
        let task = listen(
            store.clone(),
            self.channel.clone(),
            self.purges_key.clone(),
            Arc::downgrade(&self.state),
            self.waiters.clone(),
            self.interests.clone(),
            hears(),
        );
        *listener = Some(tokio::spawn(async move {
            let _running = running;
            task.await;
        }));
    }

    /// Publishes `notice` (those that no script sends itself).
    pub(crate) async fn publish(
        &self,
        store: &RedisStore,
        notice: &Notice<'_>,
    ) -> Result<(), StoreError> {
        let mut publish = redis::cmd("PUBLISH");
        publish.arg(&self.channel).arg(notice.to_string());
        let _receivers: i64 = store
            .run(Operation::Publish, Request::Command(&publish))
            .await?;
        Ok(())
    }
}

/// Clears `listening` and `subscribed` when the subscription's task ends, however it
/// ends.
struct Running(Weak<State>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(state) = self.0.upgrade() {
            state.listening.store(false, Ordering::Release);
            state.subscribed.send_replace(false);
        }
    }
}

/// Callers waiting for an entry to be filled elsewhere.
#[derive(Default)]
pub(crate) struct Waiters {
    /// Per key, the channel its waits listen on and how many waits there are: counted
    /// here, under the lock, and not read off the channel's receivers, which are
    /// dropped after the lock is let go.
    map: Mutex<HashMap<Arc<str>, (watch::Sender<()>, usize)>>,
}

/// One caller's wait; dropping it unregisters (and gives its bucket back).
pub(crate) struct Wait {
    rx: watch::Receiver<()>,
    key: Arc<str>,
    waiters: Arc<Waiters>,
    /// Its key's bucket, once the wait listens for fill notices ([`Notices::listen`]).
    interest: Option<Interest>,
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
            interest: None,
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

/// How long a command on the subscription (its `PING`, a `SUBSCRIBE`) may take before
/// the subscription is given up, unless the connect timeout is longer. Its own, not the
/// store's command timeout: that one is set for the request path, often to 100 ms, and a
/// busy CPU delays a healthy server's pong that long. A subscription given up costs a
/// reconnect, and L1 serves nothing it held then as fresh: under load, a deadline that
/// tight would add load. A stalled server is still found within three seconds.
const SUBSCRIPTION_DEADLINE: Duration = Duration::from_secs(2);

/// Keeps one subscription up for as long as the guard lives (its `State` and what
/// `Hears`); reconnects with backoff.
async fn listen(
    store: RedisStore,
    channel: String,
    purges_key: String,
    state: Weak<State>,
    waiters: Arc<Waiters>,
    interests: Arc<Interests>,
    hears: Weak<dyn Hears>,
) {
    let connect = store.connect_timeout();
    let listener = Listener {
        timeout: SUBSCRIPTION_DEADLINE.max(connect),
        store,
        channel,
        purges_key,
        state,
        waiters,
        interests,
        hears,
    };
    let mut backoff = Duration::from_millis(50);
    // Whether the log said that Redis refused the buckets' channels (once).
    let mut refused = false;
    // What the log said last, so that a retry every second says nothing new.
    let mut lost = false;
    loop {
        if let Ok(mut pubsub) = listener.store.pubsub(connect).await
            && let Ok(Ok(())) =
                tokio::time::timeout(listener.timeout, pubsub.subscribe(&listener.channel)).await
        {
            if std::mem::replace(&mut lost, false) {
                tracing::info!("stampede-guard's notice subscription is back");
            }
            if let Lasted::GuardGone = listener.up(pubsub, &mut backoff, &mut refused).await {
                return;
            }
            lost = true;
            tracing::warn!("stampede-guard lost its notice subscription; reconnecting");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// What the subscription's task holds, for each subscription it makes.
struct Listener {
    store: RedisStore,
    channel: String,
    purges_key: String,
    state: Weak<State>,
    waiters: Arc<Waiters>,
    interests: Arc<Interests>,
    hears: Weak<dyn Hears>,
    /// The deadline of each command on the subscription.
    timeout: Duration,
}

/// How a subscription ended.
enum Lasted {
    /// The connection failed, or a command on it did not answer in time.
    Lost,
    /// The guard went: nothing to listen for.
    GuardGone,
}

impl Listener {
    /// A subscription up, until it is lost. Purges sent while it was down are recorded:
    /// they are read back (after subscribing, so that none falls between the two), beside
    /// the notices, for as long as it lasts. What the read-back read stays noted; what it
    /// did not is owed again, from the same place, by the next subscription's.
    async fn up(
        &self,
        pubsub: redis::aio::PubSub,
        backoff: &mut Duration,
        refused: &mut bool,
    ) -> Lasted {
        let Some(guard) = self.hears.upgrade() else {
            return Lasted::GuardGone;
        };
        let owed = guard.subscribed();
        drop(guard);
        let Some(shared) = self.state.upgrade() else {
            return Lasted::GuardGone;
        };
        let subscribed = shared.subscribed.clone();
        let read_back = AbortOnDrop(tokio::spawn(read_back(
            self.store.clone(),
            ReadBack::new(self.purges_key.clone(), owed.since),
            owed.episode,
            Arc::downgrade(&shared),
            self.hears.clone(),
        )));
        drop(shared);
        subscribed.send_replace(true);
        if let Lasted::GuardGone = self.heard(pubsub, backoff, refused).await {
            return Lasted::GuardGone;
        }
        drop(read_back);
        subscribed.send_replace(false);
        self.interests.lost();
        Lasted::Lost
    }

    /// Delivers what the subscription hears, subscribes the buckets wanted, and checks
    /// it every second, until it is lost.
    async fn heard(
        &self,
        pubsub: redis::aio::PubSub,
        backoff: &mut Duration,
        refused: &mut bool,
    ) -> Lasted {
        let (mut sink, mut messages) = pubsub.split();
        let mut ping = tokio::time::interval(PING_EVERY);
        ping.tick().await;
        // The buckets still wanted when the last connection was lost, if any.
        self.interests.lost();
        let (interests, channel, timeout) = (&self.interests, &self.channel, self.timeout);
        loop {
            tokio::select! {
                message = messages.next() => {
                    let Some(message) = message else { return Lasted::Lost };
                    let Some(guard) = self.hears.upgrade() else { return Lasted::GuardGone };
                    deliver(&*guard, &self.waiters, message.get_payload_bytes());
                }
                () = interests.wanted() => {
                    if !subscribe_wanted(&mut sink, interests, channel, timeout, refused).await {
                        return Lasted::Lost;
                    }
                }
                _ = ping.tick() => {
                    if let Err(lasted) = self.checked(&mut sink, backoff, refused).await {
                        return lasted;
                    }
                }
            }
        }
    }

    /// Once a second: the guard's tick, a `PING`, the buckets wanted since (a wake-up
    /// lost in a race costs a second at most), and those nobody has wanted for a while
    /// let go, in one command.
    async fn checked(
        &self,
        sink: &mut redis::aio::PubSubSink,
        backoff: &mut Duration,
        refused: &mut bool,
    ) -> Result<(), Lasted> {
        let Some(guard) = self.hears.upgrade() else {
            return Err(Lasted::GuardGone);
        };
        guard.tick();
        drop(guard);
        let timeout = self.timeout;
        let pong = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
        if !matches!(pong, Ok(Ok(_))) {
            return Err(Lasted::Lost);
        }
        // Healthy for a ping: only now is a reconnect quick again (a server that takes
        // SUBSCRIBE and drops us is not retried at 20/s).
        *backoff = Duration::from_millis(50);
        if !subscribe_wanted(sink, &self.interests, &self.channel, timeout, refused).await {
            return Err(Lasted::Lost);
        }
        let idle = self.interests.take_idle();
        if !idle.is_empty() {
            let names: Vec<String> = idle.iter().map(|b| channel_of(&self.channel, *b)).collect();
            let done = tokio::time::timeout(timeout, sink.unsubscribe(&names));
            if !matches!(done.await, Ok(Ok(()))) {
                return Err(Lasted::Lost);
            }
        }
        Ok(())
    }
}

/// Subscribes every bucket wanted since the last batch, in one command, and confirms
/// them. Returns `false` when the connection is to be given up (no reply in time, or
/// it failed); a refusal by the server (an ACL that allows the broadcast channel only)
/// keeps it: the waits of those buckets go unheard, and the log says so once.
async fn subscribe_wanted(
    sink: &mut redis::aio::PubSubSink,
    interests: &Interests,
    channel: &str,
    timeout: Duration,
    refused: &mut bool,
) -> bool {
    let buckets = interests.take_wanted();
    if buckets.is_empty() {
        return true;
    }
    let names: Vec<String> = buckets.iter().map(|b| channel_of(channel, *b)).collect();
    match tokio::time::timeout(timeout, sink.subscribe(&names)).await {
        Ok(Ok(())) => interests.subscribed(&buckets),
        Ok(Err(error)) if matches!(error.kind(), redis::ErrorKind::Server(_)) => {
            interests.refused(&buckets);
            if !std::mem::replace(refused, true) {
                tracing::warn!(
                    %error,
                    "stampede-guard could not subscribe to its interest channels: waits \
                     for other instances' fills look for them every 100 ms instead"
                );
            }
        }
        _ => return false,
    }
    true
}

/// Aborts a task when dropped: the read-back of a subscription that was lost.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The longest wait between two tries of a failing read-back.
const READ_BACK_BACKOFF: Duration = Duration::from_secs(2);

/// Reads back the purges owed, a batch at a time, handing each to the guard; a failed
/// batch is tried again with backoff, for as long as the subscription lasts (its task
/// is aborted when it is lost). Its failures do not count against the breaker: they
/// would open it for Redis's every other use, and a read-back that keeps failing must
/// not stop the notices it runs beside. The log says the first failure of an episode,
/// and its end.
async fn read_back(
    store: RedisStore,
    mut cursor: ReadBack,
    episode: u64,
    state: Weak<State>,
    hears: Weak<dyn Hears>,
) {
    let mut backoff = Duration::from_millis(50);
    // Batches in a row that read nothing (asked again: the records moved under the
    // cursor). A record set that keeps moving (pruned, purged again) is not chased in
    // a tight loop: past a few, the read-back waits as after a failure.
    let mut empty = 0;
    loop {
        match cursor.next(&store).await {
            Ok(Some(records)) => {
                let Some(guard) = hears.upgrade() else { return };
                guard.purges_recorded(&records);
                drop(guard);
                if records.is_empty() {
                    empty += 1;
                    if empty >= 3 {
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(READ_BACK_BACKOFF);
                    }
                } else {
                    empty = 0;
                }
            }
            Ok(None) => {
                let Some(guard) = hears.upgrade() else { return };
                guard.purges_caught_up(episode);
                if let Some(state) = state.upgrade()
                    && state.read_back_failed.swap(false, Ordering::AcqRel)
                {
                    tracing::info!("stampede-guard read the purges back");
                }
                return;
            }
            Err(error) => {
                if let Some(state) = state.upgrade()
                    && !state.read_back_failed.swap(true, Ordering::AcqRel)
                {
                    tracing::warn!(
                        %error,
                        "stampede-guard could not read the purges back; retrying \
                         (meanwhile, entries with tags filled before are stale)"
                    );
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(READ_BACK_BACKOFF);
            }
        }
    }
}

/// Hands a notice to the guard, then wakes the callers waiting for its key.
fn deliver(guard: &dyn Hears, waiters: &Waiters, payload: &[u8]) {
    let notice = Notice::parse(payload);
    metrics::counter!(
        crate::metrics::NOTICES_HEARD,
        "notice" => notice.as_ref().map_or("unknown", Notice::kind)
    )
    .increment(1);
    match notice {
        Some(Notice::Filled(key, local)) => {
            guard.filled(key, local);
            waiters.wake(key);
        }
        Some(Notice::Invalidated(key, token, local)) => {
            guard.invalidated(local, token);
            waiters.wake(key);
        }
        Some(Notice::Ended(key, ending, lasting)) => {
            guard.ended(key, ending, lasting);
            waiters.wake(key);
        }
        Some(Notice::Learned(route, Some(response), names)) => {
            guard.learned(route, response, &names);
        }
        // From a version that learned per route: each URL learns from its own entries.
        Some(Notice::Learned(_, None, _)) => {}
        Some(Notice::Purged(how, at, ids)) => guard.purged(how, at, &ids),
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
