//! A TCP proxy between the code under test and its Redis, for breaking the network on
//! purpose.
//!
//! Modes apply at once to every connection, new and open:
//! * `Pass`: bytes flow both ways;
//! * `Blackhole`: bytes are read and thrown away, both ways; connections stay open, so a
//!   client sees a peer that never answers (like a partition, or a dead host);
//! * `Delay(d)`: every chunk waits `d` before it is forwarded.
//!
//! `reset_all` closes every open connection.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Pass,
    Blackhole,
    Delay(Duration),
}

pub(crate) struct Proxy {
    addr: SocketAddr,
    mode: Arc<Mutex<Mode>>,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    pub(crate) async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mode = Arc::new(Mutex::new(Mode::Pass));
        let tasks: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = tokio::spawn({
            let mode = mode.clone();
            let tasks = tasks.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        continue; // dropping `client` closes it
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    let up = tokio::spawn(pump(client_read, server_write, mode.clone()));
                    let down = tokio::spawn(pump(server_read, client_write, mode.clone()));
                    tasks.lock().unwrap().extend([up, down]);
                }
            }
        });
        Self {
            addr,
            mode,
            tasks,
            accept,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    pub(crate) fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
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
    mode: Arc<Mutex<Mode>>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let current = *mode.lock().unwrap();
        match current {
            Mode::Pass => {}
            Mode::Blackhole => continue,
            Mode::Delay(d) => tokio::time::sleep(d).await,
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
