//! What the guard's concept files share, written once: a guard on a test's Redis, the
//! routes' policies, guarded instances, requests with a header, an origin that varies,
//! and a gate for axum handlers.

use std::sync::Arc;
use std::time::Duration;

use super::TIMEOUT;

use http::Response;
use stampede_guard::guard::GuardBuilder;
use stampede_guard::policy::PolicyBuilder;
use stampede_guard::{Policy, RedisStore, StampedeGuard};

use super::Store;
use super::web::{self, Got, Instance, Origin, full, get, keys};

/// A guard on `redis` (a single server, a cluster, or as the least-privileged user),
/// with [`TIMEOUT`] as its command timeout.
pub(crate) fn guard(redis: &impl Store) -> StampedeGuard {
    StampedeGuard::builder(redis.store(TIMEOUT), keys())
        .build()
        .unwrap()
}

/// A guard on the server at `url`, with [`TIMEOUT`] as its command timeout, built as
/// `configure` says.
pub(crate) fn guard_at(
    url: &str,
    configure: impl FnOnce(GuardBuilder) -> GuardBuilder,
) -> StampedeGuard {
    let store = RedisStore::builder(url)
        .command_timeout(TIMEOUT)
        .build()
        .unwrap();
    configure(StampedeGuard::builder(store, keys()))
        .build()
        .unwrap()
}

/// The route most tests use: fresh for 500 ms, 30 s of grace, a cold wait of 5 s, a
/// back-off of 1 s after an error.
pub(crate) fn policy(route: &str) -> PolicyBuilder {
    Policy::builder(route)
        .fresh_ttl(Duration::from_millis(500))
        .grace(Duration::from_secs(30))
        .lease_ttl(Duration::from_secs(5))
        .refresh_timeout(Duration::from_secs(5))
        .cold_wait(Duration::from_secs(5))
        .error_backoff(Duration::from_secs(1))
}

/// The same with a cold wait far longer than any bound the tests assert (only a notice
/// can end a wait in time), and a back-off of 3 s after an error.
pub(crate) fn patient_policy(route: &str) -> PolicyBuilder {
    Policy::builder(route)
        .fresh_ttl(Duration::from_millis(500))
        .grace(Duration::from_secs(30))
        .lease_ttl(Duration::from_secs(5))
        .refresh_timeout(Duration::from_secs(5))
        .cold_wait(Duration::from_secs(10))
        .error_backoff(Duration::from_secs(3))
}

/// An instance with a guard of its own on `redis` (see [`guard`]), ready.
pub(crate) async fn instance<S>(redis: &impl Store, policy: Policy, origin: S) -> Instance<S> {
    web::instance(guard(redis), policy, origin).await
}

/// `GET path` with the header `name: value`.
pub(crate) fn with(path: &str, name: &str, value: &str) -> web::Req {
    let mut request = get(path);
    request.headers_mut().insert(
        http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
        value.parse().unwrap(),
    );
    request
}

/// What the origin answers: the `Accept-Language` it saw, with `Vary: Accept-Language`.
pub(crate) fn by_language() -> Origin {
    Origin::new(Duration::ZERO, |n, request| {
        let lang = request
            .headers()
            .get("accept-language")
            .map_or("none", |v| v.to_str().unwrap());
        let mut response = Response::new(full(format!("lang={lang} call {n}")));
        response
            .headers_mut()
            .insert("vary", "Accept-Language".parse().unwrap());
        response
    })
}

/// A gate the slow handler waits at, and a signal that it got there.
#[derive(Clone, Default)]
pub(crate) struct Gate {
    pub(crate) open: Arc<tokio::sync::Notify>,
    pub(crate) entered: Arc<tokio::sync::Notify>,
}

/// The route of the HTTP-cache tests: `docs`, fresh for `fresh`, 60 s of grace.
pub(crate) fn docs_policy(fresh: Duration) -> Policy {
    Policy::builder("docs")
        .fresh_ttl(fresh)
        .grace(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// An answer's `Cache-Status`, or nothing.
pub(crate) fn cache_status(got: &Got) -> &str {
    got.headers
        .get("cache-status")
        .map_or("", |v| v.to_str().unwrap())
}
