//! The guard layer against real Redis servers: stampedes, fencing, HTTP rules. The
//! stampede, cold-miss, fencing and invalidation tests run one body on a single server,
//! on a Redis Cluster and as a user with only what `KeySpace::acl_rules` allows, with
//! the same exact counts.

mod support;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use redis::AsyncCommands;
use stampede_guard::metrics::Event;
use stampede_guard::{ColdMiss, GuardLayer, Policy, RedisStore, StampedeGuard};
use support::web::{self, Instance, Origin, all_within, full, get, keys, send, total};
use support::{HANG, Redis, RedisServer, Store, eventually, joined, within};
use tokio::sync::Barrier;

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

/// 3 instances, an entry gone stale, 300 concurrent requests: one origin call for the
/// fleet, everyone served the stale body, and no request waited for the origin (the
/// refresh is held at a gate until every response is in: a request that waited for it
/// would never finish).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_entry_is_refreshed_once_for_the_fleet_and_nobody_waits() {
    stale_entry_refreshed_once(Redis::single()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_a_stale_entry_is_refreshed_once_for_the_fleet_and_nobody_waits() {
    stale_entry_refreshed_once(Redis::cluster()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn as_the_least_privileged_user_a_stale_entry_is_refreshed_once_for_the_fleet_and_nobody_waits()
 {
    stale_entry_refreshed_once(Redis::least_privileged(&keys()).await).await;
}

async fn stale_entry_refreshed_once(server: Redis) {
    let origin = Origin::versions(Duration::from_millis(200));
    let mut fleet = Vec::new();
    for _ in 0..3 {
        fleet.push(instance(&server, policy("items").build().unwrap(), origin.service()).await);
    }
    // Warm every instance: one cold fill, the others read L2.
    for i in &fleet {
        assert_eq!(send(&i.service, get("/items/1")).await.body, "v1");
    }
    assert_eq!(origin.calls(), 1);
    tokio::time::sleep(Duration::from_millis(600)).await; // past fresh_ttl

    origin.hold(2);
    let barrier = Arc::new(Barrier::new(300));
    let mut tasks = Vec::new();
    for n in 0..300 {
        let service = fleet[n % 3].service.clone();
        let (barrier, seq) = (barrier.clone(), origin.seq.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let got = send(&service, get("/items/1")).await;
            (got, seq.next())
        }));
    }
    let responses = all_within(
        tasks,
        Duration::from_secs(10),
        "requests waited for the held origin",
    )
    .await;
    let opened = std::time::Instant::now();
    origin.open();

    assert_eq!(responses.len(), 300);
    for (got, _) in &responses {
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(got.body, "v1");
        assert_eq!(got.x_cache(), "stale");
    }
    // Once the refresh is written, exactly one origin call was made for it.
    let layers: Vec<&GuardLayer> = fleet.iter().map(|i| &i.layer).collect();
    assert!(
        eventually(Duration::from_secs(5), || async {
            total(&layers, Event::RefreshWritten) == 1
        })
        .await
    );
    assert_eq!(origin.calls(), 2);
    let returned = origin.returned.lock().unwrap().clone();
    let refresh_returned = *returned.last().unwrap();
    assert!(
        responses.iter().all(|(_, seq)| *seq < refresh_returned),
        "a response came after the origin returned"
    );
    assert_eq!(total(&layers, Event::Stale), 300);
    // One refresh task per key per process: the other two instances' found the lease
    // busy (or, later, adopted the new entry); nobody else tried.
    assert_eq!(
        total(&layers, Event::RefreshBusy) + total(&layers, Event::RefreshAdopted),
        2,
        "refreshes that did not write"
    );
    // Every instance ends up serving the new entry, without another origin call.
    for i in &fleet {
        let (service, served) = (&i.service, Arc::new(std::sync::Mutex::new(String::new())));
        assert!(
            eventually(Duration::from_secs(3), || {
                let served = served.clone();
                async move {
                    let got = send(service, get("/items/1")).await;
                    *served.lock().unwrap() = got.body.clone();
                    got.body == "v2"
                }
            })
            .await,
            "instance still serves {}",
            served.lock().unwrap()
        );
    }
    // No call but the refresh while v2 was fresh (500 ms from its write, which came after
    // the gate opened; less 50 ms, as an entry read from Redis is aged by its PTTL).
    // Reading the instances may outlast that on a slow machine: v2's own refresh is then
    // due, one per window since.
    let v2_stale = opened + Duration::from_millis(450);
    assert_eq!(
        origin.calls_started_before(v2_stale),
        2,
        "calls while v2 was fresh"
    );
    let windows_since = (opened.elapsed().as_millis() / 500) as u64;
    assert!(
        origin.calls() - 2 <= windows_since,
        "{} origin calls, {windows_since} windows after v2",
        origin.calls()
    );
    assert_eq!(
        total(&layers, Event::LocalOnly),
        0,
        "fills and refreshes without the lease"
    );
}

/// 3 instances, a cold key, 300 concurrent requests: one origin call; the other
/// instances' fills find the lease busy and are woken by the filler's notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cold_key_is_filled_once_and_other_instances_are_woken_by_the_notice() {
    cold_key_filled_once(Redis::single()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_a_cold_key_is_filled_once_and_other_instances_are_woken_by_the_notice() {
    cold_key_filled_once(Redis::cluster()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn as_the_least_privileged_user_a_cold_key_is_filled_once_and_other_instances_are_woken_by_the_notice()
 {
    cold_key_filled_once(Redis::least_privileged(&keys()).await).await;
}

async fn cold_key_filled_once(server: Redis) {
    let origin = Origin::versions(Duration::from_millis(300));
    let mut fleet = Vec::new();
    for _ in 0..3 {
        // A cold wait far longer than the test: only a notice can end it in time.
        let policy = policy("items")
            .cold_wait(Duration::from_secs(30))
            .build()
            .unwrap();
        fleet.push(instance(&server, policy, origin.service()).await);
    }
    let barrier = Arc::new(Barrier::new(300));
    let mut tasks = Vec::new();
    for n in 0..300 {
        let service = fleet[n % 3].service.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            send(&service, get("/items/7")).await
        }));
    }
    let responses = all_within(
        tasks,
        Duration::from_secs(10),
        "cold followers were not woken",
    )
    .await;
    assert_eq!(origin.calls(), 1);
    for got in &responses {
        assert_eq!(got.body, "v1");
        assert_eq!(got.x_cache(), "miss");
    }
    let layers: Vec<&GuardLayer> = fleet.iter().map(|i| &i.layer).collect();
    assert_eq!(total(&layers, Event::ColdFill), 1);
    // One fill task per other instance waited, and each was ended by the entry.
    assert_eq!(total(&layers, Event::ColdWaitNotified), 2);
    assert_eq!(total(&layers, Event::ColdWaitTimedOut), 0);
    assert_eq!(
        total(&layers, Event::LocalOnly),
        0,
        "fills without the lease"
    );
    assert_eq!(total(&layers, Event::Miss), 300);
}

/// Over many freshness windows, with bursts on every instance, the origin is called once
/// per window (plus the first fill).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn origin_calls_equal_the_number_of_windows() {
    const WINDOWS: u64 = 8;
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::from_millis(20));
    let mut fleet = Vec::new();
    for _ in 0..3 {
        let policy = policy("items")
            .fresh_ttl(Duration::from_millis(300))
            .build()
            .unwrap();
        fleet.push(instance(&server, policy, origin.service()).await);
    }
    let layers: Vec<&GuardLayer> = fleet.iter().map(|i| &i.layer).collect();
    assert_eq!(send(&fleet[0].service, get("/items/1")).await.body, "v1");
    for window in 1..=WINDOWS {
        tokio::time::sleep(Duration::from_millis(350)).await;
        let mut tasks = Vec::new();
        for n in 0..60 {
            let service = fleet[n % 3].service.clone();
            tasks.push(tokio::spawn(async move {
                send(&service, get("/items/1")).await
            }));
        }
        for got in all_within(tasks, HANG, "a window's burst").await {
            assert_eq!(got.status, StatusCode::OK);
        }
        assert!(
            eventually(Duration::from_secs(3), || async {
                total(&layers, Event::RefreshWritten) == window
            })
            .await,
            "window {window}: {} refreshes written",
            total(&layers, Event::RefreshWritten)
        );
        // Bring every instance's L1 up to date before the next window.
        for i in &fleet {
            let want = format!("v{}", window + 1);
            let service = &i.service;
            assert!(
                eventually(Duration::from_secs(3), || {
                    let want = want.clone();
                    async move { send(service, get("/items/1")).await.body == want }
                })
                .await
            );
        }
        assert_eq!(origin.calls(), window + 1, "window {window}");
    }
    assert_eq!(origin.calls(), WINDOWS + 1);
}

/// Two instances sharing `/items/1` (answered `v1`, then `second`, then `third`), the
/// entry gone stale, and instance a's refresh held in the origin with its lease taken.
async fn a_refresh_held_in_the_origin(
    server: &impl Store,
    second: &'static str,
    third: &'static str,
) -> (
    Origin,
    Vec<
        Instance<
            impl tower::Service<
                web::Req,
                Response = Response<web::Body>,
                Error = Infallible,
                Future: Send,
            > + Clone
            + Send
            + Sync
            + 'static,
        >,
    >,
) {
    let origin = Origin::new(Duration::ZERO, move |n, _| {
        Response::new(full(match n {
            1 => "v1",
            2 => second,
            _ => third,
        }))
    });
    let a = instance(server, policy("items").build().unwrap(), origin.service()).await;
    let b = instance(server, policy("items").build().unwrap(), origin.service()).await;
    assert_eq!(send(&a.service, get("/items/1")).await.body, "v1");
    assert_eq!(send(&b.service, get("/items/1")).await.body, "v1");
    tokio::time::sleep(Duration::from_millis(600)).await;

    origin.hold(2);
    let started = origin.started.notified();
    assert_eq!(send(&a.service, get("/items/1")).await.x_cache(), "stale");
    // a's refresh is in the origin, holding the lease
    within(HANG, started, "a's refresh reaching the origin").await;
    (origin, vec![a, b])
}

/// A refresher that lost its lease mid-refresh (here: the lease key is deleted, as a
/// failover or an eviction would) is overtaken by another instance; its late write is
/// refused in Redis, counted, and it takes the newer entry into its L1 instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresher_that_lost_its_lease_cannot_overwrite_the_newer_entry() {
    late_refresher_fenced(Redis::single()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_refresher_that_lost_its_lease_cannot_overwrite_the_newer_entry() {
    late_refresher_fenced(Redis::cluster()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn as_the_least_privileged_user_a_refresher_that_lost_its_lease_cannot_overwrite_the_newer_entry()
 {
    late_refresher_fenced(Redis::least_privileged(&keys()).await).await;
}

async fn late_refresher_fenced(server: Redis) {
    let (origin, fleet) = a_refresh_held_in_the_origin(&server, "from-a-late", "from-b").await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let keys = a.layer.cache_keys(&get("/items/1")).unwrap();
    let deleted: i64 = server.cmd(redis::cmd("DEL").arg(keys.lease().key())).await;
    assert_eq!(deleted, 1, "a's lease was not there");

    assert_eq!(send(&b.service, get("/items/1")).await.x_cache(), "stale");
    assert!(
        eventually(Duration::from_secs(3), || async {
            b.layer.stats().get(Event::RefreshWritten) == 1
        })
        .await
    );
    origin.open();
    assert!(
        eventually(Duration::from_secs(3), || async {
            a.layer.stats().get(Event::FencedWriteRefused) == 1
        })
        .await
    );

    let data: Vec<u8> = server
        .cmd(redis::cmd("HGET").arg(keys.entry()).arg("d"))
        .await;
    let stored = stampede_guard::fuzzing::decode(&data).unwrap();
    assert_eq!(stored.body, "from-b");
    assert_eq!(origin.calls(), 3);
    // a serves the newer entry, never its own late result: at once (adopted when its
    // write was refused), or, if that look at L2 timed out on a slow machine, once its
    // next refresh has run.
    let service = &a.service;
    assert!(
        eventually(Duration::from_secs(3), || async {
            let got = send(service, get("/items/1")).await;
            assert_ne!(got.body, "from-a-late", "the late write reached a's L1");
            got.body == "from-b"
        })
        .await
    );
}

#[tokio::test]
async fn garbage_at_an_entry_key_is_a_counted_miss() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let i = instance(&server, policy("items").build().unwrap(), origin.service()).await;
    let valid = stampede_guard::fuzzing::CachedResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from_static(b"planted"),
        fresh_for: Duration::from_secs(60),
        grace: Duration::ZERO,
        keep: Duration::from_secs(60),
        token: stampede_guard::lease::FencingToken::new(1),
    }
    .encode();
    let mut truncated = valid.clone();
    truncated.truncate(valid.len() - 3);
    let mut other_version = valid.clone();
    other_version[2] = 99;
    let mut conn = server.conn().await;
    let cases: Vec<(&str, Box<dyn Fn(&str) -> redis::Cmd>)> = vec![
        (
            "a string",
            Box::new(|k| redis::cmd("SET").arg(k).arg("garbage").clone()),
        ),
        (
            "a list",
            Box::new(|k| redis::cmd("RPUSH").arg(k).arg("x").clone()),
        ),
        (
            "a hash without data",
            Box::new(|k| redis::cmd("HSET").arg(k).arg("t").arg("5").clone()),
        ),
        (
            "garbage data",
            Box::new(|k| {
                redis::cmd("HSET")
                    .arg(k)
                    .arg("t")
                    .arg("5")
                    .arg("d")
                    .arg("garbage")
                    .clone()
            }),
        ),
        (
            "truncated",
            Box::new({
                let t = truncated.clone();
                move |k| {
                    redis::cmd("HSET")
                        .arg(k)
                        .arg("t")
                        .arg("5")
                        .arg("d")
                        .arg(t.clone())
                        .clone()
                }
            }),
        ),
        (
            "another version",
            Box::new({
                let t = other_version.clone();
                move |k| {
                    redis::cmd("HSET")
                        .arg(k)
                        .arg("t")
                        .arg("5")
                        .arg("d")
                        .arg(t.clone())
                        .clone()
                }
            }),
        ),
    ];
    for (n, (what, plant)) in cases.iter().enumerate() {
        let path = format!("/items/{n}");
        let keys = i.layer.cache_keys(&get(&path)).unwrap();
        let _: () = plant(keys.entry()).query_async(&mut conn).await.unwrap();
        let before = i.layer.stats().get(Event::DecodeFailure);
        let got = send(&i.service, get(&path)).await;
        assert_eq!(got.status, StatusCode::OK, "{what}");
        assert_eq!(got.x_cache(), "miss", "{what}");
        assert!(got.body.starts_with('v'), "{what}: {}", got.body);
        assert_eq!(
            i.layer.stats().get(Event::DecodeFailure),
            before + 1,
            "{what}"
        );
        // The fill replaced the garbage with a valid entry.
        let data: Vec<u8> = conn.hget(keys.entry(), "d").await.unwrap();
        assert_eq!(
            stampede_guard::fuzzing::decode(&data).unwrap().body,
            got.body,
            "{what}"
        );
    }
    assert_eq!(origin.calls(), cases.len() as u64);
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

/// The origin fails from its second call on: the stale entry is served through the
/// grace window (its refresh failing), then, past grace, instead of the failure until the
/// stale-if-error window ends; after that the failure shows.
#[tokio::test]
async fn an_origin_error_keeps_serving_stale_until_stale_if_error_ends() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, _| {
        if n == 1 {
            Response::new(full("v1"))
        } else {
            let mut response = Response::new(full("boom"));
            *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            response
        }
    });
    let policy = policy("items")
        .fresh_ttl(Duration::from_millis(300))
        .grace(Duration::from_millis(700))
        .stale_if_error(Duration::from_millis(2000))
        .cold_wait(Duration::from_millis(200))
        .build()
        .unwrap();
    let i = instance(&server, policy, origin.service()).await;
    let start = tokio::time::Instant::now();
    assert_eq!(send(&i.service, get("/items/1")).await.body, "v1");

    // In grace (age 300-1000 ms): stale, and the refresh fails.
    tokio::time::sleep_until(start + Duration::from_millis(500)).await;
    let got = send(&i.service, get("/items/1")).await;
    assert_eq!((got.body.as_str(), got.x_cache()), ("v1", "stale"));
    assert!(
        eventually(Duration::from_secs(2), || async {
            i.layer.stats().get(Event::RefreshOriginError) == 1
        })
        .await
    );

    // Past grace, within stale-if-error (age 1000-2300 ms): stale instead of the 500.
    tokio::time::sleep_until(start + Duration::from_millis(1500)).await;
    let got = send(&i.service, get("/items/1")).await;
    assert_eq!(
        (got.status, got.body.as_str(), got.x_cache()),
        (StatusCode::OK, "v1", "stale")
    );
    assert_eq!(i.layer.stats().get(Event::StaleIfError), 1);

    // Past stale-if-error: the entry is gone and the failure shows (not stored).
    tokio::time::sleep_until(start + Duration::from_millis(2800)).await;
    let got = send(&i.service, get("/items/1")).await;
    assert_eq!(got.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(got.x_cache(), "pass");
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
async fn a_cold_miss_can_answer_503_when_the_filler_is_elsewhere() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::from_millis(800));
    let policy = || {
        policy("items")
            .cold_wait(Duration::from_millis(100))
            .cold_miss(ColdMiss::Reject {
                retry_after: Duration::from_millis(1500),
            })
            .build()
            .unwrap()
    };
    let a = instance(&server, policy(), origin.service()).await;
    let b = instance(&server, policy(), origin.service()).await;
    let filler = tokio::spawn({
        let service = a.service.clone();
        async move { send(&service, get("/items/1")).await }
    });
    let started = origin.started.notified();
    within(HANG, started, "a's fill reaching the origin").await;
    let got = send(&b.service, get("/items/1")).await;
    assert_eq!(got.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(got.headers.get("retry-after").unwrap(), "2");
    assert_eq!(joined(filler, HANG, "a's fill").await.body, "v1");
    assert_eq!(b.layer.stats().get(Event::Rejected), 1);
    assert_eq!(origin.calls(), 1);
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

/// A refresh that took its lease (and read the origin) before an invalidation must not
/// bring the invalidated data back: its write meets the invalidation's tombstone, whose
/// token is newer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_is_not_undone_by_a_refresh_that_began_before_it() {
    let server = RedisServer::start();
    let (origin, fleet) =
        a_refresh_held_in_the_origin(&server, "read-before-invalidation", "after").await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let item = get("/items/1");
    let invalidation = b.layer.invalidate(&item);
    assert!(
        within(HANG, invalidation, "the invalidation")
            .await
            .unwrap()
    );
    origin.open();
    assert!(
        eventually(Duration::from_secs(3), || async {
            a.layer.stats().get(Event::FencedWriteRefused) == 1
        })
        .await
    );
    // Neither instance serves the invalidated data, nor the refresh that predates it.
    for i in [a, b] {
        let got = send(&i.service, get("/items/1")).await;
        assert_eq!(got.body, "after", "{}", got.x_cache());
    }
    assert_eq!(origin.calls(), 3);
}

/// Past grace, with an entry that may still stand in (stale-if-error), a caller waits at
/// most the soft timeout for the fill, then gets the entry; the fill goes on and lands.
#[tokio::test]
async fn the_soft_timeout_serves_the_expired_entry_while_the_fill_goes_on() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, _| Response::new(full(format!("v{n}"))));
    let policy = policy("items")
        .fresh_ttl(Duration::from_millis(200))
        .grace(Duration::from_millis(200))
        .stale_if_error(Duration::from_secs(10))
        .soft_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let i = instance(&server, policy, origin.service()).await;
    assert_eq!(send(&i.service, get("/items/1")).await.body, "v1");
    tokio::time::sleep(Duration::from_millis(500)).await; // past fresh + grace
    origin.hold(2);
    let started = tokio::time::Instant::now();
    let got = send(&i.service, get("/items/1")).await;
    let waited = started.elapsed();
    assert_eq!((got.body.as_str(), got.x_cache()), ("v1", "stale"));
    assert!(
        waited >= Duration::from_millis(100) && waited < Duration::from_millis(500),
        "{waited:?}"
    );
    assert_eq!(i.layer.stats().get(Event::SoftTimeout), 1);
    let opened = std::time::Instant::now();
    origin.open();
    let service = &i.service;
    assert!(
        eventually(Duration::from_secs(2), || async {
            send(service, get("/items/1")).await.body == "v2"
        })
        .await,
        "{:?}, {} origin calls",
        i.layer.stats(),
        origin.calls()
    );
    // The fill was not repeated: no call but the fill while v2 was fresh (200 ms from its
    // write, which came after the gate opened; less 50 ms, as an entry read from Redis is
    // aged by its PTTL). A slow machine may read v2 past that: v2's own refresh is then
    // due, one per window since.
    let v2_stale = opened + Duration::from_millis(150);
    assert_eq!(
        origin.calls_started_before(v2_stale),
        2,
        "calls while v2 was fresh"
    );
    let windows_since = (opened.elapsed().as_millis() / 200) as u64;
    assert!(
        origin.calls() - 2 <= windows_since,
        "{} origin calls, {windows_since} windows after v2",
        origin.calls()
    );
}

/// Without Redis at all, the guard still coalesces: one origin call per key per process,
/// stale served while refreshing, and no Redis errors counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_only_guard_coalesces_without_redis() {
    let origin = Origin::versions(Duration::from_millis(100));
    let guard = StampedeGuard::builder(RedisStore::local_only(), keys())
        .build()
        .unwrap();
    let i = web::instance(
        guard,
        policy("items")
            .fresh_ttl(Duration::from_millis(300))
            .build()
            .unwrap(),
        origin.service(),
    )
    .await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let service = i.service.clone();
        tasks.push(tokio::spawn(async move {
            send(&service, get("/items/1")).await
        }));
    }
    for got in all_within(tasks, HANG, "the cold burst").await {
        assert_eq!(got.body, "v1");
    }
    assert_eq!(origin.calls(), 1);
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(send(&i.service, get("/items/1")).await.x_cache(), "stale");
    let service = &i.service;
    assert!(
        eventually(Duration::from_secs(2), || async {
            send(service, get("/items/1")).await.body == "v2"
        })
        .await
    );
    // Two fills, each local. v2 is fresh for 300 ms from its write, which came at least
    // 100 ms (the origin's delay) after its refresh began: no third call starts sooner.
    // A slow machine may read v2 past that: v2's own refresh is then due, one per window.
    let refresh_began = origin.log.lock().unwrap()[1].0;
    let v2_stale = refresh_began + Duration::from_millis(400);
    assert_eq!(
        origin.calls_started_before(v2_stale),
        2,
        "calls while v2 was fresh"
    );
    let windows_since = (refresh_began.elapsed().as_millis() / 300) as u64;
    let calls = origin.calls();
    assert!(
        calls - 2 <= windows_since,
        "{calls} origin calls, {windows_since} windows after v2"
    );
    let stats = i.layer.stats();
    assert_eq!(stats.get(Event::RedisError), 0, "{stats:?}");
    assert_eq!(stats.get(Event::LocalOnly), calls, "{stats:?}");
}

/// A full `Buffer` (bound 1, over a `ConcurrencyLimit(1)`) inside the guard: one fill
/// in the origin, one held by the buffer's worker, one queued in its channel. Hits are answered all the same
/// (a guard that asked the buffer for readiness would wait with them), and the fills
/// land once the origin answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_buffer_inside_the_guard_bounds_the_origin_not_the_hits() {
    use tower::{Layer, ServiceExt};
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::from_millis(50));
    let inner = tower::ServiceBuilder::new()
        .buffer(1)
        .concurrency_limit(1)
        .service(origin.service());
    let guard = guard(&server);
    within(HANG, guard.ready(), "the guard's readiness")
        .await
        .unwrap();
    let layer = guard.layer(policy("items").build().unwrap()).unwrap();
    let service = layer.layer(inner.clone());
    let fetch = |path: &'static str| {
        let service = service.clone();
        let exchange = async move {
            let response = service.oneshot(get(path)).await.unwrap();
            let x_cache = response.headers()["x-cache"].to_str().unwrap().to_owned();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (String::from_utf8_lossy(&body).into_owned(), x_cache)
        };
        within(HANG, exchange, format!("GET {path}"))
    };
    assert_eq!(
        fetch("/items/1").await,
        ("v1".to_owned(), "miss".to_owned())
    );
    assert_eq!(fetch("/items/1").await, ("v1".to_owned(), "hit".to_owned()));

    origin.hold(2);
    let started = origin.started.notified();
    let slow = tokio::spawn(fetch("/items/2"));
    // the limit's one slot is in the held origin call
    within(HANG, started, "the fill of /items/2 reaching the origin").await;
    let queued = vec![
        tokio::spawn(fetch("/items/3")),
        tokio::spawn(fetch("/items/4")),
    ];
    // The buffer is full once both fills wait in it: a ready check times out.
    let full = eventually(Duration::from_secs(10), || {
        let mut probe = inner.clone();
        async move {
            tokio::time::timeout(Duration::from_millis(50), probe.ready())
                .await
                .is_err()
        }
    });
    assert!(full.await, "the buffer never filled up");
    let hits: Vec<_> = (0..20).map(|_| tokio::spawn(fetch("/items/1"))).collect();
    for got in all_within(hits, Duration::from_secs(10), "hits waited for the buffer").await {
        assert_eq!(got, ("v1".to_owned(), "hit".to_owned()));
    }
    origin.open();
    let slow = all_within(vec![slow], Duration::from_secs(10), "the fill starved").await;
    assert_eq!(slow[0], ("v2".to_owned(), "miss".to_owned()));
    let mut queued = all_within(queued, Duration::from_secs(10), "fills starved").await;
    queued.sort();
    assert_eq!(
        queued,
        [
            ("v3".to_owned(), "miss".to_owned()),
            ("v4".to_owned(), "miss".to_owned())
        ]
    );
    assert_eq!(origin.calls(), 4);
}

/// A request with `host` set to raw bytes (not text: `to_str` refuses them).
fn with_raw_host(path: &str, host: &[u8]) -> web::Req {
    let mut request = get(path);
    request.headers_mut().insert(
        http::header::HOST,
        http::HeaderValue::from_bytes(host).unwrap(),
    );
    request
}

/// A hit finds its entry by a key it computes piece by piece from the request, while the
/// entry was put under the key computed from the identity made whole: for every shape of
/// request the two must agree, or the second request of each pair below would miss L1.
/// Pairs of requests with the same identity (parameters reordered, ignored parameters
/// changed), each pair on its own path: one origin call per pair, and the second is an
/// L1 hit.
#[tokio::test]
async fn every_request_shape_finds_its_entry_again() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let long = format!("/items/{}", "x".repeat(600));
    let many_a = (0..12)
        .map(|n| format!("p{n}={n}"))
        .collect::<Vec<_>>()
        .join("&");
    let many_b = (0..12)
        .rev()
        .map(|n| format!("p{n}={n}"))
        .collect::<Vec<_>>()
        .join("&");
    let all = instance(&server, policy("all").build().unwrap(), origin.service()).await;
    let only = instance(
        &server,
        policy("only").key_query(["page"]).build().unwrap(),
        origin.service(),
    )
    .await;
    let ignore = instance(
        &server,
        policy("ignore").ignore_query().build().unwrap(),
        origin.service(),
    )
    .await;
    let pairs: Vec<(&Instance<_>, web::Req, web::Req)> = vec![
        (&all, get("/a"), get("/a")),
        (&all, get("/b?x=1&y=2"), get("/b?y=2&x=1")),
        (&all, get("/c?&x=1&&"), get("/c?x=1")),
        (
            &all,
            get(&format!("/d?{many_a}")),
            get(&format!("/d?{many_b}")),
        ),
        (&all, get(&long), get(&long)),
        (
            &all,
            with_raw_host("/e", b"h\xe9te.example"),
            with_raw_host("/e", b"h\xe9te.example"),
        ),
        (&only, get("/f?page=2&utm=a"), get("/f?utm=b&page=2")),
        (&ignore, get("/g?page=2"), get("/g?page=3&x=1")),
    ];
    let count = pairs.len() as u64;
    for (n, (instance, first, second)) in pairs.into_iter().enumerate() {
        let what = format!("pair {n} ({})", first.uri());
        let got = send(&instance.service, first).await;
        assert_eq!(got.x_cache(), "miss", "{what}");
        // Found in L1 itself: an L2 hit would answer `hit` too.
        let l1_hits = instance.layer.stats().get(Event::L1Hit);
        let got = send(&instance.service, second).await;
        assert_eq!(got.x_cache(), "hit", "{what}");
        assert_eq!(
            instance.layer.stats().get(Event::L1Hit),
            l1_hits + 1,
            "{what}"
        );
        assert_eq!(origin.calls(), n as u64 + 1, "{what}");
    }
    assert_eq!(origin.calls(), count);
    // And the host is part of the identity, text or not: another host is another entry,
    // and so is a request with no host at all.
    let got = send(&all.service, with_raw_host("/e", b"h\xe8te.example")).await;
    assert_eq!(got.x_cache(), "miss");
    let mut hostless = get("/e");
    hostless.headers_mut().remove(http::header::HOST);
    assert_eq!(send(&all.service, hostless).await.x_cache(), "miss");
    assert_eq!(origin.calls(), count + 2);
}

/// The same once the route has learned the headers its responses vary on (`Vary:
/// Accept-Language, Host`): each variant, host bytes that are not text included, is
/// found again under the key a hit computes.
#[tokio::test]
async fn variants_find_their_entries_again() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, _| {
        let mut response = Response::new(full(format!("call {n}")));
        response
            .headers_mut()
            .insert("vary", "Accept-Language, Host".parse().unwrap());
        response
    });
    let i = instance(&server, policy("items").build().unwrap(), origin.service()).await;
    let asking = |lang: &str, host: &[u8]| {
        let mut request = with_raw_host("/items/1", host);
        request
            .headers_mut()
            .insert("accept-language", lang.parse().unwrap());
        request
    };
    // The first answer teaches the route its `Vary`, and is kept as its own variant.
    send(&i.service, asking("fr", b"shop.example")).await;
    assert_eq!(origin.calls(), 1);
    for (lang, host, first_time) in [
        ("fr", &b"shop.example"[..], "hit"),
        ("de", b"shop.example", "miss"),
        ("fr", b"h\xe9te.example", "miss"),
        ("fr", b"h\xe8te.example", "miss"),
    ] {
        let first = send(&i.service, asking(lang, host)).await;
        assert_eq!(first.x_cache(), first_time, "{lang} {host:?}");
        let l1_hits = i.layer.stats().get(Event::L1Hit);
        let second = send(&i.service, asking(lang, host)).await;
        assert_eq!(second.x_cache(), "hit", "{lang} {host:?}");
        assert_eq!(
            i.layer.stats().get(Event::L1Hit),
            l1_hits + 1,
            "{lang} {host:?}"
        );
        assert_eq!(second.body, first.body, "{lang} {host:?}");
    }
    // One fill per variant.
    assert_eq!(origin.calls(), 4);
}
