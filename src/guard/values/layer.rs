//! A Tower layer over any service whose request gives a key and whose response is a
//! serde value (a database client, a gRPC client, a pricing service): each call is
//! [`Values::get_or_fetch`](super::Values::get_or_fetch) of the request's key, fetched
//! with a clone of the service (`oneshot`, so each fetch waits for its own clone to be
//! ready, and a hit never waits for the service's readiness).

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tower::ServiceExt;
use tower_layer::Layer;
use tower_service::Service;

use super::cache::Cache;
use super::codec::Codec;
use super::error::{Answer, ValueError};

/// Applies a [`ValueService`]: made by [`Values::layer`](super::Values::layer).
pub struct ValueLayer<V, KF, C> {
    pub(crate) cache: Arc<Cache<C>>,
    pub(crate) key: Arc<KF>,
    pub(crate) value: PhantomData<fn() -> V>,
}

impl<V, KF, C> Clone for ValueLayer<V, KF, C> {
    fn clone(&self) -> Self {
        Self {
            cache: self.cache.clone(),
            key: self.key.clone(),
            value: PhantomData,
        }
    }
}

impl<V, KF, C: Codec> std::fmt::Debug for ValueLayer<V, KF, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ValueLayer")
            .field("route", &self.cache.route.policy.route)
            .field("codec", &C::NAME)
            .finish_non_exhaustive()
    }
}

impl<S, V, KF, C> Layer<S> for ValueLayer<V, KF, C> {
    type Service = ValueService<S, V, KF, C>;

    fn layer(&self, inner: S) -> Self::Service {
        ValueService {
            inner,
            cache: self.cache.clone(),
            key: self.key.clone(),
            value: PhantomData,
        }
    }
}

/// A service whose answers are cached as typed values: each call is a
/// [`Values::get_or_fetch`](super::Values::get_or_fetch) of the request's key, fetched
/// with a clone of the inner service. Its response is the value, shared (`Arc<V>`), and
/// its error either the inner service's (for the caller whose fetch it was) or the
/// guard's reason ([`ValueError`]).
///
/// Always ready, as [`Guard`](crate::Guard) is: a hit never waits for the inner
/// service; each fetch waits for its own clone's readiness.
pub struct ValueService<S, V, KF, C> {
    inner: S,
    cache: Arc<Cache<C>>,
    key: Arc<KF>,
    value: PhantomData<fn() -> V>,
}

impl<S: Clone, V, KF, C> Clone for ValueService<S, V, KF, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            cache: self.cache.clone(),
            key: self.key.clone(),
            value: PhantomData,
        }
    }
}

impl<S, V, KF, C: Codec> std::fmt::Debug for ValueService<S, V, KF, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ValueService")
            .field("route", &self.cache.route.policy.route)
            .finish_non_exhaustive()
    }
}

impl<S, Req, V, KF, K, C> Service<Req> for ValueService<S, V, KF, C>
where
    S: Service<Req, Response = V> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    Req: Clone + Send + 'static,
    V: Serialize + DeserializeOwned + Send + Sync + 'static,
    KF: Fn(&Req) -> K,
    K: Serialize,
    C: Codec,
{
    type Response = Arc<V>;
    type Error = ValueError<S::Error>;
    type Future = Pin<Box<dyn Future<Output = Answer<V, S::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let key = (self.key)(&request);
        let (cache, inner) = (self.cache.clone(), self.inner.clone());
        let keyed = cache.keyed(&key);
        Box::pin(async move {
            let keyed = keyed.map_err(ValueError::Guard)?;
            cache
                .get_or_fetch(keyed, move || inner.oneshot(request))
                .await
        })
    }
}
