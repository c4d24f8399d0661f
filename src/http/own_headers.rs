//! The headers the layer sets itself on every answer (`x-cache`, `cache-status`, and
//! `age` from an entry): their names, and which they are, so that none is stored or
//! taken from what the origin sent.

/// The response header that says how a response was answered: `hit` (a fresh entry),
/// `stale` (a stale entry, being refreshed or standing in for a failing origin), `miss`
/// (filled from the origin and stored), `pass` (from the origin, not stored: private,
/// uncacheable, too large, or a key whose answers are not stored) or `bypass` (the
/// request is not cacheable: its method, its credentials, or a never-cached route).
pub const X_CACHE: &str = "x-cache";

/// The response header of RFC 9211, set on every answer next to [`X_CACHE`], with this
/// cache's entry ([`CACHE_NAME`]) appended to what the origin's own caches said: `hit`
/// with the `ttl` left (negative once stale) for an answer from an entry; `fwd=uri-miss`
/// with `stored` and its `ttl` for a fill, `fwd=uri-miss` alone for an answer that was
/// not stored, `fwd=bypass` for a request the cache does not handle.
pub const CACHE_STATUS: &str = "cache-status";

/// The name this cache gives itself in [`CACHE_STATUS`].
pub const CACHE_NAME: &str = "stampede-guard";

/// The name of the `x-cache` header, made once.
pub(crate) const X_CACHE_NAME: http::HeaderName = http::HeaderName::from_static(X_CACHE);

/// The name of the `cache-status` header (RFC 9211), made once.
pub(crate) const CACHE_STATUS_NAME: http::HeaderName = http::HeaderName::from_static(CACHE_STATUS);

/// The headers the layer sets on each answer from an entry: never stored, and never
/// taken from what the origin sent (an upstream cache's `cache-status` described the
/// fill, not the answers from the entry).
pub(crate) fn is_set_by_the_layer(name: &http::HeaderName) -> bool {
    *name == http::header::AGE || *name == X_CACHE_NAME || *name == CACHE_STATUS_NAME
}
