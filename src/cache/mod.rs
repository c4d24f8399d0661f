//! The two tiers: L1, a moka cache in each process, and L2, Redis, shared by the fleet.
//!
//! Both hold the same [`CachedResponse`]. L1 weighs entries by their size in bytes and
//! drops each at the end of its keep time; L2 stores each entry as a Redis hash of its
//! writer's fencing token and its encoding, with the keep time as its TTL, so that Redis
//! itself ages entries and no machine's wall clock is consulted.
//!
//! Writes to both are fenced: an entry replaces another only if its token is not lower.

use std::sync::Arc;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::ops::compute::{CompResult, Op};
use moka::sync::Cache;
use redis::{Script, Value};

use crate::entry::{self, CachedResponse};
use crate::keys::CacheKeys;
use crate::lease::{FencingToken, Lease};
use crate::store::{Operation, RedisStore, Request, StoreError, StoreErrorKind};

static READ: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/read.lua")));
static WRITE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("scripts/write.lua")));
static INVALIDATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&crate::lease::with_next_token(include_str!(
        "scripts/invalidate.lua"
    )))
});

/// A cached response, and its age: how old it was when this process got it, and when
/// that was on this process's monotonic clock.
#[derive(Debug)]
pub(crate) struct Stored {
    pub(crate) response: CachedResponse,
    got_at: Instant,
    age_when_got: Duration,
}

/// Where an entry is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Freshness {
    /// Serve it.
    Fresh,
    /// Serve it and refresh it.
    Stale,
    /// Past its grace: serve it only when the origin fails.
    Expired,
}

impl Stored {
    /// An entry that is `age` old now.
    pub(crate) fn aged(response: CachedResponse, age: Duration) -> Self {
        Self {
            response,
            got_at: Instant::now(),
            age_when_got: age,
        }
    }

    pub(crate) fn age(&self) -> Duration {
        self.age_when_got + self.got_at.elapsed()
    }

    pub(crate) fn freshness(&self) -> Freshness {
        let age = self.age();
        let r = &self.response;
        if age < r.fresh_for {
            Freshness::Fresh
        } else if age < r.fresh_for + r.grace {
            Freshness::Stale
        } else {
            Freshness::Expired
        }
    }

    /// Whether it may stand in for an origin that failed.
    pub(crate) fn serves_on_error(&self, stale_if_error: Duration) -> bool {
        let age = self.age();
        age < self.response.fresh_for + stale_if_error.max(self.response.grace)
            && age < self.response.keep
    }

    fn expires_at(&self) -> Instant {
        self.got_at + self.response.keep.saturating_sub(self.age_when_got)
    }
}

/// The local tier.
pub(crate) type L1 = Cache<Arc<str>, Arc<Stored>>;

struct UntilKept;

impl Expiry<Arc<str>, Arc<Stored>> for UntilKept {
    fn expire_after_create(
        &self,
        _key: &Arc<str>,
        value: &Arc<Stored>,
        created_at: Instant,
    ) -> Option<Duration> {
        Some(value.expires_at().saturating_duration_since(created_at))
    }

    fn expire_after_update(
        &self,
        _key: &Arc<str>,
        value: &Arc<Stored>,
        updated_at: Instant,
        _duration_until_expiry: Option<Duration>,
    ) -> Option<Duration> {
        Some(value.expires_at().saturating_duration_since(updated_at))
    }
}

/// An L1 cache holding at most `capacity` bytes of entries.
pub(crate) fn new_l1(capacity: u64) -> L1 {
    Cache::builder()
        .max_capacity(capacity)
        .weigher(|key: &Arc<str>, value: &Arc<Stored>| {
            u32::try_from(key.len() + value.response.weight()).unwrap_or(u32::MAX)
        })
        .expire_after(UntilKept)
        .build()
}

/// Tokens of recent invalidations, per entry key: L1 refuses entries older than them
/// (read from L2, or filled, before the invalidation but put after it).
pub(crate) type Tombstones = Cache<Arc<str>, FencingToken>;

pub(crate) fn new_tombstones() -> Tombstones {
    Cache::builder()
        .max_capacity(100_000)
        // Longer than any fill can take (the watchdog's maximum is an hour at most).
        .time_to_live(Duration::from_secs(3600))
        .build()
}

/// Puts an entry in L1 unless an entry with a higher token is there, or the key was
/// invalidated after the entry was made. Returns whether it was put.
///
/// L1 is moka's synchronous cache: its operations do not wait, so the request path can
/// answer a hit without an `await` (and without allocating a future).
pub(crate) fn l1_put(l1: &L1, tombstones: &Tombstones, key: Arc<str>, stored: Arc<Stored>) -> bool {
    let refused = |tombstones: &Tombstones| {
        tombstones
            .get(&key)
            .is_some_and(|tomb| stored.response.token < tomb)
    };
    if refused(tombstones) {
        return false;
    }
    let result = l1.entry(key.clone()).and_compute_with(|existing| {
        match existing {
            Some(e) if e.value().response.token > stored.response.token => Op::Nop,
            // Again, under the entry's lock: an invalidation may have come since.
            _ if refused(tombstones) => Op::Nop,
            _ => Op::Put(stored.clone()),
        }
    });
    matches!(
        result,
        CompResult::Inserted(_) | CompResult::ReplacedWith(_)
    )
}

/// What L2 has at a key.
#[derive(Debug)]
pub(crate) enum L2Read {
    Miss,
    Found(Arc<Stored>),
    /// Something that is not a valid entry of ours: a miss, counted.
    Garbage(&'static str),
}

/// Reads an entry, within the command timeout (reads are on the request path: they get
/// no slack for size; an entry too large to read in time is a miss).
pub(crate) async fn l2_read(
    store: &RedisStore,
    key: &str,
    _max_size: usize,
) -> Result<L2Read, StoreError> {
    let mut invocation = READ.prepare_invoke();
    invocation.key(key);
    let value: Value = store
        .run(Operation::Read, Request::Script(&invocation))
        .await?;
    Ok(match value {
        // (Nil and false: what older versions of the script and RESP3 would send.)
        Value::Nil | Value::Boolean(false) => L2Read::Miss,
        Value::Array(items) if items.is_empty() => L2Read::Miss,
        Value::Array(items) => match items.as_slice() {
            [Value::Int(pttl), Value::BulkString(data)] => {
                if *pttl < 0 {
                    L2Read::Garbage("no ttl")
                } else {
                    match entry::decode(data) {
                        Ok(response) => {
                            let left = Duration::from_millis(*pttl as u64);
                            let age = response.keep.saturating_sub(left);
                            L2Read::Found(Arc::new(Stored::aged(response, age)))
                        }
                        Err(error) => L2Read::Garbage(decode_reason(error)),
                    }
                }
            }
            _ => L2Read::Garbage("not an entry"),
        },
        _ => {
            return Err(StoreError::new(
                Operation::Read,
                StoreErrorKind::Response,
                None,
            ));
        }
    })
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

/// What the fenced write did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteOutcome {
    pub(crate) written: bool,
    pub(crate) released: bool,
}

pub(crate) async fn l2_write(
    store: &RedisStore,
    keys: &CacheKeys,
    lease: &Lease,
    response: &CachedResponse,
    channel: &str,
) -> Result<WriteOutcome, StoreError> {
    let encoded = response.encode();
    let size = encoded.len();
    let mut invocation = WRITE.prepare_invoke();
    invocation
        .key(keys.entry())
        .key(keys.lease().key())
        .key(keys.invalidated_key())
        .arg(lease.fencing_token().get())
        .arg(lease.owner().as_str())
        .arg(encoded)
        .arg(u64::try_from(response.keep.as_millis()).unwrap_or(u64::MAX))
        .arg(channel)
        .arg(filled_notice(keys.entry()));
    let (written, released, _stored): (i64, i64, i64) = store
        .run_sized(Operation::Write, Request::Script(&invocation), size)
        .await?;
    Ok(WriteOutcome {
        written: written == 1,
        released: released == 1,
    })
}

/// Replaces an entry by a tombstone for everyone (see the script). Returns whether an
/// entry was there, and the tombstone's token.
pub(crate) async fn l2_invalidate(
    store: &RedisStore,
    keys: &CacheKeys,
    channel: &str,
    tombstone_for: Duration,
) -> Result<(bool, FencingToken), StoreError> {
    let mut invocation = INVALIDATE.prepare_invoke();
    invocation
        .key(keys.entry())
        .key(keys.lease().fence_key())
        .key(keys.invalidated_key())
        .arg(channel)
        .arg(millis(tombstone_for))
        .arg(millis(
            crate::lease::DEFAULT_FENCE_RETENTION.max(tombstone_for),
        ));
    let (existed, token): (i64, i64) = store
        .run(Operation::Invalidate, Request::Script(&invocation))
        .await?;
    Ok((existed == 1, FencingToken::new(token.max(1) as u64)))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// What instances tell each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Notice {
    Filled,
    Invalidated,
}

/// The notice of a fill (`f {key}`). Invalidation notices (`i {token} {key}`) are
/// written by the invalidation script itself.
pub(crate) fn filled_notice(key: &str) -> String {
    format!("f {key}")
}

/// A notice: what happened, to which entry key, and for an invalidation the token of its
/// tombstone.
pub(crate) fn parse_notice(payload: &[u8]) -> Option<(Notice, &str, Option<FencingToken>)> {
    let text = std::str::from_utf8(payload).ok()?;
    let (kind, rest) = text.split_once(' ')?;
    match kind {
        "f" => Some((Notice::Filled, rest, None)),
        "i" => {
            let (token, key) = rest.split_once(' ')?;
            let token = token.parse().ok().map(FencingToken::new)?;
            Some((Notice::Invalidated, key, Some(token)))
        }
        _ => None,
    }
}
