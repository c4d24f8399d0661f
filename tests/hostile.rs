//! Hostile requests against the sidecar binary, over raw TCP: each is answered as RFC
//! 9112 says (a 400, or a 431 for headers too large) or handled safely, and none
//! reaches the origin as something else than it was (nothing smuggled as a second
//! request) or is stored under another request's key. Prints the table: the request,
//! what the client got, what the origin got.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use support::http::{fetch, serve};
use support::sidecar::Sidecar;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What the origin got: each request's method, target and headers.
type Seen = Arc<Mutex<Vec<(String, String, http::HeaderMap)>>>;

async fn recording_origin() -> (std::net::SocketAddr, Seen) {
    let seen: Seen = Arc::default();
    let app = Router::new().fallback({
        let seen = seen.clone();
        move |method: http::Method, uri: http::Uri, headers: http::HeaderMap| {
            let seen = seen.clone();
            async move {
                let body = format!("origin saw {method} {uri}");
                seen.lock()
                    .unwrap()
                    .push((method.to_string(), uri.to_string(), headers));
                ([("cache-control", "max-age=60")], body)
            }
        }
    });
    (serve(app).await, seen)
}

/// Sends `bytes` on a connection of its own and reads what comes back until the
/// sidecar closes it or a second passes: the status of the first answer (`None` when
/// it closed without one), and how many answers came.
async fn raw(addr: std::net::SocketAddr, bytes: &[u8]) -> (Option<u16>, usize) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _ = stream.write_all(bytes).await;
    let mut got = Vec::new();
    let mut buffer = vec![0; 64 * 1024];
    loop {
        match tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buffer)).await {
            Ok(Ok(0) | Err(_)) | Err(_) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buffer[..n]),
        }
    }
    let text = String::from_utf8_lossy(&got);
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok());
    (status, text.matches("HTTP/1.1 ").count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_are_refused_or_handled_safely() {
    let (origin, seen) = recording_origin().await;
    let sidecar = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let addr = sidecar.listen;
    let big = format!("x-big: {}\r\n", "a".repeat(100 * 1024));
    // (name, request, the statuses RFC 9112 allows, whether the origin may see it)
    let cases: Vec<(&str, String, &[u16], bool)> = vec![
        (
            "Content-Length with Transfer-Encoding",
            // Read by its Transfer-Encoding (RFC 9112 §6.1), re-framed to the origin: one
            // request, its empty body; the bytes after its last chunk are a request of
            // their own on this connection, never part of the first.
            "POST /items/a HTTP/1.1\r\nHost: shop.example\r\nContent-Length: 4\r\n\
             Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                .into(),
            &[200, 400],
            true,
        ),
        (
            "two different Content-Lengths",
            "POST /items/b HTTP/1.1\r\nHost: shop.example\r\nContent-Length: 3\r\n\
             Content-Length: 4\r\n\r\nabcd"
                .into(),
            &[400],
            false,
        ),
        (
            "obsolete line folding",
            "GET /items/c HTTP/1.1\r\nHost: shop.example\r\nX-Folded: a\r\n b\r\n\r\n".into(),
            &[400],
            false,
        ),
        (
            "a bad chunk size",
            "POST /items/d HTTP/1.1\r\nHost: shop.example\r\nTransfer-Encoding: chunked\r\n\r\n\
             zz\r\nabc\r\n0\r\n\r\n"
                .into(),
            &[400, 502],
            true,
        ),
        (
            "a header name with a space",
            "GET /items/e HTTP/1.1\r\nHost: shop.example\r\nBad Name: x\r\n\r\n".into(),
            &[400],
            false,
        ),
        (
            "Host missing",
            "GET /items/f HTTP/1.1\r\n\r\n".into(),
            &[400],
            false,
        ),
        (
            "Host doubled",
            "GET /items/g HTTP/1.1\r\nHost: shop.example\r\nHost: evil.example\r\n\r\n".into(),
            &[400],
            false,
        ),
        (
            "100 KiB of headers",
            format!("GET /items/h HTTP/1.1\r\nHost: shop.example\r\n{big}\r\n"),
            &[431, 400],
            false,
        ),
    ];
    let (mut table, mut problems) = (Vec::new(), Vec::new());
    for (name, request, allowed, may_reach) in cases {
        let before = seen.lock().unwrap().len();
        let (status, answers) = raw(addr, request.as_bytes()).await;
        let reached: Vec<String> = seen.lock().unwrap()[before..]
            .iter()
            .map(|(m, u, _)| format!("{m} {u}"))
            .collect();
        table.push(format!(
            "| {name} | {status:?} ({answers} answer(s)) | {reached:?} |"
        ));
        if !status.is_some_and(|s| allowed.contains(&s)) {
            problems.push(format!("{name}: {status:?}, allowed {allowed:?}"));
        }
        if answers > 1 {
            problems.push(format!("{name}: {answers} answers on one connection"));
        }
        if reached.len() > usize::from(may_reach) {
            problems.push(format!("{name}: the origin got {reached:?}"));
        }
    }
    // Safe ones: what the origin gets is what keyed the answer.
    let before = seen.lock().unwrap().len();
    let (status, _) = raw(
        addr,
        b"GET http://evil.example/items/i HTTP/1.1\r\nHost: shop.example\r\n\r\n",
    )
    .await;
    let absolute = seen.lock().unwrap()[before..]
        .iter()
        .map(|(m, u, h)| format!("{m} {u} host={:?}", h.get("host")))
        .collect::<Vec<_>>();
    table.push(format!(
        "| absolute-form naming another host | {status:?} | {absolute:?} |"
    ));
    let before = seen.lock().unwrap().len();
    let (status, _) = raw(
        addr,
        b"GET /items/j HTTP/1.1\r\nHost: shop.example\r\nAuthorization: Bearer secret\r\n\
          Connection: Authorization\r\n\r\n",
    )
    .await;
    let named = seen.lock().unwrap()[before..].to_vec();
    table.push(format!(
        "| `Connection: Authorization` | {status:?} | {:?} |",
        named
            .iter()
            .map(|(m, u, h)| format!("{m} {u} authorization={:?}", h.get("authorization")))
            .collect::<Vec<_>>()
    ));
    assert!(
        named
            .iter()
            .all(|(_, _, h)| !h.contains_key("authorization"))
    );
    // Nothing of the above is served for an ordinary request of another path.
    let ordinary = fetch(addr, "/items/ordinary", &[]).await;
    assert_eq!(ordinary.body, "origin saw GET /items/ordinary");
    eprintln!("| request | the client got | the origin got |\n|---|---|---|");
    for row in table {
        eprintln!("{row}");
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// An origin that says what it got of each request (method, target, the client's host
/// as the sidecar forwards it in `X-Forwarded-Host`, `Accept-Language`) and varies on
/// `Accept-Language`; each call is recorded.
async fn telling_origin() -> (std::net::SocketAddr, Seen) {
    let seen: Seen = Arc::default();
    let app = Router::new().fallback({
        let seen = seen.clone();
        move |method: http::Method, uri: http::Uri, headers: http::HeaderMap| {
            let seen = seen.clone();
            async move {
                let header = |name: &str| {
                    headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("none")
                        .to_owned()
                };
                let body = format!(
                    "saw {method} {uri} host={} lang={}",
                    header("x-forwarded-host"),
                    header("accept-language")
                );
                seen.lock()
                    .unwrap()
                    .push((method.to_string(), uri.to_string(), headers));
                (
                    [("cache-control", "max-age=60"), ("vary", "accept-language")],
                    body,
                )
            }
        }
    });
    (serve(app).await, seen)
}

/// Sends `request` on a connection of its own; returns the first answer's status, its
/// `x-cache` and its body (read to the end: these answers close or are short).
async fn exchange(addr: std::net::SocketAddr, request: &str) -> (u16, String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buffer = vec![0; 64 * 1024];
    let text = loop {
        match tokio::time::timeout(support::HANG, stream.read(&mut buffer)).await {
            Ok(Ok(0) | Err(_)) => break String::from_utf8_lossy(&got).into_owned(),
            Ok(Ok(n)) => got.extend_from_slice(&buffer[..n]),
            Err(_) => panic!("no answer to {request:?}"),
        }
        let text = String::from_utf8_lossy(&got).into_owned();
        // Whole once the head is and the body has its declared length.
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head.lines().find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length: ")?
                    .parse()
                    .ok()
            });
            if length.is_some_and(|n: usize| body.len() >= n) {
                break text;
            }
        }
    };
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let x_cache = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("x-cache: ")
                .map(str::to_owned)
        })
        .unwrap_or_default();
    (status, x_cache, body.to_owned())
}

/// A GET of `target` with `headers` (each line ending in CRLF), closing after it.
fn get(target: &str, headers: &str) -> String {
    format!("GET {target} HTTP/1.1\r\n{headers}Connection: close\r\n\r\n")
}

/// What each hostile request keys is what the origin saw of it: sent twice (a fill,
/// then what the cache holds), and followed by the ordinary request of what the origin
/// saw, each is answered with what the origin said to that very request, never with
/// another request's answer. Paths with dot segments and encoded slashes; an
/// absolute-form target naming another host than `Host`; `Connection` naming a header
/// the answer varies on (dropped on its hop before the key is made, or the origin's
/// answer to "no language" would be stored as the French one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_store_nothing_under_another_requests_key() {
    let (origin, seen) = telling_origin().await;
    let sidecar = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let addr = sidecar.listen;
    let host = "Host: shop.example\r\n";
    let mut table = Vec::new();
    let mut problems = Vec::new();
    for (name, request) in [
        ("dot segments", get("/static/../items/k", host)),
        ("encoded dot segments", get("/static/%2e%2e/items/l", host)),
        ("an encoded slash", get("/items/a%2Fb", host)),
        ("an encoded slash and dots", get("/items/%2F..%2Fm", host)),
        (
            "absolute-form naming another host",
            get("http://evil.example/items/n", host),
        ),
    ] {
        let before = seen.lock().unwrap().len();
        let first = exchange(addr, &request).await;
        let reached = seen.lock().unwrap()[before..].to_vec();
        let again = exchange(addr, &request).await;
        table.push(format!(
            "| {name} | {} {} | {:?} |",
            first.0,
            first.2,
            reached
                .iter()
                .map(|(m, u, h)| format!(
                    "{m} {u} x-forwarded-host={:?}",
                    h.get("x-forwarded-host")
                ))
                .collect::<Vec<_>>()
        ));
        if first.0 >= 400 {
            // Refused: nothing reached the origin, nothing is stored.
            if !reached.is_empty() {
                problems.push(format!("{name}: refused, yet the origin got {reached:?}"));
            }
            continue;
        }
        if reached.len() != 1 {
            problems.push(format!("{name}: the origin got {} requests", reached.len()));
            continue;
        }
        if again.2 != first.2 {
            problems.push(format!(
                "{name}: sent again, {:?} instead of {:?}",
                again.2, first.2
            ));
        }
        // The ordinary request of what the origin saw is answered for itself.
        let (_, target, headers) = &reached[0];
        // (The origin is sent its own host; the client's only from a trusted proxy.)
        let forwarded = headers
            .get("x-forwarded-host")
            .map_or("none", |v| v.to_str().unwrap());
        let ordinary = exchange(addr, &get(target, host)).await;
        let own = format!("saw GET {target} host={forwarded} lang=none");
        if ordinary.2 != own {
            problems.push(format!("{name}: then {target} got {:?}", ordinary.2));
        }
    }
    // The answer varies on Accept-Language; `Connection` names it on one request.
    let german = exchange(
        addr,
        &get("/items/o", &format!("{host}Accept-Language: de\r\n")),
    )
    .await;
    assert_eq!(german.2, "saw GET /items/o host=none lang=de");
    let named = exchange(
        addr,
        &get(
            "/items/o",
            &format!("{host}Accept-Language: fr\r\nConnection: Accept-Language\r\n"),
        ),
    )
    .await;
    table.push(format!(
        "| `Connection` naming a varied header | {} {} | (as the body says) |",
        named.0, named.2
    ));
    let french = exchange(
        addr,
        &get("/items/o", &format!("{host}Accept-Language: fr\r\n")),
    )
    .await;
    if french.2 != "saw GET /items/o host=none lang=fr" {
        problems.push(format!(
            "French asked for, {:?} ({}) served",
            french.2, french.1
        ));
    }
    let none = exchange(addr, &get("/items/o", host)).await;
    if none.2 != "saw GET /items/o host=none lang=none" {
        problems.push(format!(
            "no language asked for, {:?} ({}) served",
            none.2, none.1
        ));
    }
    eprintln!("| request | the client got | the origin got |\n|---|---|---|");
    for row in table {
        eprintln!("{row}");
    }
    assert!(problems.is_empty(), "{problems:#?}");
}
