//! What real users hit, against real Redis servers: waits that end as soon as the lease
//! holder ends without writing, hit-for-pass, stale at once through a back-off, the
//! refresh budget, headers forwarded to the origin and `Vary` learned from it, fencing
//! against the last issued token, and the smaller fixes that came with them.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{HeaderMap, Response, StatusCode};
use redis::AsyncCommands;
use stampede_guard::guard::GuardBuilder;
use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::web::{self, Instance, Origin, all_within, full, get, keys, send};
use support::{HANG, Mode, Proxy, RedisServer, eventually, joined, within};

/// Generous: these tests must pass on a machine whose cores are busy.
const TIMEOUT: Duration = Duration::from_millis(250);

fn guard_at(url: &str, configure: impl FnOnce(GuardBuilder) -> GuardBuilder) -> StampedeGuard {
    let store = RedisStore::builder(url)
        .command_timeout(TIMEOUT)
        .build()
        .unwrap();
    configure(StampedeGuard::builder(store, keys()))
        .build()
        .unwrap()
}

/// A cold wait far longer than any bound the tests assert: only a notice can end a
/// wait in time.
fn policy(route: &str) -> stampede_guard::policy::PolicyBuilder {
    Policy::builder(route)
        .fresh_ttl(Duration::from_millis(500))
        .grace(Duration::from_secs(30))
        .lease_ttl(Duration::from_secs(5))
        .refresh_timeout(Duration::from_secs(5))
        .cold_wait(Duration::from_secs(10))
        .error_backoff(Duration::from_secs(3))
}

async fn instance<S>(server: &RedisServer, policy: Policy, origin: S) -> Instance<S> {
    web::instance(guard_at(&server.url(), |b| b), policy, origin).await
}

fn with(path: &str, name: &str, value: &str) -> web::Req {
    let mut request = get(path);
    request.headers_mut().insert(
        http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
        value.parse().unwrap(),
    );
    request
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
        policy("items")
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
    let policy = policy("items")
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

/// What the origin answers: the `Accept-Language` it saw, with `Vary: Accept-Language`.
fn by_language() -> Origin {
    Origin::new(Duration::ZERO, |n, request| {
        let lang = request
            .headers()
            .get("accept-language")
            .map_or("none", |v| v.to_str().unwrap());
        let mut response = Response::new(full(format!("lang={lang} call {n}")));
        response
            .headers_mut()
            .insert("vary", "Accept-Language".parse().unwrap());
        response
    })
}

/// A route configured with no keyed header; its responses vary on `Accept-Language`.
/// Two instances, a cold key, French and German callers arriving together on both: the
/// origin is called once per variant, and every caller gets its own, first request
/// included. Afterwards both variants are hits everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_caller_gets_the_variant_its_headers_ask_for() {
    let server = RedisServer::start();
    let origin = by_language();
    let a = instance(&server, policy("items").build().unwrap(), origin.service()).await;
    let b = instance(&server, policy("items").build().unwrap(), origin.service()).await;
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
    let i = instance(&server, policy("items").build().unwrap(), origin.service()).await;
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
            policy("strict")
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
            .layer(configure(policy(route)).build().unwrap())
            .unwrap();
        let service = tower::Layer::layer(&layer, origin.service());
        let mut request = get(&format!("/{route}"));
        request.extensions_mut().insert(User("alice"));
        assert_eq!(send(&service, request).await.body, expected, "{route}");
    }
}

/// An instance's notice subscription is cut (its Redis traffic blackholed) while
/// another instance invalidates an entry: the notice never reaches it. When the
/// subscription is back, the entry it holds is not served as fresh any more: stale,
/// while a refresh reads Redis again, then the new value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_subscription_comes_back_l1_entries_are_not_served_as_fresh() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let origin = Origin::versions(Duration::ZERO);
    let policy = || {
        policy("items")
            .fresh_ttl(Duration::from_secs(60))
            .build()
            .unwrap()
    };
    let a = web::instance(guard_at(&proxy.url(), |b| b), policy(), origin.service()).await;
    let b = instance(&server, policy(), origin.service()).await;
    assert_eq!(send(&a.service, get("/items/1")).await.body, "v1");
    assert_eq!(send(&a.service, get("/items/1")).await.x_cache(), "hit");

    proxy.set(Mode::Blackhole);
    assert!(
        eventually(Duration::from_secs(10), || async {
            !a.guard.notices_connected()
        })
        .await
    );
    let item = get("/items/1");
    let invalidation = b.layer.invalidate(&item);
    assert!(
        within(HANG, invalidation, "the invalidation")
            .await
            .unwrap()
    );
    proxy.set(Mode::Pass);
    proxy.reset_all();
    assert!(
        eventually(Duration::from_secs(10), || async {
            a.guard.notices_connected()
        })
        .await
    );
    let service = &a.service;
    let got = send(service, get("/items/1")).await;
    assert_eq!((got.x_cache(), got.body.as_str()), ("stale", "v1"));
    // Fresh by its lifetime, stale here: `cache-status` says so too (no freshness left).
    let status = got.headers["cache-status"].to_str().unwrap();
    assert_eq!(
        status, "stampede-guard; hit; ttl=0",
        "x-cache and cache-status agree"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            send(service, get("/items/1")).await.body == "v2"
        })
        .await
    );
}

/// A route that must never be cached says so; a route name is refused twice.
#[tokio::test]
async fn a_route_can_be_never_cached_and_a_route_name_is_taken_once() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let i = instance(
        &server,
        policy("admin").never_cache().build().unwrap(),
        origin.service(),
    )
    .await;
    for n in 1..=2 {
        let got = send(&i.service, get("/admin")).await;
        assert_eq!(
            (got.body.as_str(), got.x_cache()),
            (format!("v{n}").as_str(), "bypass")
        );
    }
    let again = i.guard.layer(policy("admin").build().unwrap()).unwrap_err();
    assert_eq!(again.field(), "route");
    assert!(again.to_string().contains("admin"), "{again}");
}

/// The route of the invalidation tests: fresh for 3 hours, so that only an
/// invalidation can make an instance fill again.
fn fresh_for_hours() -> Policy {
    policy("items")
        .fresh_ttl(Duration::from_secs(3 * 3600))
        .build()
        .unwrap()
}

/// After an invalidation of `/items/1`: every variant on each instance is filled again,
/// the third or fourth origin call, never answered from what was invalidated.
async fn every_variant_is_refilled<S: Clone>(instances: [&Instance<S>; 2])
where
    stampede_guard::Guard<S>: tower::Service<
            web::Req,
            Response = Response<stampede_guard::ResponseBody<web::Body>>,
            Error = std::convert::Infallible,
        >,
{
    for i in instances {
        for lang in ["fr", "de"] {
            let service = &i.service;
            let refilled = eventually(Duration::from_secs(3), || async {
                let got = send(service, with("/items/1", "accept-language", lang)).await;
                got.body.starts_with(&format!("lang={lang} "))
                    && (got.body.ends_with("call 3") || got.body.ends_with("call 4"))
            });
            assert!(refilled.await, "{lang} kept its invalidated variant");
        }
    }
}

/// A route learned `Vary: Accept-Language` and holds a French and a German variant on
/// two instances, fresh for 3 hours. One invalidation, made with no `Accept-Language` at
/// all, reaches every variant, in L2 and in every instance's L1; what hides the variants
/// in Redis lasts as long as they could; the variants' tokens and the invalidation's are
/// ordered (one counter is raised to every variant's token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_invalidation_reaches_every_variant() {
    let server = RedisServer::start();
    let origin = by_language();
    let a = instance(&server, fresh_for_hours(), origin.service()).await;
    let b = instance(&server, fresh_for_hours(), origin.service()).await;
    for i in [&a, &b] {
        for lang in ["fr", "de"] {
            let got = send(&i.service, with("/items/1", "accept-language", lang)).await;
            assert!(got.body.starts_with(&format!("lang={lang} ")));
        }
    }
    // fr first (learned Vary from it), then de: two calls; B read both from L2.
    assert_eq!(origin.calls(), 2);
    for i in [&a, &b] {
        let got = send(&i.service, with("/items/1", "accept-language", "de")).await;
        assert_eq!(got.x_cache(), "hit");
    }
    let mut conn = server.conn().await;
    let variant = |lang: &str| {
        a.layer
            .cache_keys(&with("/items/1", "accept-language", lang))
            .unwrap()
    };
    let (fr, de) = (variant("fr"), variant("de"));
    assert!(fr.is_variant() && de.is_variant());
    let counter: u64 = conn.get(fr.primary_fence_key()).await.unwrap();
    let mut tokens = Vec::new();
    for keys in [&fr, &de] {
        tokens.push(conn.hget::<_, _, u64>(keys.entry(), "t").await.unwrap());
    }
    // Raised to each variant's token as it was filled: the last one's.
    assert_eq!(
        Some(counter),
        tokens.iter().copied().max(),
        "the response's counter against its variants' tokens {tokens:?}"
    );
    let item = get("/items/1");
    let invalidation = a.layer.invalidate(&item);
    within(HANG, invalidation, "the invalidation")
        .await
        .unwrap();
    let hidden_for: i64 = conn.pttl(fr.invalidated_key()).await.unwrap();
    assert!(hidden_for > 3 * 3600 * 1000, "{hidden_for} ms");
    let invalidation: u64 = conn.get(fr.invalidated_key()).await.unwrap();
    every_variant_is_refilled([&a, &b]).await;
    // One fill per variant after the invalidation, for both instances, each with a token
    // above the invalidation's.
    assert_eq!(origin.calls(), 4);
    for keys in [&fr, &de] {
        let token: u64 = conn.hget(keys.entry(), "t").await.unwrap();
        assert!(token > invalidation);
    }
}

/// The invalidating instance need not have learned the route's `Vary`: C, which never
/// served the route, invalidates the response, and A's and B's variants all go (each
/// hearer knows what it keeps; the sender does not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_from_an_instance_that_never_learned_vary_reaches_every_variant() {
    let server = RedisServer::start();
    let origin = by_language();
    let a = instance(&server, fresh_for_hours(), origin.service()).await;
    let b = instance(&server, fresh_for_hours(), origin.service()).await;
    let c = instance(&server, fresh_for_hours(), origin.service()).await;
    for i in [&a, &b] {
        for lang in ["fr", "de"] {
            send(&i.service, with("/items/1", "accept-language", lang)).await;
        }
        for lang in ["fr", "de"] {
            let got = send(&i.service, with("/items/1", "accept-language", lang)).await;
            assert_eq!(got.x_cache(), "hit");
        }
    }
    assert_eq!(origin.calls(), 2);
    let item = get("/items/1");
    let invalidation = c.layer.invalidate(&item);
    within(HANG, invalidation, "C's invalidation")
        .await
        .unwrap();
    every_variant_is_refilled([&a, &b]).await;
    assert_eq!(origin.calls(), 4);
}

/// Notices from a version before local keys (`f {entry key}`, `i {token} {entry key}`)
/// are still heard: an invalidation whose entry this version cannot name drops all of
/// L1 (the entries come back from L2), and a fill notice is taken without a panic or a
/// lost subscription.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notices_of_the_version_before_local_keys_are_heard() {
    let server = RedisServer::start();
    let origin = web::Origin::versions(Duration::ZERO);
    let a = instance(
        &server,
        policy("items")
            .fresh_ttl(Duration::from_secs(3600))
            .build()
            .unwrap(),
        origin.service(),
    )
    .await;
    for path in ["/items/1", "/items/2"] {
        send(&a.service, get(path)).await;
        assert_eq!(send(&a.service, get(path)).await.x_cache(), "hit");
    }
    let channels: Vec<String> = server.cmd(&["PUBSUB", "CHANNELS"]).await;
    assert_eq!(channels.len(), 1, "{channels:?}");
    let entry = a.layer.cache_keys(&get("/items/1")).unwrap();
    let mut conn = server.conn().await;
    let _: i64 = conn
        .publish(&channels[0], format!("f {}", entry.entry()))
        .await
        .unwrap();
    let _: i64 = conn
        .publish(&channels[0], format!("i 7 {}", entry.entry()))
        .await
        .unwrap();
    // Both entries left L1 (the second was not even named): read from L2 again.
    for path in ["/items/1", "/items/2"] {
        let service = &a.service;
        let layer = &a.layer;
        let from_l2 = eventually(Duration::from_secs(3), || async {
            let l2 = layer.stats().get(Event::L2Hit);
            send(service, get(path)).await;
            layer.stats().get(Event::L2Hit) == l2 + 1
        });
        assert!(from_l2.await, "{path} stayed in L1");
    }
    assert_eq!(origin.calls(), 2);
    // Still subscribed: a notice of this version is heard after them.
    let item = get("/items/2");
    let invalidation = a.layer.invalidate(&item);
    assert!(
        within(HANG, invalidation, "the invalidation")
            .await
            .unwrap()
    );
    assert_eq!(send(&a.service, get("/items/2")).await.body, "v3");
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
    let i = instance(&server, policy("items").build().unwrap(), origin.service()).await;
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
        let mut policy = policy(route).cold_wait(Duration::from_millis(300));
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
