//! The store: a handle to whichever Redis answers, and how it runs each operation within
//! its deadline, through the breaker.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Once};
use std::time::Duration;

use bb8_redis::bb8;
use redis::{Client, FromRedisValue, ScriptInvocation};
use tokio::time::{Instant, timeout_at};

use super::breaker::Breaker;
#[cfg(feature = "cluster")]
use super::cluster::{self, Cluster};
use super::error::{Operation, StoreError, StoreErrorKind};
use super::manager::{Conn, Connecting, Manager};
#[cfg(feature = "sentinel")]
use super::sentinel::Sentinel;
use crate::metrics::REDIS_ERRORS;

/// Default deadline of one Redis operation.
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_millis(100);
/// Default deadline of opening one connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// Default number of pooled connections.
pub const DEFAULT_POOL_SIZE: u32 = 4;

/// A handle to Redis, cheap to clone, shared by everything built on it.
#[derive(Clone)]
pub struct RedisStore {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    /// What answers: the place where Redis Cluster and Sentinel go, next to a single
    /// server.
    pub(super) backend: Backend,
    pub(super) command_timeout: Duration,
    pub(super) connect_timeout: Duration,
    pub(super) breaker: Breaker,
    /// Set once the error series are registered at zero (see [`zero_error_series`]).
    pub(super) zeroed: Once,
}

/// The kinds of Redis a store speaks to.
pub(super) enum Backend {
    /// None at all: see [`RedisStore::local_only`].
    None,
    /// One server (or a proxy in front of one).
    Single {
        pool: bb8::Pool<Manager>,
        /// For what a pool cannot give: pub/sub connections (boxed: with its TLS settings
        /// it is large, and it is used once per subscription).
        client: Box<Client>,
        /// Why the pool's last connect failed (what a check-out that ran out of time
        /// says), and the generation its connections are made in.
        connecting: Connecting,
    },
    /// A Redis Cluster (boxed: its client is large, and the enum is built once).
    #[cfg(feature = "cluster")]
    Cluster(Box<Cluster>),
    /// A primary found through Redis Sentinel.
    #[cfg(feature = "sentinel")]
    Sentinel(Box<Sentinel>),
}

/// A duration in whole milliseconds, as Redis takes them (`PX`, `PEXPIRE`) and as entries
/// keep their times; saturating.
pub(crate) fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

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

/// Registers every error series (operation by kind) at zero, once per store, before its
/// first operation: a series that first appears with a burst already counted (the five
/// timeouts that open the breaker) shows no increase to `rate()`, and so no error on a
/// dashboard. Sixty series, fixed.
fn zero_error_series() {
    for operation in Operation::ALL {
        for kind in StoreErrorKind::ALL {
            metrics::counter!(
                REDIS_ERRORS,
                "operation" => operation.as_str(),
                "kind" => kind.as_str()
            )
            .increment(0);
        }
    }
}

/// One request to Redis.
pub(crate) enum Request<'a> {
    Script(&'a ScriptInvocation<'a>),
    Command(&'a redis::Cmd),
}

impl RedisStore {
    /// Whether the store speaks to a Redis Cluster (never, without the feature
    /// `cluster`).
    pub fn is_cluster(&self) -> bool {
        #[cfg(feature = "cluster")]
        return matches!(self.inner.backend, Backend::Cluster(_));
        #[cfg(not(feature = "cluster"))]
        false
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
                zeroed: Once::new(),
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
            #[cfg(feature = "cluster")]
            Backend::Cluster(cluster) => return cluster.pubsub(connect_timeout).await,
            #[cfg(feature = "sentinel")]
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

    /// Runs one request within the deadline, outside the breaker: its failures neither
    /// count towards opening it nor are told to the log (the caller tells its own, once),
    /// and its successes do not close it; they are counted in the error metric as any
    /// other. Refused at once while the breaker is open. For work that retries itself
    /// and must not make Redis look away for everything else: reading purges back.
    pub(crate) async fn run_aside<T: FromRedisValue>(
        &self,
        operation: Operation,
        request: Request<'_>,
    ) -> Result<T, StoreError> {
        if self.is_local_only() || self.inner.breaker.is_open() {
            return Err(StoreError::new(
                operation,
                StoreErrorKind::CircuitOpen,
                None,
            ));
        }
        self.inner.zeroed.call_once(zero_error_series);
        let result = self
            .inner
            .execute(operation, &request, Duration::ZERO)
            .await;
        if let Err(error) = &result {
            metrics::counter!(
                REDIS_ERRORS,
                "operation" => operation.as_str(),
                "kind" => error.kind().as_str()
            )
            .increment(1);
        }
        result
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
        self.inner.zeroed.call_once(zero_error_series);
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
                if !error.counts_against_redis() {
                    self.inner.breaker.refused(error);
                } else if self.inner.breaker.failure(error) {
                    // Connections made before a Redis that went away are dead; before
                    // one that was only slow, they are not (and dropping them would
                    // add reconnects to its load).
                    if let Backend::Single { connecting, .. } = &self.inner.backend
                        && matches!(
                            error.kind(),
                            StoreErrorKind::NoConnection | StoreErrorKind::ConnectionLost
                        )
                    {
                        connecting.outage();
                    }
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
    #[cfg(feature = "cluster")]
    Primary(String, u16),
}

impl RedisStore {
    /// The nodes that together hold every key: the server, or each primary of a
    /// cluster (as the cluster sees itself now).
    pub(crate) async fn nodes(&self) -> Result<Vec<Node>, StoreError> {
        match &self.inner.backend {
            #[cfg(feature = "cluster")]
            Backend::Cluster(cluster) => {
                let deadline = Instant::now() + self.inner.command_timeout;
                let mut conn = cluster.connection(Operation::Inspect).await?;
                let sent = Instant::now();
                match timeout_at(deadline, cluster::primaries(&mut conn)).await {
                    Ok(Ok(primaries)) => Ok(primaries
                        .into_iter()
                        .map(|(host, port)| Node::Primary(host, port))
                        .collect()),
                    Ok(Err(error)) => Err(StoreError::from_redis(Operation::Inspect, error)),
                    Err(_) => {
                        cluster.timed_out(sent);
                        Err(StoreError::new(
                            Operation::Inspect,
                            StoreErrorKind::Timeout,
                            None,
                        ))
                    }
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
            #[cfg(feature = "cluster")]
            (Node::Primary(host, port), Backend::Cluster(cluster)) => {
                let deadline = Instant::now() + self.inner.command_timeout;
                let mut conn = cluster.connection(operation).await?;
                let sent = Instant::now();
                match timeout_at(deadline, cluster::run_at(&mut conn, host, *port, cmd)).await {
                    Ok(Ok(value)) => Ok(value),
                    Ok(Err(error)) => Err(StoreError::from_redis(operation, error)),
                    Err(_) => {
                        cluster.timed_out(sent);
                        Err(StoreError::new(operation, StoreErrorKind::Timeout, None))
                    }
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
        let (pool, connecting) = match &self.backend {
            Backend::Single {
                pool, connecting, ..
            } => (pool, connecting),
            #[cfg(feature = "cluster")]
            Backend::Cluster(cluster) => {
                let mut conn = cluster.connection(operation).await?;
                let sent = Instant::now();
                let result = execute(&mut conn, request, deadline, operation).await;
                if let Err(error) = &result
                    && error.kind() == StoreErrorKind::Timeout
                {
                    cluster.timed_out(sent);
                }
                return result;
            }
            #[cfg(feature = "sentinel")]
            Backend::Sentinel(sentinel) => {
                let mut conn = sentinel.connection(operation).await?;
                let sent = Instant::now();
                let result = execute(&mut conn, request, deadline, operation).await;
                if let Err(error) = &result {
                    sentinel.after(error, sent);
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
        let Conn {
            mut conn, broken, ..
        } = checkout(pool, deadline, operation, connecting, |c| c.clone()).await?;
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
        match pong {
            Ok(pong) if pong == "PONG" => {
                inner.breaker.close();
                return;
            }
            Ok(_) => {}
            Err(error) => inner.breaker.probe_failed(&error),
        }
    }
}

/// Checks a connection out, clones what is needed of it and gives it back at once. Out
/// of time, the error says why the last connect failed, if one did.
async fn checkout<M, T>(
    pool: &bb8::Pool<M>,
    deadline: Instant,
    operation: Operation,
    connecting: &Connecting,
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
            connecting.last_error(),
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
