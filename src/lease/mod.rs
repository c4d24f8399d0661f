//! Redis leases with fencing tokens.
//!
//! A lease is a lock with a TTL: [`LeaseClient::try_acquire`] takes it when nobody holds
//! it, [`LeaseClient::renew`] extends it and [`LeaseClient::release`] gives it back. It is
//! what lets one caller across a whole fleet refresh a cache entry while the others serve
//! the stale one; it can be used on its own for any work that is better done once.
//!
//! ```no_run
//! use std::time::Duration;
//! use stampede_guard::keys::{KeySpace, Scope};
//! use stampede_guard::lease::{AcquireOutcome, LeaseClient};
//! use stampede_guard::store::RedisStore;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let keys = KeySpace::builder()
//!     .env("prod")
//!     .service("quote-api")
//!     .secret(std::env::var("LEASE_KEY_SECRET").map_err(|_| "set LEASE_KEY_SECRET")?)
//!     .build()?;
//! let store = RedisStore::builder("redis://127.0.0.1:6379").build()?;
//! let leases = LeaseClient::builder(store, &keys).instance_id("pod-7f8c").build()?;
//!
//! let name = keys.lease(&[Scope::id("quote", "q-123")], "recalculate")?;
//! match leases.try_acquire(&name, Duration::from_secs(5)).await {
//!     AcquireOutcome::Acquired(lease) => {
//!         // ... the work, writing with lease.fencing_token() ...
//!         let _ = leases.release(lease).await;
//!     }
//!     // Someone else is at it, or Redis could not say: do not do the work.
//!     _ => {}
//! }
//! # Ok(()) }
//! ```
//!
//! # How it is done
//!
//! * Acquire is one Lua script: only when the lease key does not exist, it issues a
//!   fencing token and sets the key to the owner value with its TTL in milliseconds.
//!   There is no moment at which a lease exists without a TTL.
//! * The owner value is new for every attempt (`{service}:{instance}:{ulid}`, see
//!   [`Owner`]); renewal and release are Lua scripts that act only
//!   when the stored value is the caller's.
//! * Scripts are sent by SHA and loaded again when Redis has forgotten them (`NOSCRIPT`).
//! * Work that may outlast a lease can run under [`LeaseClient::hold_while`], which
//!   renews it every third of its TTL, up to a maximum total duration, and cancels the
//!   work when the lease is lost.
//! * Every call is bounded by the store's command timeout and says what happened:
//!   [`AcquireOutcome`], [`RenewOutcome`], [`ReleaseOutcome`]. An acquire that timed out
//!   has an unknown outcome and must be treated as not acquired.
//!
//! # What is guaranteed, and what is not
//!
//! A lease is an efficiency device: it keeps many callers from doing the same work at
//! once. It cannot promise that two holders never overlap: a holder can pause (a slow
//! origin, a stalled process) past its TTL while someone else takes the lease, and a
//! Redis failover can lose a lease that was just set. Correctness comes from the
//! [`FencingToken`]: the protected resource refuses writes with a token lower than one
//! it has seen. `stampede_guard::postgres` (feature `postgres`) does that check in PostgreSQL;
//! [`crate::leader`] builds scheduler leadership on it.
//!
//! Tokens for one lease name are `max(last token + 1, Redis server time in µs)`:
//!
//! * They strictly increase across acquisitions, expiries and releases while the fence
//!   counter key lives.
//! * They keep increasing when the counter is lost: Redis restarted without persistence,
//!   the key was evicted (`allkeys-*` policies), or it reached its own TTL
//!   ([`fence_retention`](LeaseClientBuilder::fence_retention)). This holds as long as
//!   the Redis server's clock does not step back by more than the time since the last
//!   token was issued. Only the server's clock matters; clients' clocks never enter.
//! * They are **not** guaranteed after an asynchronous failover to a replica whose clock
//!   is behind the old primary's by more than the failover took, or after the server
//!   clock is set back: a token can then repeat or go down. If that matters, fence in a
//!   store that does not fail over asynchronously (a database row with a token column).
//!
//! Inside the process, validity is judged on the monotonic clock only
//! ([`Lease::valid_until`]), starting when the acquire was sent, so the local view of a
//! lease never outlasts Redis's.

mod client;
mod outcome;
mod owner;
mod scripts;
mod watchdog;

pub(crate) use self::client::{Acquire, check_ttl, release_if_owner};
pub use self::client::{
    DEFAULT_FENCE_RETENTION, DEFAULT_LEASE_TTL, LeaseClient, LeaseClientBuilder, MAX_LEASE_TTL,
    MIN_TTL_PER_COMMAND_TIMEOUT,
};
pub use self::outcome::{
    AcquireOutcome, FencingToken, Lease, ReleaseOutcome, RenewOutcome, UncertainAcquire,
};
pub use self::owner::Owner;
pub(crate) use self::scripts::{HELD_OFF, with_tokens};
pub use self::watchdog::LeaseLost;
