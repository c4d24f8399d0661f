//! The memory of the fills in flight: how many bytes the streams of every fill of one
//! guard (cold fills and refreshes, over all its routes) may hold together.
//!
//! Each fill's stream takes from it what it holds as its body comes, and gives back
//! what it lets go of (and all it took, once nobody holds the stream any more). A
//! stream that cannot take the bytes of its next frame goes on with a small window
//! ([`OVER_WINDOW`]) for the readers it has, shares no more (the callers that come start
//! a fill of their own), and is not stored; a refresh stops. What every fill holds
//! together is thus at most the limit, plus a small window for each fill past it.
//!
//! Counted in [`FILL_BYTES`](crate::metrics::FILL_BYTES) (the bytes held now) and
//! [`FILL_STREAMS`](crate::metrics::FILL_STREAMS) `result="over_memory"` (the fills
//! turned away).

use std::sync::atomic::{AtomicU64, Ordering};

/// The window of a stream past the memory of fills: 64 KiB beyond its slowest reader.
pub(crate) const OVER_WINDOW: u64 = 64 * 1024;

/// The bytes the streams of a guard's fills hold, and how many they may.
#[derive(Debug)]
pub(crate) struct FillMemory {
    limit: u64,
    held: AtomicU64,
}

impl FillMemory {
    pub(crate) fn new(limit: u64) -> Self {
        // Exported from the start, at what this memory holds: nothing.
        metrics::gauge!(crate::metrics::FILL_BYTES).increment(0.0);
        Self {
            limit,
            held: AtomicU64::new(0),
        }
    }

    /// Takes `bytes`, if they fit under the limit with what is held.
    pub(crate) fn take(&self, bytes: u64) -> bool {
        let taken = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|after| *after <= self.limit)
            })
            .is_ok();
        if taken {
            metrics::gauge!(crate::metrics::FILL_BYTES).increment(bytes as f64);
        }
        taken
    }

    /// Gives back `bytes` taken.
    pub(crate) fn give(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
        metrics::gauge!(crate::metrics::FILL_BYTES).decrement(bytes as f64);
    }

    /// The bytes held now.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_taken_up_to_the_limit_and_given_back() {
        let memory = FillMemory::new(100);
        assert!(memory.take(60));
        assert!(!memory.take(41), "past the limit");
        assert!(memory.take(40));
        assert_eq!(memory.held(), 100);
        memory.give(70);
        assert!(memory.take(70));
        assert!(!memory.take(1));
        memory.give(100);
        assert_eq!(memory.held(), 0);
    }
}
