//! The variants of each response that moka may hold, listed: what an invalidation of
//! a response removes, one key each.
//!
//! Why not moka's `invalidate_entries_if`: each call leaves a predicate that every read
//! of an older entry runs until moka's housekeeping has scanned the whole cache (a few
//! hundred entries a round), and each instance made one for every invalidation it
//! heard. With a million entries, 10 pending predicates made a read of moka 25x slower,
//! 1,000 made it 900x (`cargo bench --bench moka_predicates`); from three quarters
//! full, every L1 hit reads moka. Closures also cost every entry 32 bytes in moka
//! (`cargo bench --bench moka_entry`). A list costs an invalidation one lookup and a
//! removal per variant, and only variants are listed.
//!
//! The list may hold more than moka does, never less: a put lists its key once moka's
//! insert has taken it, both under its shard's lock, so that an invalidation's take
//! (under the same lock) comes before the two or after both. A variant that left moka
//! stays listed until its shard is pruned (when the shard has grown by half since its
//! last prune, or is cleared with all of L1), and a prune drops only keys moka would
//! not give (gone, or past their time: never given again either).
//!
//! Nothing here is called by moka's eviction listener: a put runs moka's housekeeping
//! (and so the listener) under a shard's lock, which would wait for itself.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::keys::{LocalKey, Spread};

/// Shards of the list, by response: many, so that a prune (a look at each key the
/// shard lists) stays short.
pub(super) const SHARDS: usize = 1024;

/// A shard is pruned when it lists this many variants, or half as many again as after
/// its last prune if that is more.
pub(super) const FIRST_PRUNE: usize = 16;

/// What a listed variant costs, counted in its entry's weight (see `l1::weigh`): a slot
/// of its shard's map (a 16-byte response and its variants, inline when it has one:
/// 49 bytes with hashbrown's control byte, about 75 at the map's usual load), and half
/// as much again for what a prune has not yet dropped. A response with more variants
/// keeps them in a list of 8 bytes each (and its spare room), under the same count.
pub(super) const BOOKKEEPING: usize = 120;

/// The variants listed, by response.
pub(super) struct Listed {
    shards: Box<[Mutex<Shard>]>,
}

#[derive(Default)]
struct Shard {
    /// Each response's listed variants (never 0: a response's own key is not listed).
    map: HashMap<u128, Variants, Spread>,
    /// How many variants the map lists in all.
    len: usize,
    /// The count at which the shard is pruned next.
    prune_at: usize,
}

/// The variants of one response: most have one.
enum Variants {
    One(u64),
    Many(Vec<u64>),
}

impl Variants {
    fn contains(&self, variant: u64) -> bool {
        match self {
            Self::One(v) => *v == variant,
            Self::Many(all) => all.contains(&variant),
        }
    }

    fn push(&mut self, variant: u64) {
        match self {
            Self::One(v) => *self = Self::Many(vec![*v, variant]),
            Self::Many(all) => all.push(variant),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Many(all) => all.len(),
        }
    }

    fn into_vec(self) -> Vec<u64> {
        match self {
            Self::One(v) => vec![v],
            Self::Many(all) => all,
        }
    }

    /// Keeps the variants `keep` says, and says whether any is left.
    fn retain(&mut self, keep: impl Fn(u64) -> bool) -> bool {
        match self {
            Self::One(v) => keep(*v),
            Self::Many(all) => {
                all.retain(|&v| keep(v));
                match all[..] {
                    [] => false,
                    [one] => {
                        *self = Self::One(one);
                        true
                    }
                    _ => {
                        if all.capacity() > 2 * all.len() {
                            all.shrink_to_fit();
                        }
                        true
                    }
                }
            }
        }
    }
}

impl Listed {
    pub(super) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::new())).collect(),
        }
    }

    fn shard(&self, response: u128) -> MutexGuard<'_, Shard> {
        // The key is a keyed hash already: its low bits spread.
        self.shards[response as usize % SHARDS]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `insert` (moka's insert of `key`) under the shard's lock and, if `inserted`
    /// says it put the key in moka and the key is a variant, lists it before letting
    /// go. A full shard is first pruned of the keys `holds` says moka does not hold.
    pub(super) fn insert<R>(
        &self,
        key: &LocalKey,
        holds: impl Fn(&LocalKey) -> bool,
        insert: impl FnOnce() -> R,
        inserted: impl FnOnce(&R) -> bool,
    ) -> R {
        if key.variant == 0 {
            return insert();
        }
        let mut shard = self.shard(key.response);
        if shard.len >= shard.prune_at {
            shard.prune(&holds);
        }
        let result = insert();
        if inserted(&result) {
            shard.list(key);
        }
        result
    }

    /// Takes the variants listed for `response`: every one moka may hold.
    pub(super) fn take(&self, response: u128) -> Vec<u64> {
        let mut shard = self.shard(response);
        let Some(variants) = shard.map.remove(&response) else {
            return Vec::new();
        };
        shard.len -= variants.len();
        variants.into_vec()
    }

    /// Forgets every listed variant (moka is about to drop every entry: a put listed
    /// after its shard was cleared stays listed, whether moka's drop takes it or not).
    pub(super) fn clear(&self) {
        for shard in &self.shards {
            *shard.lock().unwrap_or_else(PoisonError::into_inner) = Shard::new();
        }
    }

    /// How many variants are listed in all.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len)
            .sum()
    }
}

impl Shard {
    fn new() -> Self {
        Self {
            prune_at: FIRST_PRUNE,
            ..Self::default()
        }
    }

    fn list(&mut self, key: &LocalKey) {
        match self.map.get_mut(&key.response) {
            Some(variants) if variants.contains(key.variant) => return,
            Some(variants) => variants.push(key.variant),
            None => {
                self.map.insert(key.response, Variants::One(key.variant));
            }
        }
        self.len += 1;
    }

    /// Drops the keys moka does not hold; the next prune comes when the shard has grown
    /// by half.
    fn prune(&mut self, holds: &impl Fn(&LocalKey) -> bool) {
        self.map.retain(|&response, variants| {
            variants.retain(|variant| holds(&LocalKey { response, variant }))
        });
        if self.map.capacity() > 4 * self.map.len() {
            self.map.shrink_to(2 * self.map.len());
        }
        self.len = self.map.values().map(Variants::len).sum();
        self.prune_at = (self.len + self.len / 2).max(FIRST_PRUNE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(response: u128, variant: u64) -> LocalKey {
        LocalKey { response, variant }
    }

    /// Variants moka took are listed once each, a response's own key never, a refused
    /// one never; taking them empties the list of that response only.
    #[test]
    fn variants_are_listed_once_and_taken_by_response() {
        let listed = Listed::new();
        let inserted = std::cell::Cell::new(0);
        let insert = || {
            inserted.set(inserted.get() + 1);
            true
        };
        for variant in [0, 1, 2, 2, 3] {
            listed.insert(&key(7, variant), |_| true, insert, |&put| put);
        }
        listed.insert(&key(7, 4), |_| true, || false, |&put| put);
        listed.insert(&key(8, 1), |_| true, insert, |&put| put);
        assert_eq!(inserted.get(), 6, "every insert runs");
        assert_eq!(listed.len(), 4);
        let mut taken = listed.take(7);
        taken.sort_unstable();
        assert_eq!(taken, [1, 2, 3]);
        assert!(listed.take(7).is_empty());
        assert_eq!(listed.take(8), [1]);
        assert_eq!(listed.len(), 0);
    }

    /// A shard that fills is pruned of what moka no longer holds, and no sooner than
    /// when it has grown by half again.
    #[test]
    fn a_full_shard_keeps_only_what_moka_holds() {
        let listed = Listed::new();
        // One shard: responses that are equal modulo SHARDS.
        let response = |n: u64| u128::from(n) * SHARDS as u128;
        let put = |n: u64, holds: &dyn Fn(&LocalKey) -> bool| {
            listed.insert(&key(response(n), 1), holds, || (), |()| true);
        };
        for n in 0..4 * FIRST_PRUNE as u64 {
            // Moka holds the even ones only.
            put(n, &|k| (k.response / SHARDS as u128).is_multiple_of(2));
        }
        // 32 held, listed: at most half as many again.
        let len = listed.len();
        assert!((32..=48).contains(&len), "{len} listed");
        assert!(listed.take(response(1)).is_empty(), "pruned");
        for n in (0..4 * FIRST_PRUNE as u64).step_by(2) {
            assert_eq!(listed.take(response(n)), [1], "{n} is held");
        }
    }
}
