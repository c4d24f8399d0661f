//! Purge records at scale: with 100,000 tags purged, an instance whose subscription was
//! lost reads back only what it missed, a fresh instance reads every record in batches
//! that each take Redis a millisecond or so, and a read-back that fails neither
//! opens the breaker nor keeps notices from resuming; the purges take effect once it
//! succeeds. Measured on the test's own server, by its `INFO commandstats`,
//! `INFO stats` and `SLOWLOG`.

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use stampede_guard::{Mode, Policy, Purge, RedisStore, StampedeGuard};
use support::web::{self, Instance, Origin, get, keys, send};
use support::{HANG, RedisServer, eventually, within};

/// Tags purged in all.
const TAGS: usize = 100_000;
/// Tags per purge call.
const PER_CALL: usize = 10_000;
/// Records per read-back batch (the crate's batch size).
const BATCH: usize = 1_000;
/// Bytes of one record in a `ZRANGEBYSCORE ... WITHSCORES` reply (RESP2): the member
/// (`tag_` and 32 hex digits, `:h`: `$38\r\n` and 40 bytes) and its score (16 digits of
/// µs: `$16\r\n` and 18 bytes).
const RECORD_BYTES: u64 = 45 + 23;

/// A store on `server`, with a command timeout that a loaded machine does not reach by
/// accident (2.5 times the default; each batch is held to a far tighter bound on the
/// server, by `SLOWLOG`).
fn store(url: &str) -> RedisStore {
    RedisStore::builder(url)
        .command_timeout(Duration::from_millis(250))
        .build()
        .unwrap()
}

/// A guard that only purges (never subscribed), with time for a purge of `PER_CALL`
/// tags in one script.
fn purger(server: &RedisServer) -> StampedeGuard {
    let store = RedisStore::builder(server.url())
        .command_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    StampedeGuard::builder(store, keys()).build().unwrap()
}

/// A route whose entries all carry the tags `tags` (set in code).
fn tagged(tags: &[&str]) -> Policy {
    Policy::builder("items")
        .fresh_ttl(Duration::from_secs(600))
        .grace(Duration::from_secs(600))
        .tags(tags.iter().map(|t| (*t).to_owned()))
        .build()
        .unwrap()
}

/// `INFO {section}` as `field → value`, and `cmdstat_x:calls=1,...` as
/// `cmdstat_x.calls → 1`.
async fn info(server: &RedisServer, section: &str) -> HashMap<String, String> {
    let text: String = server.cmd(&["INFO", section]).await;
    let mut out = HashMap::new();
    for line in text.lines() {
        let Some((field, value)) = line.split_once(':') else {
            continue;
        };
        if field.starts_with("cmdstat_") {
            for pair in value.split(',') {
                if let Some((name, v)) = pair.split_once('=') {
                    out.insert(format!("{field}.{name}"), v.to_owned());
                }
            }
        } else {
            out.insert(field.to_owned(), value.trim().to_owned());
        }
    }
    out
}

/// What the server did so far: calls by command, and bytes it sent. The bytes are read
/// on the side of the look nearer to what is measured, so that only one `INFO` reply
/// falls in between.
struct Look {
    calls: HashMap<String, u64>,
    sent: u64,
}

async fn calls(server: &RedisServer) -> HashMap<String, u64> {
    info(server, "commandstats")
        .await
        .iter()
        .filter_map(|(k, v)| Some((k.strip_suffix(".calls")?.to_owned(), v.parse().ok()?)))
        .collect()
}

async fn sent(server: &RedisServer) -> u64 {
    info(server, "stats").await["total_net_output_bytes"]
        .parse()
        .unwrap()
}

/// A look before what is measured.
async fn look(server: &RedisServer) -> Look {
    let calls = calls(server).await;
    Look {
        calls,
        sent: sent(server).await,
    }
}

/// A look after what is measured.
async fn look_after(server: &RedisServer) -> Look {
    let sent = sent(server).await;
    Look {
        calls: calls(server).await,
        sent,
    }
}

impl Look {
    fn calls(&self, command: &str) -> u64 {
        self.calls
            .get(&format!("cmdstat_{command}"))
            .copied()
            .unwrap_or(0)
    }
}

/// Purges `TAGS` tags, hard, through `guard`, `PER_CALL` a call.
async fn purge_many(guard: &StampedeGuard) {
    let tags: Vec<String> = (0..TAGS).map(|i| format!("product-{i}")).collect();
    for chunk in tags.chunks(PER_CALL) {
        within(
            HANG,
            guard.purge_tags(chunk, Purge::Hard),
            "a purge of many tags",
        )
        .await
        .unwrap();
    }
}

/// The batches of a read-back of `records` records: full ones, then one that is not
/// (it may be empty).
fn batches(records: usize) -> usize {
    records / BATCH + 1
}

/// Bytes of the replies of a read-back of `records` records, the first of them at rank
/// `first` of the sorted set: the first batch by score; each next one the rank of the
/// last record read, then the records from it on (it first again).
fn read_back_bytes(records: usize, first: usize) -> u64 {
    let header = |n: usize| format!("*{}\r\n", 2 * n).len() as u64;
    let mut read = records.min(BATCH);
    let mut bytes = header(read) + read as u64 * RECORD_BYTES;
    let mut full = read == BATCH;
    while full {
        let n = (records - read).min(BATCH);
        let rank = format!(":{}\r\n", first + read - 1).len() as u64;
        bytes += rank + header(n + 1) + (n + 1) as u64 * RECORD_BYTES;
        read += n;
        full = n == BATCH;
    }
    bytes
}

/// Waits until `guard` knows every purge recorded.
async fn caught_up(guard: &StampedeGuard) {
    assert!(
        eventually(HANG, || async { guard.purges_caught_up() }).await,
        "the purges were not read back"
    );
}

/// 100,000 tags purged, heard; then the subscription is lost, a purge is made while it
/// is down, and it comes back: the read-back is one command of a few hundred bytes (the
/// last purge heard, less the margin, on), the missed purge takes effect, notices
/// resume, and the breaker stayed closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_subscription_reads_back_only_what_it_missed() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    // The purger never subscribes: only `b` hears.
    let purger = purger(&server);
    let b: Instance<_> = web::instance(
        StampedeGuard::builder(store(&server.url()), keys())
            .build()
            .unwrap(),
        tagged(&["marker", "section-1"]),
        origin.service(),
    )
    .await;
    assert_eq!(send(&b.service, get("/items/1")).await.x_cache(), "miss");

    purge_many(&purger).await;
    // Past the margin, then a last purge: once `b` heard it, it heard every one before
    // (one connection delivers them in order), and the read-back starts there.
    tokio::time::sleep(stampede_guard::guard::PURGE_MARGIN * 3).await;
    purger.purge_tags(["marker"], Purge::Hard).await.unwrap();
    assert!(
        eventually(HANG, || async {
            send(&b.service, get("/items/1")).await.x_cache() == "miss"
        })
        .await,
        "b did not hear the last purge"
    );
    assert_eq!(origin.calls(), 2);

    // The subscription lost, and kept from coming back while a purge is made.
    let _: () = server
        .cmd(&["ACL", "SETUSER", "default", "-subscribe"])
        .await;
    let _: i64 = server.cmd(&["CLIENT", "KILL", "TYPE", "pubsub"]).await;
    assert!(
        eventually(HANG, || async { !b.guard.notices_connected() }).await,
        "the subscription was not lost"
    );
    purger
        .purge_tags(
            ["section-1", "gap-1", "gap-2", "gap-3", "gap-4"],
            Purge::Hard,
        )
        .await
        .unwrap();
    let before = look(&server).await;
    let _: () = server
        .cmd(&["ACL", "SETUSER", "default", "+subscribe"])
        .await;
    caught_up(&b.guard).await;
    let after = look_after(&server).await;

    // Read back: the last purge heard and the five missed, in one batch.
    let commands = after.calls("zrangebyscore") - before.calls("zrangebyscore");
    let sent = after.sent - before.sent;
    let expected = read_back_bytes(6, TAGS);
    eprintln!(
        "read-back after a lost subscription, {TAGS} tags recorded: {commands} command(s), \
         {sent} bytes sent by Redis meanwhile ({expected} of them the read-back's reply)"
    );
    assert_eq!(commands, 1);
    assert_eq!(after.calls("zrange"), before.calls("zrange"));
    assert_eq!(after.calls("zrank"), before.calls("zrank"));
    assert_eq!(after.calls("hgetall"), 0);
    // The rest: the `INFO stats` reply that opened the look, `+OK`, the subscription's
    // reply and a ping or two.
    assert!(
        sent >= expected && sent <= expected + 4096,
        "{sent} bytes sent, {expected} expected"
    );
    // The missed purge took effect: b's entry (tagged section-1) is filled again.
    assert_eq!(send(&b.service, get("/items/1")).await.x_cache(), "miss");
    assert_eq!(origin.calls(), 3);
    assert_eq!(send(&b.service, get("/items/1")).await.x_cache(), "hit");
    // Notices resumed: a purge made now is heard, and takes effect.
    purger.purge_tags(["marker"], Purge::Hard).await.unwrap();
    assert!(
        eventually(HANG, || async {
            send(&b.service, get("/items/1")).await.x_cache() == "miss"
        })
        .await,
        "b did not hear the purge after the subscription came back"
    );
    assert_eq!(origin.calls(), 4);
    // With no read-back since: the one `ZRANGEBYSCORE` is the purge script's own (it
    // drops records past their three days).
    assert_eq!(
        look(&server).await.calls("zrangebyscore"),
        after.calls("zrangebyscore") + 1
    );
    assert_eq!(b.guard.mode(), Mode::Shared);
    assert!(!b.guard.store().circuit_open());
}

/// A guard that never saw a purge reads the last three days' records, 100,000 of them,
/// in batches of 1,000 (101: the last one finds the end), each command taking Redis
/// less than a quarter of the default command timeout, also deep into a run of 10,000
/// records of one purge; then an entry tagged with one of them, filled before its purge, is not served
/// as fresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_guard_reads_every_record_in_batches() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let filler = web::instance(
        StampedeGuard::builder(store(&server.url()), keys())
            .build()
            .unwrap(),
        tagged(&["product-4242"]),
        origin.service(),
    )
    .await;
    assert_eq!(
        send(&filler.service, get("/items/1")).await.x_cache(),
        "miss"
    );
    purge_many(&purger(&server)).await;

    let _: () = server
        .cmd(&["CONFIG", "SET", "slowlog-log-slower-than", "100000"])
        .await;
    let _: () = server.cmd(&["SLOWLOG", "RESET"]).await;
    let before = look(&server).await;
    let started = Instant::now();
    let fresh = StampedeGuard::builder(store(&server.url()), keys())
        .build()
        .unwrap();
    within(HANG, fresh.ready(), "the fresh guard's readiness")
        .await
        .unwrap();
    caught_up(&fresh).await;
    let took = started.elapsed();
    let after = look_after(&server).await;

    let delta = |command: &str| after.calls(command) - before.calls(command);
    let sent = after.sent - before.sent;
    let expected = read_back_bytes(TAGS, 0);
    let stats = info(&server, "commandstats").await;
    eprintln!(
        "read-back of {TAGS} records by a fresh guard: {} batches ({} ZRANGEBYSCORE, {} ZRANK, \
         {} ZRANGE), {sent} bytes sent by Redis ({expected} of them the replies), {took:?} in \
         all; ZRANGE {} µs of Redis's time per call",
        batches(TAGS),
        delta("zrangebyscore"),
        delta("zrank"),
        delta("zrange"),
        stats["cmdstat_zrange.usec_per_call"]
    );
    // The first batch by score, every other after the last record read, by its rank.
    let batches = batches(TAGS) as u64;
    assert_eq!(delta("zrangebyscore"), 1);
    assert_eq!(delta("zrange"), batches - 1);
    assert_eq!(delta("zrank"), batches - 1);
    assert!(
        sent >= expected && sent <= expected + 4096,
        "{sent} bytes sent, {expected} expected"
    );
    // No command took Redis as long as the default command timeout (100 ms; about 1 ms
    // each on an idle machine), deep into a run of 10,000 records of one purge too:
    // bounded by what matters, not closer, since a busy machine takes the CPU from
    // redis-server now and then.
    let slow: Vec<redis::Value> = server.cmd(&["SLOWLOG", "GET", "1000"]).await;
    let slow: Vec<String> = slow
        .iter()
        .map(|entry| format!("{entry:?}"))
        .filter(|entry| entry.to_lowercase().contains("zrange"))
        .collect();
    assert!(slow.is_empty(), "{slow:#?}");

    // The entry, tagged product-4242 and filled before its purge: not fresh, filled
    // again.
    let reader = web::instance(fresh, tagged(&["product-4242"]), origin.service()).await;
    assert_eq!(
        send(&reader.service, get("/items/1")).await.x_cache(),
        "miss"
    );
    assert_eq!(origin.calls(), 2);
    assert_eq!(reader.guard.mode(), Mode::Shared);
}

/// A read-back that fails (its user may not run `ZRANGEBYSCORE`): the subscription is
/// up and notices are heard all along, the breaker stays closed, and entries tagged
/// before the subscription came up are stale meanwhile, not fresh; once the user may,
/// the read-back succeeds (retried with backoff) and the purges it reads take effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_read_back_keeps_notices_and_the_breaker() {
    let server = RedisServer::start();
    let _: () = server
        .cmd(&[
            "ACL",
            "SETUSER",
            "limited",
            "on",
            ">pw",
            "~*",
            "&*",
            "+@all",
            "-zrangebyscore",
        ])
        .await;
    let limited = format!("redis://limited:pw@127.0.0.1:{}", server.addr().port());
    let origin = Origin::versions(Duration::ZERO);
    let filler = web::instance(
        StampedeGuard::builder(store(&server.url()), keys())
            .build()
            .unwrap(),
        tagged(&["old", "new"]),
        origin.service(),
    )
    .await;
    assert_eq!(
        send(&filler.service, get("/items/1")).await.x_cache(),
        "miss"
    );
    filler.guard.purge_tags(["old"], Purge::Hard).await.unwrap();
    assert_eq!(
        send(&filler.service, get("/items/1")).await.x_cache(),
        "miss"
    );
    assert_eq!(origin.calls(), 2);

    // A guard whose read-back fails: subscribed all the same.
    let b = web::instance(
        StampedeGuard::builder(store(&limited), keys())
            .build()
            .unwrap(),
        tagged(&["old", "new"]),
        origin.service(),
    )
    .await;
    assert!(b.guard.notices_connected());
    assert!(!b.guard.purges_caught_up());
    // The entry filled before b's subscription came up is stale on b, not fresh
    // (refreshed once: the refresh's entry is newer than the purge).
    let got = send(&b.service, get("/items/1")).await;
    assert_eq!(got.x_cache(), "stale");
    assert!(
        eventually(HANG, || async { origin.calls() == 3 }).await,
        "the stale entry was not refreshed"
    );
    // Notices are heard: a purge now takes effect on b.
    filler.guard.purge_tags(["new"], Purge::Hard).await.unwrap();
    assert!(
        eventually(HANG, || async {
            send(&b.service, get("/items/1")).await.x_cache() == "miss"
        })
        .await,
        "b did not hear the purge while its read-back failed"
    );
    let read_back_tries = look(&server).await.calls("zrangebyscore");
    assert!(!b.guard.purges_caught_up());
    assert_eq!(b.guard.mode(), Mode::Shared);
    assert!(!b.guard.store().circuit_open());

    // Allowed now: the read-back succeeds (retried with backoff), and b is caught up.
    let _: () = server
        .cmd(&["ACL", "SETUSER", "limited", "+zrangebyscore"])
        .await;
    caught_up(&b.guard).await;
    assert!(look(&server).await.calls("zrangebyscore") > read_back_tries);
    assert_eq!(b.guard.mode(), Mode::Shared);
    assert!(!b.guard.store().circuit_open());
    // b's entry is newer than every purge: a hit, now that nothing is owed.
    assert_eq!(send(&b.service, get("/items/1")).await.x_cache(), "hit");
}
