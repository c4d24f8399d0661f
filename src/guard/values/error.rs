//! What a caller of [`Values::get_or_fetch`](crate::Values::get_or_fetch) gets when it
//! gets no value: its own fetch's error, kept whole, or the guard's reason.

use std::fmt;
use std::sync::Arc;

/// What a value, or the guard's reason for none, comes to.
pub(crate) type Answer<V, E> = Result<Arc<V>, ValueError<E>>;

/// No value: the caller's own fetch failed ([`ValueError::Fetch`], its error whole),
/// or the guard had none to give ([`ValueError::Guard`], saying why). Neither is ever
/// cached; a stale value within the route's `stale_if_error` stands in for both.
#[derive(Debug)]
#[non_exhaustive]
pub enum ValueError<E> {
    /// This caller's fetch failed, with this error.
    Fetch(E),
    /// The guard had no value to give.
    Guard(NoValue),
}

/// Why the guard had no value to give.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NoValue {
    /// Another caller's fetch of the key (which this caller waited for) failed; its
    /// error is that caller's.
    #[error("another caller's fetch of this key failed, and no stale value stands in")]
    OtherFetchFailed,
    /// The fetch did not end within the route's refresh timeout (or the watchdog's
    /// maximum).
    #[error("the fetch did not end within the route's refresh timeout")]
    TimedOut,
    /// The watchdog found the key's lease someone else's while the fetch ran.
    #[error("the key's lease was lost while the fetch ran")]
    LeaseLost,
    /// The fetch, or its fill, panicked.
    #[error("the fetch panicked")]
    Panicked,
    /// The fill's task was cancelled (its runtime went away).
    #[error("the fill was cancelled")]
    Cancelled,
    /// The route rejects cold misses it does not fill now (`ColdMiss::Reject`: the fleet
    /// backs off the key, or the refresh budget is spent), and no stale value stands in.
    #[error("the route rejects this cold miss for now")]
    Rejected,
    /// The value the fetch gave could not be encoded.
    #[error("the value could not be encoded: {0}")]
    Encode(String),
    /// The key, encoded, is longer than [`MAX_KEY`](super::MAX_KEY) bytes.
    #[error("the key is {0} bytes encoded, over the limit")]
    KeyTooLong(usize),
}

impl<E: fmt::Display> fmt::Display for ValueError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Fetch(error) => write!(f, "the fetch failed: {error}"),
            Self::Guard(why) => write!(f, "no value: {why}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for ValueError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Fetch(error) => Some(error),
            Self::Guard(why) => Some(why),
        }
    }
}

impl<E> ValueError<E> {
    /// This caller's fetch's error, if that is why.
    pub fn fetch_error(&self) -> Option<&E> {
        match self {
            Self::Fetch(error) => Some(error),
            Self::Guard(_) => None,
        }
    }
}
