//! Purge by tag, hard or soft, for the whole fleet, without an index of keys.
//!
//! An answer's tags are what it names in `Surrogate-Key` (space-separated) and
//! `Cache-Tag` (comma-separated), and the tags its route sets in code
//! ([`PolicyBuilder::tags`](crate::policy::PolicyBuilder::tags)). A purge records, per
//! tag, when it happened, on the Redis server's clock, and tells every instance
//! ([`StampedeGuard::purge_tags`](crate::StampedeGuard::purge_tags)); nothing is deleted
//! and no key is listed. Every read of an entry checks its tags against what the
//! instance heard (one timestamp per tag, as FusionCache and BentoCache do it): an
//! entry whose fill began before a purge of one of its tags is
//!
//! * **hard**-purged: not served at all, not even for a failing origin; the next caller
//!   fills it again, once for the fleet, as a cold miss;
//! * **soft**-purged: stale. Served while one caller in the fleet refreshes it, so
//!   that the origin is called once per key, not once per caller.
//!
//! "Began" is the fencing token of the fill's lease, which Redis issues from the same
//! clock the purge is stamped with; for a fill made without the lease, Redis's time as
//! this process last learned it plus what its monotonic clock counted since
//! ([`FleetClock`](super::clock::FleetClock)), never this machine's wall clock. On a Redis Cluster the entry and the purge records
//! may live on two nodes, whose clocks differ a little: there, a fill that began up to
//! [`MARGIN`] after a purge counts as before it (it is filled once more); clocks further
//! apart than that could let an entry filled just before a purge outlive it. An
//! instance whose subscription was down reads back the purges recorded since the last
//! one it knew of when it comes up again (`purge_records::ReadBack`, in batches); until it has,
//! every entry with a tag filled before then counts as purged soft. What a process
//! keeps is bounded ([`Purges`]).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::cache::Stored;
use crate::http::directives::MAX_KEEP;
use crate::http::response::tags;
use crate::keys::{KeySpace, tag_key};
use crate::notify::Recorded;
use crate::notify::{Owed, Purge};

/// On a Redis Cluster, how long after a purge a fill may have begun and still count as
/// before it: more than the clocks of its nodes differ (one server, or a Sentinel
/// group's primary, stamps both on one clock: no margin there).
pub const MARGIN: std::time::Duration = std::time::Duration::from_millis(20);

/// How far ahead of this machine's clock Redis's may be, for the purges owed while a
/// read-back runs (see [`Purges::owe`]): a fill that began up to this long after the
/// subscription came back still counts as before it (it is refreshed once more).
const CLOCK_ALLOWANCE: Duration = Duration::from_secs(1);

/// The purges one guard heard: per tag, when it was last purged hard and soft, in µs of
/// the Redis server's clock; what was folded out of that to bound it; and what is owed
/// while the purges recorded during a lost subscription are read back.
///
/// Bounded: at most `capacity` tags. Past it, the eighth of them purged longest ago are
/// folded into a *floor*, one pair of times for every tag: an entry that has any tag
/// (its answer's or its route's) and began before the floor's hard time counts as purged
/// hard, before its soft time as purged soft. That is never less than the tags it
/// replaces said (no purged entry is served as unpurged); it is more, for entries of
/// other tags as old as those purges, which are filled (or refreshed) once more. Records
/// older than the longest an entry may be kept hide nothing and are dropped first.
pub(crate) struct Purges {
    /// Whether anything could hide an entry (a tag's purge, a floor, a read-back owed):
    /// until then (most guards, always) reading an entry costs one load here and
    /// nothing more.
    any: AtomicBool,
    state: RwLock<State>,
    /// Whether no read-back is owed, to wait on.
    caught_up: tokio::sync::watch::Sender<bool>,
}

struct State {
    /// Per tag (its id's 128 bits), its last purges: 32 bytes and a control byte each.
    map: HashMap<u128, Marks, BuildHasherDefault<IdHasher>>,
    /// At most this many tags are kept.
    capacity: usize,
    /// The purges folded out of the map (see [`Purges`]).
    floor: Marks,
    /// Every purge recorded up to this time (µs) was heard or read back: where the next
    /// read-back starts. Advanced by notices only while nothing is owed: a notice heard
    /// during a read-back says nothing of the records before it.
    seen: u64,
    /// The newest purge heard or read back since the read-back owed began.
    newest: u64,
    /// A read-back is owed: its episode, and until when (µs) a tagged entry counts as
    /// purged soft meanwhile.
    owed: Option<(u64, u64)>,
    /// Counts the read-backs owed, so that an old one cannot settle a newer one.
    episodes: u64,
}

/// The last hard and soft purge of a tag (0: none), in µs.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Marks {
    hard: u64,
    soft: u64,
}

impl Marks {
    fn set(&mut self, how: Purge, at: u64) {
        let mark = match how {
            Purge::Hard => &mut self.hard,
            Purge::Soft => &mut self.soft,
        };
        *mark = (*mark).max(at);
    }

    fn latest(self) -> u64 {
        self.hard.max(self.soft)
    }

    fn fold(&mut self, other: Self) {
        self.hard = self.hard.max(other.hard);
        self.soft = self.soft.max(other.soft);
    }

    /// What these marks make of an entry that began at `created` (µs).
    fn verdict(self, created: u64, margin: u64) -> Option<Purge> {
        if self.hard > 0 && created < self.hard.saturating_add(margin) {
            Some(Purge::Hard)
        } else if self.soft > 0 && created < self.soft.saturating_add(margin) {
            Some(Purge::Soft)
        } else {
            None
        }
    }
}

/// Tag ids are keyed hashes (HMAC) of the tag: already uniform, and no caller can choose
/// them. Their low 64 bits are as good a hash as any, at no cost.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u128 keys are hashed here; anything else still spreads.
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u128(&mut self, id: u128) {
        self.0 = id as u64;
    }
}

/// The µs of [`MAX_KEEP`]: a purge older than that before the newest hides nothing.
fn keep_micros() -> u64 {
    MAX_KEEP.as_micros() as u64
}

impl Purges {
    /// Purges that keep at most `capacity` tags (at least 8).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            any: AtomicBool::new(false),
            caught_up: tokio::sync::watch::channel(true).0,
            state: RwLock::new(State {
                map: HashMap::default(),
                capacity: capacity.max(8),
                floor: Marks::default(),
                seen: 0,
                newest: 0,
                owed: None,
                episodes: 0,
            }),
        }
    }

    /// Notes a purge of tag `id` at `at` µs, made by this process (heard or not: its
    /// notice, when heard, says the rest).
    pub(crate) fn note(&self, id: &str, how: Purge, at: u64) {
        let Some(id) = tag_key(id) else { return };
        let mut state = self.state.write().expect("purges lock");
        state.note(id, how, at);
        self.settle(&state);
    }

    /// Notes a purge notice: tags `ids` purged at `at` µs. While nothing is owed, every
    /// purge up to `at` is now known.
    pub(crate) fn heard(&self, how: Purge, at: u64, ids: &[&str]) {
        let mut state = self.state.write().expect("purges lock");
        for id in ids {
            if let Some(id) = tag_key(id) {
                state.note(id, how, at);
            }
        }
        state.newest = state.newest.max(at);
        if state.owed.is_none() {
            state.seen = state.seen.max(at);
        }
        self.settle(&state);
    }

    /// The subscription came (back) at `now` µs of this machine's clock: purges
    /// recorded meanwhile were missed. Until they are read back, an entry that has a
    /// tag and began before then (with an allowance for the clocks' difference) counts
    /// as purged soft: stale, refreshed once for the fleet. Returns what to read back.
    pub(crate) fn owe(&self, now: u64) -> Owed {
        let mut state = self.state.write().expect("purges lock");
        state.episodes += 1;
        let until = now.saturating_add(CLOCK_ALLOWANCE.as_micros() as u64);
        let until = state.owed.map_or(until, |(_, before)| before.max(until));
        state.owed = Some((state.episodes, until));
        state.newest = state.seen;
        let since = match state.seen {
            // Never caught up: everything that may still hide an entry.
            0 => now.saturating_sub(keep_micros()),
            // Less the clocks' margin: records stamped by a newer primary whose clock is
            // a little behind the last one's.
            seen => seen.saturating_sub(MARGIN.as_micros() as u64),
        };
        self.settle(&state);
        Owed {
            episode: state.episodes,
            since,
        }
    }

    /// Notes a batch of the records read back.
    pub(crate) fn recorded(&self, records: &[Recorded]) {
        let mut state = self.state.write().expect("purges lock");
        for record in records {
            state.note(record.id, record.how, record.at);
            state.newest = state.newest.max(record.at);
        }
        self.settle(&state);
    }

    /// Every record of read-back `episode` was read: every purge up to the newest heard
    /// or read is known. Nothing, if a newer read-back is owed.
    pub(crate) fn caught_up(&self, episode: u64) {
        let mut state = self.state.write().expect("purges lock");
        if state.owed.is_some_and(|(owed, _)| owed == episode) {
            state.owed = None;
            state.seen = state.seen.max(state.newest);
        }
        self.settle(&state);
    }

    /// Whether every purge recorded is known here: no read-back is owed.
    pub(crate) fn is_caught_up(&self) -> bool {
        self.state.read().expect("purges lock").owed.is_none()
    }

    /// Follows [`is_caught_up`](Self::is_caught_up).
    pub(crate) fn caught_up_changes(&self) -> tokio::sync::watch::Receiver<bool> {
        self.caught_up.subscribe()
    }

    /// How many tags' purges are kept, and about how many bytes they take.
    pub(crate) fn size(&self) -> (usize, usize) {
        let state = self.state.read().expect("purges lock");
        let table = state.map.capacity();
        // hashbrown: a power of two of buckets, 7/8 of them usable, a control byte each.
        let buckets = if table == 0 {
            0
        } else {
            (table * 8).div_ceil(7).next_power_of_two()
        };
        let bucket = std::mem::size_of::<(u128, Marks)>() + 1;
        (state.map.len(), buckets * bucket)
    }

    /// Reports the size to the metrics.
    pub(crate) fn report(&self) {
        let (tags, bytes) = self.size();
        metrics::gauge!(crate::metrics::PURGE_TAGS).set(tags as f64);
        metrics::gauge!(crate::metrics::PURGE_BYTES).set(bytes as f64);
    }

    /// Whether anything could hide an entry, for the fast path.
    fn settle(&self, state: &State) {
        let any = !state.map.is_empty() || state.floor != Marks::default() || state.owed.is_some();
        self.any.store(any, Ordering::Release);
        self.caught_up.send_if_modified(|caught_up| {
            let now = state.owed.is_none();
            std::mem::replace(caught_up, now) != now
        });
    }

    /// Whether `stored` was purged: hard if any of its tags was purged hard after its
    /// fill began, else soft if any was purged soft. `route_tags`: the tags its route
    /// sets in code.
    #[inline]
    pub(crate) fn verdict(
        &self,
        keys: &KeySpace,
        route_tags: &[u128],
        stored: &Stored,
        margin: std::time::Duration,
    ) -> Option<Purge> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        self.verdict_of_tags(keys, route_tags, stored, margin)
    }

    /// [`Purges::verdict`], once something could hide an entry.
    fn verdict_of_tags(
        &self,
        keys: &KeySpace,
        route_tags: &[u128],
        stored: &Stored,
        margin: std::time::Duration,
    ) -> Option<Purge> {
        let own = stored.tag_ids.get_or_init(|| {
            tags(&stored.headers())
                .filter_map(|t| tag_key(&keys.tag_id(t)))
                .collect()
        });
        if own.is_empty() && route_tags.is_empty() {
            return None;
        }
        let margin = margin.as_micros() as u64;
        let created = stored.created();
        let state = self.state.read().expect("purges lock");
        // The floor and an owed read-back reach every entry that has a tag.
        let mut verdict = state.floor.verdict(created, margin);
        if verdict == Some(Purge::Hard) {
            return verdict;
        }
        if let Some((_, until)) = state.owed
            && created < until
        {
            verdict = Some(Purge::Soft);
        }
        for &id in own.iter().chain(route_tags) {
            let Some(marks) = state.map.get(&id) else {
                continue;
            };
            match marks.verdict(created, margin) {
                Some(Purge::Hard) => return Some(Purge::Hard),
                Some(Purge::Soft) => verdict = Some(Purge::Soft),
                None => {}
            }
        }
        verdict
    }
}

impl State {
    fn note(&mut self, id: u128, how: Purge, at: u64) {
        if let Some(marks) = self.map.get_mut(&id) {
            marks.set(how, at);
            return;
        }
        // Purged no later than what was folded: the floor says as much already.
        let covered = match how {
            Purge::Hard => self.floor.hard >= at,
            Purge::Soft => self.floor.latest() >= at,
        };
        if covered {
            return;
        }
        // Now and then (when the map has grown to a power of two), what hides nothing
        // goes; at the capacity, the oldest are folded.
        let len = self.map.len();
        if len >= self.capacity || (len >= 1024 && len.is_power_of_two()) {
            self.make_room(at);
        }
        self.map.entry(id).or_default().set(how, at);
    }

    /// Drops what hides nothing (purges older than any entry may be, before `now`),
    /// then folds the oldest eighth of the tags into the floor.
    fn make_room(&mut self, now: u64) {
        let horizon = now.saturating_sub(keep_micros());
        self.map.retain(|_, marks| marks.latest() >= horizon);
        if self.floor.latest() < horizon {
            self.floor = Marks::default();
        }
        if self.map.len() < self.capacity {
            return;
        }
        let fold = self.map.len() - (self.capacity - self.capacity / 8);
        let mut times: Vec<u64> = self.map.values().map(|m| m.latest()).collect();
        let (_, &mut cut, _) = times.select_nth_unstable(fold - 1);
        let floor = &mut self.floor;
        self.map.retain(|_, marks| {
            let old = marks.latest() <= cut;
            if old {
                floor.fold(*marks);
            }
            !old
        });
    }
}

/// This machine's time in µs since 1970 (for tests; the guard's stamps come from its
/// [`FleetClock`](super::clock::FleetClock)).
#[cfg(test)]
pub(crate) fn local_micros() -> u64 {
    super::clock::this_machines_micros()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::cache::entry::CachedResponse;
    use crate::lease::FencingToken;

    fn keys() -> KeySpace {
        KeySpace::builder()
            .env("test")
            .service("purge")
            .secret(b"a secret of more than sixteen bytes".to_vec())
            .build()
            .unwrap()
    }

    fn stored(tags: &[(&'static str, &str)], created: u64) -> Stored {
        let mut headers = http::HeaderMap::new();
        for (name, value) in tags {
            headers.append(*name, value.parse().unwrap());
        }
        Stored::aged(
            CachedResponse {
                status: http::StatusCode::OK,
                headers,
                body: bytes::Bytes::new(),
                fresh_for: Duration::from_secs(1),
                grace: Duration::ZERO,
                keep: Duration::from_secs(1),
                token: FencingToken::new(created),
            },
            Duration::ZERO,
        )
    }

    #[test]
    fn both_headers_name_tags() {
        let s = stored(
            &[
                ("surrogate-key", "a  b"),
                ("surrogate-key", "c"),
                ("cache-tag", "d, e,,"),
            ],
            1,
        );
        let headers = s.headers();
        let all: Vec<&str> = tags(&headers).collect();
        assert_eq!(all, ["a", "b", "c", "d", "e"]);
    }

    #[test]
    fn a_purge_reaches_entries_filled_before_it_and_hard_wins() {
        let keys = keys();
        let purges = Purges::new(64);
        let at = 10_000_000;
        let old = stored(&[("surrogate-key", "p1 p2")], at - 1);
        let new = stored(
            &[("surrogate-key", "p1 p2")],
            at + MARGIN.as_micros() as u64,
        );
        let other = stored(&[("surrogate-key", "p3")], at - 1);
        assert_eq!(purges.verdict(&keys, &[], &old, MARGIN), None);
        purges.note(&keys.tag_id("p1"), Purge::Soft, at);
        assert_eq!(purges.verdict(&keys, &[], &old, MARGIN), Some(Purge::Soft));
        assert_eq!(purges.verdict(&keys, &[], &new, MARGIN), None);
        assert_eq!(purges.verdict(&keys, &[], &other, MARGIN), None);
        purges.note(&keys.tag_id("p2"), Purge::Hard, at);
        assert_eq!(purges.verdict(&keys, &[], &old, MARGIN), Some(Purge::Hard));
        // Within the margin after the purge: counted as before it.
        let close = stored(&[("cache-tag", "p2")], at + 10_000);
        assert_eq!(
            purges.verdict(&keys, &[], &close, MARGIN),
            Some(Purge::Hard)
        );
        // A route's own tags reach every entry of the route.
        let untagged = stored(&[], at - 1);
        assert_eq!(purges.verdict(&keys, &[], &untagged, MARGIN), None);
        assert_eq!(
            purges.verdict(
                &keys,
                &[tag_key(&keys.tag_id("p1")).unwrap()],
                &untagged,
                MARGIN
            ),
            Some(Purge::Soft)
        );
    }

    #[test]
    fn records_read_back_are_noted_and_settle_what_is_owed() {
        let keys = keys();
        let purges = Purges::new(64);
        let id = tag_key(&keys.tag_id("p")).unwrap();
        let s = stored(&[("surrogate-key", "p")], 400);
        let untagged = stored(&[], 400);
        // Owed: every entry with a tag, filled before the subscription came (and the
        // clocks' allowance), is stale meanwhile.
        let owed = purges.owe(1_000);
        assert_eq!(owed.since, 0, "never caught up: the last three days");
        assert_eq!(purges.verdict(&keys, &[], &s, MARGIN), Some(Purge::Soft));
        assert_eq!(purges.verdict(&keys, &[], &untagged, MARGIN), None);
        let later = stored(&[("surrogate-key", "p")], 1_000 + 1_000_001);
        assert_eq!(purges.verdict(&keys, &[], &later, MARGIN), None);
        purges.recorded(&[Recorded {
            id,
            how: Purge::Hard,
            at: 500,
        }]);
        assert_eq!(purges.verdict(&keys, &[], &s, MARGIN), Some(Purge::Hard));
        // An older read-back settles nothing.
        purges.caught_up(owed.episode - 1);
        assert!(!purges.is_caught_up());
        purges.caught_up(owed.episode);
        assert!(purges.is_caught_up());
        let s = stored(&[("surrogate-key", "other")], 400);
        assert_eq!(purges.verdict(&keys, &[], &s, MARGIN), None);
        // The next read-back starts at the newest purge read, less the margin.
        assert_eq!(purges.owe(2_000).since, 0);
        purges.caught_up(2);
        purges.heard(Purge::Soft, 90_000, &[&keys.tag_id("q")]);
        assert_eq!(purges.owe(100_000).since, 90_000 - 20_000);
        // Notices heard while a read-back is owed count only once it is done.
        purges.heard(Purge::Soft, 95_000, &[&keys.tag_id("q")]);
        let owed = purges.owe(100_000);
        assert_eq!(owed.since, 70_000);
        purges.heard(Purge::Soft, 96_000, &[&keys.tag_id("q")]);
        purges.caught_up(owed.episode);
        let owed = purges.owe(100_000);
        assert_eq!(owed.since, 76_000);
        purges.caught_up(owed.episode);
        // A purge this process made says nothing of others it missed.
        purges.note(&keys.tag_id("r"), Purge::Hard, 99_000);
        assert_eq!(purges.owe(100_000).since, 76_000);
    }

    /// Past its capacity, the oldest eighth is folded into the floor: every entry with
    /// a tag filled before the newest of them counts as purged, hard where one of them
    /// was, and none of the purged ones is served as unpurged.
    #[test]
    fn the_capacity_holds_and_the_floor_keeps_every_purge() {
        let keys = keys();
        let purges = Purges::new(16);
        let base = 10_000_000;
        // 16 tags, purged at base+1..=base+16; tag 3 hard, the rest soft.
        for i in 1..=16u64 {
            let how = if i == 3 { Purge::Hard } else { Purge::Soft };
            purges.note(&keys.tag_id(&format!("t{i}")), how, base + i);
        }
        assert_eq!(purges.size().0, 16);
        // The 17th folds the oldest two (16 - 14) into the floor.
        purges.note(&keys.tag_id("t17"), Purge::Soft, base + 17);
        assert_eq!(purges.size().0, 15);
        for i in 0..1000u64 {
            purges.note(&keys.tag_id(&format!("n{i}")), Purge::Soft, base + 100 + i);
            assert!(purges.size().0 <= 16);
        }
        let (tags, bytes) = purges.size();
        assert!(tags <= 16 && bytes <= 32 * 33, "{tags} tags, {bytes} bytes");
        // Every tag purged, folded or not, still reaches entries filled before it.
        for i in 1..=17u64 {
            let entry = stored(&[("surrogate-key", &format!("t{i}"))], base + i - 1);
            let verdict = purges.verdict(&keys, &[], &entry, Duration::ZERO);
            assert!(verdict.is_some(), "t{i}");
            if i == 3 {
                assert_eq!(verdict, Some(Purge::Hard), "t3 was purged hard");
            }
        }
        // The floor: hard up to t3's purge for every entry with a tag.
        let other = stored(&[("cache-tag", "never-purged")], base + 2);
        assert_eq!(
            purges.verdict(&keys, &[], &other, Duration::ZERO),
            Some(Purge::Hard)
        );
        let untagged = stored(&[], base);
        assert_eq!(purges.verdict(&keys, &[], &untagged, Duration::ZERO), None);
        // Filled after every purge: untouched.
        let new = stored(&[("cache-tag", "t1 never-purged")], base + 10_000);
        assert_eq!(purges.verdict(&keys, &[], &new, Duration::ZERO), None);
        // A purge no later than the floor adds nothing to the map.
        let before = purges.size().0;
        purges.note(&keys.tag_id("old"), Purge::Soft, base + 1);
        assert_eq!(purges.size().0, before);
    }

    /// Purges older than the longest an entry is kept hide nothing: they go before any
    /// is folded, and a floor that old is dropped.
    #[test]
    fn purges_older_than_any_entry_are_dropped_not_folded() {
        let keys = keys();
        let purges = Purges::new(8);
        for i in 0..8u64 {
            purges.note(&keys.tag_id(&format!("old{i}")), Purge::Hard, 1 + i);
        }
        let now = keep_micros() + 1_000;
        purges.note(&keys.tag_id("new"), Purge::Soft, now);
        assert_eq!(purges.size().0, 1);
        let entry = stored(&[("cache-tag", "other")], now - 1);
        assert_eq!(purges.verdict(&keys, &[], &entry, Duration::ZERO), None);
    }
}
