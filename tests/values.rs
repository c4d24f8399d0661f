//! Typed values (`Values::get_or_fetch`) through the fill engine, on real Redis
//! servers: a cold key fetched once for a fleet of two instances (on one server and on
//! a Cluster, in-process and through `axum::serve`); past freshness, the stale value at
//! once and one refresh for the fleet; an invalidation on one instance seen on the
//! other; Redis stopped, no error and at most one fetch per instance per window; a
//! refresher whose lease ran out cannot write over a newer value; a failing fetch,
//! the stale value within `stale_if_error` and one fetch per back-off; garbage and
//! another type's bytes in Redis, a miss and a fetch; a purge of a tag seen by every
//! instance. Each also on a Cluster, but for the layer and `axum::serve`.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use stampede_guard::metrics::Event;
use stampede_guard::{Policy, StampedeGuard, ValueError, Values};
use support::app::guard;
use support::backend::Store;
use support::{HANG, Redis, RedisServer, eventually, joined, within};
use tokio::sync::Barrier;

/// An exchange rate, as the upstream gives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Rate {
    currency: String,
    per_usd: f64,
}

/// The upstream: how many times it was asked, what it answers now, how long it takes,
/// and whether it fails.
#[derive(Clone, Default)]
struct Upstream {
    calls: Arc<AtomicU64>,
    per_usd: Arc<std::sync::Mutex<f64>>,
    delay: Arc<std::sync::Mutex<Duration>>,
    failing: Arc<std::sync::atomic::AtomicBool>,
}

#[derive(Debug, thiserror::Error)]
#[error("the upstream failed")]
struct Down;

impl Upstream {
    fn new(per_usd: f64, delay: Duration) -> Self {
        let upstream = Self::default();
        upstream.set(per_usd);
        *upstream.delay.lock().unwrap() = delay;
        upstream
    }

    fn set(&self, per_usd: f64) {
        *self.per_usd.lock().unwrap() = per_usd;
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// The fetch of `currency`'s rate.
    fn fetch(
        &self,
        currency: &str,
    ) -> impl FnOnce() -> std::pin::Pin<Box<dyn Future<Output = Result<Rate, Down>> + Send>>
    + Clone
    + Send
    + 'static
    + use<> {
        let (upstream, currency) = (self.clone(), currency.to_owned());
        move || {
            Box::pin(async move {
                upstream.calls.fetch_add(1, Ordering::SeqCst);
                let delay = *upstream.delay.lock().unwrap();
                tokio::time::sleep(delay).await;
                if upstream.failing.load(Ordering::SeqCst) {
                    return Err(Down);
                }
                let per_usd = *upstream.per_usd.lock().unwrap();
                Ok(Rate { currency, per_usd })
            })
        }
    }
}

/// Fresh for 500 ms, 30 s of grace, a cold wait of 10 s (only a notice ends a wait in
/// time), a back-off of 1 s.
fn rates() -> Policy {
    Policy::builder("rates")
        .fresh_ttl(Duration::from_millis(500))
        .grace(Duration::from_secs(30))
        .lease_ttl(Duration::from_secs(5))
        .refresh_timeout(Duration::from_secs(5))
        .cold_wait(Duration::from_secs(10))
        .error_backoff(Duration::from_secs(1))
        .build()
        .unwrap()
}

/// An instance: a guard of its own (its own L1) on `redis`, ready, and its rates.
async fn instance(redis: &impl Store, policy: Policy) -> (StampedeGuard, Values<Rate>) {
    let guard = guard(redis);
    within(HANG, guard.ready(), "the guard's readiness")
        .await
        .expect("redis up for the test");
    let values = guard.values::<Rate>(policy).unwrap();
    (guard, values)
}

/// 200 callers at once of a cold key over two instances: one fetch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cold_key_is_fetched_once_for_two_instances() {
    cold_key_fetched_once(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_a_cold_key_is_fetched_once_for_two_instances() {
    cold_key_fetched_once(Redis::cluster()).await;
}

/// The same through `axum::serve`, over real TCP: each instance an axum app whose
/// handler asks for the rate, each request on a connection of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn through_axum_a_cold_key_is_fetched_once_for_two_instances() {
    use axum::extract::{Path, State};
    let redis = RedisServer::start();
    let upstream = Upstream::new(0.92, Duration::from_millis(300));
    let mut servers = Vec::new();
    for _ in 0..2 {
        let (_, rates) = instance(&redis, rates()).await;
        let app = axum::Router::new()
            .route(
                "/rates/{currency}",
                axum::routing::get(
                    |State((rates, upstream)): State<(Values<Rate>, Upstream)>,
                     Path(currency): Path<String>| async move {
                        let fetch = upstream.fetch(&currency);
                        match rates.get_or_fetch(&currency, fetch).await {
                            Ok(rate) => rate.per_usd.to_string(),
                            Err(error) => format!("error: {error}"),
                        }
                    },
                ),
            )
            .with_state((rates, upstream.clone()));
        servers.push(support::http::serve(app).await);
    }
    let barrier = Arc::new(Barrier::new(200));
    let callers: Vec<_> = (0..200)
        .map(|n| {
            let (server, barrier) = (servers[n % 2], barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                support::http::fetch(server, "/rates/EUR", &[]).await
            })
        })
        .collect();
    for caller in callers {
        let got = joined(caller, HANG, "a caller").await;
        assert_eq!(got.body, "0.92");
    }
    assert_eq!(upstream.calls(), 1, "one fetch for the fleet");
}

/// The Tower layer over a plain `service_fn`: the same one fetch for two instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_layer_over_a_service_fn_fetches_once_for_two_instances() {
    use tower::{Layer, ServiceExt};
    let redis = RedisServer::start();
    let upstream = Upstream::new(0.92, Duration::from_millis(300));
    let mut fleet = Vec::new();
    for _ in 0..2 {
        let (_, rates) = instance(&redis, rates()).await;
        let upstream = upstream.clone();
        let service = tower::service_fn(move |currency: String| {
            let fetch = upstream.fetch(&currency);
            fetch()
        });
        fleet.push(rates.layer(currency_of).layer(service));
    }
    let barrier = Arc::new(Barrier::new(200));
    let callers: Vec<_> = (0..200)
        .map(|n| {
            let barrier = barrier.clone();
            // (Boxed out here: rustc proves the call `Send` outside an async block, not
            // within one, for a key function's higher-ranked signature.)
            let call: Call = Box::pin(fleet[n % 2].clone().oneshot("EUR".to_owned()));
            tokio::spawn(async move {
                barrier.wait().await;
                call.await
            })
        })
        .collect();
    for caller in callers {
        let rate = joined(caller, HANG, "a caller").await.unwrap();
        assert_eq!(rate.per_usd, 0.92);
    }
    assert_eq!(upstream.calls(), 1, "one fetch for the fleet");
    // The inner service's error, for the caller whose fetch it was.
    upstream.failing.store(true, Ordering::SeqCst);
    match fleet[0].clone().oneshot("CHF".to_owned()).await {
        Err(ValueError::Fetch(Down)) => {}
        got => panic!("the service's own error, not {got:?}"),
    }
}

/// A call of a rates service.
type Call = std::pin::Pin<Box<dyn Future<Output = Result<Arc<Rate>, ValueError<Down>>> + Send>>;

/// The key of a request for a currency's rate: the currency.
#[allow(clippy::ptr_arg)] // a key function takes `&Req`, and the request is a `String`
fn currency_of(currency: &String) -> String {
    currency.clone()
}

async fn cold_key_fetched_once(redis: Redis) {
    let upstream = Upstream::new(0.92, Duration::from_millis(300));
    let fleet = [
        instance(&redis, rates()).await.1,
        instance(&redis, rates()).await.1,
    ];
    let barrier = Arc::new(Barrier::new(200));
    let callers: Vec<_> = (0..200)
        .map(|n| {
            let (values, upstream) = (fleet[n % 2].clone(), upstream.clone());
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                values.get_or_fetch("EUR", upstream.fetch("EUR")).await
            })
        })
        .collect();
    for caller in callers {
        let rate = joined(caller, HANG, "a caller").await.unwrap();
        assert_eq!(rate.per_usd, 0.92);
    }
    assert_eq!(upstream.calls(), 1, "one fetch for the fleet");
    // A hit after, on either instance, from its L1: the same value, no fetch.
    for values in &fleet {
        let l1_hits = values.stats().get(Event::L1Hit);
        let rate = values.get_or_fetch("EUR", upstream.fetch("EUR")).await;
        assert_eq!(rate.unwrap().per_usd, 0.92);
        assert_eq!(values.stats().get(Event::L1Hit), l1_hits + 1);
    }
    assert_eq!(upstream.calls(), 1);
}

/// Past freshness, every caller is given the stale value at once (the refresh's fetch
/// takes a second), on both instances, and the fleet refreshes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_freshness_the_stale_value_is_served_at_once_and_refreshed_once() {
    stale_served_and_refreshed_once(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_past_freshness_the_stale_value_is_served_at_once_and_refreshed_once() {
    stale_served_and_refreshed_once(Redis::cluster()).await;
}

async fn stale_served_and_refreshed_once(redis: Redis) {
    let upstream = Upstream::new(0.92, Duration::ZERO);
    let fleet = [
        instance(&redis, rates()).await.1,
        instance(&redis, rates()).await.1,
    ];
    for values in &fleet {
        let rate = values.get_or_fetch("EUR", upstream.fetch("EUR")).await;
        assert_eq!(rate.unwrap().per_usd, 0.92);
    }
    assert_eq!(upstream.calls(), 1);
    tokio::time::sleep(Duration::from_millis(700)).await;
    upstream.set(0.95);
    *upstream.delay.lock().unwrap() = Duration::from_secs(1);
    let began = Instant::now();
    let callers: Vec<_> = (0..100)
        .map(|n| {
            let (values, upstream) = (fleet[n % 2].clone(), upstream.clone());
            tokio::spawn(async move { values.get_or_fetch("EUR", upstream.fetch("EUR")).await })
        })
        .collect();
    for caller in callers {
        let rate = joined(caller, HANG, "a caller").await.unwrap();
        // Not the refreshed value: nobody waited for the refresh's fetch.
        assert_eq!(rate.per_usd, 0.92);
    }
    assert!(
        began.elapsed() < Duration::from_secs(1),
        "the stale value at once: {:?}",
        began.elapsed()
    );
    for values in &fleet {
        let refreshed = eventually(Duration::from_secs(5), || async {
            let rate = values.get_or_fetch("EUR", upstream.fetch("EUR")).await;
            rate.unwrap().per_usd == 0.95
        });
        assert!(refreshed.await, "an instance kept the stale value");
    }
    assert_eq!(upstream.calls(), 2, "one refresh for the fleet");
    let stale: u64 = fleet.iter().map(|v| v.stats().get(Event::Stale)).sum();
    assert!(stale >= 100, "{stale} stale answers");
}

/// An invalidation on one instance: the next call on the other gets the new value
/// (once the notice came), fetched once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_invalidation_on_one_instance_is_seen_on_the_other() {
    invalidation_seen_on_the_other(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_an_invalidation_on_one_instance_is_seen_on_the_other() {
    invalidation_seen_on_the_other(Redis::cluster()).await;
}

async fn invalidation_seen_on_the_other(redis: Redis) {
    let upstream = Upstream::new(0.92, Duration::ZERO);
    let policy = || {
        Policy::builder("rates")
            .fresh_ttl(Duration::from_secs(3600))
            .build()
            .unwrap()
    };
    let (a, b) = (
        instance(&redis, policy()).await.1,
        instance(&redis, policy()).await.1,
    );
    for values in [&a, &b] {
        let rate = values.get_or_fetch("EUR", upstream.fetch("EUR")).await;
        assert_eq!(rate.unwrap().per_usd, 0.92);
    }
    upstream.set(0.95);
    // Read-your-writes on the instance that invalidated: at once.
    assert!(a.invalidate("EUR").await.unwrap(), "Redis held it");
    let rate = a.get_or_fetch("EUR", upstream.fetch("EUR")).await.unwrap();
    assert_eq!(rate.per_usd, 0.95);
    let seen = eventually(Duration::from_secs(2), || async {
        let rate = b.get_or_fetch("EUR", upstream.fetch("EUR")).await;
        rate.unwrap().per_usd == 0.95
    });
    assert!(seen.await, "the other instance kept the invalidated value");
    assert_eq!(upstream.calls(), 2);
    // `set`: a value the caller has already, for the fleet.
    let set = a
        .set(
            "EUR",
            Rate {
                currency: "EUR".into(),
                per_usd: 0.97,
            },
        )
        .await
        .unwrap();
    assert_eq!(set.per_usd, 0.97);
    let seen = eventually(Duration::from_secs(2), || async {
        let rate = b.get_or_fetch("EUR", upstream.fetch("EUR")).await;
        rate.unwrap().per_usd == 0.97
    });
    assert!(seen.await, "the other instance did not get the value set");
    assert_eq!(upstream.calls(), 2, "a set fetches nothing");
}

/// Redis stopped: no caller gets an error, and each instance fetches at most once per
/// window of freshness (its own fill, without the lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_redis_stopped_no_error_and_at_most_one_fetch_per_instance_per_window() {
    redis_stopped(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_stopped_no_error_and_at_most_one_fetch_per_instance_per_window() {
    redis_stopped(Redis::cluster()).await;
}

async fn redis_stopped(mut redis: Redis) {
    let fleet = [
        instance(&redis, rates()).await.1,
        instance(&redis, rates()).await.1,
    ];
    let upstreams = [
        Upstream::new(0.92, Duration::from_millis(50)),
        Upstream::new(0.92, Duration::from_millis(50)),
    ];
    for (values, upstream) in fleet.iter().zip(&upstreams) {
        let rate = values.get_or_fetch("EUR", upstream.fetch("EUR")).await;
        assert_eq!(rate.unwrap().per_usd, 0.92);
    }
    redis.kill();
    let began = Instant::now();
    let mut errors = 0;
    // Three seconds of callers, 20 at a time on each instance.
    while began.elapsed() < Duration::from_secs(3) {
        let mut callers = Vec::new();
        for (values, upstream) in fleet.iter().zip(&upstreams) {
            for _ in 0..20 {
                let (values, fetch) = (values.clone(), upstream.fetch("EUR"));
                callers.push(tokio::spawn(async move {
                    values.get_or_fetch("EUR", fetch).await
                }));
            }
        }
        for caller in callers {
            if joined(caller, HANG, "a caller").await.is_err() {
                errors += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = began.elapsed();
    assert_eq!(errors, 0);
    // A window is the fresh time (500 ms): its refresh, once stale, is one fetch; and
    // at least one ran (the value went stale three seconds in).
    let windows = (elapsed.as_millis() / 500) as u64 + 1;
    for upstream in &upstreams {
        let fetches = upstream.calls() - 1;
        assert!(
            (1..=windows).contains(&fetches),
            "{fetches} fetches in {elapsed:?} on one instance"
        );
    }
    // A key nothing was cached for: one fetch per instance for its 20 callers (counted
    // apart: a refresh of the other key may still be on its way).
    let upstreams = [
        Upstream::new(0.88, Duration::from_millis(50)),
        Upstream::new(0.88, Duration::from_millis(50)),
    ];
    let mut callers = Vec::new();
    for (values, upstream) in fleet.iter().zip(&upstreams) {
        for _ in 0..20 {
            let (values, fetch) = (values.clone(), upstream.fetch("CHF"));
            callers.push(tokio::spawn(async move {
                values.get_or_fetch("CHF", fetch).await
            }));
        }
    }
    for caller in callers {
        assert!(joined(caller, HANG, "a caller").await.is_ok());
    }
    for upstream in &upstreams {
        assert_eq!(upstream.calls(), 1, "one fetch per instance");
    }
}

/// A refresher that lost its lease while it fetched (its lease key deleted, as a
/// failover or an eviction would) is overtaken by another instance: its late write is
/// refused by the fenced write, and Redis keeps the newer value.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refresher_that_lost_its_lease_cannot_write_over_a_newer_value() {
    late_refresher_fenced(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_a_refresher_that_lost_its_lease_cannot_write_over_a_newer_value() {
    late_refresher_fenced(Redis::cluster()).await;
}

async fn late_refresher_fenced(redis: Redis) {
    let (a, b) = (
        instance(&redis, rates()).await.1,
        instance(&redis, rates()).await.1,
    );
    let first = Upstream::new(0.90, Duration::ZERO);
    for values in [&a, &b] {
        let rate = values.get_or_fetch("EUR", first.fetch("EUR")).await;
        assert_eq!(rate.unwrap().per_usd, 0.90);
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    // A's refresh takes the lease, and its fetch is held: an old value, read before B's.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let held = {
        let (gate, started) = (gate.clone(), started.clone());
        move || async move {
            started.notify_one();
            let _ = gate.acquire().await;
            Ok::<_, Down>(Rate {
                currency: "EUR".into(),
                per_usd: 0.91,
            })
        }
    };
    let notified = started.notified();
    assert_eq!(a.get_or_fetch("EUR", held).await.unwrap().per_usd, 0.90);
    within(HANG, notified, "A's refresh reaching its fetch").await;
    let keys = a.cache_keys("EUR").unwrap();
    let deleted: i64 = redis.cmd(redis::cmd("DEL").arg(keys.lease().key())).await;
    assert_eq!(deleted, 1, "A's lease was not there");
    // B refreshes with a newer value.
    let fresh = Upstream::new(0.95, Duration::ZERO);
    assert_eq!(
        b.get_or_fetch("EUR", fresh.fetch("EUR"))
            .await
            .unwrap()
            .per_usd,
        0.90
    );
    assert!(
        eventually(Duration::from_secs(3), || async {
            b.stats().get(Event::RefreshWritten) == 1
        })
        .await,
        "B's refresh wrote"
    );
    // A's fetch ends: its write is refused.
    gate.add_permits(1);
    assert!(
        eventually(Duration::from_secs(3), || async {
            a.stats().get(Event::FencedWriteRefused) == 1
        })
        .await,
        "{:?}",
        a.stats()
    );
    let c = instance(&redis, rates()).await.1;
    let never = Upstream::new(0.0, Duration::ZERO);
    let held = c.get_or_fetch("EUR", never.fetch("EUR")).await.unwrap();
    assert_eq!(
        held.per_usd, 0.95,
        "Redis holds B's value, not A's older one"
    );
    assert_eq!(never.calls(), 0);
    // A serves the newer value, never its own late one.
    let a_serves = eventually(Duration::from_secs(3), || async {
        let rate = a.get_or_fetch("EUR", never.fetch("EUR")).await.unwrap();
        assert_ne!(rate.per_usd, 0.91, "A's late value reached its L1");
        rate.per_usd == 0.95
    });
    assert!(a_serves.await);
}

/// A fetch that fails: the value that expired stands in within `stale_if_error`, for
/// every caller, and the fleet fetches once per back-off; the error is never cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_fetch_is_stood_in_for_and_tried_once_per_back_off() {
    failing_fetch(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_a_failing_fetch_is_stood_in_for_and_tried_once_per_back_off() {
    failing_fetch(Redis::cluster()).await;
}

async fn failing_fetch(redis: Redis) {
    let policy = || {
        Policy::builder("rates")
            .fresh_ttl(Duration::from_millis(200))
            .grace(Duration::from_millis(100))
            .stale_if_error(Duration::from_secs(60))
            .error_backoff(Duration::from_secs(1))
            .cold_wait(Duration::from_secs(5))
            .build()
            .unwrap()
    };
    let fleet = [
        instance(&redis, policy()).await.1,
        instance(&redis, policy()).await.1,
    ];
    let upstream = Upstream::new(0.92, Duration::from_millis(20));
    for values in &fleet {
        let rate = values.get_or_fetch("EUR", upstream.fetch("EUR")).await;
        assert_eq!(rate.unwrap().per_usd, 0.92);
    }
    upstream.failing.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let before = upstream.calls();
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(3) {
        let callers: Vec<_> = (0..20)
            .map(|n| {
                let (values, fetch) = (fleet[n % 2].clone(), upstream.fetch("EUR"));
                tokio::spawn(async move { values.get_or_fetch("EUR", fetch).await })
            })
            .collect();
        for caller in callers {
            let rate = joined(caller, HANG, "a caller").await;
            assert_eq!(rate.unwrap().per_usd, 0.92, "the expired value stands in");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tries = upstream.calls() - before;
    let backoffs = began.elapsed().as_secs() + 1;
    assert!(
        (1..=backoffs + 1).contains(&tries),
        "{tries} fetches in {:?}",
        began.elapsed()
    );
    // Without a value to stand in: the caller whose fetch failed gets its error.
    let other = instance(&redis, policy()).await.1;
    upstream.failing.store(true, Ordering::SeqCst);
    match other.get_or_fetch("USD", upstream.fetch("USD")).await {
        Err(ValueError::Fetch(Down)) => {}
        got => panic!("the fetch's own error, not {got:?}"),
    }
    // And it was not cached: the next fetch that succeeds is the value.
    upstream.failing.store(false, Ordering::SeqCst);
    let refetched = eventually(Duration::from_secs(3), || async {
        other
            .get_or_fetch("USD", upstream.fetch("USD"))
            .await
            .is_ok()
    });
    assert!(refetched.await);
}

/// Garbage in Redis at a value's key, and a value of another type there: each is a
/// miss, and the value is fetched (and stored) again; never a panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn garbage_and_another_types_bytes_are_a_miss_and_a_fetch() {
    garbage_a_miss(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_garbage_and_another_types_bytes_are_a_miss_and_a_fetch() {
    garbage_a_miss(Redis::cluster()).await;
}

async fn garbage_a_miss(redis: Redis) {
    let (guard, eur) = instance(&redis, rates()).await;
    let upstream = Upstream::new(0.92, Duration::ZERO);
    // Garbage where the entry is.
    let keys = eur.cache_keys("EUR").unwrap();
    let () = redis
        .cmd(redis::cmd("SET").arg(keys.entry()).arg("not an entry"))
        .await;
    let rate = eur
        .get_or_fetch("EUR", upstream.fetch("EUR"))
        .await
        .unwrap();
    assert_eq!(rate.per_usd, 0.92);
    assert_eq!(upstream.calls(), 1);
    // (Garbage is a miss, written over by the fill: nothing was invalidated.)
    let invalidated: bool = redis
        .cmd(redis::cmd("EXISTS").arg(keys.invalidated_key()))
        .await;
    assert!(!invalidated);
    // Another type's entry, copied over this one's: decodes to no `Rate`. (On a
    // Cluster, `DUMP` and `RESTORE` are each routed by their own key.)
    let words = guard
        .values::<Vec<u8>>(Policy::builder("words").build().unwrap())
        .unwrap();
    let word = words
        .get_or_fetch("w", || async { Ok::<_, Down>(vec![]) })
        .await
        .unwrap();
    assert!(word.is_empty());
    let from = words.cache_keys("w").unwrap();
    let dump: Vec<u8> = redis.cmd(redis::cmd("DUMP").arg(from.entry())).await;
    // (With a TTL, as every entry has: one without is garbage of another kind.)
    let () = redis
        .cmd(
            redis::cmd("RESTORE")
                .arg(keys.entry())
                .arg(60_000)
                .arg(dump)
                .arg("REPLACE"),
        )
        .await;
    // A fresh instance, whose L1 holds nothing: it reads Redis.
    let (_, fresh) = instance(&redis, rates()).await;
    let rate = fresh
        .get_or_fetch("EUR", upstream.fetch("EUR"))
        .await
        .unwrap();
    assert_eq!(rate.per_usd, 0.92);
    assert_eq!(upstream.calls(), 2, "fetched again");
    assert!(
        fresh.stats().get(Event::DecodeFailure) >= 1,
        "{:?}",
        fresh.stats()
    );
    // Bytes that are no `Rate` were forgotten for the fleet (an invalidation), not only
    // written over.
    let invalidated: bool = redis
        .cmd(redis::cmd("EXISTS").arg(keys.invalidated_key()))
        .await;
    assert!(invalidated, "the undecodable entry was not invalidated");
    // And stored again: a third instance reads it without a fetch.
    let (_, third) = instance(&redis, rates()).await;
    let rate = third
        .get_or_fetch("EUR", upstream.fetch("EUR"))
        .await
        .unwrap();
    assert_eq!(rate.per_usd, 0.92);
    assert_eq!(upstream.calls(), 2);
}

/// A purge of the route's tag on one instance: hard, the next call on the other fetches
/// again; soft, it gets the purged value at once while one refresh fetches the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_purge_of_the_routes_tag_reaches_the_values_of_every_instance() {
    purge_reaches_every_instance(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_a_purge_of_the_routes_tag_reaches_the_values_of_every_instance() {
    purge_reaches_every_instance(Redis::cluster()).await;
}

async fn purge_reaches_every_instance(redis: Redis) {
    use stampede_guard::Purge;
    let policy = || {
        Policy::builder("rates")
            .fresh_ttl(Duration::from_secs(3600))
            .grace(Duration::from_secs(3600))
            .tags(["fx"])
            .build()
            .unwrap()
    };
    let (a_guard, a) = instance(&redis, policy()).await;
    let (_, b) = instance(&redis, policy()).await;
    let upstream = Upstream::new(0.92, Duration::ZERO);
    for values in [&a, &b] {
        let rate = values.get_or_fetch("EUR", upstream.fetch("EUR")).await;
        assert_eq!(rate.unwrap().per_usd, 0.92);
    }
    assert_eq!(upstream.calls(), 1);
    upstream.set(0.95);
    within(
        HANG,
        a_guard.purge_tags(["fx"], Purge::Hard),
        "the hard purge",
    )
    .await
    .unwrap();
    let seen = eventually(Duration::from_secs(3), || async {
        let rate = b.get_or_fetch("EUR", upstream.fetch("EUR")).await;
        rate.unwrap().per_usd == 0.95
    });
    assert!(seen.await, "the other instance served the purged value");
    assert_eq!(upstream.calls(), 2);
    upstream.set(0.97);
    within(
        HANG,
        a_guard.purge_tags(["fx"], Purge::Soft),
        "the soft purge",
    )
    .await
    .unwrap();
    // Soft: the purged value stands in at once (stale) while one refresh fetches.
    let refreshed = eventually(Duration::from_secs(3), || async {
        let rate = b.get_or_fetch("EUR", upstream.fetch("EUR")).await.unwrap();
        assert!([0.95, 0.97].contains(&rate.per_usd), "{rate:?}");
        rate.per_usd == 0.97
    });
    assert!(refreshed.await, "the soft purge was never refreshed");
    assert_eq!(upstream.calls(), 3, "one refresh for the soft purge");
}
