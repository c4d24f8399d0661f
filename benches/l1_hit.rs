//! The cost of an L1 hit: the guarded service against the bare inner service returning
//! the same bytes, in process (`oneshot`), without and then with a metrics recorder
//! installed; and, in the same run, what three things every hit does cost alone: a
//! keyed SipHash-1-3 of the request's identity (its key in L1), a clone of an answer's
//! headers (`age` and `x-cache`, the two the guard adds, dropped again by the caller),
//! and a read of the clock entries are aged by. And a hit when L1 is full, when moka
//! answers every hit.
//!
//! ```text
//! cargo bench --bench l1_hit --features prometheus
//! ```
//!
//! Rounds of each variant are interleaved and the median per request is reported, so
//! machine noise falls on all of them alike. A hit makes no Redis round trip: the bench
//! counts commands on the server across the measured hits and reports them.

#[path = "../tests/support/mod.rs"]
mod support;

use std::hash::Hasher;
use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use siphasher::sip128::{Hasher128, SipHasher13};
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
use support::RedisServer;
use tower::{Layer, Service, ServiceExt};

const BATCH: u32 = 20_000;
const ROUNDS: usize = 15;
const BODY: &[u8] = &[b'x'; 512];

type Req = Request<Empty<Bytes>>;

fn request() -> Req {
    Request::get("/items/42?page=1")
        .header("host", "shop.example")
        .body(Empty::new())
        .unwrap()
}

fn bare()
-> impl Service<Req, Response = Response<Full<Bytes>>, Error = std::convert::Infallible, Future: Send>
+ Clone
+ Send
+ Sync
+ 'static {
    tower::service_fn(|_req: Req| async { Ok(Response::new(Full::new(Bytes::from_static(BODY)))) })
}

async fn per_request<S, B>(service: &S) -> Duration
where
    S: Service<Req, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let start = Instant::now();
    for _ in 0..BATCH {
        let response = service.clone().oneshot(request()).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        black_box(body);
    }
    start.elapsed() / BATCH
}

fn bench_keys() -> KeySpace {
    KeySpace::builder()
        .env("bench")
        .service("bench")
        .secret(b"bench secret, sixteen bytes or more".to_vec())
        .build()
        .unwrap()
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn ns(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

async fn guarded(
    server: &RedisServer,
) -> impl Service<
    Req,
    Response = Response<stampede_guard::ResponseBody<Full<Bytes>>>,
    Error = std::convert::Infallible,
> + Clone {
    let guard = StampedeGuard::builder(
        RedisStore::builder(server.url()).build().unwrap(),
        bench_keys(),
    )
    .build()
    .unwrap();
    guard.ready().await.unwrap();
    let service = items(&guard).layer(bare());
    // Fill L1 (from the origin, or from L2 in the second phase).
    let _first = service.clone().oneshot(request()).await.unwrap();
    let second = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(second.headers()["x-cache"], "hit");
    service
}

/// A guard whose L1 is full (a local-only one, small, filled with other keys while the
/// bench's key is read often enough to stay): moka answers every hit then, so that it
/// chooses what to evict knowing every hit.
async fn guarded_full() -> impl Service<
    Req,
    Response = Response<stampede_guard::ResponseBody<Full<Bytes>>>,
    Error = std::convert::Infallible,
> + Clone {
    const CAPACITY: u64 = 256 * 1024;
    let guard = StampedeGuard::builder(RedisStore::local_only(), bench_keys())
        .l1_capacity(CAPACITY)
        .build()
        .unwrap();
    let service = items(&guard).layer(bare());
    for n in 0..1000 {
        let other = Request::get(format!("/others/{n}"))
            .header("host", "shop.example")
            .body(Empty::new())
            .unwrap();
        let _ = service.clone().oneshot(other).await.unwrap();
        let _ = service.clone().oneshot(request()).await.unwrap();
    }
    let hit = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(hit.headers()["x-cache"], "hit");
    assert!(
        guard.l1_bytes() >= CAPACITY / 4 * 3,
        "L1 holds {} bytes, not full",
        guard.l1_bytes()
    );
    service
}

/// The bench's route: entries fresh for an hour.
fn items(guard: &StampedeGuard) -> stampede_guard::GuardLayer {
    let policy = Policy::builder("items")
        .fresh_ttl(Duration::from_secs(3600))
        .build()
        .unwrap();
    guard.layer(policy).unwrap()
}

async fn commands(server: &RedisServer) -> u64 {
    let stats: String = server.cmd(&["INFO", "commandstats"]).await;
    stats
        .lines()
        .filter_map(|l| l.split_once(":calls="))
        .map(|(_, rest)| rest.split(',').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

async fn phase(server: &RedisServer, label: &str) {
    let bare = bare();
    let guarded = guarded(server).await;
    let full = guarded_full().await;
    // A hit's headers: the two the guard sets on every answer.
    let mut headers = http::HeaderMap::new();
    headers.insert(http::header::AGE, http::HeaderValue::from_static("0"));
    headers.insert("x-cache", http::HeaderValue::from_static("hit"));
    // A hit's hash: the identity of the bench's request, as the guard frames it.
    let identity: &[u8] =
        b"items\0\x02\x00\x00\x00v1\x0c\x00\x00\x00shop.example\x09\x00\x00\x00/items/42\x06\x00\x00\x00page=1";
    let hasher = SipHasher13::new_with_keys(0x0706_0504_0302_0100, 0x0f0e_0d0c_0b0a_0908);

    let before = commands(server).await;
    let (mut b, mut g, mut f) = (Vec::new(), Vec::new(), Vec::new());
    let (mut m, mut h, mut c) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        b.push(per_request(&bare).await);
        g.push(per_request(&guarded).await);
        f.push(per_request(&full).await);
        let start = Instant::now();
        for _ in 0..BATCH {
            black_box(black_box(&headers).clone());
        }
        m.push(start.elapsed() / BATCH);
        let start = Instant::now();
        for _ in 0..BATCH {
            black_box(quanta::Instant::now());
        }
        c.push(start.elapsed() / BATCH);
        let start = Instant::now();
        for _ in 0..BATCH {
            let mut hasher = black_box(hasher);
            hasher.write(black_box(identity));
            black_box(hasher.finish128());
        }
        h.push(start.elapsed() / BATCH);
    }
    // Less the INFO that took the first count.
    let during = commands(server).await - before - 1;
    let (b, g, f) = (median(&mut b), median(&mut g), median(&mut f));
    let (m, h, c) = (median(&mut m), median(&mut h), median(&mut c));
    println!(
        "L1 hit, {label}: {ROUNDS} interleaved rounds of {BATCH} requests, median per request"
    );
    println!("  bare service                {:>9.0} ns", ns(b));
    println!("  guarded, L1 hit             {:>9.0} ns", ns(g));
    println!(
        "  overhead                    {:>9.0} ns ({:.2}x the bare service)",
        ns(g) - ns(b),
        ns(g) / ns(b)
    );
    for (what, alone) in [("key hash", h), ("headers clone", m), ("clock read", c)] {
        println!(
            "  of which {what:<13} (alone) {:>5.0} ns ({:.0}% of the overhead)",
            ns(alone),
            100.0 * ns(alone) / (ns(g) - ns(b)).max(1.0)
        );
    }
    println!(
        "  guarded, L1 hit, L1 full     {:>8.0} ns ({:.2}x the bare service; moka answers)",
        ns(f),
        ns(f) / ns(b)
    );
    println!(
        "  Redis commands during {} hits: {during}",
        u64::from(BATCH) * ROUNDS as u64
    );
}

fn main() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        phase(&server, "no metrics recorder").await;
        let _handle = stampede_guard::prometheus::install().unwrap();
        phase(&server, "Prometheus recorder installed").await;
    });
}
