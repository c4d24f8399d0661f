//! What every route of one guard shares: Redis, the key space, the leases, L1, the
//! marks, purges and refreshes of this process, and what the guard makes of the fleet's
//! notices ([`Hears`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::budget::Budget;
use super::fill_memory::FillMemory;
use super::inflight::{RefreshMap, filled_elsewhere, sweep_held_off};
use super::marks::{Mark, Marks};
use super::purge::Purges;
use super::vary::Learned;
use crate::cache::{L1, Tombstones};
use crate::keys::{KeySpace, LocalKey};
use crate::lease::{FencingToken, LeaseClient};
use crate::notify::Recorded;
use crate::notify::{Ending, Hears, Notices, Owed, Purge};
use crate::store::RedisStore;

/// What every route of one guard shares.
pub(crate) struct Shared {
    /// Redis, behind its deadlines and breaker.
    pub(crate) store: RedisStore,
    /// Builds every key (identities hashed with the key space's secret).
    pub(crate) keys: KeySpace,
    /// Takes the fills' and refreshes' leases.
    pub(crate) leases: LeaseClient,
    /// The local tier.
    pub(crate) l1: L1,
    /// Tokens of recent invalidations, per response: what L1 refuses entries older than.
    pub(crate) tombstones: Tombstones,
    /// The fleet's notices: the subscription, and the callers waiting on it.
    pub(crate) notices: Notices,
    /// Keys whose last fill wrote nothing: pass them through, or serve stale at once.
    pub(crate) marks: Marks,
    /// The tag purges heard: what every read checks an entry's tags against.
    pub(crate) purges: Purges,
    /// Redis's clock as learned: what every stamp compared with a purge comes from.
    pub(crate) clock: super::clock::FleetClock,
    /// Bounds the refreshes and cold fills at work at once.
    pub(crate) budget: Budget,
    /// Bounds the bytes their streams hold together.
    pub(crate) fill_memory: Arc<FillMemory>,
    /// The routes made from this guard, by name (a name is refused twice: its metrics
    /// and keys would merge), with the headers each has learned to vary on.
    pub(crate) routes: Mutex<HashMap<String, Arc<Learned>>>,
    /// Keys with a refresh running in this process, or held off because another
    /// instance holds the lease.
    pub(crate) refreshing: Mutex<RefreshMap>,
    /// Counts the times the notice subscription came up. Entries put in L1 in an earlier
    /// epoch may have missed an invalidation sent while it was down: they are not served
    /// as fresh (stale instead, and refreshed).
    pub(crate) epoch: AtomicU64,
}

impl Shared {
    /// What the URLs of route `route` have learned to vary on (for notices from other
    /// instances).
    pub(crate) fn learned(&self, route: &str) -> Option<Arc<Learned>> {
        self.routes.lock().expect("routes lock").get(route).cloned()
    }

    /// Starts the notice subscription on first use, and again if it ended (see
    /// [`Notices::ensure_listening`]).
    pub(crate) fn ensure_listening(self: &Arc<Self>) {
        // The weak handle is made only when the listener starts: every request comes
        // here, and bumping a shared count on each would be a write to one cache line
        // from every core.
        self.notices.ensure_listening(&self.store, || {
            Arc::downgrade(self) as std::sync::Weak<dyn Hears>
        });
    }

    /// Reports L1's size to the metrics.
    pub(crate) fn report_l1(&self) {
        metrics::gauge!(crate::metrics::L1_ENTRIES).set(self.l1.entry_count() as f64);
        metrics::gauge!(crate::metrics::L1_BYTES).set(self.l1.weighted_size() as f64);
        metrics::counter!(crate::metrics::L1_VARIANTS_DROPPED).absolute(self.l1.variants_dropped());
    }
}

/// What the guard makes of the fleet's notices.
impl Hears for Shared {
    /// Without a local key (from a version that sent none), a refresh held off for the
    /// entry waits out its hold-off instead of going ahead at once.
    ///
    /// Heard only while this process listens to the key's bucket: while it waits for
    /// the key (a cold wait, a refresh held off), and for a second after. A mark of a
    /// key it does not wait for is not cleared: it runs out by itself. Marks are set
    /// fleet-wide by one notice with one duration and end together, so a fill elsewhere
    /// comes from an instance whose mark ended about when this one's does; listening
    /// for every marked key instead would have every instance subscribe on every pass
    /// or error notice, the fan-out the interest channels avoid.
    fn filled(&self, key: &str, local: Option<LocalKey>) {
        self.marks.clear(key);
        if let Some(local) = local {
            filled_elsewhere(&self.refreshing, local);
        }
    }

    /// The response and every variant of it that L1 holds go (whether the sender's
    /// route had learned its `Vary` says nothing of this process's L1). Without a local
    /// key (from a version that sent none), which entry it was is unknown, and all of
    /// L1 goes: L2 holds the tombstone, and the rest is read from there again.
    fn invalidated(&self, local: Option<LocalKey>, token: FencingToken) {
        match local {
            Some(local) => {
                crate::cache::bury(&self.tombstones, local.response, token, None);
                self.l1.invalidate_response(local.response);
            }
            None => self.l1.invalidate_all(),
        }
    }

    fn ended(&self, key: &str, ending: Ending, lasting: Duration) {
        match ending {
            // (Not over this process's own `Private`: the notice it hears may be its
            // own fill's, which knew more.)
            Ending::Pass if self.marks.get(key) == Some(Mark::Private) => {}
            Ending::Pass => self.marks.set(key, Mark::Pass, lasting),
            Ending::Error => self.marks.set(key, Mark::BackOff, lasting),
            Ending::Gone => {}
        }
    }

    fn purged(&self, how: Purge, at: u64, ids: &[&str]) {
        self.purges.heard(how, at, ids);
    }

    fn purges_recorded(&self, records: &[Recorded]) {
        self.purges.recorded(records);
    }

    fn purges_caught_up(&self, episode: u64) {
        self.purges.caught_up(episode);
        self.purges.report();
    }

    fn learned(&self, route: &str, response: u128, names: &[&str]) {
        if let Some(learned) = Shared::learned(self, route) {
            let names: Vec<http::HeaderName> = names
                .iter()
                .filter_map(|n| http::HeaderName::from_bytes(n.as_bytes()).ok())
                .collect();
            let _ = learned.learn(response, &names);
        }
    }

    /// Invalidations sent while the subscription was down (or before it first was) did
    /// not reach this process: what L1 holds may be invalidated. A new epoch makes those
    /// entries stale: served while a refresh reads Redis again. Purges sent meanwhile
    /// are owed until they are read back: entries with tags filled before now are
    /// stale until then (see [`Purges::owe`](super::purge::Purges::owe)).
    fn subscribed(&self) -> Owed {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.purges.owe(self.clock.now_micros())
    }

    /// A second's tick is as good a time as any to report L1 and the purges kept, and
    /// to forget the hold-offs that ended: each listens to its key's bucket until then.
    fn tick(&self) {
        self.report_l1();
        self.purges.report();
        sweep_held_off(&self.refreshing);
    }
}
