//! A cold fill's answer, from the origin's head to how the fill lands: who may have
//! it, its body read once and streamed to every caller that shares it, and whether it
//! is stored.
//!
//! At the head, the answer is judged once (RFC 9111 §3, `response::storable`, and
//! `response::reuse`):
//!
//! * **its caller's alone** (`private`, `no-store`, `Set-Cookie`, `Vary: *`, a
//!   `no-cache` answer that is not stored, anything not stored on a route that forwards
//!   credentials, an event stream, one declared longer than 64 MiB (and than the
//!   route's `max_body`), or, on a route that follows the origin, an answer not stored
//!   that says nothing of caching): the origin's body streams to the caller that led, and
//!   every other caller asks the origin itself (after a 5xx: what may stand in, or
//!   `502`);
//! * **shared** (anything else): the fill reads the body frame by frame into a
//!   [`stream`](super::stream). A body of at most [`STREAM_FROM`] bytes is read whole
//!   first, and its callers get the entry it made (or the answer, if it may not be
//!   stored), with exact headers; a longer one (or one declared longer) is handed to
//!   every caller of the fill as it comes: each reads the same frames at its own pace,
//!   and a caller that joins mid-fill gets the frames so far, then the rest. The stream
//!   holds the whole body while it may be stored; an answer that will not be (or that
//!   grew past `max_body`) is held as a window its readers read in step with the
//!   origin, and the fill stops once nobody reads it (see `stream`).
//!
//! When the body is whole, the answer is stored if it may be and fits the route's
//! `max_body`; the stream ends only after the write, so that a caller whose answer
//! ended finds the entry when it asks again. A body that fails, stalls past the refresh
//! timeout between two frames, or is stopped by the watchdog is cut for every reader
//! (never ended as if whole), and nothing is stored.
//!
//! A `no-cache` answer that a route stores (it follows the origin) streams and is
//! stored, but only to the caller that led: every other caller asks the origin itself
//! (it is revalidated on every use).

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;

use super::body::BoxError;
use super::body::ResponseBody;
use super::fill::{Fill, Kept, not_stored};
use super::inflight::{Failure, Landed, Lead, Own, SharedAnswer};
use super::origin::{Called, OriginBody};
use super::read::{Parts, Read, parts_kept, read_body};
use super::route::Route;
use super::stream::{Stream, Writer};
use crate::http::response::{self, NotStored, Reuse, declared_length};
use crate::metrics::Event;
use crate::notify::Ending;

/// The longest body read whole before the fill's callers are answered (or the route's
/// `max_body`, if less): a longer one streams to them as it comes. 64 KiB: most API answers, whose callers then get the
/// entry with its exact headers (`stored`, its `ttl`, its length), at the cost of at
/// most 64 KiB of delay on their first byte; the leader's first byte waits as long.
pub(crate) const STREAM_FROM: u64 = 64 * 1024;

/// What the origin's call for a cold fill (not a `304` to its conditional request)
/// comes to: how the fill lands for every caller, and what only the caller that led
/// may have.
pub(crate) async fn complete<B: OriginBody, E>(
    route: &Route,
    fill: Fill,
    origin: Called<B, E>,
    asked: Arc<Request<()>>,
    lead: &Lead,
) -> (Landed, Option<Own<B, E>>) {
    match origin {
        Called::TimedOut => {
            fill.end(Ending::Error).await;
            (Landed::Failed(Failure::Timeout), None)
        }
        Called::Error(error) => {
            route.stats.record(Event::OriginError);
            fill.end(Ending::Error).await;
            (Landed::Failed(Failure::Error), Some(Err(error)))
        }
        Called::Answered(response) => read(route, fill, response, asked, lead).await,
    }
}

/// Who may have an answer, judged at its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sharing {
    /// Every caller of the fill, as its body streams.
    Shared,
    /// Stored, but given only to the caller that led (`no-cache`), as it streams.
    StoredOnly,
    /// Its caller's alone, not stored: streamed to it from the origin.
    Own(NotStored),
}

/// The largest answer a crowd shares that is not stored, by its declared length: its
/// stream holds it whole while the fill lasts (one copy for the crowd). 64 MiB, the
/// largest body a route may store; a longer one streams to each caller from the origin.
const SHARED_AT_MOST: u64 = crate::policy::defaults::MAX_BODY_LIMIT as u64;

/// Who may have `head` (see the [module docs](self)).
fn sharing(route: &Route, head: &Response<()>) -> Sharing {
    let policy = &route.policy;
    let headers = head.headers();
    // An event stream is one connection's: it may never end, and is never whole.
    let events = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        });
    if events {
        return Sharing::Own(NotStored::EventStream);
    }
    if declared_length(headers).is_some_and(|len| len > SHARED_AT_MOST.max(policy.max_body as u64))
    {
        return Sharing::Own(NotStored::TooLarge);
    }
    let never = response::reuse(headers) == Reuse::Never;
    match response::storable(policy, head) {
        Ok(()) if never => Sharing::StoredOnly,
        Ok(()) => Sharing::Shared,
        Err(why) if why.is_private() => Sharing::Own(why),
        // With credentials in fill requests, whatever is not stored (a 401 for the
        // leader's token, say) is the leader's alone.
        Err(why) if policy.allow_authorization || policy.allow_cookies => Sharing::Own(why),
        Err(_) if never => Sharing::Own(NotStored::NoCache),
        // A failure is shared, so that a crowd does not each ask a failing origin.
        Err(_) if response::is_failure(head.status()) => Sharing::Shared,
        // On a route that follows the origin, an answer that it may not keep and that
        // says nothing of caching is each caller's own, as in Varnish and Fastly.
        Err(why) if policy.follow_origin => Sharing::Own(why),
        // On a route the user declared cacheable: a 404 where 200s are stored, say.
        Err(_) => Sharing::Shared,
    }
}

/// Reads the answer whose head came, and lands the fill (see the [module docs](self)).
async fn read<B: OriginBody, E>(
    route: &Route,
    mut fill: Fill,
    response: Response<B>,
    asked: Arc<Request<()>>,
    lead: &Lead,
) -> (Landed, Option<Own<B, E>>) {
    let (parts, body) = response.into_parts();
    let mut head = Response::from_parts(parts, ());
    let failure = response::is_failure(head.status());
    let sharing = sharing(route, &head);
    if let Sharing::Own(why) = sharing {
        return own(route, fill, head, body, why).await;
    }
    // What a qualified `no-cache` names is never stored nor shared: not even with the
    // callers that join while the body streams.
    response::strip_no_cache_fields(head.headers_mut());
    let max = route.policy.max_body as u64;
    let too_large = |len: u64| len > max || head.headers().len() > crate::cache::entry::MAX_HEADERS;
    let storable = response::storable(&route.policy, &head).is_ok();
    let declared = declared_length(head.headers());
    let storing = storable && !too_large(declared.unwrap_or(0));
    let mut writer = writer_for(route, lead, storing);
    let stream = writer.stream().clone();
    // The answer as every caller of the fill gets it, its body as far as it came (of
    // `len` bytes): stored, if it may be and can still fit.
    let publish = |len: u64| Landed::Shared {
        response: Arc::new(SharedAnswer {
            status: head.status(),
            headers: head.headers().clone(),
            body: stream.clone(),
            storing: storable && !too_large(declared.unwrap_or(0).max(len)),
            leader_only: sharing == Sharing::StoredOnly,
        }),
        failure,
        origin_saw: asked.clone(),
    };
    let mut handing = Handing {
        lead,
        publish,
        stream: stream.clone(),
        // Held until it is this long, or known not to be stored.
        stream_from: STREAM_FROM.min(max),
        published: false,
        retired: false,
    };
    if declared.is_some_and(|d| d > handing.stream_from) {
        handing.publish(0);
    }
    let mut parts = Parts::of(route, &fill, &head, storing);
    let reading = read_body(route, body, declared, &mut writer, &mut parts, max, |len| {
        handing.grew(len)
    });
    // Under the watchdog only what may be stored: an answer that will not be is not
    // cut at the watchdog's maximum for its readers (its lease, no longer renewed, runs
    // out by its TTL; the fill ends when the body does).
    let read = if storing {
        match fill.hold(reading).await {
            Ok(read) => read,
            Err(lost) => Read::Stopped(lost),
        }
    } else {
        reading.await
    };
    fill.parts_written(parts.as_ref().map_or(0, Parts::usable));
    let published = handing.published;
    drop(handing);
    ended(
        route,
        fill,
        read,
        (head, writer, published, parts),
        asked,
        lead,
    )
    .await
}

/// The stream of a fill's body, out of the guard's fill memory: held whole while it may
/// be stored (`storing`, up to `max_body`); else a window (see `stream`), its start kept
/// for the callers of the flight that have yet to read it.
fn writer_for(route: &Route, lead: &Lead, storing: bool) -> Writer {
    let mut writer = Stream::writer();
    writer.charged_to(route.shared.fill_memory.clone());
    writer.awaited_by(lead.waiting());
    if !storing {
        writer.bound();
    }
    writer
}

/// Who a fill's stream is handed to as its body grows: every caller of the flight, once
/// it is longer than `stream_from` (or declared so); and once the stream let go of its
/// start (it keeps a window), or the fill memory was spent, none that comes after:
/// those start a fill of their own.
struct Handing<'a, P> {
    lead: &'a Lead,
    /// The answer as the callers get it, its body `len` bytes so far.
    publish: P,
    stream: Arc<Stream>,
    stream_from: u64,
    published: bool,
    retired: bool,
}

impl<P: Fn(u64) -> Landed> Handing<'_, P> {
    fn publish(&mut self, len: u64) {
        self.lead.publish((self.publish)(len));
        self.published = true;
    }

    /// The body is `len` bytes long: read on (it is read to its end, stored or not,
    /// while anyone reads it).
    fn grew(&mut self, len: u64) -> bool {
        // (Past the fill memory, a stream keeps too little to wait for `stream_from`.)
        if !self.published && (len > self.stream_from || self.stream.over_memory()) {
            self.publish(len);
        }
        if !self.retired && (self.stream.let_go_of_start() || self.stream.over_memory()) {
            self.lead.retire();
            self.retired = true;
        }
        true
    }
}

/// An answer that is its caller's alone (`why` it is not stored): streamed to it as it
/// comes; the others ask the origin themselves (after a failure, what may stand in, or
/// `502`).
async fn own<B: OriginBody, E>(
    route: &Route,
    fill: Fill,
    head: Response<()>,
    body: B,
    why: NotStored,
) -> (Landed, Option<Own<B, E>>) {
    not_stored(route, why);
    let failure = response::is_failure(head.status());
    if failure {
        fill.end(Ending::Error).await;
    } else {
        fill.end_private().await;
    }
    let (parts, ()) = head.into_parts();
    let own = Response::from_parts(parts, ResponseBody::stream(body));
    let others = if failure {
        // A failure the others may not be given: they are not sent to an origin that
        // just failed, each on its own, but get what may stand in, or `502`.
        Landed::Failed(Failure::Error)
    } else {
        Landed::Pass
    };
    (others, Some(Ok(own)))
}

/// How the fill lands after its body `read` ended: stored, shared, or cut. The parts
/// written while it streamed are deleted unless the entry written names them, before
/// its readers' bodies end.
async fn ended<B: Body, E>(
    route: &Route,
    fill: Fill,
    read: Read<B::Error>,
    (head, writer, published, parts): (Response<()>, Writer, bool, Option<Parts>),
    asked: Arc<Request<()>>,
    lead: &Lead,
) -> (Landed, Option<Own<B, E>>)
where
    B::Error: Into<BoxError>,
{
    let stream = writer.stream().clone();
    let landed = match read {
        Read::Whole | Read::Trailers => {
            let trailers = matches!(read, Read::Trailers);
            let read = (head, writer, published, parts);
            return read_whole(route, fill, trailers, read, asked, lead).await;
        }
        // The fill ends (and the fleet backs off) first, then the flight closes to
        // newcomers, and only then do its readers see the cut: a caller that comes
        // after a reader saw it starts a fill of its own, not this one's failure.
        Read::Failed(error) => {
            route.stats.record(Event::OriginError);
            let error: BoxError = error.into();
            tracing::debug!(%error, "the origin's body failed mid-way: cut for every reader");
            fill.end(Ending::Error).await;
            retire_and_cut(lead, writer);
            cut(published, &stream, head)
        }
        Read::Short => {
            route.stats.record(Event::OriginError);
            tracing::debug!("the origin's body ended before its declared length: cut");
            fill.end(Ending::Error).await;
            retire_and_cut(lead, writer);
            cut(published, &stream, head)
        }
        // (A cold fill reads every body to its end: it never abandons one.)
        Read::Abandoned => {
            fill.end(Ending::Error).await;
            retire_and_cut(lead, writer);
            (Landed::Failed(Failure::Error), None)
        }
        Read::Deserted => (deserted(route, fill, &head, writer, lead).await, None),
        Read::Stalled => {
            route.stats.record(Event::OriginTimeout);
            fill.end(Ending::Error).await;
            retire_and_cut(lead, writer);
            (Landed::Failed(Failure::Timeout), None)
        }
        Read::Stopped(lost) => {
            let failure = match fill.stopped(lost).await {
                super::fill::Stopped::AtMaximum => Failure::Timeout,
                super::fill::Stopped::LeaseLost => Failure::LeaseLost,
            };
            retire_and_cut(lead, writer);
            (Landed::Failed(failure), None)
        }
    };
    if let Some(parts) = parts {
        parts.drop(route, None).await;
    }
    landed
}

/// A fill of an answer that will not be stored, which nobody reads (see `stream`): the
/// origin's body is let go (its connection closed), as for any answer not stored, and
/// not as a failure unless it was one; past the fill memory, not for the answer's sake:
/// nobody is told to pass it.
async fn deserted(
    route: &Route,
    fill: Fill,
    head: &Response<()>,
    writer: Writer,
    lead: &Lead,
) -> Landed {
    route.stats.record(Event::FillDeserted);
    let stream = writer.stream().clone();
    let len = stream.len();
    if len > route.policy.max_body as u64 {
        route.said_too_large(len);
        not_stored(route, NotStored::TooLarge);
    }
    let ending = match response::is_failure(head.status()) {
        _ if stream.over_memory() => Ending::Gone,
        true => Ending::Error,
        false => Ending::Pass,
    };
    fill.end(ending).await;
    retire_and_cut(lead, writer);
    Landed::Pass
}

/// A body read to its end (with `trailers`, which are not stored): the entry stored if
/// it may be, the parts of one that is not deleted, and the stream finished; once
/// stored, the flight closes to newcomers (a caller whose answer ended finds the entry
/// when it asks again).
async fn read_whole<B: Body, E>(
    route: &Route,
    fill: Fill,
    trailers: bool,
    (head, writer, published, parts): (Response<()>, Writer, bool, Option<Parts>),
    asked: Arc<Request<()>>,
    lead: &Lead,
) -> (Landed, Option<Own<B, E>>) {
    let stream = writer.stream().clone();
    let len = stream.len();
    if stream.over_memory() {
        // Not stored for want of this process's memory, not for the answer's sake: the
        // fleet is not told to pass it (the lease is given back), and its callers share
        // what they read of it.
        fill.end(Ending::Gone).await;
        if let Some(parts) = parts {
            parts.drop(route, None).await;
        }
        lead.retire();
        writer.finish();
        let failure = response::is_failure(head.status());
        return not_kept(
            route,
            head,
            &stream,
            NotStored::TooLarge,
            failure,
            asked,
            published,
        );
    }
    let over_max = len > route.policy.max_body as u64
        || head.headers().len() > crate::cache::entry::MAX_HEADERS;
    // One buffer of its own only for what may be stored; none of a stream that let go of
    // its start (an answer that will not be stored, read by its callers as it came).
    let gathered = (!trailers && !over_max)
        .then(|| writer.gathered())
        .flatten();
    let why = if trailers {
        Some(NotStored::Trailers)
    } else if gathered.is_none() {
        Some(NotStored::TooLarge)
    } else {
        None
    };
    if over_max {
        route.said_too_large(len);
    }
    let body = gathered.unwrap_or_default();
    let gathered = body.clone();
    let (landed, kept) = whole(route, fill, head, body, &stream, asked, why, published).await;
    if !kept && let Some(parts) = parts {
        // (The write, when one was tried, wrote the parts that had not streamed.)
        parts.drop(route, why.is_none().then_some(len)).await;
    }
    if let (Landed::Entry { kept: true, .. }, _) = &landed {
        lead.retire();
    }
    writer.finish();
    // (Only with the body this fill read: a newer entry's is not its readers'.)
    if let (Landed::Entry { stored, .. }, _) = &landed
        && stored.response.body.as_ptr() == gathered.as_ptr()
        && !gathered.is_empty()
    {
        stream.settle(&gathered);
    }
    landed
}

/// Closes the fill's flight to newcomers, then cuts its stream for every reader.
fn retire_and_cut(lead: &Lead, writer: Writer) {
    lead.retire();
    writer.cut();
}

/// A body that failed mid-way: every caller that shares the stream gets it cut; one
/// that looks only now, what may stand in, or `502`; the caller that led, if nothing
/// was published yet, the answer as far as it came, then cut.
fn cut<B: Body, E>(
    published: bool,
    stream: &Arc<Stream>,
    head: Response<()>,
) -> (Landed, Option<Own<B, E>>) {
    let own = (!published).then(|| {
        let (parts, ()) = head.into_parts();
        Ok(Response::from_parts(
            parts,
            ResponseBody::shared(stream.reader()),
        ))
    });
    (Landed::Failed(Failure::Error), own)
}

/// How a whole body lands: stored when it may be (`why` says why not, when that is
/// known already), else given to its callers as an answer that was not stored.
#[allow(clippy::too_many_arguments)]
async fn whole<B: Body, E>(
    route: &Route,
    fill: Fill,
    head: Response<()>,
    body: Bytes,
    stream: &Arc<Stream>,
    asked: Arc<Request<()>>,
    why: Option<NotStored>,
    published: bool,
) -> ((Landed, Option<Own<B, E>>), bool) {
    let why = match why.map_or_else(|| response::storable(&route.policy, &head), Err) {
        Ok(()) => {
            let kept = fill.keep(&asked, head, body).await;
            // Whether the entry written is the one the fill's parts are of.
            let parts_kept = parts_kept(&kept);
            let landed = match kept {
                Kept::Stored { put, rekeyed } => {
                    let stored = put.entry().clone();
                    // Whenever the answer varies: its waiters may have asked for another
                    // variant (sent a header the URL learned only from this answer), and
                    // are checked against it.
                    let varies = stored.has_header(&http::header::VARY);
                    let variant_of = (rekeyed || varies).then_some(asked);
                    let kept = put.is_kept();
                    (
                        Landed::Entry {
                            stored,
                            kept,
                            variant_of,
                        },
                        None,
                    )
                }
                Kept::NotStored { head, why, .. } => {
                    not_kept(route, head, stream, why, false, asked, published)
                }
                // Another variant's, which someone else fills or filled: its caller has
                // it; the others look again under their own keys.
                Kept::Elsewhere { head, body } => {
                    let (parts, ()) = head.into_parts();
                    let response = Response::from_parts(parts, ResponseBody::full(body));
                    (Landed::Rekey, Some(Ok(response)))
                }
            };
            return (landed, parts_kept);
        }
        Err(why) => why,
    };
    not_stored(route, why);
    let failure = response::is_failure(head.status());
    if failure {
        fill.end(Ending::Error).await;
    } else if is_own(route, why, head.headers()) && !published {
        fill.end_private().await;
    } else {
        fill.end(Ending::Pass).await;
    }
    (
        not_kept(route, head, stream, why, failure, asked, published),
        false,
    )
}

/// Whether an answer that was not stored (for `why`) is its caller's alone: private,
/// `no-cache`, or on a route that forwards credentials.
fn is_own(route: &Route, why: NotStored, headers: &http::HeaderMap) -> bool {
    let policy = &route.policy;
    why.is_private()
        || policy.allow_authorization
        || policy.allow_cookies
        || response::reuse(headers) == Reuse::Never
}

/// How a whole answer that was not stored lands: for its caller alone when it is
/// private, says `no-cache` (or the route sends credentials), for every caller of its
/// variant otherwise (without the fields a qualified `no-cache` names). `published`:
/// its callers share its stream already.
pub(crate) fn not_kept<B: Body, E>(
    route: &Route,
    head: Response<()>,
    stream: &Arc<Stream>,
    why: NotStored,
    failure: bool,
    origin_saw: Arc<Request<()>>,
    published: bool,
) -> (Landed, Option<Own<B, E>>) {
    let own = is_own(route, why, head.headers());
    let (mut parts, ()) = head.into_parts();
    response::strip_no_cache_fields(&mut parts.headers);
    if own && !published {
        let response = Response::from_parts(parts, ResponseBody::shared(stream.reader()));
        let others = if failure {
            Landed::Failed(Failure::Error)
        } else {
            Landed::Pass
        };
        return (others, Some(Ok(response)));
    }
    let shared = Landed::Shared {
        response: Arc::new(SharedAnswer {
            status: parts.status,
            headers: parts.headers,
            body: stream.clone(),
            storing: false,
            // (Published already to its caller alone.)
            leader_only: own,
        }),
        failure,
        origin_saw,
    };
    (shared, None)
}
