//! Typed values through the fill engine: [`Values::get_or_fetch`].
//!
//! A value computed from a database or an upstream (a price, an exchange rate, a
//! user's permissions) is filled as an HTTP answer is: the same lease, fenced write,
//! notices, cold waits, back-off, stale-if-error, soft timeout, early refresh, tags,
//! invalidation and local-only mode, with the same metrics under the cache's name. The
//! fetch is the engine's origin (see `fetch`); what each caller gets from how a fill
//! landed is the engine's one decision (`reply`), carried out here as a value.
//!
//! * A key is any [`Serialize`] value, encoded with postcard (whatever the values'
//!   codec): stable across processes and machines while the key's type keeps its
//!   shape. With a digest of the codec's name and the value's type name, and the route's
//!   [`version`](crate::policy::PolicyBuilder::version), it is the identity of the entry,
//!   hashed with the key space's secret as every key is (never in Redis as it is).
//! * L1 holds the value decoded, behind an `Arc`: a hit hands out a clone of it, with no
//!   decoding and no copy. L1 weighs the entry by its encoded size.
//! * L2 holds it encoded by the handle's [`Codec`] ([`Postcard`] unless another is
//!   given). Bytes that do not decode (garbage, or a value of the type before a rolling
//!   deploy changed it, with the same version) are a miss: the entry is invalidated
//!   and the value fetched again, never a panic.

mod cache;
mod codec;
mod error;
mod fetch;
mod found;
mod get;
mod layer;
mod miss;
#[cfg(test)]
mod tests;

use std::convert::Infallible;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use self::cache::Cache;
use self::fetch::Fetch;
use self::miss::Look;
use crate::guard::route::Route;
use crate::metrics::{Event, Stats};
use crate::store::StoreError;

pub use self::cache::MAX_KEY;
#[cfg(feature = "json")]
pub use self::codec::Json;
pub use self::codec::{Codec, CodecError, Postcard};
pub use self::error::{NoValue, ValueError};
pub use self::layer::{ValueLayer, ValueService};

/// Typed values of one type `V`, cached under one route's policy: made by
/// [`StampedeGuard::values`](crate::StampedeGuard::values); cheap to clone.
///
/// ```no_run
/// use std::time::Duration;
/// use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// # let keys = KeySpace::builder().env("doc").service("fx")
/// #     .secret("a secret of sixteen bytes or more").build()?;
/// let guard = StampedeGuard::builder(RedisStore::builder("redis://127.0.0.1").build()?, keys)
///     .build()?;
/// let rates = guard.values::<f64>(Policy::builder("rates").fresh_ttl(Duration::from_secs(30)).build()?)?;
/// let eur = rates
///     .get_or_fetch("EUR", || async { Ok::<_, std::io::Error>(1.08) })
///     .await?;
/// assert_eq!(*eur, 1.08);
/// # Ok(()) }
/// ```
pub struct Values<V, C = Postcard> {
    cache: Arc<Cache<C>>,
    value: PhantomData<fn() -> V>,
}

impl<V, C> Clone for Values<V, C> {
    fn clone(&self) -> Self {
        Self {
            cache: self.cache.clone(),
            value: PhantomData,
        }
    }
}

impl<V, C: Codec> std::fmt::Debug for Values<V, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Values")
            .field("route", &self.cache.route.policy.route)
            .field("type", &std::any::type_name::<V>())
            .field("codec", &C::NAME)
            .finish_non_exhaustive()
    }
}

impl<V, C> Values<V, C>
where
    V: Serialize + DeserializeOwned + Send + Sync + 'static,
    C: Codec,
{
    pub(crate) fn new(route: Arc<Route>, codec: C) -> Self {
        let cache = Cache::new::<V>(route, Arc::new(codec));
        Self {
            cache: Arc::new(cache),
            value: PhantomData,
        }
    }

    /// The value of `key`: a fresh one at once (from L1, or else from Redis); a stale
    /// one at once while one caller in the fleet refreshes it in the background (with a
    /// clone of `fetch`); for a key nothing is cached for, one call of `fetch` for the
    /// fleet, which every other caller waits for (on another instance, at most the
    /// route's cold wait, woken by its notice).
    ///
    /// A fetch for the fleet (a fill or a refresh) runs in a task of its own, bounded by
    /// the route's refresh timeout: a caller that goes away does not cancel it, and it
    /// is `Clone + Send + 'static` (clone what it needs into it), since a refresh calls
    /// a clone of it later, in the background. Where the guard cannot share one (a fill
    /// it was too late to join, a key the key space cannot hash), the caller fetches on
    /// its own, in its own task, bounded by the route's pass timeout, uncached. Its error is never cached: the caller whose fetch failed gets it
    /// ([`ValueError::Fetch`]); the others that waited for that fetch get
    /// [`NoValue::OtherFetchFailed`]; a stale value within the route's
    /// `stale_if_error` stands in for both, and the fleet leaves the key alone for the
    /// route's error back-off.
    pub async fn get_or_fetch<K, F, Fut, E>(
        &self,
        key: &K,
        fetch: F,
    ) -> Result<Arc<V>, ValueError<E>>
    where
        K: Serialize + ?Sized,
        F: FnOnce() -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<V, E>> + Send + 'static,
        E: Send + 'static,
    {
        let keyed = self.cache.keyed(key).map_err(ValueError::Guard)?;
        self.cache.get_or_fetch(keyed, fetch).await
    }

    /// Puts `value` in the caches as the value of `key`, for a caller that has it
    /// already (it just wrote it where the fetch reads it): what the key held is
    /// invalidated first, here and in the fleet, so that no fill that began before
    /// stores an older value over it; then `value` is filled as a fetch's would be, at
    /// once (nothing is looked up first): written to Redis under the key's lease,
    /// fenced, or, when the lease cannot be had (Redis fails, or the fleet backs off
    /// the key), kept in this process's L1 only. Returns the value the key holds now:
    /// `value`, or that of another instance's fill that took the lease after the
    /// invalidation (and so read what the caller wrote).
    pub async fn set<K>(&self, key: &K, value: V) -> Result<Arc<V>, ValueError<Infallible>>
    where
        K: Serialize + ?Sized,
        V: Clone,
    {
        let cache = &self.cache;
        let keyed = cache.keyed(key).map_err(ValueError::Guard)?;
        if let Err(error) = cache.route.invalidate(&keyed.request()).await {
            cache.route.stats.record(Event::RedisError);
            tracing::debug!(%error, "invalidating before a set: other instances keep theirs");
        }
        let fetch = Fetch {
            fetch: move || async move { Ok::<V, Infallible>(value) },
            codec: cache.codec.clone(),
        };
        cache.past_l1(&keyed, None, fetch, Look::Skip).await
    }

    /// Removes the value of `key` from Redis and from the L1 of every instance
    /// (through the notice channel), and from this process's L1 in any case; a fill that
    /// began before is not stored over it, and a caller here that comes after this
    /// returns gets what was filled since. Returns whether Redis held it; without Redis,
    /// `true`. On a Redis error, the local copy is gone but the other instances keep
    /// theirs until it expires.
    pub async fn invalidate<K: Serialize + ?Sized>(&self, key: &K) -> Result<bool, StoreError> {
        let Ok(keyed) = self.cache.keyed(key) else {
            // (Such a key was never cached.)
            return Ok(false);
        };
        self.cache.route.invalidate(&keyed.request()).await
    }

    /// A Tower layer over any service whose request gives a key (`key`, of the
    /// request) and whose response is a `V`: each call is a
    /// [`get_or_fetch`](Self::get_or_fetch) of the request's key, fetched with a clone
    /// of the service (see [`ValueService`]).
    ///
    /// ```
    /// # use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
    /// use tower::{Layer, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let keys = KeySpace::builder().env("doc").service("fx")
    /// #     .secret("a secret of sixteen bytes or more").build()?;
    /// let guard = StampedeGuard::builder(RedisStore::local_only(), keys).build()?;
    /// let rates = guard.values::<f64>(Policy::builder("rates").build()?)?;
    /// // Any service: here a plain function of a currency code.
    /// let upstream = service_fn(|currency: String| async move {
    ///     Ok::<_, std::io::Error>(if currency == "EUR" { 1.08 } else { 1.0 })
    /// });
    /// let cached = rates.layer(|currency: &String| currency.clone()).layer(upstream);
    /// let eur = cached.oneshot("EUR".to_owned()).await?;
    /// assert_eq!(*eur, 1.08);
    /// # Ok(()) }
    /// ```
    pub fn layer<Req, KF, K>(&self, key: KF) -> ValueLayer<V, KF, C>
    where
        KF: Fn(&Req) -> K,
        K: Serialize,
    {
        ValueLayer {
            cache: self.cache.clone(),
            key: Arc::new(key),
            value: PhantomData,
        }
    }

    /// The Redis keys of the value of `key` (for debugging, and for looking at what the
    /// cache holds); `None` for a key over [`MAX_KEY`], or a key space whose keys would
    /// be too long.
    pub fn cache_keys<K: Serialize + ?Sized>(&self, key: &K) -> Option<crate::keys::CacheKeys> {
        let keyed = self.cache.keyed(key).ok()?;
        self.cache.route.keys_for(&keyed.request())
    }

    /// What the cache has counted so far (its metrics carry its name as `route`).
    pub fn stats(&self) -> Stats {
        self.cache.route.stats.snapshot()
    }

    /// The cache's policy.
    pub fn policy(&self) -> &crate::Policy {
        &self.cache.route.policy
    }
}
