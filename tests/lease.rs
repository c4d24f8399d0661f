//! The lease against real Redis servers, one per test.

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use stampede_guard::keys::{KeySpace, LeaseName, Scope};
use stampede_guard::lease::{
    AcquireOutcome, FencingToken, Lease, LeaseClient, ReleaseOutcome, RenewOutcome,
};
use stampede_guard::store::{RedisStore, StoreErrorKind};
use support::{HANG, Mode, Proxy, RedisServer, eventually, within};
use tokio::sync::Barrier;

/// What a timing assertion allows beyond a deadline.
/// The command timeout of these tests: a quarter of the 800 ms the shortest leases
/// and hold-offs here last (a lease must outlast four command timeouts).
const SHORT_TIMEOUT: Duration = Duration::from_millis(200);
const MARGIN: Duration = Duration::from_millis(400);

fn keys() -> KeySpace {
    KeySpace::builder()
        .env("test")
        .service("quote-api")
        .secret(b"a test secret of more than sixteen bytes".to_vec())
        .build()
        .unwrap()
}

fn client_at(url: &str, timeout: Duration) -> LeaseClient {
    let store = RedisStore::builder(url)
        .command_timeout(timeout)
        .build()
        .unwrap();
    LeaseClient::builder(store, &keys()).build().unwrap()
}

fn client(server: &RedisServer) -> LeaseClient {
    client_at(&server.url(), SHORT_TIMEOUT)
}

fn name(id: &str) -> LeaseName {
    keys()
        .lease(
            &[Scope::label("quote"), Scope::id("quote", id)],
            "recalculate",
        )
        .unwrap()
}

fn acquired(outcome: AcquireOutcome) -> Lease {
    match outcome {
        AcquireOutcome::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

async fn get(server: &RedisServer, key: &str) -> Option<String> {
    server.conn().await.get(key).await.unwrap()
}

async fn pttl(server: &RedisServer, key: &str) -> i64 {
    server.conn().await.pttl(key).await.unwrap()
}

async fn gone(server: &RedisServer, key: &str, within: Duration) -> bool {
    eventually(within, || async move { pttl(server, key).await == -2 }).await
}

#[tokio::test]
async fn single_acquire_succeeds_and_sets_owner_and_ttl() {
    let server = RedisServer::start();
    let leases = client(&server);
    let name = name("q-1");
    let ttl = Duration::from_secs(5);
    let lease = acquired(leases.try_acquire(&name, ttl).await);
    assert_eq!(
        get(&server, name.key()).await.as_deref(),
        Some(lease.owner().as_str())
    );
    let left = pttl(&server, name.key()).await;
    assert!(left > 0 && left <= 5000, "PTTL {left}");
    assert!(lease.owner().as_str().starts_with("quote-api:"));
    assert_eq!(lease.ttl(), ttl);
    assert!(lease.remaining() <= ttl && lease.remaining() > Duration::from_secs(4));
    assert!(lease.fencing_token().get() > 0);
}

#[tokio::test]
async fn second_acquire_while_held_is_busy() {
    let server = RedisServer::start();
    let (a, b) = (client(&server), client(&server));
    let name = name("q-1");
    let _held = acquired(a.try_acquire(&name, Duration::from_secs(5)).await);
    for leases in [&a, &b] {
        match leases.try_acquire(&name, Duration::from_secs(5)).await {
            AcquireOutcome::Busy {
                retry_after: Some(left),
                held_off: false,
            } => assert!(left <= Duration::from_secs(5) && left > Duration::from_secs(3)),
            other => panic!("expected Busy, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn release_by_owner_deletes_the_lease() {
    let server = RedisServer::start();
    let leases = client(&server);
    let name = name("q-1");
    let lease = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
    assert!(matches!(
        leases.release(lease).await,
        ReleaseOutcome::Released
    ));
    assert_eq!(pttl(&server, name.key()).await, -2);
    // And it can be taken again at once.
    let _again = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn release_and_renew_by_non_owner_change_nothing() {
    let server = RedisServer::start();
    let leases = client(&server);
    let name = name("q-1");
    let mut lease = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
    // Someone else's lease now stands at the key (as after an expiry and a takeover).
    let _: () = server
        .conn()
        .await
        .pset_ex(name.key(), "other-service:other:01J0Z", 3000)
        .await
        .unwrap();
    assert!(matches!(
        leases.renew(&mut lease, Duration::from_secs(60)).await,
        RenewOutcome::NotOwner
    ));
    assert!(matches!(
        leases.release(lease).await,
        ReleaseOutcome::NotOwner
    ));
    assert_eq!(
        get(&server, name.key()).await.as_deref(),
        Some("other-service:other:01J0Z")
    );
    let left = pttl(&server, name.key()).await;
    assert!(
        left > 0 && left <= 3000,
        "the renewal touched the TTL: {left}"
    );
}

#[tokio::test]
async fn an_expired_lease_can_be_acquired() {
    let server = RedisServer::start();
    let leases = client_at(&server.url(), Duration::from_millis(50));
    let name = name("q-1");
    let first = acquired(leases.try_acquire(&name, Duration::from_millis(300)).await);
    assert!(
        !leases
            .try_acquire(&name, Duration::from_millis(300))
            .await
            .is_acquired()
    );
    assert!(gone(&server, name.key(), Duration::from_secs(2)).await);
    let second = acquired(leases.try_acquire(&name, Duration::from_millis(300)).await);
    assert!(second.fencing_token() > first.fencing_token());
    assert_ne!(second.owner(), first.owner());
}

#[tokio::test]
async fn renew_by_owner_extends_the_ttl() {
    let server = RedisServer::start();
    let leases = client(&server);
    let name = name("q-1");
    let mut lease = acquired(leases.try_acquire(&name, Duration::from_millis(1000)).await);
    let before = lease.valid_until();
    assert!(matches!(
        leases.renew(&mut lease, Duration::from_secs(30)).await,
        RenewOutcome::Renewed
    ));
    let left = pttl(&server, name.key()).await;
    assert!(left > 25_000 && left <= 30_000, "PTTL {left}");
    assert!(lease.valid_until() > before + Duration::from_secs(25));
    assert_eq!(lease.ttl(), Duration::from_secs(30));
    assert_eq!(
        get(&server, name.key()).await.as_deref(),
        Some(lease.owner().as_str())
    );
}

/// A holder pauses past its TTL; another takes the lease; the first one's release and
/// renewal report 'not owner' and leave the new lease as it is.
#[tokio::test]
async fn a_holder_that_slept_past_its_ttl_cannot_touch_the_next_lease() {
    let server = RedisServer::start();
    let (a, b) = (
        client_at(&server.url(), Duration::from_millis(50)),
        client_at(&server.url(), Duration::from_millis(50)),
    );
    let name = name("q-1");
    let ttl = Duration::from_millis(300);
    let mut stale = acquired(a.try_acquire(&name, ttl).await);
    assert!(gone(&server, name.key(), Duration::from_secs(2)).await);
    assert_eq!(stale.remaining(), Duration::ZERO);
    let fresh = acquired(b.try_acquire(&name, Duration::from_secs(10)).await);
    assert!(fresh.fencing_token() > stale.fencing_token());

    assert!(matches!(
        a.renew(&mut stale, Duration::from_secs(60)).await,
        RenewOutcome::NotOwner
    ));
    assert!(matches!(a.release(stale).await, ReleaseOutcome::NotOwner));
    assert_eq!(
        get(&server, name.key()).await.as_deref(),
        Some(fresh.owner().as_str())
    );
    let left = pttl(&server, name.key()).await;
    assert!(left > 8_000 && left <= 10_000, "PTTL {left}");
    assert!(matches!(b.release(fresh).await, ReleaseOutcome::Released));
}

/// 66 tasks over 3 clients (3 pools, 3 sets of connections) contend for one lease at
/// once, over 24 lease windows: every window has exactly one winner. Windows end by
/// release and by expiry, in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_contenders_get_exactly_one_winner_per_window() {
    const CLIENTS: usize = 3;
    const TASKS_PER_CLIENT: usize = 22;
    const WINDOWS: usize = 24;
    let server = RedisServer::start();
    // Long timeouts and TTLs: the window must outlast the whole burst of contenders, so
    // that exactly one winner is what the lease, not the clock, decides.
    let timeout = Duration::from_millis(400);
    let clients: Vec<LeaseClient> = (0..CLIENTS)
        .map(|_| client_at(&server.url(), timeout))
        .collect();
    for c in &clients {
        c.store().ping().await.unwrap();
    }
    let name = Arc::new(name("contended"));
    let mut tokens = Vec::new();
    for window in 0..WINDOWS {
        let by_expiry = window % 3 == 2;
        let ttl = if by_expiry {
            Duration::from_millis(1600)
        } else {
            Duration::from_secs(10)
        };
        let barrier = Arc::new(Barrier::new(CLIENTS * TASKS_PER_CLIENT));
        let mut tasks = Vec::new();
        for c in &clients {
            for _ in 0..TASKS_PER_CLIENT {
                let (c, name, barrier) = (c.clone(), name.clone(), barrier.clone());
                tasks.push(tokio::spawn(async move {
                    barrier.wait().await;
                    c.try_acquire(&name, ttl).await
                }));
            }
        }
        let mut winners = Vec::new();
        let mut busy = 0;
        let what = format!("window {window}: the contenders");
        for outcome in support::web::all_within(tasks, HANG, &what).await {
            match outcome {
                AcquireOutcome::Acquired(lease) => winners.push(lease),
                AcquireOutcome::Busy { .. } => busy += 1,
                other => panic!("window {window}: unexpected {other:?}"),
            }
        }
        assert_eq!(
            winners.len(),
            1,
            "window {window}: {} winners",
            winners.len()
        );
        assert_eq!(busy, CLIENTS * TASKS_PER_CLIENT - 1);
        let winner = winners.pop().unwrap();
        tokens.push(winner.fencing_token());
        if by_expiry {
            assert!(gone(&server, name.key(), Duration::from_secs(4)).await);
        } else {
            assert!(matches!(
                clients[0].release(winner).await,
                ReleaseOutcome::Released
            ));
        }
    }
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "{tokens:?}");
}

#[tokio::test]
async fn fencing_tokens_strictly_increase_over_1000_acquisitions() {
    let server = RedisServer::start();
    let clients: Vec<LeaseClient> = (0..3).map(|_| client(&server)).collect();
    let name = name("q-1");
    let mut last = None;
    for i in 0..1000 {
        let leases = &clients[i % 3];
        let lease = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
        let token = lease.fencing_token();
        if let Some(last) = last {
            assert!(token > last, "acquisition {i}: {token} after {last}");
        }
        last = Some(token);
        assert!(matches!(
            leases.release(lease).await,
            ReleaseOutcome::Released
        ));
    }
}

/// The counter is lost in three ways: a restart without persistence, eviction (a
/// `DEL`), and garbage written over it. Tokens go on increasing all the same.
#[tokio::test]
async fn fencing_tokens_increase_across_a_restart_and_a_lost_counter() {
    let mut server = RedisServer::start();
    let leases = client(&server);
    let name = name("q-1");
    let mut last =
        acquired(leases.try_acquire(&name, Duration::from_secs(5)).await).fencing_token();

    server.restart();
    assert_eq!(
        pttl(&server, name.fence_key()).await,
        -2,
        "restart kept data"
    );
    // The first attempt may find the pooled connection dead; the next ones reconnect.
    let mut after_restart = None;
    for _ in 0..50 {
        if let AcquireOutcome::Acquired(lease) =
            leases.try_acquire(&name, Duration::from_secs(5)).await
        {
            after_restart = Some(lease.fencing_token());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after_restart = after_restart.expect("no acquire succeeded after the restart");
    assert!(
        after_restart > last,
        "{after_restart} after a restart, {last} before"
    );
    let _: () = server.conn().await.del(name.key()).await.unwrap();

    let mut conn = server.conn().await;
    for damage in ["evicted", "garbage"] {
        let lease = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
        assert!(lease.fencing_token() > last);
        last = lease.fencing_token();
        assert!(matches!(
            leases.release(lease).await,
            ReleaseOutcome::Released
        ));
        if damage == "evicted" {
            let _: () = conn.del(name.fence_key()).await.unwrap();
        } else {
            let _: () = conn.set(name.fence_key(), "not a number").await.unwrap();
        }
        let lease = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
        assert!(
            lease.fencing_token() > last,
            "{damage}: {} after {last}",
            lease.fencing_token()
        );
        last = lease.fencing_token();
        assert!(matches!(
            leases.release(lease).await,
            ReleaseOutcome::Released
        ));
    }
}

/// Numbers that no token can be, written over the fence counter: every acquire still
/// takes the lease with a token above the last one, and never leaves the lease set while
/// reporting a failure.
#[tokio::test]
async fn a_garbage_fence_counter_never_leaves_a_lease_set_behind_a_failure() {
    let server = RedisServer::start();
    let leases = client(&server);
    let name = name("q-1");
    let mut conn = server.conn().await;
    let mut last = FencingToken::new(0);
    for garbage in [
        "inf",
        "-inf",
        "nan",
        "1e400",
        "-5",
        "1.5",
        "99999999999999999999999",
        "0x7fffffffffffffff",
    ] {
        let _: () = conn.set(name.fence_key(), garbage).await.unwrap();
        let outcome = leases.try_acquire(&name, Duration::from_secs(5)).await;
        let lease = match outcome {
            AcquireOutcome::Acquired(lease) => lease,
            other => {
                let left = pttl(&server, name.key()).await;
                panic!("{garbage}: {other:?}, and the lease key's PTTL is {left}");
            }
        };
        assert!(lease.fencing_token() > last, "{garbage}");
        last = lease.fencing_token();
        assert!(matches!(
            leases.release(lease).await,
            ReleaseOutcome::Released
        ));
        assert_eq!(pttl(&server, name.key()).await, -2, "{garbage}");
    }
}

/// A holder that failed holds the name off: nobody owns it, every acquire answers busy
/// and says so, and it ends by its TTL.
#[tokio::test]
async fn a_held_off_lease_is_busy_for_everyone_until_its_ttl() {
    let server = RedisServer::start();
    let (a, b) = (client(&server), client(&server));
    let (name, other) = (name("q-1"), name("q-2"));
    let lease = acquired(a.try_acquire(&name, Duration::from_secs(5)).await);
    let owner_gone = acquired(b.try_acquire(&other, Duration::from_secs(5)).await);
    assert!(matches!(
        a.hold_off(lease, Duration::from_millis(800)).await,
        ReleaseOutcome::Released
    ));
    for leases in [&a, &b] {
        match leases.try_acquire(&name, Duration::from_secs(5)).await {
            AcquireOutcome::Busy {
                retry_after: Some(left),
                held_off: true,
            } => assert!(left <= Duration::from_millis(800)),
            other => panic!("expected a held-off Busy, got {other:?}"),
        }
    }
    // Only the owner can hold a lease off.
    let _: () = server.conn().await.del(other.key()).await.unwrap();
    let taken = acquired(a.try_acquire(&other, Duration::from_secs(5)).await);
    assert!(matches!(
        b.hold_off(owner_gone, Duration::from_millis(800)).await,
        ReleaseOutcome::NotOwner
    ));
    assert!(matches!(a.release(taken).await, ReleaseOutcome::Released));
    assert!(gone(&server, name.key(), Duration::from_secs(3)).await);
    assert!(
        a.try_acquire(&name, Duration::from_secs(5))
            .await
            .is_acquired()
    );
}

#[tokio::test]
async fn redis_killed_before_acquire_is_unavailable_within_the_timeout() {
    let mut server = RedisServer::start();
    let warm = client(&server);
    warm.store().ping().await.unwrap();
    let url = server.url();
    server.kill();
    // A client whose connection was open when Redis died, and one that never had one.
    for (which, leases) in [("warm", warm), ("cold", client_at(&url, SHORT_TIMEOUT))] {
        for _ in 0..3 {
            let started = Instant::now();
            let outcome = leases
                .try_acquire(&name("q-1"), Duration::from_secs(5))
                .await;
            let took = started.elapsed();
            match outcome {
                AcquireOutcome::Unavailable(error) => assert!(
                    matches!(
                        error.kind(),
                        StoreErrorKind::NoConnection | StoreErrorKind::ConnectionLost
                    ),
                    "{which}: {error}"
                ),
                other => panic!("{which}: expected Unavailable, got {other:?}"),
            }
            assert!(took < SHORT_TIMEOUT + MARGIN, "{which}: took {took:?}");
        }
    }
}

#[tokio::test]
async fn redis_paused_during_acquire_times_out_and_the_lease_ends_by_its_ttl() {
    let server = RedisServer::start();
    let leases = client(&server);
    leases.store().ping().await.unwrap();
    let name = name("q-1");
    let ttl = Duration::from_millis(1000);
    server.pause();
    let started = Instant::now();
    let outcome = leases.try_acquire(&name, ttl).await;
    let took = started.elapsed();
    server.resume();
    let attempt = match outcome {
        AcquireOutcome::TimedOut(attempt) => attempt,
        other => panic!("expected TimedOut, got {other:?}"),
    };
    assert_eq!(attempt.error().kind(), StoreErrorKind::Timeout);
    assert!(attempt.error().outcome_unknown());
    assert!(
        took >= SHORT_TIMEOUT && took < SHORT_TIMEOUT + MARGIN,
        "took {took:?}"
    );
    // Whatever Redis did with the acquire once it woke up, the key ends by its TTL:
    // it can never outlive it.
    assert!(gone(&server, name.key(), ttl + MARGIN * 2).await);
    // A best-effort release of the uncertain attempt is safe: it finds nothing of its own.
    let released = leases.release_uncertain(attempt).await;
    assert!(matches!(released, ReleaseOutcome::NotOwner), "{released:?}");
}

#[tokio::test]
async fn an_uncertain_acquire_that_did_take_the_lease_can_be_released_best_effort() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let leases = client_at(&proxy.url(), SHORT_TIMEOUT);
    let name = name("q-1");
    // Load the script first: a NOSCRIPT answer that comes after the deadline would not be
    // followed by a load and a second try.
    let warm = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
    assert!(matches!(
        leases.release(warm).await,
        ReleaseOutcome::Released
    ));
    // The acquire reaches Redis, its reply is held back past the deadline.
    proxy.set(Mode::Delay(SHORT_TIMEOUT * 3));
    let attempt = match leases.try_acquire(&name, Duration::from_secs(30)).await {
        AcquireOutcome::TimedOut(attempt) => attempt,
        other => panic!("expected TimedOut, got {other:?}"),
    };
    proxy.set(Mode::Pass);
    // Redis did set the lease: nobody can take it now...
    let (server_ref, key) = (&server, name.key());
    assert!(
        eventually(Duration::from_secs(2), || async move {
            get(server_ref, key).await.is_some()
        })
        .await
    );
    let other = client(&server);
    assert!(matches!(
        other.try_acquire(&name, Duration::from_secs(5)).await,
        AcquireOutcome::Busy { .. }
    ));
    // ...until the uncertain attempt is released with the owner value it sent.
    let released = leases.release_uncertain(attempt).await;
    assert!(matches!(released, ReleaseOutcome::Released), "{released:?}");
    assert!(
        other
            .try_acquire(&name, Duration::from_secs(5))
            .await
            .is_acquired()
    );
}

/// Redis cannot be reached during release: the failure is reported within the timeout,
/// and the lease still ends by its TTL.
#[tokio::test]
async fn redis_unavailable_during_release_is_reported_and_the_lease_ends_by_its_ttl() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let leases = client_at(&proxy.url(), SHORT_TIMEOUT);
    let name = name("q-1");
    let ttl = Duration::from_millis(1500);
    let lease = acquired(leases.try_acquire(&name, ttl).await);
    proxy.set(Mode::Blackhole);
    let started = Instant::now();
    let outcome = leases.release(lease).await;
    let took = started.elapsed();
    match outcome {
        ReleaseOutcome::Failed(error) => {
            assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    assert!(took < SHORT_TIMEOUT + MARGIN, "took {took:?}");
    // The release never reached Redis: the lease is still there, with its TTL...
    let left = pttl(&server, name.key()).await;
    assert!(left > 0 && left <= 1500, "PTTL {left}");
    // ...and it ends by it.
    assert!(gone(&server, name.key(), ttl + MARGIN).await);
}

#[tokio::test]
async fn scripts_run_by_sha_and_are_reloaded_after_a_flush() {
    let server = RedisServer::start();
    let leases = client(&server);
    let name = name("q-1");
    let mut conn = server.conn().await;
    let lease = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
    assert!(matches!(
        leases.release(lease).await,
        ReleaseOutcome::Released
    ));
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
    let lease = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
    assert!(matches!(
        leases.release(lease).await,
        ReleaseOutcome::Released
    ));

    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    let calls = |cmd: &str| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
            .map(|rest| rest.split(',').next().unwrap().parse().unwrap())
            .unwrap_or(0)
    };
    // Two acquires and two releases, each by SHA; the first try of each script after the
    // flush (and before the first load) answered NOSCRIPT and was sent again.
    assert_eq!(calls("eval"), 0, "a script was sent whole:\n{stats}");
    assert_eq!(calls("evalsha"), 4 + 4, "{stats}");
    assert_eq!(calls("script|load"), 4, "{stats}");
}

#[tokio::test]
async fn no_raw_identifier_reaches_redis() {
    let server = RedisServer::start();
    let leases = client(&server);
    let email = "alice.smith@example.com";
    let tenant = "acme-corporation";
    let name = keys()
        .lease(
            &[
                Scope::id("tenant", tenant),
                Scope::label("user"),
                Scope::id("user", email),
            ],
            "recalculate",
        )
        .unwrap();
    let lease = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
    let mut conn = server.conn().await;
    let mut iter: redis::AsyncIter<'_, String> = conn.scan_match("*").await.unwrap();
    let mut seen = HashSet::new();
    while let Some(key) = iter.next_item().await {
        seen.insert(key.unwrap());
    }
    drop(iter);
    assert_eq!(seen.len(), 2, "{seen:?}");
    for key in &seen {
        for raw in [email, "alice", "example.com", tenant, "acme"] {
            assert!(!key.contains(raw), "{key} contains {raw}");
        }
    }
    let value = get(&server, name.key()).await.unwrap();
    assert!(!value.contains(email) && !value.contains(tenant));
    assert!(matches!(
        leases.release(lease).await,
        ReleaseOutcome::Released
    ));
}

#[tokio::test]
async fn invalid_configurations_are_refused_naming_the_field() {
    let store = |b: stampede_guard::store::RedisStoreBuilder| b.build().unwrap_err().field();
    let url = "redis://127.0.0.1:1";
    assert_eq!(
        store(RedisStore::builder(url).command_timeout(Duration::ZERO)),
        "command_timeout"
    );
    assert_eq!(
        store(RedisStore::builder(url).connect_timeout(Duration::ZERO)),
        "connect_timeout"
    );
    assert_eq!(store(RedisStore::builder(url).pool_size(0)), "pool_size");
    assert_eq!(store(RedisStore::builder("http://nope")), "url");
    assert_eq!(store(RedisStore::builder("not a url at all")), "url");

    let lease = |b: stampede_guard::lease::LeaseClientBuilder| b.build().unwrap_err();
    let base = || {
        let store = RedisStore::builder(url)
            .command_timeout(Duration::from_millis(100))
            .build()
            .unwrap();
        LeaseClient::builder(store, &keys())
    };
    // Not well above the command timeout.
    let error = lease(base().lease_ttl(Duration::from_millis(399)));
    assert_eq!(error.field(), "lease_ttl");
    assert!(error.to_string().contains("lease_ttl"), "{error}");
    assert_eq!(lease(base().lease_ttl(Duration::ZERO)).field(), "lease_ttl");
    assert_eq!(
        lease(base().lease_ttl(Duration::from_secs(2 * 24 * 3600))).field(),
        "lease_ttl"
    );
    assert_eq!(
        lease(base().lease_ttl(Duration::from_micros(500_500))).field(),
        "lease_ttl"
    );
    assert_eq!(
        lease(base().fence_retention(Duration::ZERO)).field(),
        "fence_retention"
    );
    assert_eq!(lease(base().instance_id("pod 7")).field(), "instance_id");
    assert!(base().lease_ttl(Duration::from_millis(400)).build().is_ok());
}

#[tokio::test]
async fn a_bad_ttl_per_call_is_refused_without_asking_redis() {
    let server = RedisServer::start();
    let leases = client(&server); // command timeout 200 ms: TTLs from 800 ms
    let name = name("q-1");
    match leases.try_acquire(&name, Duration::from_millis(799)).await {
        AcquireOutcome::Invalid(error) => assert_eq!(error.field(), "lease_ttl"),
        other => panic!("expected Invalid, got {other:?}"),
    }
    assert_eq!(pttl(&server, name.key()).await, -2);
    assert_eq!(pttl(&server, name.fence_key()).await, -2);
    let mut lease = acquired(leases.try_acquire(&name, Duration::from_millis(800)).await);
    assert!(matches!(
        leases.renew(&mut lease, Duration::ZERO).await,
        RenewOutcome::Invalid(_)
    ));
    let left = pttl(&server, name.key()).await;
    assert!(left > 0 && left <= 800, "PTTL {left}");
}

/// `hold_while` renews the lease past its TTL while the work runs, stops at the maximum
/// and cancels the work; the lease is gone within one TTL of that.
#[tokio::test]
async fn the_watchdog_renews_until_its_maximum_then_stops() {
    let server = RedisServer::start();
    let leases = client_at(&server.url(), Duration::from_millis(100));
    let name = name("q-1");
    let ttl = Duration::from_millis(400);
    let max = Duration::from_millis(1200);
    let mut lease = acquired(leases.try_acquire(&name, ttl).await);
    let acquired_at = lease.acquired_at();
    let key = name.key().to_owned();
    let server_ref = &server;
    let probe = async {
        // Well past the first TTL, the lease is still there.
        tokio::time::sleep(Duration::from_millis(900)).await;
        server_ref.conn().await.pttl::<_, i64>(&key).await.unwrap()
    };
    let (outcome, pttl_at_900ms) = within(
        max + HANG,
        async {
            tokio::join!(
                leases.hold_while(&mut lease, max, std::future::pending::<()>()),
                probe
            )
        },
        "hold_while past its maximum",
    )
    .await;
    let stopped_after = acquired_at.elapsed();
    assert!(
        matches!(outcome, Err(stampede_guard::lease::LeaseLost::MaxDuration)),
        "{outcome:?}"
    );
    assert!(pttl_at_900ms > 0, "not renewed: PTTL {pttl_at_900ms}");
    assert!(
        stopped_after >= max && stopped_after < max + MARGIN,
        "{stopped_after:?}"
    );
    assert!(
        gone(&server, name.key(), ttl + MARGIN).await,
        "the lease outlived max + TTL"
    );
}

#[tokio::test]
async fn the_watchdog_cancels_the_work_when_the_lease_is_taken_over() {
    let server = RedisServer::start();
    let leases = client_at(&server.url(), Duration::from_millis(100));
    let name = name("q-1");
    let mut lease = acquired(leases.try_acquire(&name, Duration::from_millis(600)).await);
    let _: () = server
        .conn()
        .await
        .pset_ex(name.key(), "someone-else", 5000)
        .await
        .unwrap();
    let started = Instant::now();
    let held = leases.hold_while(
        &mut lease,
        Duration::from_secs(10),
        std::future::pending::<()>(),
    );
    let outcome = within(HANG, held, "hold_while on a lease taken over").await;
    assert!(
        matches!(outcome, Err(stampede_guard::lease::LeaseLost::NotOwner)),
        "{outcome:?}"
    );
    // Found at the first renewal, a third of the TTL in.
    assert!(started.elapsed() < Duration::from_millis(200) + MARGIN);
    assert_eq!(
        get(&server, name.key()).await.as_deref(),
        Some("someone-else")
    );
}

/// 400 acquires dropped mid-flight (their replies never read) leave no lease key once
/// three TTLs have passed: every lease that Redis did set carries its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquires_dropped_mid_flight_leave_no_lease_after_three_ttls() {
    let server = RedisServer::start();
    let leases = client(&server);
    // Load the script first: an acquire dropped while its NOSCRIPT answer is on the way
    // is never sent again, and would not reach Redis at all.
    let warm = acquired(
        leases
            .try_acquire(&name("warm"), Duration::from_secs(5))
            .await,
    );
    assert!(matches!(
        leases.release(warm).await,
        ReleaseOutcome::Released
    ));
    let ttl = Duration::from_millis(800);
    let mut tasks = Vec::new();
    for n in 0..400u64 {
        let leases = leases.clone();
        tasks.push(tokio::spawn(async move {
            let name = name(&format!("q-{n}"));
            let budget = Duration::from_micros((n * 7919) % 3000);
            tokio::time::timeout(budget, leases.try_acquire(&name, ttl))
                .await
                .is_ok()
        }));
    }
    let completed = support::web::all_within(tasks, HANG, "the dropped acquires")
        .await
        .into_iter()
        .filter(|&done| done)
        .count();
    assert!(completed < 400, "no acquire was dropped mid-flight");
    // Some dropped acquires did reach Redis and set their lease (else this proves
    // nothing): more leases stand than acquires that returned.
    let set = server.scan("*:lease").await.len();
    eprintln!("{completed} acquires returned, {set} leases set");
    assert!(
        set > completed,
        "{set} leases set, {completed} acquires returned"
    );
    // Time must pass here (that is the claim): three TTLs, whatever Redis still had to
    // run of the dropped acquires.
    tokio::time::sleep(ttl * 3).await;
    let left = server.scan("*:lease").await;
    assert!(left.is_empty(), "{} leases left", left.len());
}

/// The reply to a successful acquire is lost: the caller sees a timeout, and the lease it
/// did take blocks the name for one TTL at most.
#[tokio::test]
async fn a_reply_lost_after_a_successful_acquire_locks_for_at_most_one_ttl() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let leases = client_at(&proxy.url(), SHORT_TIMEOUT);
    let name = name("q-1");
    // Load the script first (see the uncertain-acquire test).
    let warm = acquired(leases.try_acquire(&name, Duration::from_secs(5)).await);
    assert!(matches!(
        leases.release(warm).await,
        ReleaseOutcome::Released
    ));
    let ttl = Duration::from_millis(1000);
    proxy.set(Mode::DropReplies);
    let sent = Instant::now();
    assert!(matches!(
        leases.try_acquire(&name, ttl).await,
        AcquireOutcome::TimedOut(_)
    ));
    proxy.set(Mode::Pass);
    let left = pttl(&server, name.key()).await;
    assert!(
        left > 0 && left <= 1000,
        "Redis did not set the lease: PTTL {left}"
    );
    let other = client(&server);
    assert!(matches!(
        other.try_acquire(&name, Duration::from_secs(5)).await,
        AcquireOutcome::Busy { .. }
    ));
    assert!(gone(&server, name.key(), ttl + MARGIN).await);
    assert!(sent.elapsed() < ttl + MARGIN * 2);
    assert!(
        other
            .try_acquire(&name, Duration::from_secs(5))
            .await
            .is_acquired()
    );
}
