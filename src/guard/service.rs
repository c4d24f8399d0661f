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
use super::marks::Mark;
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
/// ready in its own future (tower's `oneshot`), so a `ConcurrencyLimit` or a `Buffer`
/// (in front of a rate limit, which is not `Clone` on its own) placed *inside* the guard
/// bounds origin calls without holding up hits.
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

/// How many times a request looks again under a new key, after its route learned a
/// `Vary` header while it waited, before it goes to the origin uncached.
const MAX_REKEYS: usize = 3;

/// Past L1: what the fleet said about the key, L2, then a cold fill.
async fn handle<S, ReqBody, ResBody>(
    route: Arc<Route>,
    inner: S,
    request: Request<ReqBody>,
    kind: Kind,
    mut keys: CacheKeys,
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
    let mut rekeys = 0;
    loop {
        match route.shared.marks.get(keys.entry()) {
            // Its answers cannot be stored: no fill to wait for.
            Some(Mark::Pass) => {
                route.stats.record(Event::HitForPass);
                return passthrough(&route, inner, request, "pass").await;
            }
            // The origin just failed for it: what may stand in, does, at once.
            Some(Mark::BackOff) => {
                if let Some(stale) = usable_on_error(&route, &fallback) {
                    return Ok(stale);
                }
            }
            None => {}
        }
        // Registered before looking in L2: a fill notice that comes between the look and
        // this request's own fill is then seen, and the fill takes that entry instead.
        let wait = route.shared.waiters.register(keys.entry().into());
        let mut redis_ok = !route.shared.store.is_local_only();
        let read = if redis_ok {
            l2_read(&route.shared.store, &keys, route.policy.max_body).await
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
            route.stats.record(Event::Pass);
            return passthrough(&route, inner, request, "pass").await;
        }
        if keys.learned != route.learned.version() && rekeys < MAX_REKEYS {
            // The route learned a `Vary` header since the key was made: this caller's
            // entry has another key now (a fill may have stored it already).
            if let Some(new) = route.keys_for(&request) {
                rekeys += 1;
                keys = new;
                // What was found under the old key is not this key's.
                fallback = None;
                continue;
            }
        }
        let (slot, is_leader) =
            join_fill(&route, &inner, &request, &keys, &fallback, redis_ok, wait);
        match cold(&route, slot, is_leader, request.headers(), &fallback).await {
            Next::Answer(response) => return Ok(response),
            Next::Error(error) => return Err(error),
            Next::PassThrough => {
                route.stats.record(Event::Pass);
                return passthrough(&route, inner, request, "pass").await;
            }
            Next::ColdMiss => return cold_miss(&route, inner, request, fallback).await,
            Next::Rekey => match route.keys_for(&request) {
                Some(new) if rekeys < MAX_REKEYS => {
                    rekeys += 1;
                    keys = new;
                    fallback = None;
                }
                _ => {
                    route.stats.record(Event::Pass);
                    return passthrough(&route, inner, request, "pass").await;
                }
            },
        }
    }
}

/// What a caller does after a cold fill.
enum Next<B: Body, E> {
    Answer(Response<ResponseBody<B>>),
    /// The origin's error, handed to the caller whose fill got it.
    Error(E),
    /// Ask the origin itself; what it gets is not stored.
    PassThrough,
    /// Nothing to serve: the route's cold-miss behaviour.
    ColdMiss,
    /// Look again: the route learned a `Vary` header, and the caller's key changed.
    Rekey,
}

/// Nothing servable is cached: joins the key's fill, or leads it (starts its task).
/// Returns the fill's outcome to come, and whether this caller leads.
fn join_fill<S, ReqBody, ResBody>(
    route: &Arc<Route>,
    inner: &S,
    request: &Request<ReqBody>,
    keys: &CacheKeys,
    fallback: &Option<Arc<Stored>>,
    redis_ok: bool,
    wait: crate::notify::Wait,
) -> (flight::Slot, bool)
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
        let fill_request = route.fill_request(request);
        let local_token = fallback
            .as_ref()
            .map_or(FencingToken::new(1), |f| f.response.token);
        let stand_in = fallback
            .as_ref()
            .is_some_and(|f| f.serves_on_error(route.policy.stale_if_error));
        // In a task of its own: a caller that goes away does not cancel the fill that
        // every other caller of the key awaits.
        let span = tracing::info_span!("stampede_guard.fill", route = %route.policy.route, entry = keys.entry());
        tokio::spawn(
            fill_task(
                route.clone(),
                keys.clone(),
                fill_request,
                inner.clone(),
                wait,
                local_token,
                stand_in,
                redis_ok,
                lead,
            )
            .instrument(span),
        );
    }
    (slot, is_leader)
}

/// Waits for the key's fill and turns its outcome into what this caller does.
async fn cold<B, E>(
    route: &Arc<Route>,
    slot: flight::Slot,
    is_leader: bool,
    headers: &http::HeaderMap,
    fallback: &Option<Arc<Stored>>,
) -> Next<B, E>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Send + 'static,
    E: Send + 'static,
{
    let policy = &route.policy;
    // The fill's own waits: a budget slot and another instance's fill (each at most the
    // cold wait), the origin, and its Redis round trips (the write's deadline grows with
    // the entry's size).
    let bound = policy.refresh_timeout
        + policy.cold_wait * 2
        + route.shared.store.command_timeout() * 8
        + Duration::from_micros(policy.max_body as u64 / 32) * 2
        + Duration::from_millis(100);
    let waited = match (policy.soft_timeout, fallback) {
        // Something may be served instead: wait only the soft timeout; the fill goes on.
        (Some(soft), Some(stale)) if stale.serves_on_error(policy.stale_if_error) => {
            match tokio::time::timeout(soft, flight::wait(slot)).await {
                Ok(outcome) => outcome,
                Err(_) => {
                    route.stats.record(Event::SoftTimeout);
                    route.stats.record(Event::Stale);
                    return Next::Answer(serve(stale, Kind::Get, "stale"));
                }
            }
        }
        _ => tokio::time::timeout(bound, flight::wait(slot))
            .await
            .ok()
            .flatten(),
    };
    let outcome = waited.and_then(|o| o.downcast::<FillOutcome<B, E>>().ok());
    let Some(outcome) = outcome else {
        return Next::ColdMiss;
    };
    // What stands in when the fill failed, if anything may.
    let on_error = || usable_on_error(route, fallback).map_or(Next::ColdMiss, Next::Answer);
    match &*outcome {
        FillOutcome::Stored { stored, variant_of } => {
            // Stored under another key (it varies on a header the caller's key did not
            // include): only for callers of that variant.
            let other_variant = variant_of.as_ref().is_some_and(|asked| {
                !rules::same_variant(&stored.response.headers, asked.headers(), headers)
            });
            if other_variant && !is_leader {
                return Next::Rekey;
            }
            route.stats.record(Event::Miss);
            Next::Answer(serve(stored, Kind::Get, "miss"))
        }
        FillOutcome::Shared {
            response,
            failure,
            origin_saw,
        } => {
            if *failure && let Some(stale) = usable_on_error(route, fallback) {
                return Next::Answer(stale);
            }
            if !is_leader && !rules::same_variant(&response.headers, origin_saw.headers(), headers)
            {
                return Next::Rekey;
            }
            route.stats.record(Event::Pass);
            Next::Answer(serve_buffered(response))
        }
        FillOutcome::Handoff { slot, failure } => {
            if *failure && let Some(stale) = usable_on_error(route, fallback) {
                return Next::Answer(stale);
            }
            // Private (or the origin's error): only for the caller whose request made it.
            let taken = if is_leader {
                slot.lock().expect("handoff lock").take()
            } else {
                None
            };
            match taken {
                Some(Ok(mut response)) => {
                    route.stats.record(Event::Pass);
                    set_x_cache(response.headers_mut(), "pass");
                    Next::Answer(response)
                }
                Some(Err(error)) => Next::Error(error),
                // Private to the caller that made it: this one asks the origin itself.
                None => Next::PassThrough,
            }
        }
        FillOutcome::Pass => Next::PassThrough,
        FillOutcome::Rekey => Next::Rekey,
        FillOutcome::NoEntry => Next::ColdMiss,
        FillOutcome::TimedOut | FillOutcome::BackedOff | FillOutcome::OverBudget => on_error(),
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
    stand_in: bool,
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
    let outcome = fill::cold_fill(
        route,
        keys,
        request,
        inner,
        wait,
        local_token,
        stand_in,
        redis_ok,
    )
    .await;
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
            passthrough(route, inner, request, "pass").await
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
    let freshness = match stored.freshness() {
        // Put in L1 before the notice subscription last came up: it may have missed an
        // invalidation. Served, but not as fresh.
        Freshness::Fresh
            if stored.epoch()
                < route
                    .shared
                    .epoch
                    .load(std::sync::atomic::Ordering::Relaxed) =>
        {
            Freshness::Stale
        }
        freshness => freshness,
    };
    match freshness {
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
    let slot = {
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
        // Within the budget, or not at all: the entry is served stale meanwhile, and a
        // later caller starts the refresh once a slot is free.
        let Some(slot) = route.shared.budget.try_take() else {
            route.stats.record(Event::RefreshSkipped);
            return;
        };
        refreshing.insert(key.clone(), Refresh::Running);
        slot
    };
    let done = Refreshing {
        route: route.clone(),
        key,
        hold_off: None,
    };
    let request = route.fill_request(request);
    let (route, keys, inner) = (route.clone(), keys.clone(), inner.clone());
    // The span follows the refresh into its task; it names the route and the hashed
    // key, nothing that came with the request.
    let span = tracing::info_span!("stampede_guard.refresh", route = %route.policy.route, entry = keys.entry());
    tokio::spawn(
        async move {
            // Moved in whole (not just the field written), so that it drops with the task.
            let mut done = done;
            let _slot = slot;
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

/// An answer of the origin that was not stored, for one more of its waiters.
fn serve_buffered<B: Body>(buffered: &Buffered) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::full(buffered.body.clone()));
    *response.status_mut() = buffered.status;
    *response.headers_mut() = buffered.headers.clone();
    set_x_cache(response.headers_mut(), "pass");
    response
}

fn set_x_cache(headers: &mut http::HeaderMap, value: &'static str) {
    headers.insert(X_CACHE, HeaderValue::from_static(value));
}
