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

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// A slot of the budget; given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    /// Taken out when the slot drops, so that the slot is back before `given_back` rings.
    permit: Option<OwnedSemaphorePermit>,
    given_back: Arc<Notify>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        drop(self.permit.take());
        metrics::gauge!(crate::metrics::BUDGET_IN_USE).decrement(1.0);
        self.given_back.notify_waiters();
    }
}

pub(crate) struct Budget {
    slots: Arc<Semaphore>,
    /// The number of slots (all free when nothing is at work).
    size: usize,
    /// Rung each time a slot comes back, for [`Budget::idle_within`].
    given_back: Arc<Notify>,
}

impl Budget {
    pub(crate) fn new(size: usize) -> Self {
        // Exported from the start, at the slots this budget has given out: none.
        metrics::gauge!(crate::metrics::BUDGET_IN_USE).increment(0.0);
        Self {
            slots: Arc::new(Semaphore::new(size)),
            size,
            given_back: Arc::new(Notify::new()),
        }
    }

    /// Waits at most `within` for every slot to be back; returns whether they all are.
    /// Takes none itself: refreshes and fills starting meanwhile get theirs as usual.
    pub(crate) async fn idle_within(&self, within: Duration) -> bool {
        let all_back = async {
            loop {
                // Registered before the check, so that a slot given back in between still
                // wakes this wait.
                let given_back = self.given_back.notified();
                tokio::pin!(given_back);
                given_back.as_mut().enable();
                if self.slots.available_permits() >= self.size {
                    return;
                }
                given_back.await;
            }
        };
        tokio::time::timeout(within, all_back).await.is_ok()
    }

    /// A slot if one is free now.
    pub(crate) fn try_take(&self) -> Option<Slot> {
        let permit = self.slots.clone().try_acquire_owned().ok()?;
        Some(self.taken(permit))
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
        Some(self.taken(permit))
    }

    fn taken(&self, permit: OwnedSemaphorePermit) -> Slot {
        metrics::gauge!(crate::metrics::BUDGET_IN_USE).increment(1.0);
        Slot {
            permit: Some(permit),
            given_back: self.given_back.clone(),
        }
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

    #[tokio::test]
    async fn idle_once_every_slot_is_back() {
        let budget = Arc::new(Budget::new(2));
        assert!(budget.idle_within(Duration::ZERO).await, "nothing at work");
        let a = budget.try_take().unwrap();
        let b = budget.try_take().unwrap();
        assert!(!budget.idle_within(Duration::from_millis(20)).await);
        drop(a);
        assert!(
            !budget.idle_within(Duration::from_millis(20)).await,
            "one still out"
        );
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.idle_within(Duration::from_secs(30)).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        drop(b);
        assert!(waiting.await.unwrap(), "woken by the last slot coming back");
        // The wait took no slot.
        assert!(budget.try_take().is_some());
    }
}
