//! How a request finds its entry again: a hit computes its key piece by piece from the
//! request, a fill stores under the key computed from the identity made whole, and for
//! every shape of request (parameters reordered or ignored, many parameters, a long
//! path, host bytes that are not text, no host) and every variant the two agree: the
//! second request of each pair is an L1 hit, in process and through `axum::serve`.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing;
use http::Response;
use stampede_guard::Policy;
use stampede_guard::metrics::Event;
use support::RedisServer;
use support::app::{instance, policy};
use support::http::{fetch, serve};
use support::web::{self, Instance, Origin, full, get, ready_guard, send};

/// A request with `host` set to raw bytes (not text: `to_str` refuses them).
fn with_raw_host(path: &str, host: &[u8]) -> web::Req {
    let mut request = get(path);
    request.headers_mut().insert(
        http::header::HOST,
        http::HeaderValue::from_bytes(host).unwrap(),
    );
    request
}

/// A hit finds its entry by a key it computes piece by piece from the request, while the
/// entry was put under the key computed from the identity made whole: for every shape of
/// request the two must agree, or the second request of each pair below would miss L1.
/// Pairs of requests with the same identity (parameters reordered, ignored parameters
/// changed), each pair on its own path: one origin call per pair, and the second is an
/// L1 hit.
#[tokio::test]
async fn every_request_shape_finds_its_entry_again() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let long = format!("/items/{}", "x".repeat(600));
    let many_a = (0..12)
        .map(|n| format!("p{n}={n}"))
        .collect::<Vec<_>>()
        .join("&");
    let many_b = (0..12)
        .rev()
        .map(|n| format!("p{n}={n}"))
        .collect::<Vec<_>>()
        .join("&");
    let all = instance(&server, policy("all").build().unwrap(), origin.service()).await;
    let only = instance(
        &server,
        policy("only").key_query(["page"]).build().unwrap(),
        origin.service(),
    )
    .await;
    let ignore = instance(
        &server,
        policy("ignore").ignore_query().build().unwrap(),
        origin.service(),
    )
    .await;
    let pairs: Vec<(&Instance<_>, web::Req, web::Req)> = vec![
        (&all, get("/a"), get("/a")),
        (&all, get("/b?x=1&y=2"), get("/b?y=2&x=1")),
        (&all, get("/c?&x=1&&"), get("/c?x=1")),
        (
            &all,
            get(&format!("/d?{many_a}")),
            get(&format!("/d?{many_b}")),
        ),
        (&all, get(&long), get(&long)),
        (
            &all,
            with_raw_host("/e", b"h\xe9te.example"),
            with_raw_host("/e", b"h\xe9te.example"),
        ),
        (&only, get("/f?page=2&utm=a"), get("/f?utm=b&page=2")),
        (&ignore, get("/g?page=2"), get("/g?page=3&x=1")),
    ];
    let count = pairs.len() as u64;
    for (n, (instance, first, second)) in pairs.into_iter().enumerate() {
        let what = format!("pair {n} ({})", first.uri());
        let got = send(&instance.service, first).await;
        assert_eq!(got.x_cache(), "miss", "{what}");
        // Found in L1 itself: an L2 hit would answer `hit` too.
        let l1_hits = instance.layer.stats().get(Event::L1Hit);
        let got = send(&instance.service, second).await;
        assert_eq!(got.x_cache(), "hit", "{what}");
        assert_eq!(
            instance.layer.stats().get(Event::L1Hit),
            l1_hits + 1,
            "{what}"
        );
        assert_eq!(origin.calls(), n as u64 + 1, "{what}");
    }
    assert_eq!(origin.calls(), count);
    // And the host is part of the identity, text or not: another host is another entry,
    // and so is a request with no host at all.
    let got = send(&all.service, with_raw_host("/e", b"h\xe8te.example")).await;
    assert_eq!(got.x_cache(), "miss");
    let mut hostless = get("/e");
    hostless.headers_mut().remove(http::header::HOST);
    assert_eq!(send(&all.service, hostless).await.x_cache(), "miss");
    assert_eq!(origin.calls(), count + 2);
}

/// The same once the route has learned the headers its responses vary on (`Vary:
/// Accept-Language, Host`): each variant, host bytes that are not text included, is
/// found again under the key a hit computes.
#[tokio::test]
async fn variants_find_their_entries_again() {
    let server = RedisServer::start();
    let origin = Origin::new(Duration::ZERO, |n, _| {
        let mut response = Response::new(full(format!("call {n}")));
        response
            .headers_mut()
            .insert("vary", "Accept-Language, Host".parse().unwrap());
        response
    });
    let i = instance(&server, policy("items").build().unwrap(), origin.service()).await;
    let asking = |lang: &str, host: &[u8]| {
        let mut request = with_raw_host("/items/1", host);
        request
            .headers_mut()
            .insert("accept-language", lang.parse().unwrap());
        request
    };
    // The first answer teaches the route its `Vary`, and is kept as its own variant.
    send(&i.service, asking("fr", b"shop.example")).await;
    assert_eq!(origin.calls(), 1);
    for (lang, host, first_time) in [
        ("fr", &b"shop.example"[..], "hit"),
        ("de", b"shop.example", "miss"),
        ("fr", b"h\xe9te.example", "miss"),
        ("fr", b"h\xe8te.example", "miss"),
    ] {
        let first = send(&i.service, asking(lang, host)).await;
        assert_eq!(first.x_cache(), first_time, "{lang} {host:?}");
        let l1_hits = i.layer.stats().get(Event::L1Hit);
        let second = send(&i.service, asking(lang, host)).await;
        assert_eq!(second.x_cache(), "hit", "{lang} {host:?}");
        assert_eq!(
            i.layer.stats().get(Event::L1Hit),
            l1_hits + 1,
            "{lang} {host:?}"
        );
        assert_eq!(second.body, first.body, "{lang} {host:?}");
    }
    // One fill per variant.
    assert_eq!(origin.calls(), 4);
}

/// Over real TCP, the way a hit keys itself (piece by piece, from the request hyper
/// parsed) finds the entry a fill put under the key made from the whole identity:
/// reordered and many parameters, a long path, and variants once the route learned
/// `Vary`. Each second request of a pair is an L1 hit, one handler call per pair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_find_their_entries_through_axum() {
    use stampede_guard::metrics::Event;
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let layer = guard
        .layer(Policy::builder("pages").build().unwrap())
        .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let handler = {
        let calls = calls.clone();
        move |headers: http::HeaderMap| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let lang = headers
                .get("accept-language")
                .map_or("none", |v| v.to_str().unwrap())
                .to_owned();
            async move {
                (
                    [(http::header::VARY, "Accept-Language")],
                    format!("lang={lang} call {n}"),
                )
            }
        }
    };
    let app = Router::new()
        .route("/page", routing::get(handler.clone()))
        .route("/page/{*rest}", routing::get(handler))
        .layer(layer.clone());
    let addr = serve(app).await;
    let many = |order: &mut dyn Iterator<Item = u32>| {
        order
            .map(|n| format!("p{n}={n}"))
            .collect::<Vec<_>>()
            .join("&")
    };
    let long = format!("/page/{}", "x".repeat(600));
    let pairs = [
        ("/page?a=1&b=2".to_owned(), "/page?b=2&a=1".to_owned(), "fr"),
        (
            format!("/page?{}", many(&mut (0..12))),
            format!("/page?{}", many(&mut (0..12).rev())),
            "fr",
        ),
        (long.clone(), long, "fr"),
        ("/page?a=1&b=2".to_owned(), "/page?b=2&a=1".to_owned(), "de"),
    ];
    for (n, (first, second, lang)) in pairs.iter().enumerate() {
        let got = fetch(addr, first, &[("accept-language", lang)]).await;
        assert_eq!(got.x_cache(), "miss", "{first} {lang}");
        let l1_hits = layer.stats().get(Event::L1Hit);
        let got = fetch(addr, second, &[("accept-language", lang)]).await;
        assert_eq!(got.x_cache(), "hit", "{second} {lang}");
        assert!(
            got.body.starts_with(&format!("lang={lang} ")),
            "{}",
            got.body
        );
        assert_eq!(
            layer.stats().get(Event::L1Hit),
            l1_hits + 1,
            "{second} {lang}"
        );
        assert_eq!(
            calls.load(Ordering::SeqCst),
            n as u64 + 1,
            "{second} {lang}"
        );
    }
}

/// Query rules are a route's own: through `axum::serve`, `/search` drops tracking
/// parameters from its key (its handler is given the keyed ones, never a dropped one
/// nor one hidden behind a `;`, and the answers say `detail=query-dropped`), while
/// `/convert`, on a layer of its own, keys every parameter: its handler is given
/// `amount` and `cur`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_query_parameters_leave_the_key_and_not_the_request() {
    let server = RedisServer::start();
    let guard = ready_guard(&server).await;
    let search = guard
        .layer(
            Policy::builder("search")
                .drop_query(["utm_*", "fbclid"])
                .build()
                .unwrap(),
        )
        .unwrap();
    let convert = guard
        .layer(Policy::builder("convert").build().unwrap())
        .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let echo = {
        let calls = calls.clone();
        move |query: axum::extract::RawQuery| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move { format!("{} call {n}", query.0.unwrap_or_default()) }
        }
    };
    let app = Router::new()
        .route("/search", routing::get(echo.clone()).layer(search))
        .route("/convert", routing::get(echo).layer(convert));
    let addr = serve(app).await;
    let status = |got: &web::Got| got.headers["cache-status"].to_str().unwrap().to_owned();
    // A miss: the handler is given the keyed parameters, not the tracking ones.
    let got = fetch(addr, "/search?q=rust&utm_source=news", &[]).await;
    assert_eq!(got.x_cache(), "miss");
    assert_eq!(got.body, "q=rust call 1");
    assert!(
        status(&got).ends_with("; detail=query-dropped"),
        "{}",
        status(&got)
    );
    // Other tracking parameters, another order: the same key, a hit.
    let got = fetch(addr, "/search?fbclid=abc&q=rust&utm_medium=mail", &[]).await;
    assert_eq!(got.x_cache(), "hit");
    assert_eq!(got.body, "q=rust call 1");
    assert!(
        status(&got).ends_with("; detail=query-dropped"),
        "{}",
        status(&got)
    );
    // None of them: the same key too, and nothing was left out.
    let got = fetch(addr, "/search?q=rust", &[]).await;
    assert_eq!(got.x_cache(), "hit");
    assert!(!status(&got).contains("detail="), "{}", status(&got));
    // Another keyed value: another entry. A keyed name hidden behind a `;` (as an
    // origin that also splits at `;` would read it) is never passed on.
    let got = fetch(addr, "/search?q=tokio&utm_x=1;q=evil", &[]).await;
    assert_eq!(
        (got.x_cache(), got.body.as_str()),
        ("miss", "q=tokio call 2")
    );
    // `/convert` keys every parameter: its handler gets `amount` and `cur`.
    let got = fetch(addr, "/convert?cur=GBP&amount=5", &[]).await;
    assert_eq!(
        (got.x_cache(), got.body.as_str()),
        ("miss", "amount=5&cur=GBP call 3")
    );
    let got = fetch(addr, "/convert?amount=1&cur=GBP", &[]).await;
    assert_eq!(
        (got.x_cache(), got.body.as_str()),
        ("miss", "amount=1&cur=GBP call 4")
    );
    assert!(!status(&got).contains("detail="), "{}", status(&got));
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

/// A route that allows `Authorization`, and says nothing else: each credential has its
/// own entries and its own fill. 20 users, 10 requests each, all at once, over real
/// TCP: every answer is its caller's own, and the origin is called once per user (it
/// was: 190 of 200 answers another user's). Told to share across credentials, the same
/// crowd makes one call, and everyone gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_credential_gets_its_own_answer_through_axum() {
    for share in [false, true] {
        let server = RedisServer::start();
        let guard = ready_guard(&server).await;
        let policy = Policy::builder("me")
            .allow_authorization(true)
            .share_across_credentials(share)
            .build()
            .unwrap();
        let layer = guard.layer(policy).unwrap();
        let calls = Arc::new(AtomicU64::new(0));
        let handler = {
            let calls = calls.clone();
            move |headers: http::HeaderMap| {
                calls.fetch_add(1, Ordering::SeqCst);
                let user = headers
                    .get("authorization")
                    .map_or("nobody", |v| v.to_str().unwrap())
                    .trim_start_matches("Bearer ")
                    .to_owned();
                async move {
                    // Long enough for each user's crowd to gather on its fill.
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    format!("the account of {user}")
                }
            }
        };
        let app = Router::new()
            .route("/me", routing::get(handler))
            .layer(layer.clone());
        let addr = serve(app).await;
        let requests = (0..200).map(|n| async move {
            let user = format!("user-{}", n % 20);
            let bearer = format!("Bearer {user}");
            let got = fetch(addr, "/me", &[("authorization", &bearer)]).await;
            (user, got.body)
        });
        let answers = futures_util::future::join_all(requests).await;
        let others = answers
            .iter()
            .filter(|(user, body)| *body != format!("the account of {user}"))
            .count();
        let calls = calls.load(Ordering::SeqCst);
        if share {
            assert_eq!(calls, 1, "one answer for every authorized caller");
            let first = &answers[0].1;
            assert!(answers.iter().all(|(_, body)| body == first));
        } else {
            assert_eq!(others, 0, "{others} of 200 answers were another user's");
            assert_eq!(calls, 20, "one origin call per credential");
        }
    }
}
