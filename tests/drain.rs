//! `StampedeGuard::drained`: what a graceful shutdown waits for, on a real Redis.

mod support;

use std::time::Duration;

use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::web::{Origin, get, instance, keys, send};
use support::{HANG, RedisServer, eventually};

#[tokio::test]
async fn drained_waits_for_the_refresh_to_write() {
    let redis = RedisServer::start();
    let store = || RedisStore::builder(redis.url()).build().unwrap();
    // Long enough that the second instance reads the entry while it is fresh.
    let fresh = Duration::from_secs(2);
    let policy = || {
        Policy::builder("items")
            .fresh_ttl(fresh)
            .grace(Duration::from_secs(60))
            .lease_ttl(Duration::from_secs(20))
            .refresh_timeout(Duration::from_secs(20))
            .build()
            .unwrap()
    };
    let origin = Origin::versions(Duration::ZERO);
    let a = instance(
        StampedeGuard::builder(store(), keys()).build().unwrap(),
        policy(),
        origin.service(),
    )
    .await;
    assert!(a.guard.drained(Duration::ZERO).await, "nothing at work yet");

    let filled = send(&a.service, get("/items/1")).await;
    assert_eq!((filled.x_cache(), filled.body.as_str()), ("miss", "v1"));
    assert!(
        a.guard.drained(HANG).await,
        "the fill is over once answered"
    );

    // The refresh's origin call waits at the gate.
    origin.hold(2);
    tokio::time::sleep(fresh + Duration::from_millis(100)).await;
    let stale = send(&a.service, get("/items/1")).await;
    assert_eq!((stale.x_cache(), stale.body.as_str()), ("stale", "v1"));
    assert!(eventually(HANG, || async { origin.in_flight() == 1 }).await);
    assert!(
        !a.guard.drained(Duration::from_millis(50)).await,
        "the refresh is at work"
    );

    let waiting = tokio::spawn({
        let guard = a.guard.clone();
        async move { guard.drained(HANG).await }
    });
    origin.open();
    assert!(
        support::joined(waiting, HANG, "drained").await,
        "drained once the refresh ended"
    );

    // It had written Redis by then: another instance reads the new entry from L2.
    let b = instance(
        StampedeGuard::builder(store(), keys()).build().unwrap(),
        policy(),
        origin.service(),
    )
    .await;
    let read = send(&b.service, get("/items/1")).await;
    assert_eq!((read.x_cache(), read.body.as_str()), ("hit", "v2"));
    assert_eq!(origin.calls(), 2, "no origin call for the read");
}
