//! An entry found for a value (in L1, or in Redis): its value, decoded once, and
//! whether it answers now (fresh, or stale while its refresh starts in the background).

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::cache::{Cache, Keyed};
use super::codec::Codec;
use super::fetch::Fetch;
use crate::cache::{Decoded, Stored};
use crate::guard::answer::{Found, Lookup, lookup};
use crate::guard::early;
use crate::guard::origin::Inner;
use crate::guard::refresh::{Started, spawn_refresh};
use crate::keys::CacheKeys;
use crate::metrics::Event;

/// The engine's bounds on a fetch: an origin of requests without a body, whose answers
/// are whole bodies.
pub(crate) trait FetchService: Inner<(), http_body_util::Full<bytes::Bytes>> {}

impl<S: Inner<(), http_body_util::Full<bytes::Bytes>>> FetchService for S {}

impl<C: Codec> Cache<C> {
    /// The value an entry holds: decoded once (by the fill that fetched it, or by the
    /// first caller that reads it); `None` for bytes that are not a `V` (counted, and
    /// logged), which are a miss: see [`forget`](Self::forget).
    pub(crate) fn decoded<V>(&self, stored: &Stored) -> Option<Arc<V>>
    where
        V: DeserializeOwned + Send + Sync + 'static,
    {
        if let Some(Decoded(value)) = stored.value.get() {
            if let Ok(value) = value.clone().downcast::<V>() {
                return Some(value);
            }
        } else if stored.in_parts().is_none() {
            match self.codec.decode::<V>(&stored.response.body) {
                Ok(value) => {
                    let value = Arc::new(value);
                    let _ = stored.value.set(Decoded(value.clone()));
                    return Some(value);
                }
                Err(error) => {
                    let route = &self.route.policy.route;
                    tracing::debug!(route, %error, "a value that does not decode: a miss");
                }
            }
        }
        self.route.stats.record(Event::DecodeFailure);
        None
    }

    /// Forgets an entry whose bytes are not the handle's type: gone from this process's
    /// L1, and from Redis and the fleet's L1, so that the next fill's entry is the one
    /// found (a failed invalidation is counted: the entry then lives out its life).
    pub(crate) async fn forget(&self, keyed: &Keyed) {
        let route = &self.route;
        route.l1().invalidate_response(keyed.local.response);
        if route.invalidate(&keyed.request()).await.is_err() {
            route.stats.record(Event::RedisError);
        }
    }

    /// Whether an entry found `age` old answers: fresh (counted a hit; its early refresh
    /// started when it is due), or stale (counted; its refresh started with a clone of
    /// `fetch`). `false` when it expired. `keys`: the key's Redis keys, if the caller
    /// has them already; `in_l1`: found in L1 (counted an L1 hit with it).
    pub(crate) fn answers<F: Clone>(
        &self,
        stored: &Arc<Stored>,
        age: Duration,
        keyed: &Keyed,
        keys: Option<&CacheKeys>,
        fetch: &F,
        in_l1: bool,
    ) -> bool
    where
        Fetch<F, C>: FetchService,
    {
        let route = &self.route;
        let fresh_for = stored.response.fresh_for;
        let early = early::due(&route.policy.early, &route.recompute, fresh_for, age);
        let found = Found {
            stored,
            age,
            local: keyed.local,
            keys,
            early,
        };
        let lookup = lookup(route, &found);
        if in_l1 && lookup != (Lookup::Fresh { refresh: false }) {
            route.stats.record(Event::L1Hit);
        }
        let fresh = matches!(lookup, Lookup::Fresh { .. });
        let refresh = match lookup {
            Lookup::Fresh { refresh: false } if in_l1 => {
                route.stats.record_fresh_l1_hit();
                return true;
            }
            Lookup::Fresh { refresh } => {
                route.stats.record(Event::Hit);
                refresh
            }
            Lookup::Stale => {
                route.stats.record(Event::Stale);
                true
            }
            Lookup::Expired => return false,
        };
        if refresh {
            let request = keyed.request();
            let fetch = Fetch {
                fetch: fetch.clone(),
                codec: self.codec.clone(),
            };
            match spawn_refresh(route, keyed.local, keys, stored.clone(), &request, &fetch) {
                Started::Now if fresh => route.stats.record(Event::EarlyRefresh),
                // Served stale while one refresh runs: a fetch avoided.
                Started::Running if !fresh => route.stats.record(Event::AvoidedStale),
                _ => {}
            }
        }
        true
    }
}
