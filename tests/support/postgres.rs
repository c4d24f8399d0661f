//! A real PostgreSQL per test: `initdb` in a temporary directory, `postgres` on a free
//! loopback port, killed when the handle is dropped (and, through `setpriv
//! --pdeathsig`, when the thread that started it dies). Never the machine's own server.
//!
//! PostgreSQL refuses to run as root: when the tests run as root, the server runs as
//! the `postgres` user (which the distribution's package creates), its directory handed
//! to that user. The binaries are found on `PATH`, in `PG_BIN`, or in the
//! distribution's `/usr/lib/postgresql/<version>/bin`; without them the test fails and
//! says how to install them (it never skips).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stampede_guard::postgres::tokio_postgres::{self, Client, NoTls};
use tempfile::TempDir;

use super::server::{find_on_path, free_port, print_log_tail, setpriv};

const READY_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) struct PgServer {
    dir: TempDir,
    port: u16,
    bin: PathBuf,
    user: Option<(u32, u32)>,
    child: Option<Child>,
}

impl PgServer {
    /// A new database cluster, started and answering.
    pub(crate) fn start() -> Self {
        let bin = pg_bin();
        let dir = tempfile::Builder::new()
            .prefix("stampede-guard-pg-")
            .tempdir()
            .expect("temporary directory for postgres");
        let user = run_as();
        if let Some((uid, gid)) = user {
            chown(dir.path(), uid, gid);
        }
        let mut server = Self {
            dir,
            port: free_port(),
            bin,
            user,
            child: None,
        };
        let mut initdb = server.command("initdb");
        initdb
            .arg("-D")
            .arg(server.data())
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .stdin(Stdio::null());
        let out = initdb.output().expect("initdb runs");
        assert!(
            out.status.success(),
            "initdb failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for _ in 0..5 {
            match server.spawn() {
                Ok(()) => return server,
                Err(log) if log.contains("already in use") => server.port = free_port(),
                Err(log) => panic!("postgres did not start:\n{log}"),
            }
        }
        panic!("postgres found no free port in 5 tries");
    }

    /// The connection string of the `postgres` database, as superuser.
    pub(crate) fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    /// A new connection, its driver spawned on the current runtime.
    pub(crate) async fn client(&self) -> Client {
        let (client, connection) = tokio_postgres::connect(&self.url(), NoTls)
            .await
            .unwrap_or_else(|e| panic!("connect to the test's postgres: {e}"));
        tokio::spawn(connection);
        client
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("postgres.log")
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// `program` from the PostgreSQL binaries, as the user the server runs as.
    fn command(&self, program: &str) -> Command {
        let binary = self.bin.join(program);
        let mut command = match setpriv() {
            Some(setpriv) => {
                let mut c = Command::new(setpriv);
                if let Some((uid, gid)) = self.user {
                    c.arg(format!("--reuid={uid}"))
                        .arg(format!("--regid={gid}"))
                        .arg("--clear-groups");
                }
                c.args(["--pdeathsig", "KILL", "--"]).arg(binary);
                c
            }
            None => {
                assert!(
                    self.user.is_none(),
                    "running as root, the tests need setpriv (util-linux) to start postgres as \
                     the postgres user"
                );
                Command::new(binary)
            }
        };
        // initdb and postgres look for their locale and home: keep them plain.
        command.env("LC_ALL", "C").env_remove("PGDATA");
        command
    }

    fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::File::create(self.log_path()).expect("postgres log file");
        if let Some((uid, gid)) = self.user {
            chown(&self.log_path(), uid, gid);
        }
        let mut command = self.command("postgres");
        command
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.dir.path().display()
            ))
            .args(["-c", "fsync=off", "-c", "synchronous_commit=off"])
            .args(["-c", "full_page_writes=off", "-c", "max_connections=50"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let child = command.spawn().expect("postgres runs");
        let pid = child.id();
        self.child = Some(child);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return Err(format!("exited with {status}\n{}", self.log()));
            }
            if self.ready_as(pid) {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.kill();
                return Err(format!("not ready in {READY_TIMEOUT:?}\n{}", self.log()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the server of this directory is `pid` and says it is ready to accept
    /// connections (`postmaster.pid`: its first line is the pid, its last the status).
    /// setpriv execs postgres, so the child's pid is the server's.
    fn ready_as(&self, pid: u32) -> bool {
        let Ok(text) = std::fs::read_to_string(self.data().join("postmaster.pid")) else {
            return false;
        };
        let lines: Vec<&str> = text.lines().collect();
        lines.first().is_some_and(|l| l.trim() == pid.to_string())
            && lines
                .get(3)
                .is_some_and(|l| l.trim() == self.port.to_string())
            && lines.last().is_some_and(|l| l.trim() == "ready")
    }

    /// Stops the server: SIGQUIT (PostgreSQL's immediate shutdown, which also ends
    /// its backends), then SIGKILL if it is still there after a few seconds.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-QUIT", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_log_tail("postgres", self.port, &self.log());
        }
        self.kill();
    }
}

/// The user to run the server as: `postgres` when the tests run as root.
fn run_as() -> Option<(u32, u32)> {
    let out = Command::new("id").arg("-u").output().expect("id(1)");
    if String::from_utf8_lossy(&out.stdout).trim() != "0" {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let line = passwd
        .lines()
        .find(|l| l.starts_with("postgres:"))
        .unwrap_or_else(|| {
            panic!(
                "the tests run as root, and PostgreSQL refuses to: they start it as the user \
                 `postgres`, which does not exist. Install PostgreSQL from the distribution \
                 (`apt-get install -y postgresql`), which creates it."
            )
        });
    let fields: Vec<&str> = line.split(':').collect();
    Some((fields[2].parse().unwrap(), fields[3].parse().unwrap()))
}

fn chown(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("chown for postgres");
}

fn pg_bin() -> PathBuf {
    if let Some(path) = std::env::var_os("PG_BIN") {
        return PathBuf::from(path);
    }
    if let Some(initdb) = find_on_path("initdb") {
        let dir = std::fs::canonicalize(&initdb).unwrap_or(initdb);
        return dir.parent().unwrap().to_path_buf();
    }
    // Debian and Ubuntu keep them off PATH, one folder per major version: the newest.
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin).unwrap_or_else(|| {
        panic!(
            "PostgreSQL's server binaries (initdb, postgres) were not found. The tests start \
             a PostgreSQL of their own. Install it: `apt-get install -y postgresql` (Debian, \
             Ubuntu), `brew install postgresql` (macOS), or set PG_BIN to their folder."
        )
    })
}
