//! The origin: every request the cache does not answer is sent there, to the same path
//! and query, with the origin's host.

use std::convert::Infallible;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, Uri};
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
}

impl Upstream {
    /// `origin` is an absolute `http://` URL (checked when the settings were read); its
    /// path, if any, is not used.
    pub(crate) fn new(origin: Uri) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            origin,
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
        match self.client.request(request).await {
            Ok(response) => response.map(BodyExt::boxed),
            Err(error) => {
                tracing::warn!(%error, "origin unreachable");
                bad_gateway()
            }
        }
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
