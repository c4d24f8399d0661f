//! The settings the sidecar runs with: the config file's values (TOML), overridden by
//! the flags, checked, with every policy built. Each section reads its flags and its
//! file values into the same types and merges them there: [`limits`] (the client side
//! and the origin's), [`redis`], [`policy`] (a route's fields) and [`routes`].
//!
//! A refusal names the file, the route (by name, else by its place in the list) and the
//! field, as the file spells it.

mod defaults;
mod file;
mod limits;
mod place;
mod policy;
mod redis;
mod routes;

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use http::Uri;
use stampede_guard::{ConfigError, Policy};

use self::file::File;
use self::place::Place;
pub(crate) use self::place::SettingError;
pub(crate) use self::redis::{Backend, Redis};
pub(crate) use self::routes::Route;
use crate::access::Format;
use crate::args::{self, Args};
use crate::server::Limits;
use crate::upstream::Origin;

/// What the sidecar runs with.
pub(crate) struct Settings {
    pub(crate) file: Option<PathBuf>,
    pub(crate) listen: SocketAddr,
    pub(crate) upstream: Uri,
    pub(crate) redis: Redis,
    pub(crate) metrics: Option<SocketAddr>,
    pub(crate) admin: Option<SocketAddr>,
    pub(crate) admin_token: Option<String>,
    pub(crate) drain_timeout: Duration,
    /// Threads serving requests; none for one per core.
    pub(crate) workers: Option<usize>,
    /// The client side: connections, their timeouts, TLS.
    pub(crate) limits: Limits,
    /// How the origin is spoken to.
    pub(crate) origin: Origin,
    pub(crate) access_log: Format,
    pub(crate) env: String,
    /// By default, named after the upstream (see [`service_of`]): sidecars fronting
    /// different origins on one Redis never share keys.
    pub(crate) service: String,
    /// Where the key secret is read from when `STAMPEDE_GUARD_SECRET` is not set.
    pub(crate) secret_file: Option<PathBuf>,
    pub(crate) l1_capacity: Option<u64>,
    pub(crate) refresh_budget: Option<usize>,
    /// What the fills in flight may hold together (the guard's `fill_memory`).
    pub(crate) fill_memory: Option<u64>,
    /// The policy of requests that match no route, or `None` to pass them through.
    pub(crate) default: Option<Policy>,
    /// By prefix, longest first.
    pub(crate) routes: Vec<Route>,
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("file", &self.file)
            .field("listen", &self.listen)
            .field("upstream", &self.upstream)
            .field("redis", &self.redis)
            .field("metrics", &self.metrics)
            .field("admin", &self.admin)
            .field("admin_token", &self.admin_token.as_ref().map(|_| "<set>"))
            .field("drain_timeout", &self.drain_timeout)
            .field("workers", &self.workers)
            .field("limits", &self.limits)
            .field("origin", &self.origin)
            .field("access_log", &self.access_log)
            .field("default", &self.default)
            .field("routes", &self.routes)
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// Reads the config file named by `--config` (if any) and lays the flags over it.
    pub(crate) fn load(args: &Args) -> Result<Self, SettingError> {
        let file = match &args.config {
            Some(path) => file::read(path)?,
            None => File::default(),
        };
        Self::resolve(args, file)
    }

    fn resolve(args: &Args, file: File) -> Result<Self, SettingError> {
        let top = Place::top(args.config.as_deref());
        let upstream = match (&args.upstream, &file.upstream) {
            (Some(uri), _) => uri.clone(),
            (None, Some(text)) => args::upstream(text).map_err(|e| top.error("upstream", e))?,
            (None, None) => Uri::from_static(defaults::UPSTREAM),
        };
        let workers = args.workers.or(file.workers);
        if workers == Some(0) {
            return Err(top.error("workers", "must be at least 1"));
        }
        let drain_timeout = match args.drain_timeout {
            Some(d) => d,
            None => top
                .duration("drain_timeout", &file.drain_timeout)?
                .unwrap_or(defaults::DRAIN_TIMEOUT),
        };
        let limits = limits::limits(args, &file, &top)?;
        let origin = limits::origin(args, &file, &top, &upstream)?;
        let redis = redis::redis(args, &file, &top)?;
        let policies = routes::policies(args, &file, &top)?;
        let fill_memory = match (args.fill_memory, &file.fill_memory) {
            (Some(bytes), _) => Some(bytes),
            (None, Some(size)) => Some(size.bytes().map_err(|e| top.error("fill_memory", e))?),
            (None, None) => None,
        };
        Ok(Self {
            file: args.config.clone(),
            listen: args
                .listen
                .or(file.listen)
                .unwrap_or_else(|| defaults::LISTEN.parse().expect("an address")),
            service: file
                .service
                .clone()
                .unwrap_or_else(|| service_of(&upstream)),
            upstream,
            redis,
            metrics: args.metrics.or(file.metrics),
            admin: args.admin.or(file.admin),
            admin_token: args.admin_token.clone().or(file.admin_token),
            drain_timeout,
            workers,
            limits,
            origin,
            access_log: args.access_log.or(file.access_log).unwrap_or(Format::Off),
            env: file.env.unwrap_or_else(|| defaults::ENV.to_owned()),
            secret_file: args.secret_file.clone().or(file.secret_file),
            l1_capacity: file.l1_capacity,
            refresh_budget: file.refresh_budget,
            fill_memory,
            default: policies.default,
            routes: policies.routes,
        })
    }

    /// A refusal of a top-level setting (the key space, Redis, the guard).
    pub(crate) fn setting_error(&self, field: &str, message: String) -> SettingError {
        Place::top(self.file.as_deref()).error(field, message)
    }

    /// Turns a refusal of the guard (when it makes a route's layer) into one that names
    /// the route and field as the file does.
    pub(crate) fn layer_error(&self, route: &str, error: &ConfigError) -> SettingError {
        let place = Place {
            file: self.file.as_deref(),
            route: (route != defaults::ROUTE || self.default.is_none())
                .then(|| format!("\"{route}\"")),
        };
        place.error(policy::file_field(error.field()), error.to_string())
    }
}

/// The default service of the key space: the upstream's host and port, in the characters
/// a key part takes (`http://Origin.example:8080` is `origin-example-8080`). Two fleets
/// fronting different origins on one Redis then never compute the same keys.
fn service_of(upstream: &Uri) -> String {
    let host = upstream.host().unwrap_or("origin");
    let port = upstream
        .port_u16()
        .unwrap_or(if upstream.scheme_str() == Some("https") {
            443
        } else {
            80
        });
    let mut service: String = format!("{host}-{port}")
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '-',
        })
        .collect();
    service.truncate(48);
    service
}

#[cfg(test)]
mod tests;
