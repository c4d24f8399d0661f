//! The two tiers: L1, a moka cache in each process, and L2, Redis, shared by the fleet.
//!
//! Both hold the same [`CachedResponse`](entry::CachedResponse). L1 weighs entries
//! by their size in bytes and drops each at the end of its keep time, and answers hits
//! from its front (the entries that were read, in a map cheaper to read than moka); L2
//! stores each entry as a Redis hash of its writer's fencing token and its encoding,
//! with the keep time as its TTL, so that Redis itself ages entries and no machine's
//! wall clock is consulted.
//!
//! Writes to both are fenced: an entry replaces another only if its token is not lower.

pub(crate) mod entry;
mod front;
mod l1;
mod l2;
mod layout;
mod listed;
mod parts;
mod scripts;
mod stored;

pub(crate) use self::entry::{PART, Parted};
pub(crate) use self::l1::{L1, Tombstones, bury, bury_local, invalidated, new_tombstones};
pub(crate) use self::l2::{
    L2Read, body_digest, l2_drop_parts, l2_invalidate, l2_keep_names, l2_read, l2_read_with_names,
    l2_revalidate, l2_write, l2_write_part,
};
pub(crate) use self::parts::InParts;
pub(crate) use self::scripts::{Channels, Renewal, purge};
pub(crate) use self::stored::{Decoded, Freshness, Instant, Stored};
