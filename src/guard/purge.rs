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
//! clock the purge is stamped with. On a Redis Cluster the entry and the purge records
//! may live on two nodes, whose clocks differ a little: there, a fill that began up to
//! [`MARGIN`] after a purge counts as before it (it is filled once more); clocks further
//! apart than that could let an entry filled just before a purge outlive it. An
//! instance whose subscription was down reads the purges back from Redis when it comes
//! up again.

use std::collections::HashMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};

use http::HeaderMap;

use crate::cache::Stored;
use crate::keys::KeySpace;
use crate::notify::Purge;

/// On a Redis Cluster, how long after a purge a fill may have begun and still count as
/// before it: more than the clocks of its nodes differ (one server, or a Sentinel
/// group's primary, stamps both on one clock: no margin there).
pub const MARGIN: std::time::Duration = std::time::Duration::from_millis(20);

/// The purges one guard heard: per tag id, when it was last purged hard and soft, in µs
/// of the Redis server's clock.
#[derive(Default)]
pub(crate) struct Purges {
    /// Whether any purge was heard: until then (most guards, always) reading an entry
    /// costs one load here and nothing more.
    any: AtomicBool,
    map: RwLock<HashMap<String, Marks>>,
}

#[derive(Debug, Default, Clone, Copy)]
struct Marks {
    hard: u64,
    soft: u64,
}

impl Purges {
    /// Notes a purge of tag `id` at `at` µs.
    pub(crate) fn note(&self, id: &str, how: Purge, at: u64) {
        let mut map = self.map.write().expect("purges lock");
        // Purges older than any entry may be hide nothing: dropped now and then (when
        // the map has grown to a power of two), so that the map does not grow forever.
        if map.len() >= 1024 && map.len().is_power_of_two() {
            let horizon = at.saturating_sub(crate::http::directives::MAX_KEEP.as_micros() as u64);
            map.retain(|_, marks| marks.hard.max(marks.soft) >= horizon);
        }
        let marks = map.entry(id.to_owned()).or_default();
        let mark = match how {
            Purge::Hard => &mut marks.hard,
            Purge::Soft => &mut marks.soft,
        };
        *mark = (*mark).max(at);
        self.any.store(true, Ordering::Release);
    }

    /// Notes the records read back from Redis (`{id}:h` or `{id}:s`, and µs).
    pub(crate) fn load(&self, records: &[(String, String)]) {
        for (field, at) in records {
            let (Some((id, how)), Ok(at)) = (field.rsplit_once(':'), at.parse::<u64>()) else {
                continue;
            };
            match how {
                "h" => self.note(id, Purge::Hard, at),
                "s" => self.note(id, Purge::Soft, at),
                _ => {}
            }
        }
    }

    /// Whether `stored` was purged: hard if any of its tags was purged hard after its
    /// fill began, else soft if any was purged soft. `route_tags`: the ids of the tags
    /// its route sets in code.
    #[inline]
    pub(crate) fn verdict(
        &self,
        keys: &KeySpace,
        route_tags: &[String],
        stored: &Stored,
        margin: std::time::Duration,
    ) -> Option<Purge> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        self.verdict_of_tags(keys, route_tags, stored, margin)
    }

    /// [`Purges::verdict`], once a purge was heard.
    fn verdict_of_tags(
        &self,
        keys: &KeySpace,
        route_tags: &[String],
        stored: &Stored,
        margin: std::time::Duration,
    ) -> Option<Purge> {
        let own = stored.tag_ids.get_or_init(|| {
            tags(&stored.response.headers)
                .map(|t| keys.tag_id(t))
                .collect()
        });
        if own.is_empty() && route_tags.is_empty() {
            return None;
        }
        let margin = margin.as_micros() as u64;
        let created = stored.created();
        let map = self.map.read().expect("purges lock");
        let mut verdict = None;
        for id in own.iter().chain(route_tags) {
            let Some(marks) = map.get(id) else { continue };
            if created < marks.hard.saturating_add(margin) && marks.hard > 0 {
                return Some(Purge::Hard);
            }
            if created < marks.soft.saturating_add(margin) && marks.soft > 0 {
                verdict = Some(Purge::Soft);
            }
        }
        verdict
    }
}

/// The tags an answer names: `Surrogate-Key` (space-separated) and `Cache-Tag`
/// (comma-separated), each value trimmed, empty ones left out.
pub(crate) fn tags(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    let surrogate = headers
        .get_all("surrogate-key")
        .into_iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(' '));
    let cache_tag = headers
        .get_all("cache-tag")
        .into_iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','));
    surrogate
        .chain(cache_tag)
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// This machine's time in µs since 1970: the stamp of a purge that Redis could not
/// record, and the start of a fill made without Redis.
pub(crate) fn local_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
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
        let mut headers = HeaderMap::new();
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
        let all: Vec<&str> = tags(&s.response.headers).collect();
        assert_eq!(all, ["a", "b", "c", "d", "e"]);
    }

    #[test]
    fn a_purge_reaches_entries_filled_before_it_and_hard_wins() {
        let keys = keys();
        let purges = Purges::default();
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
            purges.verdict(&keys, &[keys.tag_id("p1")], &untagged, MARGIN),
            Some(Purge::Soft)
        );
    }

    #[test]
    fn records_read_back_are_noted() {
        let keys = keys();
        let purges = Purges::default();
        let id = keys.tag_id("p");
        purges.load(&[
            (format!("{id}:s"), "500".to_owned()),
            ("garbage".to_owned(), "x".to_owned()),
            (format!("{id}:x"), "900".to_owned()),
        ]);
        let s = stored(&[("surrogate-key", "p")], 400);
        assert_eq!(purges.verdict(&keys, &[], &s, MARGIN), Some(Purge::Soft));
    }
}
