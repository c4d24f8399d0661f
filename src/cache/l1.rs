//! The local tier: moka's synchronous cache in each process, weighed in bytes, each entry
//! dropped at the end of its keep time; and the tombstones that keep invalidated entries
//! from coming back.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::ops::compute::{CompResult, Op};
use moka::sync::Cache;

use super::stored::Stored;
use crate::keys::LocalKey;
use crate::lease::FencingToken;

/// The local tier, keyed by [`LocalKey`] (see there: no HMAC, no key string on a hit).
pub(crate) type L1 = Cache<LocalKey, Arc<Stored>, Spread>;

/// Moka's hasher for the local tier's keys. They are already uniform hashes: fold them
/// into 64 bits rather than hash them again.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Spread;

impl BuildHasher for Spread {
    type Hasher = Folded;

    fn build_hasher(&self) -> Folded {
        Folded(0)
    }
}

/// Folds the words it is given (see [`Spread`]).
#[derive(Debug)]
pub(crate) struct Folded(u64);

impl Hasher for Folded {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not used by `LocalKey` (it writes whole words), but correct if it is.
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = self.0.rotate_left(29) ^ word;
    }

    fn write_u128(&mut self, word: u128) {
        self.write_u64(word as u64 ^ (word >> 64) as u64);
    }
}

struct UntilKept;

impl Expiry<LocalKey, Arc<Stored>> for UntilKept {
    fn expire_after_create(
        &self,
        _key: &LocalKey,
        value: &Arc<Stored>,
        created_at: Instant,
    ) -> Option<Duration> {
        Some(value.expires_at().saturating_duration_since(created_at))
    }

    fn expire_after_update(
        &self,
        _key: &LocalKey,
        value: &Arc<Stored>,
        updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(value.expires_at().saturating_duration_since(updated_at))
    }
}

/// An L1 cache holding at most `capacity` bytes of entries, weighed by [`weigh`].
pub(crate) fn new_l1(capacity: u64) -> L1 {
    Cache::builder()
        .max_capacity(capacity)
        .weigher(|_: &LocalKey, value: &Arc<Stored>| {
            u32::try_from(weigh(value)).unwrap_or(u32::MAX)
        })
        .expire_after(UntilKept)
        // For dropping every variant of an invalidated response at once.
        .support_invalidation_closures()
        .build_with_hasher(Spread)
}

/// What moka keeps for each entry besides the key and the value (its entry info, the
/// nodes of its access and write orders and of its timer wheel, its slot in the hash
/// table), estimated from its structures. `tests/memory.rs` checks the whole weigher
/// against the process's resident memory.
const L1_BOOKKEEPING: usize = 400;

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

/// What an L1 entry costs in memory, in bytes: every allocation it holds, rounded as
/// the allocator rounds them, and moka's bookkeeping. The capacity is in these bytes,
/// so it is what the process really spends on entries (checked against its resident
/// memory in `tests/memory.rs`).
pub(crate) fn weigh(stored: &Stored) -> usize {
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
    let headers = &stored.response.headers;
    // A header map keeps a power-of-two table of 4-byte positions and a vector of
    // entries; each entry holds a name, a value, a hash and links.
    let slots = headers.capacity();
    let table = (slots + slots / 3).max(1).next_power_of_two();
    let entry = size_of::<http::HeaderName>() + size_of::<http::HeaderValue>() + 32;
    let map = heap(table * 4) + heap(slots * entry);
    let values: usize = headers.values().map(|v| v.len()).sum();
    // Names: standard ones are static, others a copy each (a standard name missing from
    // the list is counted as a copy: over, never under).
    let names: usize = headers
        .keys()
        .filter(|n| !STATIC_NAMES.contains(n))
        .map(|n| heap(n.as_str().len()) + SHARED)
        .sum();
    heap(size_of::<Stored>() + 16) // the Arc<Stored>
        + heap(size_of::<LocalKey>() + 16) // moka keeps the key in an Arc
        + map
        // The values are slices of one buffer (see `entry::compact`).
        + heap(values) + SHARED
        + names
        + heap(stored.response.body.len()) + SHARED
        + L1_BOOKKEEPING
}

/// Tokens of recent invalidations, per response (its [`LocalKey::response`], shared by
/// its variants): L1 refuses entries older than them (read from L2, or filled, before
/// the invalidation but put after it).
pub(crate) type Tombstones = Cache<u128, FencingToken>;

/// How many bytes the tombstones of one guard may hold (weighed as L1 entries are): at
/// about 450 bytes each, some 18,000 invalidations within the hour a tombstone lasts;
/// past that, the oldest go first (an entry read or filled before an invalidation whose
/// tombstone is gone may then be put back in L1, until the next notice or expiry).
pub(crate) const TOMBSTONE_BYTES: u64 = 8 * 1024 * 1024;

pub(crate) fn new_tombstones() -> Tombstones {
    Cache::builder()
        .max_capacity(TOMBSTONE_BYTES)
        .weigher(|_: &u128, _: &FencingToken| {
            // The key in its Arc, the token and moka's bookkeeping.
            u32::try_from(16 + 16 + 8 + L1_BOOKKEEPING).unwrap_or(u32::MAX)
        })
        // Longer than any fill can take (the watchdog's maximum is an hour at most).
        .time_to_live(Duration::from_secs(3600))
        .build()
}

/// Whether an invalidation of `response` seen here came after `stored` was written.
pub(crate) fn invalidated(tombstones: &Tombstones, response: u128, stored: &Stored) -> bool {
    tombstones
        .get(&response)
        .is_some_and(|tomb| stored.response.token < tomb)
}

/// Drops `response` from L1, and with `variants` every variant of it (those its `Vary`
/// told apart: moka checks the predicate on every read until it has gone through the
/// cache, so none is served after this returns).
pub(crate) fn l1_invalidate_response(l1: &L1, response: u128, variants: bool) {
    l1.invalidate(&LocalKey::of_response(response));
    if variants {
        let _ = l1.invalidate_entries_if(move |key, _| key.response == response);
    }
}

/// Puts an entry in L1 unless an entry with a higher token is there, or the key was
/// invalidated after the entry was made. Returns whether it was put.
///
/// L1 is moka's synchronous cache: its operations do not wait, so the request path can
/// answer a hit without an `await` (and without allocating a future).
/// `epoch` is the guard's subscription epoch now: the entry is marked with it.
pub(crate) fn l1_put(
    l1: &L1,
    tombstones: &Tombstones,
    key: LocalKey,
    stored: Arc<Stored>,
    epoch: u64,
) -> bool {
    stored.epoch.fetch_max(epoch, Ordering::Relaxed);
    let refused = |tombstones: &Tombstones| invalidated(tombstones, key.response, &stored);
    if refused(tombstones) {
        return false;
    }
    let result = l1.entry(key).and_compute_with(|existing| {
        match existing {
            Some(e) if e.value().response.token > stored.response.token => Op::Nop,
            // Again, under the entry's lock: an invalidation may have come since.
            _ if refused(tombstones) => Op::Nop,
            _ => Op::Put(stored.clone()),
        }
    });
    matches!(
        result,
        CompResult::Inserted(_) | CompResult::ReplacedWith(_)
    )
}

#[cfg(test)]
mod tombstone_tests {
    use super::*;

    /// Tombstones are weighed in bytes: many invalidations keep at most their budget.
    #[test]
    fn tombstones_are_bounded_in_bytes() {
        let tombstones = new_tombstones();
        for n in 0..50_000u64 {
            tombstones.insert(u128::from(n), FencingToken::new(n + 1));
        }
        tombstones.run_pending_tasks();
        assert!(tombstones.weighted_size() <= TOMBSTONE_BYTES);
        // Each weighs what it really costs (its key and moka's bookkeeping, over 400
        // bytes): no more entries than that allows.
        assert!(tombstones.entry_count() * 400 <= TOMBSTONE_BYTES);
    }
}
