//! The layer of one route.

use std::fmt;
use std::sync::Arc;

use http::Request;
use tower_layer::Layer;

use super::hold::LeaseTtl;
use super::route::Route;
use super::service::Guard;
use super::shared::Shared;
use super::vary::Learned;
use crate::http::request;
use crate::keys::CacheKeys;
use crate::metrics::{RouteStats, Stats};
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
    pub(super) fn new(shared: Arc<Shared>, policy: Policy, learned: Arc<Learned>) -> Self {
        let stats = RouteStats::new(&policy.route);
        let label = metrics::SharedString::from(std::sync::Arc::<str>::from(policy.route.as_str()));
        crate::metrics::route_lease_ttl(label.clone(), policy.lease_ttl);
        let hashers = shared.keys.local_hashers(&policy.route);
        let policy_tags = policy.tags.iter().map(|t| shared.keys.tag_id(t)).collect();
        let (policy_ttl, policy_adaptive) = (policy.lease_ttl, policy.adaptive);
        Self {
            route: Arc::new(Route {
                hashers,
                shared,
                policy,
                stats,
                flights: Arc::default(),
                learned,
                recompute: Default::default(),
                tag_ids: policy_tags,
                lease_ttl: LeaseTtl::new(policy_ttl, policy_adaptive),
                label,
            }),
        }
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
    /// (the responses its `Vary` told apart), from L2 and from the L1 of every instance
    /// (through the notice channel), and from this process's L1 in any case. Only the
    /// method, URI and headers of `request` are read, and only those that are part of the
    /// key by the route's configuration: build one with
    /// `http::Request::get(uri).header("host", ...)`.
    ///
    /// Returns whether L2 held the entry. On a Redis error the local copy is gone but
    /// other instances keep theirs until it expires.
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
}

impl<S> Layer<S> for GuardLayer {
    type Service = Guard<S>;

    fn layer(&self, inner: S) -> Guard<S> {
        Guard::new(inner, self.route.clone())
    }
}
