//! A real Redis Cluster per test: three primaries with a replica each, six
//! `redis-server` processes on free ports (each a [`RedisServer`], with its directory, its
//! log and its cleanup), joined by `redis-cli --cluster create`.
//!
//! Start it from the test's own thread, as a single server (see `server.rs`).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::server::RedisServer;

/// How long the six nodes may take to agree on a cluster.
const FORM_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) struct RedisCluster {
    nodes: Vec<RedisServer>,
}

/// One node as the cluster sees it.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) id: String,
    pub(crate) port: u16,
    /// A primary that serves slots (a node just joined is a primary of none until it
    /// is made a replica).
    pub(crate) primary: bool,
    /// Marked as failing by the node asked.
    pub(crate) failing: bool,
    /// For a replica, its primary's id.
    pub(crate) of: Option<String>,
}

impl RedisCluster {
    /// Starts six nodes and joins them: three primaries, a replica each. Returns once
    /// every node says `cluster_state:ok` and knows all six. A node is failed over after
    /// 5 s without an answer: long enough that a machine busy with other tests' clusters
    /// does not fail one over by itself.
    pub(crate) fn start() -> Self {
        Self::start_failing_over_after(Duration::from_secs(5))
    }

    /// [`start`](Self::start), with nodes failed over after `timeout` without an
    /// answer (`cluster-node-timeout`), for tests that kill nodes.
    pub(crate) fn start_failing_over_after(timeout: Duration) -> Self {
        let timeout = timeout.as_millis().to_string();
        let nodes: Vec<RedisServer> = (0..6)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    // Relative to the server's own directory.
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    &timeout,
                ])
            })
            .collect();
        let mut create = Command::new(redis_cli_binary());
        create.args(["--cluster", "create"]);
        for node in &nodes {
            create.arg(node.addr().to_string());
        }
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        let output = create.output().expect("redis-cli --cluster create");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = Self { nodes };
        cluster.wait_formed();
        cluster
    }

    /// The nodes' URLs, for [`stampede_guard::RedisStore::cluster`].
    pub(crate) fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The node processes, in the order they were started.
    pub(crate) fn servers(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// Kills every node (SIGKILL).
    pub(crate) fn kill(&mut self) {
        for node in &mut self.nodes {
            node.kill();
        }
    }

    /// The node process on `port`.
    pub(crate) fn server(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|n| n.addr().port() == port)
            .expect("a node of this cluster")
    }

    /// The cluster as a live node sees it (`CLUSTER NODES`): who is a primary, who
    /// replicates whom.
    pub(crate) fn topology(&self) -> Vec<Node> {
        let text = self
            .nodes
            .iter()
            .find_map(|n| cli(n.addr().port(), &["CLUSTER", "NODES"]))
            .expect("a live node answers CLUSTER NODES");
        parse_nodes(&text)
    }

    /// The ports of the primaries that are up.
    pub(crate) fn primaries(&self) -> Vec<u16> {
        self.topology()
            .into_iter()
            .filter(|n| n.primary && !is_down(n.port))
            .map(|n| n.port)
            .collect()
    }

    /// The number of keys a node of this cluster holds (`DBSIZE`).
    pub(crate) fn dbsize(&self, port: u16) -> u64 {
        assert!(
            self.nodes.iter().any(|n| n.addr().port() == port),
            "{port} is not a node of this cluster"
        );
        cli(port, &["DBSIZE"])
            .and_then(|s| s.trim().parse().ok())
            .expect("DBSIZE")
    }

    /// Waits until every live node says `cluster_state:ok`, knows every node, and sees
    /// three primaries serving slots and every other live node replicating one, and
    /// every replica has caught up with its primary.
    pub(crate) fn wait_formed(&self) {
        let deadline = Instant::now() + FORM_TIMEOUT;
        loop {
            let live: Vec<u16> = self
                .nodes
                .iter()
                .map(|n| n.addr().port())
                .filter(|p| !is_down(*p))
                .collect();
            let known = format!("cluster_known_nodes:{}", self.nodes.len());
            let ok = live.iter().all(|port| {
                let state = cli(*port, &["CLUSTER", "INFO"]).is_some_and(|info| {
                    info.lines().any(|l| l.trim() == "cluster_state:ok")
                        && info.lines().any(|l| l.trim() == known)
                });
                let roles = cli(*port, &["CLUSTER", "NODES"]).is_some_and(|text| {
                    let nodes = parse_nodes(&text);
                    let serving = nodes.iter().filter(|n| n.primary && !n.failing).count();
                    let replicas = nodes
                        .iter()
                        .filter(|n| n.of.is_some() && !n.failing)
                        .count();
                    serving == 3 && replicas == live.len() - 3
                });
                // A replica has caught up with its primary (one that has not cannot be
                // promoted if its primary dies).
                let linked = cli(*port, &["INFO", "replication"]).is_some_and(|info| {
                    !info.lines().any(|l| l.trim() == "role:slave")
                        || info.lines().any(|l| l.trim() == "master_link_status:up")
                });
                state && roles && linked
            });
            if ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not form within {FORM_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl RedisCluster {
    /// Waits until the replica on `port` has synchronized with its primary and is
    /// linked to it (`master_link_status:up`).
    pub(crate) fn wait_replicating(&self, port: u16) {
        assert!(
            self.nodes.iter().any(|n| n.addr().port() == port),
            "{port} is not a node of this cluster"
        );
        let deadline = Instant::now() + FORM_TIMEOUT;
        while !cli(port, &["INFO", "replication"])
            .is_some_and(|info| info.lines().any(|l| l.trim() == "master_link_status:up"))
        {
            assert!(
                Instant::now() < deadline,
                "the replica on {port} did not synchronize within {FORM_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The nodes listed by `CLUSTER NODES`.
fn parse_nodes(text: &str) -> Vec<Node> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let port = fields[1]
                .split(['@', ','])
                .next()
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .expect("a node address");
            let flags = fields[2];
            Node {
                id: fields[0].to_owned(),
                port,
                // Slots (or slot ranges) follow the eight fixed fields.
                primary: flags.contains("master") && fields.len() > 8,
                failing: flags.contains("fail"),
                of: (fields[3] != "-").then(|| fields[3].to_owned()),
            }
        })
        .collect()
}

fn is_down(port: u16) -> bool {
    cli(port, &["PING"]).is_none()
}

/// Runs `redis-cli -p port args...`; its output, or `None` if the node did not answer.
pub(crate) fn cli(port: u16, args: &[&str]) -> Option<String> {
    let output = Command::new(redis_cli_binary())
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    (output.status.success() && !text.starts_with("Could not connect")).then_some(text)
}

pub(crate) fn redis_cli_binary() -> PathBuf {
    // Beside the server binary the tests use, else on PATH.
    if let Some(server) = std::env::var_os("REDIS_SERVER_BIN") {
        let cli = PathBuf::from(server).with_file_name("redis-cli");
        if cli.is_file() {
            return cli;
        }
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join("redis-cli"))
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "redis-cli is not on PATH: the cluster tests use it to form the cluster. \
                 Install it with redis-server (`apt-get install -y redis-server redis-tools`)."
            )
        })
}
