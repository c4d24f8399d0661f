//! What the layer counts, and the metric names it reports under.
//!
//! Every decision of the layer is an [`Event`]. Each route counts its events twice: in
//! plain atomic counters, readable with [`GuardLayer::stats`](crate::GuardLayer::stats)
//! (for tests, demos and health pages), and through the [`metrics`] facade, under the
//! names below, labelled by route (never by key, URI or owner value). With no recorder
//! installed the facade costs nothing.
//!
//! Counter handles are registered when a layer is made: install the recorder before.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{Counter, counter};

/// Prefix of every metric name.
pub const PREFIX: &str = "stampede_guard";

/// Requests by how they were answered (`outcome` label).
pub const REQUESTS: &str = "stampede_guard_requests_total";
/// L1 lookups (`result`: hit, miss).
pub const L1_LOOKUPS: &str = "stampede_guard_l1_lookups_total";
/// L2 lookups (`result`: hit, miss).
pub const L2_LOOKUPS: &str = "stampede_guard_l2_lookups_total";
/// Values at an entry's key that did not decode.
pub const DECODE_FAILURES: &str = "stampede_guard_decode_failures_total";
/// Background refreshes by result.
pub const REFRESHES: &str = "stampede_guard_refreshes_total";
/// Fenced writes that Redis refused because a newer entry was stored.
pub const FENCED_WRITES_REFUSED: &str = "stampede_guard_fenced_writes_refused_total";
/// Origin responses that were not stored (private, uncacheable status, too large).
pub const NOT_STORED: &str = "stampede_guard_not_stored_total";
/// Cold misses this process filled.
pub const COLD_FILLS: &str = "stampede_guard_cold_fills_total";
/// Waits for another instance's fill, by how they ended.
pub const COLD_WAITS: &str = "stampede_guard_cold_waits_total";
/// Stale responses served because the origin failed.
pub const STALE_IF_ERROR: &str = "stampede_guard_stale_if_error_total";
/// Redis operations that failed, by operation and kind (counted by the store, for all
/// routes together).
pub const REDIS_ERRORS: &str = crate::store::REDIS_ERRORS;
/// Requests and refreshes of a route that went on without Redis after a Redis error.
pub const REDIS_FALLBACKS: &str = "stampede_guard_redis_fallbacks_total";
/// Fills and refreshes done without Redis (no lease to be had).
pub const LOCAL_ONLY: &str = "stampede_guard_local_only_total";
/// Refreshes and fills stopped because their lease was lost or ran past its maximum.
pub const EXPIRED_WHILE_WORKING: &str = "stampede_guard_expired_while_working_total";
/// Lease acquires whose reply never came (outcome unknown).
pub const UNCERTAIN_ACQUIRES: &str = "stampede_guard_uncertain_acquires_total";
/// Fills that ran past the soft timeout while an expired entry could be served.
pub const SOFT_TIMEOUTS: &str = "stampede_guard_soft_timeouts_total";
/// Lease releases by result.
pub const RELEASES: &str = "stampede_guard_lease_releases_total";
/// Calls the layer made to the origin (fills, refreshes and pass-throughs).
pub const ORIGIN_CALLS: &str = "stampede_guard_origin_calls_total";

macro_rules! events {
    ($($variant:ident => ($name:expr $(, $label:literal => $value:literal)?), $doc:literal;)*) => {
        /// A decision of the layer.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Event {
            $(#[doc = $doc] $variant,)*
        }

        impl Event {
            /// Every event.
            pub const ALL: &'static [Event] = &[$(Event::$variant,)*];

            /// The metric it is counted under, and its label, if any.
            pub fn metric(self) -> (&'static str, Option<(&'static str, &'static str)>) {
                match self {
                    $(Event::$variant => ($name, None $(.or(Some(($label, $value))))?),)*
                }
            }
        }
    };
}

events! {
    Hit => (REQUESTS, "outcome" => "hit"), "A fresh entry was served.";
    Stale => (REQUESTS, "outcome" => "stale"), "A stale entry was served at once.";
    Miss => (REQUESTS, "outcome" => "miss"), "Nothing was cached: the response came from a fill.";
    Bypass => (REQUESTS, "outcome" => "bypass"), "Not cacheable (method, credentials): straight to the origin.";
    Passthrough => (REQUESTS, "outcome" => "passthrough"), "A cold wait ended without an entry: the origin was called, uncached.";
    Rejected => (REQUESTS, "outcome" => "rejected"), "A cold wait ended without an entry: 503.";
    L1Hit => (L1_LOOKUPS, "result" => "hit"), "Found in L1.";
    L1Miss => (L1_LOOKUPS, "result" => "miss"), "Not in L1.";
    L2Hit => (L2_LOOKUPS, "result" => "hit"), "Found in L2.";
    L2Miss => (L2_LOOKUPS, "result" => "miss"), "Not in L2.";
    DecodeFailure => (DECODE_FAILURES), "Garbage at an entry's key, treated as a miss.";
    RefreshWritten => (REFRESHES, "result" => "written"), "A refresh stored a new entry.";
    RefreshAdopted => (REFRESHES, "result" => "adopted"), "A refresh found another instance's newer entry and took it.";
    RefreshBusy => (REFRESHES, "result" => "busy"), "A refresh found the lease held elsewhere and stopped.";
    RefreshOriginError => (REFRESHES, "result" => "origin_error"), "A refresh got an error or a 5xx; the stale entry stays.";
    RefreshTimeout => (REFRESHES, "result" => "timeout"), "A refresh's origin call ran past the refresh timeout.";
    RefreshRedisError => (REFRESHES, "result" => "redis_error"), "A refresh could not use Redis.";
    RefreshNotStored => (REFRESHES, "result" => "not_stored"), "A refresh got a response that may not be stored.";
    FencedWriteRefused => (FENCED_WRITES_REFUSED), "A write was refused: a newer entry is stored.";
    NotStored => (NOT_STORED), "An origin response was not stored.";
    ColdFill => (COLD_FILLS), "This process filled a cold miss.";
    ColdWaitNotified => (COLD_WAITS, "result" => "notified"), "A wait for another instance's fill ended with the entry.";
    ColdWaitTimedOut => (COLD_WAITS, "result" => "timed_out"), "A wait for another instance's fill ran out.";
    StaleIfError => (STALE_IF_ERROR), "A stale entry stood in for a failed origin.";
    RedisError => (REDIS_FALLBACKS), "A Redis operation failed and the route went on without it.";
    LocalOnly => (LOCAL_ONLY), "A fill or refresh went ahead without Redis.";
    OriginCall => (ORIGIN_CALLS), "The layer called the origin.";
    ExpiredWhileWorking => (EXPIRED_WHILE_WORKING), "A lease was lost (or reached its maximum) while its holder worked.";
    UncertainAcquire => (UNCERTAIN_ACQUIRES), "An acquire timed out; it was treated as not acquired.";
    Released => (RELEASES, "result" => "released"), "A lease was released by its holder.";
    ReleaseNotOwner => (RELEASES, "result" => "not_owner"), "A release found the lease gone or someone else's.";
    ReleaseFailed => (RELEASES, "result" => "error"), "A release failed in Redis; the lease ends by its TTL.";
    SoftTimeout => (SOFT_TIMEOUTS), "A fill took longer than the soft timeout; an expired entry was served.";
}

/// The events of one route.
pub(crate) struct RouteStats {
    counts: Vec<AtomicU64>,
    counters: Vec<Counter>,
}

impl RouteStats {
    pub(crate) fn new(route: &str) -> Self {
        let counters = Event::ALL
            .iter()
            .map(|event| match event.metric() {
                (name, Some((label, value))) => {
                    counter!(name, "route" => route.to_owned(), label => value)
                }
                (name, None) => counter!(name, "route" => route.to_owned()),
            })
            .collect();
        Self {
            counts: Event::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            counters,
        }
    }

    pub(crate) fn record(&self, event: Event) {
        let i = index(event);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.counters[i].increment(1);
    }

    pub(crate) fn snapshot(&self) -> Stats {
        Stats {
            counts: self
                .counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
        }
    }
}

/// Variants are declared in the order of [`Event::ALL`].
fn index(event: Event) -> usize {
    event as usize
}

/// A snapshot of a route's event counts.
#[derive(Clone, PartialEq, Eq)]
pub struct Stats {
    counts: Vec<u64>,
}

impl Stats {
    /// How many times `event` happened.
    pub fn get(&self, event: Event) -> u64 {
        self.counts[index(event)]
    }
}

impl fmt::Debug for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (event, count) in Event::ALL.iter().zip(&self.counts) {
            if *count > 0 {
                map.entry(event, count);
            }
        }
        map.finish()
    }
}
