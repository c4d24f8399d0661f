//! Breaking Redis on purpose: outages under load, network faults, error replies, lost
//! leases, and fencing across restarts. The layer must stay boring: no 5xx, no hang, no
//! retry storm, and no older value ever replacing a newer one.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Response, StatusCode};
use redis::AsyncCommands;
use stampede_guard::keys::Scope;
use stampede_guard::lease::{AcquireOutcome, LeaseClient};
use stampede_guard::metrics::Event;
use stampede_guard::store::{BreakerConfig, StoreErrorKind};
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::web::{Instance, Origin, full, get, instance, keys, send};
use support::{HANG, Mode, Proxy, RedisServer, eventually, within};

/// The command timeout of these tests: short, so that an outage is seen at once (and the
/// bounds they assert are tight).
const FAULT_TIMEOUT: Duration = Duration::from_millis(100);
const MARGIN: Duration = Duration::from_millis(400);

/// The load tests measure time: they run one at a time.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn store_at(url: &str, breaker: BreakerConfig) -> RedisStore {
    RedisStore::builder(url)
        .command_timeout(FAULT_TIMEOUT)
        .breaker(breaker)
        .build()
        .unwrap()
}

fn guard_at(url: &str, breaker: BreakerConfig) -> StampedeGuard {
    StampedeGuard::builder(store_at(url, breaker), keys())
        .build()
        .unwrap()
}

/// For tests that count exactly and break Redis on purpose only where they say so: a
/// command timeout that a busy machine does not reach by accident.
const STURDY_TIMEOUT: Duration = Duration::from_millis(250);

fn sturdy_guard_at(url: &str, breaker: BreakerConfig) -> StampedeGuard {
    let store = RedisStore::builder(url)
        .command_timeout(STURDY_TIMEOUT)
        .breaker(breaker)
        .build()
        .unwrap();
    StampedeGuard::builder(store, keys()).build().unwrap()
}

/// A breaker that does not open: for seeing each error as it is.
fn never_open() -> BreakerConfig {
    BreakerConfig {
        failures: u32::MAX,
        ..BreakerConfig::default()
    }
}

fn policy() -> stampede_guard::policy::PolicyBuilder {
    Policy::builder("items")
        .fresh_ttl(Duration::from_millis(300))
        .grace(Duration::from_secs(60))
        .lease_ttl(Duration::from_millis(400))
        .refresh_timeout(Duration::from_millis(400))
        .cold_wait(Duration::from_millis(300))
        .error_backoff(Duration::from_millis(400))
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Outage {
    Kill,
    Pause,
}

struct Sample {
    at: Duration,
    status: StatusCode,
    x_cache: String,
    latency: Duration,
}

/// 2 instances, 100 warm keys, about 1,000 requests/s for 15 s (2 % of them for keys
/// never seen, which take the cold path); Redis is broken at 5 s and mended at 10 s.
/// Every instance's breaker opens while Redis is broken, stays open until it is
/// mended, and closes soon after.
async fn outage_under_load(outage: Outage) {
    let _heavy = HEAVY.lock().await;
    const KEYS: usize = 100;
    const FRESH: Duration = Duration::from_secs(1);
    let mut server = RedisServer::start();
    let origin = Origin::versions(Duration::from_millis(2));
    let policy = || {
        Policy::builder("items")
            .fresh_ttl(FRESH)
            .grace(Duration::from_secs(60))
            .lease_ttl(Duration::from_secs(1))
            .refresh_timeout(Duration::from_millis(500))
            .cold_wait(Duration::from_millis(300))
            .error_backoff(Duration::from_millis(400))
            .build()
            .unwrap()
    };
    let fleet: Vec<Instance<_>> = vec![
        instance(
            guard_at(&server.url(), BreakerConfig::default()),
            policy(),
            origin.service(),
        )
        .await,
        instance(
            guard_at(&server.url(), BreakerConfig::default()),
            policy(),
            origin.service(),
        )
        .await,
    ];
    for key in 0..KEYS {
        for i in &fleet {
            assert_eq!(
                send(&i.service, get(&format!("/items/{key}"))).await.status,
                StatusCode::OK
            );
        }
    }
    let warm_calls = origin.calls();
    assert_eq!(warm_calls, KEYS as u64);

    let start = Instant::now();
    let end = start + Duration::from_secs(15);
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let mut workers = Vec::new();
    for worker in 0..20u64 {
        let services: Vec<_> = fleet.iter().map(|i| i.service.clone()).collect();
        let samples = samples.clone();
        workers.push(tokio::spawn(async move {
            let mut rng = worker
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            let mut n = 0u64;
            while Instant::now() < end {
                tick.tick().await;
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let pick = (rng >> 33) as usize;
                let path = if pick.is_multiple_of(50) {
                    format!("/cold/{worker}-{n}")
                } else {
                    format!("/items/{}", pick % KEYS)
                };
                n += 1;
                let sent = Instant::now();
                let got = send(&services[(n as usize) % 2], get(&path)).await;
                samples.lock().unwrap().push(Sample {
                    at: sent - start,
                    status: got.status,
                    x_cache: got.x_cache().to_owned(),
                    latency: sent.elapsed(),
                });
            }
        }));
    }

    tokio::time::sleep_until((start + Duration::from_secs(5)).into()).await;
    let broken_at = Instant::now();
    match outage {
        Outage::Kill => server.kill(),
        Outage::Pause => server.pause(),
    }
    // Watched through the outage: when each instance's breaker opened, and whether one
    // closed again while Redis was still broken.
    let mut opened_after: Vec<Option<Duration>> = vec![None; fleet.len()];
    let mut open_now = vec![false; fleet.len()];
    let mut closed_in_outage = Vec::new();
    let mend_at = start + Duration::from_secs(10);
    while Instant::now() < mend_at {
        for (n, i) in fleet.iter().enumerate() {
            let open = i.guard.store().circuit_open();
            if open && opened_after[n].is_none() {
                opened_after[n] = Some(broken_at.elapsed());
            }
            if open_now[n] && !open {
                closed_in_outage.push((n, broken_at.elapsed()));
            }
            open_now[n] = open;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mended_at = Instant::now();
    match outage {
        Outage::Kill => server.restart(),
        Outage::Pause => server.resume(),
    }
    let mut recovered_after = None;
    while recovered_after.is_none() && Instant::now() < end {
        if fleet.iter().all(|i| !i.guard.store().circuit_open()) {
            recovered_after = Some(mended_at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    support::web::all_within(
        workers,
        (end - Instant::now()) + Duration::from_secs(10),
        "the load's workers",
    )
    .await;

    let samples = std::mem::take(&mut *samples.lock().unwrap());
    let outage_window = (broken_at - start)..(mended_at - start);
    let in_outage: Vec<&Sample> = samples
        .iter()
        .filter(|s| outage_window.contains(&s.at))
        .collect();
    let fives = samples
        .iter()
        .filter(|s| s.status.is_server_error())
        .count();
    let worst_in_outage = in_outage
        .iter()
        .map(|s| s.latency)
        .max()
        .unwrap_or_default();
    let mut outage_latencies: Vec<Duration> = in_outage.iter().map(|s| s.latency).collect();
    outage_latencies.sort();
    let p999_in_outage = outage_latencies
        .get(outage_latencies.len().saturating_sub(1) * 999 / 1000)
        .copied()
        .unwrap_or_default();
    let worst_overall = samples.iter().map(|s| s.latency).max().unwrap_or_default();
    let log = origin.log.lock().unwrap().clone();
    let warm_calls_between = |from: Duration, to: Duration| -> Vec<&String> {
        log.iter()
            .filter(|(at, path)| {
                path.starts_with("/items/")
                    && at
                        .checked_duration_since(start)
                        .is_some_and(|d| d >= from && d < to)
            })
            .map(|(_, path)| path)
            .collect()
    };
    let during = warm_calls_between(outage_window.start, outage_window.end);
    let after_from = (mended_at - start) + Duration::from_secs(2);
    let after = warm_calls_between(after_from, end - start);
    let mut per_key_after: HashMap<&String, usize> = HashMap::new();
    for path in &after {
        *per_key_after.entry(path).or_default() += 1;
    }
    let windows_after = ((end - start) - after_from).as_secs_f64() / FRESH.as_secs_f64();
    eprintln!(
        "outage {outage:?}: {} requests ({} during the outage), {fives} 5xx; warm-key origin \
         calls during the outage {} (bound {}), after recovery {} over {windows_after:.1} \
         windows for {KEYS} keys (max per key {}); latency during the outage p99.9 \
         {p999_in_outage:?}, worst {worst_in_outage:?}, overall {worst_overall:?}; breakers \
         opened {opened_after:?} after the break, closed during the outage \
         {closed_in_outage:?}, closed again {recovered_after:?} after Redis came back",
        samples.len(),
        in_outage.len(),
        during.len(),
        KEYS * 2 * 6,
        after.len(),
        per_key_after.values().max().copied().unwrap_or(0),
    );

    assert!(
        samples.len() > 12_000,
        "the load was {} requests",
        samples.len()
    );
    assert_eq!(fives, 0);
    for s in samples.iter() {
        assert_eq!(s.status, StatusCode::OK);
        assert!(
            matches!(s.x_cache.as_str(), "hit" | "stale" | "miss"),
            "answered {} at {:?}",
            s.x_cache,
            s.at
        );
    }
    // Local-only protection: at most one origin call per key per instance per window.
    assert!(
        during.len() <= KEYS * 2 * 6,
        "{} origin calls during the outage",
        during.len()
    );
    // Fleet-wide protection again: about one per key per window, not one per instance.
    let bound = (KEYS as f64 * (windows_after + 1.0)) as usize;
    assert!(
        after.len() <= bound,
        "{} origin calls after recovery, bound {bound}",
        after.len()
    );
    assert!(
        per_key_after
            .values()
            .all(|&n| n <= windows_after.ceil() as usize + 1)
    );
    // The 99.9th percentile against the Redis timeout; the very worst against a bound
    // that a stalled 2-core machine cannot blur into a pass for a request that really
    // waited on a dead Redis (which would be seconds: the connect timeout and more).
    assert!(
        p999_in_outage < FAULT_TIMEOUT + MARGIN,
        "p99.9 {p999_in_outage:?} during the outage"
    );
    assert!(
        worst_in_outage < Duration::from_secs(1),
        "a request waited {worst_in_outage:?} during the outage"
    );
    // Both ways of breaking Redis open every instance's breaker (each sends its share of
    // the load), and it stays open until Redis is back: its probes find nothing.
    for (n, opened) in opened_after.iter().enumerate() {
        assert!(
            opened.is_some(),
            "{outage:?}: instance {n}'s breaker never opened during the outage"
        );
    }
    assert!(
        closed_in_outage.is_empty(),
        "{outage:?}: breakers closed while Redis was broken: {closed_in_outage:?}"
    );
    let recovered_after = recovered_after.expect("the breaker never closed");
    assert!(
        recovered_after < Duration::from_secs(2),
        "{recovered_after:?}"
    );
    // L2 is filled again.
    let key = fleet[0].layer.cache_keys(&get("/items/1")).unwrap();
    assert!(
        eventually(Duration::from_secs(3), || async {
            send(&fleet[0].service, get("/items/1")).await;
            server
                .conn()
                .await
                .exists::<_, bool>(key.entry())
                .await
                .unwrap()
        })
        .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_and_restarted_empty() {
    outage_under_load(Outage::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_under_load_and_resumed() {
    outage_under_load(Outage::Pause).await;
}

/// Every proxy fault gives a classified error within the timeout and a fallback to the
/// origin, without a storm of reconnections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_faults_are_classified_and_fall_back() {
    let server = RedisServer::start();
    let name = keys().lease(&[Scope::label("probe")], "fill").unwrap();
    for mode in [
        Mode::Delay(FAULT_TIMEOUT * 3),
        Mode::Blackhole,
        Mode::DropReplies,
        Mode::Garbage,
        Mode::Refuse,
    ] {
        let proxy = Proxy::start(server.addr()).await;
        let store = store_at(&proxy.url(), never_open());
        let leases = LeaseClient::builder(store.clone(), &keys())
            .build()
            .unwrap();
        let origin = Origin::versions(Duration::ZERO);
        let guard = StampedeGuard::builder(store, keys()).build().unwrap();
        let i = instance(guard, policy().build().unwrap(), origin.service()).await;
        proxy.set(mode);
        if mode == Mode::Refuse {
            proxy.reset_all();
        }
        let before = proxy.accepted();
        let started = Instant::now();
        let outcome = leases.try_acquire(&name, Duration::from_secs(1)).await;
        let took = started.elapsed();
        assert!(
            took < FAULT_TIMEOUT + MARGIN,
            "{mode:?}: acquire took {took:?}"
        );
        match (mode, &outcome) {
            (Mode::Delay(_) | Mode::Blackhole | Mode::DropReplies, AcquireOutcome::TimedOut(a)) => {
                assert_eq!(a.error().kind(), StoreErrorKind::Timeout)
            }
            (Mode::Garbage | Mode::Refuse, AcquireOutcome::Unavailable(e)) => assert!(
                matches!(
                    e.kind(),
                    StoreErrorKind::Response
                        | StoreErrorKind::ConnectionLost
                        | StoreErrorKind::NoConnection
                ),
                "{mode:?}: {e}"
            ),
            _ => panic!("{mode:?}: {outcome:?}"),
        }
        for n in 0..10 {
            let started = Instant::now();
            let got = send(&i.service, get(&format!("/items/{n}"))).await;
            let took = started.elapsed();
            assert_eq!(got.status, StatusCode::OK, "{mode:?}");
            assert_eq!(got.body, format!("v{}", n + 1), "{mode:?}");
            assert!(
                took < FAULT_TIMEOUT * 2 + MARGIN,
                "{mode:?}: request took {took:?}"
            );
        }
        // One failed operation per request (the read; a fill that found Redis failing
        // goes on without it), each falling back to a local fill.
        let stats = i.layer.stats();
        assert_eq!(stats.get(Event::RedisError), 10, "{mode:?}: {stats:?}");
        assert_eq!(stats.get(Event::LocalOnly), 10, "{mode:?}: {stats:?}");
        // A bound, not a count: how often the pool redials depends on when it sees each
        // connection die. A storm would be one or more per operation.
        let reconnects = proxy.accepted() - before;
        assert!(
            reconnects <= 15,
            "{mode:?}: {reconnects} connections for 11 operations"
        );
    }
}

/// Every kind of error reply is classified, counted, and falls back to the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_replies_are_classified_and_fall_back() {
    let name = keys().lease(&[Scope::label("probe")], "fill").unwrap();
    for code in ["READONLY", "OOM", "NOPERM", "BUSY", "NOAUTH"] {
        let server = RedisServer::start();
        let mut url = server.url();
        match code {
            "READONLY" => server.make_readonly().await,
            "OOM" => server.fill_memory().await,
            "NOPERM" => url = server.user_without_scripts().await,
            "BUSY" => server.start_busy_script().await,
            _ => server.require_password().await,
        }
        let store = store_at(&url, never_open());
        let leases = LeaseClient::builder(store.clone(), &keys())
            .build()
            .unwrap();
        let started = Instant::now();
        let outcome = leases.try_acquire(&name, Duration::from_secs(1)).await;
        assert!(started.elapsed() < FAULT_TIMEOUT + MARGIN, "{code}");
        match &outcome {
            AcquireOutcome::Unavailable(e) if e.kind() == StoreErrorKind::Server => {
                assert_eq!(e.server_code(), Some(code), "{e}")
            }
            // Refused at the handshake: the pool never gets a connection.
            AcquireOutcome::Unavailable(e) if code == "NOAUTH" => {
                assert_eq!(e.kind(), StoreErrorKind::NoConnection, "{e}")
            }
            other => panic!("{code}: {other:?}"),
        }
        let origin = Origin::versions(Duration::ZERO);
        let guard = StampedeGuard::builder(store, keys()).build().unwrap();
        let layer = guard.layer(policy().build().unwrap()).unwrap();
        let service = tower::Layer::layer(&layer, origin.service());
        for n in 0..5 {
            let started = Instant::now();
            let got = send(&service, get(&format!("/items/{n}"))).await;
            assert_eq!(
                (got.status, got.body.as_str()),
                (StatusCode::OK, format!("v{}", n + 1).as_str()),
                "{code}"
            );
            assert!(started.elapsed() < FAULT_TIMEOUT * 2 + MARGIN, "{code}");
        }
        // One failed operation per request (the read, or the acquire where reads
        // work), each falling back to a local fill.
        let stats = layer.stats();
        assert_eq!(stats.get(Event::RedisError), 5, "{code}: {stats:?}");
        assert_eq!(stats.get(Event::LocalOnly), 5, "{code}: {stats:?}");
        match code {
            "READONLY" => server.make_primary().await,
            "OOM" => server.free_memory().await,
            "BUSY" => server.end_busy_script().await,
            _ => {}
        }
    }
}

/// After `SCRIPT FLUSH`, each script is loaded again once, and nothing fails.
#[tokio::test]
async fn noscript_is_answered_by_one_reload_per_script() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let i = instance(
        guard_at(&server.url(), BreakerConfig::default()),
        policy().build().unwrap(),
        origin.service(),
    )
    .await;
    assert_eq!(send(&i.service, get("/items/1")).await.body, "v1");
    let _: () = server.cmd(&["SCRIPT", "FLUSH"]).await;
    let loads_before = script_loads(&server).await;
    for n in 2..=4 {
        assert_eq!(
            send(&i.service, get(&format!("/items/{n}"))).await.body,
            format!("v{n}")
        );
    }
    // read, acquire and the fenced write: each loaded once, whatever the traffic.
    assert_eq!(script_loads(&server).await - loads_before, 3);
    assert_eq!(i.layer.stats().get(Event::RedisError), 0);
}

async fn script_loads(server: &RedisServer) -> u64 {
    let stats: String = server.cmd(&["INFO", "commandstats"]).await;
    stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_script|load:calls="))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

/// A refresh whose origin hangs is renewed until the watchdog's maximum, then cancelled;
/// nothing is written and the lease is gone by the maximum plus one TTL.
#[tokio::test]
async fn a_hung_origin_stops_being_renewed_at_the_maximum() {
    let server = RedisServer::start();
    let max = Duration::from_millis(1200);
    let ttl = Duration::from_millis(400);
    let policy = policy().lease_ttl(ttl).refresh_timeout(max).watchdog(max);
    let (_origin, i, keys, token_before) = refresh_in_origin(&server, policy, Stall::Hang).await;
    let refresh_started = Instant::now();
    let holder: String = server.conn().await.get(keys.lease().key()).await.unwrap();
    // Past the first TTL (time must pass here: that is the claim), the lease is still
    // there, and still the refresh's own: renewed, not taken again.
    tokio::time::sleep(ttl * 2).await;
    let mut conn = server.conn().await;
    assert!(conn.pttl::<_, i64>(keys.lease().key()).await.unwrap() > 0);
    let still: String = conn.get(keys.lease().key()).await.unwrap();
    assert_eq!(still, holder, "the lease changed hands");
    // The watchdog gives up at the maximum (or the refresh timeout, set to the same, fires
    // in the same millisecond); the lease then ends within one TTL.
    assert!(
        eventually(max + MARGIN, || async {
            let stats = i.layer.stats();
            stats.get(Event::ExpiredWhileWorking) + stats.get(Event::RefreshTimeout) == 1
        })
        .await
    );
    let lease_key = keys.lease().key().to_owned();
    let server_ref = &server;
    assert!(
        eventually(Duration::from_secs(3), || {
            let key = lease_key.clone();
            async move { server_ref.conn().await.pttl::<_, i64>(key).await.unwrap() == -2 }
        })
        .await
    );
    assert!(
        refresh_started.elapsed() < max + ttl + MARGIN,
        "{:?}",
        refresh_started.elapsed()
    );
    assert_eq!(
        stored_token(&server, keys.entry()).await,
        token_before,
        "a write happened"
    );
    assert_eq!(i.layer.stats().get(Event::RefreshWritten), 0);
}

/// A renewal that finds another owner cancels the refresh (its origin call is dropped,
/// unanswered): nothing is written and the other owner's lease is left alone.
#[tokio::test]
async fn a_renewal_that_finds_another_owner_cancels_the_refresh() {
    let server = RedisServer::start();
    let policy = policy()
        .lease_ttl(Duration::from_millis(600))
        .refresh_timeout(Duration::from_secs(3))
        .watchdog(Duration::from_secs(3));
    let (origin, i, keys, token_before) = refresh_in_origin(&server, policy, Stall::Hold).await;
    let _: () = server
        .conn()
        .await
        .pset_ex(keys.lease().key(), "someone-else", 5000)
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(2), || async {
            i.layer.stats().get(Event::ExpiredWhileWorking) == 1
        })
        .await
    );
    // Cancelled: the held origin call is dropped before it could answer, so opening the
    // gate afterwards has nothing left to let through.
    assert!(
        eventually(Duration::from_secs(2), || async { origin.in_flight() == 0 }).await,
        "the refresh's origin call was not cancelled"
    );
    origin.open();
    // Only the first fill's call ever answered.
    assert_eq!(
        origin.returned.lock().unwrap().len(),
        1,
        "the refresh's origin call answered"
    );
    assert_eq!(origin.calls(), 2);
    let holder: String = server.conn().await.get(keys.lease().key()).await.unwrap();
    assert_eq!(holder, "someone-else");
    assert_eq!(stored_token(&server, keys.entry()).await, token_before);
    assert_eq!(i.layer.stats().get(Event::RefreshWritten), 0);
}

/// How the origin keeps a refresh waiting.
enum Stall {
    /// Never answers.
    Hang,
    /// Answers when the test opens it.
    Hold,
}

/// One instance with `/items/1` filled, gone stale, and its refresh stalled in the
/// origin (with its lease held). Also returns the entry's keys and stored token.
async fn refresh_in_origin(
    server: &RedisServer,
    policy: stampede_guard::policy::PolicyBuilder,
    stall: Stall,
) -> (
    Origin,
    Instance<
        impl tower::Service<
            support::web::Req,
            Response = http::Response<support::web::Body>,
            Error = std::convert::Infallible,
            Future: Send,
        > + Clone
        + Send
        + Sync
        + 'static,
    >,
    stampede_guard::keys::CacheKeys,
    String,
) {
    let origin = Origin::versions(Duration::ZERO);
    let i = instance(
        guard_at(&server.url(), BreakerConfig::default()),
        policy.build().unwrap(),
        origin.service(),
    )
    .await;
    assert_eq!(send(&i.service, get("/items/1")).await.body, "v1");
    let keys = i.layer.cache_keys(&get("/items/1")).unwrap();
    let token_before = stored_token(server, keys.entry()).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    match stall {
        Stall::Hang => origin.hang(2),
        Stall::Hold => origin.hold(2),
    }
    let started_call = origin.started.notified();
    assert_eq!(send(&i.service, get("/items/1")).await.x_cache(), "stale");
    within(HANG, started_call, "the refresh reaching the origin").await;
    (origin, i, keys, token_before)
}

async fn stored_token(server: &RedisServer, entry: &str) -> String {
    server.conn().await.hget(entry, "t").await.unwrap()
}

/// 400 requests on 40 cold keys, dropped while their 40 fills are in the origin
/// (holding their leases, at a gate): the fills go on without their callers, and
/// release their leases when they write, so no lease key is left, long before any lease
/// could have ended by its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_cancelled_mid_fill_leave_no_lease_behind() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    // Far longer than the test: a lease key gone at the end was released, not expired.
    let ttl = Duration::from_secs(30);
    let i = instance(
        sturdy_guard_at(&server.url(), BreakerConfig::default()),
        policy()
            .lease_ttl(ttl)
            // Past the test too: the fills are held at the gate as long as it takes.
            .refresh_timeout(Duration::from_secs(20))
            .error_backoff(Duration::from_secs(1))
            .build()
            .unwrap(),
        origin.service(),
    )
    .await;
    origin.hold_from(1);
    let mut tasks = Vec::new();
    for n in 0..400 {
        let service = i.service.clone();
        tasks.push(tokio::spawn(async move {
            send(&service, get(&format!("/items/{}", n % 40))).await
        }));
    }
    // Every fill is in the origin, at the gate, with its lease taken.
    let in_origin = eventually(Duration::from_secs(10), || async {
        origin.in_flight() == 40 && server.scan("*:lease").await.len() == 40
    });
    assert!(
        in_origin.await,
        "{} fills in the origin, {} leases",
        origin.in_flight(),
        server.scan("*:lease").await.len()
    );
    // Every caller is dropped while its fill is still held: none got an answer.
    for task in &tasks {
        task.abort();
    }
    for (n, task) in tasks.into_iter().enumerate() {
        let ended = support::within(HANG, task, format!("aborted request {n}")).await;
        assert!(
            ended.as_ref().is_err_and(|e| e.is_cancelled()),
            "request {n} was not cancelled mid-fill: it ended with {:?}",
            ended.map(|got| got.status)
        );
    }
    assert_eq!(origin.in_flight(), 40, "a fill ended with its callers");
    assert_eq!(server.scan("*:entry").await.len(), 0);
    origin.open();
    let fills_done = eventually(Duration::from_secs(10), || async {
        i.layer.stats().get(Event::ColdFill) == 40 && server.scan("*:entry").await.len() == 40
    })
    .await;
    assert!(fills_done, "{:?}", i.layer.stats());
    let leases = server.scan("*:lease").await;
    assert!(
        leases.is_empty(),
        "{} lease keys left: {leases:?}",
        leases.len()
    );
    // One fill per key, whatever happened to the callers.
    assert_eq!(origin.calls(), 40);
    assert_eq!(origin.returned.lock().unwrap().len(), 40);
}

/// Randomized trials: a refresher takes its lease and reads the origin; then Redis
/// restarts empty (counter and entries lost) or the lease is lost; another instance
/// refreshes and writes; then the first one writes. The late, older write must never
/// replace the newer one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_holds_across_restarts_that_lose_counter_and_entries() {
    const TRIALS: u64 = 8;
    let mut server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, request| {
        Response::new(full(format!("{} call {n}", request.uri().path())))
    });
    let policy = || {
        policy()
            .lease_ttl(Duration::from_secs(2))
            .refresh_timeout(Duration::from_secs(2))
            .error_backoff(Duration::from_secs(1))
            .build()
            .unwrap()
    };
    let a = instance(
        sturdy_guard_at(&server.url(), never_open()),
        policy(),
        origin.service(),
    )
    .await;
    let b = instance(
        sturdy_guard_at(&server.url(), never_open()),
        policy(),
        origin.service(),
    )
    .await;
    let mut rng: u64 = 0x2545F4914F6CDD1D;
    let mut regressions = 0;
    let mut restarts = 0;
    for trial in 0..TRIALS {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let restart = rng.is_multiple_of(2);
        let path = format!("/items/{trial}");
        send(&a.service, get(&path)).await;
        send(&b.service, get(&path)).await;
        tokio::time::sleep(Duration::from_millis(350)).await;

        let late_call = origin.calls() + 1;
        origin.hold(late_call);
        let started_call = origin.started.notified();
        assert_eq!(send(&a.service, get(&path)).await.x_cache(), "stale");
        within(
            HANG,
            started_call,
            format!("trial {trial}: a's refresh reaching the origin"),
        )
        .await;
        let keys = a.layer.cache_keys(&get(&path)).unwrap();
        if restart {
            restarts += 1;
            server.restart();
            heal(&b.guard).await;
        } else {
            let _: () = server.conn().await.del(keys.lease().key()).await.unwrap();
        }
        let written = b.layer.stats().get(Event::RefreshWritten);
        assert_eq!(send(&b.service, get(&path)).await.x_cache(), "stale");
        assert!(
            eventually(Duration::from_secs(3), || async {
                b.layer.stats().get(Event::RefreshWritten) == written + 1
            })
            .await,
            "trial {trial}"
        );
        heal(&a.guard).await;
        let refused = a.layer.stats().get(Event::FencedWriteRefused);
        origin.open();
        assert!(
            eventually(Duration::from_secs(3), || async {
                a.layer.stats().get(Event::FencedWriteRefused) == refused + 1
            })
            .await,
            "trial {trial}: the late write was not refused ({:?})",
            a.layer.stats()
        );
        let data: Vec<u8> = server.conn().await.hget(keys.entry(), "d").await.unwrap();
        let stored = stampede_guard::fuzzing::decode(&data).unwrap();
        if stored.body == format!("{path} call {late_call}") {
            regressions += 1;
        }
    }
    eprintln!("fencing: {TRIALS} trials, {restarts} with a restart, {regressions} regressions");
    assert_eq!(regressions, 0);
    assert!(
        restarts > 0 && restarts < TRIALS,
        "the trials did not mix both cases"
    );
}

/// Makes sure a guard's pool holds live connections again after a restart.
async fn heal(guard: &StampedeGuard) {
    for _ in 0..20 {
        if guard.store().ping().await.is_ok() && guard.store().ping().await.is_ok() {
            return;
        }
    }
    panic!("the store did not reconnect");
}

/// Entries near a large body limit take time to move. A read gets the same size-scaled
/// deadline as a write: 2 MiB entries read over a slow link (1 ms per 16 KiB, over
/// 128 ms in all, with a 100 ms command timeout) are hits, not timeouts, and six of them
/// leave the breaker closed for every other route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_entries_are_read_within_a_size_scaled_deadline() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let big = Bytes::from(vec![b'x'; 2 * 1024 * 1024]);
    let origin = Origin::new(Duration::ZERO, move |_, _| Response::new(full(big.clone())));
    let policy = || {
        policy()
            .fresh_ttl(Duration::from_secs(60))
            .max_body(16 * 1024 * 1024)
            .build()
            .unwrap()
    };
    let writer = instance(
        guard_at(&server.url(), BreakerConfig::default()),
        policy(),
        origin.service(),
    )
    .await;
    let reader = instance(
        guard_at(&proxy.url(), BreakerConfig::default()),
        policy(),
        origin.service(),
    )
    .await;
    for n in 0..6 {
        let got = send(&writer.service, get(&format!("/items/{n}"))).await;
        assert_eq!((got.body.len(), got.x_cache()), (2 * 1024 * 1024, "miss"));
    }
    proxy.set(Mode::Delay(Duration::from_millis(1)));
    for n in 0..6 {
        let got = send(&reader.service, get(&format!("/items/{n}"))).await;
        assert_eq!(
            (got.body.len(), got.x_cache()),
            (2 * 1024 * 1024, "hit"),
            "read {n}: {:?}",
            reader.layer.stats()
        );
    }
    assert!(!reader.guard.store().circuit_open());
    assert_eq!(reader.layer.stats().get(Event::RedisError), 0);
    assert_eq!(origin.calls(), 6);
}

/// While Redis is unavailable the guard says so: `mode()` is
/// `LocalOnly(RedisUnavailable)` and its answers carry `detail=local-only` in
/// `Cache-Status`, over real TCP as `curl -i` shows it; once Redis answers again both
/// go back by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_only_is_seen_in_the_mode_and_in_cache_status() {
    use stampede_guard::{LocalOnly, Mode as GuardMode};

    let mut server = RedisServer::start();
    let guard = guard_at(&server.url(), BreakerConfig::default());
    let layer = guard
        .layer(policy().fresh_ttl(Duration::from_secs(60)).build().unwrap())
        .unwrap();
    let app = axum::Router::new().route(
        "/items/{n}",
        axum::routing::get(|| async { "an item" }).layer(layer),
    );
    let addr = support::http::serve(app).await;
    let cache_status =
        |got: &support::web::Got| got.headers["cache-status"].to_str().unwrap().to_owned();

    let first = support::http::fetch(addr, "/items/1", &[]).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(guard.mode(), GuardMode::Shared);
    let hit = support::http::fetch(addr, "/items/1", &[]).await;
    assert!(
        !cache_status(&hit).contains("detail="),
        "{}",
        cache_status(&hit)
    );

    server.kill();
    // Misses ask Redis and fail until the breaker opens.
    let mut n = 100;
    assert!(
        eventually(HANG, || {
            n += 1;
            let path = format!("/items/{n}");
            let guard = guard.clone();
            async move {
                support::http::fetch(addr, &path, &[]).await;
                guard.mode() == GuardMode::LocalOnly(LocalOnly::RedisUnavailable)
            }
        })
        .await,
        "the breaker opens"
    );
    let hit = support::http::fetch(addr, "/items/1", &[]).await;
    assert_eq!(hit.status, StatusCode::OK);
    assert!(cache_status(&hit).starts_with("stampede-guard; hit; ttl="));
    assert!(
        cache_status(&hit).ends_with("; detail=local-only"),
        "{}",
        cache_status(&hit)
    );

    server.restart();
    assert!(
        eventually(HANG, || async {
            support::http::fetch(addr, "/items/1", &[]).await;
            guard.mode() == GuardMode::Shared
        })
        .await,
        "the breaker closes once Redis answers"
    );
    let hit = support::http::fetch(addr, "/items/1", &[]).await;
    assert!(
        !cache_status(&hit).contains("detail="),
        "{}",
        cache_status(&hit)
    );
}

/// Redis unreachable while a fill's lease is renewed: the watchdog stops renewing once
/// the lease may have expired, but lets the origin's call finish (a healthy origin is
/// not cancelled into a `504`); its answer goes to the caller, stored in this process
/// only (the write cannot be confirmed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_unreachable_during_renewals_does_not_cancel_a_healthy_origin_call() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let store = store_at(&proxy.url(), never_open());
    let guard = StampedeGuard::builder(store, keys()).build().unwrap();
    // The origin takes 2 s; the lease lasts 1 s, renewed every third of it.
    let origin = Origin::new(Duration::from_secs(2), |n, _| {
        Response::new(full(format!("v{n}")))
    });
    let policy = Policy::builder("items")
        .fresh_ttl(Duration::from_secs(60))
        .lease_ttl(Duration::from_secs(1))
        .refresh_timeout(Duration::from_secs(10))
        .cold_wait(Duration::from_secs(10))
        .watchdog(Duration::from_secs(10))
        .build()
        .unwrap();
    let i = instance(guard, policy, origin.service()).await;
    let started = Instant::now();
    let service = i.service.clone();
    let call = tokio::spawn(async move { send(&service, get("/items/1")).await });
    // Once the fill holds its lease, Redis goes silent.
    let leased = eventually(HANG, || async { origin.calls() == 1 });
    assert!(leased.await);
    proxy.set(Mode::Blackhole);
    let got = support::joined(call, HANG, "the caller").await;
    assert_eq!(
        (got.status, got.body.as_str()),
        (StatusCode::OK, "v1"),
        "{:?}",
        i.layer.stats()
    );
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert_eq!(i.layer.stats().get(Event::OriginTimeout), 0);
    // Kept in this process.
    assert_eq!(send(&i.service, get("/items/1")).await.x_cache(), "hit");
    assert_eq!(origin.calls(), 1);
}

/// A connection that a NAT or a firewall forgot (silent for good, never reset) is
/// retired by the command that timed out on it, the breaker's probe included: once the
/// pool's connections are replaced, the store answers again and its breaker closes.
/// (Kept, each of them would time out every command sent on it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_a_nat_forgot_are_retired_and_the_store_answers_again() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let store = store_at(&proxy.url(), BreakerConfig::default());
    store.ping().await.unwrap();
    let made = proxy.accepted();
    let failed = support::proxy::forgotten_then_answering(&store, &[&proxy], HANG).await;
    let failed = failed.expect("the store answers again");
    assert!(
        failed >= 1,
        "the first ping was sent on a forgotten connection"
    );
    assert!(!store.circuit_open());
    assert!(proxy.accepted() > made, "new connections were made");
}
