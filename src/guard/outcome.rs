//! What an answer was, as one value ([`XCache`]): its `x-cache` header and this cache's
//! member of `cache-status` (RFC 9211) are both made from it, so that the two never
//! disagree; and the `age` header.
//!
//! | outcome | `x-cache` | `cache-status` |
//! | --- | --- | --- |
//! | a fresh entry | `hit` | `stampede-guard; hit; ttl=N` |
//! | an entry held as stale (refreshed meanwhile, or standing in for a failed origin) | `stale` | `stampede-guard; hit; ttl=N`, `N` at most 0 |
//! | the fill it waited for, stored | `miss` | `stampede-guard; fwd=uri-miss; stored; ttl=N` |
//! | the fill it waited for, not stored (its write was refused) | `miss` | `stampede-guard; fwd=uri-miss; ttl=N` |
//! | the origin's answer, not stored | `pass` | `stampede-guard; fwd=uri-miss` |
//! | a request the cache does not handle | `bypass` | `stampede-guard; fwd=bypass` |
//! | the guard's own answer (the origin failed or did not answer in time; the route rejects) | `miss` | `stampede-guard; fwd=uri-miss; detail=...` |
//!
//! Besides, `detail=local-only` when Redis was unavailable, or else
//! `detail=query-dropped` on an answer whose key left out query parameters the request
//! had (see [`say_details`]).
//!
//! `ttl` is the freshness the entry has left for this cache, in whole seconds: an entry
//! this cache holds as stale has none left (a fresh entry that a soft purge reached, or
//! one put in L1 before the notice subscription last came up, is stale here whatever
//! its lifetime says).

use std::sync::LazyLock;

use http::HeaderValue;

use crate::CACHE_NAME;

/// `stampede-guard; ` and a `cache-status` parameter list, as a `&'static str`.
macro_rules! concat_status {
    ($params:literal) => {
        concat!("stampede-guard; ", $params)
    };
}
pub(crate) use concat_status;

/// How an answer was made (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum XCache {
    /// From a fresh entry.
    Hit,
    /// From an entry held as stale: served while it is refreshed, or standing in for a
    /// failed origin.
    Stale,
    /// From the fill the request waited for (or the guard's own answer when the fill
    /// failed).
    Miss,
    /// From the origin, not stored.
    Pass,
    /// Not a request the cache handles.
    Bypass,
}

impl XCache {
    /// The `x-cache` value.
    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            Self::Hit => "hit",
            Self::Stale => "stale",
            Self::Miss => "miss",
            Self::Pass => "pass",
            Self::Bypass => "bypass",
        }
    }

    /// The `x-cache` header.
    pub(crate) fn value(self) -> HeaderValue {
        HeaderValue::from_static(self.as_str())
    }

    /// The `cache-status` of an answer from an entry whose freshness ends in `ttl`
    /// seconds (negative once past); `stored` for a fill's entry that is in the caches.
    /// Hits and stale answers within an hour of their freshness take a value from a
    /// table made once, others the value this thread made last if it is the same: a hit
    /// does not format a number.
    pub(crate) fn of_entry(self, ttl: i64, stored: bool) -> HeaderValue {
        const HOUR: i64 = 3600;
        static HITS: LazyLock<Vec<HeaderValue>> = LazyLock::new(|| {
            (-HOUR..=HOUR)
                .map(|n| leaked(format!("{CACHE_NAME}; hit; ttl={n}")))
                .collect()
        });
        thread_local! {
            static LAST: std::cell::RefCell<Option<(i64, HeaderValue)>> =
                const { std::cell::RefCell::new(None) };
        }
        let hit = |ttl: i64| {
            if (-HOUR..=HOUR).contains(&ttl) {
                return HITS[(ttl + HOUR) as usize].clone();
            }
            LAST.with_borrow_mut(|last| match last {
                Some((at, value)) if *at == ttl => value.clone(),
                _ => {
                    let value = made(format!("{CACHE_NAME}; hit; ttl={ttl}"));
                    *last = Some((ttl, value.clone()));
                    value
                }
            })
        };
        match self {
            Self::Hit => hit(ttl),
            // Stale here: none of its freshness is left for this cache.
            Self::Stale => hit(ttl.min(0)),
            Self::Miss if stored => made(format!("{CACHE_NAME}; fwd=uri-miss; stored; ttl={ttl}")),
            Self::Miss => made(format!("{CACHE_NAME}; fwd=uri-miss; ttl={ttl}")),
            Self::Pass | Self::Bypass => self.forwarded(),
        }
    }

    /// The `cache-status` of an answer that is not from an entry.
    pub(crate) fn forwarded(self) -> HeaderValue {
        HeaderValue::from_static(match self {
            Self::Bypass => concat_status!("fwd=bypass"),
            _ => concat_status!("fwd=uri-miss"),
        })
    }

    /// This cache's member of `Cache-Status` for an answer to a GET or HEAD with a body,
    /// forwarded with it and not stored.
    pub(crate) fn bypassed_with_body() -> HeaderValue {
        HeaderValue::from_static(concat_status!("fwd=bypass; detail=request-body"))
    }

    /// This cache's member of `Cache-Status` for an answer forwarded for another
    /// caller, whose request this one's was collapsed into (RFC 9211 §2.5).
    pub(crate) fn collapsed() -> HeaderValue {
        HeaderValue::from_static(concat_status!("fwd=uri-miss; collapsed"))
    }
}

/// An `age` header value: from a table made once for the first hour, so that a hit does
/// not format a number (and allocate for it).
pub(crate) fn age_value(seconds: u64) -> HeaderValue {
    static AGES: LazyLock<Vec<HeaderValue>> =
        LazyLock::new(|| (0..3600u64).map(|n| leaked(n.to_string())).collect());
    match AGES.get(seconds as usize) {
        Some(value) => value.clone(),
        None => HeaderValue::from(seconds),
    }
}

fn leaked(text: String) -> HeaderValue {
    HeaderValue::from_static(Box::leak(text.into_boxed_str()))
}

/// A header value of text this module made (ASCII: a name, numbers, separators).
fn made(text: String) -> HeaderValue {
    HeaderValue::try_from(text).unwrap_or_else(|_| HeaderValue::from_static(CACHE_NAME))
}

/// Adds what the answer's making says of it to this cache's member of `Cache-Status`,
/// as its `detail` (RFC 9211 §2.8, one value): `local-only` when Redis was unavailable;
/// else `query-dropped` when the key left out query parameters the request had, on an
/// answer a key made (a hit, a stale answer, a fill's: not a pass or a bypass, which
/// reach the origin as they came). Not to a member with a detail already: the guard's
/// own answers say what failed.
pub(crate) fn say_details(headers: &mut http::HeaderMap, local_only: bool, query_dropped: bool) {
    let keyed = || {
        headers
            .get(crate::http::X_CACHE_NAME)
            .is_some_and(|v| matches!(v.as_bytes(), b"hit" | b"stale" | b"miss"))
    };
    let detail = if local_only {
        "detail=local-only"
    } else if query_dropped && keyed() {
        "detail=query-dropped"
    } else {
        return;
    };
    let mut values: Vec<http::HeaderValue> = headers
        .get_all(crate::http::CACHE_STATUS_NAME)
        .iter()
        .cloned()
        .collect();
    let Some(ours) = values.iter_mut().find(|v| {
        v.to_str()
            .is_ok_and(|v| v.starts_with(crate::http::CACHE_NAME) && !v.contains("detail="))
    }) else {
        return;
    };
    let text = ours.to_str().unwrap_or_default();
    let Ok(marked) = http::HeaderValue::from_str(&format!("{text}; {detail}")) else {
        return;
    };
    *ours = marked;
    headers.remove(crate::http::CACHE_STATUS_NAME);
    for value in values {
        headers.append(crate::http::CACHE_STATUS_NAME, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x_cache_and_cache_status_say_the_same() {
        assert_eq!(
            XCache::Hit.of_entry(12, false),
            "stampede-guard; hit; ttl=12"
        );
        // Held as stale with freshness left by its lifetime: none left here.
        assert_eq!(
            XCache::Stale.of_entry(2, false),
            "stampede-guard; hit; ttl=0"
        );
        assert_eq!(
            XCache::Stale.of_entry(-7, false),
            "stampede-guard; hit; ttl=-7"
        );
        assert_eq!(
            XCache::Miss.of_entry(60, true),
            "stampede-guard; fwd=uri-miss; stored; ttl=60"
        );
        assert_eq!(
            XCache::Miss.of_entry(60, false),
            "stampede-guard; fwd=uri-miss; ttl=60"
        );
        assert_eq!(XCache::Pass.forwarded(), "stampede-guard; fwd=uri-miss");
        assert_eq!(XCache::Bypass.forwarded(), "stampede-guard; fwd=bypass");
        assert_eq!(
            XCache::collapsed(),
            "stampede-guard; fwd=uri-miss; collapsed"
        );
        assert_eq!(
            XCache::Hit.of_entry(7200, false),
            "stampede-guard; hit; ttl=7200"
        );
        for x in [
            XCache::Hit,
            XCache::Stale,
            XCache::Miss,
            XCache::Pass,
            XCache::Bypass,
        ] {
            assert_eq!(x.value(), x.as_str());
        }
    }

    #[test]
    fn local_only_is_said_once_and_only_in_this_caches_entry() {
        let mut headers = http::HeaderMap::new();
        headers.append(
            crate::http::CACHE_STATUS_NAME,
            "stampede-guard; hit; ttl=5".parse().unwrap(),
        );
        headers.append(
            crate::http::CACHE_STATUS_NAME,
            "upstream; hit".parse().unwrap(),
        );
        say_details(&mut headers, true, false);
        let all: Vec<_> = headers
            .get_all(crate::http::CACHE_STATUS_NAME)
            .iter()
            .collect();
        assert_eq!(
            all,
            [
                "stampede-guard; hit; ttl=5; detail=local-only",
                "upstream; hit"
            ]
        );
        let mut failed = http::HeaderMap::new();
        failed.insert(
            crate::http::CACHE_STATUS_NAME,
            "stampede-guard; fwd=uri-miss; detail=origin-error"
                .parse()
                .unwrap(),
        );
        say_details(&mut failed, true, false);
        assert_eq!(
            failed[crate::http::CACHE_STATUS_NAME],
            "stampede-guard; fwd=uri-miss; detail=origin-error"
        );
    }

    /// A key that left out query parameters says `query-dropped` on the answers a key
    /// made; `local-only`, when Redis is unavailable, says more and takes its place.
    #[test]
    fn a_dropped_query_is_said_on_keyed_answers_and_local_only_comes_first() {
        let said = |x_cache: &str, status: &str, local_only: bool| {
            let mut headers = http::HeaderMap::new();
            headers.insert(crate::http::X_CACHE_NAME, x_cache.parse().unwrap());
            headers.insert(crate::http::CACHE_STATUS_NAME, status.parse().unwrap());
            say_details(&mut headers, local_only, true);
            headers[crate::http::CACHE_STATUS_NAME]
                .to_str()
                .unwrap()
                .to_owned()
        };
        let hit = "stampede-guard; hit; ttl=5";
        assert_eq!(
            said("hit", hit, false),
            format!("{hit}; detail=query-dropped")
        );
        assert_eq!(said("hit", hit, true), format!("{hit}; detail=local-only"));
        let miss = "stampede-guard; fwd=uri-miss; stored; ttl=5";
        assert_eq!(
            said("miss", miss, false),
            format!("{miss}; detail=query-dropped")
        );
        for (x_cache, status) in [
            ("pass", "stampede-guard; fwd=uri-miss"),
            ("bypass", "stampede-guard; fwd=bypass"),
        ] {
            assert_eq!(said(x_cache, status, false), status);
            assert_eq!(
                said(x_cache, status, true),
                format!("{status}; detail=local-only")
            );
        }
    }
}
