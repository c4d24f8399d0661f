//! The handle of a guard ([`StampedeGuard`]) and its builder: what an application makes
//! once, and the layers it makes for each route.

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;

use super::budget::Budget;
use super::layer::GuardLayer;
use super::marks::Marks;
use super::purge::Purges;
use super::route::Route;
use super::shared::Shared;
use super::values::{Codec, Postcard, Values};
use super::vary::Learned;
use crate::cache::{L1, new_tombstones};
use crate::error::ConfigError;
use crate::keys::KeySpace;
use crate::lease::LeaseClient;
use crate::notify::Notices;
use crate::notify::Purge;
use crate::policy::Policy;
use crate::store::{RedisStore, StoreError, StoreErrorKind};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Default L1 capacity, in bytes of entries.
pub const DEFAULT_L1_CAPACITY: u64 = 64 * 1024 * 1024;

/// The default of [`GuardBuilder::l1_max_variants`]: more than a response that varies
/// on its encoding and its language has (five encodings of fifty languages are 250),
/// far fewer than clients can make of a header they control.
pub const DEFAULT_L1_MAX_VARIANTS: usize = 256;

/// Default refresh budget: refreshes and cold fills of one guard at work at once.
pub const DEFAULT_REFRESH_BUDGET: usize = 64;

/// Default fill memory: the bytes the streams of every fill in flight in the process may
/// hold together (256 MiB). Sixteen answers of the default `max_body` held whole while
/// they are stored, or 256 windows of answers that are not; a process that serves more
/// at once sheds the rest to small windows, not to its memory.
pub const DEFAULT_FILL_MEMORY: u64 = 256 * 1024 * 1024;

/// Default purge capacity: how many tags' last purges a guard keeps (twice a hundred
/// thousand tags purged in the three days a purge matters, in about 9 MiB).
pub const DEFAULT_PURGE_CAPACITY: usize = 200_000;

/// The shared handle: Redis, keys, the L1 cache and the notice subscription. Cheap to
/// clone; make one per process and a [`GuardLayer`] per route from it.
///
/// ```no_run
/// use std::time::Duration;
/// use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
///
/// # fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let keys = KeySpace::builder()
///     .env("prod")
///     .service("catalog")
///     .secret("a secret of 16 bytes or more")
///     .build()?;
/// let store = RedisStore::builder("redis://127.0.0.1:6379").build()?;
/// let guard = StampedeGuard::builder(store, keys)
///     .l1_capacity(256 * 1024 * 1024)
///     .build()?;
/// let items = guard.layer(Policy::builder("items").fresh_ttl(Duration::from_secs(5)).build()?)?;
/// # let _ = items;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct StampedeGuard {
    shared: Arc<Shared>,
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
            l1_max_variants: DEFAULT_L1_MAX_VARIANTS,
            refresh_budget: DEFAULT_REFRESH_BUDGET,
            fill_memory: DEFAULT_FILL_MEMORY,
            purge_capacity: DEFAULT_PURGE_CAPACITY,
            instance_id: None,
        }
    }

    /// Makes the layer of one route. Refused, naming the field, when the policy does not
    /// fit the store (lease TTLs against the command timeout), or when the guard already
    /// made a layer for a route of that name (their metrics and keys would merge: clone
    /// the [`GuardLayer`] to put one route's layer in several places).
    pub fn layer(&self, policy: Policy) -> Result<GuardLayer, ConfigError> {
        Ok(GuardLayer::new(self.route(policy)?))
    }

    /// Makes a cache of typed values `V` under `policy` (its route's name is the cache's,
    /// in keys and metrics), kept in Redis with [`Postcard`](crate::guard::Postcard):
    /// see [`Values`]. Refused, naming the field, as [`layer`](Self::layer) refuses a
    /// policy, and for what values cannot have: `follow_origin` (a value has no
    /// `Cache-Control` to follow), `key_headers` (nor headers) and `never_cache`.
    pub fn values<V>(&self, policy: Policy) -> Result<Values<V>, ConfigError>
    where
        V: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        self.values_with(policy, Postcard)
    }

    /// As [`values`](Self::values), kept in Redis with another [`Codec`] (such as
    /// [`Json`](crate::guard::Json), with the `json` feature).
    pub fn values_with<V, C>(&self, policy: Policy, codec: C) -> Result<Values<V, C>, ConfigError>
    where
        V: Serialize + DeserializeOwned + Send + Sync + 'static,
        C: Codec,
    {
        if policy.follow_origin {
            let why = "a typed value has no `Cache-Control` to follow";
            return Err(ConfigError::invalid("follow_origin", why));
        }
        if !policy.key_headers.is_empty() {
            return Err(ConfigError::invalid(
                "key_headers",
                "a typed value has no headers",
            ));
        }
        Ok(Values::new(self.route(policy)?, codec))
    }

    /// The route of `policy`, checked against the store and against the guard's other
    /// routes (see [`layer`](Self::layer)).
    pub(crate) fn route(&self, policy: Policy) -> Result<Arc<Route>, ConfigError> {
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
            let learned = Arc::new(Learned::new(&policy.key_headers));
            routes.insert(policy.route.clone(), learned.clone());
            learned
        };
        Ok(Arc::new(Route::new(self.shared.clone(), policy, learned)))
    }

    /// Opens a Redis connection and the notice subscription, waiting at most the store's
    /// connect timeout for each, then waits as long again for the tag purges recorded
    /// in Redis to be read back (see [`purges_caught_up`](Self::purges_caught_up)). Not
    /// needed (the guard connects on first use), but lets a service start warm, and
    /// lets tests know other instances will hear this one's notices. A read-back that
    /// takes longer goes on in the background: that is not an error.
    pub async fn ready(&self) -> Result<(), StoreError> {
        if self.shared.store.is_local_only() {
            return Ok(());
        }
        self.shared.store.ping().await?;
        self.shared.ensure_listening();
        let mut subscribed = self.shared.notices.subscription();
        match tokio::time::timeout(
            self.shared.store.connect_timeout() * 2,
            subscribed.wait_for(|up| *up),
        )
        .await
        {
            Ok(Ok(_)) => {
                let mut caught_up = self.shared.purges.caught_up_changes();
                let _ = tokio::time::timeout(
                    self.shared.store.connect_timeout() * 2,
                    caught_up.wait_for(|caught_up| *caught_up),
                )
                .await;
                Ok(())
            }
            _ => Err(StoreError::new(
                crate::store::Operation::Subscribe,
                StoreErrorKind::NoConnection,
                None,
            )),
        }
    }

    /// Whether the guard shares the fleet's cache now, or serves from this process
    /// alone, and why. Local-only answers also say so in `Cache-Status`
    /// (`detail=local-only`) while Redis is unavailable.
    ///
    /// ```
    /// use stampede_guard::{KeySpace, LocalOnly, Mode, RedisStore, StampedeGuard};
    ///
    /// let keys = KeySpace::builder().env("dev").service("docs")
    ///     .secret(b"a secret of sixteen bytes or more".to_vec()).build()?;
    /// let guard = StampedeGuard::builder(RedisStore::local_only(), keys).build()?;
    /// assert_eq!(guard.mode(), Mode::LocalOnly(LocalOnly::NoRedis));
    /// # Ok::<(), stampede_guard::ConfigError>(())
    /// ```
    pub fn mode(&self) -> Mode {
        let store = &self.shared.store;
        if store.is_local_only() {
            Mode::LocalOnly(LocalOnly::NoRedis)
        } else if store.circuit_open() {
            Mode::LocalOnly(LocalOnly::RedisUnavailable)
        } else {
            Mode::Shared
        }
    }

    /// Whether the guard hears other instances' notices (fills, invalidations) now. Off
    /// before the first request (or [`ready`](Self::ready)), while Redis cannot be
    /// reached, and always for a local-only store. For health pages: an instance that
    /// does not hear them serves what it holds, but learns of invalidations late.
    pub fn notices_connected(&self) -> bool {
        self.shared.notices.is_subscribed()
    }

    /// Whether the guard knows every tag purge recorded in Redis: its notice
    /// subscription is up and the purges recorded while it was down (or, the first
    /// time, in the last three days) were read back. Until they are, entries with tags
    /// filled before the subscription came up are served stale (and refreshed once for
    /// the fleet), never as fresh. Always true for a local-only store. For health pages
    /// and tests.
    pub fn purges_caught_up(&self) -> bool {
        self.shared.store.is_local_only()
            || (self.shared.notices.is_subscribed() && self.shared.purges.is_caught_up())
    }

    /// How many entries L1 holds (approximate: moka counts lazily).
    pub fn l1_entries(&self) -> u64 {
        self.shared.l1.entry_count()
    }

    /// How many bytes of entries L1 holds (approximate).
    pub fn l1_bytes(&self) -> u64 {
        self.shared.l1.weighted_size()
    }

    /// How many bytes the streams of the fills in flight hold now, out of its
    /// [`fill_memory`](GuardBuilder::fill_memory).
    pub fn fill_bytes(&self) -> u64 {
        self.shared.fill_memory.held()
    }

    /// How many variants L1 dropped so far past its cap of variants per URL
    /// ([`GuardBuilder::l1_max_variants`]); also exported as
    /// [`L1_VARIANTS_DROPPED`](crate::metrics::L1_VARIANTS_DROPPED).
    pub fn l1_variants_dropped(&self) -> u64 {
        self.shared.l1.variants_dropped()
    }

    /// Waits at most `within` until no refresh and no cold fill of this guard is at work
    /// (every slot of the refresh budget is back: each refresh or fill that took one has
    /// ended, its entry written to Redis and L1 or given up), and returns whether that
    /// happened in time. For a
    /// graceful shutdown: stop taking requests, let those in flight finish, then call
    /// this before the runtime goes, so that background refreshes are not cut off
    /// halfway (their leases would be left to expire, the fleet's entries not renewed).
    ///
    /// It takes no slot: refreshes that start while it waits get theirs, and it waits
    /// for them too. A cold fill that went ahead without a slot (the budget was spent
    /// for its whole cold wait) is not counted; its callers are waiting for it, so it is
    /// in flight as long as they are.
    pub async fn drained(&self, within: Duration) -> bool {
        self.shared.budget.idle_within(within).await
    }

    /// The store.
    pub fn store(&self) -> &RedisStore {
        &self.shared.store
    }

    /// Purges every entry tagged with any of `tags`, on every route and every instance
    /// of the fleet, in one call, without a list of keys (see [`Purge`]):
    /// `Purge::Hard` makes them gone,
    /// `Purge::Soft` stale (served while one caller in the fleet refreshes each). An
    /// entry's tags are what its answer named in `Surrogate-Key` (space-separated) and
    /// `Cache-Tag` (comma-separated), and its route's
    /// [`tags`](crate::policy::PolicyBuilder::tags).
    ///
    /// Takes effect in this process at once, and on the others when they hear it (or,
    /// if their subscription is down, when it comes back). On a Redis error, only
    /// this process purges, and the error says so.
    ///
    /// ```no_run
    /// # async fn run(guard: stampede_guard::StampedeGuard) -> Result<(), Box<dyn std::error::Error>> {
    /// use stampede_guard::Purge;
    ///
    /// // Product 42 changed: every page that showed it, on every route and instance.
    /// guard.purge_tags(["product-42"], Purge::Hard).await?;
    /// // A new price list: old pages may be served while each is refreshed once.
    /// guard.purge_tags(["prices"], Purge::Soft).await?;
    /// # Ok(()) }
    /// ```
    pub async fn purge_tags<I, T>(&self, tags: I, how: Purge) -> Result<(), StoreError>
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        let shared = &self.shared;
        let ids: Vec<String> = tags
            .into_iter()
            .map(|tag| shared.keys.tag_id(tag.as_ref()))
            .collect();
        if ids.is_empty() {
            return Ok(());
        }
        let result = if shared.store.is_local_only() {
            Ok(shared.clock.now_micros())
        } else {
            // Records matter as long as an entry may be kept: three days at most.
            let retention = Duration::from_secs(3 * 24 * 3600);
            crate::cache::purge(
                &shared.store,
                &shared.keys,
                shared.notices.channel(),
                how == Purge::Soft,
                retention,
                &ids,
            )
            .await
        };
        let at = match &result {
            Ok(at) => {
                shared.clock.learn(*at);
                *at
            }
            Err(_) => shared.clock.now_micros(),
        };
        for id in &ids {
            shared.purges.note(id, how, at);
        }
        shared.purges.report();
        crate::metrics::purged(how.as_str(), ids.len());
        result.map(|_| ())
    }
}

/// Builds a [`StampedeGuard`].
#[must_use]
pub struct GuardBuilder {
    store: RedisStore,
    keys: KeySpace,
    l1_capacity: u64,
    l1_max_variants: usize,
    refresh_budget: usize,
    fill_memory: u64,
    purge_capacity: usize,
    instance_id: Option<String>,
}

impl fmt::Debug for GuardBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardBuilder")
            .field("l1_capacity", &self.l1_capacity)
            .field("l1_max_variants", &self.l1_max_variants)
            .field("refresh_budget", &self.refresh_budget)
            .field("fill_memory", &self.fill_memory)
            .field("purge_capacity", &self.purge_capacity)
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

    /// How many variants of one URL L1 holds at most (default
    /// [`DEFAULT_L1_MAX_VARIANTS`], 256): the entries its `Vary` or its route's keyed
    /// headers tell apart. A route that varies on a header clients control
    /// (`User-Agent`, a free-form `Accept-Language`) could otherwise fill L1 with one
    /// URL. Past the cap, the variant read or put least recently is dropped (from L1
    /// only: Redis keeps it), and counted as
    /// [`L1_VARIANTS_DROPPED`](crate::metrics::L1_VARIANTS_DROPPED).
    pub fn l1_max_variants(mut self, variants: usize) -> Self {
        self.l1_max_variants = variants;
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

    /// How many bytes the streams of every fill in flight (cold fills and refreshes, of
    /// every route) may hold together (default [`DEFAULT_FILL_MEMORY`], 256 MiB; at
    /// least 1 MiB). A fill holds its answer's body whole while it may be stored (at
    /// most its route's `max_body`), and a window of it beyond its slowest reader once
    /// it will not be. One that cannot take its bytes from this memory goes on with a
    /// 64 KiB window for the callers it has, is shared with no more of them, and is not
    /// stored (a refresh stops, and the entry stays). Counted by the gauge
    /// [`FILL_BYTES`](crate::metrics::FILL_BYTES), and the fills turned away by
    /// [`FILL_STREAMS`](crate::metrics::FILL_STREAMS) `result="over_memory"`.
    pub fn fill_memory(mut self, bytes: u64) -> Self {
        self.fill_memory = bytes;
        self
    }

    /// How many tags' last purges the guard keeps (default 200,000; at least 8): about
    /// 45 bytes each, counted by the gauges `stampede_guard_purge_tags` and
    /// `stampede_guard_purge_bytes`. Past it, the eighth purged longest ago are folded
    /// into one *floor* for every tag: an entry that has any tag and was filled before
    /// the newest of those purges counts as purged (hard, if one of them was hard). That
    /// never serves a purged entry as unpurged; it fills (or refreshes) once more
    /// entries of other tags as old. Purges older than the longest an entry is kept
    /// (three days) hide nothing and go first.
    pub fn purge_capacity(mut self, tags: usize) -> Self {
        self.purge_capacity = tags;
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
        if self.l1_max_variants == 0 {
            return Err(ConfigError::Zero {
                field: "l1_max_variants",
            });
        }
        if self.refresh_budget == 0 {
            return Err(ConfigError::Zero {
                field: "refresh_budget",
            });
        }
        if self.fill_memory < 1024 * 1024 {
            return Err(ConfigError::invalid(
                "fill_memory",
                "must be at least 1 MiB",
            ));
        }
        if self.purge_capacity < 8 {
            return Err(ConfigError::invalid("purge_capacity", "must be at least 8"));
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
        // The clock entries are aged by calibrates itself the first time it is read:
        // here, rather than on the first request.
        let _ = crate::cache::Instant::now();
        let channel = self.keys.channel();
        let purges_key = self.keys.purges_by_time_key();
        if self.store.is_local_only() {
            tracing::info!(
                "no Redis: running local-only (L1 and one origin call per key per process)"
            );
        }
        Ok(StampedeGuard {
            shared: Arc::new(Shared {
                store: self.store,
                keys: self.keys,
                leases,
                l1: L1::new(self.l1_capacity, self.l1_max_variants),
                tombstones: new_tombstones(),
                notices: Notices::new(channel, purges_key),
                purges: Purges::new(self.purge_capacity),
                clock: super::clock::FleetClock::default(),
                marks: Marks::default(),
                budget: Budget::new(self.refresh_budget),
                fill_memory: Arc::new(super::fill_memory::FillMemory::new(self.fill_memory)),
                routes: Mutex::default(),
                refreshing: Mutex::default(),
                epoch: AtomicU64::new(0),
            }),
        })
    }
}

/// Whether a guard shares the fleet's cache ([`StampedeGuard::mode`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// Entries, leases and notices go through Redis: one fill per key for the fleet.
    Shared,
    /// L1 and the local single-flight only: one fill per key per process.
    LocalOnly(LocalOnly),
}

/// Why a guard serves from its process alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LocalOnly {
    /// Its store has no Redis ([`RedisStore::local_only`]).
    NoRedis,
    /// Redis failed repeatedly and the circuit breaker is open: the guard probes it and
    /// goes back to [`Mode::Shared`] by itself once it answers. The log says why (once,
    /// at `warn`, when it opened).
    RedisUnavailable,
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use bytes::Bytes;
    use futures_util::FutureExt;
    use http_body_util::{BodyExt, Full};
    use tower::{Layer, ServiceExt};

    use super::*;
    use crate::lease::FencingToken;
    use crate::notify::Hears;

    fn get() -> http::Request<Full<Bytes>> {
        http::Request::get("/items/1")
            .header("host", "shop.example")
            .body(Full::default())
            .unwrap()
    }

    /// How a fill's put into L1 meets an invalidation between its last look at the
    /// tombstones and moka's insert: on the notice path (what another instance's
    /// invalidation does here) and on the local one without Redis. Either way the entry
    /// it invalidated is not served again: the next request calls the origin.
    #[tokio::test]
    async fn an_invalidation_that_races_a_fill_wins_on_every_path() {
        for notice in [true, false] {
            let keys = KeySpace::builder()
                .env("test")
                .service("race")
                .secret(b"a test secret of more than sixteen bytes".to_vec())
                .build()
                .unwrap();
            let guard = StampedeGuard::builder(RedisStore::local_only(), keys)
                .build()
                .unwrap();
            let layer = guard
                .layer(
                    Policy::builder("items")
                        .fresh_ttl(Duration::from_secs(60))
                        .build()
                        .unwrap(),
                )
                .unwrap();
            let calls = Arc::new(AtomicU64::new(0));
            let counted = calls.clone();
            let service = layer.layer(tower::service_fn(move |_: http::Request<Full<Bytes>>| {
                let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                async move {
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from(
                        format!("version {n}"),
                    ))))
                }
            }));
            let local = layer.cache_keys(&get()).unwrap().local;
            let shared = Arc::downgrade(&guard.shared);
            let invalidating = layer.clone();
            *guard.shared.l1.before_insert.lock().unwrap() = Some(Box::new(move || {
                if notice {
                    let token = FencingToken::new(crate::guard::purge::local_micros() + 1_000_000);
                    shared.upgrade().unwrap().invalidated(Some(local), token);
                } else {
                    let done = invalidating.invalidate(&get()).now_or_never();
                    assert!(matches!(done, Some(Ok(true))), "{done:?}");
                }
            }));
            let body = |response: http::Response<_>| async move {
                let bytes = BodyExt::collect(response.into_body()).await.unwrap();
                String::from_utf8(bytes.to_bytes().to_vec()).unwrap()
            };
            let first = service.clone().oneshot(get()).await.unwrap();
            assert_eq!(body(first).await, "version 1");
            assert!(guard.shared.l1.before_insert.lock().unwrap().is_none());
            let second = service.clone().oneshot(get()).await.unwrap();
            assert_eq!(body(second).await, "version 2", "notice: {notice}");
            let third = service.clone().oneshot(get()).await.unwrap();
            assert_eq!(body(third).await, "version 2", "a hit after the race");
            assert_eq!(calls.load(Ordering::SeqCst), 2);
        }
    }
}
