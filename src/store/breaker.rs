//! The circuit breaker: after repeated Redis failures, stop asking Redis at all.
//!
//! While Redis is down or stalled, every operation would wait out its deadline; the
//! breaker turns that into an immediate [`StoreErrorKind::CircuitOpen`], so the layer
//! runs on L1 and its local single-flight without waiting on Redis. While open, one
//! background task pings Redis every probe interval; the first answer closes the
//! breaker. The gauge `stampede_guard_redis_circuit_open` exports its state.
//!
//! It is also where the log hears of Redis, once per change and never per request:
//! Redis answering for the first time (`info`), a first failure with its cause (`warn`,
//! at most once a minute while answers and failures alternate), the breaker opening with
//! the failure that opened it (`warn`: the guard runs local-only from then on), and
//! Redis answering again (`info`, with how long it was away).
//!
//! [`StoreErrorKind::CircuitOpen`]: super::StoreErrorKind::CircuitOpen

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::error::StoreError;
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
    /// What the log last said of Redis (one of the `SAID_` values): read on every
    /// success, so that only a change takes the lock below.
    said: AtomicU8,
    /// When a failure was last logged, and when the breaker last opened.
    times: Mutex<Times>,
}

/// Nothing said yet: the store has not reached Redis.
const SAID_NOTHING: u8 = 0;
/// Redis answers.
const SAID_UP: u8 = 1;
/// Redis failed (once at least) and the breaker is closed.
const SAID_FAILING: u8 = 2;
/// The breaker is open.
const SAID_DOWN: u8 = 3;

/// A failure after answers is logged at most this often: a Redis that fails one command
/// in ten under load would otherwise log as often as it serves.
const FAILURE_LOGGED_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
struct Times {
    failure_logged: Option<Instant>,
    opened: Option<Instant>,
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
            said: AtomicU8::new(SAID_NOTHING),
            times: Mutex::default(),
        }
    }

    /// A breaker that is open for good and never probes: a store without Redis.
    pub(crate) fn always_open() -> Self {
        Self {
            config: BreakerConfig::default(),
            open: AtomicBool::new(true),
            failures: AtomicU32::new(0),
            probing: AtomicBool::new(false),
            said: AtomicU8::new(SAID_DOWN),
            times: Mutex::default(),
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
        match self.said.load(Ordering::Relaxed) {
            SAID_UP | SAID_DOWN => {}
            SAID_NOTHING => {
                if self
                    .said
                    .compare_exchange(SAID_NOTHING, SAID_UP, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    tracing::info!("Redis answers: the cache is shared with the fleet");
                }
            }
            // A failure went by without opening the breaker: nothing to say.
            _ => {
                let _ = self.said.compare_exchange(
                    SAID_FAILING,
                    SAID_UP,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                );
            }
        }
    }

    /// Counts a failure; returns true when this one opened the breaker (the caller then
    /// starts the probe).
    pub(crate) fn failure(&self, error: &StoreError) -> bool {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= self.config.failures && !self.open.swap(true, Ordering::AcqRel) {
            metrics::gauge!(CIRCUIT_OPEN).increment(1.0);
            metrics::counter!(CIRCUIT_OPENED).increment(1);
            self.said.store(SAID_DOWN, Ordering::Release);
            self.times.lock().expect("breaker times lock").opened = Some(Instant::now());
            tracing::warn!(
                failures,
                %error,
                "Redis unavailable: the circuit breaker opened; running local-only \
                 (L1 and one origin call per key per process) until Redis answers"
            );
            return true;
        }
        self.say_failed(error);
        false
    }

    /// An error reply (`NOPERM`, `OOM`, `READONLY`...): not a sign that Redis is away,
    /// so the breaker is left alone, but said as a failure is.
    pub(crate) fn refused(&self, error: &StoreError) {
        self.say_failed(error);
    }

    /// Logs a failure while Redis was answering (or before it ever did), at most once a
    /// minute: the first failure of a run is what says why.
    fn say_failed(&self, error: &StoreError) {
        let said = self.said.load(Ordering::Relaxed);
        if said == SAID_NOTHING || said == SAID_UP {
            let mut times = self.times.lock().expect("breaker times lock");
            let now = Instant::now();
            let quiet = times
                .failure_logged
                .is_none_or(|at| now.duration_since(at) >= FAILURE_LOGGED_EVERY);
            if self
                .said
                .compare_exchange(said, SAID_FAILING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
                && quiet
            {
                times.failure_logged = Some(now);
                tracing::warn!(%error, "Redis failed: going on without it for this operation");
            }
        }
    }

    pub(crate) fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self.open.swap(false, Ordering::AcqRel) {
            metrics::gauge!(CIRCUIT_OPEN).decrement(1.0);
            self.said.store(SAID_UP, Ordering::Release);
            let away = self
                .times
                .lock()
                .expect("breaker times lock")
                .opened
                .take()
                .map(|at| at.elapsed());
            tracing::info!(
                away = ?away.unwrap_or_default(),
                "Redis answers again: the circuit breaker closed; the cache is shared again"
            );
        }
    }
}
