//! Redis trouble that says why: each way of failing to reach or use Redis names its
//! cause in the error's message and keeps it as the error's `source`, so that a wrong
//! certificate authority, a host that does not resolve, a refused port, a wrong password
//! and a revoked command are each told apart from the message alone.

mod support;

use std::error::Error as _;
use std::time::Duration;

use stampede_guard::RedisStore;
use stampede_guard::lease::{AcquireOutcome, LeaseClient};
use stampede_guard::store::{StoreError, StoreErrorKind};
#[cfg(feature = "tls")]
use support::TIMEOUT;
use support::TlsServer;
use support::web::keys;
use support::{Redis, RedisServer, Store, server::free_port};

/// The error's message, and its source's, both holding `cause`.
fn says(error: &StoreError, kind: StoreErrorKind, cause: &str) {
    let message = error.to_string();
    assert_eq!(error.kind(), kind, "{message}");
    assert!(message.contains(cause), "{cause:?} not in {message:?}");
    let source = error.source().map(ToString::to_string).unwrap_or_default();
    assert!(
        source.contains(cause),
        "{cause:?} not in the source {source:?}"
    );
}

/// The error of a ping through a store built from `builder`.
async fn ping_error(builder: stampede_guard::store::RedisStoreBuilder) -> StoreError {
    let store = builder.build().unwrap();
    store.ping().await.unwrap_err()
}

#[cfg(feature = "tls")]
#[tokio::test]
async fn a_certificate_from_another_authority_says_tls_and_why() {
    let server = TlsServer::start();
    let error = ping_error(
        RedisStore::builder(server.url())
            .command_timeout(TIMEOUT)
            .tls_root_certificate(server.other_ca.clone())
            .tls_client_certificate(server.client_cert.clone(), server.client_key.clone()),
    )
    .await;
    says(
        &error,
        StoreErrorKind::NoConnection,
        "invalid peer certificate",
    );
    assert!(
        error.to_string().ends_with(
            "no connection to Redis in time: TLS: invalid peer certificate: UnknownIssuer"
        ),
        "{error}"
    );
}

#[tokio::test]
async fn a_host_that_does_not_resolve_says_so() {
    // `.invalid` never resolves (RFC 6761). A resolver may take its time to say so:
    // room for it (the ping waits the whole deadline, bb8 trying again meanwhile).
    let error = ping_error(
        RedisStore::builder("redis://no-such-host.invalid:6379")
            .command_timeout(Duration::from_secs(1))
            .connect_timeout(Duration::from_secs(1)),
    )
    .await;
    says(&error, StoreErrorKind::NoConnection, "lookup address");
}

#[tokio::test]
async fn a_refused_port_says_refused() {
    let url = format!("redis://127.0.0.1:{}", free_port());
    let error = ping_error(RedisStore::builder(url).command_timeout(TIMEOUT)).await;
    says(&error, StoreErrorKind::NoConnection, "Connection refused");
}

#[tokio::test]
async fn a_wrong_password_says_authentication_failed() {
    let server = RedisServer::start();
    server.require_password().await;
    let error = ping_error(
        RedisStore::builder(server.url())
            .command_timeout(TIMEOUT)
            .password("not-the-password"),
    )
    .await;
    says(
        &error,
        StoreErrorKind::NoConnection,
        "authentication failed",
    );
    assert!(!error.to_string().contains("not-the-password"), "{error}");
}

/// A command revoked from the guard's user: the lease's script is refused, and the
/// error names the code, the command and the user's lack of permission.
#[tokio::test]
async fn a_revoked_command_says_noperm_and_which() {
    let redis = Redis::least_privileged(&keys()).await;
    let leases = LeaseClient::builder(redis.store(TIMEOUT), &keys())
        .build()
        .unwrap();
    let name = keys()
        .lease(&[stampede_guard::keys::Scope::id("job", "nightly")], "run")
        .unwrap();
    let _: () = redis
        .cmd(
            redis::cmd("ACL")
                .arg("SETUSER")
                .arg("guard")
                .arg("-evalsha")
                .arg("-eval"),
        )
        .await;
    let AcquireOutcome::Unavailable(error) =
        leases.try_acquire(&name, Duration::from_secs(1)).await
    else {
        panic!("acquired with EVALSHA revoked");
    };
    says(&error, StoreErrorKind::Server, "no permissions");
    assert_eq!(error.server_code(), Some("NOPERM"));
    let message = error.to_string();
    assert!(
        message.starts_with("redis acquire: Redis answered with an error (NOPERM): ")
            && message.contains("'evalsha'"),
        "{message}"
    );
}
