//! Keeping a lease alive while work runs, within a maximum total duration.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::client::LeaseClient;
use super::outcome::{Lease, RenewOutcome};
use crate::store::StoreError;

/// Why [`LeaseClient::hold_while`] stopped the work.
#[derive(Debug)]
#[non_exhaustive]
pub enum LeaseLost {
    /// A renewal found the lease gone or held by someone else.
    NotOwner,
    /// The maximum total duration was reached.
    MaxDuration,
    /// Renewals failed until the lease may have expired.
    Unconfirmed(StoreError),
}

impl LeaseLost {
    /// The reason's name, as used in logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::NotOwner => "not_owner",
            Self::MaxDuration => "max_duration",
            Self::Unconfirmed(_) => "unconfirmed",
        }
    }
}

impl LeaseClient {
    /// Runs `work` while renewing `lease` every third of its TTL with the owner-checked
    /// script, for at most `max_total` from the acquire.
    ///
    /// The work is dropped (cancelled) and `Err` returned when a renewal says the lease
    /// is someone else's, when renewals fail until the lease may have expired, or when
    /// `max_total` is reached: a watchdog with no cap keeps a hung holder's lease alive
    /// forever. The renewals run inside the returned future, so they can never outlive
    /// the work: when the caller drops the future, or the work panics, renewing stops
    /// and the lease ends by its TTL (at most `max_total` plus one TTL after the
    /// acquire).
    pub async fn hold_while<F: Future>(
        &self,
        lease: &mut Lease,
        max_total: Duration,
        work: F,
    ) -> Result<F::Output, LeaseLost> {
        self.hold(lease, max_total, work, true, None).await
    }

    /// As [`hold_while`](Self::hold_while), telling `validity` the lease's new
    /// [`valid_until`](Lease::valid_until) after every renewal (for work that checks,
    /// between steps, whether it still leads: see [`crate::leader`]).
    pub(crate) async fn hold_while_telling<F: Future>(
        &self,
        lease: &mut Lease,
        max_total: Duration,
        work: F,
        validity: &tokio::sync::watch::Sender<std::time::Instant>,
    ) -> Result<F::Output, LeaseLost> {
        self.hold(lease, max_total, work, true, Some(validity))
            .await
    }

    /// As [`hold_while`](Self::hold_while), but when renewals fail because Redis cannot
    /// be reached, the work goes on without the lease (for work whose result is fenced
    /// anyway, and that would only be redone elsewhere).
    pub(crate) async fn hold_while_reachable<F: Future>(
        &self,
        lease: &mut Lease,
        max_total: Duration,
        work: F,
    ) -> Result<F::Output, LeaseLost> {
        self.hold(lease, max_total, work, false, None).await
    }

    async fn hold<F: Future>(
        &self,
        lease: &mut Lease,
        max_total: Duration,
        work: F,
        cancel_when_unreachable: bool,
        validity: Option<&tokio::sync::watch::Sender<std::time::Instant>>,
    ) -> Result<F::Output, LeaseLost> {
        let deadline = Instant::from_std(lease.acquired_at()) + max_total;
        let ttl = lease.ttl();
        let every = ttl / 3;
        let watchdog = async {
            loop {
                // Wake for the next renewal, the maximum, or the moment the lease may have
                // expired (after failed renewals), whichever comes first.
                let valid_until = Instant::from_std(lease.valid_until());
                tokio::time::sleep_until((Instant::now() + every).min(deadline).min(valid_until))
                    .await;
                if Instant::now() >= deadline {
                    return LeaseLost::MaxDuration;
                }
                match self.renew(lease, ttl).await {
                    RenewOutcome::Renewed => {
                        if let Some(validity) = validity {
                            validity.send_replace(lease.valid_until());
                        }
                    }
                    RenewOutcome::NotOwner => return LeaseLost::NotOwner,
                    RenewOutcome::Failed(error) => {
                        if lease.remaining().is_zero() {
                            if cancel_when_unreachable {
                                return LeaseLost::Unconfirmed(error);
                            }
                            // Stop renewing; let the work finish.
                            std::future::pending::<()>().await;
                        }
                    }
                    // The TTL was valid when the lease was taken; it stays valid.
                    RenewOutcome::Invalid(_) => return LeaseLost::MaxDuration,
                }
            }
        };
        tokio::select! {
            biased;
            output = work => Ok(output),
            lost = watchdog => {
                tracing::debug!(lease = lease.key(), reason = lost.as_str(), "work stopped: lease lost");
                Err(lost)
            }
        }
    }
}
