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

use super::body::ResponseBody;
use super::fill::{Fill, Kept, not_stored};
use super::inflight::{Failure, Landed, Lead, Own, SharedAnswer};
use super::origin::{Called, OriginBody};
use super::read::{BodyEnd, Parts, Read, ended, read_body};
use super::route::Route;
use super::stream::{Stream, Writer};
use super::verdict::{Sharing, Verdict, is_own, judge};
use crate::http::response::{self, NotStored};
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
    let verdict = judge(&route.policy, &head);
    if let Sharing::Own(why) = verdict.sharing {
        return own(route, fill, head, body, why).await;
    }
    // What a qualified `no-cache` names is never stored nor shared: not even with the
    // callers that join while the body streams.
    let verdict = verdict.stripped(&route.policy, &mut head);
    let storing = verdict.storing();
    if !storing && !verdict.failure {
        // Its head says it will not be stored: the fleet's waiters hear so now, not
        // once the body has streamed, and call once per instance.
        fill.said_not_stored();
    }
    let mut writer = writer_for(route, lead, storing);
    let stream = writer.stream().clone();
    // The answer as every caller of the fill gets it, its body as far as it came (of
    // `len` bytes): stored, if it may be and can still fit.
    let publish = |len: u64| Landed::Shared {
        response: Arc::new(SharedAnswer {
            status: head.status(),
            headers: head.headers().clone(),
            body: stream.clone(),
            storing: verdict.storing_at(len),
            leader_only: verdict.sharing == Sharing::StoredOnly,
        }),
        failure: verdict.failure,
        origin_saw: asked.clone(),
    };
    let max = route.policy.max_body as u64;
    let mut handing = Handing {
        lead,
        publish,
        stream: stream.clone(),
        // Held until it is this long, or known not to be stored.
        stream_from: STREAM_FROM.min(max),
        published: false,
        retired: false,
    };
    if verdict.declared.is_some_and(|d| d > handing.stream_from) {
        handing.publish(0);
    }
    let mut parts = Parts::of(route, fill.keys(), fill.lease_token(), &head, storing);
    let declared = verdict.declared;
    let reading = read_body(route, body, declared, &mut writer, &mut parts, max, |len| {
        handing.grew(len)
    });
    // Under the watchdog only what may be stored: an answer that will not be is not
    // cut at the watchdog's maximum for its readers (its lease was given back at its
    // head, or, for a failure, runs out by its TTL; the fill ends when the body does).
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
    let answer = Answer {
        head,
        verdict,
        stream,
        asked,
        published,
    };
    landed(route, fill, ended(route, read), answer, writer, parts, lead).await
}

/// A shared answer past its head, as the fill's callers may get it.
pub(crate) struct Answer {
    pub(crate) head: Response<()>,
    /// What its head allows.
    pub(crate) verdict: Verdict,
    /// Its body, as far as it came.
    pub(crate) stream: Arc<Stream>,
    /// What the origin was asked (for which variant the answer is).
    pub(crate) asked: Arc<Request<()>>,
    /// Whether its callers were handed its stream already.
    pub(crate) published: bool,
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

/// How the fill lands once its body `ended`: stored, shared, or cut. The parts written
/// while it streamed are deleted unless the entry written names them, before its
/// readers' bodies end.
async fn landed<B: Body, E>(
    route: &Route,
    fill: Fill,
    ended: BodyEnd,
    answer: Answer,
    writer: Writer,
    parts: Option<Parts>,
    lead: &Lead,
) -> (Landed, Option<Own<B, E>>) {
    // The fill ends (and the fleet backs off) first, then the flight closes to
    // newcomers, and only then do its readers see the cut: a caller that comes after a
    // reader saw it starts a fill of its own, not this one's failure.
    let landed = match ended {
        BodyEnd::Whole { trailers } => {
            return read_whole(route, fill, trailers, answer, writer, parts, lead).await;
        }
        BodyEnd::Cut(Failure::Error) => {
            fill.end(Ending::Error).await;
            retire_and_cut(lead, writer);
            cut(answer)
        }
        BodyEnd::Cut(failure) => {
            fill.end(Ending::Error).await;
            retire_and_cut(lead, writer);
            (Landed::Failed(failure), None)
        }
        // (A cold fill reads every body to its end: it never lets one go for its size.)
        BodyEnd::LetGo { deserted: false } => {
            fill.end(Ending::Error).await;
            retire_and_cut(lead, writer);
            (Landed::Failed(Failure::Error), None)
        }
        BodyEnd::LetGo { deserted: true } => (
            deserted(route, fill, &answer.head, writer, lead).await,
            None,
        ),
        BodyEnd::Stopped(lost) => {
            let failure = fill.stopped(lost).await.failure();
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
    answer: Answer,
    writer: Writer,
    parts: Option<Parts>,
    lead: &Lead,
) -> (Landed, Option<Own<B, E>>) {
    let stream = answer.stream.clone();
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
        return answer.not_kept(route, NotStored::TooLarge);
    }
    let over_max = !answer.verdict.fits(len);
    // One buffer of its own only for what may be stored; none of a stream that let go of
    // its start (an answer that will not be stored, read by its callers as it came).
    let gathered = (!trailers && !over_max)
        .then(|| writer.gathered())
        .flatten();
    let stores = if trailers {
        Err(NotStored::Trailers)
    } else if gathered.is_none() {
        Err(NotStored::TooLarge)
    } else {
        answer.verdict.stores
    };
    if over_max {
        route.said_too_large(len);
    }
    let body = gathered.unwrap_or_default();
    let gathered = body.clone();
    let (landed, kept) = answer.whole(route, fill, body, stores).await;
    if !kept && let Some(parts) = parts {
        // (The write, when one was tried, wrote the parts that had not streamed.)
        let tried = (stores.is_ok()).then_some(len);
        parts.drop(route, tried).await;
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
fn cut<B: Body, E>(answer: Answer) -> (Landed, Option<Own<B, E>>) {
    let own = (!answer.published).then(|| {
        let (parts, ()) = answer.head.into_parts();
        Ok(Response::from_parts(
            parts,
            ResponseBody::shared(answer.stream.reader()),
        ))
    });
    (Landed::Failed(Failure::Error), own)
}

impl Answer {
    /// How a whole body lands: stored when it may be (`stores`, as its head and its
    /// length said), else given to its callers as an answer that was not stored; and
    /// whether the entry written is the one the fill's parts are of.
    async fn whole<B: Body, E>(
        self,
        route: &Route,
        fill: Fill,
        body: Bytes,
        stores: Result<(), NotStored>,
    ) -> ((Landed, Option<Own<B, E>>), bool) {
        let why = match stores {
            Ok(()) => {
                let asked = self.asked.clone();
                let kept = fill.keep(&asked, self.head, body).await;
                let parts_kept = kept.has_its_parts();
                let landed = match kept {
                    Kept::Stored { put, rekeyed } => {
                        let stored = put.entry().clone();
                        // Whenever the answer varies: its waiters may have asked for
                        // another variant (sent a header the URL learned only from this
                        // answer), and are checked against it.
                        let varies = stored.has_header(&http::header::VARY);
                        let variant_of = (rekeyed || varies).then_some(asked);
                        let kept = put.is_kept();
                        let entry = Landed::Entry {
                            stored,
                            kept,
                            variant_of,
                        };
                        (entry, None)
                    }
                    Kept::NotStored { head, why, .. } => {
                        // (Not said a failure, whatever its status.)
                        let mut answer = Self { head, ..self };
                        answer.verdict.failure = false;
                        answer.not_kept(route, why)
                    }
                    // Another variant's, which someone else fills or filled: its caller
                    // has it; the others look again under their own keys.
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
        if self.verdict.failure {
            fill.end(Ending::Error).await;
        } else if is_own(&route.policy, why, self.head.headers()) && !self.published {
            fill.end_private().await;
        } else {
            fill.end(Ending::Pass).await;
        }
        (self.not_kept(route, why), false)
    }

    /// How a whole answer that was not stored (for `why`) lands: for its caller alone
    /// when it is private, says `no-cache` (or the route sends credentials), for every
    /// caller of its variant otherwise (without the fields a qualified `no-cache`
    /// names).
    pub(crate) fn not_kept<B: Body, E>(
        self,
        route: &Route,
        why: NotStored,
    ) -> (Landed, Option<Own<B, E>>) {
        let own = is_own(&route.policy, why, self.head.headers());
        let failure = self.verdict.failure;
        let (mut parts, ()) = self.head.into_parts();
        response::strip_no_cache_fields(&mut parts.headers);
        if own && !self.published {
            let reader = ResponseBody::shared(self.stream.reader());
            let response = Response::from_parts(parts, reader);
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
                body: self.stream,
                storing: false,
                // (Published already to its caller alone.)
                leader_only: own,
            }),
            failure,
            origin_saw: self.asked,
        };
        (shared, None)
    }
}
