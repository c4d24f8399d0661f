//! Routes: following the origin by default, the longest prefix, whole segments of the
//! resolved path, entries kept through unsafe requests.

use super::*;

/// An HTTP cache by default: what the origin says its answers' lifetimes are sets them;
/// an answer with neither a lifetime nor a validator is not reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_follows_the_origin_by_default() {
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let sidecar = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let first = fetch(sidecar.listen, "/max-age-60/a", &[]).await;
    assert_eq!(first.x_cache(), "miss");
    let status = first.headers["cache-status"].to_str().unwrap();
    assert_eq!(status, "stampede-guard; fwd=uri-miss; stored; ttl=60");
    let second = fetch(sidecar.listen, "/max-age-60/a", &[]).await;
    assert_eq!(
        (second.x_cache(), second.body.as_str()),
        ("hit", "/max-age-60/a call 1")
    );
    for _ in 0..2 {
        assert_eq!(fetch(sidecar.listen, "/plain", &[]).await.x_cache(), "pass");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_prefix_picks_the_policy() {
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "upstream = \"http://{origin}\"\ndefault = \"pass\"\nfresh = \"60s\"\n\
             follow_origin = false\n\n\
             [[routes]]\nname = \"items\"\nprefix = \"/items/\"\n\n\
             [[routes]]\nname = \"hot\"\nprefix = \"/items/hot\"\nkey_query = \"ignore\"\n"
        ),
    );
    let sidecar = Sidecar::start(&["--config", &config]);
    let get = |path: &'static str| fetch(sidecar.listen, path, &[]);

    // No route: passed through, every time.
    assert_eq!(get("/other").await.x_cache(), "bypass");
    assert_eq!(get("/other").await.x_cache(), "bypass");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // "/items/": every query parameter keyed.
    assert_eq!(get("/items/1?a=1").await.x_cache(), "miss");
    assert_eq!(get("/items/1?a=2").await.x_cache(), "miss");
    assert_eq!(get("/items/1?a=1").await.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    // "/items/hot" is longer: its policy ignores the query.
    assert_eq!(get("/items/hot?a=1").await.x_cache(), "miss");
    assert_eq!(get("/items/hot?a=2").await.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 5);
}

/// A route's prefix matches whole segments of the path as the strictest origin resolves
/// it: `/static` holds `/static/a.css`, not `/staticky`, and `/static/%2e%2e/account`
/// (the origin's `/account`), an encoded `/` or `\`, or a `..;` (Tomcat's `..`) never
/// land on it (web cache deception).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_holds_whole_segments_of_the_resolved_path() {
    let (origin, calls, _gate) = origin(u64::MAX).await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "upstream = \"http://{origin}\"\ndefault = \"pass\"\nfresh = \"60s\"\n\
             follow_origin = false\n\n\
             [[routes]]\nname = \"static\"\nprefix = \"/static\"\n"
        ),
    );
    let sidecar = Sidecar::start(&["--config", &config]);
    let get = |path: &'static str| fetch(sidecar.listen, path, &[]);
    assert_eq!(get("/static/a.css").await.x_cache(), "miss");
    assert_eq!(get("/static/a.css").await.x_cache(), "hit");
    assert_eq!(get("/static").await.x_cache(), "miss");
    assert_eq!(get("/static/./b.css").await.x_cache(), "miss");
    for elsewhere in [
        "/staticky",
        "/static/%2e%2e/account",
        "/static/%2E%2E/account",
        "/static/../account",
        "/static%2F..%2Faccount",
        "/static/..;/account",
        "/static/..;jsessionid=1/account",
        "/static/..%5Caccount",
        "/account%2F..%2Fstatic/x.css",
    ] {
        for _ in 0..2 {
            assert_eq!(get(elsewhere).await.x_cache(), "bypass", "{elsewhere}");
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3 + 18);
}

/// A successful `POST` invalidates its URI for the fleet (RFC 9111 §4.4), by default;
/// a route with `invalidate_on_unsafe = false` keeps its entries (any client whose
/// `POST` the origin accepts could otherwise evict them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_may_keep_its_entries_through_unsafe_requests() {
    let (origin, seen) = recording_origin().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "upstream = \"http://{origin}\"\n\n\
             [[routes]]\nname = \"kept\"\nprefix = \"/kept\"\ninvalidate_on_unsafe = false\n\n\
             [[routes]]\nname = \"items\"\nprefix = \"/items\"\n"
        ),
    );
    let sidecar = Sidecar::start(&["--config", &config]);
    for (path, invalidated) in [("/items/1", true), ("/kept/1", false)] {
        assert_eq!(fetch(sidecar.listen, path, &[]).await.x_cache(), "miss");
        assert_eq!(fetch(sidecar.listen, path, &[]).await.x_cache(), "hit");
        let posted = post_json(sidecar.listen, path, &[], "{}").await;
        assert_eq!(posted.status, StatusCode::OK);
        let after = fetch(sidecar.listen, path, &[]).await;
        let want = if invalidated { "miss" } else { "hit" };
        assert_eq!(after.x_cache(), want, "{path}");
    }
    assert_eq!(seen.lock().unwrap().len(), 5, "3 fills and 2 POSTs");
}
