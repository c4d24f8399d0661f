//! `rediss://`: certificates checked by default, a private authority trusted when given,
//! client certificates, and an insecure mode only when asked for by name.

mod support;

use std::time::Duration;

use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::TlsServer;
use support::web::{self, Origin, get, keys, send};

const TIMEOUT: Duration = Duration::from_millis(250);

fn policy() -> Policy {
    Policy::builder("items")
        .fresh_ttl(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// A store for `server` that trusts its authority and presents the client certificate.
fn verified(server: &TlsServer) -> RedisStore {
    RedisStore::builder(server.url())
        .command_timeout(TIMEOUT)
        .tls_root_certificate(server.ca.clone())
        .tls_client_certificate(server.client_cert.clone(), server.client_key.clone())
        .build()
        .unwrap()
}

/// The server's certificate checked against the authority given, the client's
/// presented: the guard fills through Redis and a second instance reads the entry.
#[tokio::test]
async fn a_verified_server_and_a_client_certificate_carry_the_guard() {
    let server = TlsServer::start();
    let store = verified(&server);
    store.ping().await.unwrap();
    let origin = Origin::versions(Duration::ZERO);
    let guard = || {
        StampedeGuard::builder(verified(&server), keys())
            .build()
            .unwrap()
    };
    let a = web::instance(guard(), policy(), origin.service()).await;
    let b = web::instance(guard(), policy(), origin.service()).await;
    assert_eq!(send(&a.service, get("/items/1")).await.x_cache(), "miss");
    assert_eq!(send(&b.service, get("/items/1")).await.x_cache(), "hit");
    assert_eq!(b.layer.stats().get(Event::L2Hit), 1);
    assert_eq!(origin.calls(), 1);
}

/// A certificate that the trusted authority did not sign is refused: by the system's
/// roots (no authority given) and by another authority. The guard then runs without
/// Redis, no request failing.
#[tokio::test]
async fn a_certificate_from_another_authority_is_refused() {
    let server = TlsServer::start();
    let client = || {
        RedisStore::builder(server.url())
            .command_timeout(TIMEOUT)
            .tls_client_certificate(server.client_cert.clone(), server.client_key.clone())
    };
    assert!(
        client().build().unwrap().ping().await.is_err(),
        "system roots"
    );
    let other = client()
        .tls_root_certificate(server.other_ca.clone())
        .build()
        .unwrap();
    assert!(other.ping().await.is_err(), "another authority");

    let origin = Origin::versions(Duration::ZERO);
    let guard = StampedeGuard::builder(other, keys()).build().unwrap();
    let layer = guard.layer(policy()).unwrap();
    let service = tower::Layer::layer(&layer, origin.service());
    assert_eq!(send(&service, get("/items/1")).await.status, 200);
    assert_eq!(send(&service, get("/items/1")).await.x_cache(), "hit");
    assert!(layer.stats().get(Event::RedisError) > 0);
}

/// With certificate checks turned off by name, the same untrusted server is accepted.
/// A URL's `#insecure` alone is refused when the store is built, naming the URL.
#[tokio::test]
async fn checks_are_off_only_when_asked_for_by_name() {
    let server = TlsServer::start();
    let insecure = RedisStore::builder(server.url())
        .command_timeout(TIMEOUT)
        .tls_root_certificate(server.other_ca.clone())
        .tls_client_certificate(server.client_cert.clone(), server.client_key.clone())
        .danger_accept_invalid_certificates()
        .build()
        .unwrap();
    insecure.ping().await.unwrap();
    assert!(format!("{insecure:?}").contains("RedisStore"));

    let error = RedisStore::builder(format!("{}/#insecure", server.url()))
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("url") && error.contains("danger_accept_invalid_certificates"),
        "{error}"
    );
    let error = RedisStore::builder("redis://127.0.0.1:6379")
        .tls_root_certificate(server.ca.clone())
        .build()
        .unwrap_err()
        .to_string();
    assert!(error.contains("rediss://"), "{error}");
}

/// A server that asks for a client certificate refuses a client without one.
#[tokio::test]
async fn a_client_without_a_certificate_is_refused_where_one_is_required() {
    let server = TlsServer::start();
    let store = RedisStore::builder(server.url())
        .command_timeout(TIMEOUT)
        .tls_root_certificate(server.ca.clone())
        .build()
        .unwrap();
    assert!(store.ping().await.is_err());
}
