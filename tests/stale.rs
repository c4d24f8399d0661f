//! Stale serving: an entry past its freshness is served at once while one refresh for
//! the whole fleet runs (one body, on a single server, on a Redis Cluster and as a user
//! with only what `KeySpace::acl_rules` allows); the origin is called once per freshness
//! window; grace, stale-if-error and the soft timeout bound how long an expired entry
//! stands in; a refresh never adopts an expired entry; fresh jitter spreads the expiries
//! of keys filled together; eager refresh and XFetch refresh a busy key before it
//! expires (two instances served by `axum::serve` under steady load).

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing;
use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};
use redis::AsyncCommands;
use stampede_guard::metrics::Event;
use stampede_guard::{GuardLayer, Policy};
use support::app::{instance, patient_policy, policy};
use support::http::{fetch, serve};
use support::web::{Origin, all_within, full, get, keys, ready_guard, send, total};
use support::{HANG, Redis, RedisServer, eventually};
use tokio::sync::Barrier;

/// 3 instances, an entry gone stale, 300 concurrent requests: one origin call for the
/// fleet, everyone served the stale body, and no request waited for the origin (the
/// refresh is held at a gate until every response is in: a request that waited for it
/// would never finish).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_entry_is_refreshed_once_for_the_fleet_and_nobody_waits() {
    stale_entry_refreshed_once(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_a_stale_entry_is_refreshed_once_for_the_fleet_and_nobody_waits() {
    stale_entry_refreshed_once(Redis::cluster()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn as_the_least_privileged_user_a_stale_entry_is_refreshed_once_for_the_fleet_and_nobody_waits()
 {
    stale_entry_refreshed_once(Redis::least_privileged(&keys()).await).await;
}

async fn stale_entry_refreshed_once(server: Redis) {
    let origin = Origin::versions(Duration::from_millis(200));
    let mut fleet = Vec::new();
    for _ in 0..3 {
        fleet.push(instance(&server, policy("items").build().unwrap(), origin.service()).await);
    }
    // Warm every instance: one cold fill, the others read L2.
    for i in &fleet {
        assert_eq!(send(&i.service, get("/items/1")).await.body, "v1");
    }
    assert_eq!(origin.calls(), 1);
    tokio::time::sleep(Duration::from_millis(600)).await; // past fresh_ttl

    origin.hold(2);
    let barrier = Arc::new(Barrier::new(300));
    let mut tasks = Vec::new();
    for n in 0..300 {
        let service = fleet[n % 3].service.clone();
        let (barrier, seq) = (barrier.clone(), origin.seq.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let got = send(&service, get("/items/1")).await;
            (got, seq.next())
        }));
    }
    let responses = all_within(
        tasks,
        Duration::from_secs(10),
        "requests waited for the held origin",
    )
    .await;
    let opened = std::time::Instant::now();
    origin.open();

    assert_eq!(responses.len(), 300);
    for (got, _) in &responses {
        assert_eq!(got.status, StatusCode::OK);
        assert_eq!(got.body, "v1");
        assert_eq!(got.x_cache(), "stale");
    }
    // Once the refresh is written, exactly one origin call was made for it.
    let layers: Vec<&GuardLayer> = fleet.iter().map(|i| &i.layer).collect();
    assert!(
        eventually(Duration::from_secs(5), || async {
            total(&layers, Event::RefreshWritten) == 1
        })
        .await
    );
    assert_eq!(origin.calls(), 2);
    let returned = origin.returned.lock().unwrap().clone();
    let refresh_returned = *returned.last().unwrap();
    assert!(
        responses.iter().all(|(_, seq)| *seq < refresh_returned),
        "a response came after the origin returned"
    );
    assert_eq!(total(&layers, Event::Stale), 300);
    // Every stale answer but the three that started their instance's refresh task was
    // served while one refresh ran: an origin call avoided, and counted as one. (The
    // other instances hold off while the lease is held, and the gate holds the refresh
    // until every answer is in.)
    assert_eq!(total(&layers, Event::AvoidedStale), 300 - 3);
    // One refresh task per key per process: the other two instances' found the lease
    // busy (or, later, adopted the new entry); nobody else tried.
    assert_eq!(
        total(&layers, Event::RefreshBusy) + total(&layers, Event::RefreshAdopted),
        2,
        "refreshes that did not write"
    );
    // Every instance ends up serving the new entry, without another origin call.
    for i in &fleet {
        let (service, served) = (&i.service, Arc::new(std::sync::Mutex::new(String::new())));
        assert!(
            eventually(Duration::from_secs(3), || {
                let served = served.clone();
                async move {
                    let got = send(service, get("/items/1")).await;
                    *served.lock().unwrap() = got.body.clone();
                    got.body == "v2"
                }
            })
            .await,
            "instance still serves {}",
            served.lock().unwrap()
        );
    }
    // No call but the refresh while v2 was fresh (500 ms from its write, which came after
    // the gate opened; less 50 ms, as an entry read from Redis is aged by its PTTL).
    // Reading the instances may outlast that on a slow machine: v2's own refresh is then
    // due, one per window since.
    let v2_stale = opened + Duration::from_millis(450);
    assert_eq!(
        origin.calls_started_before(v2_stale),
        2,
        "calls while v2 was fresh"
    );
    let windows_since = (opened.elapsed().as_millis() / 500) as u64;
    assert!(
        origin.calls() - 2 <= windows_since,
        "{} origin calls, {windows_since} windows after v2",
        origin.calls()
    );
    assert_eq!(
        total(&layers, Event::LocalOnly),
        0,
        "fills and refreshes without the lease"
    );
}

/// Over many freshness windows, with bursts on every instance, the origin is called once
/// per window (plus the first fill).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn origin_calls_equal_the_number_of_windows() {
    const WINDOWS: u64 = 8;
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::from_millis(20));
    let mut fleet = Vec::new();
    for _ in 0..3 {
        let policy = policy("items")
            .fresh_ttl(Duration::from_millis(300))
            .build()
            .unwrap();
        fleet.push(instance(&server, policy, origin.service()).await);
    }
    let layers: Vec<&GuardLayer> = fleet.iter().map(|i| &i.layer).collect();
    assert_eq!(send(&fleet[0].service, get("/items/1")).await.body, "v1");
    for window in 1..=WINDOWS {
        tokio::time::sleep(Duration::from_millis(350)).await;
        let mut tasks = Vec::new();
        for n in 0..60 {
            let service = fleet[n % 3].service.clone();
            tasks.push(tokio::spawn(async move {
                send(&service, get("/items/1")).await
            }));
        }
        for got in all_within(tasks, HANG, "a window's burst").await {
            assert_eq!(got.status, StatusCode::OK);
        }
        assert!(
            eventually(Duration::from_secs(3), || async {
                total(&layers, Event::RefreshWritten) == window
            })
            .await,
            "window {window}: {} refreshes written",
            total(&layers, Event::RefreshWritten)
        );
        // Bring every instance's L1 up to date before the next window.
        for i in &fleet {
            let want = format!("v{}", window + 1);
            let service = &i.service;
            assert!(
                eventually(Duration::from_secs(3), || {
                    let want = want.clone();
                    async move { send(service, get("/items/1")).await.body == want }
                })
                .await
            );
        }
        assert_eq!(origin.calls(), window + 1, "window {window}");
    }
    assert_eq!(origin.calls(), WINDOWS + 1);
}

/// The origin fails from its second call on: the stale entry is served through the
/// grace window (its refresh failing), then, past grace, instead of the failure until the
/// stale-if-error window ends; after that the failure shows.
#[tokio::test]
async fn an_origin_error_keeps_serving_stale_until_stale_if_error_ends() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, _| {
        if n == 1 {
            Response::new(full("v1"))
        } else {
            let mut response = Response::new(full("boom"));
            *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            response
        }
    });
    let policy = policy("items")
        .fresh_ttl(Duration::from_millis(300))
        .grace(Duration::from_millis(700))
        .stale_if_error(Duration::from_millis(2000))
        .cold_wait(Duration::from_millis(200))
        .build()
        .unwrap();
    let i = instance(&server, policy, origin.service()).await;
    let start = tokio::time::Instant::now();
    assert_eq!(send(&i.service, get("/items/1")).await.body, "v1");

    // In grace (age 300-1000 ms): stale, and the refresh fails.
    tokio::time::sleep_until(start + Duration::from_millis(500)).await;
    let got = send(&i.service, get("/items/1")).await;
    assert_eq!((got.body.as_str(), got.x_cache()), ("v1", "stale"));
    assert!(
        eventually(Duration::from_secs(2), || async {
            i.layer.stats().get(Event::RefreshOriginError) == 1
        })
        .await
    );

    // Past grace, within stale-if-error (age 1000-2300 ms): stale instead of the 500.
    tokio::time::sleep_until(start + Duration::from_millis(1500)).await;
    let got = send(&i.service, get("/items/1")).await;
    assert_eq!(
        (got.status, got.body.as_str(), got.x_cache()),
        (StatusCode::OK, "v1", "stale")
    );
    assert_eq!(i.layer.stats().get(Event::StaleIfError), 1);

    // Past stale-if-error: the entry is gone and the failure shows (not stored).
    tokio::time::sleep_until(start + Duration::from_millis(2800)).await;
    let got = send(&i.service, get("/items/1")).await;
    assert_eq!(got.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(got.x_cache(), "pass");
}

/// Past grace, with an entry that may still stand in (stale-if-error), a caller waits at
/// most the soft timeout for the fill, then gets the entry; the fill goes on and lands.
#[tokio::test]
async fn the_soft_timeout_serves_the_expired_entry_while_the_fill_goes_on() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, _| Response::new(full(format!("v{n}"))));
    let policy = policy("items")
        .fresh_ttl(Duration::from_millis(200))
        .grace(Duration::from_millis(200))
        .stale_if_error(Duration::from_secs(10))
        .soft_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let i = instance(&server, policy, origin.service()).await;
    assert_eq!(send(&i.service, get("/items/1")).await.body, "v1");
    tokio::time::sleep(Duration::from_millis(500)).await; // past fresh + grace
    origin.hold(2);
    let started = tokio::time::Instant::now();
    let got = send(&i.service, get("/items/1")).await;
    let waited = started.elapsed();
    assert_eq!((got.body.as_str(), got.x_cache()), ("v1", "stale"));
    assert!(
        waited >= Duration::from_millis(100) && waited < Duration::from_millis(500),
        "{waited:?}"
    );
    assert_eq!(i.layer.stats().get(Event::SoftTimeout), 1);
    let opened = std::time::Instant::now();
    origin.open();
    let service = &i.service;
    assert!(
        eventually(Duration::from_secs(2), || async {
            send(service, get("/items/1")).await.body == "v2"
        })
        .await,
        "{:?}, {} origin calls",
        i.layer.stats(),
        origin.calls()
    );
    // The fill was not repeated: no call but the fill while v2 was fresh (200 ms from its
    // write, which came after the gate opened; less 50 ms, as an entry read from Redis is
    // aged by its PTTL). A slow machine may read v2 past that: v2's own refresh is then
    // due, one per window since.
    let v2_stale = opened + Duration::from_millis(150);
    assert_eq!(
        origin.calls_started_before(v2_stale),
        2,
        "calls while v2 was fresh"
    );
    let windows_since = (opened.elapsed().as_millis() / 200) as u64;
    assert!(
        origin.calls() - 2 <= windows_since,
        "{} origin calls, {windows_since} windows after v2",
        origin.calls()
    );
}

/// A refresh finds, in L2, an entry with a higher token than its own that is past its
/// grace: it does not take it (it could stand in for nothing), and refreshes.
#[tokio::test]
async fn a_refresh_never_adopts_an_expired_entry() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let i = instance(
        &server,
        patient_policy("items").build().unwrap(),
        origin.service(),
    )
    .await;
    assert_eq!(send(&i.service, get("/items/1")).await.body, "v1");
    let keys = i.layer.cache_keys(&get("/items/1")).unwrap();
    let mut conn = server.conn().await;
    let token: u64 = conn.hget(keys.entry(), "t").await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await; // stale in L1
    let planted = stampede_guard::fuzzing::CachedResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from_static(b"expired"),
        fresh_for: Duration::from_millis(100),
        grace: Duration::from_millis(100),
        keep: Duration::from_secs(60),
        token: stampede_guard::lease::FencingToken::new(token + 1),
    };
    let _: () = redis::pipe()
        .del(keys.entry())
        .hset(keys.entry(), "t", token + 1)
        .hset(keys.entry(), "d", planted.encode())
        .pexpire(keys.entry(), 59_000) // written a second ago: past its grace
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(send(&i.service, get("/items/1")).await.body, "v1"); // stale; refreshes
    assert!(
        eventually(Duration::from_secs(3), || async {
            i.layer.stats().get(Event::RefreshWritten) == 1
        })
        .await,
        "{:?}",
        i.layer.stats()
    );
    assert_eq!(i.layer.stats().get(Event::RefreshAdopted), 0);
    assert_eq!(send(&i.service, get("/items/1")).await.body, "v2");
}

/// `fresh_jitter`: keys filled together are fresh for different times, all within the
/// fresh TTL minus the jitter and the fresh TTL.
#[tokio::test]
async fn fresh_jitter_spreads_the_freshness_of_keys_filled_together() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let policy = patient_policy("items")
        .fresh_ttl(Duration::from_secs(10))
        .fresh_jitter(Duration::from_secs(5))
        .build()
        .unwrap();
    let i = instance(&server, policy, origin.service()).await;
    let mut conn = server.conn().await;
    let mut fresh = std::collections::BTreeSet::new();
    for n in 0..40 {
        let path = format!("/items/{n}");
        assert_eq!(send(&i.service, get(&path)).await.x_cache(), "miss");
        let keys = i.layer.cache_keys(&get(&path)).unwrap();
        let data: Vec<u8> = conn.hget(keys.entry(), "d").await.unwrap();
        let entry = stampede_guard::fuzzing::decode(&data).unwrap();
        assert!(
            entry.fresh_for >= Duration::from_secs(5) && entry.fresh_for <= Duration::from_secs(10),
            "{:?}",
            entry.fresh_for
        );
        fresh.insert(entry.fresh_for);
    }
    assert!(
        fresh.len() > 20,
        "{} distinct fresh times in 40",
        fresh.len()
    );
}

/// An origin that answers `v{n}` after `delay`, counting its calls.
fn versions(calls: Arc<AtomicU64>, delay: Duration, layer: GuardLayer) -> Router {
    let handler = move || {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(delay).await;
            format!("v{n}")
        }
    };
    Router::new().route("/hot", routing::get(handler).layer(layer))
}

/// Steady load on `/hot` of every instance, from four clients, for `lasting`: how many
/// answers had each `x-cache`.
async fn steady_load(
    instances: &[SocketAddr],
    lasting: Duration,
) -> std::collections::BTreeMap<String, u64> {
    let seen = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
    let until = tokio::time::Instant::now() + lasting;
    let mut clients = Vec::new();
    for client in 0..4 {
        let addr = instances[client % instances.len()];
        let seen = seen.clone();
        clients.push(tokio::spawn(async move {
            while tokio::time::Instant::now() < until {
                let got = fetch(addr, "/hot", &[]).await;
                assert_eq!(got.status, StatusCode::OK);
                *seen
                    .lock()
                    .unwrap()
                    .entry(got.x_cache().to_owned())
                    .or_insert(0) += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }));
    }
    for client in clients {
        client.await.unwrap();
    }
    Arc::try_unwrap(seen).unwrap().into_inner().unwrap()
}

/// Two instances of one fleet on `server`, each serving `/hot` from the `versions`
/// origin (counting in `calls`, taking `delay`) behind a layer of `policy`; `/hot`
/// filled once. Their layers and addresses.
async fn hot_fleet(
    server: &RedisServer,
    policy: Policy,
    calls: &Arc<AtomicU64>,
    delay: Duration,
) -> ([GuardLayer; 2], [SocketAddr; 2]) {
    let (a, b) = (ready_guard(server).await, ready_guard(server).await);
    let layers = [a.layer(policy.clone()).unwrap(), b.layer(policy).unwrap()];
    let addr_a = serve(versions(calls.clone(), delay, layers[0].clone())).await;
    let addr_b = serve(versions(calls.clone(), delay, layers[1].clone())).await;
    assert_eq!(fetch(addr_a, "/hot", &[]).await.x_cache(), "miss");
    (layers, [addr_a, addr_b])
}

/// How many times `event` happened on both layers.
fn both(layers: &[GuardLayer; 2], event: Event) -> u64 {
    layers.iter().map(|layer| layer.stats().get(event)).sum()
}

/// Eager refresh under steady load, on two instances of one fleet: the hot key is
/// refreshed from half its fresh time on, so no caller is ever served it stale, and the
/// origin is called about once per half-window for the whole fleet (not once per
/// instance).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_refresh_keeps_a_hot_key_fresh_with_one_call_per_window() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let fresh = Duration::from_secs(3);
    let policy = Policy::builder("hot")
        .fresh_ttl(fresh)
        .grace(Duration::from_secs(60))
        .eager_refresh(0.5)
        .build()
        .unwrap();
    let (layers, addrs) = hot_fleet(&server, policy, &calls, Duration::from_millis(50)).await;

    let run = Duration::from_secs(9);
    let seen = steady_load(&addrs, run).await;
    let calls = calls.load(Ordering::SeqCst);
    let early = both(&layers, Event::EarlyRefresh);
    eprintln!("answers {seen:?}; origin calls {calls}; early refreshes started {early}");
    assert_eq!(seen.get("stale"), None, "stale answers");
    assert_eq!(seen.get("miss"), None, "misses under load");
    // One fill, then one refresh per half-window (1.5 s) of the 9 s at most; and at
    // least a few: it did refresh early.
    let windows = (run.as_secs_f64() / (fresh.as_secs_f64() * 0.5)).ceil() as u64;
    assert!(
        calls <= 1 + windows,
        "{calls} origin calls for {windows} windows"
    );
    assert!(calls >= 4, "{calls} origin calls: no early refreshes?");
    assert_eq!(both(&layers, Event::Stale), 0);
}

/// XFetch refreshes a busy key before it expires: early refreshes happen, and the fleet
/// still calls the origin at most about once per fresh window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xfetch_refreshes_a_busy_key_before_it_expires() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let fresh = Duration::from_secs(2);
    let policy = Policy::builder("hot")
        .fresh_ttl(fresh)
        .grace(Duration::from_secs(60))
        .xfetch(1.0)
        .build()
        .unwrap();
    // A slow origin: XFetch refreshes the earlier, the longer a refresh takes.
    let (layers, addrs) = hot_fleet(&server, policy, &calls, Duration::from_millis(100)).await;

    let run = Duration::from_secs(7);
    let seen = steady_load(&addrs, run).await;
    let calls = calls.load(Ordering::SeqCst);
    let early = both(&layers, Event::EarlyRefresh);
    eprintln!("answers {seen:?}; origin calls {calls}; early refreshes started {early}");
    assert!(early >= 1, "no early refresh");
    let windows = (run.as_secs_f64() / fresh.as_secs_f64()).ceil() as u64;
    // Each refresh is early, so a window may hold slightly more than one; never one
    // per instance per hit.
    assert!(
        calls <= 1 + 2 * windows,
        "{calls} origin calls for {windows} windows"
    );
    assert_eq!(seen.get("miss"), None, "misses under load");
}
