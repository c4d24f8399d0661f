//! An origin's answer that may be stored, read: its body frame by frame into a
//! [`stream`](super::stream) (that the callers of a cold fill follow as it comes), each
//! part of it written to Redis as soon as its bytes came (under the fill's lease), with
//! an idle timeout between frames rather than a total; and how that reading ended
//! ([`Read`]), mapped once to how the fill ends ([`BodyEnd`]), for a cold fill
//! (`complete`) and a refresh (`refresh`) alike. One path from the origin's body to the
//! entry for both.

use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body_util::BodyExt;

use super::body::BoxError;
use super::inflight::Failure;
use super::origin::OriginBody;
use super::route::Route;
use super::stream::{Room, Stream, Writer};
use crate::cache::{PART, Parted, l2_drop_parts, l2_write_part};
use crate::http::directives::lifetimes;
use crate::lease::{FencingToken, LeaseLost};
use crate::metrics::Event;

/// How the reading of a body ended.
pub(crate) enum Read<E> {
    Whole,
    /// Its last frame was trailers: the body is whole, but not stored (trailers are
    /// not kept, nor passed on to the callers that share it).
    Trailers,
    Failed(E),
    /// It ended before the length its `Content-Length` declared.
    Short,
    /// No frame for the refresh timeout.
    Stalled,
    /// The watchdog stopped the fill.
    Stopped(LeaseLost),
    /// The reader stopped reading: the body grew past what it wanted (see
    /// [`read_body`]).
    Abandoned,
    /// Nobody read the stream of an answer that will not be stored, nor waited to
    /// (see `stream`): the reading stopped.
    Deserted,
}

/// How a fill's body ended, for the fill: what cold fills and refreshes alike end on
/// (see [`ended`]).
#[derive(Debug)]
pub(crate) enum BodyEnd {
    /// Read to its end; not stored when it ended with `trailers`.
    Whole { trailers: bool },
    /// Cut by the origin: failed mid-way or ended short of its declared length
    /// ([`Failure::Error`]), or no frame for the refresh timeout ([`Failure::Timeout`]).
    Cut(Failure),
    /// The watchdog stopped the fill.
    Stopped(LeaseLost),
    /// Let go by the fill: it grew past what the fill wanted (`deserted: false`), or
    /// nobody reads the stream of an answer that will not be stored.
    LetGo { deserted: bool },
}

/// The one mapping from how a body's reading ended to how its fill ends; what the
/// origin did wrong is counted (an origin error, an origin timeout) and logged here.
pub(crate) fn ended<E: Into<BoxError>>(route: &Route, read: Read<E>) -> BodyEnd {
    match read {
        Read::Whole => BodyEnd::Whole { trailers: false },
        Read::Trailers => BodyEnd::Whole { trailers: true },
        Read::Failed(error) => {
            route.stats.record(Event::OriginError);
            let error: BoxError = error.into();
            tracing::debug!(%error, "the origin's body failed mid-way: cut for every reader");
            BodyEnd::Cut(Failure::Error)
        }
        Read::Short => {
            route.stats.record(Event::OriginError);
            tracing::debug!("the origin's body ended before its declared length: cut");
            BodyEnd::Cut(Failure::Error)
        }
        Read::Stalled => {
            route.stats.record(Event::OriginTimeout);
            BodyEnd::Cut(Failure::Timeout)
        }
        Read::Stopped(lost) => BodyEnd::Stopped(lost),
        Read::Abandoned => BodyEnd::LetGo { deserted: false },
        Read::Deserted => BodyEnd::LetGo { deserted: true },
    }
}

/// Reads `body` into `writer`'s stream until it ends (`declared`: the length its head
/// declared, if any: a body that ends short of it is cut), writing each part that came
/// while the answer may be stored (`parts`), and telling `grew` the stream's length
/// after each frame (when it answers `false`, the reading stops: [`Read::Abandoned`]).
/// No frame for the route's refresh timeout is a stall.
///
/// The stream holds the whole body up to `hold` bytes; past it (or from the start, when
/// the writer is bounded already) only a window, read in step with its readers, a
/// reader that holds it back for the refresh timeout dropped from it, and the reading
/// stopped when nobody reads it ([`Read::Deserted`]; see `stream`).
pub(crate) async fn read_body<B: OriginBody>(
    route: &Route,
    body: B,
    declared: Option<u64>,
    writer: &mut Writer,
    parts: &mut Option<Parts>,
    hold: u64,
    mut grew: impl FnMut(u64) -> bool,
) -> Read<B::Error> {
    let idle = route.policy.refresh_timeout;
    let stream = writer.stream().clone();
    let mut body = std::pin::pin!(body);
    let dropped = |readers: usize| {
        for _ in 0..readers {
            route.stats.record(Event::FillReaderDropped);
        }
    };
    let mut over_memory = false;
    loop {
        if writer.room(idle, dropped).await == Room::Deserted {
            return Read::Deserted;
        }
        let frame = tokio::select! {
            biased;
            frame = tokio::time::timeout(idle, body.frame()) => frame,
            () = writer.deserted() => return Read::Deserted,
        };
        let Ok(frame) = frame else {
            return Read::Stalled;
        };
        let data: Bytes = match frame {
            // Shorter than it said: cut, not whole.
            None if declared.is_some_and(|d| d != stream.len()) => return Read::Short,
            None => return Read::Whole,
            Some(Err(error)) => return Read::Failed(error),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                // Trailers end a body.
                Err(_) => return Read::Trailers,
            },
        };
        writer.push(data);
        if !over_memory && stream.over_memory() {
            route.stats.record(Event::FillOverMemory);
            over_memory = true;
        }
        if !grew(stream.len()) {
            return Read::Abandoned;
        }
        if stream.len() > hold {
            writer.bound();
        }
        if let Some(parts) = parts {
            parts.write_ready(route, &stream).await;
        }
    }
}

/// The parts of a body written to Redis as it streams, under the fill's lease (see
/// `cache::l2`): each as soon as its bytes came, while the answer may be stored. The
/// fill's write then writes only those left, and the entry; when the answer is not
/// written after all, they are deleted.
pub(crate) struct Parts {
    keys: crate::keys::CacheKeys,
    token: FencingToken,
    /// What is left of the entry's keep time, as its head says.
    keep: Duration,
    written: u32,
    /// A part was refused (a newer token: the entry's write will be too) or failed:
    /// the fill's write writes them all again, or nothing.
    stopped: bool,
}

impl Parts {
    /// The parts of `head`'s body, for a fill of `keys` under the lease whose token is
    /// `leased` (if it has one), of an answer that may be stored (`storing`).
    pub(crate) fn of(
        route: &Route,
        keys: &crate::keys::CacheKeys,
        leased: Option<FencingToken>,
        head: &Response<()>,
        storing: bool,
    ) -> Option<Self> {
        let token = leased.filter(|_| storing)?;
        let policy = &route.policy;
        let life = lifetimes(policy, head.headers(), policy.fresh_ttl);
        Some(Self {
            keys: keys.clone(),
            token,
            keep: life.keep.saturating_sub(life.age),
            written: 0,
            stopped: false,
        })
    }

    /// Writes every part whose bytes came, and a byte past it (a body of exactly one
    /// part is kept whole in its entry, not in parts: see `entry::Parted`), while the
    /// body fits the route's limit.
    pub(crate) async fn write_ready(&mut self, route: &Route, stream: &Stream) {
        let max = route.policy.max_body;
        while !self.stopped {
            let end = (self.written as u64 + 1) * PART as u64;
            let len = stream.len();
            if len <= end || len > max as u64 {
                return;
            }
            let data = stream.slice(end - PART as u64, end);
            if data.len() != PART {
                // (Let go of already: past the fill memory, it will not be stored.)
                self.stopped = true;
                return;
            }
            let part = (self.written, &data[..]);
            let store = &route.shared.store;
            match l2_write_part(store, &self.keys, self.token, part, self.keep).await {
                Ok(true) => self.written += 1,
                Ok(false) => self.stopped = true,
                Err(_) => {
                    route.stats.record(Event::RedisError);
                    self.stopped = true;
                }
            }
        }
    }

    /// How many parts the fill's write may take as written: none once one was refused
    /// or failed (it then writes them all again, or nothing).
    pub(crate) fn usable(&self) -> u32 {
        if self.stopped { 0 } else { self.written }
    }

    /// Deletes the parts written: the answer was not written under this fill's keys.
    /// `tried`: the length of the body whose write was tried, which wrote the parts that
    /// had not streamed (deleted too). Parts the entry names are kept whatever the fill
    /// thinks (a write whose reply was lost may have stored it).
    pub(crate) async fn drop(self, route: &Route, tried: Option<u64>) {
        let store = &route.shared.store;
        let by_the_write = tried
            .and_then(|len| Parted::of(len as usize))
            .map_or(0, |parted| parted.count);
        let count = self.written.max(by_the_write);
        if l2_drop_parts(store, &self.keys, self.token, count)
            .await
            .is_err()
        {
            route.stats.record(Event::RedisError);
        }
    }
}
