//! Building a store: the target (a server, a cluster, sentinels), credentials, TLS
//! settings, timeouts and the pool, each checked when the store is built.

use std::fmt;
use std::sync::{Arc, Once};
use std::time::Duration;

use bb8_redis::bb8;
use redis::{ConnectionInfo, IntoConnectionInfo};

use super::breaker::{Breaker, BreakerConfig};
#[cfg(feature = "cluster")]
use super::cluster::Cluster;
use super::handle::{
    Backend, DEFAULT_COMMAND_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_POOL_SIZE, Inner, RedisStore,
};
use super::manager::{Connecting, Manager};
#[cfg(feature = "sentinel")]
use super::sentinel::Sentinel;
use super::tls::{self, Tls};
use crate::error::ConfigError;

impl RedisStore {
    /// Starts a store for a single Redis server, `redis://[user:password@]host:port[/db]`,
    /// `rediss://` for TLS (feature `tls`) or `redis+unix:///path`.
    ///
    /// Building connects nothing: the first operation does, so a service can start while
    /// Redis is down.
    ///
    /// ```
    /// use std::time::Duration;
    /// use stampede_guard::RedisStore;
    ///
    /// let store = RedisStore::builder("redis://cache.internal:6379")
    ///     .username("catalog")
    ///     .password(std::env::var("REDIS_PASSWORD").unwrap_or_default())
    ///     .command_timeout(Duration::from_millis(50))
    ///     .build()?;
    /// # Ok::<(), stampede_guard::ConfigError>(())
    /// ```
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(Target::Single(url.into()))
    }

    /// Starts a store for a Redis Cluster (feature `cluster`), given some of its nodes as
    /// URLs (any of them; the rest of the cluster is learned from them). Every key a
    /// script touches shares one hash tag per cached key, so no script meets `CROSSSLOT`,
    /// and keys spread over every primary.
    ///
    /// [`pool_size`](RedisStoreBuilder::pool_size) does not apply: a cluster connection is
    /// one multiplexed connection per node. Building connects nothing.
    ///
    /// ```
    /// let store = stampede_guard::RedisStore::cluster([
    ///     "redis://10.0.0.1:7000",
    ///     "redis://10.0.0.2:7000",
    ///     "redis://10.0.0.3:7000",
    /// ])
    /// .build()?;
    /// assert!(store.is_cluster());
    /// # Ok::<(), stampede_guard::ConfigError>(())
    /// ```
    #[cfg(feature = "cluster")]
    pub fn cluster<I, S>(nodes: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder::new(Target::Cluster(nodes.into_iter().map(Into::into).collect()))
    }

    /// Starts a store for the primary that Redis Sentinel watches under `service`
    /// (`sentinel monitor <service> ...`; feature `sentinel`), given some of the sentinels
    /// as URLs (with their own credentials, if they need any) or as `host:port`, as
    /// `redis-cli` and every Sentinel client take them (spoken to as
    /// `redis://host:port`, a host alone on port 26379: write `rediss://` for TLS).
    /// The builder's
    /// [`username`](RedisStoreBuilder::username) and
    /// [`password`](RedisStoreBuilder::password) are those of the Redis servers; TLS
    /// settings apply to both. After a failover, the first operation that finds the old
    /// primary gone (or read-only) asks the sentinels for the new one.
    ///
    /// [`pool_size`](RedisStoreBuilder::pool_size) does not apply: the store keeps one
    /// multiplexed connection to the primary. Building connects nothing.
    ///
    /// ```
    /// let store = stampede_guard::RedisStore::sentinel(
    ///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
    ///     "cache",
    /// )
    /// .build()?;
    /// # Ok::<(), stampede_guard::ConfigError>(())
    /// ```
    #[cfg(feature = "sentinel")]
    pub fn sentinel<I, S>(sentinels: I, service: impl Into<String>) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder::new(Target::Sentinel(
            sentinels.into_iter().map(Into::into).collect(),
            service.into(),
        ))
    }
}

/// Builds a [`RedisStore`].
#[must_use]
pub struct RedisStoreBuilder {
    target: Target,
    /// An ACL user and password that replace those of the URLs. Never shown by `Debug`.
    username: Option<String>,
    password: Option<String>,
    tls: Tls,
    command_timeout: Duration,
    connect_timeout: Duration,
    pool_size: u32,
    breaker: BreakerConfig,
}

/// What a builder builds a store for.
enum Target {
    Single(String),
    #[cfg(feature = "cluster")]
    Cluster(Vec<String>),
    /// The sentinels, and the service they watch.
    #[cfg(feature = "sentinel")]
    Sentinel(Vec<String>, String),
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // No URL: it may carry a password.
        let target = match &self.target {
            Target::Single(_) => "single",
            #[cfg(feature = "cluster")]
            Target::Cluster(_) => "cluster",
            #[cfg(feature = "sentinel")]
            Target::Sentinel(..) => "sentinel",
        };
        f.debug_struct("RedisStoreBuilder")
            .field("target", &target)
            .field("username", &self.username)
            .field("tls_root_certificate", &self.tls.root.is_some())
            .field("tls_client_certificate", &self.tls.client.is_some())
            .field("danger_accept_invalid_certificates", &self.tls.insecure)
            .field("command_timeout", &self.command_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("pool_size", &self.pool_size)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    /// A builder for `target` with every default.
    fn new(target: Target) -> Self {
        Self {
            target,
            username: None,
            password: None,
            tls: Tls::default(),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            pool_size: DEFAULT_POOL_SIZE,
            breaker: BreakerConfig::default(),
        }
    }

    /// The deadline of one operation, pool check-out included (default 100 ms). It must
    /// be well below every lease TTL used with the store; lease clients check that.
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// The deadline of opening one connection (default 500 ms). Connections are opened in
    /// the background of the pool, so this bounds how long a reconnect attempt lasts,
    /// not how long an operation waits.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How many connections to keep (default 4, at most 256). A cluster store keeps one
    /// multiplexed connection per node instead.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size;
        self
    }

    /// The ACL user to authenticate as, in place of one in the URL (or the URLs of a
    /// cluster's nodes).
    pub fn username(mut self, username: impl Into<String>) -> Self {
        self.username = Some(username.into());
        self
    }

    /// The password to authenticate with, in place of one in the URL: a way to keep it
    /// out of URLs, which end up in configuration files and command lines. Never
    /// logged, and never shown by `Debug`.
    pub fn password(mut self, password: impl Into<String>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// Trusts these root certificates (PEM) for `rediss://` URLs instead of the
    /// system's: for a private certificate authority. Certificates are checked, and so
    /// are host names. Feature `tls`: without it, `build()` refuses this setting.
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.root = Some(pem.into());
        self
    }

    /// Presents this client certificate and key (PEM) on `rediss://` connections, for
    /// servers that ask for one (`tls-auth-clients yes`). Feature `tls`: without it,
    /// `build()` refuses this setting.
    pub fn tls_client_certificate(
        mut self,
        certificate: impl Into<Vec<u8>>,
        key: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls.client = Some((certificate.into(), key.into()));
        self
    }

    /// Accepts any certificate on `rediss://` connections, whoever signed it and
    /// whatever host it names: the traffic is encrypted, but anyone between the service
    /// and Redis can read and change it. For tests against a server with a throwaway
    /// certificate, never for production. The only way to turn the checks off (a URL's
    /// `#insecure` is refused without it); building warns when it is on. Feature `tls`:
    /// without it, `build()` refuses this setting.
    pub fn danger_accept_invalid_certificates(mut self) -> Self {
        self.tls.insecure = true;
        self
    }

    /// `url` parsed, with this builder's user and password in place of its own, and its
    /// TLS checks as the builder says.
    fn connection_info(
        &self,
        url: &str,
        field: &'static str,
    ) -> Result<ConnectionInfo, ConfigError> {
        let info = self.parsed(url, field)?;
        let mut settings = info.redis_settings().clone();
        if let Some(username) = &self.username {
            settings = settings.set_username(username);
        }
        if let Some(password) = &self.password {
            settings = settings.set_password(password);
        }
        Ok(info.set_redis_settings(settings))
    }

    /// `url` parsed, with its TLS checks as the builder says, and its own credentials.
    fn parsed(&self, url: &str, field: &'static str) -> Result<ConnectionInfo, ConfigError> {
        // The error's text is not passed on: it can quote the URL, password and all.
        let info = url
            .into_connection_info()
            .map_err(|_| ConfigError::invalid(field, url_problem(url)))?;
        Ok(match info.addr().clone() {
            redis::ConnectionAddr::TcpTls {
                host,
                port,
                insecure,
                tls_params,
            } => {
                if insecure && !self.tls.insecure {
                    return Err(ConfigError::invalid(
                        field,
                        "`#insecure` turns certificate checks off: call \
                         danger_accept_invalid_certificates() to mean it",
                    ));
                }
                info.set_addr(redis::ConnectionAddr::TcpTls {
                    host,
                    port,
                    insecure: self.tls.insecure,
                    tls_params,
                })
            }
            _ if self.tls.is_set() => {
                return Err(ConfigError::invalid(
                    field,
                    "TLS settings were given, but the URL is not `rediss://`",
                ));
            }
            _ => info,
        })
    }

    fn warn_if_insecure(&self) {
        if self.tls.insecure {
            tracing::warn!(
                "Redis TLS certificates are not checked (danger_accept_invalid_certificates): \
                 anyone on the path can read and change what the cache stores"
            );
        }
    }

    /// When the circuit breaker opens and how often it probes (see [`BreakerConfig`]).
    pub fn breaker(mut self, config: BreakerConfig) -> Self {
        self.breaker = config;
        self
    }

    /// Checks the settings and builds the store. Connects nothing.
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        let command_timeout = ConfigError::nonzero("command_timeout", self.command_timeout)?;
        self.tls.check()?;
        if self.username.is_some() && self.password.is_none() {
            // Redis authenticates a user only with a password: the user alone would be
            // dropped without a word.
            return Err(ConfigError::invalid(
                "username",
                "needs a password (set password() too)",
            ));
        }
        let connect_timeout = ConfigError::nonzero("connect_timeout", self.connect_timeout)?;
        self.breaker.check()?;
        if self.pool_size == 0 {
            return Err(ConfigError::Zero { field: "pool_size" });
        }
        if self.pool_size > 256 {
            return Err(ConfigError::invalid("pool_size", "at most 256"));
        }
        let backend = match &self.target {
            Target::Single(url) => self.single(url, connect_timeout)?,
            #[cfg(feature = "sentinel")]
            Target::Sentinel(sentinels, service) => {
                self.sentinel(sentinels, service, connect_timeout, command_timeout)?
            }
            #[cfg(feature = "cluster")]
            Target::Cluster(nodes) => self.cluster(nodes, connect_timeout, command_timeout)?,
        };
        self.warn_if_insecure();
        Ok(RedisStore {
            inner: Arc::new(Inner {
                backend,
                command_timeout,
                connect_timeout,
                breaker: Breaker::new(self.breaker),
                zeroed: Once::new(),
            }),
        })
    }

    /// A single server: a pool of multiplexed connections, and a client for pub/sub.
    fn single(&self, url: &str, connect_timeout: Duration) -> Result<Backend, ConfigError> {
        let info = self.connection_info(url, "url")?;
        let client = tls::client(info, self.tls.certificates())
            .map_err(|_| ConfigError::invalid("url", "not usable with these TLS settings"))?;
        let connecting = Connecting::default();
        let pool = bb8::Pool::builder()
            .max_size(self.pool_size)
            // Checks only the broken mark: no round trip.
            .test_on_check_out(true)
            .connection_timeout(connect_timeout)
            // No reaper: it is a task, and building must need no runtime. Idle
            // multiplexed connections cost a socket each, at most `pool_size`; broken ones
            // are replaced when they are found broken.
            .idle_timeout(None)
            .max_lifetime(None)
            .build_unchecked(Manager::new(
                client.clone(),
                connect_timeout,
                connecting.clone(),
            ));
        Ok(Backend::Single {
            pool,
            client: Box::new(client),
            connecting,
        })
    }

    /// The primary the sentinels watch under `service`.
    #[cfg(feature = "sentinel")]
    fn sentinel(
        &self,
        sentinels: &[String],
        service: &str,
        connect_timeout: Duration,
        command_timeout: Duration,
    ) -> Result<Backend, ConfigError> {
        let sentinels = sentinels
            .iter()
            // The sentinels' own credentials: the builder's are the servers'.
            .map(|url| self.parsed(&sentinel_url(url), "sentinels"))
            .collect::<Result<Vec<_>, ConfigError>>()?;
        let sentinel = Sentinel::new(
            &sentinels,
            service,
            (self.username.as_deref(), self.password.as_deref()),
            (self.tls.certificates(), self.tls.insecure),
            connect_timeout,
            command_timeout,
        )?;
        Ok(Backend::Sentinel(Box::new(sentinel)))
    }

    /// A cluster, from some of its nodes.
    #[cfg(feature = "cluster")]
    fn cluster(
        &self,
        nodes: &[String],
        connect_timeout: Duration,
        command_timeout: Duration,
    ) -> Result<Backend, ConfigError> {
        let nodes = nodes
            .iter()
            .map(|node| self.connection_info(node, "nodes"))
            .collect::<Result<Vec<_>, _>>()?;
        let cluster = Cluster::new(
            nodes,
            self.tls.certificates(),
            connect_timeout,
            command_timeout,
        )?;
        Ok(Backend::Cluster(Box::new(cluster)))
    }
}

/// A sentinel's URL: `host:port` (or `[v6]:port`), with no scheme, is `redis://` of it;
/// a host alone is on Sentinel's own port, 26379.
#[cfg(feature = "sentinel")]
fn sentinel_url(given: &str) -> std::borrow::Cow<'_, str> {
    if given.contains("://") {
        return given.into();
    }
    let has_port = match given.strip_prefix('[') {
        Some(v6) => v6.contains("]:"),
        None => given.contains(':'),
    };
    match has_port {
        true => format!("redis://{given}").into(),
        false => format!("redis://{given}:26379").into(),
    }
}

/// Why `url` is not a Redis URL, in words that never quote it (it may hold a password).
fn url_problem(url: &str) -> String {
    const SCHEMES: [&str; 5] = ["redis", "rediss", "redis+unix", "unix", "valkey"];
    let Some((scheme, rest)) = url.split_once("://") else {
        return "not a valid Redis URL: no scheme (write redis://host:port)".to_owned();
    };
    if !SCHEMES.contains(&scheme) && !scheme.eq_ignore_ascii_case("valkeys") {
        let shown: String = scheme.chars().take(16).collect();
        return format!(
            "not a valid Redis URL: the scheme is `{shown}`, not redis://, rediss:// or \
             redis+unix://"
        );
    }
    if scheme.contains("unix") {
        return "not a valid Redis URL: a Unix socket URL needs a path".to_owned();
    }
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = match host_port.strip_prefix('[') {
        // [::1]:6379
        Some(v6) => match v6.split_once(']') {
            Some((host, tail)) => (host, tail.strip_prefix(':')),
            None => return "not a valid Redis URL: an IPv6 host without its `]`".to_owned(),
        },
        None => match host_port.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (host_port, None),
        },
    };
    if host.is_empty() {
        return "not a valid Redis URL: no host".to_owned();
    }
    if let Some(port) = port
        && port.parse::<u16>().is_err()
    {
        return "not a valid Redis URL: the port must be a number from 0 to 65535".to_owned();
    }
    // The URL is fine, but redis-rs takes `rediss://` only with TLS built in.
    if !cfg!(feature = "tls") && (scheme == "rediss" || scheme.eq_ignore_ascii_case("valkeys")) {
        return format!("a `rediss://` URL {}", tls::NEEDS_FEATURE);
    }
    "not a valid Redis URL".to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "tls")]
    #[test]
    fn a_certificate_or_key_that_is_not_pem_is_refused_naming_the_setting() {
        let builder = || RedisStore::builder("rediss://127.0.0.1:6380");
        let refused = |b: RedisStoreBuilder| b.build().err().map(|e| e.field());
        assert_eq!(
            refused(builder().tls_root_certificate(b"not a certificate".to_vec())),
            Some("tls_root_certificate")
        );
        assert_eq!(
            refused(builder().tls_client_certificate(b"nope".to_vec(), b"nope".to_vec())),
            Some("tls_client_certificate")
        );
    }

    #[test]
    fn a_url_that_is_not_redis_says_why_without_quoting_it() {
        for (url, says) in [
            ("garbage", "no scheme"),
            ("http://127.0.0.1:6379", "the scheme is `http`"),
            ("redis://127.0.0.1:99999", "the port"),
            ("redis://user:hunter2@:6379", "no host"),
            ("rediss://user:hunter2@127.0.0.1:x", "the port"),
        ] {
            let Err(error) = RedisStore::builder(url).build() else {
                panic!("{url} is refused");
            };
            let error = error.to_string();
            assert!(error.contains(says), "{url}: {error}");
            assert!(!error.contains("hunter2"), "{error}");
        }
    }

    /// Sentinels are taken as `host:port`, as every Sentinel tool takes them, besides
    /// URLs; what is neither is refused, naming the setting.
    #[cfg(feature = "sentinel")]
    #[test]
    fn sentinels_are_taken_as_host_and_port_or_as_urls() {
        for sentinels in [
            vec!["127.0.0.1:26379"],
            vec!["[::1]:26379", "sentinel.internal:26379"],
            vec!["redis://127.0.0.1:26379", "127.0.0.1:26380"],
            vec!["sentinel.internal", "[::1]"],
        ] {
            let built = RedisStore::sentinel(sentinels.clone(), "cache").build();
            assert!(built.is_ok(), "{sentinels:?}: {:?}", built.err());
        }
        for wrong in ["127.0.0.1:99999", "127.0.0.1:x", "http://127.0.0.1:26379"] {
            let Err(error) = RedisStore::sentinel([wrong], "cache").build() else {
                panic!("{wrong} is refused");
            };
            assert_eq!(error.field(), "sentinels", "{wrong}");
        }
    }

    /// A build without TLS never connects in clear where TLS was asked for: it refuses
    /// a `rediss://` URL (for a server, a cluster's nodes, sentinels) and each TLS
    /// setting, naming it and the feature.
    #[cfg(not(feature = "tls"))]
    #[test]
    fn without_the_tls_feature_rediss_and_every_tls_setting_are_refused_naming_it() {
        let says_feature = |error: ConfigError| {
            let text = error.to_string();
            assert!(text.contains("the `tls` feature"), "{text}");
            assert!(!text.contains("hunter2"), "{text}");
            error.field()
        };
        let refused = |b: RedisStoreBuilder| says_feature(b.build().expect_err("refused"));
        let url = "rediss://user:hunter2@127.0.0.1:6380";
        assert_eq!(refused(RedisStore::builder(url)), "url");
        assert_eq!(
            refused(RedisStore::builder("valkeys://127.0.0.1:6380")),
            "url"
        );
        #[cfg(feature = "cluster")]
        assert_eq!(refused(RedisStore::cluster([url])), "nodes");
        #[cfg(feature = "sentinel")]
        assert_eq!(refused(RedisStore::sentinel([url], "cache")), "sentinels");
        let plain = || RedisStore::builder("redis://127.0.0.1:6379");
        assert_eq!(
            refused(plain().tls_root_certificate(b"pem".to_vec())),
            "tls_root_certificate"
        );
        assert_eq!(
            refused(plain().tls_client_certificate(b"pem".to_vec(), b"key".to_vec())),
            "tls_client_certificate"
        );
        assert_eq!(
            refused(plain().danger_accept_invalid_certificates()),
            "danger_accept_invalid_certificates"
        );
        // The same settings on a `rediss://` URL: the setting is named first.
        assert_eq!(
            refused(RedisStore::builder(url).tls_root_certificate(b"pem".to_vec())),
            "tls_root_certificate"
        );
    }

    /// Building connects nothing, so it needs no runtime (a plain `#[test]` has none).
    #[test]
    fn stores_build_outside_a_runtime() {
        let store = RedisStore::builder("redis://127.0.0.1:6379")
            .build()
            .unwrap();
        assert!(!store.is_local_only());
        assert!(RedisStore::local_only().is_local_only());
    }
}
