//! Variants, and what a fill forwards. A response's `Vary` makes one entry per variant:
//! each caller gets the variant its headers ask for, first request included, with one
//! origin call per variant; what an answer's `Vary` names is learned per URL and kept in
//! Redis, so that an instance that starts later, or missed the notice while its
//! subscription was down, serves each client its variant from its first request; one
//! URL's `Vary` never moves the entries of another. A fill forwards the caller's headers
//! and extensions as a proxy does, but never the unkeyed headers that would let one
//! caller shape what another gets.
//!
//! The tests through `axum::serve` run each instance as an axum app, every request on a
//! connection of its own.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::response::IntoResponse;
use axum::routing;
use http::{HeaderMap, Response, StatusCode, header};
use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::app::{
    Gate, by_language, docs_policy, guard_at, instance, patient_policy, policy, with,
};
use support::http::{fetch, serve};
use support::web::{Origin, all_within, full, get, keys, ready_guard, send};
use support::{HANG, Mode, Proxy, RedisServer, eventually, joined, within};

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

/// A route configured with no keyed header; its responses vary on `Accept-Language`.
/// Two instances, a cold key, French and German callers arriving together on both: the
/// origin is called once per variant, and every caller gets its own, first request
/// included. Afterwards both variants are hits everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_caller_gets_the_variant_its_headers_ask_for() {
    let server = RedisServer::start();
    let origin = by_language();
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
    origin.hold(1);
    let started = origin.started.notified();
    let leader = tokio::spawn({
        let service = a.service.clone();
        async move { send(&service, with("/items/1", "accept-language", "fr")).await }
    });
    within(HANG, started, "A's fill reaching the origin").await;
    let mut callers = Vec::new();
    for i in [&a, &b] {
        for lang in ["fr", "de"] {
            for _ in 0..10 {
                let service = i.service.clone();
                callers.push(tokio::spawn(async move {
                    let got = send(&service, with("/items/1", "accept-language", lang)).await;
                    (lang, got)
                }));
            }
        }
    }
    // Every caller on A joined A's fill, every caller on B joined B's, and B's fill
    // waits for A's entry.
    assert!(
        eventually(Duration::from_secs(5), || async {
            a.layer.stats().get(Event::L2Miss) == 21
                && b.layer.stats().get(Event::L2Miss) == 20
                && b.layer.stats().get(Event::ColdWaitStarted) == 1
        })
        .await
    );
    origin.open();
    let first = joined(leader, HANG, "the first French caller").await;
    assert_eq!(first.body, "lang=fr call 1");
    for (lang, got) in all_within(callers, Duration::from_secs(10), "callers waited").await {
        assert_eq!(got.status, StatusCode::OK);
        assert!(
            got.body.starts_with(&format!("lang={lang} ")),
            "{lang}: {}",
            got.body
        );
    }
    assert_eq!(origin.calls(), 2, "one origin call per variant");
    for i in [&a, &b] {
        for lang in ["fr", "de"] {
            let got = send(&i.service, with("/items/1", "accept-language", lang)).await;
            assert!(got.body.starts_with(&format!("lang={lang} ")));
            assert_eq!(got.x_cache(), "hit");
        }
        // A third variant is its own.
        let got = send(&i.service, with("/items/1", "accept-language", "it")).await;
        assert!(got.body.starts_with("lang=it "), "{}", got.body);
    }
    assert_eq!(origin.calls(), 3);
}

/// A fill forwards the caller's headers as a proxy does (trace context and request ids
/// reach the origin), but not the headers that poison caches: a reflected
/// `X-Forwarded-Host` cannot change what another caller gets. In strict mode only keyed
/// headers reach the origin.
#[tokio::test]
async fn fills_forward_headers_as_a_proxy_does_but_not_poisoning_ones() {
    let server = RedisServer::start();
    let seen: Arc<Mutex<Vec<HeaderMap>>> = Arc::default();
    let origin = Origin::new(Duration::ZERO, {
        let seen = seen.clone();
        move |_, request| {
            seen.lock().unwrap().push(request.headers().clone());
            let host = request
                .headers()
                .get("x-forwarded-host")
                .map_or("none", |v| v.to_str().unwrap());
            Response::new(full(format!("link=https://{host}/next")))
        }
    });
    let i = instance(
        &server,
        patient_policy("items").build().unwrap(),
        origin.service(),
    )
    .await;
    let mut attack = with("/items/1", "x-forwarded-host", "evil.example");
    let headers = attack.headers_mut();
    headers.insert(
        "traceparent",
        "00-4bf92f3577b34da6-00f067aa0ba902b7-01".parse().unwrap(),
    );
    headers.insert("x-request-id", "req-1".parse().unwrap());
    headers.insert("accept-language", "fr".parse().unwrap());
    let attacker = send(&i.service, attack).await;
    assert_eq!(attacker.body, "link=https://none/next");
    let victim = send(&i.service, get("/items/1")).await;
    assert_eq!(
        (victim.body.as_str(), victim.x_cache()),
        ("link=https://none/next", "hit")
    );
    {
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(
            seen[0]["traceparent"],
            "00-4bf92f3577b34da6-00f067aa0ba902b7-01"
        );
        assert_eq!(seen[0]["x-request-id"], "req-1");
        assert_eq!(seen[0]["accept-language"], "fr");
        assert!(seen[0].get("x-forwarded-host").is_none());
    }

    let strict = i
        .guard
        .layer(
            patient_policy("strict")
                .key_headers(["accept-language"])
                .strict_forwarding(true)
                .build()
                .unwrap(),
        )
        .unwrap();
    let service = tower::Layer::layer(&strict, origin.service());
    let mut request = with("/strict/1", "traceparent", "00-abc-def-01");
    request
        .headers_mut()
        .insert("accept-language", "de".parse().unwrap());
    send(&service, request).await;
    let seen = seen.lock().unwrap();
    let mut names: Vec<&str> = seen[1].keys().map(http::HeaderName::as_str).collect();
    names.sort_unstable();
    assert_eq!(names, ["accept-language", "host"]);
}

/// Extensions set by middleware outside the guard (a user, here) reach the request that
/// fills the entry, as the handler would see them without the guard, unless the route
/// turns that off or forwards strictly.
#[tokio::test]
async fn extensions_reach_fills_unless_the_route_says_otherwise() {
    #[derive(Clone)]
    struct User(&'static str);
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |_, request| {
        let user = request.extensions().get::<User>().map_or("none", |u| u.0);
        Response::new(full(format!("user={user}")))
    });
    let guard = guard_at(&server.url(), |b| b);
    within(HANG, guard.ready(), "the guard's readiness")
        .await
        .unwrap();
    // By default the handler sees what it would see without the guard; strict
    // forwarding drops extensions unless they are asked for.
    let cases: [(
        &str,
        fn(stampede_guard::policy::PolicyBuilder) -> stampede_guard::policy::PolicyBuilder,
        &str,
    ); 5] = [
        ("default", |p| p, "user=alice"),
        ("off", |p| p.forward_extensions(false), "user=none"),
        ("on", |p| p.forward_extensions(true), "user=alice"),
        ("strict", |p| p.strict_forwarding(true), "user=none"),
        (
            "strict-on",
            |p| p.strict_forwarding(true).forward_extensions(true),
            "user=alice",
        ),
    ];
    for (route, configure, expected) in cases {
        let layer = guard
            .layer(configure(patient_policy(route)).build().unwrap())
            .unwrap();
        let service = tower::Layer::layer(&layer, origin.service());
        let mut request = get(&format!("/{route}"));
        request.extensions_mut().insert(User("alice"));
        assert_eq!(send(&service, request).await.body, expected, "{route}");
    }
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
    let addr =
        serve(Router::new().route("/page", routing::get(handler).layer(layer.clone()))).await;

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

fn pages_policy() -> Policy {
    Policy::builder("pages")
        .fresh_ttl(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// `/doc/{id}`: document `id` varies on `Accept` (JSON for a client that asks for it,
/// HTML otherwise) when `id` is `varies`, and never otherwise. Counts its calls.
fn app(guard: &StampedeGuard, calls: Arc<AtomicU64>) -> Router {
    let layer = guard.layer(pages_policy()).unwrap();
    let handler = move |uri: http::Uri, headers: HeaderMap| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let id = uri.path().trim_start_matches("/doc/").to_owned();
            if id != "varies" {
                return format!("doc {id} (call {n})").into_response();
            }
            let json = headers
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("json"));
            let (kind, body) = if json {
                ("application/json", format!("{{\"call\":{n}}}"))
            } else {
                ("text/html", format!("<p>call {n}</p>"))
            };
            (
                [(header::CONTENT_TYPE, kind), (header::VARY, "accept")],
                body,
            )
                .into_response()
        }
    };
    Router::new().route("/doc/{id}", routing::get(handler).layer(layer))
}

const JSON: (&str, &str) = ("accept", "application/json");

/// Instance A learns that `/doc/varies` varies on `Accept` (its first client sends
/// none, its second asks for JSON); instance B starts after that: its first JSON client
/// gets the JSON variant from Redis, and its first client without `Accept` the HTML one,
/// with no call to the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_started_later_serves_the_variant_each_client_asks_for() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let a = serve(app(&ready_guard(&server).await, calls.clone())).await;
    let html = fetch(a, "/doc/varies", &[]).await;
    assert_eq!(html.body, "<p>call 1</p>");
    let json = fetch(a, "/doc/varies", &[JSON]).await;
    assert_eq!(json.body, "{\"call\":2}");
    assert_eq!(fetch(a, "/doc/varies", &[JSON]).await.x_cache(), "hit");

    let b = serve(app(&ready_guard(&server).await, calls.clone())).await;
    let json = fetch(b, "/doc/varies", &[JSON]).await;
    assert_eq!(json.body, "{\"call\":2}", "B's first JSON client");
    assert_eq!(json.headers[header::CONTENT_TYPE], "application/json");
    let html = fetch(b, "/doc/varies", &[]).await;
    assert_eq!(
        html.body, "<p>call 1</p>",
        "B's first client without Accept"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "origin calls");
}

/// Only a variant is stored (A's first client asked for JSON: the URL's own entry, which
/// B would look at first, is not there): what A learned is read back from Redis, and B's
/// first JSON client is served that variant with no call to the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_names_learned_are_read_back_from_redis() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let a_guard = ready_guard(&server).await;
    let a = serve(app(&a_guard, calls.clone())).await;
    assert_eq!(fetch(a, "/doc/varies", &[JSON]).await.body, "{\"call\":1}");
    let records = server.scan(&format!("{}*:vary", keys().prefix())).await;
    assert_eq!(records.len(), 1, "one record of names: {records:?}");
    let names: String = server.cmd(&["GET", &records[0]]).await;
    assert_eq!(names, "accept");

    let b = serve(app(&ready_guard(&server).await, calls.clone())).await;
    let json = fetch(b, "/doc/varies", &[JSON]).await;
    assert_eq!(json.body, "{\"call\":1}", "B's first JSON client");
    assert_eq!(json.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "origin calls");
    // A client without `Accept` has no entry yet: its own fill.
    assert_eq!(fetch(b, "/doc/varies", &[]).await.body, "<p>call 2</p>");
}

/// Instance B hears nothing while A learns the `Vary` (its subscription is down: the
/// notice is lost), and B never saw the URL vary: its first JSON client still gets JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_missed_the_notice_serves_the_variant_each_client_asks_for() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let calls = Arc::new(AtomicU64::new(0));
    let store = RedisStore::builder(proxy.url()).build().unwrap();
    let guard_b = StampedeGuard::builder(store, keys()).build().unwrap();
    guard_b.ready().await.unwrap();
    let b = serve(app(&guard_b, calls.clone())).await;
    let a = serve(app(&ready_guard(&server).await, calls.clone())).await;

    proxy.set(Mode::Blackhole);
    assert!(
        eventually(Duration::from_secs(10), || async {
            !guard_b.notices_connected()
        })
        .await
    );
    // Learned by A: the header-less client's HTML is stored where B looks first.
    assert_eq!(fetch(a, "/doc/varies", &[]).await.body, "<p>call 1</p>");
    proxy.set(Mode::Pass);
    proxy.reset_all();
    assert!(
        eventually(Duration::from_secs(10), || async {
            guard_b.notices_connected()
        })
        .await
    );

    let json = fetch(b, "/doc/varies", &[JSON]).await;
    assert_eq!(json.headers[header::CONTENT_TYPE], "application/json");
    assert_eq!(json.body, "{\"call\":2}", "B's first JSON client");
    let html = fetch(b, "/doc/varies", &[]).await;
    assert_eq!(
        html.body, "<p>call 1</p>",
        "B's first client without Accept"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "origin calls");
}

/// 200 URLs of which one varies: the other 199 keep one entry each (in Redis, and one
/// origin call each), whether their clients send `Accept` or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_url_that_varies_does_not_move_the_entries_of_the_others() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let guard = ready_guard(&server).await;
    let addr = serve(app(&guard, calls.clone())).await;
    assert_eq!(fetch(addr, "/doc/varies", &[]).await.body, "<p>call 1</p>");
    assert_eq!(
        fetch(addr, "/doc/varies", &[JSON]).await.body,
        "{\"call\":2}"
    );
    for id in 0..199 {
        let path = format!("/doc/{id}");
        let plain = fetch(addr, &path, &[]).await;
        let json = fetch(addr, &path, &[JSON]).await;
        assert_eq!(plain.body, json.body, "{path}: one entry for both clients");
        assert_eq!(json.x_cache(), "hit", "{path}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2 + 199, "origin calls");
    let entries = server.scan(&format!("{}*:entry", keys().prefix())).await;
    assert_eq!(entries.len(), 2 + 199, "entries in Redis: {entries:?}");
}

/// A route that learns `Vary: x-tenant` from one URL keeps the entries of its other
/// URLs for requests that do not send the header: they are still hits; requests that
/// do send it get their own variant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn learning_a_vary_header_does_not_move_entries_of_requests_without_it() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let calls = Arc::new(AtomicU64::new(0));
    let layer = guard.layer(docs_policy(Duration::from_secs(60))).unwrap();
    let handler = {
        let calls = calls.clone();
        move |uri: http::Uri, headers: HeaderMap| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                let tenant = headers
                    .get("x-tenant")
                    .map_or("none", |v| v.to_str().unwrap())
                    .to_owned();
                let vary = if uri.path() == "/varies" {
                    "x-tenant"
                } else {
                    "accept"
                };
                (
                    [(header::VARY, vary)],
                    format!("{} {tenant} v{n}", uri.path()),
                )
            }
        }
    };
    let app = Router::new()
        .route(
            "/varies",
            routing::get(handler.clone()).layer(layer.clone()),
        )
        .route("/plain", routing::get(handler).layer(layer));
    let addr = serve(app).await;
    assert_eq!(fetch(addr, "/plain", &[]).await.x_cache(), "miss");
    // The route learns x-tenant here.
    let a = fetch(addr, "/varies", &[("x-tenant", "a")]).await;
    assert_eq!((a.x_cache(), a.body.as_str()), ("miss", "/varies a v2"));
    let plain = fetch(addr, "/plain", &[]).await;
    assert_eq!(
        (plain.x_cache(), plain.body.as_str()),
        ("hit", "/plain none v1")
    );
    let b = fetch(addr, "/varies", &[("x-tenant", "b")]).await;
    assert_eq!((b.x_cache(), b.body.as_str()), ("miss", "/varies b v3"));
    assert_eq!(
        fetch(addr, "/varies", &[("x-tenant", "a")]).await.body,
        "/varies a v2"
    );
    let none = fetch(addr, "/varies", &[]).await;
    assert_eq!(
        (none.x_cache(), none.body.as_str()),
        ("miss", "/varies none v4")
    );
    assert_eq!(fetch(addr, "/varies", &[]).await.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

/// A route whose answers vary on a header the client controls: 10,000 clients, each
/// with a value of its own, over real TCP. L1 holds at most its cap of variants of the
/// URL (the default, 256), the least recently used dropped and counted; a variant read
/// all along stays in L1, one dropped comes from Redis again, not from the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variants_of_one_url_are_capped_in_l1_through_axum() {
    const CLIENTS: u64 = 10_000;
    const CAP: u64 = stampede_guard::guard::DEFAULT_L1_MAX_VARIANTS as u64;
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let calls = Arc::new(AtomicU64::new(0));
    let handler = {
        let calls = calls.clone();
        move |headers: HeaderMap| {
            calls.fetch_add(1, Ordering::SeqCst);
            let v = headers["x-v"].to_str().unwrap().to_owned();
            async move { ([(header::VARY, "x-v")], format!("variant {v}")) }
        }
    };
    // Fresh for longer than the test can take on a busy machine: every hit is fresh.
    let policy = Policy::builder("pages")
        .fresh_ttl(Duration::from_secs(3600))
        .build()
        .unwrap();
    let layer = guard.layer(policy).unwrap();
    let addr =
        serve(Router::new().route("/page", routing::get(handler).layer(layer.clone()))).await;
    let ask = move |v: u64| async move {
        let got = fetch(addr, "/page", &[("x-v", &v.to_string())]).await;
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(got.body, format!("variant {v}"));
        got.headers["x-cache"].to_str().unwrap().to_owned()
    };
    assert_eq!(ask(0).await, "miss");
    // Eight clients at a time, each with values of its own; variant 0 is read between
    // every two of them, so that it is always among the most recently used.
    let workers: Vec<_> = (0..8)
        .map(|w| {
            tokio::spawn(async move {
                for v in (1 + w..CLIENTS).step_by(8) {
                    assert_eq!(ask(v).await, "miss", "variant {v}");
                    assert_eq!(ask(0).await, "hit", "variant 0, after {v}");
                }
            })
        })
        .collect();
    all_within(workers, Duration::from_secs(240), "10,000 variants").await;
    assert_eq!(calls.load(Ordering::SeqCst), CLIENTS);
    let dropped = guard.l1_variants_dropped();
    assert!(
        (CLIENTS - CAP..=CLIENTS - CAP + 8).contains(&dropped),
        "{dropped} variants dropped"
    );
    assert!(
        guard.l1_entries() <= CAP + 8,
        "{} in L1",
        guard.l1_entries()
    );
    // Variant 0, read all along, is still in L1.
    let l1_hits = layer.stats().get(Event::L1Hit);
    assert_eq!(ask(0).await, "hit");
    assert_eq!(layer.stats().get(Event::L1Hit), l1_hits + 1);
    // The first ones asked were dropped from L1, not from Redis.
    let (l1_hits, l2_hits) = (
        layer.stats().get(Event::L1Hit),
        layer.stats().get(Event::L2Hit),
    );
    assert_eq!(ask(1).await, "hit");
    assert_eq!(layer.stats().get(Event::L1Hit), l1_hits);
    assert_eq!(layer.stats().get(Event::L2Hit), l2_hits + 1);
    assert_eq!(calls.load(Ordering::SeqCst), CLIENTS, "no origin call");

    // One invalidation of the URL takes every variant L1 holds (each one listed, none
    // left to a predicate) and those in Redis: each is asked of the origin again.
    let page = get("/page");
    let invalidation = layer.invalidate(&page);
    assert!(
        within(HANG, invalidation, "the invalidation")
            .await
            .unwrap()
    );
    for v in [0, 1, CLIENTS - 1] {
        assert_eq!(ask(v).await, "miss", "variant {v} after the invalidation");
    }
    assert_eq!(calls.load(Ordering::SeqCst), CLIENTS + 3);
}
