//! The local single-flight of cold fills: one fill task per key per process, whose
//! outcome every caller for that key awaits.
//!
//! The map holds a receiver per key in flight. The fill task holds the [`Lead`]; when it
//! ends, normally or by panic, the `Lead` is dropped, which removes the key from the map
//! and, if no outcome was sent, closes the channel: waiters then wake with nothing
//! instead of hanging.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// A fill's outcome, typed by the service that made it (see `fill::FillOutcome`).
pub(crate) type Outcome = Arc<dyn Any + Send + Sync>;

pub(crate) type Slot = watch::Receiver<Option<Outcome>>;

#[derive(Default)]
pub(crate) struct Flights {
    map: Mutex<HashMap<Arc<str>, Slot>>,
}

/// The right, and the duty, to run the fill of a key.
pub(crate) struct Lead {
    tx: watch::Sender<Option<Outcome>>,
    key: Arc<str>,
    flights: Arc<Flights>,
}

impl Flights {
    /// Joins the flight of `key`: a receiver of its outcome, and the lead if there was
    /// no flight yet.
    pub(crate) fn join(self: &Arc<Self>, key: &Arc<str>) -> (Slot, Option<Lead>) {
        let mut map = self.map.lock().expect("flights lock");
        if let Some(slot) = map.get(key) {
            return (slot.clone(), None);
        }
        let (tx, rx) = watch::channel(None);
        map.insert(key.clone(), rx.clone());
        let lead = Lead {
            tx,
            key: key.clone(),
            flights: self.clone(),
        };
        (rx, Some(lead))
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }
}

impl Lead {
    pub(crate) fn finish(self, outcome: Outcome) {
        self.tx.send_replace(Some(outcome));
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        let mut map = self.flights.map.lock().expect("flights lock");
        if map
            .get(&self.key)
            .is_some_and(|slot| slot.same_channel(&self.tx.subscribe()))
        {
            map.remove(&self.key);
        }
    }
}

/// Waits for the outcome; `None` when the fill ended without one.
pub(crate) async fn wait(mut slot: Slot) -> Option<Outcome> {
    match slot.wait_for(Option::is_some).await {
        Ok(outcome) => outcome.clone(),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn followers_get_the_leaders_outcome_and_the_flight_ends() {
        let flights = Arc::new(Flights::default());
        let key: Arc<str> = Arc::from("k");
        let (leader_slot, lead) = flights.join(&key);
        let lead = lead.expect("first is the leader");
        let (follower_slot, none) = flights.join(&key);
        assert!(none.is_none());
        let follower = tokio::spawn(wait(follower_slot));
        lead.finish(Arc::new(7u32));
        let got = follower.await.unwrap().unwrap();
        assert_eq!(got.downcast_ref::<u32>(), Some(&7));
        assert!(wait(leader_slot).await.is_some());
        assert_eq!(flights.len(), 0);
        // A new flight can start.
        assert!(flights.join(&key).1.is_some());
    }

    #[tokio::test]
    async fn a_lead_dropped_without_outcome_wakes_waiters_with_nothing() {
        let flights = Arc::new(Flights::default());
        let key: Arc<str> = Arc::from("k");
        let (_, lead) = flights.join(&key);
        let (slot, _) = flights.join(&key);
        let waiter = tokio::spawn(wait(slot));
        // As when the fill task panics.
        let task = tokio::spawn(async move {
            let _lead = lead;
            panic!("origin panicked");
        });
        assert!(task.await.is_err());
        assert!(waiter.await.unwrap().is_none());
        assert_eq!(flights.len(), 0);
    }
}
