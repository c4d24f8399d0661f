//! Everything the sidecar serves with, built from its settings: the key space (and its
//! secret), the store on the settings' Redis, the guard, the origin's client, the routes
//! and TLS termination. Building it connects nothing and binds nothing: `--check` builds
//! it too.

use std::fmt;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use stampede_guard::{KeySpace, RedisStore, StampedeGuard};
use tokio_rustls::TlsAcceptor;

use crate::config::{Backend, Settings};
use crate::failure::Failure;
use crate::routes::Routes;
use crate::upstream::Upstream;

/// What the sidecar serves with.
pub(crate) struct Assembled {
    pub(crate) guard: StampedeGuard,
    pub(crate) routes: Routes,
    /// TLS termination, if it is asked for.
    pub(crate) tls: Option<TlsAcceptor>,
}

/// Builds what the sidecar serves with; a refusal names the setting.
pub(crate) fn assemble(settings: &Settings) -> Result<Assembled, Failure> {
    let guard = guard(settings)?;
    let routes = Routes::new(&guard, settings, &upstream(settings)?)?;
    let tls = tls(settings)?;
    Ok(Assembled { guard, routes, tls })
}

/// The origin's client.
fn upstream(settings: &Settings) -> Result<Upstream, Failure> {
    Upstream::new(&settings.origin)
        .map_err(|(field, e)| Failure::Setting(settings.setting_error(field, e)))
}

/// TLS termination, if it is asked for.
fn tls(settings: &Settings) -> Result<Option<TlsAcceptor>, Failure> {
    settings
        .limits
        .tls
        .as_ref()
        .map(|tls| {
            tls.acceptor()
                .map_err(|(field, e)| Failure::Setting(settings.setting_error(field, e)))
        })
        .transpose()
}

/// How to make a secret, for the messages that ask for one.
const MAKE_ONE: &str = "make one with `openssl rand -hex 32` and give every sidecar of the \
                        fleet the same";

/// The secret keys are hashed with: `STAMPEDE_GUARD_SECRET`, else the file
/// `--secret-file` names. With Redis one of them is required (a fleet's sidecars must
/// share it, and a known one would let anyone compute the keys); without Redis, keys
/// never leave the process, and a random secret of its own does.
fn secret(settings: &Settings) -> Result<Vec<u8>, Failure> {
    if let Ok(secret) = std::env::var("STAMPEDE_GUARD_SECRET") {
        return Ok(secret.into_bytes());
    }
    if let Some(path) = &settings.secret_file {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Failure::Setting(settings.setting_error(
                "secret_file",
                format!("cannot read {}: {e}", path.display()),
            ))
        })?;
        return Ok(text.trim_end().as_bytes().to_vec());
    }
    if settings.redis.backend.is_shared() {
        return Err(Failure::Setting(settings.setting_error(
            "STAMPEDE_GUARD_SECRET",
            format!(
                "not set, and no --secret-file: with Redis, keys are hashed with a secret \
                 the fleet shares; {MAKE_ONE}"
            ),
        )));
    }
    // Three ULIDs: 240 random bits from a cryptographic generator.
    let random: String = (0..3).map(|_| ulid::Ulid::generate().to_string()).collect();
    Ok(random.into_bytes())
}

/// The guard, on the settings' Redis (or none) and key space.
fn guard(settings: &Settings) -> Result<StampedeGuard, Failure> {
    let refused = |field: &str, error: &dyn fmt::Display| {
        Failure::Setting(settings.setting_error(field, error.to_string()))
    };
    let secret = secret(settings)?;
    let keys = KeySpace::builder()
        .env(settings.env.as_str())
        .service(settings.service.as_str())
        .secret(secret)
        .build()
        .map_err(|e| match e.field() {
            "secret" => refused("STAMPEDE_GUARD_SECRET", &format!("{e}; {MAKE_ONE}")),
            field => refused(field, &e),
        })?;
    let store = store(settings)?;
    let mut builder = StampedeGuard::builder(store, keys);
    if let Some(bytes) = settings.l1_capacity {
        builder = builder.l1_capacity(bytes);
    }
    if let Some(slots) = settings.refresh_budget {
        builder = builder.refresh_budget(slots);
    }
    if let Some(bytes) = settings.fill_memory {
        builder = builder.fill_memory(bytes);
    }
    builder.build().map_err(|e| refused(e.field(), &e))
}

/// The store on the settings' Redis: one server, a Cluster or Sentinel's primary, with
/// TLS files and an ACL user; the password from `STAMPEDE_SIDECAR_REDIS_PASSWORD`, if
/// set (else the URLs'). A refusal names the setting.
fn store(settings: &Settings) -> Result<RedisStore, Failure> {
    let redis = &settings.redis;
    let (mut builder, urls_field) = match &redis.backend {
        Backend::Local => return Ok(RedisStore::local_only()),
        Backend::Single(url) => (RedisStore::builder(url.as_str()), "redis"),
        Backend::Cluster(nodes) => (RedisStore::cluster(nodes), "redis_cluster"),
        Backend::Sentinel { sentinels, service } => (
            RedisStore::sentinel(sentinels, service.as_str()),
            "redis_sentinels",
        ),
    };
    let refused = |field: &str, error: &dyn fmt::Display| {
        Failure::Setting(settings.setting_error(field, error.to_string()))
    };
    let read = |field: &str, path: &std::path::Path| {
        std::fs::read(path)
            .map_err(|e| refused(field, &format!("cannot read {}: {e}", path.display())))
    };
    // Checked here, so that a file that is not PEM is refused at start, not met at the
    // first connection.
    let certificates = |field: &str, path: &std::path::Path| {
        let pem = read(field, path)?;
        match CertificateDer::pem_slice_iter(&pem).collect::<Result<Vec<_>, _>>() {
            Ok(found) if !found.is_empty() => Ok(pem),
            Ok(_) => Err(refused(
                field,
                &format!("{}: no PEM certificate in it", path.display()),
            )),
            Err(e) => Err(refused(field, &format!("{}: {e}", path.display()))),
        }
    };
    if let Some(ca) = &redis.ca {
        builder = builder.tls_root_certificate(certificates("redis_ca", ca)?);
    }
    if let (Some(cert), Some(key)) = (&redis.client_cert, &redis.client_key) {
        let pem = read("redis_client_key", key)?;
        if let Err(e) = PrivateKeyDer::from_pem_slice(&pem) {
            return Err(refused(
                "redis_client_key",
                &format!("{}: {e}", key.display()),
            ));
        }
        builder = builder.tls_client_certificate(certificates("redis_client_cert", cert)?, pem);
    }
    if let Some(user) = &redis.username {
        builder = builder.username(user.as_str());
    }
    if let Ok(password) = std::env::var("STAMPEDE_SIDECAR_REDIS_PASSWORD") {
        builder = builder.password(password);
    }
    builder.build().map_err(|e| match e.field() {
        "url" | "nodes" | "sentinels" => refused(urls_field, &e),
        "tls_root_certificate" => refused("redis_ca", &e),
        "tls_client_certificate" => refused("redis_client_cert", &e),
        "username" => refused(
            "redis_username",
            &format!("{e}: set STAMPEDE_SIDECAR_REDIS_PASSWORD"),
        ),
        field => refused(field, &e),
    })
}
