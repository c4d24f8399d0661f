//! What every request of a route shares: its policy, its counters, its cold fills in
//! flight and the headers it learned to vary on; and how a request of the route is
//! keyed, filled, put in L1 and invalidated.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Request};

use super::early::Recompute;
use super::hold::LeaseTtl;
use super::inflight::Flights;
use super::invalidate::InvalidateError;
use super::shared::Shared;
use super::vary::{self, Check, Learned, Names, TooMany};
use crate::cache::{L1, L2Read, Stored, l2_invalidate, l2_keep_names, l2_read};
use crate::metrics::Event;
use crate::notify::Notice;
use crate::notify::Purge;
use std::hash::Hasher;

use siphasher::sip128::Hasher128;

use crate::http::{forward, request, response};
use crate::keys::{CacheKeys, LocalHashers, LocalKey};
use crate::lease::FencingToken;
use crate::metrics::RouteStats;
use crate::policy::Policy;
use crate::store::StoreError;

/// What every request of a route shares.
pub(crate) struct Route {
    pub(crate) shared: Arc<Shared>,
    pub(crate) policy: Policy,
    pub(crate) stats: RouteStats,
    /// The cold fills in flight, one per key. Here, with the route, and not in what
    /// `layer()` makes: frameworks apply a route's layer again for each connection
    /// (axum does), and single-flight must hold across all of them.
    pub(crate) flights: Arc<Flights>,
    /// The headers each of its URLs' responses vary on, learned from them.
    pub(crate) learned: Arc<Learned>,
    /// The hashers of its keys in L1, keyed and fed the route's name once.
    pub(crate) hashers: LocalHashers,
    /// How long its origin takes to answer a refresh or a fill (for XFetch).
    pub(crate) recompute: Recompute,
    /// The tags its policy gives every entry (their ids' 128 bits).
    pub(crate) tag_ids: Box<[u128]>,
    /// The TTL its leases are taken with: the policy's, or from measured hold times.
    pub(crate) lease_ttl: LeaseTtl,
    /// Its name as a metric label, shared (its leases carry it, to label their holds).
    pub(crate) label: metrics::SharedString,
    /// Whether an answer too large to store was logged (once per route).
    pub(crate) said_too_large: std::sync::atomic::AtomicBool,
}

impl Route {
    /// The route of `policy` in a guard (`shared`), with the `Vary` names its URLs
    /// learned so far.
    pub(crate) fn new(shared: Arc<Shared>, policy: Policy, learned: Arc<Learned>) -> Self {
        let stats = RouteStats::new(&policy.route);
        let label = metrics::SharedString::from(Arc::<str>::from(policy.route.as_str()));
        crate::metrics::route_lease_ttl(label.clone(), policy.lease_ttl);
        let hashers = shared.keys.local_hashers(&policy.route);
        let tag_ids = policy
            .tags
            .iter()
            .filter_map(|t| crate::keys::tag_key(&shared.keys.tag_id(t)))
            .collect();
        let lease_ttl = LeaseTtl::new(policy.lease_ttl, policy.adaptive);
        Self {
            hashers,
            shared,
            policy,
            stats,
            flights: Arc::default(),
            learned,
            recompute: Default::default(),
            tag_ids,
            lease_ttl,
            label,
            said_too_large: Default::default(),
        }
    }

    /// The longest body of an entry read from L2 whole (one L1 may keep, with room for
    /// its headers and L1's own bookkeeping); a longer one stays in Redis, read part by
    /// part as it is answered.
    pub(crate) fn whole_up_to(&self) -> usize {
        let max_entry = self.shared.l1.max_entry().saturating_sub(64 * 1024);
        usize::try_from(max_entry).unwrap_or(usize::MAX)
    }

    /// Reads the entry at `keys` from L2 (a body longer than [`Self::whole_up_to`] left
    /// in parts): for a look at what another instance wrote.
    pub(crate) async fn read_l2(&self, keys: &CacheKeys) -> Result<L2Read, StoreError> {
        let (store, max) = (&self.shared.store, self.policy.max_body);
        l2_read(store, keys, max, self.whole_up_to()).await
    }

    /// Logs, the first time only, that an answer of `size` bytes was too large to store
    /// on this route: its size, the limit, and the setting that raises it. Every such
    /// answer is counted (`not_stored_total{reason="too_large"}`).
    pub(crate) fn said_too_large(&self, size: u64) {
        use std::sync::atomic::Ordering;
        if !self.said_too_large.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                route = self.policy.route,
                size,
                max_body = self.policy.max_body,
                "an answer of {size} bytes is over the route's `max_body` of {} bytes: \
                 not stored (callers of one fill still share it); raise `max_body` \
                 (the sidecar's `--max-body`) to store it; said once per route",
                self.policy.max_body
            );
        }
    }

    /// The hash of a request's identity: its URL's own key in L1 (variant 0), and what
    /// the names its URL varies on are kept under. The same bytes as
    /// [`keys_for`](Self::keys_for) hashes, written into the hasher piece by piece.
    fn response_key<B>(&self, request: &Request<B>) -> u128 {
        let mut response = self.hashers.response;
        let mut gather = Gather::new(&mut response);
        request::identity_into(&self.policy, request, &mut |bytes| gather.push(bytes));
        gather.flush();
        response.finish128().as_u128()
    }

    /// The key in L1 of a GET of `/` and the hex of `identity` (no host, no query, no
    /// header the route keys on): a typed value's (see `values`), as
    /// [`find_l1`](Self::find_l1) and [`keys_for`](Self::keys_for) make it of that
    /// request, without the request or its path (a hit allocates nothing).
    pub(crate) fn hex_path_local_key(&self, identity: &[u8]) -> LocalKey {
        let mut response = self.hashers.response;
        let mut gather = Gather::new(&mut response);
        let len = 1 + 2 * identity.len();
        let mut path = |write: &mut dyn FnMut(&[u8])| {
            write(b"/");
            let mut hex = [0u8; 64];
            for chunk in identity.chunks(32) {
                let hex = &mut hex[..chunk.len() * 2];
                // (Never fails: the buffer is twice the chunk.)
                let _ = hex::encode_to_slice(chunk, hex);
                write(hex);
            }
        };
        request::written_path_identity_into(&self.policy, b"", len, &mut path, &mut |bytes| {
            gather.push(bytes)
        });
        gather.flush();
        LocalKey::of_response(response.finish128().as_u128())
    }

    /// Reads the entry at `keys` from L2 with its whole body, however long (up to the
    /// route's `max_body`): a typed value's, decoded whole.
    pub(crate) async fn read_l2_whole(&self, keys: &CacheKeys) -> Result<L2Read, StoreError> {
        let (store, max) = (&self.shared.store, self.policy.max_body);
        l2_read(store, keys, max, usize::MAX).await
    }

    /// The key in L1 of a request for URL `response`, which varies on `names`: the URL's
    /// own entry for a request with none of them.
    fn local_key_with<B>(
        &self,
        request: &Request<B>,
        response: u128,
        names: Option<&[HeaderName]>,
    ) -> LocalKey {
        let variant = match names {
            Some(names) if request::names_any(names, request) => {
                let mut variant = self.hashers.variant;
                let mut gather = Gather::new(&mut variant);
                request::variant_into(names, request, &mut |bytes| gather.push(bytes));
                gather.flush();
                // Never 0: that is the response's own key.
                variant.finish() | 1
            }
            _ => 0,
        };
        LocalKey { response, variant }
    }

    /// The request's entry in L1 and its key there: what a hit computes, and all it
    /// computes (see [`LocalKey`]).
    ///
    /// The URL's own entry (variant 0) is looked at first: one that varies on nothing
    /// the request sends answers it (a URL that never varied costs nothing more). Else
    /// the URL varies, and the request is keyed on the names it varies on. A request
    /// that sends one of the route's keyed headers never asks for variant 0.
    pub(crate) fn find_l1<B>(
        &self,
        request: &Request<B>,
        now: crate::cache::Instant,
    ) -> (LocalKey, Option<Arc<Stored>>) {
        let response = self.response_key(request);
        let own = LocalKey::of_response(response);
        let at_own = if request::names_any(&self.policy.key_headers, request) {
            None
        } else {
            self.l1().get(&own, now)
        };
        let names = match &at_own {
            Some(stored) => {
                let vary = self.vary_of(stored);
                if vary.is_empty() || !request::names_any(vary, request) {
                    return (own, at_own);
                }
                // It varies on a header the request sends: known here already, unless
                // the entry came from another instance's fill.
                let names = self.learned.names(response);
                if names
                    .as_deref()
                    .is_some_and(|known| vary.iter().all(|n| known.contains(n)))
                {
                    names
                } else {
                    let _ = self.learned.learn(response, vary);
                    self.learned.names(response)
                }
            }
            None if !self.learned.any() => return (own, None),
            None => self.learned.names(response),
        };
        let local = self.local_key_with(request, response, names.as_deref());
        if local == own {
            // (What is there, if anything, does not answer it.)
            return (own, None);
        }
        (local, self.l1().get(&local, now))
    }

    /// The keys of a request (in Redis, and in L1), made with the names its URL is known
    /// to vary on. Fails only for a key space whose key would be too long.
    pub(crate) fn keys_for<B>(&self, request: &Request<B>) -> Option<CacheKeys> {
        let identity = request::identity(&self.policy, request);
        let mut response = self.hashers.response;
        response.write(&identity);
        let response = response.finish128().as_u128();
        let names = self.learned.names(response);
        let keys = &self.shared.keys;
        let route = &self.policy.route;
        let mut local = LocalKey::of_response(response);
        let made = match &names {
            Some(learned) if request::names_any(learned, request) => {
                let variant = request::variant(learned, request);
                let mut variant_hash = self.hashers.variant;
                variant_hash.write(&variant);
                local.variant = variant_hash.finish() | 1;
                keys.cache_variant(route, &identity, &variant)
            }
            _ => keys.cache(route, &identity),
        };
        let mut made = made.ok()?;
        made.names = names;
        made.local = local;
        Some(made)
    }

    /// Whether a read of L2 at `keys` asks for the names their URL varies on, as kept
    /// beside its entries: a read of the URL's own entry does, and on a route with keyed
    /// headers any read (a request that sends one is keyed to a variant from the start,
    /// by what this process knows of its URL).
    pub(crate) fn reads_names(&self, keys: &CacheKeys) -> bool {
        !keys.is_variant() || !self.policy.key_headers.is_empty()
    }

    /// Whether `keys` were made with the names their URL is known to vary on now: if
    /// not, the request they were made for has other keys now.
    pub(crate) fn same_names(&self, keys: &CacheKeys) -> bool {
        vary::same(&self.learned.names(keys.local.response), &keys.names)
    }

    /// The names an entry varies on, that the route does not key on anyway.
    pub(crate) fn vary_of<'s>(&self, stored: &'s Stored) -> &'s [HeaderName] {
        stored
            .vary
            .get_or_init(|| response::unkeyed_vary(&self.policy, &[], &stored.headers()).into())
    }

    /// Whether `stored`, found at `keys`, may answer a request with `headers` by its own
    /// `Vary` (see [`vary::check`]).
    pub(crate) fn check(
        &self,
        stored: &Stored,
        keys: &CacheKeys,
        headers: &http::HeaderMap,
    ) -> Check {
        vary::check(
            self.vary_of(stored),
            keys.names.as_deref(),
            keys.local.variant == 0,
            headers,
        )
    }

    /// Learns that the URL of `keys` varies on `names` too: counted and logged when one
    /// was new, and then its names.
    pub(crate) fn learn(
        &self,
        keys: &CacheKeys,
        names: &[HeaderName],
    ) -> Result<Option<Names>, TooMany> {
        let learned = self.learned.learn(keys.local.response, names)?;
        if let Some(all) = &learned {
            self.stats.record(Event::VaryLearned);
            tracing::info!(
                route = self.policy.route,
                vary = ?all,
                "a URL's responses vary on these headers: keyed on them from now on"
            );
        }
        Ok(learned)
    }

    /// Keeps what the URL of `keys` varies on in Redis, beside its entries, and tells
    /// the fleet (best-effort: an instance that does not hear it learns from the record,
    /// or from the entry itself).
    pub(crate) async fn keep_names(&self, keys: &CacheKeys, names: &[HeaderName]) {
        let shared = &self.shared;
        if shared.store.is_local_only() {
            return;
        }
        // The route's keyed headers are every instance's from its policy.
        let strings: Vec<&str> = names
            .iter()
            .filter(|name| !self.learned.is_keyed(name))
            .map(HeaderName::as_str)
            .collect();
        let most = vary::MAX_LEARNED;
        let kept = l2_keep_names(&shared.store, keys, &strings, most, self.entries_live()).await;
        let notice = Notice::Learned(&self.policy.route, Some(keys.local.response), strings);
        let told = shared.notices.publish(&shared.store, &notice).await;
        if kept.is_err() || told.is_err() {
            self.stats.record(Event::RedisError);
        }
    }

    /// The longest an entry of the route may live: on a route that follows the origin,
    /// that is the origin's to say, up to what an entry may hold.
    fn entries_live(&self) -> Duration {
        if self.policy.follow_origin {
            crate::http::directives::MAX_KEEP
        } else {
            self.policy.kept_for()
        }
    }

    /// The route's name as a metric label (a cheap clone).
    pub(crate) fn label(&self) -> metrics::SharedString {
        self.label.clone()
    }

    /// The TTL to take the route's leases with now.
    pub(crate) fn lease_ttl(&self) -> Duration {
        self.lease_ttl.get()
    }

    /// A lease of the route was held `held` (from its acquire to its write or end): on
    /// a route whose lease TTL adapts, taken in, and the gauge follows.
    pub(crate) fn held(&self, held: Duration) {
        if let Some(ttl) = self.lease_ttl.record(held) {
            crate::metrics::route_lease_ttl(self.label(), ttl);
        }
    }

    /// Whether a purge of one of its tags reached `stored` (see [`purge`](super::purge)),
    /// counted.
    #[inline]
    pub(crate) fn purge_of(&self, stored: &Stored) -> Option<Purge> {
        let shared = &self.shared;
        let verdict =
            shared
                .purges
                .verdict(&shared.keys, &self.tag_ids, stored, self.purge_margin());
        match verdict {
            Some(Purge::Hard) => self.stats.record(Event::PurgedHard),
            Some(Purge::Soft) => self.stats.record(Event::PurgedSoft),
            None => {}
        }
        verdict
    }

    /// Whether `stored` was hard-purged: it may not be served, nor stand in for a
    /// failing origin.
    #[inline]
    pub(crate) fn is_gone(&self, stored: &Stored) -> bool {
        let shared = &self.shared;
        let gone = shared
            .purges
            .verdict(&shared.keys, &self.tag_ids, stored, self.purge_margin())
            == Some(Purge::Hard);
        if gone {
            self.stats.record(Event::PurgedHard);
        }
        gone
    }

    /// How far apart the clocks an entry's token and a purge's time come from may be:
    /// a cluster's nodes (see [`purge`](super::purge)).
    fn purge_margin(&self) -> Duration {
        if self.shared.store.is_cluster() {
            super::purge::MARGIN
        } else {
            Duration::ZERO
        }
    }

    /// Whether `stored` may stand in for a failed origin now: within the route's
    /// stale-if-error window, or on a route that follows the origin, the entry's.
    pub(crate) fn serves_on_error(&self, stored: &Stored) -> bool {
        let window = crate::http::directives::stale_if_error(&self.policy, &stored.headers());
        stored.serves_on_error(window) && !self.is_gone(stored)
    }

    /// The request that fills or refreshes the entry of `request`.
    pub(crate) fn fill_request<B, F: Default>(&self, request: &Request<B>) -> Request<F> {
        let names = self.learned.names(self.response_key(request));
        forward::fill_request(&self.policy, names.as_deref().unwrap_or_default(), request)
    }

    pub(crate) fn l1(&self) -> &L1 {
        &self.shared.l1
    }

    /// Puts an entry in L1, fenced against newer entries and invalidations.
    pub(crate) async fn put_l1(&self, keys: &CacheKeys, stored: Arc<Stored>) -> bool {
        let epoch = self.shared.epoch.load(std::sync::atomic::Ordering::Acquire);
        let shared = &self.shared;
        let put = shared.l1.put(&shared.tombstones, keys.local, stored, epoch);
        if self.shared.store.is_local_only() {
            // No notice listener to report L1 once a second: report on each fill.
            self.shared.report_l1();
        }
        put
    }

    /// The token of the last invalidation of the response seen here, if any.
    pub(crate) fn tombstone(&self, keys: &CacheKeys) -> Option<FencingToken> {
        self.shared
            .tombstones
            .get(&keys.local.response)
            .map(|tomb| tomb.token())
    }

    /// How long a fill of this route can take at most: what an invalidation's tombstone
    /// must outlive.
    pub(crate) fn max_fill(&self) -> Duration {
        let p = &self.policy;
        p.lease_ttl
            .max(p.refresh_timeout)
            .max(p.watchdog.unwrap_or_default())
            + self.shared.store.command_timeout() * 4
    }

    /// Invalidates the response `request` would be answered from (see
    /// [`GuardLayer::invalidate`](super::GuardLayer::invalidate)): whether L2 held an
    /// entry of it (its own or a variant); without Redis, always.
    pub(crate) async fn invalidate<B>(&self, request: &Request<B>) -> Result<bool, StoreError> {
        let Some(keys) = self.own_keys(request) else {
            return Ok(false);
        };
        let reached = self.invalidate_url(&keys, false).await?;
        Ok(reached.existed || reached.entries > 0)
    }

    /// Invalidates the URL `uri` names, every variant of it (see
    /// [`GuardLayer::invalidate_path`](super::GuardLayer::invalidate_path)), and counts
    /// the entries it removed.
    pub(crate) async fn invalidate_path(&self, uri: &str) -> Result<u64, InvalidateError> {
        let bad = || InvalidateError::NotAPath {
            given: uri.chars().take(200).collect(),
        };
        let parsed: http::Uri = uri.parse().map_err(|_| bad())?;
        if !parsed.path().starts_with('/') {
            return Err(bad());
        }
        let request = Request::get(parsed).body(()).map_err(|_| bad())?;
        if self.policy.key_host && request::host(&request).is_none() {
            return Err(InvalidateError::HostNeeded {
                route: self.policy.route.clone(),
            });
        }
        let Some(keys) = self.own_keys(&request) else {
            return Ok(0);
        };
        Ok(self.invalidate_url(&keys, true).await?.entries)
    }

    /// The keys of the URL of `request`: its own entry's, whatever the request's headers
    /// (its variants share them: see `vary`). `None` only for a key space whose keys
    /// would be too long.
    fn own_keys<B>(&self, request: &Request<B>) -> Option<CacheKeys> {
        let identity = request::identity(&self.policy, request);
        let mut keys = self.shared.keys.cache(&self.policy.route, &identity).ok()?;
        let mut response = self.hashers.response;
        response.write(&identity);
        keys.local = LocalKey::of_response(response.finish128().as_u128());
        Some(keys)
    }

    /// Invalidates the response of `keys` (the keys of its own entry) and every variant
    /// of it: in this process at once, and in L2 and every instance's L1 through Redis.
    /// With `count`, and without Redis, the entries removed from this process's L1 are
    /// counted; with Redis, the count is L2's.
    async fn invalidate_url(&self, keys: &CacheKeys, count: bool) -> Result<Reached, StoreError> {
        let response = keys.local.response;
        let shared = &self.shared;
        // Locally first, and whatever Redis says: a fill in flight here must not put the
        // old entry back. A local tombstone outranks every token issued so far: it is
        // the fleet's time (Redis's, as last learned, see `clock`), as tokens are.
        let local = crate::lease::FencingToken::new(shared.clock.now_micros());
        crate::cache::bury_local(&shared.tombstones, response, local);
        if shared.store.is_local_only() {
            let entries = if count {
                self.l1()
                    .remove_response(response, crate::cache::Instant::now())
            } else {
                self.l1().invalidate_response(response);
                0
            };
            return Ok(Reached {
                existed: true,
                entries,
            });
        }
        self.l1().invalidate_response(response);
        let invalidated = l2_invalidate(
            &shared.store,
            keys,
            shared.notices.channel(),
            self.max_fill(),
            self.entries_live(),
        )
        .await?;
        // Redis's token from now on: it orders against the fills' tokens, which come from
        // the same clock (the local one only covered the round trip).
        shared.clock.learn(invalidated.token.get());
        crate::cache::bury(&shared.tombstones, response, invalidated.token, Some(local));
        self.l1().invalidate_response(response);
        Ok(Reached {
            existed: invalidated.existed,
            entries: invalidated.entries,
        })
    }
}

/// What an invalidation of a response reached.
struct Reached {
    /// Whether its own entry was in L2 (always, without Redis).
    existed: bool,
    /// How many entries it removed, its own and its variants' (see
    /// [`Route::invalidate_url`]).
    entries: u64,
}

/// Gathers the small pieces of an identity (lengths, names, values) on the stack and
/// hands them to a hasher in a few large writes: SipHash pays per write.
struct Gather<'h, H: Hasher> {
    hasher: &'h mut H,
    buffer: [u8; 256],
    len: usize,
}

impl<'h, H: Hasher> Gather<'h, H> {
    fn new(hasher: &'h mut H) -> Self {
        Self {
            hasher,
            buffer: [0; 256],
            len: 0,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        if self.len + bytes.len() > self.buffer.len() {
            self.flush();
            if bytes.len() > self.buffer.len() {
                self.hasher.write(bytes);
                return;
            }
        }
        let to = &mut self.buffer[self.len..self.len + bytes.len()];
        if bytes.len() <= 8 {
            // Lengths and short parts: a loop beats a call to `memcpy`.
            for (to, from) in to.iter_mut().zip(bytes) {
                *to = *from;
            }
        } else {
            to.copy_from_slice(bytes);
        }
        self.len += bytes.len();
    }

    fn flush(&mut self) {
        self.hasher.write(&self.buffer[..self.len]);
        self.len = 0;
    }
}
