//! Calling the origin: a fill's call, read whole up to the route's body limit within
//! the refresh timeout, and a pass-through's, whose answer streams on once its head came
//! within the route's pass timeout. Every call is bounded; one that runs out is counted
//! as an origin timeout.
//!
//! This is also where the bounds on the inner service are stated, once: [`Inner`] and
//! the two body traits.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use tower::ServiceExt;
use tower_service::Service;

use super::body::BoxError;
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
    Body<Data = Bytes, Error: Into<BoxError> + Send + 'static> + Send + 'static
{
}

impl<B> OriginBody for B
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send + 'static,
{
}

pub(crate) enum Called<B: Body, E> {
    /// Its answer's head; the body is the caller's to read.
    Answered(Response<B>),
    Error(E),
    /// No head within the refresh timeout.
    TimedOut,
}

/// Calls the origin for its answer's head, within the policy's refresh timeout;
/// counted in `stats`.
pub(crate) async fn call_origin<S, ReqBody, B>(
    policy: &Policy,
    stats: &RouteStats,
    inner: S,
    request: Request<ReqBody>,
) -> Called<B, S::Error>
where
    S: Inner<ReqBody, B>,
    ReqBody: FillBody,
    B: OriginBody,
{
    stats.record(Event::OriginCall);
    match tokio::time::timeout(policy.refresh_timeout, inner.oneshot(request)).await {
        Ok(Ok(response)) => Called::Answered(response),
        Ok(Err(error)) => Called::Error(error),
        Err(_) => {
            stats.record(Event::OriginTimeout);
            Called::TimedOut
        }
    }
}

/// Calls the origin for a caller that passes through: its answer as it comes, once its
/// head came within the route's pass timeout; `Ok(None)` when it did not (counted).
pub(crate) async fn call_through<S, ReqBody, B>(
    policy: &Policy,
    stats: &RouteStats,
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
    if let Called::Answered(response) = origin
        && response.status() != StatusCode::NOT_MODIFIED
    {
        stats.record(Event::RevalidatedModified);
    }
}
