//! The layer of one route.

use std::fmt;
use std::sync::Arc;

use http::Request;
use tower_layer::Layer;

use super::invalidate::InvalidateError;
use super::route::Route;
use super::service::Guard;
use crate::http::request;
use crate::keys::CacheKeys;
use crate::metrics::Stats;
use crate::policy::Policy;
use crate::store::StoreError;

/// Applies a [`Guard`] with one route's policy. Made by
/// [`StampedeGuard::layer`](super::StampedeGuard::layer); cheap to clone.
#[derive(Clone)]
pub struct GuardLayer {
    route: Arc<Route>,
}

impl fmt::Debug for GuardLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardLayer")
            .field("policy", &self.route.policy)
            .finish_non_exhaustive()
    }
}

impl GuardLayer {
    pub(super) fn new(route: Arc<Route>) -> Self {
        Self { route }
    }

    /// The route's policy.
    pub fn policy(&self) -> &Policy {
        &self.route.policy
    }

    /// The TTL the route takes its leases with now: the policy's
    /// [`lease_ttl`](crate::policy::PolicyBuilder::lease_ttl), or, with
    /// [`adaptive_lease_ttl`](crate::policy::PolicyBuilder::adaptive_lease_ttl), what
    /// its measured hold times set.
    pub fn lease_ttl(&self) -> std::time::Duration {
        self.route.lease_ttl()
    }

    /// What the route has counted so far.
    pub fn stats(&self) -> Stats {
        self.route.stats.snapshot()
    }

    /// The Redis keys of the entry that `request` would be answered from (for
    /// debugging, and for looking at what the cache holds). `None` when the request is
    /// not cacheable by the route's rules.
    pub fn cache_keys<B>(&self, request: &Request<B>) -> Option<CacheKeys> {
        request::classify(&self.route.policy, request).ok()?;
        self.route.keys_for(request)
    }

    /// Removes the entry that `request` would be answered from, and every variant of it
    /// (the responses its `Vary` told apart, and those of every value of the route's
    /// [`key_headers`](crate::policy::PolicyBuilder::key_headers)), from L2 and from the
    /// L1 of every instance (through the notice channel), and from this process's L1 in
    /// any case. Only the URI and the host of `request` are read (the host if the route
    /// keys on it): build one with `http::Request::get(uri).header("host", ...)`. To
    /// know how many entries went, see [`invalidate_path`](Self::invalidate_path).
    ///
    /// Returns whether L2 held an entry of it (its own or a variant's); without Redis,
    /// always `true`. On a Redis error the local copy is gone but other instances keep
    /// theirs until it expires.
    ///
    /// ```no_run
    /// # async fn run(items: stampede_guard::GuardLayer) -> Result<(), Box<dyn std::error::Error>> {
    /// // Keep a clone of the route's layer where the application changes item 7.
    /// let request = http::Request::get("/items/7")
    ///     .header("host", "shop.example")
    ///     .body(())?;
    /// let was_cached = items.invalidate(&request).await?;
    /// # let _ = was_cached;
    /// # Ok(()) }
    /// ```
    pub async fn invalidate<B>(&self, request: &Request<B>) -> Result<bool, StoreError> {
        self.route.invalidate(request).await
    }

    /// Removes every entry of the URL `uri` names, whatever the headers of the requests
    /// that filled them: each variant its `Vary` told apart and each value of the
    /// route's [`key_headers`](crate::policy::PolicyBuilder::key_headers), from L2 and
    /// from the L1 of every instance (through the notice channel), and from this
    /// process's L1 in any case. Returns how many entries it removed: those L2 held, or
    /// without Redis, those this process's L1 held (counting them goes through all of
    /// L1: this is for an operator or an application that changed the data, not for
    /// every request).
    ///
    /// `uri` is a path from `/` with its query (`/items/7?page=2`), keyed as the route
    /// keys requests (only its keyed query parameters count), or an absolute URI
    /// (`https://shop.example/items/7?page=2`), whose authority is the host. On a route
    /// that keys on the host ([`key_host`](crate::policy::PolicyBuilder::key_host), the
    /// default), a path alone is refused ([`InvalidateError::HostNeeded`]): whose
    /// entries it meant is unknown.
    ///
    /// This works because a route's keyed headers are part of a request's variant, as
    /// the headers a URL learns from `Vary` are, not of its URL's identity: every entry
    /// of a URL shares its hash slot and its invalidation, and each variant written is
    /// listed beside the URL's entries (as a keyed hash), so that the invalidation, one
    /// Lua script, deletes and counts them without a scan.
    ///
    /// On a Redis error ([`InvalidateError::Store`]) this process's copies are gone but
    /// L2 and the other instances keep theirs until they expire.
    ///
    /// ```no_run
    /// # async fn run(items: stampede_guard::GuardLayer) -> Result<(), Box<dyn std::error::Error>> {
    /// // Item 7 changed: its page 2, in every language and encoding, on every instance.
    /// let removed = items
    ///     .invalidate_path("https://shop.example/items/7?page=2")
    ///     .await?;
    /// println!("{removed} entries removed");
    /// # Ok(()) }
    /// ```
    ///
    /// ```
    /// # use stampede_guard::{InvalidateError, KeySpace, Policy, RedisStore, StampedeGuard};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let keys = KeySpace::builder().env("doc").service("shop")
    /// #     .secret("a secret of sixteen bytes or more").build()?;
    /// let guard = StampedeGuard::builder(RedisStore::local_only(), keys).build()?;
    /// let items = guard.layer(Policy::builder("items").build()?)?;
    /// // The route keys on the host: a path alone does not say whose entries.
    /// let refused = items.invalidate_path("/items/7").await;
    /// assert!(matches!(refused, Err(InvalidateError::HostNeeded { .. })));
    /// // Nothing was cached yet.
    /// assert_eq!(items.invalidate_path("http://shop.example/items/7").await?, 0);
    /// # Ok(()) }
    /// ```
    pub async fn invalidate_path(&self, uri: &str) -> Result<u64, InvalidateError> {
        self.route.invalidate_path(uri).await
    }
}

impl<S> Layer<S> for GuardLayer {
    type Service = Guard<S>;

    fn layer(&self, inner: S) -> Guard<S> {
        Guard::new(inner, self.route.clone())
    }
}
