use std::fmt;
use std::sync::Arc;

use http::Request;
use tower_layer::Layer;

use super::Shared;
use super::flight::Flights;
use super::service::Guard;
use crate::cache::{L1, l2_invalidate};
use crate::keys::CacheKeys;
use crate::metrics::{RouteStats, Stats};
use crate::policy::Policy;
use crate::rules;
use crate::store::StoreError;

/// Applies a [`Guard`] with one route's policy. Made by
/// [`StampedeGuard::layer`](super::StampedeGuard::layer); cheap to clone.
#[derive(Clone)]
pub struct GuardLayer {
    route: Arc<Route>,
}

/// What every request of a route shares.
pub(crate) struct Route {
    pub(crate) shared: Arc<Shared>,
    pub(crate) policy: Policy,
    pub(crate) stats: RouteStats,
}

impl Route {
    /// The keys of a request. Fails only for a key space whose key would be too long.
    pub(crate) fn keys_for<B>(&self, request: &Request<B>) -> Option<CacheKeys> {
        let identity = rules::identity(&self.policy, request);
        self.shared.keys.cache(&self.policy.route, &identity).ok()
    }

    pub(crate) fn l1(&self) -> &L1 {
        &self.shared.l1
    }
}

impl fmt::Debug for GuardLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardLayer")
            .field("policy", &self.route.policy)
            .finish_non_exhaustive()
    }
}

impl GuardLayer {
    pub(super) fn new(shared: Arc<Shared>, policy: Policy) -> Self {
        let stats = RouteStats::new(&policy.route);
        Self {
            route: Arc::new(Route {
                shared,
                policy,
                stats,
            }),
        }
    }

    /// The route's policy.
    pub fn policy(&self) -> &Policy {
        &self.route.policy
    }

    /// What the route has counted so far.
    pub fn stats(&self) -> Stats {
        self.route.stats.snapshot()
    }

    /// The Redis keys of the entry that `request` would be answered from (for
    /// debugging, and for looking at what the cache holds). `None` when the request is
    /// not cacheable by the route's rules.
    pub fn cache_keys<B>(&self, request: &Request<B>) -> Option<CacheKeys> {
        rules::classify(&self.route.policy, request).ok()?;
        self.route.keys_for(request)
    }

    /// Removes the entry that `request` would be answered from, from L2 and from the L1
    /// of every instance (through the notice channel), and from this process's L1 in any
    /// case. Only the method, URI and headers of `request` are read: build one with
    /// `http::Request::get(uri).header("host", ...)`.
    ///
    /// Returns whether L2 held the entry. On a Redis error the local copy is gone but
    /// other instances keep theirs until it expires.
    pub async fn invalidate<B>(&self, request: &Request<B>) -> Result<bool, StoreError> {
        let Some(keys) = self.route.keys_for(request) else {
            return Ok(false);
        };
        self.route.l1().invalidate(keys.entry()).await;
        let shared = &self.route.shared;
        l2_invalidate(&shared.store, keys.entry(), &shared.channel).await
    }
}

impl<S> Layer<S> for GuardLayer {
    type Service = Guard<S>;

    fn layer(&self, inner: S) -> Guard<S> {
        Guard::new(inner, self.route.clone(), Arc::new(Flights::default()))
    }
}
