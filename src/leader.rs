//! Scheduler leadership: one instance of a fleet runs each tick of a periodic job.
//!
//! Every instance wakes on the job's period and calls [`Leadership::run_once`]. Each
//! tries the job's lease **without waiting**; the one that takes it runs the work, the
//! others skip the tick ([`Tick::Busy`]). The winner's work runs under the lease's
//! watchdog: the lease is renewed every third of its TTL, for at most
//! [`max_term`](LeadershipBuilder::max_term) in all, and the work is stopped (its future
//! dropped) when a renewal finds the lease someone else's, when renewals fail until it
//! may have expired, or at the maximum. Then the lease is released.
//!
//! ```no_run
//! use std::time::Duration;
//! use stampede_guard::keys::{KeySpace, Scope};
//! use stampede_guard::leader::{Leadership, Tick};
//! use stampede_guard::lease::LeaseClient;
//! use stampede_guard::RedisStore;
//!
//! # async fn run(keys: KeySpace, leases: LeaseClient) -> Result<(), Box<dyn std::error::Error>> {
//! let name = keys.lease(&[Scope::label("scheduler")], "quote-expiry")?;
//! let job = Leadership::builder(leases, name)
//!     .lease_ttl(Duration::from_secs(10))
//!     .max_term(Duration::from_secs(60))
//!     .build()?;
//! let mut every = tokio::time::interval(Duration::from_secs(30));
//! loop {
//!     every.tick().await;
//!     match job.run_once(|term| async move {
//!         // 1. record the run durably, fenced by term.token();
//!         // 2. process a bounded batch, each item guarded by its state;
//!         // 3. between items, stop once !term.is_held().
//!     }).await {
//!         Tick::Led { .. } => {}
//!         Tick::Busy => {}          // another instance runs this tick
//!         Tick::Stopped { .. } => {} // the lease was lost, or the term ran out
//!         _ => {}                   // Redis could not say: skipped, safely
//!     }
//! }
//! # }
//! ```
//!
//! # Duplicate runs must be safe
//!
//! The lease makes duplicate runs rare; it cannot make them impossible (see
//! [`crate::lease`]): a leader can pause past its TTL while another takes over, and
//! the first resumes its work for a moment before its next renewal tells it. So the
//! work must be safe to run twice, and the resource must be the judge, not the lease:
//!
//! * **Record the run durably**, fenced by [`Term::token`]: a claim of the tick in the
//!   database (`UPDATE job_state SET last_tick = $2, fencing_token = $3 WHERE job = $1
//!   AND last_tick < $2 AND fencing_token < $3`, with
//!   `stampede_guard::postgres::execute_guarded`). A second leader of the same
//!   tick finds it claimed and stops; a stale leader's claim is refused.
//! * **Process a bounded batch**, each item guarded by its state (`… WHERE id = $1 AND
//!   status = 'pending'`) and by the leader's token against the newest claim, with the
//!   claim's row locked for share (`AND EXISTS (SELECT 1 FROM job_state WHERE job = $2
//!   AND fencing_token <= $3 FOR SHARE)`): an item is done once whoever does it, and a
//!   leader that was taken over is refused at its next item. The share lock orders an
//!   item in flight against a new claim: the new leader's claim waits for that item's
//!   transaction, so an item is always committed under the newest claim at its commit
//!   (a paused leader's open transaction holds the claim back until it ends: bound it
//!   with `idle_in_transaction_session_timeout`). Committed work is never redone; work
//!   left half-way is pending and picked up by the next tick (the job is resumable).
//! * **Check [`Term::is_held`] between items**, and keep each item shorter than the
//!   lease's TTL. Cancellation at an `.await` stops the work too, but a check between
//!   items stops it at a clean point.
//!
//! `examples/scheduler.rs` is the whole pattern on PostgreSQL, and `tests/postgres.rs`
//! runs three instances over many ticks, killing a leader half-way through a batch.
//!
//! # When Redis cannot say
//!
//! An acquire that timed out or failed does **not** run the work ([`Tick::Unavailable`]):
//! a job skipped for one tick is picked up by the next, while two leaders at once is
//! what the lease is there to avoid. An acquire whose reply was lost is released,
//! best-effort, so that the fleet need not wait out its TTL.

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::error::ConfigError;
use crate::keys::LeaseName;
use crate::lease::{AcquireOutcome, FencingToken, LeaseClient, LeaseLost, ReleaseOutcome};
use crate::store::{Operation, StoreError, StoreErrorKind};

/// Default of [`LeadershipBuilder::max_term`].
pub const DEFAULT_MAX_TERM: Duration = Duration::from_secs(60);

/// One periodic job's leadership: its lease, its TTL and the longest a term may last.
/// Cheap to clone; share it between the ticks of one instance.
#[derive(Clone)]
pub struct Leadership {
    leases: LeaseClient,
    name: LeaseName,
    ttl: Duration,
    max_term: Duration,
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("lease", &self.name.key())
            .field("ttl", &self.ttl)
            .field("max_term", &self.max_term)
            .finish_non_exhaustive()
    }
}

impl Leadership {
    /// Starts the leadership of the job whose lease is `name`.
    pub fn builder(leases: LeaseClient, name: LeaseName) -> LeadershipBuilder {
        LeadershipBuilder {
            ttl: leases.lease_ttl(),
            leases,
            name,
            max_term: DEFAULT_MAX_TERM,
        }
    }

    /// The job's lease.
    pub fn lease_name(&self) -> &LeaseName {
        &self.name
    }

    /// One tick: tries the lease without waiting and, if this instance takes it, runs
    /// `work` under it (renewed, capped at the maximum term, stopped when lost), then
    /// releases it. See the [module docs](self) for what `work` must do.
    ///
    /// If `work` panics, or this future is dropped while the work runs, renewals stop
    /// at once and the lease is not released: it ends by its TTL. A [`Term`] says
    /// `is_held() == false` from the moment its term ends, however it ends.
    pub async fn run_once<F, Fut>(&self, work: F) -> Tick<Fut::Output>
    where
        F: FnOnce(Term) -> Fut,
        Fut: Future,
    {
        let operation = self.name.operation_label();
        let mut lease = match self.leases.try_acquire(&self.name, self.ttl).await {
            AcquireOutcome::Acquired(lease) => lease,
            AcquireOutcome::Busy { .. } => {
                crate::metrics::leader_tick(operation, "busy");
                return Tick::Busy;
            }
            AcquireOutcome::TimedOut(attempt) => {
                let error = StoreError::new(Operation::Acquire, StoreErrorKind::Timeout, None);
                let _ = self.leases.release_uncertain(attempt).await;
                crate::metrics::leader_tick(operation, "unavailable");
                return Tick::Unavailable(error);
            }
            AcquireOutcome::Unavailable(error) => {
                crate::metrics::leader_tick(operation, "unavailable");
                return Tick::Unavailable(error);
            }
            // The TTL was checked against the same store when this was built.
            AcquireOutcome::Invalid(_) => {
                crate::metrics::leader_tick(operation, "unavailable");
                return Tick::Unavailable(StoreError::new(
                    Operation::Acquire,
                    StoreErrorKind::Response,
                    None,
                ));
            }
        };
        let token = lease.fencing_token();
        let (validity, valid_until) = watch::channel(lease.valid_until());
        let validity = TermEnds(validity);
        let term = Term {
            token,
            valid_until,
            ends_at: lease.acquired_at() + self.max_term,
        };
        let outcome = self
            .leases
            .hold_while_telling(&mut lease, self.max_term, work(term), &validity.0)
            .await;
        drop(validity);
        // Released on every path that returns: the work ended, or was stopped at the
        // maximum term (still ours), or its lease was lost (the owner check makes that
        // a no-op).
        let released = self.leases.release(lease).await;
        match outcome {
            Ok(output) => {
                crate::metrics::leader_tick(operation, "led");
                Tick::Led {
                    output,
                    token,
                    released,
                }
            }
            Err(reason) => {
                crate::metrics::leader_stopped(operation, reason.as_str());
                Tick::Stopped {
                    token,
                    reason,
                    released,
                }
            }
        }
    }
}

/// Builds a [`Leadership`].
#[must_use]
pub struct LeadershipBuilder {
    leases: LeaseClient,
    name: LeaseName,
    ttl: Duration,
    max_term: Duration,
}

impl fmt::Debug for LeadershipBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeadershipBuilder")
            .field("lease", &self.name.key())
            .field("ttl", &self.ttl)
            .field("max_term", &self.max_term)
            .finish_non_exhaustive()
    }
}

impl LeadershipBuilder {
    /// The lease's TTL (default: the lease client's). It bounds how long the fleet
    /// waits for a leader that died; it is renewed while the leader works. Checked as
    /// every lease TTL is ([`LeaseClientBuilder::lease_ttl`](crate::lease::LeaseClientBuilder::lease_ttl)).
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The longest one term may last, renewals included (default
    /// [`DEFAULT_MAX_TERM`]): at that point the work is stopped. A watchdog without a
    /// maximum keeps a hung leader's lease alive for ever.
    pub fn max_term(mut self, max_term: Duration) -> Self {
        self.max_term = max_term;
        self
    }

    /// Checks the settings, naming the field refused.
    pub fn build(self) -> Result<Leadership, ConfigError> {
        crate::lease::check_ttl("lease_ttl", self.ttl, self.leases.store().command_timeout())?;
        let max_term = ConfigError::nonzero("max_term", self.max_term)?;
        if max_term > crate::lease::MAX_LEASE_TTL {
            return Err(ConfigError::invalid(
                "max_term",
                format!(
                    "{max_term:?} is longer than the longest lease, {:?}",
                    crate::lease::MAX_LEASE_TTL
                ),
            ));
        }
        Ok(Leadership {
            leases: self.leases,
            name: self.name,
            ttl: self.ttl,
            max_term,
        })
    }
}

/// Tells the term's [`Term`]s that it has ended, however it ends (returned, stopped,
/// panicked, dropped): a clone kept past it never says it still leads.
struct TermEnds(watch::Sender<Instant>);

impl Drop for TermEnds {
    fn drop(&mut self) {
        self.0.send_replace(Instant::now());
    }
}

/// What the work of a term is given: its fencing token, and whether it still leads.
#[derive(Debug, Clone)]
pub struct Term {
    token: FencingToken,
    valid_until: watch::Receiver<Instant>,
    ends_at: Instant,
}

impl Term {
    /// The term's fencing token: write it with every durable effect of the work, and
    /// have the resource refuse tokens lower than the newest it has seen.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// Whether the lease surely still holds, by the monotonic clock: before the last
    /// confirmed acquire or renewal plus its TTL, and before the maximum term. `false`
    /// means stop: another instance may lead now.
    pub fn is_held(&self) -> bool {
        !self.remaining().is_zero()
    }

    /// How long the lease surely lasts (zero once it may have ended).
    pub fn remaining(&self) -> Duration {
        let until = (*self.valid_until.borrow()).min(self.ends_at);
        until.saturating_duration_since(Instant::now())
    }
}

/// How one tick of [`Leadership::run_once`] went.
#[derive(Debug)]
#[non_exhaustive]
#[must_use = "a tick may have been skipped or stopped"]
pub enum Tick<T> {
    /// This instance led the tick, and the work ran to its end.
    Led {
        /// What the work returned.
        output: T,
        /// The term's token.
        token: FencingToken,
        /// How the release went (`NotOwner` if the lease had run out by then: the work
        /// ended, but another instance may have started; its effects were fenced).
        released: ReleaseOutcome,
    },
    /// Another instance holds the lease: this tick is theirs.
    Busy,
    /// This instance led, but the work was stopped before its end: the maximum term
    /// was reached ([`LeaseLost::MaxDuration`], a job that needs more time or is hung),
    /// or the lease was lost ([`LeaseLost::NotOwner`], [`LeaseLost::Unconfirmed`]:
    /// another instance may lead now).
    Stopped {
        /// The term's token.
        token: FencingToken,
        /// Why.
        reason: LeaseLost,
        /// How the release went (`Released` at the maximum term; `NotOwner` once lost).
        released: ReleaseOutcome,
    },
    /// Redis could not be asked, or did not answer in time: the work did not run.
    Unavailable(StoreError),
}

impl<T> Tick<T> {
    /// The tick's name, as used in metric labels: `led`, `busy`, `stopped`,
    /// `unavailable`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Led { .. } => "led",
            Self::Busy => "busy",
            Self::Stopped { .. } => "stopped",
            Self::Unavailable(_) => "unavailable",
        }
    }
}
