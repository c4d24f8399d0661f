//! Crowds: many callers of one key at once. What they share (one origin call, its
//! answer), and what they never share: an answer made for one caller alone.
//!
//! Through `axum::serve` over real TCP, and black-box on the sidecar binary.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing;
use http::{HeaderMap, StatusCode};
use stampede_guard::Policy;
use stampede_guard::metrics::Event;
use support::app::Gate;
use support::http::{fetch, serve};
use support::web::{all_within, ready_guard};
use support::{HANG, RedisServer, eventually, joined, within};

/// A handler that answers each caller with its own account (`account of <X-User>`),
/// marked with `cache_control`; the first call waits at `gate` until the test opens it.
fn own_account(
    gate: &Gate,
    calls: &Arc<AtomicU64>,
    cache_control: &'static str,
) -> impl Fn(
    HeaderMap,
) -> std::pin::Pin<Box<dyn Future<Output = ([(String, String); 1], String)> + Send>>
+ Clone
+ Send
+ Sync
+ 'static {
    let (gate, calls) = (gate.clone(), calls.clone());
    move |headers: HeaderMap| {
        let (gate, calls) = (gate.clone(), calls.clone());
        Box::pin(async move {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                let opened = gate.open.notified();
                gate.entered.notify_one();
                opened.await;
            }
            let user = headers
                .get("x-user")
                .map_or("nobody", |v| v.to_str().unwrap())
                .to_owned();
            (
                [("cache-control".to_owned(), cache_control.to_owned())],
                format!("account of {user}"),
            )
        })
    }
}

/// 20 concurrent cold callers, each with its own `X-User`, of an answer that names the
/// user and is marked `no-cache`, `no-store` or `private`; on a route the user declared
/// cacheable, and on one that follows the origin (where a `no-cache` answer is stored,
/// to be revalidated on every use). The other 19 join the first one's fill while it is
/// held in the handler; once it ends, each asks the origin itself: 20 calls, and every
/// caller gets its own account, never another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_for_one_caller_is_never_given_to_another_through_axum() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    for (case, (follow_origin, cache_control)) in [
        (false, "no-cache"),
        (true, "no-cache"),
        (true, "no-cache, max-age=60"),
        (false, "no-store"),
        (false, "private, max-age=60"),
    ]
    .into_iter()
    .enumerate()
    {
        let what = format!("{cache_control}, follow_origin({follow_origin})");
        let (gate, calls) = (Gate::default(), Arc::new(AtomicU64::new(0)));
        let layer = guard
            .layer(
                Policy::builder(format!("account-{case}"))
                    .fresh_ttl(Duration::from_secs(60))
                    // The first call is held until everyone joined.
                    .lease_ttl(Duration::from_secs(30))
                    .refresh_timeout(Duration::from_secs(30))
                    .cold_wait(Duration::from_secs(30))
                    .follow_origin(follow_origin)
                    .build()
                    .unwrap(),
            )
            .unwrap();
        let handler = own_account(&gate, &calls, cache_control);
        let app = Router::new().route("/account", routing::get(handler).layer(layer.clone()));
        let addr = serve(app).await;
        let entered = gate.entered.notified();
        let callers: Vec<_> = (0..20)
            .map(|i| {
                tokio::spawn(async move {
                    let user = format!("user-{i}");
                    (fetch(addr, "/account", &[("x-user", &user)]).await, user)
                })
            })
            .collect();
        within(HANG, entered, "the first fill reaching the handler").await;
        // Everyone else waits for that fill.
        let joined_it = eventually(Duration::from_secs(10), || async {
            layer.stats().get(Event::Joined) == 19
        });
        assert!(joined_it.await, "{what}: {:?}", layer.stats());
        gate.open.notify_one();
        for (got, user) in all_within(callers, HANG, "the callers").await {
            assert_eq!(got.status, StatusCode::OK, "{what}");
            assert_eq!(got.body, format!("account of {user}"), "{what}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 20, "{what}");
        // 19 joined the fill, and none was answered by it.
        let stats = layer.stats();
        assert_eq!(
            (stats.get(Event::Joined), stats.get(Event::Coalesced)),
            (19, 0),
            "{what}"
        );
    }
}

/// A qualified `no-cache` (`no-cache="x-account"`) leaves the answer shared, and
/// stored, but never with the field it names: not even while its body (100 KiB, over
/// what is read whole before its callers are answered) streams to them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_qualified_no_cache_shares_the_answer_without_its_fields() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let calls = Arc::new(AtomicU64::new(0));
    let layer = guard
        .layer(
            Policy::builder("page")
                .fresh_ttl(Duration::from_secs(60))
                .follow_origin(true)
                .build()
                .unwrap(),
        )
        .unwrap();
    let handler = {
        let calls = calls.clone();
        move || {
            calls.fetch_add(1, Ordering::SeqCst);
            async move {
                (
                    [
                        ("cache-control", "max-age=60, no-cache=\"x-account\""),
                        ("x-account", "ann"),
                    ],
                    "the page ".repeat(100 * 1024 / 9),
                )
            }
        }
    };
    let app = Router::new().route("/page", routing::get(handler).layer(layer));
    let addr = serve(app).await;
    for _ in 0..2 {
        let got = fetch(addr, "/page", &[]).await;
        assert_eq!(got.body, "the page ".repeat(100 * 1024 / 9));
        assert!(!got.headers.contains_key("x-account"), "{:?}", got.headers);
    }
    // Stored: never fresh (a `no-cache` answer is revalidated), but not private.
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// Black-box: 20 concurrent cold requests through the sidecar (which follows the
/// origin), each with its own `X-User`, for a `no-cache` answer naming the user: each
/// gets its own account.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sidecar_never_gives_one_users_no_cache_answer_to_another() {
    use support::sidecar::Sidecar;
    let (gate, calls) = (Gate::default(), Arc::new(AtomicU64::new(0)));
    let app = Router::new().fallback(routing::get(own_account(&gate, &calls, "no-cache")));
    let origin = serve(app).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--metrics",
        "127.0.0.1:0",
    ]);
    let metrics = sidecar.metrics.expect("a metrics listener");
    let listen = sidecar.listen;
    let entered = gate.entered.notified();
    let callers: Vec<_> = (0..20)
        .map(|i| {
            tokio::spawn(async move {
                let user = format!("user-{i}");
                (fetch(listen, "/account", &[("x-user", &user)]).await, user)
            })
        })
        .collect();
    within(HANG, entered, "the first fill reaching the origin").await;
    let joined_it = eventually(Duration::from_secs(10), || async {
        let scraped = fetch(metrics, "/metrics", &[]).await.body;
        counter(&scraped, "stampede_guard_fill_joins_total") == 19
    });
    assert!(joined_it.await, "the other 19 join the first fill");
    gate.open.notify_one();
    for (got, user) in all_within(callers, HANG, "the callers").await {
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(got.body, format!("account of {user}"));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 20);
    // None of them was answered by the fill it joined.
    let scraped = fetch(metrics, "/metrics", &[]).await.body;
    assert_eq!(counter(&scraped, "stampede_guard_coalesced_total"), 0);
}

/// The sum of a counter's series in a Prometheus scrape.
fn counter(scraped: &str, name: &str) -> u64 {
    scraped
        .lines()
        .filter(|line| line.starts_with(name) && !line.starts_with('#'))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A guard for the large answers, ready: an 8 MiB answer streamed to 200 callers loads
/// both cores, so Redis's replies get a command timeout of a second (and the leases
/// room for it); its L1 holds 256 MiB, so that one 8 MiB entry is kept (an entry may
/// weigh a quarter of L1).
async fn large_guard(server: &RedisServer) -> stampede_guard::StampedeGuard {
    guard_with_l1(server, Some(256 << 20)).await
}

/// [`large_guard`], with an L1 of `capacity` bytes (`None`: the default 64 MiB, which
/// keeps an entry of 16 MiB at most).
async fn guard_with_l1(
    server: &RedisServer,
    capacity: Option<u64>,
) -> stampede_guard::StampedeGuard {
    let store = stampede_guard::RedisStore::builder(server.url())
        .command_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut builder = stampede_guard::StampedeGuard::builder(store, support::web::keys());
    if let Some(capacity) = capacity {
        builder = builder.l1_capacity(capacity);
    }
    let guard = builder.build().unwrap();
    within(HANG, guard.ready(), "the guard's readiness")
        .await
        .unwrap();
    guard
}

/// The route of the large answers: stored up to 16 MiB, fresh for a minute.
fn large_policy() -> stampede_guard::policy::PolicyBuilder {
    Policy::builder("catalog")
        .fresh_ttl(Duration::from_secs(60))
        .max_body(16 * 1024 * 1024)
        .lease_ttl(Duration::from_secs(30))
        // The origin's body waits for the test, which waits for every caller to join:
        // far longer than that between two frames is a stall.
        .refresh_timeout(Duration::from_secs(30))
        .error_backoff(Duration::from_secs(4))
        .cold_wait(Duration::from_secs(30))
}

/// The size of the large answer: 8 MiB.
const LARGE: usize = 8 * 1024 * 1024;

/// The large answer's bytes: no two MiB alike.
fn large_body() -> bytes::Bytes {
    (0..LARGE)
        .map(|i| ((i * 7 + i / (1 << 20)) % 251) as u8)
        .collect::<Vec<u8>>()
        .into()
}

/// An origin whose every call's body the test writes: each call hands the test the
/// sender of its body's frames (an `Err` cuts it). `length`: the `Content-Length` it
/// declares, if any; `status`, its status.
struct Streaming {
    calls: Arc<AtomicU64>,
    bodies: tokio::sync::Mutex<tokio::sync::mpsc::UnboundedReceiver<BodySender>>,
}

type BodySender = tokio::sync::mpsc::UnboundedSender<Result<bytes::Bytes, std::io::Error>>;

impl Streaming {
    fn route(length: Option<usize>, status: StatusCode) -> (Self, routing::MethodRouter) {
        let calls = Arc::new(AtomicU64::new(0));
        let (to_test, bodies) = tokio::sync::mpsc::unbounded_channel::<BodySender>();
        let handler = {
            let calls = calls.clone();
            move || {
                calls.fetch_add(1, Ordering::SeqCst);
                let (frames_tx, frames) = tokio::sync::mpsc::unbounded_channel();
                to_test.send(frames_tx).unwrap();
                async move {
                    let frames = futures_util::stream::unfold(frames, |mut frames| async move {
                        let frame = frames.recv().await?;
                        Some((frame.map(http_body::Frame::data), frames))
                    });
                    let mut response = http::Response::new(axum::body::Body::new(
                        http_body_util::StreamBody::new(frames),
                    ));
                    *response.status_mut() = status;
                    if let Some(length) = length {
                        response
                            .headers_mut()
                            .insert("content-length", length.into());
                    }
                    response
                }
            }
        };
        let this = Self {
            calls,
            bodies: tokio::sync::Mutex::new(bodies),
        };
        (this, routing::get(handler))
    }

    /// The body sender of the origin's next call, once it is called.
    async fn called(&self) -> BodySender {
        let next = async { self.bodies.lock().await.recv().await };
        within(HANG, next, "the origin's next call")
            .await
            .expect("the origin is there")
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

/// What a streaming client got: the status, `x-cache`, and the body compared byte for
/// byte with `expected` as it came (its length, whether every byte matched), and how
/// it ended (`Err` when the body failed or the connection closed early).
struct Streamed {
    status: StatusCode,
    x_cache: String,
    cache_status: String,
    len: usize,
    same: bool,
    ended: Result<(), String>,
}

/// `GET path` on a connection of its own, reading the body frame by frame: counts
/// `first_bytes` when its first byte comes.
async fn stream_get(
    addr: std::net::SocketAddr,
    path: &str,
    expected: bytes::Bytes,
    first_bytes: Arc<AtomicU64>,
) -> Streamed {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let request = http::Request::get(path)
        .header("host", "shop.example")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map_or("", |v| v.to_str().unwrap())
            .to_owned()
    };
    let (status, x_cache, cache_status) =
        (response.status(), header("x-cache"), header("cache-status"));
    let mut body = response.into_body();
    let (mut len, mut same) = (0, true);
    let ended = loop {
        match body.frame().await {
            None => break Ok(()),
            Some(Err(error)) => break Err(error.to_string()),
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if len == 0 && !data.is_empty() {
                    first_bytes.fetch_add(1, Ordering::SeqCst);
                }
                same &= expected.get(len..len + data.len()) == Some(&data[..]);
                len += data.len();
            }
        }
    };
    Streamed {
        status,
        x_cache,
        cache_status,
        len,
        same,
        ended,
    }
}

/// `callers` concurrent streaming clients of `/catalog` on `addr` (see [`stream_get`]).
fn crowd(
    addr: std::net::SocketAddr,
    callers: u64,
    body: &bytes::Bytes,
    first_bytes: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<Streamed>> {
    (0..callers)
        .map(|_| {
            tokio::spawn(stream_get(
                addr,
                "/catalog",
                body.clone(),
                first_bytes.clone(),
            ))
        })
        .collect()
}

/// Waits until all `callers` but the first joined the first one's fill.
async fn all_joined(layer: &stampede_guard::GuardLayer, callers: u64) {
    let joined = eventually(Duration::from_secs(20), || async {
        layer.stats().get(Event::Joined) == callers - 1
    });
    assert!(joined.await, "{:?}", layer.stats());
}

/// 200 concurrent cold callers, each on its own connection, of an 8 MiB answer whose
/// body the origin sends in 1 MiB frames as the test lets it: one origin call. Every
/// caller's first byte comes while the origin still holds back the other 7 MiB (the
/// fill streams to all of them, it does not buffer), every body is whole and right,
/// byte for byte, and the answer is stored: the next 20 callers are hits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crowd_streams_one_fill_of_a_large_answer_through_axum() {
    const CALLERS: u64 = 200;
    let server = RedisServer::start();
    let guard = large_guard(&server).await;
    let layer = guard.layer(large_policy().build().unwrap()).unwrap();
    let (origin, route) = Streaming::route(None, StatusCode::OK);
    let addr = serve(Router::new().route("/catalog", route.layer(layer.clone()))).await;
    let body = large_body();
    let first_bytes = Arc::new(AtomicU64::new(0));
    let callers = crowd(addr, CALLERS, &body, &first_bytes);
    let frames = origin.called().await;
    all_joined(&layer, CALLERS).await;
    let mib = 1 << 20;
    frames.send(Ok(body.slice(..mib))).unwrap();
    let everyone_reads = eventually(Duration::from_secs(20), || async {
        first_bytes.load(Ordering::SeqCst) == CALLERS
    });
    assert!(
        everyone_reads.await,
        "{} of {CALLERS} callers got a first byte while the origin held back 7 MiB",
        first_bytes.load(Ordering::SeqCst)
    );
    for at in (mib..LARGE).step_by(mib) {
        frames.send(Ok(body.slice(at..at + mib))).unwrap();
    }
    drop(frames);
    let got = all_within(callers, Duration::from_secs(120), "the crowd's bodies").await;
    for got in &got {
        assert_eq!((got.status, &got.ended), (StatusCode::OK, &Ok(())));
        assert_eq!((got.len, got.same), (LARGE, true));
        assert_eq!(got.x_cache, "miss");
    }
    let collapsed = got
        .iter()
        .filter(|g| g.cache_status.ends_with("collapsed"))
        .count();
    assert_eq!(collapsed as u64, CALLERS - 1, "all but the leader");
    assert_eq!(layer.stats().get(Event::Coalesced), CALLERS - 1);
    assert_eq!(layer.stats().get(Event::AvoidedCoalesced), CALLERS - 1);
    assert_eq!(origin.calls(), 1);
    for _ in 0..20 {
        let hit = stream_get(addr, "/catalog", body.clone(), Arc::default()).await;
        assert_eq!(
            (hit.x_cache.as_str(), hit.len, hit.same),
            ("hit", LARGE, true)
        );
    }
    assert_eq!(origin.calls(), 1);
}

/// An origin that declares 8 MiB and fails after 3 MiB, read by 50 concurrent callers
/// that share its fill: every one of them gets its body cut (an error, never a whole
/// 200), nothing is stored, and the next caller asks the origin again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_fill_is_cut_for_every_caller_and_nothing_is_stored() {
    const CALLERS: u64 = 50;
    let server = RedisServer::start();
    let guard = large_guard(&server).await;
    let layer = guard.layer(large_policy().build().unwrap()).unwrap();
    let (origin, route) = Streaming::route(Some(LARGE), StatusCode::OK);
    let addr = serve(Router::new().route("/catalog", route.layer(layer.clone()))).await;
    let body = large_body();
    let first_bytes = Arc::new(AtomicU64::new(0));
    let callers = crowd(addr, CALLERS, &body, &first_bytes);
    let frames = origin.called().await;
    all_joined(&layer, CALLERS).await;
    let mib = 1 << 20;
    for at in (0..3 * mib).step_by(mib) {
        frames.send(Ok(body.slice(at..at + mib))).unwrap();
    }
    frames
        .send(Err(std::io::Error::other("the origin's disk failed")))
        .unwrap();
    let got = all_within(callers, Duration::from_secs(60), "the crowd's bodies").await;
    for got in &got {
        assert_eq!(got.status, StatusCode::OK);
        assert!(
            got.ended.is_err(),
            "a cut body ended clean after {} bytes",
            got.len
        );
        assert!(got.len < LARGE && got.same, "{} bytes", got.len);
    }
    assert_eq!(origin.calls(), 1);
    let mut conn = server.conn().await;
    let keys = layer.cache_keys(&support::web::get("/catalog")).unwrap();
    let exists: bool = redis::AsyncCommands::exists(&mut conn, keys.entry())
        .await
        .unwrap();
    assert!(!exists, "nothing is stored of a cut body");
    // The next caller asks the origin again (without the lease, which the fleet holds
    // off for the back-off after a failure).
    let next = tokio::spawn(stream_get(addr, "/catalog", body.clone(), Arc::default()));
    let frames = origin.called().await;
    frames.send(Ok(body.clone())).unwrap();
    drop(frames);
    let next = joined(next, HANG, "the next caller").await;
    assert_eq!((next.len, next.same, next.ended), (LARGE, true, Ok(())));
    assert_eq!(origin.calls(), 2);
}

/// A 404 on a route that stores 200s is not stored, and its key is passed for the
/// hit-for-pass time; but the 20 callers that come at once inside that time share one
/// call (`x-cache: pass`), as the first wave did.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_in_the_hit_for_pass_window_share_one_call() {
    const CALLERS: u64 = 20;
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(
            Policy::builder("items")
                .fresh_ttl(Duration::from_secs(60))
                .hit_for_pass(Duration::from_secs(60))
                .lease_ttl(Duration::from_secs(30))
                .refresh_timeout(Duration::from_secs(30))
                .cold_wait(Duration::from_secs(30))
                .build()
                .unwrap(),
        )
        .unwrap();
    let (origin, route) = Streaming::route(None, StatusCode::NOT_FOUND);
    let addr = serve(Router::new().route("/items/404", route.layer(layer.clone()))).await;
    let missing = bytes::Bytes::from_static(b"no such item");
    let first = tokio::spawn(stream_get(
        addr,
        "/items/404",
        missing.clone(),
        Arc::default(),
    ));
    let frames = origin.called().await;
    frames.send(Ok(missing.clone())).unwrap();
    drop(frames);
    let first = joined(first, HANG, "the first caller").await;
    assert_eq!(
        (first.status, first.x_cache.as_str()),
        (StatusCode::NOT_FOUND, "pass")
    );
    let hit_for_pass = layer.stats().get(Event::HitForPass);
    let (joined, coalesced) = (
        layer.stats().get(Event::Joined),
        layer.stats().get(Event::Coalesced),
    );
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let missing = missing.clone();
            tokio::spawn(stream_get(addr, "/items/404", missing, Arc::default()))
        })
        .collect();
    let frames = origin.called().await;
    // Every one of them skipped the caches, and all but the first joined its call.
    let everyone_waits = eventually(Duration::from_secs(20), || async {
        let stats = layer.stats();
        stats.get(Event::HitForPass) == hit_for_pass + CALLERS
            && stats.get(Event::Joined) == joined + CALLERS - 1
    });
    assert!(everyone_waits.await, "{:?}", layer.stats());
    frames.send(Ok(missing.clone())).unwrap();
    drop(frames);
    for got in all_within(callers, HANG, "the callers").await {
        assert_eq!(
            (got.status, got.x_cache.as_str()),
            (StatusCode::NOT_FOUND, "pass")
        );
        assert_eq!(
            (got.len, got.same, got.ended),
            (missing.len(), true, Ok(()))
        );
    }
    assert_eq!(
        origin.calls(),
        2,
        "one for the first wave, one for the second"
    );
    assert_eq!(
        layer.stats().get(Event::Coalesced),
        coalesced + CALLERS - 1,
        "all but the first were answered by its call"
    );
}

/// Two instances on one Redis, 50 concurrent cold callers of the 8 MiB answer on each:
/// one origin call for the fleet. The instance that holds the lease streams it to its
/// callers; the other's wait for its entry (woken by its notice) and serve it from
/// Redis. Every body is whole and right on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_make_one_origin_call_for_a_large_answer() {
    const CALLERS: u64 = 50;
    let server = RedisServer::start();
    let (origin, route) = Streaming::route(None, StatusCode::OK);
    let mut apps = Vec::new();
    for _ in 0..2 {
        let guard = large_guard(&server).await;
        let layer = guard.layer(large_policy().build().unwrap()).unwrap();
        let app = Router::new().route("/catalog", route.clone().layer(layer.clone()));
        apps.push((serve(app).await, layer, guard));
    }
    let body = large_body();
    let first_bytes = Arc::new(AtomicU64::new(0));
    let mut callers = Vec::new();
    for (addr, _, _) in &apps {
        for _ in 0..CALLERS {
            let (addr, body, first) = (*addr, body.clone(), first_bytes.clone());
            callers.push(tokio::spawn(stream_get(addr, "/catalog", body, first)));
        }
    }
    let frames = origin.called().await;
    // One instance fills, and its other callers join it; the other's fill waits for
    // the lease holder's entry, and its other callers join that.
    let everyone_waits = eventually(Duration::from_secs(20), || async {
        let stats = |i: usize| apps[i].1.stats();
        stats(0).get(Event::Joined) + stats(1).get(Event::Joined) == 2 * (CALLERS - 1)
            && stats(0).get(Event::ColdWaitStarted) + stats(1).get(Event::ColdWaitStarted) == 1
    });
    assert!(
        everyone_waits.await,
        "{:?} {:?}",
        apps[0].1.stats(),
        apps[1].1.stats()
    );
    let mib = 1 << 20;
    for at in (0..LARGE).step_by(mib) {
        frames.send(Ok(body.slice(at..at + mib))).unwrap();
    }
    drop(frames);
    for got in all_within(callers, Duration::from_secs(120), "the fleet's callers").await {
        assert_eq!((got.status, &got.ended), (StatusCode::OK, &Ok(())));
        assert_eq!(
            (got.len, got.same, got.x_cache.as_str()),
            (LARGE, true, "miss")
        );
    }
    assert_eq!(origin.calls(), 1, "one origin call for the fleet");
}

/// Two instances on one Redis, 50 concurrent cold callers on each of an answer whose
/// `Content-Length` says it is larger than the route's `max_body`: its head says it will
/// not be stored, and the fleet hears so at once. The other instance's waiters stop
/// waiting for an entry that would never come and call once for all of them, while
/// the first still streams (its body is held until the second call comes: a wait for
/// the whole fill would never end): at most one call per instance, in five runs of
/// five, and every body whole and right.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_too_large_to_store_is_one_call_per_instance_said_at_its_head() {
    const CALLERS: u64 = 50;
    const SIZE: usize = 2 << 20;
    let server = RedisServer::start();
    let (origin, route) = Streaming::route(Some(SIZE), StatusCode::OK);
    let mut apps = Vec::new();
    for _ in 0..2 {
        let guard = large_guard(&server).await;
        let policy = large_policy().max_body(1 << 20).build().unwrap();
        let layer = guard.layer(policy).unwrap();
        let app = Router::new().route("/video/{n}", route.clone().layer(layer.clone()));
        apps.push((serve(app).await, layer, guard));
    }
    let body = large_body().slice(..SIZE);
    for run in 0..5 {
        let path = format!("/video/{run}");
        let before = origin.calls();
        let joined = |i: usize| apps[i].1.stats().get(Event::Joined);
        let joined_before = joined(0) + joined(1);
        let mut callers = Vec::new();
        for (addr, _, _) in &apps {
            for _ in 0..CALLERS {
                let (addr, body, path) = (*addr, body.clone(), path.clone());
                callers.push(tokio::spawn(async move {
                    stream_get(addr, &path, body, Arc::default()).await
                }));
            }
        }
        // The first call, then the other instance's, while the first's body is held;
        // and every other caller joined its instance's call (a caller that came once a
        // body had streamed past what is held for joiners would call on its own).
        let first = origin.called().await;
        let asked = std::time::Instant::now();
        let second = origin.called().await;
        // At once, not after the other instance's cold wait (30 s) ran out.
        assert!(
            asked.elapsed() < Duration::from_secs(10),
            "the second call came after {:?}, run {run}",
            asked.elapsed()
        );
        let everyone_joined = eventually(Duration::from_secs(20), || async {
            joined(0) + joined(1) == joined_before + 2 * (CALLERS - 1)
        });
        assert!(
            everyone_joined.await,
            "{:?} {:?}",
            apps[0].1.stats(),
            apps[1].1.stats()
        );
        for frames in [first, second] {
            for at in (0..SIZE).step_by(1 << 20) {
                frames.send(Ok(body.slice(at..at + (1 << 20)))).unwrap();
            }
        }
        for got in all_within(callers, Duration::from_secs(60), "the fleet's callers").await {
            assert_eq!(
                (got.status, &got.ended),
                (StatusCode::OK, &Ok(())),
                "run {run}"
            );
            assert_eq!((got.len, got.same), (SIZE, true), "run {run}");
        }
        assert_eq!(
            origin.calls() - before,
            2,
            "one call per instance, run {run}"
        );
    }
}

/// The parts of a large answer's body kept in Redis, by their keys (see `cache::l2`).
async fn parts_in_redis(server: &RedisServer, entry: &str) -> Vec<String> {
    let mut conn = server.conn().await;
    let mut found: Vec<String> = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{entry}:p:*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .unwrap();
        found.extend(keys);
        if next == 0 {
            return found;
        }
        cursor = next;
    }
}

/// The parts of a large answer are written to Redis as its body streams (the entry
/// last); an invalidation that comes halfway refuses the rest, and the entry: the parts
/// written are deleted, no entry names them, and the next caller fills again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parts_are_written_as_the_body_streams_and_none_outlive_a_refused_fill() {
    let server = RedisServer::start();
    let guard = large_guard(&server).await;
    let layer = guard.layer(large_policy().build().unwrap()).unwrap();
    let (origin, route) = Streaming::route(None, StatusCode::OK);
    let addr = serve(Router::new().route("/catalog", route.layer(layer.clone()))).await;
    let entry = layer
        .cache_keys(&support::web::get("/catalog"))
        .unwrap()
        .entry()
        .to_owned();
    let body = large_body();
    let mib = 1 << 20;
    for invalidated in [false, true] {
        let caller = tokio::spawn(stream_get(addr, "/catalog", body.clone(), Arc::default()));
        let frames = origin.called().await;
        let first = 2 * mib + mib / 2;
        frames.send(Ok(body.slice(..first))).unwrap();
        // Four parts of 512 KiB, before the body's end (each once a byte past it came).
        let written = eventually(Duration::from_secs(20), || async {
            parts_in_redis(&server, &entry).await.len() == 4
        });
        assert!(written.await, "{:?}", parts_in_redis(&server, &entry).await);
        if invalidated {
            layer
                .invalidate(&support::web::get("/catalog"))
                .await
                .unwrap();
        }
        for at in (first..LARGE).step_by(mib) {
            frames
                .send(Ok(body.slice(at..(at + mib).min(LARGE))))
                .unwrap();
        }
        drop(frames);
        let got = joined(caller, HANG, "the caller").await;
        assert_eq!((got.len, got.same, got.ended), (LARGE, true, Ok(())));
        let parts = parts_in_redis(&server, &entry).await;
        if invalidated {
            assert!(parts.is_empty(), "a refused fill left {parts:?}");
        } else {
            assert_eq!(parts.len(), 16, "{parts:?}");
            // Served from Redis to an instance of its own.
            let other = large_guard(&server).await;
            let other_layer = other.layer(large_policy().build().unwrap()).unwrap();
            let (unused, route) = Streaming::route(None, StatusCode::OK);
            let other_addr = serve(Router::new().route("/catalog", route.layer(other_layer))).await;
            let hit = stream_get(other_addr, "/catalog", body.clone(), Arc::default()).await;
            assert_eq!(
                (hit.x_cache.as_str(), hit.len, hit.same),
                ("hit", LARGE, true)
            );
            assert_eq!(unused.calls(), 0);
            // Invalidated: the entry and its parts go.
            layer
                .invalidate(&support::web::get("/catalog"))
                .await
                .unwrap();
            assert!(parts_in_redis(&server, &entry).await.is_empty());
        }
    }
    assert_eq!(origin.calls(), 2);
}

/// A body of exactly one part (512 KiB) is kept whole in its entry: no part of it is
/// written to Redis as it streams (one was, and outlived every write of the entry,
/// named by none), and the entry serves another instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_of_exactly_one_part_leaves_no_part_in_redis() {
    const PART: usize = 512 * 1024;
    let server = RedisServer::start();
    let guard = large_guard(&server).await;
    let layer = guard.layer(large_policy().build().unwrap()).unwrap();
    let app = Router::new().route(
        "/one-part",
        routing::get(|| async { vec![7u8; PART] }).layer(layer.clone()),
    );
    let addr = serve(app).await;
    let entry = layer
        .cache_keys(&support::web::get("/one-part"))
        .unwrap()
        .entry()
        .to_owned();
    let got = fetch(addr, "/one-part", &[]).await;
    assert_eq!((got.status, got.body.len()), (StatusCode::OK, PART));
    let parts = parts_in_redis(&server, &entry).await;
    assert!(parts.is_empty(), "a body of one part left {parts:?}");
    let other = large_guard(&server).await;
    let other_layer = other.layer(large_policy().build().unwrap()).unwrap();
    let other_app = Router::new().route(
        "/one-part",
        routing::get(|| async { vec![0u8; 1] }).layer(other_layer),
    );
    let hit = fetch(serve(other_app).await, "/one-part", &[]).await;
    assert_eq!((hit.x_cache(), hit.body.len()), ("hit", PART));
}

/// The parts a fill deletes when it thinks its entry was not written are kept when the
/// entry names them (a write whose reply was lost may have stored it: its parts were
/// deleted from under a live entry), and deleted otherwise: `drop_parts.lua`, run on a
/// real entry of 4 parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parts_an_entry_names_are_never_dropped_by_its_fill() {
    let server = RedisServer::start();
    let guard = large_guard(&server).await;
    let layer = guard.layer(large_policy().build().unwrap()).unwrap();
    let app = Router::new().route(
        "/four-parts",
        routing::get(|| async { vec![7u8; 2 << 20] }).layer(layer.clone()),
    );
    let addr = serve(app).await;
    let entry = layer
        .cache_keys(&support::web::get("/four-parts"))
        .unwrap()
        .entry()
        .to_owned();
    assert_eq!(fetch(addr, "/four-parts", &[]).await.x_cache(), "miss");
    let mut conn = server.conn().await;
    let generation: String = redis::cmd("HGET")
        .arg(&entry)
        .arg("g")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(parts_in_redis(&server, &entry).await.len(), 4);
    // As the crate loads it: the token and variant helpers first.
    let drop_parts = redis::Script::new(concat!(
        include_str!("../src/lease/scripts/tokens.lua"),
        include_str!("../src/cache/scripts/variants.lua"),
        include_str!("../src/cache/scripts/drop_parts.lua")
    ));
    let dropped: i64 = drop_parts
        .key(&entry)
        .arg(&generation)
        .arg(4)
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(dropped, 0, "the entry names them");
    assert_eq!(parts_in_redis(&server, &entry).await.len(), 4);
    // Another generation's, which the entry does not name: deleted.
    for index in 0..2 {
        let _: () = redis::cmd("SET")
            .arg(format!("{entry}:p:42:{index}"))
            .arg("part")
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let dropped: i64 = drop_parts
        .key(&entry)
        .arg("42")
        .arg(2)
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(dropped, 1);
    assert_eq!(parts_in_redis(&server, &entry).await.len(), 4);
    let hit = fetch(addr, "/four-parts", &[]).await;
    assert_eq!((hit.x_cache(), hit.raw.len()), ("hit", 2 << 20));
}

/// Black-box, on the sidecar binary: 100 concurrent cold requests, each on its own
/// connection, for an 8 MiB answer that its origin sends after 300 ms, in 1 MiB frames
/// 50 ms apart. With `--max-body 4MiB` (the answer is larger than what it stores): one
/// origin call for the crowd, every body whole, and the answer not stored. With its
/// defaults (it stores up to 16 MiB) on Redis: one origin call, every body whole, and
/// once the fill has stored it, 20 requests are hits, from the entry kept in parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sidecar_makes_one_origin_call_for_a_crowd_of_a_large_answer() {
    use support::sidecar::Sidecar;
    let calls = Arc::new(AtomicU64::new(0));
    let body = large_body();
    let app = Router::new().fallback(routing::get({
        let (calls, body) = (calls.clone(), body.clone());
        move || {
            calls.fetch_add(1, Ordering::SeqCst);
            let body = body.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let frames = futures_util::stream::unfold(0, move |at| {
                    let body = body.clone();
                    async move {
                        if at >= LARGE {
                            return None;
                        }
                        if at > 0 {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        let frame = http_body::Frame::data(body.slice(at..at + (1 << 20)));
                        Some((Ok::<_, std::io::Error>(frame), at + (1 << 20)))
                    }
                });
                let mut response = http::Response::new(axum::body::Body::new(
                    http_body_util::StreamBody::new(frames),
                ));
                let headers = response.headers_mut();
                headers.insert("cache-control", "max-age=60".parse().unwrap());
                headers.insert("content-length", LARGE.into());
                response
            }
        }
    }));
    let origin = serve(app).await;
    let redis = RedisServer::start();
    let upstream = format!("http://{origin}");
    let redis_url = redis.url();
    for stored in [false, true] {
        let mut args = vec!["--upstream", &upstream];
        if stored {
            args.extend(["--redis", &redis_url]);
        } else {
            args.extend(["--max-body", "4MiB"]);
        }
        let sidecar = Sidecar::start(&args);
        let path = if stored { "/stored" } else { "/not-stored" };
        let before = calls.load(Ordering::SeqCst);
        let listen = sidecar.listen;
        let crowd: Vec<_> = (0..100)
            .map(|_| tokio::spawn(stream_get(listen, path, body.clone(), Arc::default())))
            .collect();
        let what = format!("the crowd (stored: {stored})");
        for got in all_within(crowd, Duration::from_secs(120), &what).await {
            assert_eq!(
                (got.status, &got.ended),
                (StatusCode::OK, &Ok(())),
                "{what}"
            );
            assert_eq!((got.len, got.same), (LARGE, true), "{what}");
        }
        assert_eq!(
            calls.load(Ordering::SeqCst),
            before + 1,
            "{what}: one origin call"
        );
        if stored {
            // (A client has all 8 MiB, as declared, before the fill has written its
            // last parts and its entry: a request that comes meanwhile shares the fill.)
            let stored_now = eventually(Duration::from_secs(20), || async {
                let got = stream_get(listen, path, body.clone(), Arc::default()).await;
                assert_eq!((got.len, got.same), (LARGE, true));
                got.x_cache == "hit"
            });
            assert!(stored_now.await, "the entry was stored");
            for _ in 0..20 {
                let hit = stream_get(listen, path, body.clone(), Arc::default()).await;
                assert_eq!(
                    (hit.x_cache.as_str(), hit.len, hit.same),
                    ("hit", LARGE, true)
                );
            }
            assert_eq!(
                calls.load(Ordering::SeqCst),
                before + 1,
                "the next 20 are hits"
            );
        }
    }
}

/// An event stream (`text/event-stream`) is one connection's: on a route the user
/// declared cacheable, each caller gets its own from the origin, as it comes (its first
/// event while the origin keeps the stream open), and none is stored or shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_stream_is_each_callers_own_and_streams_as_it_comes() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(
            Policy::builder("events")
                .fresh_ttl(Duration::from_secs(60))
                .build()
                .unwrap(),
        )
        .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let (open, _) = tokio::sync::watch::channel(());
    let handler = {
        let (calls, open) = (calls.clone(), open.clone());
        move || {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let mut closed = open.subscribe();
            async move {
                // One event, then nothing until the test ends.
                let first = futures_util::stream::once(async move {
                    Ok::<_, std::io::Error>(http_body::Frame::data(bytes::Bytes::from(format!(
                        "data: {n}\n\n"
                    ))))
                });
                let rest = futures_util::stream::once(async move {
                    let _ = closed.changed().await;
                    Ok::<_, std::io::Error>(http_body::Frame::data(bytes::Bytes::new()))
                });
                use futures_util::StreamExt;
                let mut response = http::Response::new(axum::body::Body::new(
                    http_body_util::StreamBody::new(first.chain(rest)),
                ));
                response
                    .headers_mut()
                    .insert("content-type", "text/event-stream".parse().unwrap());
                response
            }
        }
    };
    let addr =
        serve(Router::new().route("/events", routing::get(handler).layer(layer.clone()))).await;
    let (mut firsts, mut open_streams) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .unwrap();
        tokio::spawn(conn);
        let request = http::Request::get("/events")
            .header("host", "shop.example")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        let response = within(
            HANG,
            sender.send_request(request),
            "the event stream's head",
        )
        .await
        .unwrap();
        assert_eq!(response.headers()["x-cache"], "pass");
        let mut body = response.into_body();
        use http_body_util::BodyExt;
        let frame = within(
            HANG,
            body.frame(),
            "the first event, while the stream is open",
        )
        .await
        .unwrap()
        .unwrap();
        firsts.push(String::from_utf8(frame.into_data().unwrap().to_vec()).unwrap());
        // Kept open: the next caller comes while this stream goes on.
        open_streams.push((body, sender));
    }
    assert_eq!(firsts, ["data: 1\n\n", "data: 2\n\n", "data: 3\n\n"]);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(layer.stats().get(Event::NotStoredEventStream), 1);
    drop((open, open_streams));
}

/// Bytes Redis has sent its clients so far (`INFO stats`).
async fn redis_sent(server: &RedisServer) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut server.conn().await)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("total_net_output_bytes:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("INFO stats says what it sent")
}

/// A 32 MiB entry, stored by one instance, read on another whose L1 does not keep it
/// (the default 64 MiB L1 keeps an entry of 16 MiB at most): a range reads only the
/// parts it spans from Redis (1 KiB from the middle of a part: one part; 1 KiB across
/// two parts: two), and a crowd of whole readers streams it part by part, every body
/// whole and right, with no origin call. An invalidation while a slow reader is halfway
/// cuts that reader's body (the parts are gone): an error, never a wrong byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_large_entry_is_read_from_redis_part_by_part_and_a_range_reads_only_its_parts() {
    const HUGE: usize = 32 << 20;
    const PART: usize = 512 * 1024;
    let server = RedisServer::start();
    let body: bytes::Bytes = (0..HUGE)
        .map(|i| ((i * 7 + i / PART) % 251) as u8)
        .collect::<Vec<u8>>()
        .into();
    let calls = Arc::new(AtomicU64::new(0));
    let handler = {
        let (body, calls) = (body.clone(), calls.clone());
        move || {
            calls.fetch_add(1, Ordering::SeqCst);
            let body = body.clone();
            async move { body }
        }
    };
    let policy = || large_policy().max_body(64 << 20).build().unwrap();
    let filler = large_guard(&server).await;
    let filler_layer = filler.layer(policy()).unwrap();
    let filling = serve(Router::new().route(
        "/catalog",
        routing::get(handler.clone()).layer(filler_layer.clone()),
    ))
    .await;
    let got = fetch(filling, "/catalog", &[]).await;
    assert_eq!((got.status, got.x_cache()), (StatusCode::OK, "miss"));
    // Another instance, with the default L1.
    let reader = guard_with_l1(&server, None).await;
    let layer = reader.layer(policy()).unwrap();
    let addr =
        serve(Router::new().route("/catalog", routing::get(handler).layer(layer.clone()))).await;

    let lossy = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    for (first, parts) in [(16 * PART + 1000, 1), (20 * PART - 512, 2)] {
        let last = first + 1023;
        let sent = redis_sent(&server).await;
        let range = format!("bytes={first}-{last}");
        let got = fetch(addr, "/catalog", &[("range", &range)]).await;
        let read = redis_sent(&server).await - sent;
        eprintln!("{range}: {read} bytes read from Redis");
        assert_eq!(got.status, StatusCode::PARTIAL_CONTENT);
        assert_eq!(got.x_cache(), "hit");
        assert_eq!(got.body, lossy(&body[first..=last]), "{range}");
        assert_eq!(
            got.headers["content-range"],
            format!("bytes {first}-{last}/{HUGE}").as_str()
        );
        // The parts it spans, and the entry's head and the check: far less than a
        // part more.
        assert!(
            read >= (parts * PART) as u64 && read < (parts * PART + PART / 4) as u64,
            "{range}: {read} bytes read from Redis for {parts} part(s)"
        );
    }

    let first_bytes = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..20)
        .map(|_| {
            tokio::spawn(stream_get(
                addr,
                "/catalog",
                body.clone(),
                first_bytes.clone(),
            ))
        })
        .collect();
    for got in all_within(readers, Duration::from_secs(120), "the readers").await {
        assert_eq!((got.status, &got.ended), (StatusCode::OK, &Ok(())));
        assert_eq!(
            (got.len, got.same, got.x_cache.as_str()),
            (HUGE, true, "hit")
        );
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the origin was called once"
    );

    // A slow reader: its first bytes, then an invalidation, then the rest.
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let request = http::Request::get("/catalog")
        .header("host", "shop.example")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let response = within(HANG, sender.send_request(request), "the slow reader's head")
        .await
        .unwrap();
    assert_eq!(response.headers()["x-cache"], "hit");
    let mut slow = response.into_body();
    let mut len = 0;
    let frame = within(HANG, slow.frame(), "the first frame")
        .await
        .unwrap()
        .unwrap();
    let data = frame.into_data().unwrap();
    assert_eq!(&data[..], &body[..data.len()]);
    len += data.len();
    let invalidate = http::Request::get("/catalog")
        .header("host", "shop.example")
        .body(())
        .unwrap();
    layer.invalidate(&invalidate).await.unwrap();
    let ended = loop {
        match within(HANG, slow.frame(), "the slow reader's body").await {
            None => break Ok(()),
            Some(Err(error)) => break Err(error),
            Some(Ok(frame)) => {
                let data = frame.into_data().unwrap();
                assert_eq!(&data[..], &body[len..len + data.len()], "a wrong byte");
                len += data.len();
            }
        }
    };
    assert!(
        ended.is_err() && len < HUGE,
        "cut after {len} bytes, not ended clean"
    );
}

/// A refresh of an entry kept in parts reads its answer whole, then writes its parts
/// and the entry naming the new generation only if the body changed; the parts of the
/// entry it replaced linger long enough for a reader at 256 KiB/s to read them whole (16
/// parts: 42 s), and at most two generations linger. A refresh whose body is the same
/// renews the entry and writes no part. Another instance reads the new body.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refresh_writes_its_parts_as_its_body_streams() {
    let server = RedisServer::start();
    let guard = large_guard(&server).await;
    let policy = || {
        large_policy()
            .fresh_ttl(Duration::from_secs(1))
            .grace(Duration::from_secs(120))
            .build()
            .unwrap()
    };
    let layer = guard.layer(policy()).unwrap();
    let (origin, route) = Streaming::route(None, StatusCode::OK);
    let addr = serve(Router::new().route("/catalog", route.layer(layer.clone()))).await;
    let entry = layer
        .cache_keys(&support::web::get("/catalog"))
        .unwrap()
        .entry()
        .to_owned();
    let old = large_body();
    let new: bytes::Bytes = old.iter().map(|b| b ^ 0x5a).collect::<Vec<u8>>().into();
    let mib = 1 << 20;
    let send_from = |frames: &BodySender, body: &bytes::Bytes, from: usize, to: usize| {
        for at in (from..to).step_by(mib) {
            frames.send(Ok(body.slice(at..(at + mib).min(to)))).unwrap();
        }
    };
    let caller = tokio::spawn(stream_get(addr, "/catalog", old.clone(), Arc::default()));
    let frames = origin.called().await;
    send_from(&frames, &old, 0, LARGE);
    drop(frames);
    let got = joined(caller, HANG, "the first caller").await;
    assert_eq!(
        (got.len, got.same, got.x_cache.as_str()),
        (LARGE, true, "miss")
    );
    let generation = || async {
        let g: String = redis::cmd("HGET")
            .arg(&entry)
            .arg("g")
            .query_async(&mut server.conn().await)
            .await
            .unwrap();
        g
    };
    let first = generation().await;
    // Stale: served at once, and refreshed.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let stale = stream_get(addr, "/catalog", old.clone(), Arc::default()).await;
    assert_eq!(
        (stale.len, stale.same, stale.x_cache.as_str()),
        (LARGE, true, "stale")
    );
    let frames = origin.called().await;
    let half = 2 * mib + mib / 2;
    send_from(&frames, &new, 0, half);
    // Not written as it streams (it may be the entry's own body): the old entry's 16.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(parts_in_redis(&server, &entry).await.len(), 16);
    assert_eq!(generation().await, first, "the entry is written last");
    send_from(&frames, &new, half, LARGE);
    drop(frames);
    let replaced = eventually(Duration::from_secs(20), || async {
        generation().await != first
    });
    assert!(replaced.await, "the refresh wrote its entry");
    // The old generation's parts linger for a reader at 256 KiB/s: 16 parts of 2 s,
    // and 10 s more.
    let mut conn = server.conn().await;
    for key in parts_in_redis(&server, &entry).await {
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        if key.contains(&format!(":p:{first}:")) {
            assert!((30_000..=42_000).contains(&pttl), "{key}: {pttl} ms");
        } else {
            assert!(pttl > 60_000, "{key}: {pttl} ms");
        }
    }
    // Another instance reads the new body.
    let other = large_guard(&server).await;
    let other_layer = other.layer(policy()).unwrap();
    let (unused, route) = Streaming::route(None, StatusCode::OK);
    let other_addr = serve(Router::new().route("/catalog", route.layer(other_layer))).await;
    let hit = stream_get(other_addr, "/catalog", new.clone(), Arc::default()).await;
    assert_eq!(
        (hit.x_cache.as_str(), hit.len, hit.same),
        ("hit", LARGE, true)
    );
    assert_eq!((unused.calls(), origin.calls()), (0, 2));
    // Refreshed with a changed body, then the same body, then a changed one: the same
    // body renews the entry and writes no part; three generations at most are kept
    // (the entry's, and two lingering), the oldest going first.
    let mut generations = vec![first, generation().await];
    for (body, changed) in [(&old, true), (&old, false), (&new, true)] {
        let before = generation().await;
        let renewed = layer.stats().get(Event::RefreshWritten);
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let stale = stream_get(addr, "/catalog", (*body).clone(), Arc::default());
        let stale = stale.await;
        assert_eq!(stale.x_cache, "stale");
        let frames = origin.called().await;
        send_from(&frames, body, 0, LARGE);
        drop(frames);
        let refreshed = eventually(Duration::from_secs(20), || async {
            layer.stats().get(Event::RefreshWritten) > renewed
        });
        assert!(refreshed.await, "the refresh wrote its entry");
        let after = generation().await;
        assert_eq!(
            after != before,
            changed,
            "a new generation only for a new body"
        );
        if changed {
            generations.push(after);
        }
        let parts = parts_in_redis(&server, &entry).await;
        let of = |g: &str| {
            parts
                .iter()
                .filter(|k| k.contains(&format!(":p:{g}:")))
                .count()
        };
        let kept: Vec<usize> = generations.iter().map(|g| of(g)).collect();
        let newest: Vec<usize> = kept.iter().rev().take(3).copied().collect();
        assert_eq!(newest, vec![16; newest.len()], "{kept:?}");
        assert_eq!(parts.len(), 16 * newest.len(), "{kept:?}");
    }
    assert_eq!(generations.len(), 4);
    // Served from the renewed entry, whole, by another instance.
    let hit = stream_get(other_addr, "/catalog", new.clone(), Arc::default()).await;
    assert_eq!((hit.len, hit.same), (LARGE, true));
}

/// A stale entry read from Redis part by part (a range, on an instance whose L1 does
/// not keep it) is refreshed with an unconditional request: its body is not held, so a
/// `304` could not renew it (it renewed it with an empty body, which every instance
/// then served). The refreshed entry is whole on every instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_entry_read_in_parts_is_refreshed_whole() {
    const HUGE: usize = 32 << 20;
    let server = RedisServer::start();
    let body: bytes::Bytes = (0..HUGE)
        .map(|i| (i % 253) as u8)
        .collect::<Vec<u8>>()
        .into();
    let (calls, conditional) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let handler = {
        let (body, calls, conditional) = (body.clone(), calls.clone(), conditional.clone());
        move |headers: HeaderMap| {
            calls.fetch_add(1, Ordering::SeqCst);
            let (body, conditional) = (body.clone(), conditional.clone());
            async move {
                let etag = [("etag", "\"v1\"")];
                if headers.contains_key("if-none-match") {
                    conditional.fetch_add(1, Ordering::SeqCst);
                    return (StatusCode::NOT_MODIFIED, etag, bytes::Bytes::new());
                }
                (StatusCode::OK, etag, body)
            }
        }
    };
    let policy = || {
        large_policy()
            .max_body(64 << 20)
            .fresh_ttl(Duration::from_secs(1))
            .grace(Duration::from_secs(120))
            .build()
            .unwrap()
    };
    let filler = large_guard(&server).await;
    let filling = serve(Router::new().route(
        "/catalog",
        routing::get(handler.clone()).layer(filler.layer(policy()).unwrap()),
    ))
    .await;
    assert_eq!(fetch(filling, "/catalog", &[]).await.x_cache(), "miss");
    // Another instance, with the default L1 (it keeps 16 MiB at most).
    let reader = guard_with_l1(&server, None).await;
    let layer = reader.layer(policy()).unwrap();
    let addr =
        serve(Router::new().route("/catalog", routing::get(handler).layer(layer.clone()))).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let part = fetch(addr, "/catalog", &[("range", "bytes=0-99")]).await;
    assert_eq!(
        (part.status, part.x_cache()),
        (StatusCode::PARTIAL_CONTENT, "stale")
    );
    let refreshed = eventually(Duration::from_secs(20), || async {
        layer.stats().get(Event::RefreshWritten) == 1
    });
    assert!(refreshed.await, "{:?}", layer.stats());
    assert_eq!(
        conditional.load(Ordering::SeqCst),
        0,
        "asked unconditionally"
    );
    for addr in [addr, filling] {
        let whole = stream_get(addr, "/catalog", body.clone(), Arc::default()).await;
        assert_eq!((whole.len, whole.same, whole.ended), (HUGE, true, Ok(())));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
