//! Reading the purge records back, by time, in batches.
//!
//! A purge (`purge.lua`) records each tag's purge twice, in one hash slot: in a hash
//! (field `{tag id}:h|s`, the time) and in a sorted set of the same fields scored by the
//! time, in µs of the server's clock. An instance whose subscription was down reads back
//! what was recorded since the last purge it knows of, from the sorted set, a batch at a
//! time: never the whole record, which a fleet that purges per product fills with a
//! hundred thousand tags in the three days a record matters.
//!
//! Batches page by score, from the last score read, inclusive: a run of records with the
//! same score (every tag of one purge shares its time) may span batches, so the next
//! batch skips the part of the run already read (`LIMIT` offset) and starts with the
//! last record read, again. If that record is not where it was (a tag of the run was
//! purged again meanwhile, and moved to a later score), the run is read again from its
//! start: no record is skipped, and noting one twice changes nothing.

use crate::notify::Purge;
use crate::store::{Operation, RedisStore, Request, StoreError};

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
    /// The score (µs) the next batch starts at, inclusive.
    from: u64,
    /// How many records with score `from` were read (the run the last batch ended in),
    /// and the last of them (its member).
    run: usize,
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
            run: 0,
            last: None,
            done: false,
        }
    }

    /// Reads the next batch, with one command that does not count against the breaker
    /// (see [`RedisStore::run_aside`]); `None` once every record was read. A failed
    /// batch changes nothing: call again to retry it.
    pub(crate) async fn next(
        &mut self,
        store: &RedisStore,
    ) -> Result<Option<Vec<Recorded>>, StoreError> {
        if self.done {
            return Ok(None);
        }
        // Within a run: the part read less its last record, which comes first again.
        let (offset, count) = match self.run {
            0 => (0, BATCH),
            run => (run - 1, BATCH + 1),
        };
        let mut range = redis::cmd("ZRANGEBYSCORE");
        range
            .arg(&self.key)
            .arg(self.from)
            .arg("+inf")
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(offset)
            .arg(count);
        let reply: Vec<(String, f64)> = store
            .run_aside(Operation::Read, Request::Command(&range))
            .await?;
        let mut fresh = &reply[..];
        if self.run > 0 {
            match reply.first() {
                Some((member, score))
                    if Some(member) == self.last.as_ref() && *score as u64 == self.from =>
                {
                    fresh = &reply[1..];
                }
                // The run changed: read it again from its start.
                _ => {
                    self.run = 0;
                    self.last = None;
                    return Ok(Some(Vec::new()));
                }
            }
        }
        let mut records = Vec::with_capacity(fresh.len());
        for (member, score) in fresh {
            let at = *score as u64;
            if at == self.from {
                self.run += 1;
            } else {
                self.from = at;
                self.run = 1;
            }
            if let Some(record) = parse(member, at) {
                records.push(record);
            }
        }
        if let Some((member, _)) = fresh.last() {
            self.last = Some(member.clone());
        }
        self.done = reply.len() < count;
        Ok(Some(records))
    }
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
