//! A periodic job run by one instance of a fleet per tick, safe when two run at once.
//!
//! ```text
//! cargo run --example scheduler --features postgres                 # 3 instances here
//! cargo run --example scheduler --features postgres -- --instance pod-a --ticks 20
//! #   (run that in several terminals, with different names: one process each)
//! # options: --instances N (3), --ticks N (6), --every MS (1000), --items N (40),
//! #          --batch N (5), --reset (start the items again)
//! # REDIS_URL (default redis://127.0.0.1:6379)
//! # DATABASE_URL (default "host=127.0.0.1 user=postgres dbname=postgres")
//! ```
//!
//! The pattern (see `stampede_guard::leader`):
//!
//! 1. every instance wakes at the tick (the same tick number everywhere: the wall
//!    clock divided by the period);
//! 2. each tries the job's lease without waiting ([`Leadership::run_once`]); one wins;
//! 3. the winner records the run durably: it claims the tick in PostgreSQL, fenced by
//!    its token (`WHERE last_tick < $tick AND fencing_token < $token`). A second
//!    winner of the same tick (after the first released) finds it claimed and stops;
//! 4. it processes a bounded batch, one transaction per item, each guarded by the
//!    item's state (`status = 'pending'`) and by its token against the newest claim
//!    (whose row it locks for share, so that a new claim waits for an item in flight),
//!    checking between items that it still leads;
//! 5. the lease is renewed while it works, for at most the maximum term, and released.
//!
//! Duplicate runs are safe: an item is done once whoever does it (its state guard), a
//! leader taken over is refused at its next item (the token guard), and work left
//! half-way by a leader that died stays pending for the next tick.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use stampede_guard::keys::{KeySpace, Scope};
use stampede_guard::leader::{Leadership, Term, Tick};
use stampede_guard::lease::LeaseClient;
use stampede_guard::postgres::tokio_postgres::{self, Client, NoTls};
use stampede_guard::postgres::{FenceError, FencedTable, execute_guarded, to_bigint};
use stampede_guard::store::RedisStore;

const JOB: &str = "quote-expiry";

struct Args {
    instances: Vec<String>,
    ticks: u64,
    every: Duration,
    items: i32,
    batch: i64,
    reset: bool,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        instances: vec![],
        ticks: 6,
        every: Duration::from_millis(1000),
        items: 40,
        batch: 5,
        reset: false,
    };
    let mut count = 3usize;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        let number = |v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("`{v}` is not a number"))
        };
        match arg.as_str() {
            "--instance" => args.instances.push(value()?),
            "--instances" => count = number(value()?)? as usize,
            "--ticks" => args.ticks = number(value()?)?,
            "--every" => args.every = Duration::from_millis(number(value()?)?.max(1)),
            "--items" => {
                args.items = i32::try_from(number(value()?)?).map_err(|_| "--items is too large")?
            }
            "--batch" => {
                args.batch = i64::try_from(number(value()?)?).map_err(|_| "--batch is too large")?
            }
            "--reset" => args.reset = true,
            other => {
                return Err(format!(
                    "unknown argument {other:?}; see examples/scheduler.rs"
                ));
            }
        }
    }
    if args.instances.is_empty() {
        args.instances = (0..count)
            .map(|i| format!("pod-{}", (b'a' + i as u8) as char))
            .collect();
        args.reset = true;
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match args() {
        Ok(args) => args,
        Err(error) => {
            eprintln!("{error}");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}

async fn connect() -> Result<Client, Box<dyn std::error::Error>> {
    let database = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "host=127.0.0.1 user=postgres dbname=postgres".to_owned());
    let (db, connection) = tokio_postgres::connect(&database, NoTls).await?;
    tokio::spawn(connection);
    Ok(db)
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let db = connect().await?;
    db.batch_execute(
        "CREATE TABLE IF NOT EXISTS sched_job_state (
             job text PRIMARY KEY,
             last_tick bigint NOT NULL DEFAULT -1,
             fencing_token bigint NOT NULL DEFAULT 0);
         CREATE TABLE IF NOT EXISTS sched_items (
             id int PRIMARY KEY,
             status text NOT NULL DEFAULT 'pending',
             done_by text,
             done_tick bigint);",
    )
    .await?;
    db.execute(
        "INSERT INTO sched_job_state (job) VALUES ($1) ON CONFLICT DO NOTHING",
        &[&JOB],
    )
    .await?;
    if args.reset {
        db.execute("DELETE FROM sched_items", &[]).await?;
        db.execute(
            "INSERT INTO sched_items (id) SELECT generate_series(1, $1)",
            &[&args.items],
        )
        .await?;
    }

    let redis = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let keys = KeySpace::builder()
        .prefix("sg-demo")
        .env("local")
        .service("quote-api")
        .secret(b"demo secret: set a real one from your secret store".to_vec())
        .build()?;
    let lease = keys.lease(&[Scope::label("scheduler")], JOB)?;
    let mut tasks = Vec::new();
    for name in &args.instances {
        let store = RedisStore::builder(redis.as_str()).build()?;
        let leases = LeaseClient::builder(store, &keys)
            .instance_id(name)
            .build()?;
        let leadership = Leadership::builder(leases, lease.clone())
            .lease_ttl(Duration::from_secs(5))
            .max_term(args.every * 10)
            .build()?;
        let db = connect().await?;
        tasks.push(tokio::spawn(instance(
            name.clone(),
            leadership,
            db,
            args.ticks,
            args.every,
            args.batch,
        )));
    }
    for task in tasks {
        task.await??;
    }
    let left: i64 = db
        .query_one(
            "SELECT count(*) FROM sched_items WHERE status = 'pending'",
            &[],
        )
        .await?
        .get(0);
    println!("{left} items still pending");
    Ok(())
}

/// One instance: wakes at every tick, and runs the job when it leads.
async fn instance(
    name: String,
    leadership: Leadership,
    mut db: Client,
    ticks: u64,
    every: Duration,
    batch: i64,
) -> Result<(), String> {
    for _ in 0..ticks {
        let tick = sleep_to_next_tick(every).await;
        let db = &mut db;
        let name_ref = name.as_str();
        let outcome = leadership
            .run_once(|term| job(db, name_ref, tick, term, batch))
            .await;
        match outcome {
            Tick::Led {
                output: Ok(Some(done)),
                token,
                ..
            } => {
                println!("tick {tick}: {name} led (token {token}) and did {done} items");
            }
            Tick::Led {
                output: Ok(None), ..
            } => {
                println!("tick {tick}: {name} led, but the tick was already claimed: nothing done");
            }
            Tick::Led {
                output: Err(error), ..
            } => println!("tick {tick}: {name} failed: {error}"),
            Tick::Busy => {}
            Tick::Stopped { reason, .. } => {
                println!("tick {tick}: {name} stopped: {}", reason.as_str())
            }
            Tick::Unavailable(error) => println!("tick {tick}: {name} skipped: {error}"),
            other => println!("tick {tick}: {name}: {}", other.as_str()),
        }
    }
    Ok(())
}

/// Sleeps to the start of the next tick; returns its number (the same on every
/// instance whose clock is within a fraction of a period).
async fn sleep_to_next_tick(every: Duration) -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let period = every.as_millis();
    let next = now.as_millis() / period + 1;
    let wait = Duration::from_millis((next * period - now.as_millis()) as u64);
    tokio::time::sleep(wait).await;
    next as i64
}

/// The job: claim the tick, then a bounded batch. `Ok(None)`: the tick was claimed
/// already (a duplicate run, harmless).
async fn job(
    db: &mut Client,
    instance: &str,
    tick: i64,
    term: Term,
    batch: i64,
) -> Result<Option<usize>, FenceError> {
    let token = to_bigint(term.token())?;
    let claims = FencedTable::new("sched_job_state", "job", "fencing_token")?;
    match execute_guarded(
        &*db,
        "UPDATE sched_job_state SET last_tick = $2, fencing_token = $3
          WHERE job = $1 AND last_tick < $2 AND fencing_token < $3",
        &[&JOB, &tick, &token],
    )
    .await
    {
        Ok(_) => {}
        Err(FenceError::GuardRefused) => return Ok(None),
        Err(other) => return Err(other),
    }
    let pending: Vec<i32> = db
        .query(
            "SELECT id FROM sched_items WHERE status = 'pending' ORDER BY id LIMIT $1",
            &[&batch],
        )
        .await
        .map_err(FenceError::Database)?
        .iter()
        .map(|row| row.get(0))
        .collect();
    let mut done = 0;
    for id in pending {
        if !term.is_held() {
            break; // another instance may lead now
        }
        let tx = db.transaction().await.map_err(FenceError::Database)?;
        match claims
            .execute_fenced(
                &tx,
                // The claim's row locked for share: a new claim waits for this item.
                "UPDATE sched_items SET status = 'done', done_by = $2, done_tick = $3
                  WHERE id = $1 AND status = 'pending'
                    AND EXISTS (SELECT 1 FROM sched_job_state
                                 WHERE job = $5 AND fencing_token <= $4 FOR SHARE)",
                &[&id, &instance, &tick, &token, &JOB],
                &JOB,
                term.token(),
            )
            .await
        {
            Ok(_) => {}
            // A newer claim: another instance leads now. Stop here.
            Err(FenceError::StaleOwner { .. }) => break,
            // Done already (a duplicate run got there first): the next one.
            Err(FenceError::GuardRefused) => continue,
            Err(other) => return Err(other),
        }
        // ... the item's real work goes here, in the same transaction ...
        tx.commit().await.map_err(FenceError::Database)?;
        done += 1;
    }
    Ok(Some(done))
}
