//! The fleet's clock as this process knows it: the Redis server's time, learned from
//! each stamp Redis issues it (a lease's fencing token, a purge's time, an
//! invalidation's token), plus what this machine's monotonic clock counted since.
//!
//! Every stamp that is compared with a purge comes from it: a fill made without the
//! lease is stamped on the clock purges are, whatever this machine's wall clock says
//! (ahead of Redis's, a hard purge made after such a fill would miss it; behind, every
//! such fill made after a purge would count as purged). Before Redis issued this
//! process any stamp (or without Redis), it is this machine's wall clock.

use std::sync::Mutex;
use std::time::Instant;

/// Redis's time as last learned, and when that was on this machine's monotonic clock.
#[derive(Debug, Default)]
pub(crate) struct FleetClock {
    learned: Mutex<Option<(u64, Instant)>>,
}

impl FleetClock {
    /// Learns that Redis's clock read `micros` (µs since 1970) just now.
    pub(crate) fn learn(&self, micros: u64) {
        let mut learned = self
            .learned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *learned = Some((micros, Instant::now()));
    }

    /// The fleet's time now, in µs since 1970 (see the [module docs](self)).
    pub(crate) fn now_micros(&self) -> u64 {
        let learned = *self
            .learned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match learned {
            Some((micros, at)) => micros.saturating_add(at.elapsed().as_micros() as u64),
            None => this_machines_micros(),
        }
    }
}

/// This machine's wall clock, in µs since 1970 (skewed in tests: [`skew`]).
pub(crate) fn this_machines_micros() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    now.saturating_add_signed(SKEW.load(std::sync::atomic::Ordering::Relaxed))
}

/// What tests add to this machine's clock, in µs (feature `fuzzing`: see
/// `crate::fuzzing::skew_this_machines_clock`).
static SKEW: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// Sets how far ahead (positive) or behind this machine's clock reads, for tests.
#[cfg(feature = "fuzzing")]
pub fn skew(micros: i64) {
    SKEW.store(micros, std::sync::atomic::Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_time_once_learned_goes_on_with_the_monotonic_clock() {
        let clock = FleetClock::default();
        let wall = this_machines_micros();
        assert!(clock.now_micros().abs_diff(wall) < 1_000_000);
        // Redis an hour behind this machine.
        let redis = wall - 3_600_000_000;
        clock.learn(redis);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let now = clock.now_micros();
        assert!(
            now >= redis + 20_000 && now < redis + 1_000_000,
            "{now} vs {redis}"
        );
    }
}
