//! HTTP rules: what may be stored, and for how long. Private answers and requests with
//! credentials are never stored; oversized answers stream through uncached, and a HEAD
//! is served from the entry its GET filled; the origin's directives set an entry's
//! lifetimes within the route's bounds; `Cache-Status` says how each answer was made; a
//! route can be never cached, and policies a layer cannot keep are refused when it is
//! made.

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing;
use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Empty};
use redis::AsyncCommands;
use stampede_guard::{GuardLayer, Policy, RedisStore, StampedeGuard};
use support::app::{cache_status, docs_policy, guard, instance, patient_policy, policy};
use support::http::{fetch, serve};
use support::web::{Got, Origin, all_within, full, get, keys, ready_guard, send};
use support::{HANG, RedisServer, eventually, joined, within};

#[tokio::test]
async fn private_responses_and_requests_with_credentials_are_never_stored() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, request| {
        let mut response = Response::new(full(format!("private {n}")));
        let headers = response.headers_mut();
        match request.uri().path() {
            "/set-cookie" => {
                headers.insert("set-cookie", format!("session={n}").parse().unwrap());
            }
            "/private" => {
                headers.insert("cache-control", "private, max-age=60".parse().unwrap());
            }
            "/no-store" => {
                headers.insert("cache-control", "no-store".parse().unwrap());
            }
            "/vary-star" => {
                headers.insert("vary", "*".parse().unwrap());
            }
            "/no-cache-private" => {
                headers.insert("cache-control", "no-cache, private".parse().unwrap());
            }
            _ => {}
        }
        response
    });
    let i = instance(&server, policy("items").build().unwrap(), origin.service()).await;
    let mut conn = server.conn().await;
    for path in [
        "/set-cookie",
        "/private",
        "/no-store",
        "/vary-star",
        "/no-cache-private",
    ] {
        let before = origin.calls();
        let first = send(&i.service, get(path)).await;
        let second = send(&i.service, get(path)).await;
        assert_eq!(origin.calls(), before + 2, "{path} was served from a cache");
        assert_ne!(first.body, second.body, "{path}");
        // Not stored, and marked so; the second went straight to the origin.
        assert_eq!(first.x_cache(), "pass", "{path}");
        assert_eq!(second.x_cache(), "pass", "{path}");
        let keys = i.layer.cache_keys(&get(path)).unwrap();
        let exists: bool = conn.exists(keys.entry()).await.unwrap();
        assert!(!exists, "{path} reached Redis");
    }
    // Concurrent callers of a private response each get their own.
    let before = origin.calls();
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let service = i.service.clone();
        tasks.push(tokio::spawn(async move {
            send(&service, get("/set-cookie")).await
        }));
    }
    let mut cookies = std::collections::HashSet::new();
    for got in all_within(tasks, HANG, "concurrent private requests").await {
        cookies.insert(
            got.headers
                .get("set-cookie")
                .unwrap()
                .to_str()
                .unwrap()
                .to_owned(),
        );
    }
    assert_eq!(
        cookies.len(),
        10,
        "a Set-Cookie was handed to another caller"
    );
    assert_eq!(origin.calls(), before + 10);

    // Requests with credentials bypass the cache.
    for (name, value) in [("authorization", "Bearer secret"), ("cookie", "session=1")] {
        let before = origin.calls();
        for _ in 0..2 {
            let mut request = get("/public");
            request.headers_mut().insert(name, value.parse().unwrap());
            let got = send(&i.service, request).await;
            assert_eq!(got.x_cache(), "bypass", "{name}");
        }
        assert_eq!(origin.calls(), before + 2, "{name}");
    }
    let keys = i.layer.cache_keys(&get("/public")).unwrap();
    let exists: bool = conn.exists(keys.entry()).await.unwrap();
    assert!(!exists);
}

/// A body the test produces chunk by chunk, through a channel: a chunk exists only once
/// the test has sent it.
struct Chunks(tokio::sync::mpsc::UnboundedReceiver<Bytes>);

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|data| Ok(http_body::Frame::data(data))))
    }
}

/// Responses larger than `max_body` stream through, uncached: the guard reads no more
/// of the body than it takes to see it is too large (nothing, when the length is
/// declared), and passes every later chunk on as it comes. The origin's body is made
/// by the test chunk by chunk: each later chunk is made only once the client has
/// received every byte before it, so a guard that buffered the body would hang here.
/// A HEAD is served from the entry its GET filled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_responses_stream_through_uncached_and_head_is_served_from_get() {
    const CHUNK: usize = 512;
    const CHUNKS: usize = 8;
    let server = RedisServer::start();
    // The sending side of each streamed body, by call.
    type Sender = tokio::sync::mpsc::UnboundedSender<Bytes>;
    let bodies: Arc<std::sync::Mutex<Vec<Option<Sender>>>> = Arc::default();
    let origin = Origin::new(Duration::ZERO, {
        let bodies = bodies.clone();
        move |n, request| match request.uri().path() {
            path @ ("/big" | "/declared") => {
                let (chunks, body) = tokio::sync::mpsc::unbounded_channel();
                bodies.lock().unwrap().push(Some(chunks));
                let mut response = Response::new(Chunks(body).boxed());
                if path == "/declared" {
                    let length = (CHUNK * CHUNKS).to_string().parse().unwrap();
                    response.headers_mut().insert("content-length", length);
                }
                response
            }
            _ => {
                let mut response = Response::new(full(format!("small {n}")));
                response
                    .headers_mut()
                    .insert("content-type", "text/plain".parse().unwrap());
                response
            }
        }
    });
    let policy = policy("items").max_body(1024).build().unwrap();
    let i = instance(&server, policy, origin.service()).await;
    let chunk = |k: usize| Bytes::from(vec![b'a' + k as u8; CHUNK]);
    let expected: String = (0..CHUNKS)
        .map(|k| String::from_utf8(chunk(k).to_vec()).unwrap())
        .collect();
    // The chunks the guard may read before the client gets a byte: past 1024 bytes
    // (3 of 512) when it must find out, none when the length says so.
    for (n, (path, read_first)) in [("/big", 3), ("/big", 3), ("/declared", 1)]
        .into_iter()
        .enumerate()
    {
        let (received, mut got_bytes) = tokio::sync::mpsc::unbounded_channel::<usize>();
        let client = tokio::spawn({
            use tower::ServiceExt;
            let service = i.service.clone();
            async move {
                let response = service.oneshot(get(path)).await.unwrap();
                let x_cache = response.headers()["x-cache"].to_str().unwrap().to_owned();
                let mut body = response.into_body();
                let mut whole = Vec::new();
                while let Some(frame) = body.frame().await {
                    if let Ok(data) = frame.unwrap().into_data() {
                        let _ = received.send(data.len());
                        whole.extend_from_slice(&data);
                    }
                }
                (x_cache, String::from_utf8(whole).unwrap())
            }
        });
        let called = eventually(Duration::from_secs(10), || async {
            bodies.lock().unwrap().len() > n
        });
        assert!(called.await, "{path}: the origin was not called");
        let chunks = bodies.lock().unwrap()[n].take().unwrap();
        let mut sent = 0;
        let mut delivered = 0;
        for k in 0..CHUNKS {
            chunks.send(chunk(k)).unwrap();
            sent += CHUNK;
            if k + 1 < read_first {
                continue;
            }
            // Every byte made so far reaches the client before the next chunk exists.
            let passed_on = async {
                while delivered < sent {
                    delivered += got_bytes.recv().await.expect("the response ended early");
                }
            };
            within(
                Duration::from_secs(10),
                passed_on,
                format!(
                    "{path}: the {sent} bytes the origin made reaching the client (an \
                     oversized body held back by the guard)"
                ),
            )
            .await;
            assert_eq!(delivered, sent, "{path}");
        }
        drop(chunks); // the body ends
        let (x_cache, body) = joined(client, HANG, format!("{path}: the response")).await;
        assert_eq!(body.len(), CHUNK * CHUNKS, "{path}");
        assert_eq!(body, expected, "{path}");
        assert_eq!(x_cache, "pass", "{path}");
        assert_eq!(origin.calls(), n as u64 + 1, "{path}");
    }
    let mut conn = server.conn().await;
    let keys = i.layer.cache_keys(&get("/big")).unwrap();
    let exists: bool = conn.exists(keys.entry()).await.unwrap();
    assert!(!exists);

    let got = send(&i.service, get("/small")).await;
    assert_eq!(got.x_cache(), "miss");
    let head = Request::head("/small")
        .header("host", "shop.example")
        .body(Empty::new())
        .unwrap();
    let got_head = send(&i.service, head).await;
    assert_eq!(got_head.x_cache(), "hit");
    assert_eq!(got_head.status, StatusCode::OK);
    assert_eq!(got_head.body, "");
    assert_eq!(got_head.headers.get("content-type").unwrap(), "text/plain");
    assert_eq!(origin.calls(), 4);
}

fn policy_named(route: &str) -> Policy {
    Policy::builder(route).build().unwrap()
}

/// Answers that are not from an entry say so in `Cache-Status` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_status_says_how_each_answer_was_made() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard.layer(docs_policy(Duration::from_secs(5))).unwrap();
    let app = Router::new()
        .route(
            "/doc",
            routing::get(|| async { "doc" }).layer(layer.clone()),
        )
        .route(
            "/private",
            routing::get(|| async { ([(header::CACHE_CONTROL, "private")], "mine") })
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
    Router::new().route("/d", routing::get(handler).layer(layer))
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
        // `no-cache`: revalidated on every use, whatever the floor (never fresh: stale
        // from its first millisecond, said as -1).
        ("no-cache", "&etag=%22e%22", -1),
        // Heuristic-free, with only a validator: stale at once, but for the floor.
        ("public", "&etag=%22e%22", 2),
    ] {
        let path = query(cc, more);
        let got = fetch(follows, &path, &[]).await;
        assert_eq!(got.x_cache(), "miss", "{cc}");
        if ttl < 0 {
            assert!(ttl_of(&got) <= 0, "{cc} {more}: {}", ttl_of(&got));
        } else {
            assert_eq!(ttl_of(&got), ttl, "{cc} {more}");
        }
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

/// A route that must never be cached says so; a route name is refused twice.
#[tokio::test]
async fn a_route_can_be_never_cached_and_a_route_name_is_taken_once() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let i = instance(
        &server,
        patient_policy("admin").never_cache().build().unwrap(),
        origin.service(),
    )
    .await;
    for n in 1..=2 {
        let got = send(&i.service, get("/admin")).await;
        assert_eq!(
            (got.body.as_str(), got.x_cache()),
            (format!("v{n}").as_str(), "bypass")
        );
    }
    let again = i
        .guard
        .layer(patient_policy("admin").build().unwrap())
        .unwrap_err();
    assert_eq!(again.field(), "route");
    assert!(again.to_string().contains("admin"), "{again}");
}

#[tokio::test]
async fn invalid_policies_are_refused_when_the_layer_is_made() {
    let server = RedisServer::start();
    let guard = guard(&server); // command timeout 100 ms
    let error = guard
        .layer(
            Policy::builder("items")
                .lease_ttl(Duration::from_millis(300))
                .refresh_timeout(Duration::from_millis(200))
                .error_backoff(Duration::from_millis(300))
                .build()
                .unwrap(),
        )
        .unwrap_err();
    assert_eq!(error.field(), "lease_ttl");
    let error = guard
        .layer(
            Policy::builder("items")
                .error_backoff(Duration::from_millis(100))
                .build()
                .unwrap(),
        )
        .unwrap_err();
    assert_eq!(error.field(), "error_backoff");
    let store = RedisStore::builder(server.url()).build().unwrap();
    let error = StampedeGuard::builder(store, keys())
        .l1_capacity(0)
        .build()
        .unwrap_err();
    assert_eq!(error.field(), "l1_capacity");
}

/// A GET with a body is forwarded with its body and never stored nor answered from the
/// cache (what it asks may lie in its body, which no key holds), and its
/// `Cache-Status` says so; one without a body (or with `Content-Length: 0`) is cached
/// as ever. (Its body was dropped on the fill and not keyed: `{"q":"alice"}` and
/// `{"q":"bob"}` got one answer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_with_a_body_is_forwarded_with_it_and_not_stored() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard.layer(policy_named("search")).unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let handler = {
        let calls = calls.clone();
        move |body: String| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move { format!("results for {body}") }
        }
    };
    let app = Router::new().route("/search", routing::get(handler).layer(layer));
    let addr = serve(app).await;
    let with_body = |body: &'static str| {
        let request = http::Request::get("/search")
            .header("host", "shop.example")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                body.as_bytes(),
            )))
            .unwrap();
        support::http::send_request(addr, request)
    };
    for body in [r#"{"q":"alice"}"#, r#"{"q":"bob"}"#, r#"{"q":"alice"}"#] {
        let got = with_body(body).await;
        assert_eq!(got.body, format!("results for {body}"));
        assert_eq!(got.x_cache(), "bypass", "{body}");
        let status = got.headers.get("cache-status").unwrap().to_str().unwrap();
        assert!(
            status.ends_with("fwd=bypass; detail=request-body"),
            "{status}"
        );
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    // Without a body: cached.
    assert_eq!(fetch(addr, "/search", &[]).await.x_cache(), "miss");
    let empty = fetch(addr, "/search", &[("content-length", "0")]).await;
    assert_eq!(empty.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}
