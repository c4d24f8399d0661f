//! The refresh budget: how many refreshes and cold fills of one guard may be at work at
//! once (each calls the origin at most once).
//!
//! Without it, 10,000 keys going stale together mean 10,000 origin calls at once. A
//! refresh that finds the budget spent is skipped (and counted): its key keeps being
//! served stale, and the next caller after a slot frees starts it. A cold fill, which has
//! nothing to serve meanwhile, waits for a slot, at most the route's cold wait; then its
//! callers get an entry that may stand in if they have one, a 503 on a route that
//! rejects, or else the fill goes ahead without a slot (still one call for all of
//! them). Nothing queues without bound.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A slot of the budget; given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    _permit: OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        metrics::gauge!(crate::metrics::BUDGET_IN_USE).decrement(1.0);
    }
}

pub(crate) struct Budget {
    slots: Arc<Semaphore>,
}

impl Budget {
    pub(crate) fn new(size: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(size)),
        }
    }

    /// A slot if one is free now.
    pub(crate) fn try_take(&self) -> Option<Slot> {
        let permit = self.slots.clone().try_acquire_owned().ok()?;
        Some(Self::taken(permit))
    }

    /// A slot, waiting at most `wait` for one.
    pub(crate) async fn take_within(&self, wait: Duration) -> Option<Slot> {
        if let Some(slot) = self.try_take() {
            return Some(slot);
        }
        let permit = tokio::time::timeout(wait, self.slots.clone().acquire_owned())
            .await
            .ok()?
            .ok()?;
        Some(Self::taken(permit))
    }

    fn taken(permit: OwnedSemaphorePermit) -> Slot {
        metrics::gauge!(crate::metrics::BUDGET_IN_USE).increment(1.0);
        Slot { _permit: permit }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slots_are_bounded_and_given_back() {
        let budget = Budget::new(2);
        let a = budget.try_take().unwrap();
        let _b = budget.try_take().unwrap();
        assert!(budget.try_take().is_none());
        assert!(
            budget
                .take_within(Duration::from_millis(20))
                .await
                .is_none()
        );
        drop(a);
        assert!(budget.try_take().is_some());
    }
}
