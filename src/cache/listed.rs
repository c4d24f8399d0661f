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
//! The list may hold more than moka does, never less: a put lists its key before
//! moka's insert, both under its shard's lock; a variant that left moka stays listed
//! until its shard is pruned (when the shard has doubled since the last prune), and a
//! prune drops only keys moka does not hold, under the same lock.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::keys::{LocalKey, Spread};

/// Shards of the list, by response.
const SHARDS: usize = 64;

/// A shard is pruned when it lists this many variants, or twice what it listed after
/// its last prune if that is more.
const FIRST_PRUNE: usize = 64;

/// What a listed variant costs, counted in its entry's weight (see `l1::weigh`): its
/// place in its response's list (8 bytes, twice that at most while the list grows,
/// and twice again at most between prunes), and its share of its response's slot in
/// the map (a key, a list and the list's allocation: about 80 bytes for a response with
/// one variant).
pub(super) const BOOKKEEPING: usize = 80;

/// The variants listed, by response.
pub(super) struct Listed {
    shards: Box<[Mutex<Shard>]>,
}

#[derive(Default)]
struct Shard {
    /// Each response's listed variants (never 0: a response's own key is not listed).
    map: HashMap<u128, Vec<u64>, Spread>,
    /// How many variants the map lists in all.
    len: usize,
    /// The count at which the shard is pruned next.
    prune_at: usize,
}

impl Listed {
    pub(super) fn new() -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        prune_at: FIRST_PRUNE,
                        ..Shard::default()
                    })
                })
                .collect(),
        }
    }

    fn shard(&self, response: u128) -> std::sync::MutexGuard<'_, Shard> {
        // The key is a keyed hash already: its low bits spread.
        self.shards[response as usize % SHARDS]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Lists `key` if it is a variant, then runs `insert` (moka's insert of it) under
    /// the shard's lock, so that no prune comes between the two. A full shard is first
    /// pruned of the keys `holds` says moka does not hold.
    pub(super) fn list<R>(
        &self,
        key: &LocalKey,
        holds: impl Fn(&LocalKey) -> bool,
        insert: impl FnOnce() -> R,
    ) -> R {
        if key.variant == 0 {
            return insert();
        }
        let mut shard = self.shard(key.response);
        if shard.len >= shard.prune_at {
            shard.prune(&holds);
        }
        let variants = shard.map.entry(key.response).or_default();
        if !variants.contains(&key.variant) {
            variants.push(key.variant);
            shard.len += 1;
        }
        insert()
    }

    /// Takes the variants listed for `response`: every one moka may hold.
    pub(super) fn take(&self, response: u128) -> Vec<u64> {
        let mut shard = self.shard(response);
        let variants = shard.map.remove(&response).unwrap_or_default();
        shard.len -= variants.len();
        variants
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
    /// Drops the keys moka does not hold; the next prune comes when the shard has
    /// doubled.
    fn prune(&mut self, holds: &impl Fn(&LocalKey) -> bool) {
        self.map.retain(|&response, variants| {
            variants.retain(|&variant| holds(&LocalKey { response, variant }));
            variants.shrink_to_fit();
            !variants.is_empty()
        });
        self.len = self.map.values().map(Vec::len).sum();
        self.prune_at = (2 * self.len).max(FIRST_PRUNE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(response: u128, variant: u64) -> LocalKey {
        LocalKey { response, variant }
    }

    /// Variants are listed once each, a response's own key never; taking them empties
    /// the list of that response only.
    #[test]
    fn variants_are_listed_once_and_taken_by_response() {
        let listed = Listed::new();
        let inserted = std::cell::Cell::new(0);
        let insert = || inserted.set(inserted.get() + 1);
        for variant in [0, 1, 2, 2, 3] {
            listed.list(&key(7, variant), |_| true, insert);
        }
        listed.list(&key(8, 1), |_| true, insert);
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
    /// when it has doubled again: the list stays within twice what moka holds.
    #[test]
    fn a_full_shard_keeps_only_what_moka_holds() {
        let listed = Listed::new();
        // One shard: responses that are equal modulo SHARDS.
        let response = |n: u64| u128::from(n) * SHARDS as u128;
        for n in 0..FIRST_PRUNE as u64 {
            listed.list(&key(response(n), 1), |_| true, || ());
        }
        assert_eq!(listed.len(), FIRST_PRUNE);
        // Moka holds the even ones only: the next listing prunes the odd ones.
        let holds = |k: &LocalKey| (k.response / SHARDS as u128).is_multiple_of(2);
        listed.list(&key(response(1_000), 1), holds, || ());
        assert_eq!(listed.len(), FIRST_PRUNE / 2 + 1);
        assert!(listed.take(response(1)).is_empty());
        assert_eq!(listed.take(response(2)), [1]);
    }
}
