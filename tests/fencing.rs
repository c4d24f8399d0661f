//! Fenced writes: a cache write carries its lease's fencing token, and Redis refuses it
//! once a newer token was issued. A refresher that lost its lease cannot overwrite the
//! newer entry (one body, on a single server, on a Redis Cluster and as a user with only
//! what `KeySpace::acl_rules` allows); a write is refused against the last issued token
//! even if the newer entry is gone; an invalidation is not undone by a refresh that began
//! before it; a refused write never serves a purged entry.

mod support;

use std::convert::Infallible;
use std::time::Duration;

use http::Response;
use redis::AsyncCommands;
use stampede_guard::Policy;
use stampede_guard::metrics::Event;
use support::app::{instance, patient_policy, policy};
use support::web::{self, Instance, Origin, full, get, keys, ready_guard, send};
use support::{HANG, Redis, RedisServer, Store, eventually, within};

/// Two instances sharing `/items/1` (answered `v1`, then `second`, then `third`), the
/// entry gone stale, and instance a's refresh held in the origin with its lease taken.
async fn a_refresh_held_in_the_origin(
    server: &impl Store,
    second: &'static str,
    third: &'static str,
) -> (
    Origin,
    Vec<
        Instance<
            impl tower::Service<
                web::Req,
                Response = Response<web::Body>,
                Error = Infallible,
                Future: Send,
            > + Clone
            + Send
            + Sync
            + 'static,
        >,
    >,
) {
    let origin = Origin::new(Duration::ZERO, move |n, _| {
        Response::new(full(match n {
            1 => "v1",
            2 => second,
            _ => third,
        }))
    });
    let a = instance(server, policy("items").build().unwrap(), origin.service()).await;
    let b = instance(server, policy("items").build().unwrap(), origin.service()).await;
    assert_eq!(send(&a.service, get("/items/1")).await.body, "v1");
    assert_eq!(send(&b.service, get("/items/1")).await.body, "v1");
    tokio::time::sleep(Duration::from_millis(600)).await;

    origin.hold(2);
    let started = origin.started.notified();
    assert_eq!(send(&a.service, get("/items/1")).await.x_cache(), "stale");
    // a's refresh is in the origin, holding the lease
    within(HANG, started, "a's refresh reaching the origin").await;
    (origin, vec![a, b])
}

/// A refresher that lost its lease mid-refresh (here: the lease key is deleted, as a
/// failover or an eviction would) is overtaken by another instance; its late write is
/// refused in Redis, counted, and it takes the newer entry into its L1 instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresher_that_lost_its_lease_cannot_overwrite_the_newer_entry() {
    late_refresher_fenced(Redis::single()).await;
}

#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_refresher_that_lost_its_lease_cannot_overwrite_the_newer_entry() {
    late_refresher_fenced(Redis::cluster()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn as_the_least_privileged_user_a_refresher_that_lost_its_lease_cannot_overwrite_the_newer_entry()
 {
    late_refresher_fenced(Redis::least_privileged(&keys()).await).await;
}

async fn late_refresher_fenced(server: Redis) {
    let (origin, fleet) = a_refresh_held_in_the_origin(&server, "from-a-late", "from-b").await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let keys = a.layer.cache_keys(&get("/items/1")).unwrap();
    let deleted: i64 = server.cmd(redis::cmd("DEL").arg(keys.lease().key())).await;
    assert_eq!(deleted, 1, "a's lease was not there");

    assert_eq!(send(&b.service, get("/items/1")).await.x_cache(), "stale");
    assert!(
        eventually(Duration::from_secs(3), || async {
            b.layer.stats().get(Event::RefreshWritten) == 1
        })
        .await
    );
    origin.open();
    assert!(
        eventually(Duration::from_secs(3), || async {
            a.layer.stats().get(Event::FencedWriteRefused) == 1
        })
        .await
    );

    let data: Vec<u8> = server
        .cmd(redis::cmd("HGET").arg(keys.entry()).arg("d"))
        .await;
    let stored = stampede_guard::fuzzing::decode(&data).unwrap();
    assert_eq!(stored.body, "from-b");
    assert_eq!(origin.calls(), 3);
    // a serves the newer entry, never its own late result: at once (adopted when its
    // write was refused), or, if that look at L2 timed out on a slow machine, once its
    // next refresh has run.
    let service = &a.service;
    assert!(
        eventually(Duration::from_secs(3), || async {
            let got = send(service, get("/items/1")).await;
            assert_ne!(got.body, "from-a-late", "the late write reached a's L1");
            got.body == "from-b"
        })
        .await
    );
}

/// A's lease lapses while its refresh is in the origin; B takes the lease, refreshes
/// and writes; B's entry is then evicted. A's late write finds no newer entry, but a
/// newer token was issued since its own: it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_refused_when_a_newer_lease_was_issued_even_if_its_entry_is_gone() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
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
    assert_eq!(send(&a.service, get("/items/1")).await.body, "v1");
    assert_eq!(send(&b.service, get("/items/1")).await.body, "v1");
    tokio::time::sleep(Duration::from_millis(600)).await;
    origin.hold(2);
    let started = origin.started.notified();
    assert_eq!(send(&a.service, get("/items/1")).await.x_cache(), "stale");
    // A's refresh holds the lease, in the origin
    within(HANG, started, "A's refresh reaching the origin").await;

    let keys = a.layer.cache_keys(&get("/items/1")).unwrap();
    let mut conn = server.conn().await;
    let lapsed: i64 = conn.del(keys.lease().key()).await.unwrap();
    assert_eq!(lapsed, 1);
    assert_eq!(send(&b.service, get("/items/1")).await.x_cache(), "stale");
    assert!(
        eventually(Duration::from_secs(3), || async {
            b.layer.stats().get(Event::RefreshWritten) == 1
        })
        .await
    );
    let evicted: i64 = conn.del(keys.entry()).await.unwrap();
    assert_eq!(evicted, 1);
    origin.open();
    assert!(
        eventually(Duration::from_secs(3), || async {
            a.layer.stats().get(Event::FencedWriteRefused) == 1
        })
        .await,
        "{:?}",
        a.layer.stats()
    );
    let exists: bool = conn.exists(keys.entry()).await.unwrap();
    assert!(!exists, "the overtaken write landed");
    assert_eq!(a.layer.stats().get(Event::RefreshWritten), 0);
}

/// A refresh that took its lease (and read the origin) before an invalidation must not
/// bring the invalidated data back: its write meets the invalidation's tombstone, whose
/// token is newer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidation_is_not_undone_by_a_refresh_that_began_before_it() {
    let server = RedisServer::start();
    let (origin, fleet) =
        a_refresh_held_in_the_origin(&server, "read-before-invalidation", "after").await;
    let (a, b) = (&fleet[0], &fleet[1]);
    let item = get("/items/1");
    let invalidation = b.layer.invalidate(&item);
    assert!(
        within(HANG, invalidation, "the invalidation")
            .await
            .unwrap()
    );
    origin.open();
    assert!(
        eventually(Duration::from_secs(3), || async {
            a.layer.stats().get(Event::FencedWriteRefused) == 1
        })
        .await
    );
    // Neither instance serves the invalidated data, nor the refresh that predates it.
    for i in [a, b] {
        let got = send(&i.service, get("/items/1")).await;
        assert_eq!(got.body, "after", "{}", got.x_cache());
    }
    assert_eq!(origin.calls(), 3);
}

/// A hard purge, then a fill whose lease lapsed while it called the origin, and another
/// instance took the lease, filled and wrote, before the purge: the late write is
/// refused, and what Redis holds (the purged entry) is not what its callers get; they get
/// the late fill's own answer, which is not stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_never_serves_a_purged_entry() {
    let server = RedisServer::start();
    let tagged = || {
        Policy::builder("hot")
            .fresh_ttl(Duration::from_secs(30))
            .tags(["catalog"])
            .build()
            .unwrap()
    };
    let origin = support::web::Origin::versions(Duration::ZERO);
    let a = support::web::instance(ready_guard(&server).await, tagged(), origin.service()).await;
    let b = support::web::instance(ready_guard(&server).await, tagged(), origin.service()).await;
    origin.hold(1);
    let started = origin.started.notified();
    let late = {
        let service = a.service.clone();
        tokio::spawn(async move { support::web::send(&service, support::web::get("/hot")).await })
    };
    support::within(support::HANG, started, "the first fill's origin call").await;
    // Its lease lapses (as a TTL shorter than the call would make it), and B fills.
    let keys = a.layer.cache_keys(&support::web::get("/hot")).unwrap();
    let _: i64 = server.cmd(&["PEXPIRE", keys.lease().key(), "1"]).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let filled = support::web::send(&b.service, support::web::get("/hot")).await;
    assert_eq!((filled.body.as_str(), filled.x_cache()), ("v2", "miss"));
    // (Through A's guard, where it takes effect at once; elsewhere, when heard.)
    within_purge(&a.guard).await;
    origin.open();
    let got = support::joined(late, support::HANG, "the late fill's caller").await;
    assert_eq!(got.body, "v1", "the late fill's callers get its own answer");
    assert_eq!(a.layer.stats().get(Event::FencedWriteRefused), 1);
    // Nothing of it was stored: the next caller fills again.
    let next = support::web::send(&a.service, support::web::get("/hot")).await;
    assert_eq!((next.body.as_str(), next.x_cache()), ("v3", "miss"));
}

async fn within_purge(guard: &stampede_guard::StampedeGuard) {
    let purge = guard.purge_tags(["catalog"], stampede_guard::Purge::Hard);
    support::within(support::HANG, purge, "the purge")
        .await
        .unwrap();
}
