//! The Prometheus endpoint: the guard's metrics, rendered off the async workers.

use stampede_guard::prometheus::PrometheusHandle;
use tokio::net::TcpListener;

/// Serves the metrics on `listener` until the process exits, at `/metrics` and (as the
/// exporter's own listener did) at any other path, rendered off the async workers; and
/// drains the recorder's histograms every few seconds between scrapes.
pub(crate) async fn serve(listener: TcpListener, handle: PrometheusHandle) {
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    let render = move || {
        let handle = handle.clone();
        async move {
            let text = tokio::task::spawn_blocking(move || handle.render())
                .await
                .unwrap_or_default();
            (
                [(
                    http::header::CONTENT_TYPE,
                    "text/plain; version=0.0.4; charset=utf-8",
                )],
                text,
            )
        }
    };
    let app = axum::Router::new().fallback(render);
    let _ = axum::serve(listener, app).await;
}
