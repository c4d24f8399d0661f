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
