//! The local tier: moka's synchronous cache in each process, weighed in bytes, each entry
//! dropped at the end of its keep time, with a [front](super::front) that answers hits
//! without calling moka; and the tombstones that keep invalidated entries from coming
//! back.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::HeaderMap;
use moka::Expiry;
use moka::notification::RemovalCause;
use moka::ops::compute::{CompResult, Op};
use moka::sync::Cache;

use super::front::{self, Front};
use super::listed::{self, Listed};
use super::stored::{Instant, Stored};
use crate::keys::{LocalKey, Spread};
use crate::lease::FencingToken;

/// The local tier, keyed by [`LocalKey`] (see there: no HMAC, no key string on a hit).
///
/// Moka holds the entries and decides which to keep; the [front](super::front) holds
/// those that were read, for hits.
pub(crate) struct L1 {
    moka: Cache<LocalKey, Arc<Stored>, Spread>,
    front: Arc<Front>,
    /// The variants moka may hold, by response: what an invalidation removes.
    listed: Listed,
    /// Below this weight (three quarters of the capacity), a hit reads moka too with a
    /// chance of one in `sample` ([`front::SAMPLE`]); from it on, every hit does. Other
    /// values in tests.
    busy_at: u64,
    sample: u32,
    /// The most one entry may weigh: a quarter of the capacity ([`ENTRY_SHARE`]).
    max_entry: u64,
    /// Variants dropped past the cap of one response's (see [`Front::put`]), so far.
    variants_dropped: AtomicU64,
    /// Run once by the next put, under the entry's lock (and for a variant, its list's
    /// lock), between its last look at the tombstones and moka's insert: where an
    /// invalidation used to be lost.
    #[cfg(test)]
    pub(crate) before_insert: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// One entry weighs at most this part of L1's capacity (a quarter: 16 MiB of the
/// default 64 MiB, so that an 8 MiB answer is kept): a heavier one is not kept in L1
/// (its callers read it from Redis, part by part), so that one large answer never
/// pushes out more than a quarter of the many small ones.
pub(crate) const ENTRY_SHARE: u64 = 4;

struct UntilKept;

impl Expiry<LocalKey, Arc<Stored>> for UntilKept {
    fn expire_after_create(
        &self,
        _key: &LocalKey,
        value: &Arc<Stored>,
        _created_at: std::time::Instant,
    ) -> Option<Duration> {
        Some(value.keep_left())
    }

    fn expire_after_update(
        &self,
        _key: &LocalKey,
        value: &Arc<Stored>,
        _updated_at: std::time::Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(value.keep_left())
    }
}

impl L1 {
    /// An L1 cache holding at most `capacity` bytes of entries, weighed by [`weigh`],
    /// and at most `max_variants` variants of one response.
    pub(crate) fn new(capacity: u64, max_variants: usize) -> Self {
        Self::sampling(capacity, capacity / 4 * 3, front::SAMPLE, max_variants)
    }

    fn sampling(capacity: u64, busy_at: u64, sample: u32, max_variants: usize) -> Self {
        let front = Arc::new(Front::new(max_variants));
        let listener = front.clone();
        let moka = Cache::builder()
            .max_capacity(capacity)
            .weigher(|key: &LocalKey, value: &Arc<Stored>| {
                u32::try_from(weigh(key, value)).unwrap_or(u32::MAX)
            })
            .expire_after(UntilKept)
            // Whatever leaves moka (evicted, expired, replaced, invalidated) leaves the
            // front: only that very entry, a newer one may be there already.
            .eviction_listener(move |key: Arc<LocalKey>, value: Arc<Stored>, cause| {
                if cause == RemovalCause::Replaced {
                    listener.replaced(&key, &value);
                } else {
                    listener.remove(&key, Some(&value));
                }
            })
            .build_with_hasher(Spread);
        Self {
            moka,
            front,
            listed: Listed::new(),
            busy_at,
            sample,
            max_entry: capacity / ENTRY_SHARE,
            variants_dropped: AtomicU64::new(0),
            #[cfg(test)]
            before_insert: std::sync::Mutex::new(None),
        }
    }

    /// The most one entry may weigh (see [`ENTRY_SHARE`]): a body longer is not kept.
    pub(crate) fn max_entry(&self) -> u64 {
        self.max_entry
    }

    /// The entry at `key`, unless it is past its keep time at `now`.
    ///
    /// While L1 is less than three quarters full, the front answers, and moka sees one
    /// hit in [`front::SAMPLE`], drawn at random; from then on, moka answers every hit,
    /// so that it evicts knowing every hit (see the [front](super::front)'s docs: a hit
    /// costs about 100 ns more then, far less than each hit lost would cost).
    pub(crate) fn get(&self, key: &LocalKey, now: Instant) -> Option<Arc<Stored>> {
        let stored = if self.moka.weighted_size() >= self.busy_at {
            let stored = self.moka.get(key)?;
            if key.variant != 0 {
                self.front.touch(key);
            }
            stored
        } else {
            match self.front.get(key) {
                Ok(stored) => {
                    if front::sampled(self.sample) {
                        let _ = self.moka.get(key);
                    }
                    stored
                }
                Err(changes) => {
                    let stored = self.moka.get(key)?;
                    if let front::Put::Inserted(dropped) =
                        self.front.promote(*key, stored.clone(), changes)
                    {
                        self.drop_variant(dropped);
                    }
                    stored
                }
            }
        };
        // Moka would no longer give it (it has not dropped it yet, or the front has not
        // heard).
        (now < stored.expires_at()).then_some(stored)
    }

    /// Puts an entry in L1 unless an entry with a higher token is there, or the key was
    /// invalidated after the entry was made. Returns whether it was put.
    ///
    /// An invalidation that races the put always wins. Every invalidation writes its
    /// tombstone, then removes the entries from moka. The put looks at the tombstones
    /// before moka's insert and again after it: an invalidation whose tombstone came
    /// before the second look is seen by it (the entry is taken out again), and one that
    /// came after it finds the entry in moka. Looking before only was not enough: moka's
    /// `invalidate` takes no lock on a key it does not hold, so one that came between the
    /// look and the insert removed nothing, and the old entry stayed until it expired.
    /// What is left, for a response's own key, is the moment between moka's insert and
    /// the second look: a read in it (on another thread, a microsecond at most) may still
    /// be answered from the entry an invalidation that just returned was meant to
    /// remove. A variant is inserted and listed under its list's lock (see [`Listed`]),
    /// which the invalidation takes too: it returns after the variant is gone.
    ///
    /// L1 is moka's synchronous cache: its operations do not wait, so the request path
    /// can answer a hit without an `await` (and without allocating a future).
    /// `epoch` is the guard's subscription epoch now: the entry is marked with it.
    pub(crate) fn put(
        &self,
        tombstones: &Tombstones,
        key: LocalKey,
        stored: Arc<Stored>,
        epoch: u64,
    ) -> bool {
        stored.epoch.fetch_max(epoch, Ordering::Relaxed);
        if stored.in_parts().is_some() {
            // Not held (read from Redis in parts): nothing to keep, and nothing it
            // replaces (which may be newer, put by a fill meanwhile).
            return false;
        }
        if weigh(&key, &stored) as u64 > self.max_entry {
            // Not kept; nor is what it replaces, which is older.
            self.moka.invalidate(&key);
            return false;
        }
        let refused = |tombstones: &Tombstones| invalidated(tombstones, key.response, &stored);
        if refused(tombstones) {
            return false;
        }
        // Before moka: see the front's rules.
        let changes = self.front.changes(&key);
        let holds = |key: &LocalKey| self.moka.contains_key(key);
        let inserted = |result: &CompResult<LocalKey, Arc<Stored>>| {
            matches!(
                result,
                CompResult::Inserted(_) | CompResult::ReplacedWith(_)
            )
        };
        let insert = || {
            self.moka.entry(key).and_compute_with(|existing| {
                match existing {
                    Some(e) if e.value().response.token > stored.response.token => Op::Nop,
                    // Again, under the entry's lock: an invalidation may have come since.
                    _ if refused(tombstones) => Op::Nop,
                    _ => {
                        #[cfg(test)]
                        {
                            let hook = self.before_insert.lock().expect("hook lock").take();
                            if let Some(hook) = hook {
                                hook();
                            }
                        }
                        Op::Put(stored.clone())
                    }
                }
            })
        };
        // A variant is listed once moka has it (see `Listed`).
        let result = self.listed.insert(&key, holds, insert, inserted);
        if !inserted(&result) {
            return false;
        }
        // The second look (see above): the entry is in moka now. The fence pairs with the
        // one in `invalidate_response`: of the two, this look or that removal, at least
        // one sees the other's write (the tombstone, the entry), whatever the caches do
        // inside.
        std::sync::atomic::fence(Ordering::SeqCst);
        if refused(tombstones) {
            self.remove_if_still(key, &stored);
            // The front has not had it: nothing to remove there.
            return false;
        }
        self.to_front(key, &stored, changes);
        true
    }

    /// Puts in the front an entry moka holds now, or, when another change to the shard
    /// came between, promotes it there.
    fn to_front(&self, key: LocalKey, stored: &Arc<Stored>, changes: u64) {
        match self.front.put(key, stored.clone(), changes) {
            front::Put::Inserted(dropped) => self.drop_variant(dropped),
            // Another change to the shard came between: the front left the key out. A
            // read would promote the entry; until then the cap of variants does not
            // count it. So it is promoted now, while moka still holds it (a few tries:
            // each fails only if the shard changes again meanwhile).
            front::Put::LeftOut => {
                for _ in 0..4 {
                    let changes = self.front.changes(&key);
                    match self.moka.get(&key) {
                        Some(held) if Arc::ptr_eq(&held, stored) => {
                            if let front::Put::Inserted(dropped) =
                                self.front.promote(key, held, changes)
                            {
                                self.drop_variant(dropped);
                                break;
                            }
                        }
                        // Replaced or removed since: that change saw to the front.
                        _ => break,
                    }
                }
            }
        }
    }

    /// Drops from moka the variant the front dropped past the cap, if it is still that
    /// entry (a newer one may have been put since), and counts it.
    fn drop_variant(&self, dropped: Option<(LocalKey, Arc<Stored>)>) {
        let Some((key, stored)) = dropped else { return };
        self.remove_if_still(key, &stored);
        self.variants_dropped.fetch_add(1, Ordering::Relaxed);
    }

    /// Removes `key` from moka if it still holds `stored` there (a newer entry put
    /// since stays).
    fn remove_if_still(&self, key: LocalKey, stored: &Arc<Stored>) {
        let _ = self
            .moka
            .entry(key)
            .and_compute_with(|existing| match existing {
                Some(e) if Arc::ptr_eq(e.value(), stored) => Op::Remove,
                _ => Op::Nop,
            });
    }

    /// How many variants were dropped past the cap of one response's so far.
    pub(crate) fn variants_dropped(&self) -> u64 {
        self.variants_dropped.load(Ordering::Relaxed)
    }

    /// Drops `response` and every variant of it from L1 (those listed: see
    /// [`Listed`]; the front drops them all, so none is served after this returns).
    /// Returns how many variants were listed.
    pub(crate) fn invalidate_response(&self, response: u128) -> usize {
        let keys = self.keys_of(response);
        for key in &keys {
            self.moka.invalidate(key);
        }
        // After moka: see the front's rules.
        self.front.remove_response(response);
        keys.len() - 1
    }

    /// [`invalidate_response`](Self::invalidate_response), returning how many of the
    /// entries dropped were not past their keep time at `now`.
    pub(crate) fn remove_response(&self, response: u128, now: Instant) -> u64 {
        let mut removed = 0;
        for key in self.keys_of(response) {
            // (Moka gives back what it holds but would not give: past its time.)
            let live = self.moka.contains_key(&key);
            if let Some(stored) = self.moka.remove(&key)
                && live
                && now < stored.expires_at()
            {
                removed += 1;
            }
        }
        // After moka: see the front's rules.
        self.front.remove_response(response);
        removed
    }

    /// The keys an invalidation of `response` removes: its own, then each variant
    /// listed (taken from the list).
    fn keys_of(&self, response: u128) -> Vec<LocalKey> {
        // The tombstone was written before: see `put`'s second look.
        std::sync::atomic::fence(Ordering::SeqCst);
        let variants = self.listed.take(response);
        std::iter::once(LocalKey::of_response(response))
            .chain(
                variants
                    .into_iter()
                    .map(|variant| LocalKey { response, variant }),
            )
            .collect()
    }

    /// Drops every entry.
    pub(crate) fn invalidate_all(&self) {
        // The list first: see `Listed::clear`.
        self.listed.clear();
        self.moka.invalidate_all();
        self.front.clear();
    }

    /// How many entries it holds (moka's estimate).
    pub(crate) fn entry_count(&self) -> u64 {
        self.moka.entry_count()
    }

    /// What its entries weigh, in bytes (see [`weigh`]).
    pub(crate) fn weighted_size(&self) -> u64 {
        self.moka.weighted_size()
    }
}

/// What moka keeps for each entry besides the key and the value (its entry info, the
/// nodes of its access and write orders and of its timer wheel, its slot in the hash
/// table), estimated from its structures: 337 bytes measured with L1's settings
/// (`cargo bench --bench moka_entry`). `tests/memory.rs` checks the whole weigher
/// against the process's resident memory.
const L1_BOOKKEEPING: usize = 368;

/// Header names that responses often carry and that `http` keeps as static names.
const STATIC_NAMES: &[http::HeaderName] = &[
    http::header::ACCEPT_RANGES,
    http::header::ACCESS_CONTROL_ALLOW_ORIGIN,
    http::header::CACHE_CONTROL,
    http::header::CONTENT_DISPOSITION,
    http::header::CONTENT_ENCODING,
    http::header::CONTENT_LANGUAGE,
    http::header::CONTENT_LENGTH,
    http::header::CONTENT_TYPE,
    http::header::DATE,
    http::header::ETAG,
    http::header::EXPIRES,
    http::header::LAST_MODIFIED,
    http::header::LINK,
    http::header::LOCATION,
    http::header::REFERRER_POLICY,
    http::header::SERVER,
    http::header::STRICT_TRANSPORT_SECURITY,
    http::header::VARY,
    http::header::X_CONTENT_TYPE_OPTIONS,
    http::header::X_FRAME_OPTIONS,
];

/// What an L1 entry at `key` costs in memory, in bytes: every allocation it holds,
/// rounded as the allocator rounds them, moka's bookkeeping and the front's. The
/// capacity is in these bytes, so it is what the process really spends on entries
/// (checked against its resident memory in `tests/memory.rs`).
pub(crate) fn weigh(key: &LocalKey, stored: &Stored) -> usize {
    // An allocation of `len` bytes: a 16-byte header, rounded up to 16 bytes.
    fn heap(len: usize) -> usize {
        if len == 0 {
            0
        } else {
            (len + 16).next_multiple_of(16)
        }
    }
    // A `Bytes` that shares its buffer keeps a small shared header besides it.
    const SHARED: usize = 32;
    let kept = stored.kept_headers();
    let layout = kept.layout();
    // The entry's values: a vector of them, each a slice of one buffer of their bytes
    // (see `entry::compact`).
    let values = heap(size_of_val(kept.values()))
        + heap(kept.values().iter().map(|v| v.len()).sum())
        + SHARED;
    // Its layout (see `layout`), unless shared: a header map keeps a power-of-two
    // table of 4-byte positions, a vector of entries (one per name: a name, a value, a
    // hash and links) and one of the further values of names that have several (a value
    // and links), and a copy of each name that is not static. A layout kept for sharing
    // is paid once, not by each entry (at most `layout::MAX_LAYOUTS` of them).
    let layout = if kept.shares_its_layout() {
        0
    } else {
        let slots = layout.capacity();
        let table = (slots + slots / 3).max(1).next_power_of_two();
        let entry = size_of::<http::HeaderName>() + size_of::<http::HeaderValue>() + 32;
        let extra = size_of::<http::HeaderValue>() + 32;
        let names = layout.keys_len();
        let map = heap(table * 4) + heap(slots * entry) + heap((layout.len() - names) * extra);
        // Names: standard ones are static, others a copy each (a standard name missing
        // from the list is counted as a copy: over, never under).
        let copies: usize = layout
            .keys()
            .filter(|n| !STATIC_NAMES.contains(n))
            .map(|n| heap(n.as_str().len()) + SHARED)
            .sum();
        heap(size_of::<HeaderMap>() + 16) + map + copies
    };
    // The ids of its tags, made when a purge first asks (see `Stored::tag_ids`): 16
    // bytes each.
    let tag_ids = heap(16 * stored.tag_count());
    heap(size_of::<Stored>() + 16) // the Arc<Stored>
        + tag_ids
        + heap(size_of::<LocalKey>() + 16) // moka keeps the key in an Arc
        + values
        + layout
        + heap(stored.response.body.len()) + SHARED
        + L1_BOOKKEEPING
        + front::bookkeeping(key)
        + if key.variant == 0 {
            0
        } else {
            listed::BOOKKEEPING
        }
}

/// Tokens of recent invalidations, per response (its [`LocalKey::response`], shared by
/// its variants): L1 refuses entries older than them (read from L2, or filled, before
/// the invalidation but put after it).
pub(crate) type Tombstones = Cache<u128, Tomb>;

/// The tombstone of a response: the newest token of its invalidations from Redis (its
/// own, or those notices brought), and the token this process wrote from its own clock
/// for an invalidation still on its way to Redis. An entry older than either is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tomb {
    redis: FencingToken,
    local: Option<FencingToken>,
}

impl Tomb {
    /// The token an entry must be newer than.
    pub(crate) fn token(&self) -> FencingToken {
        self.local.map_or(self.redis, |local| local.max(self.redis))
    }
}

/// How many bytes the tombstones of one guard may hold (weighed as L1 entries are): at
/// about 430 bytes each, some 19,000 invalidations within the hour a tombstone lasts;
/// past that, the oldest go first (an entry read or filled before an invalidation whose
/// tombstone is gone may then be put back in L1, until the next notice or expiry).
pub(crate) const TOMBSTONE_BYTES: u64 = 8 * 1024 * 1024;

pub(crate) fn new_tombstones() -> Tombstones {
    Cache::builder()
        .max_capacity(TOMBSTONE_BYTES)
        .weigher(|_: &u128, _: &Tomb| {
            // The key in its Arc, the tokens and moka's bookkeeping.
            u32::try_from(16 + 16 + size_of::<Tomb>() + L1_BOOKKEEPING).unwrap_or(u32::MAX)
        })
        // Longer than any fill can take (the watchdog's maximum is an hour at most).
        .time_to_live(Duration::from_secs(3600))
        .build()
}

/// Writes the tombstone of an invalidation of `response` with `token`, keeping the
/// newest: a notice of a later invalidation that came first keeps its token.
/// `replacing`: the token this process wrote a moment ago from its own clock for the same
/// invalidation ([`bury_local`]), which `token`, Redis's, now stands for whatever their
/// order (the two clocks differ).
pub(crate) fn bury(
    tombstones: &Tombstones,
    response: u128,
    token: FencingToken,
    replacing: Option<FencingToken>,
) {
    let _ = tombstones
        .entry(response)
        .and_compute_with(|existing| match existing {
            None => Op::Put(Tomb {
                redis: token,
                local: None,
            }),
            Some(e) => {
                let tomb = *e.value();
                let local = tomb.local.filter(|local| Some(*local) != replacing);
                Op::Put(Tomb {
                    redis: tomb.redis.max(token),
                    local,
                })
            }
        });
}

/// Writes the tombstone of an invalidation from this process's clock, before Redis gives
/// it its token (or without Redis).
pub(crate) fn bury_local(tombstones: &Tombstones, response: u128, token: FencingToken) {
    let _ = tombstones
        .entry(response)
        .and_compute_with(|existing| match existing {
            None => Op::Put(Tomb {
                redis: FencingToken::new(0),
                local: Some(token),
            }),
            Some(e) => {
                let tomb = *e.value();
                Op::Put(Tomb {
                    local: Some(tomb.local.map_or(token, |local| local.max(token))),
                    ..tomb
                })
            }
        });
}

/// Whether an invalidation of `response` seen here came after `stored` was written.
pub(crate) fn invalidated(tombstones: &Tombstones, response: u128, stored: &Stored) -> bool {
    tombstones
        .get(&response)
        .is_some_and(|tomb| stored.response.token < tomb.token())
}

#[cfg(test)]
mod tombstone_tests {
    use super::*;

    /// A tombstone keeps the newest token: an older one does not replace it, and the
    /// local token of an invalidation gives way to Redis's for it, but never hides a
    /// newer token that came meanwhile, whatever the two clocks say.
    #[test]
    fn a_tombstone_keeps_the_newest_token() {
        let tombstones = new_tombstones();
        let t = FencingToken::new;
        let token = |r| tombstones.get(&r).map(|tomb: Tomb| tomb.token());
        bury(&tombstones, 1, t(10), None);
        bury(&tombstones, 1, t(5), None);
        assert_eq!(token(1), Some(t(10)));
        bury(&tombstones, 1, t(20), None);
        assert_eq!(token(1), Some(t(20)));
        // This clock behind Redis's: the local token gives way to Redis's, higher.
        bury_local(&tombstones, 2, t(100));
        assert_eq!(token(2), Some(t(100)));
        bury(&tombstones, 2, t(150), Some(t(100)));
        assert_eq!(token(2), Some(t(150)));
        // This clock ahead: Redis's token is lower than the local one, and stands.
        bury_local(&tombstones, 3, t(500));
        bury(&tombstones, 3, t(200), Some(t(500)));
        assert_eq!(token(3), Some(t(200)));
        // Ahead again, and a later invalidation's notice comes during the round trip,
        // its token between the two: it stays, above Redis's token for the first.
        bury_local(&tombstones, 4, t(500));
        bury(&tombstones, 4, t(300), None);
        assert_eq!(token(4), Some(t(500)));
        bury(&tombstones, 4, t(200), Some(t(500)));
        assert_eq!(token(4), Some(t(300)));
    }

    /// Tombstones are weighed in bytes: many invalidations keep at most their budget.
    #[test]
    fn tombstones_are_bounded_in_bytes() {
        let tombstones = new_tombstones();
        for n in 0..50_000u64 {
            bury(&tombstones, u128::from(n), FencingToken::new(n + 1), None);
        }
        tombstones.run_pending_tasks();
        assert!(tombstones.weighted_size() <= TOMBSTONE_BYTES);
        // Each weighs what it really costs (its key and moka's bookkeeping, over 400
        // bytes): no more entries than that allows.
        assert!(tombstones.entry_count() * 400 <= TOMBSTONE_BYTES);
    }
}

#[cfg(test)]
mod front_tests {
    use super::*;
    use crate::cache::entry::CachedResponse;

    fn entry(token: u64, keep: Duration) -> Arc<Stored> {
        Arc::new(Stored::aged(
            CachedResponse {
                status: http::StatusCode::OK,
                headers: http::HeaderMap::new(),
                body: bytes::Bytes::from(vec![b'x'; 100]),
                fresh_for: keep,
                grace: Duration::ZERO,
                keep,
                token: FencingToken::new(token),
            },
            Duration::ZERO,
        ))
    }

    fn key(n: u128, variant: u64) -> LocalKey {
        // Spread over the front's shards, as real keys are.
        LocalKey {
            response: n.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835),
            variant,
        }
    }

    fn same(found: Option<Arc<Stored>>, expected: &Arc<Stored>) -> bool {
        found.is_some_and(|found| Arc::ptr_eq(&found, expected))
    }

    /// Every entry of the front is the entry moka holds at its key.
    fn front_agrees(l1: &L1) {
        l1.moka.run_pending_tasks();
        for (key, stored) in l1.front.entries() {
            let held = l1.moka.get(&key);
            assert!(
                held.is_some_and(|held| Arc::ptr_eq(&held, &stored)),
                "the front holds an entry moka {}",
                if l1.moka.contains_key(&key) {
                    "replaced"
                } else {
                    "dropped"
                },
            );
        }
    }

    const HOUR: Duration = Duration::from_secs(3600);

    /// What every invalidation does (the local one, with or without Redis, and a
    /// notice's): the tombstone, then the entries out of L1.
    fn invalidate(l1: &L1, tombstones: &Tombstones, key: LocalKey, token: u64) {
        bury(tombstones, key.response, FencingToken::new(token), None);
        l1.invalidate_response(key.response);
    }

    /// An invalidation that comes between the put's look at the tombstones and moka's
    /// insert (driven there by a hook, not by luck) wins: the entry it invalidated is
    /// not put, not read, and not in the front; before the look and after the insert,
    /// it wins as well. With and without variants (a variant's removal waits for the
    /// put's insert, under the lock of the variants' list: it runs on another thread).
    #[test]
    fn an_invalidation_that_races_a_put_wins_in_every_order() {
        for variants in [false, true] {
            let l1 = Arc::new(L1::new(1 << 20, 256));
            let tombstones = Arc::new(new_tombstones());
            let (a, b) = (key(1, 0), key(1, 7));
            let at = if variants { b } else { a };
            // Between the look and the insert.
            let (hook_l1, hook_tombstones) = (l1.clone(), tombstones.clone());
            let removal = Arc::new(std::sync::Mutex::new(None));
            let hook_removal = removal.clone();
            *l1.before_insert.lock().unwrap() = Some(Box::new(move || {
                if variants {
                    bury(&hook_tombstones, at.response, FencingToken::new(10), None);
                    *hook_removal.lock().unwrap() = Some(std::thread::spawn(move || {
                        hook_l1.invalidate_response(at.response)
                    }));
                } else {
                    invalidate(&hook_l1, &hook_tombstones, at, 10);
                }
            }));
            assert!(
                !l1.put(&tombstones, at, entry(5, HOUR), 0),
                "raced, {variants}"
            );
            assert!(l1.before_insert.lock().unwrap().is_none(), "the hook ran");
            if let Some(removal) = removal.lock().unwrap().take() {
                // It waited for the insert, and found the variant listed.
                assert_eq!(removal.join().unwrap(), 1, "the variant was not listed");
            }
            assert!(
                l1.get(&at, Instant::now()).is_none(),
                "resurrected, {variants}"
            );
            l1.moka.run_pending_tasks();
            assert!(!l1.moka.contains_key(&at));
            front_agrees(&l1);
            // Before the look: refused at once.
            let c = key(2, if variants { 3 } else { 0 });
            invalidate(&l1, &tombstones, c, 10);
            assert!(!l1.put(&tombstones, c, entry(5, HOUR), 0));
            assert!(l1.get(&c, Instant::now()).is_none());
            // After the insert: removed from moka and the front.
            let d = key(3, if variants { 3 } else { 0 });
            assert!(l1.put(&tombstones, d, entry(5, HOUR), 0));
            assert!(l1.get(&d, Instant::now()).is_some());
            invalidate(&l1, &tombstones, d, 10);
            assert!(l1.get(&d, Instant::now()).is_none());
            // A newer entry than the invalidation is put, raced or not.
            *l1.before_insert.lock().unwrap() = Some(Box::new(|| {}));
            let newer = entry(11, HOUR);
            assert!(l1.put(&tombstones, at, newer.clone(), 0));
            assert!(same(l1.get(&at, Instant::now()), &newer));
            front_agrees(&l1);
        }
    }

    /// What a hit reads comes from the front after the first read; a newer entry put at
    /// the key replaces it there at once; an invalidation leaves nothing to read.
    #[test]
    fn the_front_follows_puts_and_invalidations() {
        let l1 = L1::new(1 << 20, 256);
        let tombstones = new_tombstones();
        let (a, one, two) = (key(1, 0), entry(1, HOUR), entry(2, HOUR));
        assert!(l1.get(&a, Instant::now()).is_none());
        // A put enters the front at once, whether it adds the entry or replaces one.
        assert!(l1.put(&tombstones, a, one.clone(), 0));
        assert!(same(l1.front.get(&a).ok(), &one));
        assert!(same(l1.get(&a, Instant::now()), &one));
        assert!(l1.put(&tombstones, a, two.clone(), 0));
        assert!(same(l1.front.get(&a).ok(), &two));
        assert!(same(l1.get(&a, Instant::now()), &two));
        // An older entry is refused, by moka and so by the front.
        assert!(!l1.put(&tombstones, a, one.clone(), 0));
        assert!(same(l1.get(&a, Instant::now()), &two));
        l1.invalidate_response(a.response);
        assert!(l1.get(&a, Instant::now()).is_none());
        front_agrees(&l1);
    }

    /// Every variant of a response leaves moka and the front at once (no predicate
    /// left for moka to run on later reads), and no other response's.
    #[test]
    fn an_invalidation_of_variants_reaches_the_front() {
        let l1 = L1::new(1 << 20, 256);
        let tombstones = new_tombstones();
        let variants: Vec<_> = (1..=5).map(|v| (key(7, v), entry(v, HOUR))).collect();
        let other = (key(8, 1), entry(1, HOUR));
        for (k, stored) in variants.iter().chain([&other]) {
            assert!(l1.put(&tombstones, *k, stored.clone(), 0));
            assert!(same(l1.get(k, Instant::now()), stored));
        }
        l1.invalidate_response(key(7, 0).response);
        for (k, _) in &variants {
            assert!(!l1.moka.contains_key(k), "still in moka");
            assert!(l1.get(k, Instant::now()).is_none());
        }
        assert!(same(l1.get(&other.0, Instant::now()), &other.1));
        assert_eq!(
            l1.listed.len(),
            1,
            "the other response's variant stays listed"
        );
        l1.invalidate_all();
        assert!(l1.get(&other.0, Instant::now()).is_none());
        front_agrees(&l1);
    }

    /// One response holds at most its cap of variants, in the front and in moka: past
    /// it, each put drops the variant read or put least recently, and counts it. Other
    /// responses keep theirs.
    #[test]
    fn variants_past_the_cap_drop_the_least_recently_used() {
        const CAP: usize = 100;
        let l1 = L1::new(64 << 20, CAP);
        let tombstones = new_tombstones();
        let other = (key(8, 1), entry(1, HOUR));
        assert!(l1.put(&tombstones, other.0, other.1.clone(), 0));
        let first = (key(7, 1), entry(1, HOUR));
        assert!(l1.put(&tombstones, first.0, first.1.clone(), 0));
        for v in 2..=10_000 {
            assert!(l1.put(&tombstones, key(7, v), entry(v, HOUR), 0));
            // The first variant is read after every put: always the most recently
            // used but one, never dropped.
            assert!(same(l1.get(&first.0, Instant::now()), &first.1), "{v}");
        }
        let held = |response: u128| {
            l1.moka.run_pending_tasks();
            l1.moka
                .iter()
                .filter(|(k, _)| k.response == response)
                .count()
        };
        assert_eq!(held(key(7, 0).response), CAP);
        assert_eq!(
            l1.front
                .entries()
                .iter()
                .filter(|(k, _)| k.response == key(7, 0).response)
                .count(),
            CAP
        );
        assert_eq!(l1.variants_dropped(), 10_000 - CAP as u64);
        // What is left: the one read all along, and the newest.
        assert!(same(l1.get(&first.0, Instant::now()), &first.1));
        for v in 10_000 - CAP as u64 + 2..=10_000 {
            assert!(l1.get(&key(7, v), Instant::now()).is_some(), "{v}");
        }
        assert!(l1.get(&key(7, 2), Instant::now()).is_none());
        assert!(same(l1.get(&other.0, Instant::now()), &other.1));
        front_agrees(&l1);

        // With L1 three quarters full, moka answers hits: they still mark the variant.
        let busy = L1::sampling(64 << 20, 0, 1, CAP);
        assert!(busy.put(&tombstones, first.0, first.1.clone(), 0));
        for v in 2..=1_000 {
            assert!(busy.put(&tombstones, key(7, v), entry(v, HOUR), 0));
            assert!(
                same(busy.get(&first.0, Instant::now()), &first.1),
                "busy, {v}"
            );
        }
        assert_eq!(busy.variants_dropped(), 1_000 - CAP as u64);
        front_agrees(&busy);

        // A cap of one: each new variant replaces the last.
        let l1 = L1::new(1 << 20, 1);
        assert!(l1.put(&tombstones, key(9, 1), entry(1, HOUR), 0));
        assert!(l1.put(&tombstones, key(9, 2), entry(2, HOUR), 0));
        assert!(l1.get(&key(9, 1), Instant::now()).is_none());
        assert!(l1.get(&key(9, 2), Instant::now()).is_some());
        assert_eq!(l1.variants_dropped(), 1);
        front_agrees(&l1);
    }

    /// A removal that counts: the response's own entry and its variants that are not
    /// past their keep time, and nothing of another response.
    #[test]
    fn a_counted_removal_counts_the_live_entries_of_one_response() {
        let l1 = L1::new(1 << 20, 256);
        let tombstones = new_tombstones();
        let own = (key(7, 0), entry(1, HOUR));
        let variants: Vec<_> = (1..=3).map(|v| (key(7, v), entry(v, HOUR))).collect();
        let short = (key(7, 9), entry(9, Duration::from_secs(60)));
        let other = (key(8, 1), entry(1, HOUR));
        for (k, stored) in [&own, &short, &other].into_iter().chain(&variants) {
            assert!(l1.put(&tombstones, *k, stored.clone(), 0));
        }
        let later = Instant::now() + Duration::from_secs(61);
        assert_eq!(l1.remove_response(own.0.response, later), 4);
        for (k, _) in [&own, &short].into_iter().chain(&variants) {
            assert!(l1.get(k, Instant::now()).is_none());
        }
        assert!(same(l1.get(&other.0, Instant::now()), &other.1));
        assert_eq!(l1.remove_response(own.0.response, later), 0);
        front_agrees(&l1);
    }

    /// An entry past its keep time is not given, though the front still holds it.
    #[test]
    fn an_entry_past_its_keep_time_is_not_given() {
        let l1 = L1::new(1 << 20, 256);
        let a = key(3, 0);
        let stored = entry(1, Duration::from_secs(60));
        assert!(l1.put(&new_tombstones(), a, stored.clone(), 0));
        assert!(same(l1.get(&a, Instant::now()), &stored));
        let later = Instant::now() + Duration::from_secs(61);
        assert!(l1.get(&a, later).is_none());
    }

    /// A promotion that a removal overtook does not put back what was removed.
    #[test]
    fn a_promotion_overtaken_by_a_removal_is_dropped() {
        let l1 = L1::new(1 << 20, 256);
        let a = key(4, 0);
        let stored = entry(1, HOUR);
        let Err(changes) = l1.front.get(&a) else {
            panic!("an empty front holds nothing");
        };
        // Between the miss and the promotion, the entry is invalidated.
        l1.front.remove_response(a.response);
        let _ = l1.front.promote(a, stored, changes);
        assert!(l1.front.get(&a).is_err());
    }

    /// A promotion of what moka held before a put is dropped: the put's entry stays.
    #[test]
    fn a_promotion_overtaken_by_a_put_is_dropped() {
        let l1 = L1::new(1 << 20, 256);
        let tombstones = new_tombstones();
        let (a, one, two) = (key(5, 0), entry(1, HOUR), entry(2, HOUR));
        assert!(l1.put(&tombstones, a, one, 0));
        // As after an eviction from the front alone: the next read promotes.
        l1.front.remove(&a, None);
        let Err(changes) = l1.front.get(&a) else {
            panic!("the front let go of the entry");
        };
        let old = l1.moka.get(&a).unwrap();
        // Between the reader's look in moka and its promotion, a newer entry is put.
        assert!(l1.put(&tombstones, a, two.clone(), 0));
        let _ = l1.front.promote(a, old, changes);
        assert!(same(l1.get(&a, Instant::now()), &two));
        front_agrees(&l1);
    }

    /// The hit ratio of L1 under a skewed load (Zipf, as web traffic is) that does not
    /// fit: as built (moka sees every hit once L1 is three quarters full) it is as good
    /// as with moka seeing every hit, where moka seeing one hit in 16, or none, loses
    /// hits (seen: 0.595 with every hit, 0.564 with one in 16, 0.554 with none).
    #[test]
    fn sampled_reads_keep_the_hit_ratio_of_a_skewed_load() {
        const KEYS: usize = 10_000;
        const REQUESTS: usize = 200_000;
        // Zipf with exponent 1: key `k` has weight 1 / (k + 1).
        let mut cumulative = Vec::with_capacity(KEYS);
        let mut total = 0.0;
        for k in 0..KEYS {
            total += 1.0 / (k + 1) as f64;
            cumulative.push(total);
        }
        let mut rng = fastrand::Rng::with_seed(7);
        let trace: Vec<u128> = (0..REQUESTS)
            .map(|_| {
                let x = rng.f64() * total;
                cumulative.partition_point(|c| *c < x) as u128
            })
            .collect();
        enum Sample {
            AsBuilt,
            Every,
            OneIn16,
            Never,
        }
        let hit_ratio = |sample: Sample| {
            // Room for 5 % of the keys.
            let capacity = 500 * weigh(&key(0, 0), &entry(1, HOUR)) as u64;
            let l1 = match sample {
                Sample::AsBuilt => L1::new(capacity, 256),
                Sample::Every => L1::sampling(capacity, 0, 1, 256),
                Sample::OneIn16 => L1::sampling(capacity, u64::MAX, front::SAMPLE, 256),
                Sample::Never => L1::sampling(capacity, u64::MAX, u32::MAX, 256),
            };
            let tombstones = new_tombstones();
            let mut hits = 0;
            // The same hits sampled on each run.
            fastrand::seed(7);
            for (n, k) in trace.iter().enumerate() {
                let k = key(*k, 0);
                if l1.get(&k, Instant::now()).is_some() {
                    hits += 1;
                } else {
                    l1.put(&tombstones, k, entry(n as u64, HOUR), 0);
                }
            }
            front_agrees(&l1);
            hits as f64 / REQUESTS as f64
        };
        let built = hit_ratio(Sample::AsBuilt);
        let every = hit_ratio(Sample::Every);
        let sampled = hit_ratio(Sample::OneIn16);
        let never = hit_ratio(Sample::Never);
        eprintln!(
            "hit ratio: as built {built:.3}; moka sees every hit {every:.3}, one in 16 \
             {sampled:.3}, none {never:.3}"
        );
        assert!(
            built >= every - 0.015,
            "hit ratio {built:.3} as built, {every:.3} with every hit seen"
        );
        // What the test tells apart: moka blind to hits loses hits.
        assert!(
            never < every - 0.02,
            "hit ratio {never:.3} with no hit seen, {every:.3} with every hit"
        );
    }

    /// Under eviction, with reads racing puts and invalidations, the front never holds
    /// what moka dropped: it stays a subset of moka, and what a read gives after the
    /// race is moka's own entry.
    #[test]
    fn the_front_stays_a_subset_of_moka_under_races() {
        use std::sync::atomic::AtomicBool;
        // Room for some 200 entries: moka evicts all the time. Reads go through the
        // front even so (as built, a full L1 is read in moka alone).
        let capacity = 200 * weigh(&key(0, 0), &entry(1, HOUR)) as u64;
        let l1 = Arc::new(L1::sampling(capacity, u64::MAX, front::SAMPLE, 256));
        let tombstones = Arc::new(new_tombstones());
        // Writers put `keys` (and one in 50 invalidates one), while readers read the
        // keys `read` until the writers are done.
        let race = |keys: std::ops::Range<u64>, read: std::ops::Range<u64>| {
            let done = Arc::new(AtomicBool::new(false));
            let readers: Vec<_> = (0..3u64)
                .map(|t| {
                    let (l1, done, read) = (l1.clone(), done.clone(), read.clone());
                    std::thread::spawn(move || {
                        let mut reads = 0u64;
                        while !done.load(Ordering::Relaxed) || reads < 1000 {
                            for n in read.clone() {
                                l1.get(&key(u128::from(n), (n + t) % 3), Instant::now());
                                reads += 1;
                            }
                        }
                    })
                })
                .collect();
            let writers: Vec<_> = (0..2u64)
                .map(|t| {
                    let (l1, tombstones, keys) = (l1.clone(), tombstones.clone(), keys.clone());
                    std::thread::spawn(move || {
                        // Both on every key, in opposite orders: puts race puts too.
                        let order: Vec<u64> = match t {
                            0 => keys.clone().collect(),
                            _ => keys.clone().rev().collect(),
                        };
                        for round in 0..10 {
                            for &n in &order {
                                let k = key(u128::from(n), (n + round) % 3);
                                if n % 50 == 0 {
                                    l1.invalidate_response(k.response);
                                } else {
                                    l1.put(&tombstones, k, entry(round * 1000 + n, HOUR), 0);
                                }
                            }
                        }
                    })
                })
                .collect();
            for writer in writers {
                writer.join().unwrap();
            }
            done.store(true, Ordering::Relaxed);
            for reader in readers {
                reader.join().unwrap();
            }
        };
        // Reads, puts and invalidations of the same keys.
        race(0..800, 0..800);
        // The front full of the entries moka kept; then new keys push them out, while
        // they are read (and promoted again): only moka's listener takes them out of
        // the front.
        for n in 0..800u64 {
            for v in 0..3 {
                l1.get(&key(u128::from(n), v), Instant::now());
            }
        }
        let held = l1.front.entries().len();
        assert!(held > 100, "the front holds {held}");
        race(800..1600, 0..800);
        front_agrees(&l1);
        for n in 0..1600u128 {
            for v in 0..3 {
                let k = key(n, v);
                let (front, moka) = (l1.get(&k, Instant::now()), l1.moka.get(&k));
                match (front, moka) {
                    (Some(f), Some(m)) => assert!(Arc::ptr_eq(&f, &m)),
                    (None, None) => {}
                    (f, m) => panic!("L1 gave {:?}, moka {:?}", f.is_some(), m.is_some()),
                }
            }
        }
    }

    /// The ids of an entry's tags are made when a purge first asks, long after moka
    /// weighed the entry: the weight counts them from the start (16 bytes each).
    #[test]
    fn tag_ids_are_weighed_before_they_are_made() {
        let with = |first: &'static str, second: &'static str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(first, http::HeaderValue::from_static("a b  c"));
            headers.insert(second, http::HeaderValue::from_static("d, e"));
            Stored::aged(
                CachedResponse {
                    status: http::StatusCode::OK,
                    headers,
                    body: bytes::Bytes::from_static(b"body"),
                    fresh_for: HOUR,
                    grace: Duration::ZERO,
                    keep: HOUR,
                    token: FencingToken::new(1),
                },
                Duration::ZERO,
            )
        };
        let tagged = with("surrogate-key", "cache-tag");
        // The same values under names that tag nothing.
        let untagged = with("x-surrogate-key", "x-cache-tag");
        let five_ids = (16 * 5 + 16_usize).next_multiple_of(16);
        assert_eq!(
            weigh(&key(1, 0), &tagged),
            weigh(&key(1, 0), &untagged) + five_ids
        );
        assert_eq!(tagged.tag_count(), 5);
        assert_eq!(crate::http::response::tags(&tagged.headers()).count(), 5);
    }

    /// The list of variants (what invalidations remove) holds what moka holds, and
    /// what it dropped only until the next prune: with 30,000 variants put through an
    /// L1 that holds 200, each shard lists at most half as many again as moka held at
    /// its last prune (or a first prune's worth), and every variant moka holds is listed.
    #[test]
    fn the_list_of_variants_keeps_what_moka_holds_and_little_else() {
        let held = 200;
        let capacity = held * weigh(&key(0, 1), &entry(1, HOUR)) as u64;
        let l1 = L1::new(capacity, 256);
        let tombstones = new_tombstones();
        let puts = 30_000;
        for n in 0..puts {
            assert!(l1.put(&tombstones, key(n, 1), entry(1, HOUR), 0));
            if n % 1_000 == 0 {
                l1.moka.run_pending_tasks();
            }
        }
        l1.moka.run_pending_tasks();
        // Moka holds its capacity, and up to the puts since its last housekeeping.
        let bound = listed::FIRST_PRUNE * listed::SHARDS + 3 * (held as usize + 1_000) / 2;
        let len = l1.listed.len();
        assert!(len <= bound, "{len} listed, at most {bound}");
        assert!(bound < puts as usize);
        for (key, _) in l1.moka.iter() {
            let variants = l1.listed.take(key.response);
            assert_eq!(variants, [1], "{key:?} is held but not listed");
        }
    }
}
