//! A value's way through the caches: L1 first (a hit costs a hash, a lookup and a clone
//! of the value's `Arc`), then past it (see `miss`).

use std::future::Future;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::cache::{Cache, Keyed};
use super::codec::Codec;
use super::error::Answer;
use super::fetch::Fetch;
use super::found::FetchService;
use super::miss::Look;
use crate::cache::{Instant, Stored};
use crate::metrics::Event;

impl<C: Codec> Cache<C> {
    /// The value of `keyed` (see [`Values::get_or_fetch`](super::Values::get_or_fetch)).
    pub(crate) async fn get_or_fetch<V, F, Fut, E>(&self, keyed: Keyed, fetch: F) -> Answer<V, E>
    where
        V: Serialize + DeserializeOwned + Send + Sync + 'static,
        F: FnOnce() -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<V, E>> + Send + 'static,
        E: Send + 'static,
    {
        self.route.shared.ensure_listening();
        let fallback = match self.in_l1(&keyed, &fetch) {
            Ok(value) => return Ok(value),
            Err(fallback) => fallback,
        };
        let fetch = Fetch {
            fetch,
            codec: self.codec.clone(),
        };
        self.past_l1(&keyed, fallback, fetch, Look::First).await
    }

    /// A value from L1 if one answers (a fresh one, or a stale one while its refresh
    /// starts); else the entry found, expired, that may stand in later.
    fn in_l1<V, F: Clone>(&self, keyed: &Keyed, fetch: &F) -> Result<Arc<V>, Option<Arc<Stored>>>
    where
        V: DeserializeOwned + Send + Sync + 'static,
        Fetch<F, C>: FetchService,
    {
        let route = &self.route;
        let now = Instant::now();
        let Some(stored) = route
            .l1()
            .get(&keyed.local, now)
            .filter(|s| !route.is_gone(s))
        else {
            route.stats.record(Event::L1Miss);
            return Err(None);
        };
        let Some(value) = self.decoded::<V>(&stored) else {
            // (Read from Redis: Redis holds it too, and the look there forgets it.)
            route.stats.record(Event::L1Miss);
            route.l1().invalidate_response(keyed.local.response);
            return Err(None);
        };
        if self.answers(&stored, stored.age_at(now), keyed, None, fetch, true) {
            return Ok(value);
        }
        Err(Some(stored))
    }
}
