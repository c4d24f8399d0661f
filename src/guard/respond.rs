//! Responses, built from what they answer with and nothing else: an entry (a hit, a
//! stale entry, a `304` from it), a fill's shared answer as it streams, or the guard's
//! own (`502`, `504`, `503`). No cache is read, no metric counted, nothing started:
//! [`answer`](super::answer) decides which, these build it. Each answer's `x-cache` and
//! `cache-status` come from one [`XCache`].

use std::time::Duration;

use http::header::{HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body::Body;

use super::body::ResponseBody;
use super::inflight::{Failure, SharedAnswer};
use super::outcome::{XCache, age_value, concat_status};
use crate::cache::Stored;
use crate::http::conditional::{NOT_MODIFIED_HEADERS, not_modified};
use crate::http::request::Kind;
use crate::http::{CACHE_STATUS_NAME, X_CACHE_NAME};

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
pub(crate) fn serve_not_modified<B: Body>(
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
///
/// `None` when its stream let go of its start already (it keeps only a window, see
/// `stream`): the caller cannot have it whole.
pub(crate) fn serve_shared<B: Body>(
    shared: &SharedAnswer,
    kind: Kind,
    joined: bool,
) -> Option<Response<ResponseBody<B>>> {
    let body = match kind {
        Kind::Get => ResponseBody::shared(shared.body.join()?),
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
    Some(response)
}

/// Replaces this cache's member of an answer's `cache-status` (its last, after those of
/// the caches the answer came through) with `status`.
pub(crate) fn set_own_status(headers: &mut http::HeaderMap, status: HeaderValue) {
    let mut members: Vec<HeaderValue> =
        headers.get_all(CACHE_STATUS_NAME).iter().cloned().collect();
    members.pop();
    members.push(status);
    headers.remove(CACHE_STATUS_NAME);
    for member in members {
        headers.append(CACHE_STATUS_NAME, member);
    }
}

/// Marks an answer that is not from an entry: `x-cache`, and this cache's member of
/// `cache-status`, after those of the caches the origin's answer came through.
pub(crate) fn mark_forwarded(headers: &mut http::HeaderMap, x_cache: XCache) {
    headers.insert(X_CACHE_NAME, x_cache.value());
    headers.append(CACHE_STATUS_NAME, x_cache.forwarded());
}

/// The guard's own answer to a failed origin, for a request that was to be answered
/// `x_cache` (a fill's, `miss`; a pass-through's, `pass` or `bypass`): empty, `Retry-After`
/// the route's error back-off, and a `cache-status` that says why.
pub(crate) fn own_answer<B: Body>(
    failure: Failure,
    x_cache: XCache,
    error_backoff: Duration,
) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::empty());
    *response.status_mut() = failure.status();
    let headers = response.headers_mut();
    headers.insert(RETRY_AFTER, whole_seconds(error_backoff));
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

/// `503 Service Unavailable` for a caller that need not wait for a fill that leaves the
/// origin alone, with `retry_after` as its `Retry-After`.
pub(crate) fn rejected<B: Body>(retry_after: Duration) -> Response<ResponseBody<B>> {
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
