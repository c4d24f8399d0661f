//! Interest in fill notices, by bucket of keys: which of the key space's interest
//! channels this process listens to, and for how long.
//!
//! A fill notice matters only to an instance that waits for that key (a cold wait, a
//! refresh held off because another instance holds the lease): the others take the new
//! entry when their own copy goes stale. So fill notices do not go on the key space's
//! broadcast channel, which every instance hears, but on one of [`BUCKETS`] interest
//! channels, chosen by a hash of the entry key ([`bucket_of`], [`channel_of`]); an
//! instance listens to a bucket only while it waits for a key in it.
//!
//! [`Interests`] counts, per bucket, the waits that want it ([`Interest`], one per
//! wait or held-off refresh, given back when dropped). The subscription's task (see `notify`) subscribes the buckets
//! wanted, in batches, and confirms them here; it lets a bucket go only when nobody has
//! wanted it for [`LINGER`], so that a hot bucket is not subscribed and unsubscribed on
//! every wait; and it subscribes again, after a lost connection, the buckets still
//! wanted. At most [`MOST`] buckets are subscribed at once; a wait past that goes on
//! unheard, and looks for its entry itself.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, watch};

/// How many interest channels a key space has. Every version that publishes or listens
/// must agree on it, and on [`bucket_of`]: changing either is a change of wire format.
pub(crate) const BUCKETS: u32 = 4096;

/// How long a bucket nobody wants stays subscribed: a bucket wanted again within it
/// costs no `SUBSCRIBE`.
pub(crate) const LINGER: Duration = Duration::from_secs(1);

/// The most buckets subscribed at once.
pub(crate) const MOST: usize = 1024;

/// The bucket of an entry key: FNV-1a (32 bits) of its bytes, modulo [`BUCKETS`]. Fixed
/// here, not left to a hasher of the standard library, which may change between
/// versions: publisher and listener may be built apart.
pub(crate) fn bucket_of(entry_key: &str) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in entry_key.bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash % BUCKETS
}

/// The interest channel of a bucket: the broadcast channel's name, a colon and the
/// bucket in hex (so that an ACL that allows the key space's channels allows it).
pub(crate) fn channel_of(broadcast: &str, bucket: u32) -> String {
    format!("{broadcast}:{bucket:03x}")
}

/// Where a bucket's subscription stands on the current connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stand {
    /// Wanted, not asked for yet.
    Wanted,
    /// `SUBSCRIBE` sent, not confirmed yet.
    Asked,
    /// Confirmed: its notices reach this process.
    Subscribed,
}

/// One bucket this process wants, or did a moment ago.
#[derive(Debug)]
struct Bucket {
    /// Waits that want it now.
    waits: usize,
    /// Since when nobody has wanted it: it may go once this is [`LINGER`] past and
    /// `waits` is zero.
    last: Instant,
    stand: Stand,
}

/// The buckets of one process and where each stands: the table alone, without the
/// connection (the subscription's task acts on what it says).
#[derive(Debug)]
pub(crate) struct Buckets {
    map: HashMap<u32, Bucket>,
    /// Subscribed buckets let go to make room, to be unsubscribed.
    dropped: Vec<u32>,
    most: usize,
}

impl Buckets {
    /// A table of at most `most` buckets.
    pub(crate) fn new(most: usize) -> Self {
        Self {
            map: HashMap::new(),
            dropped: Vec::new(),
            most,
        }
    }

    /// The entry of `bucket`, made if there is room (one that nobody wants any more
    /// gives its place up). `None` when the table is full.
    fn entry(&mut self, bucket: u32, now: Instant) -> Option<&mut Bucket> {
        if !self.map.contains_key(&bucket) {
            if self.map.len() >= self.most {
                let free = self
                    .map
                    .iter()
                    .find(|(_, b)| b.waits == 0 && b.last <= now)
                    .map(|(bucket, b)| (*bucket, b.stand));
                let (gone, stand) = free?;
                self.map.remove(&gone);
                if stand != Stand::Wanted {
                    self.dropped.push(gone);
                }
            }
            self.map.insert(
                bucket,
                Bucket {
                    waits: 0,
                    last: now,
                    stand: Stand::Wanted,
                },
            );
        }
        self.map.get_mut(&bucket)
    }

    /// A wait wants `bucket`. Returns `None` when the table is full (the wait goes
    /// unheard), else whether the bucket still has to be subscribed.
    pub(crate) fn take(&mut self, bucket: u32, now: Instant) -> Option<bool> {
        let entry = self.entry(bucket, now)?;
        entry.waits += 1;
        Some(entry.stand == Stand::Wanted)
    }

    /// A wait of `bucket` ended.
    pub(crate) fn release(&mut self, bucket: u32, now: Instant) {
        if let Some(entry) = self.map.get_mut(&bucket) {
            entry.waits = entry.waits.saturating_sub(1);
            if entry.waits == 0 {
                entry.last = entry.last.max(now);
            }
        }
    }

    /// Whether the notices of `bucket` reach this process now.
    #[cfg(test)]
    pub(crate) fn is_subscribed(&self, bucket: u32) -> bool {
        self.standing(bucket) == Some(true)
    }

    /// Whether `bucket` is subscribed (`true`) or to be (`false`); `None` when the table
    /// does not hold it (let go, refused).
    fn standing(&self, bucket: u32) -> Option<bool> {
        self.map.get(&bucket).map(|b| b.stand == Stand::Subscribed)
    }

    /// Redis refused to subscribe `buckets` (an ACL that does not allow their
    /// channels): they leave the table, and their waits go on unheard.
    pub(crate) fn refused(&mut self, buckets: &[u32]) {
        for bucket in buckets {
            self.map.remove(bucket);
        }
    }

    /// The buckets to subscribe now; they count as asked for.
    pub(crate) fn take_wanted(&mut self) -> Vec<u32> {
        let mut asked = Vec::new();
        for (bucket, entry) in &mut self.map {
            if entry.stand == Stand::Wanted {
                entry.stand = Stand::Asked;
                asked.push(*bucket);
            }
        }
        asked
    }

    /// Redis confirmed the subscription of `buckets` (those let go meanwhile stay
    /// gone: their `UNSUBSCRIBE` comes after).
    pub(crate) fn subscribed(&mut self, buckets: &[u32]) {
        for bucket in buckets {
            if let Some(entry) = self.map.get_mut(bucket)
                && entry.stand == Stand::Asked
            {
                entry.stand = Stand::Subscribed;
            }
        }
    }

    /// The buckets to unsubscribe now: those nobody has wanted for [`LINGER`], and those
    /// let go to make room. They leave the table.
    pub(crate) fn take_idle(&mut self, now: Instant) -> Vec<u32> {
        let mut gone = std::mem::take(&mut self.dropped);
        self.map.retain(|bucket, entry| {
            let keep = entry.waits > 0 || now < entry.last + LINGER;
            if !keep && entry.stand != Stand::Wanted {
                gone.push(*bucket);
            }
            keep
        });
        gone
    }

    /// The connection was lost, and every subscription with it: the buckets still
    /// wanted are to be subscribed again, the others are forgotten.
    pub(crate) fn lost(&mut self) {
        self.dropped.clear();
        self.map.retain(|_, entry| {
            entry.stand = Stand::Wanted;
            entry.waits > 0
        });
    }

    /// How many buckets the table holds.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }
}

/// One process's interest in buckets, shared by its waits and its subscription's task.
pub(crate) struct Interests {
    table: Mutex<Buckets>,
    /// Wakes the subscription's task: a bucket is wanted.
    wanted: Notify,
    /// Moves on each confirmation (and each lost connection): waits look again.
    confirmed: watch::Sender<u64>,
}

impl Default for Interests {
    fn default() -> Self {
        Self {
            table: Mutex::new(Buckets::new(MOST)),
            wanted: Notify::new(),
            confirmed: watch::channel(0).0,
        }
    }
}

/// A wait's interest in its bucket; given back when dropped.
pub(crate) struct Interest {
    bucket: u32,
    interests: Arc<Interests>,
}

impl Drop for Interest {
    fn drop(&mut self) {
        self.interests.table().release(self.bucket, Instant::now());
    }
}

impl Interests {
    fn table(&self) -> std::sync::MutexGuard<'_, Buckets> {
        self.table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Wants `bucket` for as long as the returned interest lives; `None` when no more
    /// buckets may be subscribed.
    pub(crate) fn take(self: &Arc<Self>, bucket: u32) -> Option<Interest> {
        let asked = self.table().take(bucket, Instant::now())?;
        if asked {
            self.wanted.notify_one();
        }
        Some(Interest {
            bucket,
            interests: self.clone(),
        })
    }

    /// Whether the notices of `bucket` reach this process, waiting at most `within` for
    /// its subscription to be confirmed.
    pub(crate) async fn confirmed(&self, bucket: u32, within: Duration) -> bool {
        let mut moved = self.confirmed.subscribe();
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match self.table().standing(bucket) {
                Some(true) => return true,
                Some(false) => {}
                None => return false,
            }
            match tokio::time::timeout_at(deadline, moved.changed()).await {
                Ok(Ok(())) => {}
                _ => return false,
            }
        }
    }

    /// Resolves when a bucket is wanted that is not subscribed (for the subscription's
    /// task).
    pub(crate) async fn wanted(&self) {
        self.wanted.notified().await;
    }

    /// The buckets to subscribe now (see [`Buckets::take_wanted`]).
    pub(crate) fn take_wanted(&self) -> Vec<u32> {
        self.table().take_wanted()
    }

    /// Redis confirmed `buckets`: the waits that want them hear their notices now.
    pub(crate) fn subscribed(&self, buckets: &[u32]) {
        self.table().subscribed(buckets);
        self.confirmed.send_modify(|n| *n += 1);
    }

    /// Redis refused `buckets` (see [`Buckets::refused`]).
    pub(crate) fn refused(&self, buckets: &[u32]) {
        self.table().refused(buckets);
        self.confirmed.send_modify(|n| *n += 1);
    }

    /// The buckets to unsubscribe now (see [`Buckets::take_idle`]).
    pub(crate) fn take_idle(&self) -> Vec<u32> {
        self.table().take_idle(Instant::now())
    }

    /// The connection was lost (see [`Buckets::lost`]); the buckets still wanted are
    /// subscribed again as soon as it is back.
    pub(crate) fn lost(&self) {
        self.table().lost();
        self.confirmed.send_modify(|n| *n += 1);
        self.wanted.notify_one();
    }

    /// How many buckets are wanted or subscribed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.table().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_fixed_and_spread() {
        // Fixed: publishers and listeners of other builds must agree.
        assert_eq!(bucket_of(""), 0x811c_9dc5 % BUCKETS);
        assert_eq!(bucket_of("a"), 0xe40c_292c % BUCKETS);
        assert_eq!(
            channel_of("sg:prod:catalog:events", 10),
            "sg:prod:catalog:events:00a"
        );
        let mut seen = std::collections::HashSet::new();
        for n in 0..10_000 {
            seen.insert(bucket_of(&format!("sg:e:s:{{items:req_{n:x}}}:fill:entry")));
        }
        assert!(seen.len() > 3_500, "{} buckets of {BUCKETS}", seen.len());
    }

    /// Waits are counted per bucket; a bucket is subscribed once, confirmed, kept for
    /// [`LINGER`] after its last wait, and then let go once.
    #[test]
    fn a_bucket_lives_while_it_is_wanted_and_lingers() {
        let mut table = Buckets::new(8);
        let t0 = Instant::now();
        assert_eq!(table.take(1, t0), Some(true));
        assert_eq!(table.take(1, t0), Some(true), "not asked for yet");
        assert_eq!(table.take_wanted(), vec![1]);
        assert!(table.take_wanted().is_empty(), "asked once");
        assert_eq!(table.take(1, t0), Some(false), "asked: nothing more to do");
        assert!(!table.is_subscribed(1));
        table.subscribed(&[1]);
        assert!(table.is_subscribed(1));
        // Three waits; two end: still wanted.
        table.release(1, t0);
        table.release(1, t0);
        assert!(table.take_idle(t0 + LINGER * 2).is_empty());
        // The last ends: kept for LINGER, then let go once.
        let t1 = t0 + Duration::from_millis(10);
        table.release(1, t1);
        assert!(table.take_idle(t1).is_empty());
        assert!(table.take_idle(t1 + LINGER / 2).is_empty());
        assert!(table.is_subscribed(1), "lingering");
        // Wanted again within LINGER: no SUBSCRIBE.
        assert_eq!(table.take(1, t1 + LINGER / 2), Some(false));
        table.release(1, t1 + LINGER / 2);
        assert!(table.take_idle(t1 + LINGER).is_empty());
        assert_eq!(table.take_idle(t1 + LINGER * 2), vec![1]);
        assert!(table.take_idle(t1 + LINGER * 3).is_empty());
        assert_eq!(table.len(), 0);
        assert!(!table.is_subscribed(1));
        // A release of a bucket the table no longer holds changes nothing.
        table.release(1, t1);
        assert_eq!(table.len(), 0);
    }

    /// A lost connection forgets what nobody wants and asks again for the rest.
    #[test]
    fn a_lost_connection_resubscribes_what_is_wanted() {
        let mut table = Buckets::new(8);
        let t0 = Instant::now();
        table.take(1, t0);
        table.take(2, t0);
        table.take(3, t0);
        table.take_wanted();
        table.subscribed(&[1, 2, 3]);
        table.release(2, t0);
        table.lost();
        assert!(!table.is_subscribed(1));
        let mut again = table.take_wanted();
        again.sort_unstable();
        assert_eq!(again, vec![1, 3], "2 was wanted by nobody");
        // A confirmation of buckets asked on the lost connection is no confirmation.
        table.lost();
        table.subscribed(&[1, 3]);
        assert!(!table.is_subscribed(1));
    }

    /// The table holds at most `most` buckets: one that nobody wants gives its place up
    /// (and is unsubscribed); when all are wanted, a new bucket is refused.
    #[test]
    fn the_table_is_bounded() {
        let mut table = Buckets::new(2);
        let t0 = Instant::now();
        assert_eq!(table.take(1, t0), Some(true));
        assert_eq!(table.take(2, t0), Some(true));
        table.take_wanted();
        table.subscribed(&[1, 2]);
        assert_eq!(table.take(3, t0), None, "full of wanted buckets");
        table.release(1, t0);
        assert_eq!(table.take(3, t0), Some(true), "1 gave its place up");
        assert_eq!(table.len(), 2);
        assert!(!table.is_subscribed(1));
        assert_eq!(table.take_idle(t0), vec![1], "unsubscribed at once");
        assert_eq!(table.take_wanted(), vec![3]);
    }

    #[tokio::test]
    async fn waits_are_confirmed_or_go_on_without() {
        let interests = Arc::new(Interests::default());
        let interest = interests.take(7).unwrap();
        assert!(!interests.confirmed(7, Duration::from_millis(20)).await);
        let waiting = tokio::spawn({
            let interests = interests.clone();
            async move { interests.confirmed(7, Duration::from_secs(30)).await }
        });
        tokio::time::timeout(Duration::from_secs(5), interests.wanted())
            .await
            .expect("the task was told");
        assert_eq!(interests.take_wanted(), vec![7]);
        interests.subscribed(&[7]);
        assert!(waiting.await.unwrap());
        drop(interest);
        assert_eq!(interests.len(), 1, "lingering");
    }
}
