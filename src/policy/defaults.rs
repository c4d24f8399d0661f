//! Defaults of [`PolicyBuilder`](super::PolicyBuilder).

use std::time::Duration;

/// How long a response is fresh.
pub const FRESH_TTL: Duration = Duration::from_secs(10);
/// How long past freshness a response may be served while it is refreshed.
pub const GRACE: Duration = Duration::from_secs(60);
/// The TTL of the refresh lease.
pub const LEASE_TTL: Duration = Duration::from_secs(5);
/// How long a refresh may call the origin.
pub const REFRESH_TIMEOUT: Duration = Duration::from_secs(4);
/// How long a call that passes through to the origin may wait for its answer's head
/// (as nginx's `proxy_read_timeout` and Varnish's `first_byte_timeout`).
pub const PASS_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a caller with nothing to serve waits for a fill another instance is
/// doing: unless set, as long as that fill may take, the refresh timeout plus
/// [`COLD_WAIT_MARGIN`].
pub const COLD_WAIT: Duration = Duration::from_secs(REFRESH_TIMEOUT.as_secs() + 1);
/// What the default cold wait adds to the refresh timeout: the holder's write.
pub const COLD_WAIT_MARGIN: Duration = Duration::from_secs(1);
/// How long past freshness a response may be served when the origin fails.
pub const STALE_IF_ERROR: Duration = Duration::from_secs(300);
/// How long the fleet leaves the origin alone after a failed refresh.
pub const ERROR_BACKOFF: Duration = Duration::from_secs(1);
/// The largest body that is cached (16 MiB: 32 parts in Redis); larger ones are
/// shared by the callers of their fill as they stream, not stored.
pub const MAX_BODY: usize = 16 * 1024 * 1024;
/// The largest body that may be configured.
pub const MAX_BODY_LIMIT: usize = 64 * 1024 * 1024;
/// How long callers of a key whose answer could not be stored go straight to the
/// origin (hit-for-pass).
pub const HIT_FOR_PASS: Duration = Duration::from_secs(10);
