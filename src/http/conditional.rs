//! Conditional requests, both ways.
//!
//! * **From clients**: a request with `If-None-Match` (or, without it,
//!   `If-Modified-Since`) whose condition the entry it is answered from meets gets
//!   `304 Not Modified` from the cache, without a body (RFC 9110 §13.1, RFC 9111 §4.3.2).
//! * **To the origin**: a refresh of an entry that has a validator (`ETag`,
//!   `Last-Modified`) asks the origin whether it changed; a `304` then renews the entry
//!   with the body it has (RFC 9111 §4.3.1, §4.3.4), and the origin sends no body.

use http::header::{
    CACHE_CONTROL, CONTENT_LOCATION, DATE, ETAG, EXPIRES, IF_MODIFIED_SINCE, IF_NONE_MATCH,
    LAST_MODIFIED, VARY,
};
use http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode};

use super::own_headers::is_set_by_the_layer;
use super::response::strip_unstorable;

/// Whether the request's condition says the client's copy is the entry's: `304`.
///
/// `If-None-Match` is evaluated with the weak comparison (RFC 9110 §13.1.2), `*`
/// matching any entry; only without it, `If-Modified-Since` against the entry's
/// `Last-Modified`, or its `Date` when it has none (RFC 9111 §4.3.2). Preconditions
/// are ignored for an entry that is not a 2xx (RFC 9110 §13.2.1).
pub(crate) fn not_modified(status: StatusCode, stored: &HeaderMap, request: &HeaderMap) -> bool {
    if !status.is_success() {
        return false;
    }
    let mut none_match = request.get_all(IF_NONE_MATCH).iter().peekable();
    if none_match.peek().is_some() {
        let etag = stored.get(ETAG).and_then(|v| v.to_str().ok());
        return none_match
            .filter_map(|v| v.to_str().ok())
            .flat_map(|list| list.split(','))
            .map(str::trim)
            .any(|tag| tag == "*" || etag.is_some_and(|etag| weak_eq(tag, etag)));
    }
    let Some(since) = request.get(IF_MODIFIED_SINCE).and_then(http_date) else {
        return false;
    };
    let modified = stored
        .get(LAST_MODIFIED)
        .or_else(|| stored.get(DATE))
        .and_then(http_date);
    modified.is_some_and(|modified| modified <= since)
}

/// The weak comparison of two entity tags: equal opaque tags, whether either is weak.
fn weak_eq(a: &str, b: &str) -> bool {
    let opaque = |tag: &str| tag.trim().trim_start_matches("W/").to_owned();
    let (a, b) = (opaque(a), opaque(b));
    a.starts_with('"') && a.len() >= 2 && a == b
}

fn http_date(value: &HeaderValue) -> Option<std::time::SystemTime> {
    super::date::parse(value)
}

/// The stored headers a `304` carries (RFC 9110 §15.4.5: those a 200 would have sent
/// among these, and `Last-Modified` to guide the client's cache).
pub(crate) const NOT_MODIFIED_HEADERS: [HeaderName; 7] = [
    CACHE_CONTROL,
    CONTENT_LOCATION,
    DATE,
    ETAG,
    EXPIRES,
    LAST_MODIFIED,
    VARY,
];

/// Makes a refresh's request conditional on the entry it refreshes: `If-None-Match`
/// with its `ETag`, `If-Modified-Since` with its `Last-Modified`. Returns whether the
/// entry had a validator to ask with.
pub(crate) fn ask_if_changed<B>(
    request: &mut Request<B>,
    status: StatusCode,
    stored: &HeaderMap,
) -> bool {
    if !status.is_success() {
        return false;
    }
    let headers = request.headers_mut();
    let mut asked = false;
    if let Some(etag) = stored.get(ETAG) {
        headers.insert(IF_NONE_MATCH, etag.clone());
        asked = true;
    }
    if let Some(modified) = stored.get(LAST_MODIFIED) {
        headers.insert(IF_MODIFIED_SINCE, modified.clone());
        asked = true;
    }
    asked
}

/// Whether a `304` the origin sent is about the entry that was asked with: it names no
/// other strong validator (RFC 9111 §4.3.4: a 304 whose `ETag` differs renews nothing).
pub(crate) fn is_about(stored: &HeaderMap, not_modified: &HeaderMap) -> bool {
    match (
        not_modified.get(ETAG).and_then(|v| v.to_str().ok()),
        stored.get(ETAG).and_then(|v| v.to_str().ok()),
    ) {
        (Some(theirs), Some(ours)) => weak_eq(theirs, ours),
        // A 304 with an ETag for an entry that had none: not the entry asked about.
        (Some(_), None) => false,
        (None, _) => true,
    }
}

/// The headers of an entry renewed by a `304` (RFC 9111 §4.3.4): the stored ones, each
/// replaced by the `304`'s fields of the same name, except those that describe the body
/// the `304` did not send, hop-by-hop ones and those the layer sets itself.
pub(crate) fn renewed_headers(stored: &HeaderMap, not_modified: &HeaderMap) -> HeaderMap {
    let mut headers = stored.clone();
    let mut updates = not_modified.clone();
    strip_unstorable(&mut updates);
    for name in updates.keys() {
        if keeps_stored(name) {
            continue;
        }
        headers.remove(name);
    }
    for (name, value) in &updates {
        if !keeps_stored(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    headers
}

/// What a `304` cannot change: the fields that describe the stored body's bytes (its
/// length, coding, range and digests: RFC 9111 §3.2 leaves `Content-Length` alone, and
/// a digest in a 304 is of a body it did not send).
fn keeps_stored(name: &HeaderName) -> bool {
    use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_RANGE};
    *name == CONTENT_LENGTH
        || *name == CONTENT_ENCODING
        || *name == CONTENT_RANGE
        || matches!(
            name.as_str(),
            "content-md5" | "digest" | "content-digest" | "repr-digest"
        )
        || is_set_by_the_layer(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the functions read of a stored entry.
    struct Cached {
        status: StatusCode,
        headers: HeaderMap,
    }

    fn cached(headers: &[(&str, &str)]) -> Cached {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        Cached {
            status: StatusCode::OK,
            headers: map,
        }
    }

    fn request(headers: &[(&str, &str)]) -> HeaderMap {
        cached(headers).headers
    }

    #[test]
    fn if_none_match_uses_the_weak_comparison() {
        let entry = cached(&[("etag", "W/\"v1\"")]);
        for (asked, matches) in [
            ("\"v1\"", true),
            ("W/\"v1\"", true),
            ("\"v2\", W/\"v1\"", true),
            ("*", true),
            ("\"v2\"", false),
            ("v1", false),
            ("", false),
        ] {
            assert_eq!(
                not_modified(
                    entry.status,
                    &entry.headers,
                    &request(&[("if-none-match", asked)])
                ),
                matches,
                "{asked}"
            );
        }
        // No ETag: only `*` matches.
        let plain = cached(&[]);
        assert!(!not_modified(
            plain.status,
            &plain.headers,
            &request(&[("if-none-match", "\"v1\"")])
        ));
        assert!(not_modified(
            plain.status,
            &plain.headers,
            &request(&[("if-none-match", "*")])
        ));
    }

    #[test]
    fn if_modified_since_is_ignored_when_if_none_match_is_there() {
        let entry = cached(&[
            ("etag", "\"v1\""),
            ("last-modified", "Sun, 06 Nov 1994 08:49:37 GMT"),
        ]);
        let later = "Mon, 07 Nov 1994 08:49:37 GMT";
        let earlier = "Sat, 05 Nov 1994 08:49:37 GMT";
        assert!(not_modified(
            entry.status,
            &entry.headers,
            &request(&[("if-modified-since", later)])
        ));
        assert!(!not_modified(
            entry.status,
            &entry.headers,
            &request(&[("if-modified-since", earlier)])
        ));
        assert!(!not_modified(
            entry.status,
            &entry.headers,
            &request(&[("if-none-match", "\"v2\""), ("if-modified-since", later)])
        ));
        assert!(!not_modified(
            entry.status,
            &entry.headers,
            &request(&[("if-modified-since", "yesterday")])
        ));
    }

    #[test]
    fn only_a_success_answers_a_condition() {
        let mut entry = cached(&[("etag", "\"v1\"")]);
        entry.status = StatusCode::NOT_FOUND;
        assert!(!not_modified(
            entry.status,
            &entry.headers,
            &request(&[("if-none-match", "*")])
        ));
    }

    #[test]
    fn a_refresh_asks_with_the_entry_validators() {
        let entry = cached(&[
            ("etag", "\"v1\""),
            ("last-modified", "Sun, 06 Nov 1994 08:49:37 GMT"),
        ]);
        let mut asking = Request::new(());
        assert!(ask_if_changed(&mut asking, entry.status, &entry.headers));
        assert_eq!(asking.headers()[IF_NONE_MATCH], "\"v1\"");
        assert_eq!(
            asking.headers()[IF_MODIFIED_SINCE],
            "Sun, 06 Nov 1994 08:49:37 GMT"
        );
        let mut plain = Request::new(());
        let none = cached(&[]);
        assert!(!ask_if_changed(&mut plain, none.status, &none.headers));
        assert!(plain.headers().is_empty());
    }

    #[test]
    fn a_304_renews_what_it_names_but_not_the_body_fields() {
        let entry = cached(&[
            ("etag", "\"v1\""),
            ("content-type", "text/plain"),
            ("content-length", "4"),
            ("cache-control", "max-age=1"),
            ("x-a", "1"),
        ]);
        let update = request(&[
            ("etag", "\"v1\""),
            ("cache-control", "max-age=60"),
            ("content-length", "0"),
            ("content-type", "text/html"),
            ("connection", "close"),
            ("x-b", "2"),
        ]);
        assert!(is_about(&entry.headers, &update));
        let renewed = renewed_headers(&entry.headers, &update);
        assert_eq!(renewed["cache-control"], "max-age=60");
        assert_eq!(renewed["content-length"], "4");
        // Metadata, updated (RFC 9111 §4.3.4).
        assert_eq!(renewed["content-type"], "text/html");
        assert_eq!(renewed["x-a"], "1");
        assert_eq!(renewed["x-b"], "2");
        assert!(!renewed.contains_key("connection"));
        assert_eq!(renewed.get_all("etag").iter().count(), 1);

        assert!(!is_about(&entry.headers, &request(&[("etag", "\"v2\"")])));
        assert!(!is_about(
            &cached(&[]).headers,
            &request(&[("etag", "\"v2\"")])
        ));
        assert!(is_about(&entry.headers, &request(&[])));
    }
}
