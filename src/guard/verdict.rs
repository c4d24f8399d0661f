//! What may become of an origin's answer, judged once, at its head (RFC 9111 §3:
//! `response::storable` and `response::reuse`): who may have it, and whether it may be
//! stored (again, once what a qualified `no-cache` names is stripped from it:
//! [`Verdict::stripped`]). The only module that asks `storable`. Pure: the route's policy and the answer's head in, a [`Verdict`] out (its
//! rules are unit-tested in `verdict/tests.rs`, as pingora-cache's `filters.rs` are).
//!
//! A cold fill and a refresh read the same verdict differently: a cold fill has
//! callers waiting, so an answer that may not be stored still goes to them (shared, or
//! its caller's alone: [`Sharing`]); a refresh has none, and an answer it may not store
//! is no better than a failure ([`Verdict::refreshes`]): the stale entry stays.

use http::{HeaderMap, Response};

use crate::cache::entry::MAX_HEADERS;
use crate::http::response::{self, NotStored, Reuse, declared_length};
use crate::policy::Policy;

#[cfg(test)]
mod tests;

/// Who may have an answer, judged at its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sharing {
    /// Every caller of the fill, as its body streams.
    Shared,
    /// Stored, but given only to the caller that led (`no-cache`), as it streams.
    StoredOnly,
    /// Its caller's alone, not stored: streamed to it from the origin.
    Own(NotStored),
}

/// Why a refresh stores nothing of an answer, judged at its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// A failure (a 5xx) that may not be stored.
    Failure,
    /// An answer that may not be stored, or is declared too large to.
    NotStored(NotStored),
}

/// The judgement of one answer's head (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Who may have it.
    pub(crate) sharing: Sharing,
    /// Whether its head lets it be stored, or why not (its body may still be too large).
    pub(crate) stores: Result<(), NotStored>,
    /// A 5xx: an origin failure, whatever it says of caching.
    pub(crate) failure: bool,
    /// The length its head declares, if any.
    pub(crate) declared: Option<u64>,
    /// The route's `max_body`.
    max_body: u64,
    /// More header values than an entry may hold.
    too_many_headers: bool,
}

/// The largest answer a crowd shares that is not stored, by its declared length: its
/// stream holds it whole while the fill lasts (one copy for the crowd). 64 MiB, the
/// largest body a route may store; a longer one streams to each caller from the origin.
pub(crate) const SHARED_AT_MOST: u64 = crate::policy::defaults::MAX_BODY_LIMIT as u64;

/// Judges `head` for a route with `policy` (see the [module docs](self)).
pub(crate) fn judge(policy: &Policy, head: &Response<()>) -> Verdict {
    let headers = head.headers();
    let declared = declared_length(headers);
    let stores = response::storable(policy, head);
    let failure = response::is_failure(head.status());
    Verdict {
        sharing: sharing(policy, headers, declared, stores, failure),
        stores,
        failure,
        declared,
        max_body: policy.max_body as u64,
        too_many_headers: headers.len() > MAX_HEADERS,
    }
}

impl Verdict {
    /// The verdict on `head` once what a qualified `no-cache` names is stripped from
    /// it (as a cold fill shares it: never those fields, not even with the callers
    /// that join while its body streams): who may have it stays as judged before (an
    /// answer with a `Set-Cookie` its `no-cache` names is still its caller's), but
    /// whether it is stored, and its length and header values, are the stripped
    /// head's.
    pub(crate) fn stripped(mut self, policy: &Policy, head: &mut Response<()>) -> Self {
        let before = head.headers().len();
        response::strip_no_cache_fields(head.headers_mut());
        if head.headers().len() != before {
            self.stores = response::storable(policy, head);
            self.declared = declared_length(head.headers());
            self.too_many_headers = head.headers().len() > MAX_HEADERS;
        }
        self
    }

    /// Whether a body of `len` bytes fits an entry (and the head's header values too).
    pub(crate) fn fits(&self, len: u64) -> bool {
        len <= self.max_body && !self.too_many_headers
    }

    /// Whether the answer is stored if its body comes whole as long as it declares (or,
    /// declaring nothing, within the route's limit).
    pub(crate) fn storing(&self) -> bool {
        self.stores.is_ok() && self.fits(self.declared.unwrap_or(0))
    }

    /// Whether the answer is stored if its body comes whole and `len` bytes long.
    pub(crate) fn storing_at(&self, len: u64) -> bool {
        self.stores.is_ok() && self.fits(self.declared.unwrap_or(0).max(len))
    }

    /// What a refresh does with the answer: read and store it, or store nothing (the
    /// stale entry stays, and the fleet backs off).
    pub(crate) fn refreshes(&self) -> Result<(), Refused> {
        match self.stores {
            Err(_) if self.failure => Err(Refused::Failure),
            Err(why) => Err(Refused::NotStored(why)),
            Ok(()) if !self.fits(self.declared.unwrap_or(0)) => {
                Err(Refused::NotStored(NotStored::TooLarge))
            }
            Ok(()) => Ok(()),
        }
    }
}

/// Who may have an answer with `headers`, whose head `stores` or not.
fn sharing(
    policy: &Policy,
    headers: &HeaderMap,
    declared: Option<u64>,
    stores: Result<(), NotStored>,
    failure: bool,
) -> Sharing {
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
    if declared.is_some_and(|len| len > SHARED_AT_MOST.max(policy.max_body as u64)) {
        return Sharing::Own(NotStored::TooLarge);
    }
    let never = response::reuse(headers) == Reuse::Never;
    match stores {
        Ok(()) if never => Sharing::StoredOnly,
        Ok(()) => Sharing::Shared,
        Err(why) if why.is_private() => Sharing::Own(why),
        // With credentials in fill requests, whatever is not stored (a 401 for the
        // leader's token, say) is the leader's alone.
        Err(why) if policy.allow_authorization || policy.allow_cookies => Sharing::Own(why),
        Err(_) if never => Sharing::Own(NotStored::NoCache),
        // A failure is shared, so that a crowd does not each ask a failing origin.
        Err(_) if failure => Sharing::Shared,
        // On a route that follows the origin, an answer that it may not keep and that
        // says nothing of caching is each caller's own, as in Varnish and Fastly.
        Err(why) if policy.follow_origin => Sharing::Own(why),
        // On a route the user declared cacheable: a 404 where 200s are stored, say.
        Err(_) => Sharing::Shared,
    }
}

/// Whether an answer that was not stored (for `why`) is its caller's alone: private,
/// `no-cache`, or on a route that forwards credentials.
pub(crate) fn is_own(policy: &Policy, why: NotStored, headers: &HeaderMap) -> bool {
    why.is_private()
        || policy.allow_authorization
        || policy.allow_cookies
        || response::reuse(headers) == Reuse::Never
}
