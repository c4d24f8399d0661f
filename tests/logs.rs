//! What the crate logs never holds an owner value, a raw identifier or a response body.

mod support;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stampede_guard::keys::Scope;
use stampede_guard::lease::{AcquireOutcome, LeaseClient, ReleaseOutcome, RenewOutcome};
use stampede_guard::metrics::Event;
use stampede_guard::{LocalOnly, Mode, Policy, RedisStore, StampedeGuard};
use support::web::{Origin, full, get, instance, keys, send};
use support::{HANG, RedisServer, eventually, within};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Everything logged so far.
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

/// Captures what is logged at `level` and above on this thread, and a runtime of one
/// thread, so that every task logs there too: keep the guard while it runs.
fn capturing(
    level: tracing::Level,
) -> (
    Captured,
    tracing::subscriber::DefaultGuard,
    tokio::runtime::Runtime,
) {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let default = tracing::subscriber::set_default(subscriber);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    (captured, default, runtime)
}

#[test]
fn logs_and_spans_hold_no_owner_value_raw_key_or_body() {
    let (captured, _default, runtime) = capturing(tracing::Level::TRACE);
    let server = RedisServer::start();
    let mut owners = Vec::new();
    runtime.block_on(async {
        const BODY: &str = "body-SECRET-42";
        let origin = Origin::new(Duration::ZERO, |_, _| http::Response::new(full(BODY)));
        let store = RedisStore::builder(server.url())
            .command_timeout(Duration::from_millis(100))
            .build()
            .unwrap();
        let policy = Policy::builder("users")
            .fresh_ttl(Duration::from_millis(200))
            .lease_ttl(Duration::from_secs(1))
            .refresh_timeout(Duration::from_secs(1))
            .build()
            .unwrap();
        let i = instance(
            StampedeGuard::builder(store.clone(), keys())
                .build()
                .unwrap(),
            policy,
            origin.service(),
        )
        .await;
        let path = "/users/alice@example.com?tenant=acme-corporation";
        assert_eq!(send(&i.service, get(path)).await.body, BODY);
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(send(&i.service, get(path)).await.x_cache(), "stale");
        assert!(
            eventually(Duration::from_secs(2), || async {
                i.layer.stats().get(Event::RefreshWritten) == 1
            })
            .await
        );
        let item = get(path);
        let invalidation = i.layer.invalidate(&item);
        within(HANG, invalidation, "the invalidation")
            .await
            .unwrap();

        // The lease client's own logs, on every outcome.
        let leases = LeaseClient::builder(store, &keys())
            .instance_id("pod-1")
            .build()
            .unwrap();
        let name = keys()
            .lease(&[Scope::id("user", "alice@example.com")], "recalculate")
            .unwrap();
        let AcquireOutcome::Acquired(mut lease) =
            leases.try_acquire(&name, Duration::from_secs(1)).await
        else {
            panic!("not acquired");
        };
        owners.push(lease.owner().as_str().to_owned());
        assert!(matches!(
            leases.try_acquire(&name, Duration::from_secs(1)).await,
            AcquireOutcome::Busy { .. }
        ));
        let renewed = leases.renew(&mut lease, Duration::from_secs(1)).await;
        assert!(matches!(renewed, RenewOutcome::Renewed), "{renewed:?}");
        let released = leases.release(lease).await;
        assert!(matches!(released, ReleaseOutcome::Released), "{released:?}");
        server.pause();
        let outcome = leases.try_acquire(&name, Duration::from_secs(1)).await;
        server.resume();
        assert!(matches!(outcome, AcquireOutcome::TimedOut(_)));
    });
    let logs = captured.text();
    assert!(
        logs.contains("lease acquired"),
        "nothing was logged:\n{logs}"
    );
    assert!(
        logs.contains("stampede_guard.refresh"),
        "the refresh span is missing:\n{logs}"
    );
    for owner in &owners {
        let random = owner.rsplit(':').next().unwrap();
        assert!(!logs.contains(random), "an owner value was logged:\n{logs}");
    }
    // And no owner value of the guard's own leases: their random part is a ULID, 26
    // characters of Crockford's base32, which nothing else the crate logs looks like.
    let ulid_like = logs.split(|c: char| !c.is_ascii_alphanumeric()).find(|w| {
        w.len() == 26
            && w.chars()
                .all(|c| c.is_ascii_digit() || ("ABCDEFGHJKMNPQRSTVWXYZ").contains(c))
    });
    assert!(
        ulid_like.is_none(),
        "a ULID was logged: {ulid_like:?}\n{logs}"
    );
    for raw in ["alice", "example.com", "acme-corporation", "body-SECRET-42"] {
        assert!(!logs.contains(raw), "{raw} was logged:\n{logs}");
    }
}

/// Each change of Redis's state is said once, with its cause, and never per request:
/// Redis answering, its first failure, the breaker opening (local-only from then on) and
/// Redis answering again, and the notice subscription lost and back, while 1,000
/// requests are served local-only in between.
#[test]
fn each_change_of_redis_state_is_logged_once() {
    let (captured, _default, runtime) = capturing(tracing::Level::INFO);
    let mut server = RedisServer::start();
    let logs = || captured.text();
    runtime.block_on(async {
        let origin = Origin::new(Duration::ZERO, |_, _| http::Response::new(full("item")));
        let store = RedisStore::builder(server.url())
            .command_timeout(Duration::from_millis(250))
            .build()
            .unwrap();
        let policy = Policy::builder("items")
            .fresh_ttl(Duration::from_secs(60))
            .build()
            .unwrap();
        let guard = StampedeGuard::builder(store, keys()).build().unwrap();
        let i = instance(guard, policy, origin.service()).await;
        for n in 0..10 {
            assert_eq!(
                send(&i.service, get(&format!("/items/{n}"))).await.status,
                200
            );
        }
        server.kill();
        for n in 0..1000 {
            let got = send(&i.service, get(&format!("/items/{}", n % 50))).await;
            assert_eq!(got.status, 200, "request {n}");
        }
        assert_eq!(
            i.guard.mode(),
            Mode::LocalOnly(LocalOnly::RedisUnavailable),
            "{}",
            logs()
        );
        server.restart();
        let back = eventually(HANG, || async {
            i.guard.mode() == Mode::Shared && i.guard.notices_connected()
        });
        assert!(back.await, "{}", logs());
        for n in 0..10 {
            let got = send(&i.service, get(&format!("/items/{}", 100 + n))).await;
            assert_eq!(got.status, 200);
        }
    });
    let logs = logs();
    let said: Vec<&str> = logs
        .lines()
        .filter(|line| line.contains(" INFO ") || line.contains(" WARN "))
        .collect();
    let count = |what: &str| said.iter().filter(|line| line.contains(what)).count();
    for (what, times) in [
        (
            "INFO stampede_guard::store::said: Redis answers: the cache is shared",
            1,
        ),
        (
            "WARN stampede_guard::store::said: Redis failed: going on without it",
            1,
        ),
        (
            "WARN stampede_guard::store::said: Redis unavailable: the circuit breaker opened",
            1,
        ),
        ("lost its notice subscription", 1),
        ("INFO stampede_guard::store::said: Redis answers again", 1),
        ("notice subscription is back", 1),
    ] {
        assert_eq!(count(what), times, "{what:?}:\n{logs}");
    }
    // Each failure says why, with the error's own words: `redis OP: KIND: CAUSE`. The
    // failure that opened the breaker may have had none (a connect still in progress at
    // its deadline): then the probe says the first cause it meets, once.
    let has_cause = |line: &str| {
        line.split("error=")
            .nth(1)
            .is_some_and(|error| error.starts_with("redis ") && error.matches(": ").count() >= 2)
    };
    let failed = said
        .iter()
        .find(|line| line.contains("Redis failed"))
        .unwrap();
    assert!(has_cause(failed), "{failed}");
    let opened = said
        .iter()
        .find(|line| line.contains("Redis unavailable"))
        .unwrap();
    assert!(opened.contains("failures=5"), "{opened}");
    let later = count("Redis still unavailable");
    if has_cause(opened) {
        assert_eq!(later, 0, "{logs}");
    } else {
        assert_eq!(later, 1, "{logs}");
        let still = said.iter().find(|line| line.contains("still")).unwrap();
        assert!(has_cause(still), "{still}");
    }
    assert_eq!(
        said.len(),
        6 + later,
        "one line per change, nothing else:\n{logs}"
    );
}
