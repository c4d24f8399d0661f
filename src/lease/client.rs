//! The lease client: taking, renewing and giving back leases, each one Lua script run
//! within the store's deadline, and the checks of a lease TTL against it.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

use super::outcome::{
    AcquireOutcome, FencingToken, Lease, ReleaseOutcome, RenewOutcome, UncertainAcquire,
};
use super::owner::{Owner, OwnerFactory, default_instance_id};
use super::scripts::{self, AcquireReply, ForFill};
use crate::error::ConfigError;
use crate::keys::{CacheKeys, KeySpace, LeaseName};
use crate::store::{Operation, RedisStore, StoreError, StoreErrorKind};

/// Releases the lease at `key` if its owner value is still `owner` (for the inspection
/// tool, which read the value itself and shows only its holder).
pub(crate) async fn release_if_owner(
    store: &RedisStore,
    key: &str,
    owner: &str,
) -> Result<bool, StoreError> {
    scripts::release(store, key, owner).await
}

/// A lease must last at least this many command timeouts: long enough for an acquire, a
/// renewal and a release to each time out once and still leave the holder time to work.
pub const MIN_TTL_PER_COMMAND_TIMEOUT: u32 = 4;

/// The longest lease accepted. Work that needs longer wants a job queue, not a lease.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// Default TTL of [`LeaseClientBuilder::lease_ttl`].
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(5);

/// Default TTL of the fence counter keys: an hour. Tokens do not depend on the counter
/// living (see the module docs); a short life keeps keys of names never used again,
/// such as one-off cache keys, from piling up.
pub const DEFAULT_FENCE_RETENTION: Duration = Duration::from_secs(60 * 60);

/// What [`LeaseClient::try_acquire_fill`] found.
#[derive(Debug)]
pub(crate) enum Acquire {
    Outcome(AcquireOutcome),
    /// The entry was written since its caller looked: the lease was not taken.
    Written,
}

/// Takes, renews and releases leases in Redis. Cheap to clone.
///
/// See the [module docs](super) for what a lease guarantees.
#[derive(Clone)]
pub struct LeaseClient {
    inner: Arc<Inner>,
}

struct Inner {
    store: RedisStore,
    owners: OwnerFactory,
    lease_ttl: Duration,
    fence_retention: Duration,
}

impl fmt::Debug for LeaseClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseClient")
            .field("store", &self.inner.store)
            .field("lease_ttl", &self.inner.lease_ttl)
            .finish_non_exhaustive()
    }
}

impl LeaseClient {
    /// Starts a client on a store, for the service of a key space.
    pub fn builder(store: RedisStore, keys: &KeySpace) -> LeaseClientBuilder {
        LeaseClientBuilder {
            store,
            service: keys.service().to_owned(),
            instance_id: None,
            lease_ttl: DEFAULT_LEASE_TTL,
            fence_retention: DEFAULT_FENCE_RETENTION,
        }
    }

    /// The store the client talks to.
    pub fn store(&self) -> &RedisStore {
        &self.inner.store
    }

    /// The TTL set with [`LeaseClientBuilder::lease_ttl`].
    pub fn lease_ttl(&self) -> Duration {
        self.inner.lease_ttl
    }

    /// Takes the lease `name` for `ttl` if nobody holds it, in one Lua script that also
    /// issues its fencing token. Never waits for a holder.
    ///
    /// Every attempt has a new owner value. Once acquired, the gauge
    /// [`LEASE_TTL_SECONDS`](crate::metrics::LEASE_TTL_SECONDS) of the name's operation
    /// shows `ttl`, for comparing the lease's hold time against.
    pub async fn try_acquire(&self, name: &LeaseName, ttl: Duration) -> AcquireOutcome {
        let span = tracing::debug_span!("stampede_guard.lease.acquire", lease = name.key());
        match self
            .acquire_inner(name, ttl, None, None)
            .instrument(span)
            .await
        {
            Acquire::Outcome(outcome) => outcome,
            // Only an acquire for a fill looks at an entry (the script gives this reply
            // to no other): a reply that says otherwise is not one of the script's.
            Acquire::Written => AcquireOutcome::Unavailable(StoreError::new(
                Operation::Acquire,
                StoreErrorKind::Response,
                None,
            )),
        }
    }

    /// [`try_acquire`](Self::try_acquire) for the fill of a cache entry, in the same
    /// script: the lease is not taken when the entry was written since its caller looked
    /// (a token newer than `seen`), and the token is ordered against the invalidations
    /// of the entry's response (see `acquire.lua`). The lease's metrics (acquisition,
    /// acquire time, renewals, release, hold time) are labelled with `route` (the name of
    /// the route whose entry it fills).
    pub(crate) async fn try_acquire_fill(
        &self,
        keys: &CacheKeys,
        route: metrics::SharedString,
        ttl: Duration,
        seen: FencingToken,
    ) -> Acquire {
        let name = keys.lease();
        let span = tracing::debug_span!("stampede_guard.lease.acquire", lease = name.key());
        self.acquire_inner(name, ttl, Some((keys, seen)), Some(route))
            .instrument(span)
            .await
    }

    /// Takes the lease; `fill` and `route` are given together, for a fill, and a lease
    /// taken on its own sets the TTL gauge of its operation.
    async fn acquire_inner(
        &self,
        name: &LeaseName,
        ttl: Duration,
        fill: ForFill<'_>,
        route: Option<metrics::SharedString>,
    ) -> Acquire {
        if let Err(error) = self.check_ttl("lease_ttl", ttl) {
            return Acquire::Outcome(AcquireOutcome::Invalid(error));
        }
        let owner = self.inner.owners.next();
        let retention = self.inner.fence_retention.max(ttl * 2);
        let sent_at = Instant::now();
        let store = &self.inner.store;
        let reply = scripts::acquire(store, name, owner.as_str(), ttl, retention, fill).await;
        let outcome = match reply {
            Ok(AcquireReply::Written) => {
                tracing::debug!(lease = name.key(), "lease not taken: the entry was written");
                crate::metrics::lease_acquired(
                    name.operation_label(),
                    route,
                    "written",
                    sent_at.elapsed(),
                );
                return Acquire::Written;
            }
            Ok(AcquireReply::Taken(token)) => {
                if route.is_none() {
                    crate::metrics::lease_ttl(name.operation_label(), ttl);
                }
                AcquireOutcome::Acquired(Lease {
                    name: name.clone(),
                    owner,
                    token: FencingToken::new(token),
                    acquired_at: sent_at,
                    ttl,
                    valid_until: sent_at + ttl,
                    route: route.clone(),
                })
            }
            Ok(AcquireReply::Busy { pttl, held_off }) => AcquireOutcome::Busy {
                retry_after: u64::try_from(pttl).ok().map(Duration::from_millis),
                held_off,
            },
            Ok(AcquireReply::Odd { taken }) => {
                // Not a reply this script gives. If it says the lease was taken (with a
                // token that is not one), the lease is set in Redis: give it back rather
                // than leave the name blocked while reporting a failure.
                if taken {
                    let _ = self.release_owned(name, &owner).await;
                }
                AcquireOutcome::Unavailable(StoreError::new(
                    Operation::Acquire,
                    StoreErrorKind::Response,
                    None,
                ))
            }
            Err(error) if error.kind() == StoreErrorKind::Timeout => {
                AcquireOutcome::TimedOut(UncertainAcquire {
                    name: name.clone(),
                    owner,
                    error,
                })
            }
            Err(error) => AcquireOutcome::Unavailable(error),
        };
        log_acquire(name, &outcome);
        if !matches!(outcome, AcquireOutcome::Invalid(_)) {
            crate::metrics::lease_acquired(
                name.operation_label(),
                route,
                outcome.as_str(),
                sent_at.elapsed(),
            );
        }
        Acquire::Outcome(outcome)
    }

    /// Extends `lease` to `ttl` from now, if it is still ours. On success the lease's
    /// [`valid_until`](Lease::valid_until) moves forward, and the gauge of its
    /// operation's TTL shows `ttl` (as after [`try_acquire`](Self::try_acquire)).
    pub async fn renew(&self, lease: &mut Lease, ttl: Duration) -> RenewOutcome {
        let span =
            tracing::debug_span!("stampede_guard.lease.renew", lease = lease.key().to_owned());
        self.renew_inner(lease, ttl).instrument(span).await
    }

    async fn renew_inner(&self, lease: &mut Lease, ttl: Duration) -> RenewOutcome {
        if let Err(error) = self.check_ttl("lease_ttl", ttl) {
            return RenewOutcome::Invalid(error);
        }
        let sent_at = Instant::now();
        let store = &self.inner.store;
        let outcome = match scripts::renew(store, lease.key(), lease.owner.as_str(), ttl).await {
            Ok(true) => {
                lease.ttl = ttl;
                lease.valid_until = sent_at + ttl;
                // A fill's TTL is its route's (that gauge is set by the route).
                if lease.route.is_none() {
                    crate::metrics::lease_ttl(lease.name.operation_label(), ttl);
                }
                RenewOutcome::Renewed
            }
            Ok(false) => RenewOutcome::NotOwner,
            Err(error) => RenewOutcome::Failed(error),
        };
        tracing::debug!(
            lease = lease.key(),
            token = lease.token.get(),
            outcome = outcome.as_str(),
            "lease renew"
        );
        if !matches!(outcome, RenewOutcome::Invalid(_)) {
            crate::metrics::lease_renewed(
                lease.name.operation_label(),
                lease.route.clone(),
                outcome.as_str(),
            );
        }
        outcome
    }

    /// Gives `lease` back, if it is still ours. A lease that expired and was taken by
    /// someone else is left alone ([`ReleaseOutcome::NotOwner`]).
    pub async fn release(&self, lease: Lease) -> ReleaseOutcome {
        let span = tracing::debug_span!("stampede_guard.lease.release", lease = lease.key());
        let outcome = self
            .release_owned(&lease.name, &lease.owner)
            .instrument(span)
            .await;
        lease.record_end(outcome.as_str());
        tracing::debug!(
            lease = lease.key(),
            token = lease.token.get(),
            held_ms = lease.held_for().as_millis() as u64,
            outcome = outcome.as_str(),
            "lease release"
        );
        outcome
    }

    /// [`release`](Self::release), but a lease whose release Redis failed (a connection
    /// that was killed fails the command in flight; the next gets a new one) is handed
    /// back, to be released again: for a holder that must not leave its lease to run out
    /// by its TTL, keeping every other instance away from work nobody does.
    pub(crate) async fn release_or_keep(&self, lease: Lease) -> Result<ReleaseOutcome, Lease> {
        let outcome = self.release_owned(&lease.name, &lease.owner).await;
        if matches!(outcome, ReleaseOutcome::Failed(_)) {
            return Err(lease);
        }
        lease.record_end(outcome.as_str());
        tracing::debug!(
            lease = lease.key(),
            token = lease.token.get(),
            outcome = outcome.as_str(),
            "lease release"
        );
        Ok(outcome)
    }

    /// Gives `lease` up to nobody, if it is still ours: the name stays taken for `ttl`
    /// (acquires answer [`Busy`](AcquireOutcome::Busy) with `held_off: true`), then ends
    /// by itself. For keeping the fleet away from work that just failed, without having
    /// to come back to release it.
    ///
    /// [`Released`](ReleaseOutcome::Released) when it was ours (it is held off now),
    /// [`NotOwner`](ReleaseOutcome::NotOwner) when it was gone or someone else's.
    pub async fn hold_off(&self, lease: Lease, ttl: Duration) -> ReleaseOutcome {
        if self.check_ttl("hold_off", ttl).is_err() {
            // A TTL the client would refuse: give the lease back plainly instead.
            return self.release(lease).await;
        }
        let store = &self.inner.store;
        let outcome = match scripts::hold_off(store, lease.key(), lease.owner.as_str(), ttl).await {
            Ok(true) => ReleaseOutcome::Released,
            Ok(false) => ReleaseOutcome::NotOwner,
            Err(error) => ReleaseOutcome::Failed(error),
        };
        lease.record_end(match outcome {
            ReleaseOutcome::Released => "held_off",
            _ => outcome.as_str(),
        });
        tracing::debug!(
            lease = lease.key(),
            token = lease.token.get(),
            outcome = outcome.as_str(),
            "lease held off"
        );
        outcome
    }

    /// Ends, best-effort, the lease an acquire may have set before its reply was lost.
    /// `NotOwner` means it was not set, or has already ended.
    ///
    /// Sent once, never retried: a release is only safe because it checks the owner.
    pub async fn release_uncertain(&self, attempt: UncertainAcquire) -> ReleaseOutcome {
        let outcome = self.release_owned(&attempt.name, &attempt.owner).await;
        tracing::debug!(
            lease = attempt.name.key(),
            outcome = outcome.as_str(),
            "uncertain lease release"
        );
        outcome
    }

    async fn release_owned(&self, name: &LeaseName, owner: &Owner) -> ReleaseOutcome {
        match scripts::release(&self.inner.store, name.key(), owner.as_str()).await {
            Ok(true) => ReleaseOutcome::Released,
            Ok(false) => ReleaseOutcome::NotOwner,
            Err(error) => ReleaseOutcome::Failed(error),
        }
    }

    fn check_ttl(&self, field: &'static str, ttl: Duration) -> Result<(), ConfigError> {
        check_ttl(field, ttl, self.inner.store.command_timeout())
    }
}

pub(crate) fn check_ttl(
    field: &'static str,
    ttl: Duration,
    command_timeout: Duration,
) -> Result<(), ConfigError> {
    ConfigError::nonzero(field, ttl)?;
    let min = command_timeout * MIN_TTL_PER_COMMAND_TIMEOUT;
    if ttl < min {
        return Err(ConfigError::TooShort {
            field,
            value: ttl,
            min,
            why: "a lease must last several Redis command timeouts (MIN_TTL_PER_COMMAND_TIMEOUT)",
        });
    }
    if ttl > MAX_LEASE_TTL {
        return Err(ConfigError::invalid(
            field,
            format!("{ttl:?} is longer than the longest lease, {MAX_LEASE_TTL:?}"),
        ));
    }
    if !ttl.subsec_nanos().is_multiple_of(1_000_000) {
        return Err(ConfigError::invalid(
            field,
            format!("{ttl:?} is not a whole number of milliseconds"),
        ));
    }
    Ok(())
}

/// Logs an acquire without the owner value: the holder (service and instance) at most.
fn log_acquire(name: &LeaseName, outcome: &AcquireOutcome) {
    match outcome {
        AcquireOutcome::Acquired(lease) => tracing::debug!(
            lease = name.key(),
            token = lease.token.get(),
            holder = lease.owner.holder(),
            "lease acquired"
        ),
        // At `debug`: the store says once when Redis fails, and why; an acquire that
        // fails with it is one of many.
        AcquireOutcome::TimedOut(attempt) => tracing::debug!(
            lease = name.key(),
            error = %attempt.error,
            "lease acquire timed out; outcome unknown, treated as not acquired"
        ),
        AcquireOutcome::Unavailable(error) => tracing::debug!(
            lease = name.key(),
            %error,
            "lease acquire failed"
        ),
        other => tracing::debug!(
            lease = name.key(),
            outcome = other.as_str(),
            "lease acquire"
        ),
    }
}

/// Builds a [`LeaseClient`].
#[must_use]
pub struct LeaseClientBuilder {
    store: RedisStore,
    service: String,
    instance_id: Option<String>,
    lease_ttl: Duration,
    fence_retention: Duration,
}

impl fmt::Debug for LeaseClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseClientBuilder")
            .field("service", &self.service)
            .field("instance_id", &self.instance_id)
            .field("lease_ttl", &self.lease_ttl)
            .field("fence_retention", &self.fence_retention)
            .finish_non_exhaustive()
    }
}

impl LeaseClientBuilder {
    /// The instance part of owner values: a pod or host name, 1 to 64 characters of
    /// `A-Z a-z 0-9 . _ -`. By default, the process id and a random suffix.
    pub fn instance_id(mut self, id: impl Into<String>) -> Self {
        self.instance_id = Some(id.into());
        self
    }

    /// The usual lease TTL (default 5 s). Checked at build against the store's command
    /// timeout: it must be at least [`MIN_TTL_PER_COMMAND_TIMEOUT`] times as long, at most
    /// [`MAX_LEASE_TTL`], in whole milliseconds. TTLs given to each call are checked the
    /// same way.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// How long a fence counter outlives the last lease taken on its name (default 1 h,
    /// and never less than twice the lease's TTL). Tokens stay increasing when the counter
    /// expires (see the [module docs](super)); the counter only guards against a server
    /// clock that steps back, so it need not live forever.
    pub fn fence_retention(mut self, retention: Duration) -> Self {
        self.fence_retention = retention;
        self
    }

    /// Checks the settings and builds the client. Connects nothing.
    pub fn build(self) -> Result<LeaseClient, ConfigError> {
        check_ttl("lease_ttl", self.lease_ttl, self.store.command_timeout())?;
        let fence_retention = ConfigError::nonzero("fence_retention", self.fence_retention)?;
        let instance = self.instance_id.unwrap_or_else(default_instance_id);
        let owners = OwnerFactory::new(&self.service, &instance)?;
        Ok(LeaseClient {
            inner: Arc::new(Inner {
                store: self.store,
                owners,
                lease_ttl: self.lease_ttl,
                fence_retention,
            }),
        })
    }
}
