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
mod assemble;
mod bodies;
mod config;
mod failure;
mod framing;
mod metrics;
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
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::args::Args;
use crate::assemble::{Assembled, assemble};
use crate::config::Settings;
use crate::failure::Failure;
use crate::shutdown::{Shutdown, Signals};

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
    assemble(settings)?;
    println!(
        "settings ok: {} route(s), {}",
        settings.routes.len(),
        settings.redis.backend
    );
    Ok(())
}

/// A runtime failure: what was being done, and the error.
fn runtime(what: &str, error: &dyn fmt::Display) -> Failure {
    Failure::Runtime(format!("{what}: {error}"))
}

/// The process's life: start, serve until a signal, drain.
async fn run(settings: Settings) -> Result<(), Failure> {
    // First: a signal sent while the sidecar starts is not lost.
    let mut signals = Signals::listen().map_err(|e| runtime("cannot listen for signals", &e))?;
    let shutdown = Shutdown::new();
    let (assembled, mut server) = start(&settings, &shutdown).await?;
    let signal = tokio::select! {
        signal = signals.next() => signal,
        ended = &mut server => {
            return Err(Failure::Runtime(format!("the listener stopped: {ended:?}")));
        }
    };
    println!(
        "{signal}: draining (at most {:?}; a second signal stops at once)",
        settings.drain_timeout
    );
    shutdown.start_draining();
    tokio::select! {
        drained = drain(&settings, &assembled, server) => drained,
        signal = signals.next() => Err(Failure::Runtime(format!("{signal} during the drain: stopped at once"))),
    }
}

/// Starts serving: the metrics (before the guard: counters are registered when its
/// layers are made), what the sidecar serves with, the admin endpoints, the listener.
async fn start(
    settings: &Settings,
    shutdown: &Shutdown,
) -> Result<(Assembled, JoinHandle<()>), Failure> {
    if let Some(addr) = settings.metrics {
        let handle = stampede_guard::prometheus::install()
            .map_err(|e| runtime(&format!("metrics on {addr}"), &e))?;
        let listener = bind(addr).await?;
        // The address bound (`--metrics 127.0.0.1:0` picks a free port).
        println!(
            "metrics on http://{}/metrics",
            listener.local_addr().unwrap_or(addr)
        );
        tokio::spawn(metrics::serve(listener, handle));
    }
    let assembled = assemble(settings)?;
    let listener = bind(settings.listen).await?;
    if let Some(addr) = settings.admin {
        let admin = admin::router(admin::Admin {
            guard: assembled.guard.clone(),
            shutdown: shutdown.clone(),
            token: settings.admin_token.as_deref().map(Arc::from),
            routes: Some(assembled.routes.clone()),
        });
        let listener = bind(addr).await?;
        println!("admin on http://{}", listener.local_addr().unwrap_or(addr));
        // Answers until the process exits: through the drain too (`/readyz` says 503).
        tokio::spawn(async move { axum::serve(listener, admin).await });
    }
    if let Err(error) = assembled.guard.ready().await {
        println!("Redis does not answer ({error}): serving from the local cache until it does.");
    }
    let addr = listener.local_addr().unwrap_or(settings.listen);
    println!("{}", banner(settings, &assembled, addr));
    let service = access::wrap(assembled.routes.clone(), settings.access_log);
    let server = server::serve(
        listener,
        settings.limits.clone(),
        assembled.tls.clone(),
        service,
        shutdown.started(),
    );
    Ok((assembled, tokio::spawn(server)))
}

/// The start line: what is cached, where, on what.
fn banner(settings: &Settings, assembled: &Assembled, addr: SocketAddr) -> String {
    let routes = settings.routes.len();
    format!(
        "caching {} on {}://{addr} ({}, {routes} route{}{})",
        settings.upstream,
        if assembled.tls.is_some() {
            "https"
        } else {
            "http"
        },
        if settings.redis.backend.is_shared() {
            "L1 + Redis"
        } else {
            "L1 only"
        },
        if routes == 1 { "" } else { "s" },
        if settings.default.is_some() {
            " and the default"
        } else {
            ", others passed through"
        },
    )
}

/// The drain: requests in flight first (a cold fill's callers wait for it), then the
/// refreshes and fills they started, all within the drain timeout.
async fn drain(
    settings: &Settings,
    assembled: &Assembled,
    mut server: JoinHandle<()>,
) -> Result<(), Failure> {
    let deadline = Instant::now() + settings.drain_timeout;
    let requests = tokio::time::timeout_at(deadline, &mut server).await.is_ok();
    let left = deadline.saturating_duration_since(Instant::now());
    let work = assembled.guard.drained(left).await;
    if requests && work {
        println!("drained: every request, refresh and fill finished");
        return Ok(());
    }
    Err(Failure::Runtime(format!(
        "drain cut short after {:?}: {}",
        settings.drain_timeout,
        match (requests, work) {
            (false, _) => "requests were still in flight",
            _ => "refreshes or fills were still at work",
        }
    )))
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, Failure> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| Failure::Runtime(format!("cannot listen on {addr}: {e}")))
}
