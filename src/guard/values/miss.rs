//! A value that L1 does not answer: what the fleet's marks say, Redis, then the key's
//! fill (the engine's cold path: one fetch for the fleet), and what each caller gets
//! from how it landed (the engine's one decision, `reply`, carried out as a value).

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use http_body_util::{BodyExt, Full};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::cache::{Cache, Keyed};
use super::codec::Codec;
use super::error::{Answer, NoValue, ValueError};
use super::fetch::{Fetch, Fetched};
use crate::cache::{L2Read, Stored};
use crate::guard::body::ResponseBody;
use crate::guard::cold::{Caller, Redis, Waited, join, stands_in, wait_landed};
use crate::guard::inflight::{Failure, Landed, Own};
use crate::guard::marks::{Says, says};
use crate::guard::reply::{Fit, Reply, Waiter, reply};
use crate::http::request::{Asked, Kind};
use crate::keys::CacheKeys;
use crate::metrics::Event;
use crate::policy::ColdMiss;

/// How many times a caller looks again (the fill it waited for stood aside for
/// another caller's sake) before it fetches on its own, uncached.
const MAX_LOOKS: usize = 3;

/// Whether a caller looks at the fleet's marks and in Redis before its key's fill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Look {
    First,
    /// Not: a value being set is filled at once.
    Skip,
}

/// What a caller does after its key's fill landed.
enum Then<V, E> {
    Answer(Answer<V, E>),
    /// Fetch on its own, uncached.
    Alone,
    /// Look again: the fill stood aside for its leader's sake.
    Again,
}

/// What a look in Redis came to.
enum Looked<V> {
    /// An entry, and its value.
    Found(Arc<Stored>, Arc<V>),
    Nothing,
    /// The read failed: the caller's fill does not wait on Redis again.
    Failed,
}

impl<C: Codec> Cache<C> {
    /// The value of `keyed` past L1 (see the [module docs](self)); `fallback`: an entry
    /// L1 holds, expired, that may stand in if the fetch fails. `look`: whether the
    /// fleet's marks and Redis are looked at first (not for a value being set: its fill
    /// goes ahead at once).
    pub(crate) async fn past_l1<V, F, Fut, E>(
        &self,
        keyed: &Keyed,
        mut fallback: Option<Arc<Stored>>,
        fetch: Fetch<F, C>,
        look: Look,
    ) -> Answer<V, E>
    where
        V: Serialize + DeserializeOwned + Send + Sync + 'static,
        F: FnOnce() -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<V, E>> + Send + 'static,
        E: Send + 'static,
    {
        let route = &self.route;
        let request = keyed.request();
        let Some(keys) = route.keys_for(&request) else {
            // A key space whose keys would be too long: fetched, not cached.
            return self.alone(fetch.fetch).await;
        };
        let headers = HeaderMap::new();
        for _ in 0..MAX_LOOKS {
            let mut redis = match self.marked(&keys, &fallback) {
                _ if look == Look::Skip && route.shared.store.is_local_only() => Redis::Failed,
                _ if look == Look::Skip => Redis::Usable,
                Ok(redis) => redis,
                Err(Some(stale)) => return Ok(stale),
                Err(None) => return self.alone(fetch.fetch).await,
            };
            // Registered before the look in Redis: a notice of another instance's fill
            // cannot slip by.
            let wait = route.shared.notices.wait_for(keys.entry().into());
            if redis == Redis::Usable && look == Look::First {
                match self.in_l2(keyed, &keys).await {
                    // (Answered now, if it may: a stale one starts its refresh.)
                    Looked::Found(stored, value) => {
                        let age = stored.age();
                        if self.answers(&stored, age, keyed, Some(&keys), &fetch.fetch, false) {
                            return Ok(value);
                        }
                        // Else it may stand in later, as the newest one found.
                        if fallback
                            .as_ref()
                            .is_none_or(|f| f.response.token < stored.response.token)
                        {
                            fallback = Some(stored);
                        }
                    }
                    Looked::Failed => redis = Redis::Failed,
                    Looked::Nothing => {}
                }
            }
            let caller = Caller {
                asked: Asked {
                    kind: Kind::Get,
                    conditional: false,
                    ranged: false,
                },
                headers: &headers,
                keys: &keys,
                fallback: &fallback,
                redis,
            };
            let mut flight = join(route, &fetch, &request, &caller, wait);
            let waited = wait_landed(route, &mut flight, &fallback).await;
            match self.landed(waited, keyed, &fallback).await {
                Then::Answer(answer) => return answer,
                Then::Alone => break,
                // (Looks again.)
                Then::Again => {}
            }
        }
        route.stats.record(Event::Pass);
        self.alone(fetch.fetch).await
    }

    /// What the fleet's mark on the key says: `Ok`, how the caller may use Redis;
    /// `Err(Some)`, the stale value that stands in (the origin just failed); `Err(None)`,
    /// fetch alone (the key's last answer here was its caller's alone).
    fn marked<V>(
        &self,
        keys: &CacheKeys,
        fallback: &Option<Arc<Stored>>,
    ) -> Result<Redis, Option<Arc<V>>>
    where
        V: DeserializeOwned + Send + Sync + 'static,
    {
        let route = &self.route;
        let stands_in = || fallback.as_ref().is_some_and(|f| route.serves_on_error(f));
        match says(route.shared.marks.get(keys.entry()), stands_in) {
            Says::Look if route.shared.store.is_local_only() => Ok(Redis::Failed),
            Says::Look => Ok(Redis::Usable),
            Says::Passing => {
                route.stats.record(Event::HitForPass);
                Ok(Redis::Passing)
            }
            Says::Pass => {
                route.stats.record(Event::HitForPass);
                Err(None)
            }
            Says::StandIn => Err(Some(self.stand_in(fallback).ok_or(None)?)),
        }
    }

    /// The value of the entry that stands in for a failed fetch (counted).
    fn stand_in<V>(&self, fallback: &Option<Arc<Stored>>) -> Option<Arc<V>>
    where
        V: DeserializeOwned + Send + Sync + 'static,
    {
        let stored = fallback.as_ref()?;
        let value = stored.value.get()?.0.clone().downcast::<V>().ok()?;
        self.route.stats.record(Event::StaleIfError);
        self.route.stats.record(Event::Stale);
        Some(value)
    }

    /// Looks in Redis: an entry that decodes is put in L1, and given back with its
    /// value; one that does not is forgotten (a miss).
    async fn in_l2<V>(&self, keyed: &Keyed, keys: &CacheKeys) -> Looked<V>
    where
        V: DeserializeOwned + Send + Sync + 'static,
    {
        let route = &self.route;
        let stored = match route.read_l2_whole(keys).await {
            Ok(L2Read::Found(stored)) if !route.is_gone(&stored) => stored,
            Ok(L2Read::Garbage(_)) => {
                route.stats.record(Event::DecodeFailure);
                route.stats.record(Event::L2Miss);
                return Looked::Nothing;
            }
            Ok(_) => {
                route.stats.record(Event::L2Miss);
                return Looked::Nothing;
            }
            Err(_) => {
                route.stats.record(Event::RedisError);
                return Looked::Failed;
            }
        };
        let Some(value) = self.decoded::<V>(&stored) else {
            route.stats.record(Event::L2Miss);
            self.forget(keyed).await;
            return Looked::Nothing;
        };
        route.stats.record(Event::L2Hit);
        route.put_l1(keys, stored.clone()).await;
        Looked::Found(stored, value)
    }

    /// What a caller does with how its key's fill landed (see `reply`).
    async fn landed<V, E>(
        &self,
        waited: Waited<Full<Bytes>, Fetched<E>>,
        keyed: &Keyed,
        fallback: &Option<Arc<Stored>>,
    ) -> Then<V, E>
    where
        V: DeserializeOwned + Send + Sync + 'static,
    {
        let route = &self.route;
        let (landed, own, is_leader) = match waited {
            Waited::Landed {
                landed,
                own,
                is_leader,
            } => (landed, own, is_leader),
            Waited::SoftTimedOut(stale) => match self.decoded::<V>(&stale) {
                Some(value) => return Then::Answer(Ok(value)),
                None => return Then::Alone,
            },
            Waited::Stuck => return Then::Answer(self.failed(fallback, Failure::Timeout)),
        };
        let waiter = Waiter {
            is_leader,
            has_own: own.is_some(),
            stands_in: stands_in(route, &landed, fallback),
            rejects: matches!(route.policy.cold_miss, ColdMiss::Reject { .. }),
            fit: Fit::Serves,
        };
        let then = self
            .carried_out(reply(&landed, waiter), &landed, own, keyed, fallback)
            .await;
        if !is_leader && matches!(then, Then::Answer(_)) {
            route.stats.record(Event::Coalesced);
        }
        then
    }

    /// Carries out the reply a caller gets.
    async fn carried_out<V, E>(
        &self,
        reply: Reply,
        landed: &Landed,
        own: Option<Own<Full<Bytes>, Fetched<E>>>,
        keyed: &Keyed,
        fallback: &Option<Arc<Stored>>,
    ) -> Then<V, E>
    where
        V: DeserializeOwned + Send + Sync + 'static,
    {
        let route = &self.route;
        match (reply, landed, own) {
            (Reply::Entry, Landed::Entry { stored, .. }, _) => {
                route.stats.record(Event::Miss);
                match self.decoded(stored) {
                    Some(value) => Then::Answer(Ok(value)),
                    // Bytes that landed meanwhile, of another type: forgotten, and
                    // filled again.
                    None => {
                        self.forget(keyed).await;
                        Then::Again
                    }
                }
            }
            (Reply::Shared, Landed::Shared { response, .. }, _) => {
                let Some(reader) = response.body.join() else {
                    route.stats.record(Event::FillTooLate);
                    return Then::Alone;
                };
                route.stats.record(response.event());
                self.read(ResponseBody::<Full<Bytes>>::shared(reader)).await
            }
            (Reply::Own, _, Some(Ok(response))) => self.read(response.into_body()).await,
            (Reply::Own, _, Some(Err(Fetched::Failed(error)))) => {
                Then::Answer(Err(ValueError::Fetch(error)))
            }
            (Reply::Own, _, Some(Err(Fetched::Encode(error)))) => {
                Then::Answer(Err(ValueError::Guard(NoValue::Encode(error.0))))
            }
            (Reply::StandIn, Landed::Failed(failure), _) => {
                Then::Answer(self.failed(fallback, *failure))
            }
            (Reply::StandIn, ..) => Then::Answer(self.failed(fallback, Failure::Error)),
            (Reply::Failed(failure), ..) => Then::Answer(self.failed(fallback, failure)),
            (Reply::Rejected, ..) => {
                route.stats.record(Event::Rejected);
                Then::Answer(Err(ValueError::Guard(NoValue::Rejected)))
            }
            (Reply::Rekey, ..) => Then::Again,
            (Reply::PassThrough | Reply::Entry | Reply::Shared | Reply::Own, ..) => Then::Alone,
        }
    }

    /// A value read whole from an answer's body, decoded.
    async fn read<V, E>(&self, body: ResponseBody<Full<Bytes>>) -> Then<V, E>
    where
        V: DeserializeOwned + Send + Sync + 'static,
    {
        let Ok(bytes) = body.collect().await.map(|whole| whole.to_bytes()) else {
            return Then::Answer(Err(ValueError::Guard(NoValue::OtherFetchFailed)));
        };
        match self.codec.decode::<V>(&bytes) {
            Ok(value) => Then::Answer(Ok(Arc::new(value))),
            Err(_) => {
                self.route.stats.record(Event::DecodeFailure);
                Then::Alone
            }
        }
    }

    /// The fetch failed with nothing to share: the value that may stand in, or the
    /// guard's reason.
    fn failed<V, E>(&self, fallback: &Option<Arc<Stored>>, failure: Failure) -> Answer<V, E>
    where
        V: DeserializeOwned + Send + Sync + 'static,
    {
        if fallback
            .as_ref()
            .is_some_and(|f| self.route.serves_on_error(f))
            && let Some(value) = self.stand_in(fallback)
        {
            return Ok(value);
        }
        self.route.stats.record(Event::OriginFailed);
        Err(ValueError::Guard(match failure {
            Failure::Error => NoValue::OtherFetchFailed,
            Failure::Timeout => NoValue::TimedOut,
            Failure::LeaseLost => NoValue::LeaseLost,
            Failure::Panicked => NoValue::Panicked,
            Failure::Cancelled => NoValue::Cancelled,
        }))
    }

    /// Fetches on its own, uncached (counted as a call to the origin), bounded by the
    /// route's pass timeout.
    pub(crate) async fn alone<V, F, Fut, E>(&self, fetch: F) -> Answer<V, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<V, E>>,
    {
        let route = &self.route;
        route.stats.record(Event::OriginCall);
        match tokio::time::timeout(route.policy.pass_timeout, fetch()).await {
            Ok(Ok(value)) => Ok(Arc::new(value)),
            Ok(Err(error)) => Err(ValueError::Fetch(error)),
            Err(_) => {
                route.stats.record(Event::OriginTimeout);
                Err(ValueError::Guard(NoValue::TimedOut))
            }
        }
    }
}
