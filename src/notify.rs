//! Instances telling each other what happened to entries, over Redis pub/sub.
//!
//! Every fenced write publishes a fill notice and every invalidation an invalidation
//! notice (inside the same Lua script, so a notice is sent exactly when the write
//! happened); a fill whose lease ends without a write says so, and so does a route that
//! learned a `Vary` header. The wire format is [`Notice`]'s.
//!
//! What every instance needs goes on the key space's broadcast channel: invalidations,
//! purges, learned `Vary` headers, and leases that ended without a write (they set the
//! marks every instance keeps). Fill notices matter only to an instance that waits for
//! the key: they go on the key's interest channel, one of a fixed number of buckets of
//! keys, which an instance listens to only while it waits for a key in it (see
//! `interest`). A waiter subscribes its bucket before it looks at the lease or the entry
//! again, so that no fill falls between the two.
//!
//! [`Notices`] is one guard's side of it: the subscription (one connection, pinged every
//! second, reconnected with backoff; the buckets are subscribed and let go on it), the
//! callers waiting for an entry to be filled elsewhere ([`Wait`]), and the channels. It
//! knows nothing of the guard's state: what a notice means for L1, tombstones, marks and
//! routes, the guard says through [`Hears`]. Callers waiting for a key are woken after
//! the guard has heard the notice, so that they find its effects.
//!
//! A lost wake-up costs time: a waiter that is not woken reads Redis when its cold wait
//! ends, and a waiter whose bucket could not be subscribed in time (the subscription is
//! down, the bucket not confirmed, too many buckets) reads Redis every 100 ms instead of
//! waiting to be woken. A lost invalidation costs freshness for a bounded time: when the
//! subscription is lost, notices sent meanwhile are lost with it, and until the loss is
//! found (a `PING` that fails: within a second and the ping's own deadline, two seconds
//! or the connect timeout if longer, or the connection's end) this process's L1 serves
//! what it holds as it was, fresh if it was. Once found, and when the subscription comes
//! back, the guard is told ([`Hears::subscribed`]) and no longer serves what it held
//! then as fresh. Purges are recorded in Redis too: those recorded since the last one
//! the guard knows of are read back, in batches, beside the notices (see
//! `purge_records::ReadBack`). The subscription counts as up as soon as it is: a
//! read-back that fails is retried with backoff, outside the breaker, while the guard
//! treats what a missed purge could have reached as stale.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::interest::{Interest, Interests, bucket_of, channel_of};
use crate::keys::LocalKey;
use crate::lease::FencingToken;
pub(crate) use crate::purge_records::Purge;
use crate::purge_records::{ReadBack, Recorded};
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
    let mut backoff = Duration::from_millis(50);
    let connect = store.connect_timeout();
    let timeout = SUBSCRIPTION_DEADLINE.max(connect);
    // Whether the log said that Redis refused the buckets' channels (once).
    let mut refused = false;
    // What the log said last, so that a retry every second says nothing new.
    let mut lost = false;
    loop {
        if let Ok(mut pubsub) = store.pubsub(connect).await
            && let Ok(Ok(())) = tokio::time::timeout(timeout, pubsub.subscribe(&channel)).await
        {
            if std::mem::replace(&mut lost, false) {
                tracing::info!("stampede-guard's notice subscription is back");
            }
            // Purges sent while the subscription was down are recorded: read them back
            // (after subscribing, so that none falls between the two), beside the
            // notices, for as long as this subscription lasts.
            let Some(guard) = hears.upgrade() else { return };
            let owed = guard.subscribed();
            drop(guard);
            let Some(shared) = state.upgrade() else {
                return;
            };
            let subscribed = shared.subscribed.clone();
            let read_back = AbortOnDrop(tokio::spawn(read_back(
                store.clone(),
                ReadBack::new(purges_key.clone(), owed.since),
                owed.episode,
                Arc::downgrade(&shared),
                hears.clone(),
            )));
            drop(shared);
            subscribed.send_replace(true);
            let (mut sink, mut messages) = pubsub.split();
            let mut ping = tokio::time::interval(PING_EVERY);
            ping.tick().await;
            // The buckets still wanted when the last connection was lost, if any.
            interests.lost();
            loop {
                tokio::select! {
                    message = messages.next() => {
                        let Some(message) = message else { break };
                        let Some(guard) = hears.upgrade() else { return };
                        deliver(&*guard, &waiters, message.get_payload_bytes());
                    }
                    () = interests.wanted() => {
                        if !subscribe_wanted(&mut sink, &interests, &channel, timeout, &mut refused).await {
                            break;
                        }
                    }
                    _ = ping.tick() => {
                        let Some(guard) = hears.upgrade() else { return };
                        guard.tick();
                        drop(guard);
                        let pong = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
                        if !matches!(pong, Ok(Ok(_))) {
                            break;
                        }
                        // Healthy for a ping: only now is a reconnect quick again (a
                        // server that takes SUBSCRIBE and drops us is not retried at 20/s).
                        backoff = Duration::from_millis(50);
                        // A wake-up lost in a race costs a second at most.
                        if !subscribe_wanted(&mut sink, &interests, &channel, timeout, &mut refused).await {
                            break;
                        }
                        // The buckets nobody has wanted for a while, in one command.
                        let idle = interests.take_idle();
                        if !idle.is_empty() {
                            let names: Vec<String> =
                                idle.iter().map(|b| channel_of(&channel, *b)).collect();
                            let done = tokio::time::timeout(timeout, sink.unsubscribe(&names));
                            if !matches!(done.await, Ok(Ok(()))) {
                                break;
                            }
                        }
                    }
                }
            }
            // What it read stays noted; what it did not is owed again, from the same
            // place, by the next subscription's.
            drop(read_back);
            subscribed.send_replace(false);
            interests.lost();
            lost = true;
            tracing::warn!("stampede-guard lost its notice subscription; reconnecting");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
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

/// How a fill's lease ended without a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The answer may not be stored: pass the key through for a while.
    Pass,
    /// The origin failed: leave it alone for a while.
    Error,
    /// Nothing to say (the write was refused, the fill was abandoned): look again.
    Gone,
}

/// What instances tell each other, on the key space's broadcast channel, but for fill
/// notices, which go on the entry key's interest channel (see `interest`). On the wire:
///
/// * `f {entry key} {local key}`: an entry was written (sent by the write script, on
///   the key's interest channel); the entry key is its Redis key, the local key its key
///   in L1 (see `keys::LocalKey`);
/// * `i {token} {entry key} {local key}`: a response was invalidated, with its
///   tombstone's token (sent by the invalidation script);
/// * `e {pass|error|gone} {ms} {entry key}`: a fill's lease ended without a write, and
///   what to make of the key for the next `ms`;
/// * `u {route} {response} {name,name,...}`: a URL learned the headers its responses vary
///   on (`response`: its local key, in hex); versions that learned per route sent
///   `v {route} {name,name,...}`, read here without a URL, and ignored (a tag of its
///   own, so that such versions ignore these in turn);
/// * `p {h|s} {µs} {tag id} {tag id}...`: tags were purged, hard or soft, at that time
///   of the server's clock (sent by the purge script).
///
/// The local key comes last, after a space no entry key holds, so that a fleet in the
/// middle of an upgrade keeps hearing itself: versions from before local keys sent
/// `f {entry key}` and `i {token} {entry key}`, read here with no local key (the
/// hearer then does what it can without one), and read the entry key of these notices
/// up to the end of its response's part, where the local key does not reach.
///
/// Every notice is heard on whichever channel it comes. In a fleet in the middle of the
/// upgrade to interest channels, versions from before publish fill notices on the
/// broadcast channel, and this version hears them there; but versions from before wait
/// for fills on the broadcast channel alone, and do not hear the fill notices of this
/// version. That costs time, not correctness: a waiter of an older version that is not
/// woken reads Redis when its cold wait ends (`cold_wait`), and a refresh it held off
/// waits out its hold-off (the lease's time left) while the entry is served stale.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Notice<'a> {
    Filled(&'a str, Option<LocalKey>),
    Invalidated(&'a str, FencingToken, Option<LocalKey>),
    Ended(&'a str, Ending, Duration),
    Learned(&'a str, Option<u128>, Vec<&'a str>),
    Purged(Purge, u64, Vec<&'a str>),
}

/// The entry key and the local key that end `f` and `i` notices; `None` for a local
/// key that is there but not one.
fn key_and_local(rest: &str) -> Option<(&str, Option<LocalKey>)> {
    match rest.split_once(' ') {
        None => Some((rest, None)),
        Some((key, local)) => Some((key, Some(local.parse().ok()?))),
    }
}

/// Writes the optional local key that ends `f` and `i` notices.
struct AndLocal(Option<LocalKey>);

impl std::fmt::Display for AndLocal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(local) => write!(f, " {local}"),
            None => Ok(()),
        }
    }
}

impl std::fmt::Display for Notice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Filled(key, local) => write!(f, "f {key}{}", AndLocal(*local)),
            Self::Invalidated(key, token, local) => {
                write!(f, "i {token} {key}{}", AndLocal(*local))
            }
            Self::Ended(key, ending, lasting) => {
                let how = match ending {
                    Ending::Pass => "pass",
                    Ending::Error => "error",
                    Ending::Gone => "gone",
                };
                write!(f, "e {how} {} {key}", lasting.as_millis())
            }
            Self::Learned(route, Some(response), names) => {
                write!(f, "u {route} {response:032x} {}", names.join(","))
            }
            Self::Learned(route, None, names) => write!(f, "v {route} {}", names.join(",")),
            Self::Purged(how, at, ids) => {
                let how = match how {
                    Purge::Hard => "h",
                    Purge::Soft => "s",
                };
                write!(f, "p {how} {at} {}", ids.join(" "))
            }
        }
    }
}

impl<'a> Notice<'a> {
    /// What kind of notice it is, as the metric of notices heard labels it.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Filled(..) => "filled",
            Self::Invalidated(..) => "invalidated",
            Self::Ended(..) => "ended",
            Self::Learned(..) => "learned",
            Self::Purged(..) => "purged",
        }
    }

    /// Reads a notice; `None` for anything else.
    pub(crate) fn parse(payload: &'a [u8]) -> Option<Self> {
        let text = std::str::from_utf8(payload).ok()?;
        let (kind, rest) = text.split_once(' ')?;
        match kind {
            "f" => {
                let (key, local) = key_and_local(rest)?;
                Some(Self::Filled(key, local))
            }
            "i" => {
                let (token, rest) = rest.split_once(' ')?;
                let token = FencingToken::new(token.parse().ok()?);
                let (key, local) = key_and_local(rest)?;
                Some(Self::Invalidated(key, token, local))
            }
            "e" => {
                let (how, rest) = rest.split_once(' ')?;
                let (ms, key) = rest.split_once(' ')?;
                let ending = match how {
                    "pass" => Ending::Pass,
                    "error" => Ending::Error,
                    "gone" => Ending::Gone,
                    _ => return None,
                };
                Some(Self::Ended(
                    key,
                    ending,
                    Duration::from_millis(ms.parse().ok()?),
                ))
            }
            "p" => {
                let (how, rest) = rest.split_once(' ')?;
                let how = match how {
                    "h" => Purge::Hard,
                    "s" => Purge::Soft,
                    _ => return None,
                };
                let (at, ids) = rest.split_once(' ')?;
                Some(Self::Purged(
                    how,
                    at.parse().ok()?,
                    ids.split(' ').filter(|id| !id.is_empty()).collect(),
                ))
            }
            "u" => {
                let (route, rest) = rest.split_once(' ')?;
                let (response, names) = rest.split_once(' ')?;
                Some(Self::Learned(
                    route,
                    Some(u128::from_str_radix(response, 16).ok()?),
                    names.split(',').filter(|n| !n.is_empty()).collect(),
                ))
            }
            "v" => {
                let (route, names) = rest.split_once(' ')?;
                Some(Self::Learned(
                    route,
                    None,
                    names.split(',').filter(|n| !n.is_empty()).collect(),
                ))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_garbage_is_none() {
        let token = FencingToken::new(42);
        let local = LocalKey {
            response: 7,
            variant: 9,
        };
        let notices = [
            Notice::Filled("sg:k:entry", Some(local)),
            Notice::Filled("sg:k:entry", None),
            Notice::Invalidated("sg:k:entry", token, Some(local)),
            Notice::Invalidated("sg:k:entry", token, None),
            Notice::Ended("sg:k:entry", Ending::Pass, Duration::from_millis(1500)),
            Notice::Ended("sg:k:entry", Ending::Error, Duration::from_millis(400)),
            Notice::Ended("sg:k:entry", Ending::Gone, Duration::ZERO),
            Notice::Learned("items", Some(7), vec!["accept-language", "x-tenant"]),
            Notice::Learned("items", None, vec!["accept-language"]),
            Notice::Purged(Purge::Hard, 1_700_000_000_000_000, vec!["tag_ab", "tag_cd"]),
            Notice::Purged(Purge::Soft, 1, vec!["tag_ab"]),
        ];
        for notice in notices {
            let wire = notice.to_string();
            assert_eq!(Notice::parse(wire.as_bytes()), Some(notice), "{wire}");
        }
        // What versions from before local keys send is read, without one.
        assert_eq!(
            Notice::parse(b"f sg:e:s:{items:req_ab}:fill:entry"),
            Some(Notice::Filled("sg:e:s:{items:req_ab}:fill:entry", None))
        );
        assert_eq!(
            Notice::parse(b"i 42 sg:e:s:{items:req_ab}:fill:entry"),
            Some(Notice::Invalidated(
                "sg:e:s:{items:req_ab}:fill:entry",
                token,
                None
            ))
        );
        // And they read the entry key of ours up to its response's part: the local key
        // after it does not change what they find there.
        let ours = Notice::Invalidated("sg:e:s:{items:req_ab}:fill:entry", token, Some(local));
        let wire = ours.to_string();
        let (_, old_key) = wire["i ".len()..].split_once(' ').unwrap();
        assert!(
            old_key.starts_with("sg:e:s:{items:req_ab}:fill:"),
            "{old_key}"
        );
        for garbage in [
            "",
            "f",
            "f key not-a-local-key",
            "f key 0000000000000000000000000000000700000000000000090",
            "i 42 key 00000000000000000000000000000007000000000000000g",
            "i 42 key 0000000000000000000000000000000700000000000000é",
            "i x key",
            "e maybe 5 key",
            "e pass x key",
            "z key",
            "\u{0}",
        ] {
            assert_eq!(Notice::parse(garbage.as_bytes()), None, "{garbage}");
        }
    }

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
