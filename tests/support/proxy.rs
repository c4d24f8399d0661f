//! A TCP proxy between the code under test and its Redis, for breaking the network on
//! purpose.
//!
//! Modes apply at once to every connection, new and open:
//! * `Pass`: bytes flow both ways;
//! * `Delay(d)`: every chunk waits `d` before it is forwarded;
//! * `Blackhole`: bytes are read and thrown away, both ways; connections stay open, so a
//!   client sees a peer that never answers (a partition, a dead host);
//! * `DropReplies`: commands reach Redis, replies are thrown away (the reply to an
//!   acquire lost after Redis ran it);
//! * `Garbage`: replies are replaced by bytes that are not RESP;
//! * `Refuse`: new connections are reset at once (open ones keep their mode's last
//!   behaviour; use `reset_all` to cut them).
//!
//! `reset_all` resets (RST) every open connection. `forget_open` makes every open
//! connection silent for good while new ones pass: what a NAT or a firewall that
//! dropped its state does to an idle flow (no reset, no reply, ever).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Pass,
    Delay(Duration),
    Blackhole,
    DropReplies,
    Garbage,
    Refuse,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Up,
    Down,
}

pub(crate) struct Proxy {
    addr: SocketAddr,
    mode: Arc<Mutex<Mode>>,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// Each open connection's mark: once set, its bytes are thrown away both ways.
    forgotten: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
    accepted: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Proxy {
    pub(crate) async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mode = Arc::new(Mutex::new(Mode::Pass));
        let tasks: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let forgotten: Arc<Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
        let accepted = Arc::new(AtomicU64::new(0));
        let accept = tokio::spawn({
            let (mode, tasks, accepted) = (mode.clone(), tasks.clone(), accepted.clone());
            let forgotten = forgotten.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::Relaxed);
                    // Every close is a reset: what a crashed peer or a middlebox does.
                    let _ = client.set_zero_linger();
                    if *mode.lock().unwrap() == Mode::Refuse {
                        continue; // dropped: reset
                    }
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        continue;
                    };
                    let _ = server.set_zero_linger();
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    let forgot = Arc::new(AtomicBool::new(false));
                    forgotten.lock().unwrap().push(forgot.clone());
                    let up = tokio::spawn(pump(
                        client_read,
                        server_write,
                        (mode.clone(), forgot.clone()),
                        Direction::Up,
                    ));
                    let down = tokio::spawn(pump(
                        server_read,
                        client_write,
                        (mode.clone(), forgot),
                        Direction::Down,
                    ));
                    tasks.lock().unwrap().extend([up, down]);
                }
            }
        });
        Self {
            addr,
            mode,
            tasks,
            forgotten,
            accepted,
            accept,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    /// Where it listens, for a proxied service that is not Redis.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    /// How many connections the proxy has accepted.
    pub(crate) fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Every connection open now goes silent for good; those made after it pass.
    pub(crate) fn forget_open(&self) {
        for forgot in self.forgotten.lock().unwrap().drain(..) {
            forgot.store(true, Ordering::Relaxed);
        }
    }

    pub(crate) fn reset_all(&self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset_all();
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    (mode, forgot): (Arc<Mutex<Mode>>, Arc<AtomicBool>),
    direction: Direction,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if forgot.load(Ordering::Relaxed) {
            continue;
        }
        let current = *mode.lock().unwrap();
        let bytes: &[u8] = match (current, direction) {
            (Mode::Pass | Mode::Refuse, _) => &buf[..n],
            (Mode::Delay(d), _) => {
                tokio::time::sleep(d).await;
                &buf[..n]
            }
            (Mode::Blackhole, _) | (Mode::DropReplies, Direction::Down) => continue,
            (Mode::DropReplies, Direction::Up) => &buf[..n],
            (Mode::Garbage, Direction::Up) => &buf[..n],
            (Mode::Garbage, Direction::Down) => b"\x00\xffnot resp at all\r\n",
        };
        if to.write_all(bytes).await.is_err() {
            return;
        }
    }
}

/// Has every connection open through `proxies` forgotten (see [`Proxy::forget_open`]),
/// then pings `store` until it answers, within `within`: returns how many pings failed
/// first (at least the one sent on a forgotten connection), or `None` if it never
/// answered again. A failed ping is followed by 50 ms of rest, so that an open breaker
/// is given its probes.
pub(crate) async fn forgotten_then_answering(
    store: &stampede_guard::RedisStore,
    proxies: &[&Proxy],
    within: Duration,
) -> Option<usize> {
    for proxy in proxies {
        proxy.forget_open();
    }
    let deadline = tokio::time::Instant::now() + within;
    let mut failed = 0;
    while tokio::time::Instant::now() < deadline {
        let ping = tokio::time::timeout(Duration::from_secs(5), store.ping()).await;
        match ping {
            Ok(Ok(())) => return Some(failed),
            Ok(Err(_)) | Err(_) => failed += 1,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}
