//! The Redis connection: the one seam between the crate and Redis.
//!
//! Everything that talks to Redis goes through a [`RedisStore`]: the lease scripts, cache
//! reads, fenced writes and invalidations, notices. It owns the connections and puts one
//! deadline, [`command_timeout`](RedisStoreBuilder::command_timeout), on every operation,
//! pool check-out included, so that no caller waits on Redis longer than that, whatever
//! Redis is doing.
//!
//! What answers is a backend: none at all ([`RedisStore::local_only`]), a single server
//! ([`RedisStore::builder`]), a Redis Cluster (`RedisStore::cluster`, feature `cluster`)
//! or the primary that Redis Sentinel names (`RedisStore::sentinel`, feature
//! `sentinel`); the rest of the crate sees only the store. `rediss://` and the TLS
//! settings need the feature `tls` (a default one).
//!
//! # Connections
//!
//! For a single server, a pool holds a few multiplexed connections. An operation checks one out, takes a
//! clone of it (a multiplexed connection is a handle to one socket that many callers can
//! use at once) and gives it straight back, so the pool size bounds sockets, not
//! concurrency. A connection on which a command timed out or broke is marked and
//! replaced; no `PING` is spent on checking connections out. A cluster is reached through
//! one multiplexed cluster connection (see the `cluster` module for why, and for how
//! notices travel on a cluster), a Sentinel's primary through one multiplexed
//! connection.
//!
//! On every backend a command that timed out retires the connection it was sent on: a
//! socket that a NAT or a firewall forgot (no reset, no reply, ever) says nothing else,
//! and kept, it would time out every command sent on it, the breaker's probe included.
//! A cluster's or a Sentinel primary's connection made less than the connect timeout
//! ago is kept (its timeouts are a slow server's), so that a slow server costs them at
//! most one reconnect per connect timeout; a single server's pool replaces at most its
//! few connections.

mod breaker;
mod builder;
#[cfg(feature = "cluster")]
mod cluster;
mod error;
mod handle;
mod manager;
mod said;
#[cfg(feature = "sentinel")]
mod sentinel;
mod tls;

pub use self::breaker::BreakerConfig;
pub use self::builder::RedisStoreBuilder;
pub use self::error::{Operation, StoreError, StoreErrorKind};
pub use self::handle::{
    DEFAULT_COMMAND_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_POOL_SIZE, RedisStore,
};
pub(crate) use self::handle::{Request, millis};
