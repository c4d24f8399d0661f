//! Settings with no flag and no file value.

use std::time::Duration;

pub(super) const LISTEN: &str = "127.0.0.1:8080";
pub(super) const UPSTREAM: &str = "http://127.0.0.1:9000";
pub(super) const FRESH: Duration = Duration::from_secs(1);
pub(super) const GRACE: Duration = Duration::from_secs(10);
pub(super) const LEASE: Duration = Duration::from_secs(5);
pub(super) const COLD_WAIT: Duration = Duration::from_secs(2);
pub(super) const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
pub(super) const ENV: &str = "sidecar";
pub(super) const VIA: &str = "stampede-sidecar";
pub(super) const MAX_CONNECTIONS: usize = 10_000;
pub(super) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
pub(super) const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(60);
pub(super) const REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(60);
pub(super) const SEND_TIMEOUT: Duration = Duration::from_secs(60);
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub(super) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(60);
pub(super) const UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// The route name of requests that match no route.
pub(super) const ROUTE: &str = "default";
