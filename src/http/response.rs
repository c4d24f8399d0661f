//! Which responses may be stored and shared (RFC 9111 §3), and what their `Vary` asks
//! of the requests they answer.

use http::header::{self, HeaderMap, HeaderName};
use http::{Response, StatusCode};

use super::directives::{self, NotReused};
use super::forward::strip_hop_by_hop;
use super::own_headers::{CACHE_STATUS, X_CACHE};
use crate::policy::Policy;

/// The headers whose values tag an answer for purging: `Surrogate-Key`
/// (space-separated tags) and `Cache-Tag` (comma-separated).
pub(crate) const TAG_HEADERS: [http::HeaderName; 2] = [
    http::HeaderName::from_static("surrogate-key"),
    http::HeaderName::from_static("cache-tag"),
];

/// The tags an answer names (see [`TAG_HEADERS`]), each value trimmed, empty ones left
/// out.
pub(crate) fn tags(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    let [surrogate_key, cache_tag] = &TAG_HEADERS;
    let surrogate = headers
        .get_all(surrogate_key)
        .into_iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(' '));
    let cache_tag = headers
        .get_all(cache_tag)
        .into_iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','));
    surrogate
        .chain(cache_tag)
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// The names a response's `Vary` lists, but `Range` and `If-Range`; `Err` for `Vary: *`
/// (or a value that is not text), which no request can match.
pub(crate) fn vary_names(headers: &HeaderMap) -> Result<Vec<HeaderName>, NotStored> {
    let mut names = Vec::new();
    for value in headers.get_all(header::VARY) {
        let value = value.to_str().map_err(|_| NotStored::VaryStar)?;
        for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            if name == "*" {
                return Err(NotStored::VaryStar);
            }
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| NotStored::VaryStar)?;
            // The cache answers ranges from the whole, which a fill asks for without
            // them: an answer cannot vary on them, and no key is made of them.
            if name == header::RANGE || name == header::IF_RANGE {
                continue;
            }
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
    /// An event stream (`text/event-stream`): one connection's, and never whole.
    EventStream,
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
            Self::EventStream => "event_stream",
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
            Self::SetCookie
                | Self::Private
                | Self::NoStore
                | Self::VaryStar
                | Self::VaryUnkeyed
                | Self::EventStream
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
    // On a route that follows the origin, a field targeted at this cache
    // (`CDN-Cache-Control`, `Surrogate-Control`) says whether to store, in place of
    // `Cache-Control`; but `private` there is always obeyed.
    let targeted = if policy.follow_origin {
        directives::controlling(headers)
    } else {
        header::CACHE_CONTROL
    };
    // `must-understand` (RFC 9111 §5.2.2.3): a cache that knows the status's caching
    // rules follows them and ignores `no-store`; one that does not, stores nothing.
    let must_understand = headers
        .get_all(&targeted)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|d| d.trim().eq_ignore_ascii_case("must-understand"));
    let understood = response.status().canonical_reason().is_some();
    if must_understand && !understood {
        return Err(NotStored::Status);
    }
    if let Some(why) = forbidden(policy, headers, &targeted, must_understand) {
        return Err(why);
    }
    vary_names(headers)?;
    if policy.follow_origin {
        return directives::reusable(policy, response.status(), headers).map_err(|why| match why {
            NotReused::Status => NotStored::Status,
            NotReused::NoFreshness => NotStored::NoFreshness,
        });
    }
    if !policy.is_cacheable_status(response.status()) {
        return Err(NotStored::Status);
    }
    Ok(())
}

/// The strongest directive that forbids storing, wherever it stands: in `Cache-Control`,
/// or in the field `targeted` at this cache, which overrides `Cache-Control` but for
/// `private`. A field that is not text is private.
fn forbidden(
    policy: &Policy,
    headers: &HeaderMap,
    targeted: &HeaderName,
    must_understand: bool,
) -> Option<NotStored> {
    let overridden = *targeted != header::CACHE_CONTROL;
    let fields = headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .map(|v| (v, false))
        .chain(
            overridden
                .then(|| headers.get_all(targeted).iter().map(|v| (v, true)))
                .into_iter()
                .flatten(),
        );
    let mut found = None;
    for (value, is_targeted) in fields {
        let Ok(value) = value.to_str() else {
            return Some(NotStored::Private);
        };
        for directive in value.split(',') {
            let name = directive.split('=').next().unwrap_or("").trim();
            // What `Cache-Control` says to every cache but of privacy, a targeted
            // field overrides for this one.
            let counts = is_targeted || !overridden || name.eq_ignore_ascii_case("private");
            if !counts {
                continue;
            }
            let why = if name.eq_ignore_ascii_case("private") {
                NotStored::Private
            } else if name.eq_ignore_ascii_case("no-store") {
                if must_understand {
                    continue;
                }
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
    found
}

/// What of an answer made for one caller may be given to others without asking the
/// origin again (RFC 9111 §5.2.2.4, `no-cache`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reuse {
    /// All of it.
    Whole,
    /// All but the fields a qualified `no-cache` names (`no-cache="Set-Cookie"`).
    Without(Vec<HeaderName>),
    /// None of it: an unqualified `no-cache` (or one whose field names do not parse)
    /// asks the origin on every use, and the answer may be made for its caller alone
    /// (on a header it does not name in `Vary`).
    Never,
}

/// What of an answer may be reused for another caller (see [`Reuse`]), by every field
/// that bears on it: `Cache-Control` and the fields targeted at this cache
/// (`CDN-Cache-Control`, `Surrogate-Control`), each read whole.
pub(crate) fn reuse(headers: &HeaderMap) -> Reuse {
    let fields = [
        header::CACHE_CONTROL,
        HeaderName::from_static("cdn-cache-control"),
        HeaderName::from_static("surrogate-control"),
    ];
    let mut without = Vec::new();
    for field in &fields {
        for value in headers.get_all(field) {
            let Ok(value) = value.to_str() else {
                // Unreadable: it may say anything.
                return Reuse::Never;
            };
            for (name, argument) in directives_of(value) {
                if !name.eq_ignore_ascii_case("no-cache") {
                    continue;
                }
                let Some(argument) = argument else {
                    return Reuse::Never;
                };
                for name in argument.trim_matches('"').split(',') {
                    match HeaderName::from_bytes(name.trim().as_bytes()) {
                        Ok(name) => without.push(name),
                        Err(_) => return Reuse::Never,
                    }
                }
            }
        }
    }
    if without.is_empty() {
        Reuse::Whole
    } else {
        Reuse::Without(without)
    }
}

/// Removes the fields a qualified `no-cache` names from what is kept or shared (see
/// [`reuse`]); `false` when nothing of the answer may be reused.
pub(crate) fn strip_no_cache_fields(headers: &mut HeaderMap) -> bool {
    match reuse(headers) {
        Reuse::Whole => true,
        Reuse::Without(names) => {
            for name in names {
                headers.remove(name);
            }
            true
        }
        Reuse::Never => false,
    }
}

/// The directives of one field value, name and argument (still quoted), split at the
/// commas that stand outside quoted strings: `no-cache="a, b", max-age=5` is two.
fn directives_of(value: &str) -> impl Iterator<Item = (&str, Option<&str>)> {
    let mut rest = value;
    std::iter::from_fn(move || {
        loop {
            if rest.is_empty() {
                return None;
            }
            let (mut quoted, mut escaped, mut end) = (false, false, rest.len());
            for (at, c) in rest.char_indices() {
                match c {
                    _ if escaped => escaped = false,
                    '\\' if quoted => escaped = true,
                    '"' => quoted = !quoted,
                    ',' if !quoted => {
                        end = at;
                        break;
                    }
                    _ => {}
                }
            }
            let directive = rest[..end].trim();
            rest = rest.get(end + 1..).unwrap_or("");
            if directive.is_empty() {
                continue;
            }
            return Some(match directive.split_once('=') {
                Some((name, argument)) => (name.trim(), Some(argument.trim())),
                None => (directive, None),
            });
        }
    })
}

/// The body's length as its `Content-Length` declares it, if it does.
pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Whether the origin failed, as stale-if-error sees it.
pub(crate) fn is_failure(status: StatusCode) -> bool {
    status.is_server_error()
}

/// Headers that describe one connection, or that the layer sets itself: never stored.
pub(crate) fn strip_unstorable(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
    headers.remove(header::AGE);
    headers.remove("keep-alive");
    headers.remove(X_CACHE);
    headers.remove(CACHE_STATUS);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::request::tests::{get, policy};

    use crate::http::request::{identity, variant};

    #[test]
    fn no_cache_answers_are_never_reused_and_qualified_ones_lose_their_fields() {
        let with = |values: &[(&str, &str)]| {
            let mut headers = HeaderMap::new();
            for (name, value) in values {
                headers.append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    value.parse().unwrap(),
                );
            }
            headers
        };
        assert_eq!(
            reuse(&with(&[("cache-control", "max-age=5")])),
            Reuse::Whole
        );
        assert_eq!(reuse(&HeaderMap::new()), Reuse::Whole);
        assert_eq!(reuse(&with(&[("cache-control", "No-Cache")])), Reuse::Never);
        assert_eq!(
            reuse(&with(&[
                ("cache-control", "max-age=5"),
                ("cache-control", "no-cache")
            ])),
            Reuse::Never
        );
        assert_eq!(
            reuse(&with(&[("cdn-cache-control", "no-cache")])),
            Reuse::Never
        );
        assert_eq!(
            reuse(&with(&[(
                "cache-control",
                "no-cache=\"X-User, X-Account\", max-age=5"
            )])),
            Reuse::Without(vec![
                HeaderName::from_static("x-user"),
                HeaderName::from_static("x-account")
            ])
        );
        // A comma inside the quotes is not the end of the directive.
        assert_eq!(
            reuse(&with(&[("cache-control", "no-cache=\"a,b\",no-cache")])),
            Reuse::Never
        );
        assert_eq!(
            reuse(&with(&[("cache-control", "no-cache=\"not a name\"")])),
            Reuse::Never
        );
        let mut headers = with(&[
            ("cache-control", "no-cache=\"x-user\""),
            ("x-user", "ann"),
            ("etag", "\"1\""),
        ]);
        assert!(strip_no_cache_fields(&mut headers));
        assert!(!headers.contains_key("x-user"));
        assert!(headers.contains_key("etag"));
        assert!(!strip_no_cache_fields(&mut with(&[(
            "cache-control",
            "no-cache"
        )])));
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
        // `must-understand`: `no-store` is ignored for a status whose rules the cache
        // knows, and nothing is stored for one it does not (RFC 9111 §5.2.2.3).
        assert_eq!(
            storable(&p, &with("cache-control", "no-store, must-understand")),
            Ok(())
        );
        assert_eq!(
            storable(
                &p,
                &with("cache-control", "no-store, must-understand, private")
            ),
            Err(NotStored::Private)
        );
        let unknown = Response::builder()
            .status(599)
            .header("cache-control", "max-age=60, no-store, must-understand")
            .body(())
            .unwrap();
        assert_eq!(storable(&p, &unknown), Err(NotStored::Status));
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
        let ranged = Response::builder()
            .header("vary", "Range, If-Range, accept-language")
            .body(())
            .unwrap();
        assert_eq!(vary_names(ranged.headers()), Ok(lang.to_vec()));
        let star = Response::builder().header("vary", "*").body(()).unwrap();
        assert!(!same_variant(star.headers(), fr.headers(), fr2.headers()));
    }
}
