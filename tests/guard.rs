//! The guard layer against real Redis servers: stampedes, fencing, HTTP rules. The
//! stampede, cold-miss, fencing and invalidation tests run one body on a single server,
//! on a Redis Cluster and as a user with only what `KeySpace::acl_rules` allows, with
//! the same exact counts.

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use redis::AsyncCommands;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::web::{self, Instance, Origin, all_within, full, get, keys, send};
use support::{HANG, Redis, RedisServer, Store, eventually, joined, within};

/// Generous: exact counts must not depend on every Redis reply coming within 100 ms
/// on a machine whose cores are busy.
const TIMEOUT: Duration = Duration::from_millis(250);

fn guard(redis: &impl Store) -> StampedeGuard {
    StampedeGuard::builder(redis.store(TIMEOUT), keys())
        .build()
        .unwrap()
}

fn policy(route: &str) -> stampede_guard::policy::PolicyBuilder {
    Policy::builder(route)
        .fresh_ttl(Duration::from_millis(500))
        .grace(Duration::from_secs(30))
        .lease_ttl(Duration::from_secs(5))
        .refresh_timeout(Duration::from_secs(5))
        .cold_wait(Duration::from_secs(5))
        .error_backoff(Duration::from_secs(1))
}

async fn instance<S>(redis: &impl Store, policy: Policy, origin: S) -> Instance<S> {
    web::instance(guard(redis), policy, origin).await
}

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

#[tokio::test]
async fn vary_headers_are_keyed_and_unkeyed_headers_cannot_poison() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |_, request| {
        let header = |name: &str| {
            request
                .headers()
                .get(name)
                .map_or("none".to_owned(), |v| v.to_str().unwrap().to_owned())
        };
        let mut response = Response::new(full(format!(
            "lang={} host={}",
            header("accept-language"),
            header("x-forwarded-host")
        )));
        response
            .headers_mut()
            .insert("vary", "Accept-Language".parse().unwrap());
        response
    });
    let policy = policy("items")
        .key_headers(["accept-language"])
        .build()
        .unwrap();
    let i = instance(&server, policy, origin.service()).await;
    let with = |lang: &str| {
        let mut request = get("/items/1");
        request
            .headers_mut()
            .insert("accept-language", lang.parse().unwrap());
        request
    };
    assert_eq!(send(&i.service, with("fr")).await.body, "lang=fr host=none");
    assert_eq!(send(&i.service, with("de")).await.body, "lang=de host=none");
    let again = send(&i.service, with("fr")).await;
    assert_eq!(
        (again.body.as_str(), again.x_cache()),
        ("lang=fr host=none", "hit")
    );
    assert_eq!(origin.calls(), 2);

    // An attacker's unkeyed header never reaches the origin through a fill, so it cannot
    // shape what the next client gets.
    let mut evil = get("/items/2");
    evil.headers_mut()
        .insert("x-forwarded-host", "evil.example".parse().unwrap());
    let attacker = send(&i.service, evil).await;
    assert_eq!(attacker.body, "lang=none host=none");
    let victim = send(&i.service, get("/items/2")).await;
    assert_eq!(
        (victim.body.as_str(), victim.x_cache()),
        ("lang=none host=none", "hit")
    );
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

#[tokio::test]
async fn invalidation_removes_the_entry_from_every_instance() {
    invalidation_reaches_every_instance(Redis::single()).await;
}

#[tokio::test]
async fn on_a_cluster_invalidation_removes_the_entry_from_every_instance() {
    invalidation_reaches_every_instance(Redis::cluster()).await;
}

#[tokio::test]
async fn as_the_least_privileged_user_invalidation_removes_the_entry_from_every_instance() {
    invalidation_reaches_every_instance(Redis::least_privileged(&keys()).await).await;
}

async fn invalidation_reaches_every_instance(server: Redis) {
    let origin = Origin::versions(Duration::ZERO);
    let mut fleet = Vec::new();
    for _ in 0..3 {
        let policy = policy("items")
            .fresh_ttl(Duration::from_secs(60))
            .build()
            .unwrap();
        fleet.push(instance(&server, policy, origin.service()).await);
    }
    for i in &fleet {
        let got = send(&i.service, get("/items/1")).await;
        assert_eq!(got.body, "v1");
    }
    assert_eq!(origin.calls(), 1);
    let item = get("/items/1");
    let invalidation = fleet[0].layer.invalidate(&item);
    let removed = within(HANG, invalidation, "the invalidation")
        .await
        .unwrap();
    assert!(removed);
    for i in &fleet {
        let service = &i.service;
        assert!(
            eventually(Duration::from_secs(2), || async {
                send(service, get("/items/1")).await.body == "v2"
            })
            .await,
            "an instance kept the invalidated entry"
        );
    }
    assert_eq!(origin.calls(), 2);
    // Every instance's L1 holds the refilled entry, and nothing else: the invalidated
    // one was dropped, not kept beside it. (moka counts lazily: a read runs its pending
    // bookkeeping, at most every 300 ms, so the count is polled with hits.)
    for (n, i) in fleet.iter().enumerate() {
        let service = &i.service;
        let settled = eventually(Duration::from_secs(3), || async {
            let got = send(service, get("/items/1")).await;
            assert_eq!(
                (got.body.as_str(), got.x_cache()),
                ("v2", "hit"),
                "instance {n}"
            );
            i.guard.l1_entries() == 1
        });
        assert!(
            settled.await,
            "instance {n}: {} entries in L1",
            i.guard.l1_entries()
        );
    }
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
