//! Limits and timeouts at the edge: a black-holed origin, half-sent headers, idle
//! connections, slow bodies, the connection cap, a client that stops reading, an origin
//! that pauses.

use super::*;

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
