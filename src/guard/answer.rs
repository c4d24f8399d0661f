//! Answering a caller: from an entry (a hit, or a stale entry while its refresh
//! starts), from the origin straight (a pass-through), or by the route's cold-miss
//! behaviour; and the `x-cache`, `cache-status` and `age` each answer carries.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use http::header::{HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use http_body::Body;
use tower::ServiceExt;

use super::body::ResponseBody;
use super::conditional::{NOT_MODIFIED_HEADERS, not_modified};
use super::origin::{Buffered, FillBody, Inner, OriginBody};
use super::refresh::spawn_refresh;
use super::route::Route;
use crate::CACHE_NAME;
use crate::cache::{CACHE_STATUS_NAME, Freshness, Stored, X_CACHE_NAME};
use crate::keys::{CacheKeys, LocalKey};
use crate::metrics::Event;
use crate::policy::ColdMiss;
use crate::rules::{Asked, Kind};

/// `stampede-guard; ` and a `cache-status` parameter list, as a `&'static str`.
macro_rules! concat_status {
    ($params:literal) => {
        concat!("stampede-guard; ", $params)
    };
}
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
/// request that the entry meets gets `304` (see [`conditional`](super::conditional)).
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
            "hit"
        }
        Freshness::Stale => {
            route.stats.record(Event::Stale);
            spawn_refresh(route, local, keys, stored.clone(), request, inner);
            "stale"
        }
        Freshness::Expired => return None,
    };
    if asked.conditional && not_modified(&stored.response, request.headers()) {
        route.stats.record(Event::NotModified);
        return Some(serve_not_modified(stored, age, x_cache));
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
        .then(|| serve_aged(stored, age, kind, "hit"))
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
    x_cache: &'static str,
) -> Response<ResponseBody<B>> {
    serve_aged(stored, stored.age(), kind, x_cache)
}

/// [`serve`], for an entry known to be `age` old.
pub(crate) fn serve_aged<B: Body>(
    stored: &Stored,
    age: Duration,
    kind: Kind,
    x_cache: &'static str,
) -> Response<ResponseBody<B>> {
    let cached = &stored.response;
    let body = match kind {
        Kind::Get => ResponseBody::full(cached.body.clone()),
        Kind::Head => ResponseBody::empty(),
    };
    let mut response = Response::new(body);
    *response.status_mut() = cached.status;
    *response.headers_mut() = stored.answer_headers(
        age_value(age.as_secs()),
        HeaderValue::from_static(x_cache),
        cache_status(x_cache, ttl(stored, age)),
    );
    response
}

/// `304 Not Modified` from an entry `age` old: no body, the stored headers RFC 9110
/// §15.4.5 asks for, and the layer's own.
fn serve_not_modified<B: Body>(
    stored: &Stored,
    age: Duration,
    x_cache: &'static str,
) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::empty());
    *response.status_mut() = StatusCode::NOT_MODIFIED;
    let headers = response.headers_mut();
    for name in NOT_MODIFIED_HEADERS {
        for value in stored.response.headers.get_all(&name) {
            headers.append(name.clone(), value.clone());
        }
    }
    headers.insert(http::header::AGE, age_value(age.as_secs()));
    headers.insert(X_CACHE_NAME, HeaderValue::from_static(x_cache));
    headers.insert(CACHE_STATUS_NAME, cache_status(x_cache, ttl(stored, age)));
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

/// The `cache-status` of an answer from an entry: `hit` with the `ttl` left for a hit
/// or a stale answer, `fwd=uri-miss; stored` for a fill. Hits and stale answers within an
/// hour of their freshness take a value from a table made once; others, the value this
/// thread made last, if it is the same: a hit does not format a number.
fn cache_status(x_cache: &'static str, ttl: i64) -> HeaderValue {
    const HOUR: i64 = 3600;
    static HITS: LazyLock<Vec<HeaderValue>> = LazyLock::new(|| {
        (-HOUR..=HOUR)
            .map(|n| leaked(format!("{CACHE_NAME}; hit; ttl={n}")))
            .collect()
    });
    thread_local! {
        static LAST: std::cell::RefCell<Option<(i64, HeaderValue)>> =
            const { std::cell::RefCell::new(None) };
    }
    match x_cache {
        "hit" | "stale" if (-HOUR..=HOUR).contains(&ttl) => HITS[(ttl + HOUR) as usize].clone(),
        "hit" | "stale" => LAST.with_borrow_mut(|last| match last {
            Some((at, value)) if *at == ttl => value.clone(),
            _ => {
                let value = value(format!("{CACHE_NAME}; hit; ttl={ttl}"));
                *last = Some((ttl, value.clone()));
                value
            }
        }),
        _ => value(format!("{CACHE_NAME}; fwd=uri-miss; stored; ttl={ttl}")),
    }
}

fn leaked(text: String) -> HeaderValue {
    HeaderValue::from_static(Box::leak(text.into_boxed_str()))
}

fn value(text: String) -> HeaderValue {
    HeaderValue::try_from(text).expect("an ASCII header value")
}

/// An `age` header value: from a table made once for the first hour, so that a hit does
/// not format a number (and allocate for it).
fn age_value(seconds: u64) -> HeaderValue {
    static AGES: LazyLock<Vec<HeaderValue>> =
        LazyLock::new(|| (0..3600u64).map(|n| leaked(n.to_string())).collect());
    match AGES.get(seconds as usize) {
        Some(value) => value.clone(),
        None => HeaderValue::from(seconds),
    }
}

/// An answer of the origin that was not stored, for one more of its waiters.
pub(crate) fn serve_buffered<B: Body>(buffered: &Buffered) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::full(buffered.body.clone()));
    *response.status_mut() = buffered.status;
    *response.headers_mut() = buffered.headers.clone();
    set_x_cache(response.headers_mut(), "pass");
    response
}

/// Marks an answer that is not from an entry: `x-cache`, and this cache's member of
/// `cache-status`, after those of the caches the origin's answer came through.
pub(crate) fn set_x_cache(headers: &mut http::HeaderMap, value: &'static str) {
    headers.insert(X_CACHE_NAME, HeaderValue::from_static(value));
    let status = match value {
        "bypass" => concat_status!("fwd=bypass"),
        "miss" => concat_status!("fwd=uri-miss; stored"),
        _ => concat_status!("fwd=uri-miss"),
    };
    headers.append(CACHE_STATUS_NAME, HeaderValue::from_static(status));
}

pub(crate) async fn passthrough<S, ReqBody, ResBody>(
    route: &Route,
    inner: S,
    request: Request<ReqBody>,
    x_cache: &'static str,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: FillBody,
    ResBody: OriginBody,
{
    route.stats.record(Event::OriginCall);
    // A clone that has not been polled: `oneshot` waits for it to be ready.
    let response = inner.oneshot(request).await?;
    let mut response = response.map(ResponseBody::stream);
    set_x_cache(response.headers_mut(), x_cache);
    Ok(response)
}

/// The entry that may stand in for a failed origin, as a response.
pub(crate) fn usable_on_error<B: Body>(
    route: &Route,
    fallback: &Option<Arc<Stored>>,
) -> Option<Response<ResponseBody<B>>> {
    let stored = fallback.as_ref()?;
    if !route.serves_on_error(stored) {
        return None;
    }
    route.stats.record(Event::StaleIfError);
    route.stats.record(Event::Stale);
    Some(serve(stored, Kind::Get, "stale"))
}

/// The cold wait is over with nothing to serve: the route's cold-miss behaviour.
pub(crate) async fn cold_miss<S, ReqBody, ResBody>(
    route: &Route,
    inner: S,
    request: Request<ReqBody>,
    fallback: Option<Arc<Stored>>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: FillBody,
    ResBody: OriginBody,
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
            let headers = response.headers_mut();
            headers.insert(X_CACHE_NAME, HeaderValue::from_static("miss"));
            headers.insert(
                CACHE_STATUS_NAME,
                HeaderValue::from_static(concat_status!("detail=cold-wait")),
            );
            Ok(response)
        }
        _ => {
            route.stats.record(Event::Passthrough);
            passthrough(route, inner, request, "pass").await
        }
    }
}
