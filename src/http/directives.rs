//! What the origin says about how long its answer may be used: `Cache-Control`
//! (RFC 9111 §5.2.2, RFC 5861), or in its place a field targeted at this cache
//! (`CDN-Cache-Control`, RFC 9213; `Surrogate-Control`), `Expires`, `Age`, and
//! heuristic freshness (RFC 9111 §4.2.2). Read only on routes that follow the origin
//! ([`PolicyBuilder::follow_origin`](crate::policy::PolicyBuilder::follow_origin));
//! other routes keep their own policy whatever the origin says (but for what makes an
//! answer private, which every route obeys: see `response::storable`).
//!
//! The origin's lifetime is clamped by the route's floor and ceiling
//! ([`min_fresh`](crate::policy::PolicyBuilder::min_fresh),
//! [`max_fresh`](crate::policy::PolicyBuilder::max_fresh)), so that an origin cannot pin
//! an entry for a year. What the origin says about serving stale:
//!
//! * `stale-while-revalidate=N`: the entry's grace is `N` (at most a day);
//! * `stale-if-error=N`: the entry stands in for a failing origin `N` past freshness;
//! * `must-revalidate`, `proxy-revalidate`, `no-cache`, and `s-maxage` without
//!   `stale-while-revalidate` (it implies `proxy-revalidate`): never served stale;
//! * nothing: the route's grace and stale-if-error (a deliberate choice of a stampede
//!   guard, which serves stale so that one caller in the fleet refreshes while the
//!   others are answered; set the route's grace to zero to forbid it).

use std::time::{Duration, SystemTime};

use http::header::{AGE, CACHE_CONTROL, DATE, ETAG, EXPIRES, LAST_MODIFIED};
use http::{HeaderMap, StatusCode};

use super::structured;
use crate::policy::Policy;

/// The longest any window may be (entries are refused past it, see `entry::decode`).
const DAY: Duration = Duration::from_secs(24 * 3600);

/// The part of the time since `Last-Modified` a response without an explicit lifetime
/// is fresh for (RFC 9111 §4.2.2's typical 10 %).
const HEURISTIC_FRACTION: u32 = 10;

/// The `Cache-Control` directives that bear on freshness.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Directives {
    pub(crate) max_age: Option<u64>,
    pub(crate) s_maxage: Option<u64>,
    pub(crate) stale_while_revalidate: Option<u64>,
    pub(crate) stale_if_error: Option<u64>,
    pub(crate) must_revalidate: bool,
    pub(crate) proxy_revalidate: bool,
    pub(crate) no_cache: bool,
}

impl Directives {
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let mut d = Self::default();
        for value in headers.get_all(controlling(headers)) {
            let Ok(value) = value.to_str() else { continue };
            for directive in value.split(',') {
                let (name, argument) = match directive.split_once('=') {
                    Some((name, argument)) => (name.trim(), Some(argument.trim())),
                    None => (directive.trim(), None),
                };
                // A delta-seconds that does not parse makes the response stale (RFC 9111
                // §1.2.2: a cache treats an invalid lifetime as none left).
                let seconds = || {
                    argument
                        // A target after `;` (`max-age=60;edge`, Edge Architecture's
                        // `Surrogate-Control`): this cache takes what it is sent.
                        .map(|a| a.split(';').next().unwrap_or(a).trim_matches('"'))
                        .and_then(|a| a.parse::<u64>().ok())
                        .unwrap_or(0)
                        // The largest delta-seconds a cache must take (RFC 9111 §1.2.2).
                        .min(1 << 31)
                };
                let name = name.to_ascii_lowercase();
                match name.as_str() {
                    // The first of repeated directives counts.
                    "max-age" => d.max_age = d.max_age.or(Some(seconds())),
                    "s-maxage" => d.s_maxage = d.s_maxage.or(Some(seconds())),
                    "stale-while-revalidate" => {
                        d.stale_while_revalidate = d.stale_while_revalidate.or(Some(seconds()));
                    }
                    "stale-if-error" => d.stale_if_error = d.stale_if_error.or(Some(seconds())),
                    "must-revalidate" => d.must_revalidate = true,
                    "proxy-revalidate" => d.proxy_revalidate = true,
                    "no-cache" => d.no_cache = true,
                    _ => {}
                }
            }
        }
        d
    }

    /// Whether the entry may never be served stale.
    fn forbids_stale(&self) -> bool {
        self.must_revalidate
            || self.proxy_revalidate
            || self.no_cache
            || (self.s_maxage.is_some() && self.stale_while_revalidate.is_none())
    }
}

/// The field whose directives this cache follows: `CDN-Cache-Control` (RFC 9213, for
/// the caches of a CDN, which a shared cache in front of an origin is), else
/// `Surrogate-Control` (its older form), else `Cache-Control`. A targeted field takes
/// the place of `Cache-Control` whole, as RFC 9213 says; a `CDN-Cache-Control` that is
/// not a valid dictionary (RFC 8941), or whose lifetimes are not integers, is ignored
/// whole (RFC 9213 §2.1).
pub(crate) fn controlling(headers: &HeaderMap) -> http::HeaderName {
    const CDN: http::HeaderName = http::HeaderName::from_static("cdn-cache-control");
    if headers.contains_key(CDN) && is_valid_cdn_field(headers.get_all(CDN)) {
        return CDN;
    }
    if headers.contains_key("surrogate-control") {
        return http::HeaderName::from_static("surrogate-control");
    }
    CACHE_CONTROL
}

/// Whether `CDN-Cache-Control`'s field lines are a dictionary whose lifetimes are
/// integers (`max-age="60"` is of the wrong type).
fn is_valid_cdn_field(lines: http::header::GetAll<'_, http::HeaderValue>) -> bool {
    let Some(members) = structured::dictionary(lines.iter().map(http::HeaderValue::as_bytes))
    else {
        return false;
    };
    members.iter().all(|(key, value)| {
        !matches!(
            key.as_str(),
            "max-age" | "s-maxage" | "stale-while-revalidate" | "stale-if-error"
        ) || *value == structured::Value::Integer
    })
}

/// How old an answer is when it arrives, how long it is fresh, served stale while
/// refreshed, and kept (the three counted from its origin's answer, as its age is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lifetimes {
    /// What the caches it came through said (`Age`): the entry starts that old.
    pub(crate) age: Duration,
    pub(crate) fresh_for: Duration,
    pub(crate) grace: Duration,
    pub(crate) keep: Duration,
}

/// The longest an entry may be kept (what `entry::decode` accepts).
pub(crate) const MAX_KEEP: Duration = Duration::from_secs(3 * 24 * 3600);

/// The oldest an answer is taken to be on arrival: its lifetimes must stay within what
/// an entry may hold (a day of freshness).
const MAX_AGE_ON_ARRIVAL: Duration = Duration::from_secs(12 * 3600);

/// The lifetimes of an answer with `headers`: the route's, or on a route that follows
/// the origin, the origin's (clamped to the route's bounds). `fresh` is the route's
/// fresh time for this entry (with its jitter).
pub(crate) fn lifetimes(policy: &Policy, headers: &HeaderMap, fresh: Duration) -> Lifetimes {
    if !policy.follow_origin {
        return Lifetimes {
            age: Duration::ZERO,
            fresh_for: fresh,
            grace: policy.grace,
            keep: policy.kept_for(),
        };
    }
    let d = Directives::of(headers);
    let lifetime = if d.no_cache {
        Duration::ZERO
    } else {
        explicit_lifetime(&d, headers)
            .or_else(|| heuristic_lifetime(headers))
            .unwrap_or(Duration::ZERO)
    };
    let age = initial_age(headers);
    // What is left of its freshness, within the route's bounds; the entry starts `age`
    // old, and its `Age` goes on from there (RFC 9111 §4.2.3).
    // An entry is fresh for a day at most from its origin's answer (entries fresh
    // longer are refused when read back).
    let left = if d.no_cache {
        // Revalidated before every use (RFC 9111 §5.2.2.4): never fresh, whatever the
        // route's floor, not even for the millisecond an entry is kept in.
        Duration::ZERO
    } else {
        lifetime
            .saturating_sub(age)
            .clamp(policy.min_fresh, policy.max_fresh)
            .min(DAY.saturating_sub(age))
            // Whole milliseconds, at least one: entries are kept in milliseconds, and
            // an entry fresh for none is one that is stale at once.
            .max(Duration::from_millis(1))
    };
    let fresh_for = age + Duration::from_millis(left.as_millis() as u64);
    let (grace, stale_if_error) = stale_windows(policy, &d);
    let mut keep = fresh_for + grace.max(stale_if_error) + policy.keep;
    if headers.contains_key(ETAG) || headers.contains_key(LAST_MODIFIED) {
        // Never served past its own windows, but kept as long as the route keeps
        // entries, to be revalidated (a `no-cache` answer is on every use).
        keep = keep.max(policy.kept_for());
    }
    // Within what an entry may hold: a day fresh, a day of grace, three days in all.
    // (At least a millisecond: a key is never written to expire at once.)
    let keep = keep.min(MAX_KEEP).max(Duration::from_millis(1));
    Lifetimes {
        age,
        fresh_for,
        grace,
        keep,
    }
}

/// `Age` as the origin (or a cache before it) sent it, at most [`MAX_AGE_ON_ARRIVAL`]:
/// the first value given (RFC 9111 §4.2.1: of a value given more than once, on two
/// field lines or as a list, the first occurrence may be used), in whole seconds. A
/// value that is not a non-negative integer (a sign, a fraction, a parameter, text) is
/// not an age at all, and is ignored as if absent: zero (§4.2.3, "or 0, if not
/// available"; §5.1).
fn initial_age(headers: &HeaderMap) -> Duration {
    let first = headers
        .get(AGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(',').next())
        .map(str::trim)
        .unwrap_or_default();
    if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
        return Duration::ZERO;
    }
    // All digits: too many for a u64 is very old (§1.2.2).
    let seconds = first.parse::<u64>().unwrap_or(u64::MAX);
    Duration::from_secs(seconds.min(MAX_AGE_ON_ARRIVAL.as_secs()))
}

/// How long past freshness an entry with `headers` may stand in for a failing origin.
pub(crate) fn stale_if_error(policy: &Policy, headers: &HeaderMap) -> Duration {
    if !policy.follow_origin {
        return policy.stale_if_error;
    }
    stale_windows(policy, &Directives::of(headers)).1
}

/// Grace and stale-if-error on a route that follows the origin.
fn stale_windows(policy: &Policy, d: &Directives) -> (Duration, Duration) {
    if d.forbids_stale() {
        return (Duration::ZERO, Duration::ZERO);
    }
    let window = |seconds: Option<u64>, otherwise: Duration| {
        seconds.map_or(otherwise, |s| Duration::from_secs(s).min(DAY))
    };
    (
        window(d.stale_while_revalidate, policy.grace),
        window(d.stale_if_error, policy.stale_if_error),
    )
}

/// `s-maxage`, else `max-age`, else `Expires` less `Date` (RFC 9111 §4.2.1).
fn explicit_lifetime(d: &Directives, headers: &HeaderMap) -> Option<Duration> {
    if let Some(seconds) = d.s_maxage.or(d.max_age) {
        return Some(Duration::from_secs(seconds));
    }
    let expires = headers.get(EXPIRES)?;
    // An invalid `Expires` (`0`, say) is a time in the past (RFC 9111 §5.3).
    let Some(expires) = date(expires) else {
        return Some(Duration::ZERO);
    };
    let now = headers
        .get(DATE)
        .and_then(date)
        .unwrap_or_else(SystemTime::now);
    Some(expires.duration_since(now).unwrap_or(Duration::ZERO))
}

/// A tenth of the time since `Last-Modified`, for a response without an explicit
/// lifetime (RFC 9111 §4.2.2; the status was checked by [`reusable`]).
fn heuristic_lifetime(headers: &HeaderMap) -> Option<Duration> {
    let modified = date(headers.get(LAST_MODIFIED)?)?;
    let now = headers
        .get(DATE)
        .and_then(date)
        .unwrap_or_else(SystemTime::now);
    let since = now.duration_since(modified).ok()?;
    Some(since / HEURISTIC_FRACTION)
}

fn date(value: &http::HeaderValue) -> Option<SystemTime> {
    super::date::parse(value)
}

/// The statuses a cache may give a heuristic lifetime to (RFC 9110 §15.1), but for the
/// ones this cache does not store (206) and the server errors (stale-if-error's).
const HEURISTICALLY_CACHEABLE: [StatusCode; 10] = [
    StatusCode::OK,
    StatusCode::NON_AUTHORITATIVE_INFORMATION,
    StatusCode::NO_CONTENT,
    StatusCode::MULTIPLE_CHOICES,
    StatusCode::MOVED_PERMANENTLY,
    StatusCode::PERMANENT_REDIRECT,
    StatusCode::NOT_FOUND,
    StatusCode::METHOD_NOT_ALLOWED,
    StatusCode::GONE,
    StatusCode::URI_TOO_LONG,
];

/// Why an answer may not be reused on a route that follows the origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotReused {
    /// A status the route does not store, and the origin gave it no lifetime.
    Status,
    /// No lifetime, explicit or heuristic, and no validator to revalidate it with.
    NoFreshness,
}

/// Whether an answer may be stored on a route that follows the origin: a status the
/// route stores, a heuristically cacheable one, or any other below 500 that the origin
/// gave a lifetime (but 206 and 304, never stored); and freshness information or a
/// validator (RFC 9111 §3: a response with neither is not reused).
pub(crate) fn reusable(
    policy: &Policy,
    status: StatusCode,
    headers: &HeaderMap,
) -> Result<(), NotReused> {
    let d = Directives::of(headers);
    let explicit = d.no_cache || explicit_lifetime(&d, headers).is_some();
    let status_ok = policy.is_cacheable_status(status)
        || HEURISTICALLY_CACHEABLE.contains(&status)
        || (explicit
            && status.as_u16() < 500
            && !status.is_informational()
            && status != StatusCode::PARTIAL_CONTENT
            && status != StatusCode::NOT_MODIFIED);
    if !status_ok {
        return Err(NotReused::Status);
    }
    let validator = headers.contains_key(ETAG) || headers.contains_key(LAST_MODIFIED);
    if explicit || validator {
        Ok(())
    } else {
        Err(NotReused::NoFreshness)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn following() -> Policy {
        Policy::builder("docs")
            .follow_origin(true)
            .grace(Duration::from_secs(30))
            .stale_if_error(Duration::from_secs(60))
            .max_fresh(Duration::from_secs(3600))
            .build()
            .unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    fn life(pairs: &[(&str, &str)]) -> Lifetimes {
        lifetimes(&following(), &headers(pairs), Duration::from_secs(10))
    }

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn max_age_and_s_maxage_set_freshness_clamped_by_the_route() {
        assert_eq!(life(&[("cache-control", "max-age=120")]).fresh_for, S(120));
        assert_eq!(
            life(&[("cache-control", "max-age=120, s-maxage=30")]).fresh_for,
            S(30)
        );
        // The ceiling.
        assert_eq!(
            life(&[("cache-control", "max-age=31536000")]).fresh_for,
            S(3600)
        );
        // Age from upstream counts: the entry starts that old.
        let aged = life(&[("cache-control", "max-age=120"), ("age", "100")]);
        assert_eq!((aged.age, aged.fresh_for), (S(100), S(120)));
        // Stale on arrival: fresh for a millisecond past its age.
        let late = life(&[("cache-control", "max-age=10"), ("age", "100")]);
        assert_eq!(late.fresh_for - late.age, Duration::from_millis(1));
        // An `Age` that is not a non-negative integer is ignored (RFC 9111 §4.2.3).
        for bad in ["soon", "-7200", "7200.0", "1;a=b", ""] {
            let l = life(&[("age", bad), ("cache-control", "max-age=60")]);
            assert_eq!((l.age, l.fresh_for), (S(0), S(60)), "{bad}");
        }
        // Of several, the first (§4.2.1): on one line or on two.
        let fresh = [S(0), S(60)];
        let stale = |l: Lifetimes| l.fresh_for - l.age == Duration::from_millis(1);
        let max_age = ("cache-control", "max-age=60");
        for (ages, is_stale) in [
            (&[("age", "0, 7200")][..], false),
            (&[("age", "7200, 0")], true),
            (&[("age", "0"), ("age", "7200")], false),
            (&[("age", "7200"), ("age", "0")], true),
            (&[("age", "0"), ("age", "0")], false),
            (&[("age", "0, 0")], false),
        ] {
            let l = life(&[ages, &[max_age]].concat());
            assert_eq!(stale(l), is_stale, "{ages:?}");
            if !is_stale {
                assert_eq!([l.age, l.fresh_for], fresh, "{ages:?}");
            }
        }
        // A target after `;` is taken.
        let targeted = life(&[("surrogate-control", "max-age=100;edge")]);
        assert_eq!(targeted.fresh_for, S(100));
        // An invalid max-age is none left.
        assert_eq!(
            life(&[("cache-control", "max-age=soon")]).fresh_for,
            Duration::from_millis(1)
        );
        // The floor.
        let floored = Policy::builder("docs")
            .follow_origin(true)
            .min_fresh(S(5))
            .build()
            .unwrap();
        let h = headers(&[("cache-control", "max-age=1")]);
        assert_eq!(lifetimes(&floored, &h, S(10)).fresh_for, S(5));
    }

    #[test]
    fn an_aged_answer_stays_within_what_an_entry_may_hold() {
        let open = Policy::builder("docs").follow_origin(true).build().unwrap();
        let h = headers(&[("cache-control", "max-age=31536000"), ("age", "1")]);
        let l = lifetimes(&open, &h, S(10));
        assert_eq!((l.age, l.fresh_for), (S(1), DAY));
        let entry = crate::cache::entry::CachedResponse {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: bytes::Bytes::new(),
            fresh_for: l.fresh_for,
            grace: l.grace,
            keep: l.keep,
            token: crate::lease::FencingToken::new(1),
        };
        assert!(crate::cache::entry::decode(&entry.encode()).is_ok());
    }

    #[test]
    fn expires_and_heuristics() {
        let date = "Sun, 06 Nov 1994 08:49:37 GMT";
        assert_eq!(
            life(&[("date", date), ("expires", "Sun, 06 Nov 1994 08:51:37 GMT")]).fresh_for,
            S(120)
        );
        // Read robustly (RFC 9110 §5.6.7): names in any case, any day name.
        assert_eq!(
            life(&[("date", date), ("expires", "MON, 06 NOV 1994 08:51:37 gmt")]).fresh_for,
            S(120)
        );
        // Another zone is not a date: in the past (RFC 9111 §5.3).
        assert_eq!(
            life(&[("date", date), ("expires", "Sun, 06 Nov 1994 08:51:37 UTC")]).fresh_for,
            Duration::from_millis(1)
        );
        assert_eq!(
            life(&[("date", date), ("expires", "0")]).fresh_for,
            Duration::from_millis(1)
        );
        // max-age wins over Expires.
        assert_eq!(
            life(&[
                ("date", date),
                ("expires", "Sun, 06 Nov 1994 08:51:37 GMT"),
                ("cache-control", "max-age=7")
            ])
            .fresh_for,
            S(7)
        );
        // A tenth of the time since it was modified: 1000 s ago, fresh 100 s.
        assert_eq!(
            life(&[
                ("date", date),
                ("last-modified", "Sun, 06 Nov 1994 08:32:57 GMT")
            ])
            .fresh_for,
            S(100)
        );
    }

    #[test]
    fn stale_windows_follow_rfc_5861_and_the_revalidate_directives() {
        let l = life(&[(
            "cache-control",
            "max-age=10, stale-while-revalidate=5, stale-if-error=100",
        )]);
        assert_eq!((l.fresh_for, l.grace, l.keep), (S(10), S(5), S(110)));
        // Nothing said: the route's windows.
        let l = life(&[("cache-control", "max-age=10")]);
        assert_eq!((l.grace, l.keep), (S(30), S(70)));
        for forbidding in [
            "max-age=10, must-revalidate",
            "max-age=10, proxy-revalidate",
            "s-maxage=10",
            "no-cache",
        ] {
            let l = life(&[("cache-control", forbidding)]);
            // (Kept a millisecond at least: a `no-cache` answer is never fresh.)
            let kept = l.fresh_for.max(Duration::from_millis(1));
            assert_eq!((l.grace, l.keep), (S(0), kept), "{forbidding}");
        }
        assert_eq!(
            life(&[("cache-control", "s-maxage=10, stale-while-revalidate=3")]).grace,
            S(3)
        );
        assert_eq!(
            stale_if_error(
                &following(),
                &headers(&[("cache-control", "stale-if-error=7")])
            ),
            S(7)
        );
    }

    #[test]
    fn a_field_targeted_at_this_cache_takes_the_place_of_cache_control() {
        let l = life(&[
            ("cache-control", "max-age=5"),
            ("cdn-cache-control", "max-age=50"),
        ]);
        assert_eq!(l.fresh_for, S(50));
        // One that is not a valid dictionary, or whose lifetime is not an integer, is
        // ignored (RFC 9213 §2.1): `Cache-Control` rules.
        for invalid in ["max-age=50, &&&&&", "max-age=\"50\"", "max-age=50,"] {
            let l = life(&[
                ("cache-control", "max-age=5"),
                ("cdn-cache-control", invalid),
            ]);
            assert_eq!(l.fresh_for, S(5), "{invalid}");
        }
        let l = life(&[
            ("cache-control", "max-age=5, must-revalidate"),
            ("surrogate-control", "max-age=40"),
        ]);
        assert_eq!((l.fresh_for, l.grace), (S(40), S(30)));
        let store = |pairs: &[(&str, &str)]| {
            let response = {
                let mut r = http::Response::new(());
                *r.headers_mut() = headers(pairs);
                r
            };
            crate::http::response::storable(&following(), &response)
        };
        assert!(
            store(&[
                ("cache-control", "no-store"),
                ("surrogate-control", "max-age=60")
            ])
            .is_ok()
        );
        assert!(
            store(&[
                ("cache-control", "max-age=60"),
                ("surrogate-control", "no-store")
            ])
            .is_err()
        );
        // An invalid targeted field leaves `Cache-Control` in charge.
        assert!(
            store(&[
                ("cache-control", "no-store"),
                ("cdn-cache-control", "max-age=10000, &&&&&")
            ])
            .is_err()
        );
        // Private is private, whatever a targeted field says.
        assert!(
            store(&[
                ("cache-control", "private"),
                ("cdn-cache-control", "max-age=60")
            ])
            .is_err()
        );
    }

    #[test]
    fn a_route_that_does_not_follow_keeps_its_policy() {
        let own = Policy::builder("docs").build().unwrap();
        let h = headers(&[("cache-control", "max-age=1, must-revalidate")]);
        let l = lifetimes(&own, &h, S(10));
        assert_eq!(
            (l.fresh_for, l.grace, l.keep),
            (S(10), own.grace, own.kept_for())
        );
        assert_eq!(stale_if_error(&own, &h), own.stale_if_error);
    }

    #[test]
    fn answers_without_freshness_or_validator_are_not_reused() {
        let p = following();
        let ok = StatusCode::OK;
        assert_eq!(reusable(&p, ok, &headers(&[])), Err(NotReused::NoFreshness));
        assert_eq!(reusable(&p, ok, &headers(&[("etag", "\"a\"")])), Ok(()));
        assert_eq!(
            reusable(&p, ok, &headers(&[("cache-control", "max-age=5")])),
            Ok(())
        );
        // A 404 is heuristically cacheable; a 418 needs an explicit lifetime.
        let teapot = StatusCode::IM_A_TEAPOT;
        assert_eq!(
            reusable(&p, teapot, &headers(&[("etag", "\"a\"")])),
            Err(NotReused::Status)
        );
        assert_eq!(
            reusable(&p, teapot, &headers(&[("cache-control", "max-age=5")])),
            Ok(())
        );
        assert_eq!(
            reusable(
                &p,
                StatusCode::INTERNAL_SERVER_ERROR,
                &headers(&[("cache-control", "max-age=5")])
            ),
            Err(NotReused::Status)
        );
    }
}
