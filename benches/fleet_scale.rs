//! The fleet at scale: K = 1, 4, 16 and 32 instances, each a `stampede-sidecar` process,
//! in front of one origin, on one Redis server and then on a Redis Cluster (three
//! primaries, a replica each). The same offered load at every K, spread at random over the
//! instances and a set of hot keys, over several freshness windows; what it costs
//! Redis, per second of the measured run:
//!
//! - commands, by command (`INFO commandstats`: the commands a script runs are counted
//!   under their own names too);
//! - bytes in and out (`INFO stats`, `total_net_input_bytes` / `total_net_output_bytes`);
//! - pub/sub deliveries: the notices the fleet heard (`notices_heard_total`, summed over
//!   instances; with a version that does not count them, `PUBLISH` calls times the
//!   broadcast channel's subscribers, `PUBSUB NUMSUB`); on a Cluster, the publish
//!   messages on the cluster bus (`CLUSTER INFO`, `cluster_stats_messages_publish_sent`);
//! - Redis CPU (`INFO cpu`, `used_cpu_sys` + `used_cpu_user`), summed over nodes, and the
//!   busiest node's;
//! - origin calls per key per freshness window (the goal: 1.0 or less at every K).
//!
//! Then the costs per event the model in BENCHMARKS.md extrapolates from: what an idle
//! instance costs per second (the fleet up, no load), what an L2 script call costs
//! (`EVALSHA`: reads, leases and fenced writes), and what a notice costs per publish and
//! per delivery (a probe: 500 `PUBLISH`es of a notice the fleet sent, one every 4 ms,
//! with the fleet idle). What an idle instance costs is the idle fleet's cost less that
//! of the nodes alone, measured before the first fleet.
//!
//! ```text
//! cargo bench --bench fleet_scale --features sidecar
//! ```
//!
//! About 2.5 minutes; needs `redis-server` and `redis-cli` on `PATH`. 32 processes on a
//! small machine are CPU-bound: the offered load is modest (1,000 requests a second in
//! all, whatever K) so that every K serves all of it; see BENCHMARKS.md.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, HashMap};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use support::http::serve;
use support::sidecar::Sidecar;
use support::{RedisCluster, RedisServer};

const FLEETS: [usize; 4] = [1, 4, 16, 32];
const KEYS: u64 = 16;
const FRESH: Duration = Duration::from_secs(1);
/// One request every millisecond, whatever K.
const EVERY: Duration = Duration::from_millis(1);
const ORIGIN_TIME: Duration = Duration::from_millis(20);
const BODY: usize = 1024;
/// The fleet up, no load: what instances cost by being there.
const IDLE: Duration = Duration::from_secs(2);
/// Load before the measured run: the cold fill and the first refreshes.
const WARM: Duration = Duration::from_secs(2);
const RUN: Duration = Duration::from_secs(8);
const PROBES: u64 = 500;
/// Slow enough that the fleet keeps up: each probe wakes every instance.
const PROBE_EVERY: Duration = Duration::from_millis(4);

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

/// What the nodes said at one moment, summed over nodes (CPU kept per node).
#[derive(Default, Clone)]
struct Snapshot {
    commands: BTreeMap<String, u64>,
    /// Microseconds spent in each command (a script's inner commands within its own).
    usec: BTreeMap<String, u64>,
    net_in: u64,
    net_out: u64,
    cpu: Vec<f64>,
    bus_sent: u64,
    /// The bytes of the `INFO` replies this snapshot read (counted in the next one's
    /// `net_out`).
    own: u64,
}

/// The differences between two snapshots, per second of `secs`.
struct Rates {
    secs: f64,
    commands: BTreeMap<String, f64>,
    /// Microseconds in each command, per call.
    usec: BTreeMap<String, f64>,
    net_in: f64,
    net_out: f64,
    /// Seconds of CPU per second, all nodes, and the busiest node.
    cpu: f64,
    cpu_busiest: f64,
    bus_sent: f64,
}

impl Rates {
    fn new(a: &Snapshot, b: &Snapshot, secs: f64) -> Self {
        let commands = b
            .commands
            .iter()
            .map(|(name, n)| {
                let before = a.commands.get(name).copied().unwrap_or(0);
                (name.clone(), n.saturating_sub(before) as f64 / secs)
            })
            .filter(|(_, n)| *n > 0.0)
            .collect();
        let usec = b
            .usec
            .iter()
            .filter_map(|(name, us)| {
                let calls = b.commands[name].checked_sub(a.commands.get(name).copied()?)?;
                let us = us - a.usec.get(name).copied()?;
                (calls > 0).then(|| (name.clone(), us as f64 / calls as f64))
            })
            .collect();
        let per_node: Vec<f64> = a.cpu.iter().zip(&b.cpu).map(|(x, y)| y - x).collect();
        Self {
            secs,
            commands,
            usec,
            net_in: b.net_in.saturating_sub(a.net_in) as f64 / secs,
            net_out: b.net_out.saturating_sub(a.net_out + a.own) as f64 / secs,
            cpu: per_node.iter().sum::<f64>() / secs,
            cpu_busiest: per_node.iter().copied().fold(0.0, f64::max) / secs,
            bus_sent: b.bus_sent.saturating_sub(a.bus_sent) as f64 / secs,
        }
    }

    fn command(&self, name: &str) -> f64 {
        self.commands.get(name).copied().unwrap_or(0.0)
    }

    fn usec(&self, name: &str) -> f64 {
        self.usec.get(name).copied().unwrap_or(0.0)
    }

    fn total_commands(&self) -> f64 {
        self.commands.values().sum()
    }
}

/// The Redis nodes a fleet speaks to, each on a direct connection of the bench's own.
struct Nodes {
    name: &'static str,
    /// `--redis URL` or `--redis-cluster URL` for each node.
    args: Vec<String>,
    conns: Vec<redis::aio::MultiplexedConnection>,
    urls: Vec<String>,
    cluster: bool,
}

impl Nodes {
    async fn new(name: &'static str, urls: Vec<String>, cluster: bool) -> Self {
        let flag = if cluster {
            "--redis-cluster"
        } else {
            "--redis"
        };
        let mut conns = Vec::new();
        for url in &urls {
            conns.push(
                redis::Client::open(url.as_str())
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap(),
            );
        }
        Self {
            name,
            args: urls
                .iter()
                .flat_map(|u| [flag.to_owned(), u.clone()])
                .collect(),
            conns,
            urls,
            cluster,
        }
    }

    async fn snapshot(&self) -> Snapshot {
        let mut s = Snapshot::default();
        for conn in &self.conns {
            let mut conn = conn.clone();
            // `stats` first: what the other replies weigh is counted in the next
            // snapshot's bytes out, and taken off there.
            let stats: String = info(&mut conn, &["INFO", "stats"]).await;
            let commands: String = info(&mut conn, &["INFO", "commandstats"]).await;
            let cpu: String = info(&mut conn, &["INFO", "cpu"]).await;
            s.own += (stats.len() + commands.len() + cpu.len()) as u64;
            s.net_in += field(&stats, "total_net_input_bytes") as u64;
            s.net_out += field(&stats, "total_net_output_bytes") as u64;
            s.cpu
                .push(field(&cpu, "used_cpu_sys") + field(&cpu, "used_cpu_user"));
            for line in commands.lines() {
                let Some((name, rest)) = line
                    .strip_prefix("cmdstat_")
                    .and_then(|l| l.split_once(':'))
                else {
                    continue;
                };
                let of = |key: &str| {
                    rest.split(',')
                        .find_map(|kv| kv.strip_prefix(key))
                        .and_then(|n| n.parse::<u64>().ok())
                        .unwrap_or(0)
                };
                *s.commands.entry(name.to_owned()).or_default() += of("calls=");
                *s.usec.entry(name.to_owned()).or_default() += of("usec=");
            }
            if self.cluster {
                let bus: String = info(&mut conn, &["CLUSTER", "INFO"]).await;
                s.own += bus.len() as u64;
                s.bus_sent += field(&bus, "cluster_stats_messages_publish_sent") as u64;
            }
        }
        s
    }

    /// The broadcast channel (the shortest: the interest channels are named after it)
    /// and the subscribers of every channel, summed over nodes (each counts its own).
    async fn subscribers(&self) -> (Option<String>, u64) {
        let (mut channel, mut total) = (None, 0);
        for conn in &self.conns {
            let mut conn = conn.clone();
            let channels: Vec<String> = redis::cmd("PUBSUB")
                .arg("CHANNELS")
                .query_async(&mut conn)
                .await
                .unwrap();
            for name in channels {
                let counts: Vec<(String, u64)> = redis::cmd("PUBSUB")
                    .arg("NUMSUB")
                    .arg(&name)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                total += counts.iter().map(|(_, n)| n).sum::<u64>();
                if channel
                    .as_ref()
                    .is_none_or(|c: &String| name.len() < c.len())
                {
                    channel = Some(name);
                }
            }
        }
        (channel, total)
    }
}

async fn info(conn: &mut redis::aio::MultiplexedConnection, args: &[&str]) -> String {
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd.query_async(conn).await.unwrap()
}

/// A numeric `name:value` field of an `INFO` reply (0 if absent).
fn field(info: &str, name: &str) -> f64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The origin: counts its calls per path, answers `BODY` bytes after `ORIGIN_TIME`.
#[derive(Clone, Default)]
struct Origin {
    calls: Arc<Mutex<HashMap<String, u64>>>,
}

impl Origin {
    async fn start(&self) -> SocketAddr {
        let calls = self.calls.clone();
        let app = Router::new().fallback(move |uri: http::Uri| {
            let calls = calls.clone();
            async move {
                *calls
                    .lock()
                    .unwrap()
                    .entry(uri.path().to_owned())
                    .or_default() += 1;
                tokio::time::sleep(ORIGIN_TIME).await;
                "x".repeat(BODY)
            }
        });
        serve(app).await
    }

    fn calls(&self) -> HashMap<String, u64> {
        self.calls.lock().unwrap().clone()
    }
}

/// How requests were answered (`x-cache`), counted as they end.
#[derive(Default)]
struct Tally {
    hit: AtomicU64,
    stale: AtomicU64,
    other: AtomicU64,
    errors: AtomicU64,
}

impl Tally {
    fn read(&self) -> [u64; 4] {
        [&self.hit, &self.stale, &self.other, &self.errors].map(|n| n.load(Ordering::Relaxed))
    }
}

/// K sidecars, started side by side; killed when dropped.
fn start_fleet(k: usize, origin: SocketAddr, nodes: &Nodes) -> (Vec<Sidecar>, Vec<SocketAddr>) {
    // Ports for `--metrics` (which prints the address it was given, not the one bound),
    // below the ephemeral range (where the sidecars' own `--listen 127.0.0.1:0` ports
    // are taken from), held until every one is picked so that no two are the same.
    let mut held: Vec<TcpListener> = Vec::new();
    while held.len() < k {
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", fastrand::u16(20_000..32_000))) {
            held.push(listener);
        }
    }
    let metrics: Vec<SocketAddr> = held.iter().map(|l| l.local_addr().unwrap()).collect();
    drop(held);
    let upstream = format!("http://{origin}");
    // Four at a time: 32 processes connecting at once on a small machine time out
    // their first commands, and start local-only.
    let mut fleet = Vec::new();
    for batch in metrics.chunks(4) {
        std::thread::scope(|scope| {
            let started: Vec<_> = batch
                .iter()
                .map(|metrics| {
                    let mut args: Vec<String> = [
                        "--upstream",
                        &upstream,
                        "--follow-origin",
                        "false",
                        "--fresh",
                        "1s",
                        "--grace",
                        "30s",
                        "--lease",
                        "5s",
                        "--metrics",
                        &metrics.to_string(),
                    ]
                    .iter()
                    .map(|a| (*a).to_owned())
                    .collect();
                    args.extend(nodes.args.iter().cloned());
                    scope.spawn(move || {
                        let args: Vec<&str> = args.iter().map(String::as_str).collect();
                        Sidecar::start(&args)
                    })
                })
                .collect();
            fleet.extend(started.into_iter().map(|s| s.join().unwrap()));
        });
    }
    (fleet, metrics)
}

/// The fleet's own counters, summed over instances: `name` or `name{result|outcome}`.
async fn scrape(client: &HttpClient, metrics: &[SocketAddr]) -> BTreeMap<String, f64> {
    let mut sums = BTreeMap::new();
    for addr in metrics {
        let got = client
            .get(format!("http://{addr}/metrics").parse().unwrap())
            .await
            .unwrap();
        let text = got.into_body().collect().await.unwrap().to_bytes();
        for line in String::from_utf8_lossy(&text).lines() {
            if line.starts_with('#') {
                continue;
            }
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let kind = labels
                .split(',')
                .find_map(|l| {
                    l.strip_prefix("result=\"")
                        .or_else(|| l.strip_prefix("outcome=\""))
                        .or_else(|| l.strip_prefix("notice=\""))
                })
                .map(|v| v.trim_end_matches(['"', '}']));
            let key = match kind {
                Some(kind) => format!("{name}{{{kind}}}"),
                None => name.to_owned(),
            };
            *sums.entry(key).or_insert(0.0) += value;
        }
    }
    sums
}

fn delta(a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>, key: &str) -> f64 {
    b.get(key).copied().unwrap_or(0.0) - a.get(key).copied().unwrap_or(0.0)
}

/// One measured fleet: the figures of the table, and the costs per event.
struct Measured {
    backend: &'static str,
    k: usize,
    requests: f64,
    stale_share: f64,
    errors: u64,
    per_key_window: f64,
    per_key_window_max: f64,
    load: Rates,
    idle: Rates,
    subscribers: u64,
    deliveries: f64,
    /// The fleet's own counters that moved, per second.
    counters: BTreeMap<String, f64>,
    /// Bytes of one delivery of a notice (RESP2 `message` frame).
    frame: usize,
    /// What one idle instance costs per second: commands, bytes out, seconds of CPU (the
    /// idle fleet's cost less the nodes' own).
    per_instance: [f64; 3],
    /// Seconds of Redis CPU per probe publish (idle CPU taken off), and bus messages.
    probe_cpu: f64,
    probe_bus: f64,
}

async fn measure(
    nodes: &Nodes,
    k: usize,
    round: usize,
    origin: &Origin,
    origin_addr: SocketAddr,
    client: &HttpClient,
    base: &Rates,
) -> Measured {
    let (fleet, metrics) = tokio::task::block_in_place(|| start_fleet(k, origin_addr, nodes));
    let listens: Vec<SocketAddr> = fleet.iter().map(|s| s.listen).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    while nodes.subscribers().await.1 < k as u64 {
        assert!(
            Instant::now() < deadline,
            "the fleet did not subscribe: {} of {k}",
            nodes.subscribers().await.1
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Idle: the fleet up, nothing asked.
    let (a, started) = (nodes.snapshot().await, Instant::now());
    tokio::time::sleep(IDLE).await;
    let idle = Rates::new(&a, &nodes.snapshot().await, started.elapsed().as_secs_f64());

    // Load, from a cold start; keys of their own per round.
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let driver = tokio::spawn({
        let (stop, tally, client) = (stop.clone(), tally.clone(), client.clone());
        async move {
            let mut tick = tokio::time::interval(EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                // Any instance, any key: a sweep instead would ask every instance for
                // one key within a few milliseconds, all of them during its refresh.
                let addr = listens[fastrand::usize(..k)];
                let key = fastrand::u64(..KEYS);
                let uri = format!("http://{addr}/r{round}/items/{key}")
                    .parse()
                    .unwrap();
                let (client, tally) = (client.clone(), tally.clone());
                tokio::spawn(async move {
                    let counter = match client.get(uri).await {
                        Ok(got) if got.status().is_success() => {
                            let x_cache = got.headers().get("x-cache").cloned();
                            let _ = got.into_body().collect().await;
                            match x_cache.as_ref().and_then(|v| v.to_str().ok()) {
                                Some("hit") => &tally.hit,
                                Some("stale") => &tally.stale,
                                _ => &tally.other,
                            }
                        }
                        _ => &tally.errors,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                });
            }
        }
    });
    // A notice of this fleet's, for the probe (on any of its channels: fill notices go
    // on interest channels); the probe sends it on the broadcast channel, to every
    // instance.
    let channel = nodes.subscribers().await.0.expect("the notice channel");
    let notice = {
        let client = redis::Client::open(nodes.urls[0].as_str()).unwrap();
        let mut pubsub = client.get_async_pubsub().await.unwrap();
        pubsub.psubscribe(format!("{channel}*")).await.unwrap();
        let message = tokio::time::timeout(WARM * 2, pubsub.on_message().next())
            .await
            .expect("a notice during the warm-up")
            .unwrap();
        message.get_payload_bytes().to_vec()
    };
    tokio::time::sleep(WARM).await;

    let (calls_a, tally_a, fleet_a) =
        (origin.calls(), tally.read(), scrape(client, &metrics).await);
    let (a, started) = (nodes.snapshot().await, Instant::now());
    tokio::time::sleep(RUN).await;
    let b = nodes.snapshot().await;
    let secs = started.elapsed().as_secs_f64();
    let (calls_b, tally_b, fleet_b) =
        (origin.calls(), tally.read(), scrape(client, &metrics).await);
    let load = Rates::new(&a, &b, secs);
    stop.store(true, Ordering::Relaxed);
    driver.await.unwrap();
    let subscribers = nodes.subscribers().await.1;

    let [hit, stale, other, errors] = [0, 1, 2, 3].map(|i| tally_b[i] - tally_a[i]);
    let windows = secs / FRESH.as_secs_f64();
    let per_key: Vec<f64> = (0..KEYS)
        .map(|key| {
            let path = format!("/r{round}/items/{key}");
            let n =
                calls_b.get(&path).copied().unwrap_or(0) - calls_a.get(&path).copied().unwrap_or(0);
            n as f64 / windows
        })
        .collect();
    let counters: BTreeMap<String, f64> = fleet_b
        .keys()
        .filter(|key| key.ends_with("_total") || key.ends_with('}'))
        .map(|key| (key.clone(), delta(&fleet_a, &fleet_b, key) / secs))
        .filter(|(_, n)| *n > 0.0)
        .collect();
    // Deliveries as the fleet counted them, if it does.
    let heard = fleet_b
        .keys()
        .any(|key| key.starts_with("stampede_guard_notices_heard_total"))
        .then(|| {
            counters
                .iter()
                .filter(|(key, _)| key.starts_with("stampede_guard_notices_heard_total"))
                .map(|(_, n)| n)
                .sum::<f64>()
        });

    // The probe: the notice again, once a millisecond, with the fleet idle.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut conn = nodes.conns[0].clone();
    let (a, started) = (nodes.snapshot().await, Instant::now());
    let mut tick = tokio::time::interval(PROBE_EVERY);
    for _ in 0..PROBES {
        tick.tick().await;
        let _: u64 = redis::cmd("PUBLISH")
            .arg(&channel)
            .arg(&notice)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let probe = Rates::new(&a, &nodes.snapshot().await, started.elapsed().as_secs_f64());
    let probe_cpu = (probe.cpu - idle.cpu) * probe.secs / PROBES as f64;
    let probe_bus = probe.bus_sent * probe.secs / PROBES as f64;
    drop(fleet);

    let requests = (hit + stale + other + errors) as f64;
    let (m_idle_commands, m_idle_out, m_idle_cpu) = (idle.total_commands(), idle.net_out, idle.cpu);
    Measured {
        backend: nodes.name,
        k,
        requests: requests / secs,
        stale_share: stale as f64 / requests.max(1.0),
        errors,
        per_key_window: per_key.iter().sum::<f64>() / KEYS as f64,
        per_key_window_max: per_key.iter().copied().fold(0.0, f64::max),
        deliveries: match heard {
            Some(heard) => heard,
            None => load.command("publish") * subscribers as f64,
        },
        load,
        idle,
        subscribers,
        counters,
        per_instance: [
            (m_idle_commands - base.total_commands()) / k as f64,
            (m_idle_out - base.net_out) / k as f64,
            (m_idle_cpu - base.cpu) / k as f64,
        ],
        frame: frame(&channel, notice.len()),
        probe_cpu,
        probe_bus,
    }
}

/// The bytes of a RESP2 `message` push: `*3 $7 message $n channel $m payload`.
fn frame(channel: &str, payload: usize) -> usize {
    let bulk = |n: usize| 1 + n.to_string().len() + 2 + n + 2;
    4 + bulk(7) + bulk(channel.len()) + bulk(payload)
}

/// What the nodes cost with no fleet.
async fn alone(nodes: &Nodes) -> Rates {
    let (a, started) = (nodes.snapshot().await, Instant::now());
    tokio::time::sleep(IDLE).await;
    Rates::new(&a, &nodes.snapshot().await, started.elapsed().as_secs_f64())
}

/// `EVALSHA` calls per instance, per hot key, per freshness window.
fn scripts_per_instance_key_window(m: &Measured) -> f64 {
    m.load.command("evalsha") * FRESH.as_secs_f64() / (m.k as f64 * KEYS as f64)
}

fn print_run(m: &Measured) {
    let l = &m.load;
    let list = |map: &BTreeMap<String, f64>, skip: &[&str]| -> String {
        map.iter()
            .filter(|(name, _)| !skip.contains(&name.as_str()))
            .map(|(name, n)| format!("{} {n:.1}", name.trim_start_matches("stampede_guard_")))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "{} K={}: {:.0} requests/s ({:.1} % stale, {} errors), origin calls/key/window {:.2} \
         (max {:.2})\n  Redis per s: {:.0} commands ({}), in {:.0} B, out {:.0} B, {:.0} \
         deliveries to {} subscribers, {:.0} bus publish messages, CPU {:.1} % (busiest node \
         {:.1} %); in-command µs per call: evalsha {:.1}, publish {:.1}; {:.2} EVALSHA per \
         instance per key per window\n  fleet per s: {}\n  idle fleet per s: {:.0} commands \
         ({}), out {:.0} B, CPU {:.2} %; probe: {:.1} µs of Redis CPU per publish, {:.1} bus \
         messages",
        m.backend,
        m.k,
        m.requests,
        100.0 * m.stale_share,
        m.errors,
        m.per_key_window,
        m.per_key_window_max,
        l.total_commands(),
        list(&l.commands, &["info"]),
        l.net_in,
        l.net_out,
        m.deliveries,
        m.subscribers,
        l.bus_sent,
        100.0 * l.cpu,
        100.0 * l.cpu_busiest,
        l.usec("evalsha"),
        l.usec("publish"),
        scripts_per_instance_key_window(m),
        list(&m.counters, &[]),
        m.idle.total_commands(),
        list(&m.idle.commands, &["info"]),
        m.idle.net_out,
        100.0 * m.idle.cpu,
        m.probe_cpu * 1e6,
        m.probe_bus,
    );
}

/// The costs per event: an idle instance per second, an `EVALSHA`, a publish.
fn costs(m: &Measured) -> [f64; 7] {
    let (l, idle) = (&m.load, &m.idle);
    let evalsha = l.command("evalsha").max(1.0);
    let publishes = l.command("publish");
    // What the load added to the idle fleet, less the notices' share.
    let out = m
        .deliveries
        .mul_add(-(m.frame as f64), l.net_out - idle.net_out);
    let cpu = publishes.mul_add(-m.probe_cpu, l.cpu - idle.cpu);
    [
        m.per_instance[0],
        m.per_instance[1],
        m.per_instance[2] * 1e6,
        (l.net_in - idle.net_in) / evalsha,
        out / evalsha,
        cpu / evalsha * 1e6,
        m.probe_cpu * 1e6,
    ]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let origin = Origin::default();
    let origin_addr = runtime.block_on(origin.start());
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    println!(
        "K instances (sidecar processes), {KEYS} hot keys, fresh {FRESH:?} (grace 30s), origin \
         {ORIGIN_TIME:?} answering {BODY} bytes; {:.0} requests/s in all whatever K, \
         spread at random over instances and keys; measured for {RUN:?} after {WARM:?} from a cold \
         start",
        1.0 / EVERY.as_secs_f64()
    );
    let mut measured = Vec::new();
    let mut round = 0;
    {
        let server = RedisServer::start();
        let nodes = runtime.block_on(Nodes::new("one Redis", vec![server.url()], false));
        let base = runtime.block_on(alone(&nodes));
        for k in FLEETS {
            round += 1;
            let m = runtime.block_on(measure(
                &nodes,
                k,
                round,
                &origin,
                origin_addr,
                &client,
                &base,
            ));
            print_run(&m);
            measured.push(m);
        }
    }
    {
        let cluster = RedisCluster::start();
        let nodes = runtime.block_on(Nodes::new("Cluster", cluster.urls(), true));
        let base = runtime.block_on(alone(&nodes));
        for k in FLEETS {
            round += 1;
            let m = runtime.block_on(measure(
                &nodes,
                k,
                round,
                &origin,
                origin_addr,
                &client,
                &base,
            ));
            print_run(&m);
            measured.push(m);
        }
    }

    println!();
    println!(
        "| Redis | K | origin calls/key/window (max) | stale answers | commands/s | EVALSHA/s \
         | EVALSHA per instance/key/window | PUBLISH/s | bytes in/s | bytes out/s | \
         deliveries/s | bus msgs/s | Redis CPU (busiest node) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for m in &measured {
        let l = &m.load;
        println!(
            "| {} | {} | {:.2} ({:.2}) | {:.1} % | {:.0} | {:.0} | {:.2} | {:.1} | {:.0} | {:.0} \
             | {:.0} | {:.0} | {:.1} % ({:.1} %) |",
            m.backend,
            m.k,
            m.per_key_window,
            m.per_key_window_max,
            100.0 * m.stale_share,
            l.total_commands(),
            l.command("evalsha"),
            scripts_per_instance_key_window(m),
            l.command("publish"),
            l.net_in,
            l.net_out,
            m.deliveries,
            l.bus_sent,
            100.0 * l.cpu,
            100.0 * l.cpu_busiest,
        );
    }
    println!();
    println!(
        "| Redis | K | idle instance: commands/s | bytes out/s | CPU µs/s | per EVALSHA: bytes in | \
         bytes out | CPU µs | per publish: CPU µs | per delivery: bytes | bus msgs per publish |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for m in &measured {
        let c = costs(m);
        println!(
            "| {} | {} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {} | {:.1} |",
            m.backend, m.k, c[0], c[1], c[2], c[3], c[4], c[5], c[6], m.frame, m.probe_bus,
        );
    }
    // The probe's CPU per publish against K: its slope is the cost of one delivery.
    for backend in ["one Redis", "Cluster"] {
        let of = |k: usize| {
            measured
                .iter()
                .find(|m| m.backend == backend && m.k == k)
                .map(|m| m.probe_cpu)
        };
        if let (Some(one), Some(most)) = (of(FLEETS[0]), of(FLEETS[FLEETS.len() - 1])) {
            let per_delivery = (most - one) / (FLEETS[FLEETS.len() - 1] - FLEETS[0]) as f64;
            println!(
                "{backend}: a publish costs {:.1} µs of Redis CPU, plus {:.2} µs per subscriber",
                (one - per_delivery) * 1e6,
                per_delivery * 1e6,
            );
        }
    }
}
