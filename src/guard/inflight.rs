//! What is in flight in this process: the cold fills, one per key, and how every one of
//! their endings reaches the callers that waited for them; and the refreshes, one per
//! key, or a key left alone while another instance holds its lease.
//!
//! # Cold fills
//! The map holds a receiver per key in flight. The fill's task holds the [`Lead`]; when
//! it ends, normally or not, the `Lead` is dropped, which removes the key from the map
//! and, if no outcome was sent, closes the channel: the waiters then wake with nothing
//! (the fill was cancelled) instead of hanging.
//!
//! The outcome every waiter gets is a [`Landed`]: the same type whatever service the
//! waiter reached the key through, so callers of one layer on services of different
//! types share one fill of a key (what is shared is an entry, or an answer whose body
//! streams, one copy for all), and nothing is downcast. What only the caller that led may have (an answer
//! private to it, a body streamed through, the inner service's error, all typed by its
//! service) goes to that caller alone, on a channel of its own ([`Own`]).
//!
//! Every way a fill ends, and what the caller that led it and every other waiter get,
//! is the table "Every way a fill ends" in the [guard's docs](super).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use http::{Request, Response};
use http_body::Body;
use tokio::sync::{oneshot, watch};

use super::body::ResponseBody;
use super::stream::Stream;
use crate::cache::Stored;
use crate::keys::LocalKey;
use crate::lease::FencingToken;
use crate::metrics::Event;
use crate::notify::Interest;

/// What a fill came to, for every caller that waited for it (see the
/// [module docs](self) for each ending).
pub(crate) enum Landed {
    /// An entry for the key: stored by this fill (`kept`), or one that landed meanwhile;
    /// or, not kept, the fill's own answer after its write was refused. `variant_of`:
    /// when its key is not its callers' (the answer varies on a header their key did
    /// not include), the request the origin saw; only callers whose headers match it on
    /// those headers may have it.
    Entry {
        stored: Arc<Stored>,
        kept: bool,
        variant_of: Option<Arc<Request<()>>>,
    },
    /// An answer that every waiter whose headers match the request the origin saw (on
    /// what it varies on) may be given, as its body streams: one that may not be stored
    /// (`failure` when it is a 5xx), or, while its body is still coming, one that may be.
    Shared {
        response: Arc<SharedAnswer>,
        failure: bool,
        origin_saw: Arc<Request<()>>,
    },
    /// The caller that led has an answer of its own ([`Own`]), which no other may have;
    /// the others ask the origin themselves. Also what another instance's notice that the
    /// key's answers may not be stored comes to.
    Pass,
    /// The origin failed without an answer to share: an entry that may stand in, or the
    /// guard's own answer. The caller that led may have the inner service's error, or the
    /// answer as far as it came ([`Own`]).
    Failed(Failure),
    /// The origin is left alone for now, and the callers need not wait: an entry that may
    /// stand in, or the route's `503`.
    StoodAside,
    /// The key's names changed meanwhile (a `Vary` header was learned): look again.
    Rekey,
}

/// An answer of the origin that the callers of its fill share: its head, and its body
/// as far as it came (see [`stream`](super::stream)).
pub(crate) struct SharedAnswer {
    pub(crate) status: http::StatusCode,
    pub(crate) headers: http::HeaderMap,
    pub(crate) body: Arc<Stream>,
    /// Whether the fill stores it if its body comes whole within the route's limit
    /// (said `miss`), or it is not stored whatever comes (said `pass`).
    pub(crate) storing: bool,
    /// Only for the caller that led (a `no-cache` answer the route stores, to be
    /// revalidated on every use): every other caller asks the origin itself.
    pub(crate) leader_only: bool,
}

impl SharedAnswer {
    /// What a caller given it counts: a miss while it may be stored, else a pass.
    pub(crate) fn event(&self) -> Event {
        if self.storing {
            Event::Miss
        } else {
            Event::Pass
        }
    }
}

/// How the origin failed, when its callers have no answer of its to share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The inner service's error, or its body failed mid-read: `502`.
    Error,
    /// No answer within the refresh timeout (or the watchdog's maximum): `504`.
    Timeout,
    /// The watchdog found the lease someone else's while the origin was called (the
    /// call was stopped; the new holder fills): `504`.
    LeaseLost,
    /// The fill panicked: `502`.
    Panicked,
    /// The fill's task was cancelled (its runtime went away): `503`.
    Cancelled,
}

impl Failure {
    /// The status of the guard's own answer.
    pub(crate) fn status(self) -> http::StatusCode {
        match self {
            Self::Error | Self::Panicked => http::StatusCode::BAD_GATEWAY,
            Self::Timeout | Self::LeaseLost => http::StatusCode::GATEWAY_TIMEOUT,
            Self::Cancelled => http::StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// What only the caller that led a fill may have: its answer (private to it, or
/// streamed through), or the inner service's error.
pub(crate) type Own<B, E> = Result<Response<ResponseBody<B>>, E>;

type Slot = watch::Receiver<Option<Arc<Landed>>>;

/// The cold fills in flight in one route, one per key.
#[derive(Default)]
pub(crate) struct Flights {
    /// Each flight, with the last invalidation of its key known here when it began, and
    /// how many of its callers have yet to be answered.
    map: Mutex<HashMap<Arc<str>, (Slot, Option<FencingToken>, Arc<AtomicUsize>)>>,
}

/// A caller's place in the flight of a key.
pub(crate) enum Joined<B: Body, E> {
    /// It started the flight: the fill's task is its to spawn, with the [`Lead`] and the
    /// sender of its own answer.
    Lead(
        Lead,
        Waiting,
        oneshot::Sender<Own<B, E>>,
        oneshot::Receiver<Own<B, E>>,
    ),
    /// It waits for the flight another caller started.
    Follow(Waiting),
}

/// A wait for the outcome of a flight, counted by the flight until it is dropped: a
/// caller keeps it until it has made what it answers with (the reader of a stream the
/// fill shares, whose start is kept for it meanwhile: see `stream`).
pub(crate) struct Waiting(
    Slot,
    // Never read: kept for its drop, which counts the caller answered.
    #[allow(dead_code)] Counted,
);

/// One of a flight's callers that has yet to be answered.
struct Counted(Arc<AtomicUsize>);

impl Counted {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(count.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The right, and the duty, to run the fill of a key.
pub(crate) struct Lead {
    tx: watch::Sender<Option<Arc<Landed>>>,
    key: Arc<str>,
    flights: Arc<Flights>,
    /// How many of its callers have yet to be answered.
    waiting: Arc<AtomicUsize>,
}

impl Flights {
    /// Joins the flight of `key`, or starts it.
    ///
    /// `invalidated`: the last invalidation of the key known here now. A flight that
    /// began before it is not joined (its answer may be what was invalidated: a caller
    /// that comes after `invalidate` returned must read what was written since): the
    /// caller starts a flight of its own in its place, for the callers that come after
    /// it, while the old one ends for those that joined it.
    pub(crate) fn join<B: Body, E>(
        self: &Arc<Self>,
        key: &Arc<str>,
        invalidated: Option<FencingToken>,
    ) -> Joined<B, E> {
        let mut map = self
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((slot, began_after, waiting)) = map.get(key)
            && *began_after == invalidated
        {
            return Joined::Follow(Waiting(slot.clone(), Counted::new(waiting)));
        }
        let (tx, rx) = watch::channel(None);
        let waiting = Arc::new(AtomicUsize::new(0));
        map.insert(key.clone(), (rx.clone(), invalidated, waiting.clone()));
        let counted = Counted::new(&waiting);
        let lead = Lead {
            tx,
            key: key.clone(),
            flights: self.clone(),
            waiting,
        };
        let (own_tx, own_rx) = oneshot::channel();
        Joined::Lead(lead, Waiting(rx, counted), own_tx, own_rx)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.lock().unwrap().len()
    }
}

impl Lead {
    /// Gives every waiter the fill's outcome.
    pub(crate) fn finish(self, landed: Landed) {
        self.tx.send_replace(Some(Arc::new(landed)));
    }

    /// Gives every waiter, and every caller that joins from now on, an answer whose
    /// body is still coming ([`Landed::Shared`]): the fill goes on, and ends with
    /// [`finish`](Self::finish) (a waiter that looks only then gets what it ended with).
    pub(crate) fn publish(&self, landed: Landed) {
        self.tx.send_replace(Some(Arc::new(landed)));
    }
}

impl Lead {
    /// How many of the flight's callers have yet to be answered (each until it made
    /// what it answers with).
    pub(crate) fn waiting(&self) -> Arc<AtomicUsize> {
        self.waiting.clone()
    }

    /// Lets the callers that come from now on start a flight of their own (they find
    /// the entry the fill stored, or fill again), while those that joined still get
    /// this one's outcome: the fill has stored what it will, and ends.
    pub(crate) fn retire(&self) {
        self.remove();
    }

    fn remove(&self) {
        let mut map = self
            .flights
            .map
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if map
            .get(&self.key)
            .is_some_and(|(slot, _, _)| slot.same_channel(&self.tx.subscribe()))
        {
            map.remove(&self.key);
        }
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        self.remove();
    }
}

impl Waiting {
    /// The outcome; [`Failure::Cancelled`] when the fill ended without one. The caller
    /// stays counted until it drops this wait.
    pub(crate) async fn landed(&mut self) -> Arc<Landed> {
        match self.0.wait_for(Option::is_some).await {
            Ok(landed) => match &*landed {
                Some(landed) => landed.clone(),
                None => Arc::new(Landed::Failed(Failure::Cancelled)),
            },
            Err(_) => Arc::new(Landed::Failed(Failure::Cancelled)),
        }
    }
}

/// The refresh state of a key in this process.
pub(crate) enum Refresh {
    Running,
    /// Running, and another instance's fill notice came meanwhile.
    RunningFilled,
    /// Until `until`, do not try: the lease is someone else's (`elsewhere`: another
    /// instance refreshes), or the last refresh failed. Meanwhile the process listens
    /// to the key's bucket for the holder's fill notice (when it could): the interest
    /// is given back with the state, when the notice lifts the hold-off, the key is
    /// refreshed again, or the hold-off is swept once it ended.
    HeldOff {
        until: std::time::Instant,
        // Never read: kept for its drop, which gives the bucket back.
        #[allow(dead_code)]
        listening: Option<Interest>,
        elsewhere: bool,
    },
}

/// The refresh state of the keys of one guard.
pub(crate) type RefreshMap = HashMap<LocalKey, Refresh>;

/// Forgets the hold-offs that ended (and gives back the buckets they listened to).
pub(crate) fn sweep_held_off(refreshing: &Mutex<RefreshMap>) {
    let now = std::time::Instant::now();
    refreshing
        .lock()
        .expect("refreshing lock")
        .retain(|_, state| !matches!(state, Refresh::HeldOff { until, .. } if *until <= now));
}

/// Another instance wrote the entry at `key`: a refresh held off for it may go ahead
/// (and will adopt the new entry); one that runs notes it, so that a hold-off it ends
/// with is moot.
pub(crate) fn filled_elsewhere(refreshing: &Mutex<RefreshMap>, key: LocalKey) {
    let mut refreshing = refreshing.lock().expect("refreshing lock");
    match refreshing.get_mut(&key) {
        Some(Refresh::HeldOff { .. }) => {
            refreshing.remove(&key);
        }
        Some(state @ Refresh::Running) => *state = Refresh::RunningFilled,
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Joined = super::Joined<http_body_util::Empty<bytes::Bytes>, ()>;

    #[tokio::test]
    async fn followers_get_the_leaders_outcome_and_the_flight_ends() {
        let flights = Arc::new(Flights::default());
        let key: Arc<str> = Arc::from("k");
        let Joined::Lead(lead, mut leader, _, _) = flights.join(&key, None) else {
            panic!("the first is the leader");
        };
        let Joined::Follow(mut follower) = flights.join(&key, None) else {
            panic!("the second follows");
        };
        let follower = tokio::spawn(async move { follower.landed().await });
        lead.finish(Landed::Pass);
        assert!(matches!(*follower.await.unwrap(), Landed::Pass));
        assert!(matches!(*leader.landed().await, Landed::Pass));
        assert_eq!(flights.len(), 0);
        // A new flight can start.
        assert!(matches!(flights.join(&key, None), Joined::Lead(..)));
    }

    /// A caller that knows of an invalidation the flight began before starts a flight of
    /// its own, which the callers after it join; the old flight ends for its own.
    #[tokio::test]
    async fn a_flight_that_began_before_an_invalidation_is_not_joined() {
        let flights = Arc::new(Flights::default());
        let key: Arc<str> = Arc::from("k");
        let Joined::Lead(old, mut old_waiting, _, _) = flights.join(&key, None) else {
            panic!("the first is the leader");
        };
        let invalidated = Some(FencingToken::new(7));
        let Joined::Lead(new, _, _, _) = flights.join(&key, invalidated) else {
            panic!("a caller after the invalidation leads a flight of its own");
        };
        assert!(matches!(flights.join(&key, invalidated), Joined::Follow(_)));
        // The old flight ends without taking the new one out of the map.
        old.finish(Landed::Pass);
        assert!(matches!(*old_waiting.landed().await, Landed::Pass));
        assert!(matches!(flights.join(&key, invalidated), Joined::Follow(_)));
        new.finish(Landed::Pass);
        assert_eq!(flights.len(), 0);
    }

    #[tokio::test]
    async fn a_lead_dropped_without_outcome_wakes_waiters_with_cancelled() {
        let flights = Arc::new(Flights::default());
        let key: Arc<str> = Arc::from("k");
        let Joined::Lead(lead, _, _, _) = flights.join(&key, None) else {
            panic!("the first is the leader");
        };
        let Joined::Follow(mut waiting) = flights.join(&key, None) else {
            panic!("the second follows");
        };
        let waiter = tokio::spawn(async move { waiting.landed().await });
        // As when the fill's task is aborted.
        drop(lead);
        assert!(matches!(
            *waiter.await.unwrap(),
            Landed::Failed(Failure::Cancelled)
        ));
        assert_eq!(flights.len(), 0);
    }

    /// Each caller of a flight is counted until it drops its wait (after it made what it
    /// answers with), whether it led or followed, and whatever the fill came to.
    #[tokio::test]
    async fn a_flight_counts_its_callers_until_each_is_answered() {
        let flights = Arc::new(Flights::default());
        let key: Arc<str> = Arc::from("k");
        let Joined::Lead(lead, mut leader, _, _) = flights.join(&key, None) else {
            panic!("the first is the leader");
        };
        let waiting = lead.waiting();
        let Joined::Follow(follower) = flights.join(&key, None) else {
            panic!("the second follows");
        };
        assert_eq!(waiting.load(Ordering::Acquire), 2);
        lead.publish(Landed::Pass);
        assert!(matches!(*leader.landed().await, Landed::Pass));
        assert_eq!(
            waiting.load(Ordering::Acquire),
            2,
            "until its wait is dropped"
        );
        drop(leader);
        drop(follower);
        assert_eq!(waiting.load(Ordering::Acquire), 0);
        let Joined::Follow(late) = flights.join(&key, None) else {
            panic!("joins the flight still open");
        };
        assert_eq!(waiting.load(Ordering::Acquire), 1);
        drop(late);
        lead.finish(Landed::Pass);
        assert_eq!(waiting.load(Ordering::Acquire), 0);
    }
}
