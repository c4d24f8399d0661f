//! The HTTP caching rules: which requests may be answered from the cache, what tells
//! requests apart, what the origin sees when it fills an entry, and which responses may
//! be stored or shared.

use http::header::{self, HeaderMap, HeaderName};
use http::{Method, Request, Response, StatusCode, Uri};

use crate::policy::{KeyQuery, Policy};

/// The methods the cache answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Get,
    /// Answered from the GET entry, without a body.
    Head,
}

/// Why a request goes straight to the origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bypass {
    Method,
    Authorization,
    Cookie,
}

impl Bypass {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Method => "method",
            Self::Authorization => "authorization",
            Self::Cookie => "cookie",
        }
    }
}

pub(crate) fn classify<B>(policy: &Policy, request: &Request<B>) -> Result<Kind, Bypass> {
    let kind = match *request.method() {
        Method::GET => Kind::Get,
        Method::HEAD => Kind::Head,
        _ => return Err(Bypass::Method),
    };
    let headers = request.headers();
    if headers.contains_key(header::AUTHORIZATION) && !policy.allow_authorization {
        return Err(Bypass::Authorization);
    }
    if headers.contains_key(header::COOKIE) && !policy.allow_cookies {
        return Err(Bypass::Cookie);
    }
    Ok(kind)
}

/// Everything that tells requests of a route apart, as bytes to be hashed: the host (if
/// keyed), the path, the keyed query parameters (sorted) and the keyed headers. Each
/// part is length-prefixed, so no two different requests give the same bytes.
pub(crate) fn identity<B>(policy: &Policy, request: &Request<B>) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    let mut part = |bytes: &[u8]| {
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(bytes);
    };
    part(b"v1");
    if policy.key_host {
        part(host(request).unwrap_or_default().as_bytes());
    }
    part(request.uri().path().as_bytes());
    for param in keyed_query(policy, request.uri()) {
        part(param.as_bytes());
    }
    for name in &policy.key_headers {
        part(name.as_str().as_bytes());
        let values = request.headers().get_all(name);
        let mut count = 0u32;
        for value in values {
            part(value.as_bytes());
            count += 1;
        }
        part(&count.to_le_bytes());
    }
    out
}

fn host<B>(request: &Request<B>) -> Option<&str> {
    request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()))
}

/// The keyed query parameters (`name=value` as they came), sorted.
fn keyed_query<'a>(policy: &Policy, uri: &'a Uri) -> Vec<&'a str> {
    let Some(query) = uri.query() else {
        return Vec::new();
    };
    let mut params: Vec<&str> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .filter(|p| {
            let name = p.split_once('=').map_or(*p, |(name, _)| name);
            match &policy.key_query {
                KeyQuery::All => true,
                KeyQuery::Only(names) => names.iter().any(|n| n == name),
                KeyQuery::Ignore => false,
            }
        })
        .collect();
    params.sort_unstable();
    params
}

/// The request the origin gets when it fills an entry: a GET of the path and keyed
/// query, carrying only the keyed headers (and the route's forwarded ones, and
/// `Authorization`/`Cookie` where the route allows them), so that nothing outside the key
/// can shape what is stored for everyone. The host is the one that was keyed, in the
/// Host header (none when the host is not keyed); the URI is relative. Extensions are
/// copied only where the route says so.
pub(crate) fn fill_request<B, F: Default>(policy: &Policy, request: &Request<B>) -> Request<F> {
    let uri = request.uri();
    let query = keyed_query(policy, uri);
    let path_and_query = if query.is_empty() {
        uri.path().to_owned()
    } else {
        format!("{}?{}", uri.path(), query.join("&"))
    };
    // Relative: the host, if any, travels in one place only, the Host header, and is the
    // same value the key was made of.
    let new_uri = Uri::builder()
        .path_and_query(path_and_query)
        .build()
        .unwrap_or_else(|_| Uri::from_static("/"));

    let mut headers = HeaderMap::new();
    if policy.key_host
        && let Some(host) = host(request).and_then(|h| http::HeaderValue::from_str(h).ok())
    {
        headers.insert(header::HOST, host);
    }
    let mut copy = |name: &HeaderName| {
        for value in request.headers().get_all(name) {
            headers.append(name.clone(), value.clone());
        }
    };
    for name in policy.key_headers.iter().chain(&policy.forward_headers) {
        copy(name);
    }
    if policy.allow_authorization {
        copy(&header::AUTHORIZATION);
    }
    if policy.allow_cookies {
        copy(&header::COOKIE);
    }
    let mut fill = Request::new(F::default());
    *fill.method_mut() = Method::GET;
    *fill.uri_mut() = new_uri;
    *fill.version_mut() = request.version();
    *fill.headers_mut() = headers;
    if policy.forward_extensions {
        *fill.extensions_mut() = request.extensions().clone();
    }
    fill
}

/// Why a response is not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotStored {
    Status,
    SetCookie,
    Private,
    NoStore,
    NoCache,
    VaryStar,
    VaryUnkeyed,
    TooLarge,
    Trailers,
}

impl NotStored {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Status => "status",
            Self::SetCookie => "set_cookie",
            Self::Private => "private",
            Self::NoStore => "no_store",
            Self::NoCache => "no_cache",
            Self::VaryStar => "vary_star",
            Self::VaryUnkeyed => "vary_unkeyed",
            Self::TooLarge => "too_large",
            Self::Trailers => "trailers",
        }
    }

    /// Whether the response is for its own caller only: never stored, never handed to
    /// another caller.
    pub(crate) fn is_private(self) -> bool {
        matches!(
            self,
            Self::SetCookie | Self::Private | Self::NoStore | Self::VaryStar | Self::VaryUnkeyed
        )
    }
}

/// Whether a response may be stored, by its status and headers.
pub(crate) fn storable<B>(policy: &Policy, response: &Response<B>) -> Result<(), NotStored> {
    let headers = response.headers();
    if headers.contains_key(header::SET_COOKIE) {
        return Err(NotStored::SetCookie);
    }
    for value in headers.get_all(header::CACHE_CONTROL) {
        let Ok(value) = value.to_str() else {
            return Err(NotStored::Private);
        };
        for directive in value.split(',') {
            let name = directive
                .split('=')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            match name.as_str() {
                "private" => return Err(NotStored::Private),
                "no-store" => return Err(NotStored::NoStore),
                "no-cache" => return Err(NotStored::NoCache),
                _ => {}
            }
        }
    }
    for value in headers.get_all(header::VARY) {
        let Ok(value) = value.to_str() else {
            return Err(NotStored::VaryStar);
        };
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "*" {
                return Err(NotStored::VaryStar);
            }
            let keyed = policy
                .key_headers
                .iter()
                .any(|k| k.as_str().eq_ignore_ascii_case(name))
                || (name.eq_ignore_ascii_case("host") && policy.key_host);
            if !keyed {
                return Err(NotStored::VaryUnkeyed);
            }
        }
    }
    if !policy.is_cacheable_status(response.status()) {
        return Err(NotStored::Status);
    }
    Ok(())
}

/// Whether the origin failed, as stale-if-error sees it.
pub(crate) fn is_failure(status: StatusCode) -> bool {
    status.is_server_error()
}

/// Headers that describe one connection, or that the layer sets itself: never stored.
pub(crate) fn strip_unstorable(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in listed {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::TE,
        header::TRAILER,
        header::UPGRADE,
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::AGE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
    headers.remove(crate::X_CACHE);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy::builder("items")
            .key_headers(["accept-language"])
            .build()
            .unwrap()
    }

    fn get(uri: &str) -> http::request::Builder {
        Request::get(uri).header("host", "example.com")
    }

    #[test]
    fn query_order_does_not_matter_and_keyed_headers_do() {
        let p = policy();
        let a = get("/items?a=1&b=2").body(()).unwrap();
        let b = get("/items?b=2&a=1").body(()).unwrap();
        assert_eq!(identity(&p, &a), identity(&p, &b));
        let fr = get("/items")
            .header("accept-language", "fr")
            .body(())
            .unwrap();
        let de = get("/items")
            .header("accept-language", "de")
            .body(())
            .unwrap();
        assert_ne!(identity(&p, &fr), identity(&p, &de));
        let evil = get("/items")
            .header("x-forwarded-host", "evil")
            .body(())
            .unwrap();
        let plain = get("/items").body(()).unwrap();
        assert_eq!(identity(&p, &evil), identity(&p, &plain));
        let other_host = Request::get("/items")
            .header("host", "other")
            .body(())
            .unwrap();
        assert_ne!(identity(&p, &other_host), identity(&p, &plain));
    }

    #[test]
    fn parts_cannot_run_into_each_other() {
        let p = Policy::builder("items").build().unwrap();
        let a = get("/items?ab=c").body(()).unwrap();
        let b = get("/items?a=bc").body(()).unwrap();
        assert_ne!(identity(&p, &a), identity(&p, &b));
    }

    #[test]
    fn the_fill_request_carries_only_what_is_keyed() {
        let p = Policy::builder("items")
            .key_query(KeyQuery::Only(vec!["page".into()]))
            .key_headers(["accept-language"])
            .forward_headers(["traceparent"])
            .build()
            .unwrap();
        let request = get("/items?utm=x&page=2")
            .header("accept-language", "fr")
            .header("traceparent", "00-abc")
            .header("x-forwarded-host", "evil.example")
            .body(())
            .unwrap();
        let fill: Request<()> = fill_request(&p, &request);
        assert_eq!(fill.method(), Method::GET);
        assert_eq!(fill.uri(), "/items?page=2");
        let names: Vec<&str> = fill.headers().keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["host", "accept-language", "traceparent"]);
        // The host that was keyed is the host the origin sees, whatever the request line.
        let absolute = Request::get("http://evil.example/items")
            .header("host", "shop.example")
            .body(())
            .unwrap();
        let fill: Request<()> = fill_request(&p, &absolute);
        assert_eq!(fill.uri(), "/items");
        assert_eq!(fill.headers()["host"], "shop.example");
        let unkeyed = Policy::builder("items").key_host(false).build().unwrap();
        let fill: Request<()> = fill_request(&unkeyed, &absolute);
        assert!(fill.headers().get("host").is_none());
    }

    #[test]
    fn private_responses_are_not_stored() {
        let p = policy();
        let with =
            |name: &str, value: &str| Response::builder().header(name, value).body(()).unwrap();
        assert_eq!(
            storable(&p, &with("set-cookie", "a=b")),
            Err(NotStored::SetCookie)
        );
        assert_eq!(
            storable(&p, &with("cache-control", "max-age=5, Private")),
            Err(NotStored::Private)
        );
        assert_eq!(
            storable(&p, &with("cache-control", "no-store")),
            Err(NotStored::NoStore)
        );
        assert_eq!(storable(&p, &with("vary", "*")), Err(NotStored::VaryStar));
        assert_eq!(
            storable(&p, &with("vary", "Accept-Encoding")),
            Err(NotStored::VaryUnkeyed)
        );
        assert_eq!(storable(&p, &with("vary", "Accept-Language")), Ok(()));
        let not_found = Response::builder().status(404).body(()).unwrap();
        assert_eq!(storable(&p, &not_found), Err(NotStored::Status));
    }

    #[test]
    fn requests_with_credentials_bypass_unless_allowed() {
        let p = policy();
        let auth = get("/")
            .header("authorization", "Bearer x")
            .body(())
            .unwrap();
        let cookie = get("/").header("cookie", "a=b").body(()).unwrap();
        let post = Request::post("/").body(()).unwrap();
        assert_eq!(classify(&p, &auth), Err(Bypass::Authorization));
        assert_eq!(classify(&p, &cookie), Err(Bypass::Cookie));
        assert_eq!(classify(&p, &post), Err(Bypass::Method));
        assert_eq!(
            classify(&p, &Request::head("/").body(()).unwrap()),
            Ok(Kind::Head)
        );
        let open = Policy::builder("items")
            .allow_authorization(true)
            .build()
            .unwrap();
        assert_eq!(classify(&open, &auth), Ok(Kind::Get));
    }
}
