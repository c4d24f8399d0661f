//! The access log: what each line says (and no secret), its duration to the last
//! byte, SIGTERM with the log on, a stalled standard output bounded by bytes.

use super::*;

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
