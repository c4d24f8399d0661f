//! The front of L1: a second pointer to moka's entries, in a plain sharded map that a
//! hit reads under one read lock, ahead of moka.
//!
//! Why: moka's `get` was most of what a hit cost. It pins an epoch, records the read for
//! its eviction policy and reads a clock: about 100 ns of a hit's 400. The front answers
//! in a few atomic operations. Moka stays the owner of what L1 holds (its capacity, its
//! weights, its expiry, its choice of what to evict): the front holds a second pointer
//! to entries moka holds, and nothing else.
//!
//! Four rules keep it so:
//!
//! - **Every change counts**: each shard counts the changes made to it (puts, removals;
//!   a replacement is counted once, by the put that made it).
//! - **An entry enters after moka has it, and only if nothing changed meanwhile**: a put
//!   reads the count, puts the entry in moka, then in the front if the count is the
//!   same (else it removes the key, and the next read promotes whatever moka holds); a
//!   read that misses here reads the count, gets the entry from moka and promotes it on
//!   the same condition. A change that races either wins: a promotion of an entry a put
//!   replaced, or one that was removed, is dropped.
//! - **Whatever leaves moka leaves the front after it**: moka's eviction listener removes
//!   the entries it evicts, expires or replaces (that very entry: a newer one may be
//!   there already); an invalidation removes the key here once moka has dropped it (and
//!   every variant of the response at once).
//! - **No lock of the front is held across a call into moka**: moka may run its
//!   listener on the calling thread, and the listener takes a shard's lock. (A put
//!   holds the lock of L1's list of variants across moka's insert: the listener never
//!   takes that one.)
//!
//! Moka still needs to see reads, to do its housekeeping and, once it has to choose what
//! to evict, to keep what is used. While L1 is less than three quarters full, a hit
//! reads moka too with a chance of one in [`SAMPLE`], drawn at random (so two keys read
//! in turn are both seen). From three quarters on, L1 does not read the front at all:
//! moka answers every hit, as it did before the front. Misses always reach moka (to find
//! the entry), and hits seen one in 16 against misses seen in full would make rarely
//! used keys look as used as the hot ones: on a skewed load that does not fit, that
//! costs 3 % of hits (`l1::front_tests` measures it), each far dearer than the 100 ns
//! moka's lookup adds to a hit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::stored::Stored;
use crate::keys::{LocalKey, Spread};

/// The front's shards, as a power of two: enough that threads rarely share one.
const SHARD_BITS: u32 = 6;

/// A hit also reads moka with a chance of one in this many.
pub(super) const SAMPLE: u32 = 16;

/// What the front costs per entry at most, besides the entry itself, counted in each
/// entry's weight (see [`bookkeeping`]). A response's slot in its shard's table is 33
/// bytes (a 16-byte key, its variants in 16, a control byte). A table doubles when
/// full (7/8 of its slots used), to 7/16, and shrinks below 7/24, back to at least
/// 7/16 (see [`shrink`]): at least 7/24 full, a slot costs at most 114 bytes. The
/// variants of a response with several are in a table of their own (boxed, 48 bytes,
/// shared by at least two): a variant's slot is 25 bytes (an 8-byte key, the entry and
/// when it was used, a control byte), at most 86 under the same rule, 77 in the small
/// tables that do not shrink (up to 88 with their trailing control bytes); with its
/// share of the response's slot (57) and of the box (24), under 192. Besides:
/// response tables of up to [`SMALL`] slots do not shrink, at most 64 × 16 × 114
/// bytes (117 KB) for a whole guard, whatever its capacity.
pub(super) const BOOKKEEPING: usize = 120;

// The slot sizes the figures above rest on.
const _: () = assert!(size_of::<(u128, Variants)>() == 32);
const _: () = assert!(size_of::<(u64, Variant)>() == 24);

/// [`BOOKKEEPING`] for an entry that is a variant of its response's (see there).
pub(super) const VARIANT_BOOKKEEPING: usize = 192;

/// What the front costs at most for the entry at `key`: a variant may be in a table of
/// variants (see [`BOOKKEEPING`]).
pub(super) fn bookkeeping(key: &LocalKey) -> usize {
    if key.variant == 0 {
        BOOKKEEPING
    } else {
        VARIANT_BOOKKEEPING
    }
}

/// Tables this small are left as they are (see [`BOOKKEEPING`]).
const SMALL: usize = 16;

/// What [`Front::put`] did.
pub(super) enum Put {
    /// The entry is in; and the variant dropped past the cap, if one was.
    Inserted(Option<(LocalKey, Arc<Stored>)>),
    /// The shard changed since the put (or the miss before a promotion) counted: the
    /// key is left out, for a read to promote.
    LeftOut,
}

/// The front of L1 (see the [module docs](self)).
pub(super) struct Front {
    shards: Box<[RwLock<Shard>]>,
    /// The most variants of one response it holds: past it, a put drops the variant
    /// unused longest (and L1 drops it from moka).
    max_variants: usize,
}

#[derive(Default)]
struct Shard {
    /// By response: its variants share one slot, so that an invalidation of all of them
    /// removes one slot.
    map: HashMap<u128, Variants, Spread>,
    /// Changes made to this shard so far (see the module docs).
    changes: u64,
}

/// The entries of one response: its own, or those its `Vary` told apart, by variant (a
/// hash: a lookup costs the same with ten thousand of them as with two), each with when
/// it was last used, for dropping the least recently used past the cap.
enum Variants {
    One(u64, Arc<Stored>),
    // Boxed: the variants of a response take 16 bytes of its slot rather than 40, for
    // every response, most of which have one variant.
    #[allow(clippy::box_collection)]
    Many(Box<HashMap<u64, Variant, Spread>>),
}

/// One variant of a response with others: the entry, and the shard's count of changes
/// when it was last put or read (a clock that moves with every put: enough to tell
/// which variant has gone unread longest).
struct Variant {
    stored: Arc<Stored>,
    used: AtomicU64,
}

impl Variant {
    fn new(stored: Arc<Stored>, now: u64) -> Self {
        Self {
            stored,
            used: AtomicU64::new(now),
        }
    }
}

impl Variants {
    /// The entry of `variant`; a variant among others is marked used `now`.
    fn get(&self, variant: u64, now: u64) -> Option<&Arc<Stored>> {
        match self {
            Variants::One(v, stored) => (*v == variant).then_some(stored),
            Variants::Many(all) => {
                let found = all.get(&variant)?;
                // A hit on a variant read since the last change writes nothing: the
                // cache line stays shared between the threads that read it.
                if found.used.load(Ordering::Relaxed) != now {
                    found.used.store(now, Ordering::Relaxed);
                }
                Some(&found.stored)
            }
        }
    }

    /// Puts `variant`, at `now`; past `max` variants, drops the one unused longest and
    /// returns it.
    fn put(
        &mut self,
        variant: u64,
        stored: Arc<Stored>,
        now: u64,
        max: usize,
    ) -> Option<(u64, Arc<Stored>)> {
        match self {
            Variants::One(v, current) if *v == variant => {
                *current = stored;
                None
            }
            Variants::One(v, current) if max <= 1 => {
                let dropped = (*v, std::mem::replace(current, stored));
                *v = variant;
                Some(dropped)
            }
            Variants::One(v, current) => {
                let mut all = HashMap::with_capacity_and_hasher(2, Spread);
                all.insert(*v, Variant::new(current.clone(), now));
                all.insert(variant, Variant::new(stored, now));
                *self = Variants::Many(Box::new(all));
                None
            }
            Variants::Many(all) => {
                if let Some(current) = all.get_mut(&variant) {
                    current.stored = stored;
                    *current.used.get_mut() = now;
                    return None;
                }
                let dropped = if all.len() >= max {
                    // A scan of at most `max` variants, on a put past the cap only.
                    let oldest = all
                        .iter()
                        .min_by_key(|(_, v)| v.used.load(Ordering::Relaxed))
                        .map(|(v, _)| *v)
                        .expect("at least one variant");
                    all.remove(&oldest).map(|v| (oldest, v.stored))
                } else {
                    None
                };
                all.insert(variant, Variant::new(stored, now));
                dropped
            }
        }
    }

    /// Removes `variant` if it is `only` (or whatever it is, without `only`); whether
    /// none is left.
    fn remove(&mut self, variant: u64, only: Option<&Arc<Stored>>) -> bool {
        let matches =
            |v: u64, s: &Arc<Stored>| v == variant && only.is_none_or(|o| Arc::ptr_eq(o, s));
        match self {
            Variants::One(v, stored) => matches(*v, stored),
            Variants::Many(all) => {
                if all
                    .get(&variant)
                    .is_some_and(|s| matches(variant, &s.stored))
                {
                    all.remove(&variant);
                }
                if all.len() == 1 {
                    let (v, last) = all.drain().next().expect("one variant");
                    *self = Variants::One(v, last.stored);
                } else if all.len() * 3 < all.capacity() {
                    // As `shrink` does (see `BOOKKEEPING`).
                    all.shrink_to(all.len());
                }
                matches!(self, Variants::Many(all) if all.is_empty())
            }
        }
    }
}

impl Front {
    pub(super) fn new(max_variants: usize) -> Self {
        Self {
            shards: (0..1 << SHARD_BITS).map(|_| RwLock::default()).collect(),
            max_variants: max_variants.max(1),
        }
    }

    /// The shard of a response, from the top bits of its key (the map's hash uses the
    /// low ones).
    fn shard(&self, response: u128) -> &RwLock<Shard> {
        &self.shards[(response >> (128 - SHARD_BITS)) as usize]
    }

    fn read(&self, response: u128) -> RwLockReadGuard<'_, Shard> {
        // A panic never happens under these locks; if one did, the map is still whole.
        self.shard(response)
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self, response: u128) -> RwLockWriteGuard<'_, Shard> {
        self.shard(response)
            .write()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The entry at `key`; or, if it is not here, the shard's changes so far, for
    /// [`Front::promote`].
    pub(super) fn get(&self, key: &LocalKey) -> Result<Arc<Stored>, u64> {
        let shard = self.read(key.response);
        match shard
            .map
            .get(&key.response)
            .and_then(|v| v.get(key.variant, shard.changes))
        {
            Some(stored) => Ok(stored.clone()),
            None => Err(shard.changes),
        }
    }

    /// Marks the variant at `key` used, if the front holds it: for a hit that moka
    /// answered (L1 three quarters full), so that the cap of variants still drops the
    /// least recently used.
    pub(super) fn touch(&self, key: &LocalKey) {
        let shard = self.read(key.response);
        if let Some(variants) = shard.map.get(&key.response) {
            let _ = variants.get(key.variant, shard.changes);
        }
    }

    /// The shard's changes so far, for [`Front::put`].
    pub(super) fn changes(&self, key: &LocalKey) -> u64 {
        self.read(key.response).changes
    }

    /// Puts what moka held for `key` after a miss here that counted `changes`, unless
    /// the shard changed since (the change may have been this entry's). Past the cap,
    /// drops a variant as [`Front::put`] does.
    #[must_use]
    pub(super) fn promote(&self, key: LocalKey, stored: Arc<Stored>, changes: u64) -> Put {
        let mut shard = self.write(key.response);
        if shard.changes != changes {
            return Put::LeftOut;
        }
        let dropped = self.insert(&mut shard, key, stored);
        if dropped.is_some() {
            // Its removal from moka is yet to come: a promotion of it meanwhile is
            // dropped.
            shard.changes += 1;
        }
        Put::Inserted(dropped)
    }

    /// Puts what was just put in moka at `key`, if the shard has not changed since it
    /// counted `changes`; else removes the key, for the next read to promote what moka
    /// holds. Either way a change: a promotion of what moka held before is dropped.
    ///
    /// A response holds at most `max_variants`: past it, the put drops the variant read
    /// or put least recently, and returns it, for L1 to drop from moka too (without a
    /// lock here: see the module docs).
    #[must_use]
    pub(super) fn put(&self, key: LocalKey, stored: Arc<Stored>, changes: u64) -> Put {
        let mut shard = self.write(key.response);
        let put = if shard.changes == changes {
            Put::Inserted(self.insert(&mut shard, key, stored))
        } else {
            remove(&mut shard.map, &key, None);
            Put::LeftOut
        };
        shard.changes += 1;
        put
    }

    fn insert(
        &self,
        shard: &mut Shard,
        key: LocalKey,
        stored: Arc<Stored>,
    ) -> Option<(LocalKey, Arc<Stored>)> {
        let now = shard.changes;
        match shard.map.get_mut(&key.response) {
            Some(variants) => variants
                .put(key.variant, stored, now, self.max_variants)
                .map(|(variant, stored)| {
                    let key = LocalKey {
                        response: key.response,
                        variant,
                    };
                    (key, stored)
                }),
            None => {
                shard
                    .map
                    .insert(key.response, Variants::One(key.variant, stored));
                None
            }
        }
    }

    /// Removes `key`'s entry `old`, which a put replaced in moka, if it is still here.
    /// Not a change of its own: the put counts it (see [`Front::put`]), and counting it
    /// here too would make every replacing put miss its own insert.
    pub(super) fn replaced(&self, key: &LocalKey, old: &Arc<Stored>) {
        let mut shard = self.write(key.response);
        remove(&mut shard.map, key, Some(old));
    }

    /// Removes `key`'s entry if it is `only` (whatever it is, without `only`).
    pub(super) fn remove(&self, key: &LocalKey, only: Option<&Arc<Stored>>) {
        let mut shard = self.write(key.response);
        shard.changes += 1;
        remove(&mut shard.map, key, only);
    }

    /// Removes every variant of `response`.
    pub(super) fn remove_response(&self, response: u128) {
        let mut shard = self.write(response);
        shard.changes += 1;
        if shard.map.remove(&response).is_some() {
            shrink(&mut shard.map);
        }
    }

    pub(super) fn clear(&self) {
        for shard in &self.shards {
            let mut shard = shard.write().unwrap_or_else(PoisonError::into_inner);
            shard.changes += 1;
            shard.map = HashMap::default();
        }
    }

    /// Every entry it holds (for tests).
    #[cfg(test)]
    pub(super) fn entries(&self) -> Vec<(LocalKey, Arc<Stored>)> {
        let mut entries = Vec::new();
        for shard in &self.shards {
            let shard = shard.read().unwrap_or_else(PoisonError::into_inner);
            for (response, variants) in &shard.map {
                let all: Vec<(u64, Arc<Stored>)> = match variants {
                    Variants::One(v, s) => vec![(*v, s.clone())],
                    Variants::Many(all) => {
                        all.iter().map(|(v, s)| (*v, s.stored.clone())).collect()
                    }
                };
                entries.extend(all.into_iter().map(|(variant, stored)| {
                    let key = LocalKey {
                        response: *response,
                        variant,
                    };
                    (key, stored)
                }));
            }
        }
        entries
    }
}

fn remove(map: &mut HashMap<u128, Variants, Spread>, key: &LocalKey, only: Option<&Arc<Stored>>) {
    if let Some(variants) = map.get_mut(&key.response)
        && variants.remove(key.variant, only)
    {
        map.remove(&key.response);
        shrink(map);
    }
}

/// Gives memory back once a table is mostly empty (hash maps never shrink by
/// themselves): a burst of entries does not keep its table after moka evicted them,
/// and a slot costs at most what [`BOOKKEEPING`] counts. Below 7/24 of its slots used
/// (a third of its room), to the fewest slots that hold what it has (at least 7/16
/// full after). A table that doubled (to 7/16) loses a third of what it holds before it
/// shrinks, and one that shrank doubles what it holds before it grows: each rehash of
/// a table is paid for by a third as many changes at least.
fn shrink(map: &mut HashMap<u128, Variants, Spread>) {
    if map.capacity() > SMALL && map.len() * 3 < map.capacity() {
        map.shrink_to(map.len());
    }
}

/// Whether this hit also reads moka: at random, one in `sample` (see [`SAMPLE`]).
pub(super) fn sampled(sample: u32) -> bool {
    fastrand::u32(..sample) == 0
}
