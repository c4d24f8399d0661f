//! The Tower layer: a two-tier cache in front of a cache-fill handler, serving stale
//! entries at once while one caller in the whole fleet refreshes them.
//!
//! A [`StampedeGuard`] is the shared handle: the Redis store, the key space, the L1
//! cache and the notice subscription. Each route gets its own [`GuardLayer`], made from
//! the handle with that route's [`Policy`], where the route is declared:
//!
//! ```no_run
//! use std::time::{Duration, Instant};
//! use axum::{Router, routing::get};
//! use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let keys = KeySpace::builder()
//!     .env("prod")
//!     .service("catalog")
//!     .secret(std::env::var("CACHE_KEY_SECRET").map_err(|_| "set CACHE_KEY_SECRET")?)
//!     .build()?;
//! let store = RedisStore::builder("redis://127.0.0.1:6379").build()?;
//! let guard = StampedeGuard::builder(store, keys).build()?;
//!
//! let items = guard.layer(
//!     Policy::builder("items")
//!         .fresh_ttl(Duration::from_secs(5))
//!         .grace(Duration::from_secs(60))
//!         .build()?,
//! )?;
//! let app: Router = Router::new().route("/items/{id}", get(|| async { "item" }).layer(items));
//! # Ok(()) }
//! ```
//!
//! # The request path
//!
//! * A **fresh** entry, in L1 or else in L2 (which then fills L1), is served with
//!   `x-cache: hit` and `age`.
//! * A **stale** entry (past its fresh time, within its grace) is served at once with
//!   `x-cache: stale`, and a refresh starts in the background, within the guard's
//!   refresh budget (over it, the refresh is skipped and counted, and a later caller
//!   starts it). The request never waits for the origin, a lease or a lock.
//! * A **refresh** runs once per key per process. It reads L2 first and takes a newer
//!   entry written by another instance if there is one; otherwise it takes the key's
//!   lease, and if someone else holds it, stops. With the lease it calls a clone of the
//!   inner service with a copy of the request, bounded by the refresh timeout, writes L2
//!   with a fenced write that also releases the lease and notifies the fleet, and fills
//!   L1. A caller that disconnects does not cancel it. When the origin fails (or answers
//!   with something that may not be stored), the stale entry stays and the lease is held
//!   off for the route's error back-off, so the fleet tries again once per back-off.
//! * A **cold miss** (nothing cached) is filled by one task per key per process, which
//!   every caller of the process for that key awaits; across the fleet, the lease picks
//!   one filler, and callers on other instances wait at most the route's cold wait for
//!   its entry, woken by its notice (heard by the instances that wait for the key, and
//!   only by them: they listen to its bucket of keys before they look at the entry
//!   again, see `notify`). When the filler's lease ends without an entry, its
//!   notice says so and they stop waiting at once: after an answer that may not be
//!   stored, their fill asks the origin once for all of them (and for the route's
//!   hit-for-pass time the key's later callers skip the caches: those that come while
//!   one of them asks the origin share its answer if it may be shared, `x-cache:
//!   pass`);
//!   after an origin failure, while the fleet backs off, they get an entry that may
//!   stand in (stale-if-error) at once, or a 503 on a route that rejects, or else share
//!   one call at a time of their process to the origin (without the lease). However a
//!   fill ends, its callers share it (see "Every way a fill ends" below).
//! * A fill's **body streams** to every caller that shares it (`guard::complete`,
//!   `guard::stream`): read once from the origin, frame by frame, into one copy that
//!   each caller reads at its own pace (one that joins mid-fill gets what came so far,
//!   then the rest); a body of at most 64 KiB is read whole first, so that its callers
//!   get the entry with its exact headers. A body that fails mid-way is cut for every
//!   reader ([`BodyError::FillCut`]), never ended as if whole, and nothing is stored.
//!   Answers larger than the route's `max_body` (declared, or grown past it) are shared
//!   the same way, not stored, and held only as a window of 1 MiB beyond their slowest
//!   reader, whatever their length: the readers read in step with the origin, one that
//!   does not move for the refresh timeout is cut, a caller that comes once the start
//!   was let go asks the origin itself, and once nobody reads it the fill stops reading
//!   the origin (within a second). A fill holds at most `max_body`, then that window.
//! * A **conditional** request (`If-None-Match`, `If-Modified-Since`) that the entry it
//!   is answered from meets gets `304` (`http::conditional`); a refresh of an entry with a
//!   validator asks the origin the same way, and a `304` renews the entry with its body.
//! * A **range request** (`Range: bytes=…`, a GET) is answered as a request for the
//!   whole, and its one range is then cut from the held body: `206`, or `416` when it
//!   lies past the end (`http::range`, `guard::ranged`). The origin is never sent
//!   `Range` on a fill, and it is never part of a key.
//! * A fresh entry **due for an early refresh** (`guard::early`) is served as a hit and
//!   refreshed as a stale one is; an entry **purged** by a tag (`guard::purge`, [`Purge`]) is stale
//!   (soft) or gone (hard); on a route that follows the origin, each entry's lifetimes
//!   are the origin's (`http::directives`).
//!
//! # Every way a fill ends
//!
//! No ending turns the callers that waited into concurrent calls to the origin, but one:
//! an answer private to the caller that led, since each other caller needs one of its
//! own. An answer too large to store is shared as it streams, as any other.
//!
//! | ending | the caller that led | every other waiter |
//! | --- | --- | --- |
//! | stored (by this fill, or landed meanwhile here or from another instance) | the entry (`miss`), or, for a body over 64 KiB, the answer as it streams (`miss`) | the same, if its headers ask for that variant; else it looks again under its own key |
//! | not storable, not private (too large for `max_body`; a status that is not cached, on a route that does not follow the origin; a 5xx) | the answer as it streams (`pass`) | the same answer (`collapsed`), if its variant; a 5xx is an origin error: an entry that may stand in is served instead |
//! | private to its caller (`private`, `no-cache` without field names, `Set-Cookie`, `no-store`, `Vary: *` or more names than a URL may learn; anything not stored on a route that forwards credentials; an event stream; one declared longer than 64 MiB and than `max_body`; on a route that follows the origin, an answer not stored that says nothing of caching) | its own answer (`pass`) | asks the origin itself (`pass`); later callers skip the caches for the route's hit-for-pass time; a private 5xx: an entry that may stand in, else `502` |
//! | its body failed, stalled past the refresh timeout, or was stopped by the watchdog, mid-way | the body cut where it stopped (an error, never a clean end) | the same, if it was reading it; else an entry that may stand in, or `502` |
//! | another variant's (the answer varies on a header the waiters' key did not include), which another fill stores | its own answer (`pass`) | looks again under its own key |
//! | origin error (the inner service's error, or its body failed mid-read) | the error, or the answer as far as it came | an entry that may stand in, else `502` (the guard's own) |
//! | origin timeout (the refresh timeout; the watchdog's maximum) | an entry that may stand in, else `504` | the same |
//! | write refused (a newer lease or entry exists) | the newer entry if it may serve (newer than the fill's, unexpired, not purged), else the fill's own answer, not stored | the same |
//! | lease lost while calling (the watchdog found another owner) | an entry that may stand in, else `504` (`detail=lease-lost`) | the same |
//! | backed off (the origin just failed, here or elsewhere), over budget, or another instance's fill did not land within the cold wait | with an entry that may stand in, or on a route that rejects, that entry or `503`; else the fill goes to the origin itself (without the lease or a budget slot): one call for all its callers, whose answer ends the fill as above | the same |
//! | the URL learned a `Vary` header meanwhile | looks again under its new key | the same |
//! | another instance's fill ended with an answer that may not be stored | the fill calls the origin itself, once, and ends as above | the same |
//! | panicked (the origin's future, or the fill) | an entry that may stand in, else `502`; the lease is held off as after a failure | the same |
//! | cancelled (the runtime went away) | an entry that may stand in, else `503` | the same |
//!
//! A `no-cache` answer that a route stores (one that follows the origin) is its
//! caller's alone as well: it is revalidated on every use, and each other waiter asks
//! the origin itself. The fields a qualified `no-cache` names (`no-cache="X-Account"`)
//! are never stored or shared; the rest of the answer is.
//!
//! After a failure the fleet backs off for the route's error back-off: callers that
//! come later get an entry that may stand in at once, and otherwise share the next fill,
//! one at a time per process. A HEAD on a cold key joins the fill of the GET it is
//! answered from, and gets its answer without the body.
//!
//! What never waits for a fill goes to the origin on its own, each call bounded by the
//! route's pass timeout: requests the route does not cache (`bypass`), the callers of a
//! private answer, and a request whose key changed three times while it waited (its URL
//! kept learning `Vary` headers). The callers of a key whose last answer could not be
//! stored skip the caches and the lease for the route's hit-for-pass time (`pass`), but
//! those that come at once share one call of their process, as a cold miss's do.
//!
//! # What reaches the origin
//!
//! A fill is a GET of the keyed path and query. It carries the caller's headers as a
//! proxy forwards them, without hop-by-hop headers and without the headers known to
//! poison caches ([`POISONING_HEADERS`]) unless keyed, or only the keyed headers on a
//! route with strict forwarding; it carries the caller's extensions (axum's path
//! parameters among them), unless the route turns that off or forwards strictly: the
//! wrapped handler sees the request it would see without the guard.
//!
//! Each URL learns the headers its responses name in `Vary`, and its requests are keyed
//! on them from then on, on every instance (see `guard::vary`), so that no caller is
//! ever served a variant its headers did not ask for; callers who waited for a fill of
//! another variant fill their own.
//!
//! # Readiness
//!
//! The guard is always ready ([`Guard`]): a hit never waits for the inner service's
//! readiness, and each call to the origin waits for its own ready clone, so limits
//! placed inside the guard bound origin calls, not hits.
//!
//! # Concurrent calls on the same key
//!
//! At most one refresh and one cold fill per key run in a process at a time, however
//! many times the framework applied the layer (axum applies a route's layers for each
//! connection: the single-flight state lives with the route, not with what `layer()`
//! makes), and while a lease is held no other instance calls the origin for that key. A
//! lease is an efficiency device: if it expires under a slow origin, a second instance
//! may refresh; the fenced write then keeps the newer entry whatever order the writes
//! land in, and refuses a write whose lease was overtaken by a newer one, even when that
//! one's entry is gone.
//!
//! When Redis cannot be used, the guard goes on with L1 and the local single-flight
//! only: at most one origin call per key per process.
//!
//! # Cancellation
//!
//! Fills and refreshes run in tasks of their own: a caller dropping its request does not
//! stop them, and every other caller waiting for the same fill still gets its result.
//! A fill that panics is caught: its waiters get an entry that may stand in, or `502`,
//! and the fleet backs off as after an origin failure.
//!
//! # Memory
//!
//! L1 holds at most its capacity in bytes of what entries really cost (every allocation
//! an entry holds, and the cache's bookkeeping for it); each entry is a compact copy
//! that keeps no network buffer alive.
//!
//! [`Policy`]: crate::Policy
//! [`BodyError::FillCut`]: crate::BodyError::FillCut
//! [`ColdMiss`]: crate::ColdMiss
//! [`POISONING_HEADERS`]: crate::policy::POISONING_HEADERS

//!
//! # Layout
//!
//! Each file imports only the ones listed above it (and the crate's lower modules:
//! `http`, `cache`, `lease`, `store`, `notify`, `policy`, `keys`, `metrics`):
//!
//! * `body`, `outcome`, `marks`, `budget`, `vary`, `early`, `hold`, `purge`, `ranged`,
//!   `verdict`: the pieces: the answer's body, what `x-cache` and `Cache-Status` say,
//!   the marks a fill's ending leaves (and what they say a request does), the refresh
//!   budget, learned `Vary` names, early refresh, adaptive lease TTLs, tag purges as
//!   read, byte ranges cut from a held body, and what may become of an origin's answer,
//!   judged once at its head;
//! * `stream`: a fill's body, read once and followed by every caller that shares it;
//! * `origin`: calling the origin, each call bounded;
//! * `inflight`: what is in flight in this process: cold fills (one per key, and what
//!   their waiters get) and refreshes (one per key, or held off);
//! * `reply`: what each caller of a fill gets from how it landed (the table above), and
//!   whether a refresh, landed the same way, backs off;
//! * `shared`: what every route of a guard shares, and what it makes of the fleet's
//!   notices;
//! * `route`: what every request of one route shares, and its keys;
//! * `read`: an answer's body read into its stream, its parts written to Redis as they
//!   come, and how the reading ended, mapped once to how the fill ends;
//! * `fill`: one fill under its claim (the one place a lease is asked for), as a type
//!   whose methods end it once;
//! * `call`: a fill's call of the origin, for a cold fill and a refresh alike (the one
//!   place the origin is asked conditionally), its `304`s told apart;
//! * `complete`: a cold fill's answer, from its head to how the fill lands: who may
//!   have it, its body streamed to them, and whether it is stored;
//! * `refresh`: refreshing a stale entry in the background: its claim (it never waits),
//!   then the call, the verdict, the body and the store of any fill, landing as one;
//! * `respond`: the responses, built from an entry, a shared answer or the guard's own;
//! * `answer`: the one decision on an entry found, a pass-through, and what stands in
//!   for a failed origin;
//! * `cold`: a cold miss, from claiming the fill to what each waiter gets;
//! * `service`, `future`: the Tower service and its future (the request path, where a
//!   refresh starts);
//! * `layer`: the Tower layer of one route;
//! * `handle`: [`StampedeGuard`] and its builder, which make the layers.

mod answer;
mod body;
mod budget;
mod call;
pub(crate) mod clock;
mod cold;
mod complete;
mod early;
mod fill;
mod fill_memory;
mod future;
mod handle;
mod hold;
mod inflight;
mod invalidate;
mod layer;
mod marks;
mod origin;
mod outcome;
mod purge;
mod ranged;
mod read;
mod refresh;
mod reply;
mod respond;
mod route;
mod service;
mod shared;
mod stream;
mod values;
mod vary;
mod verdict;

pub use self::body::{BodyError, ResponseBody};
pub use self::future::ResponseFuture;
pub use self::handle::{
    DEFAULT_FILL_MEMORY, DEFAULT_L1_CAPACITY, DEFAULT_L1_MAX_VARIANTS, DEFAULT_PURGE_CAPACITY,
    DEFAULT_REFRESH_BUDGET, GuardBuilder, LocalOnly, Mode, StampedeGuard,
};
pub use self::invalidate::InvalidateError;
pub use self::layer::GuardLayer;
pub use self::purge::MARGIN as PURGE_MARGIN;
pub use self::service::Guard;
#[cfg(feature = "json")]
pub use self::values::Json;
pub use self::values::{
    Codec, CodecError, MAX_KEY, NoValue, Postcard, ValueError, ValueLayer, ValueService, Values,
};
pub use crate::notify::Purge;
