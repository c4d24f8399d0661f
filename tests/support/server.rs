//! A real `redis-server` per test.
//!
//! Each server runs on a free loopback port, in a temporary directory, with persistence
//! off and a log file that is printed when the test fails. It is killed when the handle
//! is dropped, and (through `setpriv --pdeathsig`, where available) when the thread that
//! started it dies, so a test that panics or is killed leaves no server behind. A
//! server counts as started (or restarted) only once the process answering on its port
//! is the one it started (`process_id` in `INFO server`), never another test's server
//! that took the port first.
//!
//! Start servers from the test's own thread (the body of a `#[tokio::test]`), not from a
//! `spawn_blocking` thread: the parent-death signal follows the starting thread.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

const READY_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) struct RedisServer {
    dir: TempDir,
    port: u16,
    args: Vec<String>,
    /// For a sentinel: its configuration file's first contents (it rewrites the file).
    sentinel: Option<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// A server with the default settings.
    pub(crate) fn start() -> Self {
        Self::start_with(&[])
    }

    /// A server with extra `redis-server` arguments, such as
    /// `["--enable-debug-command", "local"]`.
    pub(crate) fn start_with(args: &[&str]) -> Self {
        Self::start_as(args, None)
    }

    /// A Redis Sentinel (`redis-server <config> --sentinel`) whose configuration starts
    /// as `config` (`sentinel monitor ...` lines).
    pub(crate) fn start_sentinel(config: &str) -> Self {
        Self::start_as(&[], Some(config.to_owned()))
    }

    fn start_as(args: &[&str], sentinel: Option<String>) -> Self {
        let binary = redis_server_binary();
        let dir = tempfile::Builder::new()
            .prefix("stampede-guard-redis-")
            .tempdir()
            .expect("temporary directory for redis-server");
        let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
        let mut server = Self {
            dir,
            port: free_port(),
            args,
            sentinel,
            child: None,
        };
        // A port picked from the OS can be taken by someone else before redis binds it:
        // try a few.
        for _ in 0..5 {
            match server.spawn(&binary) {
                Ok(()) => return server,
                Err(log) if log.contains("Address already in use") => server.port = free_port(),
                Err(log) => panic!("redis-server did not start:\n{log}"),
            }
        }
        panic!("redis-server found no free port in 5 tries");
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn pid(&self) -> u32 {
        self.child
            .as_ref()
            .expect("redis-server is not running")
            .id()
    }

    /// Kills the server (SIGKILL). Its data is gone: persistence is off.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server if it runs and starts a new, empty one on the same port.
    pub(crate) fn restart(&mut self) {
        self.kill();
        let binary = redis_server_binary();
        // The old socket may linger for a moment; redis sets SO_REUSEADDR, so a short
        // retry is enough.
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            match self.spawn(&binary) {
                Ok(()) => return,
                Err(log) if Instant::now() < deadline && log.contains("Address already in use") => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(log) => panic!("redis-server did not restart:\n{log}"),
            }
        }
    }

    /// Stops the process (SIGSTOP): connections stay open, nothing is answered.
    pub(crate) fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    /// Lets a paused process go on (SIGCONT).
    pub(crate) fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    /// A server on which `DEBUG SLEEP` works.
    pub(crate) fn start_debuggable() -> Self {
        Self::start_with(&["--enable-debug-command", "local"])
    }

    /// Keeps the server busy for `busy` (`DEBUG SLEEP`, on a server from
    /// [`start_debuggable`](Self::start_debuggable)): it answers nobody meanwhile.
    /// Returns when it answers again.
    pub(crate) async fn sleep_for(&self, busy: Duration) {
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
        let mut conn = redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .expect("direct connection to the test's redis-server");
        let () = redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(busy.as_secs_f64())
            .query_async(&mut conn)
            .await
            .expect("DEBUG SLEEP");
    }

    /// Runs a command on a direct connection and returns its reply.
    pub(crate) async fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut cmd = redis::cmd(args[0]);
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query_async(&mut self.conn().await)
            .await
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// Turns the server into a replica of nothing: writes answer `READONLY`.
    pub(crate) async fn make_readonly(&self) {
        let _: () = self.cmd(&["REPLICAOF", "127.0.0.1", "1"]).await;
    }

    /// Undoes [`make_readonly`](Self::make_readonly).
    pub(crate) async fn make_primary(&self) {
        let _: () = self.cmd(&["REPLICAOF", "NO", "ONE"]).await;
    }

    /// Writes answer `OOM`.
    pub(crate) async fn fill_memory(&self) {
        let _: () = self
            .cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
            .await;
        let _: () = self.cmd(&["CONFIG", "SET", "maxmemory", "1"]).await;
    }

    /// Undoes [`fill_memory`](Self::fill_memory).
    pub(crate) async fn free_memory(&self) {
        let _: () = self.cmd(&["CONFIG", "SET", "maxmemory", "0"]).await;
    }

    /// A user that may do everything but run scripts: its URL.
    pub(crate) async fn user_without_scripts(&self) -> String {
        let _: () = self
            .cmd(&[
                "ACL",
                "SETUSER",
                "noscripts",
                "on",
                ">pw",
                "~*",
                "&*",
                "+@all",
                "-@scripting",
            ])
            .await;
        format!("redis://noscripts:pw@127.0.0.1:{}", self.addr().port())
    }

    /// Every new connection must authenticate: unauthenticated commands answer `NOAUTH`.
    pub(crate) async fn require_password(&self) {
        let _: () = self
            .cmd(&["CONFIG", "SET", "requirepass", "secret-pw"])
            .await;
    }

    /// Runs a script that never ends, on a connection of its own, so that every other
    /// command answers `BUSY` (after the server's busy threshold, set to 50 ms). Ended
    /// by [`end_busy_script`](Self::end_busy_script).
    pub(crate) async fn start_busy_script(&self) {
        let _: () = self
            .cmd(&["CONFIG", "SET", "busy-reply-threshold", "50"])
            .await;
        // Connected before the script runs: a handshake then could meet `BUSY` itself.
        let probe = self.conn().await;
        let url = self.url();
        tokio::spawn(async move {
            let mut conn = redis::Client::open(url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            conn.set_response_timeout(Duration::from_secs(60));
            let _: Result<(), _> = redis::cmd("EVAL")
                .arg("while true do end")
                .arg(0)
                .query_async(&mut conn)
                .await;
        });
        // Running once another connection is answered `BUSY`.
        let busy = super::eventually(READY_TIMEOUT, || {
            let mut probe = probe.clone();
            async move {
                let reply: redis::RedisResult<()> =
                    redis::cmd("PING").query_async(&mut probe).await;
                reply.is_err_and(|e| e.code() == Some("BUSY"))
            }
        });
        assert!(busy.await, "the busy script did not start");
    }

    pub(crate) async fn end_busy_script(&self) {
        let _: () = self.cmd(&["SCRIPT", "KILL"]).await;
    }

    /// The keys matching `pattern`, by `SCAN` (never `KEYS`).
    pub(crate) async fn scan(&self, pattern: &str) -> Vec<String> {
        let mut conn = self.conn().await;
        let mut keys = Vec::new();
        let mut iter: redis::AsyncIter<'_, String> =
            redis::AsyncCommands::scan_match(&mut conn, pattern)
                .await
                .unwrap();
        while let Some(key) = iter.next_item().await {
            keys.push(key.unwrap());
        }
        keys
    }

    /// A direct connection, for looking at what the code under test left in Redis.
    pub(crate) async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("direct connection to the test's redis-server")
    }

    /// The server's log so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    /// Starts the process and waits until it answers; on failure, returns the log.
    fn spawn(&mut self, binary: &Path) -> Result<(), String> {
        let mut command = match setpriv() {
            Some(setpriv) => {
                let mut c = Command::new(setpriv);
                c.args(["--pdeathsig", "KILL", "--"]).arg(binary);
                c
            }
            None => Command::new(binary),
        };
        if let Some(config) = &self.sentinel {
            let path = self.dir.path().join("sentinel.conf");
            if !path.exists() {
                std::fs::write(&path, config).expect("the sentinel's configuration");
            }
            command.arg(path).arg("--sentinel");
        }
        command
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.log_path())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let _ = std::fs::remove_file(self.log_path());
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("could not run {}: {e}", binary.display()));
        self.child = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return Err(format!("exited with {status}\n{}", self.log()));
            }
            if answers_as(self.addr(), self.pid()) {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.kill();
                return Err(format!(
                    "no answer from this server (its process id in `INFO server`) in \
                     {READY_TIMEOUT:?}\n{}",
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_log_tail("redis-server", self.port, &self.log());
        }
        self.kill();
    }
}

/// Whether the server answering on `addr` is the process `pid`: up, and ours. A port
/// picked as free can be taken by another test's server before ours binds it (ours then
/// exits with "Address already in use"); that server answers too, and must not be
/// adopted. `INFO server` names the process that answers (setpriv execs redis-server,
/// so the child's pid is the server's).
fn answers_as(addr: SocketAddr, pid: u32) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"INFO server\r\n").is_err() {
        return false;
    }
    // A bulk string: `$<length>\r\n<text>\r\n`. Anything else (`-LOADING`, or `-NOAUTH`
    // from a server that is not ours) means not ready, or not ours.
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(n) if n > 0 => reply.extend_from_slice(&buf[..n]),
            _ => return false,
        }
        if reply[0] != b'$' {
            return false;
        }
        let Some(end) = reply.windows(2).position(|w| w == b"\r\n") else {
            continue;
        };
        let Some(length) = std::str::from_utf8(&reply[1..end])
            .ok()
            .and_then(|l| l.parse::<usize>().ok())
        else {
            return false;
        };
        if reply.len() >= end + 2 + length {
            break;
        }
    }
    let text = String::from_utf8_lossy(&reply);
    text.lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .is_some_and(|found| found.trim() == pid.to_string())
}

/// Prints the last lines of a server's log, for a test that failed.
pub(crate) fn print_log_tail(server: &str, port: u16, log: &str) {
    let tail: Vec<&str> = log.lines().rev().take(40).collect();
    eprintln!("--- {server} on port {port} (last lines of its log) ---");
    for line in tail.iter().rev() {
        eprintln!("{line}");
    }
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("kill(1)");
    assert!(status.success(), "kill -{name} {pid} failed");
}

pub(crate) fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
}

fn redis_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("REDIS_SERVER_BIN") {
        return PathBuf::from(path);
    }
    find_on_path("redis-server").unwrap_or_else(|| {
        panic!(
            "redis-server is not on PATH. The tests start real Redis servers of their own.\n\
             Install it: `apt-get install -y redis-server` (Debian, Ubuntu), \
             `brew install redis` (macOS), or set REDIS_SERVER_BIN to its path."
        )
    })
}

pub(crate) fn setpriv() -> Option<PathBuf> {
    find_on_path("setpriv")
}
