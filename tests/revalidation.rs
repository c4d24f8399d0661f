//! Revalidation, the way users run it (axum routes served by `axum::serve` over real
//! TCP, a real Redis): conditional refreshes that keep the body on a `304`, once per
//! window for the fleet; conditional clients answered `304` from the cache; an entry in
//! its keep window revalidated by the fill that replaces it; a `304` that would make the
//! entry another one's renews nothing.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::{HeaderMap, StatusCode, header};
use stampede_guard::metrics::Event;
use stampede_guard::{GuardLayer, Policy};
use support::app::{cache_status, docs_policy};
use support::http::{fetch, serve};
use support::web::ready_guard;
use support::{HANG, RedisServer, eventually};

/// An origin whose one resource has an `ETag` and a `Last-Modified`, and that answers a
/// matching `If-None-Match` with `304` and no body. It counts every call, the bodies it
/// sent and the 304s.
#[derive(Clone, Default)]
struct Validating {
    calls: Arc<AtomicU64>,
    bodies: Arc<AtomicU64>,
    not_modified: Arc<AtomicU64>,
}

const ETAG: &str = "\"v1\"";
const LAST_MODIFIED: &str = "Sun, 06 Nov 1994 08:49:37 GMT";

impl Validating {
    fn route(&self, layer: GuardLayer) -> Router {
        let origin = self.clone();
        let handler = move |headers: HeaderMap| {
            let origin = origin.clone();
            async move {
                let n = origin.calls.fetch_add(1, Ordering::SeqCst) + 1;
                if headers
                    .get(header::IF_NONE_MATCH)
                    .is_some_and(|v| v == ETAG)
                {
                    origin.not_modified.fetch_add(1, Ordering::SeqCst);
                    return (
                        StatusCode::NOT_MODIFIED,
                        [
                            (header::ETAG, ETAG.to_owned()),
                            (header::CACHE_CONTROL, format!("x-call={n}")),
                        ],
                        String::new(),
                    );
                }
                origin.bodies.fetch_add(1, Ordering::SeqCst);
                (
                    StatusCode::OK,
                    [
                        (header::ETAG, ETAG.to_owned()),
                        (header::LAST_MODIFIED, LAST_MODIFIED.to_owned()),
                    ],
                    format!("the body (call {n})"),
                )
            }
        };
        Router::new().route("/doc", get(handler).layer(layer))
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn bodies(&self) -> u64 {
        self.bodies.load(Ordering::SeqCst)
    }

    fn not_modified(&self) -> u64 {
        self.not_modified.load(Ordering::SeqCst)
    }
}

/// Whether `instance` answers `/doc` fresh from its cache now.
async fn answers_fresh(instance: SocketAddr) -> bool {
    fetch(instance, "/doc", &[]).await.x_cache() == "hit"
}

/// A stale entry whose origin answers its conditional refresh `304`: the body is kept
/// (the origin sent it once, in the first fill), the entry is fresh again, only its
/// metadata was written to Redis, and two instances on one Redis ask the origin once
/// per freshness window between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_304_renews_the_entry_with_its_body_once_per_window_for_the_fleet() {
    let server = RedisServer::start();
    let origin = Validating::default();
    let fresh = Duration::from_secs(1);
    let (a, b) = (ready_guard(&server).await, ready_guard(&server).await);
    let layer_a = a.layer(docs_policy(fresh)).unwrap();
    let addr_a = serve(origin.route(layer_a.clone())).await;
    let layer_b = b.layer(docs_policy(fresh)).unwrap();
    let addr_b = serve(origin.route(layer_b.clone())).await;

    let first = fetch(addr_a, "/doc", &[]).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.x_cache(), "miss");
    assert_eq!(first.body, "the body (call 1)");
    assert!(cache_status(&first).starts_with("stampede-guard; fwd=uri-miss; stored; ttl="));
    assert_eq!(fetch(addr_b, "/doc", &[]).await.x_cache(), "hit");

    const WINDOWS: u64 = 3;
    for window in 1..=WINDOWS {
        // Stale on both instances.
        tokio::time::sleep(fresh + Duration::from_millis(200)).await;
        let mut burst = Vec::new();
        for i in 0..20 {
            let addr = if i % 2 == 0 { addr_a } else { addr_b };
            burst.push(tokio::spawn(async move { fetch(addr, "/doc", &[]).await }));
        }
        for got in burst {
            let got = got.await.unwrap();
            assert_eq!(got.status, StatusCode::OK);
            // Stale while the refresh runs, or fresh once it has: the same body.
            assert_eq!(got.body, "the body (call 1)", "window {window}");
        }
        assert!(
            eventually(HANG, || async {
                answers_fresh(addr_a).await && answers_fresh(addr_b).await
            })
            .await,
            "both instances fresh again in window {window}"
        );
        assert_eq!(
            origin.calls(),
            1 + window,
            "origin calls after window {window}"
        );
    }
    assert_eq!(origin.bodies(), 1, "bodies the origin sent");
    assert_eq!(origin.not_modified(), WINDOWS);

    // Both instances hold the renewed entry: the renewer its own, the other what it
    // read back from Redis (the body of the first fill, the metadata of the last 304).
    for addr in [addr_a, addr_b] {
        let got = fetch(addr, "/doc", &[]).await;
        assert_eq!(
            got.headers[header::CACHE_CONTROL],
            format!("x-call={}", 1 + WINDOWS),
            "{addr}"
        );
        assert_eq!(got.body, "the body (call 1)");
    }
    // Renewed: fresh (its age starts again), the 304's headers taken, the body kept.
    let renewed = fetch(addr_b, "/doc", &[]).await;
    assert_eq!(renewed.x_cache(), "hit");
    assert_eq!(renewed.body, "the body (call 1)");
    assert_eq!(renewed.headers[header::ETAG], ETAG);
    assert_eq!(renewed.headers[header::LAST_MODIFIED], LAST_MODIFIED);
    assert_eq!(
        renewed.headers[header::CACHE_CONTROL],
        format!("x-call={}", 1 + WINDOWS)
    );
    let age: u64 = renewed.headers[header::AGE]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(age < 2, "age {age}");
    assert!(
        cache_status(&renewed).starts_with("stampede-guard; hit; ttl="),
        "{}",
        cache_status(&renewed)
    );

    // In Redis: the body as first written, and the renewed metadata beside it.
    let request = http::Request::get("/doc")
        .header("host", "shop.example")
        .body(())
        .unwrap();
    let entry = layer_a.cache_keys(&request).unwrap().entry().to_owned();
    let mut fields: Vec<String> = redis::cmd("HKEYS")
        .arg(&entry)
        .query_async(&mut server.conn().await)
        .await
        .unwrap();
    fields.sort();
    assert_eq!(fields, ["d", "m", "t"]);
    let revalidated = layer_a.stats().get(Event::RefreshRevalidated)
        + layer_b.stats().get(Event::RefreshRevalidated);
    assert_eq!(revalidated, WINDOWS);
}

/// A client's `If-None-Match` that matches the entry gets `304` from the cache, without
/// a body and with the validators; one that does not match gets the entry; so does
/// `If-Modified-Since`, and a stale entry answers as a fresh one does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditional_clients_get_304_from_the_cache() {
    let server = RedisServer::start();
    let origin = Validating::default();
    let guard = ready_guard(&server).await;
    let fresh = Duration::from_secs(1);
    let layer = guard.layer(docs_policy(fresh)).unwrap();
    let addr = serve(origin.route(layer.clone())).await;
    assert_eq!(fetch(addr, "/doc", &[]).await.x_cache(), "miss");

    let matching = fetch(addr, "/doc", &[("if-none-match", "W/\"v0\", \"v1\"")]).await;
    assert_eq!(matching.status, StatusCode::NOT_MODIFIED);
    assert_eq!(matching.body, "");
    assert_eq!(matching.x_cache(), "hit");
    assert_eq!(matching.headers[header::ETAG], ETAG);
    assert_eq!(matching.headers[header::LAST_MODIFIED], LAST_MODIFIED);
    assert!(matching.headers.contains_key(header::AGE));
    assert!(cache_status(&matching).starts_with("stampede-guard; hit; ttl="));

    let other = fetch(addr, "/doc", &[("if-none-match", "\"v2\"")]).await;
    assert_eq!(other.status, StatusCode::OK);
    assert_eq!(other.body, "the body (call 1)");
    assert_eq!(other.x_cache(), "hit");

    let since = fetch(
        addr,
        "/doc",
        &[("if-modified-since", "Mon, 07 Nov 1994 08:49:37 GMT")],
    )
    .await;
    assert_eq!(since.status, StatusCode::NOT_MODIFIED);
    let before = fetch(
        addr,
        "/doc",
        &[("if-modified-since", "Sat, 05 Nov 1994 08:49:37 GMT")],
    )
    .await;
    assert_eq!(before.status, StatusCode::OK);
    assert_eq!(before.body, "the body (call 1)");

    // Stale: still answered from the entry, while it is refreshed.
    tokio::time::sleep(fresh + Duration::from_millis(200)).await;
    let stale = fetch(addr, "/doc", &[("if-none-match", ETAG)]).await;
    assert_eq!(stale.status, StatusCode::NOT_MODIFIED);
    assert_eq!(stale.x_cache(), "stale");
    assert!(
        cache_status(&stale).starts_with("stampede-guard; hit; ttl=-"),
        "{}",
        cache_status(&stale)
    );

    // The client's conditions never reach the origin: it was asked only by the guard.
    assert!(
        eventually(HANG, || async {
            layer.stats().get(Event::RefreshRevalidated) == 1
        })
        .await
    );
    assert_eq!(origin.bodies(), 1);
    assert_eq!(origin.calls(), 2);
    assert_eq!(layer.stats().get(Event::NotModified), 3);
}

/// Past grace and stale-if-error, an entry kept only to be revalidated (`keep`) is not
/// served, but the fill that replaces it asks the origin with its validators, and a
/// `304` brings it back with the body it had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_in_its_keep_window_is_revalidated_by_the_fill() {
    let server = RedisServer::start();
    let origin = Validating::default();
    let guard = ready_guard(&server).await;
    let fresh = Duration::from_secs(1);
    let layer = guard
        .layer(
            Policy::builder("docs")
                .fresh_ttl(fresh)
                .grace(Duration::ZERO)
                .stale_if_error(Duration::ZERO)
                .keep(Duration::from_secs(60))
                .build()
                .unwrap(),
        )
        .unwrap();
    let addr = serve(origin.route(layer.clone())).await;
    assert_eq!(fetch(addr, "/doc", &[]).await.x_cache(), "miss");
    tokio::time::sleep(fresh + Duration::from_millis(200)).await;

    let refilled = fetch(addr, "/doc", &[]).await;
    assert_eq!(refilled.status, StatusCode::OK);
    assert_eq!(refilled.x_cache(), "miss");
    assert_eq!(refilled.body, "the body (call 1)");
    assert_eq!(origin.calls(), 2);
    assert_eq!(origin.bodies(), 1);
    assert_eq!(layer.stats().get(Event::Revalidated), 1);
    assert_eq!(fetch(addr, "/doc", &[]).await.x_cache(), "hit");
    assert_eq!(origin.calls(), 2);
}

/// A conditional request that finds nothing to answer from joins the fill, which asks
/// the origin for the whole (unconditionally): when the entry it stores meets the
/// request's condition, the answer is `304` (RFC 9111 §4.3.2), as it is from a hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conditional_request_that_fills_gets_304_when_the_entry_meets_it() {
    let server = RedisServer::start();
    let origin = Validating::default();
    let guard = ready_guard(&server).await;
    let layer = guard.layer(docs_policy(Duration::from_secs(60))).unwrap();
    let addr = serve(origin.route(layer.clone())).await;

    let filled = fetch(addr, "/doc", &[("if-modified-since", LAST_MODIFIED)]).await;
    assert_eq!(filled.status, StatusCode::NOT_MODIFIED);
    assert_eq!(filled.x_cache(), "miss");
    assert_eq!(filled.body, "");
    assert_eq!(filled.headers[header::ETAG], ETAG);
    assert!(cache_status(&filled).starts_with("stampede-guard; fwd=uri-miss; stored; ttl="));
    // The origin was asked for the body, without the client's condition.
    assert_eq!(
        (origin.calls(), origin.bodies(), origin.not_modified()),
        (1, 1, 0)
    );
    assert_eq!(layer.stats().get(Event::NotModified), 1);

    let whole = fetch(addr, "/doc", &[]).await;
    assert_eq!((whole.status, whole.x_cache()), (StatusCode::OK, "hit"));
    assert_eq!(whole.body, "the body (call 1)");
    assert_eq!(origin.calls(), 1);
}

/// A `304` that would make the entry another one's (here, give it a `Set-Cookie`) does
/// not renew it: the entry is left as it was, no client is handed the cookie, and the
/// refresh counts as an answer that may not be stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_304_that_sets_a_cookie_renews_nothing() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let fresh = Duration::from_secs(1);
    let layer = guard.layer(docs_policy(fresh)).unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let handler = {
        let calls = calls.clone();
        move |headers: HeaderMap| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                if headers.contains_key(header::IF_NONE_MATCH) {
                    return (
                        StatusCode::NOT_MODIFIED,
                        [
                            (header::ETAG, ETAG),
                            (header::SET_COOKIE, "session=someone"),
                        ],
                        "",
                    );
                }
                (
                    StatusCode::OK,
                    [(header::ETAG, ETAG), (header::VIA, "origin")],
                    "body",
                )
            }
        }
    };
    let addr = serve(Router::new().route("/doc", get(handler).layer(layer.clone()))).await;
    // Another instance on the same Redis, listening to the fleet's notices.
    let other = ready_guard(&server).await;
    let other_layer = other.layer(docs_policy(fresh)).unwrap();
    let elsewhere = |_: HeaderMap| async { (StatusCode::OK, "the origin, again") };
    let other_addr = serve(Router::new().route("/doc", get(elsewhere).layer(other_layer))).await;
    assert_eq!(fetch(addr, "/doc", &[]).await.x_cache(), "miss");
    tokio::time::sleep(fresh + Duration::from_millis(200)).await;
    assert_eq!(fetch(addr, "/doc", &[]).await.x_cache(), "stale");
    assert!(
        eventually(HANG, || async {
            layer.stats().get(Event::RefreshNotStored) == 1
        })
        .await
    );
    let after = fetch(addr, "/doc", &[]).await;
    assert_eq!(after.x_cache(), "stale");
    assert_eq!(after.body, "body");
    assert!(!after.headers.contains_key(header::SET_COOKIE));
    assert_eq!(layer.stats().get(Event::Revalidated), 0);
    // A refresh whose answer may not be stored holds the key off for the back-off, as
    // a failure does (the stale entry served, no other refresh), rather than ending as
    // a pass (its lease released, and a hit-for-pass for the fleet).
    for _ in 0..3 {
        assert_eq!(fetch(addr, "/doc", &[]).await.x_cache(), "stale");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2, "{:?}", layer.stats());
    assert_eq!(layer.stats().get(Event::RefreshNotStored), 1);
    // Another instance (nothing in its L1) is served the stale entry from Redis too,
    // not sent to the origin. (Time for a fleet notice to arrive: a hit-for-pass one
    // would have by then.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = fetch(other_addr, "/doc", &[]).await;
    assert_eq!((got.x_cache(), got.body.as_str()), ("stale", "body"));
}
