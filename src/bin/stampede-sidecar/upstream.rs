//! The origin: every request the cache does not answer is sent there, to the same path
//! and query, with the origin's host.
//!
//! As a proxy does (RFC 9110 §7.6), in both directions: the hop-by-hop headers, and
//! those a `Connection` header lists, are removed (a client's `Connection: close` does
//! not close a pooled connection to the origin, its `Proxy-Authorization` never reaches
//! it, and the origin's `Keep-Alive` says nothing of the client's connection); and
//! `Via` names this proxy, unless it is turned off. `X-Forwarded-For` and
//! `X-Forwarded-Proto` say who the client is: set from the peer's address (a client's
//! own values are dropped, so they cannot be spoofed), or, from a peer in the trusted
//! list (a load balancer in front), kept with the peer's address appended.

use std::convert::Infallible;
use std::error::Error as StdError;
use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{CONNECTION, VIA};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, Version};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::bodies::Bounded;
use crate::peer::{OriginTime, Peer, RequestBodyTimeout};

/// The body of the origin's answers (or of the sidecar's own 502 and 504).
pub(crate) type UpstreamBody = BoxBody<Bytes, Box<dyn StdError + Send + Sync>>;

/// How the origin is spoken to: its URL, its timeouts, its protocol, and the headers a
/// proxy adds.
#[derive(Clone, Debug)]
pub(crate) struct Origin {
    /// An absolute `http://` or `https://` URL (checked when the settings were read);
    /// its path, if any, is not used.
    pub(crate) uri: Uri,
    /// Connecting (and, for https://, the TLS handshake).
    pub(crate) connect: Duration,
    /// From the request sent to the response's headers.
    pub(crate) response: Duration,
    /// The longest pause while the response's body streams.
    pub(crate) idle: Duration,
    /// HTTP/2 with prior knowledge to an http:// origin.
    pub(crate) http2: bool,
    /// The certificate authorities an https:// origin is checked against, instead of
    /// the system's.
    pub(crate) ca: Option<PathBuf>,
    /// The name this proxy gives itself in `Via` (checked when the settings were read),
    /// or none.
    pub(crate) via: Option<String>,
    /// The peers whose `X-Forwarded-For` and `-Proto` are kept.
    pub(crate) trusted_proxies: Vec<Cidr>,
}

/// Forwards requests to one origin over a pool of keep-alive connections. Cloned per
/// request by the services around it: one reference count.
#[derive(Clone)]
pub(crate) struct Upstream(Arc<Inner>);

struct Inner {
    client: Client<TimedConnector, Body>,
    origin: Origin,
    /// What `Via` says of this proxy after the protocol's version
    /// (`1.1 stampede-sidecar`, `2 stampede-sidecar`); none when turned off.
    via: Option<Via>,
}

/// This proxy's entries in `Via`, one per version of HTTP it may have received a
/// message in (RFC 9110 §7.6.3: the received protocol).
#[derive(Clone, Debug)]
struct Via {
    http10: HeaderValue,
    http11: HeaderValue,
    http2: HeaderValue,
}

impl Via {
    fn new(name: &str) -> Option<Self> {
        let value = |version: &str| HeaderValue::from_str(&format!("{version} {name}")).ok();
        Some(Self {
            http10: value("1.0")?,
            http11: value("1.1")?,
            http2: value("2")?,
        })
    }

    fn of(&self, version: Version) -> &HeaderValue {
        match version {
            Version::HTTP_10 | Version::HTTP_09 => &self.http10,
            Version::HTTP_2 | Version::HTTP_3 => &self.http2,
            _ => &self.http11,
        }
    }
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upstream")
            .field("origin", &self.0.origin)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// The origin's client. Refused, naming the setting, when `upstream_ca` cannot be
    /// read or holds no certificate, or the system has no root certificates.
    pub(crate) fn new(origin: &Origin) -> Result<Self, (&'static str, String)> {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(origin.connect));
        http.enforce_http(false);
        let mut roots = rustls::RootCertStore::empty();
        match &origin.ca {
            Some(path) => {
                let certs = CertificateDer::pem_file_iter(path)
                    .and_then(Iterator::collect::<Result<Vec<_>, _>>)
                    .map_err(|e| ("upstream_ca", format!("{}: {e}", path.display())))?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err((
                        "upstream_ca",
                        format!("{}: no PEM certificate in it", path.display()),
                    ));
                }
            }
            None if origin.uri.scheme_str() == Some("https") => {
                let found = rustls_native_certs::load_native_certs();
                roots.add_parsable_certificates(found.certs);
                if roots.is_empty() {
                    return Err((
                        "upstream",
                        "no root certificates on this system to check an https:// origin \
                         with; name some with upstream_ca"
                            .to_owned(),
                    ));
                }
            }
            None => {}
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| ("upstream", e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        let connector = TimedConnector {
            inner: connector,
            within: origin.connect,
        };
        let mut client = Client::builder(TokioExecutor::new());
        client
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new());
        if origin.http2 && origin.uri.scheme_str() == Some("http") {
            client.http2_only(true);
        }
        Ok(Self(Arc::new(Inner {
            client: client.build(connector),
            via: origin.via.as_deref().and_then(Via::new),
            origin: origin.clone(),
        })))
    }

    /// The origin as a Tower service. An origin that cannot be reached is answered
    /// with a 502, one that does not answer in time with a 504 (which the guard does not
    /// cache, and may stand a stale entry in for).
    pub(crate) fn service(
        &self,
    ) -> impl tower::Service<
        Request<Body>,
        Response = Response<UpstreamBody>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + Sync
    + 'static {
        let this = self.clone();
        tower::service_fn(move |request: Request<Body>| {
            let this = this.clone();
            async move { Ok::<_, Infallible>(this.forward(request).await) }
        })
    }

    async fn forward(&self, mut request: Request<Body>) -> Response<UpstreamBody> {
        let path = request
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned();
        let origin = &self.0.origin.uri;
        let mut uri = Uri::builder().path_and_query(path);
        if let Some(scheme) = origin.scheme() {
            uri = uri.scheme(scheme.clone());
        }
        if let Some(authority) = origin.authority() {
            uri = uri.authority(authority.clone());
            if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
                request.headers_mut().insert(http::header::HOST, host);
            }
        }
        *request.uri_mut() = match uri.build() {
            Ok(uri) => uri,
            Err(_) => return failed(Failure::Error),
        };
        strip_hop_by_hop(request.headers_mut());
        self.add_via(request.version(), request.headers_mut());
        // The version is the origin connection's to choose, not the client's.
        *request.version_mut() = Version::HTTP_11;
        let peer = request.extensions().get::<Peer>().copied();
        // (Vouched for before the guard: `Routes`.)
        self.forwarded_for(request.headers_mut(), peer);
        let clock = request.extensions().get::<OriginTime>().cloned();
        let started = tokio::time::Instant::now();
        let sent = tokio::time::timeout(self.0.origin.response, self.0.client.request(request));
        let sent = sent.await;
        if let Some(clock) = clock {
            clock.set(started.elapsed());
        }
        match sent {
            Ok(Ok(mut response)) => {
                strip_hop_by_hop(response.headers_mut());
                self.add_via(response.version(), response.headers_mut());
                let idle = self.0.origin.idle;
                response.map(|body| Bounded::idle(body, idle, upstream_idle).boxed())
            }
            Ok(Err(error)) => {
                let failure = Failure::of(&error);
                if failure != Failure::RequestBody {
                    tracing::warn!(error = %Chain(&error), "origin unreachable");
                }
                failed(failure)
            }
            Err(_) => failed(Failure::ResponseTimeout),
        }
    }
}

/// The origin's connector, with its whole connection (the TCP connect, and for
/// https:// the TLS handshake) within `connect_timeout`.
#[derive(Clone)]
struct TimedConnector {
    inner: HttpsConnector<HttpConnector>,
    within: Duration,
}

type Connecting = <HttpsConnector<HttpConnector> as tower::Service<Uri>>::Response;
type BoxError = Box<dyn StdError + Send + Sync>;

impl tower::Service<Uri> for TimedConnector {
    type Response = Connecting;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Connecting, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let within = self.within;
        Box::pin(async move {
            match tokio::time::timeout(within, connecting).await {
                Ok(connected) => connected,
                Err(_) => Err(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "not connected within connect_timeout",
                )) as BoxError),
            }
        })
    }
}

/// Why the origin gave no answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    /// Not connected within `connect_timeout`: 504.
    ConnectTimeout,
    /// No response headers within `response_timeout`: 504.
    ResponseTimeout,
    /// Connection refused, reset, a TLS or protocol error: 502.
    Error,
    /// The client's body did not arrive in time: 408, and not the origin's failure.
    RequestBody,
}

impl Failure {
    fn of(error: &(dyn StdError + 'static)) -> Self {
        let mut cause: Option<&(dyn StdError + 'static)> = Some(error);
        while let Some(error) = cause {
            if error.is::<RequestBodyTimeout>() {
                return Self::RequestBody;
            }
            if let Some(io) = error.downcast_ref::<std::io::Error>()
                && io.kind() == std::io::ErrorKind::TimedOut
            {
                return Self::ConnectTimeout;
            }
            cause = error.source();
        }
        Self::Error
    }
}

/// An error and its causes, for the log.
struct Chain<'a>(&'a (dyn StdError + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut cause = self.0.source();
        while let Some(error) = cause {
            write!(f, ": {error}")?;
            cause = error.source();
        }
        Ok(())
    }
}

/// The sidecar's own answer when the origin gave none, counted by reason in
/// `stampede_sidecar_upstream_failures_total`.
fn failed(failure: Failure) -> Response<UpstreamBody> {
    let (status, reason, body): (_, _, &'static [u8]) = match failure {
        Failure::ConnectTimeout => (
            StatusCode::GATEWAY_TIMEOUT,
            "connect_timeout",
            b"gateway timeout: the origin did not accept the connection in time\n",
        ),
        Failure::ResponseTimeout => (
            StatusCode::GATEWAY_TIMEOUT,
            "response_timeout",
            b"gateway timeout: the origin did not answer in time\n",
        ),
        Failure::Error => (StatusCode::BAD_GATEWAY, "error", b"bad gateway\n"),
        Failure::RequestBody => (
            StatusCode::REQUEST_TIMEOUT,
            "",
            b"request timeout: the body did not arrive in time\n",
        ),
    };
    if failure != Failure::RequestBody {
        metrics::counter!("stampede_sidecar_upstream_failures_total", "reason" => reason)
            .increment(1);
    }
    let mut response = Response::new(
        Full::new(Bytes::from_static(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    if failure == Failure::RequestBody {
        response
            .headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// The origin's body paused longer than `upstream_idle_timeout`.
#[derive(Debug)]
struct UpstreamIdle;

impl fmt::Display for UpstreamIdle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the origin's body paused too long")
    }
}

impl StdError for UpstreamIdle {}

/// The origin's body paused too long: counted (as `idle_timeout`), and the error the
/// answer is cut with.
fn upstream_idle() -> BoxError {
    metrics::counter!("stampede_sidecar_upstream_failures_total", "reason" => "idle_timeout")
        .increment(1);
    Box::new(UpstreamIdle)
}

impl Upstream {
    /// Whether `peer` is a proxy whose word on the client is taken (`--trusted-proxy`).
    fn trusts(&self, peer: Option<Peer>) -> bool {
        peer.is_some_and(|peer| {
            let ip = peer.addr.ip();
            self.0
                .origin
                .trusted_proxies
                .iter()
                .any(|cidr| cidr.contains(ip))
        })
    }

    /// What the request says of its client, made true before anything keys on it or
    /// forwards it: anyone but a trusted proxy loses what it says of itself, or of who
    /// it is behind ([`SPOOFABLE`]); `X-Forwarded-Proto` is then the scheme the client
    /// used: a trusted proxy's word for it (a balancer that ends TLS says `https`), else
    /// this listener's. The guard keys on it (http and https answers never mix) and a
    /// fill forwards it, so the key and the origin always see the same value.
    pub(crate) fn vouch(&self, headers: &mut HeaderMap, peer: Option<Peer>) {
        if !self.trusts(peer) {
            for name in SPOOFABLE {
                headers.remove(name);
            }
        }
        if let Some(peer) = peer
            && !headers.contains_key(X_FORWARDED_PROTO)
        {
            let proto = if peer.tls { "https" } else { "http" };
            headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
        }
    }

    /// Sets `X-Forwarded-For` from the peer (what it says of the client was vouched
    /// for already: [`Upstream::vouch`]): a trusted peer's is kept, with its address
    /// appended; anyone else's is the peer's address. Without a peer (a fill made for
    /// another caller carries that caller's), it is left as it is.
    fn forwarded_for(&self, headers: &mut HeaderMap, peer: Option<Peer>) {
        let trusted = self.trusts(peer);
        let Some(peer) = peer else { return };
        let ip = peer.addr.ip();
        // Every line of it: a proxy in front may have added its own (HAProxy does).
        let before: Vec<&str> = headers
            .get_all(X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        let chain = if trusted && !before.is_empty() {
            format!("{}, {ip}", before.join(", "))
        } else {
            ip.to_string()
        };
        if let Ok(value) = HeaderValue::from_str(&chain) {
            headers.insert(X_FORWARDED_FOR, value);
        }
    }

    /// Appends this proxy to `Via` (after the hops already named).
    fn add_via(&self, received: Version, headers: &mut HeaderMap) {
        if let Some(via) = &self.0.via {
            headers.append(VIA, via.of(received).clone());
        }
    }
}

const X_FORWARDED_FOR: &str = "x-forwarded-for";
const X_FORWARDED_PROTO: &str = "x-forwarded-proto";

/// What every route keys on besides its own `key_headers`: the scheme and the host the
/// client used, as vouched for ([`Upstream::vouch`]).
pub(crate) const KEYED_FORWARDING: [&str; 2] = [X_FORWARDED_PROTO, "x-forwarded-host"];

/// What only a trusted proxy may tell the origin about the client: dropped from anyone
/// else's requests.
const SPOOFABLE: [&str; 5] = [
    X_FORWARDED_FOR,
    X_FORWARDED_PROTO,
    "x-forwarded-host",
    "x-real-ip",
    "forwarded",
];

/// An address block: an address and how many of its leading bits a peer must share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cidr {
    addr: IpAddr,
    bits: u8,
}

impl Cidr {
    /// `10.0.0.0/8`, `fd00::/8`, or one address (`127.0.0.1`, `::1`).
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let (addr, bits) = match text.split_once('/') {
            Some((addr, bits)) => (addr, Some(bits)),
            None => (text, None),
        };
        let addr: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("`{text}` is not an address or an address block"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            None => max,
            Some(bits) => match bits.trim().parse::<u8>() {
                Ok(bits) if bits <= max => bits,
                _ => return Err(format!("`{text}`: the prefix must be 0 to {max}")),
            },
        };
        Ok(Self { addr, bits })
    }

    fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 @ IpAddr::V4(_) => v4,
        };
        let prefix = |a: u128, b: u128, width: u32| {
            let shift = width - u32::from(self.bits);
            shift >= width || (a >> shift) == (b >> shift)
        };
        match (self.addr, ip) {
            (IpAddr::V4(block), IpAddr::V4(ip)) => {
                prefix(u32::from(block).into(), u32::from(ip).into(), 32)
            }
            (IpAddr::V6(block), IpAddr::V6(ip)) => prefix(block.into(), ip.into(), 128),
            _ => false,
        }
    }
}

/// Hop-by-hop headers (RFC 9110 §7.6.1; `Keep-Alive` and `Proxy-Connection` from
/// before it): they describe one connection, never the message.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Removes the hop-by-hop headers and those the `Connection` header lists.
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in listed {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_blocks() {
        let block = |text: &str| Cidr::parse(text).unwrap();
        let ip = |text: &str| text.parse::<IpAddr>().unwrap();
        assert!(block("10.0.0.0/8").contains(ip("10.200.3.4")));
        assert!(!block("10.0.0.0/8").contains(ip("11.0.0.1")));
        assert!(block("127.0.0.1").contains(ip("127.0.0.1")));
        assert!(!block("127.0.0.1").contains(ip("127.0.0.2")));
        assert!(block("0.0.0.0/0").contains(ip("203.0.113.9")));
        assert!(block("fd00::/8").contains(ip("fd12::1")));
        assert!(!block("fd00::/8").contains(ip("fe80::1")));
        assert!(block("10.0.0.0/8").contains(ip("::ffff:10.1.2.3")));
        assert!(!block("::1").contains(ip("127.0.0.1")));
        for bad in ["10.0.0.0/33", "fd00::/129", "nope", "10.0.0.0/x", ""] {
            assert!(Cidr::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn hop_by_hop_headers_and_those_connection_lists_go() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "close, X-Hop"),
            ("connection", "x-other"),
            ("x-hop", "1"),
            ("x-other", "1"),
            ("keep-alive", "timeout=5"),
            ("proxy-authorization", "Basic c2VjcmV0"),
            ("proxy-connection", "keep-alive"),
            ("te", "trailers"),
            ("upgrade", "websocket"),
            ("x-kept", "1"),
            ("cache-control", "max-age=5"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        strip_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(left, ["x-kept", "cache-control"]);
    }
}
