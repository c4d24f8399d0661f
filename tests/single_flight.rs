//! Single flight: one origin call per key for everyone who asks, in a process and across
//! the fleet. A cold key is filled once and the other instances are woken by the
//! filler's notice (one body, on a single server, on a Redis Cluster and as a user with
//! only what `KeySpace::acl_rules` allows, with the same exact counts); without Redis
//! the process still coalesces; a concurrency limit or a full buffer inside the guard
//! bounds the origin, not the hits; a cold miss can answer `503` while the filler is
//! elsewhere; HEADs join the fill of the GET they are answered from; one layer on two
//! services of different types shares one fill; the lease TTL follows measured hold
//! times.
//!
//! Every way a fill ends is shared by the callers that waited for it, and the origin
//! stays protected when it fails: a hot cold key with hundreds of callers queued on each
//! of two instances never turns into hundreds of concurrent origin calls, whatever the
//! origin does (an error answer, an answer slower than the refresh timeout), and every
//! caller is answered within the cold wait and the origin timeout. Only an answer
//! private to its caller is one call per caller, and nobody gets another's. Callers
//! waiting on another instance are answered as soon as the lease holder ends without
//! writing.
//!
//! The tests through `axum::serve` run each instance as an axum app, every request on a
//! connection of its own; their origin is the route's handler.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::response::IntoResponse;
use axum::routing;
use http::{HeaderMap, Response, StatusCode, header};
use http_body_util::BodyExt;
use stampede_guard::metrics::Event;
use stampede_guard::{ColdMiss, GuardLayer, Policy, RedisStore, StampedeGuard};
use support::app::{Gate, guard, instance, patient_policy, policy};
use support::http::{fetch, serve};
use support::web::{self, Got, Origin, all_within, full, get, keys, ready_guard, send, total};
use support::{HANG, Redis, RedisServer, eventually, joined, within};
use tokio::sync::Barrier;

/// 3 instances, a cold key, 300 concurrent requests: one origin call; the other
/// instances' fills find the lease busy and are woken by the filler's notice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cold_key_is_filled_once_and_other_instances_are_woken_by_the_notice() {
    cold_key_filled_once(Redis::single()).await;
}

#[cfg(feature = "cluster")]
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
    // Each of those fills took the entry in place of an origin call.
    assert_eq!(total(&layers, Event::AvoidedRemoteFill), 2);
    assert_eq!(total(&layers, Event::ColdWaitTimedOut), 0);
    assert_eq!(
        total(&layers, Event::LocalOnly),
        0,
        "fills without the lease"
    );
    assert_eq!(total(&layers, Event::Miss), 300);
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

/// The layer guide's shape: a guard, a layer with the route's policy, on an axum route. The
/// handler counts its calls and takes `delay`.
fn readme_app(guard: &StampedeGuard, calls: Arc<AtomicU64>, delay: Duration) -> Router {
    let items = guard
        .layer(
            Policy::builder("items")
                .fresh_ttl(Duration::from_secs(5))
                .grace(Duration::from_secs(60))
                .build()
                .unwrap(),
        )
        .unwrap();
    let handler = move || {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(delay).await;
            format!("item (call {n})")
        }
    };
    Router::new().route("/items/{id}", routing::get(handler).layer(items))
}

/// 200 requests at once on a cold key, each on its own connection: one handler call,
/// and every caller gets its answer.
async fn one_call_for_a_cold_burst(addr: std::net::SocketAddr, calls: &AtomicU64) {
    let responses = cold_burst(addr).await;
    let made = calls.load(Ordering::SeqCst);
    eprintln!("200 connections, a cold key: {made} handler calls");
    assert_eq!(made, 1, "handler calls");
    for got in &responses {
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(got.body, "item (call 1)");
    }
}

/// 200 requests at once on a cold key, each on its own connection.
async fn cold_burst(addr: std::net::SocketAddr) -> Vec<support::web::Got> {
    let barrier = Arc::new(Barrier::new(200));
    let mut tasks = Vec::new();
    for _ in 0..200 {
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            fetch(addr, "/items/1", &[]).await
        }));
    }
    support::web::all_within(tasks, Duration::from_secs(60), "the burst did not end").await
}

/// axum applies a route's layer again for every connection: the cold fill's
/// single-flight must still be one per process. Redis is down (killed), so only the
/// local single-flight stands between the burst and the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_readme_shape_fills_a_cold_key_once_with_redis_down() {
    let mut server = RedisServer::start();
    let url = server.url();
    server.kill();
    let store = RedisStore::builder(url).build().unwrap();
    let guard = StampedeGuard::builder(store, keys()).build().unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let addr = serve(readme_app(&guard, calls.clone(), Duration::from_secs(1))).await;

    one_call_for_a_cold_burst(addr, &calls).await;
}

/// The same with Redis up and an origin slower than the cold wait of earlier defaults
/// (2 s): every connection's request joins the one fill of the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_readme_shape_fills_a_cold_key_once_with_redis_up_and_a_slow_origin() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let calls = Arc::new(AtomicU64::new(0));
    let addr = serve(readme_app(&guard, calls.clone(), Duration::from_secs(3))).await;

    one_call_for_a_cold_burst(addr, &calls).await;
    // And the entry is shared: a new connection gets a hit.
    let again = fetch(addr, "/items/1", &[]).await;
    assert_eq!(
        (again.body.as_str(), again.x_cache()),
        ("item (call 1)", "hit")
    );
}

/// The layer guide's shape with a handler that reads its path parameter (axum keeps it in
/// the request's extensions) and the route's default settings: the wrapped handler sees
/// the request it would see without the guard. 200 requests at once on a cold key, each
/// on its own connection: 200 answers `200`, one handler call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_reads_its_path_works_with_the_default_settings() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let calls = Arc::new(AtomicU64::new(0));
    let items = guard
        .layer(Policy::builder("items").build().unwrap())
        .unwrap();
    let counted = calls.clone();
    let handler = move |axum::extract::Path(id): axum::extract::Path<u32>| {
        let calls = counted.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(Duration::from_millis(300)).await;
            format!("item {id} (call {n})")
        }
    };
    let addr = serve(Router::new().route("/items/{id}", routing::get(handler).layer(items))).await;
    let responses = cold_burst(addr).await;
    for got in &responses {
        assert_eq!(got.status, StatusCode::OK, "{}", got.body);
        assert_eq!(got.body, "item 1 (call 1)");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "handler calls");
}

/// A `ConcurrencyLimit(1)` inside the guard: the origin takes one request at a time, the
/// guard is always ready. While a slow cold fill holds the origin's only slot (held at a
/// gate that opens only after), hits on another key are answered, each on its own
/// connection; a hit that waited for the origin's readiness would never come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_concurrency_limit_inside_the_guard_bounds_the_origin_not_the_hits() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    // The handler reads the path through axum's `Path`: the route forwards extensions.
    let items = guard
        .layer(
            Policy::builder("items")
                .forward_extensions(true)
                .build()
                .unwrap(),
        )
        .unwrap();
    let (gate, calls) = (Gate::default(), Arc::new(AtomicU64::new(0)));
    let handler = {
        let (gate, calls) = (gate.clone(), calls.clone());
        move |axum::extract::Path(id): axum::extract::Path<String>| {
            let (gate, calls) = (gate.clone(), calls.clone());
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                if id == "slow" {
                    let opened = gate.open.notified();
                    gate.entered.notify_one();
                    opened.await;
                } else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                format!("item {id}")
            }
        }
    };
    let app = Router::new().route(
        "/items/{id}",
        // The guard outside, the limit inside (next to the handler).
        routing::get(handler).layer(
            tower::ServiceBuilder::new()
                .layer(items)
                .concurrency_limit(1),
        ),
    );
    let addr = serve(app).await;

    let first = fetch(addr, "/items/fast", &[]).await;
    assert_eq!(
        (first.body.as_str(), first.x_cache()),
        ("item fast", "miss")
    );
    let second = fetch(addr, "/items/fast", &[]).await;
    assert_eq!(
        (second.body.as_str(), second.x_cache()),
        ("item fast", "hit")
    );

    let entered = gate.entered.notified();
    let slow = tokio::spawn(async move { fetch(addr, "/items/slow", &[]).await });
    // the origin's one slot is taken, until the gate opens
    within(HANG, entered, "the slow fill reaching the handler").await;
    let mut hits = Vec::new();
    for _ in 0..20 {
        hits.push(tokio::spawn(async move {
            fetch(addr, "/items/fast", &[]).await
        }));
    }
    let hits = support::web::all_within(
        hits,
        Duration::from_secs(20),
        "hits waited for the saturated origin",
    )
    .await;
    for got in hits {
        assert_eq!((got.body.as_str(), got.x_cache()), ("item fast", "hit"));
    }
    gate.open.notify_one();
    let slow = joined(slow, Duration::from_secs(20), "the slow fill (starved)").await;
    assert_eq!((slow.body.as_str(), slow.x_cache()), ("item slow", "miss"));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A lease TTL from measured hold times: while the origin answers in 50 ms, the route's
/// leases are taken for the floor; once it takes 400 ms, for three times that, within
/// the ceiling; the fills all succeed meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_ttl_follows_measured_hold_times() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(
            Policy::builder("adaptive")
                .fresh_ttl(Duration::from_secs(60))
                .lease_ttl(Duration::from_secs(4))
                .refresh_timeout(Duration::from_secs(1))
                .adaptive_lease_ttl(3.0, Duration::from_secs(1), Duration::from_secs(5))
                .build()
                .unwrap(),
        )
        .unwrap();
    assert_eq!(layer.lease_ttl(), Duration::from_secs(4), "until measured");
    let delay_ms = Arc::new(AtomicU64::new(50));
    let handler = {
        let delay_ms = delay_ms.clone();
        move |uri: http::Uri| {
            let delay_ms = delay_ms.clone();
            async move {
                let delay = Duration::from_millis(delay_ms.load(Ordering::SeqCst));
                tokio::time::sleep(delay).await;
                uri.path().to_owned()
            }
        }
    };
    let addr =
        serve(Router::new().route("/k/{n}", routing::get(handler).layer(layer.clone()))).await;
    for n in 0..20 {
        let got = fetch(addr, &format!("/k/fast{n}"), &[]).await;
        assert_eq!(got.x_cache(), "miss");
    }
    // Three times 50 ms is below the floor.
    assert_eq!(layer.lease_ttl(), Duration::from_secs(1));
    delay_ms.store(400, Ordering::SeqCst);
    for n in 0..20 {
        let got = fetch(addr, &format!("/k/slow{n}"), &[]).await;
        assert_eq!(got.x_cache(), "miss");
    }
    let ttl = layer.lease_ttl();
    assert!(
        ttl >= Duration::from_millis(1200) && ttl <= Duration::from_secs(5),
        "{ttl:?}"
    );
}

/// How many callers queue on each instance.
const CALLERS: usize = 500;

/// An origin handler's counters, shared by its clones.
#[derive(Default)]
struct Counting {
    calls: AtomicU64,
    in_flight: AtomicU64,
    peak: AtomicU64,
}

impl Counting {
    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }
}

/// Counts a call out however it ends: answered, or dropped by a timeout.
struct Out(Arc<Counting>);

impl Drop for Out {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What the origin does on each call.
#[derive(Clone, Copy)]
enum Handler {
    /// `500` after `delay`.
    Fails(Duration),
    /// A `200` after `delay`.
    Slow(Duration),
    /// A `200` marked `private`, after `delay`, whose body is the caller's `x-caller`.
    Private(Duration),
}

/// An instance: the route `/hot` behind the guard's layer, its handler `origin`.
fn app(layer: stampede_guard::GuardLayer, origin: Handler, counts: Arc<Counting>) -> Router {
    let handler = move |headers: HeaderMap| {
        let counts = counts.clone();
        async move {
            counts.calls.fetch_add(1, Ordering::SeqCst);
            let now = counts.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            counts.peak.fetch_max(now, Ordering::SeqCst);
            let _out = Out(counts.clone());
            match origin {
                Handler::Fails(delay) => {
                    tokio::time::sleep(delay).await;
                    (StatusCode::INTERNAL_SERVER_ERROR, "down").into_response()
                }
                Handler::Slow(delay) => {
                    tokio::time::sleep(delay).await;
                    "late".into_response()
                }
                Handler::Private(delay) => {
                    tokio::time::sleep(delay).await;
                    let caller = headers
                        .get("x-caller")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("nobody")
                        .to_owned();
                    ([(header::CACHE_CONTROL, "private")], caller).into_response()
                }
            }
        }
    };
    Router::new().route("/hot", routing::get(handler).layer(layer))
}

/// The policy of every episode: a short refresh timeout and cold wait.
fn hot_policy(refresh_timeout: Duration, cold_wait: Duration) -> Policy {
    Policy::builder("hot")
        .fresh_ttl(Duration::from_secs(30))
        .lease_ttl(refresh_timeout + Duration::from_secs(2))
        .refresh_timeout(refresh_timeout)
        .cold_wait(cold_wait)
        .build()
        .unwrap()
}

/// What an episode came to.
struct Episode {
    answers: Vec<(usize, Got, Duration)>,
    counts: [Arc<Counting>; 2],
    layers: [stampede_guard::GuardLayer; 2],
}

impl Episode {
    fn worst(&self) -> Duration {
        self.answers.iter().map(|(_, _, took)| *took).max().unwrap()
    }

    fn report(&self, name: &str) {
        let [a, b] = &self.counts;
        eprintln!(
            "{name}: {} callers, origin calls {} + {}, at most {} and {} in flight at once, \
             worst answer {:?}",
            self.answers.len(),
            a.calls(),
            b.calls(),
            a.peak(),
            b.peak(),
            self.worst()
        );
    }
}

/// [`CALLERS`] callers on each of two instances sharing one Redis, all at once, each
/// on its own connection and with its own `x-caller`.
async fn episode(origin: Handler, policy: Policy) -> Episode {
    // Two sockets per caller (its own and the server's), and the rest of the process:
    // more than the 1024 many systems allow by default.
    let limit = rlimit::increase_nofile_limit(8192).unwrap();
    assert!(
        limit >= 4 * CALLERS as u64 + 256,
        "open files limited to {limit}"
    );
    let server = RedisServer::start();
    let guards = [ready_guard(&server).await, ready_guard(&server).await];
    let counts = [Arc::new(Counting::default()), Arc::new(Counting::default())];
    let layers = [
        guards[0].layer(policy.clone()).unwrap(),
        guards[1].layer(policy).unwrap(),
    ];
    let addrs = [
        serve(app(layers[0].clone(), origin, counts[0].clone())).await,
        serve(app(layers[1].clone(), origin, counts[1].clone())).await,
    ];
    let start = Arc::new(tokio::sync::Barrier::new(CALLERS * 2));
    let tasks = (0..CALLERS * 2)
        .map(|n| {
            let (addr, start) = (addrs[n % 2], start.clone());
            tokio::spawn(async move {
                start.wait().await;
                let began = Instant::now();
                let caller = n.to_string();
                let got = fetch(addr, "/hot", &[("x-caller", &caller)]).await;
                (n, got, began.elapsed())
            })
        })
        .collect();
    let answers = all_within(tasks, Duration::from_secs(60), "the episode did not end").await;
    drop(server);
    Episode {
        answers,
        counts,
        layers,
    }
}

/// An origin that answers `500`: its answer is shared with the callers that waited for
/// it, and the origin sees at most one call at a time per instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_that_answers_500_sees_one_call_at_a_time_per_instance() {
    let refresh_timeout = Duration::from_secs(5);
    let cold_wait = Duration::from_secs(5);
    let episode = episode(
        Handler::Fails(Duration::from_millis(200)),
        hot_policy(refresh_timeout, cold_wait),
    )
    .await;
    episode.report("500");
    for (n, got, _) in &episode.answers {
        assert_eq!(got.status, StatusCode::INTERNAL_SERVER_ERROR, "caller {n}");
        assert_eq!(got.body, "down", "caller {n}");
    }
    for counts in &episode.counts {
        assert_eq!(counts.peak(), 1, "origin calls in flight at once");
    }
    assert!(
        episode.worst() <= cold_wait + refresh_timeout,
        "worst answer {:?}",
        episode.worst()
    );
}

/// An origin slower than the refresh timeout: each fill's call is cut at the timeout,
/// and its callers get `504` at once; none goes to the origin on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_slower_than_the_refresh_timeout_sees_one_call_at_a_time_per_instance() {
    let refresh_timeout = Duration::from_millis(500);
    let cold_wait = Duration::from_millis(500);
    let episode = episode(
        Handler::Slow(Duration::from_secs(10)),
        hot_policy(refresh_timeout, cold_wait),
    )
    .await;
    episode.report("slower than the refresh timeout");
    for (n, got, _) in &episode.answers {
        assert_eq!(got.status, StatusCode::GATEWAY_TIMEOUT, "caller {n}");
    }
    for counts in &episode.counts {
        assert_eq!(counts.peak(), 1, "origin calls in flight at once");
    }
    let timeouts: u64 = episode
        .layers
        .iter()
        .map(|l| l.stats().get(Event::OriginTimeout))
        .sum();
    assert_eq!(
        timeouts,
        episode.counts.iter().map(|c| c.calls()).sum::<u64>(),
        "every call timed out, and was counted"
    );
    // Generous: a loaded machine takes its time with a thousand connections.
    let bound = cold_wait + refresh_timeout + Duration::from_secs(3);
    assert!(
        episode.worst() <= bound,
        "worst answer {:?}",
        episode.worst()
    );
}

/// An answer private to its caller: the others need answers of their own, one call per
/// caller (and no more), and nobody is served another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_answer_is_one_call_per_caller_and_never_anothers() {
    let episode = episode(
        Handler::Private(Duration::from_millis(200)),
        hot_policy(Duration::from_secs(5), Duration::from_secs(5)),
    )
    .await;
    episode.report("private");
    for (n, got, _) in &episode.answers {
        assert_eq!(got.status, StatusCode::OK, "caller {n}");
        assert_eq!(got.body, n.to_string(), "caller {n} got another's answer");
    }
    let calls: u64 = episode.counts.iter().map(|c| c.calls()).sum();
    assert_eq!(calls, (CALLERS * 2) as u64, "one origin call per caller");
}

/// The same layer on two services of different types (here, their bodies differ), the
/// same key asked of both at once: one origin call, both answered from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_layer_on_two_services_of_different_types_shares_one_fill() {
    use http_body_util::{Either, Empty};
    use tower::{Layer, ServiceExt};

    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(hot_policy(Duration::from_secs(5), Duration::from_secs(5)))
        .unwrap();
    let origin = support::web::Origin::versions(Duration::from_millis(300));
    let plain = layer.layer(origin.service());
    let other = layer.layer(
        origin
            .service()
            .map_response(|r| r.map(Either::<_, Empty<bytes::Bytes>>::Left)),
    );
    let first =
        tokio::spawn(async move { support::web::send(&plain, support::web::get("/hot")).await });
    let second = tokio::spawn(async move {
        let response = other.oneshot(support::web::get("/hot")).await.unwrap();
        let (parts, body) = response.into_parts();
        let body = http_body_util::BodyExt::collect(body)
            .await
            .unwrap()
            .to_bytes();
        Got::new(parts, body)
    });
    let got = all_within(vec![first, second], support::HANG, "the two callers").await;
    assert_eq!(origin.calls(), 1, "origin calls");
    for got in got {
        assert_eq!((got.status, got.body.as_str()), (StatusCode::OK, "v1"));
    }
}

/// HEAD requests on a cold key join the fill of the GET they are answered from (as a
/// cache converts them): one origin call for all of them, each answered without a body,
/// and the GET that follows is a hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_on_a_cold_key_share_one_fill() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(hot_policy(Duration::from_secs(5), Duration::from_secs(5)))
        .unwrap();
    let counts = Arc::new(Counting::default());
    let addr = serve(app(
        layer,
        Handler::Slow(Duration::from_millis(300)),
        counts.clone(),
    ))
    .await;
    let tasks = (0..50)
        .map(|_| {
            tokio::spawn(async move { support::http::fetch_method(addr, "HEAD", "/hot").await })
        })
        .collect();
    for got in all_within(tasks, support::HANG, "the HEADs").await {
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(got.body, "");
        assert_eq!(got.headers[header::CONTENT_LENGTH], "4");
    }
    assert_eq!(counts.calls(), 1, "origin calls");
    let get = fetch(addr, "/hot", &[]).await;
    assert_eq!((get.body.as_str(), get.x_cache()), ("late", "hit"));
    assert_eq!(counts.calls(), 1, "origin calls");
}

/// A holds the lease of a cold key, in the origin; 10 callers on B wait for its entry
/// (with a cold wait of 10 s). A's answer cannot be stored (a 404, a private answer, a
/// 500): B's callers are answered as soon as A's lease ends, by one call of B's that
/// they share (each of them asks for its own only when that answer is private); and
/// while the key is marked, B's next callers go straight to the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_elsewhere_are_answered_at_once_when_the_holder_writes_nothing() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, request| {
        let mut response = Response::new(full(format!("call {n}")));
        match request.uri().path() {
            "/missing" => *response.status_mut() = StatusCode::NOT_FOUND,
            "/private" => {
                let private = "private".parse().unwrap();
                response.headers_mut().insert("cache-control", private);
            }
            _ => *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR,
        }
        response
    });
    let a = instance(
        &server,
        patient_policy("items").build().unwrap(),
        origin.service(),
    )
    .await;
    let b = instance(
        &server,
        patient_policy("items").build().unwrap(),
        origin.service(),
    )
    .await;
    for (path, status) in [
        ("/missing", StatusCode::NOT_FOUND),
        ("/private", StatusCode::OK),
        ("/failing", StatusCode::INTERNAL_SERVER_ERROR),
    ] {
        let before = origin.calls();
        let waits = b.layer.stats().get(Event::ColdWaitStarted);
        let ended = b.layer.stats().get(Event::ColdWaitEnded);
        origin.hold(before + 1);
        let started = origin.started.notified();
        let leader = tokio::spawn({
            let service = a.service.clone();
            async move { send(&service, get(path)).await }
        });
        // A holds the lease, in the origin
        within(
            HANG,
            started,
            format!("{path}: A's fill reaching the origin"),
        )
        .await;
        let followers: Vec<_> = (0..10)
            .map(|_| {
                let service = b.service.clone();
                tokio::spawn(async move { send(&service, get(path)).await })
            })
            .collect();
        // B's fill found A's lease and waits for A's entry.
        assert!(
            eventually(Duration::from_secs(5), || async {
                b.layer.stats().get(Event::ColdWaitStarted) == waits + 1
            })
            .await,
            "{path}: B's fill did not wait"
        );
        let opened = Instant::now();
        origin.open();
        let answers = all_within(followers, Duration::from_secs(8), "B's callers waited").await;
        let took = opened.elapsed();
        eprintln!("{path}: B's 10 callers answered {took:?} after A's origin returned");
        assert!(took < Duration::from_secs(3), "{path}: {took:?}");
        let leader = joined(leader, HANG, format!("{path}: A's caller")).await;
        assert_eq!(leader.status, status, "{path}");
        for got in &answers {
            assert_eq!((got.status, got.x_cache()), (status, "pass"), "{path}");
        }
        assert_eq!(
            b.layer.stats().get(Event::ColdWaitEnded),
            ended + 1,
            "{path}"
        );
        // A's call, then one fill of B's own without the lease, for all its callers:
        // its answer is shared, unless it is private (then each of B's other callers
        // asks for one of its own). After a failure the fleet holds the lease off, and
        // B's fill goes on without it.
        let b_calls = if path == "/private" { 10 } else { 1 };
        assert_eq!(origin.calls(), before + 1 + b_calls, "{path}");
    }
    // Marked: the next callers go straight through, on both instances.
    for i in [&a, &b] {
        let hit_for_pass = i.layer.stats().get(Event::HitForPass);
        for path in ["/missing", "/private"] {
            assert_eq!(send(&i.service, get(path)).await.x_cache(), "pass");
        }
        assert_eq!(i.layer.stats().get(Event::HitForPass), hit_for_pass + 2);
    }
}

/// Over real TCP, two instances (two apps, two guards) on one Redis: A's fill of a cold
/// key is held in the handler and ends in a 404; B's callers, waiting for A's entry
/// with a cold wait of 20 s, are answered as soon as A's lease ends, by one call of B's
/// that they share.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_elsewhere_stop_waiting_when_the_holder_writes_nothing_through_axum() {
    let server = RedisServer::start();
    let (gate, calls) = (Gate::default(), Arc::new(AtomicU64::new(0)));
    let handler = {
        let (gate, calls) = (gate.clone(), calls.clone());
        move || {
            let (gate, calls) = (gate.clone(), calls.clone());
            async move {
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    let opened = gate.open.notified();
                    gate.entered.notify_one();
                    opened.await;
                }
                (StatusCode::NOT_FOUND, "no such item")
            }
        }
    };
    let mut apps = Vec::new();
    for _ in 0..2 {
        let guard = ready_guard(&server).await;
        let layer = guard
            .layer(
                Policy::builder("items")
                    .cold_wait(Duration::from_secs(20))
                    .build()
                    .unwrap(),
            )
            .unwrap();
        let app = Router::new().route(
            "/items/404",
            routing::get(handler.clone()).layer(layer.clone()),
        );
        apps.push((serve(app).await, layer));
    }
    let (a, b) = (apps[0].0, apps[1].0);
    let entered = gate.entered.notified();
    let holder = tokio::spawn(async move { fetch(a, "/items/404", &[]).await });
    within(HANG, entered, "A's fill reaching the handler").await;
    let callers: Vec<_> = (0..20)
        .map(|_| tokio::spawn(async move { fetch(b, "/items/404", &[]).await }))
        .collect();
    // B's fill waits for A's entry, and the other 19 callers wait for B's fill.
    let waiting = support::eventually(Duration::from_secs(10), || async {
        let stats = apps[1].1.stats();
        stats.get(stampede_guard::metrics::Event::ColdWaitStarted) == 1
            && stats.get(stampede_guard::metrics::Event::Joined) == 19
    });
    assert!(waiting.await, "{:?}", apps[1].1.stats());
    let opened = std::time::Instant::now();
    gate.open.notify_one();
    let holder = joined(holder, HANG, "A's caller").await;
    assert_eq!(holder.status, StatusCode::NOT_FOUND);
    for got in
        support::web::all_within(callers, Duration::from_secs(15), "B's callers waited").await
    {
        assert_eq!((got.status, got.x_cache()), (StatusCode::NOT_FOUND, "pass"));
    }
    let took = opened.elapsed();
    assert!(took < Duration::from_secs(5), "B's callers took {took:?}");
    // A's call, then one of B's for all its callers: a 404 is not stored, but it is
    // not private either, and B's fill shares it.
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
