//! Requests refused at the door, before anything keys or forwards them: an HTTP/1.1
//! request without exactly one `Host` (RFC 9112 §3.2), and one whose headers hold more
//! than [`HEADERS_AT_MOST`] bytes (RFC 6585 §5, `431`). hyper refuses the rest of what
//! is malformed (two `Content-Length`s, line folding, a bad header name) itself, and
//! reads a request that says both `Content-Length` and `Transfer-Encoding` by the
//! latter, dropping the former (§6.1), so that the origin gets it re-framed, as one
//! request.

use http::{HeaderMap, Request, StatusCode, Version, header};

/// The most a request's header names and values may hold, together: 64 KiB (nginx's
/// default allows 32 KiB; no real client sends near either).
pub(crate) const HEADERS_AT_MOST: usize = 64 * 1024;

/// Why `request` is refused at the door, as the status it is answered with; `None`
/// when it may go on.
pub(crate) fn refused<B>(request: &Request<B>) -> Option<StatusCode> {
    let headers = request.headers();
    let size: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if size > HEADERS_AT_MOST {
        return Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    }
    if request.version() == Version::HTTP_11 && !one_host(headers) {
        return Some(StatusCode::BAD_REQUEST);
    }
    None
}

/// Exactly one `Host` line.
fn one_host(headers: &HeaderMap) -> bool {
    headers.get_all(header::HOST).iter().count() == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(version: Version, headers: &[(&str, &str)]) -> Request<()> {
        let mut request = Request::get("/items/1").version(version);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap()
    }

    #[test]
    fn what_rfc_9112_refuses_is_refused() {
        let host = ("host", "shop.example");
        assert_eq!(refused(&request(Version::HTTP_11, &[host])), None);
        assert_eq!(refused(&request(Version::HTTP_10, &[])), None);
        assert_eq!(refused(&request(Version::HTTP_2, &[])), None);
        let bad = StatusCode::BAD_REQUEST;
        assert_eq!(refused(&request(Version::HTTP_11, &[])), Some(bad));
        assert_eq!(
            refused(&request(Version::HTTP_11, &[host, ("host", "b")])),
            Some(bad)
        );
        let big = "a".repeat(HEADERS_AT_MOST);
        assert_eq!(
            refused(&request(Version::HTTP_11, &[host, ("x-big", &big)])),
            Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        );
    }
}
