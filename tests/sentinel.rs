//! Redis Sentinel: the store finds the primary through the sentinels and follows a
//! failover.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::TIMEOUT;
use support::sentinel::{SERVICE, SentinelGroup};
use support::web::{self, Origin, get, keys, send};
use support::{HANG, Proxy, RedisServer, eventually, within};

/// How long after the primary is killed the guard must write through the new one: the
/// sentinels' 1 s to call the primary down, their election and promotion (a few
/// seconds), and the guard's next operations, with room for a busy machine.
const FOLLOWS_WITHIN: Duration = Duration::from_secs(20);

/// Two instances under load, as the least-privileged user (set on both servers); the
/// primary is killed. No request gets a 5xx, and the guard writes refreshes through the
/// promoted replica within [`FOLLOWS_WITHIN`].
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_guard_follows_the_primary_the_sentinels_promote() {
    let mut group = SentinelGroup::start();
    let first = group.primary_port().unwrap();
    let rules = keys().acl_rules();
    for server in [&group.primary, &group.replica] {
        let mut args = vec!["ACL", "SETUSER", "guard", "on", ">guard-pw"];
        args.extend(rules.split_whitespace());
        let () = server.cmd(&args).await;
    }
    // The first sentinel as `host:port`, as Sentinel tools take them; the others as URLs.
    let mut sentinels = group.urls();
    sentinels[0] = sentinels[0].trim_start_matches("redis://").to_owned();
    assert!(!sentinels[0].contains("://"));
    let store = || {
        RedisStore::sentinel(sentinels.clone(), SERVICE)
            .username("guard")
            .password("guard-pw")
            .command_timeout(TIMEOUT)
            .build()
            .unwrap()
    };
    let origin = Origin::versions(Duration::from_millis(5));
    let policy = || {
        Policy::builder("items")
            .fresh_ttl(Duration::from_millis(200))
            .grace(Duration::from_secs(60))
            .build()
            .unwrap()
    };
    let guard = || StampedeGuard::builder(store(), keys()).build().unwrap();
    let fleet = Arc::new(vec![
        web::instance(guard(), policy(), origin.service()).await,
        web::instance(guard(), policy(), origin.service()).await,
    ]);
    const KEYS: usize = 6;
    for n in 0..KEYS {
        assert_eq!(
            send(&fleet[0].service, get(&format!("/items/{n}")))
                .await
                .x_cache(),
            "miss"
        );
        assert_eq!(
            send(&fleet[1].service, get(&format!("/items/{n}")))
                .await
                .x_cache(),
            "hit"
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let workers = web::load(&fleet, KEYS, 2, &stop);
    let written = || {
        fleet
            .iter()
            .map(|i| i.layer.stats().get(Event::RefreshWritten))
            .sum::<u64>()
    };
    assert!(
        eventually(Duration::from_secs(10), || async {
            written() > KEYS as u64
        })
        .await,
        "no refreshes before the failover"
    );

    // The token of an entry before the kill; written through the new primary, it is
    // higher (a refresh the guard made on its own, without Redis, is not seen there).
    let entry = fleet[0]
        .layer
        .cache_keys(&get("/items/0"))
        .unwrap()
        .entry()
        .to_owned();
    let old = token(&group.primary.url(), &entry).await;
    assert!(old > 0);
    group.primary.kill();
    let killed = Instant::now();
    let before = written();
    let followed = eventually(FOLLOWS_WITHIN, || async {
        written() > before + KEYS as u64
            && group.primary_port().is_some_and(|port| port != first)
            && token(&group.replica.url(), &entry).await > old
    })
    .await;
    let took = killed.elapsed();
    assert!(
        followed,
        "refreshes were not written through a new primary within {FOLLOWS_WITHIN:?}"
    );
    assert_eq!(group.primary_port(), Some(group.replica.addr().port()));
    eprintln!("the guard wrote through the promoted replica {took:?} after the kill");

    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        within(HANG, worker, "a load worker").await.unwrap();
    }
    // What was written since lives on the promoted replica.
    let keys_there: u64 = group.replica.cmd(&["DBSIZE"]).await;
    assert!(keys_there > 0);
}

/// The fencing token of the entry at `entry` on the server at `url` (0 if there is none,
/// or the server does not answer).
async fn token(url: &str, entry: &str) -> u64 {
    let Ok(client) = redis::Client::open(url) else {
        return 0;
    };
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return 0;
    };
    let token: Option<String> = redis::cmd("HGET")
        .arg(entry)
        .arg("t")
        .query_async(&mut conn)
        .await
        .ok()
        .flatten();
    token.and_then(|t| t.parse().ok()).unwrap_or(0)
}

/// A connection to the primary that a NAT or a firewall forgot (silent for good, never
/// reset) is retired by the command that timed out on it: the store connects to the
/// same primary again and answers, where it timed out on that connection for good (a
/// timeout does not make it ask the sentinels, and nothing else replaced it). The
/// sentinel watches the primary through the proxy, so that the address it names is the
/// proxy's; it is slow to call the primary down, so that it starts no failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_a_nat_forgot_is_retired_and_the_primary_answers_again() {
    let primary = RedisServer::start();
    let proxy = Proxy::start(primary.addr()).await;
    let config = format!(
        "sentinel monitor {SERVICE} 127.0.0.1 {} 1\n\
         sentinel down-after-milliseconds {SERVICE} 60000\n",
        proxy.addr().port()
    );
    let sentinel = RedisServer::start_sentinel(&config);
    // Given as `host:port`, as Sentinel tools take it: the only sentinel the store has.
    let host_port = sentinel.url().trim_start_matches("redis://").to_owned();
    let store = RedisStore::sentinel([host_port], SERVICE)
        .command_timeout(TIMEOUT)
        .build()
        .unwrap();
    within(HANG, store.ping(), "the first ping").await.unwrap();
    let made = proxy.accepted();
    let failed = support::proxy::forgotten_then_answering(&store, &[&proxy], HANG).await;
    let failed = failed.expect("the store answers again");
    assert!(
        failed >= 1,
        "the first ping was sent on a forgotten connection"
    );
    assert!(proxy.accepted() > made, "a new connection was made");
}
