//! The lease beyond the cache: fenced PostgreSQL writes and scheduler leadership, on a
//! real PostgreSQL and a real redis-server of each test's own.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use stampede_guard::RedisStore;
use stampede_guard::keys::{LeaseName, Scope};
use stampede_guard::leader::{Leadership, Term, Tick};
use stampede_guard::lease::{AcquireOutcome, FencingToken, Lease, LeaseClient, LeaseLost};
use stampede_guard::postgres::tokio_postgres::Client;
use stampede_guard::postgres::{FenceError, FencedTable, execute_guarded, to_bigint};
use support::postgres::PgServer;
use support::web::keys;
use support::{HANG, RedisServer, eventually, within};
use tokio::sync::{mpsc, oneshot};

// Generous, for a loaded machine: an acquire that times out would skip a tick.
const COMMAND_TIMEOUT: Duration = Duration::from_millis(250);

fn leases(server: &RedisServer, instance: &str) -> LeaseClient {
    let store = RedisStore::builder(server.url())
        .command_timeout(COMMAND_TIMEOUT)
        .build()
        .unwrap();
    LeaseClient::builder(store, &keys())
        .instance_id(instance)
        .build()
        .unwrap()
}

fn acquired(outcome: AcquireOutcome) -> Lease {
    match outcome {
        AcquireOutcome::Acquired(lease) => lease,
        other => panic!("not acquired: {other:?}"),
    }
}

async fn pttl(server: &RedisServer, key: &str) -> i64 {
    server.cmd(&["PTTL", key]).await
}

// --- Fenced writes ---------------------------------------------------------------------

async fn quote_table(db: &Client) -> FencedTable {
    db.batch_execute(
        "CREATE TABLE quote_recalc_state (
             quote_id text PRIMARY KEY,
             status text NOT NULL,
             total bigint NOT NULL DEFAULT 0,
             fencing_token bigint NOT NULL DEFAULT 0
         );
         INSERT INTO quote_recalc_state (quote_id, status) VALUES ('q-123', 'PENDING');",
    )
    .await
    .unwrap();
    FencedTable::new("quote_recalc_state", "quote_id", "fencing_token").unwrap()
}

async fn row(db: &Client, id: &str) -> (String, i64, i64) {
    let row = db
        .query_one(
            "SELECT status, total, fencing_token FROM quote_recalc_state WHERE quote_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

#[tokio::test]
async fn a_holder_paused_past_its_ttl_is_refused_by_postgres_as_a_stale_owner() {
    let redis = RedisServer::start();
    let pg = PgServer::start();
    let db = pg.client().await;
    let table = quote_table(&db).await;
    let (a, b) = (leases(&redis, "pod-a"), leases(&redis, "pod-b"));
    let name = keys()
        .lease(&[Scope::id("quote", "q-123")], "recalculate")
        .unwrap();
    let ttl = Duration::from_millis(1000);

    let first = acquired(a.try_acquire(&name, ttl).await);
    // The first holder pauses (a stall, a slow call) until Redis has expired its lease.
    let expired = eventually(HANG, || async { pttl(&redis, name.key()).await == -2 }).await;
    assert!(expired, "the first lease never expired");
    assert_eq!(first.remaining(), Duration::ZERO);

    // A second holder takes the lease, with a higher token, and commits.
    let second = acquired(b.try_acquire(&name, ttl).await);
    assert!(second.fencing_token() > first.fencing_token());
    let written = table
        .update(
            &db,
            &"q-123",
            second.fencing_token(),
            &[("status", &"DONE"), ("total", &200i64)],
        )
        .await
        .unwrap();
    assert_eq!(written.token(), Some(second.fencing_token()));

    // The first holder wakes and writes what it computed: PostgreSQL refuses it.
    let refused = table
        .update(
            &db,
            &"q-123",
            first.fencing_token(),
            &[("status", &"DONE"), ("total", &100i64)],
        )
        .await;
    match refused {
        Err(FenceError::StaleOwner { token, current }) => {
            assert_eq!(token, first.fencing_token());
            assert_eq!(current, second.fencing_token());
        }
        other => panic!("the stale write was not refused as stale: {other:?}"),
    }
    // The row holds the second holder's value and token.
    assert_eq!(
        row(&db, "q-123").await,
        (
            "DONE".to_owned(),
            200,
            to_bigint(second.fencing_token()).unwrap()
        )
    );
    let _ = b.release(second).await;
}

#[tokio::test]
async fn two_holders_racing_inside_transactions_leave_the_higher_token_whichever_commits_first() {
    let pg = PgServer::start();
    let mut low = pg.client().await;
    let mut high = pg.client().await;
    let table = quote_table(&low).await;
    let (t_low, t_high) = (FencingToken::new(10), FencingToken::new(20));

    let observer = pg.client().await;

    // The higher token locks the row first and holds its transaction open; the lower
    // one's update waits for the lock, then checks its guard against the committed row.
    let (tx_low, refused) = race(
        &table,
        &observer,
        (&mut high, t_high, 2),
        (&mut low, t_low, 1),
    )
    .await;
    assert!(
        matches!(refused, Err(FenceError::StaleOwner { current, .. }) if current == t_high),
        "{refused:?}"
    );
    tx_low.rollback().await.unwrap();
    assert_eq!(row(&low, "q-123").await.1, 2);

    // The other order: the lower token locks first and commits while the higher one
    // waits; the higher one then writes over it (it is the newer holder).
    let (t_low, t_high) = (FencingToken::new(30), FencingToken::new(40));
    let (tx_high, written) = race(
        &table,
        &observer,
        (&mut low, t_low, 3),
        (&mut high, t_high, 4),
    )
    .await;
    assert_eq!(written.unwrap().token(), Some(t_high));
    tx_high.commit().await.unwrap();
    assert_eq!(row(&high, "q-123").await, ("PENDING".to_owned(), 4, 40));
}

/// Two holders set `total` of the same row, each in a transaction: `first` writes and
/// holds its transaction open, `second`'s update waits for the row's lock, and `first`
/// commits once it does. Returns `second`'s transaction, still open, and its result.
async fn race<'a>(
    table: &FencedTable,
    observer: &Client,
    first: (&mut Client, FencingToken, i64),
    second: (&'a mut Client, FencingToken, i64),
) -> (
    stampede_guard::postgres::tokio_postgres::Transaction<'a>,
    Result<stampede_guard::postgres::Written, FenceError>,
) {
    let tx_first = first.0.transaction().await.unwrap();
    let written = table
        .update(&tx_first, &"q-123", first.1, &[("total", &first.2)])
        .await
        .unwrap();
    assert_eq!(written.token(), Some(first.1));
    let tx_second = second.0.transaction().await.unwrap();
    let waiting = async {
        table
            .update(&tx_second, &"q-123", second.1, &[("total", &second.2)])
            .await
    };
    let commit = async {
        waits_for_a_row_lock(observer).await;
        tx_first.commit().await.unwrap();
    };
    let (result, ()) = within(HANG, async { tokio::join!(waiting, commit) }, "race").await;
    (tx_second, result)
}

/// Waits until a statement of another connection waits for a lock (so that a race is
/// the race it claims to be, not a sleep that hopes).
async fn waits_for_a_row_lock(observer: &Client) {
    let waiting = eventually(HANG, || async {
        let n: i64 = observer
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        n > 0
    })
    .await;
    assert!(waiting, "no statement ever waited for the lock");
}

#[tokio::test]
async fn every_rejection_path_is_a_typed_error_and_the_count_is_always_checked() {
    let pg = PgServer::start();
    let db = pg.client().await;
    let table = quote_table(&db).await;
    let token = FencingToken::new(5);
    let written = table
        .update(&db, &"q-123", token, &[("status", &"DONE")])
        .await
        .unwrap();
    assert_eq!(written.token(), Some(token));

    // The same holder writes again under its token: allowed (progress, then the end).
    let again = table
        .update(&db, &"q-123", token, &[("status", &"AGAIN")])
        .await
        .unwrap();
    assert_eq!(again.token(), Some(token));
    // A lower token: an earlier holder, refused.
    let lower = table
        .update(&db, &"q-123", FencingToken::new(4), &[("status", &"LATE")])
        .await;
    assert!(
        matches!(lower, Err(FenceError::StaleOwner { current, token: t }) if current == token && t.get() == 4),
        "{lower:?}"
    );
    assert_eq!(row(&db, "q-123").await.0, "AGAIN");
    // No such row.
    let missing = table
        .update(&db, &"q-999", FencingToken::new(6), &[("status", &"DONE")])
        .await;
    assert!(matches!(missing, Err(FenceError::NoSuchRow)), "{missing:?}");
    // A token past BIGINT: refused before PostgreSQL is asked.
    let huge = table
        .update(
            &db,
            &"q-123",
            FencingToken::new(u64::MAX),
            &[("status", &"X")],
        )
        .await;
    assert!(
        matches!(huge, Err(FenceError::TokenOutOfRange(_))),
        "{huge:?}"
    );
    // A column that is not an identifier: refused, naming `set`.
    let bad = table
        .update(
            &db,
            &"q-123",
            FencingToken::new(7),
            &[("status = 'x' --", &"X")],
        )
        .await;
    assert!(
        matches!(&bad, Err(FenceError::Invalid(e)) if e.field() == "set"),
        "{bad:?}"
    );
    // A table that does not exist: the database's error, typed.
    let nowhere = FencedTable::new("no_such_table", "id", "fencing_token").unwrap();
    let gone = nowhere
        .update(&db, &"q-123", FencingToken::new(8), &[("status", &"X")])
        .await;
    assert!(
        matches!(&gone, Err(FenceError::Database(e)) if e.code().is_some()),
        "{gone:?}"
    );
    // An id that is not unique: more than one row changed, reported (and, inside a
    // transaction, rolled back by the caller).
    db.batch_execute(
        "CREATE TABLE shard_state (shard int NOT NULL, fencing_token bigint NOT NULL DEFAULT 0,
                                   note text);
         INSERT INTO shard_state (shard) VALUES (1), (1);",
    )
    .await
    .unwrap();
    let shards = FencedTable::new("shard_state", "shard", "fencing_token").unwrap();
    let mut tx_db = pg.client().await;
    let tx = tx_db.transaction().await.unwrap();
    let two = shards
        .update(&tx, &1i32, FencingToken::new(9), &[("note", &"x")])
        .await;
    assert!(
        matches!(two, Err(FenceError::NotOneRow { rows: 2 })),
        "{two:?}"
    );
    drop(tx);
    let untouched: i64 = db
        .query_one("SELECT count(*) FROM shard_state WHERE note IS NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(untouched, 2, "the dropped transaction rolled back");

    // A caller's own guard: a state guard that matches no row, and one that matches two.
    let refused = execute_guarded(
        &db,
        "UPDATE quote_recalc_state SET status = 'DONE' WHERE quote_id = $1 AND status = 'PENDING'",
        &[&"q-123"],
    )
    .await;
    assert!(
        matches!(refused, Err(FenceError::GuardRefused)),
        "{refused:?}"
    );
    let many = execute_guarded(
        &db,
        "UPDATE shard_state SET note = 'y' WHERE shard = $1",
        &[&1i32],
    )
    .await;
    assert!(
        matches!(many, Err(FenceError::NotOneRow { rows: 2 })),
        "{many:?}"
    );
    let one = execute_guarded(
        &db,
        "UPDATE quote_recalc_state SET status = 'CHECKED' WHERE quote_id = $1 AND status = 'AGAIN'",
        &[&"q-123"],
    )
    .await
    .unwrap();
    assert_eq!(one.token(), None);
    // A caller's statement fenced by a row's token: which guard refused is read back.
    let fenced = |token: u64, status: &'static str, id: &'static str| {
        let table = &table;
        let db = &db;
        async move {
            table
                .execute_fenced(
                    db,
                    "UPDATE quote_recalc_state SET status = $3, fencing_token = $2
                      WHERE quote_id = $1 AND fencing_token <= $2 AND status = 'CHECKED'",
                    &[&id, &(token as i64), &status],
                    &id,
                    FencingToken::new(token),
                )
                .await
        }
    };
    let stale = fenced(4, "LATE", "q-123").await;
    assert!(
        matches!(stale, Err(FenceError::StaleOwner { current, .. }) if current == token),
        "{stale:?}"
    );
    let nobody = fenced(9, "X", "q-999").await;
    assert!(matches!(nobody, Err(FenceError::NoSuchRow)), "{nobody:?}");
    let written = fenced(9, "FINAL", "q-123").await.unwrap();
    assert_eq!(written.token(), Some(FencingToken::new(9)));
    // The token guard lets it through now; the state guard does not (not `CHECKED`).
    let state = fenced(10, "AGAIN", "q-123").await;
    assert!(matches!(state, Err(FenceError::GuardRefused)), "{state:?}");
    // Messages say what happened.
    let message = FenceError::StaleOwner {
        token: FencingToken::new(1),
        current: FencingToken::new(2),
    }
    .to_string();
    assert!(
        message.contains("stale owner") && message.contains('2'),
        "{message}"
    );
}

// --- Scheduler leadership --------------------------------------------------------------

const JOB: &str = "quote-expiry";
const BATCH: i64 = 4;

async fn scheduler_schema(db: &Client, items: i32) {
    db.batch_execute(&format!(
        "CREATE TABLE job_state (job text PRIMARY KEY, last_tick bigint NOT NULL DEFAULT -1,
                                 fencing_token bigint NOT NULL DEFAULT 0);
         INSERT INTO job_state (job) VALUES ('{JOB}');
         CREATE TABLE job_runs (tick bigint NOT NULL, instance text NOT NULL,
                                fencing_token bigint NOT NULL, started timestamptz NOT NULL);
         CREATE TABLE items (id int PRIMARY KEY, status text NOT NULL DEFAULT 'pending',
                             done_by text, done_tick bigint);
         CREATE TABLE item_log (item int NOT NULL, instance text NOT NULL, tick bigint NOT NULL);
         INSERT INTO items (id) SELECT generate_series(1, {items});"
    ))
    .await
    .unwrap();
}

/// What a term of the job did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    /// The tick was claimed by this term; `items` were done.
    Claimed { items: usize },
    /// Another term had claimed this tick (or a later one): nothing done.
    AlreadyClaimed,
    /// A newer leader claimed while this term worked: its next item was refused by the
    /// token guard, after `items` were done.
    Stale { items: usize },
}

/// Where the job is, for the tests to stop a leader there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The tick is claimed.
    Claimed,
    /// Item n (from 1) is about to be updated.
    BeforeItem(usize),
    /// Item n is updated, its transaction still open.
    InItem(usize),
    /// Item n is committed.
    Committed(usize),
}

/// The job, as a user writes it (see `examples/scheduler.rs`): claim the tick, durably
/// and fenced; then a bounded batch, one transaction per item, each guarded by its
/// state and by the term's token against the newest claim (whose row it locks for
/// share, so that a new claim waits for an item in flight). Each item's work takes
/// `item_time`, inside its transaction; `hook` runs at each [`Step`].
async fn job<F, Fut>(
    db: &mut Client,
    instance: &str,
    tick: i64,
    token: FencingToken,
    is_held: &(dyn Fn() -> bool + Sync),
    item_time: Duration,
    mut hook: F,
) -> Run
where
    F: FnMut(Step) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let fencing = token;
    let token = to_bigint(token).unwrap();
    let claims = FencedTable::new("job_state", "job", "fencing_token").unwrap();
    let claim = execute_guarded(
        &*db,
        "UPDATE job_state SET last_tick = $2, fencing_token = $3
          WHERE job = $1 AND last_tick < $2 AND fencing_token < $3",
        &[&JOB, &tick, &token],
    )
    .await;
    match claim {
        Ok(_) => {}
        Err(FenceError::GuardRefused) => return Run::AlreadyClaimed,
        Err(other) => panic!("claim: {other}"),
    }
    db.execute(
        "INSERT INTO job_runs (tick, instance, fencing_token, started)
         VALUES ($1, $2, $3, clock_timestamp())",
        &[&tick, &instance, &token],
    )
    .await
    .unwrap();
    hook(Step::Claimed).await;
    let pending: Vec<i32> = db
        .query(
            "SELECT id FROM items WHERE status = 'pending' ORDER BY id LIMIT $1",
            &[&BATCH],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut done = 0;
    for id in pending {
        if !is_held() {
            break;
        }
        hook(Step::BeforeItem(done + 1)).await;
        let tx = db.transaction().await.unwrap();
        let item = claims
            .execute_fenced(
                &tx,
                "UPDATE items SET status = 'done', done_by = $2, done_tick = $3
                  WHERE id = $1 AND status = 'pending'
                    AND EXISTS (SELECT 1 FROM job_state
                                 WHERE job = $5 AND fencing_token <= $4 FOR SHARE)",
                &[&id, &instance, &tick, &token, &JOB],
                &JOB,
                fencing,
            )
            .await;
        match item {
            Ok(_) => {}
            // A newer claim: another instance leads; stop.
            Err(FenceError::StaleOwner { .. }) => return Run::Stale { items: done },
            // Done by someone else already: the next one.
            Err(FenceError::GuardRefused) => continue,
            Err(other) => panic!("item {id}: {other}"),
        }
        hook(Step::InItem(done + 1)).await;
        tokio::time::sleep(item_time).await;
        tx.execute(
            "INSERT INTO item_log (item, instance, tick) VALUES ($1, $2, $3)",
            &[&id, &instance, &tick],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        done += 1;
        hook(Step::Committed(done)).await;
    }
    Run::Claimed { items: done }
}

/// One scheduler instance: its own Redis connection, lease client and PostgreSQL
/// connection; runs a tick whenever told, and answers with how it went.
struct Instance {
    name: String,
    ticks: mpsc::Sender<(i64, oneshot::Sender<Outcome>)>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Outcome {
    tick: Tick<Run>,
    /// When the work began, if it ran.
    started: Option<Instant>,
}

/// Tells the test which leader has committed its n-th item (instance, tick, token);
/// taken by the first leader to get there, which then hangs until killed.
type Stop = std::sync::Arc<std::sync::Mutex<Option<mpsc::Sender<(String, i64, FencingToken)>>>>;

async fn start_instance(
    redis: &RedisServer,
    pg: &PgServer,
    name: &str,
    ttl: Duration,
    stop_at: Option<(usize, Stop)>,
) -> Instance {
    let leases = leases(redis, name);
    let lease = scheduler_lease();
    let leadership = Leadership::builder(leases, lease)
        .lease_ttl(ttl)
        .max_term(Duration::from_secs(60))
        .build()
        .unwrap();
    let mut db = pg.client().await;
    let (ticks, mut rx) = mpsc::channel::<(i64, oneshot::Sender<Outcome>)>(1);
    let instance = name.to_owned();
    let task = tokio::spawn(async move {
        while let Some((tick, reply)) = rx.recv().await {
            let mut started = None;
            let stop_at = stop_at.clone();
            let instance = instance.clone();
            let outcome = leadership
                .run_once(|term| {
                    started = Some(Instant::now());
                    let token = term.token();
                    let db = &mut db;
                    async move {
                        let is_held = move || term.is_held();
                        job(
                            db,
                            &instance,
                            tick,
                            token,
                            &is_held,
                            Duration::ZERO,
                            |step| {
                                let stop_at = stop_at.clone();
                                let instance = instance.clone();
                                async move {
                                    // The first leader to get there, only.
                                    let stop = stop_at
                                        .filter(|(at, _)| step == Step::Committed(*at))
                                        .and_then(|(_, stop)| stop.lock().unwrap().take());
                                    if let Some(stop) = stop {
                                        stop.send((instance, tick, token)).await.unwrap();
                                        // Killed here: the test aborts this task.
                                        std::future::pending::<()>().await;
                                    }
                                }
                            },
                        )
                        .await
                    }
                })
                .await;
            let _ = reply.send(Outcome {
                tick: outcome,
                started,
            });
        }
    });
    Instance {
        name: name.to_owned(),
        ticks,
        task,
    }
}

fn scheduler_lease() -> LeaseName {
    keys().lease(&[Scope::label("scheduler")], JOB).unwrap()
}

/// Runs tick `tick` on every instance at once; returns each one's outcome, by name.
async fn tick_all(instances: &[&Instance], tick: i64) -> BTreeMap<String, Outcome> {
    let mut replies = Vec::new();
    for instance in instances {
        let (tx, rx) = oneshot::channel();
        instance.ticks.send((tick, tx)).await.unwrap();
        replies.push((instance.name.clone(), rx));
    }
    let mut out = BTreeMap::new();
    for (name, rx) in replies {
        let outcome = within(HANG, rx, format!("tick {tick} on {name}"))
            .await
            .unwrap();
        out.insert(name, outcome);
    }
    out
}

/// Every item's log entries: (item → [(instance, tick)]).
async fn item_log(db: &Client) -> BTreeMap<i32, Vec<(String, i64)>> {
    let mut log: BTreeMap<i32, Vec<(String, i64)>> = BTreeMap::new();
    for row in db
        .query(
            "SELECT item, instance, tick FROM item_log ORDER BY item",
            &[],
        )
        .await
        .unwrap()
    {
        log.entry(row.get(0))
            .or_default()
            .push((row.get(1), row.get(2)));
    }
    log
}

async fn runs(db: &Client) -> BTreeMap<i64, Vec<String>> {
    let mut runs: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    for row in db
        .query("SELECT tick, instance FROM job_runs ORDER BY tick", &[])
        .await
        .unwrap()
    {
        runs.entry(row.get(0)).or_default().push(row.get(1));
    }
    runs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_over_many_ticks_process_each_batch_exactly_once() {
    let redis = RedisServer::start();
    let pg = PgServer::start();
    let db = pg.client().await;
    const TICKS: i64 = 12;
    // More items than the ticks take: every tick has a full batch.
    scheduler_schema(&db, (TICKS * BATCH + 10) as i32).await;
    let mut instances = Vec::new();
    for name in ["pod-a", "pod-b", "pod-c"] {
        instances.push(start_instance(&redis, &pg, name, Duration::from_secs(3), None).await);
    }
    let all: Vec<&Instance> = instances.iter().collect();

    let mut claimed_by: BTreeMap<i64, String> = BTreeMap::new();
    let mut led = 0;
    for tick in 0..TICKS {
        let outcomes = tick_all(&all, tick).await;
        let mut claims = Vec::new();
        for (name, outcome) in &outcomes {
            match &outcome.tick {
                Tick::Led { output, .. } => {
                    led += 1;
                    if let Run::Claimed { items } = output {
                        assert_eq!(*items, BATCH as usize, "tick {tick} on {name}");
                        claims.push(name.clone());
                    }
                }
                Tick::Busy => {}
                other => panic!("tick {tick} on {name}: {other:?}"),
            }
        }
        // Exactly one instance processed this tick's batch (a second lease holder of
        // the same tick, after the first released, finds the tick claimed).
        assert_eq!(claims.len(), 1, "tick {tick}: {outcomes:?}");
        claimed_by.insert(tick, claims.pop().unwrap());
    }
    assert!(led >= TICKS, "{led} terms led for {TICKS} ticks");

    // PostgreSQL agrees: one run per tick, by the instance that claimed it; every item
    // done once, in the tick and by the instance of its run; no item done twice.
    let runs = runs(&db).await;
    assert_eq!(runs.len(), TICKS as usize);
    for (tick, by) in &runs {
        assert_eq!(by, &vec![claimed_by[tick].clone()], "tick {tick}");
    }
    let log = item_log(&db).await;
    assert_eq!(log.len(), (TICKS * BATCH) as usize);
    let mut per_tick: BTreeMap<i64, usize> = BTreeMap::new();
    for (item, entries) in &log {
        assert_eq!(entries.len(), 1, "item {item} done {entries:?}");
        let (by, tick) = &entries[0];
        assert_eq!(by, &claimed_by[tick], "item {item}");
        *per_tick.entry(*tick).or_default() += 1;
    }
    assert!(
        per_tick.values().all(|n| *n == BATCH as usize),
        "{per_tick:?}"
    );
    // The items left are the next ones, untouched.
    let pending: i64 = db
        .query_one("SELECT count(*) FROM items WHERE status = 'pending'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(pending, 10);
    for instance in instances {
        instance.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_killed_mid_batch_is_taken_over_after_its_ttl_without_redoing_committed_work() {
    let redis = RedisServer::start();
    let pg = PgServer::start();
    let db = pg.client().await;
    const ITEMS: i32 = 12;
    scheduler_schema(&db, ITEMS).await;
    let ttl = Duration::from_secs(3);
    let (stop_tx, mut stopped) = mpsc::channel(3);
    let stop_tx: Stop = std::sync::Arc::new(std::sync::Mutex::new(Some(stop_tx)));
    let mut instances = Vec::new();
    for name in ["pod-a", "pod-b", "pod-c"] {
        // Whoever leads the first tick stops after committing 2 of its 4 items.
        let stop = Some((2, stop_tx.clone()));
        instances.push(start_instance(&redis, &pg, name, ttl, stop).await);
    }

    // Tick 0: one leader; it commits two items and hangs.
    let mut replies = Vec::new();
    for instance in &instances {
        let (tx, rx) = oneshot::channel();
        instance.ticks.send((0, tx)).await.unwrap();
        replies.push((instance.name.clone(), rx));
    }
    let (leader, tick, killed_token) = within(HANG, stopped.recv(), "a leader at item 2")
        .await
        .unwrap();
    assert_eq!(tick, 0);
    // The other two skipped the tick.
    for (name, rx) in replies {
        if name == leader {
            continue;
        }
        let outcome = within(HANG, rx, "tick 0").await.unwrap();
        assert!(matches!(outcome.tick, Tick::Busy), "{name}: {outcome:?}");
    }
    // Kill it: no release, no more renewals. Its lease lasts until Redis expires it.
    let (dead, alive): (Vec<Instance>, Vec<Instance>) =
        instances.into_iter().partition(|i| i.name == leader);
    let dead = dead.into_iter().next().unwrap();
    dead.task.abort();
    let _ = dead.task.await;
    let killed_at = Instant::now();
    let left = pttl(&redis, scheduler_lease().key()).await;
    assert!(
        left > 0,
        "the killed leader's lease is gone at once ({left})"
    );
    let expires = killed_at + Duration::from_millis(left as u64);

    // The others wake every 100 ms: busy until the lease expires, then one takes over.
    let alive_refs: Vec<&Instance> = alive.iter().collect();
    let mut tick = 1;
    let mut busy_before = 0;
    let takeover = loop {
        let outcomes = tick_all(&alive_refs, tick).await;
        let led: Vec<_> = outcomes
            .iter()
            .filter_map(|(name, o)| match &o.tick {
                Tick::Led { output, token, .. } => Some((name.clone(), *output, *token, o.started)),
                _ => None,
            })
            .collect();
        if let Some((name, output, token, started)) = led.into_iter().next() {
            // Not before Redis expired the dead leader's lease.
            let started = started.unwrap();
            assert!(
                started + Duration::from_millis(50) >= expires,
                "taken over {:?} before the lease's TTL ran out",
                expires - started
            );
            assert!(token > killed_token);
            break (name, output);
        }
        busy_before += outcomes.len();
        tick += 1;
        assert!(killed_at.elapsed() < HANG, "nobody took over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        busy_before > 0,
        "no tick found the dead leader's lease held"
    );
    assert_eq!(
        takeover.1,
        Run::Claimed {
            items: BATCH as usize
        }
    );

    // The rest, tick by tick, until nothing is pending.
    loop {
        let pending: i64 = db
            .query_one("SELECT count(*) FROM items WHERE status = 'pending'", &[])
            .await
            .unwrap()
            .get(0);
        if pending == 0 {
            break;
        }
        tick += 1;
        let outcomes = tick_all(&alive_refs, tick).await;
        assert!(
            outcomes.values().any(|o| matches!(
                o.tick,
                Tick::Led {
                    output: Run::Claimed { .. },
                    ..
                }
            )),
            "tick {tick}: {outcomes:?}"
        );
    }

    // Every item done exactly once; the dead leader's two committed items stay its own
    // and were not redone; the rest were done by the live instances.
    let log = item_log(&db).await;
    assert_eq!(log.len(), ITEMS as usize);
    assert!(log.values().all(|e| e.len() == 1), "{log:?}");
    let by_dead: BTreeSet<i32> = log
        .iter()
        .filter(|(_, e)| e[0].0 == leader)
        .map(|(item, _)| *item)
        .collect();
    assert_eq!(by_dead, BTreeSet::from([1, 2]));
    for instance in alive {
        instance.task.abort();
    }
}

#[tokio::test]
async fn a_term_stops_when_its_lease_is_lost_or_its_maximum_is_reached_and_skips_without_redis() {
    let mut redis = RedisServer::start();
    let name = scheduler_lease();
    let ttl = Duration::from_millis(1200);

    // The lease is taken from under the leader (deleted, then taken by someone else):
    // its next renewal says so, and the work is stopped.
    let leadership = Leadership::builder(leases(&redis, "pod-a"), name.clone())
        .lease_ttl(ttl)
        .max_term(Duration::from_secs(30))
        .build()
        .unwrap();
    let other = leases(&redis, "pod-b");
    let key = name.key().to_owned();
    let stolen = {
        let redis = &redis;
        let other = &other;
        let name = &name;
        let key = key.clone();
        leadership.run_once(move |term: Term| async move {
            assert!(term.is_held());
            let _: i64 = redis.cmd(&["DEL", &key]).await;
            let theirs = acquired(other.try_acquire(name, Duration::from_secs(5)).await);
            assert!(theirs.fencing_token() > term.token());
            std::future::pending::<()>().await
        })
    };
    let tick = within(HANG, stolen, "a term whose lease was taken").await;
    assert!(
        matches!(
            tick,
            Tick::Stopped {
                reason: LeaseLost::NotOwner,
                ..
            }
        ),
        "{tick:?}"
    );
    let _: i64 = redis.cmd(&["DEL", &key]).await;

    // A term that runs past its maximum is stopped there, renewed until then.
    let capped = Leadership::builder(leases(&redis, "pod-a"), name.clone())
        .lease_ttl(ttl)
        .max_term(Duration::from_millis(3000))
        .build()
        .unwrap();
    let began = Instant::now();
    let tick = within(
        HANG,
        capped.run_once(|term: Term| async move {
            // Past the TTL: renewed; the watchdog tells the term so.
            tokio::time::sleep(ttl + Duration::from_millis(300)).await;
            assert!(term.is_held(), "renewals did not reach the term");
            std::future::pending::<()>().await
        }),
        "a term past its maximum",
    )
    .await;
    assert!(
        matches!(
            tick,
            Tick::Stopped {
                reason: LeaseLost::MaxDuration,
                ..
            }
        ),
        "{tick:?}"
    );
    assert!(began.elapsed() >= Duration::from_millis(3000));
    // Released at the stop: the next tick is free at once.
    assert_eq!(pttl(&redis, &key).await, -2);

    // Without Redis, the work does not run.
    redis.kill();
    let mut ran = false;
    let tick = within(
        HANG,
        capped.run_once(|_| async { ran = true }),
        "a tick without Redis",
    )
    .await;
    assert!(matches!(tick, Tick::Unavailable(_)), "{tick:?}");
    assert!(!ran);
    redis.restart();
    let tick = capped.run_once(|term| async move { term.token() }).await;
    assert!(matches!(tick, Tick::Led { .. }), "{tick:?}");

    // Bad settings are refused, naming the field.
    let error = Leadership::builder(leases(&redis, "pod-a"), name.clone())
        .lease_ttl(Duration::from_millis(100))
        .build()
        .unwrap_err();
    assert_eq!(error.field(), "lease_ttl");
    let error = Leadership::builder(leases(&redis, "pod-a"), name)
        .max_term(Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(error.field(), "max_term");
}

// --- Scheduler instances as processes, one killed with SIGKILL ---------------------------

/// The environment a scheduler process is started with: it runs the job as one
/// instance of the fleet, ticking every [`PROCESS_TICK`], until killed.
const CHILD_ENV: &str = "STAMPEDE_GUARD_TEST_SCHEDULER";
const PROCESS_TICK: Duration = Duration::from_millis(200);
const PROCESS_ITEM_TIME: Duration = Duration::from_millis(400);

/// Not a test: the body of one scheduler process of
/// `a_scheduler_process_killed_mid_batch_...`, which starts this binary with
/// `--ignored --exact` and [`CHILD_ENV`] set. Ticks on the wall clock, as every
/// instance of a fleet does (`examples/scheduler.rs`).
#[tokio::test(flavor = "current_thread")]
#[ignore = "a scheduler process of the SIGKILL test, started by it"]
async fn scheduler_process() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        panic!("run by a_scheduler_process_killed_mid_batch_..., with {CHILD_ENV} set");
    };
    let mut parts = spec.splitn(3, '|');
    let (name, redis_url, pg_url) = (
        parts.next().unwrap().to_owned(),
        parts.next().unwrap().to_owned(),
        parts.next().unwrap().to_owned(),
    );
    let store = RedisStore::builder(redis_url)
        .command_timeout(COMMAND_TIMEOUT)
        .build()
        .unwrap();
    let leases = LeaseClient::builder(store, &keys())
        .instance_id(&name)
        .build()
        .unwrap();
    let leadership = Leadership::builder(leases, scheduler_lease())
        .lease_ttl(Duration::from_secs(2))
        .max_term(Duration::from_secs(30))
        .build()
        .unwrap();
    let (mut db, connection) = stampede_guard::postgres::tokio_postgres::connect(
        &pg_url,
        stampede_guard::postgres::tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let began = Instant::now();
    while began.elapsed() < Duration::from_secs(60) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap();
        let period = PROCESS_TICK.as_millis();
        let next = now.as_millis() / period + 1;
        tokio::time::sleep(Duration::from_millis(
            (next * period - now.as_millis()) as u64,
        ))
        .await;
        let tick = next as i64;
        let db = &mut db;
        let name = name.as_str();
        let _ = leadership
            .run_once(|term| async move {
                let token = term.token();
                let is_held = move || term.is_held();
                job(
                    db,
                    name,
                    tick,
                    token,
                    &is_held,
                    PROCESS_ITEM_TIME,
                    |_| async {},
                )
                .await
            })
            .await;
    }
}

struct Process {
    name: String,
    child: std::process::Child,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_process(name: &str, redis: &RedisServer, pg: &PgServer) -> Process {
    let exe = std::env::current_exe().unwrap();
    let mut command = match support::server::setpriv() {
        Some(setpriv) => {
            let mut c = std::process::Command::new(setpriv);
            c.args(["--pdeathsig", "KILL", "--"]).arg(exe);
            c
        }
        None => std::process::Command::new(exe),
    };
    command
        .args([
            "scheduler_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(
            CHILD_ENV,
            format!(
                "{name}|{}|{} application_name={name}",
                redis.url(),
                pg.url()
            ),
        )
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    Process {
        name: name.to_owned(),
        child: command.spawn().expect("the scheduler process starts"),
    }
}

/// The last claimed tick: (tick, instance, items it has done so far).
async fn last_run(db: &Client) -> Option<(i64, String, i64)> {
    let row = db
        .query_opt(
            "SELECT r.tick, r.instance,
                    (SELECT count(*) FROM item_log l WHERE l.tick = r.tick)
               FROM job_runs r ORDER BY r.tick DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()?;
    Some((row.get(0), row.get(1), row.get(2)))
}

fn wall_micros() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_process_killed_mid_batch_is_taken_over_after_its_ttl_without_redoing_committed_work()
 {
    let redis = RedisServer::start();
    let pg = PgServer::start();
    let db = pg.client().await;
    const ITEMS: i32 = 10;
    scheduler_schema(&db, ITEMS).await;
    let mut processes: Vec<Process> = ["pod-a", "pod-b", "pod-c"]
        .iter()
        .map(|name| start_process(name, &redis, &pg))
        .collect();

    // Wait until a leader has committed its first item and is inside the next one's
    // transaction; then kill its process (SIGKILL: no release, no rollback sent).
    let mid_batch = eventually(HANG, || async {
        matches!(last_run(&db).await, Some((_, _, done)) if done >= 1)
    })
    .await;
    assert!(mid_batch, "no leader committed an item");
    let (killed_tick, leader, _) = last_run(&db).await.unwrap();
    // Inside an item's transaction: the item updated, not committed.
    let in_item = eventually(HANG, || async {
        let n: i64 = db
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE application_name = $1 AND state = 'idle in transaction'",
                &[&leader],
            )
            .await
            .unwrap()
            .get(0);
        n == 1
    })
    .await;
    assert!(
        in_item,
        "the leader was never seen inside an item's transaction"
    );
    let at = processes.iter().position(|p| p.name == leader).unwrap();
    let mut dead = processes.remove(at);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let killed_wall = wall_micros();
    let left = pttl(&redis, scheduler_lease().key()).await;
    assert!(
        left > 0,
        "the dead leader's lease ended at once ({left} ms)"
    );
    let committed_by_dead: i64 = db
        .query_one(
            "SELECT count(*) FROM item_log WHERE instance = $1",
            &[&leader],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        (1..BATCH).contains(&committed_by_dead),
        "the leader was not killed mid-batch: it had committed {committed_by_dead} items"
    );

    // The survivors take over once the lease has expired, and finish the work.
    let all_done = eventually(HANG, || async {
        let pending: i64 = db
            .query_one("SELECT count(*) FROM items WHERE status = 'pending'", &[])
            .await
            .unwrap()
            .get(0);
        pending == 0
    })
    .await;
    assert!(all_done, "the survivors did not finish the items");

    // The first run after the killed one began only after the lease's TTL ran out.
    let takeover = db
        .query_one(
            "SELECT instance, (extract(epoch FROM started) * 1000000)::bigint FROM job_runs
              WHERE tick > $1 ORDER BY tick LIMIT 1",
            &[&killed_tick],
        )
        .await
        .unwrap();
    let (taken_by, started): (String, i64) = (takeover.get(0), takeover.get(1));
    assert_ne!(taken_by, leader);
    let expiry = killed_wall + left * 1000;
    assert!(
        started + 50_000 >= expiry,
        "taken over {} ms before the dead leader's lease expired",
        (expiry - started) / 1000
    );
    // Every item done exactly once; what the dead leader committed stays its own, what it
    // had in flight was rolled back and done by a survivor.
    let log = item_log(&db).await;
    assert_eq!(log.len(), ITEMS as usize);
    assert!(log.values().all(|e| e.len() == 1), "{log:?}");
    let by_dead = log.values().filter(|e| e[0].0 == leader).count() as i64;
    assert_eq!(by_dead, committed_by_dead);
    let done_by_dead: i64 = db
        .query_one("SELECT count(*) FROM items WHERE done_by = $1", &[&leader])
        .await
        .unwrap()
        .get(0);
    assert_eq!(done_by_dead, committed_by_dead);
    drop(processes);
}

/// Where a stalled leader stops: at each step, it says so and waits to be let go.
struct Pauses {
    paused: Vec<oneshot::Receiver<()>>,
    resume: Vec<oneshot::Sender<()>>,
}

/// A hook that stops at each of `steps` in turn: it sends on the step's `paused` and
/// waits for its `resume` (a stall of the whole process, as far as the lease can tell:
/// nothing renews it meanwhile).
fn pause_at(
    steps: &[Step],
) -> (
    Pauses,
    impl FnMut(Step) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + use<>,
) {
    let mut at = std::collections::VecDeque::new();
    let mut pauses = Pauses {
        paused: vec![],
        resume: vec![],
    };
    for step in steps {
        let (paused_tx, paused) = oneshot::channel();
        let (resume, resume_rx) = oneshot::channel();
        at.push_back((*step, paused_tx, resume_rx));
        pauses.paused.push(paused);
        pauses.resume.push(resume);
    }
    let hook = move |step: Step| {
        let now = if at.front().is_some_and(|(s, _, _)| *s == step) {
            at.pop_front()
        } else {
            None
        };
        Box::pin(async move {
            if let Some((_, paused, resume)) = now {
                paused.send(()).unwrap();
                resume.await.unwrap();
            }
        }) as std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
    };
    (pauses, hook)
}

impl Pauses {
    /// Waits until the leader stops at its next step.
    async fn reached(&mut self) {
        let paused = self.paused.remove(0);
        within(HANG, async { paused.await.unwrap() }, "a pause").await;
    }

    /// Lets it go on from there.
    fn resume(&mut self) {
        self.resume.remove(0).send(()).unwrap();
    }
}

/// A stale leader: the lease taken for a tick and then never renewed (its process
/// stalls), running the job from a task of its own, stopping at `steps`; returned once
/// it has stopped at the first and Redis has expired its lease.
async fn stale_leader(
    redis: &RedisServer,
    pg: &PgServer,
    tick: i64,
    steps: &[Step],
) -> (FencingToken, Pauses, tokio::task::JoinHandle<Run>) {
    let lease = acquired(
        leases(redis, "pod-a")
            .try_acquire(&scheduler_lease(), Duration::from_secs(1))
            .await,
    );
    let token = lease.fencing_token();
    let (mut pauses, hook) = pause_at(steps);
    let mut db = pg.client().await;
    let task = tokio::spawn(async move {
        // Its last look before the stall said it held the lease.
        let held = || true;
        job(&mut db, "pod-a", tick, token, &held, Duration::ZERO, hook).await
    });
    pauses.reached().await;
    let expired = eventually(HANG, || async {
        pttl(redis, scheduler_lease().key()).await == -2
    })
    .await;
    assert!(expired, "the stalled leader's lease never expired");
    (token, pauses, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_leader_that_resumes_after_a_new_claim_is_refused_by_postgres_at_its_next_item() {
    let redis = RedisServer::start();
    let pg = PgServer::start();
    let db = pg.client().await;
    scheduler_schema(&db, 12).await;
    let leader_b = Leadership::builder(leases(&redis, "pod-b"), scheduler_lease())
        .lease_ttl(Duration::from_secs(3))
        .build()
        .unwrap();

    // A stalls before its second item, past its TTL.
    let (a_token, mut a_pauses, a) = stale_leader(&redis, &pg, 0, &[Step::BeforeItem(2)]).await;
    // B leads the next tick: it claims, then waits for the test.
    let (mut b_pauses, b_hook) = pause_at(&[Step::Claimed]);
    let b = {
        let leader_b = leader_b.clone();
        let mut db = pg.client().await;
        tokio::spawn(async move {
            leader_b
                .run_once(|term| async move {
                    let token = term.token();
                    let held = move || term.is_held();
                    job(&mut db, "pod-b", 1, token, &held, Duration::ZERO, b_hook).await
                })
                .await
        })
    };
    b_pauses.reached().await;
    // A resumes and goes for its second item, still pending: the token guard refuses it.
    a_pauses.resume();
    let run_a = within(HANG, a, "A").await.unwrap();
    assert_eq!(run_a, Run::Stale { items: 1 });
    let second: String = db
        .query_one("SELECT status FROM items WHERE id = 2", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(second, "pending", "the stale leader's item went through");
    b_pauses.resume();
    let tick_b = within(HANG, b, "B").await.unwrap();
    match tick_b {
        Tick::Led { output, token, .. } => {
            assert_eq!(
                output,
                Run::Claimed {
                    items: BATCH as usize
                }
            );
            assert!(token > a_token);
        }
        other => panic!("B: {other:?}"),
    }
    let log = item_log(&db).await;
    let owners: Vec<(i32, &str)> = log.iter().map(|(i, e)| (*i, e[0].0.as_str())).collect();
    assert_eq!(
        owners,
        vec![
            (1, "pod-a"),
            (2, "pod-b"),
            (3, "pod-b"),
            (4, "pod-b"),
            (5, "pod-b")
        ]
    );

    // A stalls again, this time inside an item's transaction (updated, not committed),
    // past its TTL. The next leader's claim waits for that transaction (the share lock
    // on the claim's row): the item in flight commits under the claim it began under,
    // and A's next item is refused.
    let (_, mut a_pauses, a) =
        stale_leader(&redis, &pg, 2, &[Step::InItem(1), Step::BeforeItem(2)]).await;
    let observer = pg.client().await;
    let c = {
        let leader_b = leader_b.clone();
        let mut db = pg.client().await;
        tokio::spawn(async move {
            leader_b
                .run_once(|term| async move {
                    let token = term.token();
                    let held = move || term.is_held();
                    job(
                        &mut db,
                        "pod-b",
                        3,
                        token,
                        &held,
                        Duration::ZERO,
                        |_| async {},
                    )
                    .await
                })
                .await
        })
    };
    // The new claim waits for A's transaction; A commits its item, and stops before the
    // next one until the claim is in.
    waits_for_a_row_lock(&observer).await;
    a_pauses.resume();
    a_pauses.reached().await;
    let claimed = eventually(HANG, || async {
        let tick: i64 = observer
            .query_one("SELECT last_tick FROM job_state", &[])
            .await
            .unwrap()
            .get(0);
        tick == 3
    })
    .await;
    assert!(claimed, "the next leader's claim never went in");
    a_pauses.resume();
    let run_a = within(HANG, a, "A").await.unwrap();
    assert_eq!(
        run_a,
        Run::Stale { items: 1 },
        "A's item in flight commits, its next is refused"
    );
    let tick_c = within(HANG, c, "the next leader").await.unwrap();
    assert!(
        matches!(tick_c, Tick::Led { output: Run::Claimed { items }, .. } if items == BATCH as usize),
        "{tick_c:?}"
    );
    let log = item_log(&db).await;
    assert!(log.values().all(|e| e.len() == 1), "{log:?}");
    assert_eq!(log[&6][0], ("pod-a".to_owned(), 2));
    assert!(
        (7..=10).all(|i| log[&i][0] == ("pod-b".to_owned(), 3)),
        "{log:?}"
    );
}

#[tokio::test]
async fn a_term_that_ends_releases_its_lease_and_one_that_panics_leaves_it_to_its_ttl() {
    let redis = RedisServer::start();
    let name = scheduler_lease();
    let leadership = Leadership::builder(leases(&redis, "pod-a"), name.clone())
        // Long enough that the check right after the panic finds the lease on a loaded
        // machine (1.5 s once ran out there before the check).
        .lease_ttl(Duration::from_secs(6))
        .build()
        .unwrap();

    // A term that ends: released, and a clone of its Term kept past it is not held.
    let (kept_tx, kept_rx) = std::sync::mpsc::channel::<Term>();
    let tick = leadership
        .run_once(|term| async move {
            assert!(term.is_held());
            kept_tx.send(term.clone()).unwrap();
            term.token()
        })
        .await;
    let Tick::Led {
        output,
        token,
        released,
    } = tick
    else {
        panic!("{tick:?}");
    };
    assert_eq!(output, token);
    assert!(matches!(
        released,
        stampede_guard::lease::ReleaseOutcome::Released
    ));
    assert_eq!(pttl(&redis, name.key()).await, -2);
    let kept = kept_rx.recv().unwrap();
    assert!(!kept.is_held(), "a term that ended still says it leads");

    // A term whose work panics: the panic goes to the caller; renewals stop, nothing
    // is released, and the lease ends by its TTL.
    let (kept_tx, kept_rx) = std::sync::mpsc::channel::<Term>();
    let panicked = tokio::spawn({
        let leadership = leadership.clone();
        async move {
            let _ = leadership
                .run_once(|term| async move {
                    kept_tx.send(term.clone()).unwrap();
                    panic!("the job failed");
                })
                .await;
        }
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());
    assert!(!kept_rx.recv().unwrap().is_held());
    let left = pttl(&redis, name.key()).await;
    assert!(left > 0, "the panicked term's lease: {left}");
    let expired = eventually(HANG, || async { pttl(&redis, name.key()).await == -2 }).await;
    assert!(expired);
    let next = leadership.run_once(|_| async {}).await;
    assert!(matches!(next, Tick::Led { .. }), "{next:?}");
}
