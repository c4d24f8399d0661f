//! Bodies around bodies, for the listener, the access log and the origin's client:
//! one that tells something of each frame and of its end ([`Tapped`]), and one with a
//! time bound ([`Bounded`]).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

/// What a [`Tapped`] body tells of itself: each data frame here; each poll, whether it
/// was pending (the body waits on what it wraps); its end by dropping the tap (written
/// out, abandoned or cut, alike).
pub(crate) trait Tap: Send + Unpin + 'static {
    fn data(&mut self, _len: usize) {}
    fn polled(&mut self, _pending: bool) {}
}

/// A body that tells its tap of its frames, and drops the tap with itself.
pub(crate) struct Tapped<B, T> {
    body: B,
    tap: T,
}

impl<B, T> Tapped<B, T> {
    pub(crate) fn new(body: B, tap: T) -> Self {
        Self { body, tap }
    }
}

impl<B, T> Body for Tapped<B, T>
where
    B: Body<Data = Bytes> + Unpin,
    T: Tap,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        this.tap.polled(polled.is_pending());
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            this.tap.data(data.len());
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A body with a time bound: it fails with `expired()`'s error (and a count of it) at
/// its deadline, which each frame moves `idle` on when it is an idle bound, and which
/// stays where it is when it is a total one. Its timer is made only if the body is ever
/// waited for (a GET's never is), and moved only when it goes off early.
pub(crate) struct Bounded<B> {
    body: B,
    deadline: Instant,
    idle: Option<Duration>,
    timer: Option<Pin<Box<Sleep>>>,
    expired: fn() -> BoxError,
}

impl<B> Bounded<B> {
    /// At most `within` for the whole body.
    pub(crate) fn total(body: B, within: Duration, expired: fn() -> BoxError) -> Self {
        Self {
            body,
            deadline: Instant::now() + within,
            idle: None,
            timer: None,
            expired,
        }
    }

    /// At most `idle` between two frames (and before the first).
    pub(crate) fn idle(body: B, idle: Duration, expired: fn() -> BoxError) -> Self {
        Self {
            idle: Some(idle),
            ..Self::total(body, idle, expired)
        }
    }
}

impl<B> Body for Bounded<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            if let Some(idle) = this.idle {
                this.deadline = Instant::now() + idle;
            }
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        let deadline = this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.deadline() < deadline {
            timer.as_mut().reset(deadline);
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err((this.expired)()))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
