//! Lists the leases and entries of a service in Redis, safely.
//!
//! ```text
//! cargo run --example inspect -- --env local --service example-axum
//! cargo run --example inspect -- --env local --service example-axum --delete-lease KEY
//! cargo run --example inspect -- --env local --service example-axum --delete-lease KEY --yes
//! cargo run --example inspect -- --metrics http://10.0.0.1:9100/metrics --metrics http://10.0.0.2:9100/metrics
//! ```
//!
//! Uses `SCAN`, never `KEYS`. Shows TTLs, fencing tokens and who holds each lease
//! (service and instance, not the random part of the owner value). Deleting a lease can
//! break work in progress: the tool prints who holds it and deletes only with `--yes`.
//! `--redis URL` (or `REDIS_URL`, default `redis://127.0.0.1:6379`), `--prefix` (`sg`).
//! For a Redis Cluster, `--cluster URL` once per node to start from (one is enough):
//! every primary is scanned, each with its own cursor (with `--features cluster`).
//!
//! `--metrics URL` (repeatable; no Redis needed) reads the `/metrics` of each instance
//! instead (plain `http://`), and prints lease hold times against the lease TTL per route
//! and lease operation: the number of holds, their p50, p95 and p99 (estimated from the
//! histogram buckets summed over the instances, as Prometheus's `histogram_quantile`
//! does, over the instances' whole lives), the TTL (the largest reported) and p99/ttl.
//! Rows at or above 0.8, where the alert `StampedeGuardLeaseHoldNearTTL` fires on a
//! recent p99, are flagged `NEAR TTL`. Leases used on their own show `-` as their route.

use std::process::ExitCode;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use stampede_guard::RedisStore;
use stampede_guard::inspect::{self, ItemKind};

/// The fraction of the TTL a p99 is flagged at (the alert's).
const NEAR: f64 = 0.8;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut redis =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let (mut prefix, mut env, mut service) = ("sg".to_owned(), None, None);
    let mut cluster: Vec<String> = Vec::new();
    let mut metrics: Vec<String> = Vec::new();
    let (mut delete, mut yes, mut limit) = (None, false, 1000usize);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_default();
        match arg.as_str() {
            "--redis" => redis = value(),
            "--cluster" => cluster.push(value()),
            "--metrics" => metrics.push(value()),
            "--prefix" => prefix = value(),
            "--env" => env = Some(value()),
            "--service" => service = Some(value()),
            "--delete-lease" => delete = Some(value()),
            "--limit" => limit = value().parse().unwrap_or(limit),
            "--yes" => yes = true,
            other => {
                eprintln!("unknown argument {other:?}; see the top of examples/inspect.rs");
                return ExitCode::from(2);
            }
        }
    }
    if !metrics.is_empty() {
        return hold_times(&metrics).await;
    }
    let (Some(env), Some(service)) = (env, service) else {
        eprintln!("--env and --service are required");
        return ExitCode::from(2);
    };
    let builder = if cluster.is_empty() {
        RedisStore::builder(redis.as_str())
    } else {
        #[cfg(feature = "cluster")]
        {
            RedisStore::cluster(cluster)
        }
        #[cfg(not(feature = "cluster"))]
        {
            eprintln!("--cluster needs the `cluster` feature: cargo run --features cluster ...");
            return ExitCode::from(2);
        }
    };
    let store = match builder.build() {
        Ok(store) => store,
        Err(error) => {
            eprintln!("{error}");
            return ExitCode::from(2);
        }
    };
    if let Some(key) = delete {
        let item = match inspect::describe(&store, &key).await {
            Ok(item) => item,
            Err(error) => {
                eprintln!("{error}");
                return ExitCode::FAILURE;
            }
        };
        if item.kind != ItemKind::Lease || item.pttl_ms == -2 {
            eprintln!("{key} is not a lease that exists; nothing deleted");
            return ExitCode::FAILURE;
        }
        println!(
            "{key}\n  held by {}, {} ms left, fencing token {}",
            item.holder.as_deref().unwrap_or("?"),
            item.pttl_ms,
            item.fencing_token.map_or("?".to_owned(), |t| t.to_string())
        );
        if !yes {
            println!("Not deleted: the holder may be working. Run again with --yes to delete it.");
            return ExitCode::FAILURE;
        }
        return match inspect::delete_lease(&store, &key).await {
            Ok(Some(_)) => {
                println!("Deleted.");
                ExitCode::SUCCESS
            }
            Ok(None) => {
                println!("Gone already.");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("{error}");
                ExitCode::FAILURE
            }
        };
    }
    let pattern = match inspect::pattern(&prefix, &env, &service) {
        Ok(pattern) => pattern,
        Err(error) => {
            eprintln!("{error}");
            return ExitCode::from(2);
        }
    };
    match inspect::list(&store, &pattern, limit).await {
        Ok(items) => {
            println!(
                "{:<10} {:>9} {:>18}  {:<28} key",
                "kind", "pttl ms", "token", "holder"
            );
            for item in &items {
                println!(
                    "{:<10} {:>9} {:>18}  {:<28} {}",
                    format!("{:?}", item.kind).to_lowercase(),
                    item.pttl_ms,
                    item.fencing_token.map_or(String::new(), |t| t.to_string()),
                    item.holder.as_deref().unwrap_or(""),
                    item.key
                );
            }
            println!("{} keys under {pattern}", items.len());
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("{error}");
            ExitCode::FAILURE
        }
    }
}

/// `--metrics`: fetches each instance's exposition and prints the table.
async fn hold_times(urls: &[String]) -> ExitCode {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut bodies = Vec::new();
    for url in urls {
        match fetch(&client, url).await {
            Ok(body) => bodies.push(body),
            Err(error) => {
                eprintln!("{url}: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    let bodies: Vec<&str> = bodies.iter().map(String::as_str).collect();
    let rows = inspect::lease_holds(&bodies);
    println!(
        "{:<24} {:<16} {:>8} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "route", "operation", "holds", "p50", "p95", "p99", "ttl", "p99/ttl"
    );
    let mut near = 0;
    for row in &rows {
        let ratio = row.p99_of_ttl();
        let flag = if ratio.is_some_and(|r| r >= NEAR) {
            near += 1;
            "  NEAR TTL"
        } else {
            ""
        };
        println!(
            "{:<24} {:<16} {:>8} {:>10} {:>10} {:>10} {:>10} {:>8}{flag}",
            row.route.as_deref().unwrap_or("-"),
            row.operation,
            row.count,
            seconds(row.p50),
            seconds(row.p95),
            seconds(row.p99),
            seconds(row.ttl),
            ratio.map_or("-".to_owned(), |r| format!("{r:.2}")),
        );
    }
    println!(
        "{} route and operation pairs from {} instances; {near} at or above {NEAR} of their TTL",
        rows.len(),
        urls.len()
    );
    if rows.is_empty() {
        println!("(no lease hold times or lease TTLs in these expositions)");
    }
    ExitCode::SUCCESS
}

/// A plain HTTP GET of `url`; its body, if the answer is 200.
async fn fetch(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    url: &str,
) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    let uri: http::Uri = url.parse()?;
    let response = client.get(uri).await?;
    let status = response.status();
    let body = response.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        return Err(format!("answered {status}").into());
    }
    Ok(String::from_utf8(body.to_vec())?)
}

/// Seconds, shown in milliseconds below one second; `-` when unknown.
fn seconds(value: Option<f64>) -> String {
    match value {
        None => "-".to_owned(),
        Some(s) if s < 1.0 => format!("{:.1}ms", s * 1000.0),
        Some(s) => format!("{s:.3}s"),
    }
}
