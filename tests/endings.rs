//! Every way a fill ends is shared by the callers that waited for it, and the origin
//! stays protected when it fails: a hot cold key with hundreds of callers queued on each
//! of two instances never turns into hundreds of concurrent origin calls, whatever the
//! origin does (an error answer, an answer slower than the refresh timeout), and every
//! caller is answered within the cold wait and the origin timeout. Only an answer
//! private to its caller is one call per caller, and nobody gets another's.
//!
//! Driven the way users run it: each instance an axum app served by `axum::serve`, every
//! request on a connection of its own; the origin is the route's handler, which counts
//! its calls, how many are in progress at once, and the most there ever were.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::response::IntoResponse;
use axum::routing::get;
use http::{HeaderMap, StatusCode, header};
use stampede_guard::Policy;
use stampede_guard::metrics::Event;
use support::RedisServer;
use support::http::{fetch, serve};
use support::web::{Got, all_within, ready_guard};

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
enum Origin {
    /// `500` after `delay`.
    Fails(Duration),
    /// A `200` after `delay`.
    Slow(Duration),
    /// A `200` marked `private`, after `delay`, whose body is the caller's `x-caller`.
    Private(Duration),
}

/// An instance: the route `/hot` behind the guard's layer, its handler `origin`.
fn app(layer: stampede_guard::GuardLayer, origin: Origin, counts: Arc<Counting>) -> Router {
    let handler = move |headers: HeaderMap| {
        let counts = counts.clone();
        async move {
            counts.calls.fetch_add(1, Ordering::SeqCst);
            let now = counts.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            counts.peak.fetch_max(now, Ordering::SeqCst);
            let _out = Out(counts.clone());
            match origin {
                Origin::Fails(delay) => {
                    tokio::time::sleep(delay).await;
                    (StatusCode::INTERNAL_SERVER_ERROR, "down").into_response()
                }
                Origin::Slow(delay) => {
                    tokio::time::sleep(delay).await;
                    "late".into_response()
                }
                Origin::Private(delay) => {
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
    Router::new().route("/hot", get(handler).layer(layer))
}

/// The policy of every episode: a short refresh timeout and cold wait.
fn policy(refresh_timeout: Duration, cold_wait: Duration) -> Policy {
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
async fn episode(origin: Origin, policy: Policy) -> Episode {
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
        Origin::Fails(Duration::from_millis(200)),
        policy(refresh_timeout, cold_wait),
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
        Origin::Slow(Duration::from_secs(10)),
        policy(refresh_timeout, cold_wait),
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
        Origin::Private(Duration::from_millis(200)),
        policy(Duration::from_secs(5), Duration::from_secs(5)),
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
        .layer(policy(Duration::from_secs(5), Duration::from_secs(5)))
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

/// A hard purge, then a fill whose lease lapsed while it called the origin, and another
/// instance took the lease, filled and wrote, before the purge: the late write is
/// refused, and what Redis holds (the purged entry) is not what its callers get; they get
/// the late fill's own answer, which is not stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_never_serves_a_purged_entry() {
    let server = RedisServer::start();
    let tagged = || {
        Policy::builder("hot")
            .fresh_ttl(Duration::from_secs(30))
            .tags(["catalog"])
            .build()
            .unwrap()
    };
    let origin = support::web::Origin::versions(Duration::ZERO);
    let a = support::web::instance(ready_guard(&server).await, tagged(), origin.service()).await;
    let b = support::web::instance(ready_guard(&server).await, tagged(), origin.service()).await;
    origin.hold(1);
    let started = origin.started.notified();
    let late = {
        let service = a.service.clone();
        tokio::spawn(async move { support::web::send(&service, support::web::get("/hot")).await })
    };
    support::within(support::HANG, started, "the first fill's origin call").await;
    // Its lease lapses (as a TTL shorter than the call would make it), and B fills.
    let keys = a.layer.cache_keys(&support::web::get("/hot")).unwrap();
    let _: i64 = server.cmd(&["PEXPIRE", keys.lease().key(), "1"]).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let filled = support::web::send(&b.service, support::web::get("/hot")).await;
    assert_eq!((filled.body.as_str(), filled.x_cache()), ("v2", "miss"));
    // (Through A's guard, where it takes effect at once; elsewhere, when heard.)
    within_purge(&a.guard).await;
    origin.open();
    let got = support::joined(late, support::HANG, "the late fill's caller").await;
    assert_eq!(got.body, "v1", "the late fill's callers get its own answer");
    assert_eq!(a.layer.stats().get(Event::FencedWriteRefused), 1);
    // Nothing of it was stored: the next caller fills again.
    let next = support::web::send(&a.service, support::web::get("/hot")).await;
    assert_eq!((next.body.as_str(), next.x_cache()), ("v3", "miss"));
}

async fn within_purge(guard: &stampede_guard::StampedeGuard) {
    let purge = guard.purge_tags(["catalog"], stampede_guard::Purge::Hard);
    support::within(support::HANG, purge, "the purge")
        .await
        .unwrap();
}

/// HEAD requests on a cold key join the fill of the GET they are answered from (as a
/// cache converts them): one origin call for all of them, each answered without a body,
/// and the GET that follows is a hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_on_a_cold_key_share_one_fill() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(policy(Duration::from_secs(5), Duration::from_secs(5)))
        .unwrap();
    let counts = Arc::new(Counting::default());
    let addr = serve(app(
        layer,
        Origin::Slow(Duration::from_millis(300)),
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
