//! The Redis connection: the one seam between the crate and Redis.
//!
//! Everything that talks to Redis goes through a [`RedisStore`]: the lease scripts, cache
//! reads, fenced writes and invalidations, notices. It owns the connections and puts one
//! deadline, [`command_timeout`](RedisStoreBuilder::command_timeout), on every operation,
//! pool check-out included, so that no caller waits on Redis longer than that, whatever
//! Redis is doing.
//!
//! What answers is a backend: none at all ([`RedisStore::local_only`]), a single server
//! ([`RedisStore::builder`]), a Redis Cluster ([`RedisStore::cluster`]) or the primary
//! that Redis Sentinel names ([`RedisStore::sentinel`]); the rest of the crate sees only
//! the store.
//!
//! # Connections
//!
//! For a single server, a pool holds a few multiplexed connections. An operation checks one out, takes a
//! clone of it (a multiplexed connection is a handle to one socket that many callers can
//! use at once) and gives it straight back, so the pool size bounds sockets, not
//! concurrency. A connection on which a command timed out or broke is marked and
//! replaced; no `PING` is spent on checking connections out. A cluster is reached through
//! one multiplexed cluster connection (see the `cluster` module for why, and for how
//! notices travel on a cluster).

mod breaker;
mod cluster;
mod error;
mod manager;
mod sentinel;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bb8_redis::bb8;
use redis::{
    Client, ConnectionInfo, FromRedisValue, IntoConnectionInfo, ScriptInvocation, TlsCertificates,
};
use tokio::time::{Instant, timeout_at};

use self::breaker::Breaker;
pub use self::breaker::{BreakerConfig, CIRCUIT_OPEN, CIRCUIT_OPENED};
use self::cluster::Cluster;
pub use self::error::{Operation, StoreError, StoreErrorKind};
use self::manager::{Conn, Manager};
use self::sentinel::Sentinel;
use crate::error::ConfigError;

/// Default deadline of one Redis operation.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_millis(100);
/// Default deadline of opening one connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Default number of pooled connections.
pub const DEFAULT_POOL_SIZE: u32 = 4;

/// A handle to Redis, cheap to clone, shared by everything built on it.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// What answers: the place where Redis Cluster and Sentinel go, next to a single
    /// server.
    backend: Backend,
    command_timeout: Duration,
    connect_timeout: Duration,
    breaker: Breaker,
}

/// The kinds of Redis a store speaks to.
enum Backend {
    /// None at all: see [`RedisStore::local_only`].
    None,
    /// One server (or a proxy in front of one).
    Single {
        pool: bb8::Pool<Manager>,
        /// For what a pool cannot give: pub/sub connections (boxed: with its TLS settings
        /// it is large, and it is used once per subscription).
        client: Box<Client>,
    },
    /// A Redis Cluster (boxed: its client is large, and the enum is built once).
    Cluster(Box<Cluster>),
    /// A primary found through Redis Sentinel.
    Sentinel(Box<Sentinel>),
}

/// A duration in whole milliseconds, as Redis takes them (`PX`, `PEXPIRE`) and as entries
/// keep their times; saturating.
pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

pub use crate::metrics::REDIS_ERRORS;

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // No address: a URL may carry a password.
        f.debug_struct("RedisStore")
            .field("command_timeout", &self.inner.command_timeout)
            .field("circuit_open", &self.inner.breaker.is_open())
            .field("local_only", &self.is_local_only())
            .finish()
    }
}

/// One request to Redis.
pub(crate) enum Request<'a> {
    Script(&'a ScriptInvocation<'a>),
    Command(&'a redis::Cmd),
}

impl RedisStore {
    /// Starts a store for a single Redis server, `redis://[user:password@]host:port[/db]`
    /// or `redis+unix:///path`.
    ///
    /// Building connects nothing: the first operation does, so a service can start while
    /// Redis is down.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            target: Target::Single(url.into()),
            username: None,
            password: None,
            tls: Tls::default(),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            pool_size: DEFAULT_POOL_SIZE,
            breaker: BreakerConfig::default(),
        }
    }

    /// Starts a store for a Redis Cluster, given some of its nodes as URLs (any of them;
    /// the rest of the cluster is learned from them). Every key a script touches shares
    /// one hash tag per cached key, so no script meets `CROSSSLOT`, and keys spread over
    /// every primary.
    ///
    /// [`pool_size`](RedisStoreBuilder::pool_size) does not apply: a cluster connection is
    /// one multiplexed connection per node. Building connects nothing.
    pub fn cluster<I, S>(nodes: I) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder {
            target: Target::Cluster(nodes.into_iter().map(Into::into).collect()),
            username: None,
            password: None,
            tls: Tls::default(),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            pool_size: DEFAULT_POOL_SIZE,
            breaker: BreakerConfig::default(),
        }
    }

    /// Starts a store for the primary that Redis Sentinel watches under `service`
    /// (`sentinel monitor <service> ...`), given some of the sentinels as URLs (with
    /// their own credentials, if they need any). The builder's
    /// [`username`](RedisStoreBuilder::username) and
    /// [`password`](RedisStoreBuilder::password) are those of the Redis servers; TLS
    /// settings apply to both. After a failover, the first operation that finds the old
    /// primary gone (or read-only) asks the sentinels for the new one.
    ///
    /// [`pool_size`](RedisStoreBuilder::pool_size) does not apply: the store keeps one
    /// multiplexed connection to the primary. Building connects nothing.
    pub fn sentinel<I, S>(sentinels: I, service: impl Into<String>) -> RedisStoreBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisStoreBuilder {
            target: Target::Sentinel(
                sentinels.into_iter().map(Into::into).collect(),
                service.into(),
            ),
            username: None,
            password: None,
            tls: Tls::default(),
            command_timeout: DEFAULT_COMMAND_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            pool_size: DEFAULT_POOL_SIZE,
            breaker: BreakerConfig::default(),
        }
    }

    /// Whether the store speaks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.inner.backend, Backend::Cluster(_))
    }

    /// A store with no Redis behind it: a guard built on it runs on L1 and its local
    /// single-flight only (at most one origin call per key per process), as when Redis
    /// is down, without ever trying to reach one. For single instances and tests.
    pub fn local_only() -> Self {
        Self {
            inner: Arc::new(Inner {
                backend: Backend::None,
                command_timeout: DEFAULT_COMMAND_TIMEOUT,
                connect_timeout: DEFAULT_CONNECT_TIMEOUT,
                breaker: Breaker::always_open(),
            }),
        }
    }

    /// Whether the store has no Redis behind it ([`local_only`](Self::local_only)).
    pub fn is_local_only(&self) -> bool {
        matches!(self.inner.backend, Backend::None)
    }

    /// The deadline of one operation.
    pub fn command_timeout(&self) -> Duration {
        self.inner.command_timeout
    }

    /// Sends a `PING`: a way to check Redis, and to open a first connection before
    /// traffic arrives.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let pong: String = self
            .run(Operation::Ping, Request::Command(&redis::cmd("PING")))
            .await?;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(StoreError::new(
                Operation::Ping,
                StoreErrorKind::Response,
                None,
            ))
        }
    }

    /// A dedicated pub/sub connection, opened within the connect deadline.
    pub(crate) async fn pubsub(
        &self,
        connect_timeout: Duration,
    ) -> Result<redis::aio::PubSub, StoreError> {
        let client = match &self.inner.backend {
            _ if self.inner.breaker.is_open() => None,
            Backend::Single { client, .. } => Some(client),
            Backend::Cluster(cluster) => return cluster.pubsub(connect_timeout).await,
            Backend::Sentinel(sentinel) => return sentinel.pubsub(connect_timeout).await,
            Backend::None => None,
        };
        let client = match client {
            Some(client) => client,
            None => {
                return Err(StoreError::new(
                    Operation::Subscribe,
                    StoreErrorKind::CircuitOpen,
                    None,
                ));
            }
        };
        match tokio::time::timeout(connect_timeout, client.get_async_pubsub()).await {
            Ok(Ok(pubsub)) => Ok(pubsub),
            Ok(Err(error)) => Err(StoreError::from_redis(Operation::Subscribe, error)),
            Err(_) => Err(StoreError::new(
                Operation::Subscribe,
                StoreErrorKind::NoConnection,
                None,
            )),
        }
    }

    /// The deadline of opening a connection.
    pub(crate) fn connect_timeout(&self) -> Duration {
        self.inner.connect_timeout
    }

    /// Whether the circuit breaker is open: Redis is not being asked.
    pub fn circuit_open(&self) -> bool {
        self.inner.breaker.is_open()
    }

    /// Runs one request within the deadline, unless the breaker is open.
    pub(crate) async fn run<T: FromRedisValue>(
        &self,
        operation: Operation,
        request: Request<'_>,
    ) -> Result<T, StoreError> {
        self.run_sized(operation, request, 0).await
    }

    /// Runs one request that moves up to `payload` bytes: its deadline grows with the
    /// payload (at 32 MiB/s), so that a large entry is not a timeout by nature.
    pub(crate) async fn run_sized<T: FromRedisValue>(
        &self,
        operation: Operation,
        request: Request<'_>,
        payload: usize,
    ) -> Result<T, StoreError> {
        if self.is_local_only() {
            return Err(StoreError::new(
                operation,
                StoreErrorKind::CircuitOpen,
                None,
            ));
        }
        if self.inner.breaker.is_open() {
            self.start_probe();
            metrics::counter!(
                REDIS_ERRORS,
                "operation" => operation.as_str(),
                "kind" => StoreErrorKind::CircuitOpen.as_str()
            )
            .increment(1);
            return Err(StoreError::new(
                operation,
                StoreErrorKind::CircuitOpen,
                None,
            ));
        }
        let slack = Duration::from_micros(payload as u64 / 32);
        let result = self.inner.execute(operation, &request, slack).await;
        match &result {
            Ok(_) => self.inner.breaker.success(),
            Err(error) => {
                metrics::counter!(
                    REDIS_ERRORS,
                    "operation" => operation.as_str(),
                    "kind" => error.kind().as_str()
                )
                .increment(1);
                // Error replies (OOM, NOPERM, READONLY...) come back fast: they cost no
                // waiting, and a PING would close the breaker at once.
                if error.counts_against_redis() && self.inner.breaker.failure() {
                    self.start_probe();
                }
            }
        }
        result
    }
}

/// A node a command can be sent to, for what must visit every node (a key scan).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Node {
    /// The one server of a single-server store.
    Server,
    /// A primary of a cluster, by address.
    Primary(String, u16),
}

impl RedisStore {
    /// The nodes that together hold every key: the server, or each primary of a
    /// cluster (as the cluster sees itself now).
    pub(crate) async fn nodes(&self) -> Result<Vec<Node>, StoreError> {
        match &self.inner.backend {
            Backend::Cluster(cluster) => {
                let deadline = Instant::now() + self.inner.command_timeout;
                let mut conn = cluster.connection(Operation::Inspect).await?;
                match timeout_at(deadline, cluster::primaries(&mut conn)).await {
                    Ok(Ok(primaries)) => Ok(primaries
                        .into_iter()
                        .map(|(host, port)| Node::Primary(host, port))
                        .collect()),
                    Ok(Err(error)) => Err(StoreError::from_redis(Operation::Inspect, error)),
                    Err(_) => Err(StoreError::new(
                        Operation::Inspect,
                        StoreErrorKind::Timeout,
                        None,
                    )),
                }
            }
            _ => Ok(vec![Node::Server]),
        }
    }

    /// Runs a command on one node (see [`RedisStore::nodes`]), within the deadline.
    pub(crate) async fn run_at<T: FromRedisValue>(
        &self,
        node: &Node,
        operation: Operation,
        cmd: &redis::Cmd,
    ) -> Result<T, StoreError> {
        match (node, &self.inner.backend) {
            (Node::Primary(host, port), Backend::Cluster(cluster)) => {
                let deadline = Instant::now() + self.inner.command_timeout;
                let mut conn = cluster.connection(operation).await?;
                match timeout_at(deadline, cluster::run_at(&mut conn, host, *port, cmd)).await {
                    Ok(Ok(value)) => Ok(value),
                    Ok(Err(error)) => Err(StoreError::from_redis(operation, error)),
                    Err(_) => Err(StoreError::new(operation, StoreErrorKind::Timeout, None)),
                }
            }
            _ => self.run(operation, Request::Command(cmd)).await,
        }
    }

    /// Starts the probe of an open breaker unless one runs.
    fn start_probe(&self) {
        if !self.inner.breaker.probing.swap(true, Ordering::AcqRel) {
            tokio::spawn(probe(Arc::downgrade(&self.inner)));
        }
    }
}

impl Inner {
    async fn execute<T: FromRedisValue>(
        &self,
        operation: Operation,
        request: &Request<'_>,
        slack: Duration,
    ) -> Result<T, StoreError> {
        let deadline = Instant::now() + self.command_timeout + slack;
        let pool = match &self.backend {
            Backend::Single { pool, .. } => pool,
            Backend::Cluster(cluster) => {
                let mut conn = cluster.connection(operation).await?;
                return execute(&mut conn, request, deadline, operation).await;
            }
            Backend::Sentinel(sentinel) => {
                let mut conn = sentinel.connection(operation).await?;
                let result = execute(&mut conn, request, deadline, operation).await;
                if let Err(error) = &result {
                    sentinel.after(error);
                }
                return result;
            }
            Backend::None => {
                return Err(StoreError::new(
                    operation,
                    StoreErrorKind::CircuitOpen,
                    None,
                ));
            }
        };
        let Conn { mut conn, broken } = checkout(pool, deadline, operation, |c| c.clone()).await?;
        let result = execute(&mut conn, request, deadline, operation).await;
        if let Err(error) = &result
            && error.breaks_connection()
        {
            broken.store(true, Ordering::Relaxed);
        }
        result
    }
}

/// Pings Redis while the breaker is open; closes it at the first answer. Ends with the
/// store.
async fn probe(inner: std::sync::Weak<Inner>) {
    /// Clears `probing` however the probe ends (closed, store gone, runtime gone).
    struct Probing(std::sync::Weak<Inner>);
    impl Drop for Probing {
        fn drop(&mut self) {
            if let Some(inner) = self.0.upgrade() {
                inner.breaker.probing.store(false, Ordering::Release);
            }
        }
    }
    let _probing = Probing(inner.clone());
    loop {
        let every = match inner.upgrade() {
            Some(inner) => inner.breaker.probe_every(),
            None => return,
        };
        tokio::time::sleep(every).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let ping = redis::cmd("PING");
        let pong: Result<String, StoreError> = inner
            .execute(Operation::Ping, &Request::Command(&ping), Duration::ZERO)
            .await;
        if pong.is_ok_and(|p| p == "PONG") {
            inner.breaker.close();
            return;
        }
    }
}

/// Checks a connection out, clones what is needed of it and gives it back at once.
async fn checkout<M, T>(
    pool: &bb8::Pool<M>,
    deadline: Instant,
    operation: Operation,
    take: impl FnOnce(&M::Connection) -> T,
) -> Result<T, StoreError>
where
    M: bb8::ManageConnection<Error = redis::RedisError>,
{
    match timeout_at(deadline, pool.get()).await {
        Ok(Ok(conn)) => Ok(take(&conn)),
        Ok(Err(bb8::RunError::User(error))) => Err(StoreError::new(
            operation,
            StoreErrorKind::NoConnection,
            Some(error),
        )),
        Ok(Err(bb8::RunError::TimedOut)) | Err(_) => Err(StoreError::new(
            operation,
            StoreErrorKind::NoConnection,
            None,
        )),
    }
}

async fn execute<T: FromRedisValue>(
    conn: &mut impl redis::aio::ConnectionLike,
    request: &Request<'_>,
    deadline: Instant,
    operation: Operation,
) -> Result<T, StoreError> {
    let reply = async {
        match request {
            Request::Script(invocation) => invocation.invoke_async(conn).await,
            Request::Command(cmd) => cmd.query_async(conn).await,
        }
    };
    match timeout_at(deadline, reply).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(StoreError::from_redis(operation, error)),
        Err(_) => Err(StoreError::new(operation, StoreErrorKind::Timeout, None)),
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

/// The TLS settings of a builder, for `rediss://` URLs.
#[derive(Default)]
struct Tls {
    /// PEM root certificates to trust instead of the system's.
    root: Option<Vec<u8>>,
    /// A PEM client certificate and its key, for servers that ask for one.
    client: Option<(Vec<u8>, Vec<u8>)>,
    /// Certificates are not checked at all.
    insecure: bool,
}

impl Tls {
    /// What redis-rs is given besides the URL, if anything.
    fn certificates(&self) -> Option<TlsCertificates> {
        if self.root.is_none() && self.client.is_none() {
            return None;
        }
        Some(TlsCertificates {
            client_tls: self
                .client
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.root.clone(),
        })
    }
}

/// What a builder builds a store for.
enum Target {
    Single(String),
    Cluster(Vec<String>),
    /// The sentinels, and the service they watch.
    Sentinel(Vec<String>, String),
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // No URL: it may carry a password.
        let target = match &self.target {
            Target::Single(_) => "single",
            Target::Cluster(_) => "cluster",
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
    /// are host names.
    pub fn tls_root_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls.root = Some(pem.into());
        self
    }

    /// Presents this client certificate and key (PEM) on `rediss://` connections, for
    /// servers that ask for one (`tls-auth-clients yes`).
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
    /// `#insecure` is refused without it); building warns when it is on.
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
            .map_err(|_| ConfigError::invalid(field, "not a valid Redis URL"))?;
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
            _ if self.tls.root.is_some() || self.tls.client.is_some() || self.tls.insecure => {
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
        // The store around a backend, whichever it is.
        let breaker = self.breaker;
        let made = move |backend| RedisStore {
            inner: Arc::new(Inner {
                backend,
                command_timeout,
                connect_timeout,
                breaker: Breaker::new(breaker),
            }),
        };
        let url = match &self.target {
            Target::Single(url) => url,
            Target::Sentinel(sentinels, service) => {
                let sentinels = sentinels
                    .iter()
                    // The sentinels' own credentials: the builder's are the servers'.
                    .map(|url| self.parsed(url, "sentinels"))
                    .collect::<Result<Vec<_>, ConfigError>>()?;
                let sentinel = Sentinel::new(
                    &sentinels,
                    service,
                    (self.username.as_deref(), self.password.as_deref()),
                    (self.tls.certificates(), self.tls.insecure),
                    connect_timeout,
                    command_timeout,
                )?;
                self.warn_if_insecure();
                return Ok(made(Backend::Sentinel(Box::new(sentinel))));
            }
            Target::Cluster(nodes) => {
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
                self.warn_if_insecure();
                return Ok(made(Backend::Cluster(Box::new(cluster))));
            }
        };
        let info = self.connection_info(url, "url")?;
        let client = match self.tls.certificates() {
            Some(certificates) => Client::build_with_tls(info, certificates),
            None => Client::open(info),
        }
        .map_err(|_| ConfigError::invalid("url", "not usable with these TLS settings"))?;
        self.warn_if_insecure();
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
            .build_unchecked(Manager::new(client.clone(), connect_timeout));
        Ok(made(Backend::Single {
            pool,
            client: Box::new(client),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
