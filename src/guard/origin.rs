//! Calling the origin: a fill's call, read whole up to the route's body limit within
//! the refresh timeout, and a pass-through's, whose answer streams on once its head came
//! within the route's pass timeout. Every call is bounded; one that runs out is counted
//! as an origin timeout.
//!
//! This is also where the bounds on the inner service are stated, once: [`Inner`] and
//! the two body traits.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_service::Service;

use crate::http::response::NotStored;
use crate::metrics::{Event, RouteStats};
use crate::policy::Policy;

/// What the guard needs of the inner service: a service of requests with body `ReqBody`
/// and responses with body `ResBody`, cloned for each call that reaches it (fills and
/// refreshes run in tasks of their own, so everything is `Send + 'static`).
pub(crate) trait Inner<ReqBody, ResBody>:
    Service<
        Request<ReqBody>,
        Response = Response<ResBody>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S, ReqBody, ResBody> Inner<ReqBody, ResBody> for S
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
}

/// The body of the requests the guard makes for fills and refreshes: empty.
pub(crate) trait FillBody: Default + Send + 'static {}

impl<B: Default + Send + 'static> FillBody for B {}

/// The body of the origin's responses.
pub(crate) trait OriginBody:
    Body<Data = Bytes, Error: Send + 'static> + Send + 'static
{
}

impl<B> OriginBody for B
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Send + 'static,
{
}

/// A whole response, as read from the origin.
pub(crate) struct Buffered {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

/// A response read from the origin, whole or not.
pub(crate) enum Read<B: Body> {
    Whole {
        head: Response<()>,
        body: Bytes,
    },
    /// Reading stopped: the body is too large, has trailers, or failed.
    Partial {
        head: Response<()>,
        prefix: VecDeque<Frame<Bytes>>,
        error: Option<B::Error>,
        rest: Option<Pin<Box<B>>>,
        why: NotStored,
    },
}

pub(crate) enum Called<B: Body, E> {
    Read(Read<B>),
    Error(E),
    TimedOut,
}

/// Calls the origin and reads its body, up to the policy's `max_body` bytes, all within
/// its refresh timeout; counted in `stats`.
pub(crate) async fn call_origin<S, ReqBody, B>(
    (policy, stats): (&Policy, &RouteStats),
    inner: S,
    request: Request<ReqBody>,
) -> Called<B, S::Error>
where
    S: Inner<ReqBody, B>,
    ReqBody: FillBody,
    B: OriginBody,
{
    stats.record(Event::OriginCall);
    let max = policy.max_body;
    let call = async {
        match inner.oneshot(request).await {
            Ok(response) => Called::Read(read(response, max).await),
            Err(error) => Called::Error(error),
        }
    };
    match tokio::time::timeout(policy.refresh_timeout, call).await {
        Ok(origin) => origin,
        Err(_) => {
            stats.record(Event::OriginTimeout);
            Called::TimedOut
        }
    }
}

/// Calls the origin for a caller that passes through: its answer as it comes, once its
/// head came within the route's pass timeout; `Ok(None)` when it did not (counted).
pub(crate) async fn call_through<S, ReqBody, B>(
    (policy, stats): (&Policy, &RouteStats),
    inner: S,
    request: Request<ReqBody>,
) -> Result<Option<Response<B>>, S::Error>
where
    S: Inner<ReqBody, B>,
    ReqBody: Send + 'static,
    B: OriginBody,
{
    stats.record(Event::OriginCall);
    // A clone that has not been polled: `oneshot` waits for it to be ready.
    match tokio::time::timeout(policy.pass_timeout, inner.oneshot(request)).await {
        Ok(answered) => answered.map(Some),
        Err(_) => {
            stats.record(Event::OriginTimeout);
            Ok(None)
        }
    }
}

pub(crate) async fn read<B: Body<Data = Bytes>>(response: Response<B>, max: usize) -> Read<B> {
    let (parts, body) = response.into_parts();
    let head = Response::from_parts(parts, ());
    let mut body = Box::pin(body);
    let declared = head
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    // More header values than an entry may hold (`entry::MAX_HEADERS`) would make an
    // entry that L2 could never give back.
    if declared.unwrap_or(0) > max as u64
        || body.size_hint().lower() > max as u64
        || head.headers().len() > crate::cache::entry::MAX_HEADERS
    {
        return Read::Partial {
            head,
            prefix: VecDeque::new(),
            error: None,
            rest: Some(body),
            why: NotStored::TooLarge,
        };
    }
    let mut frames: VecDeque<Frame<Bytes>> = VecDeque::new();
    let mut size = 0;
    loop {
        match body.frame().await {
            None => {
                let mut whole = BytesMut::with_capacity(size);
                for frame in frames {
                    if let Ok(data) = frame.into_data() {
                        whole.extend_from_slice(&data);
                    }
                }
                return Read::Whole {
                    head,
                    body: whole.freeze(),
                };
            }
            Some(Ok(frame)) => {
                let why = match frame.data_ref() {
                    Some(data) => {
                        size += data.len();
                        (size > max).then_some(NotStored::TooLarge)
                    }
                    None => Some(NotStored::Trailers),
                };
                frames.push_back(frame);
                if let Some(why) = why {
                    return Read::Partial {
                        head,
                        prefix: frames,
                        error: None,
                        rest: Some(body),
                        why,
                    };
                }
            }
            Some(Err(error)) => {
                return Read::Partial {
                    head,
                    prefix: frames,
                    error: Some(error),
                    rest: None,
                    why: NotStored::TooLarge,
                };
            }
        }
    }
}

/// Splits off what the origin is asked (method, URI, headers), to key and match the
/// answer by, from the request that goes to it.
pub(crate) fn asked<ReqBody>(request: Request<ReqBody>) -> (Request<ReqBody>, Arc<Request<()>>) {
    let (parts, body) = request.into_parts();
    let mut asked = Request::new(());
    *asked.method_mut() = parts.method.clone();
    *asked.uri_mut() = parts.uri.clone();
    *asked.headers_mut() = parts.headers.clone();
    (Request::from_parts(parts, body), Arc::new(asked))
}

/// Counts the answer to a conditional request: a new response (the `304`s are counted
/// where they renew an entry).
pub(crate) fn counted_revalidation<B: Body, E>(stats: &RouteStats, origin: &Called<B, E>) {
    if let Called::Read(Read::Whole { head, .. } | Read::Partial { head, .. }) = origin
        && head.status() != StatusCode::NOT_MODIFIED
    {
        stats.record(Event::RevalidatedModified);
    }
}
