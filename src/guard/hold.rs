//! Lease TTLs from measured hold times (opt-in per route,
//! [`PolicyBuilder::adaptive_lease_ttl`](crate::policy::PolicyBuilder::adaptive_lease_ttl)).
//!
//! A lease's TTL must outlast the work done under it, or a second holder starts while
//! the first still works (fencing keeps that safe, but the origin is called twice). Set
//! by hand, it is a guess; here it follows what the route's fills and refreshes really
//! hold their leases for: the 99th percentile of the last [`WINDOW`] holds, times a
//! safety factor, between a floor and a ceiling. The floor is never below what the
//! policy's own checks require (the refresh timeout without a watchdog, and several
//! Redis command timeouts), so that no refresh is cut short by its own lease.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::policy::Adaptive;

/// How many of the latest holds the percentile is taken over.
pub(crate) const WINDOW: usize = 256;

/// A route's lease TTL: fixed, or following its hold times.
#[derive(Debug)]
pub(crate) struct LeaseTtl {
    /// The TTL now, in ms (what every acquire of the route asks for).
    current_ms: AtomicU64,
    adaptive: Option<(Adaptive, Mutex<Holds>)>,
}

/// The latest holds, in a ring.
#[derive(Debug, Default)]
struct Holds {
    ring: Vec<Duration>,
    next: usize,
}

impl LeaseTtl {
    /// Starts at `configured` (the policy's lease TTL, kept until holds are measured);
    /// `adaptive` makes it follow them, from `floor` on.
    pub(crate) fn new(configured: Duration, adaptive: Option<Adaptive>) -> Self {
        Self {
            current_ms: AtomicU64::new(configured.as_millis() as u64),
            adaptive: adaptive.map(|a| (a, Mutex::default())),
        }
    }

    /// The TTL to acquire with now.
    pub(crate) fn get(&self) -> Duration {
        Duration::from_millis(self.current_ms.load(Ordering::Relaxed))
    }

    /// Takes in one more hold; returns the new TTL if it changed.
    pub(crate) fn record(&self, held: Duration) -> Option<Duration> {
        let (adaptive, holds) = self.adaptive.as_ref()?;
        let p99 = {
            let mut holds = holds.lock().expect("holds lock");
            if holds.ring.len() < WINDOW {
                holds.ring.push(held);
            } else {
                let at = holds.next;
                holds.ring[at] = held;
            }
            holds.next = (holds.next + 1) % WINDOW;
            percentile(&holds.ring, 0.99)
        };
        let ttl = p99
            .mul_f64(adaptive.factor)
            .clamp(adaptive.floor, adaptive.ceiling);
        // Whole milliseconds, as every lease TTL is.
        let ms = ttl.as_millis() as u64;
        (self.current_ms.swap(ms, Ordering::Relaxed) != ms).then(|| Duration::from_millis(ms))
    }
}

/// The `p` percentile (nearest rank) of `values`.
fn percentile(values: &[Duration], p: f64) -> Duration {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let rank = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn a_fixed_ttl_stays() {
        let ttl = LeaseTtl::new(MS(5000), None);
        assert_eq!(ttl.record(MS(9000)), None);
        assert_eq!(ttl.get(), MS(5000));
    }

    #[test]
    fn the_ttl_follows_the_p99_of_holds_within_its_bounds() {
        let adaptive = Adaptive {
            factor: 3.0,
            floor: MS(1000),
            ceiling: MS(5000),
        };
        let ttl = LeaseTtl::new(MS(4000), Some(adaptive));
        for _ in 0..WINDOW {
            ttl.record(MS(50));
        }
        // 3 × 50 ms is below the floor.
        assert_eq!(ttl.get(), MS(1000));
        for _ in 0..WINDOW {
            ttl.record(MS(400));
        }
        assert_eq!(ttl.get(), MS(1200));
        // One slow hold in a hundred sets the p99.
        for i in 0..WINDOW {
            ttl.record(if i % 50 == 0 { MS(1500) } else { MS(400) });
        }
        assert_eq!(ttl.get(), MS(4500));
        // The ceiling.
        ttl.record(MS(60_000));
        ttl.record(MS(60_000));
        ttl.record(MS(60_000));
        assert_eq!(ttl.get(), MS(5000));
    }
}
