//! A stampede on one cache key, with and without a lease.
//!
//! Three "instances" (three lease clients, each with its own connections) serve 100
//! callers each. Every freshness window, all 300 find the cached value expired at once.
//! Without coordination every one of them recomputes it; with the lease one caller in the
//! whole fleet does, the others move on, and the one that writes the value carries a
//! fencing token that a late writer cannot beat.
//!
//! ```text
//! cargo run --example lease            # uses REDIS_URL, default redis://127.0.0.1:6379
//! ```

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use stampede_guard::keys::{KeySpace, Scope};
use stampede_guard::lease::{AcquireOutcome, LeaseClient, ReleaseOutcome};
use stampede_guard::store::RedisStore;
use tokio::sync::Barrier;

const INSTANCES: usize = 3;
const CALLERS_PER_INSTANCE: usize = 100;
const WINDOWS: usize = 5;
/// How long one recomputation takes.
const ORIGIN_TIME: Duration = Duration::from_millis(200);

#[tokio::main]
async fn main() -> ExitCode {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let keys = KeySpace::builder()
        .prefix("sg-demo")
        .env("local")
        .service("quote-api")
        .secret(b"demo secret: set a real one from your secret store".to_vec())
        .build()
        .expect("key space");
    let fleet: Vec<LeaseClient> = (0..INSTANCES)
        .map(|i| {
            let store = RedisStore::builder(url.as_str())
                .build()
                .expect("Redis URL");
            LeaseClient::builder(store, &keys)
                .instance_id(format!("instance-{i}"))
                .build()
                .expect("lease client")
        })
        .collect();
    if let Err(error) = fleet[0].store().ping().await {
        println!("No Redis answers at {url} ({error}).");
        println!("Start one (`redis-server --port 6379`) or set REDIS_URL, then run this again.");
        return ExitCode::SUCCESS;
    }

    let callers = INSTANCES * CALLERS_PER_INSTANCE;
    println!(
        "{callers} callers on {INSTANCES} instances, one hot key, {WINDOWS} freshness windows; \
         a recomputation takes {ORIGIN_TIME:?}.\n"
    );

    // Without coordination: everyone who finds the entry expired recomputes it.
    let unguarded = callers * WINDOWS;

    // With the lease.
    let name = Arc::new(
        keys.lease(
            &[Scope::label("quote"), Scope::id("quote", "q-123")],
            "recalculate",
        )
        .expect("lease name"),
    );
    let origin_calls = Arc::new(AtomicU64::new(0));
    let mut busy_total = 0;
    let started = Instant::now();
    println!("window  winner                 fencing token     busy  worst wait of a busy caller");
    for window in 1..=WINDOWS {
        let barrier = Arc::new(Barrier::new(callers));
        let mut tasks = Vec::new();
        for client in &fleet {
            for _ in 0..CALLERS_PER_INSTANCE {
                let (client, name, barrier, calls) = (
                    client.clone(),
                    name.clone(),
                    barrier.clone(),
                    origin_calls.clone(),
                );
                tasks.push(tokio::spawn(async move {
                    barrier.wait().await;
                    let asked = Instant::now();
                    match client.try_acquire(&name, Duration::from_secs(5)).await {
                        AcquireOutcome::Acquired(lease) => {
                            calls.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(ORIGIN_TIME).await; // the recomputation
                            let summary = (
                                lease.owner().holder().to_owned(),
                                lease.fencing_token().get(),
                            );
                            let released = client.release(lease).await;
                            assert!(matches!(released, ReleaseOutcome::Released));
                            Ok(summary)
                        }
                        // Busy: someone in the fleet is at it; serve the stale value.
                        AcquireOutcome::Busy { .. } => Err(asked.elapsed()),
                        other => panic!("Redis trouble: {other:?}"),
                    }
                }));
            }
        }
        let mut winners = Vec::new();
        let mut busy = 0;
        let mut worst_wait = Duration::ZERO;
        for task in tasks {
            match task.await.expect("caller task") {
                Ok(winner) => winners.push(winner),
                Err(waited) => {
                    busy += 1;
                    worst_wait = worst_wait.max(waited);
                }
            }
        }
        busy_total += busy;
        for (holder, token) in &winners {
            println!("{window:>6}  {holder:<22} {token:>16} {busy:>6}  {worst_wait:>10.2?}");
        }
    }
    let guarded = origin_calls.load(Ordering::Relaxed);
    println!(
        "\norigin calls: {unguarded} without coordination, {guarded} with the lease \
         ({busy_total} callers served stale instead), in {:.1?}.",
        started.elapsed()
    );
    if guarded == WINDOWS as u64 {
        println!("One recomputation per window for the whole fleet: the stampede was prevented.");
        ExitCode::SUCCESS
    } else {
        println!("Expected {WINDOWS} origin calls.");
        ExitCode::FAILURE
    }
}
