//! The Tower layer: a two-tier cache in front of a cache-fill handler, serving stale
//! entries at once while one caller in the whole fleet refreshes them.
//!
//! A [`StampedeGuard`] is the shared handle: the Redis store, the key space, the L1
//! cache and the notice subscription. Each route gets its own [`GuardLayer`], made from
//! the handle with that route's [`Policy`], where the route is declared:
//!
//! ```no_run
//! use std::time::{Duration, Instant};
//! use axum::{Router, routing::get};
//! use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let keys = KeySpace::builder()
//!     .env("prod")
//!     .service("catalog")
//!     .secret(std::env::var("CACHE_KEY_SECRET")?)
//!     .build()?;
//! let store = RedisStore::builder("redis://127.0.0.1:6379").build()?;
//! let guard = StampedeGuard::builder(store, keys).build()?;
//!
//! let items = guard.layer(
//!     Policy::builder("items")
//!         .fresh_ttl(Duration::from_secs(5))
//!         .grace(Duration::from_secs(60))
//!         .build()?,
//! )?;
//! let app: Router = Router::new().route("/items/{id}", get(|| async { "item" }).layer(items));
//! # Ok(()) }
//! ```
//!
//! # The request path
//!
//! * A **fresh** entry, in L1 or else in L2 (which then fills L1), is served with
//!   `x-cache: hit` and `age`.
//! * A **stale** entry (past its fresh time, within its grace) is served at once with
//!   `x-cache: stale`, and a refresh starts in the background, within the guard's
//!   refresh budget (over it, the refresh is skipped and counted, and a later caller
//!   starts it). The request never waits for the origin, a lease or a lock.
//! * A **refresh** runs once per key per process. It reads L2 first and takes a newer
//!   entry written by another instance if there is one; otherwise it takes the key's
//!   lease, and if someone else holds it, stops. With the lease it calls a clone of the
//!   inner service with a copy of the request, bounded by the refresh timeout, writes L2
//!   with a fenced write that also releases the lease and notifies the fleet, and fills
//!   L1. A caller that disconnects does not cancel it. When the origin fails (or answers
//!   with something that may not be stored), the stale entry stays and the lease is held
//!   off for the route's error back-off, so the fleet tries again once per back-off.
//! * A **cold miss** (nothing cached) is filled by one task per key per process, which
//!   every caller of the process for that key awaits; across the fleet, the lease picks
//!   one filler, and callers on other instances wait at most the route's cold wait for
//!   its entry, woken by its notice. When the filler's lease ends without an entry, its
//!   notice says so and they stop waiting at once: after an answer that may not be
//!   stored they go to the origin themselves (and so do the key's callers for the
//!   route's hit-for-pass time, `x-cache: pass`); after an origin failure, while the
//!   fleet backs off, they get an entry that may stand in (stale-if-error) at once, or a
//!   503 on a route that rejects, or else share one call at a time of their process to
//!   the origin (without the lease).
//!
//! # What reaches the origin
//!
//! A fill is a GET of the keyed path and query. It carries the caller's headers as a
//! proxy forwards them, without hop-by-hop headers and without the headers known to
//! poison caches ([`POISONING_HEADERS`]) unless keyed, or only the keyed headers on a
//! route with strict forwarding; it carries the caller's extensions only where the
//! route says so. A route learns the headers its responses name in `Vary` and keys on
//! them from then on, so that no caller is ever served a variant its headers did not ask
//! for; callers who waited for a fill of another variant fill their own.
//!
//! # Readiness
//!
//! The guard is always ready ([`Guard`]): a hit never waits for the inner service's
//! readiness, and each call to the origin waits for its own ready clone, so limits
//! placed inside the guard bound origin calls, not hits.
//!
//! # Concurrent calls on the same key
//!
//! At most one refresh and one cold fill per key run in a process at a time, however
//! many times the framework applied the layer (axum applies a route's layers for each
//! connection: the single-flight state lives with the route, not with what `layer()`
//! makes), and while a lease is held no other instance calls the origin for that key. A
//! lease is an efficiency device: if it expires under a slow origin, a second instance
//! may refresh; the fenced write then keeps the newer entry whatever order the writes
//! land in, and refuses a write whose lease was overtaken by a newer one, even when that
//! one's entry is gone.
//!
//! When Redis cannot be used, the guard goes on with L1 and the local single-flight
//! only: at most one origin call per key per process.
//!
//! # Cancellation
//!
//! Fills and refreshes run in tasks of their own: a caller dropping its request does not
//! stop them, and every other caller waiting for the same fill still gets its result.
//! A fill that panics wakes its waiters, who then follow the route's cold-miss setting.
//!
//! # Memory
//!
//! L1 holds at most its capacity in bytes of what entries really cost (every allocation
//! an entry holds, and the cache's bookkeeping for it); each entry is a compact copy
//! that keeps no network buffer alive.
//!
//! [`Policy`]: crate::Policy
//! [`ColdMiss`]: crate::ColdMiss
//! [`POISONING_HEADERS`]: crate::policy::POISONING_HEADERS

mod body;
mod budget;
mod fill;
mod flight;
mod future;
mod layer;
pub(crate) mod marks;
mod service;
mod vary;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use self::body::ResponseBody;
use self::budget::Budget;
pub use self::future::ResponseFuture;
pub use self::layer::GuardLayer;
use self::marks::Marks;
pub use self::service::Guard;
use self::vary::Learned;
use crate::cache::{L1, Tombstones, new_l1, new_tombstones};
use crate::error::ConfigError;
use crate::keys::KeySpace;
use crate::lease::LeaseClient;
use crate::notify::Waiters;
use crate::policy::Policy;
use crate::store::{RedisStore, StoreError, StoreErrorKind};
use tokio::sync::Semaphore;

/// Default L1 capacity, in bytes of entries.
pub const DEFAULT_L1_CAPACITY: u64 = 64 * 1024 * 1024;

/// Default refresh budget: refreshes and cold fills of one guard at work at once.
pub const DEFAULT_REFRESH_BUDGET: usize = 64;

/// The shared handle: Redis, keys, the L1 cache and the notice subscription. Cheap to
/// clone; make one per process and a [`GuardLayer`] per route from it.
#[derive(Clone)]
pub struct StampedeGuard {
    shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) store: RedisStore,
    pub(crate) keys: KeySpace,
    pub(crate) leases: LeaseClient,
    pub(crate) l1: L1,
    pub(crate) tombstones: Tombstones,
    pub(crate) waiters: Arc<Waiters>,
    pub(crate) channel: String,
    /// Keys whose last fill wrote nothing: pass them through, or serve stale at once.
    pub(crate) marks: Marks,
    /// Bounds the refreshes and cold fills at work at once.
    pub(crate) budget: Budget,
    /// The routes made from this guard, by name (a name is refused twice: its metrics
    /// and keys would merge), with the headers each has learned to vary on.
    pub(crate) routes: Mutex<HashMap<String, Arc<Learned>>>,
    /// Keys with a refresh running in this process, or held off because another
    /// instance holds the lease.
    pub(crate) refreshing: Mutex<HashMap<Arc<str>, Refresh>>,
    /// The notice subscription's task, and whether it runs.
    listener: Mutex<Option<JoinHandle<()>>>,
    listening: AtomicBool,
    pub(crate) subscribed: watch::Sender<bool>,
    /// Counts the times the notice subscription came up. Entries put in L1 in an earlier
    /// epoch may have missed an invalidation sent while it was down: they are not served
    /// as fresh (stale instead, and refreshed).
    pub(crate) epoch: AtomicU64,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(listener) = self.listener.lock().expect("listener lock").take() {
            listener.abort();
        }
    }
}

impl fmt::Debug for StampedeGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StampedeGuard")
            .field("keys", &self.shared.keys)
            .field("store", &self.shared.store)
            .field("l1_entries", &self.shared.l1.entry_count())
            .finish_non_exhaustive()
    }
}

impl StampedeGuard {
    /// Starts a guard on a store and a key space.
    pub fn builder(store: RedisStore, keys: KeySpace) -> GuardBuilder {
        GuardBuilder {
            store,
            keys,
            l1_capacity: DEFAULT_L1_CAPACITY,
            refresh_budget: DEFAULT_REFRESH_BUDGET,
            instance_id: None,
        }
    }

    /// Makes the layer of one route. Refused, naming the field, when the policy does not
    /// fit the store (lease TTLs against the command timeout), or when the guard already
    /// made a layer for a route of that name (their metrics and keys would merge: clone
    /// the [`GuardLayer`] to put one route's layer in several places).
    pub fn layer(&self, policy: Policy) -> Result<GuardLayer, ConfigError> {
        policy.check_against(self.shared.store.command_timeout())?;
        self.shared
            .keys
            .cache(&policy.route, b"")
            .map_err(|e| ConfigError::invalid("route", e.to_string()))?;
        let learned = {
            let mut routes = self.shared.routes.lock().expect("routes lock");
            if routes.contains_key(&policy.route) {
                return Err(ConfigError::invalid(
                    "route",
                    format!(
                        "`{}` is already a route of this guard: clone its layer instead",
                        policy.route
                    ),
                ));
            }
            let learned = Arc::new(Learned::default());
            routes.insert(policy.route.clone(), learned.clone());
            learned
        };
        Ok(GuardLayer::new(self.shared.clone(), policy, learned))
    }

    /// Opens a Redis connection and the notice subscription, waiting at most the store's
    /// connect timeout for each. Not needed (the guard connects on first use), but lets a
    /// service start warm, and lets tests know other instances will hear this one's
    /// notices.
    pub async fn ready(&self) -> Result<(), StoreError> {
        if self.shared.store.is_local_only() {
            return Ok(());
        }
        self.shared.store.ping().await?;
        self.shared.ensure_listener();
        let mut subscribed = self.shared.subscribed.subscribe();
        match tokio::time::timeout(
            self.shared.store.connect_timeout() * 2,
            subscribed.wait_for(|up| *up),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            _ => Err(StoreError::new(
                crate::store::Operation::Subscribe,
                StoreErrorKind::NoConnection,
                None,
            )),
        }
    }

    /// Whether the guard hears other instances' notices (fills, invalidations) now. Off
    /// before the first request (or [`ready`](Self::ready)), while Redis cannot be
    /// reached, and always for a local-only store. For health pages: an instance that
    /// does not hear them serves what it holds, but learns of invalidations late.
    pub fn notices_connected(&self) -> bool {
        *self.shared.subscribed.borrow()
    }

    /// How many entries L1 holds (approximate: moka counts lazily).
    pub fn l1_entries(&self) -> u64 {
        self.shared.l1.entry_count()
    }

    /// How many bytes of entries L1 holds (approximate).
    pub fn l1_bytes(&self) -> u64 {
        self.shared.l1.weighted_size()
    }

    /// The store.
    pub fn store(&self) -> &RedisStore {
        &self.shared.store
    }
}

impl Shared {
    /// The headers route `route` has learned to vary on (for notices from other
    /// instances).
    pub(crate) fn learned(&self, route: &str) -> Option<Arc<Learned>> {
        self.routes.lock().expect("routes lock").get(route).cloned()
    }

    /// Another instance wrote `key`: a refresh held off for it may go ahead (and will
    /// adopt the new entry).
    pub(crate) fn filled_elsewhere(&self, key: &str) {
        let mut refreshing = self.refreshing.lock().expect("refreshing lock");
        match refreshing.get_mut(key) {
            Some(Refresh::HeldOff(_)) => {
                refreshing.remove(key);
            }
            // Seen while the refresh runs: a hold-off it ends with is moot.
            Some(state @ Refresh::Running) => *state = Refresh::RunningFilled,
            _ => {}
        }
    }

    /// Starts the notice subscription on first use (a runtime is needed for it), and
    /// again if its task ended (its runtime went away). One atomic load when it runs.
    pub(crate) fn ensure_listener(self: &Arc<Self>) {
        if self.listening.load(Ordering::Acquire) || self.store.is_local_only() {
            return;
        }
        let mut listener = self.listener.lock().expect("listener lock");
        if self.listening.swap(true, Ordering::AcqRel) {
            return;
        }
        let (weak, subscribed) = (Arc::downgrade(self), self.subscribed.clone());
        let running = Running(Arc::downgrade(self));
        *listener = Some(tokio::spawn(async move {
            let _running = running;
            crate::notify::listen(weak, subscribed).await;
        }));
    }
}

/// Clears `listening` when the subscription's task ends, however it ends.
struct Running(std::sync::Weak<Shared>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            shared.listening.store(false, Ordering::Release);
            shared.subscribed.send_replace(false);
        }
    }
}

/// The refresh state of a key in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refresh {
    Running,
    /// Running, and another instance's fill notice came meanwhile.
    RunningFilled,
    /// Until then, the lease is someone else's: do not try.
    HeldOff(Instant),
}

/// Builds a [`StampedeGuard`].
#[must_use]
pub struct GuardBuilder {
    store: RedisStore,
    keys: KeySpace,
    l1_capacity: u64,
    refresh_budget: usize,
    instance_id: Option<String>,
}

impl fmt::Debug for GuardBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardBuilder")
            .field("l1_capacity", &self.l1_capacity)
            .field("refresh_budget", &self.refresh_budget)
            .field("instance_id", &self.instance_id)
            .finish_non_exhaustive()
    }
}

impl GuardBuilder {
    /// How many bytes of entries L1 may hold (default 64 MiB). Entries are weighed by
    /// what they really cost in memory (every allocation an entry holds, and the cache's
    /// bookkeeping for it), so this is what the process spends on them; the least used
    /// go first.
    pub fn l1_capacity(mut self, bytes: u64) -> Self {
        self.l1_capacity = bytes;
        self
    }

    /// How many refreshes and cold fills may be at work at once, over all routes of the
    /// guard (default 64): each calls the origin at most once. Over it, a stale entry is
    /// served without a refresh (counted as skipped; a later caller starts it), and a
    /// cold fill waits for a slot, at most its route's cold wait. Size it to what the
    /// origin can take from one instance.
    pub fn refresh_budget(mut self, slots: usize) -> Self {
        self.refresh_budget = slots;
        self
    }

    /// The instance part of lease owner values (see
    /// [`LeaseClientBuilder::instance_id`](crate::lease::LeaseClientBuilder::instance_id)).
    pub fn instance_id(mut self, id: impl Into<String>) -> Self {
        self.instance_id = Some(id.into());
        self
    }

    /// Checks the settings and builds the guard. Connects nothing.
    pub fn build(self) -> Result<StampedeGuard, ConfigError> {
        if self.l1_capacity == 0 {
            return Err(ConfigError::Zero {
                field: "l1_capacity",
            });
        }
        if self.refresh_budget == 0 {
            return Err(ConfigError::Zero {
                field: "refresh_budget",
            });
        }
        if self.refresh_budget > Semaphore::MAX_PERMITS {
            return Err(ConfigError::invalid("refresh_budget", "too large"));
        }
        let mut leases = LeaseClient::builder(self.store.clone(), &self.keys)
            // Any valid TTL: every call passes the route's own.
            .lease_ttl(
                (self.store.command_timeout() * crate::lease::MIN_TTL_PER_COMMAND_TIMEOUT)
                    .max(Duration::from_secs(1)),
            );
        if let Some(id) = self.instance_id {
            leases = leases.instance_id(id);
        }
        let leases = leases.build()?;
        let channel = self.keys.channel();
        Ok(StampedeGuard {
            shared: Arc::new(Shared {
                store: self.store,
                keys: self.keys,
                leases,
                l1: new_l1(self.l1_capacity),
                tombstones: new_tombstones(),
                waiters: Arc::default(),
                channel,
                marks: Marks::default(),
                budget: Budget::new(self.refresh_budget),
                routes: Mutex::default(),
                refreshing: Mutex::default(),
                listener: Mutex::default(),
                listening: AtomicBool::new(false),
                subscribed: watch::channel(false).0,
                epoch: AtomicU64::new(0),
            }),
        })
    }
}
