//! The request headers a URL's responses vary on, learned from their `Vary`, per URL.
//!
//! A response that says `Vary: Accept-Language` is one variant among several: it must
//! never be served to a client whose `Accept-Language` differs, whatever the route was
//! configured to key on. As Varnish keeps the variants of each object apart, each URL
//! (each response's identity: host, path and keyed query) learns the names its
//! responses vary on, and from then on its requests are keyed on their values of them:
//! one URL's `Vary` never moves another URL's entries. A request with none of those
//! headers asks for the URL's own entry (its variant 0), as before anything was learned.
//!
//! The route's keyed headers ([`key_headers`](crate::policy::PolicyBuilder::key_headers))
//! are names every URL of the route varies on from the start, as if learned before its
//! first request (and never kept in Redis nor told: every instance has them from its
//! policy). So a request that sends one of them is keyed to a variant of its URL, and
//! the entries of every value of a keyed header share the URL's identity: its hash slot,
//! its invalidation token and its record of variants, which is what lets one
//! invalidation of the URL (by request, or by path) reach all of them and count them.
//! (Keying them into the URL's identity instead would make each value a URL of its own,
//! which an invalidation by path could only reach through an index of every value seen.)
//!
//! Learned names are kept three ways, so that every instance keys alike from its first
//! request, however long it has been up:
//!
//! * in this process, per route (a bounded map from each URL's local key to its names);
//! * in Redis, beside the URL's entries (the same hash slot): the learner writes them
//!   there, and a read of the URL's own entry reads them back in the same round trip, so
//!   an instance that started later, or missed the notice while its subscription was
//!   down, learns on its first L1 miss;
//! * on the fleet's channel, a notice, for the instances listening now.
//!
//! And every entry is checked against the request by its own `Vary` before it is
//! served ([`Check`]): whatever was learned or missed, an entry answers only a request
//! its `Vary` lets it answer; a mismatch is learned from, and the request keyed again.
//! The hit of a URL that never varied pays for none of this: its entry is found at its
//! variant 0 and varies on nothing.
//!
//! Names only grow, at most [`MAX_LEARNED`] per URL: a response that would need more is
//! not stored.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::HeaderName;

/// How many header names a URL may learn.
pub(crate) const MAX_LEARNED: usize = 8;

/// How many URLs' names a route keeps in memory (Redis keeps them all; one evicted here
/// is read back with its URL's next miss).
const URLS: u64 = 65_536;

/// The names a URL's key is made with, sorted.
pub(crate) type Names = Arc<[HeaderName]>;

/// What one route learned: the names each of its URLs varies on.
pub(crate) struct Learned {
    urls: moka::sync::Cache<u128, Names>,
    /// Whether any URL of the route varies: a route where none does never looks names
    /// up (read without a lock). From the start on a route with keyed headers.
    any: AtomicBool,
    /// The route's keyed headers, sorted: what every URL varies on before it learned
    /// anything (`None` for a route with none).
    keyed: Option<Names>,
}

impl Default for Learned {
    fn default() -> Self {
        Self::new(&[])
    }
}

/// Learning would take the URL past [`MAX_LEARNED`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooMany;

impl Learned {
    /// What a route with keyed headers `keyed` starts from: every URL varies on them.
    pub(crate) fn new(keyed: &[HeaderName]) -> Self {
        let keyed = (!keyed.is_empty()).then(|| {
            let mut names = keyed.to_vec();
            names.sort_by(|a, b| a.as_str().cmp(b.as_str()));
            names.dedup();
            Names::from(names)
        });
        Self {
            urls: moka::sync::Cache::new(URLS),
            any: AtomicBool::new(keyed.is_some()),
            keyed,
        }
    }

    /// Whether any URL of the route varies, as far as this process knows.
    pub(crate) fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// The names URL `response` varies on, if it varies: the route's keyed headers and
    /// what it learned.
    pub(crate) fn names(&self, response: u128) -> Option<Names> {
        if !self.any() {
            return None;
        }
        self.urls.get(&response).or_else(|| self.keyed.clone())
    }

    /// Whether `name` is one of the route's keyed headers (not learned: never kept in
    /// Redis nor told to the fleet).
    pub(crate) fn is_keyed(&self, name: &HeaderName) -> bool {
        self.keyed
            .as_deref()
            .is_some_and(|keyed| keyed.contains(name))
    }

    /// Learns that URL `response` varies on `names` too; returns its names when any was
    /// new.
    pub(crate) fn learn<'a>(
        &self,
        response: u128,
        names: impl IntoIterator<Item = &'a HeaderName>,
    ) -> Result<Option<Names>, TooMany> {
        let names: Vec<&HeaderName> = names.into_iter().collect();
        if names.is_empty() {
            return Ok(None);
        }
        let mut outcome = Ok(None);
        let keyed = self.keyed.as_deref().unwrap_or_default();
        self.urls.entry(response).and_compute_with(|current| {
            let current = current
                .map(|entry| entry.into_value())
                .or_else(|| self.keyed.clone());
            let mut next: Vec<HeaderName> = current.as_deref().unwrap_or_default().to_vec();
            for name in &names {
                if !next.contains(name) {
                    next.push((*name).clone());
                }
            }
            if current.as_ref().is_some_and(|c| c.len() == next.len()) {
                return moka::ops::compute::Op::Nop;
            }
            // The keyed headers do not count: a URL learns up to MAX_LEARNED names.
            if next.len() > MAX_LEARNED + keyed.len() {
                outcome = Err(TooMany);
                return moka::ops::compute::Op::Nop;
            }
            next.sort_by(|a, b| a.as_str().cmp(b.as_str()));
            let next: Names = next.into();
            outcome = Ok(Some(next.clone()));
            moka::ops::compute::Op::Put(next)
        });
        if let Ok(Some(_)) = &outcome {
            self.any.store(true, Ordering::Release);
        }
        outcome
    }
}

/// Whether two sets of names a key was made with are the same.
pub(crate) fn same(a: &Option<Names>, b: &Option<Names>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b) || a == b,
        _ => false,
    }
}

/// An entry checked against a request by its own `Vary` (the names it varies on that
/// the route does not key on anyway).
pub(crate) enum Check {
    /// It may answer the request.
    Serves,
    /// It may not: it varies on these, which the key it was found at did not tell
    /// apart. Learn them, and key the request again.
    Learn(Vec<HeaderName>),
}

/// Checks an entry that varies on `vary`, found at a key made with `keyed` (the URL's
/// own entry when `at_variant_zero`), against a request with `headers`.
///
/// At its variant 0 an entry was filled by a request with none of the names its key
/// was made with, and so none of those it varies on: it answers a request that has
/// none of them either. At a variant, it was filled by a request with the same values
/// of every name its key was made with: it answers if it varies on nothing else.
pub(crate) fn check(
    vary: &[HeaderName],
    keyed: Option<&[HeaderName]>,
    at_variant_zero: bool,
    headers: &http::HeaderMap,
) -> Check {
    let keyed = keyed.unwrap_or_default();
    let unknown: Vec<HeaderName> = vary
        .iter()
        .filter(|name| {
            if at_variant_zero {
                headers.contains_key(*name)
            } else {
                !keyed.contains(name)
            }
        })
        .cloned()
        .collect();
    if unknown.is_empty() {
        Check::Serves
    } else {
        Check::Learn(vary.to_vec())
    }
}

/// The names kept in Redis for a URL, as read back: `None` for anything that is not a
/// list of at most [`MAX_LEARNED`] header names (garbage is ignored, never trusted).
pub(crate) fn parse(record: &str) -> Option<Vec<HeaderName>> {
    let mut names = Vec::new();
    for name in record.split(',').filter(|n| !n.is_empty()) {
        let name = HeaderName::from_bytes(name.as_bytes()).ok()?;
        if !names.contains(&name) {
            names.push(name);
        }
    }
    (names.len() <= MAX_LEARNED).then_some(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_learned_per_url_once_sorted_and_bounded() {
        let learned = Learned::default();
        assert!(!learned.any());
        assert_eq!(learned.names(1), None);
        let lang = HeaderName::from_static("accept-language");
        let enc = HeaderName::from_static("accept-encoding");
        assert_eq!(
            learned.learn(1, [&lang]).unwrap().as_deref(),
            Some(&[lang.clone()][..])
        );
        assert_eq!(learned.learn(1, [&lang]), Ok(None));
        let both = learned.learn(1, [&lang, &enc]).unwrap().unwrap();
        assert_eq!(&*both, &[enc.clone(), lang.clone()]);
        assert!(learned.any());
        // Another URL of the route learned nothing.
        assert_eq!(learned.names(2), None);
        let many: Vec<HeaderName> = (0..MAX_LEARNED)
            .map(|i| HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap())
            .collect();
        assert_eq!(learned.learn(1, &many), Err(TooMany));
        assert_eq!(learned.names(1).unwrap().len(), 2);
    }

    #[test]
    fn keyed_headers_are_names_every_url_varies_on_from_the_start() {
        let lang = HeaderName::from_static("accept-language");
        let tenant = HeaderName::from_static("x-tenant");
        let enc = HeaderName::from_static("accept-encoding");
        let learned = Learned::new(&[tenant.clone(), lang.clone()]);
        assert!(learned.any());
        let keyed = learned.names(1).unwrap();
        assert_eq!(&*keyed, &[lang.clone(), tenant.clone()]);
        assert!(learned.is_keyed(&lang) && !learned.is_keyed(&enc));
        // Nothing new: nothing learned.
        assert_eq!(learned.learn(1, [&lang]), Ok(None));
        let all = learned.learn(1, [&enc]).unwrap().unwrap();
        assert_eq!(&*all, &[enc.clone(), lang.clone(), tenant.clone()]);
        assert_eq!(learned.names(2).as_deref(), Some(&*keyed));
        // The keyed headers do not count against what a URL may learn.
        let many: Vec<HeaderName> = (1..MAX_LEARNED)
            .map(|i| HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap())
            .collect();
        assert!(learned.learn(1, &many).unwrap().is_some());
        assert_eq!(learned.names(1).unwrap().len(), MAX_LEARNED + 2);
    }

    #[test]
    fn an_entry_answers_only_what_its_vary_lets_it() {
        let accept = HeaderName::from_static("accept");
        let json = {
            let mut h = http::HeaderMap::new();
            h.insert(http::header::ACCEPT, "application/json".parse().unwrap());
            h
        };
        let none = http::HeaderMap::new();
        let vary = [accept.clone()];
        // The URL's own entry, varying on Accept: for requests without it.
        assert!(matches!(check(&vary, None, true, &none), Check::Serves));
        assert!(matches!(check(&vary, None, true, &json), Check::Learn(_)));
        // A variant made with Accept: for the requests keyed to it.
        let keyed: Names = vec![accept.clone()].into();
        assert!(matches!(
            check(&vary, Some(&keyed), false, &json),
            Check::Serves
        ));
        // A variant made without a name it varies on: cannot tell.
        let other: Names = vec![HeaderName::from_static("x-tenant")].into();
        assert!(matches!(
            check(&vary, Some(&other), false, &json),
            Check::Learn(_)
        ));
        // An entry that varies on nothing answers anything.
        assert!(matches!(check(&[], None, true, &json), Check::Serves));
    }

    #[test]
    fn records_of_names_are_read_back_and_garbage_is_ignored() {
        assert_eq!(
            parse("accept,accept-language").unwrap(),
            vec![
                HeaderName::from_static("accept"),
                HeaderName::from_static("accept-language")
            ]
        );
        assert_eq!(parse("").unwrap(), Vec::<HeaderName>::new());
        assert!(parse("bad name").is_none());
        assert!(parse(&"x,".repeat(3)).is_some());
        let many: Vec<String> = (0..=MAX_LEARNED).map(|i| format!("x-h{i}")).collect();
        assert!(parse(&many.join(",")).is_none());
    }
}
