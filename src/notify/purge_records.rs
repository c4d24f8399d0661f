//! Reading the purge records back, by time, in batches.
//!
//! A purge (`purge.lua`) records each tag's purge twice, in one hash slot: in a hash
//! (field `{tag id}:h|s`, the time) and in a sorted set of the same fields scored by the
//! time, in µs of the server's clock. An instance whose subscription was down reads back
//! what was recorded since the last purge it knows of, from the sorted set, a batch at a
//! time: never the whole record, which a fleet that purges per product fills with a
//! hundred thousand tags in the three days a record matters.
//!
//! The first batch asks by score (`ZRANGEBYSCORE ... WITHSCORES LIMIT 0 1000`); each
//! next one starts at the last record read, found by its rank (`ZRANK`, then `ZRANGE`
//! by rank): a run of records with one score (every tag of one purge shares its time,
//! and a purge may name a hundred thousand tags) may span many batches, and a `LIMIT`
//! offset would walk the part of it already read, so that a batch deep into a long run
//! would take Redis longer than a command may. The batch must begin with that record,
//! at its score: if records before it went between the two commands, the batch is
//! asked again; if it moved (its tag was purged again, at a later time) or went, the
//! run is read again from its start. No record is skipped, and noting one twice changes
//! nothing.

use crate::store::{Operation, RedisStore, Request, StoreError};

/// How a purge ([`StampedeGuard::purge_tags`](crate::StampedeGuard::purge_tags)) treats
/// the entries it reaches.
///
/// A purge records, per tag, when it happened on the Redis server's clock (the clock
/// fencing tokens are issued from), and tells every instance; nothing is deleted and no
/// key is listed. Every read checks the entry's tags: an entry whose fill began before
/// a purge of one of them is gone (hard) or stale (soft). An instance whose
/// subscription was down reads back the purges recorded since the last one it knew of
/// when it comes up; until it has, entries with tags filled before then are stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Purge {
    /// Gone: not served, refilled by the next caller (once for the fleet).
    Hard,
    /// Stale: served while one caller in the fleet refreshes it.
    Soft,
}

impl Purge {
    /// The purge's name, as used in metric labels.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Hard => "hard",
            Self::Soft => "soft",
        }
    }
}

/// How many records one batch asks for. About 70 bytes each on the wire: a batch is
/// 70 KB, and a fraction of a millisecond of Redis's time, far inside any command
/// timeout.
pub(crate) const BATCH: usize = 1000;

/// One record read back: tag `id` (its 128 bits) purged `how`, at `at` µs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Recorded {
    pub(crate) id: u128,
    pub(crate) how: Purge,
    pub(crate) at: u64,
}

/// Where a read-back is: what the next batch asks for.
pub(crate) struct ReadBack {
    /// The sorted set of the records.
    key: String,
    /// The score (µs) the next batch starts at, inclusive: the last record's.
    from: u64,
    /// The last record read (its member), at score `from`.
    last: Option<String>,
    /// Whether the last batch reached the end.
    done: bool,
}

impl ReadBack {
    /// A read-back of the records at `key` scored from `since` µs on.
    pub(crate) fn new(key: String, since: u64) -> Self {
        Self {
            key,
            from: since,
            last: None,
            done: false,
        }
    }

    /// Reads the next batch, with commands that do not count against the breaker (see
    /// `RedisStore::run_aside`); `None` once every record was read. A failed batch
    /// changes nothing: call again to retry it. A batch may be empty (see above).
    pub(crate) async fn next(
        &mut self,
        store: &RedisStore,
    ) -> Result<Option<Vec<Recorded>>, StoreError> {
        if self.done {
            return Ok(None);
        }
        let reply = match self.last.take() {
            None => {
                let mut range = redis::cmd("ZRANGEBYSCORE");
                range
                    .arg(&self.key)
                    .arg(self.from)
                    .arg("+inf")
                    .arg("WITHSCORES")
                    .arg("LIMIT")
                    .arg(0)
                    .arg(BATCH);
                run::<Vec<(String, f64)>>(store, &range).await?
            }
            Some(last) => {
                let mut rank = redis::cmd("ZRANK");
                rank.arg(&self.key).arg(&last);
                // Gone (dropped as past its three days): read the run from its start.
                let Some(rank) = run::<Option<u64>>(store, &rank).await? else {
                    return Ok(Some(Vec::new()));
                };
                let mut range = redis::cmd("ZRANGE");
                range
                    .arg(&self.key)
                    .arg(rank)
                    .arg(rank + BATCH as u64)
                    .arg("WITHSCORES");
                let mut reply = run::<Vec<(String, f64)>>(store, &range).await?;
                match reply.first() {
                    Some((member, score)) if *member == last => {
                        // Moved to a later time: read the run from its start.
                        if *score as u64 != self.from {
                            return Ok(Some(Vec::new()));
                        }
                        reply.remove(0);
                    }
                    // Records before it went in between: ask again.
                    _ => {
                        self.last = Some(last);
                        return Ok(Some(Vec::new()));
                    }
                }
                reply
            }
        };
        let records = reply
            .iter()
            .filter_map(|(member, score)| parse(member, *score as u64))
            .collect();
        match reply.last() {
            Some((member, score)) => {
                self.from = *score as u64;
                self.last = Some(member.clone());
            }
            None => self.last = None,
        }
        self.done = reply.len() < BATCH;
        Ok(Some(records))
    }
}

/// Runs one command of a read-back, outside the breaker.
async fn run<T: redis::FromRedisValue>(
    store: &RedisStore,
    cmd: &redis::Cmd,
) -> Result<T, StoreError> {
    store
        .run_aside(Operation::Read, Request::Command(cmd))
        .await
}

/// A record from its member (`{tag id}:h` or `{tag id}:s`) and score; `None` for
/// anything else.
fn parse(member: &str, at: u64) -> Option<Recorded> {
    let (id, how) = member.rsplit_once(':')?;
    let how = match how {
        "h" => Purge::Hard,
        "s" => Purge::Soft,
        _ => return None,
    };
    Some(Recorded {
        id: crate::keys::tag_key(id)?,
        how,
        at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_read_and_garbage_is_left_out() {
        let id = "tag_0123456789abcdef0123456789abcdef";
        assert_eq!(
            parse(&format!("{id}:h"), 7),
            Some(Recorded {
                id: 0x0123456789abcdef0123456789abcdef,
                how: Purge::Hard,
                at: 7
            })
        );
        assert_eq!(parse(&format!("{id}:s"), 7).unwrap().how, Purge::Soft);
        for garbage in [
            "",
            "tag_0123:h",
            &format!("{id}:x"),
            &format!("{id}h"),
            "tag_0123456789abcdef0123456789abcdeg:h",
        ] {
            assert_eq!(parse(garbage, 1), None, "{garbage}");
        }
    }
}
