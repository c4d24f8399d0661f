//! Answering a caller from what the guard has: the one decision on an entry found for
//! a request (a hit, a stale entry served while its refresh starts, a `304`, or expired:
//! not an answer), made in [`lookup`] (and carried out by the request path,
//! `service::answer`, the one place a refresh is started); a request passed through to
//! the origin (bounded by the route's pass timeout); an entry that may stand in for a
//! failed origin, else the guard's own answer. The responses themselves are built in
//! [`respond`](super::respond).

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body::Body;

use super::body::ResponseBody;
use super::inflight::Failure;
use super::origin::{Inner, OriginBody, call_through};
use super::outcome::XCache;
use super::respond::{mark_forwarded, own_answer, rejected, serve, serve_aged};
use super::route::Route;
use crate::cache::{Freshness, Stored};
use crate::http::request::Kind;
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

/// What an entry found for a request answers it with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup {
    /// A hit, and whether the entry is due for its early refresh.
    Fresh { refresh: bool },
    /// Served stale while it is refreshed.
    Stale,
    /// Not an answer: the caller fills it (or waits for the fill).
    Expired,
}

/// The one decision on an entry found for a request: where it is in its life for this
/// process, and, fresh, whether its early refresh is due.
pub(crate) fn lookup(route: &Route, found: &Found<'_>) -> Lookup {
    match freshness(route, found.stored, found.age) {
        Freshness::Fresh => Lookup::Fresh {
            refresh: found.early,
        },
        Freshness::Stale => Lookup::Stale,
        Freshness::Expired => Lookup::Expired,
    }
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
    let Some(response) = call_through(&route.policy, &route.stats, inner, request).await? else {
        route.stats.record(Event::OriginFailed);
        return Ok(own_answer(
            Failure::Timeout,
            x_cache,
            route.policy.error_backoff,
        ));
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
    own_answer(failure, XCache::Miss, route.policy.error_backoff)
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
    rejected(retry_after)
}
