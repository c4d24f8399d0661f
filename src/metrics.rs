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

use std::time::Duration;

use metrics::{Counter, Histogram, SharedString, counter, histogram};

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
/// Waits for another instance's fill that began (those in progress: this minus
/// [`COLD_WAITS`]).
pub const COLD_WAITS_STARTED: &str = "stampede_guard_cold_waits_started_total";
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
/// Lease acquisitions by operation and result (acquired, busy, timed_out, unavailable).
pub const LEASE_ACQUISITIONS: &str = "stampede_guard_lease_acquisitions_total";
/// How long acquires take, by operation.
pub const LEASE_ACQUIRE_SECONDS: &str = "stampede_guard_lease_acquire_seconds";
/// How long leases are held, from acquire to release, by operation.
pub const LEASE_HOLD_SECONDS: &str = "stampede_guard_lease_hold_seconds";
/// Lease renewals by operation and result (renewed, not_owner, error).
pub const LEASE_RENEWALS: &str = "stampede_guard_lease_renewals_total";
/// Lease releases by operation and result (released, not_owner, error).
pub const LEASE_RELEASES: &str = "stampede_guard_lease_releases_total";
/// Renewals and releases that found the lease someone else's, by operation.
pub const LEASE_OWNER_MISMATCHES: &str = "stampede_guard_lease_owner_mismatches_total";
/// How long refreshes take, by route.
pub const REFRESH_SECONDS: &str = "stampede_guard_refresh_seconds";
/// How long callers wait for another instance's fill, by route.
pub const COLD_WAIT_SECONDS: &str = "stampede_guard_cold_wait_seconds";
/// The lease TTL of each route, for comparing hold times against.
pub const LEASE_TTL_SECONDS: &str = "stampede_guard_lease_ttl_seconds";
/// Entries in L1.
pub const L1_ENTRIES: &str = "stampede_guard_l1_entries";
/// Bytes of entries in L1 (weighed).
pub const L1_BYTES: &str = "stampede_guard_l1_bytes";
/// Calls the layer made to the origin (fills, refreshes and pass-throughs).
pub const ORIGIN_CALLS: &str = "stampede_guard_origin_calls_total";
/// Refreshes and cold fills at work, out of the guard's refresh budget.
pub const BUDGET_IN_USE: &str = "stampede_guard_refresh_budget_in_use";
/// Header names a route learned from its responses' `Vary`.
pub const VARY_LEARNED: &str = "stampede_guard_vary_learned_total";

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
    Bypass => (REQUESTS, "outcome" => "bypass"), "Not cacheable (method, credentials, a never-cached route): straight to the origin.";
    Pass => (REQUESTS, "outcome" => "pass"), "The origin's answer could not be stored (private, uncacheable, too large): passed on as it came.";
    HitForPass => (REQUESTS, "outcome" => "hit_for_pass"), "The key's last answer could not be stored: straight to the origin, without waiting for a fill.";
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
    RefreshNotStored => (REFRESHES, "result" => "not_stored"), "A refresh got a response that may not be stored; the fleet backs off as after an error.";
    RefreshSkipped => (REFRESHES, "result" => "skipped"), "A refresh was not started: the refresh budget was spent. The stale entry is served.";
    FencedWriteRefused => (FENCED_WRITES_REFUSED), "A write was refused: a newer entry is stored.";
    NotStored => (NOT_STORED), "An origin response was not stored.";
    ColdFill => (COLD_FILLS), "This process filled a cold miss.";
    ColdWaitStarted => (COLD_WAITS_STARTED), "A fill found another instance's lease and began to wait for its entry.";
    ColdWaitNotified => (COLD_WAITS, "result" => "notified"), "A wait for another instance's fill ended with the entry.";
    ColdWaitTimedOut => (COLD_WAITS, "result" => "timed_out"), "A wait for another instance's fill ran out.";
    ColdWaitEnded => (COLD_WAITS, "result" => "ended"), "A wait for another instance's fill ended early: its lease ended without a write.";
    FillOverBudget => (COLD_WAITS, "result" => "over_budget"), "A cold fill found no slot of the refresh budget within the cold wait (it went ahead without one, unless its callers could be answered otherwise).";
    VaryLearned => (VARY_LEARNED), "The route learned a header its responses vary on.";
    StaleIfError => (STALE_IF_ERROR), "A stale entry stood in for a failed origin.";
    RedisError => (REDIS_FALLBACKS), "A Redis operation failed and the route went on without it.";
    LocalOnly => (LOCAL_ONLY), "A fill or refresh went ahead without Redis.";
    OriginCall => (ORIGIN_CALLS), "The layer called the origin.";
    ExpiredWhileWorking => (EXPIRED_WHILE_WORKING), "A lease was lost (or reached its maximum) while its holder worked.";
    UncertainAcquire => (UNCERTAIN_ACQUIRES), "An acquire timed out; it was treated as not acquired.";
    SoftTimeout => (SOFT_TIMEOUTS), "A fill took longer than the soft timeout; an expired entry was served.";
}

/// The events of one route.
pub(crate) struct RouteStats {
    counts: Vec<AtomicU64>,
    counters: Vec<Counter>,
    pub(crate) refresh_seconds: Histogram,
    pub(crate) cold_wait_seconds: Histogram,
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
            refresh_seconds: histogram!(REFRESH_SECONDS, "route" => route.to_owned()),
            cold_wait_seconds: histogram!(COLD_WAIT_SECONDS, "route" => route.to_owned()),
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

/// Lease metrics, by operation (the lease client's; the fenced write releases too).
pub(crate) fn lease_acquired(operation: SharedString, result: &'static str, took: Duration) {
    counter!(LEASE_ACQUISITIONS, "operation" => operation.clone(), "result" => result).increment(1);
    histogram!(LEASE_ACQUIRE_SECONDS, "operation" => operation).record(took);
}

pub(crate) fn lease_renewed(operation: SharedString, result: &'static str) {
    if result == "not_owner" {
        counter!(LEASE_OWNER_MISMATCHES, "operation" => operation.clone()).increment(1);
    }
    counter!(LEASE_RENEWALS, "operation" => operation, "result" => result).increment(1);
}

pub(crate) fn lease_released(operation: SharedString, result: &'static str, held: Duration) {
    if result == "not_owner" {
        counter!(LEASE_OWNER_MISMATCHES, "operation" => operation.clone()).increment(1);
    }
    counter!(LEASE_RELEASES, "operation" => operation.clone(), "result" => result).increment(1);
    histogram!(LEASE_HOLD_SECONDS, "operation" => operation).record(held);
}

/// Every metric the crate emits, with its kind and help text: for descriptions, and for
/// checking that dashboards and alert rules only use what exists.
pub const ALL: &[(&str, MetricKind, &str)] = &[
    (
        REQUESTS,
        MetricKind::Counter,
        "Requests by how they were answered.",
    ),
    (L1_LOOKUPS, MetricKind::Counter, "L1 lookups by result."),
    (L2_LOOKUPS, MetricKind::Counter, "L2 lookups by result."),
    (
        DECODE_FAILURES,
        MetricKind::Counter,
        "Values at entry keys that did not decode (treated as misses).",
    ),
    (
        REFRESHES,
        MetricKind::Counter,
        "Background refreshes by result.",
    ),
    (
        FENCED_WRITES_REFUSED,
        MetricKind::Counter,
        "Writes refused because a newer entry (or an invalidation) was stored.",
    ),
    (
        NOT_STORED,
        MetricKind::Counter,
        "Origin responses that were not stored.",
    ),
    (
        COLD_FILLS,
        MetricKind::Counter,
        "Cold misses this process filled.",
    ),
    (
        COLD_WAITS,
        MetricKind::Counter,
        "Waits for another instance's fill, by how they ended.",
    ),
    (
        COLD_WAITS_STARTED,
        MetricKind::Counter,
        "Waits for another instance's fill that began.",
    ),
    (
        STALE_IF_ERROR,
        MetricKind::Counter,
        "Stale entries served because the origin failed.",
    ),
    (
        REDIS_FALLBACKS,
        MetricKind::Counter,
        "Route operations that went on without Redis after an error.",
    ),
    (
        LOCAL_ONLY,
        MetricKind::Counter,
        "Fills and refreshes done without a lease.",
    ),
    (
        ORIGIN_CALLS,
        MetricKind::Counter,
        "Calls the layer made to the origin.",
    ),
    (
        EXPIRED_WHILE_WORKING,
        MetricKind::Counter,
        "Refreshes stopped because their lease was lost or ran past its maximum.",
    ),
    (
        UNCERTAIN_ACQUIRES,
        MetricKind::Counter,
        "Acquires whose reply never came.",
    ),
    (
        SOFT_TIMEOUTS,
        MetricKind::Counter,
        "Fills that ran past the soft timeout.",
    ),
    (
        LEASE_ACQUISITIONS,
        MetricKind::Counter,
        "Lease acquisitions by operation and result.",
    ),
    (
        LEASE_ACQUIRE_SECONDS,
        MetricKind::Histogram,
        "Lease acquire latency.",
    ),
    (
        LEASE_HOLD_SECONDS,
        MetricKind::Histogram,
        "How long leases are held.",
    ),
    (
        LEASE_RENEWALS,
        MetricKind::Counter,
        "Lease renewals by result.",
    ),
    (
        LEASE_RELEASES,
        MetricKind::Counter,
        "Lease releases by result.",
    ),
    (
        LEASE_OWNER_MISMATCHES,
        MetricKind::Counter,
        "Renewals and releases that found the lease someone else's.",
    ),
    (
        REFRESH_SECONDS,
        MetricKind::Histogram,
        "How long refreshes take.",
    ),
    (
        COLD_WAIT_SECONDS,
        MetricKind::Histogram,
        "How long callers wait for another instance's fill.",
    ),
    (
        LEASE_TTL_SECONDS,
        MetricKind::Gauge,
        "The lease TTL of each route.",
    ),
    (L1_ENTRIES, MetricKind::Gauge, "Entries in L1."),
    (
        BUDGET_IN_USE,
        MetricKind::Gauge,
        "Refreshes and cold fills at work, out of the refresh budget.",
    ),
    (
        VARY_LEARNED,
        MetricKind::Counter,
        "Header names routes learned from their responses' Vary.",
    ),
    (L1_BYTES, MetricKind::Gauge, "Bytes of entries in L1."),
    (
        crate::store::REDIS_ERRORS,
        MetricKind::Counter,
        "Redis operations that failed, by operation and kind.",
    ),
    (
        crate::store::CIRCUIT_OPEN,
        MetricKind::Gauge,
        "1 while the Redis circuit breaker is open.",
    ),
    (
        crate::store::CIRCUIT_OPENED,
        MetricKind::Counter,
        "Times the Redis circuit breaker opened.",
    ),
];

/// What kind of metric a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetricKind {
    /// A counter (`_total`).
    Counter,
    /// A gauge.
    Gauge,
    /// A histogram (`_seconds`; rendered as `_bucket`, `_sum`, `_count`).
    Histogram,
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
