//! Refreshing before expiry, so that a hot key is refreshed before any caller sees it
//! stale (opt-in per route, [`PolicyBuilder::eager_refresh`] and
//! [`PolicyBuilder::xfetch`]).
//!
//! A hit on an entry that is due answers from the entry as any hit does, and starts its
//! refresh in the background, the same refresh a stale entry gets: one per key per
//! process, within the guard's refresh budget, under the key's lease, so that the fleet
//! still calls the origin once per key. Two rules say when an entry is due:
//!
//! * **a fraction of its fresh time** (FusionCache's eager refresh): from
//!   `fraction × fresh time` on;
//! * **XFetch** (Vattani, Chierichetti and Lowenstein, "Optimal Probabilistic Cache
//!   Stampede Prevention", VLDB 2015): on each hit with probability rising toward its
//!   expiry, when `age + δ·β·(−ln U) ≥ fresh time`, with `U` uniform in (0, 1], `δ` how
//!   long the route's refreshes take the origin (measured) and `β` the route's
//!   setting (1 is the paper's optimum; above 1 refreshes earlier).
//!
//! [`PolicyBuilder::eager_refresh`]: crate::policy::PolicyBuilder::eager_refresh
//! [`PolicyBuilder::xfetch`]: crate::policy::PolicyBuilder::xfetch

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::policy::Early;

/// Whether a fresh entry `age` old is due for its early refresh. Costs one comparison
/// on a route that does not refresh early.
pub(crate) fn due(
    early: &Early,
    recompute: &Recompute,
    fresh_for: Duration,
    age: Duration,
) -> bool {
    if early.is_off() {
        return false;
    }
    if let Some(fraction) = early.fraction
        && age.as_secs_f64() >= fresh_for.as_secs_f64() * fraction
    {
        return true;
    }
    if let Some(beta) = early.beta {
        let delta = recompute.get().as_secs_f64();
        // In (0, 1]: ln of it is finite.
        let u = 1.0 - fastrand::f64();
        return (delta * beta).mul_add(-u.ln(), age.as_secs_f64()) >= fresh_for.as_secs_f64();
    }
    false
}

/// How long the route's origin takes to answer a refresh or a fill (XFetch's δ): a
/// moving average of the calls made under a lease, or without one.
#[derive(Debug, Default)]
pub(crate) struct Recompute {
    /// Microseconds; zero until the first call.
    micros: AtomicU64,
}

impl Recompute {
    pub(crate) fn get(&self) -> Duration {
        Duration::from_micros(self.micros.load(Ordering::Relaxed))
    }

    /// Takes in one more call's time: an exponentially weighted average, a quarter for
    /// the newest (races between two updates lose one sample, which is harmless).
    pub(crate) fn record(&self, took: Duration) {
        let took = took.as_micros().min(u64::MAX as u128) as u64;
        let old = self.micros.load(Ordering::Relaxed);
        let new = if old == 0 {
            took
        } else {
            old - old / 4 + took / 4
        };
        self.micros.store(new, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recompute_time_is_a_moving_average() {
        let recompute = Recompute::default();
        assert_eq!(recompute.get(), Duration::ZERO);
        recompute.record(Duration::from_millis(400));
        assert_eq!(recompute.get(), Duration::from_millis(400));
        recompute.record(Duration::from_millis(0));
        assert_eq!(recompute.get(), Duration::from_millis(300));
        for _ in 0..100 {
            recompute.record(Duration::from_millis(100));
        }
        let settled = recompute.get().as_millis();
        assert!((99..=101).contains(&settled), "{settled}");
    }
}
