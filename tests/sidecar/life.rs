//! Starting and stopping: `--help` and `--version`, flags and config files refused
//! naming what is wrong, the documented configs accepted, a secret required with Redis,
//! and SIGTERM letting a refresh finish and write.

use super::*;

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
