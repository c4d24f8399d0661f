//! The lease's Lua scripts, each with the one typed call that runs it: its keys and
//! arguments in the order the script reads them, and its reply as a type. The scripts
//! say what they do (see each `.lua` file); this module only speaks to them.
//!
//! Loaded once per process and sent by SHA (EVALSHA); redis-rs loads a script again when
//! Redis answers NOSCRIPT (after a restart or SCRIPT FLUSH). Never put them in a
//! pipeline: there, NOSCRIPT is not handled.

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Script, ScriptInvocation};

use super::outcome::FencingToken;
use crate::keys::{CacheKeys, LeaseName};
use crate::store::{Operation, RedisStore, Request, StoreError, StoreErrorKind, millis};

static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_tokens(include_str!("scripts/acquire.lua"))));
static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/renew.lua")));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/release.lua")));
static HOLD_OFF: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/hold_off.lua")));

/// A script that issues or compares fencing tokens, with the functions that do it
/// (`tokens.lua`: `next_token`, `sane_token`, `token_at`).
pub(crate) fn with_tokens(script: &str) -> String {
    format!("{}{script}", include_str!("scripts/tokens.lua"))
}

/// What a held-off lease holds (see `hold_off.lua`). Owner values start with a service
/// name, which cannot start with `~`: no owner value is ever equal to it.
pub(crate) const HELD_OFF: &str = "~held-off";

/// What `acquire.lua` answered.
#[derive(Debug)]
pub(crate) enum AcquireReply {
    /// The lease was taken, with this token.
    Taken(u64),
    /// Someone holds it (or it is held off), for `pttl` more milliseconds.
    Busy { pttl: i64, held_off: bool },
    /// For a fill: the entry was written since its caller looked; not taken.
    Written,
    /// Not a reply the script gives; `taken` when it says the lease was set.
    Odd { taken: bool },
}

/// For a fill's acquire: the entry it is for, and the token of what its caller found.
pub(crate) type ForFill<'a> = Option<(&'a CacheKeys, FencingToken)>;

/// Takes `name` for `owner` for `ttl`, its fence counter kept `retention`.
pub(crate) async fn acquire(
    store: &RedisStore,
    name: &LeaseName,
    owner: &str,
    ttl: Duration,
    retention: Duration,
    fill: ForFill<'_>,
) -> Result<AcquireReply, StoreError> {
    let mut invocation = ACQUIRE.prepare_invoke();
    invocation
        .key(name.key())
        .key(name.fence_key())
        .arg(owner)
        .arg(millis(ttl))
        .arg(millis(retention))
        .arg(HELD_OFF);
    if let Some((keys, seen)) = fill {
        invocation
            .key(keys.entry())
            .key(keys.invalidated_key())
            .key(keys.primary_fence_key())
            .arg(seen.get());
    }
    let reply: Vec<i64> = store
        .run(Operation::Acquire, Request::Script(&invocation))
        .await?;
    Ok(match reply.as_slice() {
        &[2, 0] if fill.is_some() => AcquireReply::Written,
        &[1, token] if token > 0 => AcquireReply::Taken(token as u64),
        &[0, pttl, held_off] => AcquireReply::Busy {
            pttl,
            held_off: held_off == 1,
        },
        other => AcquireReply::Odd {
            taken: other.first() == Some(&1),
        },
    })
}

/// Extends the lease at `key` to `ttl` if `owner` holds it.
pub(crate) async fn renew(
    store: &RedisStore,
    key: &str,
    owner: &str,
    ttl: Duration,
) -> Result<bool, StoreError> {
    let mut invocation = RENEW.prepare_invoke();
    invocation.key(key).arg(owner).arg(millis(ttl));
    owner_checked(store, Operation::Renew, &invocation).await
}

/// Deletes the lease at `key` if `owner` holds it.
pub(crate) async fn release(
    store: &RedisStore,
    key: &str,
    owner: &str,
) -> Result<bool, StoreError> {
    let mut invocation = RELEASE.prepare_invoke();
    invocation.key(key).arg(owner);
    owner_checked(store, Operation::Release, &invocation).await
}

/// Holds the lease at `key` off for `ttl`, owned by nobody, if `owner` holds it.
pub(crate) async fn hold_off(
    store: &RedisStore,
    key: &str,
    owner: &str,
    ttl: Duration,
) -> Result<bool, StoreError> {
    let mut invocation = HOLD_OFF.prepare_invoke();
    invocation
        .key(key)
        .arg(owner)
        .arg(millis(ttl))
        .arg(HELD_OFF);
    owner_checked(store, Operation::Release, &invocation).await
}

/// Runs an owner-checked script, which answers 1 (done) or 0 (not the owner).
async fn owner_checked(
    store: &RedisStore,
    operation: Operation,
    invocation: &ScriptInvocation<'_>,
) -> Result<bool, StoreError> {
    match store
        .run::<i64>(operation, Request::Script(invocation))
        .await?
    {
        1 => Ok(true),
        0 => Ok(false),
        _ => Err(StoreError::new(operation, StoreErrorKind::Response, None)),
    }
}
