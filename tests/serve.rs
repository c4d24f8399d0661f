//! The layer the way users run it: on axum routes served by `axum::serve` over real TCP,
//! every request on a connection of its own.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::StatusCode;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::http::{fetch, serve};
use support::web::{keys, ready_guard};
use support::{HANG, RedisServer, joined, within};
use tokio::sync::Barrier;

/// The README's shape: a guard, a layer with the route's policy, on an axum route. The
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
    Router::new().route("/items/{id}", get(handler).layer(items))
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

/// The README's shape with a handler that reads its path parameter (axum keeps it in
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
    let addr = serve(Router::new().route("/items/{id}", get(handler).layer(items))).await;
    let responses = cold_burst(addr).await;
    for got in &responses {
        assert_eq!(got.status, StatusCode::OK, "{}", got.body);
        assert_eq!(got.body, "item 1 (call 1)");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "handler calls");
}

/// A gate the slow handler waits at, and a signal that it got there.
#[derive(Clone, Default)]
struct Gate {
    open: Arc<tokio::sync::Notify>,
    entered: Arc<tokio::sync::Notify>,
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
        get(handler).layer(
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

/// Over real TCP: callers with different `Accept-Language` on a route that keys on no
/// header, arriving together on a cold key, each get their own variant (the handler
/// says `Vary: Accept-Language`); the handler runs once per variant; the trace context
/// reaches it, a reflected `X-Forwarded-Host` does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn variants_and_forwarded_headers_through_axum() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(Policy::builder("pages").build().unwrap())
        .unwrap();
    let (gate, calls) = (Gate::default(), Arc::new(AtomicU64::new(0)));
    let handler = {
        let (gate, calls) = (gate.clone(), calls.clone());
        move |headers: http::HeaderMap| {
            let (gate, calls) = (gate.clone(), calls.clone());
            async move {
                if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                    let opened = gate.open.notified();
                    gate.entered.notify_one();
                    opened.await;
                }
                let header = |name: &str| {
                    headers
                        .get(name)
                        .map_or("none", |v| v.to_str().unwrap())
                        .to_owned()
                };
                let body = format!(
                    "lang={} trace={} host={}",
                    header("accept-language"),
                    header("traceparent"),
                    header("x-forwarded-host")
                );
                ([(http::header::VARY, "Accept-Language")], body)
            }
        }
    };
    let addr = serve(Router::new().route("/page", get(handler).layer(layer.clone()))).await;

    let entered = gate.entered.notified();
    let first = tokio::spawn(async move {
        let headers = [
            ("accept-language", "fr"),
            ("traceparent", "00-aa-bb-01"),
            ("x-forwarded-host", "evil.example"),
        ];
        fetch(addr, "/page", &headers).await
    });
    within(HANG, entered, "the first fill reaching the handler").await;
    let mut callers = Vec::new();
    for lang in ["fr", "de"] {
        for _ in 0..20 {
            callers.push(tokio::spawn(async move {
                (
                    lang,
                    fetch(addr, "/page", &[("accept-language", lang)]).await,
                )
            }));
        }
    }
    // Every caller has looked in Redis, and so joined the fill in flight.
    let joined = support::eventually(Duration::from_secs(10), || async {
        layer.stats().get(stampede_guard::metrics::Event::L2Miss) == 41
    });
    assert!(joined.await, "{:?}", layer.stats());
    gate.open.notify_one();
    let first = support::joined(first, HANG, "the first caller").await;
    assert_eq!(first.body, "lang=fr trace=00-aa-bb-01 host=none");
    let callers =
        support::web::all_within(callers, Duration::from_secs(20), "callers waited").await;
    for (lang, got) in callers {
        assert_eq!(got.status, StatusCode::OK);
        assert!(
            got.body.starts_with(&format!("lang={lang} ")),
            "{lang}: {}",
            got.body
        );
        assert!(got.body.ends_with("host=none"));
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "handler calls: one per variant"
    );
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
    let addr = serve(Router::new().route("/account", get(handler).layer(layer.clone()))).await;
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
        let app = Router::new().route("/items/404", get(handler.clone()).layer(layer.clone()));
        apps.push((serve(app).await, layer));
    }
    let (a, b) = (apps[0].0, apps[1].0);
    let entered = gate.entered.notified();
    let holder = tokio::spawn(async move { fetch(a, "/items/404", &[]).await });
    within(HANG, entered, "A's fill reaching the handler").await;
    let callers: Vec<_> = (0..20)
        .map(|_| tokio::spawn(async move { fetch(b, "/items/404", &[]).await }))
        .collect();
    let waiting = support::eventually(Duration::from_secs(10), || async {
        apps[1]
            .1
            .stats()
            .get(stampede_guard::metrics::Event::ColdWaitStarted)
            == 1
    });
    assert!(waiting.await);
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
    // A's call, then one of B's for all the callers that waited: a 404 is not stored,
    // but it is not private either, and B's fill shares it. A caller that reached B only
    // after that (a loaded machine is slow to connect twenty clients) finds the key
    // marked hit-for-pass and makes a call of its own, counted as such.
    let late = apps[1]
        .1
        .stats()
        .get(stampede_guard::metrics::Event::HitForPass);
    assert!(late < 20, "no caller waited for A's fill");
    assert_eq!(calls.load(Ordering::SeqCst), 2 + late);
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
    let app = Router::new().route("/items/{id}", get(handler).layer(layer.clone()));
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

/// Over real TCP, the way a hit keys itself (piece by piece, from the request hyper
/// parsed) finds the entry a fill put under the key made from the whole identity:
/// reordered and many parameters, a long path, and variants once the route learned
/// `Vary`. Each second request of a pair is an L1 hit, one handler call per pair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_find_their_entries_through_axum() {
    use stampede_guard::metrics::Event;
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(Policy::builder("pages").build().unwrap())
        .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let handler = {
        let calls = calls.clone();
        move |headers: http::HeaderMap| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let lang = headers
                .get("accept-language")
                .map_or("none", |v| v.to_str().unwrap())
                .to_owned();
            async move {
                (
                    [(http::header::VARY, "Accept-Language")],
                    format!("lang={lang} call {n}"),
                )
            }
        }
    };
    let app = Router::new()
        .route("/page", get(handler.clone()))
        .route("/page/{*rest}", get(handler))
        .layer(layer.clone());
    let addr = serve(app).await;
    let many = |order: &mut dyn Iterator<Item = u32>| {
        order
            .map(|n| format!("p{n}={n}"))
            .collect::<Vec<_>>()
            .join("&")
    };
    let long = format!("/page/{}", "x".repeat(600));
    let pairs = [
        ("/page?a=1&b=2".to_owned(), "/page?b=2&a=1".to_owned(), "fr"),
        (
            format!("/page?{}", many(&mut (0..12))),
            format!("/page?{}", many(&mut (0..12).rev())),
            "fr",
        ),
        (long.clone(), long, "fr"),
        ("/page?a=1&b=2".to_owned(), "/page?b=2&a=1".to_owned(), "de"),
    ];
    for (n, (first, second, lang)) in pairs.iter().enumerate() {
        let got = fetch(addr, first, &[("accept-language", lang)]).await;
        assert_eq!(got.x_cache(), "miss", "{first} {lang}");
        let l1_hits = layer.stats().get(Event::L1Hit);
        let got = fetch(addr, second, &[("accept-language", lang)]).await;
        assert_eq!(got.x_cache(), "hit", "{second} {lang}");
        assert!(
            got.body.starts_with(&format!("lang={lang} ")),
            "{}",
            got.body
        );
        assert_eq!(
            layer.stats().get(Event::L1Hit),
            l1_hits + 1,
            "{second} {lang}"
        );
        assert_eq!(
            calls.load(Ordering::SeqCst),
            n as u64 + 1,
            "{second} {lang}"
        );
    }
}
