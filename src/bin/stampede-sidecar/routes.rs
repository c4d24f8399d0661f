//! Which layer a request goes through: the route with the longest matching path prefix,
//! else the default policy, else (with `default = "pass"`) none.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Request};
use stampede_guard::{GuardLayer, StampedeGuard};
use tower::util::BoxCloneSyncService;
use tower::util::Oneshot;
use tower::{Layer, ServiceExt};

use crate::config::{SettingError, Settings};
use crate::peer::Peer;
use crate::upstream::{Upstream, strip_hop_by_hop};

type Route = BoxCloneSyncService<Request<Body>, Response, Infallible>;

/// The sidecar's service: one guard layer per route, all on one [`StampedeGuard`].
#[derive(Clone)]
pub(crate) struct Routes {
    /// Longest prefix first.
    routes: Arc<[(String, Route)]>,
    /// For requests that match no route.
    unrouted: Route,
    /// Each route's layer, in the same order (for purges by path); the default's last.
    layers: Arc<[(String, GuardLayer)]>,
    /// What vouches for the forwarding headers before the guard keys on them.
    upstream: Upstream,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field(
                "prefixes",
                &self.routes.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Routes {
    /// Makes each route's layer (the guard refuses a policy that does not fit its store,
    /// or a name used twice).
    pub(crate) fn new(
        guard: &StampedeGuard,
        settings: &Settings,
        upstream: &Upstream,
    ) -> Result<Self, SettingError> {
        let mut layers = Vec::with_capacity(settings.routes.len() + 1);
        let mut guarded =
            |prefix: &str, policy: &stampede_guard::Policy| -> Result<Route, SettingError> {
                let layer = guard
                    .layer(policy.clone())
                    .map_err(|e| settings.layer_error(policy.route(), &e))?;
                layers.push((prefix.to_owned(), layer.clone()));
                Ok(Route::new(
                    layer
                        .layer(upstream.service())
                        .map_response(IntoResponse::into_response),
                ))
            };
        let mut routes = Vec::with_capacity(settings.routes.len());
        for route in &settings.routes {
            routes.push((route.prefix.clone(), guarded(&route.prefix, &route.policy)?));
        }
        let unrouted = match &settings.default {
            // The empty prefix: every path.
            Some(policy) => guarded("", policy)?,
            None => Route::new(upstream.service().map_response(|mut response| {
                // Not cacheable by configuration, as a never-cached route says it.
                response
                    .headers_mut()
                    .insert("x-cache", HeaderValue::from_static("bypass"));
                response.into_response()
            })),
        };
        Ok(Self {
            routes: routes.into(),
            unrouted,
            layers: layers.into(),
            upstream: upstream.clone(),
        })
    }

    /// The layer a request for `path` goes through, if it is cached at all.
    pub(crate) fn layer(&self, path: &str) -> Option<&GuardLayer> {
        self.layers
            .iter()
            .find(|(prefix, _)| path.starts_with(prefix.as_str()))
            .map(|(_, layer)| layer)
    }

    fn route(&self, path: &str) -> &Route {
        self.routes
            .iter()
            .find(|(prefix, _)| path.starts_with(prefix.as_str()))
            .map_or(&self.unrouted, |(_, route)| route)
    }
}

impl tower::Service<Request<Body>> for Routes {
    type Response = Response;
    type Error = Infallible;
    type Future = Oneshot<Route, Request<Body>>;

    /// Always ready, as the guard is.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    /// The hop-by-hop headers, and those `Connection` lists, go before the guard sees
    /// the request: a header a client names in `Connection` (a keyed one) must not key
    /// the entry and then be missing from the fill, which would store the answer to a
    /// request without it under the key of a request with it. For the same reason what
    /// the request says of its client (`X-Forwarded-*`) is vouched for here, before the
    /// guard keys on it, never after (see `Upstream::vouch`).
    fn call(&mut self, mut request: Request<Body>) -> Self::Future {
        strip_hop_by_hop(request.headers_mut());
        let peer = request.extensions().get::<Peer>().copied();
        self.upstream.vouch(request.headers_mut(), peer);
        let route = self.route(request.uri().path()).clone();
        route.oneshot(request)
    }
}
