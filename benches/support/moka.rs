//! What the moka benches share: a key of L1's shape and an hour's expiry.

use std::sync::Arc;
use std::time::Duration;

/// A key of L1's size and shape.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub(crate) response: u128,
    pub(crate) variant: u64,
}

/// Key `n` of variant `variant`, spread as L1's keyed hashes are.
pub(crate) fn key(n: u64, variant: u64) -> Key {
    Key {
        response: u128::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835),
        variant,
    }
}

/// Every entry kept an hour (per-entry expiry, as L1 has).
pub(crate) struct Hour;

impl moka::Expiry<Key, Arc<u64>> for Hour {
    fn expire_after_create(
        &self,
        _: &Key,
        _: &Arc<u64>,
        _: std::time::Instant,
    ) -> Option<Duration> {
        Some(Duration::from_secs(3600))
    }
}
