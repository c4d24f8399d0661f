//! What each caller of a cold fill gets from how the fill landed: the one decision,
//! made here ([`reply`]) from the landing and a few facts about the caller, and carried
//! out by the cold path (`cold::landed`); and what a refresh, a fill with no caller,
//! leaves behind ([`backs_off`]). Pure: its rules are unit-tested in `reply/tests.rs`,
//! row by row of the module docs' "every way a fill ends" table.

use super::inflight::{Failure, Landed};

#[cfg(test)]
mod tests;

/// What the decision needs to know of a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Waiter {
    /// It led the fill: the origin saw its request.
    pub(crate) is_leader: bool,
    /// It led, and has what only the leader may have: an answer of its own, or the
    /// inner service's error.
    pub(crate) has_own: bool,
    /// It has an entry that may stand in for a failed origin (stale-if-error).
    pub(crate) stands_in: bool,
    /// Its route answers a cold miss it will not fill with `503` (`ColdMiss::Reject`).
    pub(crate) rejects: bool,
    /// Whether what the fill landed with is an answer to its request (see [`Fit`]).
    pub(crate) fit: Fit,
}

/// Whether an entry or an answer a fill landed with answers a caller's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fit {
    /// It does.
    Serves,
    /// It is another variant's (it varies on a header the caller sent otherwise).
    Other,
    /// It does, but is revalidated on every use (`no-cache`): only its leader's.
    EachUse,
}

/// What a caller gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reply {
    /// The entry the fill landed with.
    Entry,
    /// The answer the fill shares, as its body streams.
    Shared,
    /// What only the leader may have: its own answer, or the inner service's error.
    Own,
    /// The entry that may stand in for the failed origin.
    StandIn,
    /// The guard's own answer for how the origin failed (`502`, `504`, `503`).
    Failed(Failure),
    /// The route's `503`: the fill stood aside, and nothing stands in.
    Rejected,
    /// It asks the origin itself.
    PassThrough,
    /// It looks again, under its own key.
    Rekey,
}

/// What a caller (`waiter`) gets from how a fill `landed` (see the module docs of
/// `guard`, "Every way a fill ends").
pub(crate) fn reply(landed: &Landed, waiter: Waiter) -> Reply {
    let others = !waiter.is_leader;
    match landed {
        Landed::Entry { .. } => match waiter.fit {
            Fit::Other => Reply::Rekey,
            // Revalidated on every use: each other caller asks the origin itself.
            Fit::EachUse if others => Reply::PassThrough,
            Fit::Serves | Fit::EachUse => Reply::Entry,
        },
        Landed::Shared {
            response, failure, ..
        } => {
            if *failure && waiter.stands_in {
                Reply::StandIn
            } else if others && response.leader_only {
                Reply::PassThrough
            } else if others && waiter.fit == Fit::Other {
                Reply::Rekey
            } else {
                Reply::Shared
            }
        }
        // Private to the caller that made it: every other asks the origin itself.
        Landed::Pass if waiter.has_own => Reply::Own,
        Landed::Pass => Reply::PassThrough,
        Landed::Failed(_) if waiter.stands_in => Reply::StandIn,
        Landed::Failed(_) if waiter.has_own => Reply::Own,
        Landed::Failed(failure) => Reply::Failed(*failure),
        // The fill stood aside for its leader's sake (an entry it may serve, or the
        // route rejects): a caller with nothing to serve on a route that passes cold
        // misses through looks again, and fills (one call for its process) rather than
        // being refused for what another caller had.
        Landed::StoodAside if !waiter.rejects && !waiter.stands_in => Reply::Rekey,
        Landed::StoodAside if waiter.stands_in => Reply::StandIn,
        Landed::StoodAside => Reply::Rejected,
        Landed::Rekey if waiter.has_own => Reply::Own,
        Landed::Rekey => Reply::Rekey,
    }
}

/// Whether the fleet's origin is left alone for the route's back-off after a refresh
/// that landed so: not after an entry (stored, renewed, or one that landed meanwhile),
/// nor after another variant's answer (nothing failed); after anything else, yes: the
/// stale entry stays, and stands in meanwhile.
pub(crate) fn backs_off(landed: &Landed) -> bool {
    !matches!(landed, Landed::Entry { .. } | Landed::Rekey)
}
