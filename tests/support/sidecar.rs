//! The `stampede-sidecar` binary, run as users run it: to its end (`--check`, `--help`, a
//! refused setting), or started and read until it listens, killed when dropped.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::Uri;

use super::HANG;

/// The binary cargo built for the tests.
pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_stampede-sidecar");

/// The key secret the tests give it (`STAMPEDE_GUARD_SECRET`).
pub(crate) const SECRET: &str = "a sidecar test secret of more than sixteen bytes";

/// Runs the binary to its end with `args` (for the ones that exit at once).
pub(crate) fn run(args: &[&str]) -> Output {
    let child = Command::new(BIN)
        .args(args)
        .env_clear()
        .env("STAMPEDE_GUARD_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the sidecar starts");
    wait_output(child)
}

/// Waits for `child` to exit, at most [`HANG`], and returns what it printed.
pub(crate) fn wait_output(child: Child) -> Output {
    let (done, out) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    out.recv_timeout(HANG)
        .expect("the sidecar exited within HANG")
        .expect("its output")
}

/// Bytes a process printed, as text.
pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A running sidecar, killed when dropped. What it prints is kept, and shown when a test
/// fails.
pub(crate) struct Sidecar {
    pub(crate) child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    pub(crate) listen: SocketAddr,
    pub(crate) admin: Option<SocketAddr>,
    /// Where it serves `/metrics`, given `--metrics`.
    pub(crate) metrics: Option<SocketAddr>,
}

/// What a line the sidecar prints when it starts announces: `("admin", addr)`,
/// `("metrics", addr)` or `("listen", addr)`; `None` for any other line.
pub(crate) fn announced(line: &str) -> Option<(&'static str, SocketAddr)> {
    let addr = |line: &str| -> SocketAddr {
        let url = line
            .split_whitespace()
            .find(|w| w.starts_with("http://") || w.starts_with("https://"))
            .unwrap();
        url.parse::<Uri>()
            .unwrap()
            .authority()
            .unwrap()
            .as_str()
            .parse()
            .unwrap()
    };
    if line.starts_with("admin on ") {
        Some(("admin", addr(line)))
    } else if line.starts_with("metrics on ") {
        Some(("metrics", addr(line)))
    } else if line.starts_with("caching ") {
        Some(("listen", addr(line.split(" on ").nth(1)?)))
    } else {
        None
    }
}

impl Sidecar {
    /// Starts the binary on free ports (`127.0.0.1:0`: the addresses it binds are read
    /// from what it prints once it listens), with the tests' secret.
    pub(crate) fn start(args: &[&str]) -> Self {
        let mut command = Command::new(BIN);
        command
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env_clear()
            .env("STAMPEDE_GUARD_SECRET", SECRET);
        Self::spawn(command)
    }

    /// Starts `command` (the sidecar, or what execs it) and waits until it listens. Give
    /// it `--listen` and `--admin` on port 0: the addresses it binds are read from what it
    /// prints.
    pub(crate) fn spawn(mut command: Command) -> Self {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the sidecar starts");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (seen, listening) = std::sync::mpsc::channel::<String>();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let (lines, seen) = (lines.clone(), seen.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = seen.send(line.clone());
                    lines.lock().unwrap().push(line);
                }
            });
        }
        let (mut listen, mut admin, mut metrics) = (None, None, None);
        let deadline = Instant::now() + HANG;
        while listen.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = listening.recv_timeout(left) else {
                panic!(
                    "the sidecar did not start listening:\n{}",
                    lines.lock().unwrap().join("\n")
                );
            };
            match announced(&line) {
                Some(("admin", addr)) => admin = Some(addr),
                Some(("metrics", addr)) => metrics = Some(addr),
                Some((_, addr)) => listen = Some(addr),
                None => {}
            }
        }
        Self {
            child,
            lines,
            listen: listen.unwrap(),
            admin,
            metrics,
        }
    }

    pub(crate) fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// Sends signal `name` (`TERM`, `INT`) to the process.
    pub(crate) fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.pid()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{name} failed");
    }

    /// What it printed so far, both streams.
    pub(crate) fn log(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// Waits for the process to exit (at most `within`) and returns its exit code.
    pub(crate) async fn exited(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(
                Instant::now() < deadline,
                "the sidecar did not exit within {within:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- the sidecar said:\n{}", self.log());
        }
    }
}

/// Writes `text` as `sidecar.toml` in `dir`; returns its path, for `--config`.
pub(crate) fn write_config(dir: &Path, text: &str) -> String {
    let path = dir.join("sidecar.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}
