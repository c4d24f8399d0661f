//! The HTTP caching rules (RFC 9110, RFC 9111), as pure functions of requests,
//! responses and a route's [`Policy`](crate::Policy): no Redis, no cache, no state.
//! The guard calls them; they can be read and tested on their own.
//!
//! * `request`: which requests the cache answers, and what tells them apart (identity,
//!   keyed query, variant);
//! * `date`: HTTP dates, read robustly;
//! * `forward`: what a fill sends the origin;
//! * `directives`: what an answer's `Cache-Control`, `Expires`, `Age` and validators
//!   say about how long it may be reused;
//! * `conditional`: conditional requests, from clients and to the origin;
//! * `range`: range requests, answered from a whole body;
//! * `invalidation`: what a successful unsafe request changed (RFC 9111 §4.4);
//! * `own_headers`: the headers the layer sets itself on every answer;
//! * `response`: which answers may be stored and shared, and their `Vary`;
//! * `structured`: Structured Field dictionaries, as `CDN-Cache-Control` is one.

pub(crate) mod conditional;
pub(crate) mod date;
pub(crate) mod directives;
pub(crate) mod forward;
pub(crate) mod invalidation;
pub(crate) mod own_headers;
pub(crate) mod range;
pub(crate) mod request;
pub(crate) mod response;
pub(crate) mod structured;

pub use self::own_headers::{CACHE_NAME, CACHE_STATUS, X_CACHE};
pub(crate) use self::own_headers::{CACHE_STATUS_NAME, X_CACHE_NAME, is_set_by_the_layer};
