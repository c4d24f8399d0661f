//! What a request is to the cache: whether it is answered from it at all (its method,
//! its credentials, the route), and what tells it apart from other requests (its
//! identity, its URL: host, path and the keyed query; its variant: the route's keyed
//! headers and the headers its URL's responses vary on).

use http::header::{self, HeaderName, IF_MODIFIED_SINCE, IF_NONE_MATCH};
use http::{Method, Request, Uri};

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
    /// A GET or HEAD with a body (`Content-Length` above zero, or `Transfer-Encoding`):
    /// what it asks may lie in its body, which no key holds (RFC 9110 §9.3.1 gives such
    /// a body no meaning, yet some origins read one).
    Body,
    /// The route is never cached.
    Route,
}

impl Bypass {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Method => "method",
            Self::Authorization => "authorization",
            Self::Cookie => "cookie",
            Self::Body => "body",
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
    let (mut authorization, mut cookie, mut conditional, mut ranged) = (false, false, false, false);
    let mut framed = false;
    for name in request.headers().keys() {
        authorization |= *name == header::AUTHORIZATION;
        cookie |= *name == header::COOKIE;
        conditional |= is_conditional(name);
        ranged |= *name == header::RANGE;
        framed |= *name == header::CONTENT_LENGTH || *name == header::TRANSFER_ENCODING;
    }
    // (Its values looked at only when it has one of them: a GET rarely does.)
    if framed && has_body(request.headers()) {
        return Err(Bypass::Body);
    }
    if authorization && !policy.allow_authorization {
        return Err(Bypass::Authorization);
    }
    if cookie && !policy.allow_cookies {
        return Err(Bypass::Cookie);
    }
    Ok(Asked {
        kind,
        conditional,
        // Only a GET's range is answered (RFC 9110 §14.2).
        ranged: ranged && kind == Kind::Get,
    })
}

/// Whether a request's framing says it has a body: `Transfer-Encoding`, or a
/// `Content-Length` above zero.
fn has_body(headers: &http::HeaderMap) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get_all(header::CONTENT_LENGTH)
            .iter()
            .any(|value| value.as_bytes().iter().any(|b| *b != b'0'))
}

/// Whether a client's request is a conditional one the cache may answer: it has
/// `If-None-Match` or `If-Modified-Since`. Checked on the request's one pass over its
/// header names (see [`classify`]).
pub(crate) fn is_conditional(name: &HeaderName) -> bool {
    *name == IF_NONE_MATCH || *name == IF_MODIFIED_SINCE
}

/// What a cacheable request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Asked {
    pub(crate) kind: Kind,
    /// It has `If-None-Match` or `If-Modified-Since`: an entry that meets the condition
    /// answers `304` (see `conditional`).
    pub(crate) conditional: bool,
    /// A GET with `Range`: its answer is cut to the range (see `range`).
    pub(crate) ranged: bool,
}

/// What tells the URLs of a route apart, as bytes to be hashed: the route's version (if
/// not 0), the host (if keyed), the path and the keyed query parameters (sorted). Each
/// part is length-prefixed, so no two different URLs give the same bytes.
///
/// The route's keyed headers are not part of it: like the headers a URL learned from
/// `Vary`, they tell the variants of one URL apart ([`variant`]), so that the variants
/// of a URL share its identity, and one invalidation of the URL reaches all of them.
pub(crate) fn identity<B>(policy: &Policy, request: &Request<B>) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    identity_into(policy, request, &mut |bytes| out.extend_from_slice(bytes));
    out
}

/// [`identity`], written piece by piece into `out` (a hasher, on the hit path: no
/// allocation).
pub(crate) fn identity_into<B>(policy: &Policy, request: &Request<B>, out: &mut impl FnMut(&[u8])) {
    let host = host(request).unwrap_or_default();
    path_identity_into(policy, host, request.uri().path().as_bytes(), out);
    keyed_query(policy, request.uri(), &mut |param| {
        out(&(param.len() as u32).to_le_bytes());
        out(param.as_bytes());
    });
}

/// The identity of a URL without a query (see [`identity`]): that of a GET of `path`
/// at `host` (read only where the route keys on it), as a typed value's is (see
/// `guard::values`).
pub(crate) fn path_identity_into(
    policy: &Policy,
    host: &[u8],
    path: &[u8],
    out: &mut impl FnMut(&[u8]),
) {
    written_path_identity_into(policy, host, path.len(), &mut |write| write(path), out);
}

/// [`path_identity_into`], with the path (of `len` bytes) written piece by piece by
/// `path`: a typed value's path is made only when a request needs it, not for a hit.
pub(crate) fn written_path_identity_into(
    policy: &Policy,
    host: &[u8],
    len: usize,
    path: &mut dyn FnMut(&mut dyn FnMut(&[u8])),
    out: &mut impl FnMut(&[u8]),
) {
    let mut part = |bytes: &[u8]| {
        out(&(bytes.len() as u32).to_le_bytes());
        out(bytes);
    };
    part(b"v1");
    if policy.version != 0 {
        part(&policy.version.to_le_bytes());
    }
    if policy.key_host {
        part(host);
    }
    out(&(len as u32).to_le_bytes());
    path(&mut |bytes| out(bytes));
}

/// Whether the request has any of the headers its URL varies on (the route's keyed
/// headers, and those it learned). Without them it asks for the response's own entry
/// (variant 0), as before the URL learned any. (Such an entry was filled by a request
/// without the headers, or before the URL learned them by an answer that did not vary
/// on them: were it varying, the URL would have learned the header from it then, and
/// stored it as a variant.)
pub(crate) fn names_any<B>(learned: &[HeaderName], request: &Request<B>) -> bool {
    let headers = request.headers();
    learned.iter().any(|name| headers.contains_key(name))
}

/// Which variant of a response a request asks for: its values of the headers its URL
/// varies on (`learned`, sorted: the route's keyed headers and the names learned from
/// `Vary`), as bytes to be hashed.
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
pub(crate) fn host<B>(request: &Request<B>) -> Option<&[u8]> {
    match request.headers().get(header::HOST) {
        Some(value) => Some(value.as_bytes()),
        None => request.uri().authority().map(|a| a.as_str().as_bytes()),
    }
}

/// The keyed query parameters (`name=value` as they came), sorted, each handed to
/// `each`. Without an allocation for up to 8 of them (a query string seldom has more).
pub(crate) fn keyed_query<'a>(policy: &Policy, uri: &'a Uri, each: &mut impl FnMut(&'a str)) {
    let Some(query) = uri.query() else {
        return;
    };
    if matches!(policy.key_query, KeyQuery::Ignore) {
        return;
    }
    let keyed = params(query)
        .filter(|p| !p.is_empty())
        .filter(|p| matches!(policy.key_query, KeyQuery::All) || policy.key_query.keys(name(p)));
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

/// Whether the key leaves out a parameter of `uri`'s query (one of the route's
/// `key_query`, `drop_query` or `ignore_query` rules applied).
pub(crate) fn query_left_out(policy: &Policy, uri: &Uri) -> bool {
    let Some(query) = uri.query() else {
        return false;
    };
    match policy.key_query {
        KeyQuery::All => false,
        _ => params(query)
            .filter(|p| !p.is_empty())
            .any(|p| !policy.key_query.keys(name(p))),
    }
}

/// A parameter's name: up to its `=` (found by a byte scan, as in `params`).
fn name(param: &str) -> &str {
    param
        .bytes()
        .position(|b| b == b'=')
        .map_or(param, |at| &param[..at])
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

#[cfg(test)]
pub(super) mod tests {
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

    /// A route keyed on `accept-language` (the other rules' tests use it too).
    pub(in crate::http) fn policy() -> Policy {
        Policy::builder("items")
            .key_headers(["accept-language"])
            .build()
            .unwrap()
    }

    /// A GET of `uri` at `example.com`.
    pub(in crate::http) fn get(uri: &str) -> http::request::Builder {
        Request::get(uri).header("host", "example.com")
    }

    #[test]
    fn query_order_does_not_matter_and_keyed_headers_make_variants() {
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
        // One URL: the keyed header tells its variants apart, not URLs.
        assert_eq!(identity(&p, &fr), identity(&p, &de));
        assert!(names_any(&p.key_headers, &fr));
        assert_ne!(variant(&p.key_headers, &fr), variant(&p.key_headers, &de));
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

    /// `drop_query` leaves out parameters by name or prefix, and keys the rest as
    /// `All` does; the other modes leave out what they do not keep; and the answer
    /// knows when the key left anything out.
    #[test]
    fn dropped_parameters_are_left_out_of_the_key_by_name_or_prefix() {
        let dropping = Policy::builder("search")
            .drop_query(["utm_*", "fbclid"])
            .build()
            .unwrap();
        let all = Policy::builder("search").build().unwrap();
        let id = |p: &Policy, uri: &str| identity(p, &get(uri).body(()).unwrap());
        let plain = id(&dropping, "/search?q=a&page=2");
        for tracked in [
            "/search?q=a&page=2&utm_source=x",
            "/search?utm_campaign=y&page=2&fbclid=z&q=a",
            "/search?page=2&utm_=1&q=a",
        ] {
            assert_eq!(id(&dropping, tracked), plain, "{tracked}");
            let uri: Uri = tracked.parse().unwrap();
            assert!(query_left_out(&dropping, &uri), "{tracked}");
            assert!(!query_left_out(&all, &uri));
        }
        // Not a prefix match for an exact name, nor dropped when only alike.
        for kept in ["/search?q=a&page=2&fbclid2=z", "/search?q=a&page=2&utm=x"] {
            assert_ne!(id(&dropping, kept), plain, "{kept}");
            assert!(!query_left_out(&dropping, &kept.parse().unwrap()), "{kept}");
        }
        // Without any tracking parameter: the key `All` would make.
        assert_eq!(plain, id(&all, "/search?page=2&q=a"));
        let only = Policy::builder("s").key_query(["q"]).build().unwrap();
        assert!(query_left_out(&only, &"/s?q=a&page=2".parse().unwrap()));
        assert!(!query_left_out(&only, &"/s?q=a".parse().unwrap()));
        let ignore = Policy::builder("s").ignore_query().build().unwrap();
        assert!(query_left_out(&ignore, &"/s?q=a".parse().unwrap()));
        assert!(!query_left_out(&ignore, &"/s".parse().unwrap()));
    }

    #[test]
    fn parts_cannot_run_into_each_other() {
        let p = Policy::builder("items").build().unwrap();
        let a = get("/items?ab=c").body(()).unwrap();
        let b = get("/items?a=bc").body(()).unwrap();
        assert_ne!(identity(&p, &a), identity(&p, &b));
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
                conditional: false,
                ranged: false,
            })
        );
        let conditional = get("/").header("if-none-match", "\"v1\"").body(()).unwrap();
        assert_eq!(
            classify(&p, &conditional),
            Ok(Asked {
                kind: Kind::Get,
                conditional: true,
                ranged: false,
            })
        );
        let ranged = get("/").header("range", "bytes=0-1").body(()).unwrap();
        assert_eq!(classify(&p, &ranged).map(|a| a.ranged), Ok(true));
        let head = Request::head("/")
            .header("range", "bytes=0-1")
            .body(())
            .unwrap();
        assert_eq!(classify(&p, &head).map(|a| a.ranged), Ok(false));
        let open = Policy::builder("items")
            .allow_authorization(true)
            .build()
            .unwrap();
        assert_eq!(classify(&open, &auth).map(|a| a.kind), Ok(Kind::Get));
        for (name, value, bypass) in [
            ("content-length", "12", true),
            ("transfer-encoding", "chunked", true),
            ("content-length", "0", false),
            ("content-length", "00", false),
        ] {
            let with = get("/").header(name, value).body(()).unwrap();
            let got = classify(&p, &with).err();
            assert_eq!(got == Some(Bypass::Body), bypass, "{name}: {value}");
        }
    }
}
