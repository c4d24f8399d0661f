//! The Prometheus exporter after a scripted scenario: exact counter values.
//!
//! A process has one global recorder, so this file holds one test.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use stampede_guard::inspect::{self, LeaseHolds};
use stampede_guard::keys::Scope;
use stampede_guard::lease::{AcquireOutcome, LeaseClient, ReleaseOutcome, RenewOutcome};
use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::web::{Origin, get, instance, keys, send};
use support::{HANG, RedisServer, eventually, within};

/// `name{labels}` → value, labels sorted, from the text format.
fn parse(rendered: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in rendered
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let key = match series.split_once('{') {
            Some((name, labels)) => {
                let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                labels.sort_unstable();
                format!("{name}{{{}}}", labels.join(","))
            }
            None => series.to_owned(),
        };
        out.insert(key, value.parse().unwrap());
    }
    out
}

/// The counters and gauges the shipped dashboard and alert rules use (histograms, which
/// are exported from their first sample, left out).
fn dashboard_and_alert_metrics() -> Vec<String> {
    use stampede_guard::metrics::{ALL, MetricKind};
    let text = std::fs::read_to_string("dashboards/stampede-guard.json").unwrap()
        + &std::fs::read_to_string("dashboards/alerts.yml").unwrap();
    let mut used: Vec<String> = ALL
        .iter()
        .filter(|(_, kind, _)| *kind != MetricKind::Histogram)
        .map(|(name, _, _)| name.to_string())
        .filter(|name| {
            text.match_indices(name.as_str()).any(|(at, _)| {
                // The name whole, not the start of a longer one.
                !text[at + name.len()..]
                    .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
            })
        })
        .collect();
    used.sort();
    used
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exporter_renders_exact_counts_after_a_scripted_scenario() {
    let handle = stampede_guard::prometheus::install().unwrap();
    let mut server = RedisServer::start();
    let store = RedisStore::builder(server.url())
        .command_timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let policy = Policy::builder("items")
        .fresh_ttl(Duration::from_millis(500))
        .grace(Duration::from_secs(30))
        .lease_ttl(Duration::from_secs(2))
        .refresh_timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let origin = Origin::versions(Duration::ZERO);
    let i = instance(
        StampedeGuard::builder(store.clone(), keys())
            .build()
            .unwrap(),
        policy,
        origin.service(),
    )
    .await;

    // From start-up, before any request: every counter and gauge the dashboard and the
    // alert rules use is exported (at 0 where nothing happened yet), so that their
    // panels and alerts have data on a healthy fleet. (Histograms: from their first
    // sample.)
    let used = dashboard_and_alert_metrics();
    let missing = |text: &str| -> Vec<String> {
        used.iter()
            .filter(|name| {
                !text
                    .lines()
                    .any(|l| !l.starts_with('#') && l.starts_with(name.as_str()))
            })
            .cloned()
            .collect()
    };
    // (The per-process gauges are reported by the notice listener once it is up.)
    let exported = eventually(Duration::from_secs(3), || async {
        missing(&handle.render()).is_empty()
    });
    assert!(
        exported.await,
        "not exported at start-up: {:?}",
        missing(&handle.render())
    );
    let startup = parse(&handle.render());
    for name in [
        "stampede_guard_origin_calls_avoided_total",
        "stampede_guard_lease_renewals_total",
        "stampede_guard_lease_owner_mismatches_total",
    ] {
        let route: Vec<f64> = startup
            .iter()
            .filter(|(series, _)| series.starts_with(name) && series.contains("route=\"items\""))
            .map(|(_, value)| *value)
            .collect();
        assert!(!route.is_empty(), "{name} of the route, exported");
        assert!(route.iter().all(|v| *v == 0.0), "{name} at 0: {route:?}");
    }

    // A cold fill, then a hit.
    assert_eq!(send(&i.service, get("/items/1")).await.x_cache(), "miss");
    assert_eq!(send(&i.service, get("/items/1")).await.x_cache(), "hit");
    // A stale entry, refreshed.
    tokio::time::sleep(Duration::from_millis(550)).await;
    assert_eq!(send(&i.service, get("/items/1")).await.x_cache(), "stale");
    assert!(
        eventually(Duration::from_secs(2), || async {
            i.layer.stats().get(Event::RefreshWritten) == 1
        })
        .await
    );
    // A stale entry whose lease someone else holds.
    let keys_of_1 = i.layer.cache_keys(&get("/items/1")).unwrap();
    let other = LeaseClient::builder(store.clone(), &keys())
        .build()
        .unwrap();
    let held = match other
        .try_acquire(keys_of_1.lease(), Duration::from_millis(600))
        .await
    {
        AcquireOutcome::Acquired(lease) => lease,
        outcome => panic!("{outcome:?}"),
    };
    tokio::time::sleep(Duration::from_millis(550)).await;
    assert_eq!(send(&i.service, get("/items/1")).await.x_cache(), "stale");
    assert!(
        eventually(Duration::from_secs(2), || async {
            i.layer.stats().get(Event::RefreshBusy) == 1
        })
        .await
    );
    let _ = other.release(held).await;
    // A refused fenced write: a refresh that began before an invalidation. (Past the
    // hold-off the busy lease left: at most its TTL.)
    tokio::time::sleep(Duration::from_millis(2100)).await;
    origin.hold(origin.calls() + 1);
    let started = origin.started.notified();
    assert_eq!(send(&i.service, get("/items/1")).await.x_cache(), "stale");
    within(HANG, started, "the refresh reaching the origin").await;
    let item = get("/items/1");
    let invalidation = i.layer.invalidate(&item);
    assert!(
        within(HANG, invalidation, "the invalidation")
            .await
            .unwrap()
    );
    origin.open();
    assert!(
        eventually(Duration::from_secs(2), || async {
            i.layer.stats().get(Event::FencedWriteRefused) == 1
        })
        .await
    );
    // Let the refused refresh's last look at L2 end before Redis goes: its task records
    // how long it took once it is over, the third refresh to do so.
    let refreshes_over = eventually(Duration::from_secs(2), || async {
        parse(&handle.render())
            .get("stampede_guard_refresh_seconds_count{route=\"items\"}")
            .is_some_and(|&n| n == 3.0)
    });
    assert!(refreshes_over.await, "the refused refresh did not end");
    // A lease used on its own: taken for 1 s, renewed for 1.5 s, released.
    let scheduler = keys()
        .lease(&[Scope::label("nightly")], "scheduler")
        .unwrap();
    let mut job = match other.try_acquire(&scheduler, Duration::from_secs(1)).await {
        AcquireOutcome::Acquired(lease) => lease,
        outcome => panic!("{outcome:?}"),
    };
    assert!(matches!(
        other.renew(&mut job, Duration::from_millis(1500)).await,
        RenewOutcome::Renewed
    ));
    assert!(matches!(other.release(job).await, ReleaseOutcome::Released));
    // Redis killed: a cold key is served by the origin, without Redis.
    server.kill();
    assert_eq!(send(&i.service, get("/items/2")).await.x_cache(), "miss");

    let rendered = handle.render();
    let got = parse(&rendered);
    let value = |series: &str| got.get(series).copied().unwrap_or(0.0);
    let expect = [
        (
            "stampede_guard_requests_total{outcome=\"miss\",route=\"items\"}",
            2.0,
        ),
        (
            "stampede_guard_requests_total{outcome=\"hit\",route=\"items\"}",
            1.0,
        ),
        (
            "stampede_guard_requests_total{outcome=\"stale\",route=\"items\"}",
            3.0,
        ),
        (
            "stampede_guard_refreshes_total{result=\"written\",route=\"items\"}",
            1.0,
        ),
        (
            "stampede_guard_refreshes_total{result=\"busy\",route=\"items\"}",
            1.0,
        ),
        (
            "stampede_guard_fenced_writes_refused_total{route=\"items\"}",
            1.0,
        ),
        ("stampede_guard_cold_fills_total{route=\"items\"}", 2.0),
        ("stampede_guard_local_only_total{route=\"items\"}", 1.0),
        ("stampede_guard_redis_fallbacks_total{route=\"items\"}", 1.0),
        // The guard's leases, by route: the fill, the refresh, the refused refresh (its
        // write released the lease), and the refresh that found the lease busy, twice:
        // it looks again once it listens for the holder's fill notice.
        (
            "stampede_guard_lease_acquisitions_total{operation=\"fill\",result=\"acquired\",route=\"items\"}",
            3.0,
        ),
        (
            "stampede_guard_lease_acquisitions_total{operation=\"fill\",result=\"busy\",route=\"items\"}",
            2.0,
        ),
        (
            "stampede_guard_lease_releases_total{operation=\"fill\",result=\"released\",route=\"items\"}",
            3.0,
        ),
        (
            "stampede_guard_lease_acquire_seconds_count{operation=\"fill\",route=\"items\"}",
            5.0,
        ),
        // The other client's lease on the same name, taken on its own: no route.
        (
            "stampede_guard_lease_acquisitions_total{operation=\"fill\",result=\"acquired\"}",
            1.0,
        ),
        (
            "stampede_guard_lease_releases_total{operation=\"fill\",result=\"released\"}",
            1.0,
        ),
        (
            "stampede_guard_lease_acquire_seconds_count{operation=\"fill\"}",
            1.0,
        ),
        ("stampede_guard_origin_calls_total{route=\"items\"}", 4.0),
        // Hold times and TTLs, labelled alike: the guard's three holds by route and
        // operation, the other client's one (a lease on the same name, taken on its own)
        // by operation only; the scheduler's lease by its operation, at its last TTL.
        (
            "stampede_guard_lease_hold_seconds_count{operation=\"fill\",route=\"items\"}",
            3.0,
        ),
        (
            "stampede_guard_lease_ttl_seconds{operation=\"fill\",route=\"items\"}",
            2.0,
        ),
        (
            "stampede_guard_lease_hold_seconds_count{operation=\"fill\"}",
            1.0,
        ),
        ("stampede_guard_lease_ttl_seconds{operation=\"fill\"}", 0.6),
        (
            "stampede_guard_lease_hold_seconds_count{operation=\"scheduler\"}",
            1.0,
        ),
        (
            "stampede_guard_lease_ttl_seconds{operation=\"scheduler\"}",
            1.5,
        ),
        (
            "stampede_guard_lease_acquisitions_total{operation=\"scheduler\",result=\"acquired\"}",
            1.0,
        ),
        ("stampede_guard_redis_circuit_open", 0.0),
    ];
    let mut wrong = Vec::new();
    for (series, want) in expect {
        if value(series) != want {
            wrong.push(format!("{series}: {} (want {want})", value(series)));
        }
    }
    // The read that found Redis dead, whichever way it failed.
    let read_errors: f64 = got
        .iter()
        .filter(|(k, _)| {
            k.starts_with("stampede_guard_redis_errors_total{") && k.contains("operation=\"read\"")
        })
        .map(|(_, v)| v)
        .sum();
    if read_errors != 1.0 {
        wrong.push(format!("read errors: {read_errors} (want 1)"));
    }
    // Every error series is there from the store's first operation, at zero until it
    // counts: a burst that comes before a scrape is still an increase to `rate()`.
    let errors = got
        .keys()
        .filter(|k| k.starts_with("stampede_guard_redis_errors_total{"))
        .count();
    if errors != 60 {
        wrong.push(format!(
            "error series: {errors} (want 10 operations x 6 kinds)"
        ));
    }
    let never = "stampede_guard_redis_errors_total{kind=\"response\",operation=\"inspect\"}";
    if got.get(never) != Some(&0.0) {
        wrong.push(format!("{never}: {:?} (want 0)", got.get(never)));
    }
    // Histograms render with the crate's buckets.
    assert!(
        rendered.contains(
            "stampede_guard_lease_acquire_seconds_bucket{operation=\"fill\",le=\"0.0005\"}"
        ),
        "{rendered}"
    );
    assert!(
        rendered.contains("# HELP stampede_guard_requests_total"),
        "{rendered}"
    );
    assert!(
        rendered.contains(
            "stampede_guard_lease_hold_seconds_bucket{route=\"items\",operation=\"fill\",le=\"+Inf\"} 3"
        ),
        "{rendered}"
    );
    // The hold series have no labels but these (never a key or an owner).
    let hold_labels: Vec<&str> = got
        .keys()
        .filter(|k| k.starts_with("stampede_guard_lease_hold_seconds_count{"))
        .map(String::as_str)
        .collect();
    assert_eq!(
        hold_labels,
        [
            "stampede_guard_lease_hold_seconds_count{operation=\"fill\",route=\"items\"}",
            "stampede_guard_lease_hold_seconds_count{operation=\"fill\"}",
            "stampede_guard_lease_hold_seconds_count{operation=\"scheduler\"}",
        ],
    );
    // Every lease series of the guard's has its route, and only those: the lease client's
    // own carry `operation` alone. (The route's are exported at 0 from the start, for
    // every result: those that counted something are listed.)
    let is_lease = |k: &str| {
        k.starts_with("stampede_guard_lease_acquisitions_total{")
            || k.starts_with("stampede_guard_lease_releases_total{")
            || k.starts_with("stampede_guard_lease_renewals_total{")
    };
    for (series, _) in got.iter().filter(|(k, v)| is_lease(k) && **v == 0.0) {
        assert!(series.contains("route=\"items\""), "{series}");
    }
    let lease_series: Vec<&str> = got
        .iter()
        .filter(|(k, v)| is_lease(k) && **v > 0.0)
        .map(|(k, _)| k.as_str())
        .collect();
    assert_eq!(
        lease_series,
        [
            "stampede_guard_lease_acquisitions_total{operation=\"fill\",result=\"acquired\",route=\"items\"}",
            "stampede_guard_lease_acquisitions_total{operation=\"fill\",result=\"acquired\"}",
            "stampede_guard_lease_acquisitions_total{operation=\"fill\",result=\"busy\",route=\"items\"}",
            "stampede_guard_lease_acquisitions_total{operation=\"scheduler\",result=\"acquired\"}",
            "stampede_guard_lease_releases_total{operation=\"fill\",result=\"released\",route=\"items\"}",
            "stampede_guard_lease_releases_total{operation=\"fill\",result=\"released\"}",
            "stampede_guard_lease_releases_total{operation=\"scheduler\",result=\"released\"}",
            "stampede_guard_lease_renewals_total{operation=\"scheduler\",result=\"renewed\"}",
        ],
    );
    // What belongs to the whole process has no route.
    for name in [
        "stampede_guard_l1_entries",
        "stampede_guard_l1_bytes",
        "stampede_guard_refresh_budget_in_use",
        "stampede_guard_redis_circuit_open",
    ] {
        let labelled: Vec<&String> = got
            .keys()
            .filter(|k| k.starts_with(&format!("{name}{{")))
            .collect();
        assert!(labelled.is_empty(), "{labelled:?}");
    }
    // The inspection tool reads them back: counts and TTLs, and quantiles within the
    // buckets (each hold took more than nothing and less than its TTL).
    let rows = inspect::lease_holds(&[&rendered]);
    let row = |route: Option<&str>, operation: &str| -> &LeaseHolds {
        rows.iter()
            .find(|r| r.route.as_deref() == route && r.operation == operation)
            .unwrap_or_else(|| panic!("no row {route:?} {operation}: {rows:#?}"))
    };
    let items = row(Some("items"), "fill");
    assert_eq!((items.count, items.ttl), (3, Some(2.0)), "{items:?}");
    assert!(
        items.p99.is_some_and(|p99| p99 > 0.0 && p99 < 2.0),
        "{items:?}"
    );
    assert!(
        items.p50 <= items.p95 && items.p95 <= items.p99,
        "{items:?}"
    );
    let alone = row(None, "fill");
    assert_eq!((alone.count, alone.ttl), (1, Some(0.6)), "{alone:?}");
    let job = row(None, "scheduler");
    assert_eq!((job.count, job.ttl), (1, Some(1.5)), "{job:?}");
    assert_eq!(rows.len(), 3, "{rows:#?}");
    eprintln!("{rendered}");
    assert!(wrong.is_empty(), "{wrong:#?}\n{rendered}");
}
