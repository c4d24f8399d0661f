//! Redis Sentinel: the store asks the sentinels which server is the primary, and keeps one
//! multiplexed connection to it until it fails.
//!
//! The primary is forgotten, and asked for again at the next operation, when an
//! operation loses its connection or the server answers `READONLY`: it is no longer the
//! primary, a failover happened. A command that timed out retires only the connection
//! (the next operation connects to the same primary again): a socket can go silent
//! without being closed (a NAT or a firewall that forgot an idle flow: no reset, no
//! reply, ever), and nothing else would ever replace it. A connection made less than
//! the connect timeout ago is kept: a flow that young was not forgotten, its timeouts
//! are a slow primary's, and so a slow primary costs at most one reconnect per connect
//! timeout; if connecting again fails, the primary is asked for. Until the
//! sentinels have promoted a replica, operations fail as they do when a single server is
//! down (the breaker opens, the guard runs on L1 and its local single-flight), and the
//! first operation after the promotion finds the new primary. Notices subscribe on the
//! primary too: a failover ends the subscription, and the listener subscribes again on
//! the new primary (and treats L1 as after any lost subscription).

use std::sync::Mutex;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{AsyncConnectionConfig, Client, ConnectionInfo};
use tokio::time::{Instant, timeout_at};

use super::error::{Operation, StoreError, StoreErrorKind};
use super::tls::TlsCertificates;
use crate::error::ConfigError;

/// A primary found through sentinels, as the store speaks to it.
pub(super) struct Sentinel {
    /// Asked for the primary; behind an async lock, as redis-rs' client asks through
    /// `&mut self` (one question at a time, which is what a failover needs anyway).
    sentinels: tokio::sync::Mutex<SentinelClient>,
    /// The primary, once found.
    primary: Mutex<Option<Primary>>,
    /// Held while the primary is looked for, so that callers wait for one lookup instead
    /// of each making their own (after a failover, every caller needs the new primary).
    finding: tokio::sync::Mutex<()>,
    connect_timeout: Duration,
    command_timeout: Duration,
}

/// The primary as found: its client, and a connection to it with when it was made
/// (none after a timeout retired it).
struct Primary {
    client: Client,
    connection: Option<(MultiplexedConnection, Instant)>,
}

impl Sentinel {
    /// Takes the sentinels' parsed URLs (with their own credentials, if they need
    /// any), the name of the service they watch, the user and password for its servers,
    /// and the TLS settings for both; connects nothing.
    pub(super) fn new(
        sentinels: &[ConnectionInfo],
        service: &str,
        credentials: (Option<&str>, Option<&str>),
        tls: (Option<TlsCertificates>, bool),
        connect_timeout: Duration,
        command_timeout: Duration,
    ) -> Result<Self, ConfigError> {
        let Some(first) = sentinels.first() else {
            return Err(ConfigError::invalid(
                "sentinels",
                "needs at least one sentinel",
            ));
        };
        if service.is_empty() {
            return Err(ConfigError::invalid(
                "service",
                "names the primary the sentinels watch",
            ));
        }
        let invalid = |_| ConfigError::invalid("sentinels", "not valid sentinel URLs");
        let mut builder = SentinelClientBuilder::new(
            sentinels.iter().map(|s| s.addr().clone()),
            service,
            SentinelServerType::Master,
        )
        .map_err(invalid)?;
        let own = first.redis_settings();
        if let Some(username) = own.username() {
            builder = builder.set_client_to_sentinel_username(username);
        }
        if let Some(password) = own.password() {
            builder = builder.set_client_to_sentinel_password(password);
        }
        let (username, password) = credentials;
        if let Some(username) = username {
            builder = builder.set_client_to_redis_username(username);
        }
        if let Some(password) = password {
            builder = builder.set_client_to_redis_password(password);
        }
        // Without the feature `tls` there are no certificates (see `tls::TlsCertificates`).
        #[cfg_attr(not(feature = "tls"), expect(unused_variables))]
        let (certificates, insecure) = tls;
        if let redis::ConnectionAddr::TcpTls { .. } = first.addr() {
            let mode = if insecure {
                redis::TlsMode::Insecure
            } else {
                redis::TlsMode::Secure
            };
            builder = builder
                .set_client_to_sentinel_tls_mode(mode)
                .set_client_to_redis_tls_mode(mode);
            #[cfg(feature = "tls")]
            if let Some(certificates) = certificates {
                builder = builder
                    .set_client_to_sentinel_certificates(certificates.clone())
                    .set_client_to_redis_certificates(certificates);
            }
        }
        Ok(Self {
            sentinels: tokio::sync::Mutex::new(builder.build().map_err(invalid)?),
            primary: Mutex::new(None),
            finding: tokio::sync::Mutex::new(()),
            connect_timeout,
            command_timeout,
        })
    }

    /// A connection to the primary (a clone of it), found first if need be. Finding it
    /// (a sentinel asked, the primary's role checked, a connection made) is bounded by
    /// the connect timeout, not by the operation's deadline, so that it can finish on a
    /// slow link. One lookup at a time; the others wait for it.
    pub(super) async fn connection(
        &self,
        operation: Operation,
    ) -> Result<MultiplexedConnection, StoreError> {
        if let Some(connection) = self.known() {
            return Ok(connection);
        }
        let deadline = Instant::now() + self.connect_timeout;
        let _one_lookup = timeout_at(deadline, self.finding.lock())
            .await
            .map_err(|_| StoreError::new(operation, StoreErrorKind::NoConnection, None))?;
        if let Some(connection) = self.known() {
            return Ok(connection);
        }
        let known = self
            .primary
            .lock()
            .expect("primary lock")
            .as_ref()
            .map(|primary| primary.client.clone());
        let (client, connection) = match known {
            // A timeout retired the connection: the same primary, connected again.
            Some(client) => match self.connect(&client, deadline, operation).await {
                Ok(connection) => (client, connection),
                Err(error) => {
                    *self.primary.lock().expect("primary lock") = None;
                    return Err(error);
                }
            },
            // Boxed: asking the sentinels is a deep future, and rare.
            None => Box::pin(self.find(deadline, operation)).await?,
        };
        *self.primary.lock().expect("primary lock") = Some(Primary {
            client,
            connection: Some((connection.clone(), Instant::now())),
        });
        Ok(connection)
    }

    fn known(&self) -> Option<MultiplexedConnection> {
        self.primary
            .lock()
            .expect("primary lock")
            .as_ref()
            .and_then(|primary| primary.connection.as_ref())
            .map(|(connection, _)| connection.clone())
    }

    /// Asks the sentinels for the primary and connects to it.
    async fn find(
        &self,
        deadline: Instant,
        operation: Operation,
    ) -> Result<(Client, MultiplexedConnection), StoreError> {
        let no_connection =
            |source| StoreError::new(operation, StoreErrorKind::NoConnection, source);
        let mut sentinels = timeout_at(deadline, self.sentinels.lock())
            .await
            .map_err(|_| no_connection(None))?;
        let client = match timeout_at(deadline, sentinels.async_get_client()).await {
            Ok(Ok(client)) => client,
            Ok(Err(error)) => return Err(no_connection(Some(error))),
            Err(_) => return Err(no_connection(None)),
        };
        drop(sentinels);
        let connection = self.connect(&client, deadline, operation).await?;
        Ok((client, connection))
    }

    /// Connects to the primary `client` names, by `deadline`.
    async fn connect(
        &self,
        client: &Client,
        deadline: Instant,
        operation: Operation,
    ) -> Result<MultiplexedConnection, StoreError> {
        let no_connection =
            |source| StoreError::new(operation, StoreErrorKind::NoConnection, source);
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.connect_timeout))
            .set_response_timeout(Some(self.command_timeout));
        let connect = client.get_multiplexed_async_connection_with_config(&config);
        match timeout_at(deadline, connect).await {
            Ok(Ok(connection)) => Ok(connection),
            Ok(Err(error)) => Err(no_connection(Some(error))),
            Err(_) => Err(no_connection(None)),
        }
    }

    /// After `error`, of a command sent at `sent`: forgets the primary if the error says
    /// the connection is lost or the server is no longer the primary (the next
    /// operation asks the sentinels); retires the connection after a timeout (see the
    /// module docs), unless it is younger than the connect timeout or was made after
    /// `sent` (another command's timeout retired the one this one used). A timeout
    /// alone does not forget the primary: a slow command is not a failover.
    pub(super) fn after(&self, error: &StoreError, sent: Instant) {
        let lost = matches!(
            error.kind(),
            StoreErrorKind::ConnectionLost | StoreErrorKind::NoConnection
        );
        let mut primary = self.primary.lock().expect("primary lock");
        if lost || error.server_code() == Some("READONLY") {
            *primary = None;
        } else if error.kind() == StoreErrorKind::Timeout
            && let Some(primary) = primary.as_mut()
            && primary
                .connection
                .as_ref()
                .is_some_and(|(_, made)| *made <= sent && made.elapsed() >= self.connect_timeout)
        {
            primary.connection = None;
        }
    }

    /// A pub/sub connection to the primary, found first if need be.
    pub(super) async fn pubsub(
        &self,
        connect_timeout: Duration,
    ) -> Result<redis::aio::PubSub, StoreError> {
        let deadline = Instant::now() + connect_timeout;
        let known = self
            .primary
            .lock()
            .expect("primary lock")
            .as_ref()
            .map(|primary| primary.client.clone());
        let client = match known {
            Some(client) => client,
            None => {
                let (client, connection) =
                    Box::pin(self.find(deadline, Operation::Subscribe)).await?;
                *self.primary.lock().expect("primary lock") = Some(Primary {
                    client: client.clone(),
                    connection: Some((connection, Instant::now())),
                });
                client
            }
        };
        match timeout_at(deadline, client.get_async_pubsub()).await {
            Ok(Ok(pubsub)) => Ok(pubsub),
            Ok(Err(error)) => {
                // A primary that refuses a subscription may be gone: look again next time.
                *self.primary.lock().expect("primary lock") = None;
                Err(StoreError::from_redis(Operation::Subscribe, error))
            }
            Err(_) => Err(StoreError::new(
                Operation::Subscribe,
                StoreErrorKind::NoConnection,
                None,
            )),
        }
    }
}
