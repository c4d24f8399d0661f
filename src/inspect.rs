//! Safe debugging: what the crate holds in Redis, found with `SCAN` (never `KEYS`, which
//! blocks a production server), shown without the secret parts.
//!
//! Lease owner values are shown as their holder (`service:instance`), never with the
//! random part that makes a release possible. Deleting a lease by hand can break work in
//! progress; [`delete_lease`] only deletes lease keys, and the command-line tool
//! (`examples/inspect.rs`) asks for an explicit `--yes` after printing who holds it.

use crate::error::ConfigError;
use crate::store::{Operation, RedisStore, Request, StoreError, StoreErrorKind};

/// What a key is, by its last part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ItemKind {
    /// A lease (`…:lease`).
    Lease,
    /// A lease's fence counter (`…:fence`).
    Fence,
    /// A cached entry (`…:entry`).
    Entry,
    /// An invalidation's tombstone at an entry key.
    Tombstone,
    /// Something else under the prefix.
    Other,
}

/// One key, as the tool shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    /// The key (identifiers in it are hashed).
    pub key: String,
    /// What it is.
    pub kind: ItemKind,
    /// Its remaining TTL in milliseconds (`-1`: none, `-2`: gone).
    pub pttl_ms: i64,
    /// For a lease: who holds it (`service:instance`).
    pub holder: Option<String>,
    /// For a lease, the last token issued on its name; for an entry or a tombstone, the
    /// token of its writer.
    pub fencing_token: Option<u64>,
}

/// The `SCAN … MATCH` pattern for a key space (see [`KeySpace`](crate::KeySpace)), from
/// its public parts: no secret needed to look.
pub fn pattern(prefix: &str, env: &str, service: &str) -> Result<String, ConfigError> {
    for (field, value) in [("prefix", prefix), ("env", env), ("service", service)] {
        let ok = !value.is_empty()
            && value
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
        if !ok {
            return Err(ConfigError::invalid(
                field,
                format!("`{value}` is not a key part"),
            ));
        }
    }
    Ok(format!("{prefix}:{env}:{service}:*"))
}

/// Lists up to `limit` keys matching `pattern`, with `SCAN` in batches of 100 (never
/// `KEYS`): on a cluster, every primary in turn, each with its own cursor.
pub async fn list(
    store: &RedisStore,
    pattern: &str,
    limit: usize,
) -> Result<Vec<Item>, StoreError> {
    let mut items = Vec::new();
    for node in store.nodes().await? {
        let mut cursor: u64 = 0;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(100);
            let (next, keys): (u64, Vec<String>) =
                store.run_at(&node, Operation::Inspect, &scan).await?;
            for key in keys {
                if items.len() >= limit {
                    return Ok(items);
                }
                items.push(describe(store, &key).await?);
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(items)
}

/// Describes one key.
pub async fn describe(store: &RedisStore, key: &str) -> Result<Item, StoreError> {
    let pttl: i64 = run(store, redis::cmd("PTTL").arg(key)).await?;
    let kind = if key.ends_with(":lease") {
        ItemKind::Lease
    } else if key.ends_with(":fence") {
        ItemKind::Fence
    } else if key.ends_with(":entry") {
        ItemKind::Entry
    } else {
        ItemKind::Other
    };
    let mut item = Item {
        key: key.to_owned(),
        kind,
        pttl_ms: pttl,
        holder: None,
        fencing_token: None,
    };
    match kind {
        ItemKind::Lease => {
            let owner: Option<String> = run(store, redis::cmd("GET").arg(key)).await.ok().flatten();
            // `service:instance:random`: the random part stays out.
            item.holder = owner.map(|o| {
                if o == crate::lease::HELD_OFF {
                    // Held off after a failure: nobody owns it, it ends by its TTL.
                    return "(held off)".to_owned();
                }
                o.rsplit_once(':')
                    .map_or("?", |(holder, _)| holder)
                    .to_owned()
            });
            let fence = format!("{}:fence", key.trim_end_matches(":lease"));
            let token: Option<String> = run(store, redis::cmd("GET").arg(&fence))
                .await
                .ok()
                .flatten();
            item.fencing_token = token.and_then(|t| t.parse().ok());
        }
        ItemKind::Fence => {
            let token: Option<String> = run(store, redis::cmd("GET").arg(key)).await.ok().flatten();
            item.fencing_token = token.and_then(|t| t.parse().ok());
        }
        ItemKind::Entry => {
            let fields: Vec<Option<String>> =
                run(store, redis::cmd("HMGET").arg(key).arg("t").arg("x"))
                    .await
                    .unwrap_or_default();
            item.fencing_token = fields
                .first()
                .cloned()
                .flatten()
                .and_then(|t| t.parse().ok());
            if fields.get(1).is_some_and(Option::is_some) {
                item.kind = ItemKind::Tombstone;
            }
        }
        _ => {}
    }
    Ok(item)
}

/// Deletes a lease key, and only a lease key, and only while it is held by the owner it
/// had when it was looked at: a lease taken by someone else in between is left alone
/// (`Ok(None)`). Returns what was deleted. Refused (an error of kind `Response`) for any
/// other key.
pub async fn delete_lease(store: &RedisStore, key: &str) -> Result<Option<Item>, StoreError> {
    if !key.ends_with(":lease") {
        return Err(StoreError::new(
            Operation::Inspect,
            StoreErrorKind::Response,
            None,
        ));
    }
    let item = describe(store, key).await?;
    let owner: Option<String> = run(store, redis::cmd("GET").arg(key)).await.ok().flatten();
    let Some(owner) = owner else {
        return Ok(None);
    };
    if crate::lease::release_if_owner(store, key, &owner).await? {
        Ok(Some(item))
    } else {
        Ok(None)
    }
}

async fn run<T: redis::FromRedisValue>(
    store: &RedisStore,
    cmd: &mut redis::Cmd,
) -> Result<T, StoreError> {
    store.run(Operation::Inspect, Request::Command(cmd)).await
}

/// Lease hold times against the lease TTL, for one route and lease operation, as
/// [`lease_holds`] reads them from the instances' `/metrics`.
///
/// Quantiles are over everything the instances recorded since they started (their
/// histograms' running totals, summed), not over a recent window as the dashboard's are.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseHolds {
    /// The route, for the guard's cache leases; `None` for leases taken on their own
    /// through a [`LeaseClient`](crate::lease::LeaseClient).
    pub route: Option<String>,
    /// The lease operation (`fill` for the guard's leases).
    pub operation: String,
    /// How many holds were recorded, over all the instances.
    pub count: u64,
    /// The median hold, in seconds (`None` with no holds, or no buckets to estimate from).
    pub p50: Option<f64>,
    /// The 95th percentile hold, in seconds.
    pub p95: Option<f64>,
    /// The 99th percentile hold, in seconds.
    pub p99: Option<f64>,
    /// The lease TTL, in seconds: the largest any instance reports (`None` when none
    /// reports one).
    pub ttl: Option<f64>,
}

impl LeaseHolds {
    /// The p99 as a fraction of the TTL (the alert `StampedeGuardLeaseHoldNearTTL`
    /// fires on a recent p99 above 0.8 of it).
    pub fn p99_of_ttl(&self) -> Option<f64> {
        match (self.p99, self.ttl) {
            (Some(p99), Some(ttl)) if ttl > 0.0 => Some(p99 / ttl),
            _ => None,
        }
    }
}

/// One (route, operation) while reading: cumulative bucket counts by upper bound.
#[derive(Default)]
struct Gathered {
    buckets: Vec<(f64, f64)>,
    count: f64,
    ttl: Option<f64>,
}

/// Reads the lease hold histogram and the lease TTL gauge out of the Prometheus text
/// exposition of one or more instances (the bodies of their `/metrics`), and returns one
/// row per (route, operation), sorted, with the hold count and quantiles summed over the
/// instances and the largest TTL.
///
/// Quantiles are estimated from the buckets the way Prometheus's `histogram_quantile`
/// does: the bucket the rank falls into, linearly within it (from 0 for the first
/// bucket); the upper bound of the last finite bucket when the rank falls into `+Inf`;
/// none when there are no holds or no finite bucket. Other metrics, and lines that do not
/// parse, are skipped. Labels other than `route`, `operation` and `le` (`instance`,
/// say, in a federated exposition) are summed over.
pub fn lease_holds(expositions: &[&str]) -> Vec<LeaseHolds> {
    use std::collections::BTreeMap;

    let bucket = format!("{}_bucket", crate::metrics::LEASE_HOLD_SECONDS);
    let count = format!("{}_count", crate::metrics::LEASE_HOLD_SECONDS);
    let mut rows: BTreeMap<(Option<String>, String), Gathered> = BTreeMap::new();
    for exposition in expositions {
        for line in exposition.lines() {
            let Some((name, labels, value)) = sample(line) else {
                continue;
            };
            let label = |wanted: &str| {
                labels
                    .iter()
                    .find(|(name, _)| name == wanted)
                    .map(|(_, value)| value.clone())
            };
            let Some(operation) = label("operation") else {
                continue;
            };
            let key = (label("route"), operation);
            if name == bucket {
                let Some(le) = label("le").and_then(|le| bound(&le)) else {
                    continue;
                };
                let row = rows.entry(key).or_default();
                match row.buckets.iter_mut().find(|(b, _)| *b == le) {
                    Some((_, n)) => *n += value,
                    None => row.buckets.push((le, value)),
                }
            } else if name == count {
                rows.entry(key).or_default().count += value;
            } else if name == crate::metrics::LEASE_TTL_SECONDS {
                let row = rows.entry(key).or_default();
                row.ttl = Some(row.ttl.map_or(value, |ttl: f64| ttl.max(value)));
            }
        }
    }
    rows.into_iter()
        .map(|((route, operation), mut row)| {
            row.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
            let quantile = |q| bucket_quantile(q, &row.buckets);
            LeaseHolds {
                route,
                operation,
                count: row.count as u64,
                p50: quantile(0.5),
                p95: quantile(0.95),
                p99: quantile(0.99),
                ttl: row.ttl,
            }
        })
        .collect()
}

/// The `q` quantile of cumulative `buckets` (sorted by upper bound), as Prometheus's
/// `histogram_quantile` estimates it; `None` where it would answer NaN.
fn bucket_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let (&(last, _), finite) = buckets.split_last()?;
    if last != f64::INFINITY || finite.is_empty() {
        return None;
    }
    // Counts that went down from one bucket to the next (instances with different
    // buckets, scrapes torn apart) are evened out, as Prometheus does.
    let mut counts: Vec<f64> = Vec::with_capacity(buckets.len());
    for &(_, n) in buckets {
        let floor = counts.last().copied().unwrap_or(0.0);
        counts.push(n.max(floor));
    }
    let observations = counts[counts.len() - 1];
    if observations <= 0.0 {
        return None;
    }
    let rank = q * observations;
    let b = counts[..finite.len()]
        .iter()
        .position(|&n| n >= rank)
        .unwrap_or(finite.len());
    if b == finite.len() {
        // In the +Inf bucket: the largest finite bound is all that is known.
        return Some(finite[finite.len() - 1].0);
    }
    let end = buckets[b].0;
    if b == 0 && end <= 0.0 {
        return Some(end);
    }
    let (start, below) = if b == 0 {
        (0.0, 0.0)
    } else {
        (buckets[b - 1].0, counts[b - 1])
    };
    Some((end - start).mul_add((rank - below) / (counts[b] - below), start))
}

/// A bucket's upper bound (`le`).
fn bound(le: &str) -> Option<f64> {
    match le {
        "+Inf" | "Inf" | "inf" | "+inf" => Some(f64::INFINITY),
        _ => le.parse().ok(),
    }
}

/// One sample line of the text exposition: its name, labels and value. `None` for
/// comments, blank lines and lines that do not parse.
fn sample(line: &str) -> Option<(&str, Vec<(String, String)>, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let (name, mut rest) = line.split_at(name_end);
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let mut chars = after.char_indices();
        let mut label = String::new();
        loop {
            let (i, c) = chars.next()?;
            match c {
                '}' => {
                    rest = &after[i + 1..];
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            other => value.push(other),
                        }
                    }
                    labels.push((std::mem::take(&mut label), value));
                }
                other => label.push(other),
            }
        }
    }
    // The value, then an optional timestamp.
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        _ => value.parse().ok()?,
    };
    Some((name, labels, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two instances of one route (buckets 0.1, 0.5, 1, +Inf), a lease used on its own
    /// with nothing recorded yet, and one whose only bucket is +Inf.
    const A: &str = r#"# HELP stampede_guard_lease_hold_seconds How long leases are held.
# TYPE stampede_guard_lease_hold_seconds histogram
stampede_guard_lease_hold_seconds_bucket{route="items",operation="fill",le="0.1"} 50
stampede_guard_lease_hold_seconds_bucket{route="items",operation="fill",le="0.5"} 90
stampede_guard_lease_hold_seconds_bucket{route="items",operation="fill",le="1"} 100
stampede_guard_lease_hold_seconds_bucket{route="items",operation="fill",le="+Inf"} 100
stampede_guard_lease_hold_seconds_sum{route="items",operation="fill"} 20.5
stampede_guard_lease_hold_seconds_count{route="items",operation="fill"} 100
stampede_guard_lease_hold_seconds_bucket{operation="scheduler",le="0.1"} 0
stampede_guard_lease_hold_seconds_bucket{operation="scheduler",le="+Inf"} 0
stampede_guard_lease_hold_seconds_sum{operation="scheduler"} 0
stampede_guard_lease_hold_seconds_count{operation="scheduler"} 0
stampede_guard_lease_hold_seconds_bucket{operation="report",le="+Inf"} 4
stampede_guard_lease_hold_seconds_count{operation="report"} 4
# TYPE stampede_guard_lease_ttl_seconds gauge
stampede_guard_lease_ttl_seconds{route="items",operation="fill"} 2
stampede_guard_lease_ttl_seconds{operation="scheduler"} 30
stampede_guard_requests_total{route="items",outcome="hit"} 7
"#;

    const B: &str = r#"stampede_guard_lease_hold_seconds_bucket{route="items",operation="fill",le="0.1"} 50
stampede_guard_lease_hold_seconds_bucket{route="items",operation="fill",le="0.5"} 50
stampede_guard_lease_hold_seconds_bucket{route="items",operation="fill",le="1"} 60
stampede_guard_lease_hold_seconds_bucket{route="items",operation="fill",le="+Inf"} 100
stampede_guard_lease_hold_seconds_count{route="items",operation="fill"} 100
stampede_guard_lease_ttl_seconds{operation="fill",route="items"} 2.5
"#;

    fn close(got: Option<f64>, want: f64) -> bool {
        got.is_some_and(|got| (got - want).abs() < 1e-9)
    }

    #[test]
    fn quantiles_are_estimated_as_histogram_quantile_does_summed_over_instances() {
        let rows = lease_holds(&[A, B]);
        let keys: Vec<(Option<&str>, &str)> = rows
            .iter()
            .map(|r| (r.route.as_deref(), r.operation.as_str()))
            .collect();
        assert_eq!(
            keys,
            [
                (None, "report"),
                (None, "scheduler"),
                (Some("items"), "fill")
            ]
        );

        // Summed: 100 in (0, 0.1], 40 in (0.1, 0.5], 20 in (0.5, 1], 40 above 1; 200.
        let items = &rows[2];
        assert_eq!(items.count, 200);
        // Rank 100: the last of the first bucket.
        assert!(close(items.p50, 0.1), "{items:?}");
        // Rank 190 and 198: in +Inf, so the largest finite bound.
        assert!(close(items.p95, 1.0), "{items:?}");
        assert!(close(items.p99, 1.0), "{items:?}");
        // The largest of the two instances' TTLs.
        assert_eq!(items.ttl, Some(2.5));
        assert!(close(items.p99_of_ttl(), 0.4));

        // One instance alone: rank 50 ends the first bucket; rank 95 is 5/10 into
        // (0.5, 1]; rank 99 is 9/10 into it.
        let one = &lease_holds(&[A])[2];
        assert_eq!(one.count, 100);
        assert!(close(one.p50, 0.1), "{one:?}");
        assert!(close(one.p95, 0.75), "{one:?}");
        assert!(close(one.p99, 0.95), "{one:?}");
        assert_eq!(one.ttl, Some(2.0));
        // Rank 25: halfway into the first bucket, which starts at 0.
        let buckets = [
            (0.1, 50.0),
            (0.5, 90.0),
            (1.0, 100.0),
            (f64::INFINITY, 100.0),
        ];
        assert!(close(bucket_quantile(0.25, &buckets), 0.05));

        // Nothing recorded: no quantiles, but the TTL.
        let scheduler = &rows[1];
        assert_eq!(scheduler.count, 0);
        assert_eq!(
            (scheduler.p50, scheduler.p95, scheduler.p99),
            (None, None, None)
        );
        assert_eq!(scheduler.ttl, Some(30.0));
        assert_eq!(scheduler.p99_of_ttl(), None);

        // Only +Inf: counted, but nothing to estimate from (Prometheus answers NaN).
        let report = &rows[0];
        assert_eq!(report.count, 4);
        assert_eq!((report.p50, report.p99), (None, None));
        assert_eq!(report.ttl, None);
    }

    #[test]
    fn exposition_lines_parse_with_escapes_and_timestamps() {
        let (name, labels, value) =
            sample(r#"m_bucket{a="x\"y,z",le="+Inf"} 3 1700000000000"#).unwrap();
        assert_eq!(name, "m_bucket");
        assert_eq!(
            labels,
            [
                ("a".to_owned(), "x\"y,z".to_owned()),
                ("le".to_owned(), "+Inf".to_owned())
            ]
        );
        assert_eq!(value, 3.0);
        assert_eq!(sample("m 2.5").map(|s| s.2), Some(2.5));
        assert!(sample("# TYPE m gauge").is_none());
        assert!(sample("m{a=\"b\" 1").is_none());
    }
}
