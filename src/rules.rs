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
    /// The route is never cached.
    Route,
}

impl Bypass {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Method => "method",
            Self::Authorization => "authorization",
            Self::Cookie => "cookie",
            Self::Route => "route",
        }
    }
}

pub(crate) fn classify<B>(policy: &Policy, request: &Request<B>) -> Result<Asked, Bypass> {
    if !policy.cache {
        return Err(Bypass::Route);
    }
    let kind = match *request.method() {
        Method::GET => Kind::Get,
        Method::HEAD => Kind::Head,
        _ => return Err(Bypass::Method),
    };
    // One pass over the names a request has (a handful), rather than three hashed
    // lookups: every request comes here.
    let (mut authorization, mut cookie, mut conditional) = (false, false, false);
    for name in request.headers().keys() {
        authorization |= *name == header::AUTHORIZATION;
        cookie |= *name == header::COOKIE;
        conditional |= crate::guard::is_conditional(name);
    }
    if authorization && !policy.allow_authorization {
        return Err(Bypass::Authorization);
    }
    if cookie && !policy.allow_cookies {
        return Err(Bypass::Cookie);
    }
    Ok(Asked { kind, conditional })
}

/// What a cacheable request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Asked {
    pub(crate) kind: Kind,
    /// It has `If-None-Match` or `If-Modified-Since`: an entry that meets the condition
    /// answers `304` (see `guard::conditional`).
    pub(crate) conditional: bool,
}

/// Everything that tells requests of a route apart, as bytes to be hashed: the host (if
/// keyed), the path, the keyed query parameters (sorted) and the keyed headers. Each
/// part is length-prefixed, so no two different requests give the same bytes.
pub(crate) fn identity<B>(policy: &Policy, request: &Request<B>) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    identity_into(policy, request, &mut |bytes| out.extend_from_slice(bytes));
    out
}

/// [`identity`], written piece by piece into `out` (a hasher, on the hit path: no
/// allocation).
pub(crate) fn identity_into<B>(policy: &Policy, request: &Request<B>, out: &mut impl FnMut(&[u8])) {
    let mut part = |bytes: &[u8]| {
        out(&(bytes.len() as u32).to_le_bytes());
        out(bytes);
    };
    part(b"v1");
    if policy.key_host {
        part(host(request).unwrap_or_default());
    }
    part(request.uri().path().as_bytes());
    keyed_query(policy, request.uri(), &mut |param| part(param.as_bytes()));
    headers_into(&policy.key_headers, request, out);
}

/// Whether the request has any of the headers its URL learned to vary on. Without
/// them it asks for the response's own entry (variant 0), as before the URL learned
/// any. (Such an entry was filled by a request without the headers, or before the URL
/// learned them by an answer that did not vary on them: were it varying, the URL would
/// have learned the header from it then, and stored it as a variant.)
pub(crate) fn names_any<B>(learned: &[HeaderName], request: &Request<B>) -> bool {
    let headers = request.headers();
    learned.iter().any(|name| headers.contains_key(name))
}

/// Which variant of a response a request asks for: its values of the headers its URL
/// learned its responses vary on (`learned`, sorted), as bytes to be hashed.
pub(crate) fn variant<B>(learned: &[HeaderName], request: &Request<B>) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    headers_into(learned, request, &mut |bytes| out.extend_from_slice(bytes));
    out
}

/// [`variant`], written piece by piece into `out`.
pub(crate) fn variant_into<B>(
    learned: &[HeaderName],
    request: &Request<B>,
    out: &mut impl FnMut(&[u8]),
) {
    headers_into(learned, request, out);
}

/// Each header of `names` with its values, length-prefixed.
fn headers_into<B>(names: &[HeaderName], request: &Request<B>, out: &mut impl FnMut(&[u8])) {
    let mut part = |bytes: &[u8]| {
        out(&(bytes.len() as u32).to_le_bytes());
        out(bytes);
    };
    for name in names {
        part(name.as_str().as_bytes());
        let mut count = 0u32;
        if name == header::HOST {
            // What a learned `Vary: Host` means: the host, however the request gives it.
            if let Some(host) = host(request) {
                part(host);
                count = 1;
            }
        } else {
            for value in request.headers().get_all(name) {
                part(value.as_bytes());
                count += 1;
            }
        }
        part(&count.to_le_bytes());
    }
}

/// The host a request is for: its `Host` header as sent, text or not (two hosts that
/// are not text are still two hosts, never one empty one), else its URI's authority.
fn host<B>(request: &Request<B>) -> Option<&[u8]> {
    match request.headers().get(header::HOST) {
        Some(value) => Some(value.as_bytes()),
        None => request.uri().authority().map(|a| a.as_str().as_bytes()),
    }
}

/// The keyed query parameters (`name=value` as they came), sorted, each handed to
/// `each`. Without an allocation for up to 8 of them (a query string seldom has more).
fn keyed_query<'a>(policy: &Policy, uri: &'a Uri, each: &mut impl FnMut(&'a str)) {
    let Some(query) = uri.query() else {
        return;
    };
    if matches!(policy.key_query, KeyQuery::Ignore) {
        return;
    }
    let keyed = params(query).filter(|p| !p.is_empty()).filter(|p| {
        match &policy.key_query {
            KeyQuery::All => true,
            KeyQuery::Only(names) => {
                // Only a filter needs the name (found by a byte scan, as in `params`).
                let name = p.bytes().position(|b| b == b'=').map_or(*p, |at| &p[..at]);
                names.iter().any(|n| n == name)
            }
            KeyQuery::Ignore => false,
        }
    });
    let mut few: [&str; 8] = [""; 8];
    let mut count = 0;
    let mut many: Vec<&str> = Vec::new();
    for param in keyed {
        if count < few.len() {
            few[count] = param;
            count += 1;
        } else {
            if many.is_empty() {
                many.extend_from_slice(&few);
            }
            many.push(param);
        }
    }
    let params: &mut [&str] = if many.is_empty() {
        &mut few[..count]
    } else {
        &mut many
    };
    params.sort_unstable();
    for param in params.iter() {
        each(param);
    }
}

/// The parameters of a query string, split at `&`: a plain scan of its bytes, cheaper
/// than a general pattern search for strings this short.
fn params(query: &str) -> impl Iterator<Item = &str> {
    let mut rest = Some(query);
    std::iter::from_fn(move || {
        let now = rest?;
        match now.bytes().position(|b| b == b'&') {
            Some(at) => {
                rest = Some(&now[at + 1..]);
                Some(&now[..at])
            }
            None => {
                rest = None;
                Some(now)
            }
        }
    })
}

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

/// Request headers known to poison caches when they are not part of the key: frameworks
/// build links, redirects and routing decisions from them, so a response shaped by one
/// client's value would be served to everyone. A fill never forwards them unless the
/// route keys on them (or has learned that its responses vary on them). From published
/// cache-poisoning research: the forwarded-host and -scheme family, method and URL
/// overrides.
pub const POISONING_HEADERS: &[&str] = &[
    "forwarded",
    "x-forwarded-host",
    "x-forwarded-scheme",
    "x-forwarded-proto",
    "x-forwarded-port",
    "x-forwarded-prefix",
    "x-forwarded-server",
    "x-forwarded-ssl",
    "x-host",
    "x-original-host",
    "x-original-url",
    "x-rewrite-url",
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
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
    let uri = request.uri();
    let mut path_and_query = uri.path().to_owned();
    let mut first = true;
    keyed_query(policy, uri, &mut |param| {
        path_and_query.push(if first { '?' } else { '&' });
        path_and_query.push_str(param);
        first = false;
    });
    // Relative: the host, if any, travels in one place only, the Host header, and is the
    // same value the key was made of.
    let new_uri = Uri::builder()
        .path_and_query(path_and_query)
        .build()
        .unwrap_or_else(|_| Uri::from_static("/"));

    let keyed = |name: &HeaderName| policy.key_headers.contains(name) || learned.contains(name);
    let given = request.headers();
    let mut headers = HeaderMap::with_capacity(given.keys_len());
    if policy.strict_forwarding {
        for name in policy
            .key_headers
            .iter()
            .chain(learned)
            .chain(&policy.forward_headers)
        {
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
    } else {
        let listed = connection_listed(given);
        for (name, value) in given {
            let dropped = HOP_BY_HOP.contains(name)
                || NOT_FOR_A_FILL.contains(name)
                || name.as_str() == "keep-alive"
                || name.as_str() == "proxy-connection"
                || listed.contains(name)
                || (*name == header::AUTHORIZATION && !policy.allow_authorization)
                || (*name == header::COOKIE && !policy.allow_cookies)
                || (POISONING_HEADERS.contains(&name.as_str()) && !keyed(name));
            if !dropped {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    headers.remove(header::HOST);
    if (policy.key_host || learned.contains(&header::HOST))
        && let Some(host) = host(request).and_then(|h| http::HeaderValue::from_bytes(h).ok())
    {
        headers.insert(header::HOST, host);
    }
    let mut fill = Request::new(F::default());
    *fill.method_mut() = Method::GET;
    *fill.uri_mut() = new_uri;
    *fill.version_mut() = request.version();
    *fill.headers_mut() = headers;
    if policy.forward_extensions() {
        *fill.extensions_mut() = request.extensions().clone();
    }
    fill
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

/// The names a response's `Vary` lists; `Err` for `Vary: *` (or a value that is not
/// text), which no request can match.
pub(crate) fn vary_names(headers: &HeaderMap) -> Result<Vec<HeaderName>, NotStored> {
    let mut names = Vec::new();
    for value in headers.get_all(header::VARY) {
        let value = value.to_str().map_err(|_| NotStored::VaryStar)?;
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "*" {
                return Err(NotStored::VaryStar);
            }
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| NotStored::VaryStar)?;
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    Ok(names)
}

/// The names in a response's `Vary` that a key made with `learned` does not include.
pub(crate) fn unkeyed_vary(
    policy: &Policy,
    learned: &[HeaderName],
    response: &HeaderMap,
) -> Vec<HeaderName> {
    vary_names(response)
        .unwrap_or_default()
        .into_iter()
        .filter(|name| {
            !(policy.key_headers.contains(name)
                || learned.contains(name)
                || (*name == header::HOST && policy.key_host))
        })
        .collect()
}

/// Whether a response (by its `Vary`) made for a request with headers `made_for` may be
/// given to a request with headers `asking`: every header it varies on has the same
/// values in both.
pub(crate) fn same_variant(response: &HeaderMap, made_for: &HeaderMap, asking: &HeaderMap) -> bool {
    match vary_names(response) {
        Ok(names) => names.iter().all(|name| {
            made_for
                .get_all(name)
                .iter()
                .eq(asking.get_all(name).iter())
        }),
        Err(_) => false,
    }
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
    /// On a route that follows the origin: neither a lifetime nor a validator.
    NoFreshness,
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
            Self::NoFreshness => "no_freshness",
        }
    }

    /// Of two reasons found in one response, the one that keeps it closer to its caller.
    fn strongest(self, other: Self) -> Self {
        if self.is_private() { self } else { other }
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

/// Whether a response may be stored, by its status and headers. `Cache-Control` is read
/// whole: `no-cache, private` is private.
pub(crate) fn storable<B>(policy: &Policy, response: &Response<B>) -> Result<(), NotStored> {
    let headers = response.headers();
    if headers.contains_key(header::SET_COOKIE) {
        return Err(NotStored::SetCookie);
    }
    let mut found = None;
    // On a route that follows the origin, a field targeted at this cache
    // (`CDN-Cache-Control`, `Surrogate-Control`) says whether to store, in place of
    // `Cache-Control`; but `private` there is always obeyed.
    let targeted = if policy.follow_origin {
        crate::guard::controlling(headers)
    } else {
        header::CACHE_CONTROL
    };
    let fields = headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .map(|v| (v, false))
        .chain(
            (targeted != header::CACHE_CONTROL)
                .then(|| headers.get_all(&targeted).iter().map(|v| (v, true)))
                .into_iter()
                .flatten(),
        );
    let overridden = targeted != header::CACHE_CONTROL;
    for (value, is_targeted) in fields {
        let Ok(value) = value.to_str() else {
            return Err(NotStored::Private);
        };
        for directive in value.split(',') {
            let name = directive.split('=').next().unwrap_or("").trim();
            // What `Cache-Control` says to every cache but of privacy, a targeted
            // field overrides for this one.
            let counts = is_targeted || !overridden || name.eq_ignore_ascii_case("private");
            if !counts {
                continue;
            }
            // The strongest directive wins, wherever it stands.
            let why = if name.eq_ignore_ascii_case("private") {
                NotStored::Private
            } else if name.eq_ignore_ascii_case("no-store") {
                NotStored::NoStore
            } else if name.eq_ignore_ascii_case("no-cache") && !policy.follow_origin {
                // (Followed, it is stored, and revalidated on every use.)
                NotStored::NoCache
            } else {
                continue;
            };
            found = Some(found.map_or(why, |f: NotStored| f.strongest(why)));
        }
    }
    if let Some(why) = found {
        return Err(why);
    }
    vary_names(headers)?;
    if policy.follow_origin {
        use crate::guard::NotReused;
        return crate::guard::reusable(policy, response.status(), headers).map_err(
            |why| match why {
                NotReused::Status => NotStored::Status,
                NotReused::NoFreshness => NotStored::NoFreshness,
            },
        );
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
    for name in connection_listed(headers) {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove(header::AGE);
    headers.remove("keep-alive");
    headers.remove(crate::X_CACHE);
    headers.remove(crate::CACHE_STATUS);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The byte scan splits a query exactly where `str::split('&')` does, empty
    /// parameters and non-ASCII ones included.
    #[test]
    fn params_split_like_str_split() {
        for query in [
            "",
            "a",
            "a=1",
            "a=1&b=2",
            "&",
            "&&",
            "a=1&&b=2&",
            "&a",
            "é=ü&x",
            "a=&=b",
        ] {
            let ours: Vec<&str> = params(query).collect();
            let std: Vec<&str> = query.split('&').collect();
            assert_eq!(ours, std, "{query:?}");
        }
    }

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
        let unkeyed = Policy::builder("items").key_host(false).build().unwrap();
        let fill: Request<()> = fill_request(&unkeyed, &[], &absolute);
        assert!(fill.headers().get("host").is_none());
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

    #[test]
    fn learned_headers_are_keyed_and_variants_are_told_apart() {
        let p = Policy::builder("items").build().unwrap();
        let lang = [HeaderName::from_static("accept-language")];
        let fr = get("/items")
            .header("accept-language", "fr")
            .body(())
            .unwrap();
        let de = get("/items")
            .header("accept-language", "de")
            .body(())
            .unwrap();
        assert_eq!(identity(&p, &fr), identity(&p, &de));
        assert_eq!(variant(&[], &fr), variant(&[], &de));
        assert_ne!(variant(&lang, &fr), variant(&lang, &de));
        let response = Response::builder()
            .header("vary", "Accept-Language, accept-encoding")
            .body(())
            .unwrap();
        let unkeyed = unkeyed_vary(&p, &lang, response.headers());
        assert_eq!(unkeyed, [HeaderName::from_static("accept-encoding")]);
        let fr2 = get("/other")
            .header("accept-language", "fr")
            .body(())
            .unwrap();
        assert!(same_variant(
            response.headers(),
            fr.headers(),
            fr2.headers()
        ));
        assert!(!same_variant(
            response.headers(),
            fr.headers(),
            de.headers()
        ));
        let star = Response::builder().header("vary", "*").body(()).unwrap();
        assert!(!same_variant(star.headers(), fr.headers(), fr2.headers()));
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
        // Learned from, and keyed on, by the guard.
        assert_eq!(storable(&p, &with("vary", "Accept-Encoding")), Ok(()));
        // Read whole: the strongest directive wins, wherever it stands.
        assert_eq!(
            storable(&p, &with("cache-control", "no-cache, private")),
            Err(NotStored::Private)
        );
        assert_eq!(
            storable(&p, &with("cache-control", "no-cache, no-store")),
            Err(NotStored::NoStore)
        );
        assert_eq!(
            storable(&p, &with("cache-control", "no-cache")),
            Err(NotStored::NoCache)
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
            Ok(Asked {
                kind: Kind::Head,
                conditional: false
            })
        );
        let conditional = get("/").header("if-none-match", "\"v1\"").body(()).unwrap();
        assert_eq!(
            classify(&p, &conditional),
            Ok(Asked {
                kind: Kind::Get,
                conditional: true
            })
        );
        let open = Policy::builder("items")
            .allow_authorization(true)
            .build()
            .unwrap();
        assert_eq!(classify(&open, &auth).map(|a| a.kind), Ok(Kind::Get));
    }
}
