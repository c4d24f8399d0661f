//! Redis Cluster: redis-rs' asynchronous cluster client behind the store.
//!
//! bb8-redis speaks to one server only, so a cluster is reached through redis-rs' own
//! cluster connection. It is multiplexed (one socket per node, shared by every caller)
//! and a cheap clone, so the store keeps one and clones it for each operation: a pool in
//! front of it would add sockets, not concurrency. It learns the slot map from the
//! nodes it is given, routes each command by its first key (a script by its first key:
//! every key a script touches shares that key's hash tag, see [`crate::keys`]), follows
//! `MOVED` and `ASK` answers and reconnects to nodes by itself, within the store's
//! deadline. It is made by the first operation, not when the store is built, so that a
//! service can start while the cluster is down.
//!
//! What it does not notice is a socket that went silent without being closed (a NAT or
//! a firewall that forgot an idle flow: no reset, no reply, ever): its commands time
//! out in the store, which drops them, and redis-rs never hears of it. So a command
//! that timed out retires the connection it was sent on, and the next operation makes
//! a new one (every node connected again, the slot map asked for again). A connection
//! made less than the connect timeout ago is kept: a flow that young was not forgotten,
//! its timeouts are a slow cluster's, and so a slow cluster costs at most one
//! reconnect per connect timeout.
//!
//! # Notices on a cluster
//!
//! Notices use classic pub/sub, not sharded pub/sub (`SSUBSCRIBE`). A classic `PUBLISH`
//! reaches the subscribers of every node (the cluster bus carries it to all of them), so
//! an instance subscribes on any one node and hears the whole fleet, and a fill script
//! may publish from whichever node holds its key. Sharded pub/sub would keep each
//! message on one shard, but it routes a channel by its slot: one channel per key space
//! would put every notice on one shard anyway, and a channel per key would have every
//! instance subscribe on every shard. What classic pub/sub costs is that each notice
//! crosses the cluster bus to every node, which at a few notices per fill is small
//! beside the fill itself. An instance subscribes on one of the nodes it was given,
//! starting from one picked at random (so that a fleet spreads its subscriptions), then
//! on the primaries the cluster names. If that node goes away, the subscription ends,
//! and the listener subscribes again the same way (and treats L1 as it does after any
//! lost subscription).

use std::sync::Mutex;
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{ConnectionInfo, FromRedisValue, RedisResult};
use tokio::time::{Instant, timeout_at};

use super::error::{Operation, StoreError, StoreErrorKind};
use super::tls::TlsCertificates;
use crate::error::ConfigError;

/// See the cluster client's `response_timeout` in [`Cluster::new`].
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(60);

/// A cluster, as the store speaks to it.
pub(super) struct Cluster {
    client: ClusterClient,
    /// The nodes the store was given, for pub/sub connections (any node hears every
    /// notice, see the module docs).
    nodes: Vec<ConnectionInfo>,
    /// The TLS certificates of the store, for pub/sub connections too.
    certificates: Option<TlsCertificates>,
    /// The connection, once made, and when it was made.
    connection: Mutex<Option<(ClusterConnection, Instant)>>,
    /// Held while a connection is being made, so that callers wait for one attempt
    /// instead of each making their own.
    connecting: tokio::sync::Mutex<()>,
    connect_timeout: Duration,
}

impl Cluster {
    /// Takes the nodes' parsed URLs; connects nothing.
    pub(super) fn new(
        nodes: Vec<ConnectionInfo>,
        certificates: Option<TlsCertificates>,
        connect_timeout: Duration,
        command_timeout: Duration,
    ) -> Result<Self, ConfigError> {
        let Some(first) = nodes.first() else {
            return Err(ConfigError::invalid("nodes", "needs at least one node"));
        };
        let tls =
            |node: &ConnectionInfo| matches!(node.addr(), redis::ConnectionAddr::TcpTls { .. });
        if nodes.iter().any(|node| tls(node) != tls(first)) {
            // Else some connections (pub/sub ones, with the password) would go in clear.
            return Err(ConfigError::invalid(
                "nodes",
                "mixes `rediss://` and `redis://`: all or none must use TLS",
            ));
        }
        let settings = first.redis_settings();
        let mut builder = ClusterClientBuilder::new(nodes.clone());
        // The cluster client authenticates to every node as the first node says.
        if let Some(username) = settings.username() {
            builder = builder.username(username);
        }
        if let Some(password) = settings.password() {
            builder = builder.password(password);
        }
        // Without the feature `tls`, building refused every `rediss://` URL.
        #[cfg(feature = "tls")]
        if let redis::ConnectionAddr::TcpTls { insecure, .. } = first.addr() {
            builder = builder.tls(if *insecure {
                redis::TlsMode::Insecure
            } else {
                redis::TlsMode::Secure
            });
        }
        #[cfg(feature = "tls")]
        if let Some(certificates) = &certificates {
            builder = builder.certs(certificates.clone());
        }
        let client = builder
            .connection_timeout(connect_timeout)
            // The store puts its own deadline on each operation (and drops the request
            // when it passes). redis-rs would send a request again after its own reply
            // timeout, and a script sent twice (an acquire) would meet itself: leave it
            // far beyond any deadline of the store.
            .response_timeout(RESPONSE_TIMEOUT.max(command_timeout * 10))
            .build()
            .map_err(|_| ConfigError::invalid("nodes", "not a valid cluster"))?;
        Ok(Self {
            client,
            nodes,
            certificates,
            connection: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            connect_timeout,
        })
    }

    /// The cluster connection (a clone of it), made first if need be. Making it (the
    /// seeds asked for the slot map, every node connected, TLS handshakes) is bounded by
    /// the connect timeout, not by the operation's deadline, so that it can finish on a
    /// slow link: the first operation may wait that long. One attempt at a time; the
    /// others wait for it.
    pub(super) async fn connection(
        &self,
        operation: Operation,
    ) -> Result<ClusterConnection, StoreError> {
        if let Some(connection) = self.made() {
            return Ok(connection);
        }
        let no_connection =
            |source| StoreError::new(operation, StoreErrorKind::NoConnection, source);
        let deadline = Instant::now() + self.connect_timeout;
        let _one_attempt = timeout_at(deadline, self.connecting.lock())
            .await
            .map_err(|_| no_connection(None))?;
        if let Some(connection) = self.made() {
            return Ok(connection);
        }
        match timeout_at(deadline, self.client.get_async_connection()).await {
            Ok(Ok(connection)) => {
                *self.connection.lock().expect("cluster connection lock") =
                    Some((connection.clone(), Instant::now()));
                Ok(connection)
            }
            Ok(Err(error)) => Err(no_connection(Some(error))),
            Err(_) => Err(no_connection(None)),
        }
    }

    fn made(&self) -> Option<ClusterConnection> {
        self.connection
            .lock()
            .expect("cluster connection lock")
            .as_ref()
            .map(|(connection, _)| connection.clone())
    }

    /// A command sent at `sent` timed out: the connection it was sent on is retired
    /// (see the module docs), unless it is younger than the connect timeout, or was
    /// made after `sent` (another command's timeout retired the one it used).
    pub(super) fn timed_out(&self, sent: Instant) {
        let mut connection = self.connection.lock().expect("cluster connection lock");
        if let Some((_, made)) = &*connection
            && *made <= sent
            && made.elapsed() >= self.connect_timeout
        {
            *connection = None;
        }
    }

    /// A pub/sub connection to a node that answers within `connect_timeout`: the nodes
    /// given, from one picked at random (so that a fleet spreads its subscriptions),
    /// then the primaries the cluster names now (the nodes given may all be gone).
    pub(super) async fn pubsub(
        &self,
        connect_timeout: Duration,
    ) -> Result<redis::aio::PubSub, StoreError> {
        let mut last = None;
        let start = fastrand::usize(..self.nodes.len());
        let mut candidates: Vec<ConnectionInfo> = self.nodes[start..]
            .iter()
            .chain(&self.nodes[..start])
            .cloned()
            .collect();
        if let Some(mut connection) = self.made() {
            let listed = tokio::time::timeout(connect_timeout, primaries(&mut connection)).await;
            if let Ok(Ok(primaries)) = listed {
                let template = &self.nodes[0];
                candidates.extend(primaries.into_iter().map(|(host, port)| {
                    // As the given nodes are reached (TLS, user and password), elsewhere.
                    let addr = match template.addr() {
                        redis::ConnectionAddr::TcpTls {
                            insecure,
                            tls_params,
                            ..
                        } => redis::ConnectionAddr::TcpTls {
                            host,
                            port,
                            insecure: *insecure,
                            tls_params: tls_params.clone(),
                        },
                        _ => redis::ConnectionAddr::Tcp(host, port),
                    };
                    template.clone().set_addr(addr)
                }));
            }
        }
        for node in &candidates {
            let client = match &self.certificates {
                #[cfg(feature = "tls")]
                Some(certificates) => {
                    redis::Client::build_with_tls(node.clone(), certificates.clone())
                }
                #[cfg(not(feature = "tls"))]
                Some(none) => match *none {},
                None => redis::Client::open(node.clone()),
            };
            let Ok(client) = client else {
                continue;
            };
            match tokio::time::timeout(connect_timeout, client.get_async_pubsub()).await {
                Ok(Ok(pubsub)) => return Ok(pubsub),
                Ok(Err(error)) => last = Some(error),
                Err(_) => {}
            }
        }
        Err(StoreError::new(
            Operation::Subscribe,
            StoreErrorKind::NoConnection,
            last,
        ))
    }
}

/// The primaries of the cluster as `conn` sees it (`CLUSTER NODES`): those that hold
/// slots and are not marked failed.
pub(super) async fn primaries(conn: &mut ClusterConnection) -> RedisResult<Vec<(String, u16)>> {
    let text: String = redis::cmd("CLUSTER").arg("NODES").query_async(conn).await?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags: Vec<&str> = fields.get(2)?.split(',').collect();
            // Holding slots: a ninth field (a range or a slot) is there. `fail?` is one
            // node's suspicion, not a failure: such a primary still holds its keys.
            let serves = fields.len() > 8;
            if !flags.contains(&"master")
                || flags.contains(&"fail")
                || flags.contains(&"noaddr")
                || !serves
            {
                return None;
            }
            // `host:port@bus-port` (and `,hostname` since Redis 7).
            let address = fields.get(1)?.split(['@', ',']).next()?;
            let (host, port) = address.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect())
}

/// Runs `cmd` on the node at `host:port`.
pub(super) async fn run_at<T: FromRedisValue>(
    conn: &mut ClusterConnection,
    host: &str,
    port: u16,
    cmd: &redis::Cmd,
) -> RedisResult<T> {
    let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port,
    });
    let value = conn.route_command(cmd.clone(), routing).await?;
    T::from_redis_value(value).map_err(Into::into)
}
