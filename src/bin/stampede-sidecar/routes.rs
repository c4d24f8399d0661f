//! Which layer a request goes through: the route with the longest matching path prefix,
//! else the default policy, else (with `default = "pass"`) none.
//!
//! A prefix matches whole segments of the path as an origin resolves it
//! ([`normalized`]): `/api` matches `/api` and `/api/users`, never `/apiary`, and
//! `/static/%2e%2e/account` is `/account`, never under `/static` (where a route that
//! stores answers to requests with cookies would be a web cache deception).

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Request};
use stampede_guard::{GuardLayer, StampedeGuard};
use tower::util::BoxCloneSyncService;
use tower::util::Oneshot;
use tower::{Layer, ServiceExt};

use crate::config::{SettingError, Settings};
use crate::peer::Peer;
use crate::upstream::{Upstream, strip_hop_by_hop};

type Route = BoxCloneSyncService<Request<Body>, Response, Infallible>;

/// The sidecar's service: one guard layer per route, all on one [`StampedeGuard`].
#[derive(Clone)]
pub(crate) struct Routes {
    /// Longest prefix first.
    routes: Arc<[(String, Route)]>,
    /// For requests that match no route.
    unrouted: Route,
    /// Each route's layer, in the same order (for purges by path); the default's last.
    layers: Arc<[(String, GuardLayer)]>,
    /// What vouches for the forwarding headers before the guard keys on them.
    upstream: Upstream,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field(
                "prefixes",
                &self.routes.iter().map(|(p, _)| p).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Routes {
    /// Makes each route's layer (the guard refuses a policy that does not fit its store,
    /// or a name used twice).
    pub(crate) fn new(
        guard: &StampedeGuard,
        settings: &Settings,
        upstream: &Upstream,
    ) -> Result<Self, SettingError> {
        let mut layers = Vec::with_capacity(settings.routes.len() + 1);
        let mut guarded =
            |prefix: &str, policy: &stampede_guard::Policy| -> Result<Route, SettingError> {
                let layer = guard
                    .layer(policy.clone())
                    .map_err(|e| settings.layer_error(policy.route(), &e))?;
                layers.push((prefix.to_owned(), layer.clone()));
                Ok(Route::new(
                    layer
                        .layer(upstream.service())
                        .map_response(IntoResponse::into_response),
                ))
            };
        let mut routes = Vec::with_capacity(settings.routes.len());
        for route in &settings.routes {
            routes.push((route.prefix.clone(), guarded(&route.prefix, &route.policy)?));
        }
        let unrouted = match &settings.default {
            // The empty prefix: every path.
            Some(policy) => guarded("", policy)?,
            None => Route::new(upstream.service().map_response(|mut response| {
                // Not cacheable by configuration, as a never-cached route says it.
                response
                    .headers_mut()
                    .insert("x-cache", HeaderValue::from_static("bypass"));
                response.into_response()
            })),
        };
        Ok(Self {
            routes: routes.into(),
            unrouted,
            layers: layers.into(),
            upstream: upstream.clone(),
        })
    }

    /// The layer a request for `path` goes through, if it is cached at all.
    pub(crate) fn layer(&self, path: &str) -> Option<&GuardLayer> {
        let path = Routed::of(path);
        self.layers
            .iter()
            .find(|(prefix, _)| path.is_under(prefix))
            .map(|(_, layer)| layer)
    }

    fn route(&self, path: &str) -> &Route {
        let path = Routed::of(path);
        self.routes
            .iter()
            .find(|(prefix, _)| path.is_under(prefix))
            .map_or(&self.unrouted, |(_, route)| route)
    }
}

/// A request's path as routes see it (see [`normalized`]).
struct Routed<'a> {
    path: std::borrow::Cow<'a, str>,
    /// It encodes a separator (`%2F`, `%5C`): some origins split a segment there, others
    /// do not, so no prefix but the empty one (the default) holds it, whichever way it
    /// would resolve.
    ambiguous: bool,
}

impl<'a> Routed<'a> {
    fn of(path: &'a str) -> Self {
        let lower = path.to_ascii_lowercase();
        Self {
            ambiguous: lower.contains("%2f") || lower.contains("%5c"),
            path: normalized(path),
        }
    }

    fn is_under(&self, prefix: &str) -> bool {
        prefix.is_empty() || (!self.ambiguous && under(prefix, &self.path))
    }
}

/// Whether `path` is under `prefix`: the prefix is the whole path, or ends where a
/// segment does (or itself ends with `/`). The empty prefix (the default) is every path.
fn under(prefix: &str, path: &str) -> bool {
    prefix.is_empty()
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/') || prefix.ends_with('/'))
}

/// `path` as the strictest origin resolves it, for routing (a route must hold nothing
/// that any origin would serve from elsewhere: web cache deception):
///
/// * percent-encoded unreserved characters are decoded (RFC 3986 §6.2.2.2: `%2e` is
///   `.`), and so are an encoded `/` (`%2F`) and `\` (`%5C`), which some servers and
///   frameworks decode before they route;
/// * `\` separates segments, as IIS, ASP.NET and Windows origins read it;
/// * each segment's parameters (`;` and what follows it) go, as Tomcat and Jetty strip
///   them (`..;` is `..`);
/// * then dot segments are removed (§5.2.4).
///
/// Only the route is chosen so: the origin gets the path as it came, and the key is made
/// of it. (A path that encodes a separator at all routes to the default: see
/// [`Routed`].)
fn normalized(path: &str) -> std::borrow::Cow<'_, str> {
    if !path.contains(['%', ';', '\\']) && !path.contains("/.") {
        return path.into();
    }
    let mut decoded = String::with_capacity(path.len());
    let mut rest = path;
    while let Some(at) = rest.find('%') {
        decoded.push_str(&rest[..at]);
        let escape = rest
            .get(at + 1..at + 3)
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escape {
            Some(byte) if byte.is_ascii_alphanumeric() || b"-._~/\\".contains(&byte) => {
                decoded.push(char::from(byte));
                rest = &rest[at + 3..];
            }
            _ => {
                decoded.push('%');
                rest = &rest[at + 1..];
            }
        }
    }
    decoded.push_str(rest);
    let decoded = decoded.replace('\\', "/");
    let segments: Vec<&str> = decoded
        .split('/')
        .skip(1)
        .map(|segment| segment.split(';').next().unwrap_or_default())
        .collect();
    let mut kept: Vec<&str> = Vec::with_capacity(segments.len());
    for (index, segment) in segments.iter().enumerate() {
        let last = index + 1 == segments.len();
        match *segment {
            "." => {}
            ".." => {
                kept.pop();
            }
            segment => kept.push(segment),
        }
        // A path that ends in a dot segment names a directory: it ends with `/`.
        if last && (*segment == "." || *segment == "..") {
            kept.push("");
        }
    }
    format!("/{}", kept.join("/")).into()
}

impl tower::Service<Request<Body>> for Routes {
    type Response = Response;
    type Error = Infallible;
    type Future = Oneshot<Route, Request<Body>>;

    /// Always ready, as the guard is.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    /// The hop-by-hop headers, and those `Connection` lists, go before the guard sees
    /// the request: a header a client names in `Connection` (a keyed one) must not key
    /// the entry and then be missing from the fill, which would store the answer to a
    /// request without it under the key of a request with it. For the same reason what
    /// the request says of its client (`X-Forwarded-*`) is vouched for here, before the
    /// guard keys on it, never after (see `Upstream::vouch`).
    fn call(&mut self, mut request: Request<Body>) -> Self::Future {
        strip_hop_by_hop(request.headers_mut());
        let peer = request.extensions().get::<Peer>().copied();
        self.upstream.vouch(request.headers_mut(), peer);
        let route = self.route(request.uri().path()).clone();
        route.oneshot(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_matched_by_whole_segments_as_the_origin_resolves_them() {
        for (path, resolved) in [
            ("/static/a.css", "/static/a.css"),
            ("/static/%2e%2e/account", "/account"),
            ("/static/%2E%2E/account", "/account"),
            ("/static/./a.css", "/static/a.css"),
            ("/a/b/../../c", "/c"),
            ("/../../etc", "/etc"),
            ("/static/..", "/"),
            ("/static/.", "/static/"),
            ("/static%2F..%2Faccount", "/account"),
            ("/static%2f..%2faccount", "/account"),
            ("/static/..;/account", "/account"),
            ("/static/..;jsessionid=1/account", "/account"),
            ("/static/a.css;v=2", "/static/a.css"),
            ("/static/..%5Caccount", "/account"),
            ("/static\\..\\account", "/account"),
            ("/%7Euser/%41", "/~user/A"),
            ("/100%", "/100%"),
            ("/a%zz", "/a%zz"),
        ] {
            assert_eq!(normalized(path), resolved, "{path}");
        }
        assert!(under("/api", "/api"));
        assert!(under("/api", "/api/users"));
        assert!(!under("/api", "/apiary"));
        assert!(under("/items/", "/items/1"));
        assert!(!under("/items/", "/items"));
        assert!(under("", "/anything"));
        assert!(!under("/static", &normalized("/static/%2e%2e/account")));
        assert!(!under("/static", &normalized("/static%2F..%2Faccount")));
        assert!(!under("/static", &normalized("/static/..;/account")));
        // An encoded separator: held by no prefix, whichever way an origin reads it.
        for path in [
            "/account%2F..%2Fstatic/x.css",
            "/static%2fa.css",
            "/static/a%5Cb",
        ] {
            assert!(!Routed::of(path).is_under("/static"), "{path}");
            assert!(Routed::of(path).is_under(""), "{path}");
        }
        assert!(Routed::of("/static/a.css").is_under("/static"));
    }
}
