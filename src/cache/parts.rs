//! A body kept in parts in Redis (see `cache::l2`), read by the answer that streams it:
//! one part at a time, each as its reader's client takes it, so that no reader holds
//! the body whole (see `guard::body`).
//!
//! Before an entry in parts is answered from, its parts are checked in one round trip
//! ([`InParts::check`]: each is there, of its length, of the entry's generation and in
//! its place), so that a body that is not whole is a miss and a refill, as when it is
//! read whole. A part that goes between that check and its read (Redis evicted it, or an
//! invalidation deleted it) cuts the answer's body: never a wrong byte.

use std::fmt;

use bytes::Bytes;

use super::entry::{self, PART, PART_HEADER, Parted};
use super::scripts;
use crate::keys::CacheKeys;
use crate::lease::FencingToken;
use crate::store::{RedisStore, StoreError};

/// Where an entry's body is kept in parts, and how to read them.
#[derive(Clone)]
pub(crate) struct InParts {
    store: RedisStore,
    keys: CacheKeys,
    parted: Parted,
    generation: FencingToken,
    /// Each part is read within the deadline of a read of this many bytes (the route's
    /// body limit, as when the body is read whole).
    max_size: usize,
}

impl fmt::Debug for InParts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InParts")
            .field("count", &self.parted.count)
            .field("len", &self.parted.len)
            .finish_non_exhaustive()
    }
}

impl InParts {
    pub(crate) fn new(
        store: RedisStore,
        keys: CacheKeys,
        parted: Parted,
        generation: FencingToken,
        max_size: usize,
    ) -> Self {
        Self {
            store,
            keys,
            parted,
            generation,
            max_size,
        }
    }

    /// The whole body's length.
    pub(crate) fn len(&self) -> u64 {
        self.parted.len
    }

    /// The part that holds byte `offset`, and where in it that byte is.
    pub(crate) fn part_of(offset: u64) -> (u32, usize) {
        (
            (offset / PART as u64) as u32,
            (offset % PART as u64) as usize,
        )
    }

    /// Whether every part is there, whole, of this body's generation and in its place
    /// (read without their bytes).
    pub(crate) async fn check(&self) -> Result<bool, StoreError> {
        let keys: Vec<String> = (0..self.parted.count)
            .map(|index| self.keys.part(self.generation.get(), index))
            .collect();
        let expected: Vec<_> = (0..self.parted.count)
            .map(|index| {
                let header = entry::part_header(self.generation, index);
                (header, PART_HEADER + self.parted.part_len(index))
            })
            .collect();
        scripts::parts_whole(&self.store, &keys, &expected).await
    }

    /// The data of part `index` (a slice of the reply, not a copy); `None` when it is
    /// not there, or is not the part this body names.
    pub(crate) async fn read(&self, index: u32) -> Result<Option<Bytes>, StoreError> {
        let key = self.keys.part(self.generation.get(), index);
        let Some(part) = scripts::read_part(&self.store, &key, self.max_size).await? else {
            return Ok(None);
        };
        let len = self.parted.part_len(index);
        if entry::part_data(&part, self.generation, index, len).is_none() {
            return Ok(None);
        }
        Ok(Some(Bytes::from(part).slice(PART_HEADER..)))
    }

    /// How many parts.
    pub(crate) fn count(&self) -> u32 {
        self.parted.count
    }
}
