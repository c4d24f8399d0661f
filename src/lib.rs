//! Cache-stampede protection for axum and hyper services.
//!
//! `stampede-guard` wraps cache-fill handlers in a Tower layer. Responses are cached in
//! two tiers: a local moka cache (L1) in each process and Redis (L2), shared by every
//! instance. When an entry goes stale, the first caller across the whole fleet takes a
//! short Redis lease and refreshes it in the background; every other caller is served the
//! stale entry at once. The refresh writes back with a fenced write, so a refresher whose
//! lease expired cannot overwrite a newer entry. Redis trouble never becomes an error:
//! the layer goes on with L1 and a local single-flight.
//!
//! * [`StampedeGuard`], [`GuardLayer`], [`Guard`]: the layer (see [`guard`]);
//! * [`Policy`]: per-route settings;
//! * [`lease`]: the Redis lease with fencing tokens, usable on its own;
//! * [`leader`]: one instance of a fleet runs each tick of a periodic job;
//! * `postgres` (feature of the same name): writes to PostgreSQL fenced by the lease's
//!   tokens;
//! * [`keys`]: every Redis key, identifiers replaced by a keyed hash;
//! * [`store`]: the Redis connection, every operation bounded by a deadline; TLS, Redis
//!   Cluster and Sentinel are the features `tls` (a default one), `cluster` and
//!   `sentinel`;
//! * [`metrics`]: what is counted, and the metric names; `prometheus` (feature of the
//!   same name): the exporter with the crate's buckets.

mod cache;
pub mod error;
pub mod guard;
mod http;
pub mod inspect;
pub mod keys;
pub mod leader;
pub mod lease;
pub mod metrics;
mod notify;
pub mod policy;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "prometheus")]
pub mod prometheus;
pub mod store;

/// The wire format of cached entries, for the fuzz target and for tests that plant or
/// read entries in Redis (feature `fuzzing`). Not part of the crate's API: it changes
/// whenever the format does.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::cache::entry::{CachedResponse, DecodeError, VERSION, decode};
    /// Skews this machine's clock as the guard reads it, by µs (ahead when positive):
    /// for tests of what is stamped on which clock.
    pub use crate::guard::clock::skew as skew_this_machines_clock;

    /// The key space's broadcast channel of notices, for tests that listen to it.
    pub fn channel(keys: &crate::KeySpace) -> String {
        keys.channel()
    }

    /// The keys of the response `identity` of `route` (what the layer computes from a
    /// request), for benchmarks of the key path.
    pub fn cache_keys(
        keys: &crate::KeySpace,
        route: &str,
        identity: &[u8],
    ) -> Result<crate::keys::CacheKeys, crate::ConfigError> {
        keys.cache(route, identity)
    }
}

pub use self::error::ConfigError;
pub use self::guard::{
    BodyError, Guard, GuardLayer, InvalidateError, LocalOnly, Mode, NoValue, Purge, ResponseBody,
    ResponseFuture, StampedeGuard, ValueError, Values,
};
pub use self::keys::KeySpace;
pub use self::policy::{ColdMiss, KeyQuery, Policy};
pub use self::store::RedisStore;

pub use self::http::{CACHE_NAME, CACHE_STATUS, X_CACHE};

// The README's examples, and the guides', are compiled with the doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

#[cfg(doctest)]
mod guides {
    #[doc = include_str!("../docs/layer.md")]
    pub struct Layer;
    #[doc = include_str!("../docs/http-cache.md")]
    pub struct HttpCache;
    #[doc = include_str!("../docs/invalidation.md")]
    pub struct Invalidation;
    #[doc = include_str!("../docs/redis.md")]
    pub struct Redis;
    #[doc = include_str!("../docs/observability.md")]
    pub struct Observability;
    #[doc = include_str!("../docs/sidecar.md")]
    pub struct Sidecar;
    #[doc = include_str!("../docs/lease.md")]
    pub struct Lease;
    #[doc = include_str!("../docs/testing.md")]
    pub struct Testing;
    #[doc = include_str!("../docs/values.md")]
    pub struct Values;
}
