//! The shared tier: Redis, one hash per entry (its writer's fencing token, its encoding,
//! and the newer metadata a `304` renewed it with) with the keep time as its TTL; read,
//! written under a lease and invalidated by the scripts beside it.
//!
//! A body larger than one part (`entry::PART`, 512 KiB) is kept beside its entry, in
//! parts of that size in the entry's hash slot, so that no command moves more than a
//! part: each part is written fenced by the writer's token (as the entry is), named by
//! that token (its generation), as soon as its bytes came from the origin (a cold fill
//! writes them while the body streams, `guard::complete`), and the entry is written
//! last, naming how many there are; parts of a fill that writes no entry after all are
//! deleted. A reader takes the parts of the generation its entry names, one at a time:
//! whole, for a body L1 may keep, or part by part as the answer streams (`cache::parts`:
//! a body L1 would not keep, or a range, which reads only the parts it spans). A part
//! that is missing (evicted, or deleted by an invalidation), short, of another
//! generation or garbage makes the read a miss ([`L2Read::Garbage`]), never a wrong
//! body. Parts expire a second after their entry, and go with it when an invalidation
//! removes it. When a newer entry replaces it, its parts linger for the answers that
//! are streaming them: long enough for a reader at
//! [`SLOWEST_READ_RATE`](entry::SLOWEST_READ_RATE), 256 KiB/s, to read them whole (2 s
//! a part and 10 s more: 42 s for 8 MiB, 266 s for 64 MiB), and two replaced
//! generations at most (the second replacement after them deletes them): Redis holds
//! at most three generations of a key's body, its own and two lingering, three times
//! its size (192 MiB at the largest `max_body`, 64 MiB). A refresh whose answer has the
//! same body (its digest, kept beside the parts) renews the entry and writes no part:
//! an unchanged body never replaces a generation.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;

use super::parts::InParts;
use super::scripts::{
    self, Channels, Invalidated, Lasting, Named, ReadReply, Renewal, Revalidated, WriteReply,
};
use super::stored::Stored;
use crate::cache::entry::{self, CachedResponse, PART, Parted};
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
/// takes to move (`max_size`, the route's body limit: the same slack its write gets);
/// a body kept in parts is read whole up to `whole_up_to` bytes, a longer one left in
/// Redis (see [`l2_read_with_names`]).
pub(crate) async fn l2_read(
    store: &RedisStore,
    keys: &CacheKeys,
    max_size: usize,
    whole_up_to: usize,
) -> Result<L2Read, StoreError> {
    let names = !keys.is_variant();
    Ok(
        l2_read_with_names(store, keys, max_size, names, whole_up_to)
            .await?
            .0,
    )
}

/// [`l2_read`], and with `names` the names of the headers the response varies on, as
/// kept beside its entries (see `guard::vary`), in the same round trip. A body kept in
/// parts is read whole up to `whole_up_to` bytes; a longer one is checked (see
/// [`InParts::check`]) and left in Redis, to be read part by part as it is answered
/// ([`Stored::in_parts`]).
pub(crate) async fn l2_read_with_names(
    store: &RedisStore,
    keys: &CacheKeys,
    max_size: usize,
    names: bool,
    whole_up_to: usize,
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
            Ok((mut response, parted)) => {
                let left = Duration::from_millis(pttl as u64);
                let age = response.keep.saturating_sub(left);
                let stored = match parted {
                    None => Stored::aged(response, age),
                    Some((parted, generation)) if parted.len as usize <= whole_up_to => {
                        match read_parts(store, keys, parted, generation, max_size).await? {
                            Some(body) => response.body = body,
                            None => return Ok((L2Read::Garbage("a part"), names)),
                        }
                        Stored::aged(response, age)
                    }
                    Some((parted, generation)) => {
                        let (store, keys) = (store.clone(), keys.clone());
                        let in_parts = InParts::new(store, keys, parted, generation, max_size);
                        if !in_parts.check().await? {
                            return Ok((L2Read::Garbage("a part"), names));
                        }
                        Stored::aged(response, age).reading_parts(in_parts)
                    }
                };
                (L2Read::Found(Arc::new(stored)), names)
            }
            Err(error) => (L2Read::Garbage(decode_reason(error)), names),
        },
    })
}

/// The body kept in `parted` parts of `generation`, read one part at a time, each
/// within the deadline of a read of `max_size` bytes (a slow link is not a timeout by
/// nature); `None` when a part is missing, or is not the one the entry names (see the
/// module docs).
async fn read_parts(
    store: &RedisStore,
    keys: &CacheKeys,
    parted: Parted,
    generation: FencingToken,
    max_size: usize,
) -> Result<Option<bytes::Bytes>, StoreError> {
    let mut body = BytesMut::with_capacity(parted.len as usize);
    for index in 0..parted.count {
        let key = keys.part(generation.get(), index);
        let Some(part) = scripts::read_part(store, &key, max_size).await? else {
            return Ok(None);
        };
        let len = parted.part_len(index);
        let Some(data) = entry::part_data(&part, generation, index, len) else {
            return Ok(None);
        };
        body.extend_from_slice(data);
    }
    Ok(Some(body.freeze()))
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
/// metadata (status, headers, times, token) with the body of the entry; and, when that
/// body is kept in parts, how many and their generation (the token it was written
/// under).
fn decode(
    data: &[u8],
    meta: Option<&[u8]>,
) -> Result<(CachedResponse, Option<(Parted, FencingToken)>), entry::DecodeError> {
    let (whole, parted) = entry::decode_head(data)?;
    let parted = parted.map(|parted| (parted, whole.token));
    match meta {
        None => Ok((whole, parted)),
        Some(meta) => Ok((
            CachedResponse {
                body: whole.body,
                ..entry::decode(meta)?
            },
            parted,
        )),
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

/// The fenced write of an entry under `lease` (see `scripts/write.lua`): its body's
/// parts first, if it is kept in parts (but the first `written`, which were written as
/// it streamed: [`l2_write_part`]), then the entry, which keeps the body's `digest`
/// ([`body_digest`]; empty for a body kept in the entry).
pub(crate) async fn l2_write(
    store: &RedisStore,
    keys: &CacheKeys,
    lease: &Lease,
    stored: &Stored,
    channels: Channels<'_>,
    written: u32,
    digest: &[u8],
) -> Result<WriteReply, StoreError> {
    let response = stored.to_response();
    // Kept for what is left of its keep time: an entry that came already aged (`Age`
    // from the origin) is read back as old as it is (its age is its keep time less
    // the key's TTL).
    let keep_left = stored.keep_left().max(Duration::from_millis(1));
    let parted = Parted::of(response.body.len());
    if let Some(parted) = parted {
        // The parts first, each fenced; a refused one means the entry's write is
        // refused too (it is fenced the same way), and says so.
        let token = lease.fencing_token();
        for index in written.min(parted.count)..parted.count {
            let start = index as usize * PART;
            let data = &response.body[start..start + parted.part_len(index)];
            if !l2_write_part(store, keys, token, (index, data), keep_left).await? {
                break;
            }
        }
    }
    scripts::write(
        store,
        keys,
        lease,
        response.encode_for_l2(parted),
        Named {
            count: parted.map_or(0, |p| p.count),
            digest,
        },
        keep_left,
        channels,
    )
    .await
}

/// The digest of a body kept in parts (SHA-256), which its entry keeps beside them: a
/// refresh whose answer has the same body renews the entry without writing its parts
/// again ([`l2_revalidate`] with it).
pub(crate) fn body_digest(body: &[u8]) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(body).to_vec()
}

/// Writes part `index` (its `data`) of the body of the entry about to be written under
/// `token`, kept `keep` (and a second more: [`PARTS_OUTLIVE`]): `false` when a higher
/// token was stored or issued (see `scripts/part.lua`).
pub(crate) async fn l2_write_part(
    store: &RedisStore,
    keys: &CacheKeys,
    token: FencingToken,
    (index, data): (u32, &[u8]),
    keep: Duration,
) -> Result<bool, StoreError> {
    let part = entry::part(token, index, data);
    scripts::write_part(store, keys, token, (index, part), keep + PARTS_OUTLIVE).await
}

/// Deletes the first `count` parts written under `token` for an entry that was not
/// written after all (its answer was cut, not stored, or its write refused), so that
/// they do not wait out their keep time; unless the entry names them (a write whose
/// reply was lost may have stored it: see `scripts/drop_parts.lua`).
pub(crate) async fn l2_drop_parts(
    store: &RedisStore,
    keys: &CacheKeys,
    token: FencingToken,
    count: u32,
) -> Result<(), StoreError> {
    if count == 0 {
        return Ok(());
    }
    scripts::drop_parts(store, keys, token, count)
        .await
        .map(|_| ())
}

/// How much longer than their entry its parts are kept: an entry never outlives them.
const PARTS_OUTLIVE: Duration = Duration::from_secs(1);

/// Renews the entry that `revalidated` was written under with `response`'s metadata,
/// under `lease`, without writing its body again (see `scripts/revalidate.lua`): for a
/// `304` (`same_body` empty), or for an answer whose body has the digest `same_body`, if
/// the entry's has it too ([`Renewal::Gone`] if not).
pub(crate) async fn l2_revalidate(
    store: &RedisStore,
    keys: &CacheKeys,
    lease: &Lease,
    revalidated: FencingToken,
    same_body: &[u8],
    response: &CachedResponse,
    channels: Channels<'_>,
) -> Result<Renewal, StoreError> {
    let meta = CachedResponse {
        body: bytes::Bytes::new(),
        ..response.clone()
    };
    let revalidated = Revalidated {
        token: revalidated,
        same_body,
    };
    scripts::revalidate(
        store,
        keys,
        lease,
        revalidated,
        meta.encode_for_l2(None),
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
