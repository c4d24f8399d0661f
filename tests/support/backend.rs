//! One test body, two backends: the tests that must hold on a single server and on a
//! cluster alike take a [`Redis`] (or anything that makes a [`Store`]).

use std::time::Duration;

use redis::FromRedisValue;
use stampede_guard::RedisStore;

use super::{RedisCluster, RedisServer};

/// What a test's store speaks to.
pub(crate) enum Redis {
    Single(RedisServer),
    Cluster(RedisCluster),
}

/// Something a store can be made for.
pub(crate) trait Store {
    /// A store with `timeout` as its command timeout.
    fn store(&self, timeout: Duration) -> RedisStore;
}

impl Store for RedisServer {
    fn store(&self, timeout: Duration) -> RedisStore {
        RedisStore::builder(self.url())
            .command_timeout(timeout)
            .build()
            .unwrap()
    }
}

impl Store for RedisCluster {
    fn store(&self, timeout: Duration) -> RedisStore {
        RedisStore::cluster(self.urls())
            .command_timeout(timeout)
            .build()
            .unwrap()
    }
}

impl Store for Redis {
    fn store(&self, timeout: Duration) -> RedisStore {
        match self {
            Redis::Single(server) => server.store(timeout),
            Redis::Cluster(cluster) => cluster.store(timeout),
        }
    }
}

impl Redis {
    pub(crate) fn single() -> Self {
        Self::Single(RedisServer::start())
    }

    pub(crate) fn cluster() -> Self {
        Self::Cluster(RedisCluster::start())
    }

    /// Runs `cmd` on a direct connection (on a cluster, routed by its first key), for
    /// looking at or changing what the code under test left in Redis.
    pub(crate) async fn cmd<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        let reply = match self {
            Redis::Single(server) => cmd.query_async(&mut server.conn().await).await,
            Redis::Cluster(cluster) => {
                let mut conn = redis::cluster::ClusterClient::new(cluster.urls())
                    .unwrap()
                    .get_async_connection()
                    .await
                    .expect("direct connection to the test's cluster");
                cmd.query_async(&mut conn).await
            }
        };
        reply.unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
    }
}
