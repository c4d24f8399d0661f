//! A throwaway `redis-server` for an example's run, when none answers at `REDIS_URL`.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stampede_guard::RedisStore;

/// A `redis-server` of the example's own, on a free port, for one run: no persistence;
/// killed when dropped (at the end, on an error or a panic) and on Ctrl-C.
pub(crate) struct ThrowawayRedis {
    child: Child,
    /// Its URL.
    pub(crate) url: String,
}

impl ThrowawayRedis {
    /// `None` when there is no `redis-server` on `PATH`.
    pub(crate) async fn start() -> Option<Result<Self, String>> {
        let port = match std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()) {
            Ok(addr) => addr.port(),
            Err(e) => return Some(Err(format!("no free port: {e}"))),
        };
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => return Some(Err(format!("redis-server did not start: {e}"))),
        };
        let redis = Self {
            child,
            url: format!("redis://127.0.0.1:{port}"),
        };
        // Ctrl-C ends the process without unwinding: stop the server first.
        let pid = redis.child.id().to_string();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                let _ = Command::new("kill").arg(&pid).status();
                eprintln!("\ninterrupted");
                #[allow(clippy::exit)] // nothing left to unwind: the server is stopped
                std::process::exit(130);
            }
        });
        let store = RedisStore::builder(redis.url.as_str())
            .build()
            .expect("a valid URL");
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.ping().await.is_err() {
            if Instant::now() > deadline {
                return Some(Err("redis-server did not answer within 10 s".to_owned()));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Some(Ok(redis))
    }
}

impl Drop for ThrowawayRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
