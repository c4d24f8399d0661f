//! The access log: one line per request on standard output, off by default
//! (`--access-log json` or `common`).
//!
//! A line says who asked (the peer's address), what (method, path, protocol), what it got
//! (status, how the cache served it, body bytes), and how long it took (until the last
//! byte of the answer was written to its connection, see `written`, or the client went
//! away) and how long the origin took when
//! this request called it (a fill's leader, or a request passed through; a caller served
//! by someone else's fill has none). It never holds a secret: no header but `User-Agent`,
//! no cookie, no `Authorization`, and of the query only the parameters' names
//! (`/search?q&page`; an item without `=` as `-`), as a query can carry a token.
//!
//! A request whose client left before its answer is logged with status 499 (as nginx
//! does). Lines are written by a thread of their own, so that a slow standard output
//! never holds a request; if it falls [`BEHIND_AT_MOST`] bytes behind (16 MiB: a line
//! carries a path and a `User-Agent` a client chose), further lines are dropped and
//! counted in `stampede_sidecar_access_log_dropped_total`.

use std::convert::Infallible;
use std::io::Write;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::SyncSender;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use axum::body::Body;
use http::{Request, Response, Version};
use serde::Deserialize;
use tower::util::{BoxCloneSyncService, Either};
use tower::{Service, ServiceExt};

use crate::bodies::{Tap, Tapped};
use crate::peer::{OriginTime, Peer};
use crate::written::Written;

/// How lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Format {
    /// No access log.
    Off,
    /// One JSON object per line.
    Json,
    /// The Common Log Format, with the cache's outcome and the times after it.
    Common,
}

/// The service it wraps.
type Inner = BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

/// The most the lines waiting to be written may hold: 16 MiB.
pub(crate) const BEHIND_AT_MOST: usize = 16 * 1024 * 1024;

/// Logs each request through `inner`.
#[derive(Clone)]
pub(crate) struct AccessLog {
    inner: Inner,
    format: Format,
    lines: Lines,
}

/// The lines on their way to the writing thread, and how many bytes they hold.
#[derive(Clone)]
struct Lines {
    sender: SyncSender<String>,
    waiting: Arc<AtomicUsize>,
}

impl Lines {
    /// Queues `line`, unless the lines waiting hold [`BEHIND_AT_MOST`] bytes with it:
    /// then it is dropped, and counted.
    fn send(&self, line: String) {
        let len = line.len();
        let room = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |waiting| {
                (waiting + len <= BEHIND_AT_MOST).then_some(waiting + len)
            });
        let sent = room.is_ok() && self.sender.try_send(line).is_ok();
        if !sent {
            if room.is_ok() {
                self.waiting.fetch_sub(len, Ordering::AcqRel);
            }
            metrics::counter!("stampede_sidecar_access_log_dropped_total").increment(1);
        }
    }
}

impl AccessLog {
    /// Wraps `inner`, and starts the thread that writes the lines.
    pub(crate) fn new(inner: Inner, format: Format) -> Self {
        // (Bounded by bytes; the count is only a backstop for empty lines.)
        let (sender, written) = std::sync::mpsc::sync_channel::<String>(1 << 20);
        let waiting = Arc::new(AtomicUsize::new(0));
        let lines = Lines {
            sender,
            waiting: waiting.clone(),
        };
        std::thread::Builder::new()
            .name("access-log".to_owned())
            .spawn(move || {
                let stdout = std::io::stdout();
                let write = |out: &mut dyn Write, line: String| {
                    let _ = writeln!(out, "{line}");
                    waiting.fetch_sub(line.len(), Ordering::AcqRel);
                };
                while let Ok(line) = written.recv() {
                    // Standard output is locked for one batch only (what is waiting), never
                    // while waiting: the sidecar's own messages (the drain's) go through.
                    let mut out = std::io::BufWriter::new(stdout.lock());
                    write(&mut out, line);
                    while let Ok(line) = written.try_recv() {
                        write(&mut out, line);
                    }
                    let _ = out.flush();
                }
            })
            .expect("a thread for the access log");
        Self {
            inner,
            format,
            lines,
        }
    }
}

impl Service<Request<Body>> for AccessLog {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send + 'static>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: Request<Body>) -> Self::Future {
        let origin = OriginTime::default();
        request.extensions_mut().insert(origin.clone());
        let mut record = Record {
            line: Line {
                at: SystemTime::now(),
                peer: request.extensions().get::<Peer>().map(|p| p.addr.ip()),
                method: request.method().to_string(),
                path: path_of(request.uri()),
                version: request.version(),
                user_agent: request
                    .headers()
                    .get(http::header::USER_AGENT)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
                status: 499,
                cache: String::new(),
                bytes: 0,
                took: Duration::ZERO,
                origin: None,
            },
            started: Instant::now(),
            origin,
            format: self.format,
            lines: self.lines.clone(),
            written: request.extensions().get::<Written>().cloned(),
            answered: false,
        };
        let inner = self.inner.clone();
        Box::pin(async move {
            let response = match inner.oneshot(request).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            record.line.status = response.status().as_u16();
            record.line.cache = response
                .headers()
                .get("x-cache")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_owned();
            record.answered = true;
            Ok(response.map(|body| Body::new(Tapped::new(body, record))))
        })
    }
}

/// A request being logged: ends when dropped, with its answer's body (then written
/// once the answer's last byte is, on a connection that tells) or with the future if
/// the client left first.
struct Record {
    line: Line,
    started: Instant,
    origin: OriginTime,
    format: Format,
    lines: Lines,
    /// What the connection's writes tell.
    written: Option<Written>,
    /// Its answer was handed over: it ends with the body.
    answered: bool,
}

impl Drop for Record {
    fn drop(&mut self) {
        let mut line = std::mem::replace(&mut self.line, Line::empty());
        let (started, origin, format) = (self.started, self.origin.clone(), self.format);
        let lines = self.lines.clone();
        let mut write = move || {
            line.took = started.elapsed();
            line.origin = origin.get();
            let text = match format {
                Format::Json => line.json(),
                Format::Common => line.common(),
                Format::Off => return,
            };
            lines.send(text);
        };
        match self.written.take() {
            Some(written) if self.answered => written.then(write),
            _ => write(),
        }
    }
}

/// What one line says.
#[derive(Debug, Clone)]
struct Line {
    at: SystemTime,
    peer: Option<IpAddr>,
    method: String,
    path: String,
    version: Version,
    user_agent: Option<String>,
    status: u16,
    /// How it was served (`x-cache`: `hit`, `miss`, `stale`, `pass`, `bypass`, ...).
    cache: String,
    bytes: u64,
    took: Duration,
    origin: Option<Duration>,
}

impl Line {
    /// What is left of a line moved out: nothing allocated.
    fn empty() -> Self {
        Self {
            at: SystemTime::UNIX_EPOCH,
            peer: None,
            method: String::new(),
            path: String::new(),
            version: Version::HTTP_11,
            user_agent: None,
            status: 0,
            cache: String::new(),
            bytes: 0,
            took: Duration::ZERO,
            origin: None,
        }
    }
}

fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

impl Line {
    fn json(&self) -> String {
        serde_json::json!({
            "time": humantime::format_rfc3339_millis(self.at).to_string(),
            "peer": self.peer.map(|ip| ip.to_string()),
            "method": self.method,
            "path": self.path,
            "protocol": format!("{:?}", self.version),
            "status": self.status,
            "cache": self.cache,
            "bytes": self.bytes,
            "duration_ms": millis(self.took),
            "upstream_ms": self.origin.map(millis),
            "user_agent": self.user_agent,
        })
        .to_string()
    }

    /// `127.0.0.1 - - [03/Dec/2026:09:40:00 +0000] "GET /a HTTP/1.1" 200 5 cache=hit
    /// duration_ms=0.42 upstream_ms=-`
    fn common(&self) -> String {
        let upstream = self
            .origin
            .map_or_else(|| "-".to_owned(), |d| millis(d).to_string());
        format!(
            "{} - - [{}] \"{} {} {:?}\" {} {} cache={} duration_ms={} upstream_ms={}",
            self.peer
                .map_or_else(|| "-".to_owned(), |ip| ip.to_string()),
            common_time(self.at),
            self.method,
            self.path,
            self.version,
            self.status,
            self.bytes,
            self.cache,
            millis(self.took),
            upstream,
        )
    }
}

/// `03/Dec/2026:09:40:00 +0000`, from the RFC 3339 form (always UTC).
fn common_time(at: SystemTime) -> String {
    let text = humantime::format_rfc3339_seconds(at).to_string();
    // 2026-12-03T09:40:00Z
    let (date, time) = (&text[..10], &text[11..19]);
    let month = match &date[5..7] {
        "01" => "Jan",
        "02" => "Feb",
        "03" => "Mar",
        "04" => "Apr",
        "05" => "May",
        "06" => "Jun",
        "07" => "Jul",
        "08" => "Aug",
        "09" => "Sep",
        "10" => "Oct",
        "11" => "Nov",
        _ => "Dec",
    };
    format!("{}/{month}/{}:{time} +0000", &date[8..10], &date[..4])
}

/// The path, and of the query only the parameters' names (an item without `=`, which
/// may be a value, as `-`); `"`, `\` and controls percent-encoded, so that a line
/// cannot be forged.
fn path_of(uri: &http::Uri) -> String {
    let mut path = escaped(uri.path());
    if let Some(query) = uri.query() {
        path.push('?');
        let names: Vec<String> = query
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                p.split_once('=')
                    .map_or("-".to_owned(), |(name, _)| escaped(name))
            })
            .collect();
        path.push_str(&names.join("&"));
    }
    path
}

fn escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c == '"' || c == '\\' || c.is_control() {
            let mut buf = [0u8; 4];
            for byte in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{byte:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A record counts its answer's bytes, and is written when the body goes.
impl Tap for Record {
    fn data(&mut self, len: usize) {
        self.line.bytes += len as u64;
    }
}

/// `service` in the access log, or alone (at no cost) when it is off.
pub(crate) fn wrap<S>(service: S, format: Format) -> Either<AccessLog, S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    match format {
        Format::Off => Either::Right(service),
        format => Either::Left(AccessLog::new(Inner::new(service), format)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_keeps_its_names_only() {
        let path = |uri: &str| path_of(&uri.parse().unwrap());
        assert_eq!(path("/a"), "/a");
        assert_eq!(path("/search?q=secret&page=2"), "/search?q&page");
        assert_eq!(path("/x?token=abc&&flag"), "/x?token&-");
        assert_eq!(path("/a%22b"), "/a%22b");
        assert_eq!(escaped("a\"b\\c"), "a%22b%5Cc");
    }

    #[test]
    fn lines_in_both_formats() {
        let line = Line {
            at: SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_290_800),
            peer: Some("127.0.0.1".parse().unwrap()),
            method: "GET".to_owned(),
            path: "/a?q".to_owned(),
            version: Version::HTTP_11,
            user_agent: Some("curl/8".to_owned()),
            status: 200,
            cache: "hit".to_owned(),
            bytes: 5,
            took: Duration::from_micros(420),
            origin: None,
        };
        assert_eq!(
            line.common(),
            "127.0.0.1 - - [03/Dec/2026:09:40:00 +0000] \"GET /a?q HTTP/1.1\" 200 5 \
             cache=hit duration_ms=0.42 upstream_ms=-"
        );
        let json: serde_json::Value = serde_json::from_str(&line.json()).unwrap();
        assert_eq!(json["time"], "2026-12-03T09:40:00.000Z");
        assert_eq!(json["status"], 200);
        assert_eq!(json["upstream_ms"], serde_json::Value::Null);
        assert_eq!(json["protocol"], "HTTP/1.1");
    }
}
