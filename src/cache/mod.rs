//! The two tiers: L1, a moka cache in each process, and L2, Redis, shared by the fleet.
//!
//! Both hold the same [`CachedResponse`]. L1 weighs entries by their size in bytes and
//! drops each at the end of its keep time; L2 stores each entry as a Redis hash of its
//! writer's fencing token and its encoding, with the keep time as its TTL, so that Redis
//! itself ages entries and no machine's wall clock is consulted.
//!
//! Writes to both are fenced: an entry replaces another only if its token is not lower.

mod scripts;

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::ops::compute::{CompResult, Op};
use moka::sync::Cache;

pub(crate) use self::scripts::WriteReply;
use self::scripts::{Invalidated, Lasting, ReadReply};
use crate::entry::{self, CachedResponse};
use crate::keys::{CacheKeys, LocalKey};
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
    ///
    /// Its headers get the two the layer sets on every answer (`age` and `x-cache`), with
    /// placeholder values, as the first two entries of the map: an answer clones the
    /// headers and overwrites those two values in place (see [`Stored::answer_headers`]),
    /// instead of growing the map and hashing two names every time. They are never
    /// encoded ([`CachedResponse::encode`] leaves them out).
    pub(crate) fn aged(mut response: CachedResponse, age: Duration) -> Self {
        let stored = std::mem::take(&mut response.headers);
        let headers = &mut response.headers;
        headers.reserve(stored.len() + 2);
        headers.insert(http::header::AGE, http::HeaderValue::from_static("0"));
        headers.insert(X_CACHE_NAME, http::HeaderValue::from_static("hit"));
        let mut name = None;
        for (first, value) in stored {
            // `into_iter` names the first value of each header and leaves the name out
            // of the values that follow it.
            if first.is_some() {
                name = first;
            }
            match &name {
                Some(name) if *name != http::header::AGE && *name != X_CACHE_NAME => {
                    headers.append(name.clone(), value);
                }
                _ => {}
            }
        }
        Self {
            response,
            got_at: Instant::now(),
            age_when_got: age,
            epoch: AtomicU64::new(0),
        }
    }

    /// The headers of an answer from this entry: a clone of the stored ones, with the
    /// `age` and `x-cache` placeholders (the first two entries, see [`Stored::aged`])
    /// set to `age` and `x_cache`.
    pub(crate) fn answer_headers(
        &self,
        age: http::HeaderValue,
        x_cache: http::HeaderValue,
    ) -> http::HeaderMap {
        let mut headers = self.response.headers.clone();
        let mut placeholders = headers.iter_mut();
        match (placeholders.next(), placeholders.next()) {
            (Some((first, age_slot)), Some((second, x_cache_slot)))
                if *first == http::header::AGE && *second == X_CACHE_NAME =>
            {
                *age_slot = age;
                *x_cache_slot = x_cache;
            }
            // Not made by `aged` (never the case today): set them the long way.
            _ => {
                headers.insert(http::header::AGE, age);
                headers.insert(X_CACHE_NAME, x_cache);
            }
        }
        headers
    }

    /// The subscription epoch it was put in L1 under.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    pub(crate) fn age(&self) -> Duration {
        self.age_when_got + self.got_at.elapsed()
    }

    pub(crate) fn freshness(&self) -> Freshness {
        self.freshness_at(self.age())
    }

    /// Where an entry `age` old is in its life.
    pub(crate) fn freshness_at(&self, age: Duration) -> Freshness {
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

/// The name of the `x-cache` header, made once.
pub(crate) const X_CACHE_NAME: http::HeaderName = http::HeaderName::from_static(crate::X_CACHE);

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
    variants: bool,
) -> Result<(bool, FencingToken), StoreError> {
    let counter = crate::lease::DEFAULT_FENCE_RETENTION.max(tombstone_for);
    let lasting = Lasting {
        tombstone: tombstone_for,
        counter,
        token: counter.max(entries_live),
    };
    let notice = Invalidated {
        local: keys.local,
        variants,
    };
    scripts::invalidate(store, keys, channel, lasting, notice).await
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

#[cfg(test)]
mod answer_header_tests {
    use super::*;
    use http::HeaderValue;
    use http::header::{AGE, CONTENT_TYPE, LINK, VARY};

    fn stored(headers: http::HeaderMap) -> Stored {
        Stored::aged(
            CachedResponse {
                status: http::StatusCode::OK,
                headers,
                body: bytes::Bytes::from_static(b"body"),
                fresh_for: Duration::from_secs(60),
                grace: Duration::ZERO,
                keep: Duration::from_secs(60),
                token: FencingToken::new(1),
            },
            Duration::ZERO,
        )
    }

    /// An answer's headers are the stored ones, every value of each in order, with one
    /// `age` and one `x-cache`, set to the answer's.
    #[test]
    fn answers_keep_every_stored_header_and_set_age_and_x_cache() {
        let mut headers = http::HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        headers.append(LINK, HeaderValue::from_static("</a>; rel=preload"));
        headers.append(LINK, HeaderValue::from_static("</b>; rel=preload"));
        headers.insert(VARY, HeaderValue::from_static("accept-encoding"));
        // Never stored in practice (the layer strips them), but if they were: replaced.
        headers.append(AGE, HeaderValue::from_static("7"));
        headers.append(AGE, HeaderValue::from_static("8"));
        headers.insert(X_CACHE_NAME, HeaderValue::from_static("from-origin"));
        let stored = stored(headers);

        let answer = stored.answer_headers(
            HeaderValue::from_static("42"),
            HeaderValue::from_static("stale"),
        );
        let all = |name| {
            answer
                .get_all(name)
                .iter()
                .map(|v| v.to_str().unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(all(AGE), ["42"]);
        assert_eq!(all(X_CACHE_NAME), ["stale"]);
        assert_eq!(all(CONTENT_TYPE), ["text/plain"]);
        assert_eq!(all(LINK), ["</a>; rel=preload", "</b>; rel=preload"]);
        assert_eq!(all(VARY), ["accept-encoding"]);
        assert_eq!(answer.len(), 6);
        assert_eq!(answer.keys_len(), 5);

        // The stored map is left as it was: the next answer sets its own values.
        let next = stored.answer_headers(
            HeaderValue::from_static("43"),
            HeaderValue::from_static("hit"),
        );
        assert_eq!(next[AGE], "43");
        assert_eq!(next[X_CACHE_NAME], "hit");
        assert_eq!(next.len(), 6);
    }

    /// With no stored header at all, an answer carries just the two.
    #[test]
    fn an_entry_without_headers_answers_with_age_and_x_cache() {
        let stored = stored(http::HeaderMap::new());
        let answer = stored.answer_headers(
            HeaderValue::from_static("0"),
            HeaderValue::from_static("hit"),
        );
        assert_eq!(answer.len(), 2);
        assert_eq!(answer[AGE], "0");
        assert_eq!(answer[X_CACHE_NAME], "hit");
    }
}
