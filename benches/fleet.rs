//! A fleet stampede: K = 1, 3 and 8 instances on one Redis, then on a Redis Cluster
//! (three primaries, a replica each), a crowd of clients on a few hot keys over several
//! freshness windows, from a cold start. Reports origin calls per key per freshness
//! window (the goal is 1.0 whatever K, on either) and the latency of stale-served
//! requests against fresh hits measured in the same run; on one server, again with
//! eager refresh at half the fresh time (each key refreshed before it goes stale: about
//! two calls per window, and no stale answers once filled).
//!
//! ```text
//! cargo bench --bench fleet --features cluster
//! ```

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stampede_guard::{Policy, StampedeGuard, store::DEFAULT_COMMAND_TIMEOUT};
use support::web::{Origin, get, instance, keys, send};
use support::{RedisCluster, RedisServer, Store};

const KEYS: usize = 4;
const CLIENTS: usize = 200;
const FRESH: Duration = Duration::from_millis(500);
const RUN: Duration = Duration::from_secs(3);
const ORIGIN_TIME: Duration = Duration::from_millis(50);

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

async fn run(redis: &impl Store, k: usize, round: usize, eager: bool) {
    let origin = Origin::versions(ORIGIN_TIME);
    let mut fleet = Vec::new();
    for _ in 0..k {
        let store = redis.store(DEFAULT_COMMAND_TIMEOUT);
        let guard = StampedeGuard::builder(store, keys()).build().unwrap();
        let mut policy = Policy::builder("items")
            .fresh_ttl(FRESH)
            .grace(Duration::from_secs(10))
            .lease_ttl(Duration::from_secs(1))
            .refresh_timeout(Duration::from_millis(800));
        if eager {
            policy = policy.eager_refresh(0.5);
        }
        let policy = policy.build().unwrap();
        fleet.push(instance(guard, policy, origin.service()).await);
    }
    let samples: Arc<Mutex<Vec<(String, Duration)>>> = Arc::default();
    let end = Instant::now() + RUN;
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let service = fleet[client % k].service.clone();
        let samples = samples.clone();
        clients.push(tokio::spawn(async move {
            let mut n = client;
            let mut mine = Vec::new();
            while Instant::now() < end {
                n += 1;
                let sent = Instant::now();
                // A key space of its own per run: every run starts cold.
                let got = send(
                    &service,
                    get(&format!("/r{round}{eager}/items/{}", n % KEYS)),
                )
                .await;
                mine.push((got.x_cache().to_owned(), sent.elapsed()));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            samples.lock().unwrap().extend(mine);
        }));
    }
    for client in clients {
        client.await.unwrap();
    }
    let samples = std::mem::take(&mut *samples.lock().unwrap());
    let of = |kind: &str| {
        let mut v: Vec<Duration> = samples
            .iter()
            .filter(|(x, _)| x == kind)
            .map(|(_, d)| *d)
            .collect();
        v.sort();
        v
    };
    let (hits, stale) = (of("hit"), of("stale"));
    let windows = RUN.as_secs_f64() / FRESH.as_secs_f64() + 1.0;
    let per_key_window = origin.calls() as f64 / (KEYS as f64 * windows);
    println!(
        "K={k:<2} {} requests {:>7}  origin calls {:>3}  per key per window {:.2}  \
         stale answers {:>5.2} %  \
         hit p50/p99 {:>5.1}/{:>6.1} µs  stale p50/p99 {:>5.1}/{:>6.1} µs  stale/hit p99 {:.2}x",
        if eager { "eager" } else { "     " },
        samples.len(),
        origin.calls(),
        per_key_window,
        100.0 * stale.len() as f64 / samples.len().max(1) as f64,
        us(percentile(&hits, 0.5)),
        us(percentile(&hits, 0.99)),
        us(percentile(&stale, 0.5)),
        us(percentile(&stale, 0.99)),
        us(percentile(&stale, 0.99)) / us(percentile(&hits, 0.99)).max(0.001),
    );
}

fn main() {
    let server = RedisServer::start();
    let cluster = RedisCluster::start();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "{CLIENTS} clients, {KEYS} hot keys, fresh {FRESH:?}, origin {ORIGIN_TIME:?}, {RUN:?} from a cold start \
         ({:.0} windows counting the cold one)",
        RUN.as_secs_f64() / FRESH.as_secs_f64() + 1.0
    );
    runtime.block_on(async {
        println!("one Redis server:");
        for eager in [false, true] {
            for (round, k) in [1, 3, 8].into_iter().enumerate() {
                run(&server, k, round, eager).await;
            }
        }
        println!("a Redis Cluster of three primaries:");
        for (round, k) in [1, 3, 8].into_iter().enumerate() {
            run(&cluster, k, round, false).await;
        }
    });
}
