//! What a fill sends the origin: a GET of the keyed path and query, with the caller's
//! headers as a proxy forwards them (RFC 9110 §7.6), less what could poison the cache.

use http::header::{self, HeaderMap, HeaderName};
use http::{Method, Request, Uri};

use super::request::{host, keyed_query};
use crate::policy::{POISONING_HEADERS, Policy};

/// Hop-by-hop headers (RFC 9110 §7.6.1), and those that only make sense for the
/// client's own connection or body: never forwarded on a fill, never stored.
const HOP_BY_HOP: &[HeaderName] = &[
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
];

/// Request headers a fill never forwards: the request is a plain GET of the whole
/// representation, made for everyone, and these would make it something else (a
/// conditional or partial answer, a body).
const NOT_FOR_A_FILL: &[HeaderName] = &[
    header::CONTENT_LENGTH,
    header::CONTENT_TYPE,
    header::EXPECT,
    header::IF_MATCH,
    header::IF_NONE_MATCH,
    header::IF_MODIFIED_SINCE,
    header::IF_UNMODIFIED_SINCE,
    header::IF_RANGE,
    header::RANGE,
];

/// The request the origin gets when it fills (or refreshes) an entry: a GET of the path
/// and keyed query, with the host that was keyed (in the `Host` header, none when the
/// host is not keyed) and a relative URI.
///
/// Headers: by default, as a proxy forwards them (content negotiation, trace context and
/// request ids keep working), without hop-by-hop headers, without conditional, range and
/// body headers, and without [`POISONING_HEADERS`] unless keyed. With
/// `strict_forwarding`, only the keyed
/// headers and the route's `forward_headers`. Keyed and learned headers are always
/// forwarded, `Authorization` and `Cookie` only where the route allows them. Extensions
/// are copied unless the route says otherwise (by default, unless it forwards strictly).
pub(crate) fn fill_request<B, F: Default>(
    policy: &Policy,
    learned: &[HeaderName],
    request: &Request<B>,
) -> Request<F> {
    let given = request.headers();
    let mut headers = if policy.strict_forwarding {
        strictly_forwarded(policy, learned, given)
    } else {
        forwarded(policy, learned, given)
    };
    headers.remove(header::HOST);
    if (policy.key_host || learned.contains(&header::HOST))
        && let Some(host) = host(request).and_then(|h| http::HeaderValue::from_bytes(h).ok())
    {
        headers.insert(header::HOST, host);
    }
    let mut fill = Request::new(F::default());
    *fill.method_mut() = Method::GET;
    *fill.uri_mut() = fill_uri(policy, request.uri());
    *fill.version_mut() = request.version();
    *fill.headers_mut() = headers;
    if policy.forward_extensions() {
        *fill.extensions_mut() = request.extensions().clone();
    }
    fill
}

/// The URI a fill asks for: the path and the keyed query, sorted, whatever the mode
/// (what the origin sees of a query is what its answer is stored under: a parameter
/// left out of the key and passed on could put one caller's text in everyone's answer,
/// or, split otherwise by the origin, `?q=a&utm_x=1;q=b`, another answer under `q=a`),
/// relative (the host, if any,
/// travels in one place only, the `Host` header, and is the same value the key was made
/// of).
fn fill_uri(policy: &Policy, uri: &Uri) -> Uri {
    let mut path_and_query = uri.path().to_owned();
    let mut first = true;
    keyed_query(policy, uri, &mut |param| {
        path_and_query.push(if first { '?' } else { '&' });
        path_and_query.push_str(param);
        first = false;
    });
    Uri::builder()
        .path_and_query(path_and_query)
        .build()
        .unwrap_or_else(|_| Uri::from_static("/"))
}

/// With `strict_forwarding`: the keyed and learned headers, the route's
/// `forward_headers`, and `Authorization` and `Cookie` where the route allows them.
fn strictly_forwarded(policy: &Policy, learned: &[HeaderName], given: &HeaderMap) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(given.keys_len());
    // (The names a URL varies on include the route's keyed headers: each once.)
    let learned = learned.iter().filter(|n| !policy.key_headers.contains(n));
    for name in policy
        .key_headers
        .iter()
        .chain(learned)
        .chain(&policy.forward_headers)
    {
        // (A learned `Vary: Range` is not one: see `response::vary_names`.)
        if *name == header::RANGE || *name == header::IF_RANGE {
            continue;
        }
        for value in given.get_all(name) {
            headers.append(name.clone(), value.clone());
        }
    }
    for (name, allowed) in [
        (header::AUTHORIZATION, policy.allow_authorization),
        (header::COOKIE, policy.allow_cookies),
    ] {
        if allowed {
            for value in given.get_all(&name) {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    headers
}

/// By default: the headers as a proxy forwards them, less what is dropped (see
/// [`fill_request`]).
fn forwarded(policy: &Policy, learned: &[HeaderName], given: &HeaderMap) -> HeaderMap {
    let keyed = |name: &HeaderName| policy.key_headers.contains(name) || learned.contains(name);
    let mut headers = HeaderMap::with_capacity(given.keys_len());
    let listed = connection_listed(given);
    for (name, value) in given {
        let dropped = HOP_BY_HOP.contains(name)
            || NOT_FOR_A_FILL.contains(name)
            || name.as_str() == "keep-alive"
            || name.as_str() == "proxy-connection"
            // A keyed header stays even where `Connection` lists it: the entry is keyed
            // on it, so the fill must ask with it.
            || (listed.contains(name) && !keyed(name))
            || (*name == header::AUTHORIZATION && !policy.allow_authorization)
            || (*name == header::COOKIE && !policy.allow_cookies)
            || (POISONING_HEADERS.contains(&name.as_str()) && !keyed(name));
        if !dropped {
            headers.append(name.clone(), value.clone());
        }
    }
    headers
}

/// Removes the hop-by-hop headers (RFC 9110 §7.6.1) and those the `Connection` header
/// names: they describe one connection, never what is stored or sent on.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in connection_listed(headers) {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The headers a `Connection` header names: hop-by-hop for this connection only.
fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::request::tests::get;

    /// What a fill is given of the query, in every mode: the keyed parameters, sorted,
    /// and nothing else (never a dropped one, nor one hidden behind a `;`).
    #[test]
    fn a_fill_is_given_the_query_its_mode_says() {
        let uri = "/convert?utm_source=x&amount=5&cur=GBP";
        let given = |p: Policy| {
            let fill: Request<()> = fill_request(&p, &[], &get(uri).body(()).unwrap());
            fill.uri().to_string()
        };
        let b = || Policy::builder("convert");
        assert_eq!(
            given(b().drop_query(["utm_*"]).build().unwrap()),
            "/convert?amount=5&cur=GBP"
        );
        let hidden = "/convert?amount=5&utm_x=1;amount=9";
        let fill: Request<()> = fill_request(
            &b().drop_query(["utm_*"]).build().unwrap(),
            &[],
            &get(hidden).body(()).unwrap(),
        );
        assert_eq!(fill.uri(), "/convert?amount=5");
        assert_eq!(
            given(b().build().unwrap()),
            "/convert?amount=5&cur=GBP&utm_source=x"
        );
        assert_eq!(
            given(b().key_query(["cur"]).build().unwrap()),
            "/convert?cur=GBP"
        );
        assert_eq!(given(b().ignore_query().build().unwrap()), "/convert");
    }

    #[test]
    fn a_strict_fill_request_carries_only_what_is_keyed() {
        let p = Policy::builder("items")
            .key_query(["page"])
            .key_headers(["accept-language"])
            .forward_headers(["traceparent"])
            .strict_forwarding(true)
            .build()
            .unwrap();
        let request = get("/items?utm=x&page=2")
            .header("accept-language", "fr")
            .header("traceparent", "00-abc")
            .header("x-forwarded-host", "evil.example")
            .body(())
            .unwrap();
        let fill: Request<()> = fill_request(&p, &[], &request);
        // The names its URL varies on hold the keyed header too: still sent once.
        let varies = [HeaderName::from_static("accept-language")];
        let again: Request<()> = fill_request(&p, &varies, &request);
        assert_eq!(again.headers().get_all("accept-language").iter().count(), 1);
        assert_eq!(fill.method(), Method::GET);
        assert_eq!(fill.uri(), "/items?page=2");
        let mut names: Vec<&str> = fill.headers().keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["accept-language", "host", "traceparent"]);
        // The host that was keyed is the host the origin sees, whatever the request line.
        let absolute = Request::get("http://evil.example/items")
            .header("host", "shop.example")
            .body(())
            .unwrap();
        let fill: Request<()> = fill_request(&p, &[], &absolute);
        assert_eq!(fill.uri(), "/items");
        assert_eq!(fill.headers()["host"], "shop.example");
        // Never a range, even one a `Vary` named.
        let ranged = get("/items")
            .header("range", "bytes=0-1")
            .header("if-range", "\"v1\"")
            .body(())
            .unwrap();
        let fill: Request<()> = fill_request(&p, &[header::RANGE, header::IF_RANGE], &ranged);
        assert!(!fill.headers().contains_key(header::RANGE));
        assert!(!fill.headers().contains_key(header::IF_RANGE));
        let unkeyed = Policy::builder("items").key_host(false).build().unwrap();
        let fill: Request<()> = fill_request(&unkeyed, &[], &absolute);
        assert!(fill.headers().get("host").is_none());
    }

    #[test]
    fn a_keyed_header_stays_on_the_fill_even_if_connection_lists_it() {
        let p = Policy::builder("items")
            .key_headers(["accept-language"])
            .build()
            .unwrap();
        let request = get("/items")
            .header("accept-language", "de")
            .header("connection", "accept-language, x-hop")
            .header("x-hop", "gone")
            .body(())
            .unwrap();
        let fill: Request<()> = fill_request(&p, &[], &request);
        assert_eq!(fill.headers()["accept-language"], "de");
        assert!(!fill.headers().contains_key("x-hop"));
    }

    #[test]
    fn a_fill_request_forwards_as_a_proxy_does_without_poisoning_headers() {
        let p = Policy::builder("items").build().unwrap();
        let request = get("/items?page=2")
            .header("accept-language", "fr")
            .header("traceparent", "00-abc")
            .header("x-request-id", "r-1")
            .header("connection", "keep-alive, x-hop")
            .header("x-hop", "gone")
            .header("keep-alive", "timeout=5")
            .header("if-none-match", "\"v1\"")
            .header("range", "bytes=0-1")
            .header("x-forwarded-host", "evil.example")
            .header("X-Original-URL", "/admin")
            .header("forwarded", "host=evil.example")
            .body(())
            .unwrap();
        let fill: Request<()> = fill_request(&p, &[], &request);
        let mut names: Vec<&str> = fill.headers().keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            ["accept-language", "host", "traceparent", "x-request-id"]
        );
        // Keyed (or learned), a poisoning header is part of the key: then it is sent.
        let learned = [HeaderName::from_static("x-forwarded-host")];
        let fill: Request<()> = fill_request(&p, &learned, &request);
        assert_eq!(fill.headers()["x-forwarded-host"], "evil.example");
    }
}
