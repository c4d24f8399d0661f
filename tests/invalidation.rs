//! Invalidation and purge: an invalidation removes the entry from every instance (one
//! body, on a single server, on a Redis Cluster and as a user with only what
//! `KeySpace::acl_rules` allows) and reaches every variant, whichever instance sends it;
//! a hard purge of a tag removes exactly the tagged entries for the fleet, a soft purge
//! under load refreshes each key once for the fleet; a successful unsafe request
//! invalidates what it changes. Notices: those of the version before local keys are
//! still heard, and an instance whose subscription was cut does not serve its L1
//! entries as fresh once it is back.
//!
//! The purge and unsafe-method tests run each instance as an axum app served by
//! `axum::serve`, every request on a connection of its own.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing;
use http::{HeaderMap, Response, StatusCode, header};
use redis::AsyncCommands;
use stampede_guard::metrics::Event;
use stampede_guard::{GuardLayer, Policy, StampedeGuard};
use support::app::{by_language, guard_at, instance, patient_policy, policy, with};
use support::http::{fetch, serve};
use support::web::{self, Instance, Origin, full, get, keys, ready_guard, send};
use support::{HANG, Mode, Proxy, Redis, RedisServer, eventually, within};

#[tokio::test]
async fn invalidation_removes_the_entry_from_every_instance() {
    invalidation_reaches_every_instance(Redis::single()).await;
}

#[cfg(feature = "cluster")]
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

/// The route of the invalidation tests: fresh for 3 hours, so that only an
/// invalidation can make an instance fill again.
fn fresh_for_hours() -> Policy {
    patient_policy("items")
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

/// One invalidation by path, on a single server, on a Redis Cluster (the variants'
/// keys are made inside the script, in the slot of the URL's own entry) and as a user
/// with only what `KeySpace::acl_rules` allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_by_path_reaches_every_keyed_value_and_variant_on_every_instance() {
    invalidation_by_path_reaches_every_entry_of_the_url(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_an_invalidation_by_path_reaches_every_keyed_value_and_variant() {
    invalidation_by_path_reaches_every_entry_of_the_url(Redis::cluster()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn as_the_least_privileged_user_an_invalidation_by_path_reaches_every_entry() {
    invalidation_by_path_reaches_every_entry_of_the_url(Redis::least_privileged(&keys()).await)
        .await;
}

/// The URL the invalidation-by-path tests invalidate, and its neighbour: the same path,
/// another keyed query.
const URL: &str = "/items/1?page=2";
const NEIGHBOUR: &str = "/items/1?page=3";

/// The headers of the requests those tests make of each URL: none; two values of the
/// keyed `Accept-Language`; and, with and without one, `Accept-Encoding`, which the
/// URL learns from its answers' `Vary`. Five entries of one URL.
const ASKS: [&[(&str, &str)]; 5] = [
    &[],
    &[("accept-language", "fr")],
    &[("accept-language", "de")],
    &[("accept-language", "fr"), ("accept-encoding", "gzip")],
    &[("accept-encoding", "gzip")],
];

fn ask(path: &str, headers: &[(&str, &str)]) -> web::Req {
    let mut request = get(path);
    for (name, value) in headers {
        request.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    request
}

/// A route keyed on `Accept-Language` whose answers say `Vary: Accept-Encoding`, on two
/// instances of one Redis (the second started once the first has filled): five entries
/// of one URL (no header, `fr`, `de`, `fr` with
/// gzip, gzip alone) and two of its neighbour. Invalidated by path from the second
/// instance, the URL's five entries are counted and gone from L2 and from both
/// instances' L1 (each asks the origin once more, once for the fleet); the neighbour's
/// stay; a path alone is refused on a route that keys on the host.
async fn invalidation_by_path_reaches_every_entry_of_the_url(server: Redis) {
    let origin = Origin::new(Duration::ZERO, |n, request| {
        let header = |name: &str| {
            request
                .headers()
                .get(name)
                .map_or("none", |v| v.to_str().unwrap())
        };
        let mut response = Response::new(full(format!(
            "{} lang={} enc={} call {n}",
            request.uri(),
            header("accept-language"),
            header("accept-encoding")
        )));
        response
            .headers_mut()
            .insert("vary", "Accept-Encoding".parse().unwrap());
        response
    });
    let policy = || {
        patient_policy("items")
            .fresh_ttl(Duration::from_secs(3 * 3600))
            .key_headers(["accept-language"])
            .build()
            .unwrap()
    };
    let a = instance(&server, policy(), origin.service()).await;
    let mut before = Vec::new();
    for (n, headers) in ASKS.iter().enumerate() {
        let got = send(&a.service, ask(URL, headers)).await;
        assert_eq!(got.x_cache(), "miss", "{headers:?}: {}", got.body);
        assert!(
            got.body.ends_with(&format!(" call {}", n + 1)),
            "{}",
            got.body
        );
        before.push(got.body);
    }
    for (n, headers) in ASKS[..2].iter().enumerate() {
        let got = send(&a.service, ask(NEIGHBOUR, headers)).await;
        assert!(
            got.body.ends_with(&format!(" call {}", n + 6)),
            "{}",
            got.body
        );
        before.push(got.body);
    }
    // Each its own entry, on both instances: B, started now (it heard none of A's
    // notices), reads A's from L2, last first, so that its first request of each URL
    // sends the keyed header (it learns what the URL varies on from the record beside
    // the entries, read with the variant).
    let b = instance(&server, policy(), origin.service()).await;
    let urls = std::iter::repeat_n(URL, ASKS.len()).chain([NEIGHBOUR; 2]);
    let all: Vec<(&str, &[(&str, &str)])> =
        urls.zip(ASKS.iter().chain(&ASKS[..2]).copied()).collect();
    for i in [&a, &b] {
        for _ in 0..2 {
            for ((url, headers), body) in all.iter().zip(&before).rev() {
                let got = send(&i.service, ask(url, headers)).await;
                assert_eq!(&got.body, body, "{url} {headers:?}");
            }
        }
        for (url, headers) in &all {
            assert_eq!(send(&i.service, ask(url, headers)).await.x_cache(), "hit");
        }
    }
    assert_eq!(origin.calls(), 7);
    // The URL's four variants are listed beside its entries, by their keyed hashes.
    let fr = a.layer.cache_keys(&ask(URL, ASKS[1])).unwrap();
    assert!(fr.is_variant());
    let listed: Vec<String> = server
        .cmd(redis::cmd("SMEMBERS").arg(fr.variants_key()))
        .await;
    assert_eq!(listed.len(), 4, "{listed:?}");
    assert!(
        listed
            .iter()
            .all(|part| part.starts_with("v_") && !part.contains("fr"))
    );

    // A path alone, on a route that keys on the host: refused, nothing invalidated.
    match a.layer.invalidate_path(URL).await {
        Err(stampede_guard::InvalidateError::HostNeeded { route }) => assert_eq!(route, "items"),
        other => panic!("a path alone on a route keyed on the host: {other:?}"),
    }
    assert!(matches!(
        a.layer.invalidate_path("items/1").await,
        Err(stampede_guard::InvalidateError::NotAPath { .. })
    ));
    assert_eq!(send(&a.service, ask(URL, ASKS[1])).await.body, before[1]);

    let invalidation = b
        .layer
        .invalidate_path("http://shop.example/items/1?page=2");
    let removed = within(HANG, invalidation, "the invalidation by path")
        .await
        .unwrap();
    assert_eq!(removed, 5, "the URL's entries, counted in Redis");
    let exists: i64 = server
        .cmd(redis::cmd("EXISTS").arg(fr.variants_key()))
        .await;
    assert_eq!(exists, 0, "the list of variants goes with them");
    // A, which heard of it: every entry of the URL is asked for again, once each.
    let mut after = Vec::new();
    for (headers, old) in ASKS.iter().zip(&before) {
        let service = &a.service;
        let refilled = eventually(HANG, || async {
            send(service, ask(URL, headers)).await.body != *old
        });
        assert!(refilled.await, "A kept {headers:?}: {old}");
        // (Now a hit on the new entry.)
        after.push(send(service, ask(URL, headers)).await.body);
    }
    assert_eq!(origin.calls(), 12);
    for (n, body) in after.iter().enumerate() {
        assert!(body.ends_with(&format!(" call {}", n + 8)), "{body}");
    }
    // B, which sent it, reads A's new entries; the neighbour is untouched on both.
    for i in [&a, &b] {
        for (headers, body) in ASKS.iter().zip(&after) {
            assert_eq!(&send(&i.service, ask(URL, headers)).await.body, body);
        }
        for (headers, body) in ASKS[..2].iter().zip(&before[5..]) {
            let got = send(&i.service, ask(NEIGHBOUR, headers)).await;
            assert_eq!((got.x_cache(), &got.body), ("hit", body));
        }
    }
    assert_eq!(origin.calls(), 12);
    // A URL nothing was cached for: nothing to count.
    let nothing = b.layer.invalidate_path("http://shop.example/items/9");
    assert_eq!(
        within(HANG, nothing, "an empty invalidation")
            .await
            .unwrap(),
        0
    );
}

/// An origin for `/p/{n}` whose answers are tagged `p{n}` and `group-{n % 2}` (half in
/// `Surrogate-Key`, half in `Cache-Tag`), versioned by call, after `delay`; `/u` is
/// untagged.
fn tagged(calls: Arc<AtomicU64>, delay: Duration, layer: GuardLayer) -> Router {
    let handler = move |uri: http::Uri| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(delay).await;
            let path = uri.path().to_owned();
            let mut headers = HeaderMap::new();
            if let Some(id) = path.strip_prefix("/p/") {
                let id: u64 = id.parse().unwrap();
                let tags = format!("p{id} group-{}", id % 2);
                if id.is_multiple_of(2) {
                    headers.insert("surrogate-key", tags.parse().unwrap());
                } else {
                    headers.insert("cache-tag", tags.replace(' ', ", ").parse().unwrap());
                }
            }
            (headers, format!("{path} v{n}"))
        }
    };
    Router::new()
        .route(
            "/p/{id}",
            routing::get(handler.clone()).layer(layer.clone()),
        )
        .route("/u", routing::get(handler).layer(layer))
}

fn tagged_policy() -> Policy {
    Policy::builder("tagged")
        .fresh_ttl(Duration::from_secs(60))
        .grace(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// A hard purge of a tag, from one instance, removes exactly the entries tagged with
/// it, on both instances: they are filled again (once for the fleet), and the others
/// are still hits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hard_purge_removes_exactly_the_tagged_entries_on_every_instance() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let (a, b) = (ready_guard(&server).await, ready_guard(&server).await);
    let (layer_a, layer_b) = (
        a.layer(tagged_policy()).unwrap(),
        b.layer(tagged_policy()).unwrap(),
    );
    let addr_a = serve(tagged(calls.clone(), Duration::ZERO, layer_a)).await;
    let addr_b = serve(tagged(calls.clone(), Duration::ZERO, layer_b)).await;
    let paths = ["/p/1", "/p/2", "/p/3", "/p/4", "/u"];
    for path in paths {
        assert_eq!(fetch(addr_a, path, &[]).await.x_cache(), "miss");
        assert_eq!(fetch(addr_b, path, &[]).await.x_cache(), "hit");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 5);

    a.purge_tags(["group-0"], stampede_guard::Purge::Hard)
        .await
        .unwrap();
    // The even ones, on b first (once it heard the purge): filled again, once.
    for path in ["/p/2", "/p/4"] {
        assert!(
            eventually(HANG, || async {
                let got = fetch(addr_b, path, &[]).await;
                got.x_cache() == "miss" || !got.body.ends_with(" v2") && !got.body.ends_with(" v4")
            })
            .await,
            "{path} on b after the purge"
        );
        let got = fetch(addr_a, path, &[]).await;
        assert_eq!(got.x_cache(), "hit", "{path} on a: b's new entry");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 7);
    for path in ["/p/1", "/p/3", "/u"] {
        for addr in [addr_a, addr_b] {
            assert_eq!(fetch(addr, path, &[]).await.x_cache(), "hit", "{path}");
        }
    }
    // A purge of one key's tag (in Cache-Tag).
    b.purge_tags(["p3"], stampede_guard::Purge::Hard)
        .await
        .unwrap();
    assert_eq!(fetch(addr_b, "/p/3", &[]).await.x_cache(), "miss");
    assert!(
        eventually(HANG, || async {
            fetch(addr_a, "/p/3", &[]).await.body == "/p/3 v8"
        })
        .await
    );
    assert_eq!(calls.load(Ordering::SeqCst), 8);
}

/// A hard purge that lands while a fill calls the origin reaches that fill's entry,
/// whether the fill holds the lease or not (another instance holds it, and the fill
/// went ahead without it after its cold wait): each is stamped when its call began,
/// so the next request fills again. (Without the lease, the entry was stamped when
/// the origin answered, after the purge, and served as a hit with the purged body.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_during_a_fill_reaches_its_entry_with_or_without_the_lease() {
    use stampede_guard::lease::{AcquireOutcome, LeaseClient};
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let guard = ready_guard(&server).await;
    let policy = Policy::builder("tagged")
        .fresh_ttl(Duration::from_secs(60))
        .grace(Duration::from_secs(60))
        .lease_ttl(Duration::from_secs(10))
        .refresh_timeout(Duration::from_secs(10))
        .cold_wait(Duration::from_millis(300))
        .build()
        .unwrap();
    let layer = guard.layer(policy).unwrap();
    let addr = serve(tagged(calls.clone(), Duration::from_secs(2), layer.clone())).await;
    let store = stampede_guard::RedisStore::builder(server.url())
        .build()
        .unwrap();
    let leases = LeaseClient::builder(store, &keys()).build().unwrap();
    for (path, leased) in [("/p/2", true), ("/p/4", false)] {
        let request = http::Request::get(path)
            .header("host", "shop.example")
            .body(())
            .unwrap();
        let lease = layer.cache_keys(&request).unwrap().lease().to_owned();
        // Another instance holds the key's lease, and keeps it.
        let _held = if leased {
            None
        } else {
            let outcome = leases.try_acquire(&lease, Duration::from_secs(30)).await;
            let AcquireOutcome::Acquired(held) = outcome else {
                panic!("the lease is free");
            };
            Some(held)
        };
        let before = calls.load(Ordering::SeqCst);
        let fill = tokio::spawn(async move { fetch(addr, path, &[]).await });
        let called = eventually(HANG, || async { calls.load(Ordering::SeqCst) > before });
        assert!(called.await, "{path}: the origin was not called");
        // Mid-call: the origin answers 2 s after it was called.
        tokio::time::sleep(Duration::from_millis(500)).await;
        guard
            .purge_tags(["group-0"], stampede_guard::Purge::Hard)
            .await
            .unwrap();
        let filled = fill.await.unwrap();
        assert_eq!(filled.x_cache(), "miss", "{path}");
        let again = fetch(addr, path, &[]).await;
        assert_eq!(
            again.x_cache(),
            "miss",
            "{path} (leased: {leased}): the purged entry"
        );
        assert_ne!(again.body, filled.body, "{path} (leased: {leased})");
        assert_eq!(calls.load(Ordering::SeqCst), before + 2, "{path}");
    }
}

/// A soft purge under load: every caller is answered at once from the purged entries
/// (stale), and the origin is called once per purged key for the whole fleet, not once
/// per caller; an entry without the tag is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_soft_purge_under_load_refreshes_each_key_once_for_the_fleet() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let (a, b) = (ready_guard(&server).await, ready_guard(&server).await);
    let (layer_a, layer_b) = (
        a.layer(tagged_policy()).unwrap(),
        b.layer(tagged_policy()).unwrap(),
    );
    let delay = Duration::from_millis(200);
    let addr_a = serve(tagged(calls.clone(), delay, layer_a.clone())).await;
    let addr_b = serve(tagged(calls.clone(), delay, layer_b.clone())).await;
    let keys = ["/p/1", "/p/2", "/p/3", "/p/4"];
    for path in keys.iter().chain(&["/u"]) {
        assert_eq!(fetch(addr_a, path, &[]).await.x_cache(), "miss");
        assert_eq!(fetch(addr_b, path, &[]).await.x_cache(), "hit");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 5);

    // Both group tags: every /p/ key.
    a.purge_tags(["group-0", "group-1"], stampede_guard::Purge::Soft)
        .await
        .unwrap();
    let mut burst = Vec::new();
    for round in 0..10 {
        for (i, &path) in keys.iter().enumerate() {
            let addr = if (round + i) % 2 == 0 { addr_a } else { addr_b };
            burst.push(tokio::spawn(
                async move { (path, fetch(addr, path, &[]).await) },
            ));
        }
    }
    for answer in burst {
        let (path, got) = answer.await.unwrap();
        assert_eq!(got.status, StatusCode::OK);
        // At once, from the entry: stale (or a hit on b before it heard the purge, or
        // the refreshed entry once it landed).
        assert!(
            ["stale", "hit"].contains(&got.x_cache()),
            "{path}: {}",
            got.x_cache()
        );
    }
    for path in keys {
        assert!(
            eventually(HANG, || async {
                let (a, b) = (
                    fetch(addr_a, path, &[]).await,
                    fetch(addr_b, path, &[]).await,
                );
                a.x_cache() == "hit"
                    && b.x_cache() == "hit"
                    && a.body == b.body
                    && !a.body.ends_with(&format!(" v{}", &path[3..]))
            })
            .await,
            "{path} refreshed on both"
        );
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        5 + keys.len() as u64,
        "one call per key"
    );
    assert_eq!(fetch(addr_a, "/u", &[]).await.body, "/u v5");
    let soft = layer_a.stats().get(Event::PurgedSoft) + layer_b.stats().get(Event::PurgedSoft);
    assert!(soft >= keys.len() as u64, "{soft} soft-purged reads");
}

/// A successful unsafe request invalidates, for the fleet, the entries of its URI and
/// of the same-origin URI its answer names in `Location`, on a route that follows the
/// origin (RFC 9111 §4.4); a failed one does not; a route that does not follow the
/// origin leaves them by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_requests_invalidate_what_they_change() {
    let server = RedisServer::start();
    let (a, b) = (ready_guard(&server).await, ready_guard(&server).await);
    let calls = Arc::new(AtomicU64::new(0));
    let app = |guard: &StampedeGuard, follow: bool| {
        let layer = guard
            .layer(
                Policy::builder("changing")
                    .follow_origin(follow)
                    .fresh_ttl(Duration::from_secs(60))
                    .build()
                    .unwrap(),
            )
            .unwrap();
        let calls = calls.clone();
        let read = move |uri: http::Uri| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                (
                    [(header::CACHE_CONTROL, "max-age=60")],
                    format!("{} v{n}", uri.path()),
                )
            }
        };
        let write = |uri: http::Uri| async move {
            match uri.path() {
                "/list" => (StatusCode::CREATED, [(header::LOCATION, "/item")]).into_response(),
                "/fails" => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
                _ => StatusCode::NO_CONTENT.into_response(),
            }
        };
        Router::new()
            .route(
                "/item",
                routing::get(read.clone()).post(write).layer(layer.clone()),
            )
            .route(
                "/list",
                routing::get(read.clone()).post(write).layer(layer.clone()),
            )
            .route("/fails", routing::get(read).post(write).layer(layer))
    };
    use axum::response::IntoResponse;
    let follows = serve(app(&a, true)).await;
    let other = serve(app(&b, true)).await;
    for path in ["/item", "/list", "/fails"] {
        assert_eq!(fetch(follows, path, &[]).await.x_cache(), "miss");
        assert_eq!(fetch(other, path, &[]).await.x_cache(), "hit");
    }
    let post = |addr, path| support::http::fetch_method(addr, "POST", path);

    assert_eq!(
        post(follows, "/fails").await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(fetch(follows, "/fails", &[]).await.x_cache(), "hit");

    assert_eq!(post(follows, "/item").await.status, StatusCode::NO_CONTENT);
    assert_eq!(fetch(follows, "/item", &[]).await.x_cache(), "miss");
    // The other instance heard it.
    assert!(
        eventually(HANG, || async {
            fetch(other, "/item", &[]).await.body == "/item v4"
        })
        .await
    );

    // `/list`'s answer names `/item` in `Location`: both go.
    assert_eq!(post(other, "/list").await.status, StatusCode::CREATED);
    assert_eq!(fetch(other, "/list", &[]).await.x_cache(), "miss");
    assert_eq!(fetch(other, "/item", &[]).await.x_cache(), "miss");
    assert_eq!(calls.load(Ordering::SeqCst), 6);

    // A route that keeps its own policy keeps its entries.
    let own_guard = ready_guard(&server).await;
    let own = serve(app(&own_guard, false)).await;
    assert_eq!(fetch(own, "/item", &[]).await.x_cache(), "hit");
    assert_eq!(post(own, "/item").await.status, StatusCode::NO_CONTENT);
    assert_eq!(fetch(own, "/item", &[]).await.x_cache(), "hit");
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
        patient_policy("items")
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
        patient_policy("items")
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

/// A healthy Redis whose pongs come late does not cost the notice subscription: with
/// the command and connect timeouts at 100 ms (as a request path wants them), Redis
/// busy for 1.2 s (`DEBUG SLEEP`: more than the ping interval, so that a ping waits it
/// out) and then both cores loaded by four spinning threads for at least three pings,
/// the subscription is never given up, and each invalidation made meanwhile reaches the
/// other instance. (Its ping
/// had the connect timeout as its deadline: the sleep dropped the subscription, and the
/// instance treated its L1 as after any lost subscription.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_pong_or_a_busy_cpu_does_not_drop_the_notice_subscription() {
    use std::sync::atomic::AtomicBool;
    let server = RedisServer::start_debuggable();
    let origin = Origin::versions(Duration::ZERO);
    let tight = || {
        let store = stampede_guard::RedisStore::builder(server.url())
            .command_timeout(Duration::from_millis(100))
            .connect_timeout(Duration::from_millis(100))
            .build()
            .unwrap();
        StampedeGuard::builder(store, keys()).build().unwrap()
    };
    let policy = || fresh_for_hours();
    let a = web::instance(tight(), policy(), origin.service()).await;
    let b = Arc::new(web::instance(tight(), policy(), origin.service()).await);
    // Every 10 ms from now on: was B's subscription up?
    let dropped = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let watch = tokio::spawn({
        let (b, dropped, done) = (b.clone(), dropped.clone(), done.clone());
        async move {
            while !done.load(Ordering::Relaxed) {
                if !b.guard.notices_connected() {
                    dropped.fetch_add(1, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    within(
        HANG,
        server.sleep_for(Duration::from_millis(1200)),
        "DEBUG SLEEP",
    )
    .await;
    // Both cores loaded while invalidations go on, for three seconds at least.
    let hogs: Vec<_> = (0..4)
        .map(|_| {
            let done = done.clone();
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !done.load(Ordering::Relaxed) {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            })
        })
        .collect();
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    let mut n = 0;
    while n < 5 || tokio::time::Instant::now() < until {
        n += 1;
        let path = format!("/items/{n}");
        // Redis may still be answering the request path late: what B holds is filled
        // once the breakers are closed.
        let shared = eventually(HANG, || async {
            a.guard.mode() == stampede_guard::Mode::Shared
                && b.guard.mode() == stampede_guard::Mode::Shared
        });
        assert!(shared.await);
        let before = send(&b.service, get(&path)).await.body;
        assert_eq!(send(&b.service, get(&path)).await.x_cache(), "hit");
        let removed = within(HANG, a.layer.invalidate(&get(&path)), "the invalidation").await;
        assert!(removed.unwrap(), "{path}");
        let heard = eventually(HANG, || async {
            send(&b.service, get(&path)).await.body != before
        });
        assert!(heard.await, "{path}: B kept the invalidated entry");
    }
    done.store(true, Ordering::Relaxed);
    for hog in hogs {
        hog.join().unwrap();
    }
    support::joined(watch, HANG, "the watch").await;
    assert_eq!(
        dropped.load(Ordering::Relaxed),
        0,
        "samples of B without its notice subscription"
    );
}

/// Read-your-writes: a caller that comes after an invalidation returned (by
/// `invalidate`, or by a `PUT` that the guard passed through) never joins a fill that
/// began before it, whose answer is what was invalidated: it fills again, and reads
/// what was written. The caller that began the old fill (before the write) still gets
/// its answer. Through axum over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_after_an_invalidation_never_gets_the_fill_before_it() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(
            Policy::builder("items")
                .fresh_ttl(Duration::from_secs(60))
                .lease_ttl(Duration::from_secs(20))
                .refresh_timeout(Duration::from_secs(20))
                .cold_wait(Duration::from_secs(20))
                .invalidate_on_unsafe(true)
                .build()
                .unwrap(),
        )
        .unwrap();
    let gate = support::app::Gate::default();
    let (calls, version) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(1)));
    let read = {
        let (gate, calls, version) = (gate.clone(), calls.clone(), version.clone());
        move || {
            let (gate, calls, version) = (gate.clone(), calls.clone(), version.clone());
            async move {
                // What the origin reads, before it is held.
                let seen = version.load(Ordering::SeqCst);
                if calls.fetch_add(1, Ordering::SeqCst) % 2 == 0 {
                    let opened = gate.open.notified();
                    gate.entered.notify_one();
                    opened.await;
                }
                format!("v{seen}")
            }
        }
    };
    let write = {
        let version = version.clone();
        move || {
            let version = version.clone();
            async move {
                version.fetch_add(1, Ordering::SeqCst);
                "written"
            }
        }
    };
    let app = Router::new().route(
        "/items/doc",
        routing::get(read).put(write).layer(layer.clone()),
    );
    let addr = serve(app).await;
    for by_put in [false, true] {
        let path = if by_put {
            "/items/doc?round=2"
        } else {
            "/items/doc"
        };
        let before = version.load(Ordering::SeqCst);
        let entered = gate.entered.notified();
        let first = tokio::spawn(async move { fetch(addr, path, &[]).await });
        within(HANG, entered, "the first fill reaching the origin").await;
        // The write, and its invalidation, return.
        if by_put {
            let put = support::http::fetch_method(addr, "PUT", path).await;
            assert_eq!(put.status, StatusCode::OK);
        } else {
            version.fetch_add(1, Ordering::SeqCst);
            let request = http::Request::get(path)
                .header("host", "shop.example")
                .body(())
                .unwrap();
            layer.invalidate(&request).await.unwrap();
        }
        let calls_before = calls.load(Ordering::SeqCst);
        let joined_before = layer.stats().get(Event::Joined);
        let waits_before = layer.stats().get(Event::ColdWaitStarted);
        let second = tokio::spawn(async move { fetch(addr, path, &[]).await });
        // It fills on its own: it waits for the lease the old fill holds (or, wrongly,
        // joins the old fill).
        let moved = eventually(HANG, || async {
            let stats = layer.stats();
            calls.load(Ordering::SeqCst) > calls_before
                || stats.get(Event::Joined) > joined_before
                || stats.get(Event::ColdWaitStarted) > waits_before
        });
        assert!(moved.await);
        gate.open.notify_one();
        let (first, second) = (
            support::joined(first, HANG, "the first caller").await,
            support::joined(second, HANG, "the second caller").await,
        );
        assert_eq!(
            first.body,
            format!("v{before}"),
            "by PUT: {by_put}: {:?} {:?}",
            first.status,
            first.headers
        );
        assert_eq!(
            second.body,
            format!("v{}", before + 1),
            "by PUT: {by_put}: read its write: {:?} {:?}",
            second.headers,
            layer.stats()
        );
        assert_eq!(layer.stats().get(Event::Joined), joined_before);
    }
}

/// `Cache-Status` says `stored` only of what a cache kept: a fill without Redis whose
/// entry L1 refused (an invalidation came while it filled) says nothing was stored, and
/// the next caller fills again. Through axum over TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_that_l1_refused_does_not_say_stored() {
    let guard = StampedeGuard::builder(stampede_guard::RedisStore::local_only(), keys())
        .build()
        .unwrap();
    let layer = guard
        .layer(
            Policy::builder("items")
                .fresh_ttl(Duration::from_secs(60))
                .build()
                .unwrap(),
        )
        .unwrap();
    let gate = support::app::Gate::default();
    let calls = Arc::new(AtomicU64::new(0));
    let read = {
        let (gate, calls) = (gate.clone(), calls.clone());
        move || {
            let (gate, calls) = (gate.clone(), calls.clone());
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                if n == 1 {
                    let opened = gate.open.notified();
                    gate.entered.notify_one();
                    opened.await;
                }
                format!("v{n}")
            }
        }
    };
    let app = Router::new().route("/items/doc", routing::get(read).layer(layer.clone()));
    let addr = serve(app).await;
    let entered = gate.entered.notified();
    let first = tokio::spawn(async move { fetch(addr, "/items/doc", &[]).await });
    within(HANG, entered, "the fill reaching the origin").await;
    let request = http::Request::get("/items/doc")
        .header("host", "shop.example")
        .body(())
        .unwrap();
    layer.invalidate(&request).await.unwrap();
    gate.open.notify_one();
    let first = support::joined(first, HANG, "the caller").await;
    assert_eq!((first.body.as_str(), first.x_cache()), ("v1", "miss"));
    let status = first.headers["cache-status"].to_str().unwrap();
    assert!(!status.contains("stored"), "{status}");
    let next = fetch(addr, "/items/doc", &[]).await;
    assert_eq!((next.body.as_str(), next.x_cache()), ("v2", "miss"));
}
