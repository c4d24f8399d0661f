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
use support::{HANG, RedisServer, eventually, within};

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
            layer.stats().get(Event::Coalesced) == 19
        });
        assert!(joined_it.await, "{what}: {:?}", layer.stats());
        gate.open.notify_one();
        for (got, user) in all_within(callers, HANG, "the callers").await {
            assert_eq!(got.status, StatusCode::OK, "{what}");
            assert_eq!(got.body, format!("account of {user}"), "{what}");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 20, "{what}");
    }
}

/// A qualified `no-cache` (`no-cache="x-account"`) leaves the answer shared, and
/// stored, but never with the field it names.
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
                    "the page",
                )
            }
        }
    };
    let app = Router::new().route("/page", routing::get(handler).layer(layer));
    let addr = serve(app).await;
    for _ in 0..2 {
        let got = fetch(addr, "/page", &[]).await;
        assert_eq!(got.body, "the page");
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
        counter(&scraped, "stampede_guard_coalesced_total") == 19
    });
    assert!(joined_it.await, "the other 19 join the first fill");
    gate.open.notify_one();
    for (got, user) in all_within(callers, HANG, "the callers").await {
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(got.body, format!("account of {user}"));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 20);
}

/// The sum of a counter's series in a Prometheus scrape.
fn counter(scraped: &str, name: &str) -> u64 {
    scraped
        .lines()
        .filter(|line| line.starts_with(name) && !line.starts_with('#'))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}
