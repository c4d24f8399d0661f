//! The response future: ready at once for a hit in L1, one boxed future past it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use http_body::Body;

use super::body::ResponseBody;
use super::outcome::say_details;

type Boxed<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

/// The response future of [`Guard`](super::Guard).
///
/// A hit in L1 is answered when the service is called, and the future is ready at once.
/// Past L1 the request path awaits Redis (and, on a cold miss, a fill): that part is one
/// boxed future rather than a state machine spelled out by hand.
pub struct ResponseFuture<B: Body, E> {
    inner: Inner<B, E>,
    /// Served while Redis is unavailable: `Cache-Status` says `detail=local-only`.
    local_only: bool,
    /// The key left out query parameters the request had: `detail=query-dropped`.
    query_dropped: bool,
}

enum Inner<B: Body, E> {
    /// Answered from L1 when called: nothing to wait for, nothing allocated.
    Ready(Option<Response<ResponseBody<B>>>),
    Boxed(Boxed<B, E>),
}

impl<B: Body, E> ResponseFuture<B, E> {
    pub(crate) fn new(
        future: impl Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Inner::Boxed(Box::pin(future)),
            local_only: false,
            query_dropped: false,
        }
    }

    pub(crate) fn ready(response: Response<ResponseBody<B>>) -> Self {
        Self {
            inner: Inner::Ready(Some(response)),
            local_only: false,
            query_dropped: false,
        }
    }

    /// The answer says how it was made (see [`say_details`]): while Redis was
    /// unavailable, or under a key that left out query parameters the request had.
    pub(crate) fn said(mut self, local_only: bool, query_dropped: bool) -> Self {
        self.local_only = local_only;
        self.query_dropped = query_dropped;
        self
    }
}

impl<B: Body, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Unpin: both variants are (a response, a boxed future).
        let this = self.get_mut();
        let polled = match &mut this.inner {
            Inner::Ready(response) => {
                Poll::Ready(Ok(response.take().expect("polled after completion")))
            }
            Inner::Boxed(future) => future.as_mut().poll(cx),
        };
        match polled {
            Poll::Ready(Ok(mut response)) if this.local_only || this.query_dropped => {
                say_details(response.headers_mut(), this.local_only, this.query_dropped);
                Poll::Ready(Ok(response))
            }
            other => other,
        }
    }
}

impl<B: Body, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
