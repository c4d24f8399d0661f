//! What a lease operation came to: a held [`Lease`] with its fencing token, or why not
//! (busy, timed out, unavailable), and how a renewal or a release ended.

use std::fmt;
use std::time::{Duration, Instant};

use super::owner::Owner;
use crate::error::ConfigError;
use crate::keys::LeaseName;
use crate::store::StoreError;

/// A fencing token: a number issued with every lease, larger than every token issued
/// before it for the same lease name (see the [module docs](super) for exactly when).
///
/// Hand it to whatever the lease protects, and have that refuse a write whose token is
/// lower than the last one it accepted: that, not the lease, is what stops a holder whose
/// lease expired from overwriting newer data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// The token as a number.
    pub fn get(self) -> u64 {
        self.0
    }

    /// A token from its number, as stored by a resource that checks tokens.
    pub fn new(token: u64) -> Self {
        Self(token)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A lease this process holds (or held: Redis may have expired it since).
///
/// Dropping a lease does not release it; it then ends by its TTL. Release it with
/// [`LeaseClient::release`](super::LeaseClient::release) when the work is done.
#[derive(Debug)]
pub struct Lease {
    pub(crate) name: LeaseName,
    pub(crate) owner: Owner,
    pub(crate) token: FencingToken,
    pub(crate) acquired_at: Instant,
    pub(crate) ttl: Duration,
    pub(crate) valid_until: Instant,
    /// The route whose cache entry the lease fills, for the `route` label of its
    /// metrics (`None` for a lease taken on its own through the client).
    pub(crate) route: Option<metrics::SharedString>,
}

impl Lease {
    /// The lease's name (its Redis keys).
    pub fn name(&self) -> &LeaseName {
        &self.name
    }

    /// The lease key.
    pub fn key(&self) -> &str {
        self.name.key()
    }

    /// The owner value stored in the lease.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// The fencing token issued with the lease.
    pub fn fencing_token(&self) -> FencingToken {
        self.token
    }

    /// When the acquire was sent, by the monotonic clock. Redis started the TTL after
    /// this, so the lease cannot have ended before `acquired_at + ttl`.
    pub fn acquired_at(&self) -> Instant {
        self.acquired_at
    }

    /// The TTL of the last acquire or renewal.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Until when the lease surely lasts, by the monotonic clock: the send time of the
    /// last successful acquire or renewal plus its TTL. Past it, Redis may have given the
    /// lease to someone else.
    pub fn valid_until(&self) -> Instant {
        self.valid_until
    }

    /// How much of the lease surely remains (zero once it may have expired).
    pub fn remaining(&self) -> Duration {
        self.valid_until.saturating_duration_since(Instant::now())
    }

    /// How long the lease has been held.
    pub fn held_for(&self) -> Duration {
        self.acquired_at.elapsed()
    }

    /// Counts the lease's end (`result`: released, held_off, not_owner, error), and how
    /// long it was held, by operation and, for the guard's leases, route (the labels the
    /// TTL gauge carries too, so that the two compare).
    pub(crate) fn record_end(&self, result: &'static str) {
        crate::metrics::lease_released(
            self.name().operation_label(),
            self.route.clone(),
            self.held_for(),
            result,
        );
    }
}

/// An acquire whose reply never came: Redis may or may not have set the lease.
///
/// The caller must act as if it does not hold the lease. If Redis did set it, it ends by
/// its TTL; [`LeaseClient::release_uncertain`](super::LeaseClient::release_uncertain)
/// can end it sooner, best-effort, since it knows the owner value that was sent.
#[derive(Debug)]
pub struct UncertainAcquire {
    pub(crate) name: LeaseName,
    pub(crate) owner: Owner,
    pub(crate) error: StoreError,
}

impl UncertainAcquire {
    /// The lease's name.
    pub fn name(&self) -> &LeaseName {
        &self.name
    }

    /// What went wrong.
    pub fn error(&self) -> &StoreError {
        &self.error
    }
}

/// What [`try_acquire`](super::LeaseClient::try_acquire) found.
#[derive(Debug)]
#[non_exhaustive]
#[must_use = "a lease that is acquired and not used still blocks others until its TTL"]
pub enum AcquireOutcome {
    /// The lease is ours.
    Acquired(Lease),
    /// Someone else holds it.
    Busy {
        /// How long its TTL still runs, if it has one.
        retry_after: Option<Duration>,
        /// Nobody holds it: its last holder failed and keeps the name taken until then
        /// ([`LeaseClient::hold_off`](super::LeaseClient::hold_off)).
        held_off: bool,
    },
    /// No reply came within the command timeout; the outcome is unknown. Treat it as not
    /// acquired.
    TimedOut(UncertainAcquire),
    /// Redis could not be asked, refused, or failed. Not acquired. When the error says
    /// the outcome is unknown (connection lost in flight), a lease that was set anyway
    /// ends by its TTL.
    Unavailable(StoreError),
    /// The TTL asked for is not acceptable; Redis was not asked.
    Invalid(ConfigError),
}

impl AcquireOutcome {
    /// The lease, if acquired.
    pub fn lease(self) -> Option<Lease> {
        match self {
            Self::Acquired(lease) => Some(lease),
            _ => None,
        }
    }

    /// Whether the lease was acquired.
    pub fn is_acquired(&self) -> bool {
        matches!(self, Self::Acquired(_))
    }

    /// The outcome's name, as used in logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Acquired(_) => "acquired",
            Self::Busy { .. } => "busy",
            Self::TimedOut(_) => "timed_out",
            Self::Unavailable(_) => "unavailable",
            Self::Invalid(_) => "invalid",
        }
    }
}

/// What [`renew`](super::LeaseClient::renew) found.
#[derive(Debug)]
#[non_exhaustive]
#[must_use = "a renewal that failed means the lease may be someone else's"]
pub enum RenewOutcome {
    /// The TTL was extended.
    Renewed,
    /// The lease is gone or someone else holds it: it expired, or was taken over. Stop
    /// the work it protects.
    NotOwner,
    /// Redis failed; whether the lease still holds is unknown.
    Failed(StoreError),
    /// The TTL asked for is not acceptable; Redis was not asked.
    Invalid(ConfigError),
}

impl RenewOutcome {
    /// The outcome's name, as used in logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Renewed => "renewed",
            Self::NotOwner => "not_owner",
            Self::Failed(_) => "error",
            Self::Invalid(_) => "invalid",
        }
    }
}

/// What [`release`](super::LeaseClient::release) found.
#[derive(Debug)]
#[non_exhaustive]
#[must_use]
pub enum ReleaseOutcome {
    /// The lease was ours and is deleted.
    Released,
    /// The lease was gone or someone else's: it expired, or was taken over. Nothing was
    /// deleted.
    NotOwner,
    /// Redis failed; the lease, if still there, ends by its TTL.
    Failed(StoreError),
}

impl ReleaseOutcome {
    /// The outcome's name, as used in logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Released => "released",
            Self::NotOwner => "not_owner",
            Self::Failed(_) => "error",
        }
    }
}
