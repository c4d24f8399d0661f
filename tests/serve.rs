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
use support::{HANG, RedisServer, within};

/// A gate the slow handler waits at, and a signal that it got there.
#[derive(Clone, Default)]
struct Gate {
    open: Arc<tokio::sync::Notify>,
    entered: Arc<tokio::sync::Notify>,
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
