//! Headers on their hop: hop-by-hop headers dropped both ways, `Via`, the forwarding
//! headers (`X-Forwarded-*`) vouched for before the cache keys the request.

use super::*;

/// A proxy's headers, both ways (RFC 9110 §7.6): the origin never sees the client's
/// hop-by-hop headers (nor one its `Connection` lists), the client never sees the
/// origin's, and `Via` names the sidecar on both sides, on a request passed through
/// (a POST), a fill and a hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_stay_on_their_hop_and_via_names_the_sidecar() {
    let seen = Arc::new(Mutex::new(Vec::<http::HeaderMap>::new()));
    let app = Router::new().fallback({
        let seen = seen.clone();
        move |headers: http::HeaderMap| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(headers);
                (
                    [
                        ("cache-control", "max-age=60"),
                        ("connection", "x-origin-hop"),
                        ("x-origin-hop", "1"),
                        ("keep-alive", "timeout=5"),
                        ("proxy-authenticate", "Basic"),
                        ("x-origin-kept", "1"),
                    ],
                    "body",
                )
            }
        }
    });
    let origin = serve(app).await;
    let sidecar = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let hop = [
        ("connection", "keep-alive, x-client-hop"),
        ("x-client-hop", "1"),
        ("keep-alive", "timeout=5"),
        ("proxy-authorization", "Basic c2VjcmV0"),
        ("proxy-connection", "keep-alive"),
        ("x-client-kept", "1"),
    ];
    let posted = post_json(sidecar.listen, "/items/1", &hop, "{}").await;
    let filled = fetch(sidecar.listen, "/items/2", &hop).await;
    let hit = fetch(sidecar.listen, "/items/2", &hop).await;
    assert_eq!(
        [posted.x_cache(), filled.x_cache(), hit.x_cache()],
        ["bypass", "miss", "hit"]
    );
    for got in [&posted, &filled, &hit] {
        assert_eq!(got.status, StatusCode::OK, "{}", got.body);
        for gone in [
            "connection",
            "x-origin-hop",
            "keep-alive",
            "proxy-authenticate",
        ] {
            assert!(!got.headers.contains_key(gone), "{gone}: {:?}", got.headers);
        }
        assert_eq!(got.headers["x-origin-kept"], "1");
        let via: Vec<_> = got.headers.get_all("via").iter().collect();
        assert_eq!(via, ["1.1 stampede-sidecar"], "{:?}", got.headers);
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2, "the POST and the fill");
    for headers in seen.iter() {
        for gone in [
            "connection",
            "x-client-hop",
            "keep-alive",
            "proxy-authorization",
            "proxy-connection",
        ] {
            assert!(!headers.contains_key(gone), "{gone}: {headers:?}");
        }
        assert_eq!(headers["x-client-kept"], "1");
        assert_eq!(headers["via"], "1.1 stampede-sidecar");
    }
}

/// `X-Forwarded-For` and `-Proto` say who the client is: a client's own values are
/// replaced by the peer's address (they cannot be spoofed), and kept, with the peer's
/// address appended, when the peer is a trusted proxy. On a request passed through and
/// on a fill alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_forwarded_for_is_the_peer_unless_the_peer_is_trusted() {
    let (origin, seen) = recording_origin().await;
    // Two lines of it: a proxy in front may add its own line (HAProxy does).
    let spoofed = [
        ("x-forwarded-for", "203.0.113.7"),
        ("x-forwarded-for", "198.51.100.2"),
        ("x-forwarded-proto", "https"),
        ("x-real-ip", "203.0.113.7"),
        ("forwarded", "for=203.0.113.7"),
    ];
    for (trusted, want_for, want_proto) in [
        (None, "127.0.0.1", "http"),
        (
            Some("127.0.0.0/8"),
            "203.0.113.7, 198.51.100.2, 127.0.0.1",
            "https",
        ),
    ] {
        seen.lock().unwrap().clear();
        let mut args = vec!["--upstream".to_owned(), format!("http://{origin}")];
        if let Some(block) = trusted {
            args.extend(["--trusted-proxy".to_owned(), block.to_owned()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let sidecar = Sidecar::start(&args);
        let posted = post_json(sidecar.listen, "/items/1", &spoofed, "{}").await;
        let filled = fetch(sidecar.listen, "/items/2", &spoofed).await;
        assert_eq!([posted.x_cache(), filled.x_cache()], ["bypass", "miss"]);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2, "the POST and the fill");
        let (post, fill) = (&seen[0], &seen[1]);
        assert_eq!(post["x-forwarded-for"], want_for, "{trusted:?}");
        assert_eq!(post.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(post["x-forwarded-proto"], want_proto, "{trusted:?}");
        if trusted.is_none() {
            for spoofable in ["x-real-ip", "forwarded"] {
                assert!(!post.contains_key(spoofable), "{spoofable}: {post:?}");
            }
        }
        assert_eq!(fill["x-forwarded-for"], want_for, "{trusted:?}");
        // A fill forwards the scheme the client used, as vouched for (a trusted
        // balancer's word, else the sidecar's own listener's), which keys the entry.
        assert_eq!(fill["x-forwarded-proto"], want_proto, "{trusted:?}");
    }
}

/// No poisoning through forwarding headers: an untrusted client that says
/// `X-Forwarded-Proto: https` (or `X-Forwarded-Host`) to an origin whose answer varies
/// on it gets, and stores, the answer to its real scheme, under that scheme's key; the
/// trusted balancer's `https` request (from another address) is a miss answered for
/// https, then a hit on that, never on the untrusted client's entry. Before, the
/// untrusted `https` was keyed and then replaced by `http` on its way to the origin:
/// the balancer got a hit saying "origin saw proto=http".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_headers_key_what_the_origin_sees() {
    let app = Router::new().fallback(|headers: http::HeaderMap| async move {
        let said = |name: &str| {
            headers
                .get(name)
                .map_or("-", |v| v.to_str().unwrap())
                .to_owned()
        };
        (
            [
                ("cache-control", "max-age=60".to_owned()),
                ("vary", "X-Forwarded-Proto, X-Forwarded-Host".to_owned()),
            ],
            format!(
                "origin saw proto={} host={}",
                said("x-forwarded-proto"),
                said("x-forwarded-host")
            ),
        )
    });
    let origin = serve(app).await;
    let upstream = format!("http://{origin}");
    let sidecar = Sidecar::start(&["--upstream", &upstream, "--trusted-proxy", "127.0.0.2"]);
    let client: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    let balancer: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let lies = [
        ("x-forwarded-proto", "https"),
        ("x-forwarded-host", "admin.example"),
    ];
    for round in 0..2 {
        let got = fetch_from(client, sidecar.listen, "/page", &lies).await;
        assert_eq!(got.body, "origin saw proto=http host=-", "round {round}");
        assert_eq!(got.x_cache(), if round == 0 { "miss" } else { "hit" });
    }
    let vouched = [
        ("x-forwarded-proto", "https"),
        ("x-forwarded-host", "shop.example"),
    ];
    for round in 0..2 {
        let got = fetch_from(balancer, sidecar.listen, "/page", &vouched).await;
        assert_eq!(
            got.body, "origin saw proto=https host=shop.example",
            "round {round}"
        );
        assert_eq!(got.x_cache(), if round == 0 { "miss" } else { "hit" });
    }
    // The balancer's plain http requests are their own, too.
    let got = fetch_from(
        balancer,
        sidecar.listen,
        "/page",
        &[("x-forwarded-proto", "http")],
    )
    .await;
    assert_eq!(got.body, "origin saw proto=http host=-");
}
