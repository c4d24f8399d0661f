//! The guard as an HTTP cache, the way users run it (axum routes served by
//! `axum::serve` over real TCP, a real Redis): conditional refreshes that keep the body
//! on a `304`, conditional clients answered from the cache, and `Cache-Status`.

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::{HeaderMap, StatusCode, header};
use stampede_guard::metrics::Event;
use stampede_guard::{GuardLayer, Policy, StampedeGuard};
use support::http::{fetch, serve};
use support::web::{Got, ready_guard};
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

fn policy(fresh: Duration) -> Policy {
    Policy::builder("docs")
        .fresh_ttl(fresh)
        .grace(Duration::from_secs(60))
        .build()
        .unwrap()
}

fn cache_status(got: &Got) -> &str {
    got.headers
        .get("cache-status")
        .map_or("", |v| v.to_str().unwrap())
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
    let layer_a = a.layer(policy(fresh)).unwrap();
    let addr_a = serve(origin.route(layer_a.clone())).await;
    let layer_b = b.layer(policy(fresh)).unwrap();
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

fn policy_named(route: &str) -> Policy {
    Policy::builder(route).build().unwrap()
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
    let layer = guard.layer(policy(fresh)).unwrap();
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

/// Answers that are not from an entry say so in `Cache-Status` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_status_says_how_each_answer_was_made() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard.layer(policy(Duration::from_secs(5))).unwrap();
    let app = Router::new()
        .route("/doc", get(|| async { "doc" }).layer(layer.clone()))
        .route(
            "/private",
            get(|| async { ([(header::CACHE_CONTROL, "private")], "mine") })
                .layer(guard.layer(policy_named("private")).unwrap()),
        );
    let addr = serve(app).await;
    let bypass = support::http::fetch_method(addr, "POST", "/doc").await;
    assert_eq!(bypass.x_cache(), "bypass");
    assert_eq!(cache_status(&bypass), "stampede-guard; fwd=bypass");
    let private = fetch(addr, "/private", &[]).await;
    assert_eq!(private.x_cache(), "pass");
    assert_eq!(cache_status(&private), "stampede-guard; fwd=uri-miss");
    assert!(cache_status(&fetch(addr, "/doc", &[]).await).contains("fwd=uri-miss; stored"));
    assert!(cache_status(&fetch(addr, "/doc", &[]).await).starts_with("stampede-guard; hit"));
}

/// An origin that sends the `Cache-Control` (and `Age`, `Expires`, `ETag`) its query
/// asks for, counting its calls.
fn directed(calls: Arc<AtomicU64>, layer: GuardLayer) -> Router {
    let handler = move |axum::extract::Query(q): axum::extract::Query<
        std::collections::HashMap<String, String>,
    >| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let mut headers = HeaderMap::new();
            for (param, name) in [
                ("cc", header::CACHE_CONTROL),
                ("age", header::AGE),
                ("etag", header::ETAG),
            ] {
                if let Some(value) = q.get(param) {
                    headers.insert(name, value.parse().unwrap());
                }
            }
            (headers, format!("call {n}"))
        }
    };
    Router::new().route("/d", get(handler).layer(layer))
}

/// The `ttl` of a `Cache-Status`.
fn ttl_of(got: &Got) -> i64 {
    let status = cache_status(got);
    let at = status
        .find("ttl=")
        .unwrap_or_else(|| panic!("no ttl in {status}"));
    status[at + 4..]
        .split(';')
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn query(cc: &str, more: &str) -> String {
    let cc: String = cc
        .bytes()
        .map(|b| match b {
            b'=' => "%3D".to_owned(),
            b',' => "%2C".to_owned(),
            b' ' => "%20".to_owned(),
            b'"' => "%22".to_owned(),
            b => (b as char).to_string(),
        })
        .collect();
    format!("/d?cc={cc}{more}")
}

/// Each origin directive sets an entry's lifetimes as RFC 9111 and RFC 5861 say,
/// clamped by the route's floor and ceiling, on a route that follows the origin; a
/// route that does not ignores them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origin_directives_set_freshness_within_the_route_bounds() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let calls = Arc::new(AtomicU64::new(0));
    let following = guard
        .layer(
            Policy::builder("following")
                .follow_origin(true)
                .fresh_ttl(Duration::from_secs(5))
                .grace(Duration::from_secs(30))
                .min_fresh(Duration::from_secs(2))
                .max_fresh(Duration::from_secs(100))
                .build()
                .unwrap(),
        )
        .unwrap();
    let own = guard
        .layer(
            Policy::builder("own")
                .fresh_ttl(Duration::from_secs(5))
                .build()
                .unwrap(),
        )
        .unwrap();
    let follows = serve(directed(calls.clone(), following.clone())).await;
    let ignores = serve(directed(calls.clone(), own)).await;

    for (cc, more, ttl) in [
        ("max-age=60", "", 60),
        ("max-age=60, s-maxage=20", "", 20),
        ("max-age=60", "&age=15", 45),
        // The ceiling and the floor.
        ("max-age=31536000", "", 100),
        ("max-age=1", "", 2),
        ("no-cache", "&etag=%22e%22", 2),
        // Heuristic-free, with only a validator: stale at once, but for the floor.
        ("public", "&etag=%22e%22", 2),
    ] {
        let path = query(cc, more);
        let got = fetch(follows, &path, &[]).await;
        assert_eq!(got.x_cache(), "miss", "{cc}");
        assert_eq!(ttl_of(&got), ttl, "{cc} {more}");
        // The entry is as old as the origin said it was.
        let age = if more == "&age=15" { "15" } else { "0" };
        assert_eq!(got.headers[header::AGE], age, "{cc} {more}");
        // A route that does not follow: its own five seconds (and `no-cache`, as
        // every route takes it by default, is not stored).
        let got = fetch(ignores, &path, &[]).await;
        if cc == "no-cache" {
            assert_eq!(got.x_cache(), "pass", "{cc}");
            continue;
        }
        assert_eq!(got.x_cache(), "miss", "{cc}");
        assert_eq!(ttl_of(&got), 5, "{cc} {more}");
    }

    // A year, and already a second old: a day's freshness at most, and an entry that
    // another instance reads back from Redis (a hit there, no second origin call).
    let other_guard = ready_guard(&server).await;
    let open = |guard: &StampedeGuard| {
        guard
            .layer(Policy::builder("open").follow_origin(true).build().unwrap())
            .unwrap()
    };
    let first = serve(directed(calls.clone(), open(&guard))).await;
    let second = serve(directed(calls.clone(), open(&other_guard))).await;
    let year = query("max-age=31536000", "&age=1");
    let filled = fetch(first, &year, &[]).await;
    assert_eq!(filled.x_cache(), "miss");
    assert_eq!(ttl_of(&filled), 24 * 3600 - 1);
    let before = calls.load(Ordering::SeqCst);
    let read_back = fetch(second, &year, &[]).await;
    assert_eq!(read_back.x_cache(), "hit", "read back from Redis");
    assert_eq!(read_back.headers[header::AGE], "1");
    assert_eq!(calls.load(Ordering::SeqCst), before);

    // Neither a lifetime nor a validator: not reused (the route that does not follow
    // the origin stores it).
    let bare = query("public", "");
    let before = calls.load(Ordering::SeqCst);
    for _ in 0..2 {
        assert_eq!(fetch(follows, &bare, &[]).await.x_cache(), "pass");
    }
    assert_eq!(calls.load(Ordering::SeqCst), before + 2);
    assert_eq!(fetch(ignores, &bare, &[]).await.x_cache(), "miss");
    assert_eq!(fetch(ignores, &bare, &[]).await.x_cache(), "hit");

    // Past freshness: `stale-while-revalidate` serves it stale, `must-revalidate` does
    // not (a fill), and nothing said leaves the route's grace.
    let swr = query("max-age=2, stale-while-revalidate=30, must-revalidate", "");
    let swr_only = query("max-age=2, stale-while-revalidate=30", "");
    let must = query("max-age=2, must-revalidate", "");
    let silent = query("max-age=2", "");
    for path in [&swr, &swr_only, &must, &silent] {
        assert_eq!(fetch(follows, path, &[]).await.x_cache(), "miss");
    }
    tokio::time::sleep(Duration::from_millis(2300)).await;
    assert_eq!(fetch(follows, &swr_only, &[]).await.x_cache(), "stale");
    assert_eq!(fetch(follows, &silent, &[]).await.x_cache(), "stale");
    assert_eq!(fetch(follows, &must, &[]).await.x_cache(), "miss");
    assert_eq!(fetch(follows, &swr, &[]).await.x_cache(), "miss");
}

/// An origin for `/p/{n}` whose answers are tagged `p{n}` and `group-{n % 2}` (half in
/// `Surrogate-Key`, half in `Cache-Tag`), versioned by call, after `delay`; `/u` is
/// untagged.
fn tagged(calls: Arc<AtomicU64>, delay: Duration, layer: GuardLayer) -> Router {
    let handler = move |uri: http::Uri| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(delay).await;
            let path = uri.path().to_owned();
            let mut headers = HeaderMap::new();
            if let Some(id) = path.strip_prefix("/p/") {
                let id: u64 = id.parse().unwrap();
                let tags = format!("p{id} group-{}", id % 2);
                if id.is_multiple_of(2) {
                    headers.insert("surrogate-key", tags.parse().unwrap());
                } else {
                    headers.insert("cache-tag", tags.replace(' ', ", ").parse().unwrap());
                }
            }
            (headers, format!("{path} v{n}"))
        }
    };
    Router::new()
        .route("/p/{id}", get(handler.clone()).layer(layer.clone()))
        .route("/u", get(handler).layer(layer))
}

fn tagged_policy() -> Policy {
    Policy::builder("tagged")
        .fresh_ttl(Duration::from_secs(60))
        .grace(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// A hard purge of a tag, from one instance, removes exactly the entries tagged with
/// it, on both instances: they are filled again (once for the fleet), and the others
/// are still hits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_purge_removes_exactly_the_tagged_entries_on_every_instance() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let (a, b) = (ready_guard(&server).await, ready_guard(&server).await);
    let (layer_a, layer_b) = (
        a.layer(tagged_policy()).unwrap(),
        b.layer(tagged_policy()).unwrap(),
    );
    let addr_a = serve(tagged(calls.clone(), Duration::ZERO, layer_a)).await;
    let addr_b = serve(tagged(calls.clone(), Duration::ZERO, layer_b)).await;
    let paths = ["/p/1", "/p/2", "/p/3", "/p/4", "/u"];
    for path in paths {
        assert_eq!(fetch(addr_a, path, &[]).await.x_cache(), "miss");
        assert_eq!(fetch(addr_b, path, &[]).await.x_cache(), "hit");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 5);

    a.purge_tags(["group-0"], stampede_guard::Purge::Hard)
        .await
        .unwrap();
    // The even ones, on b first (once it heard the purge): filled again, once.
    for path in ["/p/2", "/p/4"] {
        assert!(
            eventually(HANG, || async {
                let got = fetch(addr_b, path, &[]).await;
                got.x_cache() == "miss" || !got.body.ends_with(" v2") && !got.body.ends_with(" v4")
            })
            .await,
            "{path} on b after the purge"
        );
        let got = fetch(addr_a, path, &[]).await;
        assert_eq!(got.x_cache(), "hit", "{path} on a: b's new entry");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 7);
    for path in ["/p/1", "/p/3", "/u"] {
        for addr in [addr_a, addr_b] {
            assert_eq!(fetch(addr, path, &[]).await.x_cache(), "hit", "{path}");
        }
    }
    // A purge of one key's tag (in Cache-Tag).
    b.purge_tags(["p3"], stampede_guard::Purge::Hard)
        .await
        .unwrap();
    assert_eq!(fetch(addr_b, "/p/3", &[]).await.x_cache(), "miss");
    assert!(
        eventually(HANG, || async {
            fetch(addr_a, "/p/3", &[]).await.body == "/p/3 v8"
        })
        .await
    );
    assert_eq!(calls.load(Ordering::SeqCst), 8);
}

/// A soft purge under load: every caller is answered at once from the purged entries
/// (stale), and the origin is called once per purged key for the whole fleet, not once
/// per caller; an entry without the tag is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soft_purge_under_load_refreshes_each_key_once_for_the_fleet() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let (a, b) = (ready_guard(&server).await, ready_guard(&server).await);
    let (layer_a, layer_b) = (
        a.layer(tagged_policy()).unwrap(),
        b.layer(tagged_policy()).unwrap(),
    );
    let delay = Duration::from_millis(200);
    let addr_a = serve(tagged(calls.clone(), delay, layer_a.clone())).await;
    let addr_b = serve(tagged(calls.clone(), delay, layer_b.clone())).await;
    let keys = ["/p/1", "/p/2", "/p/3", "/p/4"];
    for path in keys.iter().chain(&["/u"]) {
        assert_eq!(fetch(addr_a, path, &[]).await.x_cache(), "miss");
        assert_eq!(fetch(addr_b, path, &[]).await.x_cache(), "hit");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 5);

    // Both group tags: every /p/ key.
    a.purge_tags(["group-0", "group-1"], stampede_guard::Purge::Soft)
        .await
        .unwrap();
    let mut burst = Vec::new();
    for round in 0..10 {
        for (i, &path) in keys.iter().enumerate() {
            let addr = if (round + i) % 2 == 0 { addr_a } else { addr_b };
            burst.push(tokio::spawn(
                async move { (path, fetch(addr, path, &[]).await) },
            ));
        }
    }
    for answer in burst {
        let (path, got) = answer.await.unwrap();
        assert_eq!(got.status, StatusCode::OK);
        // At once, from the entry: stale (or a hit on b before it heard the purge, or
        // the refreshed entry once it landed).
        assert!(
            ["stale", "hit"].contains(&got.x_cache()),
            "{path}: {}",
            got.x_cache()
        );
    }
    for path in keys {
        assert!(
            eventually(HANG, || async {
                let (a, b) = (
                    fetch(addr_a, path, &[]).await,
                    fetch(addr_b, path, &[]).await,
                );
                a.x_cache() == "hit"
                    && b.x_cache() == "hit"
                    && a.body == b.body
                    && !a.body.ends_with(&format!(" v{}", &path[3..]))
            })
            .await,
            "{path} refreshed on both"
        );
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        5 + keys.len() as u64,
        "one call per key"
    );
    assert_eq!(fetch(addr_a, "/u", &[]).await.body, "/u v5");
    let soft = layer_a.stats().get(Event::PurgedSoft) + layer_b.stats().get(Event::PurgedSoft);
    assert!(soft >= keys.len() as u64, "{soft} soft-purged reads");
}

/// A successful unsafe request invalidates, for the fleet, the entries of its URI and
/// of the same-origin URI its answer names in `Location`, on a route that follows the
/// origin (RFC 9111 §4.4); a failed one does not; a route that does not follow the
/// origin leaves them by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_requests_invalidate_what_they_change() {
    let server = RedisServer::start();
    let (a, b) = (ready_guard(&server).await, ready_guard(&server).await);
    let calls = Arc::new(AtomicU64::new(0));
    let app = |guard: &StampedeGuard, follow: bool| {
        let layer = guard
            .layer(
                Policy::builder("changing")
                    .follow_origin(follow)
                    .fresh_ttl(Duration::from_secs(60))
                    .build()
                    .unwrap(),
            )
            .unwrap();
        let calls = calls.clone();
        let read = move |uri: http::Uri| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                (
                    [(header::CACHE_CONTROL, "max-age=60")],
                    format!("{} v{n}", uri.path()),
                )
            }
        };
        let write = |uri: http::Uri| async move {
            match uri.path() {
                "/list" => (StatusCode::CREATED, [(header::LOCATION, "/item")]).into_response(),
                "/fails" => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                _ => StatusCode::NO_CONTENT.into_response(),
            }
        };
        Router::new()
            .route("/item", get(read.clone()).post(write).layer(layer.clone()))
            .route("/list", get(read.clone()).post(write).layer(layer.clone()))
            .route("/fails", get(read).post(write).layer(layer))
    };
    use axum::response::IntoResponse;
    let follows = serve(app(&a, true)).await;
    let other = serve(app(&b, true)).await;
    for path in ["/item", "/list", "/fails"] {
        assert_eq!(fetch(follows, path, &[]).await.x_cache(), "miss");
        assert_eq!(fetch(other, path, &[]).await.x_cache(), "hit");
    }
    let post = |addr, path| support::http::fetch_method(addr, "POST", path);

    assert_eq!(
        post(follows, "/fails").await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(fetch(follows, "/fails", &[]).await.x_cache(), "hit");

    assert_eq!(post(follows, "/item").await.status, StatusCode::NO_CONTENT);
    assert_eq!(fetch(follows, "/item", &[]).await.x_cache(), "miss");
    // The other instance heard it.
    assert!(
        eventually(HANG, || async {
            fetch(other, "/item", &[]).await.body == "/item v4"
        })
        .await
    );

    // `/list`'s answer names `/item` in `Location`: both go.
    assert_eq!(post(other, "/list").await.status, StatusCode::CREATED);
    assert_eq!(fetch(other, "/list", &[]).await.x_cache(), "miss");
    assert_eq!(fetch(other, "/item", &[]).await.x_cache(), "miss");
    assert_eq!(calls.load(Ordering::SeqCst), 6);

    // A route that keeps its own policy keeps its entries.
    let own_guard = ready_guard(&server).await;
    let own = serve(app(&own_guard, false)).await;
    assert_eq!(fetch(own, "/item", &[]).await.x_cache(), "hit");
    assert_eq!(post(own, "/item").await.status, StatusCode::NO_CONTENT);
    assert_eq!(fetch(own, "/item", &[]).await.x_cache(), "hit");
}

/// A route that learns `Vary: x-tenant` from one URL keeps the entries of its other
/// URLs for requests that do not send the header: they are still hits; requests that
/// do send it get their own variant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learning_a_vary_header_does_not_move_entries_of_requests_without_it() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let calls = Arc::new(AtomicU64::new(0));
    let layer = guard.layer(policy(Duration::from_secs(60))).unwrap();
    let handler = {
        let calls = calls.clone();
        move |uri: http::Uri, headers: HeaderMap| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let tenant = headers
                    .get("x-tenant")
                    .map_or("none", |v| v.to_str().unwrap())
                    .to_owned();
                let vary = if uri.path() == "/varies" {
                    "x-tenant"
                } else {
                    "accept"
                };
                (
                    [(header::VARY, vary)],
                    format!("{} {tenant} v{n}", uri.path()),
                )
            }
        }
    };
    let app = Router::new()
        .route("/varies", get(handler.clone()).layer(layer.clone()))
        .route("/plain", get(handler).layer(layer));
    let addr = serve(app).await;
    assert_eq!(fetch(addr, "/plain", &[]).await.x_cache(), "miss");
    // The route learns x-tenant here.
    let a = fetch(addr, "/varies", &[("x-tenant", "a")]).await;
    assert_eq!((a.x_cache(), a.body.as_str()), ("miss", "/varies a v2"));
    let plain = fetch(addr, "/plain", &[]).await;
    assert_eq!(
        (plain.x_cache(), plain.body.as_str()),
        ("hit", "/plain none v1")
    );
    let b = fetch(addr, "/varies", &[("x-tenant", "b")]).await;
    assert_eq!((b.x_cache(), b.body.as_str()), ("miss", "/varies b v3"));
    assert_eq!(
        fetch(addr, "/varies", &[("x-tenant", "a")]).await.body,
        "/varies a v2"
    );
    let none = fetch(addr, "/varies", &[]).await;
    assert_eq!(
        (none.x_cache(), none.body.as_str()),
        ("miss", "/varies none v4")
    );
    assert_eq!(fetch(addr, "/varies", &[]).await.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

/// A `304` that would make the entry another one's (here, give it a `Set-Cookie`) does
/// not renew it: the entry is left as it was, no client is handed the cookie, and the
/// refresh counts as an answer that may not be stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_304_that_sets_a_cookie_renews_nothing() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let fresh = Duration::from_secs(1);
    let layer = guard.layer(policy(fresh)).unwrap();
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
    assert!(calls.load(Ordering::SeqCst) >= 2);
}
