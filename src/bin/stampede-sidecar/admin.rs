//! The admin listener (`--admin ADDR`): health for load balancers and orchestrators, on
//! an address of its own so that no origin path is ever shadowed.
//!
//! * `GET /healthz`: 200 while the process serves, with what it is connected to
//!   (`redis: "down"` is still 200: the sidecar serves from its local cache meanwhile).
//! * `GET /readyz`: 200, or 503 once a SIGTERM or SIGINT started the drain.
//!
//! Endpoints that change what the sidecar holds go in [`protected`], behind the bearer
//! token (`--admin-token`, `admin_token`).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use http::{StatusCode, header};
use stampede_guard::StampedeGuard;

use crate::shutdown::Shutdown;

/// How long `/healthz` waits for Redis to answer a PING (the store's own deadline may be
/// longer).
const PING_WITHIN: Duration = Duration::from_secs(1);

/// What the admin handlers read.
#[derive(Clone, Debug)]
pub(crate) struct Admin {
    pub(crate) guard: StampedeGuard,
    pub(crate) shutdown: Shutdown,
    /// Asked of protected endpoints; none of them answers without it.
    pub(crate) token: Option<Arc<str>>,
}

/// The admin router.
pub(crate) fn router(admin: Admin) -> Router {
    let open = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz));
    open.merge(protected(&admin)).with_state(admin)
}

/// Endpoints behind the bearer token: add them here.
fn protected(admin: &Admin) -> Router<Admin> {
    let routes = Router::new();
    if !routes.has_routes() {
        return routes;
    }
    routes.route_layer(middleware::from_fn_with_state(admin.clone(), require_token))
}

async fn healthz(State(admin): State<Admin>) -> Json<serde_json::Value> {
    let store = admin.guard.store();
    let redis = if store.is_local_only() {
        "off"
    } else {
        match tokio::time::timeout(PING_WITHIN, store.ping()).await {
            Ok(Ok(())) => "up",
            _ => "down",
        }
    };
    Json(serde_json::json!({
        "status": "ok",
        "redis": redis,
        "notices": if admin.guard.notices_connected() { "connected" } else { "disconnected" },
        "l1_entries": admin.guard.l1_entries(),
        "draining": admin.shutdown.is_draining(),
    }))
}

async fn readyz(State(admin): State<Admin>) -> (StatusCode, &'static str) {
    if admin.shutdown.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    } else {
        (StatusCode::OK, "ready\n")
    }
}

/// Lets a request through only with `Authorization: Bearer <token>`.
async fn require_token(State(admin): State<Admin>, request: Request, next: Next) -> Response {
    let Some(expected) = admin.token.as_deref() else {
        return (
            StatusCode::FORBIDDEN,
            "no admin token is set (--admin-token): this endpoint is off\n",
        )
            .into_response();
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(given) if same(given.as_bytes(), expected.as_bytes()) => next.run(request).await,
        _ => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "a bearer token is needed\n",
        )
            .into_response(),
    }
}

/// Compares in time that depends on the length only.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use stampede_guard::{KeySpace, RedisStore};
    use tower::ServiceExt;

    fn admin(token: Option<&str>) -> Admin {
        let keys = KeySpace::builder()
            .env("test")
            .service("admin")
            .secret(b"a test secret of more than sixteen bytes".to_vec())
            .build()
            .unwrap();
        Admin {
            guard: StampedeGuard::builder(RedisStore::local_only(), keys)
                .build()
                .unwrap(),
            shutdown: Shutdown::new(),
            token: token.map(Arc::from),
        }
    }

    async fn status(router: Router, path: &str, authorization: Option<&str>) -> StatusCode {
        let mut request = Request::get(path);
        if let Some(value) = authorization {
            request = request.header(header::AUTHORIZATION, value);
        }
        router
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap()
            .status()
    }

    #[tokio::test]
    async fn the_token_guards_what_is_behind_it() {
        let with = |admin: Admin| {
            Router::new()
                .route("/secret", get(|| async { "in" }))
                .route_layer(middleware::from_fn_with_state(admin.clone(), require_token))
                .with_state(admin)
        };
        let on = with(admin(Some("s3cret")));
        assert_eq!(
            status(on.clone(), "/secret", None).await,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            status(on.clone(), "/secret", Some("Bearer nope")).await,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            status(on, "/secret", Some("Bearer s3cret")).await,
            StatusCode::OK
        );
        let off = with(admin(None));
        assert_eq!(
            status(off, "/secret", Some("Bearer x")).await,
            StatusCode::FORBIDDEN
        );
    }

    #[tokio::test]
    async fn ready_until_draining() {
        let admin = admin(None);
        let router = router(admin.clone());
        assert_eq!(
            status(router.clone(), "/readyz", None).await,
            StatusCode::OK
        );
        assert_eq!(
            status(router.clone(), "/healthz", None).await,
            StatusCode::OK
        );
        admin.shutdown.start_draining();
        assert_eq!(
            status(router.clone(), "/readyz", None).await,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(status(router, "/healthz", None).await, StatusCode::OK);
    }
}
