//! The store on a real Redis Cluster (three primaries, a replica each): every script
//! runs there without `CROSSSLOT`, keys spread over every primary, notices reach every
//! instance.

mod support;

use std::time::Duration;

use stampede_guard::keys::{KeySpace, LeaseName, Scope};
use stampede_guard::lease::{AcquireOutcome, LeaseClient, ReleaseOutcome, RenewOutcome};
use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::web::{self, Origin, get, keys, send};
use support::{HANG, RedisCluster, eventually, within};

/// Generous, as in the single-server tests; within what the default policies allow.
const TIMEOUT: Duration = Duration::from_millis(250);

fn store(cluster: &RedisCluster) -> RedisStore {
    RedisStore::cluster(cluster.urls())
        .command_timeout(TIMEOUT)
        .build()
        .unwrap()
}

fn lease_name(keys: &KeySpace, id: &str) -> LeaseName {
    keys.lease(
        &[Scope::label("quote"), Scope::id("quote", id)],
        "recalculate",
    )
    .unwrap()
}

/// The lease's scripts on a cluster: acquire, renew, hold off, release, on names whose
/// keys land on every primary; tokens keep increasing per name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lease_script_runs_on_the_cluster() {
    let cluster = RedisCluster::start();
    let keys = keys();
    let leases = LeaseClient::builder(store(&cluster), &keys)
        .build()
        .unwrap();
    let ttl = Duration::from_secs(5);
    for n in 0..30 {
        let name = lease_name(&keys, &n.to_string());
        let AcquireOutcome::Acquired(mut lease) = leases.try_acquire(&name, ttl).await else {
            panic!("lease {n} not acquired");
        };
        assert!(
            matches!(
                leases.try_acquire(&name, ttl).await,
                AcquireOutcome::Busy { .. }
            ),
            "lease {n} taken twice"
        );
        assert!(matches!(
            leases.renew(&mut lease, ttl).await,
            RenewOutcome::Renewed
        ));
        let first = lease.fencing_token();
        assert!(matches!(
            leases.hold_off(lease, Duration::from_millis(1)).await,
            ReleaseOutcome::Released
        ));
        let again = within(
            HANG,
            async {
                loop {
                    if let AcquireOutcome::Acquired(lease) = leases.try_acquire(&name, ttl).await {
                        return lease;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            },
            "the lease after its hold-off",
        )
        .await;
        assert!(
            again.fencing_token() > first,
            "tokens went back on lease {n}"
        );
        assert!(matches!(
            leases.release(again).await,
            ReleaseOutcome::Released
        ));
    }
    // The lease names' keys spread over every primary (fence counters stay).
    for port in cluster.primaries() {
        assert!(cluster.dbsize(port) > 0, "primary {port} holds no key");
    }
}

/// The cache's scripts on a cluster, through two instances of the guard: a fill (lease,
/// fenced write, notice), a read of L2 by the other instance, an invalidation that
/// reaches both, a refill. Entries of many keys land on every primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cache_script_runs_on_the_cluster_and_entries_spread_over_every_primary() {
    let cluster = RedisCluster::start();
    let origin = Origin::versions(Duration::ZERO);
    let policy = || {
        Policy::builder("items")
            .fresh_ttl(Duration::from_secs(60))
            .build()
            .unwrap()
    };
    let guard = || {
        StampedeGuard::builder(store(&cluster), keys())
            .build()
            .unwrap()
    };
    let a = web::instance(guard(), policy(), origin.service()).await;
    let b = web::instance(guard(), policy(), origin.service()).await;

    for n in 0..40 {
        let path = format!("/items/{n}");
        let filled = send(&a.service, get(&path)).await;
        assert_eq!(filled.x_cache(), "miss", "{path}");
        let read = send(&b.service, get(&path)).await;
        assert_eq!(read.x_cache(), "hit", "{path}: not read from L2");
        assert_eq!(read.body, filled.body);
    }
    assert_eq!(origin.calls(), 40);
    assert_eq!(b.layer.stats().get(Event::L2Hit), 40);
    assert_eq!(a.layer.stats().get(Event::RedisError), 0);
    assert_eq!(b.layer.stats().get(Event::RedisError), 0);
    let primaries = cluster.primaries();
    assert_eq!(primaries.len(), 3);
    for port in primaries {
        assert!(cluster.dbsize(port) > 0, "primary {port} holds no entry");
    }

    // An invalidation from a reaches b's L1 through the notice.
    assert!(a.layer.invalidate(&get("/items/3")).await.unwrap());
    assert!(
        eventually(Duration::from_secs(5), || async {
            send(&b.service, get("/items/3")).await.x_cache() == "miss"
        })
        .await,
        "b still serves the invalidated entry"
    );
    assert_eq!(origin.calls(), 41);
    assert_eq!(send(&a.service, get("/items/3")).await.x_cache(), "hit");
}
