//! The two tiers: L1, a moka cache in each process, and L2, Redis, shared by the fleet.
//!
//! Both hold the same [`CachedResponse`]. L1 weighs entries by their size in bytes and
//! drops each at the end of its keep time; L2 stores each entry as a Redis hash of its
//! writer's fencing token and its encoding, with the keep time as its TTL, so that Redis
//! itself ages entries and no machine's wall clock is consulted.
//!
//! Writes to both are fenced: an entry replaces another only if its token is not lower.

mod scripts;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::ops::compute::{CompResult, Op};
use moka::sync::Cache;

pub(crate) use self::scripts::WriteReply;
use self::scripts::{Lasting, ReadReply};
use crate::entry::{self, CachedResponse};
use crate::keys::CacheKeys;
use crate::lease::{FencingToken, Lease};
use crate::store::{RedisStore, StoreError};

/// A cached response, and its age: how old it was when this process got it, and when
/// that was on this process's monotonic clock.
#[derive(Debug)]
pub(crate) struct Stored {
    pub(crate) response: CachedResponse,
    got_at: Instant,
    age_when_got: Duration,
    /// The guard's subscription epoch when the entry was put in L1 (see
    /// [`l1_put`]): an entry from an earlier epoch may have missed an invalidation.
    epoch: AtomicU64,
}

/// Where an entry is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Freshness {
    /// Serve it.
    Fresh,
    /// Serve it and refresh it.
    Stale,
    /// Past its grace: serve it only when the origin fails.
    Expired,
}

impl Stored {
    /// An entry that is `age` old now.
    pub(crate) fn aged(response: CachedResponse, age: Duration) -> Self {
        Self {
            response,
            got_at: Instant::now(),
            age_when_got: age,
            epoch: AtomicU64::new(0),
        }
    }

    /// The subscription epoch it was put in L1 under.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    pub(crate) fn age(&self) -> Duration {
        self.age_when_got + self.got_at.elapsed()
    }

    pub(crate) fn freshness(&self) -> Freshness {
        let age = self.age();
        let r = &self.response;
        if age < r.fresh_for {
            Freshness::Fresh
        } else if age < r.fresh_for + r.grace {
            Freshness::Stale
        } else {
            Freshness::Expired
        }
    }

    /// Whether it may stand in for an origin that failed.
    pub(crate) fn serves_on_error(&self, stale_if_error: Duration) -> bool {
        let age = self.age();
        age < self.response.fresh_for + stale_if_error.max(self.response.grace)
            && age < self.response.keep
    }

    fn expires_at(&self) -> Instant {
        self.got_at + self.response.keep.saturating_sub(self.age_when_got)
    }
}

/// The local tier.
pub(crate) type L1 = Cache<Arc<str>, Arc<Stored>>;

struct UntilKept;

impl Expiry<Arc<str>, Arc<Stored>> for UntilKept {
    fn expire_after_create(
        &self,
        _key: &Arc<str>,
        value: &Arc<Stored>,
        created_at: Instant,
    ) -> Option<Duration> {
        Some(value.expires_at().saturating_duration_since(created_at))
    }

    fn expire_after_update(
        &self,
        _key: &Arc<str>,
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
        .weigher(|key: &Arc<str>, value: &Arc<Stored>| {
            u32::try_from(weigh(key, value)).unwrap_or(u32::MAX)
        })
        .expire_after(UntilKept)
        // For dropping every variant of an invalidated response at once.
        .support_invalidation_closures()
        .build()
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
pub(crate) fn weigh(key: &str, stored: &Stored) -> usize {
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
        + heap(key.len() + 16) // the Arc<str> key
        + map
        // The values are slices of one buffer (see `entry::compact`).
        + heap(values) + SHARED
        + names
        + heap(stored.response.body.len()) + SHARED
        + L1_BOOKKEEPING
}

/// Tokens of recent invalidations, per response (the primary part of its keys, shared by
/// its variants: see [`CacheKeys::primary`]): L1 refuses entries older than them (read
/// from L2, or filled, before the invalidation but put after it), and a variant older
/// than its response's invalidation is not served.
pub(crate) type Tombstones = Cache<Arc<str>, FencingToken>;

/// How many bytes the tombstones of one guard may hold (weighed as L1 entries are): at
/// about 550 bytes each, some 15,000 invalidations within the hour a tombstone lasts;
/// past that, the oldest go first (an entry read or filled before an invalidation whose
/// tombstone is gone may then be put back in L1, until the next notice or expiry).
pub(crate) const TOMBSTONE_BYTES: u64 = 8 * 1024 * 1024;

pub(crate) fn new_tombstones() -> Tombstones {
    Cache::builder()
        .max_capacity(TOMBSTONE_BYTES)
        .weigher(|key: &Arc<str>, _: &FencingToken| {
            // The key, its Arc, the token and moka's bookkeeping.
            u32::try_from(key.len() + 16 + 8 + L1_BOOKKEEPING).unwrap_or(u32::MAX)
        })
        // Longer than any fill can take (the watchdog's maximum is an hour at most).
        .time_to_live(Duration::from_secs(3600))
        .build()
}

/// Whether an invalidation seen here of the response whose keys start with `primary`
/// (see [`CacheKeys::primary`]) came after `stored` was written.
pub(crate) fn invalidated(tombstones: &Tombstones, primary: &str, stored: &Stored) -> bool {
    tombstones
        .get(primary)
        .is_some_and(|tomb| stored.response.token < tomb)
}

/// Drops from L1 every variant of the response whose keys start with `primary` (those
/// its `Vary` told apart), and the response itself. Moka checks the predicate on every
/// read until it has gone through the cache, so none is served after this returns.
pub(crate) fn l1_invalidate_response(l1: &L1, primary: &str) {
    let primary: Arc<str> = primary.into();
    l1.invalidate(&*format!("{primary}:entry"));
    let _ = l1.invalidate_entries_if(move |key, _| crate::keys::primary_of(key) == &*primary);
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
    key: Arc<str>,
    stored: Arc<Stored>,
    epoch: u64,
) -> bool {
    stored.epoch.fetch_max(epoch, Ordering::Relaxed);
    let primary = crate::keys::primary_of(&key);
    let refused = |tombstones: &Tombstones| invalidated(tombstones, primary, &stored);
    if refused(tombstones) {
        return false;
    }
    let result = l1.entry(key.clone()).and_compute_with(|existing| {
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

/// What L2 has at a key.
#[derive(Debug)]
pub(crate) enum L2Read {
    Miss,
    Found(Arc<Stored>),
    /// Something that is not a valid entry of ours: a miss, counted.
    Garbage(&'static str),
}

/// Reads an entry, within the command timeout plus the time its largest possible size
/// takes to move (`max_size`, the route's body limit: the same slack its write gets).
pub(crate) async fn l2_read(
    store: &RedisStore,
    keys: &CacheKeys,
    max_size: usize,
) -> Result<L2Read, StoreError> {
    Ok(match scripts::read(store, keys, max_size).await? {
        ReadReply::Miss => L2Read::Miss,
        ReadReply::NotOurs => L2Read::Garbage("not an entry"),
        ReadReply::Entry { pttl, .. } if pttl < 0 => L2Read::Garbage("no ttl"),
        ReadReply::Entry { pttl, data } => match entry::decode(&data) {
            Ok(response) => {
                let left = Duration::from_millis(pttl as u64);
                let age = response.keep.saturating_sub(left);
                L2Read::Found(Arc::new(Stored::aged(response, age)))
            }
            Err(error) => L2Read::Garbage(decode_reason(error)),
        },
    })
}

fn decode_reason(error: entry::DecodeError) -> &'static str {
    match error {
        entry::DecodeError::NotAnEntry => "not an entry",
        entry::DecodeError::Version(_) => "version",
        entry::DecodeError::TooLarge => "too large",
        entry::DecodeError::Malformed => "malformed",
        entry::DecodeError::Invalid(_) => "invalid",
    }
}

/// The fenced write of an entry under `lease` (see `scripts/write.lua`).
pub(crate) async fn l2_write(
    store: &RedisStore,
    keys: &CacheKeys,
    lease: &Lease,
    response: &CachedResponse,
    channel: &str,
) -> Result<WriteReply, StoreError> {
    scripts::write(
        store,
        keys,
        lease,
        response.encode(),
        response.keep,
        channel,
    )
    .await
}

/// Replaces an entry by a tombstone for everyone (see the script). Returns whether an
/// entry was there, and the tombstone's token. `tombstone_for` is how long a fill can
/// take; `entries_live` the longest an entry of the route may live: the invalidation's
/// token outlives every variant it hides.
pub(crate) async fn l2_invalidate(
    store: &RedisStore,
    keys: &CacheKeys,
    channel: &str,
    tombstone_for: Duration,
    entries_live: Duration,
) -> Result<(bool, FencingToken), StoreError> {
    let counter = crate::lease::DEFAULT_FENCE_RETENTION.max(tombstone_for);
    let lasting = Lasting {
        tombstone: tombstone_for,
        counter,
        token: counter.max(entries_live),
    };
    scripts::invalidate(store, keys, channel, lasting).await
}

#[cfg(test)]
mod tombstone_tests {
    use super::*;

    /// Tombstones are weighed in bytes: many invalidations keep at most their budget.
    #[test]
    fn tombstones_are_bounded_in_bytes() {
        let tombstones = new_tombstones();
        for n in 0..50_000u64 {
            let key: Arc<str> = format!("sg:prod:catalog:{{items:req_{n:032x}}}:fill").into();
            tombstones.insert(key, FencingToken::new(n + 1));
        }
        tombstones.run_pending_tasks();
        assert!(tombstones.weighted_size() <= TOMBSTONE_BYTES);
        // Each weighs what it really costs (its key and moka's bookkeeping, over 450
        // bytes here): no more entries than that allows.
        assert!(tombstones.entry_count() * 450 <= TOMBSTONE_BYTES);
    }
}
