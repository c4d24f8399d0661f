//! Real HTTP over real TCP: a server started with `axum::serve`, and a client that opens
//! a new connection for every request (as many users behind a load balancer do), so
//! that nothing is shared between requests but what the framework itself shares.

use std::net::SocketAddr;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

use super::web::Got;

/// Serves `app` with `axum::serve` on a free loopback port until the test ends.
pub(crate) async fn serve(app: axum::Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    addr
}

/// `GET path` on a connection of its own, with `headers`, within
/// [`HANG`](super::HANG).
pub(crate) async fn fetch(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Got {
    let mut request = Request::get(path).header("host", "shop.example");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    exchange(addr, request.body(Empty::<Bytes>::new()).unwrap()).await
}

/// `GET path` with `headers`, on a connection of its own from the local address
/// `from` (any of 127.0.0.0/8 on loopback: a peer the server tells apart by address),
/// within [`HANG`](super::HANG).
pub(crate) async fn fetch_from(
    from: std::net::IpAddr,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> Got {
    let mut request = Request::get(path).header("host", "shop.example");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Empty::<Bytes>::new()).unwrap();
    let exchange = async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::new(from, 0)).unwrap();
        let stream = socket.connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let response = sender.send_request(request).await.unwrap();
        let (parts, body) = response.into_parts();
        Got::new(parts, body.collect().await.unwrap().to_bytes())
    };
    super::within(super::HANG, exchange, format!("GET {path} from {from}")).await
}

/// `method path` on a connection of its own, without a body, within
/// [`HANG`](super::HANG).
pub(crate) async fn fetch_method(addr: SocketAddr, method: &str, path: &str) -> Got {
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "shop.example")
        .body(Empty::<Bytes>::new())
        .unwrap();
    exchange(addr, request).await
}

/// `POST path` with a JSON `body` and `headers`, on a connection of its own, within
/// [`HANG`](super::HANG).
pub(crate) async fn post_json(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Got {
    let mut request = Request::post(path)
        .header("host", "admin.example")
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let body = http_body_util::Full::new(Bytes::from(body.to_owned()));
    exchange(addr, request.body(body).unwrap()).await
}

/// Sends `request` on a new connection to `addr` and reads the answer whole, within
/// [`HANG`](super::HANG).
pub(crate) async fn send_request<B>(addr: SocketAddr, request: Request<B>) -> Got
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    exchange(addr, request).await
}

/// Sends `request` on a new connection to `addr` and reads the answer whole, within
/// [`HANG`](super::HANG): a request that hangs fails the test, naming it.
async fn exchange<B>(addr: SocketAddr, request: Request<B>) -> Got
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let what = format!("{} {} on {addr}", request.method(), request.uri());
    let exchange = async {
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let response = sender.send_request(request).await.unwrap();
        let (parts, body) = response.into_parts();
        Got::new(parts, body.collect().await.unwrap().to_bytes())
    };
    super::within(super::HANG, exchange, what).await
}
