//! Lists the leases and entries of a service in Redis, safely.
//!
//! ```text
//! cargo run --example inspect -- --env local --service example-axum
//! cargo run --example inspect -- --env local --service example-axum --delete-lease KEY
//! cargo run --example inspect -- --env local --service example-axum --delete-lease KEY --yes
//! ```
//!
//! Uses `SCAN`, never `KEYS`. Shows TTLs, fencing tokens and who holds each lease
//! (service and instance, not the random part of the owner value). Deleting a lease can
//! break work in progress: the tool prints who holds it and deletes only with `--yes`.
//! `--redis URL` (or `REDIS_URL`, default `redis://127.0.0.1:6379`), `--prefix` (`sg`).
//! For a Redis Cluster, `--cluster URL` once per node to start from (one is enough):
//! every primary is scanned, each with its own cursor.

use std::process::ExitCode;

use stampede_guard::RedisStore;
use stampede_guard::inspect::{self, ItemKind};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut redis =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    let (mut prefix, mut env, mut service) = ("sg".to_owned(), None, None);
    let mut cluster: Vec<String> = Vec::new();
    let (mut delete, mut yes, mut limit) = (None, false, 1000usize);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_default();
        match arg.as_str() {
            "--redis" => redis = value(),
            "--cluster" => cluster.push(value()),
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
    let (Some(env), Some(service)) = (env, service) else {
        eprintln!("--env and --service are required");
        return ExitCode::from(2);
    };
    let builder = if cluster.is_empty() {
        RedisStore::builder(redis.as_str())
    } else {
        RedisStore::cluster(cluster)
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
