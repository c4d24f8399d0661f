//! What every request of a route shares: its policy, its counters, its cold fills in
//! flight and the headers it learned to vary on; and how a request of the route is
//! keyed, filled, put in L1 and invalidated.

use std::sync::Arc;
use std::time::Duration;

use http::Request;

use super::early::Recompute;
use super::flight::Flights;
use super::handle::Shared;
use super::hold::LeaseTtl;
use super::purge::Purge;
use super::vary::Learned;
use crate::cache::{L1, Stored, l2_invalidate};
use crate::metrics::Event;
use std::hash::Hasher;

use siphasher::sip128::Hasher128;

use crate::keys::{CacheKeys, LocalHashers, LocalKey};
use crate::lease::FencingToken;
use crate::metrics::RouteStats;
use crate::policy::Policy;
use crate::rules;
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
    /// The headers this route's responses vary on, learned from them.
    pub(crate) learned: Arc<Learned>,
    /// The hashers of its keys in L1, keyed and fed the route's name once.
    pub(crate) hashers: LocalHashers,
    /// How long its origin takes to answer a refresh or a fill (for XFetch).
    pub(crate) recompute: Recompute,
    /// The ids of the tags its policy gives every entry.
    pub(crate) tag_ids: Box<[String]>,
    /// The TTL its leases are taken with: the policy's, or from measured hold times.
    pub(crate) lease_ttl: LeaseTtl,
    /// Its name as a metric label, shared (its leases carry it, to label their holds).
    pub(crate) label: metrics::SharedString,
}

impl Route {
    /// The key of a request's entry in L1: what a hit computes, and all it computes (see
    /// [`LocalKey`]). The same bytes as [`keys_for`](Self::keys_for) hashes, written
    /// into the hashers piece by piece.
    pub(crate) fn local_key<B>(&self, request: &Request<B>) -> LocalKey {
        let LocalHashers {
            mut response,
            mut variant,
        } = self.hashers;
        let mut gather = Gather::new(&mut response);
        rules::identity_into(&self.policy, request, &mut |bytes| gather.push(bytes));
        gather.flush();
        let variant = self.learned.with_names(|learned, _| {
            if !rules::names_any(learned, request) {
                return 0;
            }
            let mut gather = Gather::new(&mut variant);
            rules::variant_into(learned, request, &mut |bytes| gather.push(bytes));
            gather.flush();
            // Never 0: that is the response's own key.
            variant.finish() | 1
        });
        LocalKey {
            response: response.finish128().as_u128(),
            variant,
        }
    }

    /// The keys of a request (in Redis, and in L1), with the headers the route has
    /// learned to vary on. Fails only for a key space whose key would be too long.
    pub(crate) fn keys_for<B>(&self, request: &Request<B>) -> Option<CacheKeys> {
        let identity = rules::identity(&self.policy, request);
        let keys = &self.shared.keys;
        let route = &self.policy.route;
        let LocalHashers {
            mut response,
            variant: mut variant_hash,
        } = self.hashers;
        response.write(&identity);
        self.learned
            .with_names(|learned, version| {
                let mut local = LocalKey::of_response(response.finish128().as_u128());
                let mut made = if !rules::names_any(learned, request) {
                    keys.cache(route, &identity)
                } else {
                    let variant = rules::variant(learned, request);
                    variant_hash.write(&variant);
                    local.variant = variant_hash.finish() | 1;
                    keys.cache_variant(route, &identity, &variant)
                };
                if let Ok(made) = &mut made {
                    made.learned = version;
                    made.local = local;
                }
                made
            })
            .ok()
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
        let window = super::directives::stale_if_error(&self.policy, &stored.response.headers);
        stored.serves_on_error(window) && !self.is_gone(stored)
    }

    /// The request that fills or refreshes the entry of `request`.
    pub(crate) fn fill_request<B, F: Default>(&self, request: &Request<B>) -> Request<F> {
        self.learned
            .with_names(|learned, _| rules::fill_request(&self.policy, learned, request))
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
            let l1 = &self.shared.l1;
            metrics::gauge!(crate::metrics::L1_ENTRIES).set(l1.entry_count() as f64);
            metrics::gauge!(crate::metrics::L1_BYTES).set(l1.weighted_size() as f64);
        }
        put
    }

    /// The token of the last invalidation of the response seen here, if any.
    pub(crate) async fn tombstone(&self, keys: &CacheKeys) -> Option<FencingToken> {
        self.shared.tombstones.get(&keys.local.response)
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
    /// [`GuardLayer::invalidate`](super::GuardLayer::invalidate)).
    pub(crate) async fn invalidate<B>(&self, request: &Request<B>) -> Result<bool, StoreError> {
        // The response's own keys: one invalidation reaches every variant of it (those
        // its `Vary` told apart), whatever the request's headers.
        let identity = rules::identity(&self.policy, request);
        let Ok(mut keys) = self.shared.keys.cache(&self.policy.route, &identity) else {
            return Ok(false);
        };
        let mut response = self.hashers.response;
        response.write(&identity);
        keys.local = LocalKey::of_response(response.finish128().as_u128());
        let response = keys.local.response;
        let variants = self.learned.version() > 0;
        let shared = &self.shared;
        // Locally first, and whatever Redis says: a fill in flight here must not put the
        // old entry back. A local tombstone outranks every token issued so far.
        let local = crate::lease::FencingToken::new(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(u64::MAX / 2, |d| d.as_micros() as u64),
        );
        shared.tombstones.insert(response, local);
        self.l1().invalidate_response(response, variants);
        if shared.store.is_local_only() {
            return Ok(true);
        }
        let (existed, token) = l2_invalidate(
            &shared.store,
            &keys,
            shared.notices.channel(),
            self.max_fill(),
            // As long as an entry of the route may live: on a route that follows the
            // origin, that is the origin's to say, up to what an entry may hold.
            if self.policy.follow_origin {
                super::directives::MAX_KEEP
            } else {
                self.policy.kept_for()
            },
        )
        .await?;
        // Redis's token from now on: it orders against the fills' tokens, which come from
        // the same clock (the local one only covered the round trip).
        shared.tombstones.insert(response, token);
        self.l1().invalidate_response(response, variants);
        Ok(existed)
    }
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
