//! A fill: one claim on a key (the fleet's lease, or this process's single-flight
//! alone), from its call to the origin to its one ending.
//!
//! A [`Fill`] holds the route, the key's keys and the claim together, and every method
//! that ends it takes it by value, so that a claim ends exactly once and in order: the
//! origin is [called](Fill::call) (and a call that the watchdog stopped ends the fill),
//! then its answer is [kept](Fill::keep) (a fenced write that also releases the lease),
//! or the entry it asked about [renewed](Fill::renew), or the fill
//! [ended](Fill::end) without a write, saying why to the fleet. One exception gives the
//! lease back early: an answer whose head says it will not be stored
//! ([`said_not_stored`](Fill::said_not_stored)) tells the fleet then, and the fill
//! streams on for its callers with no claim left to end.
//!
//! A `Fill` dropped without an ending (its task panicked, or its runtime went away)
//! holds its lease off for the route's error back-off, best-effort, as after an origin
//! failure: the fleet leaves the key alone for a moment instead of waiting out the
//! lease's TTL, then tries again (as pingora-cache's write permit, dropped unreleased,
//! lets its readers compete again).
//!
//! Refreshes and cold fills both work this way; what a fill's ending means for the
//! callers that waited for it is the cold path's (see `inflight`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};

use super::budget;
use super::inflight::Failure;
use super::marks::Mark;
use super::origin::{Called, FillBody, Inner, OriginBody, call_origin};
use super::route::Route;
use super::vary::{Check, TooMany};
use super::verdict::{Verdict, judge};
use crate::cache::entry::{self, CachedResponse};
use crate::cache::{
    Channels, Decoded, Freshness, L2Read, Renewal, Stored, body_digest, l2_revalidate, l2_write,
};
use crate::http::conditional;
use crate::http::directives::{Lifetimes, lifetimes};
use crate::http::range;
use crate::http::response::{self, NotStored};
use crate::keys::CacheKeys;
use crate::lease::{Acquire, AcquireOutcome, FencingToken, Lease, LeaseLost};
use crate::metrics::Event;
use crate::notify::{Ending, Notice};
use crate::store::StoreError;

/// What a fill works under.
enum Claim {
    /// The key's lease: the write is fenced by its token, goes to L2, releases the lease
    /// and tells the fleet.
    Leased(Lease),
    /// No lease (Redis unusable, or the fleet backing off after a failure): only this
    /// process's single-flight, and only L1 is filled.
    Local(Unleased),
}

/// What a fill without the lease is stamped with, both taken when it was claimed,
/// before the origin is asked: a purge or an invalidation that comes during the call is
/// newer than its entry, as it is for a fill under the lease (whose token is both).
#[derive(Debug, Clone, Copy)]
struct Unleased {
    /// That of the entry it replaces, or of the last invalidation seen here if higher,
    /// so that neither refuses it.
    token: FencingToken,
    /// When it began, in µs of the fleet's clock (see `clock`): what a purge's time is
    /// compared with.
    began: u64,
}

/// One claim on a key, until it ends (see the [module docs](self)).
pub(crate) struct Fill {
    route: Arc<Route>,
    keys: CacheKeys,
    /// Taken by the method that ends the fill; still here when it is dropped without an
    /// ending.
    claim: Option<Claim>,
    /// The slot of the refresh budget it calls the origin under, if it has one: given
    /// back once the origin has answered.
    slot: Option<budget::Slot>,
    /// How many parts of the answer's body were written to Redis while it streamed,
    /// under the fill's lease (see `cache::l2`): its write writes only the others.
    parts_written: u32,
    /// How it ends when its answer may not be stored after all: `Pass` (hit-for-pass)
    /// for a cold fill, `Error` (held off for the back-off, the stale entry served) for
    /// a refresh ([`Fill::refreshing`]).
    not_stored: Ending,
    /// For a refresh of an entry kept in parts, its token: an answer with the same body
    /// renews it without writing its parts again ([`Fill::renewing_unchanged`]).
    renew_unchanged: Option<FencingToken>,
}

/// What a call to the origin came to.
// Returned once per call and taken apart at once: boxing would allocate for nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Answered<B: http_body::Body, E> {
    /// The origin answered, or failed: the fill goes on, with that.
    Called(Fill, Called<B, E>),
    /// The watchdog stopped the call: the fill has ended, and nothing may be written.
    Stopped(Stopped),
}

/// Why the watchdog stopped a fill's call to the origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stopped {
    /// The call ran past the watchdog's maximum.
    AtMaximum,
    /// A renewal found the lease someone else's.
    LeaseLost,
}

impl Stopped {
    /// How a fill so stopped fails.
    pub(crate) fn failure(self) -> Failure {
        match self {
            Self::AtMaximum => Failure::Timeout,
            Self::LeaseLost => Failure::LeaseLost,
        }
    }
}

/// What became of a storable answer.
pub(crate) enum Kept {
    /// Put in the caches (see [`Put`]); `rekeyed` when under another key than its
    /// caller's (the answer varies on a header the caller's key did not include).
    Stored { put: Put, rekeyed: bool },
    /// Not stored after all; the fill has ended.
    NotStored { head: Response<()>, why: NotStored },
    /// The answer is another variant's than the fill's callers', and someone else fills
    /// (or filled) that variant: not stored here; the fill has ended.
    Elsewhere { head: Response<()>, body: Bytes },
}

impl Kept {
    /// Whether the entry kept is the one the parts of its body written while it
    /// streamed are of: written to Redis under the fill's own key. Else they are deleted.
    pub(crate) fn has_its_parts(&self) -> bool {
        matches!(
            self,
            Kept::Stored {
                put: Put::Written { to_l2: true, .. },
                rekeyed: false
            }
        )
    }
}

/// A `304`'s renewal of an entry that may not be stored (see [`Fill::renew`]).
pub(crate) struct NotRenewed {
    /// The entry's head as renewed.
    pub(crate) head: Response<()>,
    /// What that head allows.
    pub(crate) verdict: Verdict,
    /// Why it may not be stored.
    pub(crate) why: NotStored,
}

/// Where an entry went, and which one its callers get.
pub(crate) enum Put {
    /// In L1, and in L2 too when `to_l2` (under a lease whose write went through).
    Written { stored: Arc<Stored>, to_l2: bool },
    /// The fenced write was refused, and the newer entry Redis holds may serve: it is in
    /// L1 now.
    Newer(Arc<Stored>),
    /// The fenced write was refused, and what Redis holds may not serve (gone, expired,
    /// purged, older, of another variant): the fill's own entry, stored nowhere.
    Refused(Arc<Stored>),
}

impl Put {
    /// The entry the fill's callers get.
    pub(crate) fn entry(&self) -> &Arc<Stored> {
        match self {
            Self::Written { stored, .. } | Self::Newer(stored) | Self::Refused(stored) => stored,
        }
    }

    /// Whether that entry is in the caches.
    pub(crate) fn is_kept(&self) -> bool {
        !matches!(self, Self::Refused(_))
    }
}

impl Route {
    /// Puts an entry in L1 only (a fill without the lease, or whose write Redis did not
    /// confirm): kept if L1 took it; else (an invalidation since, or too heavy) stored
    /// nowhere, and its callers are told so.
    async fn put_l1_only(&self, keys: &CacheKeys, stored: Arc<Stored>) -> Put {
        if self.put_l1(keys, stored.clone()).await {
            Put::Written {
                stored,
                to_l2: false,
            }
        } else {
            Put::Refused(stored)
        }
    }
}

impl Fill {
    /// A fill under the key's lease.
    pub(crate) fn leased(
        route: &Arc<Route>,
        keys: CacheKeys,
        lease: Lease,
        slot: Option<budget::Slot>,
    ) -> Self {
        // Issued from Redis's clock just now.
        route.shared.clock.learn(lease.fencing_token().get());
        Self {
            route: route.clone(),
            keys,
            claim: Some(Claim::Leased(lease)),
            slot,
            parts_written: 0,
            not_stored: Ending::Pass,
            renew_unchanged: None,
        }
    }

    /// A fill without the lease, that replaces the entry with token `replaces` (or
    /// nothing: 1), counted. Its token is taken before the origin is called: an
    /// invalidation that comes during the call then has a higher token than this fill's
    /// entry, and refuses it.
    pub(crate) fn local(
        route: &Arc<Route>,
        keys: CacheKeys,
        replaces: FencingToken,
        slot: Option<budget::Slot>,
    ) -> Self {
        route.stats.record(Event::LocalOnly);
        let mut fill = Self::passing(route, keys, replaces);
        fill.slot = slot;
        fill
    }

    /// A fill without the lease for the callers of a key whose last answer could not
    /// be stored (hit-for-pass): as [`Self::local`], but not counted as a fill without
    /// Redis.
    pub(crate) fn passing(route: &Arc<Route>, keys: CacheKeys, replaces: FencingToken) -> Self {
        let token = route
            .tombstone(&keys)
            .map_or(replaces, |tomb| tomb.max(replaces));
        let began = route.shared.clock.now_micros();
        Self {
            route: route.clone(),
            keys,
            claim: Some(Claim::Local(Unleased { token, began })),
            slot: None,
            parts_written: 0,
            not_stored: Ending::Pass,
            renew_unchanged: None,
        }
    }

    /// The refresh of `current`, whose body Redis keeps in parts under its own token: an
    /// answer with the same body (the same digest) renews the entry, its head and its
    /// life, without writing its parts again (a reader of them is never cut by it).
    pub(crate) fn renewing_unchanged(mut self, current: &Stored) -> Self {
        let in_parts = current.in_parts().is_some()
            || entry::Parted::of(current.response.body.len()).is_some();
        if in_parts && current.token_is_its_own() && self.is_leased() {
            self.renew_unchanged = Some(current.response.token);
        }
        self
    }

    /// Whether an answer with the same body as the entry it refreshes renews it.
    pub(crate) fn renews_unchanged(&self) -> bool {
        self.renew_unchanged.is_some()
    }

    /// The fill of a refresh: an answer it may not store after all holds the key off
    /// for the back-off (the stale entry is served meanwhile), as a failure does,
    /// rather than sending its callers to the origin (hit-for-pass).
    pub(crate) fn refreshing(mut self) -> Self {
        self.not_stored = Ending::Error;
        self
    }

    /// Calls the origin with `request` for its answer's head, under the route's
    /// watchdog when it has one and the fill holds the lease (see [`Self::hold`], for the
    /// body); the budget slot is given back once the origin answered.
    pub(crate) async fn call<S, ReqBody, B>(
        mut self,
        inner: S,
        request: Request<ReqBody>,
    ) -> Answered<B, S::Error>
    where
        S: Inner<ReqBody, B>,
        ReqBody: FillBody,
        B: OriginBody,
    {
        let route = self.route.clone();
        let calling = Instant::now();
        let call = call_origin(&route.policy, &route.stats, inner, request);
        let called = self.hold(call).await;
        route.recompute.record(calling.elapsed());
        self.slot = None;
        match called {
            Ok(called) => {
                if matches!(&self.claim, Some(Claim::Leased(lease)) if lease.remaining().is_zero())
                {
                    // No watchdog, and the origin outlasted the lease: the write that
                    // follows is fenced, so it cannot replace a newer entry; counted all
                    // the same.
                    route.stats.record(Event::ExpiredWhileWorking);
                }
                Answered::Called(self, called)
            }
            Err(lost) => Answered::Stopped(self.stopped(lost).await),
        }
    }

    /// Runs `work` (a call to the origin, or the reading of its body) under the route's
    /// watchdog, when it has one and the fill holds the lease: the lease is renewed
    /// while it runs, and `Err` when the watchdog stopped it.
    pub(crate) async fn hold<F: Future>(&mut self, work: F) -> Result<F::Output, LeaseLost> {
        match (&mut self.claim, self.route.policy.watchdog) {
            (Some(Claim::Leased(lease)), Some(max_total)) => {
                let leases = &self.route.shared.leases;
                leases.hold_while_reachable(lease, max_total, work).await
            }
            _ => Ok(work.await),
        }
    }

    /// Ends a fill whose work the watchdog stopped, and says why.
    pub(crate) async fn stopped(mut self, lost: LeaseLost) -> Stopped {
        self.route.stats.record(Event::ExpiredWhileWorking);
        match lost {
            // Someone else's now, and filled by them: nothing of ours to end.
            LeaseLost::NotOwner => {
                self.claim = None;
                Stopped::LeaseLost
            }
            _ => {
                // Past the watchdog's maximum: the origin did not answer in time.
                self.route.stats.record(Event::OriginTimeout);
                self.end(Ending::Error).await;
                Stopped::AtMaximum
            }
        }
    }

    /// Stores a storable answer under the key it belongs to: the fill's, unless the
    /// answer varies on a header that key did not include. Then its URL learns the
    /// header (kept in Redis, and told to the fleet), the answer's own lease is taken and
    /// the fill's given back (its waiters look again, under their own new keys), and the
    /// answer is stored under its own key.
    pub(crate) async fn keep(self, asked: &Request<()>, head: Response<()>, body: Bytes) -> Kept {
        let route = self.route.clone();
        let keyed = self.keys.names.as_deref().unwrap_or_default();
        let unkeyed = response::unkeyed_vary(&route.policy, keyed, head.headers());
        if !unkeyed.is_empty() {
            match route.learn(&self.keys, &unkeyed) {
                Ok(None) => {}
                // Kept in Redis and told to the fleet by the fill that holds the lease.
                Ok(Some(names)) if self.is_leased() => route.keep_names(&self.keys, &names).await,
                Ok(Some(_)) => {}
                Err(TooMany) => return self.not_kept(head, NotStored::VaryUnkeyed).await,
            }
        }
        let Some(own) = route.keys_for(asked) else {
            return self.not_kept(head, NotStored::VaryUnkeyed).await;
        };
        if own == self.keys {
            let put = self.store(head, body, asked).await;
            return Kept::Stored {
                put,
                rekeyed: false,
            };
        }
        // The fill's lease is not the lease of the key the answer belongs to.
        let fill = match self.claim_kind() {
            Some(token) => self.rekeyed_locally(own, token),
            None => {
                // The answer's own lease first, then the fill's given back: the fill's
                // waiters elsewhere, woken by its end, find the variant being filled and
                // wait for it, rather than racing this instance to fill it again. Never
                // waits, so holding both for a moment cannot deadlock.
                let asked_for = ask_lease(&route, &own, FencingToken::new(0)).await;
                self.end(Ending::Gone).await;
                match asked_for {
                    LeaseReply::Leased(lease) => Fill::leased(&route, own, lease, None),
                    // Someone stored that variant meanwhile, or fills it already: the
                    // answer goes to its caller unstored.
                    LeaseReply::Written | LeaseReply::Busy { .. } => {
                        return Kept::Elsewhere { head, body };
                    }
                    // Redis failed: stored here only.
                    LeaseReply::Unavailable => Fill::local(&route, own, FencingToken::new(1), None),
                }
            }
        };
        let put = fill.store(head, body, asked).await;
        Kept::Stored { put, rekeyed: true }
    }

    /// Ends the fill as for an answer that may not be stored, and gives the answer back.
    async fn not_kept(self, head: Response<()>, why: NotStored) -> Kept {
        not_stored(&self.route, why);
        let ending = self.not_stored;
        self.end(ending).await;
        Kept::NotStored { head, why }
    }

    /// The fill, without the lease, of the answer's own keys `own` in place of this one
    /// (which ends with it): under the same token.
    fn rekeyed_locally(mut self, own: CacheKeys, unleased: Unleased) -> Fill {
        self.claim = None;
        Fill {
            route: self.route.clone(),
            keys: own,
            claim: Some(Claim::Local(unleased)),
            slot: None,
            parts_written: 0,
            not_stored: self.not_stored,
            renew_unchanged: None,
        }
    }

    /// The stamps of a fill without the lease; `None` for one under it.
    fn claim_kind(&self) -> Option<Unleased> {
        match &self.claim {
            Some(Claim::Local(unleased)) => Some(*unleased),
            _ => None,
        }
    }

    /// The token of the fill's lease, when it holds one: what the parts of a body
    /// written while it streams are fenced by, and named by.
    pub(crate) fn lease_token(&self) -> Option<FencingToken> {
        match &self.claim {
            Some(Claim::Leased(lease)) => Some(lease.fencing_token()),
            _ => None,
        }
    }

    /// The keys the fill writes under.
    pub(crate) fn keys(&self) -> &CacheKeys {
        &self.keys
    }

    /// Says that the first `parts` parts of the answer's body were written under the
    /// fill's lease while it streamed: its write writes only the others.
    pub(crate) fn parts_written(&mut self, parts: u32) {
        self.parts_written = parts;
    }

    /// Whether the fill holds the key's lease.
    pub(crate) fn is_leased(&self) -> bool {
        matches!(self.claim, Some(Claim::Leased(_)))
    }

    /// Stores a response to `asked` under the fill's keys.
    async fn store(self, head: Response<()>, body: Bytes, asked: &Request<()>) -> Put {
        let (parts, ()) = head.into_parts();
        let policy = &self.route.policy;
        // Read before `Age` is stripped.
        let life = lifetimes(policy, &parts.headers, fresh_time(policy));
        let mut headers = entry::compact(&parts.headers);
        response::strip_unstorable(&mut headers);
        // What a qualified `no-cache` names is never reused; an unqualified one leaves
        // the entry to be revalidated on every use (it is never fresh).
        response::strip_no_cache_fields(&mut headers);
        // So that a HEAD answered from the entry says how long the GET would be.
        if !headers.contains_key(http::header::CONTENT_LENGTH) {
            headers.insert(http::header::CONTENT_LENGTH, body.len().into());
        }
        // Already a copy of its own: `read` gathers the body's frames into one buffer of
        // its exact size.
        let stored = self.entry_of(parts.status, headers, body, life);
        // A typed value's fetch handed over what it encoded: never decoded again here.
        if let Some(value) = parts.extensions.get::<Decoded>() {
            let _ = stored.value.set(value.clone());
        }
        let write = self.renew_unchanged.map_or(Write::Whole, Write::Unchanged);
        self.put(stored, write, asked).await
    }

    /// Renews `current`, which the origin said is unchanged (a `304` to a conditional
    /// request): its headers updated from the `304`'s, its body kept, fresh again. Under
    /// a lease, only its metadata is written to L2 (fenced as a whole write is), unless
    /// the entry there is not `current` any more: then the whole entry is written.
    ///
    /// When the renewed entry may not be stored (the `304` made it private, gave it a
    /// cookie, or a `Vary` this key does not cover), the fill ends as for any answer that
    /// may not be stored, the entry is left as it was, and the renewed head is given back
    /// with why.
    pub(crate) async fn renew(
        self,
        current: &Stored,
        not_modified: Response<()>,
        asked: &Request<()>,
    ) -> Result<Put, NotRenewed> {
        // An entry read in parts holds no body to renew with (refresh does not ask
        // conditionally for one; a cold fill does not revalidate one).
        debug_assert!(
            current.in_parts().is_none(),
            "renewing a body that is not held"
        );
        let route = &self.route;
        let cached = &current.response;
        let mut headers = conditional::renewed_headers(&current.headers(), not_modified.headers());
        // What the 304 added is judged as a whole answer's headers are.
        let mut renewed = Response::new(());
        *renewed.status_mut() = cached.status;
        *renewed.headers_mut() = headers;
        let keyed = self.keys.names.as_deref().unwrap_or_default();
        let unkeyed = response::unkeyed_vary(&route.policy, keyed, renewed.headers());
        let mut verdict = judge(&route.policy, &renewed);
        // (Not said a failure, whatever its status: the origin said the entry holds.)
        verdict.failure = false;
        let why = match verdict.stores {
            Err(why) => Some(why),
            Ok(()) if !unkeyed.is_empty() => Some(NotStored::VaryUnkeyed),
            Ok(()) => None,
        };
        if let Some(why) = why {
            not_stored(route, why);
            let ending = self.not_stored;
            self.end(ending).await;
            let head = renewed;
            return Err(NotRenewed { head, verdict, why });
        }
        route.stats.record(Event::Revalidated);
        headers = std::mem::take(renewed.headers_mut());
        // A copy of its own: the 304's values are slices of the client's read buffer.
        headers = entry::compact(&headers);
        response::strip_no_cache_fields(&mut headers);
        let life = lifetimes(&route.policy, &headers, fresh_time(&route.policy));
        let stored = self.entry_of(cached.status, headers, cached.body.clone(), life);
        // Only metadata, over a body Redis is known to hold under that token.
        let write = if current.token_is_its_own() {
            Write::Renew(cached.token)
        } else {
            Write::Whole
        };
        Ok(self.put(stored, write, asked).await)
    }

    /// The entry of a response to store under the fill's claim, fresh from now for
    /// `life`.
    fn entry_of(
        &self,
        status: StatusCode,
        mut headers: HeaderMap,
        body: Bytes,
        life: Lifetimes,
    ) -> Arc<Stored> {
        // The layer answers byte ranges of what it stores (see `ranged`).
        range::advertise(status, &mut headers);
        let (token, began) = match &self.claim {
            Some(Claim::Leased(lease)) => (lease.fencing_token(), None),
            Some(Claim::Local(unleased)) => (unleased.token, Some(unleased.began)),
            None => (
                FencingToken::new(1),
                Some(self.route.shared.clock.now_micros()),
            ),
        };
        let response = CachedResponse {
            status,
            headers,
            body,
            fresh_for: life.fresh_for,
            grace: life.grace,
            keep: life.keep,
            token,
        };
        let stored = Stored::aged(response, life.age);
        Arc::new(match began {
            // Its token is not the time its fill began: the fleet's clock then is.
            Some(began) => stored.filled_locally(began),
            None => stored,
        })
    }

    /// Puts an entry (the answer to `asked`) in the caches: under a lease, the fenced
    /// write to L2 (which releases the lease), then L1; without one, L1 only.
    async fn put(mut self, stored: Arc<Stored>, write: Write, asked: &Request<()>) -> Put {
        let route = self.route.clone();
        let Some(Claim::Leased(lease)) = self.claim.take() else {
            route.shared.marks.clear(self.keys.entry());
            return route.put_l1_only(&self.keys, stored).await;
        };
        route.held(lease.held_for());
        let written = self.written(&lease, &stored, write).await;
        let keys = &self.keys;
        let shared = &route.shared;
        match written {
            Ok((true, released)) => {
                written_release(&lease, released);
                if !released {
                    // Written under a lease that had expired: fencing made it safe.
                    tracing::debug!(entry = keys.entry(), "entry written after its lease ended");
                }
                shared.marks.clear(keys.entry());
                route.put_l1(keys, stored.clone()).await;
                Put::Written {
                    stored,
                    to_l2: true,
                }
            }
            Ok((false, released)) => {
                written_release(&lease, released);
                route.stats.record(Event::FencedWriteRefused);
                tracing::debug!(
                    entry = keys.entry(),
                    token = lease.fencing_token().get(),
                    "fenced write refused: a newer lease or entry exists"
                );
                refused(&route, keys, stored, asked).await
            }
            Err(_) => {
                // Written or not, released or not: unknown. The write is not retried;
                // the lease is given back (if still ours: owner-checked, so whether the
                // write's script ran does not matter), not left to run out by its TTL
                // while the fleet waits for it, and waiters elsewhere are told to look
                // again. Redis trouble holds nobody off.
                route.stats.record(Event::RedisError);
                shared.marks.clear(keys.entry());
                let (route, keys) = (route.clone(), keys.clone());
                let put = route.put_l1_only(&keys, stored).await;
                tokio::spawn(async move {
                    let shared = &route.shared;
                    if let Err(lease) = shared.leases.release_or_keep(lease).await {
                        let again = shared.store.command_timeout();
                        release_again(shared.leases.clone(), lease, again).await;
                    }
                    let gone = Notice::Ended(keys.entry(), Ending::Gone, Duration::ZERO);
                    let _ = shared.notices.publish(&shared.store, &gone).await;
                });
                put
            }
        }
    }

    /// The fenced write to L2 (which releases the lease): the entry renewed by a `304`
    /// (its metadata), or written whole; whether it was written, and whether the lease
    /// was released.
    async fn written(
        &self,
        lease: &Lease,
        stored: &Arc<Stored>,
        write: Write,
    ) -> Result<(bool, bool), StoreError> {
        let (shared, keys) = (&self.route.shared, &self.keys);
        let filled = shared.notices.fill_channel(keys.entry());
        let channels = Channels {
            filled: &filled,
            broadcast: shared.notices.channel(),
        };
        // The digest of a body kept in parts, hashed once and off the runtime's workers
        // (up to 64 MiB): the entry keeps it, and an unchanged body's renewal checks it.
        let digest = match entry::Parted::of(stored.response.body.len()) {
            Some(_) => {
                let body = stored.response.body.clone();
                tokio::task::spawn_blocking(move || body_digest(&body))
                    .await
                    .unwrap_or_default()
            }
            None => Vec::new(),
        };
        let renewing = match write {
            Write::Whole => None,
            Write::Renew(revalidated) => Some((revalidated, Vec::new())),
            Write::Unchanged(current) => Some((current, digest.clone())),
        };
        if let Some((revalidated, same_body)) = renewing {
            let response = stored.to_response();
            let renewal = l2_revalidate(
                &shared.store,
                keys,
                lease,
                revalidated,
                &same_body,
                &response,
                channels,
            );
            match renewal.await? {
                Renewal::Renewed { released } => return Ok((true, released)),
                Renewal::Refused { released } => return Ok((false, released)),
                // Not the entry that was revalidated any more: write all of it.
                Renewal::Gone => {}
            }
        }
        let parts = self.parts_written;
        l2_write(&shared.store, keys, lease, stored, channels, parts, &digest)
            .await
            .map(|outcome| (outcome.written, outcome.released))
    }

    /// Ends the fill without a write, and says how to the fleet: the key is marked here
    /// (pass it through, or back off) and the notice marks it on every other instance
    /// and wakes the callers waiting there, who then stop waiting.
    ///
    /// After a failure the lease is not released but held off for the route's error
    /// back-off, so that the fleet does not retry at once.
    pub(crate) async fn end(mut self, ending: Ending) {
        let lasting = self.mark(ending);
        let Some(Claim::Leased(lease)) = self.claim.take() else {
            return;
        };
        end_lease(&self.route, &self.keys, lease, ending, lasting).await;
    }

    /// Tells the fleet, as soon as an answer's head says so, that the fill will store
    /// nothing (its answer is declared longer than `max_body`, or has a status the route
    /// does not store): the lease is given back and the ending notice sent, in the
    /// background, so that the other instances' waiters stop waiting for an entry that
    /// will not come and call once each. The fill goes on for its own callers, who
    /// share its answer as it streams; its ending later tells the fleet nothing more.
    pub(crate) fn said_not_stored(&mut self) {
        let Some(Claim::Leased(_)) = &self.claim else {
            return;
        };
        let Some(Claim::Leased(lease)) = self.claim.take() else {
            return;
        };
        let (route, keys) = (self.route.clone(), self.keys.clone());
        let lasting = route.policy.hit_for_pass;
        tokio::spawn(async move {
            end_lease(&route, &keys, lease, Ending::Pass, lasting).await;
        });
    }

    /// Ends the fill as for an answer that is its caller's alone: as
    /// `end(Ending::Pass)` for the fleet, but here the key's callers go straight to the
    /// origin for the hit-for-pass time (they could not share such an answer).
    pub(crate) async fn end_private(mut self) {
        let route = self.route.clone();
        let lasting = route.policy.hit_for_pass;
        route
            .shared
            .marks
            .set(self.keys.entry(), Mark::Private, lasting);
        let Some(Claim::Leased(lease)) = self.claim.take() else {
            return;
        };
        end_lease(&route, &self.keys, lease, Ending::Pass, lasting).await;
    }

    /// Marks the key here for how the fill ended; returns for how long.
    fn mark(&self, ending: Ending) -> Duration {
        let (route, key) = (&self.route, self.keys.entry());
        let policy = &route.policy;
        match ending {
            Ending::Pass => {
                route.shared.marks.set(key, Mark::Pass, policy.hit_for_pass);
                policy.hit_for_pass
            }
            Ending::Error => {
                route
                    .shared
                    .marks
                    .set(key, Mark::BackOff, policy.error_backoff);
                policy.error_backoff
            }
            Ending::Gone => Duration::ZERO,
        }
    }
}

/// Dropped without an ending: hold the lease off, as after a failure (see the
/// [module docs](self)).
impl Drop for Fill {
    fn drop(&mut self) {
        let Some(claim) = self.claim.take() else {
            return;
        };
        let lasting = self.mark(Ending::Error);
        let Claim::Leased(lease) = claim else { return };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (route, keys) = (self.route.clone(), self.keys.clone());
            runtime.spawn(async move {
                end_lease(&route, &keys, lease, Ending::Error, lasting).await;
            });
        }
    }
}

/// Gives back (or holds off) a fill's lease that wrote nothing, and tells the fleet.
async fn end_lease(
    route: &Route,
    keys: &CacheKeys,
    lease: Lease,
    ending: Ending,
    lasting: Duration,
) {
    route.held(lease.held_for());
    let leases = &route.shared.leases;
    match ending {
        Ending::Error => {
            let _ = leases.hold_off(lease, route.policy.error_backoff).await;
        }
        Ending::Pass | Ending::Gone => {
            if let Err(lease) = leases.release_or_keep(lease).await {
                // Tried again in the background: the fill's callers do not wait for it.
                let again = route.shared.store.command_timeout();
                tokio::spawn(release_again(leases.clone(), lease, again));
            }
        }
    }
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

/// Releases a lease whose release Redis failed, once more `after` (a command timeout),
/// counted as it ends.
async fn release_again(leases: crate::lease::LeaseClient, lease: Lease, after: Duration) {
    tokio::time::sleep(after).await;
    let _ = leases.release(lease).await;
}

/// How an entry goes to L2.
#[derive(Clone, Copy)]
enum Write {
    /// All of it.
    Whole,
    /// Only its metadata, over the entry written under this token, whose body it has.
    Renew(FencingToken),
    /// Only its metadata, over the entry written under this token, if that entry's body
    /// (kept in parts) has the same digest; else all of it.
    Unchanged(FencingToken),
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

/// What asking for a key's lease came to (see [`ask_lease`]).
pub(crate) enum LeaseReply {
    /// The lease is the caller's.
    Leased(Lease),
    /// Someone else holds it, for `retry_after` if its TTL says; `held_off` when nobody
    /// does, but its last holder failed and keeps the fleet away until then.
    Busy {
        retry_after: Option<Duration>,
        held_off: bool,
    },
    /// An entry newer than the one the caller saw was written since: not taken.
    Written,
    /// Redis could not say (counted): the caller goes on without the lease.
    Unavailable,
}

/// Asks for the lease of `keys`, for the route's lease TTL; `seen` is the token of the
/// newest entry the caller knows of (one written since refuses the lease: `Written`).
/// The one place the guard asks for a lease: cold fills, refreshes and a fill's answer
/// stored under another variant's key all come here.
pub(crate) async fn ask_lease(route: &Route, keys: &CacheKeys, seen: FencingToken) -> LeaseReply {
    let leases = &route.shared.leases;
    let acquired = leases
        .try_acquire_fill(keys, route.label(), route.lease_ttl(), seen)
        .await;
    match acquired {
        Acquire::Written => LeaseReply::Written,
        Acquire::Outcome(AcquireOutcome::Acquired(lease)) => LeaseReply::Leased(lease),
        Acquire::Outcome(AcquireOutcome::Busy {
            retry_after,
            held_off,
        }) => LeaseReply::Busy {
            retry_after,
            held_off,
        },
        Acquire::Outcome(other) => {
            lease_unavailable(route, other);
            LeaseReply::Unavailable
        }
    }
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

/// Counts an answer that was not stored, and logs why.
pub(crate) fn not_stored(route: &Route, why: NotStored) {
    route.stats.record(match why {
        NotStored::Status => Event::NotStoredStatus,
        NotStored::SetCookie => Event::NotStoredSetCookie,
        NotStored::Private => Event::NotStoredPrivate,
        NotStored::NoStore => Event::NotStoredNoStore,
        NotStored::NoCache => Event::NotStoredNoCache,
        NotStored::VaryStar => Event::NotStoredVaryStar,
        NotStored::VaryUnkeyed => Event::NotStoredVaryUnkeyed,
        NotStored::TooLarge => Event::NotStoredTooLarge,
        NotStored::Trailers => Event::NotStoredTrailers,
        NotStored::NoFreshness => Event::NotStoredNoFreshness,
        NotStored::EventStream => Event::NotStoredEventStream,
    });
    tracing::debug!(
        route = route.policy.route,
        reason = why.as_str(),
        "response not stored"
    );
}

/// The fenced write released the lease (or found it gone): counted as a release.
fn written_release(lease: &Lease, released: bool) {
    lease.record_end(if released { "released" } else { "not_owner" });
}

/// A fenced write refused (a newer lease or entry exists): what Redis holds serves the
/// fill's callers only if it may serve at all: newer than the fill's, not past its
/// grace, not purged since, and by its own `Vary` an answer to what the fill asked.
/// Else (an invalidation refused the write, or the newer entry is gone, or a purge
/// reached it) the fill's own answer goes to them, stored nowhere.
async fn refused(route: &Route, keys: &CacheKeys, stored: Arc<Stored>, asked: &Request<()>) -> Put {
    if let Ok(L2Read::Found(newer)) = route.read_l2(keys).await
        && newer.response.token > stored.response.token
        && newer.freshness() != Freshness::Expired
        && route.purge_of(&newer).is_none()
        && matches!(route.check(&newer, keys, asked.headers()), Check::Serves)
    {
        route.put_l1(keys, newer.clone()).await;
        return Put::Newer(newer);
    }
    Put::Refused(stored)
}
