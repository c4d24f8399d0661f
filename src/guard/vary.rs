//! The request headers a route's responses vary on, learned from their `Vary`.
//!
//! A response that says `Vary: Accept-Language` is one variant among several: it must
//! never be served to a client whose `Accept-Language` differs, whatever the route was
//! configured to key on. As Varnish and nginx do, the route learns the names from its
//! responses and keys on them from then on (the key's identity includes each learned
//! header's values). A response that names a header the key did not include when it was
//! fetched is stored under the key it belongs to, computed from the headers the origin
//! saw; callers who waited for that fill and ask for another variant fill their own.
//!
//! What one instance learns it tells the others (a notice on the guard's channel), so a
//! fleet learns once. Learned names only grow, for as long as the process lives, and at
//! most [`MAX_LEARNED`] per route: a response that would need more is not stored.
//!
//! Learning is per route, not per URL (Varnish keeps the variants of each object apart):
//! one URL answering `Vary: User-Agent` keys every URL of the route on it. That costs
//! one fill per entry of the route when a name is learned (their keys change), and
//! fragments the route by the header's values; a header known in advance is better
//! named in `key_headers`. In exchange a hit stays one lookup, whatever varies.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use http::HeaderName;

/// How many header names a route may learn.
pub(crate) const MAX_LEARNED: usize = 8;

/// The names a route has learned.
#[derive(Default)]
pub(crate) struct Learned {
    names: RwLock<Arc<[HeaderName]>>,
    /// Bumped at each change; zero while nothing is learned (the common case, read
    /// without the lock).
    version: AtomicU64,
}

/// Learning would take the route past [`MAX_LEARNED`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooMany;

impl Learned {
    /// The names learned so far, sorted.
    pub(crate) fn names(&self) -> Arc<[HeaderName]> {
        self.names.read().expect("learned lock").clone()
    }

    /// Runs `f` on the names learned so far and their version; on the request path,
    /// without a lock or an allocation while none is learned.
    pub(crate) fn with_names<R>(&self, f: impl FnOnce(&[HeaderName], u64) -> R) -> R {
        if self.version.load(Ordering::Acquire) == 0 {
            return f(&[], 0);
        }
        let names = self.names.read().expect("learned lock");
        // Read under the lock: the version of exactly these names.
        f(&names, self.version.load(Ordering::Acquire))
    }

    /// Changes each time a name is learned.
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Learns `names` (those not known yet); returns whether any was new.
    pub(crate) fn learn<'a>(
        &self,
        names: impl IntoIterator<Item = &'a HeaderName>,
    ) -> Result<bool, TooMany> {
        let mut current = self.names.write().expect("learned lock");
        let mut next: Vec<HeaderName> = current.to_vec();
        for name in names {
            if !next.contains(name) {
                next.push(name.clone());
            }
        }
        if next.len() == current.len() {
            return Ok(false);
        }
        if next.len() > MAX_LEARNED {
            return Err(TooMany);
        }
        next.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        *current = next.into();
        // Bumped under the lock, with the names.
        self.version.fetch_add(1, Ordering::AcqRel);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_learned_once_sorted_and_bounded() {
        let learned = Learned::default();
        assert!(learned.names().is_empty());
        let lang = HeaderName::from_static("accept-language");
        let enc = HeaderName::from_static("accept-encoding");
        assert_eq!(learned.learn([&lang]), Ok(true));
        assert_eq!(learned.learn([&lang]), Ok(false));
        assert_eq!(learned.learn([&lang, &enc]), Ok(true));
        assert_eq!(&*learned.names(), &[enc.clone(), lang.clone()]);
        assert_eq!(learned.version(), 2);
        let many: Vec<HeaderName> = (0..MAX_LEARNED)
            .map(|i| HeaderName::from_bytes(format!("x-h{i}").as_bytes()).unwrap())
            .collect();
        assert_eq!(learned.learn(&many), Err(TooMany));
        assert_eq!(learned.names().len(), 2);
    }
}
