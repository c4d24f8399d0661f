//! What a lease costs against the bare commands it replaces, on one real Redis server.
//!
//! Baseline: `SET key value NX PX ttl` then `DEL key` (the unsafe textbook lock, two round
//! trips). Measured: `try_acquire` then `release` (two Lua scripts, with fencing token and
//! owner check, two round trips). Both run on the same server over the same pool, in
//! interleaved batches so that machine noise falls on both alike; the figure to read is
//! the ratio.
//!
//! ```text
//! cargo bench --bench lease
//! ```

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use stampede_guard::keys::{KeySpace, Scope};
use stampede_guard::lease::{AcquireOutcome, LeaseClient, ReleaseOutcome};
use stampede_guard::store::RedisStore;
use support::RedisServer;

const BATCH: u32 = 2_000;
const ROUNDS: usize = 15;

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Started from the main thread, which outlives the runtime (see the support docs).
    let server = RedisServer::start();
    runtime.block_on(run(&server));
}

async fn run(server: &RedisServer) {
    let keys = KeySpace::builder()
        .env("bench")
        .service("bench")
        .secret(b"bench secret, sixteen bytes or more".to_vec())
        .build()
        .unwrap();
    let store = RedisStore::builder(server.url()).build().unwrap();
    let leases = LeaseClient::builder(store, &keys).build().unwrap();
    let name = keys
        .lease(&[Scope::id("quote", "q-1")], "recalculate")
        .unwrap();
    let raw = server.conn().await;
    let mut stats = server.conn().await;
    let ttl = Duration::from_secs(5);

    let bare = || {
        let mut raw = raw.clone();
        let key = name.key().to_owned();
        async move {
            let start = Instant::now();
            for _ in 0..BATCH {
                let ok: Option<String> = redis::cmd("SET")
                    .arg(&key)
                    .arg("owner")
                    .arg("NX")
                    .arg("PX")
                    .arg(5000)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
                assert!(ok.is_some());
                let _: i64 = redis::cmd("DEL")
                    .arg(&key)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
            }
            start.elapsed() / BATCH
        }
    };
    let lease = || {
        let (leases, name) = (leases.clone(), name.clone());
        async move {
            let start = Instant::now();
            for _ in 0..BATCH {
                let AcquireOutcome::Acquired(lease) = leases.try_acquire(&name, ttl).await else {
                    panic!("not acquired");
                };
                let ReleaseOutcome::Released = leases.release(lease).await else {
                    panic!("not released");
                };
            }
            start.elapsed() / BATCH
        }
    };

    // Warm up (loads the scripts, opens the connections).
    bare().await;
    lease().await;

    let before = calls(&mut stats).await;
    lease().await;
    let after = calls(&mut stats).await;
    // Round trips are the commands clients sent; the scripts' own calls inside Redis
    // (PTTL, TIME, GET, SET...) are counted by Redis too, so they are told apart.
    let round_trips = (after.0 - before.0) as f64 / f64::from(BATCH);
    let inside = (after.1 - before.1 - 1) as f64 / f64::from(BATCH);

    let (mut bare_times, mut lease_times) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        bare_times.push(bare().await);
        lease_times.push(lease().await);
    }
    let (b, l) = (median(&mut bare_times), median(&mut lease_times));
    println!("lease round trip, {ROUNDS} interleaved rounds of {BATCH}, median per pair:");
    println!("  SET NX PX + DEL (baseline)        {:>8.1} µs", micros(b));
    println!("  try_acquire + release             {:>8.1} µs", micros(l));
    println!(
        "  ratio                             {:>8.2}x",
        micros(l) / micros(b)
    );
    println!(
        "  round trips per acquire+release:   {round_trips:>8.2} (EVALSHA; {inside:.2} commands \
         run in Redis, scripts' own included; from INFO commandstats)"
    );
}

/// (`EVALSHA` calls, all commands run) from `INFO commandstats`, the `INFO` included.
async fn calls(conn: &mut redis::aio::MultiplexedConnection) -> (u64, u64) {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    let mut counts = (0, 0);
    for (name, rest) in stats.lines().filter_map(|l| l.split_once(":calls=")) {
        let n: u64 = rest.split(',').next().unwrap().parse().unwrap();
        if name == "cmdstat_evalsha" {
            counts.0 += n;
        }
        counts.1 += n;
    }
    counts
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
