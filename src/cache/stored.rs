//! An entry as a process holds it: the cached response, how old it was when the process
//! got it and when that was, and the headers every answer from it carries.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// An instant of the clock entries are aged by: quanta's, which reads the processor's
/// time-stamp counter where it can (about half what `std::time::Instant::now` costs;
/// every hit reads it once), and the system's monotonic clock where it cannot.
pub(crate) type Instant = quanta::Instant;

use super::layout::{FIXED, Headers};
use super::parts::InParts;
use crate::cache::entry::CachedResponse;
use crate::http::response::tags;
use crate::http::{CACHE_STATUS_NAME, X_CACHE_NAME, is_set_by_the_layer};
use crate::lease::FencingToken;

/// A cached response, and its age: how old it was when this process got it, and when
/// that was on this process's monotonic clock.
#[derive(Debug)]
pub(crate) struct Stored {
    /// The response but for its headers.
    pub(crate) response: Parts,
    /// Its headers (see [`Stored::aged`]).
    headers: Headers,
    got_at: Instant,
    age_when_got: Duration,
    /// The end of its keep time on this process's clock: L1 drops it then.
    expires_at: Instant,
    /// The guard's subscription epoch when the entry was put in L1 (see
    /// [`L1::put`](super::L1::put)): an entry from an earlier epoch may have missed an
    /// invalidation.
    pub(super) epoch: AtomicU64,
    /// When its fill began, in µs of the Redis server's clock: its fencing token (issued
    /// from that clock when the fill took its lease), or for an entry filled without
    /// Redis, this machine's time. Purges of its tags before then hide it.
    created: u64,
    /// The ids of its tags (see `guard::purge`), made when first needed (and weighed
    /// from the start: see `l1::weigh`).
    pub(crate) tag_ids: std::sync::OnceLock<Box<[u128]>>,
    /// How many tags it has (see [`tags`]): its ids' count, known before they are made.
    tag_count: u32,
    /// The names in its `Vary` that its route does not key on anyway (see
    /// `guard::vary`), made when first needed: most entries vary on none.
    pub(crate) vary: std::sync::OnceLock<Box<[http::HeaderName]>>,
    /// The typed value its body encodes (see `guard::values`), decoded once: by the
    /// fill that fetched it, or by the first caller that reads the entry. A hit hands out
    /// a clone of the `Arc`, neither decoding nor copying the value.
    pub(crate) value: std::sync::OnceLock<Decoded>,
    /// Filled without Redis: its token is borrowed (the entry it replaced had it), so
    /// Redis may hold another body under that token.
    local: bool,
    /// Its body, when it is not in `response.body` (left empty) but read from Redis part
    /// by part as it is answered (see `cache::parts`): such an entry is never kept in
    /// L1, nor written.
    in_parts: Option<std::sync::Arc<InParts>>,
}

/// A typed value, decoded, of whatever type its [`Values`](crate::Values) handle holds.
/// A fill's answer carries it in its extensions from the fetch that made it to the
/// entry that stores it, so that the value fetched is never decoded again here.
#[derive(Clone)]
pub(crate) struct Decoded(pub(crate) std::sync::Arc<dyn std::any::Any + Send + Sync>);

impl std::fmt::Debug for Decoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Decoded(..)")
    }
}

/// A [`CachedResponse`] but for its headers, which an entry keeps apart.
#[derive(Debug)]
pub(crate) struct Parts {
    pub(crate) status: http::StatusCode,
    pub(crate) body: bytes::Bytes,
    pub(crate) fresh_for: Duration,
    pub(crate) grace: Duration,
    pub(crate) keep: Duration,
    pub(crate) token: FencingToken,
}

/// Where an entry is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Freshness {
    /// Serve it.
    Fresh,
    /// Serve it and refresh it.
    Stale,
    /// Past its grace: serve it only when the origin fails.
    Expired,
}

impl Stored {
    /// An entry that is `age` old now.
    ///
    /// Its headers get the three the layer sets on every answer (`age`, `x-cache` and
    /// `cache-status`), with placeholder values, as the first three of the map: an
    /// answer clones the map and overwrites those values in place (see
    /// [`Stored::answer_headers`]), instead of growing the map and hashing three names
    /// every time. They are never encoded for L2 (`CachedResponse::encode_for_l2` leaves
    /// them out). The map is kept as its layout, shared with the entries of the same
    /// names, and the entry's values (see [`Headers`]).
    pub(crate) fn aged(response: CachedResponse, age: Duration) -> Self {
        let CachedResponse {
            status,
            headers: stored,
            body,
            fresh_for,
            grace,
            keep,
            token,
        } = response;
        let mut headers = http::HeaderMap::with_capacity(stored.len() + FIXED);
        headers.insert(http::header::AGE, http::HeaderValue::from_static("0"));
        headers.insert(X_CACHE_NAME, http::HeaderValue::from_static("hit"));
        headers.insert(CACHE_STATUS_NAME, http::HeaderValue::from_static("hit"));
        let mut name = None;
        for (first, value) in stored {
            // `into_iter` names the first value of each header and leaves the name out
            // of the values that follow it.
            if first.is_some() {
                name = first;
            }
            match &name {
                Some(name) if !is_set_by_the_layer(name) => {
                    headers.append(name.clone(), value);
                }
                _ => {}
            }
        }
        let got_at = Instant::now();
        let expires_at = got_at + keep.saturating_sub(age);
        Self {
            response: Parts {
                status,
                body,
                fresh_for,
                grace,
                keep,
                token,
            },
            tag_count: u32::try_from(tags(&headers).count()).unwrap_or(u32::MAX),
            headers: Headers::new(&headers),
            got_at,
            age_when_got: age,
            expires_at,
            epoch: AtomicU64::new(0),
            created: token.get(),
            tag_ids: std::sync::OnceLock::new(),
            vary: std::sync::OnceLock::new(),
            value: std::sync::OnceLock::new(),
            local: false,
            in_parts: None,
        }
    }

    /// The entry, its body left in Redis in parts (`in_parts`), read as it is answered.
    pub(crate) fn reading_parts(mut self, in_parts: InParts) -> Self {
        self.in_parts = Some(std::sync::Arc::new(in_parts));
        self
    }

    /// Where its body is kept in parts, when it is not held (see
    /// [`Stored::reading_parts`]).
    pub(crate) fn in_parts(&self) -> Option<&std::sync::Arc<InParts>> {
        self.in_parts.as_ref()
    }

    /// Its headers, with placeholders of the three the layer sets on every answer
    /// (`age`, `x-cache` and `cache-status`; see [`Stored::aged`]): a map made for the
    /// asking (a clone of its layout's), for what is not on a hit's path.
    pub(crate) fn headers(&self) -> http::HeaderMap {
        self.headers.to_map()
    }

    /// The entry as a whole response (its headers with the placeholders of the three:
    /// see [`Stored::headers`]).
    pub(crate) fn to_response(&self) -> CachedResponse {
        debug_assert!(
            self.in_parts.is_none(),
            "an entry read in parts is not held"
        );
        let r = &self.response;
        CachedResponse {
            status: r.status,
            headers: self.headers(),
            body: r.body.clone(),
            fresh_for: r.fresh_for,
            grace: r.grace,
            keep: r.keep,
            token: r.token,
        }
    }

    /// Whether it has a header `name`, without making its map.
    pub(crate) fn has_header(&self, name: &http::HeaderName) -> bool {
        self.headers.layout().contains_key(name)
    }

    /// How many tags it has (the ids it will make: see [`Stored::tag_ids`]).
    pub(crate) fn tag_count(&self) -> usize {
        self.tag_count as usize
    }

    /// Its headers as kept (see [`Headers`]), for weighing.
    pub(crate) fn kept_headers(&self) -> &Headers {
        &self.headers
    }

    /// The entry, filled without Redis at `created` (µs of this machine's clock, see
    /// [`Stored::created`]), under a token it borrowed.
    pub(crate) fn filled_locally(mut self, created: u64) -> Self {
        self.created = created;
        self.local = true;
        self
    }

    /// Whether Redis holds this entry's body under its token, if it holds that token at
    /// all: false for an entry filled without Redis, whose token is borrowed.
    pub(crate) fn token_is_its_own(&self) -> bool {
        !self.local
    }

    /// When its fill began, in µs of the Redis server's clock (or, filled without
    /// Redis, of this machine's).
    pub(crate) fn created(&self) -> u64 {
        self.created
    }

    /// The headers of an answer from this entry: its headers (see
    /// [`Stored::headers`]), with the placeholders set to `age`, `x_cache` and
    /// `cache_status`.
    pub(crate) fn answer_headers(
        &self,
        age: http::HeaderValue,
        x_cache: http::HeaderValue,
        cache_status: http::HeaderValue,
    ) -> http::HeaderMap {
        self.headers.to_map_with(age, x_cache, cache_status)
    }

    /// The subscription epoch it was put in L1 under.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Relaxed)
    }

    pub(crate) fn age(&self) -> Duration {
        self.age_at(Instant::now())
    }

    /// How old it is at `now` (an instant of this process's clock).
    pub(crate) fn age_at(&self, now: Instant) -> Duration {
        self.age_when_got + now.saturating_duration_since(self.got_at)
    }

    pub(crate) fn freshness(&self) -> Freshness {
        self.freshness_at(self.age())
    }

    /// Where an entry `age` old is in its life.
    pub(crate) fn freshness_at(&self, age: Duration) -> Freshness {
        let r = &self.response;
        if age < r.fresh_for {
            Freshness::Fresh
        } else if age < r.fresh_for + r.grace {
            Freshness::Stale
        } else {
            Freshness::Expired
        }
    }

    /// Whether it may stand in for an origin that failed.
    pub(crate) fn serves_on_error(&self, stale_if_error: Duration) -> bool {
        let age = self.age();
        age < self.response.fresh_for + stale_if_error.max(self.response.grace)
            && age < self.response.keep
    }

    pub(super) fn expires_at(&self) -> Instant {
        self.expires_at
    }

    /// How long until the end of its keep time.
    pub(super) fn keep_left(&self) -> Duration {
        self.expires_at.saturating_duration_since(Instant::now())
    }
}

#[cfg(test)]
mod answer_header_tests {
    use super::*;
    use crate::lease::FencingToken;
    use http::HeaderValue;
    use http::header::{AGE, CONTENT_TYPE, LINK, VARY};

    fn stored(headers: http::HeaderMap) -> Stored {
        Stored::aged(
            CachedResponse {
                status: http::StatusCode::OK,
                headers,
                body: bytes::Bytes::from_static(b"body"),
                fresh_for: Duration::from_secs(60),
                grace: Duration::ZERO,
                keep: Duration::from_secs(60),
                token: FencingToken::new(1),
            },
            Duration::ZERO,
        )
    }

    /// An answer's headers are the stored ones, every value of each in order, with one
    /// `age`, one `x-cache` and one `cache-status`, set to the answer's.
    #[test]
    fn answers_keep_every_stored_header_and_set_age_and_x_cache() {
        let mut headers = http::HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        headers.append(LINK, HeaderValue::from_static("</a>; rel=preload"));
        headers.append(LINK, HeaderValue::from_static("</b>; rel=preload"));
        headers.insert(VARY, HeaderValue::from_static("accept-encoding"));
        // Never stored in practice (the layer strips them), but if they were: replaced.
        headers.append(AGE, HeaderValue::from_static("7"));
        headers.append(AGE, HeaderValue::from_static("8"));
        headers.insert(X_CACHE_NAME, HeaderValue::from_static("from-origin"));
        headers.insert(CACHE_STATUS_NAME, HeaderValue::from_static("upstream; hit"));
        let stored = stored(headers);

        let answer = stored.answer_headers(
            HeaderValue::from_static("42"),
            HeaderValue::from_static("stale"),
            HeaderValue::from_static("stampede-guard; hit; ttl=-2"),
        );
        let all = |name| {
            answer
                .get_all(name)
                .iter()
                .map(|v| v.to_str().unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(all(AGE), ["42"]);
        assert_eq!(all(X_CACHE_NAME), ["stale"]);
        assert_eq!(all(CACHE_STATUS_NAME), ["stampede-guard; hit; ttl=-2"]);
        assert_eq!(all(CONTENT_TYPE), ["text/plain"]);
        assert_eq!(all(LINK), ["</a>; rel=preload", "</b>; rel=preload"]);
        assert_eq!(all(VARY), ["accept-encoding"]);
        assert_eq!(answer.len(), 7);
        assert_eq!(answer.keys_len(), 6);

        // The stored map is left as it was: the next answer sets its own values.
        let next = stored.answer_headers(
            HeaderValue::from_static("43"),
            HeaderValue::from_static("hit"),
            HeaderValue::from_static("stampede-guard; hit; ttl=1"),
        );
        assert_eq!(next[AGE], "43");
        assert_eq!(next[X_CACHE_NAME], "hit");
        assert_eq!(next[CACHE_STATUS_NAME], "stampede-guard; hit; ttl=1");
        assert_eq!(next.len(), 7);
    }

    /// With no stored header at all, an answer carries just the three.
    #[test]
    fn an_entry_without_headers_answers_with_age_and_x_cache() {
        let stored = stored(http::HeaderMap::new());
        let answer = stored.answer_headers(
            HeaderValue::from_static("0"),
            HeaderValue::from_static("hit"),
            HeaderValue::from_static("stampede-guard; hit; ttl=60"),
        );
        assert_eq!(answer.len(), 3);
        assert_eq!(answer[CACHE_STATUS_NAME], "stampede-guard; hit; ttl=60");
        assert_eq!(answer[AGE], "0");
        assert_eq!(answer[X_CACHE_NAME], "hit");
    }
}
