//! An origin on real TCP whose answers have no declared length: `GET /chunked/<MiB>`
//! streams that many MiB in 64 KiB frames, each a buffer of its own (as one from the
//! network is), its bytes a pattern a client checks ([`pattern_at`]), fresh for a
//! minute. It keeps, for each call, how many bytes it gave and when its body was let
//! go (the connection closed, or the body read to its end).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, StreamBody};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;

const FRAME: usize = 64 * 1024;
const MIB: u64 = 1024 * 1024;

/// The byte at `offset` of every answer.
pub(crate) fn pattern_at(offset: u64) -> u8 {
    (offset % 251) as u8
}

/// One call: the bytes its body gave so far, and when the body was let go.
#[derive(Debug, Default, Clone)]
pub(crate) struct Call {
    pub(crate) sent: u64,
    pub(crate) let_go: Option<Instant>,
}

/// The calls the origin got, in order; and a gate their bodies wait at, while closed.
#[derive(Clone)]
pub(crate) struct Calls(Arc<Mutex<Vec<Call>>>, Arc<tokio::sync::watch::Sender<bool>>);

impl Default for Calls {
    fn default() -> Self {
        Self(
            Arc::default(),
            Arc::new(tokio::sync::watch::Sender::new(true)),
        )
    }
}

impl Calls {
    pub(crate) fn get(&self) -> Vec<Call> {
        self.0.lock().unwrap().clone()
    }

    /// From now on, bodies send nothing (their heads go at once) until [`Self::open`].
    pub(crate) fn hold(&self) {
        self.1.send_replace(false);
    }

    pub(crate) fn open(&self) {
        self.1.send_replace(true);
    }
}

/// The body of one call: frames until `total`, its call's record kept up to date.
struct Frames {
    calls: Calls,
    index: usize,
    at: u64,
    total: u64,
    cycle: &'static [u8],
    /// What the pattern is shifted by (a body of another version).
    shift: u64,
}

impl Drop for Frames {
    fn drop(&mut self) {
        self.calls.0.lock().unwrap()[self.index].let_go = Some(Instant::now());
    }
}

impl Frames {
    fn next_frame(&mut self) -> Option<Bytes> {
        if self.at >= self.total {
            return None;
        }
        let len = (self.total - self.at).min(FRAME as u64) as usize;
        let from = ((self.at + self.shift) % 251) as usize;
        // A buffer of its own, as one read from the network.
        let frame = Bytes::copy_from_slice(&self.cycle[from..from + len]);
        self.at += len as u64;
        self.calls.0.lock().unwrap()[self.index].sent = self.at;
        Some(frame)
    }
}

/// The answer to a call for `path`: `/chunked/<MiB>` without a declared length, and
/// `/sized/<KiB>` with one; `/versioned/<KiB>` as `sized`, but each call's body another
/// (its pattern shifted by the call's number: see [`fetch_checked`]).
pub(crate) fn answer_path(calls: &Calls, path: &str) -> Response<BoxBody<Bytes, Infallible>> {
    let versioned = path.starts_with("/versioned/");
    if path.starts_with("/sized/") || versioned {
        let kib = mib_of(path);
        let mut response = answer_bytes(calls, kib * 1024, versioned);
        response
            .headers_mut()
            .insert("content-length", (kib * 1024).into());
        response
    } else {
        answer(calls, mib_of(path))
    }
}

/// The answer to a call for `mib` MiB: counted in `calls`, its body frames of their own.
pub(crate) fn answer(calls: &Calls, mib: u64) -> Response<BoxBody<Bytes, Infallible>> {
    answer_bytes(calls, mib * MIB, false)
}

fn answer_bytes(
    calls: &Calls,
    total: u64,
    versioned: bool,
) -> Response<BoxBody<Bytes, Infallible>> {
    let index = {
        let mut calls = calls.0.lock().unwrap();
        calls.push(Call::default());
        calls.len() - 1
    };
    let frames = Frames {
        calls: calls.clone(),
        index,
        at: 0,
        total,
        shift: if versioned { index as u64 % 251 } else { 0 },
        cycle: CYCLE.get_or_init(|| (0..FRAME as u64 + 251).map(pattern_at).collect()),
    };
    let gate = calls.1.subscribe();
    let stream = futures_util::stream::unfold(frames, move |mut frames| {
        let mut gate = gate.clone();
        async move {
            let _ = gate.wait_for(|open| *open).await;
            let frame = frames.next_frame()?;
            Some((Ok::<_, Infallible>(http_body::Frame::data(frame)), frames))
        }
    });
    Response::builder()
        .header("content-type", "application/octet-stream")
        .header("cache-control", "public, max-age=60")
        .body(StreamBody::new(stream).boxed())
        .unwrap()
}

/// A frame's worth of the pattern, from every offset of its cycle.
static CYCLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();

/// The MiB a path asks for: its last segment.
pub(crate) fn mib_of(path: &str) -> u64 {
    path.rsplit('/')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

/// Starts the origin on a free port.
pub(crate) async fn origin() -> (SocketAddr, Calls) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let calls = Calls::default();
    let served = calls.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let calls = served.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: Request<_>| {
                    let answer = answer_path(&calls, request.uri().path());
                    async move { Ok::<_, Infallible>(answer) }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, calls)
}

/// A process's resident memory and its peak since [`reset_peak`], in bytes, from
/// `/proc/<pid>/status` (`VmRSS`, `VmHWM`).
pub(crate) fn memory(pid: &str) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib = |field: &str| -> u64 {
        let line = status.lines().find(|l| l.starts_with(field)).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    };
    (kib("VmRSS:"), kib("VmHWM:"))
}

/// Resets a process's peak resident memory to what it holds now.
pub(crate) fn reset_peak(pid: &str) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

/// Reads an HTTP/1.1 answer without a declared length from `stream` for `within`,
/// checking every byte of its body against [`pattern_at`]; returns how many body bytes
/// came, and whether the body ended (its last chunk) within that time.
pub(crate) async fn read_checked(
    stream: &mut tokio::net::TcpStream,
    within: std::time::Duration,
) -> (u64, bool) {
    read_paced(stream, within, u64::MAX).await
}

/// [`read_checked`], at most `rate` bytes a second (as a slow client reads).
pub(crate) async fn read_paced(
    stream: &mut tokio::net::TcpStream,
    within: std::time::Duration,
    rate: u64,
) -> (u64, bool) {
    let checked = read_answer(stream, "the answer", within, rate).await;
    if checked.status != 0 {
        assert_eq!(checked.status, 200, "{checked:?}");
        assert!(checked.chunked, "not chunked: {checked:?}");
    }
    (checked.body, checked.whole)
}

/// A chunked body's decoder that checks every byte of it.
#[derive(Default)]
struct Chunks {
    /// Bytes left of the chunk being read, and the size line being read.
    left: u64,
    line: Vec<u8>,
    /// The CRLF after a chunk's data is yet to come.
    crlf: u8,
    body: u64,
    ended: bool,
}

impl Chunks {
    fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() && !self.ended {
            if self.left > 0 {
                let take = (self.left as usize).min(data.len());
                for (i, byte) in data[..take].iter().enumerate() {
                    let at = self.body + i as u64;
                    assert_eq!(*byte, pattern_at(at), "a wrong byte at {at}");
                }
                self.body += take as u64;
                self.left -= take as u64;
                data = &data[take..];
                if self.left == 0 {
                    self.crlf = 2;
                }
            } else if self.crlf > 0 {
                self.crlf -= 1;
                data = &data[1..];
            } else {
                let byte = data[0];
                data = &data[1..];
                if byte != b'\n' {
                    self.line.push(byte);
                    continue;
                }
                let line = String::from_utf8_lossy(&self.line).trim().to_owned();
                self.line.clear();
                let size = u64::from_str_radix(line.split(';').next().unwrap(), 16)
                    .unwrap_or_else(|_| panic!("a chunk size: {line:?}"));
                if size == 0 {
                    self.ended = true;
                } else {
                    self.left = size;
                }
            }
        }
    }
}

/// What [`fetch_checked`] got.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Checked {
    pub(crate) status: u16,
    /// The body's bytes, every one checked against [`pattern_at`].
    pub(crate) body: u64,
    /// Its declared length, if any.
    pub(crate) declared: Option<u64>,
    /// It ended as HTTP says a whole body ends (its declared length, or its last chunk).
    pub(crate) whole: bool,
    /// Its body came in chunks (`Transfer-Encoding: chunked`).
    pub(crate) chunked: bool,
}

/// `GET path` on a connection of its own (`Connection: close`), its body read to its
/// end (at most `within`), every byte checked.
pub(crate) async fn fetch_checked(
    addr: SocketAddr,
    path: &str,
    within: std::time::Duration,
) -> Checked {
    fetch_paced(addr, path, within, u64::MAX).await
}

/// [`fetch_checked`], at most `rate` bytes a second (as a slow client reads, with a
/// receive buffer of 32 KiB: the server's sending buffer and its own hold the rest). The
/// body may be of any version (`/versioned/`): its first byte says which, and every
/// other byte is checked against it.
pub(crate) async fn fetch_paced(
    addr: SocketAddr,
    path: &str,
    within: std::time::Duration,
    rate: u64,
) -> Checked {
    use tokio::io::AsyncWriteExt;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    if rate != u64::MAX {
        socket.set_recv_buffer_size(32 * 1024).unwrap();
    }
    let mut stream = socket.connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: shop.example\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    read_answer(&mut stream, path, within, rate).await
}

/// Reads an answer from `stream` (to a request for `path`, named in failures) for at
/// most `within`, at most `rate` bytes a second, every byte of its body checked: in
/// chunks or of a declared length, of any version (`/versioned/`: its first byte says
/// which).
async fn read_answer(
    stream: &mut tokio::net::TcpStream,
    path: &str,
    within: std::time::Duration,
    rate: u64,
) -> Checked {
    use tokio::io::AsyncReadExt;
    let deadline = tokio::time::Instant::now() + within;
    let mut buffer = vec![0u8; 256 * 1024];
    let mut head = Vec::new();
    let mut checked = Checked {
        status: 0,
        body: 0,
        declared: None,
        whole: false,
        chunked: false,
    };
    let mut decoder = Chunks::default();
    let started = tokio::time::Instant::now();
    let mut shift = None;
    loop {
        if tokio::time::Instant::now() >= deadline {
            return checked;
        }
        let chunk = if rate == u64::MAX {
            buffer.len()
        } else {
            let due =
                started + std::time::Duration::from_secs_f64(checked.body as f64 / rate as f64);
            tokio::time::sleep_until(due.min(deadline)).await;
            16 * 1024
        };
        let read = tokio::time::timeout_at(deadline, stream.read(&mut buffer[..chunk]));
        let n = match read.await {
            Err(_) | Ok(Ok(0) | Err(_)) => {
                checked.whole = if checked.chunked {
                    decoder.ended
                } else {
                    checked.status != 0 && checked.declared.is_none_or(|d| d == checked.body)
                };
                return checked;
            }
            Ok(Ok(n)) => n,
        };
        let mut data = &buffer[..n];
        let rest;
        if checked.status == 0 {
            head.extend_from_slice(data);
            let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let text = String::from_utf8_lossy(&head[..end]).to_ascii_lowercase();
            checked.status = text[9..12].parse().unwrap();
            checked.chunked = text.contains("transfer-encoding: chunked");
            checked.declared = text
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse().unwrap());
            rest = head[end + 4..].to_vec();
            data = &rest;
            if checked.status != 200 {
                return checked;
            }
        }
        if checked.chunked {
            decoder.feed(data);
            checked.body = decoder.body;
            if decoder.ended {
                checked.whole = true;
                return checked;
            }
        } else {
            for (i, byte) in data.iter().enumerate() {
                let at = checked.body + i as u64;
                let shift = *shift.get_or_insert((u64::from(*byte) + 251 - at % 251) % 251);
                assert_eq!(
                    *byte,
                    pattern_at(at + shift),
                    "a wrong byte at {at} of {path}"
                );
            }
            checked.body += data.len() as u64;
        }
    }
}
