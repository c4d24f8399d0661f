//! The cost of an L1 hit on a URL with many variants against one with a single variant:
//! a route whose answers say `Vary: x-v`, one URL asked with one value of `x-v`, another
//! with 10,000, every variant in L1 and read once (so that each is in L1's front, where
//! hits are answered), then hits on each URL timed in interleaved rounds. L1's cap of
//! variants per URL (256 by default) is raised to 10,000 here, so that all of them stay.
//!
//! ```text
//! cargo bench --bench variants
//! ```
//!
//! No Redis: a local-only guard (a hit does not reach Redis anyway).

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
use tower::{Layer, ServiceExt};

const VARIANTS: u32 = 10_000;
const BATCH: u32 = 20_000;
const ROUNDS: usize = 15;

fn request(path: &str, variant: u32) -> Request<Empty<Bytes>> {
    Request::get(path)
        .header("host", "shop.example")
        .header("x-v", variant.to_string())
        .body(Empty::new())
        .unwrap()
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let keys = KeySpace::builder()
        .env("bench")
        .service("bench")
        .secret(b"bench secret, sixteen bytes or more".to_vec())
        .build()
        .unwrap();
    let guard = StampedeGuard::builder(RedisStore::local_only(), keys)
        .l1_max_variants(VARIANTS as usize)
        .build()
        .unwrap();
    let policy = Policy::builder("items")
        .fresh_ttl(Duration::from_secs(3600))
        .build()
        .unwrap();
    let origin = tower::service_fn(|_: Request<Empty<Bytes>>| async {
        let mut response = Response::new(Full::new(Bytes::from_static(&[b'x'; 512])));
        response
            .headers_mut()
            .insert("vary", http::HeaderValue::from_static("x-v"));
        Ok::<_, std::convert::Infallible>(response)
    });
    let service = guard.layer(policy).unwrap().layer(origin);
    let ask = |path: &'static str, variant: u32| {
        let service = service.clone();
        async move {
            let response = service.oneshot(request(path, variant)).await.unwrap();
            let cache = response.headers()["x-cache"].to_str().unwrap().to_owned();
            black_box(response.into_body().collect().await.unwrap().to_bytes());
            cache
        }
    };
    // Fill, then read each variant once: each in the front.
    let _ = ask("/one", 0).await;
    assert_eq!(ask("/one", 0).await, "hit");
    for variant in 0..VARIANTS {
        let _ = ask("/many", variant).await;
    }
    for variant in 0..VARIANTS {
        assert_eq!(ask("/many", variant).await, "hit", "variant {variant}");
    }
    assert!(guard.l1_entries() >= u64::from(VARIANTS));
    let mut one = Vec::new();
    let mut many = Vec::new();
    for _ in 0..ROUNDS {
        for (path, variant, times) in [("/one", 0, &mut one), ("/many", VARIANTS / 2, &mut many)] {
            let start = Instant::now();
            for _ in 0..BATCH {
                black_box(ask(path, variant).await);
            }
            times.push(start.elapsed() / BATCH);
        }
    }
    let (one, many) = (median(&mut one), median(&mut many));
    println!("L1 hit, median of {ROUNDS} rounds of {BATCH}:");
    println!(
        "  a URL with 1 variant:      {:>8.0} ns",
        one.as_secs_f64() * 1e9
    );
    println!(
        "  a URL with {VARIANTS} variants: {:>8.0} ns",
        many.as_secs_f64() * 1e9
    );
    println!("  ratio: {:.2}", many.as_secs_f64() / one.as_secs_f64());
}
