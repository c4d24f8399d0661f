//! The pool's connection manager.
//!
//! bb8-redis's own `RedisConnectionManager` opens connections with redis-rs' default
//! timeouts (it cannot take an `AsyncConnectionConfig`) and never reports a connection as
//! broken, so a dead connection goes back into the pool until a check-out `PING` (one more
//! round trip on every command) finds it. This manager connects with the store's connect
//! timeout, and marks a connection broken when a command on it failed in a way that
//! leaves it unusable; the check-out test then only reads that mark.
//!
//! bb8 keeps a failed connect to itself: it retries, and a check-out that runs out of
//! time says only that it timed out. The manager keeps the last connect error, so that
//! such a check-out can say why (refused, a name that does not resolve, a certificate
//! refused, a wrong password).
//!
//! A connection that sat idle in the pool through an outage is as dead as Redis was,
//! and nothing marks it: each connection is made in a generation, which the store moves
//! on when its breaker opens, so that what was made before the outage is replaced
//! rather than tried after it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bb8_redis::bb8;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisError};

/// A pooled connection and its broken mark, shared with the clones handed out.
#[derive(Clone)]
pub(crate) struct Conn {
    pub(crate) conn: MultiplexedConnection,
    pub(crate) broken: Arc<AtomicBool>,
    generation: u64,
}

pub(crate) struct Manager {
    client: Client,
    config: AsyncConnectionConfig,
    state: Connecting,
}

/// What the manager and the store share: the error of the last connect (cleared by one
/// that succeeds), and the generation connections are made in.
#[derive(Clone, Default)]
pub(crate) struct Connecting(Arc<ConnectingInner>);

#[derive(Default)]
struct ConnectingInner {
    last_error: Mutex<Option<RedisError>>,
    generation: AtomicU64,
}

impl Connecting {
    /// Why the last connect failed, unless one succeeded since.
    pub(crate) fn last_error(&self) -> Option<RedisError> {
        self.0
            .last_error
            .lock()
            .expect("connect error lock")
            .clone()
    }

    fn set_error(&self, error: Option<RedisError>) {
        *self.0.last_error.lock().expect("connect error lock") = error;
    }

    /// Redis went away: every connection made so far is dropped at its next check-out.
    pub(crate) fn outage(&self) {
        self.0.generation.fetch_add(1, Ordering::Relaxed);
    }

    fn generation(&self) -> u64 {
        self.0.generation.load(Ordering::Relaxed)
    }
}

impl Manager {
    pub(crate) fn new(client: Client, connect_timeout: Duration, state: Connecting) -> Self {
        // No response timeout here: every command is bounded by the store's own deadline,
        // which also covers the pool check-out.
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(None);
        Self {
            client,
            config,
            state,
        }
    }
}

impl bb8::ManageConnection for Manager {
    type Connection = Conn;
    type Error = RedisError;

    async fn connect(&self) -> Result<Conn, RedisError> {
        let generation = self.state.generation();
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await;
        let conn = match conn {
            Ok(conn) => {
                self.state.set_error(None);
                conn
            }
            Err(error) => {
                self.state.set_error(Some(error.clone()));
                return Err(error);
            }
        };
        Ok(Conn {
            conn,
            broken: Arc::new(AtomicBool::new(false)),
            generation,
        })
    }

    async fn is_valid(&self, conn: &mut Conn) -> Result<(), RedisError> {
        if self.has_broken(conn) {
            Err(RedisError::from(std::io::Error::from(
                std::io::ErrorKind::BrokenPipe,
            )))
        } else {
            Ok(())
        }
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.broken.load(Ordering::Relaxed) || conn.generation != self.state.generation()
    }
}
