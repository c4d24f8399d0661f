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
use std::net::{IpAddr, SocketAddr};

use axum::extract::ConnectInfo;

use axum::body::Body;
use bytes::Bytes;
use http::header::{CONNECTION, VIA};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The body of the origin's answers (or of the sidecar's own 502).
pub(crate) type UpstreamBody = BoxBody<Bytes, hyper::Error>;

/// Forwards requests to one origin over a pool of keep-alive connections.
#[derive(Clone, Debug)]
pub(crate) struct Upstream {
    client: Client<HttpConnector, Body>,
    origin: Uri,
    /// What `Via` says of this proxy (`1.1 stampede-sidecar`); none when turned off.
    via: Option<HeaderValue>,
    /// The peers whose `X-Forwarded-For` and `-Proto` are kept.
    trusted: Vec<Cidr>,
}

impl Upstream {
    /// `origin` is an absolute `http://` URL (checked when the settings were read); its
    /// path, if any, is not used. `via`: the name this proxy gives itself in `Via`
    /// (checked when the settings were read), or none.
    pub(crate) fn new(origin: Uri, via: Option<&str>, trusted: Vec<Cidr>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            origin,
            via: via.and_then(|name| HeaderValue::from_str(&format!("1.1 {name}")).ok()),
            trusted,
        }
    }

    /// The origin as a Tower service. An origin that cannot be reached is answered
    /// with a 502 (which the guard does not cache, and may stand a stale entry in for).
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
        let mut uri = Uri::builder().path_and_query(path);
        if let Some(scheme) = self.origin.scheme() {
            uri = uri.scheme(scheme.clone());
        }
        if let Some(authority) = self.origin.authority() {
            uri = uri.authority(authority.clone());
            if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
                request.headers_mut().insert(http::header::HOST, host);
            }
        }
        *request.uri_mut() = match uri.build() {
            Ok(uri) => uri,
            Err(_) => return bad_gateway(),
        };
        strip_hop_by_hop(request.headers_mut());
        self.add_via(request.headers_mut());
        let peer = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(addr)| addr.ip());
        self.forwarded_for(request.headers_mut(), peer);
        match self.client.request(request).await {
            Ok(mut response) => {
                strip_hop_by_hop(response.headers_mut());
                self.add_via(response.headers_mut());
                response.map(BodyExt::boxed)
            }
            Err(error) => {
                tracing::warn!(%error, "origin unreachable");
                bad_gateway()
            }
        }
    }
}

impl Upstream {
    /// Sets `X-Forwarded-For` and `X-Forwarded-Proto` from the peer: a trusted peer's
    /// are kept, and its address appended to the first; anyone else's are replaced.
    /// Without a peer (a fill made for another caller carries that caller's), they are
    /// left out.
    fn forwarded_for(&self, headers: &mut HeaderMap, peer: Option<IpAddr>) {
        let trusted = peer.is_some_and(|ip| self.trusted.iter().any(|cidr| cidr.contains(ip)));
        if !trusted {
            headers.remove(X_FORWARDED_FOR);
            headers.remove(X_FORWARDED_PROTO);
        }
        let Some(peer) = peer else { return };
        let chain = match headers.get(X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
            Some(before) if trusted => format!("{before}, {peer}"),
            _ => peer.to_string(),
        };
        if let Ok(value) = HeaderValue::from_str(&chain) {
            headers.insert(X_FORWARDED_FOR, value);
        }
        if !headers.contains_key(X_FORWARDED_PROTO) {
            // The sidecar's listener speaks plain HTTP.
            headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        }
    }

    /// Appends this proxy to `Via` (after the hops already named).
    fn add_via(&self, headers: &mut HeaderMap) {
        if let Some(via) = &self.via {
            headers.append(VIA, via.clone());
        }
    }
}

const X_FORWARDED_FOR: &str = "x-forwarded-for";
const X_FORWARDED_PROTO: &str = "x-forwarded-proto";

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
fn strip_hop_by_hop(headers: &mut HeaderMap) {
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

fn bad_gateway() -> Response<UpstreamBody> {
    let mut response = Response::new(
        Full::new(Bytes::from_static(b"bad gateway\n"))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = StatusCode::BAD_GATEWAY;
    response
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
