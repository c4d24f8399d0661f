//! The client side: connections accepted (plain or TLS), HTTP/1.1 and HTTP/2 served on
//! them, and the limits a proxy at the edge needs.
//!
//! - **At most `max_connections` at once.** Beyond it the sidecar stops accepting: new
//!   connections wait in the listener's accept queue (the kernel's backlog) until one
//!   closes, rather than being refused, so that a burst is absorbed and not failed.
//! - **HTTP/1.1 with keep-alive and HTTP/2**, told apart by the connection's first bytes
//!   (h2c with prior knowledge) or, over TLS, by ALPN (`h2`, `http/1.1`).
//! - **A request's headers within `header_read_timeout`**, counted from the
//!   connection's start (the TLS handshake included) or from the first byte of the next
//!   request on a kept-alive connection; a connection that overruns is closed (a client
//!   that sends half a header block holds nothing for long).
//! - **An idle connection closed after `keep_alive_timeout`** (for HTTP/2, one with no
//!   stream open; it is sent a GOAWAY).
//! - **A request's body within `request_body_timeout`** of its headers; past it, the
//!   body fails, and the request is answered 408 (see [`RequestBodyTimeout`]).
//! - **An answer's bytes moving at least every `send_timeout`**: a client that stops
//!   reading (or an HTTP/2 client that opens no window) has its connection closed. The
//!   time an answer's body waits on the origin does not count: an origin that pauses
//!   (an event stream's heartbeat longer than the send timeout) is bounded by the
//!   origin's own idle timeout, not taken for a client that does not read.
//!
//! Each closing for a limit is counted in `stampede_sidecar_client_timeouts_total`
//! (label `timeout`: `header_read`, `keep_alive`, `request_body`, `send`); the open
//! connections are the gauge `stampede_sidecar_connections`.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::bodies::{Bounded, Tap, Tapped};
use crate::peer::{Peer, RequestBodyTimeout};
use crate::written::Written;

/// The client side's limits and TLS.
#[derive(Clone, Debug)]
pub(crate) struct Limits {
    pub(crate) max_connections: usize,
    pub(crate) header_read: Duration,
    pub(crate) keep_alive: Duration,
    pub(crate) body_read: Duration,
    pub(crate) send: Duration,
    pub(crate) tls: Option<Tls>,
}

/// Where the certificate chain and key of TLS termination are.
#[derive(Clone, Debug)]
pub(crate) struct Tls {
    pub(crate) cert: PathBuf,
    pub(crate) key: PathBuf,
}

impl Tls {
    /// Reads and checks the certificate chain and key. A refusal names the setting
    /// (`tls_cert` or `tls_key`) and says what is wrong.
    pub(crate) fn acceptor(&self) -> Result<TlsAcceptor, (&'static str, String)> {
        let certs = CertificateDer::pem_file_iter(&self.cert)
            .and_then(Iterator::collect::<Result<Vec<_>, _>>)
            .map_err(|e| ("tls_cert", format!("{}: {e}", self.cert.display())))?;
        if certs.is_empty() {
            return Err((
                "tls_cert",
                format!("{}: no PEM certificate in it", self.cert.display()),
            ));
        }
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|e| ("tls_key", format!("{}: {e}", self.key.display())))?;
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| ("tls_cert", e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| ("tls_key", format!("does not fit the certificate: {e}")))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(TlsAcceptor::from(Arc::new(config)))
    }
}

/// Serves `service` on `listener` until `stop` ends, then lets every connection finish
/// its requests (HTTP/1.1 connections close after their current response, HTTP/2 ones
/// get a GOAWAY) and returns when all have closed.
pub(crate) async fn serve<S>(
    listener: TcpListener,
    limits: Limits,
    tls: Option<TlsAcceptor>,
    service: S,
    stop: impl Future<Output = ()>,
) where
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // The limits are the connection task's (see `Activity`): hyper's own header timer
    // would arm and disarm a timer for every request.
    builder.http1().keep_alive(true).header_read_timeout(None);
    builder.http2().max_concurrent_streams(256);
    let shared = Arc::new(Shared {
        builder,
        limits,
        tls,
        draining: watch::Sender::new(false),
    });
    let permits = Arc::new(Semaphore::new(shared.limits.max_connections));
    // Each connection's task holds a sender: when all are gone, every one has closed.
    let (open, mut closed) = mpsc::channel::<()>(1);
    tokio::pin!(stop);
    loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => permit.expect("never closed"),
            () = &mut stop => break,
        };
        let (stream, addr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, or a connection reset before it was
                    // accepted: not the listener's end.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        let service = service.clone();
        let open = open.clone();
        tokio::spawn(async move {
            connection(stream, addr, &shared, service, permit).await;
            drop(open);
        });
    }
    drop(listener);
    shared.draining.send_replace(true);
    drop(open);
    let _ = closed.recv().await;
}

/// What every connection's task shares.
struct Shared {
    builder: auto::Builder<TokioExecutor>,
    limits: Limits,
    tls: Option<TlsAcceptor>,
    draining: watch::Sender<bool>,
}

/// One connection, from its handshake to its close.
async fn connection<S>(
    stream: TcpStream,
    addr: SocketAddr,
    shared: &Shared,
    service: S,
    _permit: OwnedSemaphorePermit,
) where
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let gauge = metrics::gauge!("stampede_sidecar_connections");
    gauge.increment(1);
    let activity = Arc::new(Activity::new());
    match &shared.tls {
        None => {
            let peer = Peer { addr, tls: false };
            drive(
                Watched::new(stream, &activity, None),
                peer,
                shared,
                service,
                activity,
            )
            .await;
        }
        Some(acceptor) => {
            match tokio::time::timeout(shared.limits.header_read, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => {
                    // Without ALPN a client may still speak HTTP/2 (prior knowledge):
                    // then its first bytes tell, as on a plain connection.
                    let h2 = stream.get_ref().1.alpn_protocol().map(|alpn| alpn == b"h2");
                    let peer = Peer { addr, tls: true };
                    let io = Watched::new(stream, &activity, h2);
                    drive(io, peer, shared, service, activity).await;
                }
                Ok(Err(error)) => tracing::debug!(%error, "TLS handshake failed"),
                Err(_) => client_timeout(Expired::HeaderRead),
            }
        }
    }
    gauge.decrement(1);
}

/// Serves HTTP on one connection's byte stream, closing it when a limit runs out.
async fn drive<IO, S>(io: IO, peer: Peer, shared: &Shared, service: S, activity: Arc<Activity>)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let body_read = shared.limits.body_read;
    let requests = activity.clone();
    let hyper_service = hyper::service::service_fn(move |request: Request<Incoming>| {
        // Made before the future, so that a request dropped half-way still ends.
        let end = RequestEnd::start(&requests);
        let mut request =
            request.map(|body| Body::new(Bounded::total(body, body_read, body_timed_out)));
        request.extensions_mut().insert(peer);
        request.extensions_mut().insert(requests.written.clone());
        let refused = crate::framing::refused(&request);
        let service = service.clone();
        async move {
            let response = match refused {
                // (The connection closes after it: what follows on it is not trusted.)
                Some(status) => {
                    let mut response = Response::new(Body::empty());
                    *response.status_mut() = status;
                    response.headers_mut().insert(
                        http::header::CONNECTION,
                        http::HeaderValue::from_static("close"),
                    );
                    response
                }
                None => match service.oneshot(request).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                },
            };
            let end = end.answering();
            Ok::<_, Infallible>(response.map(|body| Body::new(Tapped::new(body, end))))
        }
    });
    let conn = shared
        .builder
        .serve_connection(TokioIo::new(io), hyper_service);
    tokio::pin!(conn);
    let mut draining = shared.draining.subscribe();
    let mut shutting = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "connection ended with an error");
                }
                return;
            }
            _ = async { draining.wait_for(|d| *d).await.is_ok() }, if !shutting => {
                conn.as_mut().graceful_shutdown();
                shutting = true;
            }
            expired = activity.expired(&shared.limits) => {
                client_timeout(expired);
                if expired == Expired::KeepAlive {
                    // Idle: HTTP/1.1 closes at once, HTTP/2 says GOAWAY first.
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(1), conn.as_mut()).await;
                }
                // A stalled header read is cut: dropping the connection closes it.
                return;
            }
        }
    }
}

fn client_timeout(expired: Expired) {
    let timeout = match expired {
        Expired::HeaderRead => "header_read",
        Expired::KeepAlive => "keep_alive",
        Expired::Send => "send",
    };
    metrics::counter!("stampede_sidecar_client_timeouts_total", "timeout" => timeout).increment(1);
}

/// Which connection limit ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expired {
    HeaderRead,
    KeepAlive,
    /// An answer's bytes did not move for `send_timeout`: a client that does not read.
    Send,
}

/// Where a connection stands, for its limits.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Waiting for a request's headers since then.
    Head(Instant),
    /// Requests in flight: their bodies' timeout and the origin's bound them, and the
    /// send timeout their answers.
    Busy(usize),
    /// Nothing in flight since then.
    Idle(Instant),
}

/// A connection's phase, and its answers being written: how many, how many of them
/// wait on their bodies (the origin has not sent their next bytes yet), and when a
/// byte of them last moved.
#[derive(Clone, Copy, Debug)]
struct State {
    phase: Phase,
    answering: usize,
    waiting: usize,
    moved: Instant,
}

/// A connection's state, moved by its bytes and its requests, and looked at by its
/// task. Nothing is signalled when it moves (that would cost a wake-up and a timer per
/// request): the task wakes at the current deadline, and at least once per shortest
/// limit, as a deadline that begins later cannot end sooner than that.
struct Activity {
    state: Mutex<State>,
    /// What waits for the answers' bytes to be written (the access log's lines).
    written: Written,
}

impl Activity {
    fn new() -> Self {
        let now = Instant::now();
        Self {
            state: Mutex::new(State {
                phase: Phase::Head(now),
                answering: 0,
                waiting: 0,
                moved: now,
            }),
            written: Written::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Bytes arrived on an idle HTTP/1.1 connection: the next request's head has begun.
    fn bytes(&self) {
        let mut state = self.lock();
        if let Phase::Idle(_) = state.phase {
            state.phase = Phase::Head(Instant::now());
        }
    }

    /// Bytes of an answer were written.
    fn wrote(&self) {
        let mut state = self.lock();
        if state.answering > 0 {
            state.moved = Instant::now();
        }
    }

    fn started(&self) {
        let mut state = self.lock();
        state.phase = match state.phase {
            Phase::Busy(n) => Phase::Busy(n + 1),
            Phase::Head(_) | Phase::Idle(_) => Phase::Busy(1),
        };
    }

    /// A request's answer is handed over to be written.
    fn answering(&self) {
        let mut state = self.lock();
        state.answering += 1;
        state.moved = Instant::now();
    }

    /// An answer's body began (`true`) or ended (`false`) waiting on the origin. When
    /// its bytes come, the send timeout starts again from then.
    fn waiting(&self, waiting: bool) {
        let mut state = self.lock();
        if waiting {
            state.waiting += 1;
        } else {
            state.waiting = state.waiting.saturating_sub(1);
            state.moved = Instant::now();
        }
    }

    fn ended(&self, answered: bool, waiting: bool) {
        let mut state = self.lock();
        if answered {
            state.answering = state.answering.saturating_sub(1);
        }
        if waiting {
            state.waiting = state.waiting.saturating_sub(1);
        }
        state.phase = match state.phase {
            Phase::Busy(n) if n > 1 => Phase::Busy(n - 1),
            _ => Phase::Idle(Instant::now()),
        };
    }

    fn deadline(&self, limits: &Limits) -> Option<(Instant, Expired)> {
        let state = *self.lock();
        match state.phase {
            Phase::Head(since) => Some((since + limits.header_read, Expired::HeaderRead)),
            Phase::Idle(since) => Some((since + limits.keep_alive, Expired::KeepAlive)),
            // Some answer has bytes the client has not taken.
            Phase::Busy(_) if state.answering > state.waiting => {
                Some((state.moved + limits.send, Expired::Send))
            }
            Phase::Busy(_) => None,
        }
    }

    /// Ends when a limit runs out.
    async fn expired(&self, limits: &Limits) -> Expired {
        let shortest = limits.header_read.min(limits.keep_alive).min(limits.send);
        loop {
            let now = Instant::now();
            let wake = match self.deadline(limits) {
                Some((at, expired)) if at <= now => return expired,
                Some((at, _)) => at.min(now + shortest),
                None => now + shortest,
            };
            tokio::time::sleep_until(wake).await;
        }
    }
}

/// Ends a request's part in its connection's activity when dropped: with its response's
/// body (written out, or abandoned), or with its future if it never answered.
struct RequestEnd {
    activity: Arc<Activity>,
    answered: bool,
    /// Its answer's body waits on the origin: its last poll was pending.
    waiting: bool,
}

impl RequestEnd {
    fn start(activity: &Arc<Activity>) -> Self {
        activity.started();
        Self {
            activity: activity.clone(),
            answered: false,
            waiting: false,
        }
    }

    /// Its answer is handed over: the send timeout applies from now.
    fn answering(mut self) -> Self {
        self.activity.answering();
        self.answered = true;
        self
    }
}

impl Drop for RequestEnd {
    fn drop(&mut self) {
        self.activity.ended(self.answered, self.waiting);
    }
}

/// A request's end comes with its answer's body: the body is [`Tapped`] with it, and
/// tells when it waits on the origin.
impl Tap for RequestEnd {
    fn polled(&mut self, pending: bool) {
        if pending != self.waiting {
            self.waiting = pending;
            self.activity.waiting(pending);
        }
    }
}

/// A request body's time ran out: counted, and the error its body ends with.
fn body_timed_out() -> Box<dyn std::error::Error + Send + Sync> {
    metrics::counter!("stampede_sidecar_client_timeouts_total", "timeout" => "request_body")
        .increment(1);
    Box::new(RequestBodyTimeout)
}

/// A connection's byte stream, telling its [`Activity`] when bytes arrive on an idle
/// HTTP/1.1 connection. HTTP/2 (known by ALPN, or by its connection preface) is left
/// out: its pings and window updates are not the start of a request.
struct Watched<IO> {
    io: IO,
    activity: Arc<Activity>,
    speaks: Speaks,
}

/// What a connection speaks, as far as its first bytes told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Speaks {
    Http1,
    Http2,
    /// Its first bytes so far (this many) are the start of HTTP/2's preface.
    Unknown(usize),
}

impl Speaks {
    /// After `read` came: HTTP/2 once the preface's first line came whole, HTTP/1.1 at
    /// the first byte that is not the preface's (however the bytes were split in reads).
    fn after(self, read: &[u8]) -> Self {
        let Self::Unknown(matched) = self else {
            return self;
        };
        let expected = &H2_PREFACE[matched..];
        let n = read.len().min(expected.len());
        if read[..n] != expected[..n] {
            Self::Http1
        } else if matched + n == H2_PREFACE.len() {
            Self::Http2
        } else {
            Self::Unknown(matched + n)
        }
    }
}

impl<IO> Watched<IO> {
    /// `h2` as ALPN said, if it did: without it, the first bytes tell.
    fn new(io: IO, activity: &Arc<Activity>, h2: Option<bool>) -> Self {
        let speaks = match h2 {
            Some(true) => Speaks::Http2,
            Some(false) => Speaks::Http1,
            None => Speaks::Unknown(0),
        };
        Self {
            io,
            activity: activity.clone(),
            speaks,
        }
    }
}

impl<IO> Watched<IO> {
    /// Notes that bytes of an answer moved, if some were written.
    fn noted(&self, written: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        if let Poll::Ready(Ok(n)) = written
            && n > 0
        {
            self.activity.wrote();
        }
        written
    }
}

/// A connection that goes has written all it will.
impl<IO> Drop for Watched<IO> {
    fn drop(&mut self) {
        self.activity.written.flushed();
    }
}

/// The start of HTTP/2's connection preface.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

impl<IO: AsyncRead + Unpin> AsyncRead for Watched<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let read = &buf.filled()[before..];
        if !read.is_empty() {
            self.speaks = self.speaks.after(read);
            // (While unknown, the connection is still at its first request's head.)
            if self.speaks == Speaks::Http1 {
                self.activity.bytes();
            }
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Watched<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write(cx, buf);
        self.noted(written)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let flushed = Pin::new(&mut self.io).poll_flush(cx);
        if let Poll::Ready(Ok(())) = flushed {
            self.activity.written.flushed();
        }
        flushed
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.noted(written)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::Speaks;

    /// What the first bytes say, however they were split in reads.
    fn told(reads: &[&[u8]]) -> Speaks {
        reads
            .iter()
            .fold(Speaks::Unknown(0), |speaks, read| speaks.after(read))
    }

    #[test]
    fn the_preface_is_told_however_its_bytes_are_split() {
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        assert_eq!(told(&[preface]), Speaks::Http2);
        assert_eq!(told(&[b"P", b"R", b"I * HTTP/2.0\r\n"]), Speaks::Http2);
        assert_eq!(told(&[b"PR"]), Speaks::Unknown(2));
        assert_eq!(told(&[b"PR", b"IX /a HTTP/1.1\r\n"]), Speaks::Http1);
        assert_eq!(told(&[b"GET / HTTP/1.1\r\n"]), Speaks::Http1);
        assert_eq!(told(&[b"P", b"OST / HTTP/1.1\r\n"]), Speaks::Http1);
        // Once told, later bytes change nothing.
        assert_eq!(told(&[preface, b"GET / HTTP/1.1\r\n"]), Speaks::Http2);
        assert_eq!(told(&[b"GET / ", preface]), Speaks::Http1);
    }
}
