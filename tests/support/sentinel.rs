//! A real Redis Sentinel setup per test: a primary, a replica of it, and three sentinels
//! watching them under the name `mymaster` (quorum 2, a server down after 1 s).

use std::time::{Duration, Instant};

use super::cluster::cli;
use super::server::RedisServer;

/// The name the sentinels watch the primary under.
pub(crate) const SERVICE: &str = "mymaster";

/// How long the sentinels may take to find each other and the replica.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) struct SentinelGroup {
    pub(crate) primary: RedisServer,
    pub(crate) replica: RedisServer,
    pub(crate) sentinels: Vec<RedisServer>,
}

impl SentinelGroup {
    /// Starts the two servers and the three sentinels; returns once every sentinel
    /// knows the replica and the two other sentinels.
    pub(crate) fn start() -> Self {
        let primary = RedisServer::start();
        let port = primary.addr().port().to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
        let config = format!(
            "sentinel monitor {SERVICE} 127.0.0.1 {port} 2\n\
             sentinel down-after-milliseconds {SERVICE} 1000\n\
             sentinel failover-timeout {SERVICE} 5000\n"
        );
        let sentinels = (0..3)
            .map(|_| RedisServer::start_sentinel(&config))
            .collect();
        let group = Self {
            primary,
            replica,
            sentinels,
        };
        group.wait_ready();
        group
    }

    /// The sentinels' URLs, for [`stampede_guard::RedisStore::sentinel`].
    pub(crate) fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(RedisServer::url).collect()
    }

    /// The primary's port, as the first sentinel that answers says.
    pub(crate) fn primary_port(&self) -> Option<u16> {
        self.sentinels.iter().find_map(|s| {
            let reply = cli(
                s.addr().port(),
                &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE],
            )?;
            reply.lines().nth(1)?.trim().parse().ok()
        })
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let linked = cli(self.replica.addr().port(), &["INFO", "replication"])
                .is_some_and(|info| info.contains("master_link_status:up"));
            let known = self.sentinels.iter().all(|s| {
                let port = s.addr().port();
                // One `name` field per server or sentinel listed.
                let count = |what: &str| {
                    cli(port, &["SENTINEL", what, SERVICE]).map_or(0, |reply| {
                        reply.lines().filter(|l| l.trim() == "name").count()
                    })
                };
                count("REPLICAS") >= 1 && count("SENTINELS") >= 2
            });
            if linked && known {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the sentinels did not find each other and the replica within {READY_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
