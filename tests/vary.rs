//! Variants: what an answer's `Vary` names is learned per URL and kept in Redis, so that
//! an instance that starts later, or missed the notice while its subscription was down,
//! serves each client the variant its headers ask for from its first request; and one
//! URL's `Vary` never moves the entries of another.
//!
//! Each instance is an axum app served by `axum::serve`, every request on a connection
//! of its own.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::response::IntoResponse;
use axum::routing::get;
use http::{HeaderMap, header};
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::http::{fetch, serve};
use support::web::{keys, ready_guard};
use support::{Mode, Proxy, RedisServer, eventually};

fn policy() -> Policy {
    Policy::builder("pages")
        .fresh_ttl(Duration::from_secs(60))
        .build()
        .unwrap()
}

/// `/doc/{id}`: document `id` varies on `Accept` (JSON for a client that asks for it,
/// HTML otherwise) when `id` is `varies`, and never otherwise. Counts its calls.
fn app(guard: &StampedeGuard, calls: Arc<AtomicU64>) -> Router {
    let layer = guard.layer(policy()).unwrap();
    let handler = move |uri: http::Uri, headers: HeaderMap| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let id = uri.path().trim_start_matches("/doc/").to_owned();
            if id != "varies" {
                return format!("doc {id} (call {n})").into_response();
            }
            let json = headers
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains("json"));
            let (kind, body) = if json {
                ("application/json", format!("{{\"call\":{n}}}"))
            } else {
                ("text/html", format!("<p>call {n}</p>"))
            };
            (
                [(header::CONTENT_TYPE, kind), (header::VARY, "accept")],
                body,
            )
                .into_response()
        }
    };
    Router::new().route("/doc/{id}", get(handler).layer(layer))
}

const JSON: (&str, &str) = ("accept", "application/json");

/// Instance A learns that `/doc/varies` varies on `Accept` (its first client sends
/// none, its second asks for JSON); instance B starts after that: its first JSON client
/// gets the JSON variant from Redis, and its first client without `Accept` the HTML one,
/// with no call to the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_started_later_serves_the_variant_each_client_asks_for() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let a = serve(app(&ready_guard(&server).await, calls.clone())).await;
    let html = fetch(a, "/doc/varies", &[]).await;
    assert_eq!(html.body, "<p>call 1</p>");
    let json = fetch(a, "/doc/varies", &[JSON]).await;
    assert_eq!(json.body, "{\"call\":2}");
    assert_eq!(fetch(a, "/doc/varies", &[JSON]).await.x_cache(), "hit");

    let b = serve(app(&ready_guard(&server).await, calls.clone())).await;
    let json = fetch(b, "/doc/varies", &[JSON]).await;
    assert_eq!(json.body, "{\"call\":2}", "B's first JSON client");
    assert_eq!(json.headers[header::CONTENT_TYPE], "application/json");
    let html = fetch(b, "/doc/varies", &[]).await;
    assert_eq!(
        html.body, "<p>call 1</p>",
        "B's first client without Accept"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "origin calls");
}

/// Only a variant is stored (A's first client asked for JSON: the URL's own entry, which
/// B would look at first, is not there): what A learned is read back from Redis, and B's
/// first JSON client is served that variant with no call to the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_names_learned_are_read_back_from_redis() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let a_guard = ready_guard(&server).await;
    let a = serve(app(&a_guard, calls.clone())).await;
    assert_eq!(fetch(a, "/doc/varies", &[JSON]).await.body, "{\"call\":1}");
    let records = server.scan(&format!("{}*:vary", keys().prefix())).await;
    assert_eq!(records.len(), 1, "one record of names: {records:?}");
    let names: String = server.cmd(&["GET", &records[0]]).await;
    assert_eq!(names, "accept");

    let b = serve(app(&ready_guard(&server).await, calls.clone())).await;
    let json = fetch(b, "/doc/varies", &[JSON]).await;
    assert_eq!(json.body, "{\"call\":1}", "B's first JSON client");
    assert_eq!(json.x_cache(), "hit");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "origin calls");
    // A client without `Accept` has no entry yet: its own fill.
    assert_eq!(fetch(b, "/doc/varies", &[]).await.body, "<p>call 2</p>");
}

/// Instance B hears nothing while A learns the `Vary` (its subscription is down: the
/// notice is lost), and B never saw the URL vary: its first JSON client still gets JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_missed_the_notice_serves_the_variant_each_client_asks_for() {
    let server = RedisServer::start();
    let proxy = Proxy::start(server.addr()).await;
    let calls = Arc::new(AtomicU64::new(0));
    let store = RedisStore::builder(proxy.url()).build().unwrap();
    let guard_b = StampedeGuard::builder(store, keys()).build().unwrap();
    guard_b.ready().await.unwrap();
    let b = serve(app(&guard_b, calls.clone())).await;
    let a = serve(app(&ready_guard(&server).await, calls.clone())).await;

    proxy.set(Mode::Blackhole);
    assert!(
        eventually(Duration::from_secs(10), || async {
            !guard_b.notices_connected()
        })
        .await
    );
    // Learned by A: the header-less client's HTML is stored where B looks first.
    assert_eq!(fetch(a, "/doc/varies", &[]).await.body, "<p>call 1</p>");
    proxy.set(Mode::Pass);
    proxy.reset_all();
    assert!(
        eventually(Duration::from_secs(10), || async {
            guard_b.notices_connected()
        })
        .await
    );

    let json = fetch(b, "/doc/varies", &[JSON]).await;
    assert_eq!(json.headers[header::CONTENT_TYPE], "application/json");
    assert_eq!(json.body, "{\"call\":2}", "B's first JSON client");
    let html = fetch(b, "/doc/varies", &[]).await;
    assert_eq!(
        html.body, "<p>call 1</p>",
        "B's first client without Accept"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2, "origin calls");
}

/// 200 URLs of which one varies: the other 199 keep one entry each (in Redis, and one
/// origin call each), whether their clients send `Accept` or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_url_that_varies_does_not_move_the_entries_of_the_others() {
    let server = RedisServer::start();
    let calls = Arc::new(AtomicU64::new(0));
    let guard = ready_guard(&server).await;
    let addr = serve(app(&guard, calls.clone())).await;
    assert_eq!(fetch(addr, "/doc/varies", &[]).await.body, "<p>call 1</p>");
    assert_eq!(
        fetch(addr, "/doc/varies", &[JSON]).await.body,
        "{\"call\":2}"
    );
    for id in 0..199 {
        let path = format!("/doc/{id}");
        let plain = fetch(addr, &path, &[]).await;
        let json = fetch(addr, &path, &[JSON]).await;
        assert_eq!(plain.body, json.body, "{path}: one entry for both clients");
        assert_eq!(json.x_cache(), "hit", "{path}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2 + 199, "origin calls");
    let entries = server.scan(&format!("{}*:entry", keys().prefix())).await;
    assert_eq!(entries.len(), 2 + 199, "entries in Redis: {entries:?}");
}
