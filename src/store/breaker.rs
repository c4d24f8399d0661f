//! The circuit breaker: after repeated Redis failures, stop asking Redis at all.
//!
//! While Redis is down or stalled, every operation would wait out its deadline; the
//! breaker turns that into an immediate [`StoreErrorKind::CircuitOpen`], so the layer
//! runs on L1 and its local single-flight without waiting on Redis. While open, one
//! background task pings Redis every probe interval; the first answer closes the
//! breaker. The gauge `stampede_guard_redis_circuit_open` exports its state.
//!
//! Each change of state is told to the log ([`Said`](super::said::Said)).
//!
//! [`StoreErrorKind::CircuitOpen`]: super::StoreErrorKind::CircuitOpen

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use super::error::StoreError;
use super::said::Said;
use crate::error::ConfigError;

use crate::metrics::{CIRCUIT_OPEN, CIRCUIT_OPENED};

/// When the breaker opens, and how it looks for Redis coming back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failed operations that open the breaker (default 5).
    pub failures: u32,
    /// How often an open breaker pings Redis (default 250 ms).
    pub probe_every: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failures: 5,
            probe_every: Duration::from_millis(250),
        }
    }
}

impl BreakerConfig {
    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        if self.failures == 0 {
            return Err(ConfigError::Zero {
                field: "breaker.failures",
            });
        }
        ConfigError::nonzero("breaker.probe_every", self.probe_every)?;
        Ok(())
    }
}

#[derive(Debug)]
pub(crate) struct Breaker {
    config: BreakerConfig,
    open: AtomicBool,
    failures: AtomicU32,
    /// Whether a probe task runs; cleared by the task however it ends, so that a probe
    /// lost with its runtime is started again.
    pub(crate) probing: AtomicBool,
    /// What the log is told of Redis.
    said: Said,
}

impl Breaker {
    pub(crate) fn new(config: BreakerConfig) -> Self {
        // Counted up and down by each store's breaker: other stores leave it alone.
        metrics::gauge!(CIRCUIT_OPEN).increment(0.0);
        Self {
            config,
            open: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            probing: AtomicBool::new(false),
            said: Said::new(),
        }
    }

    /// A breaker that is open for good and never probes: a store without Redis.
    pub(crate) fn always_open() -> Self {
        Self {
            config: BreakerConfig::default(),
            open: AtomicBool::new(true),
            failures: AtomicU32::new(0),
            probing: AtomicBool::new(false),
            said: Said::new(),
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    pub(crate) fn probe_every(&self) -> Duration {
        self.config.probe_every
    }

    pub(crate) fn success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
        self.said.answered();
    }

    /// Counts a failure; returns true when this one opened the breaker (the caller then
    /// starts the probe).
    pub(crate) fn failure(&self, error: &StoreError) -> bool {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= self.config.failures && !self.open.swap(true, Ordering::AcqRel) {
            metrics::gauge!(CIRCUIT_OPEN).increment(1.0);
            metrics::counter!(CIRCUIT_OPENED).increment(1);
            self.said.opened(failures, error);
            return true;
        }
        if !self.is_open() {
            self.said.failed(error);
        }
        false
    }

    /// An error reply (`NOPERM`, `OOM`, `READONLY`...): not a sign that Redis is away,
    /// so the breaker is left alone, but said as a failure is.
    pub(crate) fn refused(&self, error: &StoreError) {
        self.said.failed(error);
    }

    /// A probe of the open breaker failed.
    pub(crate) fn probe_failed(&self, error: &StoreError) {
        self.said.probe_failed(error);
    }

    pub(crate) fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self.open.swap(false, Ordering::AcqRel) {
            metrics::gauge!(CIRCUIT_OPEN).decrement(1.0);
            self.said.closed();
        }
    }
}
