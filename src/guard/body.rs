//! The body of every answer: a cached body served whole, or the origin's body streamed
//! through after the part the layer read while deciding whether to cache it.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// The body of a guarded response: a cached body served whole, or the origin's body
/// streamed through (after whatever part of it the layer read while deciding whether
/// to cache it).
pub struct ResponseBody<B: Body> {
    kind: Kind<B>,
}

enum Kind<B: Body> {
    Full(Option<Bytes>),
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
            Kind::Stream { .. } => None,
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
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match &mut self.get_mut().kind {
            Kind::Full(data) => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
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
                    return Poll::Ready(Some(Err(*error)));
                }
                match rest {
                    Some(body) => {
                        let polled = body.as_mut().poll_frame(cx);
                        if let Poll::Ready(None) = polled {
                            *rest = None;
                        }
                        polled
                    }
                    None => Poll::Ready(None),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full(data) => data.is_none(),
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
