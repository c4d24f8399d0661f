//! The config file (TOML) and the settings the sidecar runs with: the file's values,
//! overridden by the flags, checked, with every policy built.
//!
//! A refusal names the file, the route (by name, else by its place in the list) and the
//! field, as the file spells it.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Uri;
use serde::Deserialize;
use stampede_guard::{ColdMiss, ConfigError, Policy};

use crate::access::Format;
use crate::args::{self, Args, redacted};
use crate::server::{Limits, Tls};
use crate::upstream::{Cidr, KEYED_FORWARDING, Origin};

/// Settings with no flag and no file value.
mod defaults {
    use std::time::Duration;

    pub(super) const LISTEN: &str = "127.0.0.1:8080";
    pub(super) const UPSTREAM: &str = "http://127.0.0.1:9000";
    pub(super) const FRESH: Duration = Duration::from_secs(1);
    pub(super) const GRACE: Duration = Duration::from_secs(10);
    pub(super) const LEASE: Duration = Duration::from_secs(5);
    pub(super) const COLD_WAIT: Duration = Duration::from_secs(2);
    pub(super) const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
    pub(super) const ENV: &str = "sidecar";
    pub(super) const VIA: &str = "stampede-sidecar";
    pub(super) const MAX_CONNECTIONS: usize = 10_000;
    pub(super) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
    pub(super) const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(60);
    pub(super) const REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(60);
    pub(super) const SEND_TIMEOUT: Duration = Duration::from_secs(60);
    pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
    pub(super) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(60);
    pub(super) const UPSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
    /// The route name of requests that match no route.
    pub(super) const ROUTE: &str = "default";
}

/// Declares a struct of the file with its own fields and the policy fields that both the
/// top level and each route take (serde's `flatten` would lose `deny_unknown_fields`).
macro_rules! with_policy_fields {
    ($(#[$meta:meta])* struct $name:ident { $($(#[$fmeta:meta])* $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        struct $name {
            $($(#[$fmeta])* $field: $ty,)*
            fresh: Option<String>,
            grace: Option<String>,
            lease: Option<String>,
            cold_wait: Option<String>,
            cold_miss: Option<ColdMissFile>,
            key_query: Option<KeyQueryFile>,
            key_headers: Option<Vec<String>>,
            stale_if_error: Option<String>,
            max_body: Option<SizeFile>,
            follow_origin: Option<bool>,
            invalidate_on_unsafe: Option<bool>,
            min_fresh: Option<String>,
            max_fresh: Option<String>,
            keep: Option<String>,
            eager_refresh: Option<f64>,
            xfetch: Option<f64>,
        }

        impl $name {
            fn policy_fields(&self) -> PolicyFields {
                PolicyFields {
                    fresh: self.fresh.clone(),
                    grace: self.grace.clone(),
                    lease: self.lease.clone(),
                    cold_wait: self.cold_wait.clone(),
                    cold_miss: self.cold_miss.clone(),
                    key_query: self.key_query.clone(),
                    key_headers: self.key_headers.clone(),
                    stale_if_error: self.stale_if_error.clone(),
                    max_body: self.max_body.clone(),
                    follow_origin: self.follow_origin,
                    invalidate_on_unsafe: self.invalidate_on_unsafe,
                    min_fresh: self.min_fresh.clone(),
                    max_fresh: self.max_fresh.clone(),
                    keep: self.keep.clone(),
                    eager_refresh: self.eager_refresh,
                    xfetch: self.xfetch,
                }
            }
        }
    };
}

with_policy_fields! {
    /// The file's top level: the sidecar's settings and the policy of requests that
    /// match no route (which routes start from).
    #[derive(Deserialize, Default)]
    #[serde(deny_unknown_fields)]
    struct File {
        listen: Option<SocketAddr>,
        upstream: Option<String>,
        redis: Option<String>,
        redis_cluster: Option<Vec<String>>,
        redis_sentinels: Option<Vec<String>>,
        redis_sentinel_service: Option<String>,
        redis_ca: Option<PathBuf>,
        redis_client_cert: Option<PathBuf>,
        redis_client_key: Option<PathBuf>,
        redis_username: Option<String>,
        metrics: Option<SocketAddr>,
        admin: Option<SocketAddr>,
        admin_token: Option<String>,
        via: Option<String>,
        trusted_proxies: Option<Vec<String>>,
        drain_timeout: Option<String>,
        workers: Option<usize>,
        max_connections: Option<usize>,
        header_read_timeout: Option<String>,
        keep_alive_timeout: Option<String>,
        request_body_timeout: Option<String>,
        send_timeout: Option<String>,
        connect_timeout: Option<String>,
        response_timeout: Option<String>,
        upstream_idle_timeout: Option<String>,
        upstream_http2: Option<bool>,
        upstream_ca: Option<PathBuf>,
        access_log: Option<Format>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        env: Option<String>,
        service: Option<String>,
        secret_file: Option<PathBuf>,
        l1_capacity: Option<u64>,
        refresh_budget: Option<usize>,
        default: Option<Unrouted>,
        #[serde(default)]
        routes: Vec<RouteFile>,
    }
}

with_policy_fields! {
    /// One `[[routes]]` table.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct RouteFile {
        name: String,
        prefix: String,
    }
}

/// The policy fields, each unset where the file leaves it out.
#[derive(Clone, Default)]
struct PolicyFields {
    fresh: Option<String>,
    grace: Option<String>,
    lease: Option<String>,
    cold_wait: Option<String>,
    cold_miss: Option<ColdMissFile>,
    key_query: Option<KeyQueryFile>,
    key_headers: Option<Vec<String>>,
    stale_if_error: Option<String>,
    max_body: Option<SizeFile>,
    follow_origin: Option<bool>,
    invalidate_on_unsafe: Option<bool>,
    min_fresh: Option<String>,
    max_fresh: Option<String>,
    keep: Option<String>,
    eager_refresh: Option<f64>,
    xfetch: Option<f64>,
}

/// A size in the file: a number of bytes (`max_body = 1048576`), or text with its unit
/// (`max_body = "16MiB"`), as durations take `"1s"`.
#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum SizeFile {
    Bytes(u64),
    Text(String),
}

/// `cold_miss = "passthrough"` or `cold_miss = { reject = { retry_after = "2s" } }`.
#[derive(Deserialize, Clone)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum ColdMissFile {
    Passthrough,
    Reject { retry_after: String },
}

/// `key_query = ["page", "sort"]`, `"all"` or `"ignore"`.
#[derive(Deserialize, Clone)]
#[serde(untagged)]
enum KeyQueryFile {
    Only(Vec<String>),
    Mode(String),
}

/// What requests that match no route get: `default = "cache"` (the top-level policy) or
/// `default = "pass"` (forwarded uncached).
#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Unrouted {
    Cache,
    Pass,
}

/// A refused setting: where it is, and why.
#[derive(Debug)]
pub(crate) struct SettingError {
    /// The config file, if the setting came from one.
    file: Option<PathBuf>,
    /// The route, by name or else by its place (`routes[2]`); none for the top level.
    route: Option<String>,
    /// The field, as the file spells it.
    field: Option<String>,
    message: String,
}

impl fmt::Display for SettingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.file {
            Some(file) => write!(f, "config file {}", file.display())?,
            None => write!(f, "settings")?,
        }
        if let Some(route) = &self.route {
            write!(f, ", route {route}")?;
        }
        if let Some(field) = &self.field {
            write!(f, ", field `{field}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for SettingError {}

/// Where the policy being checked sits, for its errors.
#[derive(Clone)]
struct Place<'a> {
    file: Option<&'a Path>,
    route: Option<String>,
}

impl Place<'_> {
    fn error(&self, field: &str, message: impl Into<String>) -> SettingError {
        SettingError {
            file: self.file.map(Path::to_path_buf),
            route: self.route.clone(),
            field: Some(field.to_owned()),
            message: message.into(),
        }
    }

    fn duration(
        &self,
        field: &str,
        text: &Option<String>,
    ) -> Result<Option<Duration>, SettingError> {
        text.as_deref()
            .map(args::duration)
            .transpose()
            .map_err(|e| self.error(field, e))
    }
}

/// One route: requests whose path starts with `prefix` get `policy`.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) prefix: String,
    pub(crate) policy: Policy,
}

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

/// The fleet's Redis, if any, and how to reach it. The password is not here: it comes
/// from `STAMPEDE_SIDECAR_REDIS_PASSWORD` or the URLs, when the store is built.
pub(crate) struct Redis {
    pub(crate) backend: Backend,
    pub(crate) ca: Option<PathBuf>,
    pub(crate) client_cert: Option<PathBuf>,
    pub(crate) client_key: Option<PathBuf>,
    pub(crate) username: Option<String>,
}

/// Which Redis.
pub(crate) enum Backend {
    /// None: the local cache only.
    Local,
    /// One server (`redis`).
    Single(String),
    /// A Redis Cluster, by some of its nodes (`redis_cluster`).
    Cluster(Vec<String>),
    /// The primary the sentinels watch under `service` (`redis_sentinels`,
    /// `redis_sentinel_service`).
    Sentinel {
        sentinels: Vec<String>,
        service: String,
    },
}

impl Backend {
    /// Whether a fleet shares it (and so needs a shared secret).
    pub(crate) fn is_shared(&self) -> bool {
        !matches!(self, Self::Local)
    }
}

/// Says which backend, without a password: for `--check`, the start line and `Debug`.
impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |urls: &[String]| {
            urls.iter()
                .map(|u| redacted(u))
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self {
            Self::Local => f.write_str("the local cache only"),
            Self::Single(url) => write!(f, "Redis at {}", redacted(url)),
            Self::Cluster(nodes) => write!(f, "Redis Cluster from {}", list(nodes)),
            Self::Sentinel { sentinels, service } => {
                write!(
                    f,
                    "Redis Sentinel service {service} from {}",
                    list(sentinels)
                )
            }
        }
    }
}

impl fmt::Debug for Redis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redis")
            .field("backend", &self.backend.to_string())
            .field("ca", &self.ca)
            .field("client_cert", &self.client_cert)
            .field("client_key", &self.client_key)
            .field("username", &self.username)
            .finish()
    }
}

/// The Redis settings: a backend given by flags replaces the file's; one backend at
/// most.
fn redis(args: &Args, file: &File, top: &Place<'_>) -> Result<Redis, SettingError> {
    let flags =
        !(args.redis.is_none() && args.redis_cluster.is_empty() && args.redis_sentinels.is_empty());
    let (single, cluster, sentinels, service) = if flags {
        (
            args.redis.clone(),
            args.redis_cluster.clone(),
            args.redis_sentinels.clone(),
            args.redis_sentinel_service.clone(),
        )
    } else {
        (
            file.redis.clone(),
            file.redis_cluster.clone().unwrap_or_default(),
            file.redis_sentinels.clone().unwrap_or_default(),
            args.redis_sentinel_service
                .clone()
                .or(file.redis_sentinel_service.clone()),
        )
    };
    let backend = match (single, cluster.is_empty(), sentinels.is_empty()) {
        (None, true, true) => {
            if service.is_some() {
                return Err(top.error(
                    "redis_sentinel_service",
                    "is for redis_sentinels, and none is set",
                ));
            }
            Backend::Local
        }
        (Some(url), true, true) => Backend::Single(url),
        (None, false, true) => Backend::Cluster(cluster),
        (None, true, false) => Backend::Sentinel {
            sentinels,
            service: service.ok_or_else(|| {
                top.error(
                    "redis_sentinel_service",
                    "is needed with redis_sentinels: the name they watch the primary under",
                )
            })?,
        },
        _ => {
            return Err(top.error(
                "redis",
                "give one of redis, redis_cluster and redis_sentinels, not several",
            ));
        }
    };
    let redis = Redis {
        backend,
        ca: args.redis_ca.clone().or(file.redis_ca.clone()),
        client_cert: args
            .redis_client_cert
            .clone()
            .or(file.redis_client_cert.clone()),
        client_key: args
            .redis_client_key
            .clone()
            .or(file.redis_client_key.clone()),
        username: args.redis_username.clone().or(file.redis_username.clone()),
    };
    if redis.client_cert.is_some() != redis.client_key.is_some() {
        let missing = if redis.client_cert.is_some() {
            "redis_client_key"
        } else {
            "redis_client_cert"
        };
        return Err(top.error(
            missing,
            "redis_client_cert and redis_client_key go together",
        ));
    }
    if !redis.backend.is_shared()
        && let Some(field) = [
            ("redis_ca", redis.ca.is_some()),
            ("redis_client_cert", redis.client_cert.is_some()),
            ("redis_username", redis.username.is_some()),
        ]
        .iter()
        .find_map(|(field, set)| set.then_some(*field))
    {
        return Err(top.error(field, "is set, but no Redis is"));
    }
    Ok(redis)
}

impl Settings {
    /// Reads the config file named by `--config` (if any) and lays the flags over it.
    pub(crate) fn load(args: &Args) -> Result<Self, SettingError> {
        let file = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| SettingError {
                    file: Some(path.clone()),
                    route: None,
                    field: None,
                    message: format!("cannot be read: {e}"),
                })?;
                parse(&text, path)?
            }
            None => File::default(),
        };
        Self::resolve(args, file)
    }

    fn resolve(args: &Args, file: File) -> Result<Self, SettingError> {
        let path = args.config.as_deref();
        let top = Place {
            file: path,
            route: None,
        };
        let upstream = match (&args.upstream, &file.upstream) {
            (Some(uri), _) => uri.clone(),
            (None, Some(text)) => args::upstream(text).map_err(|e| top.error("upstream", e))?,
            (None, None) => Uri::from_static(defaults::UPSTREAM),
        };
        let service = file
            .service
            .clone()
            .unwrap_or_else(|| service_of(&upstream));
        let trusted_proxies = if args.trusted_proxies.is_empty() {
            file.trusted_proxies.clone().unwrap_or_default()
        } else {
            args.trusted_proxies.clone()
        }
        .iter()
        .map(|text| Cidr::parse(text).map_err(|e| top.error("trusted_proxies", e)))
        .collect::<Result<Vec<_>, _>>()?;
        let via = match args.via.clone().or(file.via.clone()) {
            None => Some(defaults::VIA.to_owned()),
            Some(name) if name.is_empty() => None,
            Some(name) if name.bytes().all(is_tchar) => Some(name),
            Some(name) => {
                return Err(top.error(
                    "via",
                    format!("`{name}` is not a token (letters, digits and !#$%&'*+-.^_`|~)"),
                ));
            }
        };
        let drain_timeout = match args.drain_timeout {
            Some(d) => d,
            None => top
                .duration("drain_timeout", &file.drain_timeout)?
                .unwrap_or(defaults::DRAIN_TIMEOUT),
        };
        let timeout = |field: &str, flag: Option<Duration>, text: &Option<String>, default| {
            let value = match flag {
                Some(d) => d,
                None => top.duration(field, text)?.unwrap_or(default),
            };
            if value.is_zero() {
                return Err(top.error(field, "must be more than 0s"));
            }
            Ok(value)
        };
        let workers = args.workers.or(file.workers);
        if workers == Some(0) {
            return Err(top.error("workers", "must be at least 1"));
        }
        let max_connections = args
            .max_connections
            .or(file.max_connections)
            .unwrap_or(defaults::MAX_CONNECTIONS);
        if max_connections == 0 {
            return Err(top.error("max_connections", "must be at least 1"));
        }
        let tls = match (
            args.tls_cert.clone().or(file.tls_cert.clone()),
            args.tls_key.clone().or(file.tls_key.clone()),
        ) {
            (Some(cert), Some(key)) => Some(Tls { cert, key }),
            (None, None) => None,
            (Some(_), None) => return Err(top.error("tls_key", "is needed with tls_cert")),
            (None, Some(_)) => return Err(top.error("tls_cert", "is needed with tls_key")),
        };
        let limits = Limits {
            max_connections,
            header_read: timeout(
                "header_read_timeout",
                args.header_read_timeout,
                &file.header_read_timeout,
                defaults::HEADER_READ_TIMEOUT,
            )?,
            keep_alive: timeout(
                "keep_alive_timeout",
                args.keep_alive_timeout,
                &file.keep_alive_timeout,
                defaults::KEEP_ALIVE_TIMEOUT,
            )?,
            body_read: timeout(
                "request_body_timeout",
                args.request_body_timeout,
                &file.request_body_timeout,
                defaults::REQUEST_BODY_TIMEOUT,
            )?,
            send: timeout(
                "send_timeout",
                args.send_timeout,
                &file.send_timeout,
                defaults::SEND_TIMEOUT,
            )?,
            tls,
        };
        let origin = Origin {
            uri: upstream.clone(),
            connect: timeout(
                "connect_timeout",
                args.connect_timeout,
                &file.connect_timeout,
                defaults::CONNECT_TIMEOUT,
            )?,
            response: timeout(
                "response_timeout",
                args.response_timeout,
                &file.response_timeout,
                defaults::RESPONSE_TIMEOUT,
            )?,
            idle: timeout(
                "upstream_idle_timeout",
                args.upstream_idle_timeout,
                &file.upstream_idle_timeout,
                defaults::UPSTREAM_IDLE_TIMEOUT,
            )?,
            http2: args.upstream_http2.or(file.upstream_http2).unwrap_or(false),
            ca: args.upstream_ca.clone().or(file.upstream_ca.clone()),
            via,
            trusted_proxies,
        };
        let redis = redis(args, &file, &top)?;
        if origin.ca.is_some() && upstream.scheme_str() != Some("https") {
            return Err(top.error("upstream_ca", "is for an https:// upstream"));
        }
        if let Some(mode) = &file.default
            && *mode == Unrouted::Pass
            && file.routes.is_empty()
        {
            return Err(top.error("default", "\"pass\" with no routes would cache nothing"));
        }
        // The top level's policy fields, with the flags laid over them: the policy of
        // unrouted requests, and what each route starts from.
        let mut base = file.policy_fields();
        let flag = |d: Option<Duration>| d.map(|d| format!("{}ms", d.as_millis()));
        if args.fresh.is_some() {
            base.fresh = flag(args.fresh);
        }
        if args.grace.is_some() {
            base.grace = flag(args.grace);
        }
        if args.follow_origin.is_some() {
            base.follow_origin = args.follow_origin;
        }
        if args.lease.is_some() {
            base.lease = flag(args.lease);
        }
        if args.cold_wait.is_some() {
            base.cold_wait = flag(args.cold_wait);
        }
        if let Some(bytes) = args.max_body {
            base.max_body = Some(SizeFile::Bytes(bytes));
        }
        let default = match file.default.unwrap_or(Unrouted::Cache) {
            Unrouted::Cache => Some(policy(&top, defaults::ROUTE, &base)?),
            Unrouted::Pass => None,
        };
        // The top level's one-way fields: whether a policy takes each (the default's, a
        // route's that does not set its own), and whether one that takes it reads it.
        let mut top_level = [Taken::default(); ONE_WAY.len()];
        if default.is_some() {
            for (taken, (_, way)) in top_level.iter_mut().zip(ONE_WAY) {
                taken.note(follows(&base) == way);
            }
        }
        let mut routes: Vec<Route> = Vec::with_capacity(file.routes.len());
        for (i, route) in file.routes.iter().enumerate() {
            let place = Place {
                file: path,
                route: Some(format!("\"{}\" (routes[{i}])", route.name)),
            };
            if !route.prefix.starts_with('/') {
                return Err(place.error("prefix", format!("`{}` must start with /", route.prefix)));
            }
            if let Some(other) = routes.iter().find(|r| r.prefix == route.prefix) {
                return Err(place.error(
                    "prefix",
                    format!(
                        "`{}` is route \"{}\"'s prefix too",
                        route.prefix,
                        other.policy.route()
                    ),
                ));
            }
            if let Some(first) = file.routes[..i].iter().position(|r| r.name == route.name) {
                return Err(place.error(
                    "name",
                    format!(
                        "\"{}\" is routes[{first}]'s name too: each route needs a name of its \
                         own (it labels its metrics and its keys)",
                        route.name
                    ),
                ));
            }
            if route.name == defaults::ROUTE && default.is_some() {
                return Err(place.error(
                    "name",
                    "\"default\" is the name of requests that match no route",
                ));
            }
            let fields = route.policy_fields();
            let own = ONE_WAY.map(|(field, _)| fields.is_set(field));
            let merged = PolicyFields {
                fresh: fields.fresh.or_else(|| base.fresh.clone()),
                grace: fields.grace.or_else(|| base.grace.clone()),
                lease: fields.lease.or_else(|| base.lease.clone()),
                cold_wait: fields.cold_wait.or_else(|| base.cold_wait.clone()),
                cold_miss: fields.cold_miss.or_else(|| base.cold_miss.clone()),
                key_query: fields.key_query.or_else(|| base.key_query.clone()),
                key_headers: fields.key_headers.or_else(|| base.key_headers.clone()),
                stale_if_error: fields
                    .stale_if_error
                    .or_else(|| base.stale_if_error.clone()),
                max_body: fields.max_body.clone().or_else(|| base.max_body.clone()),
                follow_origin: fields.follow_origin.or(base.follow_origin),
                invalidate_on_unsafe: fields.invalidate_on_unsafe.or(base.invalidate_on_unsafe),
                min_fresh: fields.min_fresh.or_else(|| base.min_fresh.clone()),
                max_fresh: fields.max_fresh.or_else(|| base.max_fresh.clone()),
                keep: fields.keep.or_else(|| base.keep.clone()),
                eager_refresh: fields.eager_refresh.or(base.eager_refresh),
                xfetch: fields.xfetch.or(base.xfetch),
            };
            let built = policy(&place, &route.name, &merged)?;
            for ((taken, (field, way)), own) in top_level.iter_mut().zip(ONE_WAY).zip(own) {
                match own {
                    true if follows(&merged) != way => {
                        return Err(place.error(field, unread(field, way, Said::Route)));
                    }
                    true => {}
                    false => taken.note(follows(&merged) == way),
                }
            }
            routes.push(Route {
                prefix: route.prefix.clone(),
                policy: built,
            });
        }
        for (taken, (field, way)) in top_level.iter().zip(ONE_WAY) {
            if base.is_set(field) && taken.by_some && !taken.read {
                // `--fresh` is the only one of them that is a flag too.
                let (place, said) = match (field, args.fresh) {
                    ("fresh", Some(_)) => (
                        Place {
                            file: None,
                            route: None,
                        },
                        Said::Flag,
                    ),
                    _ => (top.clone(), Said::TopLevel),
                };
                return Err(place.error(field, unread(field, way, said)));
            }
        }
        // Longest prefix first: the first that matches is the longest.
        routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));
        Ok(Self {
            file: path.map(Path::to_path_buf),
            listen: args
                .listen
                .or(file.listen)
                .unwrap_or_else(|| defaults::LISTEN.parse().expect("an address")),
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
            service,
            secret_file: args.secret_file.clone().or(file.secret_file),
            l1_capacity: file.l1_capacity,
            refresh_budget: file.refresh_budget,
            default,
            routes,
        })
    }

    /// A refusal of a top-level setting (the key space, Redis, the guard).
    pub(crate) fn setting_error(&self, field: &str, message: String) -> SettingError {
        let place = Place {
            file: self.file.as_deref(),
            route: None,
        };
        place.error(field, message)
    }

    /// Turns a refusal of the guard (when it makes a route's layer) into one that names
    /// the route and field as the file does.
    pub(crate) fn layer_error(&self, route: &str, error: &ConfigError) -> SettingError {
        let place = Place {
            file: self.file.as_deref(),
            route: (route != defaults::ROUTE || self.default.is_none())
                .then(|| format!("\"{route}\"")),
        };
        place.error(file_field(error.field()), error.to_string())
    }
}

/// Parses the file, naming the route an error is in when it is in one.
fn parse(text: &str, path: &Path) -> Result<File, SettingError> {
    toml::from_str(text).map_err(|error| {
        let route = error.span().and_then(|span| route_at(text, span.start));
        SettingError {
            file: Some(path.to_path_buf()),
            route,
            field: None,
            message: error.to_string().trim_end().to_owned(),
        }
    })
}

/// The `[[routes]]` table that byte `at` of `text` falls in (by name where the table
/// has a plain `name = "…"` line), for errors that serde reports without one.
fn route_at(text: &str, at: usize) -> Option<String> {
    let before = &text[..at.min(text.len())];
    let mut seen = 0;
    // The route the line is in: its place in the list and where its table starts.
    let mut current = None;
    let mut offset = 0;
    for line in before.split_inclusive('\n') {
        let header = line.trim();
        if header == "[[routes]]" {
            current = Some((seen, offset));
            seen += 1;
        } else if header.starts_with('[') && !header.starts_with("[routes.") {
            current = None;
        }
        offset += line.len();
    }
    let (i, start) = current?;
    let name = text[start..]
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().starts_with("[["))
        .find_map(|l| {
            let (key, value) = l.split_once('=')?;
            (key.trim() == "name").then(|| value.trim().trim_matches('"').to_owned())
        });
    Some(match name {
        Some(name) => format!("\"{name}\" (routes[{i}])"),
        None => format!("routes[{i}]"),
    })
}

/// The file's name for a field the crate names as its builder method does.
fn file_field(field: &str) -> &str {
    match field {
        "fresh_ttl" => "fresh",
        // The lease bounds the refresh and the back-off after an error.
        "lease_ttl" | "refresh_timeout" | "error_backoff" | "watchdog" => "lease",
        "route" => "name",
        other => other,
    }
}

/// The policy fields that only one of the two ways of setting an entry's lifetimes reads,
/// and which one (whether it follows the origin): `fresh` is read by a policy of its own
/// only, `min_fresh` and `max_fresh` by one that follows the origin only. Set where no
/// policy reads them they would do nothing, silently, so they are refused.
const ONE_WAY: [(&str, bool); 3] = [("fresh", false), ("min_fresh", true), ("max_fresh", true)];

impl PolicyFields {
    /// Whether the one-way `field` is set here.
    fn is_set(&self, field: &str) -> bool {
        match field {
            "fresh" => self.fresh.is_some(),
            "min_fresh" => self.min_fresh.is_some(),
            "max_fresh" => self.max_fresh.is_some(),
            _ => false,
        }
    }
}

/// Whether a policy of these fields follows the origin (the sidecar's default).
fn follows(fields: &PolicyFields) -> bool {
    fields.follow_origin.unwrap_or(true)
}

/// Of a top-level one-way field: whether some policy takes it, and whether one that takes
/// it reads it. Taken by some and read by none, it does nothing.
#[derive(Clone, Copy, Default)]
struct Taken {
    by_some: bool,
    read: bool,
}

impl Taken {
    fn note(&mut self, read: bool) {
        self.by_some = true;
        self.read |= read;
    }
}

/// Where a one-way field that does nothing was set.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Said {
    Flag,
    TopLevel,
    Route,
}

/// Why one-way `field`, read only by a policy that follows the origin or only by one that
/// does not (`read_when_following`), does nothing where it was set.
fn unread(field: &str, read_when_following: bool, said: Said) -> String {
    let route = said == Said::Route;
    match (read_when_following, said) {
        (false, Said::Flag) => "--fresh does nothing while the sidecar follows the origin \
                                (--follow-origin true, the default): the origin's \
                                Cache-Control, Expires and Age say how long entries are \
                                fresh. Add --follow-origin false for entries fresh that \
                                long whatever the origin says, or leave --fresh out"
            .to_owned(),
        (false, _) => format!(
            "does nothing while {} the origin (follow_origin, true by default): the \
             origin's Cache-Control, Expires and Age say how long entries are fresh. Set \
             follow_origin = false{} for entries fresh that long whatever the origin \
             says, or leave it out (min_fresh and max_fresh bound what the origin says)",
            if route {
                "the route follows"
            } else {
                "every policy that takes it follows"
            },
            if route { " on the route" } else { "" },
        ),
        (true, _) => format!(
            "does nothing while {} the origin (follow_origin = false): `{field}` bounds \
             the lifetimes the origin gives, and `fresh` sets a policy's own. Leave it out, \
             or set follow_origin = true{}",
            if route {
                "the route does not follow"
            } else {
                "no policy that takes it follows"
            },
            if route { " on the route" } else { "" },
        ),
    }
}

/// Builds the policy of route `name` from its fields.
fn policy(place: &Place<'_>, name: &str, fields: &PolicyFields) -> Result<Policy, SettingError> {
    let fresh = place
        .duration("fresh", &fields.fresh)?
        .unwrap_or(defaults::FRESH);
    // An HTTP cache serves stale only when allowed: following the origin, that is what
    // its `stale-while-revalidate` says, unless a grace is set here (RFC 9111 §4.2.4's
    // "configuration"); with a policy of its own, the stampede guard's grace.
    let follow_origin = fields.follow_origin.unwrap_or(true);
    let grace = place
        .duration("grace", &fields.grace)?
        .unwrap_or(if follow_origin {
            Duration::ZERO
        } else {
            defaults::GRACE
        });
    let lease = place
        .duration("lease", &fields.lease)?
        .unwrap_or(defaults::LEASE);
    let cold_wait = place
        .duration("cold_wait", &fields.cold_wait)?
        .unwrap_or(defaults::COLD_WAIT);
    let mut builder = Policy::builder(name)
        .fresh_ttl(fresh)
        .grace(grace)
        .lease_ttl(lease)
        .refresh_timeout(lease)
        .cold_wait(cold_wait)
        .error_backoff(lease.min(Duration::from_secs(1)))
        // Every sidecar of the fleet fronts the same origin, under whatever host name
        // it is reached.
        .key_host(false);
    match &fields.cold_miss {
        None | Some(ColdMissFile::Passthrough) => {}
        Some(ColdMissFile::Reject { retry_after }) => {
            let retry_after = args::duration(retry_after)
                .map_err(|e| place.error("cold_miss.reject.retry_after", e))?;
            builder = builder.cold_miss(ColdMiss::Reject { retry_after });
        }
    }
    match &fields.key_query {
        None => {}
        Some(KeyQueryFile::Only(names)) => builder = builder.key_query(names),
        Some(KeyQueryFile::Mode(mode)) => match mode.as_str() {
            "all" => {}
            "ignore" => builder = builder.ignore_query(),
            other => {
                return Err(place.error(
                    "key_query",
                    format!("`{other}`: write a list of names, \"all\" or \"ignore\""),
                ));
            }
        },
    }
    // The scheme and host the client used, as vouched for, besides the route's own.
    let keyed = fields.key_headers.iter().flatten().map(String::as_str);
    builder = builder.key_headers(keyed.chain(KEYED_FORWARDING));
    if let Some(window) = place.duration("stale_if_error", &fields.stale_if_error)? {
        builder = builder.stale_if_error(window);
    }
    if let Some(size) = &fields.max_body {
        let bytes = match size {
            SizeFile::Bytes(bytes) => Ok(*bytes),
            SizeFile::Text(text) => args::size(text),
        }
        .and_then(|bytes| usize::try_from(bytes).map_err(|e| e.to_string()))
        .map_err(|e| place.error("max_body", e))?;
        builder = builder.max_body(bytes);
    }
    // An HTTP cache: it follows what the origin says unless told not to.
    builder = builder.follow_origin(follow_origin);
    // A successful unsafe request invalidates what it changed (RFC 9111 §4.4), unless
    // the route says not to: any client whose POST succeeds evicts its URI for the fleet.
    if let Some(invalidate) = fields.invalidate_on_unsafe {
        builder = builder.invalidate_on_unsafe(invalidate);
    }
    if let Some(floor) = place.duration("min_fresh", &fields.min_fresh)? {
        builder = builder.min_fresh(floor);
    }
    if let Some(ceiling) = place.duration("max_fresh", &fields.max_fresh)? {
        builder = builder.max_fresh(ceiling);
    }
    if let Some(window) = place.duration("keep", &fields.keep)? {
        builder = builder.keep(window);
    }
    if let Some(fraction) = fields.eager_refresh {
        builder = builder.eager_refresh(fraction);
    }
    if let Some(beta) = fields.xfetch {
        builder = builder.xfetch(beta);
    }
    builder
        .build()
        .map_err(|e| place.error(file_field(e.field()), e.to_string()))
}

/// A character of an HTTP token (RFC 9110 §5.6.2): what `Via` takes as a proxy's name.
fn is_tchar(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
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
mod tests {
    use super::*;
    use clap::Parser;

    fn load(flags: &[&str], text: &str) -> Result<Settings, SettingError> {
        let mut argv = vec!["stampede-sidecar", "--config", "sidecar.toml"];
        argv.extend_from_slice(flags);
        let args = Args::try_parse_from(argv).unwrap();
        Settings::resolve(&args, parse(text, Path::new("sidecar.toml"))?)
    }

    #[test]
    fn the_fixture_loads() {
        let text = include_str!("../../../tests/fixtures/sidecar.toml");
        let settings = load(&[], text).unwrap();
        let prefixes: Vec<&str> = settings.routes.iter().map(|r| r.prefix.as_str()).collect();
        assert_eq!(prefixes, ["/items/featured", "/reports/", "/items/"]);
        assert_eq!(
            settings.routes[2].policy.fresh_ttl(),
            Duration::from_secs(5)
        );
        // Inherited from the top level.
        assert_eq!(settings.routes[2].policy.grace(), Duration::ZERO);
        assert!(settings.default.is_none());
    }

    #[test]
    fn sizes_take_their_units_in_the_file_and_the_flag() {
        let text = "follow_origin = false\nmax_body = \"8MiB\"\nlisten = \"127.0.0.1:1\"\n\
                    [[routes]]\nname = \"a\"\nprefix = \"/a\"\nmax_body = 512\n\
                    [[routes]]\nname = \"b\"\nprefix = \"/b\"\n";
        let s = load(&[], text).unwrap();
        let max_body = |s: &Settings, name: &str| {
            s.routes
                .iter()
                .find(|r| r.policy.route() == name)
                .unwrap()
                .policy
                .max_body()
        };
        assert_eq!(s.default.as_ref().unwrap().max_body(), 8 << 20);
        assert_eq!(max_body(&s, "a"), 512);
        assert_eq!(max_body(&s, "b"), 8 << 20, "inherits the top level");
        let s = load(&["--max-body", "16MiB"], text).unwrap();
        assert_eq!(max_body(&s, "b"), 16 << 20, "inherits the flag");
        let refused = load(&[], "max_body = \"huge\"\n")
            .err()
            .unwrap()
            .to_string();
        assert!(
            refused.contains("max_body") && refused.contains("`huge` is not a size"),
            "{refused}"
        );
    }

    #[test]
    fn flags_override_the_top_level() {
        let text = "follow_origin = false\nfresh = \"3s\"\nlisten = \"127.0.0.1:1\"\n[[routes]]\nname = \"a\"\nprefix = \"/a\"\n\
                    [[routes]]\nname = \"b\"\nprefix = \"/b\"\nfresh = \"7s\"\n";
        let s = load(&["--fresh", "250ms", "--listen", "127.0.0.1:2"], text).unwrap();
        assert_eq!(s.listen, "127.0.0.1:2".parse().unwrap());
        assert_eq!(s.default.unwrap().fresh_ttl(), Duration::from_millis(250));
        let fresh = |name: &str| {
            s.routes
                .iter()
                .find(|r| r.policy.route() == name)
                .unwrap()
                .policy
                .fresh_ttl()
        };
        assert_eq!(fresh("a"), Duration::from_millis(250), "inherits the flag");
        assert_eq!(fresh("b"), Duration::from_secs(7), "its own value stands");
    }

    #[test]
    fn errors_name_the_file_the_route_and_the_field() {
        let route = |body: &str| {
            format!(
                "fresh = \"1s\"\n\n[[routes]]\nname = \"items\"\nprefix = \"/items/\"\n{body}\n"
            )
        };
        for (body, field) in [
            ("fresh = \"1x\"", "`fresh`"),
            ("fresh = \"0s\"", "`fresh`"),
            ("grace = \"2 fortnights\"", "`grace`"),
            ("key_query = \"some\"", "`key_query`"),
            ("key_headers = [\"bad header\"]", "`key_headers`"),
            (
                "cold_miss = { reject = { retry_after = \"soon\" } }",
                "retry_after",
            ),
            ("prefix2 = \"/x\"", "prefix2"),
        ] {
            let error = load(&[], &route(body)).map(|_| ()).unwrap_err().to_string();
            assert!(error.contains("sidecar.toml"), "{body}: {error}");
            assert!(error.contains("\"items\""), "{body}: {error}");
            assert!(error.contains(field), "{body}: {error}");
        }
        let error = load(&[], "fressh = \"1s\"")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(error.contains("fressh"), "{error}");
        let error = load(&[], "drain_timeout = \"x\"")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(error.contains("`drain_timeout`"), "{error}");
        let twice = "[[routes]]\nname = \"a\"\nprefix = \"/a\"\n[[routes]]\nname = \"b\"\nprefix = \"/a\"\n";
        let error = load(&[], twice).map(|_| ()).unwrap_err().to_string();
        assert!(
            error.contains("`prefix`") && error.contains("\"b\""),
            "{error}"
        );
    }

    /// `fresh` where the origin is followed, `min_fresh` and `max_fresh` where it is
    /// not, would do nothing: refused, naming where; read somewhere, accepted.
    #[test]
    fn fields_that_would_do_nothing_are_refused() {
        let refused = |flags: &[&str], text: &str| match load(flags, text) {
            Ok(_) => panic!("accepted: {flags:?} {text}"),
            Err(error) => error.to_string(),
        };
        let said = refused(&["--fresh", "1s"], "");
        assert!(said.starts_with("settings, field `fresh`"), "{said}");
        assert!(
            said.contains("--fresh") && said.contains("--follow-origin false"),
            "{said}"
        );
        let said = refused(&[], "fresh = \"1s\"\n");
        assert!(said.contains("sidecar.toml, field `fresh`"), "{said}");
        assert!(said.contains("follow_origin = false"), "{said}");
        let route = "[[routes]]\nname = \"items\"\nprefix = \"/items/\"\n";
        let said = refused(
            &["--follow-origin", "false"],
            &format!("default = \"pass\"\n{route}follow_origin = true\nfresh = \"5s\"\n"),
        );
        assert!(
            said.contains("route \"items\" (routes[0]), field `fresh`"),
            "{said}"
        );
        assert!(said.contains("on the route"), "{said}");
        for field in ["min_fresh", "max_fresh"] {
            let said = refused(
                &["--follow-origin", "false"],
                &format!("{field} = \"1s\"\n"),
            );
            assert!(said.contains(&format!("field `{field}`")), "{said}");
            let said = refused(
                &[],
                &format!("{route}follow_origin = false\n{field} = \"1s\"\n"),
            );
            assert!(
                said.contains("\"items\"") && said.contains(&format!("`{field}`")),
                "{said}"
            );
        }

        // Read by some policy: accepted.
        for (flags, text) in [
            (
                &["--follow-origin", "false", "--fresh", "1s"][..],
                String::new(),
            ),
            // The default follows, a route of its own reads the top level's `fresh`.
            (
                &["--fresh", "1s"][..],
                format!("{route}follow_origin = false\n"),
            ),
            // No policy takes the top level's `fresh` at all: not this check's business.
            (
                &[][..],
                format!(
                    "default = \"pass\"\nfresh = \"1s\"\n{route}follow_origin = false\nfresh = \"2s\"\n"
                ),
            ),
            (
                &[][..],
                "min_fresh = \"1s\"\nmax_fresh = \"1h\"\n".to_owned(),
            ),
        ] {
            if let Err(error) = load(flags, &text) {
                panic!("{flags:?} {text}: {error}");
            }
        }
    }

    #[test]
    fn passwords_stay_out() {
        assert_eq!(
            redacted("redis://user:secret@h:6379/0"),
            "redis://user:***@h:6379/0"
        );
        assert_eq!(redacted("redis://:secret@h"), "redis://:***@h");
        assert_eq!(redacted("rediss://secret@h"), "rediss://***@h");
        assert_eq!(redacted("redis://h:6379"), "redis://h:6379");
        let args = Args::try_parse_from(["s", "--redis", "redis://u:hunter2@h"]).unwrap();
        assert!(!format!("{args:?}").contains("hunter2"));
        let settings = Settings::resolve(&args, File::default()).unwrap();
        assert!(!format!("{settings:?}").contains("hunter2"));
    }

    #[test]
    fn the_default_service_is_named_after_the_upstream() {
        let service = |uri: &str| service_of(&uri.parse().unwrap());
        assert_eq!(service("http://127.0.0.1:9000"), "127-0-0-1-9000");
        assert_eq!(service("http://Origin.example"), "origin-example-80");
        assert_ne!(
            service("http://a.example:80"),
            service("http://b.example:80")
        );
        let long = service(&format!("http://{}.example:8080", "x".repeat(80)));
        assert_eq!(long.len(), 48);
        // Every default is a service the key space takes.
        for uri in [
            "http://127.0.0.1:9000",
            "http://[::1]:8080",
            "http://Origin.example",
        ] {
            stampede_guard::KeySpace::builder()
                .env("sidecar")
                .service(service(uri))
                .secret("a test secret of sixteen bytes")
                .build()
                .unwrap();
        }
    }

    #[test]
    fn limits_have_defaults_flags_and_refusals() {
        let settings = load(&[], "").unwrap();
        assert_eq!(settings.limits.header_read, Duration::from_secs(10));
        assert_eq!(settings.limits.max_connections, 10_000);
        assert_eq!(settings.origin.connect, Duration::from_secs(5));
        assert!(!settings.origin.http2);
        let set = load(
            &["--connect-timeout", "250ms"],
            "connect_timeout = \"9s\"\nresponse_timeout = \"3s\"\nmax_connections = 7\n",
        )
        .unwrap();
        assert_eq!(set.origin.connect, Duration::from_millis(250));
        assert_eq!(set.origin.response, Duration::from_secs(3));
        assert_eq!(set.limits.max_connections, 7);
        for (text, field) in [
            ("keep_alive_timeout = \"0s\"\n", "keep_alive_timeout"),
            ("max_connections = 0\n", "max_connections"),
            ("tls_cert = \"c.pem\"\n", "tls_key"),
            ("upstream_ca = \"ca.pem\"\n", "upstream_ca"),
        ] {
            let refused = load(&[], text).unwrap_err().to_string();
            assert!(refused.contains(field), "{text}: {refused}");
        }
    }

    #[test]
    fn via_names_a_token_or_nothing() {
        let via = |flags: &[&str], text: &str| load(flags, text).map(|s| s.origin.via);
        assert_eq!(via(&[], "").unwrap().as_deref(), Some("stampede-sidecar"));
        assert_eq!(
            via(&[], "via = \"edge-7\"\n").unwrap().as_deref(),
            Some("edge-7")
        );
        assert_eq!(via(&["--via", ""], "via = \"edge-7\"\n").unwrap(), None);
        let refused = via(&[], "via = \"two words\"\n").unwrap_err().to_string();
        assert!(refused.contains("via"), "{refused}");
    }

    #[test]
    fn trusted_proxies_are_address_blocks() {
        let trusted = load(&[], "trusted_proxies = [\"10.0.0.0/8\", \"::1\"]\n").unwrap();
        assert_eq!(trusted.origin.trusted_proxies.len(), 2);
        let flagged = load(
            &["--trusted-proxy", "127.0.0.1"],
            "trusted_proxies = [\"10.0.0.0/8\"]\n",
        );
        assert_eq!(
            flagged.unwrap().origin.trusted_proxies.len(),
            1,
            "the flags replace the file's"
        );
        let refused = load(&["--trusted-proxy", "10.0.0.0/40"], "")
            .unwrap_err()
            .to_string();
        assert!(refused.contains("trusted_proxies"), "{refused}");
    }
}
