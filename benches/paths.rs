//! The request paths that touch Redis, and the CPU work on every path.
//!
//! * an L2 hit (L1 miss): time per request against the bare service, and Redis round
//!   trips per request, counted with `INFO commandstats`;
//! * a refresh and a cold fill: Redis round trips each;
//! * key hashing and entry encoding/decoding per KiB, against copying the same bytes.
//!
//! ```text
//! cargo bench --bench paths
//! ```

#[path = "../tests/support/mod.rs"]
mod support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use stampede_guard::fuzzing::{CachedResponse, decode};
use stampede_guard::lease::FencingToken;
use stampede_guard::metrics::Event;
use stampede_guard::{Policy, RedisStore, StampedeGuard};
use support::RedisServer;
use support::web::{Origin, get, instance, keys, send};

const N: usize = 2_000;

/// (client round trips, all commands run in Redis) so far.
async fn calls(server: &RedisServer) -> (u64, u64) {
    let stats: String = server.cmd(&["INFO", "commandstats"]).await;
    let mut client = 0;
    let mut all = 0;
    for (name, rest) in stats.lines().filter_map(|l| l.split_once(":calls=")) {
        let n: u64 = rest.split(',').next().unwrap().parse().unwrap();
        all += n;
        // Commands a client sends; the scripts' own calls are counted apart by Redis.
        if matches!(
            name,
            "cmdstat_evalsha" | "cmdstat_eval" | "cmdstat_ping" | "cmdstat_info"
        ) {
            client += n;
        }
    }
    (client, all)
}

fn guard(server: &RedisServer) -> StampedeGuard {
    StampedeGuard::builder(RedisStore::builder(server.url()).build().unwrap(), keys())
        .build()
        .unwrap()
}

fn policy(fresh: Duration) -> Policy {
    Policy::builder("items")
        .fresh_ttl(fresh)
        .grace(Duration::from_secs(60))
        .build()
        .unwrap()
}

async fn redis_paths(server: &RedisServer) {
    let origin = Origin::versions(Duration::ZERO);
    let filler = instance(
        guard(server),
        policy(Duration::from_secs(3600)),
        origin.service(),
    )
    .await;
    for n in 0..N {
        send(&filler.service, get(&format!("/items/{n}"))).await;
    }
    // Another instance: every first request is an L1 miss and an L2 hit.
    let reader = instance(
        guard(server),
        policy(Duration::from_secs(3600)),
        origin.service(),
    )
    .await;
    let bare = origin.service();
    let before = calls(server).await;
    let start = Instant::now();
    for n in 0..N {
        let got = send(&reader.service, get(&format!("/items/{n}"))).await;
        assert_eq!(got.x_cache(), "hit");
    }
    let l2_hit = start.elapsed() / N as u32;
    let after = calls(server).await;
    let start = Instant::now();
    for n in 0..N {
        use tower::ServiceExt;
        black_box(
            bare.clone()
                .oneshot(get(&format!("/items/{n}")))
                .await
                .unwrap(),
        );
    }
    let bare_time = start.elapsed() / N as u32;
    // One INFO in between.
    let l2_round_trips = (after.0 - before.0 - 1) as f64 / N as f64;
    assert_eq!(reader.layer.stats().get(Event::L2Hit), N as u64);
    println!("L2 hit (L1 miss), {N} requests:");
    println!(
        "  bare service                {:>9.1} µs",
        micros(bare_time)
    );
    println!(
        "  guarded, L2 hit             {:>9.1} µs ({:.1}x)",
        micros(l2_hit),
        micros(l2_hit) / micros(bare_time)
    );
    println!("  Redis round trips per L2 hit: {l2_round_trips:.2}");

    // Refreshes: entries that go stale, one request each (served stale), refreshed in
    // the background.
    let origin = Origin::versions(Duration::ZERO);
    let fresh = Duration::from_millis(300);
    let i = instance(guard(server), policy(fresh), origin.service()).await;
    let before = calls(server).await;
    for n in 0..N {
        send(&i.service, get(&format!("/stale/{n}"))).await;
    }
    let cold = calls(server).await;
    tokio::time::sleep(fresh + Duration::from_millis(50)).await;
    let start = Instant::now();
    for n in 0..N {
        let got = send(&i.service, get(&format!("/stale/{n}"))).await;
        assert_eq!(got.x_cache(), "stale");
    }
    let stale_serve = start.elapsed() / N as u32;
    while i.layer.stats().get(Event::RefreshWritten) < N as u64 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let refreshed = calls(server).await;
    let cold_trips = (cold.0 - before.0 - 1) as f64 / N as f64;
    let refresh_trips = (refreshed.0 - cold.0 - 1) as f64 / N as f64;
    println!("Cold fills and refreshes, {N} keys:");
    println!(
        "  Redis round trips per cold fill: {cold_trips:.2} (read, acquire, fenced write + release + notice)"
    );
    println!(
        "  Redis round trips per refresh:   {refresh_trips:.2} (re-read, acquire, fenced write + release + notice)"
    );
    println!(
        "  a stale request is served in {:.1} µs while its refresh runs apart",
        micros(stale_serve)
    );
}

fn cpu_paths() {
    let keys = keys();
    let rounds = 20_000u32;
    for size in [64usize, 1024] {
        let identity = vec![b'a'; size];
        let start = Instant::now();
        for _ in 0..rounds {
            black_box(
                stampede_guard::fuzzing::cache_keys(&keys, "items", black_box(&identity)).unwrap(),
            );
        }
        let hash = start.elapsed() / rounds;
        let start = Instant::now();
        for _ in 0..rounds {
            black_box(Bytes::copy_from_slice(black_box(&identity)));
        }
        let copy = start.elapsed() / rounds;
        println!(
            "key for a {size} B identity: {:>7.0} ns ({:.1}x copying it)",
            ns(hash),
            ns(hash) / ns(copy).max(1.0)
        );
    }
    for kib in [1usize, 64] {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("etag", HeaderValue::from_static("\"abc123\""));
        let entry = CachedResponse {
            status: StatusCode::OK,
            headers,
            body: Bytes::from(vec![b'x'; kib * 1024]),
            fresh_for: Duration::from_secs(1),
            grace: Duration::from_secs(10),
            keep: Duration::from_secs(60),
            token: FencingToken::new(1_796_000_000_000_000),
        };
        let rounds = (2_000 / kib as u32).max(50) * 10;
        let start = Instant::now();
        let mut encoded = Vec::new();
        for _ in 0..rounds {
            encoded = black_box(entry.encode());
        }
        let encode = start.elapsed() / rounds;
        let start = Instant::now();
        for _ in 0..rounds {
            black_box(decode(black_box(&encoded)).unwrap());
        }
        let decode_time = start.elapsed() / rounds;
        let start = Instant::now();
        for _ in 0..rounds {
            black_box(Bytes::copy_from_slice(black_box(&encoded)));
        }
        let copy = start.elapsed() / rounds;
        println!(
            "entry of {kib} KiB: encode {:.0} ns/KiB ({:.1}x a copy), decode {:.0} ns/KiB ({:.1}x a copy)",
            ns(encode) / kib as f64,
            ns(encode) / ns(copy).max(1.0),
            ns(decode_time) / kib as f64,
            ns(decode_time) / ns(copy).max(1.0)
        );
    }
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn ns(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

fn main() {
    let server = RedisServer::start();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(redis_paths(&server));
    cpu_paths();
}
