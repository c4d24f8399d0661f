//! `stampede-sidecar`: the stampede guard in front of any HTTP origin, so that it can be
//! run without writing code and measured from outside.
//!
//! ```text
//! cargo run --release --features sidecar --bin stampede-sidecar -- --help
//! ```
//!
//! Settings come from `--config FILE` (TOML, with per-route policies by path prefix),
//! overridden by flags. Exit codes: 0 after a clean shutdown (SIGTERM or SIGINT, every
//! request, refresh and fill finished within the drain timeout), 2 for a bad flag or
//! setting (the message names it), 1 for anything else (an address that cannot be
//! bound, a drain cut short).

mod access;
mod admin;
mod args;
mod bodies;
mod config;
mod framing;
mod peer;
mod routes;
mod server;
mod shutdown;
mod upstream;
mod written;

use std::fmt;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use stampede_guard::prometheus::PrometheusHandle;
use stampede_guard::{KeySpace, RedisStore, StampedeGuard};
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::args::Args;
use crate::config::{Backend, SettingError, Settings};
use crate::routes::Routes;
use crate::shutdown::{Shutdown, Signals};
use crate::upstream::Upstream;

/// Why the sidecar stopped other than cleanly.
enum Failure {
    /// A setting was refused (exit code 2).
    Setting(SettingError),
    /// Anything else (exit code 1).
    Runtime(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Setting(error) => error.fmt(f),
            Self::Runtime(error) => f.write_str(error),
        }
    }
}

impl From<SettingError> for Failure {
    fn from(error: SettingError) -> Self {
        Self::Setting(error)
    }
}

fn main() -> ExitCode {
    // Exits itself: 0 for --help and --version, 2 for a bad flag or value.
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colours for a terminal only: not escape codes in a file or a log collector.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_max_level(tracing::Level::INFO)
        .init();
    let outcome = Settings::load(&args)
        .map_err(Failure::from)
        .and_then(|settings| {
            let mut runtime = tokio::runtime::Builder::new_multi_thread();
            if let Some(workers) = settings.workers {
                runtime.worker_threads(workers);
            }
            runtime
                .enable_all()
                .build()
                .map_err(|e| Failure::Runtime(format!("cannot start the runtime: {e}")))?
                .block_on(async {
                    if args.check {
                        check(&settings)
                    } else {
                        run(settings).await
                    }
                })
        });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("stampede-sidecar: {failure}");
            match failure {
                Failure::Setting(_) => ExitCode::from(2),
                Failure::Runtime(_) => ExitCode::FAILURE,
            }
        }
    }
}

/// `--check`: builds what `run` would build, short of connecting and binding.
fn check(settings: &Settings) -> Result<(), Failure> {
    let guard = guard(settings)?;
    Routes::new(&guard, settings, &upstream(settings)?)?;
    tls(settings)?;
    println!(
        "settings ok: {} route(s), {}",
        settings.routes.len(),
        settings.redis.backend
    );
    Ok(())
}

/// The origin's client.
fn upstream(settings: &Settings) -> Result<Upstream, Failure> {
    Upstream::new(&settings.origin)
        .map_err(|(field, e)| Failure::Setting(settings.setting_error(field, e)))
}

/// TLS termination, if it is asked for.
fn tls(settings: &Settings) -> Result<Option<tokio_rustls::TlsAcceptor>, Failure> {
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

async fn run(settings: Settings) -> Result<(), Failure> {
    let runtime =
        |what: &str, error: &dyn fmt::Display| Failure::Runtime(format!("{what}: {error}"));
    // First: a signal sent while the sidecar starts is not lost.
    let mut signals = Signals::listen().map_err(|e| runtime("cannot listen for signals", &e))?;
    if let Some(addr) = settings.metrics {
        // Before the guard: counters are registered when its layers are made.
        let handle = stampede_guard::prometheus::install()
            .map_err(|e| runtime(&format!("metrics on {addr}"), &e))?;
        let listener = bind(addr).await?;
        // The address bound (`--metrics 127.0.0.1:0` picks a free port).
        println!(
            "metrics on http://{}/metrics",
            listener.local_addr().unwrap_or(addr)
        );
        tokio::spawn(serve_metrics(listener, handle));
    }
    let guard = guard(&settings)?;
    let routes = Routes::new(&guard, &settings, &upstream(&settings)?)?;
    let tls = tls(&settings)?;
    let listener = bind(settings.listen).await?;
    let shutdown = Shutdown::new();
    if let Some(addr) = settings.admin {
        let admin = admin::router(admin::Admin {
            guard: guard.clone(),
            shutdown: shutdown.clone(),
            token: settings.admin_token.as_deref().map(Arc::from),
            routes: Some(routes.clone()),
        });
        let listener = bind(addr).await?;
        println!("admin on http://{}", listener.local_addr().unwrap_or(addr));
        // Answers until the process exits: through the drain too (`/readyz` says 503).
        tokio::spawn(async move { axum::serve(listener, admin).await });
    }
    if let Err(error) = guard.ready().await {
        println!("Redis does not answer ({error}): serving from the local cache until it does.");
    }
    println!(
        "caching {} on {}://{} ({}, {} route{}{})",
        settings.upstream,
        if tls.is_some() { "https" } else { "http" },
        listener.local_addr().unwrap_or(settings.listen),
        if settings.redis.backend.is_shared() {
            "L1 + Redis"
        } else {
            "L1 only"
        },
        settings.routes.len(),
        if settings.routes.len() == 1 { "" } else { "s" },
        if settings.default.is_some() {
            " and the default"
        } else {
            ", others passed through"
        },
    );

    let service = access::wrap(routes.clone(), settings.access_log);
    let server = server::serve(
        listener,
        settings.limits.clone(),
        tls,
        service,
        shutdown.started(),
    );
    let mut server = tokio::spawn(server);
    let signal = tokio::select! {
        signal = signals.next() => signal,
        ended = &mut server => {
            return Err(Failure::Runtime(format!("the listener stopped: {ended:?}")));
        }
    };
    let deadline = Instant::now() + settings.drain_timeout;
    println!(
        "{signal}: draining (at most {:?}; a second signal stops at once)",
        settings.drain_timeout
    );
    shutdown.start_draining();
    let drain = async {
        // Requests in flight first (a cold fill's callers wait for it), then the
        // refreshes and fills they started.
        let requests = tokio::time::timeout_at(deadline, &mut server).await.is_ok();
        let left = deadline.saturating_duration_since(Instant::now());
        let work = guard.drained(left).await;
        (requests, work)
    };
    tokio::select! {
        (requests, work) = drain => {
            if requests && work {
                println!("drained: every request, refresh and fill finished");
                Ok(())
            } else {
                Err(Failure::Runtime(format!(
                    "drain cut short after {:?}: {}",
                    settings.drain_timeout,
                    match (requests, work) {
                        (false, _) => "requests were still in flight",
                        _ => "refreshes or fills were still at work",
                    }
                )))
            }
        }
        signal = signals.next() => Err(Failure::Runtime(format!("{signal} during the drain: stopped at once"))),
    }
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

/// Serves the metrics on `listener` until the process exits, at `/metrics` and (as the
/// exporter's own listener did) at any other path, rendered off the async workers; and
/// drains the recorder's histograms every few seconds between scrapes.
async fn serve_metrics(listener: TcpListener, handle: PrometheusHandle) {
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

async fn bind(addr: SocketAddr) -> Result<TcpListener, Failure> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| Failure::Runtime(format!("cannot listen on {addr}: {e}")))
}
