//! Range requests (RFC 9110 §14), answered from a whole body the cache has.
//!
//! * One byte range of a `200` (`bytes=0-9`, `bytes=5-`, `bytes=-5`) is answered `206
//!   Partial Content` with its `Content-Range`; an end past the body's is clamped to it
//!   (§14.1.1). A range that starts at or past the end (or `bytes=-0`) is answered `416
//!   Range Not Satisfiable` with `Content-Range: bytes */LEN` (§15.5.17).
//! * Several ranges (`bytes=0-1,5-6`) are answered with the whole `200`: a server may
//!   ignore `Range` (§14.2), and a cache that did not would have to build a
//!   `multipart/byteranges` body, which few clients ask for.
//! * A `Range` that is not valid syntax, of a unit other than `bytes`, or given on more
//!   than one field line, is ignored: the whole `200` (§14.2).
//! * `If-Range` (§13.1.5): the range is applied only if the validator it carries is the
//!   answer's, by the strong comparison (an entity tag), or exactly its strong
//!   `Last-Modified` (a date); else the whole `200`.
//! * Only a GET's (the caller checks) and only of a `200` (§14.2: other statuses are
//!   never sliced).
//!
//! The cache never keys on `Range` nor sends it on a fill: the origin is asked for the
//! whole representation, which is stored, and each range is cut from it.

use http::StatusCode;
use http::header::{self, HeaderMap, HeaderValue};

/// What a request's `Range` makes of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The whole answer, as it is.
    Whole,
    /// `206`: the bytes from `first` to `last`, both included, of `len`.
    Bytes { first: u64, last: u64, len: u64 },
    /// `416`: no byte of the `len` asked for exists.
    Unsatisfiable { len: u64 },
}

/// A request's `Range` (and `If-Range`), kept as it came for the answer it gets.
#[derive(Debug, Clone)]
pub(crate) struct Ranged {
    range: HeaderValue,
    if_range: Option<HeaderValue>,
}

impl Ranged {
    /// The range a request asks for; `None` without `Range`, or with more than one
    /// field line of it (not valid: ignored).
    pub(crate) fn of(request: &HeaderMap) -> Option<Self> {
        let mut values = request.get_all(header::RANGE).iter();
        let range = values.next()?.clone();
        if values.next().is_some() {
            return None;
        }
        Some(Self {
            range,
            if_range: request.get(header::IF_RANGE).cloned(),
        })
    }

    /// What the range makes of an answer with `status` and `headers` whose body is
    /// `len` bytes.
    pub(crate) fn part(&self, status: StatusCode, headers: &HeaderMap, len: u64) -> Part {
        if status != StatusCode::OK {
            return Part::Whole;
        }
        let Some(spec) = parse(self.range.as_bytes()) else {
            return Part::Whole;
        };
        if let Some(validator) = &self.if_range
            && !validator_matches(validator, headers)
        {
            return Part::Whole;
        }
        spec.of(len)
    }
}

/// One range of a `Range` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spec {
    /// `first-` or `first-last`.
    From { first: u64, last: Option<u64> },
    /// `-suffix`: the last `suffix` bytes.
    Suffix(u64),
}

impl Spec {
    fn of(self, len: u64) -> Part {
        match self {
            Self::From { first, .. } if first >= len => Part::Unsatisfiable { len },
            Self::From { first, last } => Part::Bytes {
                first,
                last: last.map_or(len - 1, |last| last.min(len - 1)),
                len,
            },
            Self::Suffix(0) => Part::Unsatisfiable { len },
            // Nothing to cut from an empty body: it is the whole of any suffix.
            Self::Suffix(_) if len == 0 => Part::Whole,
            Self::Suffix(suffix) => Part::Bytes {
                first: len.saturating_sub(suffix),
                last: len - 1,
                len,
            },
        }
    }
}

/// The single byte range a `Range` value asks for (RFC 9110 §14.1.2); `None` for
/// several ranges, another unit, or a value that is not valid (`last` before `first`
/// included).
fn parse(value: &[u8]) -> Option<Spec> {
    let value = std::str::from_utf8(value).ok()?;
    let (unit, set) = value.split_once('=')?;
    if !unit.eq_ignore_ascii_case("bytes") {
        return None;
    }
    // `1#range-spec`: empty list elements are allowed, and skipped.
    let mut specs = set
        .split(',')
        .map(|s| s.trim_matches([' ', '\t']))
        .filter(|s| !s.is_empty());
    let spec = specs.next()?;
    if specs.next().is_some() {
        return None;
    }
    let (first, last) = spec.split_once('-')?;
    if first.is_empty() {
        return Some(Spec::Suffix(digits(last)?));
    }
    let first = digits(first)?;
    let last = if last.is_empty() {
        None
    } else {
        Some(digits(last)?)
    };
    if last.is_some_and(|last| last < first) {
        return None;
    }
    Some(Spec::From { first, last })
}

/// `1*DIGIT`, saturating: a position past what a `u64` holds is past any body.
fn digits(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(text.bytes().fold(0u64, |n, b| {
        n.saturating_mul(10).saturating_add(u64::from(b - b'0'))
    }))
}

/// Whether an `If-Range` validator is the answer's (RFC 9110 §13.1.5): an entity tag by
/// the strong comparison (a weak tag never matches), a date only as the answer's exact
/// `Last-Modified`, and only when that is a strong validator (at least a second before
/// its `Date`, §8.8.2.2; without a `Date`, it is not).
fn validator_matches(validator: &HeaderValue, answer: &HeaderMap) -> bool {
    let Ok(validator) = validator.to_str() else {
        return false;
    };
    let validator = validator.trim();
    if validator.starts_with('"') || validator.starts_with("W/") {
        let etag = answer.get(header::ETAG).and_then(|v| v.to_str().ok());
        return validator.starts_with('"')
            && validator.len() >= 2
            && validator.ends_with('"')
            && etag.is_some_and(|etag| etag.trim() == validator);
    }
    let date = |name| {
        answer
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
            .and_then(|v| httpdate::parse_http_date(v).ok())
    };
    let (Ok(asked), Some(modified)) = (
        httpdate::parse_http_date(validator),
        date(header::LAST_MODIFIED),
    ) else {
        return false;
    };
    // Without a `Date` to compare it with, a `Last-Modified` is weak (§8.8.2.2): an
    // answer made within the second it names may have changed since.
    let strong = date(header::DATE).is_some_and(|date| {
        date.duration_since(modified)
            .is_ok_and(|gap| gap.as_secs() >= 1)
    });
    asked == modified && strong
}

/// The `Content-Range` of a `206` (RFC 9110 §14.4).
pub(crate) fn content_range(first: u64, last: u64, len: u64) -> HeaderValue {
    HeaderValue::try_from(format!("bytes {first}-{last}/{len}"))
        .expect("digits are a valid header value")
}

/// The `Content-Range` of a `416`: what the whole is (RFC 9110 §14.4).
pub(crate) fn unsatisfied_range(len: u64) -> HeaderValue {
    HeaderValue::try_from(format!("bytes */{len}")).expect("digits are a valid header value")
}

/// Says, in the headers of an entry of `status`, that the cache answers byte ranges of
/// it (RFC 9110 §14.3): every `200` it stores, whatever the origin said.
pub(crate) fn advertise(status: StatusCode, headers: &mut HeaderMap) {
    if status == StatusCode::OK {
        headers.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(range: &str, if_range: Option<&str>) -> Ranged {
        let mut headers = HeaderMap::new();
        headers.insert(header::RANGE, HeaderValue::from_str(range).unwrap());
        if let Some(v) = if_range {
            headers.insert(header::IF_RANGE, HeaderValue::from_str(v).unwrap());
        }
        Ranged::of(&headers).unwrap()
    }

    fn part_of(range: &str, len: u64) -> Part {
        asked(range, None).part(StatusCode::OK, &HeaderMap::new(), len)
    }

    fn bytes(first: u64, last: u64, len: u64) -> Part {
        Part::Bytes { first, last, len }
    }

    #[test]
    fn one_range_of_each_form() {
        assert_eq!(part_of("bytes=0-9", 100), bytes(0, 9, 100));
        assert_eq!(part_of("bytes=-5", 100), bytes(95, 99, 100));
        assert_eq!(part_of("bytes=5-", 100), bytes(5, 99, 100));
        assert_eq!(part_of("bytes=5-5", 100), bytes(5, 5, 100));
        // The unit is case-insensitive; whitespace around a list element is allowed, as
        // are empty elements.
        assert_eq!(part_of("Bytes= 0-9 ,", 100), bytes(0, 9, 100));
    }

    #[test]
    fn over_long_ends_clamp() {
        assert_eq!(part_of("bytes=0-999", 100), bytes(0, 99, 100));
        assert_eq!(part_of("bytes=-500", 100), bytes(0, 99, 100));
        assert_eq!(
            part_of("bytes=90-99999999999999999999999999", 100),
            bytes(90, 99, 100)
        );
        assert_eq!(
            part_of("bytes=-99999999999999999999999999", 100),
            bytes(0, 99, 100)
        );
    }

    #[test]
    fn ranges_past_the_end_are_not_satisfiable() {
        for range in [
            "bytes=100-",
            "bytes=100-200",
            "bytes=-0",
            "bytes=99999999999999999999-",
        ] {
            assert_eq!(
                part_of(range, 100),
                Part::Unsatisfiable { len: 100 },
                "{range}"
            );
        }
        assert_eq!(part_of("bytes=0-", 0), Part::Unsatisfiable { len: 0 });
        // An empty body is the whole of any suffix.
        assert_eq!(part_of("bytes=-5", 0), Part::Whole);
    }

    #[test]
    fn invalid_syntax_and_several_ranges_are_ignored() {
        for range in [
            "bytes=",
            "bytes=,",
            "bytes=-",
            "bytes=a-b",
            "bytes=5-1",
            "bytes=0-9-",
            "bytes=+1-2",
            "bytes = 0-9",
            "bytes 0-9",
            "0-9",
            "items=0-9",
            "bytes=0x1-2",
            "bytes=0-1,5-6",
            "bytes=0-1, -5",
        ] {
            assert_eq!(part_of(range, 100), Part::Whole, "{range}");
        }
        // On two field lines.
        let mut two = HeaderMap::new();
        two.append(header::RANGE, HeaderValue::from_static("bytes=0-1"));
        two.append(header::RANGE, HeaderValue::from_static("bytes=2-3"));
        assert!(Ranged::of(&two).is_none());
        assert!(Ranged::of(&HeaderMap::new()).is_none());
    }

    #[test]
    fn only_a_200_is_sliced() {
        for status in [
            StatusCode::NOT_FOUND,
            StatusCode::PARTIAL_CONTENT,
            StatusCode::NO_CONTENT,
        ] {
            assert_eq!(
                asked("bytes=0-1", None).part(status, &HeaderMap::new(), 100),
                Part::Whole
            );
        }
    }

    #[test]
    fn if_range_applies_the_range_only_to_its_validator() {
        let mut answer = HeaderMap::new();
        answer.insert(header::ETAG, HeaderValue::from_static("\"v1\""));
        answer.insert(
            header::LAST_MODIFIED,
            HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT"),
        );
        answer.insert(
            header::DATE,
            HeaderValue::from_static("Mon, 07 Nov 1994 08:49:37 GMT"),
        );
        let part = |if_range: &str, answer: &HeaderMap| {
            asked("bytes=0-1", Some(if_range)).part(StatusCode::OK, answer, 10)
        };
        assert_eq!(part("\"v1\"", &answer), bytes(0, 1, 10));
        assert_eq!(part("\"v2\"", &answer), Part::Whole);
        // The strong comparison: a weak tag never matches.
        assert_eq!(part("W/\"v1\"", &answer), Part::Whole);
        assert_eq!(
            part("Sun, 06 Nov 1994 08:49:37 GMT", &answer),
            bytes(0, 1, 10)
        );
        assert_eq!(part("Sun, 06 Nov 1994 08:49:38 GMT", &answer), Part::Whole);
        assert_eq!(part("not a validator", &answer), Part::Whole);

        let mut weak = answer.clone();
        weak.insert(header::ETAG, HeaderValue::from_static("W/\"v1\""));
        assert_eq!(part("W/\"v1\"", &weak), Part::Whole);
        assert_eq!(part("\"v1\"", &weak), Part::Whole);
        // A `Last-Modified` as late as the answer's `Date` is weak: no date matches it.
        weak.insert(
            header::DATE,
            HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT"),
        );
        assert_eq!(part("Sun, 06 Nov 1994 08:49:37 GMT", &weak), Part::Whole);
        // Without a `Date`, a `Last-Modified` is weak too (as in most answers a
        // library's handler makes): the whole answer.
        weak.remove(header::DATE);
        assert_eq!(part("Sun, 06 Nov 1994 08:49:37 GMT", &weak), Part::Whole);
        // Without validators, nothing matches.
        assert_eq!(part("\"v1\"", &HeaderMap::new()), Part::Whole);
    }

    #[test]
    fn content_ranges_and_accept_ranges() {
        assert_eq!(content_range(0, 9, 100), "bytes 0-9/100");
        assert_eq!(unsatisfied_range(100), "bytes */100");
        let mut headers = HeaderMap::new();
        headers.insert(header::ACCEPT_RANGES, HeaderValue::from_static("none"));
        advertise(StatusCode::OK, &mut headers);
        assert_eq!(headers[header::ACCEPT_RANGES], "bytes");
        let mut not_found = HeaderMap::new();
        advertise(StatusCode::NOT_FOUND, &mut not_found);
        assert!(not_found.is_empty());
    }
}
