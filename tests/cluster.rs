//! The store on a real Redis Cluster (three primaries, a replica each): every script
//! runs there without `CROSSSLOT`, keys spread over every primary, notices reach every
//! instance.

mod support;

use std::time::Duration;

use http::StatusCode;
use stampede_guard::keys::{KeySpace, LeaseName, Scope};
use stampede_guard::lease::{AcquireOutcome, LeaseClient, ReleaseOutcome, RenewOutcome};
use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::TIMEOUT;
use support::web::{self, Origin, get, keys, send};
use support::{HANG, Proxy, RedisCluster, eventually, within};

fn store(cluster: &RedisCluster) -> RedisStore {
    RedisStore::cluster(cluster.urls())
        .command_timeout(TIMEOUT)
        .build()
        .unwrap()
}

/// A store that speaks to `cluster` as a user allowed only what `KeySpace::acl_rules`
/// allows, set on every node (ACL users are not replicated).
fn least_privileged_store(cluster: &RedisCluster) -> RedisStore {
    least_privileged_store_with(cluster, TIMEOUT)
}

/// [`least_privileged_store`], with `timeout` as its command timeout.
fn least_privileged_store_with(cluster: &RedisCluster, timeout: Duration) -> RedisStore {
    let rules = keys().acl_rules();
    for node in cluster.servers() {
        let mut args = vec!["ACL", "SETUSER", "guard", "on", ">guard-pw"];
        args.extend(rules.split_whitespace());
        let reply = support::cluster::cli(node.addr().port(), &args).unwrap();
        assert_eq!(reply.trim(), "OK");
    }
    RedisStore::cluster(cluster.urls())
        .username("guard")
        .password("guard-pw")
        .command_timeout(timeout)
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

/// The cache's scripts on a cluster, through two instances of the guard, as a user
/// allowed only what `KeySpace::acl_rules` allows: a fill (lease, fenced write, notice),
/// a read of L2 by the other instance, an invalidation that reaches both, a refill.
/// Entries of many keys land on every primary.
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
        StampedeGuard::builder(least_privileged_store(&cluster), keys())
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
    assert_eq!(primaries.len(), 3, "{:#?}", cluster.topology());
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

/// Load on two instances while the cluster fails over twice: a replica takes over by
/// `CLUSTER FAILOVER` (nothing lost), then a primary is killed and its replica promoted
/// (what the primary had not replicated yet may be lost). What holds, and is asserted:
///
/// - no request gets a 5xx, and every request is answered;
/// - in L2, no key's entry is ever replaced by one with a lower fencing token, before
///   the kill and after the promotion; across the kill, a key may go back to what the
///   replica had (lost writes), and every entry written after the promotion has a
///   token above every token seen before the kill (tokens come from the server's clock,
///   so they keep increasing across a failover);
/// - refreshes write again after each failover.
///
/// What does not hold, by design: an instance that refreshed an entry on its own while
/// it could not reach Redis stores it under the token of the entry it replaced, so the
/// fleet's next entry wins over it when Redis is back, even if the fleet's was fetched
/// from the origin earlier; for one refresh, that instance may serve an older version
/// than it served during the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failovers_under_load_give_no_5xx_and_never_a_lower_token() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

    let mut cluster = RedisCluster::start_failing_over_after(Duration::from_secs(2));
    let origin = Origin::versions(Duration::from_millis(5));
    let policy = || {
        Policy::builder("items")
            .fresh_ttl(Duration::from_millis(200))
            .grace(Duration::from_secs(60))
            .build()
            .unwrap()
    };
    let guard = || {
        StampedeGuard::builder(store(&cluster), keys())
            .build()
            .unwrap()
    };
    let fleet = Arc::new(vec![
        web::instance(guard(), policy(), origin.service()).await,
        web::instance(guard(), policy(), origin.service()).await,
    ]);
    const KEYS: usize = 12;
    let path = |n: usize| format!("/items/{n}");
    for n in 0..KEYS {
        for i in fleet.iter() {
            assert_eq!(send(&i.service, get(&path(n))).await.status, 200);
        }
    }
    let entries: Vec<String> = (0..KEYS)
        .map(|n| {
            let keys = fleet[0].layer.cache_keys(&get(&path(n))).unwrap();
            keys.entry().to_owned()
        })
        .collect();

    let stop = Arc::new(AtomicBool::new(false));
    // Load: every request answered, none with a 5xx.
    let workers = web::load(&fleet, KEYS, 4, &stop);
    // A watcher of L2: each key's entry token, with the phase it was seen in (0 before
    // the kill, 1 until the promotion is done, 2 after).
    let phase = Arc::new(AtomicU8::new(0));
    let watcher = {
        let (stop, phase, entries, urls) =
            (stop.clone(), phase.clone(), entries.clone(), cluster.urls());
        tokio::spawn(async move {
            let client = redis::cluster::ClusterClient::new(urls).unwrap();
            let mut conn = client.get_async_connection().await.unwrap();
            let mut seen: Vec<Vec<(u8, u64)>> = vec![Vec::new(); entries.len()];
            while !stop.load(Ordering::Relaxed) {
                for (n, entry) in entries.iter().enumerate() {
                    let now = phase.load(Ordering::SeqCst);
                    let mut hget = redis::cmd("HGET");
                    hget.arg(entry).arg("t");
                    let read = hget.query_async(&mut conn);
                    let token: Option<String> =
                        match tokio::time::timeout(Duration::from_millis(500), read).await {
                            Ok(Ok(token)) => token,
                            // A node going away: look again later.
                            _ => continue,
                        };
                    if let Some(token) = token.and_then(|t| t.parse().ok()) {
                        seen[n].push((now, token));
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seen
        })
    };

    let written = || {
        fleet
            .iter()
            .map(|i| i.layer.stats().get(Event::RefreshWritten))
            .sum::<u64>()
    };
    let refreshes_resume = |label: &'static str| {
        let before = written();
        async move {
            assert!(
                eventually(Duration::from_secs(15), || async {
                    written() > before + KEYS as u64
                })
                .await,
                "refreshes did not resume after {label}"
            );
        }
    };
    refreshes_resume("the start").await;

    // A replica takes over, gracefully.
    let topology = cluster.topology();
    let replica = topology.iter().find(|n| n.of.is_some()).unwrap().port;
    assert!(support::cluster::cli(replica, &["CLUSTER", "FAILOVER"]).is_some());
    assert!(
        eventually(Duration::from_secs(15), || async {
            cluster.primaries().contains(&replica)
        })
        .await,
        "the replica on {replica} did not take over"
    );
    cluster.wait_formed();
    refreshes_resume("CLUSTER FAILOVER").await;

    // A primary dies; its replica is promoted.
    let victim = cluster.primaries()[0];
    phase.store(1, Ordering::SeqCst);
    cluster.server(victim).kill();
    assert!(
        eventually(Duration::from_secs(20), || async {
            cluster.primaries().len() == 3
        })
        .await,
        "no replica took over from the killed primary on {victim}"
    );
    cluster.wait_formed();
    phase.store(2, Ordering::SeqCst);
    refreshes_resume("a killed primary").await;

    stop.store(true, Ordering::Relaxed);
    let mut answered = 0;
    for worker in workers {
        answered += within(HANG, worker, "a load worker").await.unwrap();
    }
    let seen = within(HANG, watcher, "the watcher").await.unwrap();
    let errors: u64 = fleet
        .iter()
        .map(|i| i.layer.stats().get(Event::RedisError))
        .sum();
    eprintln!("{answered} requests answered; {errors} Redis errors met and fallen back from");
    assert!(answered > 1000, "only {answered} requests were answered");

    let mut new_after = 0;
    for (n, tokens) in seen.iter().enumerate() {
        for window in tokens.windows(2) {
            let ((p0, t0), (p1, t1)) = (window[0], window[1]);
            if p0 == p1 && p0 != 1 {
                assert!(
                    t1 >= t0,
                    "/items/{n}: token {t1} replaced {t0} (phase {p0})"
                );
            }
        }
        let before: Vec<u64> = tokens
            .iter()
            .filter(|(p, _)| *p == 0)
            .map(|(_, t)| *t)
            .collect();
        let highest = before.iter().copied().max().unwrap_or(0);
        for &(_, token) in tokens.iter().filter(|(p, _)| *p == 2) {
            if !before.contains(&token) {
                new_after += 1;
                assert!(
                    token > highest,
                    "/items/{n}: token {token} written after the promotion, {highest} before the kill"
                );
            }
        }
    }
    assert!(new_after > 0, "no entry was written after the promotion");
}

/// The inspection tool on a cluster: `SCAN` on every primary, each with its cursor,
/// never `KEYS`; every entry is listed, whichever primary holds it.
#[tokio::test]
async fn the_inspector_scans_every_primary() {
    use stampede_guard::inspect::{self, ItemKind};

    let cluster = RedisCluster::start();
    let origin = Origin::versions(Duration::ZERO);
    let policy = Policy::builder("items")
        .fresh_ttl(Duration::from_secs(60))
        .build()
        .unwrap();
    let guard = StampedeGuard::builder(store(&cluster), keys())
        .build()
        .unwrap();
    let a = web::instance(guard, policy, origin.service()).await;
    const ENTRIES: usize = 150;
    for n in 0..ENTRIES {
        assert_eq!(
            send(&a.service, get(&format!("/items/{n}"))).await.status,
            200
        );
    }
    let store = store(&cluster);
    let pattern = inspect::pattern("sg", "test", "catalog").unwrap();
    let items = inspect::list(&store, &pattern, 10_000).await.unwrap();
    let entries = items.iter().filter(|i| i.kind == ItemKind::Entry).count();
    assert_eq!(entries, ENTRIES, "entries listed");
    let primaries = cluster.primaries();
    assert_eq!(primaries.len(), 3);
    for port in primaries {
        let stats = support::cluster::cli(port, &["INFO", "commandstats"]).unwrap();
        assert!(
            stats.contains("cmdstat_scan:"),
            "no SCAN on the primary on {port}"
        );
        assert!(
            !stats.contains("cmdstat_keys:"),
            "KEYS on the primary on {port}"
        );
    }
}

/// A replica promoted while missing the primary's last writes: the replica is paused,
/// the primary takes writes (refreshes under load), the primary is killed, the replica
/// resumes and is promoted. Asserted, as what holds:
///
/// - no request gets a 5xx;
/// - the writes the replica missed are lost (its entries are older than the killed
///   primary's last ones): the test checks it did make the scenario (the load pauses
///   while the replica is promoted, so that the loss is seen before refreshes replace
///   it; the replication link is also cut on the primary's side, as a paused process
///   still receives what its socket buffered);
/// - leases and fences recover: refreshes write again on the promoted replica, and every
///   token it issues is above every token issued before the kill, lost ones included
///   (tokens come from the server's clock, not from the lost counter).
///
/// Not guaranteed: what was written only to the lost primary is gone, so an instance
/// that had not read it serves the older entry until the next refresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_promoted_without_the_last_writes_recovers_with_higher_tokens() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let mut cluster = RedisCluster::start_failing_over_after(Duration::from_secs(2));
    let origin = Origin::versions(Duration::from_millis(5));
    let policy = || {
        Policy::builder("items")
            .fresh_ttl(Duration::from_millis(200))
            .grace(Duration::from_secs(60))
            .build()
            .unwrap()
    };
    let guard = || {
        StampedeGuard::builder(store(&cluster), keys())
            .build()
            .unwrap()
    };
    let fleet = Arc::new(vec![
        web::instance(guard(), policy(), origin.service()).await,
        web::instance(guard(), policy(), origin.service()).await,
    ]);
    const KEYS: usize = 12;
    let path = |n: usize| format!("/items/{n}");
    for n in 0..KEYS {
        assert_eq!(send(&fleet[0].service, get(&path(n))).await.status, 200);
    }
    let entries: Vec<String> = (0..KEYS)
        .map(|n| {
            let keys = fleet[0].layer.cache_keys(&get(&path(n))).unwrap();
            keys.entry().to_owned()
        })
        .collect();
    // The primary that holds the most of these entries, and its replica.
    let topology = cluster.topology();
    let holds = |port: u16| {
        entries
            .iter()
            .filter(|e| {
                support::cluster::cli(port, &["EXISTS", e]).is_some_and(|r| r.trim() == "1")
            })
            .cloned()
            .collect::<Vec<_>>()
    };
    let primary = topology
        .iter()
        .filter(|n| n.primary)
        .max_by_key(|n| holds(n.port).len())
        .unwrap()
        .clone();
    let on_primary = holds(primary.port);
    assert!(!on_primary.is_empty());
    let replica = topology
        .iter()
        .find(|n| n.of.as_deref() == Some(primary.id.as_str()))
        .unwrap()
        .port;
    let token_at = |port: u16, entry: &str| -> Option<u64> {
        support::cluster::cli(port, &["HGET", entry, "t"])?
            .trim()
            .parse()
            .ok()
    };

    let stop = Arc::new(AtomicBool::new(false));
    let workers = web::load(&fleet, KEYS, 2, &stop);

    // The replica stops replicating (once it has caught up: a replica that never
    // did is not promoted at all); the primary goes on taking refreshes.
    cluster.wait_replicating(replica);
    cluster.server(replica).pause();
    // What a paused process has not read still reaches it from its socket when it
    // resumes: cut the replication link on the primary's side as well, so that what
    // the primary takes from now on stays on the primary.
    assert!(support::cluster::cli(primary.port, &["CLIENT", "KILL", "TYPE", "replica"]).is_some());
    let before: Vec<u64> = on_primary
        .iter()
        .map(|e| token_at(primary.port, e).unwrap_or(0))
        .collect();
    assert!(
        eventually(Duration::from_secs(10), || async {
            on_primary
                .iter()
                .zip(&before)
                .all(|(e, b)| token_at(primary.port, e).is_some_and(|t| t > *b))
        })
        .await,
        "the primary took no writes while its replica was paused"
    );
    // The load stops, so that nothing is written while the replica is promoted and the
    // loss can be seen; then: every token issued so far, on the primary about to die.
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        within(HANG, worker, "a load worker").await.unwrap();
    }
    let highest = on_primary
        .iter()
        .filter_map(|e| token_at(primary.port, e))
        .max()
        .unwrap();
    cluster.server(primary.port).kill();
    cluster.server(replica).resume();
    assert!(
        eventually(Duration::from_secs(30), || async {
            cluster.primaries().contains(&replica)
        })
        .await,
        "the replica was not promoted:\n{}",
        cluster.server(replica).log()
    );
    cluster.wait_formed();
    // The replica missed writes: at least one of its entries is older than the
    // primary's last.
    let lost = on_primary
        .iter()
        .filter(|e| token_at(replica, e).is_none_or(|t| t < highest))
        .count();
    assert!(
        lost > 0,
        "the replica had every write: the test made no loss"
    );
    // Under load again, refreshes write on it, with tokens above every token issued
    // before.
    let stop = Arc::new(AtomicBool::new(false));
    let workers = web::load(&fleet, KEYS, 2, &stop);
    assert!(
        eventually(Duration::from_secs(20), || async {
            on_primary
                .iter()
                .all(|e| token_at(replica, e).is_some_and(|t| t > highest))
        })
        .await,
        "entries on the promoted replica did not get tokens above {highest}"
    );
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        within(HANG, worker, "a load worker").await.unwrap();
    }
}

/// The node an instance listens for notices on is killed: instance b is given that one
/// node only, so that it subscribes there, and must find another node through the
/// cluster. It subscribes again (its entries go stale, as after any lost subscription,
/// and are refreshed), and an invalidation sent afterwards by another instance reaches
/// it while its entry is fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notices_are_heard_again_after_the_node_listened_on_dies() {
    let mut cluster = RedisCluster::start_failing_over_after(Duration::from_secs(2));
    let origin = Origin::versions(Duration::ZERO);
    let policy = || {
        Policy::builder("items")
            .fresh_ttl(Duration::from_secs(60))
            .build()
            .unwrap()
    };
    let a = web::instance(
        StampedeGuard::builder(store(&cluster), keys())
            .build()
            .unwrap(),
        policy(),
        origin.service(),
    )
    .await;
    let listened_on = cluster.servers()[0].addr().port();
    let only = RedisStore::cluster([cluster.servers()[0].url()])
        .command_timeout(TIMEOUT)
        .build()
        .unwrap();
    let b = web::instance(
        StampedeGuard::builder(only, keys()).build().unwrap(),
        policy(),
        origin.service(),
    )
    .await;
    assert_eq!(send(&a.service, get("/items/1")).await.body, "v1");
    assert_eq!(send(&b.service, get("/items/1")).await.body, "v1");

    cluster.server(listened_on).kill();
    assert!(
        eventually(Duration::from_secs(30), || async {
            cluster.primaries().len() == 3
        })
        .await,
        "the cluster did not recover from losing the node on {listened_on}"
    );
    cluster.wait_formed();
    // b subscribed again (elsewhere: its one node is gone): its entry went stale.
    let service = &b.service;
    assert!(
        eventually(Duration::from_secs(15), || async {
            send(service, get("/items/1")).await.x_cache() == "stale"
        })
        .await,
        "b did not subscribe again"
    );
    // Refreshed, it answers a hit again (fresh for a minute): only a notice can change
    // it now.
    assert!(
        eventually(Duration::from_secs(15), || async {
            send(service, get("/items/1")).await.x_cache() == "hit"
        })
        .await,
        "b did not come back to a fresh entry"
    );
    let held = send(service, get("/items/1")).await.body;
    // The invalidation is sent through Redis once Redis takes it again.
    assert!(
        eventually(Duration::from_secs(15), || async {
            a.layer
                .invalidate(&get("/items/1"))
                .await
                .is_ok_and(|existed| existed)
        })
        .await,
        "invalidations did not go through after the failover"
    );
    assert!(
        eventually(Duration::from_secs(15), || async {
            send(service, get("/items/1")).await.body != held
        })
        .await,
        "b kept serving the invalidated entry: the notice did not reach it"
    );
}

/// Every slot of the primary that holds the most entries moves to another primary
/// (`redis-cli --cluster reshard`) while two instances serve under load, as the
/// least-privileged user: the `ASK` and `MOVED` answers of the move are followed
/// (`ASKING` included), and none of it becomes a Redis error of the guard; no request
/// fails, and every entry is found on its new primary afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn resharding_under_load_is_followed_without_errors() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let cluster = RedisCluster::start();
    let origin = Origin::versions(Duration::from_millis(5));
    // A deadline no busy machine reaches: what is counted is what the move did.
    const PATIENT: Duration = Duration::from_secs(2);
    let policy = || {
        Policy::builder("items")
            .fresh_ttl(Duration::from_millis(200))
            .grace(Duration::from_secs(60))
            .lease_ttl(Duration::from_secs(10))
            .refresh_timeout(Duration::from_secs(10))
            .error_backoff(Duration::from_secs(10))
            .build()
            .unwrap()
    };
    let guard = || {
        StampedeGuard::builder(least_privileged_store_with(&cluster, PATIENT), keys())
            .build()
            .unwrap()
    };
    let fleet = Arc::new(vec![
        web::instance(guard(), policy(), origin.service()).await,
        web::instance(guard(), policy(), origin.service()).await,
    ]);
    const KEYS: usize = 12;
    for n in 0..KEYS {
        assert_eq!(
            send(&fleet[0].service, get(&format!("/items/{n}")))
                .await
                .status,
            200
        );
    }
    let entries: Vec<String> = (0..KEYS)
        .map(|n| {
            let keys = fleet[0]
                .layer
                .cache_keys(&get(&format!("/items/{n}")))
                .unwrap();
            keys.entry().to_owned()
        })
        .collect();
    let holds = |port: u16| {
        entries
            .iter()
            .filter(|e| {
                support::cluster::cli(port, &["EXISTS", e]).is_some_and(|r| r.trim() == "1")
            })
            .count()
    };
    let topology = cluster.topology();
    let primaries: Vec<_> = topology.iter().filter(|n| n.primary).collect();
    let from = *primaries.iter().max_by_key(|n| holds(n.port)).unwrap();
    let to = *primaries.iter().find(|n| n.id != from.id).unwrap();
    let moved = holds(from.port);
    assert!(moved > 0);

    let stop = Arc::new(AtomicBool::new(false));
    let workers = web::load(&fleet, KEYS, 2, &stop);
    let reshard = {
        let (from, to, port) = (from.id.clone(), to.id.clone(), to.port);
        tokio::task::spawn_blocking(move || {
            support::cluster::cli(
                port,
                &[
                    "--cluster",
                    "reshard",
                    &format!("127.0.0.1:{port}"),
                    "--cluster-from",
                    &from,
                    "--cluster-to",
                    &to,
                    "--cluster-slots",
                    "16384",
                    "--cluster-yes",
                ],
            )
        })
    };
    let output = within(Duration::from_secs(120), reshard, "the reshard")
        .await
        .unwrap();
    assert!(output.is_some(), "redis-cli --cluster reshard failed");
    stop.store(true, Ordering::Relaxed);
    let mut answered = 0;
    for worker in workers {
        answered += within(HANG, worker, "a load worker").await.unwrap();
    }
    assert_eq!(holds(from.port), 0, "entries left on the emptied primary");
    assert!(
        holds(to.port) >= moved,
        "the moved entries are not on the new primary"
    );
    let errors: u64 = fleet
        .iter()
        .map(|i| i.layer.stats().get(Event::RedisError))
        .sum();
    assert_eq!(
        errors, 0,
        "the move became Redis errors ({answered} requests)"
    );
}

/// How many keys of the cluster's primaries match `pattern` (scanned on each).
fn keys_matching(cluster: &RedisCluster, pattern: &str) -> usize {
    cluster
        .primaries()
        .into_iter()
        .map(|port| {
            support::cluster::cli(port, &["--scan", "--pattern", pattern])
                .unwrap_or_default()
                .lines()
                .filter(|l| !l.trim().is_empty())
                .count()
        })
        .sum()
}

/// A body over 512 KiB is kept in parts beside its entry, in the entry's hash slot: on
/// a cluster, as the least-privileged user, the parts and the entry are written (no
/// `CROSSSLOT`), another instance reads the body whole from them, and an invalidation
/// takes them with the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_in_parts_lives_in_its_entrys_slot() {
    const LEN: usize = 2 * 1024 * 1024 + 7;
    let cluster = RedisCluster::start();
    let origin = Origin::new(Duration::ZERO, |n, _| {
        http::Response::new(support::web::full(vec![n as u8; LEN]))
    });
    let policy = || {
        Policy::builder("items")
            .fresh_ttl(Duration::from_secs(60))
            .max_body(4 << 20)
            .build()
            .unwrap()
    };
    let guard = || {
        StampedeGuard::builder(least_privileged_store(&cluster), keys())
            .build()
            .unwrap()
    };
    let a = web::instance(guard(), policy(), origin.service()).await;
    let b = web::instance(guard(), policy(), origin.service()).await;
    let filled = send(&a.service, get("/items/large")).await;
    assert_eq!((filled.x_cache(), filled.body.len()), ("miss", LEN));
    let entry = a.layer.cache_keys(&get("/items/large")).unwrap();
    let parts = format!("{}:p:*", entry.entry());
    assert_eq!(keys_matching(&cluster, &parts), 5);
    let read = send(&b.service, get("/items/large")).await;
    assert_eq!((read.x_cache(), read.body.len()), ("hit", LEN));
    assert!(read.body.bytes().all(|b| b == 1));
    assert_eq!(origin.calls(), 1);
    assert_eq!(a.layer.stats().get(Event::RedisError), 0);
    assert_eq!(b.layer.stats().get(Event::RedisError), 0);
    // A range is read part by part, checked whole first (one script over the parts'
    // keys, in the entry's slot).
    let mut ranged = get("/items/large");
    let range = http::HeaderValue::from_static("bytes=600000-600099");
    ranged.headers_mut().insert("range", range);
    let part = send(&b.service, ranged).await;
    assert_eq!(
        (part.status, part.x_cache()),
        (StatusCode::PARTIAL_CONTENT, "hit")
    );
    assert_eq!(part.body, "\u{1}".repeat(100));
    assert!(a.layer.invalidate(&get("/items/large")).await.unwrap());
    assert_eq!(keys_matching(&cluster, &parts), 0);
    // A crowd on both instances, of an answer its origin takes 300 ms to give: one
    // origin call for the fleet, every body whole on both.
    let slow = Origin::new(Duration::from_millis(300), |n, _| {
        http::Response::new(support::web::full(vec![n as u8; LEN]))
    });
    let a = web::instance(guard(), policy(), slow.service()).await;
    let b = web::instance(guard(), policy(), slow.service()).await;
    let crowd: Vec<_> = (0..40)
        .map(|i| {
            let service = if i % 2 == 0 { &a.service } else { &b.service }.clone();
            tokio::spawn(async move { send(&service, get("/items/crowd")).await })
        })
        .collect();
    for got in web::all_within(crowd, Duration::from_secs(60), "the crowd").await {
        assert_eq!((got.status, got.body.len()), (StatusCode::OK, LEN));
        assert!(got.body.bytes().all(|b| b == 1), "a wrong byte");
    }
    assert_eq!(slow.calls(), 1, "one origin call for the fleet");
}

/// A connection that a NAT or a firewall forgot (silent for good, never reset) to one
/// primary among healthy ones: the command that timed out on it retires the cluster
/// connection, and the store, connected again, answers (a `PING` asks every primary).
/// Kept, every command for that primary's slots would time out for good: redis-rs
/// never hears of a timeout the store puts on its commands. Each primary announces a
/// proxy in front of it as its address, so that the store's connections pass through
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_a_nat_forgot_is_retired_and_the_cluster_answers_again() {
    use support::cluster::cli;
    let cluster = RedisCluster::start();
    let mut proxies = Vec::new();
    for port in cluster.primaries() {
        let proxy = Proxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], port))).await;
        // The bus keeps its own port: by default it follows the announced one.
        let bus = (u32::from(port) + 10_000).to_string();
        let announced = proxy.addr().port().to_string();
        for (name, value) in [
            ("cluster-announce-bus-port", &bus),
            ("cluster-announce-port", &announced),
        ] {
            let reply = cli(port, &["CONFIG", "SET", name, value]).unwrap();
            assert_eq!(reply.trim(), "OK", "{name}");
        }
        proxies.push(proxy);
    }
    let announced = || {
        cluster.servers().iter().all(|node| {
            cli(node.addr().port(), &["CLUSTER", "SLOTS"]).is_some_and(|slots| {
                proxies.iter().all(|p| {
                    slots
                        .lines()
                        .any(|l| l.trim() == p.addr().port().to_string())
                })
            })
        })
    };
    assert!(
        eventually(HANG, || async { announced() }).await,
        "every node names the proxies"
    );
    let store = store(&cluster);
    within(HANG, store.ping(), "the first ping").await.unwrap();
    let made = proxies[0].accepted();
    let failed = support::proxy::forgotten_then_answering(&store, &[&proxies[0]], HANG).await;
    let failed = failed.expect("the store answers again");
    assert!(
        failed >= 1,
        "the first ping was sent on a forgotten connection"
    );
    assert!(
        proxies[0].accepted() > made,
        "the primary was connected again"
    );
}
