//! Budget and back-off: what bounds the origin calls a cache makes on its own. The
//! refresh budget bounds the refreshes in flight when thousands of keys go stale
//! together (in process and through `axum::serve`), and a cold fill over the budget
//! follows its route; after an error, or an answer a refresh cannot store, the fleet
//! backs off and serves stale at once; a key whose answers are private is marked
//! hit-for-pass and passed straight through.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing;
use http::{Response, StatusCode};
use redis::AsyncCommands;
use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::app::{Gate, guard_at, instance, patient_policy};
use support::http::{fetch, serve};
use support::web::{self, Origin, all_within, full, get, keys, ready_guard, send};
use support::{HANG, RedisServer, eventually, joined, within};

/// 5,000 keys go stale together and one client walks them, with a budget of 8: the
/// first 8 stale answers start refreshes (held in the origin until the walk is over),
/// the other 4,992 are skipped and counted; every answer is stale, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_refresh_budget_bounds_origin_calls_when_5000_keys_go_stale() {
    const KEYS: u64 = 5000;
    const BUDGET: u64 = 8;
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, request| {
        Response::new(full(format!("{} v{n}", request.uri().path())))
    });
    let guard = guard_at(&server.url(), |b| b.refresh_budget(BUDGET as usize));
    let policy = patient_policy("items")
        .fresh_ttl(Duration::from_secs(2))
        .build()
        .unwrap();
    let i = web::instance(guard, policy, origin.service()).await;
    // Warm every key (50 callers at a time).
    let paths: Arc<Vec<String>> = Arc::new((0..KEYS).map(|k| format!("/items/{k}")).collect());
    let mut warmers = Vec::new();
    for w in 0..50 {
        let (service, paths) = (i.service.clone(), paths.clone());
        warmers.push(tokio::spawn(async move {
            for path in paths.iter().skip(w).step_by(50) {
                assert_eq!(send(&service, get(path)).await.x_cache(), "miss");
            }
        }));
    }
    all_within(warmers, Duration::from_secs(120), "warming took too long").await;
    assert_eq!(origin.calls(), KEYS);
    tokio::time::sleep(Duration::from_millis(2100)).await; // all stale now

    origin.hold_from(KEYS + 1);
    let walk = async {
        for path in paths.iter() {
            let got = send(&i.service, get(path)).await;
            assert_eq!(got.x_cache(), "stale", "{path}");
        }
    };
    tokio::time::timeout(Duration::from_secs(60), walk)
        .await
        .expect("the walk waited for the origin");
    let stats = i.layer.stats();
    assert_eq!(stats.get(Event::Stale), KEYS);
    assert_eq!(stats.get(Event::RefreshSkipped), KEYS - BUDGET, "{stats:?}");
    // The 8 refreshes reach the origin, and no more.
    assert!(
        eventually(Duration::from_secs(10), || async {
            origin.in_flight.load(std::sync::atomic::Ordering::SeqCst) == BUDGET
        })
        .await
    );
    origin.open();
    assert!(
        eventually(Duration::from_secs(10), || async {
            i.layer.stats().get(Event::RefreshWritten) == BUDGET
        })
        .await
    );
    assert_eq!(origin.peak(), BUDGET);
    assert_eq!(origin.calls(), KEYS + BUDGET);
    eprintln!(
        "{KEYS} stale keys walked, budget {BUDGET}: {} stale answers, {} refreshes written, \
         {} skipped, at most {} origin calls at once",
        i.layer.stats().get(Event::Stale),
        i.layer.stats().get(Event::RefreshWritten),
        i.layer.stats().get(Event::RefreshSkipped),
        origin.peak()
    );
}

/// Over real TCP: 600 keys gone stale, walked by one client, a budget of 4. Four
/// refreshes start (held in the handler until the walk is over), 596 are skipped; every
/// answer is stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_refresh_budget_through_axum() {
    const KEYS: u64 = 600;
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().unwrap();
    let guard = StampedeGuard::builder(store, keys())
        .refresh_budget(4)
        .build()
        .unwrap();
    within(HANG, guard.ready(), "the guard's readiness")
        .await
        .unwrap();
    let layer = guard
        .layer(
            Policy::builder("items")
                .fresh_ttl(Duration::from_secs(2))
                .forward_extensions(true)
                .build()
                .unwrap(),
        )
        .unwrap();
    let (gate, calls, in_flight, peak) = (
        Gate::default(),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let handler = {
        let (gate, calls) = (gate.clone(), calls.clone());
        let (in_flight, peak) = (in_flight.clone(), peak.clone());
        move |axum::extract::Path(id): axum::extract::Path<u64>| {
            let (gate, calls) = (gate.clone(), calls.clone());
            let (in_flight, peak) = (in_flight.clone(), peak.clone());
            async move {
                // Made before the call is counted in flight: a `Notified` hears
                // `notify_waiters` from the moment it exists.
                let opened = gate.open.notified();
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(
                    in_flight.fetch_add(1, Ordering::SeqCst) + 1,
                    Ordering::SeqCst,
                );
                if n > KEYS {
                    opened.await;
                }
                in_flight.fetch_sub(1, Ordering::SeqCst);
                format!("item {id} call {n}")
            }
        }
    };
    let app = Router::new().route("/items/{id}", routing::get(handler).layer(layer.clone()));
    let addr = serve(app).await;
    let mut warmers = Vec::new();
    for w in 0..20 {
        warmers.push(tokio::spawn(async move {
            for id in (w..KEYS).step_by(20) {
                let got = fetch(addr, &format!("/items/{id}"), &[]).await;
                assert_eq!(got.x_cache(), "miss");
            }
        }));
    }
    support::web::all_within(warmers, Duration::from_secs(60), "warming took too long").await;
    tokio::time::sleep(Duration::from_millis(2100)).await; // all stale now
    for id in 0..KEYS {
        let got = fetch(addr, &format!("/items/{id}"), &[]).await;
        assert_eq!(got.x_cache(), "stale", "{id}");
    }
    let stats = layer.stats();
    assert_eq!(
        stats.get(stampede_guard::metrics::Event::RefreshSkipped),
        KEYS - 4,
        "{stats:?}"
    );
    let reached = support::eventually(Duration::from_secs(10), || async {
        in_flight.load(Ordering::SeqCst) == 4
    });
    assert!(reached.await);
    // Opened for good: the notify wakes the 4 waiting, and no call is held after.
    gate.open.notify_waiters();
    let written = support::eventually(Duration::from_secs(10), || async {
        layer
            .stats()
            .get(stampede_guard::metrics::Event::RefreshWritten)
            == 4
    });
    assert!(written.await);
    assert_eq!(peak.load(Ordering::SeqCst), 4);
    assert_eq!(calls.load(Ordering::SeqCst), KEYS + 4);
}

/// A budget of one slot, held by a fill in the origin. A cold key of another route waits
/// for a slot at most its cold wait; then, with nothing to stand in, it goes ahead
/// without one on a route that passes through (one call for all its callers), and
/// answers 503 on a route that rejects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_fill_over_the_budget_follows_the_route() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, request| {
        Response::new(full(format!("{} call {n}", request.uri().path())))
    });
    let guard = guard_at(&server.url(), |b| b.refresh_budget(1));
    within(HANG, guard.ready(), "the guard's readiness")
        .await
        .unwrap();
    let layer = |route: &str, reject: bool| {
        let mut policy = patient_policy(route).cold_wait(Duration::from_millis(300));
        if reject {
            policy = policy.cold_miss(stampede_guard::ColdMiss::Reject {
                retry_after: Duration::from_secs(1),
            });
        }
        let layer = guard.layer(policy.build().unwrap()).unwrap();
        let service = tower::Layer::layer(&layer, origin.service());
        (layer, service)
    };
    let (holder, holding) = layer("holder", false);
    let (items, passing) = layer("items", false);
    let (_reports, rejecting) = layer("reports", true);
    origin.hold(1);
    let started = origin.started.notified();
    let held = tokio::spawn(async move { send(&holding, get("/holder")).await });
    // the budget's one slot is in the origin
    within(HANG, started, "the holder's fill reaching the origin").await;
    let callers: Vec<_> = (0..10)
        .map(|_| {
            let service = passing.clone();
            tokio::spawn(async move { send(&service, get("/items/1")).await })
        })
        .collect();
    for got in all_within(callers, Duration::from_secs(10), "callers waited").await {
        assert_eq!(
            (got.body.as_str(), got.x_cache()),
            ("/items/1 call 2", "miss")
        );
    }
    assert_eq!(items.stats().get(Event::FillOverBudget), 1);
    let got = send(&rejecting, get("/reports")).await;
    assert_eq!(got.status, StatusCode::SERVICE_UNAVAILABLE);
    origin.open();
    let held = joined(held, HANG, "the holder's caller").await;
    assert_eq!(held.body, "/holder call 1");
    assert_eq!(holder.stats().get(Event::ColdFill), 1);
    assert_eq!(origin.calls(), 2);
}

/// The origin fails while an entry is past its grace but within stale-if-error: after
/// the first failure, every caller on every instance gets the entry at once while the
/// back-off lasts, and nobody calls the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_origin_in_outage_serves_stale_at_once_through_the_back_off() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, _| {
        let mut response = Response::new(full(if n == 1 { "v1" } else { "down" }));
        if n > 1 {
            *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
        }
        response
    });
    let policy = || {
        patient_policy("items")
            .fresh_ttl(Duration::from_millis(300))
            .grace(Duration::from_millis(300))
            .stale_if_error(Duration::from_secs(60))
            .build()
            .unwrap()
    };
    let a = instance(&server, policy(), origin.service()).await;
    let b = instance(&server, policy(), origin.service()).await;
    assert_eq!(send(&a.service, get("/items/1")).await.body, "v1");
    assert_eq!(send(&b.service, get("/items/1")).await.body, "v1");
    tokio::time::sleep(Duration::from_millis(700)).await; // past grace

    // The first caller's fill meets the failure, and gets the entry instead.
    let got = send(&a.service, get("/items/1")).await;
    assert_eq!((got.status, got.body.as_str()), (StatusCode::OK, "v1"));
    assert_eq!(origin.calls(), 2);
    // Through the back-off (3 s), on both instances: at once, and no origin call.
    let back_off_began = Instant::now();
    let mut slowest = Duration::ZERO;
    while back_off_began.elapsed() < Duration::from_millis(1500) {
        for i in [&a, &b] {
            let asked = Instant::now();
            let got = send(&i.service, get("/items/1")).await;
            slowest = slowest.max(asked.elapsed());
            assert_eq!(
                (got.status, got.body.as_str(), got.x_cache()),
                (StatusCode::OK, "v1", "stale")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("through the back-off: the slowest answer took {slowest:?}");
    assert!(
        slowest < Duration::from_secs(1),
        "a caller waited {slowest:?}"
    );
    assert_eq!(origin.calls(), 2);
}

/// A refresh gets an answer that may not be stored (a 404): the stale entry stays, and
/// the fleet backs off as after an error. The lease is held off (nobody owns it, it ends
/// by itself) and the stale entry's next callers do not refresh again meanwhile.
#[tokio::test]
async fn a_refresh_that_gets_an_answer_it_cannot_store_backs_off() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, _| {
        let mut response = Response::new(full(format!("call {n}")));
        if n > 1 {
            *response.status_mut() = StatusCode::NOT_FOUND;
        }
        response
    });
    let i = instance(
        &server,
        patient_policy("items").build().unwrap(),
        origin.service(),
    )
    .await;
    assert_eq!(send(&i.service, get("/items/1")).await.body, "call 1");
    tokio::time::sleep(Duration::from_millis(600)).await; // stale
    assert_eq!(send(&i.service, get("/items/1")).await.x_cache(), "stale");
    assert!(
        eventually(Duration::from_secs(3), || async {
            i.layer.stats().get(Event::RefreshNotStored) == 1
        })
        .await
    );
    let keys = i.layer.cache_keys(&get("/items/1")).unwrap();
    let held: Option<String> = server.conn().await.get(keys.lease().key()).await.unwrap();
    assert_eq!(held.as_deref(), Some("~held-off"));
    let left: i64 = server.conn().await.pttl(keys.lease().key()).await.unwrap();
    assert!(left > 0 && left <= 3000, "{left} ms");
    for _ in 0..5 {
        let got = send(&i.service, get("/items/1")).await;
        assert_eq!((got.body.as_str(), got.x_cache()), ("call 1", "stale"));
    }
    assert_eq!(origin.calls(), 2);
}

/// Over real TCP: a route whose answers are private is passed straight through
/// (`x-cache: pass`) once the first answer showed it, without queueing behind a fill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_answers_pass_through_axum() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(Policy::builder("account").build().unwrap())
        .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let handler = {
        let calls = calls.clone();
        move || {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move {
                (
                    [(http::header::CACHE_CONTROL, "private")],
                    format!("yours {n}"),
                )
            }
        }
    };
    let addr =
        serve(Router::new().route("/account", routing::get(handler).layer(layer.clone()))).await;
    for n in 1..=3 {
        let got = fetch(addr, "/account", &[]).await;
        assert_eq!(
            (got.body.as_str(), got.x_cache()),
            (format!("yours {n}").as_str(), "pass")
        );
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    // The first went through a fill; the next two straight to the handler.
    let stats = layer.stats();
    assert_eq!(
        stats.get(stampede_guard::metrics::Event::ColdFill),
        1,
        "{stats:?}"
    );
    assert_eq!(
        stats.get(stampede_guard::metrics::Event::HitForPass),
        2,
        "{stats:?}"
    );
}
