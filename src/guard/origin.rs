//! Calling the origin, and what fills and refreshes both do with its answer: read it
//! (up to the route's body limit), judge it, store it under the lease (a fenced write,
//! then L1) or end the lease without a write and say so to the fleet.
//!
//! This is also where the bounds on the inner service are stated, once: [`Inner`] and
//! the two body traits.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_service::Service;

use super::conditional;
use super::directives::{Lifetimes, lifetimes};
use super::marks::Mark;
use super::route::Route;
use super::vary::TooMany;
use crate::cache::{L2Read, Renewal, Stored, l2_read, l2_revalidate, l2_write};
use crate::entry::{self, CachedResponse};
use crate::keys::CacheKeys;
use crate::lease::{Acquire, AcquireOutcome, FencingToken, Lease, LeaseLost};
use crate::metrics::Event;
use crate::notify::{Ending, Notice};
use crate::rules::{self, NotStored};

/// What the guard needs of the inner service: a service of requests with body `ReqBody`
/// and responses with body `ResBody`, cloned for each call that reaches it (fills and
/// refreshes run in tasks of their own, so everything is `Send + 'static`).
pub(crate) trait Inner<ReqBody, ResBody>:
    Service<
        Request<ReqBody>,
        Response = Response<ResBody>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S, ReqBody, ResBody> Inner<ReqBody, ResBody> for S
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
}

/// The body of the requests the guard makes for fills and refreshes: empty.
pub(crate) trait FillBody: Default + Send + 'static {}

impl<B: Default + Send + 'static> FillBody for B {}

/// The body of the origin's responses.
pub(crate) trait OriginBody:
    Body<Data = Bytes, Error: Send + 'static> + Send + 'static
{
}

impl<B> OriginBody for B
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Send + 'static,
{
}

/// A whole response, as read from the origin.
pub(crate) struct Buffered {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// A response read from the origin, whole or not.
pub(crate) enum Read<B: Body> {
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

pub(crate) enum Called<B: Body, E> {
    Read(Read<B>),
    Error(E),
    TimedOut,
}

/// Calls the origin and reads its body, up to `max_body` bytes, all within `timeout`.
pub(crate) async fn call_origin<S, ReqBody, B>(
    route: &Route,
    inner: S,
    request: Request<ReqBody>,
) -> Called<B, S::Error>
where
    S: Inner<ReqBody, B>,
    ReqBody: FillBody,
    B: OriginBody,
{
    route.stats.record(Event::OriginCall);
    let max = route.policy.max_body;
    let call = async {
        match inner.oneshot(request).await {
            Ok(response) => Called::Read(read(response, max).await),
            Err(error) => Called::Error(error),
        }
    };
    match tokio::time::timeout(route.policy.refresh_timeout, call).await {
        Ok(origin) => origin,
        Err(_) => Called::TimedOut,
    }
}

pub(crate) async fn read<B: Body<Data = Bytes>>(response: Response<B>, max: usize) -> Read<B> {
    let (parts, body) = response.into_parts();
    let head = Response::from_parts(parts, ());
    let mut body = Box::pin(body);
    let declared = head
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // More header values than an entry may hold (`entry::MAX_HEADERS`) would make an
    // entry that L2 could never give back.
    if declared.unwrap_or(0) > max as u64
        || body.size_hint().lower() > max as u64
        || head.headers().len() > crate::entry::MAX_HEADERS
    {
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

/// Splits off what the origin is asked (method, URI, headers), to key and match the
/// answer by, from the request that goes to it.
pub(crate) fn asked<ReqBody>(request: Request<ReqBody>) -> (Request<ReqBody>, Arc<Request<()>>) {
    let (parts, body) = request.into_parts();
    let mut asked = Request::new(());
    *asked.method_mut() = parts.method.clone();
    *asked.uri_mut() = parts.uri.clone();
    *asked.headers_mut() = parts.headers.clone();
    (Request::from_parts(parts, body), Arc::new(asked))
}

/// Calls the origin, under the route's watchdog when it has one and a lease is held.
/// `None` when the watchdog stopped the call (the lease was lost or ran past its
/// maximum): nothing may be written then.
pub(crate) async fn call_under_lease<S, ReqBody, B>(
    route: &Route,
    keys: &CacheKeys,
    inner: S,
    request: Request<ReqBody>,
    claim: &mut Claim,
) -> Option<Called<B, S::Error>>
where
    S: Inner<ReqBody, B>,
    ReqBody: FillBody,
    B: OriginBody,
{
    let origin = match (&mut *claim, route.policy.watchdog) {
        (Claim::Leased(held), Some(max_total)) => {
            match route
                .shared
                .leases
                .hold_while_reachable(held, max_total, call_origin(route, inner, request))
                .await
            {
                Ok(origin) => origin,
                Err(lost) => {
                    route.stats.record(Event::ExpiredWhileWorking);
                    let lost_claim = std::mem::replace(claim, Claim::Local(FencingToken::new(1)));
                    if !matches!(lost, LeaseLost::NotOwner) {
                        end(route, keys, lost_claim, Ending::Error).await;
                    }
                    return None;
                }
            }
        }
        _ => call_origin(route, inner, request).await,
    };
    if matches!(claim, Claim::Leased(lease) if lease.remaining().is_zero()) {
        // No watchdog, and the origin outlasted the lease: the write that follows is
        // fenced, so it cannot replace a newer entry; count it all the same.
        route.stats.record(Event::ExpiredWhileWorking);
    }
    Some(origin)
}

/// What a fill or a refresh works under.
pub(crate) enum Claim {
    /// The key's lease: the write is fenced by its token, goes to L2, releases the lease
    /// and tells the fleet.
    Leased(Lease),
    /// No lease (Redis unusable, or the fleet backing off after a failure): only this
    /// process's single-flight, and only L1 is filled, under this token: that of the
    /// entry it replaces, or of the last invalidation seen here if higher, so that
    /// neither refuses it.
    Local(FencingToken),
}

impl Claim {
    pub(crate) fn is_leased(&self) -> bool {
        matches!(self, Self::Leased(_))
    }
}

/// What became of a storable answer.
pub(crate) enum Kept {
    /// Stored; `written` when it reached L2, `rekeyed` when under another key than its
    /// caller's (the route learned a `Vary` header from it).
    Stored {
        stored: Arc<Stored>,
        written: bool,
        rekeyed: bool,
    },
    /// Not stored after all; the lease has been ended.
    NotStored {
        head: Response<()>,
        body: Bytes,
        why: NotStored,
    },
}

/// Stores a storable answer under the key it belongs to: the caller's, unless the answer
/// varies on a header that key did not include. Then the route learns the header (and
/// tells the fleet), the caller's lease is given back (its waiters look again, under
/// their own new keys), and the answer is stored under its own key with that key's lease.
pub(crate) async fn keep(
    route: &Route,
    keys: &CacheKeys,
    asked: &Request<()>,
    head: Response<()>,
    body: Bytes,
    claim: Claim,
) -> Kept {
    let unkeyed = rules::unkeyed_vary(&route.policy, &route.learned.names(), head.headers());
    if !unkeyed.is_empty() {
        match route.learned.learn(&unkeyed) {
            Ok(false) => {}
            Ok(true) => {
                route.stats.record(Event::VaryLearned);
                tracing::info!(
                    route = route.policy.route,
                    vary = ?unkeyed,
                    "route learned headers its responses vary on: keyed from now on"
                );
                if claim.is_leased() {
                    let names: Vec<&str> = unkeyed.iter().map(HeaderName::as_str).collect();
                    let notice = Notice::Learned(&route.policy.route, names);
                    let _ = route
                        .shared
                        .notices
                        .publish(&route.shared.store, &notice)
                        .await;
                }
            }
            Err(TooMany) => {
                not_stored(route, NotStored::VaryUnkeyed);
                end(route, keys, claim, Ending::Pass).await;
                return Kept::NotStored {
                    head,
                    body,
                    why: NotStored::VaryUnkeyed,
                };
            }
        }
    }
    let Some(own) = route.keys_for(asked) else {
        end(route, keys, claim, Ending::Pass).await;
        return Kept::NotStored {
            head,
            body,
            why: NotStored::VaryUnkeyed,
        };
    };
    if own == *keys {
        let (stored, written) = store(route, keys, head, body, claim).await;
        return Kept::Stored {
            stored,
            written,
            rekeyed: false,
        };
    }
    // The caller's lease is not the lease of the key the answer belongs to.
    let claim = match claim {
        Claim::Local(token) => Claim::Local(token),
        leased @ Claim::Leased(_) => {
            // The answer's own lease first, then the caller's given back: the caller's
            // waiters elsewhere, woken by its end, find the variant being filled and
            // wait for it, rather than racing this instance to fill it again. Never
            // waits, so holding both for a moment cannot deadlock.
            let acquired = route
                .shared
                .leases
                .try_acquire_fill(&own, route.label(), route.lease_ttl(), FencingToken::new(0))
                .await;
            end(route, keys, leased, Ending::Gone).await;
            match acquired {
                Acquire::Outcome(AcquireOutcome::Acquired(own_lease)) => Claim::Leased(own_lease),
                // Someone stored that variant meanwhile.
                Acquire::Written => {
                    return Kept::NotStored {
                        head,
                        body,
                        why: NotStored::VaryUnkeyed,
                    };
                }
                Acquire::Outcome(other) => {
                    // Someone fills that variant already, or Redis failed: the answer goes
                    // to its callers unstored.
                    if !matches!(other, AcquireOutcome::Busy { .. }) {
                        lease_unavailable(route, other);
                    }
                    return Kept::NotStored {
                        head,
                        body,
                        why: NotStored::VaryUnkeyed,
                    };
                }
            }
        }
    };
    let (stored, written) = store(route, &own, head, body, claim).await;
    Kept::Stored {
        stored,
        written,
        rekeyed: true,
    }
}

/// Stores a response: under a lease, the fenced write to L2 (which releases the
/// lease), then L1; a write refused because a newer entry is stored gives way to that
/// entry. Without one, only L1 is filled.
pub(crate) async fn store(
    route: &Route,
    keys: &CacheKeys,
    head: Response<()>,
    body: Bytes,
    claim: Claim,
) -> (Arc<Stored>, bool) {
    let (parts, ()) = head.into_parts();
    // Read before `Age` is stripped.
    let life = lifetimes(&route.policy, &parts.headers, fresh_time(&route.policy));
    let mut headers = entry::compact(&parts.headers);
    rules::strip_unstorable(&mut headers);
    // So that a HEAD answered from the entry says how long the GET would be.
    if !headers.contains_key(http::header::CONTENT_LENGTH) {
        headers.insert(http::header::CONTENT_LENGTH, body.len().into());
    }
    // Already a copy of its own: `read` gathers the body's frames into one buffer of its
    // exact size.
    let stored = entry_of(parts.status, headers, body, life, &claim);
    put(route, keys, stored, claim, Write::Whole).await
}

/// Counts the answer to a conditional request: a new response (the `304`s are counted
/// where they renew an entry).
pub(crate) fn counted_revalidation<B: Body, E>(route: &Route, origin: &Called<B, E>) {
    if let Called::Read(Read::Whole { head, .. } | Read::Partial { head, .. }) = origin
        && head.status() != StatusCode::NOT_MODIFIED
    {
        route.stats.record(Event::RevalidatedModified);
    }
}

/// Renews `current`, which the origin said is unchanged (a `304` to a conditional
/// request): its headers updated from the `304`'s, its body kept, fresh again. Under a
/// lease, only its metadata is written to L2 (fenced as a whole write is), unless the
/// entry there is not `current` any more: then the whole entry is written.
///
/// `None` when the renewed entry may not be stored (the `304` made it private, gave it
/// a cookie, or a `Vary` this key does not cover): the lease is ended as for any answer
/// that may not be stored, and the entry is left as it was.
pub(crate) async fn renew(
    route: &Route,
    keys: &CacheKeys,
    current: &Stored,
    not_modified: Response<()>,
    claim: Claim,
) -> Option<(Arc<Stored>, bool)> {
    let cached = &current.response;
    let mut headers = conditional::renewed_headers(&cached.headers, not_modified.headers());
    // What the 304 added is judged as a whole answer's headers are.
    let mut renewed = Response::new(());
    *renewed.status_mut() = cached.status;
    *renewed.headers_mut() = headers;
    let unkeyed = rules::unkeyed_vary(&route.policy, &route.learned.names(), renewed.headers());
    let why = match rules::storable(&route.policy, &renewed) {
        Err(why) => Some(why),
        Ok(()) if !unkeyed.is_empty() => Some(NotStored::VaryUnkeyed),
        Ok(()) => None,
    };
    if let Some(why) = why {
        not_stored(route, why);
        end(route, keys, claim, Ending::Pass).await;
        return None;
    }
    route.stats.record(Event::Revalidated);
    headers = std::mem::take(renewed.headers_mut());
    // A copy of its own: the 304's values are slices of the client's read buffer.
    headers = entry::compact(&headers);
    let life = lifetimes(&route.policy, &headers, fresh_time(&route.policy));
    let stored = entry_of(cached.status, headers, cached.body.clone(), life, &claim);
    // Only metadata, over a body Redis is known to hold under that token.
    let write = if current.token_is_its_own() {
        Write::Renew(cached.token)
    } else {
        Write::Whole
    };
    Some(put(route, keys, stored, claim, write).await)
}

/// The route's fresh time for one more entry: its fresh TTL less its jitter.
fn fresh_time(policy: &crate::Policy) -> Duration {
    match policy.fresh_jitter {
        jitter if jitter.is_zero() => policy.fresh_ttl,
        // Whole milliseconds, as entries keep their times.
        jitter => {
            let off = fastrand::u64(0..=jitter.as_millis() as u64);
            policy.fresh_ttl - Duration::from_millis(off)
        }
    }
}

/// The entry of a response to store under `claim`, fresh from now for `life`.
fn entry_of(
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    life: Lifetimes,
    claim: &Claim,
) -> Arc<Stored> {
    let response = CachedResponse {
        status,
        headers,
        body,
        fresh_for: life.fresh_for,
        grace: life.grace,
        keep: life.keep,
        token: match claim {
            Claim::Leased(lease) => lease.fencing_token(),
            Claim::Local(token) => *token,
        },
    };
    let stored = Stored::aged(response, life.age);
    Arc::new(match claim {
        // Its token is not the time its fill began: this machine's time is.
        Claim::Local(_) => stored.filled_locally(super::purge::local_micros()),
        Claim::Leased(_) => stored,
    })
}

/// How an entry goes to L2.
#[derive(Clone, Copy)]
enum Write {
    /// All of it.
    Whole,
    /// Only its metadata, over the entry written under this token, whose body it has.
    Renew(FencingToken),
}

/// Puts an entry in the caches: under a lease, the fenced write to L2 (which releases
/// the lease), then L1; a write refused because a newer entry is stored gives way to
/// that entry. Without one, only L1 is filled.
async fn put(
    route: &Route,
    keys: &CacheKeys,
    stored: Arc<Stored>,
    claim: Claim,
    write: Write,
) -> (Arc<Stored>, bool) {
    if let Claim::Leased(lease) = claim {
        route.held(lease.held_for());
        let shared = &route.shared;
        let channel = shared.notices.channel();
        let mut written = match write {
            Write::Whole => None,
            Write::Renew(revalidated) => match l2_revalidate(
                &shared.store,
                keys,
                &lease,
                revalidated,
                &stored.response,
                channel,
            )
            .await
            {
                Ok(Renewal::Renewed { released }) => Some(Ok((true, released))),
                Ok(Renewal::Refused { released }) => Some(Ok((false, released))),
                // Not the entry that was revalidated any more: write all of it.
                Ok(Renewal::Gone) => None,
                Err(error) => Some(Err(error)),
            },
        };
        if written.is_none() {
            written = Some(
                l2_write(&shared.store, keys, &lease, &stored, channel)
                    .await
                    .map(|outcome| (outcome.written, outcome.released)),
            );
        }
        match written.expect("written above") {
            Ok((true, released)) => {
                written_release(&lease, released);
                if !released {
                    // Written under a lease that had expired: fencing made it safe.
                    tracing::debug!(entry = keys.entry(), "entry written after its lease ended");
                }
                shared.marks.clear(keys.entry());
                route.put_l1(keys, stored.clone()).await;
                return (stored, true);
            }
            Ok((false, released)) => {
                written_release(&lease, released);
                route.stats.record(Event::FencedWriteRefused);
                tracing::debug!(
                    entry = keys.entry(),
                    token = lease.fencing_token().get(),
                    "fenced write refused: a newer lease or entry exists"
                );
                if let Ok(L2Read::Found(newer)) =
                    l2_read(&shared.store, keys, route.policy.max_body).await
                {
                    route.put_l1(keys, newer.clone()).await;
                    return (newer, false);
                }
                // Refused for an invalidation (or the newer entry is gone already): ours
                // answers the callers that waited for it, and goes no further.
                return (stored, false);
            }
            Err(_) => {
                // Written or not, released or not: unknown. The lease ends by its TTL;
                // the write is not retried. Waiters elsewhere are told to look again,
                // if Redis takes that.
                route.stats.record(Event::RedisError);
                let gone = Notice::Ended(keys.entry(), Ending::Gone, Duration::ZERO);
                let _ = shared.notices.publish(&shared.store, &gone).await;
                crate::metrics::lease_released(&lease, "error");
            }
        }
    }
    route.shared.marks.clear(keys.entry());
    route.put_l1(keys, stored.clone()).await;
    (stored, false)
}

/// The token of an entry filled without Redis: it stands in for the entry it replaces,
/// and for the last invalidation seen before the origin was called.
pub(crate) async fn local_floor(
    route: &Route,
    keys: &CacheKeys,
    replaces: FencingToken,
) -> FencingToken {
    route
        .tombstone(keys)
        .await
        .map_or(replaces, |tomb| tomb.max(replaces))
}

/// The lease could not be had for another reason than `Busy`: go on without it. An
/// acquire whose reply was lost may have set the lease after all: release it,
/// best-effort and once, so that other instances need not wait out its TTL.
pub(crate) fn lease_unavailable(route: &Route, outcome: AcquireOutcome) {
    route.stats.record(Event::RedisError);
    if let AcquireOutcome::TimedOut(attempt) = outcome {
        route.stats.record(Event::UncertainAcquire);
        let leases = route.shared.leases.clone();
        tokio::spawn(async move {
            let _ = leases.release_uncertain(attempt).await;
        });
    }
}

pub(crate) fn not_stored(route: &Route, why: NotStored) {
    route.stats.record(Event::NotStored);
    tracing::debug!(
        route = route.policy.route,
        reason = why.as_str(),
        "response not stored"
    );
}

/// Ends a fill's lease that wrote nothing, and says how to the fleet: the key is marked
/// here (pass it through, or back off) and the notice marks it on every other instance
/// and wakes the callers waiting there, who then stop waiting.
///
/// After a failure the lease is not released but held off for the route's error
/// back-off, so that the fleet does not retry at once.
pub(crate) async fn end(route: &Route, keys: &CacheKeys, claim: Claim, ending: Ending) {
    let policy = &route.policy;
    let lasting = match ending {
        Ending::Pass => {
            route
                .shared
                .marks
                .set(keys.entry(), Mark::Pass, policy.hit_for_pass);
            policy.hit_for_pass
        }
        Ending::Error => {
            route
                .shared
                .marks
                .set(keys.entry(), Mark::BackOff, policy.error_backoff);
            policy.error_backoff
        }
        Ending::Gone => Duration::ZERO,
    };
    let Claim::Leased(lease) = claim else {
        return;
    };
    route.held(lease.held_for());
    let leases = &route.shared.leases;
    let _ = match ending {
        Ending::Error => leases.hold_off(lease, policy.error_backoff).await,
        Ending::Pass | Ending::Gone => leases.release(lease).await,
    };
    let notice = Notice::Ended(keys.entry(), ending, lasting);
    if route
        .shared
        .notices
        .publish(&route.shared.store, &notice)
        .await
        .is_err()
    {
        // The waiters elsewhere find out when their cold wait ends.
        route.stats.record(Event::RedisError);
    }
}

/// The fenced write released the lease (or found it gone): counted as a release.
pub(crate) fn written_release(lease: &Lease, released: bool) {
    crate::metrics::lease_released(lease, if released { "released" } else { "not_owner" });
}
