//! What the layer counts, and the metric names it reports under.
//!
//! Every decision of the layer is an [`Event`]. Each route counts its events twice: in
//! plain atomic counters, readable with [`GuardLayer::stats`](crate::GuardLayer::stats)
//! (for tests, demos and health pages), and through the [`metrics`] facade, under the
//! names below, labelled by route (never by key, URI or owner value). With no recorder
//! installed the facade costs nothing.
//!
//! Which metrics carry `route`:
//!
//! - every [`Event`]'s metric, [`REFRESH_SECONDS`] and [`COLD_WAIT_SECONDS`];
//! - the lease metrics ([`LEASE_ACQUISITIONS`], [`LEASE_ACQUIRE_SECONDS`],
//!   [`LEASE_RENEWALS`], [`LEASE_RELEASES`], [`LEASE_OWNER_MISMATCHES`],
//!   [`LEASE_HOLD_SECONDS`], [`LEASE_TTL_SECONDS`]) for the guard's cache leases only
//!   (`operation="fill"`); a lease used on its own through a
//!   [`LeaseClient`](crate::lease::LeaseClient) has no route, and carries `operation`
//!   alone.
//!
//! The rest, listed in [`PER_PROCESS`], belong to the whole process, shared by all of
//! its routes, and have no `route` label: L1's size ([`L1_ENTRIES`], [`L1_BYTES`]), the
//! refresh budget ([`BUDGET_IN_USE`]), the store's errors and circuit breaker
//! ([`REDIS_ERRORS`], [`CIRCUIT_OPEN`], [`CIRCUIT_OPENED`]), tag purges ([`PURGES`]) and
//! what the process keeps of them ([`PURGE_TAGS`], [`PURGE_BYTES`]), and periodic jobs
//! ([`LEADER_TICKS`]). Prometheus adds `job` and `instance` to every series
//! when it scrapes: tell services and processes apart by those.
//!
//! Counter handles are registered when a layer is made: install the recorder before.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use std::time::Duration;

use metrics::{Counter, Histogram, Label, SharedString, counter, histogram};

/// Prefix of every metric name.
pub const PREFIX: &str = "stampede_guard";

/// Declares each metric once: its constant (with its doc), and its entry in [`ALL`]
/// (name, kind and help text).
macro_rules! names {
    ($($(#[doc = $doc:literal])* $constant:ident: $kind:ident = $name:literal, $help:literal;)*) => {
        $($(#[doc = $doc])* pub const $constant: &str = $name;)*

        /// Every metric the crate emits, with its kind and help text: for descriptions,
        /// and for checking that dashboards and alert rules only use what exists.
        pub const ALL: &[(&str, MetricKind, &str)] = &[$(($name, MetricKind::$kind, $help),)*];
    };
}

names! {
    /// Requests by how they were answered (`outcome` label).
    REQUESTS: Counter = "stampede_guard_requests_total", "Requests by how they were answered.";
    /// L1 lookups (`result`: hit, miss).
    L1_LOOKUPS: Counter = "stampede_guard_l1_lookups_total", "L1 lookups by result.";
    /// L2 lookups (`result`: hit, miss).
    L2_LOOKUPS: Counter = "stampede_guard_l2_lookups_total", "L2 lookups by result.";
    /// Values at an entry's key that did not decode.
    DECODE_FAILURES: Counter = "stampede_guard_decode_failures_total", "Values at entry keys that did not decode (treated as misses).";
    /// Background refreshes by result.
    REFRESHES: Counter = "stampede_guard_refreshes_total", "Background refreshes by result.";
    /// Fenced writes that Redis refused because a newer entry was stored.
    FENCED_WRITES_REFUSED: Counter = "stampede_guard_fenced_writes_refused_total", "Writes refused because a newer entry (or an invalidation) was stored.";
    /// Origin responses that were not stored (private, uncacheable status, too large).
    NOT_STORED: Counter = "stampede_guard_not_stored_total", "Origin responses that were not stored, by reason (status, set_cookie, private, no_store, no_cache, vary_star, vary_unkeyed, too_large, trailers, no_freshness, event_stream).";
    /// Cold misses this process filled.
    COLD_FILLS: Counter = "stampede_guard_cold_fills_total", "Cold misses this process filled.";
    /// Waits for another instance's fill, by how they ended.
    COLD_WAITS: Counter = "stampede_guard_cold_waits_total", "Waits for another instance's fill, by how they ended.";
    /// Waits for another instance's fill that began (those in progress: this minus
    /// [`COLD_WAITS`]).
    COLD_WAITS_STARTED: Counter = "stampede_guard_cold_waits_started_total", "Waits for another instance's fill that began.";
    /// Callers that were answered by a fill already in flight in this process (its
    /// entry, its answer as it streamed, or its failure) instead of calling the origin
    /// themselves: what the local single-flight saved.
    COALESCED: Counter = "stampede_guard_coalesced_total", "Callers answered by a fill already in flight in this process instead of calling the origin.";
    /// Callers that joined a fill already in flight in this process and waited for it
    /// (a caller that joins again under another key counts again): [`COALESCED`], those
    /// it could not answer (an answer that was its own caller's alone, or of another
    /// variant), which asked the origin after all, and those served a stale entry while
    /// it took too long.
    FILL_JOINS: Counter = "stampede_guard_fill_joins_total", "Callers that joined a fill already in flight in this process and waited for it.";
    /// Stale responses served because the origin failed.
    STALE_IF_ERROR: Counter = "stampede_guard_stale_if_error_total", "Stale entries served because the origin failed.";
    /// Redis operations that failed, by operation and kind (counted by the store, for all
    /// routes together: no `route` label; a route's own are [`REDIS_FALLBACKS`]).
    REDIS_ERRORS: Counter = "stampede_guard_redis_errors_total", "Redis operations that failed, by operation and kind (per process, for all routes: no route label).";
    /// Requests and refreshes of a route that went on without Redis after a Redis error.
    REDIS_FALLBACKS: Counter = "stampede_guard_redis_fallbacks_total", "Route operations that went on without Redis after an error.";
    /// Fills and refreshes done without Redis (no lease to be had).
    LOCAL_ONLY: Counter = "stampede_guard_local_only_total", "Fills and refreshes done without a lease.";
    /// Refreshes and fills stopped because their lease was lost or ran past its maximum.
    EXPIRED_WHILE_WORKING: Counter = "stampede_guard_expired_while_working_total", "Refreshes stopped because their lease was lost or ran past its maximum.";
    /// Lease acquires whose reply never came (outcome unknown).
    UNCERTAIN_ACQUIRES: Counter = "stampede_guard_uncertain_acquires_total", "Acquires whose reply never came.";
    /// Fills that ran past the soft timeout while an expired entry could be served.
    SOFT_TIMEOUTS: Counter = "stampede_guard_soft_timeouts_total", "Fills that ran past the soft timeout.";
    /// Lease acquisitions by operation and result (acquired, busy, timed_out, unavailable,
    /// written) and, for the guard's cache leases, route.
    LEASE_ACQUISITIONS: Counter = "stampede_guard_lease_acquisitions_total", "Lease acquisitions by operation and result (and route, for the guard's leases).";
    /// How long acquires take, by operation and, for the guard's cache leases, route.
    LEASE_ACQUIRE_SECONDS: Histogram = "stampede_guard_lease_acquire_seconds", "Lease acquire latency, by operation (and route, for the guard's leases).";
    /// How long leases are held, from acquire to release, by operation and, for the
    /// guard's cache leases, route.
    LEASE_HOLD_SECONDS: Histogram = "stampede_guard_lease_hold_seconds", "How long leases are held, by operation (and route, for the guard's leases).";
    /// Lease renewals by operation and result (renewed, not_owner, error) and, for the
    /// guard's cache leases, route.
    LEASE_RENEWALS: Counter = "stampede_guard_lease_renewals_total", "Lease renewals by operation and result (and route, for the guard's leases).";
    /// Lease releases by operation and result (released, held_off, not_owner, error)
    /// and, for the guard's cache leases, route.
    LEASE_RELEASES: Counter = "stampede_guard_lease_releases_total", "Lease releases by operation and result (and route, for the guard's leases).";
    /// Renewals and releases that found the lease someone else's, by operation and, for
    /// the guard's cache leases, route.
    LEASE_OWNER_MISMATCHES: Counter = "stampede_guard_lease_owner_mismatches_total", "Renewals and releases that found the lease someone else's (by route, for the guard's leases).";
    /// How long refreshes take, by route.
    REFRESH_SECONDS: Histogram = "stampede_guard_refresh_seconds", "How long refreshes take.";
    /// How long callers wait for another instance's fill, by route.
    COLD_WAIT_SECONDS: Histogram = "stampede_guard_cold_wait_seconds", "How long callers wait for another instance's fill.";
    /// The lease TTL, for comparing [`LEASE_HOLD_SECONDS`] against, with the same labels:
    /// `route` and `operation="fill"` for each route's cache leases (the TTL it takes them
    /// with now); `operation` alone for leases taken on their own through a
    /// [`LeaseClient`](crate::lease::LeaseClient) (the TTL of the last successful acquire
    /// or renewal of that operation in this process).
    LEASE_TTL_SECONDS: Gauge = "stampede_guard_lease_ttl_seconds", "The lease TTL, by route and operation: each route's for its fills; for leases used on their own, the last one taken or renewed with.";
    /// Entries in L1. One per process, no `route` label: L1 is shared by every route
    /// of the guard.
    L1_ENTRIES: Gauge = "stampede_guard_l1_entries", "Entries in L1 (per process, shared by all routes: no route label).";
    /// Bytes of entries in L1 (weighed). One per process, no `route` label, as
    /// [`L1_ENTRIES`].
    L1_BYTES: Gauge = "stampede_guard_l1_bytes", "Bytes of entries in L1 (per process, shared by all routes: no route label).";
    /// Variants of one URL that L1 dropped past its cap
    /// ([`GuardBuilder::l1_max_variants`](crate::guard::GuardBuilder::l1_max_variants)):
    /// the least recently used, to make room for another. One per process, no `route`
    /// label, as [`L1_ENTRIES`].
    L1_VARIANTS_DROPPED: Counter = "stampede_guard_l1_variants_dropped_total", "Variants of one URL dropped from L1 past its cap of variants per URL (per process, shared by all routes: no route label).";
    /// Origin calls the layer avoided, by `reason`: `coalesced` (a caller answered by a
    /// fill already in flight in this process), `remote_fill` (a fill of this process
    /// that waited for another instance's and took its entry), `stale_while_refresh` (a
    /// stale entry served while its refresh ran, here or on another instance). Each is a
    /// caller that, without the guard, would have called the origin at that moment; an
    /// ordinary hit of a fresh entry is none of them (it avoided a call by being cached,
    /// which any cache does): the stampedes the guard stopped, not its hit ratio.
    ORIGIN_CALLS_AVOIDED: Counter = "stampede_guard_origin_calls_avoided_total", "Origin calls avoided by sharing a fill (coalesced), by taking another instance's fill (remote_fill), or by serving stale while one refresh ran (stale_while_refresh); ordinary hits are not counted.";
    /// Calls the layer made to the origin (fills, refreshes and pass-throughs).
    ORIGIN_CALLS: Counter = "stampede_guard_origin_calls_total", "Calls the layer made to the origin.";
    /// Calls to the origin that failed without an answer, by reason (`timeout`, `error`,
    /// `panic`).
    ORIGIN_FAILURES: Counter = "stampede_guard_origin_failures_total", "Calls to the origin that failed without an answer, by reason: timeout, error, panic.";
    /// Refreshes and cold fills at work, out of the guard's refresh budget. One per
    /// process, no `route` label: the budget is shared by every route of the guard (the
    /// refreshes it skipped are counted by route, as [`REFRESHES`] `result="skipped"`).
    BUDGET_IN_USE: Gauge = "stampede_guard_refresh_budget_in_use", "Refreshes and cold fills at work, out of the refresh budget (per process, shared by all routes: no route label).";
    /// Header names a route learned from its responses' `Vary`.
    VARY_LEARNED: Counter = "stampede_guard_vary_learned_total", "Header names routes learned from their responses' Vary.";
    /// The gauge of the breakers' state: how many are open in this process (one per store).
    /// No `route` label: a store's breaker serves every route that uses the store.
    CIRCUIT_OPEN: Gauge = "stampede_guard_redis_circuit_open", "1 while the Redis circuit breaker is open (per process, for all routes: no route label).";
    /// Hits that started the refresh of a fresh entry early (eager refresh, XFetch).
    EARLY_REFRESHES: Counter = "stampede_guard_early_refreshes_total", "Hits that started an early refresh of a fresh entry.";
    /// Tags purged through this process, by how (`hard`, `soft`).
    PURGES: Counter = "stampede_guard_purged_tags_total", "Tags purged through this process, by how.";
    /// Tags whose last purges this process keeps, to check entries against (see
    /// [`GuardBuilder::purge_capacity`](crate::guard::GuardBuilder::purge_capacity)).
    /// One per process, no `route` label.
    PURGE_TAGS: Gauge = "stampede_guard_purge_tags", "Tags whose last purges this process keeps (per process, shared by all routes: no route label).";
    /// Bytes the kept purges take (the table's allocation). One per process, no `route`
    /// label, as [`PURGE_TAGS`].
    PURGE_BYTES: Gauge = "stampede_guard_purge_bytes", "Bytes of the tag purges this process keeps (per process, shared by all routes: no route label).";
    /// Entries found purged (a tag purged after their fill began), by how.
    PURGED_READS: Counter = "stampede_guard_purged_entries_total", "Reads that found an entry purged by a tag, by how.";
    /// Conditional requests answered `304 Not Modified` from an entry.
    NOT_MODIFIED: Counter = "stampede_guard_not_modified_total", "Conditional requests answered 304 from an entry.";
    /// Conditional requests to the origin (refreshes and fills of an entry with a
    /// validator), by result (`not_modified`: renewed with the body it had; `modified`).
    REVALIDATIONS: Counter = "stampede_guard_revalidations_total", "Conditional requests to the origin, by result.";
    /// Ticks of a periodic job ([`crate::leader`]) by operation and result (led, busy,
    /// stopped, with a `reason`, unavailable).
    LEADER_TICKS: Counter = "stampede_guard_leader_ticks_total", "Ticks of periodic jobs by result.";
    /// Notices this process heard from the fleet (its own included), by kind (`notice`:
    /// filled, invalidated, ended, learned, purged, unknown). Fill notices are heard only
    /// while the process waits for a key in their bucket. One per process, no `route`
    /// label.
    NOTICES_HEARD: Counter = "stampede_guard_notices_heard_total", "Notices heard from the fleet, by kind (per process, shared by all routes: no route label).";
    /// Bytes the streams of the fills in flight hold, out of the guard's fill memory
    /// ([`GuardBuilder::fill_memory`](crate::guard::GuardBuilder::fill_memory)). One per
    /// process, no `route` label.
    FILL_BYTES: Gauge = "stampede_guard_fill_bytes", "Bytes the streams of the fills in flight hold, out of the fill memory (per process, shared by all routes: no route label).";
    /// Fill streams of answers that are not stored that did not run their course, by
    /// `result`: `deserted` (nobody read it any more: the fill stopped reading the
    /// origin), `reader_dropped` (a reader held it back for the refresh timeout and was
    /// cut), `too_late` (a caller of the fill came after its stream let go of its start,
    /// and asked the origin itself), `over_memory` (the fill memory was spent: it went
    /// on with a small window, shared no more, and was not stored).
    FILL_STREAMS: Counter = "stampede_guard_fill_streams_total", "Fill streams that did not run their course, by result: deserted, reader_dropped, too_late, over_memory.";
    /// Counter of breaker openings (per process, no `route` label, as [`CIRCUIT_OPEN`]).
    CIRCUIT_OPENED: Counter = "stampede_guard_redis_circuit_opened_total", "Times the Redis circuit breaker opened (per process: no route label).";
}

/// The metrics of the whole process, shared by all of its routes: they never carry a
/// `route` label. Every other metric does, but for the lease metrics of leases used on
/// their own (through a [`LeaseClient`](crate::lease::LeaseClient)), which carry
/// `operation` alone. For dashboards: filter these by `job` and `instance` only.
pub const PER_PROCESS: &[&str] = &[
    L1_ENTRIES,
    L1_BYTES,
    L1_VARIANTS_DROPPED,
    BUDGET_IN_USE,
    FILL_BYTES,
    REDIS_ERRORS,
    CIRCUIT_OPEN,
    CIRCUIT_OPENED,
    PURGES,
    PURGE_TAGS,
    PURGE_BYTES,
    LEADER_TICKS,
    NOTICES_HEARD,
];

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
    RefreshRevalidated => (REFRESHES, "result" => "revalidated"), "A refresh asked the origin whether the entry changed, and it had not (304): renewed with the body it had.";
    EarlyRefresh => (EARLY_REFRESHES), "A hit found its entry due for an early refresh (eager refresh or XFetch) and started it.";
    PurgedHard => (PURGED_READS, "how" => "hard"), "A read found an entry hard-purged by a tag: not served.";
    PurgedSoft => (PURGED_READS, "how" => "soft"), "A read found a fresh entry soft-purged by a tag: served stale, and refreshed.";
    RefreshSkipped => (REFRESHES, "result" => "skipped"), "A refresh was not started: the refresh budget was spent. The stale entry is served.";
    FencedWriteRefused => (FENCED_WRITES_REFUSED), "A write was refused: a newer entry is stored.";
    NotStoredStatus => (NOT_STORED, "reason" => "status"), "An origin response was not stored: its status is not one the route stores (or, following the origin, one it gave no lifetime).";
    NotStoredSetCookie => (NOT_STORED, "reason" => "set_cookie"), "An origin response was not stored: it sets a cookie (its caller's alone).";
    NotStoredPrivate => (NOT_STORED, "reason" => "private"), "An origin response was not stored: `Cache-Control: private` (its caller's alone).";
    NotStoredNoStore => (NOT_STORED, "reason" => "no_store"), "An origin response was not stored: `Cache-Control: no-store` (its caller's alone).";
    NotStoredNoCache => (NOT_STORED, "reason" => "no_cache"), "An origin response was not stored: `Cache-Control: no-cache` on a route that does not follow the origin (its caller's alone).";
    NotStoredVaryStar => (NOT_STORED, "reason" => "vary_star"), "An origin response was not stored: `Vary: *` (its caller's alone).";
    NotStoredVaryUnkeyed => (NOT_STORED, "reason" => "vary_unkeyed"), "An origin response was not stored: it varies on more headers than a URL may learn (its caller's alone).";
    NotStoredTooLarge => (NOT_STORED, "reason" => "too_large"), "An origin response was not stored: its body is larger than the route's `max_body` (its fill's callers still shared it).";
    NotStoredTrailers => (NOT_STORED, "reason" => "trailers"), "An origin response was not stored: its body ended with trailers.";
    NotStoredNoFreshness => (NOT_STORED, "reason" => "no_freshness"), "An origin response was not stored: on a route that follows the origin, it has neither a lifetime nor a validator.";
    NotStoredEventStream => (NOT_STORED, "reason" => "event_stream"), "An origin response was not stored: an event stream (`text/event-stream`), its caller's alone.";
    ColdFill => (COLD_FILLS), "This process filled a cold miss.";
    FillDeserted => (FILL_STREAMS, "result" => "deserted"), "A fill of an answer that is not stored stopped reading the origin: nobody read it, nor waited to.";
    FillReaderDropped => (FILL_STREAMS, "result" => "reader_dropped"), "A reader of a fill's stream held it back for the refresh timeout: its body was cut, and the others read on.";
    FillTooLate => (FILL_STREAMS, "result" => "too_late"), "A caller of a fill came after its stream let go of its start: it asked the origin itself.";
    FillOverMemory => (FILL_STREAMS, "result" => "over_memory"), "A fill's stream could not take its bytes from the fill memory: it went on with a small window for the readers it had, shared no more, and was not stored (a refresh stopped).";
    ColdWaitStarted => (COLD_WAITS_STARTED), "A fill found another instance's lease and began to wait for its entry.";
    Joined => (FILL_JOINS), "A caller joined a fill already in flight in this process, and waits for its result.";
    Coalesced => (COALESCED), "A caller was answered by a fill already in flight in this process (it did not call the origin).";
    ColdWaitNotified => (COLD_WAITS, "result" => "notified"), "A wait for another instance's fill ended with the entry.";
    ColdWaitTimedOut => (COLD_WAITS, "result" => "timed_out"), "A wait for another instance's fill ran out.";
    ColdWaitEnded => (COLD_WAITS, "result" => "ended"), "A wait for another instance's fill ended early: its lease ended without a write.";
    FillOverBudget => (COLD_WAITS, "result" => "over_budget"), "A cold fill found no slot of the refresh budget within the cold wait (it went ahead without one, unless its callers could be answered otherwise).";
    VaryLearned => (VARY_LEARNED), "The route learned a header its responses vary on.";
    StaleIfError => (STALE_IF_ERROR), "A stale entry stood in for a failed origin.";
    RedisError => (REDIS_FALLBACKS), "A Redis operation failed and the route went on without it.";
    LocalOnly => (LOCAL_ONLY), "A fill or refresh went ahead without Redis.";
    OriginCall => (ORIGIN_CALLS), "The layer called the origin.";
    OriginTimeout => (ORIGIN_FAILURES, "reason" => "timeout"), "A call to the origin (a fill, a refresh or a pass-through) did not answer within its timeout (or the watchdog's maximum), and was cut.";
    OriginError => (ORIGIN_FAILURES, "reason" => "error"), "A call to the origin failed without an answer (the inner service's error, or its body failed mid-read).";
    FillPanicked => (ORIGIN_FAILURES, "reason" => "panic"), "A cold fill panicked; its callers were answered, and the fleet backs off.";
    OriginFailed => (REQUESTS, "outcome" => "origin_failed"), "The origin failed and nothing could stand in: the guard's own 502 or 504 (never stored).";
    ExpiredWhileWorking => (EXPIRED_WHILE_WORKING), "A lease was lost (or reached its maximum) while its holder worked.";
    UncertainAcquire => (UNCERTAIN_ACQUIRES), "An acquire timed out; it was treated as not acquired.";
    SoftTimeout => (SOFT_TIMEOUTS), "A fill took longer than the soft timeout; an expired entry was served.";
    NotModified => (NOT_MODIFIED), "A conditional request was answered 304 from an entry (also counted as a hit or a stale answer).";
    AvoidedCoalesced => (ORIGIN_CALLS_AVOIDED, "reason" => "coalesced"), "An origin call avoided: a caller was answered by a fill already in flight in this process (counted with every `Coalesced`).";
    AvoidedRemoteFill => (ORIGIN_CALLS_AVOIDED, "reason" => "remote_fill"), "An origin call avoided: a fill of this process waited for another instance's and took its entry (counted with every `ColdWaitNotified`).";
    AvoidedStale => (ORIGIN_CALLS_AVOIDED, "reason" => "stale_while_refresh"), "An origin call avoided: a stale entry was served while its refresh ran, here or on another instance.";
    Revalidated => (REVALIDATIONS, "result" => "not_modified"), "The origin answered a conditional refresh or fill 304: the entry was renewed with the body it had.";
    RevalidatedModified => (REVALIDATIONS, "result" => "modified"), "The origin answered a conditional refresh or fill with a new response.";
}

/// The events of one route.
pub(crate) struct RouteStats {
    counts: Vec<AtomicU64>,
    /// Fresh hits in L1, each both an [`Event::L1Hit`] and an [`Event::Hit`]: counted
    /// once here (the commonest request costs one atomic count, not two) and added to
    /// both in [`RouteStats::snapshot`].
    fresh_l1_hits: AtomicU64,
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
        // The route's fill-lease series, at 0 from the start (some only a watchdog or a
        // lost lease would otherwise make), so that their panels and alerts have data.
        let fill = |more: &[(&'static str, &'static str)]| {
            lease_labels(Some(route.to_owned().into()), "fill".into(), more)
        };
        let results: [(&str, &[&'static str]); 3] = [
            (
                LEASE_ACQUISITIONS,
                &["acquired", "busy", "timed_out", "unavailable", "written"],
            ),
            (LEASE_RENEWALS, &["renewed", "not_owner", "error"]),
            (
                LEASE_RELEASES,
                &["released", "held_off", "not_owner", "error"],
            ),
        ];
        for (name, results) in results {
            for &result in results {
                counter!(name, fill(&[("result", result)])).increment(0);
            }
        }
        counter!(LEASE_OWNER_MISMATCHES, fill(&[])).increment(0);
        Self {
            counts: Event::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            fresh_l1_hits: AtomicU64::new(0),
            counters,
            refresh_seconds: histogram!(REFRESH_SECONDS, "route" => route.to_owned()),
            cold_wait_seconds: histogram!(COLD_WAIT_SECONDS, "route" => route.to_owned()),
        }
    }

    pub(crate) fn record(&self, event: Event) {
        self.count(event);
        // What also counts as an origin call avoided.
        match event {
            Event::Coalesced => self.count(Event::AvoidedCoalesced),
            Event::ColdWaitNotified => self.count(Event::AvoidedRemoteFill),
            _ => {}
        }
    }

    fn count(&self, event: Event) {
        let i = index(event);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.counters[i].increment(1);
    }

    /// A fresh hit in L1: [`Event::L1Hit`] and [`Event::Hit`] at once.
    pub(crate) fn record_fresh_l1_hit(&self) {
        self.fresh_l1_hits.fetch_add(1, Ordering::Relaxed);
        self.counters[index(Event::L1Hit)].increment(1);
        self.counters[index(Event::Hit)].increment(1);
    }

    pub(crate) fn snapshot(&self) -> Stats {
        let mut counts: Vec<u64> = self
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let fresh_l1_hits = self.fresh_l1_hits.load(Ordering::Relaxed);
        counts[index(Event::L1Hit)] += fresh_l1_hits;
        counts[index(Event::Hit)] += fresh_l1_hits;
        Stats { counts }
    }
}

/// Variants are declared in the order of [`Event::ALL`].
fn index(event: Event) -> usize {
    event as usize
}

/// The labels of a lease metric: `route` for the guard's cache leases (the route whose
/// entry the lease fills), none for a lease used on its own through a
/// [`LeaseClient`](crate::lease::LeaseClient); then `operation`, then `more`.
fn lease_labels(
    route: Option<SharedString>,
    operation: SharedString,
    more: &[(&'static str, &'static str)],
) -> Vec<Label> {
    let mut labels = Vec::with_capacity(2 + more.len());
    if let Some(route) = route {
        labels.push(Label::new("route", route));
    }
    labels.push(Label::new("operation", operation));
    labels.extend(more.iter().map(|&(key, value)| Label::new(key, value)));
    labels
}

/// An acquire ended with `result`, after `took`: counted and timed by operation and, for
/// the guard's leases, route.
pub(crate) fn lease_acquired(
    operation: SharedString,
    route: Option<SharedString>,
    result: &'static str,
    took: Duration,
) {
    let labels = lease_labels(route.clone(), operation.clone(), &[("result", result)]);
    counter!(LEASE_ACQUISITIONS, labels).increment(1);
    histogram!(LEASE_ACQUIRE_SECONDS, lease_labels(route, operation, &[])).record(took);
}

/// A renewal ended with `result` (renewed, not_owner, error), by operation and, for the
/// guard's leases, route.
pub(crate) fn lease_renewed(
    operation: SharedString,
    route: Option<SharedString>,
    result: &'static str,
) {
    if result == "not_owner" {
        let labels = lease_labels(route.clone(), operation.clone(), &[]);
        counter!(LEASE_OWNER_MISMATCHES, labels).increment(1);
    }
    let labels = lease_labels(route, operation, &[("result", result)]);
    counter!(LEASE_RENEWALS, labels).increment(1);
}

/// A lease ended (`result`: released, held_off, not_owner, error): the release and how
/// long it was held, by operation and, for the guard's leases, route (the labels
/// [`LEASE_TTL_SECONDS`] carries too, so that the two compare).
pub(crate) fn lease_released(
    operation: SharedString,
    route: Option<SharedString>,
    held: Duration,
    result: &'static str,
) {
    if result == "not_owner" {
        let labels = lease_labels(route.clone(), operation.clone(), &[]);
        counter!(LEASE_OWNER_MISMATCHES, labels).increment(1);
    }
    let labels = lease_labels(route.clone(), operation.clone(), &[("result", result)]);
    counter!(LEASE_RELEASES, labels).increment(1);
    histogram!(LEASE_HOLD_SECONDS, lease_labels(route, operation, &[])).record(held);
}

/// The TTL a route takes its cache leases with now (labels `route`, `operation="fill"`).
pub(crate) fn route_lease_ttl(route: SharedString, ttl: Duration) {
    metrics::gauge!(LEASE_TTL_SECONDS, "route" => route, "operation" => "fill")
        .set(ttl.as_secs_f64());
}

/// The TTL a lease used on its own was just taken or renewed with (label `operation`).
pub(crate) fn lease_ttl(operation: SharedString, ttl: Duration) {
    metrics::gauge!(LEASE_TTL_SECONDS, "operation" => operation).set(ttl.as_secs_f64());
}

/// A tick of a periodic job.
pub(crate) fn leader_tick(operation: SharedString, result: &'static str) {
    counter!(LEADER_TICKS, "operation" => operation, "result" => result).increment(1);
}

/// A term of a periodic job stopped before its work ended, and why (`max_duration`,
/// `not_owner`, `unconfirmed`).
pub(crate) fn leader_stopped(operation: SharedString, reason: &'static str) {
    counter!(LEADER_TICKS, "operation" => operation, "result" => "stopped", "reason" => reason)
        .increment(1);
}

/// Tags purged through this process, by how (`hard`, `soft`).
pub(crate) fn purged(how: &'static str, tags: usize) {
    counter!(PURGES, "how" => how).increment(tags as u64);
}

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
