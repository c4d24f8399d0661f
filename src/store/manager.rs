//! The pool's connection manager.
//!
//! bb8-redis's own `RedisConnectionManager` opens connections with redis-rs' default
//! timeouts (it cannot take an `AsyncConnectionConfig`) and never reports a connection as
//! broken, so a dead connection goes back into the pool until a check-out `PING` (one more
//! round trip on every command) finds it. This manager connects with the store's connect
//! timeout, and marks a connection broken when a command on it failed in a way that
//! leaves it unusable; the check-out test then only reads that mark.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bb8_redis::bb8;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisError};

/// A pooled connection and its broken mark, shared with the clones handed out.
#[derive(Clone)]
pub(crate) struct Conn {
    pub(crate) conn: MultiplexedConnection,
    pub(crate) broken: Arc<AtomicBool>,
}

pub(crate) struct Manager {
    client: Client,
    config: AsyncConnectionConfig,
}

impl Manager {
    pub(crate) fn new(client: Client, connect_timeout: Duration) -> Self {
        // No response timeout here: every command is bounded by the store's own deadline,
        // which also covers the pool check-out.
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(None);
        Self { client, config }
    }
}

impl bb8::ManageConnection for Manager {
    type Connection = Conn;
    type Error = RedisError;

    async fn connect(&self) -> Result<Conn, RedisError> {
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        Ok(Conn {
            conn,
            broken: Arc::new(AtomicBool::new(false)),
        })
    }

    async fn is_valid(&self, conn: &mut Conn) -> Result<(), RedisError> {
        if conn.broken.load(Ordering::Relaxed) {
            Err(RedisError::from(std::io::Error::from(
                std::io::ErrorKind::BrokenPipe,
            )))
        } else {
            Ok(())
        }
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.broken.load(Ordering::Relaxed)
    }
}
