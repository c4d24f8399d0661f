//! The `stampede-sidecar` binary, black box: run as users run it, over real TCP, in front
//! of a real origin, on a real `redis-server`.

mod support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use http::{StatusCode, Uri};
use support::http::{fetch, fetch_method, post_json, serve};
use support::{HANG, RedisServer, eventually};
use tokio::sync::watch;

const BIN: &str = env!("CARGO_BIN_EXE_stampede-sidecar");
const SECRET: &str = "a sidecar test secret of more than sixteen bytes";

/// Runs the binary to its end with `args` (for the ones that exit at once).
fn run(args: &[&str]) -> Output {
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

fn wait_output(child: Child) -> Output {
    let (done, out) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    out.recv_timeout(HANG)
        .expect("the sidecar exited within HANG")
        .expect("its output")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A running sidecar, killed when dropped. What it prints is kept, and shown when a test
/// fails.
struct Sidecar {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    listen: SocketAddr,
    admin: Option<SocketAddr>,
}

impl Sidecar {
    /// Starts the binary on free ports (`127.0.0.1:0`: the addresses it binds are read
    /// from what it prints once it listens).
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(BIN)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .env_clear()
            .env("STAMPEDE_GUARD_SECRET", SECRET)
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
        let (mut listen, mut admin) = (None, None);
        let deadline = Instant::now() + HANG;
        while listen.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = listening.recv_timeout(left) else {
                panic!(
                    "the sidecar did not start listening:\n{}",
                    lines.lock().unwrap().join("\n")
                );
            };
            let addr = |line: &str| -> SocketAddr {
                let url = line
                    .split_whitespace()
                    .find(|w| w.starts_with("http://"))
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
                admin = Some(addr(&line));
            } else if line.starts_with("caching ") {
                listen = Some(addr(line.split(" on ").nth(1).unwrap()));
            }
        }
        Self {
            child,
            lines,
            listen: listen.unwrap(),
            admin,
        }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.pid()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -{name} failed");
    }

    fn log(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// Waits for the process to exit (at most `within`) and returns its exit code.
    async fn exited(&mut self, within: Duration) -> Option<i32> {
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

/// The origin: counts its calls, answers `<path> call <n>`; calls after `fast` wait for
/// `gate` to open.
#[derive(Clone)]
struct Origin {
    calls: Arc<AtomicU64>,
    fast: u64,
    gate: watch::Receiver<bool>,
}

async fn answer(State(origin): State<Origin>, uri: Uri) -> impl IntoResponse {
    let n = origin.calls.fetch_add(1, Ordering::SeqCst) + 1;
    if n > origin.fast {
        let _ = origin.gate.clone().wait_for(|open| *open).await;
    }
    // Under /max-age-60/, the origin says how long its answer is fresh, and tags it.
    let (cache_control, tags) = if uri.path().starts_with("/max-age-60/") {
        ("max-age=60", "all")
    } else {
        ("public", "")
    };
    (
        [
            (http::header::CACHE_CONTROL, cache_control),
            (http::HeaderName::from_static("surrogate-key"), tags),
        ],
        format!("{} call {n}", uri.path()),
    )
}

/// An origin on a free port whose first `fast` calls answer at once; the others wait for
/// the returned sender to send `true`.
async fn origin(fast: u64) -> (SocketAddr, Arc<AtomicU64>, watch::Sender<bool>) {
    let calls = Arc::new(AtomicU64::new(0));
    let (open, gate) = watch::channel(false);
    let app = Router::new().fallback(get(answer)).with_state(Origin {
        calls: calls.clone(),
        fast,
        gate,
    });
    (serve(app).await, calls, open)
}

fn write_config(dir: &Path, text: &str) -> String {
    let path = dir.join("sidecar.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn help_and_version_exit_zero() {
    let help = run(&["--help"]);
    assert_eq!(help.status.code(), Some(0));
    let out = text(&help.stdout);
    for flag in [
        "--config",
        "--listen",
        "--upstream",
        "--redis",
        "--follow-origin",
        "--fresh",
        "--grace",
        "--lease",
        "--cold-wait",
        "--metrics",
        "--admin",
        "--drain-timeout",
        "--secret-file",
        "--via",
        "--trusted-proxy",
    ] {
        assert!(out.contains(flag), "--help does not mention {flag}:\n{out}");
    }
    let version = run(&["--version"]);
    assert_eq!(version.status.code(), Some(0));
    assert!(text(&version.stdout).contains(env!("CARGO_PKG_VERSION")));
}

#[test]
fn a_bad_flag_or_value_exits_2_naming_it() {
    let out = run(&["--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--no-such-flag"),
        "{}",
        text(&out.stderr)
    );

    for (flag, value) in [
        ("--fresh", "1x"),
        ("--listen", "nowhere"),
        ("--upstream", "https://example.com"),
    ] {
        let out = run(&[flag, value]);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}");
        let err = text(&out.stderr);
        assert!(
            err.contains(flag) && err.contains(value),
            "{flag} {value}: {err}"
        );
    }
}

#[test]
fn a_bad_config_exits_2_naming_the_file_the_route_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let route = |body: &str| {
        format!("fresh = \"1s\"\n\n[[routes]]\nname = \"items\"\nprefix = \"/items/\"\n{body}\n")
    };
    for (config, field) in [
        // Refused by the crate's policy check.
        (route("fresh = \"0s\""), "`fresh`"),
        (route("lease = \"10ms\""), "`lease`"),
        (route("key_headers = [\"not a header\"]"), "`key_headers`"),
        // A bad duration.
        (route("grace = \"soon\""), "`grace`"),
        // Unknown to the schema.
        (route("fressh = \"1s\""), "fressh"),
        // Not TOML.
        (route("fresh = "), "fresh"),
    ] {
        let path = write_config(dir.path(), &config);
        let out = run(&["--config", &path, "--check"]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{config}\n{err}");
        assert!(err.contains(&path), "the file is named:\n{err}");
        assert!(err.contains(field), "{field} is named:\n{err}");
        if !config.ends_with("fresh = \n") {
            assert!(err.contains("\"items\""), "the route is named:\n{err}");
        }
    }
    // Two routes of one name: the guard refuses the second.
    let twice =
        "[[routes]]\nname = \"a\"\nprefix = \"/a\"\n\n[[routes]]\nname = \"a\"\nprefix = \"/b\"\n";
    let path = write_config(dir.path(), twice);
    let out = run(&["--config", &path, "--check"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("\"a\"") && err.contains("`name`"), "{err}");

    let missing = run(&["--config", "no-such-file.toml", "--check"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(text(&missing.stderr).contains("no-such-file.toml"));
}

/// With Redis, keys are hashed with a secret the fleet shares: without one the sidecar
/// refuses to start (exit 2, naming it and how to make one), where it once used a
/// secret everyone knows. `--secret-file` gives it; without Redis, the process makes a
/// random one of its own.
#[test]
fn with_redis_a_secret_is_required() {
    let no_secret = |args: &[&str]| {
        let child = Command::new(BIN)
            .args(args)
            .env_clear()
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the sidecar starts");
        wait_output(child)
    };
    let redis = ["--redis", "redis://127.0.0.1:1", "--check"];
    let out = no_secret(&redis);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("STAMPEDE_GUARD_SECRET"), "{err}");
    assert!(err.contains("openssl rand"), "how to make one:\n{err}");

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("secret");
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    let file = file.to_str().unwrap();
    let out = no_secret(&[&redis[..2], &["--secret-file", file, "--check"]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = no_secret(&[&redis[..2], &["--secret-file", "no-such-file", "--check"]].concat());
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("secret_file") && err.contains("no-such-file"),
        "{err}"
    );

    let local = no_secret(&["--check"]);
    assert_eq!(local.status.code(), Some(0), "{}", text(&local.stderr));
}

/// A proxy's headers, both ways (RFC 9110 §7.6): the origin never sees the client's
/// hop-by-hop headers (nor one its `Connection` lists), the client never sees the
/// origin's, and `Via` names the sidecar on both sides, on a request passed through
/// (a POST), a fill and a hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_stay_on_their_hop_and_via_names_the_sidecar() {
    let seen = Arc::new(Mutex::new(Vec::<http::HeaderMap>::new()));
    let app = Router::new().fallback({
        let seen = seen.clone();
        move |headers: http::HeaderMap| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(headers);
                (
                    [
                        ("cache-control", "max-age=60"),
                        ("connection", "x-origin-hop"),
                        ("x-origin-hop", "1"),
                        ("keep-alive", "timeout=5"),
                        ("proxy-authenticate", "Basic"),
                        ("x-origin-kept", "1"),
                    ],
                    "body",
                )
            }
        }
    });
    let origin = serve(app).await;
    let sidecar = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let hop = [
        ("connection", "keep-alive, x-client-hop"),
        ("x-client-hop", "1"),
        ("keep-alive", "timeout=5"),
        ("proxy-authorization", "Basic c2VjcmV0"),
        ("proxy-connection", "keep-alive"),
        ("x-client-kept", "1"),
    ];
    let posted = post_json(sidecar.listen, "/items/1", &hop, "{}").await;
    let filled = fetch(sidecar.listen, "/items/2", &hop).await;
    let hit = fetch(sidecar.listen, "/items/2", &hop).await;
    assert_eq!(
        [posted.x_cache(), filled.x_cache(), hit.x_cache()],
        ["bypass", "miss", "hit"]
    );
    for got in [&posted, &filled, &hit] {
        assert_eq!(got.status, StatusCode::OK, "{}", got.body);
        for gone in [
            "connection",
            "x-origin-hop",
            "keep-alive",
            "proxy-authenticate",
        ] {
            assert!(!got.headers.contains_key(gone), "{gone}: {:?}", got.headers);
        }
        assert_eq!(got.headers["x-origin-kept"], "1");
        let via: Vec<_> = got.headers.get_all("via").iter().collect();
        assert_eq!(via, ["1.1 stampede-sidecar"], "{:?}", got.headers);
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2, "the POST and the fill");
    for headers in seen.iter() {
        for gone in [
            "connection",
            "x-client-hop",
            "keep-alive",
            "proxy-authorization",
            "proxy-connection",
        ] {
            assert!(!headers.contains_key(gone), "{gone}: {headers:?}");
        }
        assert_eq!(headers["x-client-kept"], "1");
        assert_eq!(headers["via"], "1.1 stampede-sidecar");
    }
}

/// `X-Forwarded-For` and `-Proto` say who the client is: a client's own values are
/// replaced by the peer's address (they cannot be spoofed), and kept, with the peer's
/// address appended, when the peer is a trusted proxy. On a request passed through and
/// on a fill alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_forwarded_for_is_the_peer_unless_the_peer_is_trusted() {
    let seen = Arc::new(Mutex::new(Vec::<http::HeaderMap>::new()));
    let app = Router::new().fallback({
        let seen = seen.clone();
        move |headers: http::HeaderMap| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(headers);
                ([("cache-control", "max-age=60")], "body")
            }
        }
    });
    let origin = serve(app).await;
    let spoofed = [
        ("x-forwarded-for", "203.0.113.7"),
        ("x-forwarded-proto", "https"),
    ];
    for (trusted, want_for, want_proto) in [
        (None, "127.0.0.1", "http"),
        (Some("127.0.0.0/8"), "203.0.113.7, 127.0.0.1", "https"),
    ] {
        seen.lock().unwrap().clear();
        let mut args = vec!["--upstream".to_owned(), format!("http://{origin}")];
        if let Some(block) = trusted {
            args.extend(["--trusted-proxy".to_owned(), block.to_owned()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let sidecar = Sidecar::start(&args);
        let posted = post_json(sidecar.listen, "/items/1", &spoofed, "{}").await;
        let filled = fetch(sidecar.listen, "/items/2", &spoofed).await;
        assert_eq!([posted.x_cache(), filled.x_cache()], ["bypass", "miss"]);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2, "the POST and the fill");
        let (post, fill) = (&seen[0], &seen[1]);
        assert_eq!(post["x-forwarded-for"], want_for, "{trusted:?}");
        assert_eq!(post["x-forwarded-proto"], want_proto, "{trusted:?}");
        assert_eq!(fill["x-forwarded-for"], want_for, "{trusted:?}");
        // A fill never forwards the client's scheme (it would poison the entry for
        // everyone): the sidecar's own.
        assert_eq!(fill["x-forwarded-proto"], "http", "{trusted:?}");
    }
}

#[test]
fn the_documented_config_is_accepted() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/sidecar.toml");
    let out = run(&["--config", fixture, "--check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("settings ok: 3 route(s)"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fills_once_then_hits_over_tcp_and_reports_health() {
    let mut redis = RedisServer::start();
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--redis",
        &redis.url(),
        "--follow-origin",
        "false",
        "--fresh",
        "60s",
        "--admin",
        "127.0.0.1:0",
    ]);
    let first = fetch(sidecar.listen, "/items/1", &[]).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.x_cache(), "miss");
    assert_eq!(first.body, "/items/1 call 1");
    let second = fetch(sidecar.listen, "/items/1", &[]).await;
    assert_eq!(second.x_cache(), "hit");
    assert_eq!(second.body, "/items/1 call 1");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the origin is called once");

    let admin = sidecar.admin.expect("an admin listener");
    let health = fetch(admin, "/healthz", &[]).await;
    assert_eq!(health.status, StatusCode::OK);
    let health: serde_json::Value = serde_json::from_str(&health.body).unwrap();
    assert_eq!(health["redis"], "up", "{health}");
    assert_eq!(health["notices"], "connected", "{health}");
    assert_eq!(health["draining"], false, "{health}");
    assert_eq!(fetch(admin, "/readyz", &[]).await.status, StatusCode::OK);
    // The origin's paths are not shadowed: the admin paths go to the origin.
    let through = fetch(sidecar.listen, "/healthz", &[]).await;
    assert_eq!(through.body, "/healthz call 2");

    // Redis gone: still healthy (it serves from L1), and says so.
    redis.kill();
    let health = fetch(admin, "/healthz", &[]).await;
    assert_eq!(health.status, StatusCode::OK);
    let health: serde_json::Value = serde_json::from_str(&health.body).unwrap();
    assert_eq!(health["redis"], "down", "{health}");
    let hit = fetch(sidecar.listen, "/items/1", &[]).await;
    assert_eq!(
        (hit.x_cache(), hit.body.as_str()),
        ("hit", "/items/1 call 1")
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// An HTTP cache by default: what the origin says its answers' lifetimes are sets them;
/// an answer with neither a lifetime nor a validator is not reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_follows_the_origin_by_default() {
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let sidecar = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let first = fetch(sidecar.listen, "/max-age-60/a", &[]).await;
    assert_eq!(first.x_cache(), "miss");
    let status = first.headers["cache-status"].to_str().unwrap();
    assert_eq!(status, "stampede-guard; fwd=uri-miss; stored; ttl=60");
    let second = fetch(sidecar.listen, "/max-age-60/a", &[]).await;
    assert_eq!(
        (second.x_cache(), second.body.as_str()),
        ("hit", "/max-age-60/a call 1")
    );
    for _ in 0..2 {
        assert_eq!(fetch(sidecar.listen, "/plain", &[]).await.x_cache(), "pass");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

/// Purges over HTTP, behind the admin token: by path (that entry only) and by tag (hard:
/// gone; soft: stale, here filled again at once as the origin allows no stale).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_over_http_need_the_token() {
    let redis = RedisServer::start();
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--redis",
        &redis.url(),
        "--admin",
        "127.0.0.1:0",
        "--admin-token",
        "s3cret",
    ]);
    let admin = sidecar.admin.expect("an admin listener");
    let get = |path: &'static str| fetch(sidecar.listen, path, &[]);
    let auth = [("authorization", "Bearer s3cret")];
    assert_eq!(get("/max-age-60/a").await.x_cache(), "miss");
    assert_eq!(get("/max-age-60/b").await.x_cache(), "miss");

    let tags = r#"{"tags": ["all"]}"#;
    let refused = post_json(admin, "/purge/tags", &[], tags).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    let wrong = post_json(admin, "/purge/tags", &[("authorization", "Bearer x")], tags).await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert_eq!(get("/max-age-60/a").await.x_cache(), "hit");

    // By path: that entry only.
    let by_path = post_json(admin, "/purge/path", &auth, r#"{"path": "/max-age-60/a"}"#).await;
    assert_eq!(by_path.status, StatusCode::OK, "{}", by_path.body);
    assert_eq!(by_path.body, r#"{"existed":true}"#);
    assert_eq!(get("/max-age-60/a").await.x_cache(), "miss");
    assert_eq!(get("/max-age-60/b").await.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    // Soft, by tag: stale; and as the origin did not allow serving them stale (no
    // stale-while-revalidate), filled again at once, once each.
    let soft = post_json(
        admin,
        "/purge/tags",
        &auth,
        r#"{"tags": ["all"], "soft": true}"#,
    )
    .await;
    assert_eq!(soft.status, StatusCode::OK, "{}", soft.body);
    for path in ["/max-age-60/a", "/max-age-60/b"] {
        assert_eq!(fetch(sidecar.listen, path, &[]).await.x_cache(), "miss");
    }
    assert!(
        eventually(HANG, || async {
            get("/max-age-60/a").await.x_cache() == "hit"
                && get("/max-age-60/b").await.x_cache() == "hit"
        })
        .await
    );
    assert_eq!(calls.load(Ordering::SeqCst), 5);

    // Hard, by tag: gone.
    let hard = post_json(admin, "/purge/tags", &auth, tags).await;
    assert_eq!(hard.status, StatusCode::OK, "{}", hard.body);
    assert_eq!(get("/max-age-60/b").await.x_cache(), "miss");
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    // Bad requests are refused, naming what is wrong.
    let empty = post_json(admin, "/purge/tags", &auth, r#"{"tags": []}"#).await;
    assert_eq!(empty.status, StatusCode::BAD_REQUEST);
    let relative = post_json(admin, "/purge/path", &auth, r#"{"path": "items"}"#).await;
    assert_eq!(relative.status, StatusCode::BAD_REQUEST);
}

/// The representation the range tests' origin serves: 20 bytes.
const WHOLE: &str = "0123456789abcdefghij";

/// An origin of [`WHOLE`] (fresh for a minute, with an `ETag`) that keeps the headers of
/// every request it gets, and answers a `Range` of the form `bytes=F-L` itself, `206`
/// (the sidecar must never send it one on a fill).
async fn ranged_origin() -> (SocketAddr, Arc<Mutex<Vec<http::HeaderMap>>>) {
    let seen = Arc::new(Mutex::new(Vec::<http::HeaderMap>::new()));
    let app = Router::new().fallback({
        let seen = seen.clone();
        move |headers: http::HeaderMap| {
            let seen = seen.clone();
            async move {
                let range = headers
                    .get("range")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("bytes="))
                    .and_then(|v| v.split_once('-'))
                    .and_then(|(f, l)| Some((f.parse::<usize>().ok()?, l.parse::<usize>().ok()?)));
                seen.lock().unwrap().push(headers);
                let fields = [("cache-control", "max-age=60"), ("etag", "\"v1\"")];
                match range {
                    Some((first, last)) => (
                        StatusCode::PARTIAL_CONTENT,
                        fields,
                        [(
                            "content-range",
                            format!("bytes {first}-{last}/{}", WHOLE.len()),
                        )],
                        WHOLE[first..=last].to_owned(),
                    ),
                    None => (
                        StatusCode::OK,
                        fields,
                        [("x-whole", "1".to_owned())],
                        WHOLE.to_owned(),
                    ),
                }
            }
        }
    });
    (serve(app).await, seen)
}

/// A single byte range is cut from the whole entry: on a miss, the origin is asked once,
/// for the whole (no `Range`), and the range answered from what it sent; on a hit, from
/// the entry, without the origin. `bytes=-5` is the last five bytes; a range past the
/// end is `416` with the length. `Accept-Ranges: bytes` on the entry's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_is_cut_from_the_whole_entry_on_a_miss_and_on_a_hit() {
    let (origin, seen) = ranged_origin().await;
    let sidecar = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let cases = [
        (
            "/a",
            "bytes=0-9",
            StatusCode::PARTIAL_CONTENT,
            "bytes 0-9/20",
            "0123456789",
        ),
        (
            "/b",
            "bytes=-5",
            StatusCode::PARTIAL_CONTENT,
            "bytes 15-19/20",
            "fghij",
        ),
        (
            "/c",
            "bytes=20-",
            StatusCode::RANGE_NOT_SATISFIABLE,
            "bytes */20",
            "",
        ),
    ];
    for (at, (path, range, status, content_range, body)) in cases.into_iter().enumerate() {
        for x_cache in ["miss", "hit"] {
            let got = fetch(sidecar.listen, path, &[("range", range)]).await;
            let what = format!("{range} on a {x_cache}");
            assert_eq!(got.status, status, "{what}: {}", got.body);
            assert_eq!(got.x_cache(), x_cache, "{what}");
            assert_eq!(got.headers["content-range"], content_range, "{what}");
            assert_eq!(
                got.headers["content-length"],
                body.len().to_string(),
                "{what}"
            );
            assert_eq!(got.body, body, "{what}");
            assert_eq!(got.headers["accept-ranges"], "bytes", "{what}");
            // Exactly one origin call per path, for the whole.
            let seen = seen.lock().unwrap();
            assert_eq!(seen.len(), at + 1, "{what}");
            assert!(!seen[at].contains_key("range"), "{what}: {:?}", seen[at]);
            assert!(!seen[at].contains_key("if-range"), "{what}");
        }
        // The entry is the whole: a GET without a range gets it.
        let whole = fetch(sidecar.listen, path, &[]).await;
        assert_eq!((whole.status, whole.x_cache()), (StatusCode::OK, "hit"));
        assert_eq!(whole.body, WHOLE);
        assert!(!whole.headers.contains_key("content-range"));
    }
    assert_eq!(seen.lock().unwrap().len(), 3);
}

/// What is not one byte range of the entry the client means gets the whole `200`, from
/// the entry: several ranges, a `Range` that is not valid, an `If-Range` whose
/// validator is not the entry's; a HEAD's range is ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_ranges_get_the_whole_entry() {
    let (origin, seen) = ranged_origin().await;
    let sidecar = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let cut = fetch(
        sidecar.listen,
        "/a",
        &[("range", "bytes=1-2"), ("if-range", "\"v1\"")],
    )
    .await;
    assert_eq!(
        (cut.status, cut.body.as_str()),
        (StatusCode::PARTIAL_CONTENT, "12")
    );
    for asked in [
        &[("range", "bytes=0-1,5-6")][..],
        &[("range", "bytes=5-1")],
        &[("range", "lines=0-1")],
        &[("range", "bytes=0-1"), ("if-range", "\"v0\"")],
        &[("range", "bytes=0-1"), ("if-range", "W/\"v1\"")],
    ] {
        let got = fetch(sidecar.listen, "/a", asked).await;
        assert_eq!(got.status, StatusCode::OK, "{asked:?}");
        assert_eq!(
            (got.x_cache(), got.body.as_str()),
            ("hit", WHOLE),
            "{asked:?}"
        );
        assert!(!got.headers.contains_key("content-range"), "{asked:?}");
    }
    let head = fetch_method(sidecar.listen, "HEAD", "/a").await;
    assert_eq!((head.status, head.x_cache()), (StatusCode::OK, "hit"));
    assert_eq!(seen.lock().unwrap().len(), 1, "one fill, of the whole");
}

/// An answer too large to store streams through: the request whose fill found that out
/// gets it whole (its fill asked for the whole); the key's later callers pass through,
/// and their `Range` goes to the origin, which answers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_of_an_answer_too_large_to_store_goes_to_the_origin() {
    let (origin, seen) = ranged_origin().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "upstream = \"http://{origin}\"\ndefault = \"cache\"\n\n\
             [[routes]]\nname = \"big\"\nprefix = \"/big/\"\nmax_body = 16\n"
        ),
    );
    let sidecar = Sidecar::start(&["--config", &config]);
    let first = fetch(sidecar.listen, "/big/1", &[("range", "bytes=0-9")]).await;
    assert_eq!((first.status, first.x_cache()), (StatusCode::OK, "pass"));
    assert_eq!(first.body, WHOLE);
    let second = fetch(sidecar.listen, "/big/1", &[("range", "bytes=0-9")]).await;
    assert_eq!(second.status, StatusCode::PARTIAL_CONTENT);
    assert_eq!(second.x_cache(), "pass");
    assert_eq!(second.headers["content-range"], "bytes 0-9/20");
    assert_eq!(second.body, "0123456789");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    assert!(
        !seen[0].contains_key("range"),
        "the fill asks for the whole"
    );
    assert_eq!(seen[1]["range"], "bytes=0-9", "a pass-through forwards it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_prefix_picks_the_policy() {
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "upstream = \"http://{origin}\"\ndefault = \"pass\"\nfresh = \"60s\"\n\
             follow_origin = false\n\n\
             [[routes]]\nname = \"items\"\nprefix = \"/items/\"\n\n\
             [[routes]]\nname = \"hot\"\nprefix = \"/items/hot\"\nkey_query = \"ignore\"\n"
        ),
    );
    let sidecar = Sidecar::start(&["--config", &config]);
    let get = |path: &'static str| fetch(sidecar.listen, path, &[]);

    // No route: passed through, every time.
    assert_eq!(get("/other").await.x_cache(), "bypass");
    assert_eq!(get("/other").await.x_cache(), "bypass");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // "/items/": every query parameter keyed.
    assert_eq!(get("/items/1?a=1").await.x_cache(), "miss");
    assert_eq!(get("/items/1?a=2").await.x_cache(), "miss");
    assert_eq!(get("/items/1?a=1").await.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    // "/items/hot" is longer: its policy ignores the query.
    assert_eq!(get("/items/hot?a=1").await.x_cache(), "miss");
    assert_eq!(get("/items/hot?a=2").await.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_refresh_finish_and_write() {
    let redis = RedisServer::start();
    // The first call answers at once; the refresh's waits until the test opens the gate.
    let (origin, calls, gate) = origin(1).await;
    let fresh = Duration::from_secs(4);
    let args = |admin: bool| {
        let mut args = vec![
            "--upstream".to_owned(),
            format!("http://{origin}"),
            "--redis".to_owned(),
            redis.url(),
            "--follow-origin".to_owned(),
            "false".to_owned(),
            "--fresh".to_owned(),
            format!("{}ms", fresh.as_millis()),
            "--grace".to_owned(),
            "60s".to_owned(),
            "--lease".to_owned(),
            "20s".to_owned(),
            "--drain-timeout".to_owned(),
            "30s".to_owned(),
        ];
        if admin {
            args.extend(["--admin".to_owned(), "127.0.0.1:0".to_owned()]);
        }
        args
    };
    let owned = args(true);
    let mut a = Sidecar::start(&owned.iter().map(String::as_str).collect::<Vec<_>>());
    let owned = args(false);
    // On the same Redis, with an L1 of its own that holds nothing yet.
    let b = Sidecar::start(&owned.iter().map(String::as_str).collect::<Vec<_>>());

    let filled = fetch(a.listen, "/r", &[]).await;
    assert_eq!(
        (filled.x_cache(), filled.body.as_str()),
        ("miss", "/r call 1")
    );
    // Past its freshness: the next request is served stale and starts a refresh.
    tokio::time::sleep(fresh + Duration::from_millis(200)).await;
    let stale = fetch(a.listen, "/r", &[]).await;
    assert_eq!(
        (stale.x_cache(), stale.body.as_str()),
        ("stale", "/r call 1")
    );
    assert!(
        eventually(HANG, || async { calls.load(Ordering::SeqCst) == 2 }).await,
        "the refresh reached the origin"
    );

    a.signal("TERM");
    let admin = a.admin.unwrap();
    assert!(
        eventually(HANG, || async {
            fetch(admin, "/readyz", &[]).await.status == StatusCode::SERVICE_UNAVAILABLE
        })
        .await,
        "/readyz says 503 while draining"
    );
    // It stopped accepting, and waits for the refresh.
    assert!(
        eventually(HANG, || async {
            tokio::net::TcpStream::connect(a.listen).await.is_err()
        })
        .await,
        "the listener is closed"
    );
    assert_eq!(
        a.child.try_wait().unwrap(),
        None,
        "still at work on the refresh"
    );

    gate.send_replace(true);
    assert_eq!(a.exited(HANG).await, Some(0), "{}", a.log());
    assert!(a.log().contains("drained"), "{}", a.log());
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // The refresh wrote Redis: the other sidecar serves its body as a hit, no origin call.
    let read = fetch(b.listen, "/r", &[]).await;
    assert_eq!((read.x_cache(), read.body.as_str()), ("hit", "/r call 2"));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the origin was not called again"
    );
}
