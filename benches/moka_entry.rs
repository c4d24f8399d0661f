//! What moka itself keeps for each entry, measured as the process's resident memory:
//! a million entries put in moka's synchronous cache, configured as L1 configures it
//! (a weigher, per-entry expiry, an eviction listener; invalidation closures until
//! L1 listed its variants instead, see `src/cache/listed.rs`), with a
//! key of L1's size (32 bytes) and a value of 8 bytes behind an `Arc`; and again with
//! fewer of those features, to see what each costs. What is left after the key and the
//! value is moka's bookkeeping: the floor of what an L1 entry can weigh.
//!
//! ```text
//! cargo bench --bench moka_entry
//! ```
//!
//! Each configuration runs in a process of its own (the bench starts itself again),
//! so that one's freed memory does not hide the next one's.

use std::sync::Arc;

use moka::sync::Cache;

#[path = "support/moka.rs"]
mod support;
use support::{Hour, Key, key};

const ENTRIES: u64 = 1_000_000;

/// The process's resident memory, in bytes.
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// Bytes per entry with `features` (any of `e`xpiry, `i`nvalidation closures,
/// eviction `l`istener), the key and the value included.
fn per_entry(features: &str) -> u64 {
    let before = resident();
    let mut builder = Cache::builder()
        .max_capacity(u64::MAX / 4)
        .weigher(|_: &Key, _: &Arc<u64>| 100);
    if features.contains('e') {
        builder = builder.expire_after(Hour);
    }
    if features.contains('i') {
        builder = builder.support_invalidation_closures();
    }
    if features.contains('l') {
        builder = builder.eviction_listener(|_, _, _| {});
    }
    let cache: Cache<Key, Arc<u64>> = builder.build();
    for n in 0..ENTRIES {
        cache.insert(key(n, 0), Arc::new(n));
    }
    cache.run_pending_tasks();
    assert_eq!(cache.entry_count(), ENTRIES);
    (resident() - before) / ENTRIES
}

fn main() {
    if let Some(features) = std::env::args().nth(1).filter(|a| !a.starts_with('-')) {
        println!("{}", per_entry(&features));
        return;
    }
    // The key in its `Arc` (moka keeps one: 32 bytes and two counts, 48 allocated) and
    // the value's `Arc` (8 bytes and two counts, 32 allocated).
    let key_and_value = 48 + 32;
    println!("moka's synchronous cache, {ENTRIES} entries, resident bytes per entry:");
    for (features, what) in [
        ("", "a weigher only"),
        ("e", "and per-entry expiry"),
        ("el", "and an eviction listener (as L1)"),
        ("eil", "and invalidation closures (as L1 had)"),
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .arg(if features.is_empty() { "w" } else { features })
            .output()
            .unwrap();
        let bytes: u64 = String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        println!(
            "  {what:<38} {bytes:>5} ({} beyond the key and the value)",
            bytes - key_and_value
        );
    }
}
