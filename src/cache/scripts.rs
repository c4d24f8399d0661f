//! The cache's Lua scripts, each with the one typed call that runs it: its keys and
//! arguments in the order the script reads them, and its reply as a type. The scripts
//! say what they do (see each `.lua` file); this module only speaks to them.
//!
//! Loaded once per process and sent by SHA (EVALSHA); redis-rs loads a script again when
//! Redis answers NOSCRIPT. Never put them in a pipeline: there, NOSCRIPT is not handled.

use std::sync::LazyLock;
use std::time::Duration;

use redis::{Script, Value};

use crate::keys::CacheKeys;
use crate::lease::{FencingToken, Lease, with_tokens};
use crate::notify::{Ending, Notice};
use crate::store::{Operation, RedisStore, Request, StoreError, StoreErrorKind, millis};

static READ: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_tokens(include_str!("scripts/read.lua"))));
static WRITE: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_variants(include_str!("scripts/write.lua"))));
static READ_PART: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/read_part.lua")));
static PARTS_WHOLE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/parts_whole.lua")));
static PART: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_tokens(include_str!("scripts/part.lua"))));
static DROP_PARTS: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_variants(include_str!("scripts/drop_parts.lua"))));
static REVALIDATE: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_variants(include_str!("scripts/revalidate.lua"))));
static PURGE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/purge.lua")));
static VARY: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/vary.lua")));
static INVALIDATE: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_variants(include_str!("scripts/invalidate.lua"))));

/// A script that writes or deletes the variants of a response, with the token helpers
/// (`tokens.lua`) and those of the list of variants (`variants.lua`: `list_variant`,
/// `holds_entry`, `drop_variants`).
fn with_variants(script: &str) -> String {
    with_tokens(&format!("{}{script}", include_str!("scripts/variants.lua")))
}

/// What `read.lua` found at an entry's key.
#[derive(Debug)]
pub(crate) enum ReadReply {
    /// Nothing, a tombstone, or an entry older than its response's invalidation; and
    /// the names the response varies on, if they were asked for and are kept.
    Miss { names: Option<String> },
    /// Something that is not an entry of ours (another type, a hash without data).
    NotOurs,
    /// An entry's encoding, its remaining TTL in milliseconds, the metadata that a
    /// `304` renewed it with, if one did, and the names the response varies on, if they
    /// were asked for and are kept.
    Entry {
        pttl: i64,
        data: Vec<u8>,
        meta: Option<Vec<u8>>,
        names: Option<String>,
    },
}

/// The most an entry moves in one read: a body of one part, and room for its headers.
const ENTRY_AT_MOST: usize = super::entry::PART + 64 * 1024;

/// Reads an entry (and with `names` the names its response varies on); the deadline
/// grows with `max_size`, what the entry may weigh, up to what an entry holds at most
/// (a body longer than a part is kept in parts beside it: [`ENTRY_AT_MOST`]).
pub(crate) async fn read(
    store: &RedisStore,
    keys: &CacheKeys,
    max_size: usize,
    names: bool,
) -> Result<ReadReply, StoreError> {
    let mut invocation = READ.prepare_invoke();
    invocation.key(keys.entry()).key(keys.invalidated_key());
    if names {
        invocation.key(keys.vary_key());
    }
    let value: Value = store
        .run_sized(
            Operation::Read,
            Request::Script(&invocation),
            max_size.min(ENTRY_AT_MOST),
        )
        .await?;
    let text = |bytes: Vec<u8>| String::from_utf8(bytes).ok();
    Ok(match value {
        // (Nil and false: what older versions of the script and RESP3 would send.)
        Value::Nil | Value::Boolean(false) => ReadReply::Miss { names: None },
        Value::Array(items) => {
            let mut items = items.into_iter();
            match (
                items.next(),
                items.next(),
                items.next(),
                items.next(),
                items.next(),
            ) {
                (None, ..) => ReadReply::Miss { names: None },
                (Some(Value::Int(-4)), Some(Value::BulkString(names)), None, ..) => {
                    ReadReply::Miss { names: text(names) }
                }
                (Some(Value::Int(pttl)), Some(Value::BulkString(data)), meta, names, None)
                    if pttl != -3 && pttl != -4 =>
                {
                    let meta = match meta {
                        None => None,
                        Some(Value::BulkString(meta)) if meta.is_empty() && names.is_some() => None,
                        Some(Value::BulkString(meta)) => Some(meta),
                        Some(_) => return Ok(ReadReply::NotOurs),
                    };
                    let names = match names {
                        None => None,
                        Some(Value::BulkString(names)) => text(names),
                        Some(_) => return Ok(ReadReply::NotOurs),
                    };
                    ReadReply::Entry {
                        pttl,
                        data,
                        meta,
                        names,
                    }
                }
                _ => ReadReply::NotOurs,
            }
        }
        _ => {
            return Err(StoreError::new(
                Operation::Read,
                StoreErrorKind::Response,
                None,
            ));
        }
    })
}

/// Keeps `names` with those kept for the response of `keys`, at most `most` in all, for
/// at least `keep` (see `vary.lua`).
pub(crate) async fn keep_names(
    store: &RedisStore,
    keys: &CacheKeys,
    names: &[&str],
    most: usize,
    keep: Duration,
) -> Result<(), StoreError> {
    let mut invocation = VARY.prepare_invoke();
    invocation
        .key(keys.vary_key())
        .arg(millis(keep.max(Duration::from_millis(1))))
        .arg(most);
    for name in names {
        invocation.arg(*name);
    }
    let _kept: i64 = store
        .run(Operation::Write, Request::Script(&invocation))
        .await?;
    Ok(())
}

/// Where the notices of a write go: that it wrote, on the key's interest channel (heard
/// by the instances that wait for the key); that its lease ended without a write, on
/// the broadcast channel (heard by every instance: it sets their marks).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Channels<'a> {
    pub(crate) filled: &'a str,
    pub(crate) broadcast: &'a str,
}

/// What `write.lua` did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteReply {
    pub(crate) written: bool,
    pub(crate) released: bool,
}

/// Writes part `index` of the body of the entry `keys` is about to get under `token`
/// (see `part.lua`), within the deadline of a write of its size: `false` when a higher
/// token was stored or issued.
pub(crate) async fn write_part(
    store: &RedisStore,
    keys: &CacheKeys,
    token: FencingToken,
    (index, part): (u32, Vec<u8>),
    keep: Duration,
) -> Result<bool, StoreError> {
    let size = part.len();
    let token = token.get();
    let mut invocation = PART.prepare_invoke();
    invocation
        .key(keys.entry())
        .key(keys.invalidated_key())
        .key(keys.lease().fence_key())
        .key(keys.part(token, index))
        .arg(token)
        .arg(part)
        .arg(millis(keep));
    let written: i64 = store
        .run_sized(Operation::Write, Request::Script(&invocation), size)
        .await?;
    Ok(written == 1)
}

/// Deletes the first `count` parts of generation `token` of the entry at `keys`, unless
/// the entry names that generation (see `drop_parts.lua`): whether they were deleted.
pub(crate) async fn drop_parts(
    store: &RedisStore,
    keys: &CacheKeys,
    token: FencingToken,
    count: u32,
) -> Result<bool, StoreError> {
    let mut invocation = DROP_PARTS.prepare_invoke();
    invocation.key(keys.entry()).arg(token.get()).arg(count);
    let dropped: i64 = store
        .run(Operation::Write, Request::Script(&invocation))
        .await?;
    Ok(dropped == 1)
}

/// Reads the part at `key` (see `cache::entry::part` and `read_part.lua`), within the
/// deadline of a read of `max_size` bytes, as the entry's own read; `None` when there is
/// none (or the key holds something else than a string).
pub(crate) async fn read_part(
    store: &RedisStore,
    key: &str,
    max_size: usize,
) -> Result<Option<Vec<u8>>, StoreError> {
    let mut invocation = READ_PART.prepare_invoke();
    invocation.key(key);
    let value: Value = store
        .run_sized(Operation::Read, Request::Script(&invocation), max_size)
        .await?;
    Ok(match value {
        Value::BulkString(bytes) => Some(bytes),
        _ => None,
    })
}

/// Whether each part at `keys` is whole: of the length `expected` gives it, opening
/// with the header it gives (see `parts_whole.lua`).
pub(crate) async fn parts_whole(
    store: &RedisStore,
    keys: &[String],
    expected: &[([u8; super::entry::PART_HEADER], usize)],
) -> Result<bool, StoreError> {
    let mut invocation = PARTS_WHOLE.prepare_invoke();
    for (key, (header, len)) in keys.iter().zip(expected) {
        invocation.key(key).arg(&header[..]).arg(*len);
    }
    let whole: i64 = store
        .run(Operation::Read, Request::Script(&invocation))
        .await?;
    Ok(whole == 1)
}

/// The fenced write of an `encoded` entry under `lease`, kept `keep`, with the release
/// of the lease and the notice of the write, on the key's interest channel (or of a
/// lease that ended without one, on the broadcast channel); `parts`, how many parts of
/// its body were written beside it under the same lease (0: the body is in it).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn write(
    store: &RedisStore,
    keys: &CacheKeys,
    lease: &Lease,
    encoded: Vec<u8>,
    parts: Named<'_>,
    keep: Duration,
    channels: Channels<'_>,
) -> Result<WriteReply, StoreError> {
    let size = encoded.len();
    let mut invocation = WRITE.prepare_invoke();
    invocation
        .key(keys.entry())
        .key(keys.lease().key())
        .key(keys.invalidated_key())
        .key(keys.lease().fence_key())
        .arg(lease.fencing_token().get())
        .arg(lease.owner().as_str())
        .arg(encoded)
        .arg(millis(keep))
        .arg(channels.filled)
        .arg(Notice::Filled(keys.entry(), Some(keys.local)).to_string())
        .arg(channels.broadcast)
        .arg(Notice::Ended(keys.entry(), Ending::Gone, Duration::ZERO).to_string())
        .arg(parts.count)
        .arg(parts.digest)
        .arg(millis(crate::cache::entry::PART_READ_AT_SLOWEST));
    list_variant(&mut invocation, keys);
    let (written, released, _measured_against): (i64, i64, i64) = store
        .run_sized(Operation::Write, Request::Script(&invocation), size)
        .await?;
    Ok(WriteReply {
        written: written == 1,
        released: released == 1,
    })
}

/// The parts a written entry names: how many (0: its body is in the entry), and the
/// digest of the body they hold, which a renewal by an unchanged body checks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Named<'a> {
    pub(crate) count: u32,
    pub(crate) digest: &'a [u8],
}

/// The entry a renewal renews: the token it was written under, and, for a renewal by a
/// body the origin sent again, that body's digest (empty for a `304`'s).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Revalidated<'a> {
    pub(crate) token: FencingToken,
    pub(crate) same_body: &'a [u8],
}

/// For a write or renewal of a variant: the list of its response's variants (the last
/// key) and its part of the key (the last argument), so that the script lists it.
fn list_variant(invocation: &mut redis::ScriptInvocation<'_>, keys: &CacheKeys) {
    if let Some(part) = keys.variant_part() {
        invocation.key(keys.variants_key()).arg(part);
    }
}

/// What `revalidate.lua` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// The entry's metadata was replaced; `released` if the lease still was the renewer's.
    Renewed { released: bool },
    /// A higher token was stored or issued: nothing written.
    Refused { released: bool },
    /// The entry that was revalidated is not there any more: nothing done, the lease
    /// kept for a whole write.
    Gone,
}

/// Renews the entry written under `revalidated` with `meta` (an encoded entry without a
/// body), kept `keep` from now, under `lease` (see `revalidate.lua`).
pub(crate) async fn revalidate(
    store: &RedisStore,
    keys: &CacheKeys,
    lease: &Lease,
    revalidated: Revalidated<'_>,
    meta: Vec<u8>,
    keep: Duration,
    channels: Channels<'_>,
) -> Result<Renewal, StoreError> {
    let mut invocation = REVALIDATE.prepare_invoke();
    invocation
        .key(keys.entry())
        .key(keys.lease().key())
        .key(keys.invalidated_key())
        .key(keys.lease().fence_key())
        .arg(lease.fencing_token().get())
        .arg(lease.owner().as_str())
        .arg(revalidated.token.get())
        .arg(meta)
        .arg(millis(keep))
        .arg(channels.filled)
        .arg(Notice::Filled(keys.entry(), Some(keys.local)).to_string())
        .arg(channels.broadcast)
        .arg(Notice::Ended(keys.entry(), Ending::Gone, Duration::ZERO).to_string())
        .arg(revalidated.same_body);
    list_variant(&mut invocation, keys);
    let (renewed, released, _measured_against): (i64, i64, i64) = store
        .run(Operation::Write, Request::Script(&invocation))
        .await?;
    let released = released == 1;
    Ok(match renewed {
        1 => Renewal::Renewed { released },
        -1 => Renewal::Gone,
        _ => Renewal::Refused { released },
    })
}

/// How long what an invalidation leaves lasts.
pub(crate) struct Lasting {
    /// The tombstone at the entry key.
    pub(crate) tombstone: Duration,
    /// The response's fence counter.
    pub(crate) counter: Duration,
    /// The invalidation's token (it hides the response's variants).
    pub(crate) token: Duration,
}

/// What `invalidate.lua` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Invalidated {
    /// Whether the response's own entry held an entry.
    pub(crate) existed: bool,
    /// The invalidation's token.
    pub(crate) token: FencingToken,
    /// How many entries it removed: the own entry and its variants that held one.
    pub(crate) entries: u64,
}

/// Invalidates the response of `keys` (the keys of its own entry) and every variant of
/// it (see `invalidate.lua`).
pub(crate) async fn invalidate(
    store: &RedisStore,
    keys: &CacheKeys,
    channel: &str,
    lasting: Lasting,
) -> Result<Invalidated, StoreError> {
    let mut invocation = INVALIDATE.prepare_invoke();
    invocation
        .key(keys.entry())
        .key(keys.lease().fence_key())
        .key(keys.invalidated_key())
        .key(keys.variants_key())
        .arg(channel)
        .arg(millis(lasting.tombstone))
        .arg(millis(lasting.counter))
        .arg(millis(lasting.token))
        // What the notice carries after the entry key (see `notify::Notice`).
        .arg(format!(" {}", keys.local));
    let (existed, token, entries): (i64, i64, i64) = store
        .run(Operation::Invalidate, Request::Script(&invocation))
        .await?;
    Ok(Invalidated {
        existed: existed == 1,
        token: FencingToken::new(token.max(1) as u64),
        entries: entries.max(0) as u64,
    })
}

/// Purges `ids` (tag ids), hard or soft, for the fleet (see `purge.lua`); records kept
/// for `retention`. Returns the purge's time on the server's clock, in µs.
pub(crate) async fn purge(
    store: &RedisStore,
    keys: &crate::keys::KeySpace,
    channel: &str,
    soft: bool,
    retention: Duration,
    ids: &[String],
) -> Result<u64, StoreError> {
    let mut invocation = PURGE.prepare_invoke();
    invocation
        .key(keys.purges_key())
        .key(keys.purges_by_time_key())
        .arg(if soft { "s" } else { "h" })
        .arg(channel)
        .arg(retention.as_micros() as u64);
    for id in ids {
        invocation.arg(id);
    }
    let at: i64 = store
        .run(Operation::Invalidate, Request::Script(&invocation))
        .await?;
    Ok(at.max(0) as u64)
}
