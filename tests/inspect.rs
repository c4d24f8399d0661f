//! The debugging helpers, against a real Redis with known leases and entries.

mod support;

use std::time::Duration;

use redis::AsyncCommands;
use stampede_guard::inspect::{self, ItemKind};
use stampede_guard::keys::Scope;
use stampede_guard::lease::{AcquireOutcome, LeaseClient};
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::RedisServer;
use support::web::{Origin, get, instance, keys, send};

fn calls(stats: &str, command: &str) -> u64 {
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

#[tokio::test]
async fn the_inspector_lists_leases_and_entries_with_scan_and_deletes_only_leases() {
    let server = RedisServer::start();
    let store = RedisStore::builder(server.url()).build().unwrap();
    let origin = Origin::versions(Duration::ZERO);
    let i = instance(
        StampedeGuard::builder(store.clone(), keys())
            .build()
            .unwrap(),
        Policy::builder("items").build().unwrap(),
        origin.service(),
    )
    .await;
    for n in 0..3 {
        send(&i.service, get(&format!("/items/{n}"))).await;
    }
    let leases = LeaseClient::builder(store.clone(), &keys())
        .instance_id("pod-7")
        .build()
        .unwrap();
    let name = keys()
        .lease(&[Scope::id("job", "nightly")], "reconcile")
        .unwrap();
    let AcquireOutcome::Acquired(lease) = leases.try_acquire(&name, Duration::from_secs(30)).await
    else {
        panic!("not acquired");
    };

    let pattern = inspect::pattern("sg", "test", "catalog").unwrap();
    let items = inspect::list(&store, &pattern, 100).await.unwrap();
    let of = |kind| items.iter().filter(|i| i.kind == kind).count();
    assert_eq!(of(ItemKind::Entry), 3, "{items:#?}");
    assert_eq!(of(ItemKind::Lease), 1, "{items:#?}");
    // A fence counter per filled entry and one for the job's lease.
    assert_eq!(of(ItemKind::Fence), 4, "{items:#?}");
    let listed = items.iter().find(|i| i.kind == ItemKind::Lease).unwrap();
    assert_eq!(listed.key, name.key());
    assert_eq!(listed.holder.as_deref(), Some("catalog:pod-7"));
    assert_eq!(listed.fencing_token, Some(lease.fencing_token().get()));
    assert!(listed.pttl_ms > 25_000);
    // The random part of the owner value is nowhere in what is shown.
    let random = lease
        .owner()
        .as_str()
        .rsplit(':')
        .next()
        .unwrap()
        .to_owned();
    assert!(!format!("{items:?}").contains(&random));
    assert!(
        items
            .iter()
            .filter(|i| i.kind == ItemKind::Entry)
            .all(|i| i.fencing_token.is_some() && i.pttl_ms > 0)
    );

    let stats: String = server.cmd(&["INFO", "commandstats"]).await;
    // Fewer keys than one batch of 100: Redis walks the whole key space in one SCAN.
    assert_eq!(calls(&stats, "scan"), 1, "{stats}");
    assert_eq!(calls(&stats, "keys"), 0, "KEYS was sent:\n{stats}");

    // Only leases can be deleted.
    let entry = items.iter().find(|i| i.kind == ItemKind::Entry).unwrap();
    assert!(inspect::delete_lease(&store, &entry.key).await.is_err());
    assert!(
        server
            .conn()
            .await
            .exists::<_, bool>(&entry.key)
            .await
            .unwrap()
    );
    let deleted = inspect::delete_lease(&store, name.key())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(deleted.holder.as_deref(), Some("catalog:pod-7"));
    assert_eq!(
        inspect::describe(&store, name.key()).await.unwrap().pttl_ms,
        -2
    );
    assert!(
        inspect::delete_lease(&store, name.key())
            .await
            .unwrap()
            .is_none()
    );
}
