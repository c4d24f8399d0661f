//! The middleware: the decision of the request path, from L1 to the origin.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::answer::{Found, Lookup, answer_fresh, lookup, passthrough, usable_on_error};
use super::body::ResponseBody;
use super::cold::{Caller, Next, Redis, join, landed};
use super::early;
use super::future::ResponseFuture;
use super::marks::{Says, says};
use super::origin::{FillBody, Inner, OriginBody};
use super::outcome::XCache;
use super::ranged;
use super::refresh::{Started, spawn_refresh};
use super::respond::{serve_aged, serve_not_modified, set_own_status};
use super::route::Route;
use super::vary::{self, Check};
use crate::cache::{Instant, L2Read, Stored, l2_read_with_names};
use crate::http::conditional::not_modified;
use crate::http::invalidation;
use crate::http::range::Ranged;
use crate::http::request::{self, Asked, Bypass};
use crate::keys::CacheKeys;
use crate::metrics::Event;

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
    ResBody::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Always ready: see "Readiness" on [`Guard`].
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // Redis is unavailable (the breaker is open; one atomic load): the answer says
        // it was made from this process alone.
        let store = &self.route.shared.store;
        let local_only = store.circuit_open() && !store.is_local_only();
        // The key leaves out parameters the request has: the answer says so.
        let query_dropped = request::query_left_out(&self.route.policy, request.uri());
        let future = self.answer(request);
        if local_only || query_dropped {
            future.said(local_only, query_dropped)
        } else {
            future
        }
    }
}

impl<S> Guard<S> {
    /// The answer to `request`, before it is marked (see `call`).
    fn answer<ReqBody, ResBody>(
        &mut self,
        request: Request<ReqBody>,
    ) -> ResponseFuture<ResBody, S::Error>
    where
        S: Inner<ReqBody, ResBody>,
        ReqBody: FillBody,
        ResBody: OriginBody,
    {
        let route = &self.route;
        route.shared.ensure_listening();
        let asked = match request::classify(&route.policy, &request) {
            Ok(asked) => asked,
            Err(reason) => {
                route.stats.record(Event::Bypass);
                tracing::trace!(reason = reason.as_str(), "not cacheable: bypass");
                let (route, inner) = (route.clone(), self.inner.clone());
                // A change through an unsafe method: what is cached of its URI goes.
                let changes = (route.policy.invalidate_on_unsafe()
                    && invalidation::changes(request.method())
                    && route.policy.cache)
                    .then(|| invalidation::target(&request));
                return ResponseFuture::new(async move {
                    let mut response = passthrough(&route, inner, request, XCache::Bypass).await?;
                    if reason == Bypass::Body {
                        // Said: its body was forwarded, and nothing was stored.
                        set_own_status(response.headers_mut(), XCache::bypassed_with_body());
                    }
                    if let Some(target) = changes {
                        let named = invalidation::changed_uris(&target, &response);
                        invalidate_after(&route, target, named).await;
                    }
                    Ok(response)
                });
            }
        };
        // A range is answered as a request for the whole, then cut (see `ranged`).
        match asked
            .ranged
            .then(|| Ranged::of(request.headers()))
            .flatten()
        {
            None => self.cached(request, asked),
            Some(range) => {
                let whole = self.cached(request, asked);
                ResponseFuture::new(async move { Ok(ranged::cut(whole.await?, &range)) })
            }
        }
    }

    /// The answer to a request the route caches, for the whole of what it asks.
    fn cached<ReqBody, ResBody>(
        &mut self,
        request: Request<ReqBody>,
        asked: Asked,
    ) -> ResponseFuture<ResBody, S::Error>
    where
        S: Inner<ReqBody, ResBody>,
        ReqBody: FillBody,
        ResBody: OriginBody,
    {
        let route = &self.route;
        // L1 answers fresh and stale entries here, without a future to allocate: the
        // common case costs a fast keyed hash, a lookup and the response (no HMAC, no
        // key string: the Redis keys are made only past L1).
        let now = Instant::now();
        let (local, found) = route.find_l1(&request, now);
        // (An entry hard-purged by a tag is not there: see `purge`.)
        let fallback = match found.filter(|s| !route.is_gone(s)) {
            Some(stored) => {
                let age = stored.age_at(now);
                let early = early::due(
                    &route.policy.early,
                    &route.recompute,
                    stored.response.fresh_for,
                    age,
                );
                // (A conditional request takes the longer way: it may be answered 304;
                // so does a hit that starts an early refresh.)
                if !asked.conditional
                    && !early
                    && let Some(response) = answer_fresh(route, &stored, age, asked.kind)
                {
                    route.stats.record_fresh_l1_hit();
                    return ResponseFuture::ready(response);
                }
                // Not fresh: stale (served, and refreshed), or expired; or conditional.
                route.stats.record(Event::L1Hit);
                let found = Found {
                    stored: &stored,
                    age,
                    local,
                    keys: None,
                    early,
                };
                if let Some(response) = answer(route, found, asked, &request, &self.inner) {
                    return ResponseFuture::ready(response);
                }
                Some(stored)
            }
            None => {
                route.stats.record(Event::L1Miss);
                None
            }
        };
        let Some(keys) = route.keys_for(&request) else {
            route.stats.record(Event::Bypass);
            let (route, inner) = (route.clone(), self.inner.clone());
            return ResponseFuture::new(async move {
                passthrough(&route, inner, request, XCache::Bypass).await
            });
        };
        // The URL learned a `Vary` header between the two keys: what L1 gave is another
        // variant's entry, which may not stand in for this one.
        let fallback = fallback.filter(|_| keys.local == local);
        ResponseFuture::new(handle(
            route.clone(),
            self.inner.clone(),
            request,
            asked,
            keys,
            fallback,
        ))
    }
}

/// Carries out [`lookup`](super::answer::lookup): a hit, or a stale entry served while its refresh starts in
/// the background with a clone of the service (the one place a refresh is started);
/// `None` for an expired one. A conditional request that the entry meets gets `304`
/// (see `http::conditional`).
pub(crate) fn answer<S, ReqBody, ResBody>(
    route: &Arc<Route>,
    found: Found<'_>,
    asked: Asked,
    request: &Request<ReqBody>,
    inner: &S,
) -> Option<Response<ResponseBody<ResBody>>>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: FillBody,
    ResBody: OriginBody,
{
    let (x_cache, refresh) = match lookup(route, &found) {
        Lookup::Fresh { refresh } => {
            route.stats.record(Event::Hit);
            (XCache::Hit, refresh)
        }
        Lookup::Stale => {
            route.stats.record(Event::Stale);
            (XCache::Stale, true)
        }
        Lookup::Expired => return None,
    };
    let Found {
        stored,
        age,
        local,
        keys,
        ..
    } = found;
    if refresh {
        match spawn_refresh(route, local, keys, stored.clone(), request, inner) {
            Started::Now if x_cache == XCache::Hit => route.stats.record(Event::EarlyRefresh),
            // Served stale while one refresh runs: a call the origin did not get.
            Started::Running if x_cache == XCache::Stale => {
                route.stats.record(Event::AvoidedStale);
            }
            _ => {}
        }
    }
    if asked.conditional
        && not_modified(stored.response.status, &stored.headers(), request.headers())
    {
        route.stats.record(Event::NotModified);
        return Some(serve_not_modified(stored, age, x_cache, true));
    }
    Some(serve_aged(stored, age, asked.kind, x_cache))
}

/// Invalidates what a successful unsafe request changed: its URI's entries and those
/// of `named`. A Redis failure costs only the other instances' copies (counted).
async fn invalidate_after(route: &Route, mut target: Request<()>, named: Option<Vec<http::Uri>>) {
    let Some(named) = named else { return };
    if route.invalidate(&target).await.is_err() {
        route.stats.record(Event::RedisError);
    }
    for uri in named {
        let Some(named) = invalidation::named_uri(&target, &uri) else {
            continue;
        };
        *target.uri_mut() = named;
        if route.invalidate(&target).await.is_err() {
            route.stats.record(Event::RedisError);
        }
    }
}

/// How many times a request looks again under a new key, after its URL learned a
/// `Vary` header while it waited, before it goes to the origin uncached.
const MAX_REKEYS: usize = 3;

/// The request's keys made again, if it has looked again fewer than [`MAX_REKEYS`]
/// times (counted in `rekeys`) and may be keyed.
fn rekey<B>(route: &Route, request: &Request<B>, rekeys: &mut usize) -> Option<CacheKeys> {
    if *rekeys >= MAX_REKEYS {
        return None;
    }
    let new = route.keys_for(request)?;
    *rekeys += 1;
    Some(new)
}

/// Past L1: what the fleet said about the key, L2, then a cold fill.
async fn handle<S, ReqBody, ResBody>(
    route: Arc<Route>,
    inner: S,
    request: Request<ReqBody>,
    asked: Asked,
    mut keys: CacheKeys,
    mut fallback: Option<Arc<Stored>>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: FillBody,
    ResBody: OriginBody,
{
    let mut rekeys = 0;
    loop {
        let mut redis = match marked(&route, &keys, asked, &fallback) {
            // (A local-only store has no Redis to look in.)
            Marked::Look if route.shared.store.is_local_only() => Redis::Failed,
            Marked::Look => Redis::Usable,
            Marked::Passing => Redis::Passing,
            Marked::Pass => return passthrough(&route, inner, request, XCache::Pass).await,
            Marked::Stale(response) => return Ok(response),
        };
        // Registered before looking in L2: a fill notice that comes between the look and
        // this request's own fill is then seen, and the fill takes that entry instead.
        let wait = route.shared.notices.wait_for(keys.entry().into());
        if let Some(stored) = from_l2(&route, &keys, asked, request.headers(), &mut redis).await
            && let Some(response) = answered(
                &route,
                stored,
                &keys,
                asked,
                &request,
                &inner,
                &mut fallback,
            )
        {
            return Ok(response);
        }
        // The URL learned a `Vary` header since the key was made: this caller's entry has
        // another key now (a fill may have stored it already).
        if !route.same_names(&keys)
            && let Some(new) = rekey(&route, &request, &mut rekeys)
        {
            keys = new;
            // What was found under the old key is not this key's.
            fallback = None;
            continue;
        }
        let caller = Caller {
            asked,
            headers: request.headers(),
            keys: &keys,
            fallback: &fallback,
            redis,
        };
        let flight = join(&route, &inner, &request, &caller, wait);
        // (A HEAD joins the fill of the GET it is answered from, as a cache converts it.)
        match landed(&route, flight, &caller).await {
            Next::Answer(response) => return Ok(response),
            Next::Error(error) => return Err(error),
            Next::PassThrough => {
                route.stats.record(Event::Pass);
                return passthrough(&route, inner, request, XCache::Pass).await;
            }
            Next::Rekey => match rekey(&route, &request, &mut rekeys) {
                Some(new) => {
                    keys = new;
                    fallback = None;
                }
                _ => {
                    route.stats.record(Event::Pass);
                    return passthrough(&route, inner, request, XCache::Pass).await;
                }
            },
        }
    }
}

/// What the fleet's marks on a key say a request does.
enum Marked<B: Body> {
    /// Nothing: look in L2.
    Look,
    /// Its last answer could not be stored: nothing in the caches to look for, but the
    /// callers that come while one asks the origin share its answer, if it may be shared
    /// (else each asks the origin itself).
    Passing,
    /// Its last answer here was its caller's alone: no fill to wait for.
    Pass,
    /// The origin just failed for it: what may stand in, does, at once.
    Stale(Response<ResponseBody<B>>),
}

/// Carries out what the fleet's mark on the request's key says (see [`says`]).
fn marked<B: Body>(
    route: &Route,
    keys: &CacheKeys,
    asked: Asked,
    fallback: &Option<Arc<Stored>>,
) -> Marked<B> {
    let stands_in = || fallback.as_ref().is_some_and(|f| route.serves_on_error(f));
    match says(route.shared.marks.get(keys.entry()), stands_in) {
        // A range too: its callers share one call of the whole, and each gets its range
        // cut from it as it streams (when its length is declared; else the whole); the
        // call stops once the last of them has read what it wanted.
        Says::Passing => {
            route.stats.record(Event::HitForPass);
            Marked::Passing
        }
        Says::Pass => {
            route.stats.record(Event::HitForPass);
            Marked::Pass
        }
        Says::StandIn => match usable_on_error(route, fallback, asked.kind) {
            Some(stale) => Marked::Stale(stale),
            None => Marked::Look,
        },
        Says::Look => Marked::Look,
    }
}

/// Looks in L2 (when Redis may be asked): an entry found there is put in L1, and given
/// back when it may answer the request; a read that failed marks Redis as failed for
/// this request.
async fn from_l2(
    route: &Route,
    keys: &CacheKeys,
    asked: Asked,
    headers: &http::HeaderMap,
    redis: &mut Redis,
) -> Option<Arc<Stored>> {
    let read = if *redis == Redis::Usable {
        l2_looked(route, keys, asked).await
    } else {
        Ok(L2Read::Miss)
    };
    match read {
        Ok(L2Read::Found(stored)) if route.is_gone(&stored) => {
            route.stats.record(Event::L2Miss);
        }
        Ok(L2Read::Found(stored)) => {
            if let Check::Learn(names) = route.check(&stored, keys, headers) {
                // Another variant (its `Vary` names a header the request's key did not
                // include): learned from, kept for the fleet, and the request keyed
                // again. It stays the entry of requests it answers.
                route.stats.record(Event::L2Miss);
                if let Ok(Some(all)) = route.learn(keys, &names) {
                    route.keep_names(keys, &all).await;
                }
                route.put_l1(keys, stored).await;
                return None;
            }
            route.stats.record(Event::L2Hit);
            route.put_l1(keys, stored.clone()).await;
            return Some(stored);
        }
        Ok(L2Read::Miss) if *redis == Redis::Usable => route.stats.record(Event::L2Miss),
        Ok(L2Read::Miss) => {}
        Ok(L2Read::Garbage(reason)) => {
            route.stats.record(Event::DecodeFailure);
            route.stats.record(Event::L2Miss);
            tracing::debug!(entry = keys.entry(), reason, "garbage at an entry's key");
        }
        Err(error) => {
            *redis = Redis::Failed;
            route.stats.record(Event::RedisError);
            tracing::debug!(%error, "cache read failed; going on without Redis");
        }
    }
    None
}

/// The answer an entry found in L2 gives the request, if it may; else it may stand in
/// later, as the newest one found (`fallback`).
fn answered<S, ReqBody, ResBody>(
    route: &Arc<Route>,
    stored: Arc<Stored>,
    keys: &CacheKeys,
    asked: Asked,
    request: &Request<ReqBody>,
    inner: &S,
    fallback: &mut Option<Arc<Stored>>,
) -> Option<Response<ResponseBody<ResBody>>>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: FillBody,
    ResBody: OriginBody,
{
    let found = Found {
        stored: &stored,
        age: stored.age(),
        local: keys.local,
        keys: Some(keys),
        early: early::due(
            &route.policy.early,
            &route.recompute,
            stored.response.fresh_for,
            stored.age(),
        ),
    };
    if let Some(response) = answer(route, found, asked, request, inner) {
        return Some(response);
    }
    if fallback
        .as_ref()
        .is_none_or(|f| f.response.token < stored.response.token)
    {
        *fallback = Some(stored);
    }
    None
}

/// Reads the key's entry from L2, with what its URL varies on as kept in Redis: an
/// instance that started later, or missed the notice, learns it here (before it would
/// key alike). A body in parts that L1 would not keep, or asked for a range of, is read
/// part by part as it is answered (a range: only the parts it spans).
async fn l2_looked(
    route: &Route,
    keys: &CacheKeys,
    asked: Asked,
) -> Result<L2Read, crate::store::StoreError> {
    let names = route.reads_names(keys);
    // (A range reads only the parts it spans.)
    let whole_up_to = if asked.ranged { 0 } else { route.whole_up_to() };
    let (store, max) = (&route.shared.store, route.policy.max_body);
    let (read, record) = l2_read_with_names(store, keys, max, names, whole_up_to).await?;
    if let Some(names) = record.as_deref().and_then(vary::parse) {
        let _ = route.learn(keys, &names);
    }
    Ok(read)
}
