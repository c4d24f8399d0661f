//! The admin listener (`--admin ADDR`): health for load balancers and orchestrators, on
//! an address of its own so that no origin path is ever shadowed.
//!
//! * `GET /healthz`: 200 while the process serves, with what it is connected to
//!   (`redis: "down"` is still 200: the sidecar serves from its local cache meanwhile).
//! * `GET /readyz`: 200, or 503 once a SIGTERM or SIGINT started the drain.
//!
//! Endpoints that change what the sidecar holds are behind the bearer token
//! (`--admin-token`, `admin_token`; without one they answer 403):
//!
//! * `POST /purge/tags` with `{"tags": ["a", "b"], "soft": false}`: purges every entry
//!   tagged with one of them (`Surrogate-Key`, `Cache-Tag`), on every sidecar of the
//!   fleet; soft makes them stale instead of gone (`StampedeGuard::purge_tags`). It
//!   answers `{"tags": 2, "soft": false}`: how many tags, not entries (a tag purge is a
//!   timestamp each entry is checked against when it is read; no index of entries is
//!   kept, so there is nothing to count).
//! * `POST /purge/path` with `{"path": "/items/1?page=2"}`: removes every entry of that
//!   path and query (its keyed query: the route's `key_query`), whatever the headers of
//!   the requests that filled them: each value of the route's `key_headers`, and each
//!   variant the origin's `Vary` told apart; on every sidecar of the fleet
//!   (`GuardLayer::invalidate_path`). Answers `{"entries": 3}`: how many entries it
//!   removed from Redis (without Redis, from this sidecar's memory); 404 when no cached
//!   route serves the path; 502 when Redis failed (then only this sidecar purged).
//!
//! They are a JSON API, errors included: each error is `{"error": "..."}` with its
//! status, a body that is not JSON (or not sent as `application/json`), a missing or
//! wrong token and another method alike.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{StatusCode, header};
use serde::Deserialize;
use stampede_guard::{InvalidateError, Purge, StampedeGuard};

use crate::routes::Routes;
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
    /// The routes' layers, for purges by path.
    pub(crate) routes: Option<Routes>,
}

/// The admin router.
pub(crate) fn router(admin: Admin) -> Router {
    let open = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz));
    open.merge(protected(&admin)).with_state(admin)
}

/// Endpoints behind the bearer token.
fn protected(admin: &Admin) -> Router<Admin> {
    let only_post = || async { error(StatusCode::METHOD_NOT_ALLOWED, "only POST is served here") };
    Router::new()
        .route("/purge/tags", post(purge_tags).fallback(only_post))
        .route("/purge/path", post(purge_path).fallback(only_post))
        .route_layer(middleware::from_fn_with_state(admin.clone(), require_token))
}

/// An error of the JSON endpoints: `{"error": what}`.
type Failed = (StatusCode, Json<serde_json::Value>);

fn error(status: StatusCode, what: impl std::fmt::Display) -> Failed {
    (status, Json(serde_json::json!({"error": what.to_string()})))
}

/// What was asked, or why the body could not be read, in JSON.
fn asked<T>(body: Result<Json<T>, JsonRejection>) -> Result<T, Failed> {
    match body {
        Ok(Json(asked)) => Ok(asked),
        Err(JsonRejection::MissingJsonContentType(_)) => Err(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "the body must be JSON, sent with `Content-Type: application/json`",
        )),
        Err(rejection) => Err(error(rejection.status(), rejection.body_text())),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PurgeTags {
    tags: Vec<String>,
    #[serde(default)]
    soft: bool,
}

async fn purge_tags(
    State(admin): State<Admin>,
    body: Result<Json<PurgeTags>, JsonRejection>,
) -> Failed {
    let asked = match asked(body) {
        Ok(asked) => asked,
        Err(failed) => return failed,
    };
    if asked.tags.is_empty() || asked.tags.iter().any(|t| t.trim().is_empty()) {
        return error(
            StatusCode::BAD_REQUEST,
            "`tags` must name at least one tag, none empty",
        );
    }
    let how = if asked.soft { Purge::Soft } else { Purge::Hard };
    match admin.guard.purge_tags(&asked.tags, how).await {
        Ok(()) => (
            StatusCode::OK,
            Json(serde_json::json!({"tags": asked.tags.len(), "soft": asked.soft})),
        ),
        // Purged here; the rest of the fleet did not hear of it.
        Err(failed) => (
            StatusCode::BAD_GATEWAY,
            Json(serde_json::json!({
                "tags": asked.tags.len(),
                "soft": asked.soft,
                "error": format!("only this sidecar purged: {failed}"),
            })),
        ),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PurgePath {
    path: String,
}

async fn purge_path(
    State(admin): State<Admin>,
    body: Result<Json<PurgePath>, JsonRejection>,
) -> Failed {
    let asked = match asked(body) {
        Ok(asked) => asked,
        Err(failed) => return failed,
    };
    let bad = || {
        error(
            StatusCode::BAD_REQUEST,
            "`path` must be a path and query, from /",
        )
    };
    let Some(path) = asked
        .path
        .parse::<http::Uri>()
        .ok()
        .filter(|uri| asked.path.starts_with('/') && uri.path().starts_with('/'))
        .map(|uri| uri.path().to_owned())
    else {
        return bad();
    };
    let Some(layer) = admin.routes.as_ref().and_then(|routes| routes.layer(&path)) else {
        return error(StatusCode::NOT_FOUND, "no cached route serves this path");
    };
    match layer.invalidate_path(&asked.path).await {
        Ok(entries) => (
            StatusCode::OK,
            Json(serde_json::json!({"entries": entries})),
        ),
        Err(InvalidateError::Store(failed)) => error(
            StatusCode::BAD_GATEWAY,
            format!("only this sidecar purged: {failed}"),
        ),
        // (Not a path, or a route that keys on the host: the sidecar's do not.)
        Err(failed) => error(StatusCode::BAD_REQUEST, failed),
    }
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
        return error(
            StatusCode::FORBIDDEN,
            "no admin token is set (--admin-token): this endpoint is off",
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
            [(header::WWW_AUTHENTICATE, "Bearer")],
            error(
                StatusCode::UNAUTHORIZED,
                "the admin token is needed: `Authorization: Bearer <token>`",
            ),
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
            routes: None,
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
