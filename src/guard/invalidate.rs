//! Why an invalidation by path ([`GuardLayer::invalidate_path`](super::GuardLayer::invalidate_path))
//! did not reach the fleet.

use crate::store::StoreError;

/// An invalidation by path ([`GuardLayer::invalidate_path`](super::GuardLayer::invalidate_path))
/// was refused, or reached only this process.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidateError {
    /// What was given is not a path (from `/`, with its query if any) nor an absolute
    /// URI. Nothing was invalidated.
    #[error("`{given}` is not a path from `/` (with its query) nor an absolute URI")]
    NotAPath {
        /// What was given (its first 200 characters).
        given: String,
    },
    /// The route keys on the host ([`key_host`](crate::policy::PolicyBuilder::key_host),
    /// on by default) and the URI named none: whose entries to invalidate is unknown.
    /// Give an absolute URI (`https://shop.example/items/7`). Nothing was invalidated.
    #[error(
        "route `{route}` keys on the host: give an absolute URI (https://host/path), not a path alone"
    )]
    HostNeeded {
        /// The route's name.
        route: String,
    },
    /// Redis failed: this process's L1 dropped the entries, but L2 and the other
    /// instances keep theirs until they expire.
    #[error("only this process invalidated: {0}")]
    Store(#[from] StoreError),
}
