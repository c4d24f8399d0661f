//! The shared tier: Redis, one hash per entry (its writer's fencing token, its encoding,
//! and the newer metadata a `304` renewed it with) with the keep time as its TTL; read, written under a lease and invalidated
//! by the scripts beside it.

use std::sync::Arc;
use std::time::Duration;

use super::scripts::{self, Channels, Invalidated, Lasting, ReadReply, Renewal, WriteReply};
use super::stored::Stored;
use crate::cache::entry::{self, CachedResponse};
use crate::keys::CacheKeys;
use crate::lease::{FencingToken, Lease};
use crate::store::{RedisStore, StoreError};

/// What L2 has at a key.
#[derive(Debug)]
pub(crate) enum L2Read {
    Miss,
    Found(Arc<Stored>),
    /// Something that is not a valid entry of ours: a miss, counted.
    Garbage(&'static str),
}

/// Reads an entry, within the command timeout plus the time its largest possible size
/// takes to move (`max_size`, the route's body limit: the same slack its write gets).
pub(crate) async fn l2_read(
    store: &RedisStore,
    keys: &CacheKeys,
    max_size: usize,
) -> Result<L2Read, StoreError> {
    Ok(
        l2_read_with_names(store, keys, max_size, !keys.is_variant())
            .await?
            .0,
    )
}

/// [`l2_read`], and with `names` the names of the headers the response varies on, as
/// kept beside its entries (see `guard::vary`), in the same round trip.
pub(crate) async fn l2_read_with_names(
    store: &RedisStore,
    keys: &CacheKeys,
    max_size: usize,
    names: bool,
) -> Result<(L2Read, Option<String>), StoreError> {
    let reply = scripts::read(store, keys, max_size, names).await?;
    Ok(match reply {
        ReadReply::Miss { names } => (L2Read::Miss, names),
        ReadReply::NotOurs => (L2Read::Garbage("not an entry"), None),
        ReadReply::Entry { pttl, names, .. } if pttl < 0 => (L2Read::Garbage("no ttl"), names),
        ReadReply::Entry {
            pttl,
            data,
            meta,
            names,
        } => match decode(&data, meta.as_deref()) {
            Ok(response) => {
                let left = Duration::from_millis(pttl as u64);
                let age = response.keep.saturating_sub(left);
                (L2Read::Found(Arc::new(Stored::aged(response, age))), names)
            }
            Err(error) => (L2Read::Garbage(decode_reason(error)), names),
        },
    })
}

/// Keeps `names` as what the response of `keys` varies on, with what was kept already
/// (at most `most` in all), for at least `keep` (see `scripts/vary.lua`).
pub(crate) async fn l2_keep_names(
    store: &RedisStore,
    keys: &CacheKeys,
    names: &[&str],
    most: usize,
    keep: Duration,
) -> Result<(), StoreError> {
    scripts::keep_names(store, keys, names, most, keep).await
}

/// An entry from its encoding, and the metadata a `304` renewed it with if any: that
/// metadata (status, headers, times, token) with the body of the entry.
fn decode(data: &[u8], meta: Option<&[u8]>) -> Result<CachedResponse, entry::DecodeError> {
    let whole = entry::decode(data)?;
    match meta {
        None => Ok(whole),
        Some(meta) => Ok(CachedResponse {
            body: whole.body,
            ..entry::decode(meta)?
        }),
    }
}

fn decode_reason(error: entry::DecodeError) -> &'static str {
    match error {
        entry::DecodeError::NotAnEntry => "not an entry",
        entry::DecodeError::Version(_) => "version",
        entry::DecodeError::TooLarge => "too large",
        entry::DecodeError::Malformed => "malformed",
        entry::DecodeError::Invalid(_) => "invalid",
    }
}

/// The fenced write of an entry under `lease` (see `scripts/write.lua`).
pub(crate) async fn l2_write(
    store: &RedisStore,
    keys: &CacheKeys,
    lease: &Lease,
    stored: &Stored,
    channels: Channels<'_>,
) -> Result<WriteReply, StoreError> {
    let response = stored.to_response();
    // Kept for what is left of its keep time: an entry that came already aged (`Age`
    // from the origin) is read back as old as it is (its age is its keep time less
    // the key's TTL).
    let keep_left = stored.keep_left().max(Duration::from_millis(1));
    scripts::write(
        store,
        keys,
        lease,
        response.encode_for_l2(),
        keep_left,
        channels,
    )
    .await
}

/// Renews the entry that `revalidated` was written under with `response`'s metadata,
/// under `lease`, without writing its body again (see `scripts/revalidate.lua`).
pub(crate) async fn l2_revalidate(
    store: &RedisStore,
    keys: &CacheKeys,
    lease: &Lease,
    revalidated: FencingToken,
    response: &CachedResponse,
    channels: Channels<'_>,
) -> Result<Renewal, StoreError> {
    let meta = CachedResponse {
        body: bytes::Bytes::new(),
        ..response.clone()
    };
    scripts::revalidate(
        store,
        keys,
        lease,
        revalidated,
        meta.encode_for_l2(),
        response.keep,
        channels,
    )
    .await
}

/// Replaces a response's own entry (`keys`) by a tombstone and deletes the variants
/// listed beside it, for everyone (see the script). Returns whether the own entry was
/// there, the tombstone's token and how many entries were removed. `tombstone_for` is
/// how long a fill can take; `entries_live` the longest an entry of the route may live:
/// the invalidation's token outlives every variant it hides.
pub(crate) async fn l2_invalidate(
    store: &RedisStore,
    keys: &CacheKeys,
    channel: &str,
    tombstone_for: Duration,
    entries_live: Duration,
) -> Result<Invalidated, StoreError> {
    let counter = crate::lease::DEFAULT_FENCE_RETENTION.max(tombstone_for);
    let lasting = Lasting {
        tombstone: tombstone_for,
        counter,
        token: counter.max(entries_live),
    };
    scripts::invalidate(store, keys, channel, lasting).await
}
