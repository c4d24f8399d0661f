//! What moka's invalidation closures cost the reads after them: L1 used one
//! (`invalidate_entries_if`) for every invalidation of a response with variants, and
//! now lists variants instead (`src/cache/listed.rs`). A million entries in moka's
//! synchronous cache, configured as L1 was (a weigher, per-entry expiry, invalidation
//! closures, an eviction listener); reads of random entries before any predicate, then
//! while `P` predicates are registered (as `P` invalidations would leave them, until
//! moka's housekeeping has scanned every entry, a few hundred a round). L1 now removes
//! the listed keys one by one: no predicate, and reads cost the baseline.
//!
//! ```text
//! cargo bench --bench moka_predicates
//! ```
//!
//! Baseline: the same reads, in the same run, before the predicates. (Each run of reads
//! starts its sequence again: the reads with predicates re-read keys the baseline
//! warmed, which flatters them. Moka's housekeeping, which reads run, is counted in.)

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use moka::sync::Cache;

#[path = "support/moka.rs"]
mod support;
use support::{Hour, Key, key};

const ENTRIES: u64 = 1_000_000;
const READS: u64 = 200_000;

/// Nanoseconds per read of `count` entries spread over the cache.
fn reads(cache: &Cache<Key, Arc<u64>>, count: u64) -> f64 {
    let started = Instant::now();
    let mut n: u64 = 1;
    for _ in 0..count {
        // A cheap spread over every entry.
        n = n.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        black_box(cache.get(&key((n >> 16) % ENTRIES, 1)));
    }
    started.elapsed().as_nanos() as f64 / count as f64
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let cache: Cache<Key, Arc<u64>> = Cache::builder()
        .max_capacity(u64::MAX / 4)
        .weigher(|_: &Key, _: &Arc<u64>| 100)
        .expire_after(Hour)
        .support_invalidation_closures()
        .eviction_listener(|_, _, _| {})
        .build();
    for n in 0..ENTRIES {
        cache.insert(key(n, 1), Arc::new(n));
    }
    cache.run_pending_tasks();
    println!("moka's synchronous cache as L1 configured it, {ENTRIES} entries:");
    let baseline = reads(&cache, READS);
    println!("  no predicate: {baseline:>9.0} ns a read (baseline)");
    let mut registered = 0u64;
    for predicates in [10u64, 100, 1_000] {
        // Invalidations of responses that are not in the cache: the predicates match
        // nothing, and stay until moka's scan has been through every entry.
        while registered < predicates {
            let response = u128::from(registered) + 1;
            cache
                .invalidate_entries_if(move |key, _| key.response == response)
                .unwrap();
            registered += 1;
        }
        let each = reads(&cache, READS / 10);
        println!(
            "  {predicates:>5} predicates: {each:>9.0} ns a read, {:.1}x the baseline",
            each / baseline
        );
    }
}
