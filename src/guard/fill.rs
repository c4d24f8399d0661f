//! Calling the origin: cold fills (awaited by callers) and refreshes (awaited by no one).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_service::Service;

use super::body::ResponseBody;
use super::layer::Route;
use super::marks::Mark;
use super::vary::TooMany;
use crate::cache::{
    Ending, Freshness, L2Read, Notice, Stored, invalidated, l2_read, l2_write, publish,
};
use crate::entry::{self, CachedResponse};
use crate::keys::CacheKeys;
use crate::lease::{Acquire, AcquireOutcome, FencingToken, Lease, LeaseLost};
use crate::metrics::Event;
use crate::notify::Wait;
use crate::policy::ColdMiss;
use crate::rules::{self, NotStored};

/// What a cold fill ended with; every caller waiting for the key turns it into its
/// response.
pub(crate) enum FillOutcome<B: Body, E> {
    /// The entry is in the caches. `variant_of`: when it was stored under another key
    /// than its callers' (the route learned a `Vary` header from it), the request the
    /// origin saw; only callers whose headers match it on those headers may have it.
    Stored {
        stored: Arc<Stored>,
        variant_of: Option<Arc<Request<()>>>,
    },
    /// A response that may not be stored but may be given to every waiter whose headers
    /// match the request the origin saw on what it varies on (an uncacheable status, not
    /// private). `failure` when it is a 5xx.
    Shared {
        response: Arc<Buffered>,
        failure: bool,
        origin_saw: Arc<Request<()>>,
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
    /// The key's answers may not be stored (this fill's, or another instance's): its
    /// callers go to the origin themselves.
    Pass,
    /// The origin failed (here or on another instance) and the fleet backs off: callers
    /// get what may stand in, or the route's 503.
    BackedOff,
    /// No slot of the refresh budget came free within the cold wait.
    OverBudget,
    /// The route learned a `Vary` header while this fill waited: its callers look again
    /// under their new key.
    Rekey,
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
/// asked for, so a notice of another instance's fill cannot slip by. `local_token` is
/// the token of what the caller found (an expired entry, or nothing: 1), `stand_in`
/// whether that entry may stand in for a failed origin.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn cold_fill<S, ReqBody, B>(
    route: Arc<Route>,
    keys: CacheKeys,
    request: Request<ReqBody>,
    inner: S,
    mut wait: Wait,
    local_token: FencingToken,
    stand_in: bool,
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
        return FillOutcome::Stored {
            stored,
            variant_of: None,
        };
    }
    // The names its key was made with: when the route learns more, the key is not its
    // callers' any more.
    let version = keys.learned;
    let deadline = tokio::time::Instant::now() + policy.cold_wait;
    // Since when this fill waits for another instance's (for the metric).
    let mut waiting_since = None;
    // What to do when the origin must be left alone (the fleet backs off after a
    // failure, or the budget is spent): callers that have an entry to stand in get it,
    // and on a route that answers 503 rather than pass through, so do the others. Else
    // this fill goes ahead on its own (without the lease, or without a slot): still one
    // call for all its callers, where each would otherwise call the origin.
    let stand_aside = stand_in || matches!(policy.cold_miss, ColdMiss::Reject { .. });
    // A slot of the budget first, then the lease: a lease held while waiting for a slot
    // could run out before the origin is even called.
    let mut over_budget = false;
    let (slot, mut lease) = loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let slot = route.shared.budget.take_within(left).await;
        if slot.is_none() {
            if !over_budget {
                route.stats.record(Event::FillOverBudget);
                over_budget = true;
            }
            if stand_aside {
                return FillOutcome::OverBudget;
            }
        }
        // A request waits on Redis at most once: if its cache read failed, it does not
        // also wait on the lease.
        if !redis_ok {
            break (slot, None);
        }
        let acquired = route
            .shared
            .leases
            .try_acquire_fill(&keys, policy.lease_ttl, local_token)
            .await;
        let outcome = match acquired {
            Acquire::Outcome(outcome) => outcome,
            // Another instance's fill landed since the caller looked (its notice may
            // still be on its way).
            Acquire::Written => match landed_meanwhile(&route, &keys, local_token, true).await {
                Some(stored) => {
                    return FillOutcome::Stored {
                        stored,
                        variant_of: None,
                    };
                }
                // Not an entry that serves (garbage, say): take the lease as usual.
                None => match route
                    .shared
                    .leases
                    .try_acquire_fill(&keys, policy.lease_ttl, FencingToken::new(u64::MAX))
                    .await
                {
                    Acquire::Outcome(outcome) => outcome,
                    Acquire::Written => unreachable!("no entry is newer than the newest"),
                },
            },
        };
        match outcome {
            AcquireOutcome::Acquired(lease) if route.learned.version() != version => {
                // The route learned a `Vary` header since this fill's key was made: the
                // key is not its callers' any more.
                end(&route, &keys, Some(lease), Ending::Gone).await;
                return FillOutcome::Rekey;
            }
            AcquireOutcome::Acquired(lease) => {
                let notified = waiting_since.is_some() || wait.has_notice();
                if let Some(stored) = landed_meanwhile(&route, &keys, local_token, notified).await {
                    end(&route, &keys, Some(lease), Ending::Gone).await;
                    return FillOutcome::Stored {
                        stored,
                        variant_of: None,
                    };
                }
                break (slot, Some(lease));
            }
            AcquireOutcome::Busy {
                held_off: true,
                retry_after,
            } => {
                // The last holder failed and keeps the fleet away: no fill to wait for.
                let left = retry_after.unwrap_or(policy.error_backoff);
                route.shared.marks.set(keys.entry(), Mark::BackOff, left);
                if stand_aside {
                    return FillOutcome::BackedOff;
                }
                // Counted as a fill without Redis (`LocalOnly`), which it is.
                break (slot, None);
            }
            AcquireOutcome::Busy { .. } => {
                drop(slot);
                let since = *waiting_since.get_or_insert_with(|| {
                    route.stats.record(Event::ColdWaitStarted);
                    tokio::time::Instant::now()
                });
                let woke = wait_for_remote(&route, &keys, &mut wait, deadline, version).await;
                let event = match &woke {
                    Woke::Entry(_) => Event::ColdWaitNotified,
                    Woke::Ended(_) => Event::ColdWaitEnded,
                    Woke::TimedOut => Event::ColdWaitTimedOut,
                    // The holder may be gone: try the lease again.
                    Woke::Look => continue,
                };
                route.stats.record(event);
                route.stats.cold_wait_seconds.record(since.elapsed());
                return match woke {
                    Woke::Entry(stored) => FillOutcome::Stored {
                        stored,
                        variant_of: None,
                    },
                    Woke::Ended(Ended::Pass) => FillOutcome::Pass,
                    // The lease is held off now: the next look decides.
                    Woke::Ended(Ended::BackedOff) if !stand_aside => continue,
                    Woke::Ended(Ended::BackedOff) => FillOutcome::BackedOff,
                    Woke::Ended(Ended::Rekey) => FillOutcome::Rekey,
                    Woke::TimedOut | Woke::Look => FillOutcome::NoEntry,
                };
            }
            other => {
                lease_unavailable(&route, other);
                break (slot, None);
            }
        }
    };
    if lease.is_none() {
        route.stats.record(Event::LocalOnly);
    }
    // Taken before the origin is called: an invalidation that comes during the call then
    // has a higher token than this fill's local entry, and refuses it.
    let local_token = local_floor(&route, &keys, local_token).await;
    route.stats.record(Event::ColdFill);
    let (request, asked) = asked(request);
    let origin = call_under_lease(&route, &keys, inner, request, &mut lease).await;
    drop(slot);
    let Some(origin) = origin else {
        return FillOutcome::TimedOut;
    };
    match origin {
        Origin::TimedOut => {
            end(&route, &keys, lease, Ending::Error).await;
            FillOutcome::TimedOut
        }
        Origin::Error(error) => {
            end(&route, &keys, lease, Ending::Error).await;
            FillOutcome::Handoff {
                slot: Mutex::new(Some(Err(error))),
                failure: true,
            }
        }
        Origin::Read(Read::Whole { head, body }) => {
            let why = match rules::storable(policy, &head) {
                Ok(()) => match keep(&route, &keys, &asked, head, body, lease, local_token).await {
                    Kept::Stored {
                        stored, rekeyed, ..
                    } => {
                        return FillOutcome::Stored {
                            stored,
                            variant_of: rekeyed.then_some(asked),
                        };
                    }
                    Kept::NotStored { head, body, why } => {
                        return not_kept(&route, head, body, why, false, asked);
                    }
                },
                Err(why) => why,
            };
            not_stored(&route, why);
            let failure = rules::is_failure(head.status());
            let ending = if failure { Ending::Error } else { Ending::Pass };
            end(&route, &keys, lease, ending).await;
            not_kept(&route, head, body, why, failure, asked)
        }
        Origin::Read(Read::Partial {
            head,
            prefix,
            error,
            rest,
            why,
        }) => {
            not_stored(&route, why);
            let failure = error.is_some();
            let ending = if failure { Ending::Error } else { Ending::Pass };
            end(&route, &keys, lease, ending).await;
            let (parts, ()) = head.into_parts();
            let response = Response::from_parts(parts, ResponseBody::resume(prefix, error, rest));
            FillOutcome::Handoff {
                slot: Mutex::new(Some(Ok(response))),
                failure,
            }
        }
    }
}

/// The outcome of a whole answer that was not stored: for its caller alone when it is
/// private (or the route sends credentials), for every caller of its variant otherwise.
fn not_kept<B: Body, E>(
    route: &Route,
    head: Response<()>,
    body: Bytes,
    why: NotStored,
    failure: bool,
    origin_saw: Arc<Request<()>>,
) -> FillOutcome<B, E> {
    let (parts, ()) = head.into_parts();
    // With credentials in fill requests, whatever is not stored (a 401 for the leader's
    // token, say) is the leader's alone.
    let credentials = route.policy.allow_authorization || route.policy.allow_cookies;
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
            origin_saw,
        }
    }
}

/// Splits off what the origin is asked (method, URI, headers), to key and match the
/// answer by, from the request that goes to it.
fn asked<ReqBody>(request: Request<ReqBody>) -> (Request<ReqBody>, Arc<Request<()>>) {
    let (parts, body) = request.into_parts();
    let mut asked = Request::new(());
    *asked.method_mut() = parts.method.clone();
    *asked.uri_mut() = parts.uri.clone();
    *asked.headers_mut() = parts.headers.clone();
    (Request::from_parts(parts, body), Arc::new(asked))
}

/// An entry that landed while the caller looked: in L1 (free to check), or in L2 when
/// `notified` says another instance wrote one. Servable, and at least as new as what the
/// caller found (`seen`: the expired entry it may fall back on, or nothing), and so newer
/// than it: a fill without Redis stores the entry it replaces under that entry's token.
async fn landed_meanwhile(
    route: &Route,
    keys: &CacheKeys,
    seen: FencingToken,
    notified: bool,
) -> Option<Arc<Stored>> {
    let usable = |s: &Stored| s.freshness() != Freshness::Expired && s.response.token >= seen;
    if let Some(stored) = route.l1().get(keys.entry())
        && usable(&stored)
        && !invalidated(&route.shared.tombstones, keys.primary(), &stored)
    {
        return Some(stored);
    }
    if notified
        && let Ok(L2Read::Found(stored)) =
            l2_read(&route.shared.store, keys, route.policy.max_body).await
        && usable(&stored)
    {
        route.put_l1(keys.entry().into(), stored.clone()).await;
        return Some(stored);
    }
    None
}

/// How a wait for another instance's fill ended.
enum Woke {
    /// Its entry.
    Entry(Arc<Stored>),
    /// Its lease ended without an entry, and what that means for the key.
    Ended(Ended),
    /// Woken (or, without a subscription, a poll is due) and no entry yet: the lease may
    /// be free now.
    Look,
    /// The cold wait is over.
    TimedOut,
}

enum Ended {
    Pass,
    BackedOff,
    Rekey,
}

/// Another instance holds the lease: wait for its entry, woken by its notices, until
/// `deadline`. A notice that its lease ended without an entry ends the wait at once.
async fn wait_for_remote(
    route: &Route,
    keys: &CacheKeys,
    wait: &mut Wait,
    deadline: tokio::time::Instant,
    version: u64,
) -> Woke {
    let mut woken = false;
    let mut last_look = false;
    loop {
        if woken {
            // What the holder's notices said (see `notify`).
            if route.learned.version() != version {
                return Woke::Ended(Ended::Rekey);
            }
            match route.shared.marks.get(keys.entry()) {
                Some(Mark::Pass) => return Woke::Ended(Ended::Pass),
                Some(Mark::BackOff) => return Woke::Ended(Ended::BackedOff),
                None => {}
            }
        }
        match l2_read(&route.shared.store, keys, route.policy.max_body).await {
            Ok(L2Read::Found(stored)) if stored.freshness() != Freshness::Expired => {
                route.put_l1(keys.entry().into(), stored.clone()).await;
                return Woke::Entry(stored);
            }
            Ok(L2Read::Garbage(_)) => route.stats.record(Event::DecodeFailure),
            Err(_) => route.stats.record(Event::RedisError),
            Ok(_) => {}
        }
        if last_look {
            return Woke::TimedOut;
        }
        if woken {
            return Woke::Look;
        }
        // Woken by the holder's notice; without a subscription (starting up,
        // reconnecting) no notice can come, so look again every 100 ms.
        let until = if *route.shared.subscribed.borrow() {
            deadline
        } else {
            deadline.min(tokio::time::Instant::now() + Duration::from_millis(100))
        };
        match tokio::time::timeout_at(until, wait.notified()).await {
            Ok(()) => woken = true,
            // One last look: the notice may have been lost.
            Err(_) if tokio::time::Instant::now() >= deadline => last_look = true,
            Err(_) => woken = true,
        }
    }
}

/// Refreshes a stale entry in the background. Nobody awaits it. Returns how long the
/// process should leave the key alone: while another instance holds its lease, or
/// after a failure.
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
        l2_read(&route.shared.store, &keys, route.policy.max_body)
            .await
            .map_err(|_| route.stats.record(Event::RedisError))
    };
    // The newest entry this refresh knows of: one written after it is another's refresh.
    let mut seen = current.response.token;
    let redis_up = match read {
        // An expired entry is never taken (it would stand in for nothing), but is known:
        // what is written after it is another instance's refresh.
        Ok(L2Read::Found(stored)) if stored.freshness() == Freshness::Expired => {
            seen = seen.max(stored.response.token);
            true
        }
        Ok(L2Read::Found(stored))
            if stored.response.token > current.response.token
                || stored.freshness() == Freshness::Fresh =>
        {
            let fresh = stored.freshness() == Freshness::Fresh;
            seen = seen.max(stored.response.token);
            route.put_l1(keys.entry().into(), stored).await;
            if fresh {
                route.stats.record(Event::RefreshAdopted);
                return None;
            }
            // Newer, but stale too: it is served meanwhile, and refreshed here.
            true
        }
        Ok(L2Read::Garbage(_)) => {
            route.stats.record(Event::DecodeFailure);
            true
        }
        Ok(_) => true,
        Err(()) => false,
    };
    let lease = if redis_up {
        let acquired = route
            .shared
            .leases
            .try_acquire_fill(&keys, policy.lease_ttl, seen)
            .await;
        let outcome = match acquired {
            Acquire::Outcome(outcome) => outcome,
            // Written by another instance since the look above: take it.
            Acquire::Written => {
                if let Ok(L2Read::Found(stored)) =
                    l2_read(&route.shared.store, &keys, route.policy.max_body).await
                {
                    route.put_l1(keys.entry().into(), stored).await;
                }
                route.stats.record(Event::RefreshAdopted);
                return None;
            }
        };
        match outcome {
            AcquireOutcome::Acquired(lease) => Some(lease),
            AcquireOutcome::Busy { retry_after, .. } => {
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
    let (request, asked) = asked(request);
    let Some(origin) = call_under_lease(&route, &keys, inner, request, &mut lease).await else {
        return failed;
    };
    let (event, why) = match origin {
        Origin::TimedOut => (Event::RefreshTimeout, None),
        Origin::Error(_) => (Event::RefreshOriginError, None),
        Origin::Read(Read::Whole { head, body }) => match rules::storable(policy, &head) {
            Ok(()) => match keep(&route, &keys, &asked, head, body, lease, local_token).await {
                Kept::Stored { written, .. } => {
                    if written {
                        route.stats.record(Event::RefreshWritten);
                    }
                    return None;
                }
                // Ended with the lease already.
                Kept::NotStored { .. } => {
                    route.stats.record(Event::RefreshNotStored);
                    return failed;
                }
            },
            Err(_) if rules::is_failure(head.status()) => (Event::RefreshOriginError, None),
            Err(why) => (Event::RefreshNotStored, Some(why)),
        },
        Origin::Read(Read::Partial { error: Some(_), .. }) => (Event::RefreshOriginError, None),
        Origin::Read(Read::Partial { why, .. }) => (Event::RefreshNotStored, Some(why)),
    };
    if let Some(why) = why {
        not_stored(&route, why);
    }
    // An answer that may not be stored is no better than a failure here: the stale entry
    // stays, and the fleet leaves the origin alone for the back-off.
    end(&route, &keys, lease, Ending::Error).await;
    route.stats.record(event);
    failed
}

/// What became of a storable answer.
enum Kept {
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
async fn keep(
    route: &Route,
    keys: &CacheKeys,
    asked: &Request<()>,
    head: Response<()>,
    body: Bytes,
    mut lease: Option<Lease>,
    local_token: FencingToken,
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
                if lease.is_some() {
                    let names: Vec<&str> = unkeyed.iter().map(HeaderName::as_str).collect();
                    let notice = Notice::Learned(&route.policy.route, names);
                    let _ = publish(&route.shared.store, &route.shared.channel, &notice).await;
                }
            }
            Err(TooMany) => {
                not_stored(route, NotStored::VaryUnkeyed);
                end(route, keys, lease, Ending::Pass).await;
                return Kept::NotStored {
                    head,
                    body,
                    why: NotStored::VaryUnkeyed,
                };
            }
        }
    }
    let Some(own) = route.keys_for(asked) else {
        end(route, keys, lease, Ending::Pass).await;
        return Kept::NotStored {
            head,
            body,
            why: NotStored::VaryUnkeyed,
        };
    };
    if own == *keys {
        let (stored, written) = store(route, keys, head, body, lease, local_token).await;
        return Kept::Stored {
            stored,
            written,
            rekeyed: false,
        };
    }
    // The caller's lease is not the lease of the key the answer belongs to.
    let had_lease = lease.is_some();
    end(route, keys, lease.take(), Ending::Gone).await;
    if had_lease {
        match route
            .shared
            .leases
            .try_acquire_fill(&own, route.policy.lease_ttl, FencingToken::new(0))
            .await
        {
            Acquire::Outcome(AcquireOutcome::Acquired(own_lease)) => lease = Some(own_lease),
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
    let (stored, written) = store(route, &own, head, body, lease, local_token).await;
    Kept::Stored {
        stored,
        written,
        rekeyed: true,
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
    let mut headers = entry::compact(&parts.headers);
    rules::strip_unstorable(&mut headers);
    // So that a HEAD answered from the entry says how long the GET would be.
    if !headers.contains_key(http::header::CONTENT_LENGTH) {
        headers.insert(http::header::CONTENT_LENGTH, body.len().into());
    }
    let fresh_for = match policy.fresh_jitter {
        jitter if jitter.is_zero() => policy.fresh_ttl,
        // Whole milliseconds, as entries keep their times.
        jitter => {
            let off = fastrand::u64(0..=jitter.as_millis() as u64);
            policy.fresh_ttl - Duration::from_millis(off)
        }
    };
    let response = CachedResponse {
        status: parts.status,
        headers,
        // Already a copy of its own: `read` gathers the body's frames into one buffer
        // of its exact size.
        body,
        fresh_for,
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
                shared.marks.clear(keys.entry());
                route.put_l1(keys.entry().into(), stored.clone()).await;
                return (stored, true);
            }
            Ok(outcome) => {
                written_release(&lease, outcome.released);
                route.stats.record(Event::FencedWriteRefused);
                tracing::debug!(
                    entry = keys.entry(),
                    token = lease.fencing_token().get(),
                    "fenced write refused: a newer lease or entry exists"
                );
                if let Ok(L2Read::Found(newer)) =
                    l2_read(&shared.store, keys, route.policy.max_body).await
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
                // the write is not retried. Waiters elsewhere are told to look again,
                // if Redis takes that.
                route.stats.record(Event::RedisError);
                let gone = Notice::Ended(keys.entry(), Ending::Gone, Duration::ZERO);
                let _ = publish(&shared.store, &shared.channel, &gone).await;
                crate::metrics::lease_released(
                    lease.name().operation_label(),
                    "error",
                    lease.held_for(),
                );
            }
        }
    }
    route.shared.marks.clear(keys.entry());
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
    keys: &CacheKeys,
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
                        end(route, keys, lease, Ending::Error).await;
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

/// Ends a fill's lease that wrote nothing, and says how to the fleet: the key is marked
/// here (pass it through, or back off) and the notice marks it on every other instance
/// and wakes the callers waiting there, who then stop waiting.
///
/// After a failure the lease is not released but held off for the route's error
/// back-off, so that the fleet does not retry at once.
async fn end(route: &Route, keys: &CacheKeys, lease: Option<Lease>, ending: Ending) {
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
    let Some(lease) = lease else {
        return;
    };
    let leases = &route.shared.leases;
    let _ = match ending {
        Ending::Error => leases.hold_off(lease, policy.error_backoff).await,
        Ending::Pass | Ending::Gone => leases.release(lease).await,
    };
    let notice = Notice::Ended(keys.entry(), ending, lasting);
    if publish(&route.shared.store, &route.shared.channel, &notice)
        .await
        .is_err()
    {
        // The waiters elsewhere find out when their cold wait ends.
        route.stats.record(Event::RedisError);
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
