//! Ranges end to end, through the sidecar binary over real TCP: a range cut from the
//! whole entry on a miss and on a hit, other ranges answered with the whole entry, a
//! range of an answer too large to store sent to the origin.

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use http::StatusCode;
use support::http::{fetch, fetch_method, serve};
use support::sidecar::{Sidecar, write_config};

/// The representation the range tests' origin serves: 20 bytes.
const WHOLE: &str = "0123456789abcdefghij";

/// An origin of [`WHOLE`] (fresh for a minute, with an `ETag`) that keeps the headers of
/// every request it gets, and answers a `Range` of the form `bytes=F-L` itself, `206`
/// (the sidecar must never send it one on a fill).
async fn ranged_origin() -> (SocketAddr, Arc<Mutex<Vec<http::HeaderMap>>>) {
    let seen = Arc::new(Mutex::new(Vec::<http::HeaderMap>::new()));
    let app = Router::new().fallback({
        let seen = seen.clone();
        move |headers: http::HeaderMap| {
            let seen = seen.clone();
            async move {
                let range = headers
                    .get("range")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("bytes="))
                    .and_then(|v| v.split_once('-'))
                    .and_then(|(f, l)| Some((f.parse::<usize>().ok()?, l.parse::<usize>().ok()?)));
                seen.lock().unwrap().push(headers);
                let fields = [("cache-control", "max-age=60"), ("etag", "\"v1\"")];
                match range {
                    Some((first, last)) => (
                        StatusCode::PARTIAL_CONTENT,
                        fields,
                        [(
                            "content-range",
                            format!("bytes {first}-{last}/{}", WHOLE.len()),
                        )],
                        WHOLE[first..=last].to_owned(),
                    ),
                    None => (
                        StatusCode::OK,
                        fields,
                        [("x-whole", "1".to_owned())],
                        WHOLE.to_owned(),
                    ),
                }
            }
        }
    });
    (serve(app).await, seen)
}

/// A single byte range is cut from the whole entry: on a miss, the origin is asked once,
/// for the whole (no `Range`), and the range answered from what it sent; on a hit, from
/// the entry, without the origin. `bytes=-5` is the last five bytes; a range past the
/// end is `416` with the length. `Accept-Ranges: bytes` on the entry's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_is_cut_from_the_whole_entry_on_a_miss_and_on_a_hit() {
    let (origin, seen) = ranged_origin().await;
    let sidecar = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let cases = [
        (
            "/a",
            "bytes=0-9",
            StatusCode::PARTIAL_CONTENT,
            "bytes 0-9/20",
            "0123456789",
        ),
        (
            "/b",
            "bytes=-5",
            StatusCode::PARTIAL_CONTENT,
            "bytes 15-19/20",
            "fghij",
        ),
        (
            "/c",
            "bytes=20-",
            StatusCode::RANGE_NOT_SATISFIABLE,
            "bytes */20",
            "",
        ),
    ];
    for (at, (path, range, status, content_range, body)) in cases.into_iter().enumerate() {
        for x_cache in ["miss", "hit"] {
            let got = fetch(sidecar.listen, path, &[("range", range)]).await;
            let what = format!("{range} on a {x_cache}");
            assert_eq!(got.status, status, "{what}: {}", got.body);
            assert_eq!(got.x_cache(), x_cache, "{what}");
            assert_eq!(got.headers["content-range"], content_range, "{what}");
            assert_eq!(
                got.headers["content-length"],
                body.len().to_string(),
                "{what}"
            );
            assert_eq!(got.body, body, "{what}");
            assert_eq!(got.headers["accept-ranges"], "bytes", "{what}");
            // Exactly one origin call per path, for the whole.
            let seen = seen.lock().unwrap();
            assert_eq!(seen.len(), at + 1, "{what}");
            assert!(!seen[at].contains_key("range"), "{what}: {:?}", seen[at]);
            assert!(!seen[at].contains_key("if-range"), "{what}");
        }
        // The entry is the whole: a GET without a range gets it.
        let whole = fetch(sidecar.listen, path, &[]).await;
        assert_eq!((whole.status, whole.x_cache()), (StatusCode::OK, "hit"));
        assert_eq!(whole.body, WHOLE);
        assert!(!whole.headers.contains_key("content-range"));
    }
    assert_eq!(seen.lock().unwrap().len(), 3);
}

/// What is not one byte range of the entry the client means gets the whole `200`, from
/// the entry: several ranges, a `Range` that is not valid, an `If-Range` whose
/// validator is not the entry's; a HEAD's range is ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_ranges_get_the_whole_entry() {
    let (origin, seen) = ranged_origin().await;
    let sidecar = Sidecar::start(&["--upstream", &format!("http://{origin}")]);
    let cut = fetch(
        sidecar.listen,
        "/a",
        &[("range", "bytes=1-2"), ("if-range", "\"v1\"")],
    )
    .await;
    assert_eq!(
        (cut.status, cut.body.as_str()),
        (StatusCode::PARTIAL_CONTENT, "12")
    );
    for asked in [
        &[("range", "bytes=0-1,5-6")][..],
        &[("range", "bytes=5-1")],
        &[("range", "lines=0-1")],
        &[("range", "bytes=0-1"), ("if-range", "\"v0\"")],
        &[("range", "bytes=0-1"), ("if-range", "W/\"v1\"")],
    ] {
        let got = fetch(sidecar.listen, "/a", asked).await;
        assert_eq!(got.status, StatusCode::OK, "{asked:?}");
        assert_eq!(
            (got.x_cache(), got.body.as_str()),
            ("hit", WHOLE),
            "{asked:?}"
        );
        assert!(!got.headers.contains_key("content-range"), "{asked:?}");
    }
    let head = fetch_method(sidecar.listen, "HEAD", "/a").await;
    assert_eq!((head.status, head.x_cache()), (StatusCode::OK, "hit"));
    assert_eq!(seen.lock().unwrap().len(), 1, "one fill, of the whole");
}

/// An answer too large to store streams through: the request whose fill found that out
/// gets its range cut from it as it streams (its fill asked for the whole, whose length
/// it declares); the key's later callers skip the caches (hit-for-pass), and share one
/// call of the whole for each crowd of them, each cut to its range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_of_an_answer_too_large_to_store_goes_to_the_origin() {
    let (origin, seen) = ranged_origin().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!(
            "upstream = \"http://{origin}\"\ndefault = \"cache\"\n\n\
             [[routes]]\nname = \"big\"\nprefix = \"/big/\"\nmax_body = 16\n"
        ),
    );
    let sidecar = Sidecar::start(&["--config", &config]);
    let first = fetch(sidecar.listen, "/big/1", &[("range", "bytes=0-9")]).await;
    assert_eq!(
        (first.status, first.x_cache()),
        (StatusCode::PARTIAL_CONTENT, "pass")
    );
    assert_eq!(first.headers["content-range"], "bytes 0-9/20");
    assert_eq!(first.body, "0123456789");
    let second = fetch(sidecar.listen, "/big/1", &[("range", "bytes=0-9")]).await;
    assert_eq!(second.status, StatusCode::PARTIAL_CONTENT);
    assert_eq!(second.x_cache(), "pass");
    assert_eq!(second.headers["content-range"], "bytes 0-9/20");
    assert_eq!(second.body, "0123456789");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    assert!(
        seen.iter().all(|headers| !headers.contains_key("range")),
        "each fill asks for the whole"
    );
}

/// Twenty ranged GETs at once, each of another MiB of a 20 MiB answer too large to
/// store, after the key's first answer said so (hit-for-pass): one origin call of the
/// whole for all of them, each cut to its range, every byte right. (Each went to the
/// origin on its own: 20 calls.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_ranges_during_hit_for_pass_shares_one_call() {
    use support::chunked::{self, pattern_at};
    let (origin, calls) = chunked::origin().await;
    let sidecar = Sidecar::start(&[
        "--upstream",
        &format!("http://{origin}"),
        "--metrics",
        "127.0.0.1:0",
    ]);
    let path = "/sized/20480";
    let first = fetch(sidecar.listen, path, &[]).await;
    assert_eq!((first.status, first.x_cache()), (StatusCode::OK, "pass"));
    assert_eq!(calls.get().len(), 1);
    // The origin's body is held until every caller joined the fill (its head is not).
    calls.hold();
    let mib = 1024 * 1024;
    let ranges = (0..20u64).map(|n| {
        let listen = sidecar.listen;
        tokio::spawn(async move {
            let range = format!("bytes={}-{}", n * mib, n * mib + 1023);
            (n, fetch(listen, path, &[("range", range.as_str())]).await)
        })
    });
    let ranges: Vec<_> = ranges.collect();
    let metrics = sidecar.metrics.unwrap();
    let joined = support::eventually(support::HANG, || async {
        let scraped = fetch(metrics, "/metrics", &[]).await.body;
        scraped
            .lines()
            .find(|l| l.starts_with("stampede_guard_fill_joins_total"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            == Some(19)
    });
    assert!(joined.await, "the 20 ranged callers did not join one fill");
    calls.open();
    for ranged in ranges {
        let (n, got) = ranged.await.unwrap();
        assert_eq!(got.status, StatusCode::PARTIAL_CONTENT, "range {n}");
        assert_eq!(got.raw.len(), 1024, "range {n}");
        let right = (0..1024).all(|i| got.raw[i] == pattern_at(n * mib + i as u64));
        assert!(right, "range {n}: a wrong byte");
    }
    let made = calls.get().len() - 1;
    assert_eq!(made, 1, "{made} origin calls for 20 ranges at once");
}
