//! One test body, two backends: the tests that must hold on a single server and on a
//! cluster alike take a [`Redis`] (or anything that makes a [`Store`]). The cluster is
//! there with the feature `cluster`.

use std::time::Duration;

use redis::FromRedisValue;
use stampede_guard::RedisStore;

use super::{RedisCluster, RedisServer};

/// What a test's store speaks to.
pub(crate) enum Redis {
    Single(RedisServer),
    #[cfg(feature = "cluster")]
    Cluster(RedisCluster),
    /// A single server, spoken to as a user with only what
    /// [`KeySpace::acl_rules`](stampede_guard::KeySpace::acl_rules) allows: its URL.
    LeastPrivileged(RedisServer, String),
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

#[cfg(feature = "cluster")]
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
            #[cfg(feature = "cluster")]
            Redis::Cluster(cluster) => cluster.store(timeout),
            Redis::LeastPrivileged(_, url) => RedisStore::builder(url.as_str())
                .command_timeout(timeout)
                .build()
                .unwrap(),
        }
    }
}

impl Redis {
    pub(crate) fn single() -> Self {
        Self::Single(RedisServer::start())
    }

    #[cfg(feature = "cluster")]
    pub(crate) fn cluster() -> Self {
        Self::Cluster(RedisCluster::start())
    }

    /// A server with a user allowed what `keys`' ACL rules allow, and nothing else; the
    /// stores are made as that user (the test's own commands, as the default user).
    pub(crate) async fn least_privileged(keys: &stampede_guard::KeySpace) -> Self {
        let server = RedisServer::start();
        let mut setuser = redis::cmd("ACL");
        setuser
            .arg("SETUSER")
            .arg("guard")
            .arg("on")
            .arg(">guard-pw");
        for rule in keys.acl_rules().split_whitespace() {
            setuser.arg(rule);
        }
        let () = setuser
            .query_async(&mut server.conn().await)
            .await
            .expect("ACL SETUSER");
        let url = format!("redis://guard:guard-pw@127.0.0.1:{}", server.addr().port());
        Self::LeastPrivileged(server, url)
    }

    /// Kills the server, or every node of the cluster (SIGKILL): Redis is gone.
    pub(crate) fn kill(&mut self) {
        match self {
            Redis::Single(server) | Redis::LeastPrivileged(server, _) => server.kill(),
            #[cfg(feature = "cluster")]
            Redis::Cluster(cluster) => cluster.kill(),
        }
    }

    /// Runs `cmd` on a direct connection (on a cluster, routed by its first key), for
    /// looking at or changing what the code under test left in Redis.
    pub(crate) async fn cmd<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        let reply = match self {
            Redis::Single(server) | Redis::LeastPrivileged(server, _) => {
                cmd.query_async(&mut server.conn().await).await
            }
            #[cfg(feature = "cluster")]
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
