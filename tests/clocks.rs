//! One clock for every stamp compared with a purge: Redis's. A fill made without the
//! lease is stamped on the time Redis last issued this process (a lease's token, a
//! purge's time) plus what the monotonic clock counted since, not on this machine's
//! wall clock, so that a hard purge made after it reaches it and one made before it
//! does not, whichever way this machine's clock is skewed. (A test binary of its own:
//! it skews the clock of the whole process.)

mod support;

use std::time::Duration;

use http::Response;
use stampede_guard::lease::{AcquireOutcome, LeaseClient};
use stampede_guard::metrics::Event;
use stampede_guard::store::BreakerConfig;
use stampede_guard::{Policy, Purge, RedisStore, StampedeGuard};
use support::web::{Origin, full, get, keys, send};
use support::{Mode, Proxy, RedisServer, eventually};

/// Held by each test: each skews the clock of the whole process.
static SKEWED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_without_the_lease_is_stamped_on_redis_clock_however_this_machine_is_skewed() {
    let _alone = SKEWED.lock().await;
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, _| Response::new(full(format!("v{n}"))));
    let store = || {
        RedisStore::builder(server.url())
            .command_timeout(Duration::from_millis(500))
            .build()
            .unwrap()
    };
    let policy = Policy::builder("items")
        .fresh_ttl(Duration::from_secs(600))
        .grace(Duration::from_secs(600))
        .tags(["catalog"])
        .lease_ttl(Duration::from_secs(10))
        .error_backoff(Duration::from_secs(2))
        // The lease is another's: its fill waits this long, then fills without it.
        .cold_wait(Duration::from_millis(300))
        .build()
        .unwrap();
    let guard = StampedeGuard::builder(store(), keys()).build().unwrap();
    let i = support::web::instance(guard, policy, origin.service()).await;
    // A fill under the lease: Redis's clock, learned.
    assert_eq!(send(&i.service, get("/items/warm")).await.x_cache(), "miss");
    let leases = LeaseClient::builder(store(), &keys()).build().unwrap();
    let minute = 60_000_000;
    for (skew, purged_after) in [(minute, true), (-minute, false)] {
        stampede_guard::fuzzing::skew_this_machines_clock(skew);
        let path = format!("/items/{}", if purged_after { "ahead" } else { "behind" });
        let keys = i.layer.cache_keys(&get(&path)).unwrap();
        // Another instance holds the key's lease, and keeps it.
        let AcquireOutcome::Acquired(_held) = leases
            .try_acquire(keys.lease(), Duration::from_secs(30))
            .await
        else {
            panic!("the lease is free");
        };
        if !purged_after {
            i.guard.purge_tags(["catalog"], Purge::Hard).await.unwrap();
        }
        let waited = i.layer.stats().get(Event::ColdWaitTimedOut);
        let filled = send(&i.service, get(&path)).await;
        assert_eq!(filled.x_cache(), "miss", "skew {skew}");
        assert_eq!(i.layer.stats().get(Event::ColdWaitTimedOut), waited + 1);
        if purged_after {
            // A purge after the fill reaches it (this machine's clock a minute ahead
            // stamped it a minute after the purge).
            i.guard.purge_tags(["catalog"], Purge::Hard).await.unwrap();
            let calls = origin.calls();
            let again = send(&i.service, get(&path)).await;
            assert_eq!(again.x_cache(), "miss", "skew {skew}: purged");
            assert_eq!(origin.calls(), calls + 1);
        } else {
            // A purge before the fill does not (this machine's clock a minute behind
            // stamped it a minute before the purge: it was refilled every time).
            let calls = origin.calls();
            let again = send(&i.service, get(&path)).await;
            assert_eq!(
                again.x_cache(),
                "hit",
                "skew {skew}: filled after the purge"
            );
            assert_eq!(again.body, filled.body);
            assert_eq!(origin.calls(), calls);
        }
    }
    stampede_guard::fuzzing::skew_this_machines_clock(0);
}

/// An invalidation's local tombstone is the fleet's time, not this machine's: with this
/// machine's clock a minute behind, an invalidation made while Redis cannot be reached
/// (its tombstone only local) keeps a fill that was in flight under the lease from
/// putting its answer in L1, and the next request fills again. (The tombstone, a
/// minute behind, was below the fill's token, Redis's time: the invalidated answer was
/// served as a hit.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_without_redis_outranks_a_fill_in_flight_however_this_machine_is_skewed() {
    let _alone = SKEWED.lock().await;
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let origin = Origin::versions(Duration::ZERO);
    let store = RedisStore::builder(proxy.url())
        .command_timeout(Duration::from_millis(500))
        .breaker(BreakerConfig {
            failures: u32::MAX,
            ..BreakerConfig::default()
        })
        .build()
        .unwrap();
    let policy = Policy::builder("items")
        .fresh_ttl(Duration::from_secs(600))
        .lease_ttl(Duration::from_secs(10))
        .refresh_timeout(Duration::from_secs(10))
        .error_backoff(Duration::from_secs(2))
        .build()
        .unwrap();
    let guard = StampedeGuard::builder(store, keys()).build().unwrap();
    let i = support::web::instance(guard, policy, origin.service()).await;
    // A fill under the lease: Redis's clock, learned.
    assert_eq!(send(&i.service, get("/items/warm")).await.x_cache(), "miss");
    stampede_guard::fuzzing::skew_this_machines_clock(-60_000_000);
    origin.hold(2);
    let service = i.service.clone();
    let fill = tokio::spawn(async move { send(&service, get("/items/x")).await });
    let called = eventually(Duration::from_secs(10), || async { origin.calls() == 2 });
    assert!(called.await, "the fill did not call the origin");
    // Redis out of reach: the invalidation's tombstone is only local.
    proxy.set(Mode::Blackhole);
    assert!(i.layer.invalidate(&get("/items/x")).await.is_err());
    origin.open();
    let filled = fill.await.unwrap();
    assert_eq!((filled.x_cache(), filled.body.as_str()), ("miss", "v2"));
    let again = send(&i.service, get("/items/x")).await;
    stampede_guard::fuzzing::skew_this_machines_clock(0);
    assert_eq!(
        (again.x_cache(), again.body.as_str()),
        ("miss", "v3"),
        "the answer of a fill the invalidation came after"
    );
}
