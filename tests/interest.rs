//! Fill notices reach the instances that wait for the key, and only those: a fill is
//! published on the key's interest channel, which only a waiting instance subscribes
//! (and lets go a while after its wait); a waiter subscribes before it looks at the
//! entry again, so that a fill that lands before its subscription is found, not
//! missed; a waiter whose bucket Redis refuses looks for the entry itself.

#[path = "support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use stampede_guard::RedisStore;
use stampede_guard::metrics::Event;
use support::app::{instance, patient_policy};
use support::web::{self, get, keys, send};
use support::{HANG, Mode, Proxy, Redis, RedisServer, eventually, joined};

/// The interest channel of an entry key, as the crate names it: the broadcast channel,
/// a colon and FNV-1a (32 bits) of the entry key modulo 4096, in hex. Written out here
/// on purpose: it is a wire format, which other versions must agree on.
fn interest_channel(entry_key: &str) -> String {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in entry_key.bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    format!(
        "{}:{:03x}",
        stampede_guard::fuzzing::channel(&keys()),
        hash % 4096
    )
}

/// How many connections subscribe to `channel`.
async fn numsub(redis: &Redis, channel: &str) -> u64 {
    let counts: Vec<(String, u64)> = redis
        .cmd(redis::cmd("PUBSUB").arg("NUMSUB").arg(channel))
        .await;
    counts[0].1
}

/// The `sub=` count (channels subscribed) of every connection, from `CLIENT LIST`.
async fn subscriptions(redis: &Redis) -> Vec<u64> {
    let list: String = redis.cmd(redis::cmd("CLIENT").arg("LIST")).await;
    list.lines()
        .filter_map(|line| {
            line.split(' ')
                .find_map(|field| field.strip_prefix("sub="))
                .and_then(|n| n.parse().ok())
        })
        .filter(|&n| n > 0)
        .collect()
}

/// Every message published on the key space's channels, by channel: a pattern
/// subscription of the test's own, on a direct connection.
struct Observer {
    seen: Arc<Mutex<HashMap<String, Vec<String>>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Observer {
    async fn start(url: &str) -> Self {
        let client = redis::Client::open(url).unwrap();
        let mut pubsub = client.get_async_pubsub().await.unwrap();
        pubsub
            .psubscribe(format!("{}*", stampede_guard::fuzzing::channel(&keys())))
            .await
            .unwrap();
        let seen: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
        let task = tokio::spawn({
            let seen = seen.clone();
            async move {
                let mut messages = pubsub.into_on_message();
                while let Some(message) = messages.next().await {
                    let payload = String::from_utf8_lossy(message.get_payload_bytes()).into();
                    seen.lock()
                        .unwrap()
                        .entry(message.get_channel_name().to_owned())
                        .or_default()
                        .push(payload);
                }
            }
        });
        Self { seen, task }
    }

    /// The messages of `kind` (`f`, `e`, ...) published on `channel`.
    fn count(&self, channel: &str, kind: &str) -> usize {
        self.seen.lock().unwrap().get(channel).map_or(0, |all| {
            all.iter()
                .filter(|m| m.starts_with(&format!("{kind} ")))
                .count()
        })
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Four instances on one Redis, as the least-privileged user; A fills a cold key (its
/// origin held), B waits for it, C and D are idle. The fill is published once, on the
/// key's interest channel, which B alone subscribes: it reaches B and no idle
/// instance. B's wait ends on it; a second after, B lets the bucket go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_reaches_the_waiting_instance_and_no_idle_one() {
    let redis = Redis::least_privileged(&keys()).await;
    let origin = web::Origin::versions(Duration::ZERO);
    origin.hold(1);
    let policy = || patient_policy("items").build().unwrap();
    let mut fleet = Vec::new();
    for _ in 0..4 {
        fleet.push(instance(&redis, policy(), origin.service()).await);
    }
    let Redis::LeastPrivileged(server, _) = &redis else {
        unreachable!()
    };
    let observer = Observer::start(&server.url()).await;
    let broadcast = stampede_guard::fuzzing::channel(&keys());
    let entry = fleet[0].layer.cache_keys(&get("/items/1")).unwrap();
    let bucket = interest_channel(entry.entry());
    // Idle: every instance hears the broadcast channel, none a bucket.
    assert_eq!(numsub(&redis, &broadcast).await, 4);
    assert_eq!(subscriptions(&redis).await, vec![1; 4]);

    let a = tokio::spawn({
        let service = fleet[0].service.clone();
        async move { send(&service, get("/items/1")).await }
    });
    assert!(
        eventually(HANG, || async { origin.calls() == 1 }).await,
        "A did not call the origin"
    );
    let b = tokio::spawn({
        let service = fleet[1].service.clone();
        async move { send(&service, get("/items/1")).await }
    });
    assert!(
        eventually(HANG, || async { numsub(&redis, &bucket).await == 1 }).await,
        "B did not subscribe the key's bucket"
    );
    // B's connection holds two channels (the broadcast and the bucket), the others one.
    let mut subs = subscriptions(&redis).await;
    subs.sort_unstable();
    assert_eq!(subs, vec![1, 1, 1, 2]);
    assert_eq!(fleet[1].layer.stats().get(Event::ColdWaitStarted), 1);

    origin.open();
    let (a, b) = (
        joined(a, HANG, "A's fill").await,
        joined(b, HANG, "B's wait").await,
    );
    assert_eq!((a.body.as_str(), b.body.as_str()), ("v1", "v1"));
    assert_eq!(origin.calls(), 1);
    // B's wait was ended by the entry (the notice), not by its deadline.
    assert_eq!(fleet[1].layer.stats().get(Event::ColdWaitNotified), 1);
    assert_eq!(fleet[1].layer.stats().get(Event::ColdWaitTimedOut), 0);
    // Published once, on the bucket, and never on the broadcast channel; when it was,
    // the bucket had one subscriber: B.
    let published = eventually(Duration::from_secs(5), || async {
        observer.count(&bucket, "f") == 1
    });
    assert!(
        published.await,
        "the fill notice was not published on the bucket"
    );
    assert_eq!(observer.count(&broadcast, "f"), 0);
    assert_eq!(observer.count(&broadcast, "e"), 0);
    assert_eq!(numsub(&redis, &bucket).await, 1, "B still lingers");
    // The idle instances never subscribed anything but the broadcast channel.
    for idle in &fleet[2..] {
        assert_eq!(idle.layer.stats().get(Event::ColdWaitStarted), 0);
    }

    // Nobody waits any more: B lets the bucket go within a second or two (UNSUBSCRIBE,
    // which the least-privileged user may send), and keeps the broadcast channel.
    let started = Instant::now();
    assert!(
        eventually(Duration::from_secs(10), || async {
            numsub(&redis, &bucket).await == 0
        })
        .await,
        "B kept the bucket"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(numsub(&redis, &broadcast).await, 4);
    assert_eq!(subscriptions(&redis).await, vec![1; 4]);
    let channels: Vec<String> = redis.cmd(redis::cmd("PUBSUB").arg("CHANNELS")).await;
    assert_eq!(channels, vec![broadcast]);
}

/// How slow B's connections are made in the races below, each way.
const SLOW: Duration = Duration::from_millis(500);

/// No lost wake-up, the fill first: B's `SUBSCRIBE` of the key's bucket reaches Redis a
/// slow hop after B found the lease busy, and A's fill lands in between: published to
/// nobody. B then looks at the entry (after its subscription is confirmed, as a waiter
/// does) and finds it, long before its cold wait (10 s) would have ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_bucket_came_up_after_the_fill_finds_the_entry() {
    race(false).await;
}

/// No lost wake-up, the subscription first: after B found the lease busy, A's fill is
/// let go as soon as Redis has either B's `SUBSCRIBE` of the bucket or B's next look at
/// the entry; it must be the `SUBSCRIBE`. A waiter that looked first and subscribed
/// after would miss this fill (its look before it, its subscription after) and wait
/// out its cold wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_between_the_subscription_and_the_look_wakes_the_waiter() {
    race(true).await;
}

/// The scripts Redis ran (`EVALSHA` calls).
async fn scripts_run(redis: &Redis) -> u64 {
    let stats: String = redis.cmd(redis::cmd("INFO").arg("commandstats")).await;
    stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// B's connections are slowed (`SLOW` each way) once it is ready; A holds the lease of
/// a cold key (its origin held) and B waits for it. A's fill is let go at once when B
/// found the lease busy, or, `after_first_step`, once Redis has B's next step (its
/// `SUBSCRIBE`, or a look at the entry).
async fn race(after_first_step: bool) {
    let server = RedisServer::start();
    let redis = Redis::Single(server);
    let Redis::Single(server) = &redis else {
        unreachable!()
    };
    let proxy = Proxy::start(server.addr()).await;
    let origin = web::Origin::versions(Duration::ZERO);
    origin.hold(1);
    // Leases and back-offs long enough for B's command timeout.
    let policy = || {
        patient_policy("items")
            .lease_ttl(Duration::from_secs(20))
            .error_backoff(Duration::from_secs(10))
            .build()
            .unwrap()
    };
    let a = instance(&redis, policy(), origin.service()).await;
    // B's every reply takes two slow hops: its deadlines allow for them.
    let store = RedisStore::builder(proxy.url())
        .command_timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let b = web::instance(
        stampede_guard::StampedeGuard::builder(store, keys())
            .build()
            .unwrap(),
        policy(),
        origin.service(),
    )
    .await;
    let entry = a.layer.cache_keys(&get("/items/1")).unwrap();
    let bucket = interest_channel(entry.entry());

    let a_fill = tokio::spawn({
        let service = a.service.clone();
        async move { send(&service, get("/items/1")).await }
    });
    assert!(
        eventually(HANG, || async { origin.calls() == 1 }).await,
        "A did not call the origin"
    );
    proxy.set(Mode::Delay(SLOW));
    let b_wait = tokio::spawn({
        let service = b.service.clone();
        async move { send(&service, get("/items/1")).await }
    });
    // B found the lease busy (a reply that took a slow hop back): its `SUBSCRIBE` is on
    // its way, a slow hop from Redis.
    assert!(
        eventually(HANG, || async {
            b.layer.stats().get(Event::ColdWaitStarted) == 1
        })
        .await,
        "B did not wait"
    );
    let scripts = scripts_run(&redis).await;
    if after_first_step {
        let step = eventually(HANG, || async {
            numsub(&redis, &bucket).await == 1 || scripts_run(&redis).await > scripts
        });
        assert!(step.await, "B took no step");
        // The step was the subscription: B has not looked at the entry again.
        assert_eq!(numsub(&redis, &bucket).await, 1);
        assert_eq!(scripts_run(&redis).await, scripts, "B looked first");
    }
    origin.open();
    let opened = Instant::now();
    assert_eq!(joined(a_fill, HANG, "A's fill").await.body, "v1");
    assert!(
        opened.elapsed() < SLOW / 4,
        "the fill took too long for the race"
    );
    // When the fill landed, B had subscribed (after its first step) or not yet (at
    // once: its notice reached nobody).
    let subscribed = u64::from(after_first_step);
    assert_eq!(
        numsub(&redis, &bucket).await,
        subscribed,
        "the race was lost"
    );

    let got = joined(b_wait, HANG, "B's wait").await;
    let took = opened.elapsed();
    assert_eq!(got.body, "v1");
    assert_eq!(origin.calls(), 1);
    // Its subscription (a slow round trip) and its look (another): about 2 s; the
    // cold wait would have been 10 s.
    assert!(took < Duration::from_secs(6), "B took {took:?}");
    assert_eq!(b.layer.stats().get(Event::ColdWaitNotified), 1);
    assert_eq!(b.layer.stats().get(Event::ColdWaitTimedOut), 0);
    // And it subscribed.
    assert_eq!(numsub(&redis, &bucket).await, 1);
}

/// A waiter whose bucket Redis refuses (an ACL that allows the broadcast channel
/// alone) goes on without it: it looks for the entry every 100 ms and finds it soon
/// after the fill, long before its cold wait ends; its notice subscription stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_bucket_is_refused_looks_for_the_entry_itself() {
    let server = RedisServer::start();
    let broadcast = stampede_guard::fuzzing::channel(&keys());
    // The least-privileged rules, with the broadcast channel as the only channel.
    let mut setuser = redis::cmd("ACL");
    setuser
        .arg("SETUSER")
        .arg("narrow")
        .arg("on")
        .arg(">narrow-pw");
    for rule in keys().acl_rules().split_whitespace() {
        if rule.starts_with('&') {
            setuser.arg(format!("&{broadcast}"));
        } else {
            setuser.arg(rule);
        }
    }
    let () = setuser.query_async(&mut server.conn().await).await.unwrap();
    let redis = Redis::Single(server);
    let Redis::Single(server) = &redis else {
        unreachable!()
    };
    let origin = web::Origin::versions(Duration::ZERO);
    origin.hold(1);
    let policy = || patient_policy("items").build().unwrap();
    let a = instance(&redis, policy(), origin.service()).await;
    let narrow = format!(
        "redis://narrow:narrow-pw@127.0.0.1:{}",
        server.addr().port()
    );
    let b = web::instance(
        support::app::guard_at(&narrow, |b| b),
        policy(),
        origin.service(),
    )
    .await;
    let a_fill = tokio::spawn({
        let service = a.service.clone();
        async move { send(&service, get("/items/1")).await }
    });
    assert!(
        eventually(HANG, || async { origin.calls() == 1 }).await,
        "A did not call the origin"
    );
    let b_wait = tokio::spawn({
        let service = b.service.clone();
        async move { send(&service, get("/items/1")).await }
    });
    assert!(
        eventually(HANG, || async {
            b.layer.stats().get(Event::ColdWaitStarted) == 1
        })
        .await,
        "B did not wait"
    );
    // Let B's SUBSCRIBE be refused, and B poll a few times.
    tokio::time::sleep(Duration::from_millis(300)).await;
    origin.open();
    let opened = Instant::now();
    assert_eq!(joined(a_fill, HANG, "A's fill").await.body, "v1");
    let got = joined(b_wait, HANG, "B's wait").await;
    assert_eq!(got.body, "v1");
    assert!(
        opened.elapsed() < Duration::from_secs(3),
        "{:?}",
        opened.elapsed()
    );
    assert_eq!(origin.calls(), 1);
    assert_eq!(b.layer.stats().get(Event::ColdWaitTimedOut), 0);
    // B's notice subscription stayed up (it was not cut for the refusal).
    assert!(b.guard.notices_connected());
    assert_eq!(numsub(&redis, &broadcast).await, 2);
}
