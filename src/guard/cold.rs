//! The cold path: nothing servable is cached for a key.
//!
//! One fill per key per process ([single-flight](super::inflight)): the first caller
//! leads and starts the fill in a task of its own, and every caller of the process for
//! that key awaits how it lands. The fill first [claims](claim) the key: the fleet's
//! lease, or, when the origin must be called without it, this process's single-flight
//! alone; a claim may also find that an entry landed meanwhile (here, or from the
//! instance that holds the lease, whose notice wakes it), or that there is nothing to
//! call the origin for. With a claim it calls the origin once, and what the call comes
//! to is one [`Landed`] for all its callers (see [`inflight`](super::inflight) for each
//! ending and what the callers get). Each caller then turns it into its answer.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use http::{Request, Response};
use http_body::Body;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::answer::{failed, stood_aside};
use super::body::ResponseBody;
use super::budget;
use super::call::{Call, call};
use super::complete::{Answer, complete};
use super::fill::{Fill, LeaseReply, NotRenewed, ask_lease};
use super::inflight::{Failure, Joined, Landed, Lead, Own, Waiting};
use super::marks::Mark;
use super::origin::{FillBody, Inner, OriginBody, asked};
use super::outcome::XCache;
use super::reply::{Fit, Reply, Waiter, reply};
use super::respond::{filled_not_modified, mark_forwarded, serve, serve_filled, serve_shared};
use super::route::Route;
use super::stream::Stream;
use super::vary::Check;
use crate::cache::{Freshness, L2Read, Stored, invalidated};
use crate::http::request::{Asked, Kind};
use crate::http::response;
use crate::keys::CacheKeys;
use crate::lease::{FencingToken, Lease};
use crate::metrics::Event;
use crate::notify::{Ending, Wait};
use crate::policy::ColdMiss;

/// What a caller does after a cold fill.
pub(crate) enum Next<B: Body, E> {
    Answer(Response<ResponseBody<B>>),
    /// The origin's error, for the caller whose fill got it.
    Error(E),
    /// Ask the origin itself; what it gets is not stored.
    PassThrough,
    /// Look again: the key's names changed, and the caller's key with them.
    Rekey,
}

/// Whether the caller's request could use Redis: a request waits on Redis at most
/// once, so when its read failed, its fill does not also wait on the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Redis {
    Usable,
    Failed,
    /// Not asked: the key's last answer could not be stored (hit-for-pass), so its
    /// callers share one call of this process at a time, without the lease.
    Passing,
}

/// A caller of the cold path: what it asked, with what headers, its keys and what it
/// found.
pub(crate) struct Caller<'a> {
    pub(crate) asked: Asked,
    pub(crate) headers: &'a http::HeaderMap,
    pub(crate) keys: &'a CacheKeys,
    /// An entry past its grace (or kept only to be revalidated), if any.
    pub(crate) fallback: &'a Option<Arc<Stored>>,
    pub(crate) redis: Redis,
}

/// A caller's place in the flight of its key (see [`wait_landed`]).
pub(crate) struct Flight<B: Body, E> {
    waiting: Waiting,
    /// What only this caller may have, if it leads.
    own: Option<oneshot::Receiver<Own<B, E>>>,
}

/// Nothing servable is cached: joins the key's fill, or leads it (starts its task, which
/// makes the fill's request of `request`). `wait` was registered before the caller
/// looked in L2: a notice of another instance's fill cannot slip by.
pub(crate) fn join<S, ReqBody, ResBody>(
    route: &Arc<Route>,
    inner: &S,
    request: &Request<ReqBody>,
    caller: &Caller<'_>,
    wait: Wait,
) -> Flight<ResBody, S::Error>
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: FillBody,
    ResBody: OriginBody,
{
    let Caller {
        keys,
        fallback,
        redis,
        ..
    } = *caller;
    let key: Arc<str> = keys.entry().into();
    match route
        .flights
        .join::<ResBody, S::Error>(&key, route.tombstone(keys))
    {
        Joined::Lead(lead, waiting, own_tx, own_rx) => {
            let fill = ColdFill {
                route: route.clone(),
                keys: keys.clone(),
                request: route.fill_request(request),
                inner: inner.clone(),
                wait,
                found: fallback
                    .as_ref()
                    .map_or(FencingToken::new(1), |f| f.response.token),
                stand_aside: fallback.as_ref().is_some_and(|f| route.serves_on_error(f))
                    || matches!(route.policy.cold_miss, ColdMiss::Reject { .. }),
                // (An entry read in parts is not held: filled whole again.)
                revalidate: fallback.clone().filter(|f| f.in_parts().is_none()),
                redis,
            };
            // In a task of its own: a caller that goes away does not cancel the fill
            // that every other caller of the key awaits.
            let span = tracing::info_span!("stampede_guard.fill", route = %route.policy.route, entry = keys.entry());
            tokio::spawn(fill_task(fill, lead, own_tx).instrument(span));
            Flight {
                waiting,
                own: Some(own_rx),
            }
        }
        Joined::Follow(waiting) => {
            route.stats.record(Event::Joined);
            Flight { waiting, own: None }
        }
    }
}

/// How a caller's wait for its key's fill ended.
pub(crate) enum Waited<B: Body, E> {
    /// The fill landed: how, and what only this caller may have, if it led.
    Landed {
        landed: Arc<Landed>,
        own: Option<Own<B, E>>,
        is_leader: bool,
    },
    /// The route's soft timeout passed, and this entry (the caller's) stands in while
    /// the fill goes on (counted).
    SoftTimedOut(Arc<Stored>),
    /// Far past what the fill can take: it is stuck somewhere.
    Stuck,
}

/// Waits for the key's fill (`flight`), with `fallback` the entry the caller may serve
/// instead: at most the route's soft timeout when that entry may stand in for a failed
/// origin, else at most what a fill can take. The caller stays counted by the flight
/// until it drops `flight` (once it made what it answers with).
pub(crate) async fn wait_landed<B: Body, E>(
    route: &Route,
    flight: &mut Flight<B, E>,
    fallback: &Option<Arc<Stored>>,
) -> Waited<B, E> {
    let is_leader = flight.own.is_some();
    let waiting = &mut flight.waiting;
    let landed = match (route.policy.soft_timeout, fallback) {
        // Something may be served instead: wait only the soft timeout; the fill goes on.
        (Some(soft), Some(stale)) if route.serves_on_error(stale) => {
            match tokio::time::timeout(soft, waiting.landed()).await {
                Ok(landed) => landed,
                Err(_) => {
                    route.stats.record(Event::SoftTimeout);
                    route.stats.record(Event::Stale);
                    return Waited::SoftTimedOut(stale.clone());
                }
            }
        }
        _ => match tokio::time::timeout(longest_fill(route), waiting.landed()).await {
            Ok(landed) => landed,
            Err(_) => return Waited::Stuck,
        },
    };
    // What only this caller may have, if it led: sent before the flight ended.
    let own = flight.own.take().and_then(|mut own| own.try_recv().ok());
    Waited::Landed {
        landed,
        own,
        is_leader,
    }
}

/// Waits for the key's fill and turns how it landed into what this caller does; a HEAD
/// is answered from the GET the fill made, and a conditional request that the entry
/// meets, `304`.
pub(crate) async fn landed<B: OriginBody, E>(
    route: &Arc<Route>,
    mut flight: Flight<B, E>,
    caller: &Caller<'_>,
) -> Next<B, E> {
    let (kind, fallback) = (caller.asked.kind, caller.fallback);
    // (The flight is kept to the end: the caller is counted by it until it made what it
    // answers with.)
    let (landed, own, is_leader) = match wait_landed(route, &mut flight, fallback).await {
        Waited::Landed {
            landed,
            own,
            is_leader,
        } => (landed, own, is_leader),
        Waited::SoftTimedOut(stale) => return Next::Answer(serve(&stale, kind, XCache::Stale)),
        Waited::Stuck => return Next::Answer(failed(route, fallback, Failure::Timeout, kind)),
    };
    let waiter = Waiter {
        is_leader,
        has_own: own.is_some(),
        stands_in: stands_in(route, &landed, fallback),
        rejects: matches!(route.policy.cold_miss, ColdMiss::Reject { .. }),
        fit: fit(route, &landed, is_leader, caller),
    };
    let next = answer_landed(route, &landed, own, waiter, caller);
    if !is_leader && matches!(next, Next::Answer(_)) {
        // Answered by another caller's fill: its entry, its answer, or its failure.
        route.stats.record(Event::Coalesced);
    }
    drop(flight);
    next
}

/// Whether the caller has an entry that may stand in for a failed origin, asked only
/// where the fill failed or stood aside.
pub(crate) fn stands_in(route: &Route, landed: &Landed, fallback: &Option<Arc<Stored>>) -> bool {
    let failed = matches!(
        landed,
        Landed::Shared { failure: true, .. } | Landed::Failed(_) | Landed::StoodAside
    );
    failed && fallback.as_ref().is_some_and(|f| route.serves_on_error(f))
}

/// Whether what the fill landed with answers the caller's request. An entry stored
/// under another key (`variant_of`: it varies on a header the caller's key did not
/// include) answers only callers of that variant; one at the caller's key, those its
/// own `Vary` lets it answer (it may have come from elsewhere: a header it varies on is
/// learned here). An answer the fill shares answers callers of the variant the origin
/// saw (the leader's request).
fn fit(route: &Route, landed: &Landed, is_leader: bool, caller: &Caller<'_>) -> Fit {
    let headers = caller.headers;
    let serves = match landed {
        Landed::Entry {
            stored, variant_of, ..
        } => {
            let serves = match variant_of {
                Some(asked) => {
                    is_leader || response::same_variant(&stored.headers(), asked.headers(), headers)
                }
                None => match route.check(stored, caller.keys, headers) {
                    Check::Serves => true,
                    Check::Learn(names) => {
                        let _ = route.learn(caller.keys, &names);
                        false
                    }
                },
            };
            if serves && response::reuse(&stored.headers()) == response::Reuse::Never {
                return Fit::EachUse;
            }
            serves
        }
        Landed::Shared {
            response,
            origin_saw,
            ..
        } => is_leader || response::same_variant(&response.headers, origin_saw.headers(), headers),
        _ => true,
    };
    if serves { Fit::Serves } else { Fit::Other }
}

/// Carries out the [`reply`] a caller (`waiter`) gets from how the fill `landed` (with
/// its `own` answer, if it led).
fn answer_landed<B: OriginBody, E>(
    route: &Arc<Route>,
    landed: &Landed,
    own: Option<Own<B, E>>,
    waiter: Waiter,
    caller: &Caller<'_>,
) -> Next<B, E> {
    let (kind, fallback) = (caller.asked.kind, caller.fallback);
    match (reply(landed, waiter), landed, own) {
        (Reply::Entry, Landed::Entry { stored, kept, .. }, _) => {
            route.stats.record(Event::Miss);
            let headers = caller.headers;
            if caller.asked.conditional
                && let Some(not_modified) = filled_not_modified(stored, *kept, headers)
            {
                route.stats.record(Event::NotModified);
                return Next::Answer(not_modified);
            }
            Next::Answer(serve_filled(stored, *kept, kind))
        }
        (Reply::Shared, Landed::Shared { response, .. }, _) => {
            let Some(answer) = serve_shared(response, kind, !waiter.is_leader) else {
                // Its stream moved past its start: this caller asks the origin itself.
                route.stats.record(Event::FillTooLate);
                return Next::PassThrough;
            };
            route.stats.record(response.event());
            Next::Answer(answer)
        }
        (Reply::Own, _, Some(own)) => answer_own(route, own, kind),
        (Reply::StandIn | Reply::Rejected, Landed::StoodAside, _) => {
            Next::Answer(stood_aside(route, fallback, kind))
        }
        (Reply::StandIn, Landed::Failed(failure), _) => {
            Next::Answer(failed(route, fallback, *failure, kind))
        }
        (Reply::StandIn, _, _) => Next::Answer(failed(route, fallback, Failure::Error, kind)),
        (Reply::Failed(failure), _, _) => Next::Answer(failed(route, fallback, failure, kind)),
        (Reply::Rekey, _, _) => Next::Rekey,
        // (Never: each reply comes with its landing, `Own` with the leader's own.)
        (
            Reply::PassThrough | Reply::Entry | Reply::Shared | Reply::Own | Reply::Rejected,
            _,
            _,
        ) => Next::PassThrough,
    }
}

/// The answer only the caller that led may have, as its answer (without its body, to
/// a HEAD).
fn answer_own<B: Body, E>(route: &Route, own: Own<B, E>, kind: Kind) -> Next<B, E> {
    match own {
        Ok(mut response) => {
            route.stats.record(Event::Pass);
            mark_forwarded(response.headers_mut(), XCache::Pass);
            if kind == Kind::Head {
                response = response.map(|_| ResponseBody::empty());
            }
            Next::Answer(response)
        }
        Err(error) => Next::Error(error),
    }
}

/// The longest a cold fill can take: a budget slot and another instance's fill (each
/// at most the cold wait), the origin, and its Redis round trips (the write's deadline
/// grows with the entry's size). A wait past it is a fill stuck somewhere.
fn longest_fill(route: &Route) -> Duration {
    let policy = &route.policy;
    policy.refresh_timeout
        + policy.cold_wait * 2
        + route.shared.store.command_timeout() * 16
        + Duration::from_micros(policy.max_body as u64 / 32) * 2
        + Duration::from_millis(100)
}

/// What a cold fill starts from.
struct ColdFill<S, ReqBody> {
    route: Arc<Route>,
    keys: CacheKeys,
    /// The request the origin gets (see `Route::fill_request`).
    request: Request<ReqBody>,
    inner: S,
    wait: Wait,
    /// The token of what the caller found: an expired entry, or nothing (1).
    found: FencingToken,
    /// Whether its callers need not wait for a fill when the origin is to be left alone:
    /// what the caller found may stand in for a failed origin, or the route rejects.
    stand_aside: bool,
    /// What it found, expired (or kept only to be revalidated): the origin is asked
    /// whether it changed, if it has a validator.
    revalidate: Option<Arc<Stored>>,
    redis: Redis,
}

/// The task of a fill that callers await: how it lands goes to all of them, and what
/// only its leader may have, to that caller. A panic in it is caught: its callers are
/// told, and the fleet backs off as after an origin failure.
async fn fill_task<S, ReqBody, B>(
    fill: ColdFill<S, ReqBody>,
    lead: Lead,
    own: oneshot::Sender<Own<B, S::Error>>,
) where
    S: Inner<ReqBody, B>,
    ReqBody: FillBody,
    B: OriginBody,
{
    let (route, key) = (fill.route.clone(), fill.keys.entry().to_owned());
    let landed = match AssertUnwindSafe(cold_fill(fill, &lead))
        .catch_unwind()
        .await
    {
        Ok((landed, mine)) => {
            if let Some(mine) = mine {
                // Gone if its caller went away: nobody else may have it.
                let _ = own.send(mine);
            }
            landed
        }
        Err(_) => {
            route.stats.record(Event::FillPanicked);
            tracing::error!(route = route.policy.route, "a cold fill panicked");
            let backoff = route.policy.error_backoff;
            route.shared.marks.set(&key, Mark::BackOff, backoff);
            Landed::Failed(Failure::Panicked)
        }
    };
    lead.finish(landed);
}

/// What a claim on a key comes to.
// Returned once per fill and taken apart at once: boxing the fill would allocate for
// nothing.
#[allow(clippy::large_enum_variant)]
enum Claimed {
    /// Call the origin, under the lease or without it.
    Fill(Fill),
    /// An entry landed meanwhile (here, or from another instance's fill).
    Landed(Arc<Stored>),
    /// Nothing to call the origin for: how the fill lands.
    Done(Landed),
}

/// Fills a key that nothing is cached for: how it lands, and what only the caller
/// that led may have.
async fn cold_fill<S, ReqBody, B>(
    fill: ColdFill<S, ReqBody>,
    lead: &Lead,
) -> (Landed, Option<Own<B, S::Error>>)
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
        found,
        stand_aside,
        revalidate,
        redis,
    } = fill;
    let claimed = claim(&route, &keys, &mut wait, found, stand_aside, redis).await;
    drop(wait);
    let fill = match claimed {
        Claimed::Fill(fill) => fill,
        Claimed::Landed(stored) => return (Landed::entry(stored), None),
        Claimed::Done(landed) => return (landed, None),
    };
    if redis != Redis::Passing {
        route.stats.record(Event::ColdFill);
    }
    // What the caller asked is split off first: the answer is keyed by it, not by a
    // condition the call adds.
    let (request, asked) = asked(request);
    match call(&route, fill, inner, request, revalidate.as_deref()).await {
        Call::NotModified(fill, head, current) => renewed(&route, fill, current, head, asked).await,
        // A 304 about another entry is no answer for the callers, who did not ask it.
        Call::AboutAnother(fill) => {
            fill.end(Ending::Error).await;
            (Landed::Failed(Failure::Error), None)
        }
        Call::Answered(fill, origin) => complete(&route, fill, origin, asked, lead).await,
        Call::Stopped(stopped) => (Landed::Failed(stopped.failure()), None),
    }
}

/// The entry `current` that a fill asked about, renewed by the origin's `304`: in the
/// caches, or, where it may not be stored (ended already), its renewed answer goes to
/// its callers as any answer that may not be stored does.
async fn renewed<B: OriginBody, E>(
    route: &Arc<Route>,
    fill: Fill,
    current: &Stored,
    not_modified: Response<()>,
    asked: Arc<Request<()>>,
) -> (Landed, Option<Own<B, E>>) {
    match fill.renew(current, not_modified, &asked).await {
        Ok(put) => {
            let renewed = Landed::Entry {
                stored: put.entry().clone(),
                kept: put.is_kept(),
                variant_of: None,
            };
            (renewed, None)
        }
        Err(NotRenewed { head, verdict, why }) => {
            let answer = Answer {
                head,
                verdict,
                stream: Stream::whole(current.response.body.clone()),
                asked,
                published: false,
            };
            answer.not_kept(route, why)
        }
    }
}

impl Landed {
    /// An entry that landed meanwhile, in the caches already.
    fn entry(stored: Arc<Stored>) -> Self {
        Self::Entry {
            stored,
            kept: true,
            variant_of: None,
        }
    }
}

/// Claims the key for a fill: its lease (waiting for the instance that holds it, at
/// most the cold wait, woken by its notices), or this process's single-flight alone
/// when Redis cannot be used, the fleet backs off, or the holder's entry did not come;
/// or finds that there is nothing to call the origin for. `stand_aside`: the callers
/// need not wait when the origin is to be left alone (see [`ColdFill`]); else the fill
/// goes ahead on its own (without the lease, or without a budget slot): still one call
/// for all its callers, where each would otherwise call the origin.
async fn claim(
    route: &Arc<Route>,
    keys: &CacheKeys,
    wait: &mut Wait,
    found: FencingToken,
    stand_aside: bool,
    redis: Redis,
) -> Claimed {
    // The caller looked in the caches before this fill began; another fill may have
    // landed since (here, or elsewhere: its notice then came). Take that instead.
    if let Some(stored) = landed_meanwhile(route, keys, found, false).await {
        return Claimed::Landed(stored);
    }
    if redis == Redis::Passing {
        // Neither the lease nor a budget slot: the callers would each have called the
        // origin.
        return Claimed::Fill(Fill::passing(route, keys.clone(), found));
    }
    lease_claimed(route, keys, wait, found, stand_aside, redis).await
}

/// Claims the key under its lease, within the cold wait (see [`claim`]): a budget slot
/// first, then the lease, or a wait for the instance that holds it.
async fn lease_claimed(
    route: &Arc<Route>,
    keys: &CacheKeys,
    wait: &mut Wait,
    found: FencingToken,
    stand_aside: bool,
    redis: Redis,
) -> Claimed {
    let policy = &route.policy;
    let local = |slot| Claimed::Fill(Fill::local(route, keys.clone(), found, slot));
    let deadline = tokio::time::Instant::now() + policy.cold_wait;
    // Since when this fill waits for another instance's (for the metric).
    let mut waiting_since = None;
    let mut over_budget = false;
    loop {
        // A slot of the budget first, then the lease: a lease held while waiting for a
        // slot could run out before the origin is even called.
        let slot = budget_slot(route, deadline, &mut over_budget).await;
        if slot.is_none() && stand_aside {
            return Claimed::Done(Landed::StoodAside);
        }
        // A request waits on Redis at most once: if its cache read failed, it does not
        // also wait on the lease.
        if redis == Redis::Failed {
            return local(slot);
        }
        let asked_for = match lease_asked(route, keys, found).await {
            LeaseAsked::Asked(asked_for) => asked_for,
            LeaseAsked::Landed(stored) => return Claimed::Landed(stored),
            // Said written twice, and still nothing that serves: the fill goes ahead
            // on its own.
            LeaseAsked::Written => return local(slot),
        };
        match asked_for {
            LeaseReply::Leased(lease) => {
                let notified = waiting_since.is_some() || wait.has_notice();
                return leased(route, keys, lease, slot, found, notified).await;
            }
            LeaseReply::Busy {
                held_off: true,
                retry_after,
            } => {
                // The last holder failed and keeps the fleet away: no fill to wait for.
                let left = retry_after.unwrap_or(policy.error_backoff);
                route.shared.marks.set(keys.entry(), Mark::BackOff, left);
                // Else counted as a fill without Redis (`LocalOnly`), which it is.
                return match stand_aside {
                    true => Claimed::Done(Landed::StoodAside),
                    false => local(slot),
                };
            }
            LeaseReply::Busy { .. } => {
                drop(slot);
                let since = *waiting_since.get_or_insert_with(|| {
                    route.stats.record(Event::ColdWaitStarted);
                    tokio::time::Instant::now()
                });
                let remote = Remote {
                    since,
                    deadline,
                    found,
                    stand_aside,
                };
                if let Some(claimed) = waited(route, keys, wait, remote).await {
                    return claimed;
                }
            }
            // (Counted. Said written: taken care of by `lease_asked`.)
            LeaseReply::Unavailable | LeaseReply::Written => return local(slot),
        }
    }
}

/// A slot of the refresh budget within what is left of the cold wait; the fill's first
/// time without one is counted.
async fn budget_slot(
    route: &Route,
    deadline: tokio::time::Instant,
    over_budget: &mut bool,
) -> Option<budget::Slot> {
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    let slot = route.shared.budget.take_within(left).await;
    if slot.is_none() && !*over_budget {
        route.stats.record(Event::FillOverBudget);
        *over_budget = true;
    }
    slot
}

/// The lease taken (`found`: the token of what the caller found; `notified`: whether
/// a notice came while it waited): the fill is the caller's, unless the URL learned a `Vary` header
/// since the fill's key was made (the key is not its callers' any more), or another
/// fill landed meanwhile (looked for in Redis when a notice said so).
async fn leased(
    route: &Arc<Route>,
    keys: &CacheKeys,
    lease: Lease,
    slot: Option<budget::Slot>,
    found: FencingToken,
    notified: bool,
) -> Claimed {
    if !route.same_names(keys) {
        Fill::leased(route, keys.clone(), lease, None)
            .end(Ending::Gone)
            .await;
        return Claimed::Done(Landed::Rekey);
    }
    let fill = Fill::leased(route, keys.clone(), lease, slot);
    if let Some(stored) = landed_meanwhile(route, keys, found, notified).await {
        fill.end(Ending::Gone).await;
        return Claimed::Landed(stored);
    }
    Claimed::Fill(fill)
}

/// What asking for the lease came to, the entry found meanwhile taken into account.
enum LeaseAsked {
    Asked(LeaseReply),
    /// Another instance's fill landed since the caller looked (its notice may still be
    /// on its way).
    Landed(Arc<Stored>),
    /// Said written, twice, and nothing found that serves.
    Written,
}

/// Asks for the key's lease, with `found` the newest token the caller knows of. Said
/// written (another instance's fill landed since the caller looked), the entry is taken;
/// if none serves (garbage, say), the lease is asked for as usual.
async fn lease_asked(route: &Route, keys: &CacheKeys, found: FencingToken) -> LeaseAsked {
    let asked_for = ask_lease(route, keys, found).await;
    if !matches!(asked_for, LeaseReply::Written) {
        return LeaseAsked::Asked(asked_for);
    }
    if let Some(stored) = landed_meanwhile(route, keys, found, true).await {
        return LeaseAsked::Landed(stored);
    }
    match ask_lease(route, keys, FencingToken::new(u64::MAX)).await {
        LeaseReply::Written => LeaseAsked::Written,
        asked_for => LeaseAsked::Asked(asked_for),
    }
}

/// A wait for another instance's fill: since when (for the metric), until when, the
/// token of what the caller found, and whether its callers may stand aside (they have
/// an entry to serve, or the route rejects).
struct Remote {
    since: tokio::time::Instant,
    deadline: tokio::time::Instant,
    found: FencingToken,
    stand_aside: bool,
}

/// Waits for another instance's fill of the key (its holder has the lease), until
/// its deadline: what the caller then claims, or `None` to ask for the lease again (the
/// holder may be gone, or its lease is held off now).
async fn waited(
    route: &Arc<Route>,
    keys: &CacheKeys,
    wait: &mut Wait,
    remote: Remote,
) -> Option<Claimed> {
    let Remote {
        since,
        deadline,
        found,
        stand_aside,
    } = remote;
    let local = |slot| Claimed::Fill(Fill::local(route, keys.clone(), found, slot));
    let woke = wait_for_remote(route, keys, wait, deadline).await;
    let event = match &woke {
        Woke::Entry(_) => Event::ColdWaitNotified,
        Woke::Ended(_) => Event::ColdWaitEnded,
        Woke::TimedOut => Event::ColdWaitTimedOut,
        // The holder may be gone: try the lease again.
        Woke::Look => return None,
    };
    route.stats.record(event);
    route.stats.cold_wait_seconds.record(since.elapsed());
    Some(match woke {
        Woke::Entry(stored) => Claimed::Landed(stored),
        // Its answer may not be stored, and whether it could be shared is not said: one
        // call of this process finds out for all its callers (a private answer then
        // sends the others on their own).
        Woke::Ended(Ended::Pass) => local(route.shared.budget.try_take()),
        // The lease is held off now: the next look decides.
        Woke::Ended(Ended::BackedOff) if !stand_aside => return None,
        Woke::Ended(Ended::BackedOff) => Claimed::Done(Landed::StoodAside),
        Woke::Ended(Ended::Rekey) => Claimed::Done(Landed::Rekey),
        // The holder's entry did not come in time.
        Woke::TimedOut | Woke::Look if stand_aside => Claimed::Done(Landed::StoodAside),
        // One call of this process for all its callers, without the lease.
        Woke::TimedOut | Woke::Look => local(route.shared.budget.try_take()),
    })
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
        && let Ok(L2Read::Found(stored)) = route.read_l2(keys).await
        && usable(&stored)
    {
        route.put_l1(keys, stored.clone()).await;
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
///
/// Fill notices reach this process only while it listens to the key's bucket: it
/// subscribes first, then looks at the entry, so that a fill that lands between the
/// two is found by the look or heard after it. When the bucket is not subscribed in
/// time, it looks every 100 ms instead.
async fn wait_for_remote(
    route: &Route,
    keys: &CacheKeys,
    wait: &mut Wait,
    deadline: tokio::time::Instant,
) -> Woke {
    let notices = &route.shared.notices;
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    let heard = notices
        .listen(wait, route.shared.store.command_timeout().min(left))
        .await;
    let mut woken = false;
    let mut last_look = false;
    loop {
        if woken {
            // What the holder's notices said (see `notify`).
            if !route.same_names(keys) {
                return Woke::Ended(Ended::Rekey);
            }
            match route.shared.marks.get(keys.entry()) {
                Some(Mark::Pass | Mark::Private) => return Woke::Ended(Ended::Pass),
                Some(Mark::BackOff) => return Woke::Ended(Ended::BackedOff),
                None => {}
            }
        }
        match route.read_l2(keys).await {
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
        // reconnecting, the bucket not confirmed) no notice can come, so look again
        // every 100 ms.
        let until = if heard && notices.is_subscribed() {
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
