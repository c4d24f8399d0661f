//! Answering a caller: from an entry (a hit, or a stale entry while its refresh
//! starts), from the origin straight (a pass-through, bounded by the route's pass
//! timeout), from an entry that may stand in for a failed origin, or with the guard's
//! own answer when nothing may (`502`, `504`, or the route's `503`). Each answer's
//! `x-cache` and `cache-status` come from one [`XCache`].

use std::sync::Arc;
use std::time::Duration;

use http::header::{HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use http_body::Body;

use super::body::ResponseBody;
use super::inflight::{Failure, SharedAnswer};
use super::origin::{FillBody, Inner, OriginBody, call_through};
use super::outcome::{XCache, age_value, concat_status};
use super::refresh::spawn_refresh;
use super::route::Route;
use crate::cache::{Freshness, Stored};
use crate::http::conditional::{NOT_MODIFIED_HEADERS, not_modified};
use crate::http::request::{Asked, Kind};
use crate::http::{CACHE_STATUS_NAME, X_CACHE_NAME};
use crate::keys::{CacheKeys, LocalKey};
use crate::metrics::Event;
use crate::policy::ColdMiss;

/// An entry found for a request, and what answering from it needs.
pub(crate) struct Found<'a> {
    pub(crate) stored: &'a Arc<Stored>,
    /// How old it is now.
    pub(crate) age: Duration,
    /// Its key in L1.
    pub(crate) local: LocalKey,
    /// Its Redis keys, when the caller has them (past L1).
    pub(crate) keys: Option<&'a CacheKeys>,
    /// Fresh, and due for its early refresh (see [`early`](super::early)): decided once
    /// per request, as XFetch draws a number for it.
    pub(crate) early: bool,
}

/// Answers from an entry that is fresh (a hit) or stale (served, and refreshed in the
/// background with a clone of the service); `None` for an expired one. A conditional
/// request that the entry meets gets `304` (see `http::conditional`).
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
    let Found {
        stored,
        age,
        local,
        keys,
        early,
    } = found;
    let x_cache = match freshness(route, stored, age) {
        Freshness::Fresh => {
            route.stats.record(Event::Hit);
            if early && spawn_refresh(route, local, keys, stored.clone(), request, inner) {
                route.stats.record(Event::EarlyRefresh);
            }
            XCache::Hit
        }
        Freshness::Stale => {
            route.stats.record(Event::Stale);
            spawn_refresh(route, local, keys, stored.clone(), request, inner);
            XCache::Stale
        }
        Freshness::Expired => return None,
    };
    if asked.conditional
        && not_modified(stored.response.status, &stored.headers(), request.headers())
    {
        route.stats.record(Event::NotModified);
        return Some(serve_not_modified(stored, age, x_cache, true));
    }
    Some(serve_aged(stored, age, asked.kind, x_cache))
}

/// A hit: the answer from an entry `age` old if it is fresh and not due for an early
/// refresh (counted by the caller, as an L1 hit and a hit at once).
pub(crate) fn answer_fresh<B: Body>(
    route: &Route,
    stored: &Stored,
    age: Duration,
    kind: Kind,
) -> Option<Response<ResponseBody<B>>> {
    (freshness(route, stored, age) == Freshness::Fresh)
        .then(|| serve_aged(stored, age, kind, XCache::Hit))
}

/// Where an entry `age` old is in its life, for this process.
fn freshness(route: &Route, stored: &Stored, age: Duration) -> Freshness {
    match stored.freshness_at(age) {
        // Soft-purged by a tag: served stale, and refreshed, where the entry may be
        // served stale at all (else it is filled again, once, as an expired one).
        Freshness::Fresh if route.purge_of(stored).is_some() => {
            if stored.response.grace.is_zero() {
                Freshness::Expired
            } else {
                Freshness::Stale
            }
        }
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
    }
}

/// A response from a stored entry, with its `age`, `x-cache` and `cache-status`.
pub(crate) fn serve<B: Body>(
    stored: &Stored,
    kind: Kind,
    x_cache: XCache,
) -> Response<ResponseBody<B>> {
    serve_aged(stored, stored.age(), kind, x_cache)
}

/// The answer from the entry a fill came to: `kept` when it is in the caches (else it
/// is the fill's own answer, after its write was refused).
pub(crate) fn serve_filled<B: Body>(
    stored: &Stored,
    kept: bool,
    kind: Kind,
) -> Response<ResponseBody<B>> {
    let age = stored.age();
    let mut response = Response::new(body_for(kind, stored));
    *response.status_mut() = stored.response.status;
    *response.headers_mut() = stored.answer_headers(
        age_value(age.as_secs()),
        XCache::Miss.value(),
        XCache::Miss.of_entry(ttl(stored, age), kept),
    );
    response
}

/// [`serve`], for an entry known to be `age` old.
pub(crate) fn serve_aged<B: Body>(
    stored: &Stored,
    age: Duration,
    kind: Kind,
    x_cache: XCache,
) -> Response<ResponseBody<B>> {
    let cached = &stored.response;
    let mut response = Response::new(body_for(kind, stored));
    *response.status_mut() = cached.status;
    *response.headers_mut() = stored.answer_headers(
        age_value(age.as_secs()),
        x_cache.value(),
        x_cache.of_entry(ttl(stored, age), true),
    );
    response
}

/// The answer from the entry a fill came to (`kept` when it is in the caches), to a
/// conditional request: `304` if the entry meets its condition (RFC 9111 §4.3.2: the
/// entry was just filled or validated), else `None`.
pub(crate) fn filled_not_modified<B: Body>(
    stored: &Stored,
    kept: bool,
    request: &http::HeaderMap,
) -> Option<Response<ResponseBody<B>>> {
    not_modified(stored.response.status, &stored.headers(), request)
        .then(|| serve_not_modified(stored, stored.age(), XCache::Miss, kept))
}

/// `304 Not Modified` from an entry `age` old (`kept` when it is in the caches): no
/// body, the stored headers RFC 9110 §15.4.5 asks for, and the layer's own.
fn serve_not_modified<B: Body>(
    stored: &Stored,
    age: Duration,
    x_cache: XCache,
    kept: bool,
) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::empty());
    *response.status_mut() = StatusCode::NOT_MODIFIED;
    let stored_headers = stored.headers();
    let headers = response.headers_mut();
    for name in NOT_MODIFIED_HEADERS {
        for value in stored_headers.get_all(&name) {
            headers.append(name.clone(), value.clone());
        }
    }
    headers.insert(http::header::AGE, age_value(age.as_secs()));
    headers.insert(X_CACHE_NAME, x_cache.value());
    headers.insert(CACHE_STATUS_NAME, x_cache.of_entry(ttl(stored, age), kept));
    response
}

/// The freshness an entry `age` old has left, in whole seconds (RFC 9211's `ttl`):
/// rounded up while fresh, negative once stale.
fn ttl(stored: &Stored, age: Duration) -> i64 {
    let fresh_for = stored.response.fresh_for;
    if age < fresh_for {
        let left = fresh_for - age;
        (left.as_secs() + u64::from(left.subsec_nanos() > 0)) as i64
    } else {
        -((age - fresh_for).as_secs() as i64) - 1
    }
}

/// The body of an answer of `kind` from a whole `body`: none for a HEAD.
fn body_for<B: Body>(kind: Kind, stored: &Stored) -> ResponseBody<B> {
    match (kind, stored.in_parts()) {
        (Kind::Get, None) => ResponseBody::full(stored.response.body.clone()),
        (Kind::Get, Some(parts)) => ResponseBody::parts(parts.clone(), 0, parts.len()),
        (Kind::Head, _) => ResponseBody::empty(),
    }
}

/// An answer of the origin that the callers of its fill share, as its body streams:
/// `miss` while it may be stored, else `pass`; `collapsed` (RFC 9211) for a caller
/// that joined the fill another caller led.
pub(crate) fn serve_shared<B: Body>(
    shared: &SharedAnswer,
    kind: Kind,
    joined: bool,
) -> Response<ResponseBody<B>> {
    let body = match kind {
        Kind::Get => ResponseBody::shared(shared.body.reader()),
        Kind::Head => ResponseBody::empty(),
    };
    let mut response = Response::new(body);
    *response.status_mut() = shared.status;
    *response.headers_mut() = shared.headers.clone();
    let x_cache = if shared.storing {
        XCache::Miss
    } else {
        XCache::Pass
    };
    let headers = response.headers_mut();
    headers.insert(X_CACHE_NAME, x_cache.value());
    headers.append(
        CACHE_STATUS_NAME,
        if joined {
            XCache::collapsed()
        } else {
            x_cache.forwarded()
        },
    );
    response
}

/// Marks an answer that is not from an entry: `x-cache`, and this cache's member of
/// `cache-status`, after those of the caches the origin's answer came through.
pub(crate) fn mark_forwarded(headers: &mut http::HeaderMap, x_cache: XCache) {
    headers.insert(X_CACHE_NAME, x_cache.value());
    headers.append(CACHE_STATUS_NAME, x_cache.forwarded());
}

/// Passes a request through to the origin: its answer as it comes, not stored, marked
/// `x_cache`; the guard's `504` when its head did not come within the route's pass
/// timeout.
pub(crate) async fn passthrough<S, ReqBody, ResBody>(
    route: &Route,
    inner: S,
    request: Request<ReqBody>,
    x_cache: XCache,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: Send + 'static,
    ResBody: OriginBody,
{
    let Some(response) = call_through((&route.policy, &route.stats), inner, request).await? else {
        route.stats.record(Event::OriginFailed);
        return Ok(own_answer(route, Failure::Timeout, x_cache));
    };
    let mut response = response.map(ResponseBody::stream);
    mark_forwarded(response.headers_mut(), x_cache);
    Ok(response)
}

/// The entry that may stand in for a failed origin, as a response of `kind`.
pub(crate) fn usable_on_error<B: Body>(
    route: &Route,
    fallback: &Option<Arc<Stored>>,
    kind: Kind,
) -> Option<Response<ResponseBody<B>>> {
    let stored = fallback.as_ref()?;
    if !route.serves_on_error(stored) {
        return None;
    }
    route.stats.record(Event::StaleIfError);
    route.stats.record(Event::Stale);
    Some(serve(stored, kind, XCache::Stale))
}

/// The origin failed with nothing of its to share: the entry that may stand in, or the
/// guard's own answer (`502`, `504`), never stored.
pub(crate) fn failed<B: Body>(
    route: &Route,
    fallback: &Option<Arc<Stored>>,
    failure: Failure,
    kind: Kind,
) -> Response<ResponseBody<B>> {
    if let Some(stale) = usable_on_error(route, fallback, kind) {
        return stale;
    }
    route.stats.record(Event::OriginFailed);
    own_answer(route, failure, XCache::Miss)
}

/// The guard's own answer to a failed origin, for a request that was to be answered
/// `x_cache` (a fill's, `miss`; a pass-through's, `pass` or `bypass`): empty, `Retry-After`
/// the route's error back-off, and a `cache-status` that says why.
fn own_answer<B: Body>(
    route: &Route,
    failure: Failure,
    x_cache: XCache,
) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::empty());
    *response.status_mut() = failure.status();
    let headers = response.headers_mut();
    headers.insert(RETRY_AFTER, whole_seconds(route.policy.error_backoff));
    headers.insert(X_CACHE_NAME, x_cache.value());
    let status = match (x_cache, failure) {
        (XCache::Bypass, _) => concat_status!("fwd=bypass; detail=origin-timeout"),
        (_, Failure::Error) => concat_status!("fwd=uri-miss; detail=origin-error"),
        (_, Failure::Timeout) => concat_status!("fwd=uri-miss; detail=origin-timeout"),
        (_, Failure::LeaseLost) => concat_status!("fwd=uri-miss; detail=lease-lost"),
        (_, Failure::Panicked) => concat_status!("fwd=uri-miss; detail=origin-panicked"),
        (_, Failure::Cancelled) => concat_status!("fwd=uri-miss; detail=fill-cancelled"),
    };
    headers.insert(CACHE_STATUS_NAME, HeaderValue::from_static(status));
    response
}

/// A duration as a `Retry-After`: whole seconds, rounded up, at least 1.
fn whole_seconds(duration: Duration) -> HeaderValue {
    HeaderValue::from(duration.as_secs_f64().ceil().max(1.0) as u64)
}

/// The caller need not wait for a fill that leaves the origin alone: the entry that may
/// stand in, or `503` with the route's `Retry-After` (on a route that passes cold misses
/// through, the back-off's).
pub(crate) fn stood_aside<B: Body>(
    route: &Route,
    fallback: &Option<Arc<Stored>>,
    kind: Kind,
) -> Response<ResponseBody<B>> {
    if let Some(stale) = usable_on_error(route, fallback, kind) {
        return stale;
    }
    route.stats.record(Event::Rejected);
    let retry_after = match route.policy.cold_miss {
        ColdMiss::Reject { retry_after } => retry_after,
        _ => route.policy.error_backoff,
    };
    let mut response = Response::new(ResponseBody::empty());
    *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let headers = response.headers_mut();
    headers.insert(RETRY_AFTER, whole_seconds(retry_after));
    headers.insert(X_CACHE_NAME, XCache::Miss.value());
    headers.insert(
        CACHE_STATUS_NAME,
        HeaderValue::from_static(concat_status!("detail=cold-wait")),
    );
    response
}
