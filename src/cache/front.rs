//! The front of L1: the entries that were read, in a plain sharded map that a hit reads
//! under one read lock, ahead of moka.
//!
//! Why: moka's `get` was most of what a hit cost. It pins an epoch, records the read for
//! its eviction policy and reads a clock: about 100 ns of a hit's 400. The front answers
//! in a few atomic operations. Moka stays the owner of what L1 holds (its capacity, its
//! weights, its expiry, its choice of what to evict): the front holds a second pointer
//! to entries moka holds, and nothing else.
//!
//! Three rules keep it so:
//!
//! - **An entry enters only by promotion**: after a miss here, L1 copies what moka holds
//!   into the front, unless something was removed from the same shard since the miss
//!   (every shard counts its removals). A removal that races the copy wins.
//! - **Whatever leaves moka leaves the front after it**: moka's eviction listener removes
//!   entries it evicts, expires or replaces; a put and an invalidation remove the key
//!   here once moka has it (an invalidation of variants, which moka drops lazily, removes
//!   them all). Since moka changes first and the front second, a promotion either sees
//!   moka changed or is undone by the removal that follows.
//! - **No lock is held across a call into moka**: moka may run its listener on the
//!   calling thread, and the listener takes a shard's lock.
//!
//! Moka still needs to see reads, to keep popular entries and to do its housekeeping:
//! one hit in [`SAMPLE`] on each thread also reads moka. Its counts of use are then
//! scaled down alike for every entry, which does not change which entries it keeps.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::l1::Spread;
use super::stored::Stored;
use crate::keys::LocalKey;

/// The front's shards, as a power of two: enough that threads rarely share one.
const SHARD_BITS: u32 = 6;

/// One hit in this many (on each thread) also reads moka.
pub(super) const SAMPLE: u32 = 16;

/// What the front costs per entry, besides the entry itself: a slot of a hash table
/// (a 16-byte key and its variants, 48 bytes, with a control byte; tables are between
/// 7/16 and 7/8 full) and a share of a variant list. Counted in each entry's weight.
pub(super) const BOOKKEEPING: usize = 112;

/// The front of L1 (see the [module docs](self)).
pub(super) struct Front {
    shards: Box<[RwLock<Shard>]>,
}

#[derive(Default)]
struct Shard {
    /// By response: its variants share one slot, so that an invalidation of all of them
    /// removes one slot.
    map: HashMap<u128, Variants, Spread>,
    /// Removals from this shard so far (see "promotion" in the module docs).
    removals: u64,
}

/// The entries of one response that were read: its own, or those its `Vary` told apart.
enum Variants {
    One(u64, Arc<Stored>),
    Many(Vec<(u64, Arc<Stored>)>),
}

impl Variants {
    fn get(&self, variant: u64) -> Option<&Arc<Stored>> {
        match self {
            Variants::One(v, stored) => (*v == variant).then_some(stored),
            Variants::Many(all) => all.iter().find(|(v, _)| *v == variant).map(|(_, s)| s),
        }
    }

    fn put(&mut self, variant: u64, stored: Arc<Stored>) {
        match self {
            Variants::One(v, current) if *v == variant => *current = stored,
            Variants::One(v, current) => {
                let first = (*v, current.clone());
                *self = Variants::Many(vec![first, (variant, stored)]);
            }
            Variants::Many(all) => match all.iter_mut().find(|(v, _)| *v == variant) {
                Some((_, current)) => *current = stored,
                None => all.push((variant, stored)),
            },
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
                all.retain(|(v, s)| !matches(*v, s));
                all.is_empty()
            }
        }
    }
}

impl Front {
    pub(super) fn new() -> Self {
        Self {
            shards: (0..1 << SHARD_BITS).map(|_| RwLock::default()).collect(),
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

    /// The entry at `key`; or, if it is not here, the shard's removals so far, for
    /// [`Front::promote`].
    pub(super) fn get(&self, key: &LocalKey) -> Result<Arc<Stored>, u64> {
        let shard = self.read(key.response);
        match shard
            .map
            .get(&key.response)
            .and_then(|v| v.get(key.variant))
        {
            Some(stored) => Ok(stored.clone()),
            None => Err(shard.removals),
        }
    }

    /// Puts what moka held for `key` after a miss here that counted `removals`,
    /// unless something left the shard since (it may have been this entry).
    pub(super) fn promote(&self, key: LocalKey, stored: Arc<Stored>, removals: u64) {
        let mut shard = self.write(key.response);
        if shard.removals != removals {
            return;
        }
        match shard.map.get_mut(&key.response) {
            Some(variants) => variants.put(key.variant, stored),
            None => {
                shard
                    .map
                    .insert(key.response, Variants::One(key.variant, stored));
            }
        }
    }

    /// Removes `key`'s entry if it is `only` (whatever it is, without `only`).
    pub(super) fn remove(&self, key: &LocalKey, only: Option<&Arc<Stored>>) {
        let mut shard = self.write(key.response);
        shard.removals += 1;
        if let Some(variants) = shard.map.get_mut(&key.response)
            && variants.remove(key.variant, only)
        {
            shard.map.remove(&key.response);
            shrink(&mut shard.map);
        }
    }

    /// Removes every variant of `response`.
    pub(super) fn remove_response(&self, response: u128) {
        let mut shard = self.write(response);
        shard.removals += 1;
        if shard.map.remove(&response).is_some() {
            shrink(&mut shard.map);
        }
    }

    pub(super) fn clear(&self) {
        for shard in &self.shards {
            let mut shard = shard.write().unwrap_or_else(PoisonError::into_inner);
            shard.removals += 1;
            shard.map = HashMap::default();
        }
    }

    /// How many responses it holds (for tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.read().unwrap_or_else(PoisonError::into_inner).map.len())
            .sum()
    }
}

/// Gives memory back once a table is mostly empty (hash maps never shrink by
/// themselves): a burst of entries does not keep its table after moka evicted them.
fn shrink(map: &mut HashMap<u128, Variants, Spread>) {
    if map.capacity() > 64 && map.len() * 4 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
}

/// Whether this hit also reads moka: one in [`SAMPLE`] on each thread.
pub(super) fn sampled() -> bool {
    thread_local! {
        static HITS: Cell<u32> = const { Cell::new(0) };
    }
    HITS.with(|hits| {
        let n = hits.get().wrapping_add(1);
        hits.set(n);
        n % SAMPLE == 0
    })
}
