use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{AGE, HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use http_body::Body;
use tower::ServiceExt;
use tower_service::Service;
use tracing::Instrument;

use super::Refresh;
use super::body::ResponseBody;
use super::fill::{self, Buffered, FillOutcome};
use super::flight;
use super::future::ResponseFuture;
use super::layer::Route;
use crate::X_CACHE;
use crate::cache::{Freshness, L2Read, Stored, l2_read};
use crate::keys::CacheKeys;
use crate::lease::FencingToken;
use crate::metrics::Event;
use crate::policy::ColdMiss;
use crate::rules::{self, Kind};

/// The middleware of one route; see the [module docs](super) for the request path.
///
/// The inner service keeps its error type: a Redis failure never becomes an error of the
/// guard, it only costs the cache.
///
/// # Readiness
///
/// A cache is always ready: `poll_ready` never waits for the inner service, so a hit is
/// answered whatever the origin's capacity. Whatever needs the origin (a fill, a refresh,
/// a pass-through) takes a clone of the inner service and waits for that clone to be
/// ready in its own future (tower's `oneshot`), so a `ConcurrencyLimit`, a `Buffer` or a
/// rate limit placed *inside* the guard bounds origin calls without holding up hits.
pub struct Guard<S> {
    inner: S,
    route: Arc<Route>,
}

impl<S: Clone> Clone for Guard<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            route: self.route.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Guard<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("inner", &self.inner)
            .field("route", &self.route.policy.route)
            .finish_non_exhaustive()
    }
}

impl<S> Guard<S> {
    pub(super) fn new(inner: S, route: Arc<Route>) -> Self {
        Self { inner, route }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the guard, giving back the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Guard<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Default + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Always ready: see "Readiness" on [`Guard`].
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let route = &self.route;
        route.shared.ensure_listener();
        let kind = match rules::classify(&route.policy, &request) {
            Ok(kind) => kind,
            Err(reason) => {
                route.stats.record(Event::Bypass);
                tracing::trace!(reason = reason.as_str(), "not cacheable: bypass");
                let (route, inner) = (route.clone(), self.inner.clone());
                return ResponseFuture::new(async move {
                    passthrough(&route, inner, request, "bypass").await
                });
            }
        };
        let Some(keys) = route.keys_for(&request) else {
            route.stats.record(Event::Bypass);
            let (route, inner) = (route.clone(), self.inner.clone());
            return ResponseFuture::new(async move {
                passthrough(&route, inner, request, "bypass").await
            });
        };
        // L1 answers fresh and stale entries here, without a future to allocate: the
        // common case costs a hash, a lookup and the response.
        let fallback = match route.l1().get(keys.entry()) {
            Some(stored) => {
                route.stats.record(Event::L1Hit);
                if let Some(response) = answer(route, &stored, kind, &keys, &request, &self.inner) {
                    return ResponseFuture::ready(response);
                }
                Some(stored)
            }
            None => {
                route.stats.record(Event::L1Miss);
                None
            }
        };
        ResponseFuture::new(handle(
            route.clone(),
            self.inner.clone(),
            request,
            kind,
            keys,
            fallback,
        ))
    }
}

/// Past L1: L2, then a cold fill.
async fn handle<S, ReqBody, ResBody>(
    route: Arc<Route>,
    inner: S,
    request: Request<ReqBody>,
    kind: Kind,
    keys: CacheKeys,
    mut fallback: Option<Arc<Stored>>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Default + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    // Registered before looking in L2: a fill notice that comes between the look and this
    // request's own fill is then seen, and the fill takes that entry instead.
    let wait = route.shared.waiters.register(keys.entry().into());
    let mut redis_ok = !route.shared.store.is_local_only();
    let read = if redis_ok {
        l2_read(&route.shared.store, keys.entry(), route.policy.max_body).await
    } else {
        Ok(L2Read::Miss)
    };
    match read {
        Ok(L2Read::Found(stored)) => {
            route.stats.record(Event::L2Hit);
            route.put_l1(keys.entry().into(), stored.clone()).await;
            if let Some(response) = answer(&route, &stored, kind, &keys, &request, &inner) {
                return Ok(response);
            }
            if fallback
                .as_ref()
                .is_none_or(|f| f.response.token < stored.response.token)
            {
                fallback = Some(stored);
            }
        }
        Ok(L2Read::Miss) if redis_ok => route.stats.record(Event::L2Miss),
        Ok(L2Read::Miss) => {}
        Ok(L2Read::Garbage(reason)) => {
            route.stats.record(Event::DecodeFailure);
            route.stats.record(Event::L2Miss);
            tracing::debug!(entry = keys.entry(), reason, "garbage at an entry's key");
        }
        Err(error) => {
            redis_ok = false;
            route.stats.record(Event::RedisError);
            tracing::debug!(%error, "cache read failed; going on without Redis");
        }
    }

    if kind == Kind::Head {
        // A HEAD cannot fill the GET entry it would be answered from.
        route.stats.record(Event::Miss);
        return passthrough(&route, inner, request, "miss").await;
    }
    cold(route, inner, request, keys, fallback, redis_ok, wait).await
}

/// Nothing servable is cached: join (or lead) the key's fill, and answer from it.
#[allow(clippy::too_many_arguments)]
async fn cold<S, ReqBody, ResBody>(
    route: Arc<Route>,
    inner: S,
    request: Request<ReqBody>,
    keys: CacheKeys,
    fallback: Option<Arc<Stored>>,
    redis_ok: bool,
    wait: crate::notify::Wait,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Default + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    let key: Arc<str> = keys.entry().into();
    let (slot, lead) = route.flights.join(&key);
    let is_leader = lead.is_some();
    if let Some(lead) = lead {
        let fill_request = rules::fill_request(&route.policy, &request);
        let local_token = fallback
            .as_ref()
            .map_or(FencingToken::new(1), |f| f.response.token);
        // In a task of its own: a caller that goes away does not cancel the fill that
        // every other caller of the key awaits.
        let span = tracing::info_span!("stampede_guard.fill", route = %route.policy.route, entry = keys.entry());
        tokio::spawn(
            fill_task(
                route.clone(),
                keys,
                fill_request,
                inner.clone(),
                wait,
                local_token,
                redis_ok,
                lead,
            )
            .instrument(span),
        );
    }
    let policy = &route.policy;
    // The fill's own waits: the origin, a wait for another instance, and its Redis
    // round trips (the write's deadline grows with the entry's size).
    let bound = policy.refresh_timeout
        + policy.cold_wait
        + route.shared.store.command_timeout() * 4
        + Duration::from_micros(policy.max_body as u64 / 32)
        + Duration::from_millis(100);
    let waited = match (policy.soft_timeout, &fallback) {
        // Something may be served instead: wait only the soft timeout; the fill goes on.
        (Some(soft), Some(stale)) if stale.serves_on_error(policy.stale_if_error) => {
            match tokio::time::timeout(soft, flight::wait(slot)).await {
                Ok(outcome) => outcome,
                Err(_) => {
                    route.stats.record(Event::SoftTimeout);
                    route.stats.record(Event::Stale);
                    return Ok(serve(stale, Kind::Get, "stale"));
                }
            }
        }
        _ => tokio::time::timeout(bound, flight::wait(slot))
            .await
            .ok()
            .flatten(),
    };
    let outcome = waited.and_then(|o| o.downcast::<FillOutcome<ResBody, S::Error>>().ok());
    let Some(outcome) = outcome else {
        return cold_miss(&route, inner, request, fallback).await;
    };
    match &*outcome {
        FillOutcome::Stored(stored) => {
            route.stats.record(Event::Miss);
            Ok(serve(stored, Kind::Get, "miss"))
        }
        FillOutcome::Shared { response, failure } => {
            if *failure && let Some(stale) = usable_on_error(&route, &fallback) {
                return Ok(stale);
            }
            route.stats.record(Event::Miss);
            Ok(serve_buffered(response))
        }
        FillOutcome::Handoff { slot, failure } => {
            if *failure && let Some(stale) = usable_on_error(&route, &fallback) {
                return Ok(stale);
            }
            // Private (or the origin's error): only for the caller whose request made it.
            let taken = if is_leader {
                slot.lock().expect("handoff lock").take()
            } else {
                None
            };
            match taken {
                Some(Ok(mut response)) => {
                    route.stats.record(Event::Miss);
                    set_x_cache(response.headers_mut(), "miss");
                    Ok(response)
                }
                Some(Err(error)) => Err(error),
                // Private to the caller that made it: this one asks the origin itself.
                None => {
                    route.stats.record(Event::Passthrough);
                    passthrough(&route, inner, request, "bypass").await
                }
            }
        }
        FillOutcome::TimedOut => match usable_on_error(&route, &fallback) {
            Some(stale) => Ok(stale),
            None => cold_miss(&route, inner, request, None).await,
        },
        FillOutcome::NoEntry => cold_miss(&route, inner, request, fallback).await,
    }
}

#[allow(clippy::too_many_arguments)]
async fn fill_task<S, ReqBody, ResBody>(
    route: Arc<Route>,
    keys: CacheKeys,
    request: Request<ReqBody>,
    inner: S,
    wait: crate::notify::Wait,
    local_token: FencingToken,
    redis_ok: bool,
    lead: flight::Lead,
) where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    let outcome = fill::cold_fill(route, keys, request, inner, wait, local_token, redis_ok).await;
    lead.finish(Arc::new(outcome));
}

/// The entry that may stand in for a failed origin, as a response.
fn usable_on_error<B: Body>(
    route: &Route,
    fallback: &Option<Arc<Stored>>,
) -> Option<Response<ResponseBody<B>>> {
    let stored = fallback.as_ref()?;
    if !stored.serves_on_error(route.policy.stale_if_error) {
        return None;
    }
    route.stats.record(Event::StaleIfError);
    route.stats.record(Event::Stale);
    Some(serve(stored, Kind::Get, "stale"))
}

/// The cold wait is over with nothing to serve: the route's cold-miss behaviour.
async fn cold_miss<S, ReqBody, ResBody>(
    route: &Route,
    inner: S,
    request: Request<ReqBody>,
    fallback: Option<Arc<Stored>>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes>,
{
    if let Some(stale) = usable_on_error(route, &fallback) {
        return Ok(stale);
    }
    match route.policy.cold_miss {
        ColdMiss::Reject { retry_after } => {
            route.stats.record(Event::Rejected);
            let mut response = Response::new(ResponseBody::empty());
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            let seconds = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(seconds));
            set_x_cache(response.headers_mut(), "miss");
            Ok(response)
        }
        _ => {
            route.stats.record(Event::Passthrough);
            passthrough(route, inner, request, "bypass").await
        }
    }
}

/// Answers from an entry that is fresh (a hit) or stale (served, and refreshed in the
/// background with a clone of the service); `None` for an expired one.
fn answer<S, ReqBody, ResBody>(
    route: &Arc<Route>,
    stored: &Arc<Stored>,
    kind: Kind,
    keys: &CacheKeys,
    request: &Request<ReqBody>,
    inner: &S,
) -> Option<Response<ResponseBody<ResBody>>>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Default + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    match stored.freshness() {
        Freshness::Fresh => {
            route.stats.record(Event::Hit);
            Some(serve(stored, kind, "hit"))
        }
        Freshness::Stale => {
            route.stats.record(Event::Stale);
            spawn_refresh(route, keys, stored.clone(), request, inner);
            Some(serve(stored, kind, "stale"))
        }
        Freshness::Expired => None,
    }
}

fn spawn_refresh<S, ReqBody, ResBody>(
    route: &Arc<Route>,
    keys: &CacheKeys,
    current: Arc<Stored>,
    request: &Request<ReqBody>,
    inner: &S,
) where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Default + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    let key: Arc<str> = keys.entry().into();
    {
        let mut refreshing = route.shared.refreshing.lock().expect("refreshing lock");
        match refreshing.get(&key) {
            // One refresh per key per process.
            Some(Refresh::Running | Refresh::RunningFilled) => return,
            // Someone else has the lease; their notice, or its TTL, lifts the hold.
            Some(Refresh::HeldOff(until)) if Instant::now() < *until => return,
            _ => {}
        }
        // Hold-offs of keys nobody asks for any more would pile up: sweep them now and
        // then (amortized: only when the map has grown).
        if refreshing.len() >= 1024 && refreshing.len().is_power_of_two() {
            let now = Instant::now();
            refreshing
                .retain(|_, state| !matches!(state, Refresh::HeldOff(until) if *until <= now));
        }
        refreshing.insert(key.clone(), Refresh::Running);
    }
    let done = Refreshing {
        route: route.clone(),
        key,
        hold_off: None,
    };
    let request = rules::fill_request(&route.policy, request);
    let (route, keys, inner) = (route.clone(), keys.clone(), inner.clone());
    // The span follows the refresh into its task; it names the route and the hashed
    // key, nothing that came with the request.
    let span = tracing::info_span!("stampede_guard.refresh", route = %route.policy.route, entry = keys.entry());
    tokio::spawn(
        async move {
            // Moved in whole (not just the field written), so that it drops with the task.
            let mut done = done;
            let started = Instant::now();
            done.hold_off = fill::refresh(route.clone(), keys, current, request, inner).await;
            route.stats.refresh_seconds.record(started.elapsed());
        }
        .instrument(span),
    );
}

/// Marks a key as no longer refreshing, however the refresh ends (a panic included).
struct Refreshing {
    route: Arc<Route>,
    key: Arc<str>,
    /// How long to leave the key alone, when the refresh found the lease elsewhere.
    hold_off: Option<Duration>,
}

impl Drop for Refreshing {
    fn drop(&mut self) {
        let mut refreshing = self
            .route
            .shared
            .refreshing
            .lock()
            .expect("refreshing lock");
        let filled = refreshing.get(&self.key) == Some(&Refresh::RunningFilled);
        match self.hold_off {
            Some(hold_off) if !filled => {
                refreshing.insert(
                    self.key.clone(),
                    Refresh::HeldOff(Instant::now() + hold_off),
                );
            }
            _ => {
                refreshing.remove(&self.key);
            }
        }
    }
}

async fn passthrough<S, ReqBody, ResBody>(
    route: &Route,
    inner: S,
    request: Request<ReqBody>,
    x_cache: &'static str,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes>,
{
    route.stats.record(Event::OriginCall);
    // A clone that has not been polled: `oneshot` waits for it to be ready.
    let response = inner.oneshot(request).await?;
    let mut response = response.map(ResponseBody::stream);
    set_x_cache(response.headers_mut(), x_cache);
    Ok(response)
}

fn serve<B: Body>(stored: &Stored, kind: Kind, x_cache: &'static str) -> Response<ResponseBody<B>> {
    let cached = &stored.response;
    let body = match kind {
        Kind::Get => ResponseBody::full(cached.body.clone()),
        Kind::Head => ResponseBody::empty(),
    };
    let mut response = Response::new(body);
    *response.status_mut() = cached.status;
    *response.headers_mut() = cached.headers.clone();
    let headers = response.headers_mut();
    headers.insert(AGE, HeaderValue::from(stored.age().as_secs()));
    set_x_cache(headers, x_cache);
    response
}

fn serve_buffered<B: Body>(buffered: &Buffered) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::full(buffered.body.clone()));
    *response.status_mut() = buffered.status;
    *response.headers_mut() = buffered.headers.clone();
    set_x_cache(response.headers_mut(), "miss");
    response
}

fn set_x_cache(headers: &mut http::HeaderMap, value: &'static str) {
    headers.insert(X_CACHE, HeaderValue::from_static(value));
}
