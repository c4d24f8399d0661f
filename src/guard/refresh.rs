//! Refreshing a stale entry in the background, while it is served.
//!
//! One refresh per key per process, within the guard's refresh budget (over it, the
//! refresh is skipped and counted). A refresh reads L2 first and takes a newer entry
//! that another instance wrote; otherwise it takes the key's lease (when another
//! instance holds it, the process leaves the key alone until that lease ends or its
//! fill notice comes), calls the origin and stores the answer, or ends the lease and
//! backs off. Nobody awaits it; a caller that disconnects does not cancel it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Request;
use tracing::Instrument;

use super::call::{Call, call};
use super::fill::{Fill, Kept, LeaseReply, Put, ask_lease, not_stored};
use super::inflight::{Failure, Landed, Refresh};
use super::origin::{Called, FillBody, Inner, OriginBody, asked};
use super::read::{BodyEnd, Parts, ended, read_body};
use super::reply::backs_off;
use super::route::Route;
use super::stream::{Stream, Writer};
use super::verdict::{Refused, judge};
use crate::cache::{Freshness, L2Read, Stored};
use crate::http::response::NotStored;
use crate::keys::{CacheKeys, LocalKey};
use crate::lease::{FencingToken, Lease};
use crate::metrics::Event;
use crate::notify::Ending;
use crate::notify::Interest;

/// Whether a refresh was started, and if not, whether one runs for the entry all the
/// same (an answer served stale meanwhile avoided an origin call).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Started {
    /// By this call.
    Now,
    /// One runs: in this process, or on another instance that holds the lease.
    Running,
    /// None: the budget is spent, the key backs off after a failure, or the entry is
    /// not the variant the request asks for now.
    No,
}

/// Starts the refresh of the entry `current` of `request` (at `local` in L1), unless one
/// runs or is held off, or the budget is spent. `keys`, its Redis keys, if the caller has
/// them already: a hit does not (they cost an HMAC), and they are made only once the
/// refresh has its slot.
pub(crate) fn spawn_refresh<S, ReqBody, ResBody>(
    route: &Arc<Route>,
    local: LocalKey,
    keys: Option<&CacheKeys>,
    current: Arc<Stored>,
    request: &Request<ReqBody>,
    inner: &S,
) -> Started
where
    S: Inner<ReqBody, ResBody>,
    ReqBody: FillBody,
    ResBody: OriginBody,
{
    let key = local;
    let slot = {
        let mut refreshing = route.shared.refreshing.lock().expect("refreshing lock");
        match refreshing.get(&key) {
            // One refresh per key per process.
            Some(Refresh::Running | Refresh::RunningFilled) => return Started::Running,
            // Someone else has the lease (it listens for their notice, which lifts the
            // hold, as its TTL does); or, listening to nothing, the key backs off.
            Some(Refresh::HeldOff {
                until, elsewhere, ..
            }) if Instant::now() < *until => {
                return match elsewhere {
                    true => Started::Running,
                    false => Started::No,
                };
            }
            _ => {}
        }
        // Hold-offs of keys nobody asks for any more would pile up: sweep them now and
        // then (amortized: only when the map has grown).
        if refreshing.len() >= 1024 && refreshing.len().is_power_of_two() {
            let now = Instant::now();
            refreshing.retain(
                |_, state| !matches!(state, Refresh::HeldOff { until, .. } if *until <= now),
            );
        }
        // Within the budget, or not at all: the entry is served stale meanwhile, and a
        // later caller starts the refresh once a slot is free.
        let Some(slot) = route.shared.budget.try_take() else {
            route.stats.record(Event::RefreshSkipped);
            return Started::No;
        };
        refreshing.insert(key, Refresh::Running);
        slot
    };
    // From here, returning gives the slot back and clears the key's state.
    let done = Refreshing {
        route: route.clone(),
        key,
        hold_off: None,
    };
    let Some(keys) = keys.cloned().or_else(|| route.keys_for(request)) else {
        return Started::No;
    };
    if keys.local != local {
        // The URL learned a `Vary` header since `local` was made: the entry is not
        // the variant the request asks for now; the next caller refreshes its own.
        return Started::No;
    }
    let request = route.fill_request(request);
    let (route, inner) = (route.clone(), inner.clone());
    // The span follows the refresh into its task; it names the route and the hashed
    // key, nothing that came with the request.
    let span = tracing::info_span!("stampede_guard.refresh", route = %route.policy.route, entry = keys.entry());
    tokio::spawn(
        async move {
            // Moved in whole (not just the field written), so that it drops with the task.
            let mut done = done;
            let _slot = slot;
            let started = Instant::now();
            done.hold_off = refresh(route.clone(), keys, current, request, inner).await;
            route.stats.refresh_seconds.record(started.elapsed());
        }
        .instrument(span),
    );
    Started::Now
}

/// Marks a key as no longer refreshing, however the refresh ends (a panic included).
pub(crate) struct Refreshing {
    route: Arc<Route>,
    key: LocalKey,
    /// How long to leave the key alone, when the refresh found the lease elsewhere or
    /// failed.
    hold_off: Option<HoldOff>,
}

/// How long the process leaves a key alone after its refresh, and the bucket it
/// listens to meanwhile for the fill notice of the instance that holds the lease.
pub(crate) struct HoldOff {
    lasting: Duration,
    listening: Option<Interest>,
    /// Another instance holds the lease (else the refresh failed).
    elsewhere: bool,
}

impl HoldOff {
    /// A hold-off that listens to nothing (after a failure: no fill is coming).
    fn of(lasting: Duration) -> Option<Self> {
        Some(Self {
            lasting,
            listening: None,
            elsewhere: false,
        })
    }
}

impl Drop for Refreshing {
    fn drop(&mut self) {
        let mut refreshing = self
            .route
            .shared
            .refreshing
            .lock()
            .expect("refreshing lock");
        let filled = matches!(refreshing.get(&self.key), Some(Refresh::RunningFilled));
        match self.hold_off.take() {
            Some(hold_off) if !filled => {
                let until = Instant::now() + hold_off.lasting;
                let held_off = Refresh::HeldOff {
                    until,
                    listening: hold_off.listening,
                    elsewhere: hold_off.elsewhere,
                };
                refreshing.insert(self.key, held_off);
            }
            _ => {
                refreshing.remove(&self.key);
            }
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
) -> Option<HoldOff>
where
    S: Inner<ReqBody, B>,
    ReqBody: FillBody,
    B: OriginBody,
{
    let lease = match looked_again(&route, &keys, &current).await {
        Looked::Adopted => return None,
        Looked::Down => None,
        Looked::Up { seen } => match taken(&route, &keys, seen).await {
            Taken::Leased(lease) => Some(lease),
            Taken::Unavailable => None,
            Taken::Adopted => return None,
            Taken::HeldOff(hold_off) => return Some(hold_off),
        },
    };
    let fill = match lease {
        Some(lease) => Fill::leased(&route, keys, lease, None),
        None => Fill::local(&route, keys, current.response.token, None),
    }
    .refreshing();
    let landed = asked_and_kept(&route, fill, &current, request, inner).await;
    if backs_off(&landed) {
        return HoldOff::of(route.policy.error_backoff);
    }
    None
}

/// What L2 said before the lease is asked for.
enum Looked {
    /// Another instance refreshed already: its entry is taken, nothing to do.
    Adopted,
    /// Redis answers; `seen` is the newest entry's token this refresh knows of (one
    /// written after it is another's refresh).
    Up { seen: FencingToken },
    /// Redis does not: the refresh goes on in this process alone.
    Down,
}

/// Reads L2 again: another instance may have refreshed already, and its entry is taken
/// rather than the lease.
async fn looked_again(route: &Route, keys: &CacheKeys, current: &Stored) -> Looked {
    let read = if route.shared.store.is_local_only() {
        Err(())
    } else {
        route
            .read_l2(keys)
            .await
            .map_err(|_| route.stats.record(Event::RedisError))
    };
    let mut seen = current.response.token;
    // Started before the entry went stale (see `early`): L2 holding that same entry,
    // fresh, is no reason to stop. (An entry of an earlier subscription epoch, served
    // as stale while fresh, is not early: L2's copy of it is what the refresh wants.)
    let early = current.freshness() == Freshness::Fresh
        && current.epoch()
            >= route
                .shared
                .epoch
                .load(std::sync::atomic::Ordering::Relaxed);
    match read {
        // An expired entry is never taken (it would stand in for nothing), but is known:
        // what is written after it is another instance's refresh.
        // Nor is one purged by a tag: it is what this refresh replaces.
        Ok(L2Read::Found(stored))
            if stored.freshness() == Freshness::Expired || route.purge_of(&stored).is_some() =>
        {
            seen = seen.max(stored.response.token);
        }
        Ok(L2Read::Found(stored))
            if stored.response.token > current.response.token
                || (stored.freshness() == Freshness::Fresh && !early) =>
        {
            let fresh = stored.freshness() == Freshness::Fresh;
            seen = seen.max(stored.response.token);
            route.put_l1(keys, stored).await;
            if fresh {
                route.stats.record(Event::RefreshAdopted);
                return Looked::Adopted;
            }
            // Newer, but stale too: it is served meanwhile, and refreshed here.
        }
        Ok(L2Read::Garbage(_)) => route.stats.record(Event::DecodeFailure),
        Ok(_) => {}
        Err(()) => return Looked::Down,
    }
    Looked::Up { seen }
}

/// What asking for the lease came to.
enum Taken {
    Leased(Lease),
    /// Redis failed the acquire: the refresh goes on in this process alone.
    Unavailable,
    /// Another instance wrote the entry meanwhile: taken, nothing to do.
    Adopted,
    /// Another instance holds the lease: the key is left alone this long, listening.
    HeldOff(HoldOff),
}

/// Asks for the key's lease, with `seen` the newest token known. When another instance
/// holds it, the key is left alone until its fill notice comes, which reaches this
/// process only while it listens to the key's bucket: it listens (for as long as the
/// hold-off lasts), then looks at the lease once more, so that a fill that landed
/// between the two is found (`Written`) rather than missed.
async fn taken(route: &Route, keys: &CacheKeys, seen: FencingToken) -> Taken {
    let mut listening = None;
    loop {
        match ask_lease(route, keys, seen).await {
            // Written by another instance since the look above: take it.
            LeaseReply::Written => {
                if let Ok(L2Read::Found(stored)) = route.read_l2(keys).await {
                    route.put_l1(keys, stored).await;
                }
                route.stats.record(Event::RefreshAdopted);
                return Taken::Adopted;
            }
            LeaseReply::Leased(lease) => return Taken::Leased(lease),
            LeaseReply::Busy {
                retry_after,
                held_off,
            } => {
                let ttl = route.lease_ttl();
                let hold_off = retry_after.map_or(ttl, |left| left.min(ttl));
                if listening.is_none() {
                    let shared = &route.shared;
                    let within = shared.store.command_timeout();
                    let (interest, heard) = shared.notices.interest(keys.entry(), within).await;
                    listening = Some(interest);
                    if heard {
                        continue;
                    }
                }
                route.stats.record(Event::RefreshBusy);
                return Taken::HeldOff(HoldOff {
                    lasting: hold_off,
                    listening: listening.flatten(),
                    // Held off after another instance's failure: no refresh runs.
                    elsewhere: !held_off,
                });
            }
            LeaseReply::Unavailable => {
                route.stats.record(Event::RefreshRedisError);
                return Taken::Unavailable;
            }
        }
    }
}

/// Calls the origin, asking whether the entry changed when it can (its validators),
/// and keeps what it answers: the entry renewed by a `304`, or the new answer stored.
/// Returns how the refresh landed, as a cold fill lands (with no caller to share it).
async fn asked_and_kept<S, ReqBody, B>(
    route: &Route,
    fill: Fill,
    current: &Stored,
    request: Request<ReqBody>,
    inner: S,
) -> Landed
where
    S: Inner<ReqBody, B>,
    ReqBody: FillBody,
    B: OriginBody,
{
    // What the caller asked is split off first: the answer is keyed by it, not by a
    // condition the call adds.
    let (request, asked) = asked(request);
    // (Not for an entry read in parts, whose body is not held: a 304 could not renew
    // it; the answer is read whole.)
    let revalidate = Some(current).filter(|current| current.in_parts().is_none());
    let (fill, origin) = match call(route, fill, inner, request, revalidate).await {
        Call::NotModified(fill, head, _) => {
            return renewed(route, fill, current, head, &asked).await;
        }
        // A 304 about another entry than the one asked about: nothing to renew.
        Call::AboutAnother(fill) => {
            return given_up(route, fill, Landed::Failed(Failure::Error), None).await;
        }
        Call::Answered(fill, origin) => (fill, origin),
        Call::Stopped(stopped) => return Landed::Failed(stopped.failure()),
    };
    let response = match origin {
        Called::Answered(response) => response,
        Called::TimedOut => {
            return given_up(route, fill, Landed::Failed(Failure::Timeout), None).await;
        }
        Called::Error(_) => {
            route.stats.record(Event::OriginError);
            return given_up(route, fill, Landed::Failed(Failure::Error), None).await;
        }
    };
    let (parts, body) = response.into_parts();
    let head = http::Response::from_parts(parts, ());
    // (An answer with the body the entry has renews it: its parts are not written.)
    kept(route, fill.renewing_unchanged(current), head, body, &asked).await
}

/// A `304` about the entry: renewed with the body it has (or, ended already, not).
async fn renewed(
    route: &Route,
    fill: Fill,
    current: &Stored,
    head: http::Response<()>,
    asked: &Request<()>,
) -> Landed {
    match fill.renew(current, head, asked).await {
        Ok(put) => {
            route.stats.record(Event::RefreshRevalidated);
            Landed::Entry {
                stored: put.entry().clone(),
                kept: put.is_kept(),
                variant_of: None,
            }
        }
        Err(_) => {
            route.stats.record(Event::RefreshNotStored);
            Landed::Pass
        }
    }
}

/// The origin's new answer: judged at its head (one that may not be stored is no
/// better than a failure here, and its body is not read: the stale entry stays, and
/// the fleet leaves the origin alone for the back-off), then its body read as a cold
/// fill's is (its parts written as they come), under the watchdog as the call was, and
/// stored.
async fn kept<B: OriginBody>(
    route: &Route,
    mut fill: Fill,
    head: http::Response<()>,
    body: B,
    asked: &Request<()>,
) -> Landed {
    let verdict = judge(&route.policy, &head);
    match verdict.refreshes() {
        Ok(()) => {}
        Err(Refused::Failure) => {
            return given_up(route, fill, Landed::Failed(Failure::Error), None).await;
        }
        Err(Refused::NotStored(why)) => {
            return given_up(route, fill, Landed::Pass, Some(why)).await;
        }
    }
    let mut writer = Stream::writer();
    writer.charged_to(route.shared.fill_memory.clone());
    let stream = writer.stream().clone();
    let mut parts = Parts::of(route, fill.keys(), fill.lease_token(), &head, true);
    // Not written as they stream when the body may be the entry's own: the write tells
    // at the end (all of them if not; deleted with the others if it is not kept).
    let mut streamed = if fill.renews_unchanged() {
        None
    } else {
        parts.take()
    };
    // (Held whole: a refresh has no reader, and stops past what fits, or once the fill
    // memory is spent.)
    let grew = |len: u64| verdict.fits(len) && !stream.over_memory();
    let reading = read_body(
        route,
        body,
        verdict.declared,
        &mut writer,
        &mut streamed,
        u64::MAX,
        grew,
    );
    let read = fill.hold(reading).await;
    let parts = streamed.or(parts);
    let read = match read {
        Ok(read) => read,
        Err(lost) => {
            if let Some(parts) = parts {
                parts.drop(route, None).await;
            }
            return Landed::Failed(fill.stopped(lost).await.failure());
        }
    };
    fill.parts_written(parts.as_ref().map_or(0, Parts::usable));
    let (landed, why) = match ended(route, read) {
        BodyEnd::Whole { trailers: false } => {
            return stored(route, fill, head, writer, parts, asked).await;
        }
        BodyEnd::Whole { trailers: true } => (Landed::Pass, Some(NotStored::Trailers)),
        BodyEnd::LetGo { .. } => (Landed::Pass, Some(NotStored::TooLarge)),
        BodyEnd::Cut(Failure::Error) => (Landed::Failed(Failure::Error), None),
        BodyEnd::Cut(_) | BodyEnd::Stopped(_) => (Landed::Failed(Failure::Timeout), None),
    };
    if let Some(parts) = parts {
        parts.drop(route, None).await;
    }
    given_up(route, fill, landed, why).await
}

/// A body read whole: the entry written (its parts dropped if it was not kept).
async fn stored(
    route: &Route,
    fill: Fill,
    head: http::Response<()>,
    writer: Writer,
    parts: Option<Parts>,
    asked: &Request<()>,
) -> Landed {
    let len = writer.stream().len();
    let Some(body) = writer.gathered() else {
        // (Never: a refresh has no reader to let its start go for.)
        return given_up(route, fill, Landed::Pass, Some(NotStored::TooLarge)).await;
    };
    let kept = fill.keep(asked, head, body).await;
    if !kept.has_its_parts()
        && let Some(parts) = parts
    {
        parts.drop(route, Some(len)).await;
    }
    match kept {
        Kept::Stored { put, .. } => {
            if matches!(put, Put::Written { to_l2: true, .. }) {
                route.stats.record(Event::RefreshWritten);
            }
            Landed::Entry {
                kept: put.is_kept(),
                stored: put.entry().clone(),
                variant_of: None,
            }
        }
        // Another variant's, filled by someone else: nothing failed.
        Kept::Elsewhere { .. } => Landed::Rekey,
        // Ended already.
        Kept::NotStored { .. } => {
            route.stats.record(Event::RefreshNotStored);
            Landed::Pass
        }
    }
}

/// A refresh that stored nothing: its fill ends (`why` the answer was not stored, if
/// it came), counted by how it `landed`: an origin error, a timeout, or an answer not
/// stored.
async fn given_up(route: &Route, fill: Fill, landed: Landed, why: Option<NotStored>) -> Landed {
    if let Some(why) = why {
        not_stored(route, why);
    }
    fill.end(Ending::Error).await;
    route.stats.record(match landed {
        Landed::Failed(Failure::Error) => Event::RefreshOriginError,
        Landed::Failed(_) => Event::RefreshTimeout,
        _ => Event::RefreshNotStored,
    });
    landed
}
