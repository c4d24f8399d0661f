//! TLS and HTTP/2: h2c clients sharing one fill, TLS termination and HTTP/2 to the
//! origin, idle HTTP/2 told by its preface however it comes.

use super::*;

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
