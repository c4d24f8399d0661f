//! A database update under a Redis lease, fenced so that a holder whose lease expired
//! cannot overwrite a newer holder's write.
//!
//! ```text
//! cargo run --example fenced_update --features postgres
//! # REDIS_URL (default redis://127.0.0.1:6379)
//! # DATABASE_URL (default "host=127.0.0.1 user=postgres dbname=postgres")
//! ```
//!
//! The pattern, step by step:
//!
//! 1. acquire the Redis lease (one script: `SET NX PX` and a fencing token);
//! 2. do the work;
//! 3. update PostgreSQL with a guard on the token:
//!    `UPDATE … SET …, fencing_token = $2 WHERE quote_id = $1 AND fencing_token <= $2`;
//! 4. an update count of zero means this holder is stale: a typed error,
//!    [`FenceError::StaleOwner`], never a `bool`;
//! 5. release the lease (owner-checked).
//!
//! Two holders play it out. Holder A takes the lease and stalls (a pause, a slow call)
//! past its TTL; holder B takes the lease with a higher token and commits; A wakes and
//! writes what it computed. PostgreSQL refuses A's write, and the row keeps B's value.

use std::process::ExitCode;
use std::time::Duration;

use stampede_guard::keys::{KeySpace, Scope};
use stampede_guard::lease::{AcquireOutcome, Lease, LeaseClient, ReleaseOutcome};
use stampede_guard::postgres::tokio_postgres::{self, NoTls};
use stampede_guard::postgres::{FenceError, FencedTable};
use stampede_guard::store::RedisStore;

const LEASE_TTL: Duration = Duration::from_millis(800);

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let database = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=postgres".to_owned());

    let keys = KeySpace::builder()
        .prefix("sg-demo")
        .env("local")
        .service("quote-api")
        .secret(b"demo secret: set a real one from your secret store".to_vec())
        .build()?;
    let store = RedisStore::builder(redis.as_str())
        .command_timeout(Duration::from_millis(100))
        .build()?;
    let pod_a = LeaseClient::builder(store.clone(), &keys)
        .instance_id("pod-a")
        .build()?;
    let pod_b = LeaseClient::builder(store, &keys)
        .instance_id("pod-b")
        .build()?;

    let (db, connection) = tokio_postgres::connect(&database, NoTls).await?;
    tokio::spawn(connection);
    // The protected resource: a row that carries the token of its last writer.
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS quote_recalc_state (
             quote_id text PRIMARY KEY,
             status text NOT NULL,
             total bigint NOT NULL DEFAULT 0,
             fencing_token bigint NOT NULL DEFAULT 0
         );
         INSERT INTO quote_recalc_state (quote_id, status) VALUES ('q-123', 'PENDING')
             ON CONFLICT (quote_id) DO UPDATE SET status = 'PENDING', total = 0;",
    )
    .await?;
    let table = FencedTable::new("quote_recalc_state", "quote_id", "fencing_token")?;
    let name = keys.lease(&[Scope::id("quote", "q-123")], "recalculate")?;

    // 1. A takes the lease.
    let a = acquired(pod_a.try_acquire(&name, LEASE_TTL).await)?;
    println!("A acquired the lease, token {}", a.fencing_token());

    // 2. A stalls past its TTL; Redis expires the lease.
    println!(
        "A stalls for {:?} (its lease lasts {LEASE_TTL:?})",
        LEASE_TTL * 2
    );
    tokio::time::sleep(LEASE_TTL * 2).await;

    // B takes it, with a higher token, and commits.
    let b = acquired(pod_b.try_acquire(&name, LEASE_TTL).await)?;
    println!("B acquired the lease, token {}", b.fencing_token());
    let written = table
        .update(
            &db,
            &"q-123",
            b.fencing_token(),
            &[("status", &"DONE"), ("total", &200i64)],
        )
        .await?;
    if let Some(token) = written.token() {
        println!("B wrote total = 200; the row holds token {token}");
    }
    release(&pod_b, b, "B").await;

    // 3. A wakes and writes what it computed: refused by PostgreSQL.
    match table
        .update(
            &db,
            &"q-123",
            a.fencing_token(),
            &[("status", &"DONE"), ("total", &100i64)],
        )
        .await
    {
        Ok(_) => return Err("A's stale write went through: the fence is missing".into()),
        Err(FenceError::StaleOwner { token, current }) => {
            println!("A's write was refused: token {token} is stale, the row holds {current}");
        }
        Err(other) => return Err(other.into()),
    }
    // 5. A's release finds the lease someone else's (or gone) and deletes nothing.
    release(&pod_a, a, "A").await;

    let row = db
        .query_one(
            "SELECT status, total, fencing_token FROM quote_recalc_state WHERE quote_id = $1",
            &[&"q-123"],
        )
        .await?;
    let (status, total, token): (String, i64, i64) = (row.get(0), row.get(1), row.get(2));
    println!("the row: status {status}, total {total}, fencing_token {token}");
    if total != 200 {
        return Err(format!("the row holds {total}, not B's 200").into());
    }
    Ok(())
}

fn acquired(outcome: AcquireOutcome) -> Result<Lease, Box<dyn std::error::Error>> {
    match outcome {
        AcquireOutcome::Acquired(lease) => Ok(lease),
        other => Err(format!("lease not acquired: {}", other.as_str()).into()),
    }
}

async fn release(leases: &LeaseClient, lease: Lease, who: &str) {
    match leases.release(lease).await {
        ReleaseOutcome::Released => println!("{who} released the lease"),
        ReleaseOutcome::NotOwner => {
            println!("{who}'s release: not the owner any more, nothing deleted")
        }
        ReleaseOutcome::Failed(error) => {
            println!("{who}'s release failed ({error}); it ends by its TTL")
        }
        other => println!("{who}'s release: {}", other.as_str()),
    }
}
