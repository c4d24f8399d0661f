//! TLS and authentication. `rediss://`: certificates checked by default, a private
//! authority trusted when given, client certificates, and an insecure mode only when
//! asked for by name. Authentication: an ACL user and password from the builder, kept
//! out of URLs, logs and `Debug`; a wrong password or a revoked command is a Redis
//! failure the guard falls back from, never a 5xx. The TLS tests need the feature `tls`
//! (a default one); the authentication tests run in every build.

mod support;

use std::time::Duration;

use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::TIMEOUT;
#[cfg(feature = "tls")]
use support::TlsServer;
use support::web::{self, Origin, get, keys, send};
use support::{Redis, Store};

fn policy() -> Policy {
    Policy::builder("items")
        .fresh_ttl(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// A store for `server` that trusts its authority and presents the client certificate.
#[cfg(feature = "tls")]
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
#[cfg(feature = "tls")]
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
#[cfg(feature = "tls")]
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
#[cfg(feature = "tls")]
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
#[cfg(feature = "tls")]
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

/// The least-privileged user, named and authenticated by the builder over a URL with
/// no credentials: the guard fills and serves through Redis; `Debug` shows the user,
/// never the password.
#[tokio::test]
async fn a_user_and_password_from_the_builder_authenticate() {
    let redis = Redis::least_privileged(&keys()).await;
    let Redis::LeastPrivileged(server, _) = &redis else {
        unreachable!()
    };
    let builder = RedisStore::builder(server.url())
        .command_timeout(TIMEOUT)
        .username("guard")
        .password("guard-pw");
    let shown = format!("{builder:?}");
    assert!(
        shown.contains("guard") && !shown.contains("guard-pw"),
        "{shown}"
    );
    let store = builder.build().unwrap();
    assert!(!format!("{store:?}").contains("guard-pw"));
    store.ping().await.unwrap();
    let origin = Origin::versions(Duration::ZERO);
    let guard = StampedeGuard::builder(store, keys()).build().unwrap();
    let a = web::instance(guard, policy(), origin.service()).await;
    // A second instance reads the first one's entry from Redis.
    let b = web::instance(
        StampedeGuard::builder(redis.store(TIMEOUT), keys())
            .build()
            .unwrap(),
        policy(),
        origin.service(),
    )
    .await;
    assert_eq!(send(&a.service, get("/items/1")).await.x_cache(), "miss");
    assert_eq!(send(&b.service, get("/items/1")).await.x_cache(), "hit");
    assert_eq!(b.layer.stats().get(Event::L2Hit), 1);
    assert_eq!(origin.calls(), 1);
    // A purge, and its read-back on subscribing, are within what the user may do.
    a.guard
        .purge_tags(["t1", "t2"], stampede_guard::Purge::Soft)
        .await
        .expect("a purge as the least-privileged user");
    let c = StampedeGuard::builder(redis.store(TIMEOUT), keys())
        .build()
        .unwrap();
    c.ready().await.expect("subscribed");
    assert!(
        support::eventually(support::HANG, || async { c.purges_caught_up() }).await,
        "the purges were not read back as the least-privileged user"
    );
}

/// A wrong password: every Redis operation fails, is counted, and the guard answers
/// from the origin and L1 as it does without Redis.
#[tokio::test]
async fn a_wrong_password_degrades_to_local_protection() {
    let redis = Redis::least_privileged(&keys()).await;
    let Redis::LeastPrivileged(server, _) = &redis else {
        unreachable!()
    };
    let store = RedisStore::builder(server.url())
        .command_timeout(TIMEOUT)
        .username("guard")
        .password("not-the-password")
        .build()
        .unwrap();
    assert!(store.ping().await.is_err());
    let origin = Origin::versions(Duration::ZERO);
    let guard = StampedeGuard::builder(store, keys()).build().unwrap();
    let layer = guard.layer(policy()).unwrap();
    let service = tower::Layer::layer(&layer, origin.service());
    let first = send(&service, get("/items/1")).await;
    assert_eq!(first.status, 200);
    let second = send(&service, get("/items/1")).await;
    assert_eq!((second.status.as_u16(), second.x_cache()), (200, "hit"));
    assert_eq!(origin.calls(), 1);
    assert!(layer.stats().get(Event::RedisError) > 0);
}

/// A command the guard needs, revoked from its user while it runs: every failure is
/// counted, cached entries are still served from L1, new keys come from the origin
/// (once per key per process), and no request fails.
#[tokio::test]
async fn a_revoked_command_degrades_cleanly() {
    let redis = Redis::least_privileged(&keys()).await;
    let origin = Origin::versions(Duration::ZERO);
    let guard = StampedeGuard::builder(redis.store(TIMEOUT), keys())
        .build()
        .unwrap();
    let i = web::instance(guard, policy(), origin.service()).await;
    assert_eq!(send(&i.service, get("/items/1")).await.x_cache(), "miss");
    assert_eq!(i.layer.stats().get(Event::RedisError), 0);

    let _: () = redis
        .cmd(
            redis::cmd("ACL")
                .arg("SETUSER")
                .arg("guard")
                .arg("-evalsha"),
        )
        .await;
    let cached = send(&i.service, get("/items/1")).await;
    assert_eq!((cached.status.as_u16(), cached.x_cache()), (200, "hit"));
    for n in 2..=6 {
        let got = send(&i.service, get(&format!("/items/{n}"))).await;
        assert_eq!(got.status, 200, "/items/{n}");
        let again = send(&i.service, get(&format!("/items/{n}"))).await;
        assert_eq!((again.status.as_u16(), again.x_cache()), (200, "hit"));
    }
    assert_eq!(origin.calls(), 6);
    let stats = i.layer.stats();
    assert!(stats.get(Event::RedisError) >= 5, "{stats:?}");
    assert_eq!(stats.get(Event::LocalOnly), 5, "{stats:?}");
}
