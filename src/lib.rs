//! Cache-stampede protection for axum and hyper services.
//!
//! `stampede-guard` wraps cache-fill handlers so that when a cached response goes stale,
//! one caller across the whole fleet refreshes it under a short Redis lease while every
//! other caller is served the stale response at once.
//!
//! This release holds the foundation:
//!
//! * [`lease`]: Redis leases with fencing tokens, owner-checked renewal and release, and
//!   explicit outcomes for every failure;
//! * [`keys`]: every Redis key, with identifiers replaced by a keyed hash;
//! * [`store`]: the Redis connection, every operation bounded by a deadline;
//! * [`owner`]: unique owner values per acquire attempt.
//!
//! The Tower layer (two-tier cache, stale serving, fenced cache writes) builds on these.

pub mod error;
pub mod keys;
pub mod lease;
pub mod owner;
pub mod store;

pub use self::error::ConfigError;

// The README's examples are compiled with the doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
