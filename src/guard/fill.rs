//! Calling the origin: cold fills (awaited by callers) and refreshes (awaited by no one).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_service::Service;

use super::body::ResponseBody;
use super::layer::Route;
use crate::cache::{Freshness, L2Read, Stored, l2_read, l2_write};
use crate::entry::CachedResponse;
use crate::keys::CacheKeys;
use crate::lease::{AcquireOutcome, FencingToken, Lease, LeaseLost};
use crate::metrics::Event;
use crate::notify::Wait;
use crate::rules::{self, NotStored};

/// What a cold fill ended with; every caller waiting for the key turns it into its
/// response.
pub(crate) enum FillOutcome<B: Body, E> {
    /// The entry is in the caches.
    Stored(Arc<Stored>),
    /// A response that may not be stored but may be given to every waiter (an
    /// uncacheable status, not private). `failure` when it is a 5xx.
    Shared {
        response: Arc<Buffered>,
        failure: bool,
    },
    /// A response for one caller only (private, too large to buffer) or the origin's
    /// error: the first waiter takes it, the others call the origin themselves.
    Handoff {
        slot: Mutex<Option<Result<Response<ResponseBody<B>>, E>>>,
        failure: bool,
    },
    /// The origin did not answer within the refresh timeout.
    TimedOut,
    /// Another instance held the lease and its entry did not come within the cold wait.
    NoEntry,
}

/// A whole response, as read from the origin.
pub(crate) struct Buffered {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// A response read from the origin, whole or not.
enum Read<B: Body> {
    Whole {
        head: Response<()>,
        body: Bytes,
    },
    /// Reading stopped: the body is too large, has trailers, or failed.
    Partial {
        head: Response<()>,
        prefix: VecDeque<Frame<Bytes>>,
        error: Option<B::Error>,
        rest: Option<Pin<Box<B>>>,
        why: NotStored,
    },
}

enum Origin<B: Body, E> {
    Read(Read<B>),
    Error(E),
    TimedOut,
}

/// Calls the origin and reads its body, up to `max_body` bytes, all within `timeout`.
async fn call_origin<S, ReqBody, B>(
    route: &Route,
    inner: S,
    request: Request<ReqBody>,
) -> Origin<B, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<B>>,
    B: Body<Data = Bytes>,
{
    route.stats.record(Event::OriginCall);
    let max = route.policy.max_body;
    let call = async {
        match inner.oneshot(request).await {
            Ok(response) => Origin::Read(read(response, max).await),
            Err(error) => Origin::Error(error),
        }
    };
    match tokio::time::timeout(route.policy.refresh_timeout, call).await {
        Ok(origin) => origin,
        Err(_) => Origin::TimedOut,
    }
}

async fn read<B: Body<Data = Bytes>>(response: Response<B>, max: usize) -> Read<B> {
    let (parts, body) = response.into_parts();
    let head = Response::from_parts(parts, ());
    let mut body = Box::pin(body);
    let declared = head
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.unwrap_or(0) > max as u64 || body.size_hint().lower() > max as u64 {
        return Read::Partial {
            head,
            prefix: VecDeque::new(),
            error: None,
            rest: Some(body),
            why: NotStored::TooLarge,
        };
    }
    let mut frames: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut size = 0;
    loop {
        match body.frame().await {
            None => {
                let mut whole = BytesMut::with_capacity(size);
                for frame in frames {
                    if let Ok(data) = frame.into_data() {
                        whole.extend_from_slice(&data);
                    }
                }
                return Read::Whole {
                    head,
                    body: whole.freeze(),
                };
            }
            Some(Ok(frame)) => {
                let why = match frame.data_ref() {
                    Some(data) => {
                        size += data.len();
                        (size > max).then_some(NotStored::TooLarge)
                    }
                    None => Some(NotStored::Trailers),
                };
                frames.push_back(frame);
                if let Some(why) = why {
                    return Read::Partial {
                        head,
                        prefix: frames,
                        error: None,
                        rest: Some(body),
                        why,
                    };
                }
            }
            Some(Err(error)) => {
                return Read::Partial {
                    head,
                    prefix: frames,
                    error: Some(error),
                    rest: None,
                    why: NotStored::TooLarge,
                };
            }
        }
    }
}

/// Fills a key that nothing is cached for. `wait` was registered before the lease was
/// asked for, so a notice of another instance's fill cannot slip by.
pub(crate) async fn cold_fill<S, ReqBody, B>(
    route: Arc<Route>,
    keys: CacheKeys,
    request: Request<ReqBody>,
    inner: S,
    mut wait: Wait,
    local_token: FencingToken,
    redis_ok: bool,
) -> FillOutcome<B, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<B>>,
    B: Body<Data = Bytes>,
{
    let policy = &route.policy;
    // The caller looked in the caches before this fill began; another fill may have
    // landed since (here, or elsewhere: its notice then came). Take that instead.
    if let Some(stored) = landed_meanwhile(&route, &keys, local_token, false).await {
        return FillOutcome::Stored(stored);
    }
    // A request waits on Redis at most once: if its cache read failed, it does not also
    // wait on the lease.
    let mut lease = if redis_ok {
        match route
            .shared
            .leases
            .try_acquire(keys.lease(), policy.lease_ttl)
            .await
        {
            AcquireOutcome::Acquired(lease) => {
                if let Some(stored) =
                    landed_meanwhile(&route, &keys, local_token, wait.has_notice()).await
                {
                    release(&route, Some(lease)).await;
                    return FillOutcome::Stored(stored);
                }
                Some(lease)
            }
            AcquireOutcome::Busy { .. } => return wait_for_remote(&route, &keys, &mut wait).await,
            other => {
                lease_unavailable(&route, other);
                None
            }
        }
    } else {
        None
    };
    if lease.is_none() {
        route.stats.record(Event::LocalOnly);
    }
    // Taken before the origin is called: an invalidation that comes during the call then
    // has a higher token than this fill's local entry, and refuses it.
    let local_token = local_floor(&route, &keys, local_token).await;
    route.stats.record(Event::ColdFill);
    let origin = match call_under_lease(&route, inner, request, &mut lease).await {
        Some(origin) => origin,
        None => return FillOutcome::TimedOut,
    };
    match origin {
        Origin::TimedOut => {
            back_off(&route, lease).await;
            FillOutcome::TimedOut
        }
        Origin::Error(error) => {
            back_off(&route, lease).await;
            FillOutcome::Handoff {
                slot: Mutex::new(Some(Err(error))),
                failure: true,
            }
        }
        Origin::Read(Read::Whole { head, body }) => match rules::storable(policy, &head) {
            Ok(()) => {
                FillOutcome::Stored(store(&route, &keys, head, body, lease, local_token).await.0)
            }
            Err(why) => {
                not_stored(&route, why);
                let failure = rules::is_failure(head.status());
                if failure {
                    back_off(&route, lease).await;
                } else {
                    release(&route, lease).await;
                }
                let (parts, ()) = head.into_parts();
                // With credentials in fill requests, whatever is not stored (a 401 for
                // the leader's token, say) is the leader's alone.
                let credentials = policy.allow_authorization || policy.allow_cookies;
                if why.is_private() || credentials {
                    let response = Response::from_parts(parts, ResponseBody::full(body));
                    FillOutcome::Handoff {
                        slot: Mutex::new(Some(Ok(response))),
                        failure,
                    }
                } else {
                    FillOutcome::Shared {
                        response: Arc::new(Buffered {
                            status: parts.status,
                            headers: parts.headers,
                            body,
                        }),
                        failure,
                    }
                }
            }
        },
        Origin::Read(Read::Partial {
            head,
            prefix,
            error,
            rest,
            why,
        }) => {
            not_stored(&route, why);
            let failure = error.is_some();
            if failure {
                back_off(&route, lease).await;
            } else {
                release(&route, lease).await;
            }
            let (parts, ()) = head.into_parts();
            let response = Response::from_parts(parts, ResponseBody::resume(prefix, error, rest));
            FillOutcome::Handoff {
                slot: Mutex::new(Some(Ok(response))),
                failure,
            }
        }
    }
}

/// An entry newer than what the caller found (`seen`), that landed while it looked: in
/// L1 (free to check), or in L2 when `notified` says another instance wrote one.
async fn landed_meanwhile(
    route: &Route,
    keys: &CacheKeys,
    seen: FencingToken,
    notified: bool,
) -> Option<Arc<Stored>> {
    let usable = |s: &Stored| s.freshness() != Freshness::Expired && s.response.token > seen;
    if let Some(stored) = route.l1().get(keys.entry())
        && usable(&stored)
    {
        return Some(stored);
    }
    if notified
        && let Ok(L2Read::Found(stored)) =
            l2_read(&route.shared.store, keys.entry(), route.policy.max_body).await
        && usable(&stored)
    {
        route.put_l1(keys.entry().into(), stored.clone()).await;
        return Some(stored);
    }
    None
}

/// Another instance holds the lease: wait for its entry, woken by its notice, at most the
/// route's cold wait.
async fn wait_for_remote<B: Body, E>(
    route: &Route,
    keys: &CacheKeys,
    wait: &mut Wait,
) -> FillOutcome<B, E> {
    let started = tokio::time::Instant::now();
    let deadline = started + route.policy.cold_wait;
    let mut last_look = false;
    loop {
        match l2_read(&route.shared.store, keys.entry(), route.policy.max_body).await {
            Ok(L2Read::Found(stored)) if stored.freshness() != Freshness::Expired => {
                route.put_l1(keys.entry().into(), stored.clone()).await;
                route.stats.record(Event::ColdWaitNotified);
                route.stats.cold_wait_seconds.record(started.elapsed());
                return FillOutcome::Stored(stored);
            }
            Ok(L2Read::Garbage(_)) => route.stats.record(Event::DecodeFailure),
            Err(_) => route.stats.record(Event::RedisError),
            Ok(_) => {}
        }
        if last_look {
            route.stats.record(Event::ColdWaitTimedOut);
            route.stats.cold_wait_seconds.record(started.elapsed());
            return FillOutcome::NoEntry;
        }
        // Woken by the filler's notice; without a subscription (starting up,
        // reconnecting) no notice can come, so look again every 100 ms.
        let until = if *route.shared.subscribed.borrow() {
            deadline
        } else {
            deadline.min(tokio::time::Instant::now() + Duration::from_millis(100))
        };
        if tokio::time::timeout_at(until, wait.notified())
            .await
            .is_err()
            && tokio::time::Instant::now() >= deadline
        {
            // One last look: the notice may have been lost.
            last_look = true;
        }
    }
}

/// Refreshes a stale entry in the background. Nobody awaits it. Returns how long the
/// process should leave the key alone: while another instance holds its lease.
pub(crate) async fn refresh<S, ReqBody, B>(
    route: Arc<Route>,
    keys: CacheKeys,
    current: Arc<Stored>,
    request: Request<ReqBody>,
    inner: S,
) -> Option<Duration>
where
    S: Service<Request<ReqBody>, Response = Response<B>>,
    B: Body<Data = Bytes>,
{
    let policy = &route.policy;
    // Another instance may have refreshed already: take its entry rather than the lease.
    let read = if route.shared.store.is_local_only() {
        Err(())
    } else {
        l2_read(&route.shared.store, keys.entry(), route.policy.max_body)
            .await
            .map_err(|_| route.stats.record(Event::RedisError))
    };
    let redis_up = match read {
        Ok(L2Read::Found(stored))
            if stored.response.token > current.response.token
                || stored.freshness() == Freshness::Fresh =>
        {
            route.put_l1(keys.entry().into(), stored).await;
            route.stats.record(Event::RefreshAdopted);
            return None;
        }
        Ok(L2Read::Garbage(_)) => {
            route.stats.record(Event::DecodeFailure);
            true
        }
        Ok(_) => true,
        Err(()) => false,
    };
    let lease = if redis_up {
        match route
            .shared
            .leases
            .try_acquire(keys.lease(), policy.lease_ttl)
            .await
        {
            AcquireOutcome::Acquired(lease) => Some(lease),
            AcquireOutcome::Busy { retry_after } => {
                route.stats.record(Event::RefreshBusy);
                let ttl = policy.lease_ttl;
                return Some(retry_after.map_or(ttl, |left| left.min(ttl)));
            }
            other => {
                route.stats.record(Event::RefreshRedisError);
                lease_unavailable(&route, other);
                None
            }
        }
    } else {
        None
    };
    if lease.is_none() {
        route.stats.record(Event::LocalOnly);
    }
    let failed = Some(policy.error_backoff);
    let mut lease = lease;
    let local_token = local_floor(&route, &keys, current.response.token).await;
    let Some(origin) = call_under_lease(&route, inner, request, &mut lease).await else {
        return failed;
    };
    match origin {
        Origin::TimedOut => {
            back_off(&route, lease).await;
            route.stats.record(Event::RefreshTimeout);
            failed
        }
        Origin::Error(_) => {
            back_off(&route, lease).await;
            route.stats.record(Event::RefreshOriginError);
            failed
        }
        Origin::Read(Read::Whole { head, body }) => match rules::storable(policy, &head) {
            Ok(()) => {
                let (_, written) = store(&route, &keys, head, body, lease, local_token).await;
                if written {
                    route.stats.record(Event::RefreshWritten);
                }
                None
            }
            Err(_) if rules::is_failure(head.status()) => {
                back_off(&route, lease).await;
                route.stats.record(Event::RefreshOriginError);
                failed
            }
            Err(why) => {
                release(&route, lease).await;
                not_stored(&route, why);
                route.stats.record(Event::RefreshNotStored);
                None
            }
        },
        Origin::Read(Read::Partial { error, why, .. }) => {
            if error.is_some() {
                back_off(&route, lease).await;
                route.stats.record(Event::RefreshOriginError);
                failed
            } else {
                release(&route, lease).await;
                not_stored(&route, why);
                route.stats.record(Event::RefreshNotStored);
                None
            }
        }
    }
}

/// Stores a response: the fenced write to L2 (which releases the lease), then L1. A
/// write refused because a newer entry is stored gives way to that entry. Without a
/// lease (Redis unusable) only L1 is filled, under `local_token`.
async fn store(
    route: &Route,
    keys: &CacheKeys,
    head: Response<()>,
    body: Bytes,
    lease: Option<Lease>,
    local_token: FencingToken,
) -> (Arc<Stored>, bool) {
    let policy = &route.policy;
    let (parts, ()) = head.into_parts();
    let mut headers = parts.headers;
    rules::strip_unstorable(&mut headers);
    // So that a HEAD answered from the entry says how long the GET would be.
    if !headers.contains_key(http::header::CONTENT_LENGTH) {
        headers.insert(http::header::CONTENT_LENGTH, body.len().into());
    }
    let response = CachedResponse {
        status: parts.status,
        headers,
        body,
        fresh_for: policy.fresh_ttl,
        grace: policy.grace,
        keep: policy.keep(),
        token: match &lease {
            Some(lease) => lease.fencing_token(),
            // Without Redis, the entry stands in for the one it replaces, and for an
            // invalidation seen since: it must not be refused by either.
            None => local_token,
        },
    };
    let stored = Arc::new(Stored::aged(response, Duration::ZERO));
    if let Some(lease) = lease {
        let shared = &route.shared;
        match l2_write(
            &shared.store,
            keys,
            &lease,
            &stored.response,
            &shared.channel,
        )
        .await
        {
            Ok(outcome) if outcome.written => {
                written_release(&lease, outcome.released);
                if !outcome.released {
                    // Written under a lease that had expired: fencing made it safe.
                    tracing::debug!(entry = keys.entry(), "entry written after its lease ended");
                }
                route.put_l1(keys.entry().into(), stored.clone()).await;
                return (stored, true);
            }
            Ok(outcome) => {
                written_release(&lease, outcome.released);
                route.stats.record(Event::FencedWriteRefused);
                tracing::debug!(
                    entry = keys.entry(),
                    token = lease.fencing_token().get(),
                    "fenced write refused: a newer entry is stored"
                );
                if let Ok(L2Read::Found(newer)) =
                    l2_read(&shared.store, keys.entry(), route.policy.max_body).await
                {
                    route.put_l1(keys.entry().into(), newer.clone()).await;
                    return (newer, false);
                }
                // Refused for an invalidation (or the newer entry is gone already): ours
                // answers the callers that waited for it, and goes no further.
                return (stored, false);
            }
            Err(_) => {
                // Written or not, released or not: unknown. The lease ends by its TTL;
                // the write is not retried.
                route.stats.record(Event::RedisError);
                crate::metrics::lease_released(
                    lease.name().operation_label(),
                    "error",
                    lease.held_for(),
                );
            }
        }
    }
    route.put_l1(keys.entry().into(), stored.clone()).await;
    (stored, false)
}

/// The token of an entry filled without Redis: it stands in for the entry it replaces,
/// and for the last invalidation seen before the origin was called.
async fn local_floor(route: &Route, keys: &CacheKeys, replaces: FencingToken) -> FencingToken {
    route
        .tombstone(keys.entry())
        .await
        .map_or(replaces, |tomb| tomb.max(replaces))
}

/// Calls the origin, under the route's watchdog when it has one and a lease is held.
/// `None` when the watchdog stopped the call (the lease was lost or ran past its
/// maximum): nothing may be written then.
async fn call_under_lease<S, ReqBody, B>(
    route: &Route,
    inner: S,
    request: Request<ReqBody>,
    lease: &mut Option<Lease>,
) -> Option<Origin<B, S::Error>>
where
    S: Service<Request<ReqBody>, Response = Response<B>>,
    B: Body<Data = Bytes>,
{
    let origin = match (lease.as_mut(), route.policy.watchdog) {
        (Some(held), Some(max_total)) => {
            match route
                .shared
                .leases
                .hold_while_reachable(held, max_total, call_origin(route, inner, request))
                .await
            {
                Ok(origin) => origin,
                Err(lost) => {
                    route.stats.record(Event::ExpiredWhileWorking);
                    let lease = lease.take();
                    if !matches!(lost, LeaseLost::NotOwner) {
                        back_off(route, lease).await;
                    }
                    return None;
                }
            }
        }
        _ => call_origin(route, inner, request).await,
    };
    if lease.as_ref().is_some_and(|l| l.remaining().is_zero()) {
        // No watchdog, and the origin outlasted the lease: the write that follows is
        // fenced, so it cannot replace a newer entry; count it all the same.
        route.stats.record(Event::ExpiredWhileWorking);
    }
    Some(origin)
}

/// The lease could not be had for another reason than `Busy`: go on without it. An
/// acquire whose reply was lost may have set the lease after all: release it,
/// best-effort and once, so that other instances need not wait out its TTL.
fn lease_unavailable(route: &Route, outcome: AcquireOutcome) {
    route.stats.record(Event::RedisError);
    if let AcquireOutcome::TimedOut(attempt) = outcome {
        route.stats.record(Event::UncertainAcquire);
        let leases = route.shared.leases.clone();
        tokio::spawn(async move {
            let _ = leases.release_uncertain(attempt).await;
        });
    }
}

fn not_stored(route: &Route, why: NotStored) {
    route.stats.record(Event::NotStored);
    tracing::debug!(
        route = route.policy.route,
        reason = why.as_str(),
        "response not stored"
    );
}

/// After an origin failure: keep the lease, shortened to the error backoff, so that the
/// fleet does not retry at once.
async fn back_off(route: &Route, lease: Option<Lease>) {
    if let Some(mut lease) = lease {
        let _ = route
            .shared
            .leases
            .renew(&mut lease, route.policy.error_backoff)
            .await;
    }
}

async fn release(route: &Route, lease: Option<Lease>) {
    if let Some(lease) = lease {
        let _ = route.shared.leases.release(lease).await;
    }
}

/// The fenced write released the lease (or found it gone): counted as a release.
fn written_release(lease: &Lease, released: bool) {
    crate::metrics::lease_released(
        lease.name().operation_label(),
        if released { "released" } else { "not_owner" },
        lease.held_for(),
    );
}
