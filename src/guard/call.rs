//! A fill's call of the origin, the same for a cold fill and a refresh: asked whether
//! the entry it would replace changed, when it has one to revalidate and a validator to
//! ask with, and what the origin said told apart: a `304` about that entry (which renews
//! it), a `304` about another (no answer: nobody asked for it), an answer, or a failure.

use http::{Request, Response, StatusCode};

use super::fill::{Answered, Fill, Stopped};
use super::origin::{Called, FillBody, Inner, OriginBody, counted_revalidation};
use super::route::Route;
use crate::cache::Stored;
use crate::http::conditional;

/// What a fill's call of the origin came to.
pub(crate) enum Call<'a, B: http_body::Body, E> {
    /// A `304` about the entry asked about (`revalidate`): its head, to renew it with.
    NotModified(Fill, Response<()>, &'a Stored),
    /// A `304` about another entry than the one asked about.
    AboutAnother(Fill),
    /// The origin's answer (not a `304` to the fill's question), or its failure.
    Answered(Fill, Called<B, E>),
    /// The fill stopped before the origin's head came.
    Stopped(Stopped),
}

/// Calls the origin with `request` for `fill`, on `route`; asks whether `revalidate` changed, if it
/// is given and has a validator. (`request` is what the origin gets: what the caller
/// asked is split off before, so that a condition added here keys nothing.)
pub(crate) async fn call<'a, S, ReqBody, B>(
    route: &Route,
    fill: Fill,
    inner: S,
    mut request: Request<ReqBody>,
    revalidate: Option<&'a Stored>,
) -> Call<'a, B, S::Error>
where
    S: Inner<ReqBody, B>,
    ReqBody: FillBody,
    B: OriginBody,
{
    let asked_about = revalidate.filter(|current| {
        conditional::ask_if_changed(&mut request, current.response.status, &current.headers())
    });
    let (fill, origin) = match fill.call(inner, request).await {
        Answered::Called(fill, origin) => (fill, origin),
        Answered::Stopped(stopped) => return Call::Stopped(stopped),
    };
    let Some(current) = asked_about else {
        return Call::Answered(fill, origin);
    };
    counted_revalidation(&route.stats, &origin);
    match origin {
        Called::Answered(response) if response.status() == StatusCode::NOT_MODIFIED => {
            if !conditional::is_about(&current.headers(), response.headers()) {
                return Call::AboutAnother(fill);
            }
            // (A 304 has no body.)
            let (parts, _) = response.into_parts();
            Call::NotModified(fill, Response::from_parts(parts, ()), current)
        }
        origin => Call::Answered(fill, origin),
    }
}
