//! What the crate logs never holds an owner value, a raw identifier or a response body.

mod support;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use stampede_guard::keys::Scope;
use stampede_guard::lease::{AcquireOutcome, LeaseClient, ReleaseOutcome, RenewOutcome};
use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
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

#[test]
fn logs_and_spans_hold_no_owner_value_raw_key_or_body() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    // One thread, so that every task logs to the subscriber set above.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
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
    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
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
