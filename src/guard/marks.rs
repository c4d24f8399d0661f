//! What the fleet said about a key whose last fill wrote nothing, for a short while.
//!
//! * **Pass** (Varnish's hit-for-pass): the origin's answer may not be stored (too
//!   large, a status that is not cached; or, said by another instance, any reason).
//!   Until the mark ends, callers of the key skip the caches and the lease; those that
//!   come at once share one call of their process, if its answer may be shared.
//! * **Private**: this process's last fill of the key got an answer for its caller
//!   alone (`private`, `Set-Cookie`, `no-store`, ...). Until the mark ends, callers go
//!   straight to the origin instead of queueing behind a leader whose answer they could
//!   not have anyway.
//! * **Back-off**: the origin failed. Until the mark ends, a caller that has an entry it
//!   may serve on error (stale-if-error) gets it at once, instead of waiting for a fill
//!   that the fleet is not going to try.
//!
//! A mark is set by the instance whose fill ended so, and by every other instance when
//! its notice arrives (see `notify`). Marks are bounded in number and end by themselves;
//! a fill of the key clears them where its notice is heard (in the instances that wait
//! for the key), and elsewhere they run out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::sync::Cache;

/// What a mark says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mark {
    Pass,
    Private,
    BackOff,
}

/// What a key's mark says a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Says {
    /// Nothing: it looks in L2, and fills or waits for a fill.
    Look,
    /// Its last answer could not be stored: nothing in the caches to look for, but the
    /// callers that come while one asks the origin share its answer, if it may be shared
    /// (else each asks the origin itself).
    Passing,
    /// Its last answer here was its caller's alone: no fill to wait for.
    Pass,
    /// The origin just failed for it, and the request has an entry that may stand in:
    /// that entry, at once.
    StandIn,
}

/// What `mark` says a request does; `stands_in`: whether it has an entry that may
/// stand in for a failed origin (asked only of a key the fleet backs off from).
pub(crate) fn says(mark: Option<Mark>, stands_in: impl FnOnce() -> bool) -> Says {
    match mark {
        Some(Mark::Pass) => Says::Passing,
        Some(Mark::Private) => Says::Pass,
        Some(Mark::BackOff) if stands_in() => Says::StandIn,
        // Backing off, with nothing to stand in: its fill decides (see `cold`).
        Some(Mark::BackOff) | None => Says::Look,
    }
}

/// The marks of one guard.
pub(crate) struct Marks {
    map: Cache<Arc<str>, (Mark, Instant)>,
}

/// The longest a mark can last, whatever a route or a notice asks.
const LONGEST: Duration = Duration::from_secs(3600);

impl Default for Marks {
    fn default() -> Self {
        Self {
            // Weighed as L1 entries are (key, value and moka's bookkeeping, about 550
            // bytes a mark): at most 8 MiB of them, the least used going first.
            map: Cache::builder()
                .max_capacity(8 * 1024 * 1024)
                .weigher(|key: &Arc<str>, _: &(Mark, Instant)| {
                    u32::try_from(key.len() + 16 + 24 + 400).unwrap_or(u32::MAX)
                })
                .time_to_live(LONGEST)
                .build(),
        }
    }
}

impl Marks {
    /// The key's mark, if one is live.
    pub(crate) fn get(&self, key: &str) -> Option<Mark> {
        let (mark, until) = self.map.get(key)?;
        (Instant::now() < until).then_some(mark)
    }

    /// Marks `key` for `lasting` (nothing for zero).
    pub(crate) fn set(&self, key: &str, mark: Mark, lasting: Duration) {
        if lasting.is_zero() {
            return;
        }
        let until = Instant::now() + lasting.min(LONGEST);
        self.map.insert(key.into(), (mark, until));
    }

    /// An entry was stored for `key`: whatever was said about its last fill is moot.
    pub(crate) fn clear(&self, key: &str) {
        // Most keys have no mark: a look is cheaper than an invalidation.
        if self.map.contains_key(key) {
            self.map.invalidate(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_each_mark_says() {
        let never = || -> bool { panic!("asked only of a key the fleet backs off from") };
        assert_eq!(says(None, never), Says::Look);
        assert_eq!(says(Some(Mark::Pass), never), Says::Passing);
        assert_eq!(says(Some(Mark::Private), never), Says::Pass);
        assert_eq!(says(Some(Mark::BackOff), || true), Says::StandIn);
        assert_eq!(says(Some(Mark::BackOff), || false), Says::Look);
    }

    #[test]
    fn marks_end_by_themselves_and_can_be_cleared() {
        let marks = Marks::default();
        marks.set("a", Mark::Pass, Duration::from_millis(50));
        marks.set("b", Mark::BackOff, Duration::from_secs(60));
        marks.set("c", Mark::Pass, Duration::ZERO);
        assert_eq!(marks.get("a"), Some(Mark::Pass));
        assert_eq!(marks.get("b"), Some(Mark::BackOff));
        assert_eq!(marks.get("c"), None);
        std::thread::sleep(Duration::from_millis(80));
        assert_eq!(marks.get("a"), None);
        marks.clear("b");
        assert_eq!(marks.get("b"), None);
    }
}
