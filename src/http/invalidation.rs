//! Invalidation by unsafe methods (RFC 9111 §4.4): a successful `POST`, `PUT`, `PATCH`
//! or `DELETE` changes what its URI names, and may say in `Location` and
//! `Content-Location` what else it changed; a cache drops what it holds of them. Only
//! URIs of the same origin are dropped, so that an answer cannot evict another site's
//! entries.

use http::header::{CONTENT_LOCATION, HOST, LOCATION};
use http::{Method, Request, Response, Uri};

/// Whether a request of `method` changes what its URI names, when it succeeds.
pub(crate) fn changes(method: &Method) -> bool {
    !method.is_safe()
}

/// What a request changes: its URI and headers (its host among them), as a `GET` of it
/// would be keyed.
pub(crate) fn target<B>(request: &Request<B>) -> Request<()> {
    let mut target = Request::new(());
    *target.uri_mut() = request.uri().clone();
    *target.headers_mut() = request.headers().clone();
    target
}

/// What a request to `target` changed, from its `response`: `None` if it did not
/// succeed (2xx, 3xx); else the same-origin URIs the answer names in `Location` and
/// `Content-Location`, besides the target's own.
pub(crate) fn changed_uris<B>(target: &Request<()>, response: &Response<B>) -> Option<Vec<Uri>> {
    let status = response.status();
    if !(status.is_success() || status.is_redirection()) {
        return None;
    }
    Some(
        [LOCATION, CONTENT_LOCATION]
            .iter()
            .filter_map(|name| response.headers().get(name))
            .filter_map(|value| value.to_str().ok())
            .filter_map(|value| value.parse::<Uri>().ok())
            .filter(|uri| same_origin(uri, target))
            .collect(),
    )
}

/// The URI of `named`'s path and query under the authority `target` had (if its URI
/// carried one, as HTTP/2's do): keyed as a `GET` of it would be. `None` for a URI
/// with no path.
pub(crate) fn named_uri(target: &Request<()>, named: &Uri) -> Option<Uri> {
    let mut parts = target.uri().clone().into_parts();
    parts.path_and_query = Some(named.path_and_query()?.clone());
    Uri::from_parts(parts).ok()
}

/// Whether `uri` (from a `Location`) names the origin `request` went to: a path, or an
/// absolute URI of the same host.
fn same_origin(uri: &Uri, request: &Request<()>) -> bool {
    let Some(authority) = uri.authority() else {
        return uri.path().starts_with('/');
    };
    let host = request
        .headers()
        .get(HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| request.uri().authority().map(http::uri::Authority::as_str));
    host.is_some_and(|host| host.eq_ignore_ascii_case(authority.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post(uri: &str, host: &str) -> Request<()> {
        let request = Request::post(uri).header(HOST, host).body(()).unwrap();
        target(&request)
    }

    fn answer(status: u16, headers: &[(http::HeaderName, &str)]) -> Response<()> {
        let mut response = Response::builder().status(status);
        for (name, value) in headers {
            response = response.header(name, *value);
        }
        response.body(()).unwrap()
    }

    #[test]
    fn only_unsafe_methods_change_what_they_name() {
        for method in [Method::POST, Method::PUT, Method::PATCH, Method::DELETE] {
            assert!(changes(&method), "{method}");
        }
        for method in [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE] {
            assert!(!changes(&method), "{method}");
        }
    }

    #[test]
    fn a_failed_request_changed_nothing() {
        let target = post("/items/1", "shop.example");
        for status in [400, 404, 500, 503] {
            assert!(
                changed_uris(&target, &answer(status, &[])).is_none(),
                "{status}"
            );
        }
        for status in [200, 201, 204, 303] {
            assert_eq!(changed_uris(&target, &answer(status, &[])), Some(vec![]));
        }
    }

    #[test]
    fn the_uris_named_are_changed_when_they_are_of_the_same_origin() {
        let target = post("/items", "Shop.example");
        let named = changed_uris(
            &target,
            &answer(
                201,
                &[
                    (LOCATION, "/items/7"),
                    (CONTENT_LOCATION, "http://shop.example/items/7?v=2"),
                ],
            ),
        )
        .unwrap();
        assert_eq!(named.len(), 2);
        for foreign in ["http://other.example/items/7", "items/7", "not a uri"] {
            let named = changed_uris(&target, &answer(201, &[(LOCATION, foreign)])).unwrap();
            assert!(named.is_empty(), "{foreign}");
        }
    }

    #[test]
    fn a_named_uri_keeps_the_targets_authority() {
        let request = Request::post("https://shop.example/items")
            .body(())
            .unwrap();
        let target = target(&request);
        let named = named_uri(&target, &"http://shop.example/items/7?v=2".parse().unwrap());
        assert_eq!(
            named.unwrap().to_string(),
            "https://shop.example/items/7?v=2"
        );
        let relative = post("/items", "shop.example");
        let named = named_uri(&relative, &"/items/8".parse().unwrap()).unwrap();
        assert_eq!(named.to_string(), "/items/8");
    }
}
