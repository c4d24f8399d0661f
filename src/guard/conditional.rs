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
use http::{HeaderMap, HeaderName, HeaderValue, Request};

use crate::cache::entry::CachedResponse;

/// Whether a client's request is a conditional one the cache may answer: it has
/// `If-None-Match` or `If-Modified-Since`. Checked on the request's one pass over its
/// header names (see `rules::classify`).
pub(crate) fn is_conditional(name: &HeaderName) -> bool {
    *name == IF_NONE_MATCH || *name == IF_MODIFIED_SINCE
}

/// Whether the request's condition says the client's copy is the entry's: `304`.
///
/// `If-None-Match` is evaluated with the weak comparison (RFC 9110 §13.1.2), `*`
/// matching any entry; only without it, `If-Modified-Since` against the entry's
/// `Last-Modified`, or its `Date` when it has none (RFC 9111 §4.3.2). Preconditions
/// are ignored for an entry that is not a 2xx (RFC 9110 §13.2.1).
pub(crate) fn not_modified(cached: &CachedResponse, request: &HeaderMap) -> bool {
    if !cached.status.is_success() {
        return false;
    }
    let mut none_match = request.get_all(IF_NONE_MATCH).iter().peekable();
    if none_match.peek().is_some() {
        let etag = cached.headers.get(ETAG).and_then(|v| v.to_str().ok());
        return none_match
            .filter_map(|v| v.to_str().ok())
            .flat_map(|list| list.split(','))
            .map(str::trim)
            .any(|tag| tag == "*" || etag.is_some_and(|etag| weak_eq(tag, etag)));
    }
    let Some(since) = request.get(IF_MODIFIED_SINCE).and_then(http_date) else {
        return false;
    };
    let modified = cached
        .headers
        .get(LAST_MODIFIED)
        .or_else(|| cached.headers.get(DATE))
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
    httpdate::parse_http_date(value.to_str().ok()?).ok()
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
pub(crate) fn ask_if_changed<B>(request: &mut Request<B>, cached: &CachedResponse) -> bool {
    if !cached.status.is_success() {
        return false;
    }
    let headers = request.headers_mut();
    let mut asked = false;
    if let Some(etag) = cached.headers.get(ETAG) {
        headers.insert(IF_NONE_MATCH, etag.clone());
        asked = true;
    }
    if let Some(modified) = cached.headers.get(LAST_MODIFIED) {
        headers.insert(IF_MODIFIED_SINCE, modified.clone());
        asked = true;
    }
    asked
}

/// Whether a `304` the origin sent is about the entry that was asked with: it names no
/// other strong validator (RFC 9111 §4.3.4: a 304 whose `ETag` differs renews nothing).
pub(crate) fn is_about(cached: &CachedResponse, not_modified: &HeaderMap) -> bool {
    match (
        not_modified.get(ETAG).and_then(|v| v.to_str().ok()),
        cached.headers.get(ETAG).and_then(|v| v.to_str().ok()),
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
    crate::rules::strip_unstorable(&mut updates);
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
        || crate::cache::is_set_by_the_layer(name)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::StatusCode;

    use super::*;
    use crate::lease::FencingToken;

    fn cached(headers: &[(&str, &str)]) -> CachedResponse {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        CachedResponse {
            status: StatusCode::OK,
            headers: map,
            body: Bytes::from_static(b"body"),
            fresh_for: Duration::from_secs(1),
            grace: Duration::ZERO,
            keep: Duration::from_secs(1),
            token: FencingToken::new(1),
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
                not_modified(&entry, &request(&[("if-none-match", asked)])),
                matches,
                "{asked}"
            );
        }
        // No ETag: only `*` matches.
        let plain = cached(&[]);
        assert!(!not_modified(
            &plain,
            &request(&[("if-none-match", "\"v1\"")])
        ));
        assert!(not_modified(&plain, &request(&[("if-none-match", "*")])));
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
            &entry,
            &request(&[("if-modified-since", later)])
        ));
        assert!(!not_modified(
            &entry,
            &request(&[("if-modified-since", earlier)])
        ));
        assert!(!not_modified(
            &entry,
            &request(&[("if-none-match", "\"v2\""), ("if-modified-since", later)])
        ));
        assert!(!not_modified(
            &entry,
            &request(&[("if-modified-since", "yesterday")])
        ));
    }

    #[test]
    fn only_a_success_answers_a_condition() {
        let mut entry = cached(&[("etag", "\"v1\"")]);
        entry.status = StatusCode::NOT_FOUND;
        assert!(!not_modified(&entry, &request(&[("if-none-match", "*")])));
    }

    #[test]
    fn a_refresh_asks_with_the_entry_validators() {
        let entry = cached(&[
            ("etag", "\"v1\""),
            ("last-modified", "Sun, 06 Nov 1994 08:49:37 GMT"),
        ]);
        let mut asking = Request::new(());
        assert!(ask_if_changed(&mut asking, &entry));
        assert_eq!(asking.headers()[IF_NONE_MATCH], "\"v1\"");
        assert_eq!(
            asking.headers()[IF_MODIFIED_SINCE],
            "Sun, 06 Nov 1994 08:49:37 GMT"
        );
        let mut plain = Request::new(());
        assert!(!ask_if_changed(&mut plain, &cached(&[])));
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
        assert!(is_about(&entry, &update));
        let renewed = renewed_headers(&entry.headers, &update);
        assert_eq!(renewed["cache-control"], "max-age=60");
        assert_eq!(renewed["content-length"], "4");
        // Metadata, updated (RFC 9111 §4.3.4).
        assert_eq!(renewed["content-type"], "text/html");
        assert_eq!(renewed["x-a"], "1");
        assert_eq!(renewed["x-b"], "2");
        assert!(!renewed.contains_key("connection"));
        assert_eq!(renewed.get_all("etag").iter().count(), 1);

        assert!(!is_about(&entry, &request(&[("etag", "\"v2\"")])));
        assert!(!is_about(&cached(&[]), &request(&[("etag", "\"v2\"")])));
        assert!(is_about(&entry, &request(&[])));
    }
}
