//! The command line. Every flag but `--config` overrides the config file's top-level
//! setting of the same name (`--cold-wait` is `cold_wait`).

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use http::Uri;

/// A caching sidecar: stampede-guard in front of any HTTP origin. Stale entries are
/// served at once while one instance of the fleet refreshes them; cold misses are filled
/// once per key.
#[derive(Parser)]
#[command(name = "stampede-sidecar", version, about, long_about = None)]
pub(crate) struct Args {
    /// A TOML file with the settings below and per-route policies (see docs/sidecar.md).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,

    /// Where to take requests [default: 127.0.0.1:8080].
    #[arg(long, value_name = "ADDR")]
    pub(crate) listen: Option<SocketAddr>,

    /// The origin, an absolute http:// or https:// URL [default: http://127.0.0.1:9000].
    #[arg(long, value_name = "URL", value_parser = upstream)]
    pub(crate) upstream: Option<Uri>,

    /// Redis shared by the fleet (redis://, rediss://). Without it: the local cache only.
    #[arg(
        long,
        value_name = "URL",
        env = "STAMPEDE_SIDECAR_REDIS",
        hide_env_values = true
    )]
    pub(crate) redis: Option<String>,

    /// Redis Cluster shared by the fleet: a node's URL (any of them; the rest is learned
    /// from it); repeat for more.
    #[arg(long = "redis-cluster", value_name = "URL", conflicts_with = "redis")]
    pub(crate) redis_cluster: Vec<String>,

    /// Redis Sentinel: a sentinel, as `host:port` or a URL; repeat for more. With
    /// `--redis-sentinel-service`, the name the sentinels watch the primary under.
    #[arg(
        long = "redis-sentinel",
        value_name = "HOST:PORT|URL",
        conflicts_with_all = ["redis", "redis_cluster"],
        requires = "redis_sentinel_service"
    )]
    pub(crate) redis_sentinels: Vec<String>,

    /// The name the sentinels of `--redis-sentinel` watch the primary under.
    #[arg(long, value_name = "NAME", requires = "redis_sentinels")]
    pub(crate) redis_sentinel_service: Option<String>,

    /// The certificate authority (PEM) a `rediss://` server is checked against, instead
    /// of the system's roots.
    #[arg(long, value_name = "FILE")]
    pub(crate) redis_ca: Option<PathBuf>,

    /// A client certificate (PEM) for Redis servers that ask for one; with
    /// `--redis-client-key`.
    #[arg(long, value_name = "FILE", requires = "redis_client_key")]
    pub(crate) redis_client_cert: Option<PathBuf>,

    /// The private key (PEM) of `--redis-client-cert`.
    #[arg(long, value_name = "FILE", requires = "redis_client_cert")]
    pub(crate) redis_client_key: Option<PathBuf>,

    /// The Redis ACL user (instead of the URL's). Its password comes from
    /// `STAMPEDE_SIDECAR_REDIS_PASSWORD`, never from a flag.
    #[arg(long, value_name = "USER")]
    pub(crate) redis_username: Option<String>,

    /// Whether the origin's Cache-Control, Expires and Age set how long entries are
    /// fresh and may be served stale (an HTTP cache), for requests matching no route and
    /// routes that do not set it; false: --fresh and --grace, whatever the origin says
    /// [default: true].
    #[arg(long, value_name = "BOOL", action = clap::ArgAction::Set)]
    pub(crate) follow_origin: Option<bool>,

    /// How long an entry is fresh, for requests matching no route and routes that do
    /// not set it, when the origin is not followed (--follow-origin false; while it is
    /// followed, --fresh would do nothing and is refused) [default: 1s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) fresh: Option<Duration>,

    /// How long past freshness an entry is served stale while it is refreshed, when the
    /// origin says nothing of it [default: 0s when following the origin (stale only as
    /// its stale-while-revalidate allows), 10s otherwise].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) grace: Option<Duration>,

    /// The refresh lease, and how long a fill may wait on the origin [default: 5s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) lease: Option<Duration>,

    /// How long a caller with nothing to serve waits for another instance's fill
    /// [default: 2s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) cold_wait: Option<Duration>,

    /// The largest answer that is stored, for requests matching no route and routes
    /// that do not set it: bytes, or a size with its unit (`512KiB`, `16MiB`, `8MB`)
    /// [default: 16MiB, at most 64MiB]. A larger answer is not stored: the callers that
    /// share its fill still get it as it streams (one origin call), and later callers
    /// ask the origin again. Logged once per route, counted in
    /// `stampede_guard_not_stored_total{reason="too_large"}`.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub(crate) max_body: Option<u64>,

    /// The bytes the fills in flight may hold together: bytes, or a size with its unit
    /// [default: 256MiB, at least 1MiB]. A fill holds its answer whole while it may be
    /// stored (at most its `--max-body`), then a 1 MiB window beyond its slowest
    /// client; one that finds this spent goes on with a 64 KiB window for the clients
    /// it has, shares no more, and is not stored. Gauged in
    /// `stampede_guard_fill_bytes`, counted in
    /// `stampede_guard_fill_streams_total{result="over_memory"}`.
    #[arg(long, value_name = "SIZE", value_parser = size)]
    pub(crate) fill_memory: Option<u64>,

    /// Serve Prometheus metrics on this address (`/metrics`).
    #[arg(long, value_name = "ADDR")]
    pub(crate) metrics: Option<SocketAddr>,

    /// Serve the admin endpoints on this address (off unless set): `GET /healthz` and
    /// `GET /readyz`, and, with `--admin-token`, `POST /purge/tags` and `POST
    /// /purge/path`. Never on the origin's listener: no origin path is shadowed.
    #[arg(long, value_name = "ADDR")]
    pub(crate) admin: Option<SocketAddr>,

    /// The bearer token that the purge endpoints of `--admin` ask for (without it they
    /// answer 403).
    #[arg(
        long,
        value_name = "TOKEN",
        env = "STAMPEDE_SIDECAR_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub(crate) admin_token: Option<String>,

    /// After SIGTERM or SIGINT, how long in-flight requests, refreshes and fills may
    /// take to finish [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) drain_timeout: Option<Duration>,

    /// The name this proxy gives itself in `Via` (to the origin and to clients), or
    /// `""` for no `Via` [default: stampede-sidecar].
    #[arg(long, value_name = "NAME")]
    pub(crate) via: Option<String>,

    /// A peer whose `X-Forwarded-For`, `-Proto` and `-Host` are kept (a load balancer
    /// in front): an address or a block (`10.0.0.0/8`); repeat for more. Anyone else's
    /// are replaced by what the sidecar sees. The cache keys on the scheme and host so
    /// vouched for, and fills forward them.
    #[arg(long = "trusted-proxy", value_name = "CIDR")]
    pub(crate) trusted_proxies: Vec<String>,

    /// A file holding the secret that keys are hashed with (its whole content, less
    /// trailing whitespace), when `STAMPEDE_GUARD_SECRET` is not set. Every sidecar of
    /// a fleet needs the same one; with `--redis`, one of the two is required.
    #[arg(long, value_name = "FILE")]
    pub(crate) secret_file: Option<std::path::PathBuf>,

    /// Threads serving requests [default: one per core].
    #[arg(long, value_name = "N")]
    pub(crate) workers: Option<usize>,

    /// At most this many client connections at once; beyond it, new ones wait in the
    /// listener's accept queue until one closes [default: 10000].
    #[arg(long, value_name = "N")]
    pub(crate) max_connections: Option<usize>,

    /// How long a client may take to send a request's headers, from the connection's
    /// start or the request's first byte; then the connection is closed [default: 10s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) header_read_timeout: Option<Duration>,

    /// How long a client connection may stay idle between requests [default: 60s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) keep_alive_timeout: Option<Duration>,

    /// How long a request's body may take to arrive, from its headers; then the
    /// request is answered 408 [default: 60s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) request_body_timeout: Option<Duration>,

    /// How long an answer may go without a byte of it written to the client while it
    /// has bytes to send (a client that does not read; the origin's pauses do not
    /// count); then the connection is closed [default: 60s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) send_timeout: Option<Duration>,

    /// How long connecting to the origin may take (TLS included); then 504
    /// [default: 5s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) connect_timeout: Option<Duration>,

    /// How long the origin may take to send its response headers, from when the request
    /// is sent (its body's upload included); then 504 [default: 60s]. A fill is also
    /// bounded by its route's lease.
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) response_timeout: Option<Duration>,

    /// How long the origin's body may pause while it streams; then the answer is cut
    /// (and a fill fails) [default: 60s].
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub(crate) upstream_idle_timeout: Option<Duration>,

    /// Speak HTTP/2 to an http:// origin (prior knowledge, h2c) instead of HTTP/1.1.
    /// An https:// origin is offered both, by ALPN.
    #[arg(long, value_name = "BOOL", action = clap::ArgAction::Set)]
    pub(crate) upstream_http2: Option<bool>,

    /// Terminate TLS: the certificate chain (PEM) clients are shown. With
    /// `--tls-key`; HTTP/2 and HTTP/1.1 are offered by ALPN.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,

    /// The private key (PEM) of `--tls-cert`.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,

    /// The certificate authorities (PEM) an https:// origin's certificate is checked
    /// against, instead of the system's.
    #[arg(long, value_name = "FILE")]
    pub(crate) upstream_ca: Option<PathBuf>,

    /// One line per request on standard output: `json`, `common` (the Common Log
    /// Format, with the cache's outcome and times) or `off` [default: off].
    #[arg(long, value_name = "FORMAT")]
    pub(crate) access_log: Option<crate::access::Format>,

    /// Check the settings (flags, config file, every route's policy) and exit: 0 if
    /// they would run, 2 naming what is refused. Connects nothing, binds nothing.
    #[arg(long)]
    pub(crate) check: bool,
}

impl fmt::Debug for Args {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // No Redis URL (it may carry a password), no token.
        f.debug_struct("Args")
            .field("config", &self.config)
            .field("listen", &self.listen)
            .field("upstream", &self.upstream)
            .field("secret_file", &self.secret_file)
            .field("via", &self.via)
            .field("trusted_proxies", &self.trusted_proxies)
            .field("redis", &self.redis.as_deref().map(redacted))
            .field(
                "redis_cluster",
                &self
                    .redis_cluster
                    .iter()
                    .map(|u| redacted(u))
                    .collect::<Vec<_>>(),
            )
            .field(
                "redis_sentinels",
                &self
                    .redis_sentinels
                    .iter()
                    .map(|u| redacted(u))
                    .collect::<Vec<_>>(),
            )
            .field("redis_sentinel_service", &self.redis_sentinel_service)
            .field("redis_ca", &self.redis_ca)
            .field("redis_client_cert", &self.redis_client_cert)
            .field("redis_client_key", &self.redis_client_key)
            .field("redis_username", &self.redis_username)
            .field("follow_origin", &self.follow_origin)
            .field("fresh", &self.fresh)
            .field("grace", &self.grace)
            .field("lease", &self.lease)
            .field("cold_wait", &self.cold_wait)
            .field("max_body", &self.max_body)
            .field("fill_memory", &self.fill_memory)
            .field("metrics", &self.metrics)
            .field("admin", &self.admin)
            .field("admin_token", &self.admin_token.as_ref().map(|_| "<set>"))
            .field("drain_timeout", &self.drain_timeout)
            .field("workers", &self.workers)
            .field("max_connections", &self.max_connections)
            .field("header_read_timeout", &self.header_read_timeout)
            .field("keep_alive_timeout", &self.keep_alive_timeout)
            .field("request_body_timeout", &self.request_body_timeout)
            .field("send_timeout", &self.send_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("upstream_idle_timeout", &self.upstream_idle_timeout)
            .field("upstream_http2", &self.upstream_http2)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("upstream_ca", &self.upstream_ca)
            .field("access_log", &self.access_log)
            .field("check", &self.check)
            .finish()
    }
}

/// A duration such as `250ms`, `1s`, `1m 30s` (a bare number is seconds, as the proxy
/// example took them).
pub(crate) fn duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text
            .parse()
            .map(Duration::from_secs)
            .map_err(|e| format!("`{text}`: {e}"));
    }
    humantime::parse_duration(text)
        .map_err(|e| format!("`{text}` is not a duration ({e}; write e.g. 250ms, 1s, 2m)"))
}

/// A size: a number of bytes (`1048576`), or a number with its unit (`512KiB`,
/// `16MiB`, `8MB`, `1.5 GiB`; `KB` and `MB` are powers of ten, `KiB` and `MiB` of two).
pub(crate) fn size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse().map_err(|e| format!("`{text}`: {e}"));
    }
    text.parse::<bytesize::ByteSize>()
        .map(|size| size.as_u64())
        .map_err(|e| format!("`{text}` is not a size ({e}; write e.g. 512KiB, 16MiB, 8MB)"))
}

/// An absolute `http://` or `https://` URL.
pub(crate) fn upstream(text: &str) -> Result<Uri, String> {
    let uri: Uri = text.parse().map_err(|e| format!("`{text}`: {e}"))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some(_), Some(authority)) if authority.as_str().contains('@') => Err(format!(
            "`{}`: no user or password in an origin's URL (it would be sent as its host)",
            redacted(text)
        )),
        (Some("http" | "https"), Some(_)) => Ok(uri),
        (Some(other), Some(_)) => Err(format!(
            "`{text}`: origins are http:// or https://, not {other}://"
        )),
        _ => Err(format!(
            "`{text}` must be an absolute http:// or https:// URL"
        )),
    }
}

/// `url` with its password (and a user-only credential) replaced by `***`: for logs.
pub(crate) fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None => "***".to_owned(),
            };
            format!("{scheme}://{user}@{host}{tail}")
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn sizes() {
        assert_eq!(size("1048576"), Ok(1 << 20));
        assert_eq!(size("16MiB"), Ok(16 << 20));
        assert_eq!(size("512 KiB"), Ok(512 << 10));
        assert_eq!(size("8MB"), Ok(8_000_000));
        let refused = size("lots").unwrap_err();
        assert!(refused.contains("`lots` is not a size"), "{refused}");
    }

    #[test]
    fn durations() {
        assert_eq!(duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(duration("3"), Ok(Duration::from_secs(3)));
        assert_eq!(duration("1m 30s"), Ok(Duration::from_secs(90)));
        assert!(duration("1x").unwrap_err().contains("`1x`"));
        assert!(duration("").is_err());
    }

    #[test]
    fn upstreams() {
        assert!(upstream("http://127.0.0.1:9000").is_ok());
        assert!(upstream("https://example.com").is_ok());
        assert!(upstream("ftp://example.com").is_err());
        let refused = upstream("http://user:hunter2@example.com").unwrap_err();
        assert!(!refused.contains("hunter2"), "{refused}");
        assert!(upstream("/relative").is_err());
    }
}
