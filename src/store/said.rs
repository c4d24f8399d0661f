//! What the log says of Redis: each change of its state once, never per request.
//!
//! - Redis answering for the first time (`info`).
//! - A first failure, with its cause (`warn`). Then nothing more of failures until a
//!   minute has passed and Redis answered again: a Redis that fails one command in ten
//!   under load says so once a minute, not as often as it fails.
//! - The breaker opening, with the failure that opened it (`warn`: local-only from then
//!   on); if that failure did not say why (a connect still in progress when its deadline
//!   came), the first probe that fails with a cause says it (`warn`, once).
//! - The breaker closing, with how long Redis was away (`info`).
//!
//! A breaker that opens again within a minute of the last opening it said (a Redis slow
//! enough to time out five commands, fast enough to answer the probe) says nothing of
//! that opening nor of its closing until the minute is over: then the next opening, or
//! a probe that fails while it is still open, says it, counting those in between.
//!
//! All of it is atomics: an answer costs two relaxed loads while nothing changes, and a
//! read of the clock in the minute after a failure.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use super::error::StoreError;

/// How often a failure, or an opening, is said at most.
const EVERY_MS: u64 = 60_000;

/// No failure being said (in `failing_since`), or never (in `open_said_at`).
const NONE: u64 = u64::MAX;

#[derive(Debug)]
pub(crate) struct Said {
    /// What the times below count from.
    born: Instant,
    /// Whether Redis answered once: said the first time.
    answered: AtomicBool,
    /// Since when (ms from `born`) failures are said no more, or [`NONE`].
    failing_since: AtomicU64,
    /// When an opening was last said (ms from `born`), or [`NONE`].
    open_said_at: AtomicU64,
    /// When the breaker last opened (ms from `born`).
    opened_at: AtomicU64,
    /// Whether the breaker's current opening was said (its closing is said only then).
    open_said: AtomicBool,
    /// Whether what was said of the current opening named a cause.
    cause_said: AtomicBool,
    /// Openings not said since the last one that was.
    unsaid_opens: AtomicU32,
    /// Added to the clock, so that tests need not wait a minute.
    #[cfg(test)]
    skew_ms: AtomicU64,
}

impl Said {
    pub(crate) fn new() -> Self {
        Self {
            born: Instant::now(),
            answered: AtomicBool::new(false),
            failing_since: AtomicU64::new(NONE),
            open_said_at: AtomicU64::new(NONE),
            opened_at: AtomicU64::new(0),
            open_said: AtomicBool::new(false),
            cause_said: AtomicBool::new(false),
            unsaid_opens: AtomicU32::new(0),
            #[cfg(test)]
            skew_ms: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        let now = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(NONE - 1);
        #[cfg(test)]
        let now = now + self.skew_ms.load(Ordering::Relaxed);
        now
    }

    /// An operation Redis answered: on every one.
    #[inline]
    pub(crate) fn answered(&self) {
        if !self.answered.load(Ordering::Relaxed) && !self.answered.swap(true, Ordering::AcqRel) {
            tracing::info!("Redis answers: the cache is shared with the fleet");
        }
        let since = self.failing_since.load(Ordering::Relaxed);
        if since != NONE && self.now_ms().saturating_sub(since) >= EVERY_MS {
            let _ = self.failing_since.compare_exchange(
                since,
                NONE,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    /// An operation that failed with the breaker closed, or that Redis refused.
    pub(crate) fn failed(&self, error: &StoreError) {
        if self.failing_since.load(Ordering::Relaxed) != NONE {
            return;
        }
        let now = self.now_ms();
        if self
            .failing_since
            .compare_exchange(NONE, now, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            tracing::warn!(%error, "Redis failed: going on without it for this operation");
        }
    }

    /// The breaker opened after `failures` in a row, the last of them `error`.
    pub(crate) fn opened(&self, failures: u32, error: &StoreError) {
        let now = self.now_ms();
        self.opened_at.store(now, Ordering::Relaxed);
        // Failures right after it closes again are part of this outage.
        self.failing_since.store(now, Ordering::Relaxed);
        let last = self.open_said_at.load(Ordering::Relaxed);
        if last != NONE && now.saturating_sub(last) < EVERY_MS {
            self.open_said.store(false, Ordering::Relaxed);
            self.unsaid_opens.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.open_said_at.store(now, Ordering::Relaxed);
        self.open_said.store(true, Ordering::Relaxed);
        let has_cause = std::error::Error::source(error).is_some();
        self.cause_said.store(has_cause, Ordering::Relaxed);
        let unsaid = self.unsaid_opens.swap(0, Ordering::Relaxed);
        if unsaid == 0 {
            tracing::warn!(
                failures,
                %error,
                "Redis unavailable: the circuit breaker opened; running local-only \
                 (L1 and one origin call per key per process) until Redis answers"
            );
        } else {
            tracing::warn!(
                failures,
                %error,
                reopened = unsaid,
                "Redis unavailable: the circuit breaker opened again (it also opened the \
                 `reopened` times since it last said so); running local-only until Redis \
                 answers"
            );
        }
    }

    /// A probe of the open breaker failed (every probe interval while it is open): says
    /// the cause once, if the opening did not; says an opening it did not say, once the
    /// minute since the last it said is over (an outage that began with flapping).
    pub(crate) fn probe_failed(&self, error: &StoreError) {
        let has_cause = std::error::Error::source(error).is_some();
        if !self.open_said.load(Ordering::Relaxed) {
            let now = self.now_ms();
            let last = self.open_said_at.load(Ordering::Relaxed);
            if last != NONE && now.saturating_sub(last) < EVERY_MS {
                return;
            }
            self.open_said_at.store(now, Ordering::Relaxed);
            self.open_said.store(true, Ordering::Relaxed);
            self.cause_said.store(has_cause, Ordering::Relaxed);
            let unsaid = self.unsaid_opens.swap(0, Ordering::Relaxed);
            tracing::warn!(
                %error,
                reopened = unsaid,
                "Redis unavailable: the circuit breaker is open (it opened the `reopened` \
                 times since it last said so); running local-only until Redis answers"
            );
            return;
        }
        if has_cause && !self.cause_said.swap(true, Ordering::AcqRel) {
            tracing::warn!(%error, "Redis still unavailable");
        }
    }

    /// The breaker closed: Redis answered its probe.
    pub(crate) fn closed(&self) {
        let first = !self.answered.swap(true, Ordering::AcqRel);
        if !self.open_said.load(Ordering::Relaxed) {
            return;
        }
        let away = std::time::Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.opened_at.load(Ordering::Relaxed)),
        );
        if first {
            tracing::info!(
                ?away,
                "Redis answers: the circuit breaker closed; the cache is shared with the fleet"
            );
        } else {
            tracing::info!(
                ?away,
                "Redis answers again: the circuit breaker closed; the cache is shared again"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::store::{Operation, StoreErrorKind};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What is said, in order, for what happens: once per change, and a breaker that
    /// opens again within the minute says nothing more of it.
    #[test]
    fn each_change_is_said_once_and_flapping_is_not_said_again() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .without_time()
            .with_target(false)
            .with_writer(move || writer.clone())
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let timeout = StoreError::new(Operation::Read, StoreErrorKind::Timeout, None);
        let said = Said::new();
        for _ in 0..3 {
            said.answered();
        }
        for _ in 0..100 {
            said.failed(&timeout);
            said.answered();
        }
        said.opened(5, &timeout);
        said.probe_failed(&timeout); // no cause to add
        said.closed();
        for _ in 0..10 {
            said.opened(5, &timeout);
            said.closed();
            said.failed(&timeout);
        }
        let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = logs.lines().map(str::trim).collect();
        let expected = [
            "INFO Redis answers: the cache is shared with the fleet",
            "WARN Redis failed: going on without it for this operation error=redis read: no reply from Redis in time (outcome unknown)",
            "WARN Redis unavailable: the circuit breaker opened; running local-only (L1 and one origin call per key per process) until Redis answers failures=5 error=redis read: no reply from Redis in time (outcome unknown)",
        ];
        assert_eq!(lines.len(), 4, "{logs}");
        assert_eq!(lines[..3], expected, "{logs}");
        assert!(
            lines[3].starts_with("INFO Redis answers again: the circuit breaker closed"),
            "{logs}"
        );

        // Flapping, then open for good: once the minute is over, the probe says so, with
        // the openings it did not say; then its closing is said too. Failures, told
        // nothing of for a minute, are told again once Redis answered past it.
        captured.0.lock().unwrap().clear();
        said.opened(5, &timeout);
        said.probe_failed(&timeout);
        assert!(captured.0.lock().unwrap().is_empty());
        said.skew_ms.store(61_000, Ordering::Relaxed);
        said.probe_failed(&timeout);
        said.closed();
        said.answered();
        said.failed(&timeout);
        let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = logs.lines().map(str::trim).collect();
        assert_eq!(lines.len(), 3, "{logs}");
        assert!(
            lines[0].starts_with("WARN Redis unavailable: the circuit breaker is open")
                && lines[0].contains("reopened=11"),
            "{logs}"
        );
        assert!(lines[1].starts_with("INFO Redis answers again"), "{logs}");
        assert!(lines[2].starts_with("WARN Redis failed"), "{logs}");
    }
}
