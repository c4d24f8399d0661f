//! The body of every answer: a cached body served whole, a fill's body as it streams
//! to every caller that shares it, or the origin's body streamed through after the part
//! the layer read while deciding whether to cache it.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::stream::{self, Reader};
use crate::cache::InParts;

/// An error of a boxed kind, as the origin's body errors are kept.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why the body of a guarded response failed. A body that fails is cut where it
/// failed, never ended as if whole: the server closes the connection (HTTP/1.1) or
/// resets the stream (HTTP/2), and the client knows it did not get all of it.
#[derive(Debug)]
#[non_exhaustive]
pub enum BodyError {
    /// The origin's body failed while it streamed to this caller alone (its error is
    /// the source).
    Origin(BoxError),
    /// The fill this answer was shared from was cut: the origin's body failed, or
    /// ended before its declared end, for every caller that shared it; nothing was
    /// stored.
    FillCut,
    /// A stored body read from Redis part by part could not be read on: Redis failed,
    /// or the part was gone (evicted, or deleted by an invalidation) since the answer
    /// began.
    Stored,
}

impl fmt::Display for BodyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Origin(_) => f.write_str("the origin's body failed"),
            Self::FillCut => f.write_str("the shared fill's body was cut by its origin"),
            Self::Stored => f.write_str("the stored body could not be read on from Redis"),
        }
    }
}

impl std::error::Error for BodyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Origin(error) => Some(error.as_ref()),
            Self::FillCut | Self::Stored => None,
        }
    }
}

/// The body of a guarded response: a cached body served whole, a fill's body as it
/// streams (shared by every caller of the fill), or the origin's body streamed through
/// (after whatever part of it the layer read while deciding whether to cache it).
pub struct ResponseBody<B: Body> {
    kind: Kind<B>,
}

enum Kind<B: Body> {
    Full(Option<Bytes>),
    Shared(Reader),
    Parts(PartsReader),
    Stream {
        /// Frames read before the layer gave up on caching the response.
        prefix: VecDeque<Frame<Bytes>>,
        /// An error the origin's body returned while being read.
        error: Option<Box<B::Error>>,
        rest: Option<Pin<Box<B>>>,
    },
}

impl<B: Body> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Full(data) => f
                .debug_struct("ResponseBody::Full")
                .field("len", &data.as_ref().map_or(0, Bytes::len))
                .finish(),
            Kind::Shared(_) => f
                .debug_struct("ResponseBody::Shared")
                .finish_non_exhaustive(),
            Kind::Parts(reader) => f
                .debug_struct("ResponseBody::Parts")
                .field("left", &reader.left)
                .finish_non_exhaustive(),
            Kind::Stream { prefix, .. } => f
                .debug_struct("ResponseBody::Stream")
                .field("prefix_frames", &prefix.len())
                .finish_non_exhaustive(),
        }
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full(if data.is_empty() { None } else { Some(data) }),
        }
    }

    pub(crate) fn empty() -> Self {
        Self {
            kind: Kind::Full(None),
        }
    }

    /// The whole body, when it is held (not streamed from the origin).
    pub(crate) fn whole(&self) -> Option<Bytes> {
        match &self.kind {
            Kind::Full(data) => Some(data.clone().unwrap_or_default()),
            Kind::Shared(_) | Kind::Parts(_) | Kind::Stream { .. } => None,
        }
    }

    /// The length of a body read from Redis in parts.
    pub(crate) fn parts_len(&self) -> Option<u64> {
        match &self.kind {
            Kind::Parts(reader) => Some(reader.parts.len()),
            _ => None,
        }
    }

    /// The bytes from `start` up to `end` (exclusive, within the body) of a held body,
    /// or of a fill's body as it streams (sent as they come); `None` for the origin's
    /// body streamed through.
    pub(crate) fn range(&self, start: u64, end: u64) -> Option<Self> {
        match &self.kind {
            Kind::Full(data) => {
                let data = data.clone().unwrap_or_default();
                Some(Self::full(data.slice(start as usize..end as usize)))
            }
            Kind::Shared(reader) => Some(Self::shared(reader.stream().range(start, end))),
            Kind::Parts(reader) => Some(Self::parts(reader.parts.clone(), start, end)),
            Kind::Stream { .. } => None,
        }
    }

    /// Whether it is a fill's body as it streams.
    pub(crate) fn is_shared(&self) -> bool {
        matches!(self.kind, Kind::Shared(_))
    }

    /// A fill's body as it streams, from `reader`'s place.
    pub(crate) fn shared(reader: Reader) -> Self {
        Self {
            kind: Kind::Shared(reader),
        }
    }

    /// The bytes from `start` up to `end` (exclusive, within the body) of a stored body
    /// kept in Redis in parts, read one part at a time (the next while the client takes
    /// the one before), from the part that holds `start`.
    pub(crate) fn parts(parts: Arc<InParts>, start: u64, end: u64) -> Self {
        let (next, skip) = InParts::part_of(start);
        Self {
            kind: Kind::Parts(PartsReader {
                parts,
                next,
                skip,
                left: end.saturating_sub(start),
                reading: None,
            }),
        }
    }

    pub(crate) fn stream(body: B) -> Self {
        Self::resume(VecDeque::new(), None, Some(Box::pin(body)))
    }

    /// The rest of a body of which `prefix` was read (and which failed with `error`, if
    /// given).
    pub(crate) fn resume(
        prefix: VecDeque<Frame<Bytes>>,
        error: Option<B::Error>,
        rest: Option<Pin<Box<B>>>,
    ) -> Self {
        Self {
            kind: Kind::Stream {
                prefix,
                error: error.map(Box::new),
                rest,
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match &mut self.get_mut().kind {
            Kind::Full(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            Kind::Shared(reader) => reader.poll_next(cx).map(|next| match next {
                stream::Next::Data(data) => Some(Ok(Frame::data(data))),
                stream::Next::End => None,
                stream::Next::Cut => Some(Err(BodyError::FillCut)),
            }),
            Kind::Parts(reader) => reader.poll_next(cx),
            Kind::Stream {
                prefix,
                error,
                rest,
            } => {
                if let Some(frame) = prefix.pop_front() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                if let Some(error) = error.take() {
                    *rest = None;
                    return Poll::Ready(Some(Err(BodyError::Origin((*error).into()))));
                }
                match rest {
                    Some(body) => {
                        let polled = body.as_mut().poll_frame(cx);
                        if let Poll::Ready(None) = polled {
                            *rest = None;
                        }
                        polled
                            .map(|frame| frame.map(|f| f.map_err(|e| BodyError::Origin(e.into()))))
                    }
                    None => Poll::Ready(None),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(data) => data.is_none(),
            Kind::Shared(reader) => reader.is_end(),
            Kind::Parts(reader) => reader.left == 0,
            Kind::Stream {
                prefix,
                error,
                rest,
            } => {
                prefix.is_empty()
                    && error.is_none()
                    && rest.as_ref().is_none_or(|b| b.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full(data) => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
            Kind::Shared(reader) => reader
                .left()
                .map_or_else(SizeHint::new, SizeHint::with_exact),
            Kind::Parts(reader) => SizeHint::with_exact(reader.left),
            Kind::Stream { prefix, rest, .. } => {
                let buffered: u64 = prefix
                    .iter()
                    .filter_map(|f| f.data_ref())
                    .map(|d| d.len() as u64)
                    .sum();
                let rest = rest
                    .as_ref()
                    .map_or_else(|| SizeHint::with_exact(0), |b| b.size_hint());
                // Upper first: a lower bound above the upper one panics.
                let mut hint = SizeHint::new();
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper + buffered);
                }
                hint.set_lower(rest.lower() + buffered);
                hint
            }
        }
    }
}

/// A reader of a stored body kept in Redis in parts: its place, and the read of the
/// part it takes next (in a task of its own, so that it goes on while the client takes
/// the part before).
struct PartsReader {
    parts: Arc<InParts>,
    /// The part read next, and how many of its first bytes are skipped (a range's
    /// start).
    next: u32,
    skip: usize,
    /// The bytes left to give.
    left: u64,
    reading: Option<tokio::task::JoinHandle<Result<Option<Bytes>, crate::store::StoreError>>>,
}

impl Drop for PartsReader {
    /// A client that went away costs no more reading.
    fn drop(&mut self) {
        if let Some(reading) = &self.reading {
            reading.abort();
        }
    }
}

impl PartsReader {
    fn read_next(&mut self) {
        if self.left > 0 && self.next < self.parts.count() && self.reading.is_none() {
            let (parts, index) = (self.parts.clone(), self.next);
            self.reading = Some(tokio::spawn(async move { parts.read(index).await }));
        }
    }

    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.read_next();
        let Some(reading) = self.reading.as_mut() else {
            // (Past the last part: the body is shorter than its entry said.)
            self.left = 0;
            return Poll::Ready(Some(Err(BodyError::Stored)));
        };
        let read = std::task::ready!(Pin::new(reading).poll(cx));
        self.reading = None;
        let data = match read {
            Ok(Ok(Some(data))) if data.len() > self.skip => data,
            read => {
                if let Ok(Err(error)) = read {
                    tracing::debug!(%error, "a part of a stored body could not be read");
                } else {
                    tracing::debug!("a part of a stored body was gone");
                }
                self.left = 0;
                return Poll::Ready(Some(Err(BodyError::Stored)));
            }
        };
        let end = data
            .len()
            .min(self.skip + usize::try_from(self.left).unwrap_or(usize::MAX));
        let data = data.slice(self.skip..end);
        self.skip = 0;
        self.next += 1;
        self.left -= data.len() as u64;
        // The next part is read while the client takes this one.
        self.read_next();
        Poll::Ready(Some(Ok(Frame::data(data))))
    }
}
