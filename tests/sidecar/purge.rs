//! Purges over HTTP: the token, by path and by tag, soft and hard, errors in JSON.

use super::*;

/// Purges over HTTP, behind the admin token: by path (that entry only) and by tag (hard:
/// gone; soft: stale, here filled again at once as the origin allows no stale).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_over_http_need_the_token() {
    let redis = RedisServer::start();
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--redis",
        &redis.url(),
        "--admin",
        "127.0.0.1:0",
        "--admin-token",
        "s3cret",
    ]);
    let admin = sidecar.admin.expect("an admin listener");
    let get = |path: &'static str| fetch(sidecar.listen, path, &[]);
    let auth = [("authorization", "Bearer s3cret")];
    assert_eq!(get("/max-age-60/a").await.x_cache(), "miss");
    assert_eq!(get("/max-age-60/b").await.x_cache(), "miss");

    let tags = r#"{"tags": ["all"]}"#;
    let refused = post_json(admin, "/purge/tags", &[], tags).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    let wrong = post_json(admin, "/purge/tags", &[("authorization", "Bearer x")], tags).await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert_eq!(get("/max-age-60/a").await.x_cache(), "hit");

    // By path: that entry only.
    let by_path = post_json(admin, "/purge/path", &auth, r#"{"path": "/max-age-60/a"}"#).await;
    assert_eq!(by_path.status, StatusCode::OK, "{}", by_path.body);
    assert_eq!(by_path.body, r#"{"entries":1}"#);
    assert_eq!(get("/max-age-60/a").await.x_cache(), "miss");
    assert_eq!(get("/max-age-60/b").await.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    // Soft, by tag: stale; and as the origin did not allow serving them stale (no
    // stale-while-revalidate), filled again at once, once each.
    let soft = post_json(
        admin,
        "/purge/tags",
        &auth,
        r#"{"tags": ["all"], "soft": true}"#,
    )
    .await;
    assert_eq!(soft.status, StatusCode::OK, "{}", soft.body);
    let said: serde_json::Value = serde_json::from_str(&soft.body).unwrap();
    assert_eq!(said, serde_json::json!({"tags": 1, "soft": true}));
    for path in ["/max-age-60/a", "/max-age-60/b"] {
        assert_eq!(fetch(sidecar.listen, path, &[]).await.x_cache(), "miss");
    }
    assert!(
        eventually(HANG, || async {
            get("/max-age-60/a").await.x_cache() == "hit"
                && get("/max-age-60/b").await.x_cache() == "hit"
        })
        .await
    );
    assert_eq!(calls.load(Ordering::SeqCst), 5);

    // Hard, by tag: gone.
    let hard = post_json(admin, "/purge/tags", &auth, tags).await;
    assert_eq!(hard.status, StatusCode::OK, "{}", hard.body);
    assert_eq!(get("/max-age-60/b").await.x_cache(), "miss");
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    // Bad requests are refused, naming what is wrong, in JSON as the rest.
    let empty = post_json(admin, "/purge/tags", &auth, r#"{"tags": []}"#).await;
    assert_eq!(empty.status, StatusCode::BAD_REQUEST);
    let relative = post_json(admin, "/purge/path", &auth, r#"{"path": "items"}"#).await;
    assert_eq!(relative.status, StatusCode::BAD_REQUEST);
    let garbled = post_json(admin, "/purge/tags", &auth, r#"{"tags": "#).await;
    assert_eq!(garbled.status, StatusCode::BAD_REQUEST);
    let unknown = post_json(admin, "/purge/tags", &auth, r#"{"tag": ["all"]}"#).await;
    assert_eq!(unknown.status, StatusCode::UNPROCESSABLE_ENTITY);
    // As `curl -d` sends it: a form's content type.
    let (form, form_body) = raw_exchange(
        admin,
        &format!(
            "POST /purge/tags HTTP/1.1\r\nHost: admin.example\r\nAuthorization: Bearer s3cret\r\n\
             Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{tags}",
            tags.len()
        ),
    )
    .await;
    assert_eq!(form, 415);
    assert!(form_body.contains("application/json"), "{form_body}");
    let (read, read_body) = raw_exchange(
        admin,
        "GET /purge/tags HTTP/1.1\r\nHost: admin.example\r\nAuthorization: Bearer s3cret\r\n\
         Connection: close\r\n\r\n",
    )
    .await;
    assert_eq!(read, 405);
    for (what, body) in [
        ("no token", &refused.body),
        ("a wrong token", &wrong.body),
        ("no tags", &empty.body),
        ("a relative path", &relative.body),
        ("a body cut short", &garbled.body),
        ("an unknown field", &unknown.body),
        ("a form", &form_body),
        ("a GET", &read_body),
    ] {
        let said: serde_json::Value =
            serde_json::from_str(body).unwrap_or_else(|_| panic!("{what}: not JSON: {body:?}"));
        assert!(said["error"].is_string(), "{what}: {said}");
    }
}

/// Sends `request` as it is on a connection of its own, reads until the server closes
/// it: the status and the body.
async fn raw_exchange(addr: SocketAddr, request: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    within(HANG, stream.read_to_end(&mut got), "the answer")
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (head[9..12].parse().unwrap(), body.to_owned())
}

/// Purge by path on a route keyed on `Accept-Language` (in the config file): the
/// entries of two values and of no value at all are cached (the origin called once
/// each); one `POST /purge/path` answers that it removed 3, and the next request for
/// each value reaches the origin again, once; the same path with another query stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_by_path_reaches_every_value_of_a_keyed_header() {
    let redis = RedisServer::start();
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "upstream = \"http://{origin}\"\ndefault = \"pass\"\nfollow_origin = false\n\
             fresh = \"1h\"\n\n\
             [[routes]]\nname = \"pages\"\nprefix = \"/pages/\"\n\
             key_headers = [\"accept-language\"]\n"
        ),
    );
    let sidecar = Sidecar::start(&[
        "--config",
        &config,
        "--redis",
        &redis.url(),
        "--admin",
        "127.0.0.1:0",
        "--admin-token",
        "s3cret",
    ]);
    let admin = sidecar.admin.expect("an admin listener");
    let auth = [("authorization", "Bearer s3cret")];
    let asks: [&[(&str, &str)]; 3] = [
        &[("accept-language", "fr")],
        &[("accept-language", "de")],
        &[],
    ];
    let page = |path: &'static str, headers: &'static [(&'static str, &'static str)]| {
        fetch(sidecar.listen, path, headers)
    };
    // Each of the three filled from the origin (calls `first`, `first + 1`, ...), then hit.
    let fill_all = |first: usize| async move {
        for (n, headers) in asks.into_iter().enumerate() {
            let got = page("/pages/7?page=2", headers).await;
            let body = format!("/pages/7 call {}", n + first);
            assert_eq!((got.x_cache(), &got.body), ("miss", &body), "{headers:?}");
            let again = page("/pages/7?page=2", headers).await;
            assert_eq!(
                (again.x_cache(), &again.body),
                ("hit", &body),
                "{headers:?}"
            );
        }
    };
    fill_all(1).await;
    let neighbour = page("/pages/7?page=3", asks[0]).await;
    assert_eq!(neighbour.body, "/pages/7 call 4");
    assert_eq!(calls.load(Ordering::SeqCst), 4);

    let purge = r#"{"path": "/pages/7?page=2"}"#;
    let refused = post_json(admin, "/purge/path", &[], purge).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    assert_eq!(page("/pages/7?page=2", asks[0]).await.x_cache(), "hit");
    let purged = post_json(admin, "/purge/path", &auth, purge).await;
    assert_eq!(purged.status, StatusCode::OK, "{}", purged.body);
    let answer: serde_json::Value = serde_json::from_str(&purged.body).unwrap();
    assert_eq!(answer, serde_json::json!({"entries": 3}));

    fill_all(5).await;
    let neighbour = page("/pages/7?page=3", asks[0]).await;
    assert_eq!(
        (neighbour.x_cache(), neighbour.body.as_str()),
        ("hit", "/pages/7 call 4")
    );
    assert_eq!(calls.load(Ordering::SeqCst), 7);
}
