//! The cold path: nothing servable is cached for a key.
//!
//! One fill per key per process ([single-flight](super::flight)): the first caller leads and
//! starts the fill in a task of its own, every caller of the process awaits its outcome.
//! Across the fleet, the fill takes the key's lease; if another instance holds it, the
//! fill waits for that instance's entry, woken by its notices, at most the route's cold
//! wait, and stops waiting as soon as the holder's lease ends without a write. Then each
//! caller turns the outcome into its answer: the entry, a response it may share, the
//! origin itself, or the route's cold-miss behaviour.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use tracing::Instrument;

use super::answer::{serve, serve_buffered, set_x_cache, usable_on_error};
use super::body::ResponseBody;
use super::conditional;
use super::flight;
use super::marks::Mark;
use super::origin::{
    Buffered, Called, Claim, FillBody, Inner, Kept, OriginBody, Read, asked, call_under_lease,
    counted_revalidation, end, keep, lease_unavailable, local_floor, not_stored, renew,
};
use super::route::Route;
use crate::cache::{Freshness, L2Read, Stored, invalidated, l2_read};
use crate::keys::CacheKeys;
use crate::lease::{Acquire, AcquireOutcome, FencingToken};
use crate::metrics::Event;
use crate::notify::{Ending, Wait};
use crate::policy::ColdMiss;
use crate::rules::{self, Kind, NotStored};

/// What a caller does after a cold fill.
pub(crate) enum Next<B: Body, E> {
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
pub(crate) fn join_fill<S, ReqBody, ResBody>(
    route: &Arc<Route>,
    inner: &S,
    request: &Request<ReqBody>,
    keys: &CacheKeys,
    fallback: &Option<Arc<Stored>>,
    redis: Redis,
    wait: Wait,
) -> (flight::Slot, bool)
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: FillBody,
    ResBody: OriginBody,
{
    let key: Arc<str> = keys.entry().into();
    let (slot, lead) = route.flights.join(&key);
    let is_leader = lead.is_some();
    if let Some(lead) = lead {
        let fill = ColdFill {
            route: route.clone(),
            keys: keys.clone(),
            request: route.fill_request(request),
            inner: inner.clone(),
            wait,
            found: fallback
                .as_ref()
                .map_or(FencingToken::new(1), |f| f.response.token),
            stand_in: fallback.as_ref().is_some_and(|f| route.serves_on_error(f)),
            revalidate: fallback.clone(),
            redis,
        };
        // In a task of its own: a caller that goes away does not cancel the fill that
        // every other caller of the key awaits.
        let span = tracing::info_span!("stampede_guard.fill", route = %route.policy.route, entry = keys.entry());
        tokio::spawn(fill_task::<S, ReqBody, ResBody>(fill, lead).instrument(span));
    }
    (slot, is_leader)
}

/// Waits for the key's fill and turns its outcome into what this caller does.
pub(crate) async fn cold<B, E>(
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
        (Some(soft), Some(stale)) if route.serves_on_error(stale) => {
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

/// The task of a fill that callers await: its outcome goes to all of them.
pub(crate) async fn fill_task<S, ReqBody, ResBody>(fill: ColdFill<S, ReqBody>, lead: flight::Lead)
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: FillBody,
    ResBody: OriginBody,
{
    let outcome: FillOutcome<ResBody, S::Error> = cold_fill(fill).await;
    lead.finish(Arc::new(outcome));
}

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

/// Whether the caller's request could use Redis: a request waits on Redis at most
/// once, so when its read failed, its fill does not also wait on the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Redis {
    Usable,
    Failed,
}

/// What a cold fill starts from.
pub(crate) struct ColdFill<S, ReqBody> {
    pub(crate) route: Arc<Route>,
    pub(crate) keys: CacheKeys,
    /// The request the origin gets (see `Route::fill_request`).
    pub(crate) request: Request<ReqBody>,
    pub(crate) inner: S,
    /// Registered before the caller looked in L2: a notice of another instance's fill
    /// cannot slip by.
    pub(crate) wait: Wait,
    /// The token of what the caller found: an expired entry, or nothing (1).
    pub(crate) found: FencingToken,
    /// Whether what it found may stand in for a failed origin.
    pub(crate) stand_in: bool,
    /// What it found, expired (or kept only to be revalidated): the origin is asked
    /// whether it changed, if it has a validator.
    pub(crate) revalidate: Option<Arc<Stored>>,
    pub(crate) redis: Redis,
}

/// Fills a key that nothing is cached for.
pub(crate) async fn cold_fill<S, ReqBody, B>(fill: ColdFill<S, ReqBody>) -> FillOutcome<B, S::Error>
where
    S: Inner<ReqBody, B>,
    ReqBody: FillBody,
    B: OriginBody,
{
    let ColdFill {
        route,
        keys,
        request,
        inner,
        mut wait,
        found: local_token,
        stand_in,
        revalidate,
        redis,
    } = fill;
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
    let (slot, lease) = loop {
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
        if let Redis::Failed = redis {
            break (slot, None);
        }
        let acquired = route
            .shared
            .leases
            .try_acquire_fill(&keys, route.label(), route.lease_ttl(), local_token)
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
                    .try_acquire_fill(
                        &keys,
                        route.label(),
                        route.lease_ttl(),
                        FencingToken::new(u64::MAX),
                    )
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
                end(&route, &keys, Claim::Leased(lease), Ending::Gone).await;
                return FillOutcome::Rekey;
            }
            AcquireOutcome::Acquired(lease) => {
                let notified = waiting_since.is_some() || wait.has_notice();
                if let Some(stored) = landed_meanwhile(&route, &keys, local_token, notified).await {
                    end(&route, &keys, Claim::Leased(lease), Ending::Gone).await;
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
    let mut claim = match lease {
        Some(lease) => Claim::Leased(lease),
        None => {
            route.stats.record(Event::LocalOnly);
            // Taken before the origin is called: an invalidation that comes during the
            // call then has a higher token than this fill's local entry, and refuses it.
            Claim::Local(local_floor(&route, &keys, local_token).await)
        }
    };
    route.stats.record(Event::ColdFill);
    let (mut request, asked) = asked(request);
    // Asked after `asked` is split off: the answer is keyed by what the caller asked.
    let revalidate =
        revalidate.filter(|current| conditional::ask_if_changed(&mut request, &current.response));
    let calling = std::time::Instant::now();
    let origin = call_under_lease(&route, &keys, inner, request, &mut claim).await;
    route.recompute.record(calling.elapsed());
    drop(slot);
    let Some(origin) = origin else {
        return FillOutcome::TimedOut;
    };
    // The answer to a conditional request: a 304 about the entry asked about renews it;
    // one about another is no answer for the callers, who did not ask it.
    let renews = match (&origin, &revalidate) {
        (Called::Read(Read::Whole { head, .. }), Some(current))
            if head.status() == StatusCode::NOT_MODIFIED =>
        {
            Some(conditional::is_about(&current.response, head.headers()))
        }
        _ => None,
    };
    if revalidate.is_some() {
        counted_revalidation(&route, &origin);
    }
    match (origin, revalidate) {
        (Called::Read(Read::Whole { head, .. }), Some(current)) if renews == Some(true) => {
            match renew(&route, &keys, &current, head, claim).await {
                Some((stored, _)) => FillOutcome::Stored {
                    stored,
                    variant_of: None,
                },
                // Ended with the lease: the callers ask the origin themselves.
                None => FillOutcome::Pass,
            }
        }
        (Called::Read(Read::Whole { .. }), _) if renews == Some(false) => {
            end(&route, &keys, claim, Ending::Error).await;
            FillOutcome::BackedOff
        }
        (origin, _) => answered(&route, &keys, claim, origin, asked, policy).await,
    }
}

/// What a fill's origin call (not a `304` to its conditional request) comes to.
async fn answered<B: OriginBody, E>(
    route: &Route,
    keys: &CacheKeys,
    claim: Claim,
    origin: Called<B, E>,
    asked: Arc<Request<()>>,
    policy: &crate::Policy,
) -> FillOutcome<B, E> {
    match origin {
        Called::TimedOut => {
            end(route, keys, claim, Ending::Error).await;
            FillOutcome::TimedOut
        }
        Called::Error(error) => {
            end(route, keys, claim, Ending::Error).await;
            FillOutcome::Handoff {
                slot: Mutex::new(Some(Err(error))),
                failure: true,
            }
        }
        Called::Read(Read::Whole { head, body }) => {
            let why = match rules::storable(policy, &head) {
                Ok(()) => match keep(route, keys, &asked, head, body, claim).await {
                    Kept::Stored {
                        stored, rekeyed, ..
                    } => {
                        // Whenever the answer varies: its waiters may have asked for
                        // another variant (sent a header the route learned only from
                        // this answer), and are checked against it.
                        let varies = stored.response.headers.contains_key(http::header::VARY);
                        return FillOutcome::Stored {
                            stored,
                            variant_of: (rekeyed || varies).then_some(asked),
                        };
                    }
                    Kept::NotStored { head, body, why } => {
                        return not_kept(route, head, body, why, false, asked);
                    }
                },
                Err(why) => why,
            };
            not_stored(route, why);
            let failure = rules::is_failure(head.status());
            let ending = if failure { Ending::Error } else { Ending::Pass };
            end(route, keys, claim, ending).await;
            not_kept(route, head, body, why, failure, asked)
        }
        Called::Read(Read::Partial {
            head,
            prefix,
            error,
            rest,
            why,
        }) => {
            not_stored(route, why);
            let failure = error.is_some();
            let ending = if failure { Ending::Error } else { Ending::Pass };
            end(route, keys, claim, ending).await;
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
pub(crate) fn not_kept<B: Body, E>(
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

/// An entry that landed while the caller looked: in L1 (free to check), or in L2 when
/// `notified` says another instance wrote one. Servable, and at least as new as what the
/// caller found (`seen`: the expired entry it may fall back on, or nothing), and so newer
/// than it: a fill without Redis stores the entry it replaces under that entry's token.
pub(crate) async fn landed_meanwhile(
    route: &Route,
    keys: &CacheKeys,
    seen: FencingToken,
    notified: bool,
) -> Option<Arc<Stored>> {
    // (Not one a purge reached: it is what the fill replaces.)
    let usable = |s: &Stored| {
        s.freshness() != Freshness::Expired
            && s.response.token >= seen
            && route.purge_of(s).is_none()
    };
    if let Some(stored) = route.l1().get(&keys.local, crate::cache::Instant::now())
        && usable(&stored)
        && !invalidated(&route.shared.tombstones, keys.local.response, &stored)
    {
        return Some(stored);
    }
    if notified
        && let Ok(L2Read::Found(stored)) =
            l2_read(&route.shared.store, keys, route.policy.max_body).await
        && usable(&stored)
    {
        route.put_l1(keys, stored.clone()).await;
        return Some(stored);
    }
    None
}

/// How a wait for another instance's fill ended.
pub(crate) enum Woke {
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

pub(crate) enum Ended {
    Pass,
    BackedOff,
    Rekey,
}

/// Another instance holds the lease: wait for its entry, woken by its notices, until
/// `deadline`. A notice that its lease ended without an entry ends the wait at once.
pub(crate) async fn wait_for_remote(
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
            Ok(L2Read::Found(stored))
                if stored.freshness() != Freshness::Expired
                    && route.purge_of(&stored).is_none() =>
            {
                route.put_l1(keys, stored.clone()).await;
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
        let until = if route.shared.notices.is_subscribed() {
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
