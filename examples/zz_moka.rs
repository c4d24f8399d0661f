use moka::sync::Cache;
use std::sync::Arc;
use std::time::Duration;
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    s.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
}
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct K {
    a: u128,
    b: u64,
}
struct Exp;
impl moka::Expiry<K, Arc<u64>> for Exp {
    fn expire_after_create(&self, _: &K, _: &Arc<u64>, _: std::time::Instant) -> Option<Duration> {
        Some(Duration::from_secs(3600))
    }
}
fn main() {
    let mode = std::env::args().nth(1).unwrap();
    let n = 1_000_000u64;
    let before = rss();
    let mut b = Cache::builder()
        .max_capacity(u64::MAX / 4)
        .weigher(|_: &K, _: &Arc<u64>| 100u32);
    if mode.contains('e') {
        b = b.expire_after(Exp);
    }
    if mode.contains('i') {
        b = b.support_invalidation_closures();
    }
    if mode.contains('l') {
        b = b.eviction_listener(|_, _, _| {});
    }
    let c: Cache<K, Arc<u64>> = b.build();
    for i in 0..n {
        c.insert(
            K {
                a: i as u128 * 0x9e3779b97f4a7c15,
                b: 0,
            },
            Arc::new(i),
        );
    }
    c.run_pending_tasks();
    let after = rss();
    println!(
        "{mode}: {} entries, {} bytes per entry (value Arc<u64> = 32 B alloc incl.)",
        c.entry_count(),
        (after - before) / n
    );
}
