//! Instances telling each other what happened to entries, over Redis pub/sub.
//!
//! Every fenced write publishes a fill notice and every invalidation an invalidation
//! notice (inside the same Lua script, so a notice is sent exactly when the write
//! happened); a fill whose lease ends without a write says so, and so does a route that
//! learned a `Vary` header. The wire format is [`Notice`]'s.
//!
//! What every instance needs goes on the key space's broadcast channel: invalidations,
//! purges, learned `Vary` headers, and leases that ended without a write (they set the
//! marks every instance keeps). Fill notices matter only to an instance that waits for
//! the key: they go on the key's interest channel, one of a fixed number of buckets of
//! keys, which an instance listens to only while it waits for a key in it (see
//! `interest`). A waiter subscribes its bucket before it looks at the lease or the entry
//! again, so that no fill falls between the two.
//!
//! [`Notices`] is one guard's side of it: the subscription (one connection, pinged every
//! second, reconnected with backoff; the buckets are subscribed and let go on it), the
//! callers waiting for an entry to be filled elsewhere ([`Wait`]), and the channels. It
//! knows nothing of the guard's state: what a notice means for L1, tombstones, marks and
//! routes, the guard says through [`Hears`]. Callers waiting for a key are woken after
//! the guard has heard the notice, so that they find its effects.
//!
//! A lost wake-up costs time: a waiter that is not woken reads Redis when its cold wait
//! ends, and a waiter whose bucket could not be subscribed in time (the subscription is
//! down, the bucket not confirmed, too many buckets) reads Redis every 100 ms instead of
//! waiting to be woken. A lost invalidation costs freshness for a bounded time: when the
//! subscription is lost, notices sent meanwhile are lost with it, and until the loss is
//! found (a `PING` that fails: within a second and the ping's own deadline, two seconds
//! or the connect timeout if longer, or the connection's end) this process's L1 serves
//! what it holds as it was, fresh if it was. Once found, and when the subscription comes
//! back, the guard is told ([`Hears::subscribed`]) and no longer serves what it held
//! then as fresh. Purges are recorded in Redis too: those recorded since the last one
//! the guard knows of are read back, in batches, beside the notices (see
//! `purge_records::ReadBack`). The subscription counts as up as soon as it is: a
//! read-back that fails is retried with backoff, outside the breaker, while the guard
//! treats what a missed purge could have reached as stale.

mod interest;
mod message;
mod purge_records;
mod subscription;

pub(crate) use self::interest::Interest;
pub(crate) use self::message::{Ending, Notice};
pub use self::purge_records::Purge;
pub(crate) use self::purge_records::Recorded;
pub(crate) use self::subscription::{Hears, Notices, Owed, Wait};
