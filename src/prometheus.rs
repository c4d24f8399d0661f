//! Exporting the crate's metrics to Prometheus (feature `prometheus`).
//!
//! [`install`] sets `metrics-exporter-prometheus` as the global recorder, with histogram
//! buckets suited to each metric (sub-millisecond for Redis round trips, up to a minute
//! for refreshes and lease holds) and the crate's descriptions. Serve
//! [`PrometheusHandle::render`] on a `/metrics` route of your own, or let
//! [`install_with_listener`] serve it on an address of its own.
//!
//! Install before building the guard: counter handles are registered when a layer is
//! made, and a handle registered before a recorder exists stays a no-op.
//!
//! ```no_run
//! use axum::{Router, routing::get};
//!
//! let handle = stampede_guard::prometheus::install()?;
//! let metrics: Router = Router::new().route("/metrics", get(move || async move { handle.render() }));
//! # Ok::<(), stampede_guard::prometheus::BuildError>(())
//! ```

use std::net::SocketAddr;

use metrics_exporter_prometheus::Matcher;
pub use metrics_exporter_prometheus::{BuildError, PrometheusBuilder, PrometheusHandle};

use crate::metrics::{self as names, MetricKind};

/// Buckets for Redis round trips: 50 µs to 1 s.
pub const REDIS_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// Buckets for origin work (refreshes, lease holds, cold waits): 1 ms to 60 s.
pub const WORK_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A builder with the crate's buckets, to add your own settings to.
pub fn builder() -> PrometheusBuilder {
    let with = |builder: PrometheusBuilder, name: &str, buckets: &[f64]| {
        builder
            .set_buckets_for_metric(Matcher::Full(name.to_owned()), buckets)
            .expect("the bucket lists are not empty")
    };
    let builder = with(
        PrometheusBuilder::new(),
        names::LEASE_ACQUIRE_SECONDS,
        REDIS_BUCKETS,
    );
    let builder = with(builder, names::LEASE_HOLD_SECONDS, WORK_BUCKETS);
    let builder = with(builder, names::REFRESH_SECONDS, WORK_BUCKETS);
    with(builder, names::COLD_WAIT_SECONDS, WORK_BUCKETS)
}

/// Installs the exporter as the global recorder and describes every metric. Render the
/// returned handle on your own `/metrics` route.
pub fn install() -> Result<PrometheusHandle, BuildError> {
    let handle = builder().install_recorder()?;
    describe();
    Ok(handle)
}

/// Installs the exporter and serves `/metrics` on `addr` (call it inside a Tokio
/// runtime).
pub fn install_with_listener(addr: SocketAddr) -> Result<(), BuildError> {
    builder().with_http_listener(addr).install()?;
    describe();
    Ok(())
}

/// Registers the help text of every metric with the installed recorder.
pub fn describe() {
    for &(name, kind, help) in names::ALL {
        match kind {
            MetricKind::Counter => metrics::describe_counter!(name, help),
            MetricKind::Gauge => metrics::describe_gauge!(name, help),
            MetricKind::Histogram => {
                metrics::describe_histogram!(name, metrics::Unit::Seconds, help)
            }
        }
    }
}
