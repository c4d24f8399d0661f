//! The `stampede-sidecar` binary, black box: run as users run it, over real TCP, in front
//! of a real origin, on a real `redis-server`.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::get;
use http::{StatusCode, Uri};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::http::{fetch, fetch_from, fetch_method, post_json, serve};
use support::sidecar::{BIN, SECRET, Sidecar, run, text, wait_output};
use support::{HANG, Mode, Proxy, RedisServer, eventually, joined, within};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

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

/// An origin that keeps the headers of every request it gets and answers `body`,
/// fresh for a minute.
async fn recording_origin() -> (SocketAddr, Arc<Mutex<Vec<http::HeaderMap>>>) {
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
    (serve(app).await, seen)
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
        ("--upstream", "ftp://example.com"),
        ("--header-read-timeout", "soon"),
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
        format!(
            "follow_origin = false\nfresh = \"1s\"\n\n[[routes]]\nname = \"items\"\n\
             prefix = \"/items/\"\n{body}\n"
        )
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
    // Two routes of one name: refused, saying which, and no advice for library users.
    let twice =
        "[[routes]]\nname = \"a\"\nprefix = \"/a\"\n\n[[routes]]\nname = \"a\"\nprefix = \"/b\"\n";
    let path = write_config(dir.path(), twice);
    let out = run(&["--config", &path, "--check"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("\"a\"") && err.contains("`name`"), "{err}");
    assert!(err.contains("routes[0]'s name too"), "{err}");
    assert!(!err.contains("clone"), "{err}");

    let missing = run(&["--config", "no-such-file.toml", "--check"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(text(&missing.stderr).contains("no-such-file.toml"));
}

/// A flag or field that would do nothing is refused at start, naming it and what would
/// make it count: `--fresh` while the sidecar follows the origin (the README once showed
/// `--fresh 1s --grace 10s` alone, which cached nothing of an origin that sends no
/// Cache-Control), a route's `fresh` where that route follows the origin, and
/// `min_fresh` where it does not.
#[test]
fn a_setting_that_would_do_nothing_is_refused_at_start() {
    let out = run(&["--listen", "127.0.0.1:0", "--fresh", "1s", "--grace", "10s"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let line = err
        .lines()
        .find(|l| l.contains("--fresh"))
        .unwrap_or_else(|| panic!("no line names --fresh:\n{err}"));
    assert!(
        line.starts_with("stampede-sidecar: settings, field `fresh`"),
        "{line}"
    );
    assert!(line.contains("--follow-origin false"), "{line}");
    let out = run(&[
        "--follow-origin",
        "false",
        "--fresh",
        "1s",
        "--grace",
        "10s",
        "--check",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));

    let dir = tempfile::tempdir().unwrap();
    for (body, field) in [
        ("fresh = \"5s\"", "`fresh`"),
        ("follow_origin = false\nmin_fresh = \"5s\"", "`min_fresh`"),
    ] {
        let config = write_config(
            dir.path(),
            &format!(
                "default = \"pass\"\n\n[[routes]]\nname = \"items\"\nprefix = \"/items/\"\n{body}\n"
            ),
        );
        let out = run(&["--listen", "127.0.0.1:0", "--config", &config]);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{body}: {err}");
        assert!(
            err.contains(&format!(
                "config file {config}, route \"items\" (routes[0]), field {field}: does nothing"
            )),
            "{body}: {err}"
        );
    }
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
    let (origin, seen) = recording_origin().await;
    // Two lines of it: a proxy in front may add its own line (HAProxy does).
    let spoofed = [
        ("x-forwarded-for", "203.0.113.7"),
        ("x-forwarded-for", "198.51.100.2"),
        ("x-forwarded-proto", "https"),
        ("x-real-ip", "203.0.113.7"),
        ("forwarded", "for=203.0.113.7"),
    ];
    for (trusted, want_for, want_proto) in [
        (None, "127.0.0.1", "http"),
        (
            Some("127.0.0.0/8"),
            "203.0.113.7, 198.51.100.2, 127.0.0.1",
            "https",
        ),
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
        assert_eq!(post.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(post["x-forwarded-proto"], want_proto, "{trusted:?}");
        if trusted.is_none() {
            for spoofable in ["x-real-ip", "forwarded"] {
                assert!(!post.contains_key(spoofable), "{spoofable}: {post:?}");
            }
        }
        assert_eq!(fill["x-forwarded-for"], want_for, "{trusted:?}");
        // A fill forwards the scheme the client used, as vouched for (a trusted
        // balancer's word, else the sidecar's own listener's), which keys the entry.
        assert_eq!(fill["x-forwarded-proto"], want_proto, "{trusted:?}");
    }
}

/// No poisoning through forwarding headers: an untrusted client that says
/// `X-Forwarded-Proto: https` (or `X-Forwarded-Host`) to an origin whose answer varies
/// on it gets, and stores, the answer to its real scheme, under that scheme's key; the
/// trusted balancer's `https` request (from another address) is a miss answered for
/// https, then a hit on that, never on the untrusted client's entry. Before, the
/// untrusted `https` was keyed and then replaced by `http` on its way to the origin:
/// the balancer got a hit saying "origin saw proto=http".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_headers_key_what_the_origin_sees() {
    let app = Router::new().fallback(|headers: http::HeaderMap| async move {
        let said = |name: &str| {
            headers
                .get(name)
                .map_or("-", |v| v.to_str().unwrap())
                .to_owned()
        };
        (
            [
                ("cache-control", "max-age=60".to_owned()),
                ("vary", "X-Forwarded-Proto, X-Forwarded-Host".to_owned()),
            ],
            format!(
                "origin saw proto={} host={}",
                said("x-forwarded-proto"),
                said("x-forwarded-host")
            ),
        )
    });
    let origin = serve(app).await;
    let upstream = format!("http://{origin}");
    let sidecar = Sidecar::start(&["--upstream", &upstream, "--trusted-proxy", "127.0.0.2"]);
    let client: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    let balancer: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let lies = [
        ("x-forwarded-proto", "https"),
        ("x-forwarded-host", "admin.example"),
    ];
    for round in 0..2 {
        let got = fetch_from(client, sidecar.listen, "/page", &lies).await;
        assert_eq!(got.body, "origin saw proto=http host=-", "round {round}");
        assert_eq!(got.x_cache(), if round == 0 { "miss" } else { "hit" });
    }
    let vouched = [
        ("x-forwarded-proto", "https"),
        ("x-forwarded-host", "shop.example"),
    ];
    for round in 0..2 {
        let got = fetch_from(balancer, sidecar.listen, "/page", &vouched).await;
        assert_eq!(
            got.body, "origin saw proto=https host=shop.example",
            "round {round}"
        );
        assert_eq!(got.x_cache(), if round == 0 { "miss" } else { "hit" });
    }
    // The balancer's plain http requests are their own, too.
    let got = fetch_from(
        balancer,
        sidecar.listen,
        "/page",
        &[("x-forwarded-proto", "http")],
    )
    .await;
    assert_eq!(got.body, "origin saw proto=http host=-");
}

/// A listener that never accepts, its backlog full: a connection to it is never
/// established, as to a host that drops packets. The connections that filled it are
/// returned with it (they must stay open).
async fn unaccepting() -> (SocketAddr, TcpListener, Vec<TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut filled = Vec::new();
    for _ in 0..64 {
        match tokio::time::timeout(Duration::from_millis(500), TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => filled.push(stream),
            _ => return (addr, listener, filled),
        }
    }
    panic!("the backlog of a listener that never accepts did not fill");
}

/// An origin that does not answer in time is a 504 within the configured timeout, for
/// what the cache cannot answer (a POST, a GET with a cookie), while a cached key goes
/// on answering from the cache: an origin that accepts and never answers, and one that
/// never accepts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_origin_is_a_504_in_time_and_the_cache_still_answers() {
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let proxy = Proxy::start(origin).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{}", proxy.addr()),
        "--follow-origin",
        "false",
        "--fresh",
        "60s",
        "--response-timeout",
        "1s",
    ]);
    let cached = fetch(sidecar.listen, "/items/1", &[]).await;
    assert_eq!(cached.x_cache(), "miss");

    // Accepts, and never answers.
    proxy.set(Mode::Blackhole);
    let started = Instant::now();
    let (posted, cookied) = tokio::join!(
        post_json(sidecar.listen, "/items/2", &[], "{}"),
        fetch(sidecar.listen, "/items/3", &[("cookie", "session=1")]),
    );
    let waited = started.elapsed();
    for got in [&posted, &cookied] {
        assert_eq!(got.status, StatusCode::GATEWAY_TIMEOUT, "{}", got.body);
        assert!(got.body.contains("did not answer in time"), "{}", got.body);
    }
    assert!(
        waited >= Duration::from_millis(950) && waited < HANG / 2,
        "the response timeout is 1s: {waited:?}"
    );
    let hit = fetch(sidecar.listen, "/items/1", &[]).await;
    assert_eq!(
        (hit.x_cache(), hit.body.as_str()),
        ("hit", "/items/1 call 1")
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // Never accepts: the connect timeout.
    let (unaccepting, _listener, _filled) = unaccepting().await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{unaccepting}"),
        "--connect-timeout",
        "1s",
    ]);
    let started = Instant::now();
    let posted = post_json(sidecar.listen, "/items/2", &[], "{}").await;
    let waited = started.elapsed();
    assert_eq!(
        posted.status,
        StatusCode::GATEWAY_TIMEOUT,
        "{}",
        posted.body
    );
    assert!(
        posted
            .body
            .contains("did not accept the connection in time"),
        "{}",
        posted.body
    );
    assert!(
        waited >= Duration::from_millis(950) && waited < HANG / 2,
        "the connect timeout is 1s: {waited:?}"
    );
}

/// Reads from `stream` until `want` has arrived or the stream ends; returns what came.
async fn read_until(stream: &mut TcpStream, want: &str) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(want) {
        match within(
            HANG,
            stream.read(&mut buf),
            format!("reading until {want:?}"),
        )
        .await
        {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Waits for `stream` to be closed by the sidecar (an end or a reset), and returns
/// when.
async fn closed(mut stream: TcpStream) -> Instant {
    let mut buf = [0u8; 64];
    loop {
        match within(HANG, stream.read(&mut buf), "a connection's close").await {
            Ok(0) | Err(_) => return Instant::now(),
            Ok(_) => {}
        }
    }
}

/// Slowloris: a thousand connections that each send half a header block hold nothing
/// for long. A normal client is answered meanwhile, and each of them is closed once the
/// header-read timeout has passed, and not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_headers_are_cut_after_the_header_read_timeout() {
    let (origin, _calls, _gate) = origin(u64::MAX).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--header-read-timeout",
        "5s",
    ]);
    let started = Instant::now();
    let mut slow = Vec::with_capacity(1000);
    for _ in 0..1000 {
        let mut stream = TcpStream::connect(sidecar.listen).await.unwrap();
        stream
            .write_all(b"GET /items/1 HTTP/1.1\r\nHost: shop.example\r\nX-Half: ")
            .await
            .unwrap();
        slow.push(stream);
    }
    let normal = fetch(sidecar.listen, "/items/2", &[]).await;
    assert_eq!(normal.status, StatusCode::OK);
    assert_eq!(normal.body, "/items/2 call 1");
    let closes: Vec<_> = slow.into_iter().map(|s| tokio::spawn(closed(s))).collect();
    let mut first = None::<Instant>;
    for close in closes {
        let at = joined(close, HANG, "a slow connection's close").await;
        first = Some(first.map_or(at, |first| first.min(at)));
    }
    let first = first.unwrap().duration_since(started);
    assert!(
        first >= Duration::from_millis(4900),
        "none is closed before the header-read timeout (5s): the first after {first:?}"
    );
}

/// The client side's other limits: a connection idle past the keep-alive timeout is
/// closed (not before); a body that does not arrive within the request-body timeout is
/// answered 408; beyond `--max-connections`, a new connection waits until one closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_slow_bodies_and_the_connection_cap() {
    let app = Router::new().fallback(|body: String| async move { format!("got {body}") });
    let origin = serve(app).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--keep-alive-timeout",
        "2s",
        "--request-body-timeout",
        "2s",
        "--header-read-timeout",
        "3s",
        "--max-connections",
        "2",
    ]);

    let mut idle = TcpStream::connect(sidecar.listen).await.unwrap();
    idle.write_all(b"GET /a HTTP/1.1\r\nHost: shop.example\r\n\r\n")
        .await
        .unwrap();
    let answer = read_until(&mut idle, "got ").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let answered = Instant::now();
    let idled = closed(idle).await.duration_since(answered);
    assert!(
        idled >= Duration::from_millis(1950),
        "closed after {idled:?}, before the keep-alive timeout (2s)"
    );

    let mut slow = TcpStream::connect(sidecar.listen).await.unwrap();
    slow.write_all(b"POST /b HTTP/1.1\r\nHost: shop.example\r\nContent-Length: 10\r\n\r\nabc")
        .await
        .unwrap();
    let sent = Instant::now();
    let answer = read_until(&mut slow, "\r\n\r\n").await;
    let waited = sent.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        waited >= Duration::from_millis(1950),
        "answered after {waited:?}, before the request-body timeout (2s)"
    );
    drop(slow);

    // Two connections that say nothing hold both places; a third waits in the accept
    // queue until the header-read timeout (3s) closes them.
    let quiet: Vec<TcpStream> = vec![
        TcpStream::connect(sidecar.listen).await.unwrap(),
        TcpStream::connect(sidecar.listen).await.unwrap(),
    ];
    let asked = Instant::now();
    let third = fetch(sidecar.listen, "/c", &[]).await;
    let waited = asked.elapsed();
    assert_eq!(third.status, StatusCode::OK, "{}", third.body);
    assert!(
        waited >= Duration::from_millis(2500),
        "served after {waited:?}: the cap of 2 was not held"
    );
    drop(quiet);
}

/// An HTTP/2 client with prior knowledge (h2c) is served as an HTTP/1.1 one is: a
/// hundred concurrent streams on one connection for a cold key make one origin call,
/// and then it gets hits, and a miss for another key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_share_one_fill_and_get_hits() {
    let (origin, calls, gate) = origin(0).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--follow-origin",
        "false",
        "--fresh",
        "60s",
        "--lease",
        "30s",
    ]);
    let stream = TcpStream::connect(sidecar.listen).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let get = |path: &str| {
        let mut sender = sender.clone();
        let request = http::Request::get(format!("http://shop.example{path}"))
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        async move {
            let response = sender.send_request(request).await.unwrap();
            let (parts, body) = response.into_parts();
            let body = http_body_util::BodyExt::collect(body)
                .await
                .unwrap()
                .to_bytes();
            (parts, String::from_utf8_lossy(&body).into_owned())
        }
    };
    let streams: Vec<_> = (0..100).map(|_| tokio::spawn(get("/cold"))).collect();
    assert!(
        eventually(HANG, || async { calls.load(Ordering::SeqCst) == 1 }).await,
        "the fill reaches the origin"
    );
    gate.send_replace(true);
    for stream in streams {
        let (parts, body) = joined(stream, HANG, "an h2 stream").await;
        assert_eq!(parts.version, http::Version::HTTP_2);
        assert_eq!(parts.status, StatusCode::OK);
        assert_eq!(body, "/cold call 1");
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "one origin call for 100 streams"
    );
    let (hit, body) = get("/cold").await;
    assert_eq!(
        (hit.headers["x-cache"].to_str().unwrap(), body.as_str()),
        ("hit", "/cold call 1")
    );
    let (miss, body) = get("/other").await;
    assert_eq!(
        (miss.headers["x-cache"].to_str().unwrap(), body.as_str()),
        ("miss", "/other call 2")
    );
}

/// TLS termination and HTTP/2 to the origin: a sidecar with `--tls-cert` in front of
/// the origin, and one in front of it with an https:// upstream (checked against
/// `--upstream-ca`), which speaks HTTP/2 to it by ALPN; and a sidecar that speaks h2c
/// to an http:// upstream with `--upstream-http2`. Each hop's `Via` names the
/// version it received.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_termination_and_http2_to_the_origin() {
    let dir = tempfile::tempdir().unwrap();
    support::tls::authority(dir.path(), "ca");
    support::tls::signed(
        dir.path(),
        "server",
        "127.0.0.1",
        "subjectAltName=IP:127.0.0.1",
    );
    let file = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let (origin, seen) = recording_origin().await;
    let edge = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--tls-cert",
        &file("server.crt"),
        "--tls-key",
        &file("server.key"),
    ]);
    let front = Sidecar::start(&[
        "--upstream",
        &format!("https://{}", edge.listen),
        "--upstream-ca",
        &file("ca.crt"),
    ]);
    let got = fetch(front.listen, "/tls", &[]).await;
    assert_eq!(got.status, StatusCode::OK, "{}", got.body);
    assert_eq!(got.body, "body");
    {
        let seen = seen.lock().unwrap();
        let via: Vec<_> = seen[0].get_all("via").iter().collect();
        assert_eq!(via, ["1.1 stampede-sidecar", "2 stampede-sidecar"]);
        assert_eq!(seen[0]["x-forwarded-proto"], "https");
    }

    let plain = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let h2c = Sidecar::start(&[
        "--upstream",
        &format!("http://{}", plain.listen),
        "--upstream-http2",
        "true",
    ]);
    let got = fetch(h2c.listen, "/h2c", &[]).await;
    assert_eq!(got.status, StatusCode::OK, "{}", got.body);
    let seen = seen.lock().unwrap();
    let via: Vec<_> = seen[1].get_all("via").iter().collect();
    assert_eq!(via, ["1.1 stampede-sidecar", "2 stampede-sidecar"]);
    assert_eq!(seen[1]["x-forwarded-proto"], "http");

    // A certificate that is not PEM is refused at start, naming the setting.
    let not_pem = file("not.pem");
    std::fs::write(&not_pem, "not a certificate").unwrap();
    let out = run(&[
        "--tls-cert",
        &not_pem,
        "--tls-key",
        &file("server.key"),
        "--check",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("tls_cert") && err.contains("not.pem"), "{err}");
}

/// Which Redis: one server, a Cluster or Sentinel's primary, one at a time; `--check`
/// says which it would use; a TLS file that is not PEM is refused at start, naming the
/// setting.
#[test]
fn redis_backends_are_checked_and_named() {
    let out = run(&[
        "--redis-cluster",
        "redis://10.0.0.1:7000",
        "--redis-cluster",
        "redis://user:hunter2@10.0.0.2:7000",
        "--check",
    ]);
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        said.contains("Redis Cluster from redis://10.0.0.1:7000, redis://user:***@10.0.0.2:7000"),
        "{said}"
    );
    let out = run(&[
        "--redis-sentinel",
        "redis://10.0.0.5:26379",
        "--redis-sentinel-service",
        "cache",
        "--check",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("Redis Sentinel service cache from redis://10.0.0.5:26379"),
        "{}",
        text(&out.stdout)
    );
    let out = run(&["--check"]);
    assert!(text(&out.stdout).contains("the local cache only"));
    let out = run(&["--redis", "redis://127.0.0.1:6379", "--check"]);
    assert!(text(&out.stdout).contains("Redis at redis://127.0.0.1:6379"));

    // Refused, naming what.
    let dir = tempfile::tempdir().unwrap();
    let not_pem = dir.path().join("ca.pem");
    std::fs::write(&not_pem, "not a certificate").unwrap();
    let not_pem = not_pem.to_str().unwrap();
    let both = write_config(
        dir.path(),
        "redis = \"redis://10.0.0.1:6379\"\nredis_cluster = [\"redis://10.0.0.2:7000\"]\n",
    );
    for (args, named) in [
        (
            vec!["--redis", "redis://a:1", "--redis-cluster", "redis://b:2"],
            "--redis-cluster",
        ),
        (
            vec!["--redis-sentinel", "redis://a:26379"],
            "--redis-sentinel-service",
        ),
        (
            vec!["--redis", "rediss://127.0.0.1:6380", "--redis-ca", not_pem],
            "redis_ca",
        ),
        (vec!["--config", &both], "`redis`"),
        (vec!["--redis-username", "catalog"], "redis_username"),
        (
            vec!["--redis-cluster", "http://10.0.0.1:7000"],
            "redis_cluster",
        ),
    ] {
        let out = run(&[&args[..], &["--check"]].concat());
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(named), "{args:?} names {named}: {err}");
        assert!(!err.contains("hunter2"));
    }
}

/// Three sidecars on a six-node Redis Cluster (three primaries, a replica each) act as
/// one fleet: a cold key asked of all three at once reaches the origin once; under
/// steady load, each key is refreshed at most once per freshness window among them;
/// and a primary killed under load gives no 5xx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sidecars_on_a_cluster_are_one_fleet_through_a_failover() {
    use std::sync::atomic::AtomicBool;

    let mut cluster = support::RedisCluster::start_failing_over_after(Duration::from_secs(2));
    let (origin, calls, gate) = origin(0).await;
    let mut args: Vec<String> = [
        "--upstream",
        &format!("http://{origin}"),
        "--follow-origin",
        "false",
        "--fresh",
        "1s",
        "--grace",
        "60s",
        "--lease",
        "30s",
        "--cold-wait",
        "30s",
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .collect();
    for url in cluster.urls() {
        args.extend(["--redis-cluster".to_owned(), url]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let fleet = [
        Sidecar::start(&args),
        Sidecar::start(&args),
        Sidecar::start(&args),
    ];
    const KEYS: u64 = 6;

    // Cold: every key asked of every sidecar at once, five times each.
    let mut asked = Vec::new();
    for n in 0..KEYS {
        for sidecar in &fleet {
            for _ in 0..5 {
                let addr = sidecar.listen;
                asked.push(tokio::spawn(async move {
                    fetch(addr, &format!("/items/{n}"), &[]).await
                }));
            }
        }
    }
    assert!(
        eventually(HANG, || async { calls.load(Ordering::SeqCst) >= KEYS }).await,
        "every key's fill reaches the origin"
    );
    gate.send_replace(true);
    for task in asked {
        let got = joined(task, HANG, "a cold request").await;
        assert_eq!(got.status, StatusCode::OK, "{}", got.body);
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        KEYS,
        "one origin call per key for the three sidecars"
    );

    // Load on every sidecar and key, counting what is answered and any 5xx.
    let stop = Arc::new(AtomicBool::new(false));
    let listens: Vec<SocketAddr> = fleet.iter().map(|s| s.listen).collect();
    let workers: Vec<_> = (0..6)
        .map(|w| {
            let (stop, listens) = (stop.clone(), listens.clone());
            tokio::spawn(async move {
                let (mut answered, mut failed) = (0u64, Vec::new());
                let mut i = w;
                while !stop.load(Ordering::Relaxed) {
                    let addr = listens[i % listens.len()];
                    let got = fetch(addr, &format!("/items/{}", i as u64 % KEYS), &[]).await;
                    if got.status.is_server_error() {
                        failed.push(format!("{}: {}", got.status, got.body));
                    }
                    answered += 1;
                    i += 1;
                }
                (answered, failed)
            })
        })
        .collect();

    // Steady: at most one refresh per key per window among the three.
    let (before, started) = (calls.load(Ordering::SeqCst), Instant::now());
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (refreshed, took) = (calls.load(Ordering::SeqCst) - before, started.elapsed());
    let windows = took.as_secs() + 2;
    assert!(
        refreshed <= KEYS * windows,
        "{refreshed} origin calls for {KEYS} keys in {took:?} (windows of 1s)"
    );
    assert!(refreshed >= KEYS, "entries were refreshed: {refreshed}");

    // A primary dies under load; its replica takes over.
    let victim = cluster.primaries()[0];
    cluster.server(victim).kill();
    assert!(
        eventually(Duration::from_secs(30), || async {
            cluster.primaries().len() == 3
        })
        .await,
        "no replica took over from the killed primary on {victim}"
    );
    cluster.wait_formed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let mut answered = 0;
    for worker in workers {
        let (n, failed) = joined(worker, HANG, "a load worker").await;
        assert!(failed.is_empty(), "5xx under a failover: {failed:?}");
        answered += n;
    }
    eprintln!("{answered} answered through the failover; {refreshed} refreshes in {took:?}");
    assert!(answered > 100, "only {answered} requests were answered");
}

/// The access log: off by default; with `--access-log json`, one line per request with
/// how it was served and the origin's time when it called the origin, and never a
/// secret (no cookie, no `Authorization`, no query value); `common` writes the Common
/// Log Format.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_says_how_each_request_was_served_and_no_secret() {
    let (origin, _calls, _gate) = origin(u64::MAX).await;
    let upstream = format!("http://{origin}");
    let base = [
        "--upstream",
        &upstream,
        "--follow-origin",
        "false",
        "--fresh",
        "60s",
    ];
    let lines = |sidecar: &Sidecar, starts: &str| -> Vec<String> {
        let log = sidecar.log();
        log.lines()
            .filter(|l| l.starts_with(starts))
            .map(str::to_owned)
            .collect()
    };

    let quiet = Sidecar::start(&base);
    assert_eq!(
        fetch(quiet.listen, "/items/1", &[]).await.status,
        StatusCode::OK
    );

    let sidecar = Sidecar::start(&[&base[..], &["--access-log", "json"]].concat());
    let secrets = [
        ("cookie", "session=cookie-secret"),
        ("authorization", "Bearer auth-secret"),
        ("user-agent", "test-agent/1"),
    ];
    let miss = fetch(sidecar.listen, "/items/1?token=query-secret&page=2", &[]).await;
    let hit = fetch(sidecar.listen, "/items/1?token=query-secret&page=2", &[]).await;
    let posted = post_json(sidecar.listen, "/items/2", &secrets, "{}").await;
    assert_eq!(
        [miss.x_cache(), hit.x_cache(), posted.x_cache()],
        ["miss", "hit", "bypass"]
    );
    assert!(
        eventually(HANG, || async { lines(&sidecar, "{").len() == 3 }).await,
        "three lines:\n{}",
        sidecar.log()
    );
    let logged: Vec<serde_json::Value> = lines(&sidecar, "{")
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Each by what it says: a line is written once its answer's last byte is, and a
    // connection's thread may be preempted between the two, after the client has its
    // answer and asked again on another connection.
    let by = |key: &str, value: &str| logged.iter().find(|l| l[key] == value).unwrap();
    let (miss, hit, posted) = (
        by("cache", "miss"),
        by("cache", "hit"),
        by("method", "POST"),
    );
    assert_eq!(miss["path"], "/items/1?token&page", "{miss}");
    assert_eq!(
        (&miss["method"], &miss["status"], &miss["cache"]),
        (&"GET".into(), &200.into(), &"miss".into())
    );
    assert!(miss["upstream_ms"].as_f64().is_some(), "{miss}");
    assert_eq!(miss["peer"], "127.0.0.1");
    assert_eq!(miss["protocol"], "HTTP/1.1");
    assert_eq!(
        miss["bytes"].as_u64(),
        Some("/items/1 call 1".len() as u64),
        "{miss}"
    );
    assert!(miss["duration_ms"].as_f64().is_some(), "{miss}");
    assert_eq!(hit["cache"], "hit");
    assert!(hit["upstream_ms"].is_null(), "a hit calls no origin: {hit}");
    assert_eq!(
        (&posted["method"], &posted["cache"]),
        (&"POST".into(), &"bypass".into())
    );
    assert_eq!(posted["user_agent"], "test-agent/1");
    let log = sidecar.log();
    for secret in ["cookie-secret", "auth-secret", "query-secret"] {
        assert!(!log.contains(secret), "{secret} is logged:\n{log}");
    }
    assert!(
        lines(&quiet, "{").is_empty(),
        "off by default:\n{}",
        quiet.log()
    );

    let common = Sidecar::start(&[&base[..], &["--access-log", "common"]].concat());
    assert_eq!(
        fetch(common.listen, "/items/3", &[]).await.status,
        StatusCode::OK
    );
    assert!(
        eventually(HANG, || async {
            !lines(&common, "127.0.0.1 - - [").is_empty()
        })
        .await,
        "a common line:\n{}",
        common.log()
    );
    let line = &lines(&common, "127.0.0.1 - - [")[0];
    assert!(
        line.contains("] \"GET /items/3 HTTP/1.1\" 200 15 cache=miss duration_ms="),
        "{line}"
    );
}

/// The access log's duration runs to the last byte of the answer written, not to its
/// head: a 12 MiB hit (one piece of memory, handed over at once) read by a client that
/// takes at most 128 KiB every 30 ms (about 3 s in all) is logged as taking more than a
/// second, the kernel's buffers (a few MiB) left aside. (It was logged at a few
/// milliseconds.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_times_an_answer_to_its_last_byte() {
    const BIG: usize = 12 << 20;
    let app =
        Router::new().fallback(|| async { ([("cache-control", "max-age=60")], vec![b'x'; BIG]) });
    let origin = serve(app).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--access-log",
        "json",
    ]);
    assert_eq!(fetch(sidecar.listen, "/big", &[]).await.body.len(), BIG);
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(128 << 10).unwrap();
    let mut stream = socket.connect(sidecar.listen).await.unwrap();
    stream
        .write_all(b"GET /big HTTP/1.1\r\nHost: shop.example\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let mut got = 0usize;
    let mut buf = vec![0u8; 128 << 10];
    loop {
        match within(HANG, stream.read(&mut buf), "reading the hit").await {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let took = started.elapsed();
    assert!(got > BIG, "the whole answer came ({got} bytes)");
    let logged = || {
        sidecar.log().lines().find_map(|l| {
            let line: serde_json::Value = serde_json::from_str(l).ok()?;
            (line["cache"] == "hit").then(|| line["duration_ms"].as_f64().unwrap())
        })
    };
    assert!(
        eventually(HANG, || async { logged().is_some() }).await,
        "{}",
        sidecar.log()
    );
    let ms = logged().unwrap();
    assert!(
        ms >= 1000.0,
        "the hit is logged at {ms} ms; its client took {took:?} to read it"
    );
    assert!(
        ms <= took.as_secs_f64().mul_add(1000.0, 50.0),
        "{ms} ms, read in {took:?}"
    );
}

/// A client that stops reading holds nothing for long: with `--send-timeout 1s`, a
/// connection whose answer (32 MiB, more than the sockets hold) has not moved for a
/// second is closed, and the client gets no more than what was in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_after_the_send_timeout() {
    const BIG: usize = 32 << 20;
    let app = Router::new().fallback(|| async { vec![b'x'; BIG] });
    let origin = serve(app).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--send-timeout",
        "1s",
    ]);
    let mut stream = TcpStream::connect(sidecar.listen).await.unwrap();
    stream
        .write_all(b"POST /big HTTP/1.1\r\nHost: shop.example\r\nContent-Length: 0\r\n\r\n")
        .await
        .unwrap();
    // Not reading: the answer fills the sockets and stops moving. Long enough for the
    // second to pass on a busy machine; what matters is what arrives next.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut got = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match within(HANG, stream.read(&mut buf), "reading the rest").await {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
        assert!(
            got < BIG,
            "the whole answer arrived: the connection was not cut"
        );
    }
    assert!(got > 0, "part of the answer was in flight");
}

/// The value of the sidecar's counter `name` with the label `label` (`timeout="send"`),
/// 0 while it has none.
async fn counter(sidecar: &Sidecar, name: &str, label: &str) -> u64 {
    let metrics = fetch(
        sidecar.metrics.expect("a metrics listener"),
        "/metrics",
        &[],
    )
    .await;
    metrics
        .body
        .lines()
        .find(|l| l.starts_with(name) && l.contains(label))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// An origin that pauses is not a client that does not read: with `--send-timeout 1s`,
/// an event stream whose origin sends an event, waits 3 s (a heartbeat longer than the
/// send timeout) and sends another reaches its reader whole, and no send timeout is
/// counted. (The time its body waited on the origin counted as the client's, and the
/// connection was cut after a second, counted as `send`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_that_pauses_is_not_a_client_that_does_not_read() {
    let app = Router::new().fallback(|| async {
        let events = futures_util::stream::unfold(0, |n| async move {
            match n {
                0 => Some((
                    Ok::<_, std::io::Error>(bytes::Bytes::from("data: 1\n\n")),
                    1,
                )),
                1 => {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    Some((Ok(bytes::Bytes::from("data: 2\n\n")), 2))
                }
                _ => None,
            }
        });
        (
            [("content-type", "text/event-stream")],
            axum::body::Body::from_stream(events),
        )
    });
    let origin = serve(app).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--send-timeout",
        "1s",
        "--upstream-idle-timeout",
        "30s",
        "--metrics",
        "127.0.0.1:0",
    ]);
    let got = fetch(sidecar.listen, "/events", &[]).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.body, "data: 1\n\ndata: 2\n\n");
    let cut = counter(
        &sidecar,
        "stampede_sidecar_client_timeouts_total",
        "timeout=\"send\"",
    );
    assert_eq!(cut.await, 0);
}

/// A client byte stream whose first write sends two bytes and then waits 300 ms, so
/// that the server's first read has them alone: HTTP/2's preface split as a slow link
/// may split it.
struct SplitFirst {
    stream: TcpStream,
    state: Split,
}

enum Split {
    First,
    Pausing(std::pin::Pin<Box<tokio::time::Sleep>>),
    Done,
}

impl tokio::io::AsyncRead for SplitFirst {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for SplitFirst {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            match &mut this.state {
                Split::First => {
                    let n = buf.len().min(2);
                    let written = std::pin::Pin::new(&mut this.stream).poll_write(cx, &buf[..n]);
                    if let Poll::Ready(Ok(_)) = written {
                        this.state = Split::Pausing(Box::pin(tokio::time::sleep(
                            Duration::from_millis(300),
                        )));
                    }
                    return written;
                }
                Split::Pausing(sleep) => {
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    this.state = Split::Done;
                }
                Split::Done => return std::pin::Pin::new(&mut this.stream).poll_write(cx, buf),
            }
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Speaks HTTP/2 on `io` with a ping every 300 ms, idle or not; asks for one page, and
/// returns how long after its answer the sidecar closed the connection.
async fn idle_http2_closed_after<IO>(io: IO) -> Duration
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive_interval(Duration::from_millis(300))
        .keep_alive_while_idle(true)
        .handshake(TokioIo::new(io))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let request = http::Request::get("http://shop.example/idle")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let response = within(HANG, sender.send_request(request), "the h2 request")
        .await
        .unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::OK);
    let answered = Instant::now();
    let _ = http_body_util::BodyExt::collect(response.into_body()).await;
    let _ = joined(conn, HANG, "the h2 connection").await;
    answered.elapsed()
}

/// An idle HTTP/2 connection is held for the keep-alive timeout however its client said
/// HTTP/2: over TLS without ALPN (prior knowledge), and in plain text with its preface
/// split so that the first read has two bytes. Its pings are not a request's head: with
/// a header-read timeout of 1 s and a keep-alive timeout of 4 s, a connection that pings
/// every 300 ms is closed after 4 s, as `keep_alive`. (Taken as HTTP/1.1, its first
/// ping began a request's head, and it was closed a second later as `header_read`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http2_is_told_by_its_preface_without_alpn_or_split() {
    let dir = tempfile::tempdir().unwrap();
    support::tls::authority(dir.path(), "ca");
    support::tls::signed(
        dir.path(),
        "server",
        "127.0.0.1",
        "subjectAltName=IP:127.0.0.1",
    );
    let file = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let (origin, _calls, _gate) = origin(u64::MAX).await;
    let limits = [
        "--keep-alive-timeout",
        "4s",
        "--header-read-timeout",
        "1s",
        "--metrics",
        "127.0.0.1:0",
    ];
    let upstream = format!("http://{origin}");
    let mut tls_args = vec!["--upstream", upstream.as_str()];
    tls_args.extend(limits);
    let (cert, key) = (file("server.crt"), file("server.key"));
    tls_args.extend(["--tls-cert", cert.as_str(), "--tls-key", key.as_str()]);
    let tls = Sidecar::start(&tls_args);
    let mut plain_args = vec!["--upstream", upstream.as_str()];
    plain_args.extend(limits);
    let plain = Sidecar::start(&plain_args);

    // TLS, no ALPN offered.
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let ca = std::fs::read(dir.path().join("ca.crt")).unwrap();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&ca) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    assert!(config.alpn_protocols.is_empty());
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = TcpStream::connect(tls.listen).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let stream = connector.connect(name, tcp).await.unwrap();
    let split = SplitFirst {
        stream: TcpStream::connect(plain.listen).await.unwrap(),
        state: Split::First,
    };
    let (over_tls, split) = tokio::join!(
        idle_http2_closed_after(stream),
        idle_http2_closed_after(split)
    );
    for (how, after, sidecar) in [
        ("TLS without ALPN", over_tls, &tls),
        ("split", split, &plain),
    ] {
        assert!(
            after >= Duration::from_millis(3900),
            "{how}: closed {after:?} after its answer, before the keep-alive timeout (4s)"
        );
        let name = "stampede_sidecar_client_timeouts_total";
        assert_eq!(
            counter(sidecar, name, "timeout=\"keep_alive\"").await,
            1,
            "{how}"
        );
        assert_eq!(
            counter(sidecar, name, "timeout=\"header_read\"").await,
            0,
            "{how}"
        );
    }
}

/// With the access log on, SIGTERM still drains and exits 0 (its thread never holds
/// standard output while it waits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_with_the_access_log_on() {
    let (origin, _calls, _gate) = origin(u64::MAX).await;
    let mut sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--access-log",
        "json",
    ]);
    assert_eq!(
        fetch(sidecar.listen, "/items/1", &[]).await.status,
        StatusCode::OK
    );
    assert!(
        eventually(HANG, || async {
            sidecar.log().contains("\"method\":\"GET\"")
        })
        .await,
        "the request is logged:\n{}",
        sidecar.log()
    );
    sidecar.signal("TERM");
    assert_eq!(sidecar.exited(HANG).await, Some(0), "{}", sidecar.log());
    assert!(sidecar.log().contains("drained"), "{}", sidecar.log());
}

/// The access log is bounded by bytes, not lines: with standard output stalled (a pipe
/// nobody reads), 3,000 requests each with an 8 KiB `User-Agent` (24 MiB of lines) keep
/// at most 16 MiB waiting, and the rest are dropped and counted; the requests are all
/// answered. (Bounded by 65,536 lines, none was dropped, and a client choosing long
/// lines made the queue hold gigabytes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_access_log_holds_at_most_its_bytes_and_counts_the_rest() {
    use std::io::BufRead;
    const REQUESTS: usize = 3000;
    let (origin, _calls, _gate) = origin(u64::MAX).await;
    let mut child = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
        .args(["--upstream", &format!("http://{origin}")])
        .args(["--access-log", "json"])
        .env_clear()
        .env("STAMPEDE_GUARD_SECRET", SECRET)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // What it prints until it listens is read; then standard output is never read again.
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let (mut listen, mut metrics) = (None, None);
    while listen.is_none() {
        let mut line = String::new();
        assert!(
            stdout.read_line(&mut line).unwrap() > 0,
            "it printed where it listens"
        );
        match support::sidecar::announced(&line) {
            Some(("metrics", addr)) => metrics = Some(addr),
            Some(("listen", addr)) => listen = Some(addr),
            _ => {}
        }
    }
    let (listen, metrics) = (listen.unwrap(), metrics.unwrap());
    let agent: &'static str = Box::leak("a".repeat(8 * 1024).into_boxed_str());
    let sent = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let sent = sent.clone();
            tokio::spawn(async move {
                while (sent.fetch_add(1, Ordering::SeqCst) as usize) < REQUESTS {
                    let got = fetch(listen, "/items/1", &[("user-agent", agent)]).await;
                    assert_eq!(got.status, StatusCode::OK);
                }
            })
        })
        .collect();
    for client in clients {
        joined(client, Duration::from_secs(120), "a client").await;
    }
    let scraped = fetch(metrics, "/metrics", &[]).await.body;
    let dropped: u64 = scraped
        .lines()
        .find_map(|l| l.strip_prefix("stampede_sidecar_access_log_dropped_total "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    // 24 MiB of lines, at most 16 MiB waiting and 64 KiB in the pipe: about a third
    // dropped.
    assert!(
        (500..REQUESTS as u64).contains(&dropped),
        "{dropped} lines dropped of {REQUESTS}"
    );
    let _ = child.kill();
    let _ = child.wait();
    drop(stdout);
}

#[test]
fn the_documented_config_is_accepted() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/sidecar.toml");
    let out = run(&["--config", fixture, "--check"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("settings ok: 3 route(s)"));
}

/// The sidecar guide's production config is the fixture, and is accepted as it stands (its
/// files made for the test: certificates, authorities, the secret).
#[test]
fn the_production_config_is_accepted() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sidecar-production.toml"
    );
    let config = std::fs::read_to_string(fixture).unwrap();
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/sidecar.md")).unwrap();
    assert!(
        readme.contains(&format!("```toml\n{config}```")),
        "the sidecar guide shows tests/fixtures/sidecar-production.toml as it is"
    );
    let dir = tempfile::tempdir().unwrap();
    support::tls::authority(dir.path(), "ca");
    support::tls::signed(
        dir.path(),
        "server",
        "127.0.0.1",
        "subjectAltName=IP:127.0.0.1",
    );
    for (from, to) in [
        ("server.crt", "cert.pem"),
        ("server.key", "key.pem"),
        ("ca.crt", "origin-ca.pem"),
        ("ca.crt", "redis-ca.pem"),
    ] {
        std::fs::copy(dir.path().join(from), dir.path().join(to)).unwrap();
    }
    std::fs::write(dir.path().join("secret"), SECRET).unwrap();
    let config = config.replace(
        "/etc/stampede-sidecar/",
        &format!("{}/", dir.path().display()),
    );
    let path = dir.path().join("production.toml");
    std::fs::write(&path, config).unwrap();
    let child = Command::new(BIN)
        .args(["--config", path.to_str().unwrap(), "--check"])
        .env_clear()
        .env("STAMPEDE_SIDECAR_REDIS_PASSWORD", "a password")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_output(child);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.contains("settings ok: 2 route(s), Redis Cluster from rediss://redis-0.internal"),
        "{said}"
    );
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
        "--metrics",
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

    // `--metrics` on port 0: the address it prints is the one it bound, and serves the
    // counts of what was just answered.
    let metrics = fetch(
        sidecar.metrics.expect("a metrics listener"),
        "/metrics",
        &[],
    )
    .await;
    assert_eq!(metrics.status, StatusCode::OK);
    let hits = metrics
        .body
        .lines()
        .find(|l| l.starts_with("stampede_guard_requests_total") && l.contains("outcome=\"hit\""))
        .unwrap_or_else(|| panic!("no hit counter in:\n{}", metrics.body));
    assert!(hits.ends_with(" 1"), "{hits}");

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
    assert_eq!(by_path.body, r#"{"entries":1}"#);
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
    let said: serde_json::Value = serde_json::from_str(&soft.body).unwrap();
    assert_eq!(said, serde_json::json!({"tags": 1, "soft": true}));
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
    // Bad requests are refused, naming what is wrong, in JSON as the rest.
    let empty = post_json(admin, "/purge/tags", &auth, r#"{"tags": []}"#).await;
    assert_eq!(empty.status, StatusCode::BAD_REQUEST);
    let relative = post_json(admin, "/purge/path", &auth, r#"{"path": "items"}"#).await;
    assert_eq!(relative.status, StatusCode::BAD_REQUEST);
    let garbled = post_json(admin, "/purge/tags", &auth, r#"{"tags": "#).await;
    assert_eq!(garbled.status, StatusCode::BAD_REQUEST);
    let unknown = post_json(admin, "/purge/tags", &auth, r#"{"tag": ["all"]}"#).await;
    assert_eq!(unknown.status, StatusCode::UNPROCESSABLE_ENTITY);
    // As `curl -d` sends it: a form's content type.
    let (form, form_body) = raw_exchange(
        admin,
        &format!(
            "POST /purge/tags HTTP/1.1\r\nHost: admin.example\r\nAuthorization: Bearer s3cret\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{tags}",
            tags.len()
        ),
    )
    .await;
    assert_eq!(form, 415);
    assert!(form_body.contains("application/json"), "{form_body}");
    let (read, read_body) = raw_exchange(
        admin,
        "GET /purge/tags HTTP/1.1\r\nHost: admin.example\r\nAuthorization: Bearer s3cret\r\n\
         Connection: close\r\n\r\n",
    )
    .await;
    assert_eq!(read, 405);
    for (what, body) in [
        ("no token", &refused.body),
        ("a wrong token", &wrong.body),
        ("no tags", &empty.body),
        ("a relative path", &relative.body),
        ("a body cut short", &garbled.body),
        ("an unknown field", &unknown.body),
        ("a form", &form_body),
        ("a GET", &read_body),
    ] {
        let said: serde_json::Value =
            serde_json::from_str(body).unwrap_or_else(|_| panic!("{what}: not JSON: {body:?}"));
        assert!(said["error"].is_string(), "{what}: {said}");
    }
}

/// Sends `request` as it is on a connection of its own, reads until the server closes
/// it: the status and the body.
async fn raw_exchange(addr: SocketAddr, request: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    within(HANG, stream.read_to_end(&mut got), "the answer")
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (head[9..12].parse().unwrap(), body.to_owned())
}

/// Purge by path on a route keyed on `Accept-Language` (in the config file): the
/// entries of two values and of no value at all are cached (the origin called once
/// each); one `POST /purge/path` answers that it removed 3, and the next request for
/// each value reaches the origin again, once; the same path with another query stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_by_path_reaches_every_value_of_a_keyed_header() {
    let redis = RedisServer::start();
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "upstream = \"http://{origin}\"\ndefault = \"pass\"\nfollow_origin = false\n\
             fresh = \"1h\"\n\n\
             [[routes]]\nname = \"pages\"\nprefix = \"/pages/\"\n\
             key_headers = [\"accept-language\"]\n"
        ),
    );
    let sidecar = Sidecar::start(&[
        "--config",
        &config,
        "--redis",
        &redis.url(),
        "--admin",
        "127.0.0.1:0",
        "--admin-token",
        "s3cret",
    ]);
    let admin = sidecar.admin.expect("an admin listener");
    let auth = [("authorization", "Bearer s3cret")];
    let asks: [&[(&str, &str)]; 3] = [
        &[("accept-language", "fr")],
        &[("accept-language", "de")],
        &[],
    ];
    let page = |path: &'static str, headers: &'static [(&'static str, &'static str)]| {
        fetch(sidecar.listen, path, headers)
    };
    // Each of the three filled from the origin (calls `first`, `first + 1`, ...), then hit.
    let fill_all = |first: usize| async move {
        for (n, headers) in asks.into_iter().enumerate() {
            let got = page("/pages/7?page=2", headers).await;
            let body = format!("/pages/7 call {}", n + first);
            assert_eq!((got.x_cache(), &got.body), ("miss", &body), "{headers:?}");
            let again = page("/pages/7?page=2", headers).await;
            assert_eq!(
                (again.x_cache(), &again.body),
                ("hit", &body),
                "{headers:?}"
            );
        }
    };
    fill_all(1).await;
    let neighbour = page("/pages/7?page=3", asks[0]).await;
    assert_eq!(neighbour.body, "/pages/7 call 4");
    assert_eq!(calls.load(Ordering::SeqCst), 4);

    let purge = r#"{"path": "/pages/7?page=2"}"#;
    let refused = post_json(admin, "/purge/path", &[], purge).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    assert_eq!(page("/pages/7?page=2", asks[0]).await.x_cache(), "hit");
    let purged = post_json(admin, "/purge/path", &auth, purge).await;
    assert_eq!(purged.status, StatusCode::OK, "{}", purged.body);
    let answer: serde_json::Value = serde_json::from_str(&purged.body).unwrap();
    assert_eq!(answer, serde_json::json!({"entries": 3}));

    fill_all(5).await;
    let neighbour = page("/pages/7?page=3", asks[0]).await;
    assert_eq!(
        (neighbour.x_cache(), neighbour.body.as_str()),
        ("hit", "/pages/7 call 4")
    );
    assert_eq!(calls.load(Ordering::SeqCst), 7);
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
/// gets its range cut from it as it streams (its fill asked for the whole, whose length
/// it declares); the key's later callers pass through, and their `Range` goes to the
/// origin, which answers it.
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
    assert_eq!(
        (first.status, first.x_cache()),
        (StatusCode::PARTIAL_CONTENT, "pass")
    );
    assert_eq!(first.headers["content-range"], "bytes 0-9/20");
    assert_eq!(first.body, "0123456789");
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

/// A route's prefix matches whole segments of the path as the origin resolves it:
/// `/static` holds `/static/a.css`, not `/staticky`, and `/static/%2e%2e/account` (the
/// origin's `/account`) or an encoded `/` never land on it (web cache deception).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_holds_whole_segments_of_the_resolved_path() {
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "upstream = \"http://{origin}\"\ndefault = \"pass\"\nfresh = \"60s\"\n\
             follow_origin = false\n\n\
             [[routes]]\nname = \"static\"\nprefix = \"/static\"\n"
        ),
    );
    let sidecar = Sidecar::start(&["--config", &config]);
    let get = |path: &'static str| fetch(sidecar.listen, path, &[]);
    assert_eq!(get("/static/a.css").await.x_cache(), "miss");
    assert_eq!(get("/static/a.css").await.x_cache(), "hit");
    assert_eq!(get("/static").await.x_cache(), "miss");
    assert_eq!(get("/static/./b.css").await.x_cache(), "miss");
    for elsewhere in [
        "/staticky",
        "/static/%2e%2e/account",
        "/static/%2E%2E/account",
        "/static/../account",
        "/static%2F..%2Faccount",
    ] {
        for _ in 0..2 {
            assert_eq!(get(elsewhere).await.x_cache(), "bypass", "{elsewhere}");
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3 + 10);
}

/// A successful `POST` invalidates its URI for the fleet (RFC 9111 §4.4), by default;
/// a route with `invalidate_on_unsafe = false` keeps its entries (any client whose
/// `POST` the origin accepts could otherwise evict them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_may_keep_its_entries_through_unsafe_requests() {
    let (origin, seen) = recording_origin().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "upstream = \"http://{origin}\"\n\n\
             [[routes]]\nname = \"kept\"\nprefix = \"/kept\"\ninvalidate_on_unsafe = false\n\n\
             [[routes]]\nname = \"items\"\nprefix = \"/items\"\n"
        ),
    );
    let sidecar = Sidecar::start(&["--config", &config]);
    for (path, invalidated) in [("/items/1", true), ("/kept/1", false)] {
        assert_eq!(fetch(sidecar.listen, path, &[]).await.x_cache(), "miss");
        assert_eq!(fetch(sidecar.listen, path, &[]).await.x_cache(), "hit");
        let posted = post_json(sidecar.listen, path, &[], "{}").await;
        assert_eq!(posted.status, StatusCode::OK);
        let after = fetch(sidecar.listen, path, &[]).await;
        let want = if invalidated { "miss" } else { "hit" };
        assert_eq!(after.x_cache(), want, "{path}");
    }
    assert_eq!(seen.lock().unwrap().len(), 5, "3 fills and 2 POSTs");
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

/// A Redis that refuses connections, seen from outside: every answer is served, from the
/// origin once per key and then from the local cache, saying `detail=local-only` once the
/// breaker opened; the sidecar's log says why (the refusal) when it starts, once when
/// Redis first fails and once when the breaker opens, not once per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_redis_is_said_once_with_its_cause() {
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let refused = format!("redis://127.0.0.1:{}", support::server::free_port());
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--redis",
        &refused,
    ]);
    let mut local_only = 0;
    for n in 0..300 {
        let got = fetch(sidecar.listen, &format!("/max-age-60/{}", n % 20), &[]).await;
        assert_eq!(got.status, StatusCode::OK, "request {n}: {}", got.body);
        let status = got.headers["cache-status"].to_str().unwrap();
        local_only += usize::from(status.contains("detail=local-only"));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 20, "{}", sidecar.log());
    assert!(local_only >= 250, "{local_only} of 300 said local-only");
    let log = sidecar.log();
    let lines = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    let failed = log
        .lines()
        .find(|l| l.contains("Redis failed"))
        .unwrap_or_default();
    assert!(failed.contains("Connection refused"), "{log}");
    assert_eq!(lines("Redis failed"), 1, "{log}");
    assert_eq!(lines("Redis unavailable"), 1, "{log}");
    // And the sidecar's own line at start, which says why too.
    assert_eq!(lines("Redis does not answer"), 1, "{log}");
    assert_eq!(lines("Connection refused"), 3, "{log}");
}
