//! Instructions per L1 hit, counted by valgrind's callgrind (through gungraun): the same
//! number on every run, whatever else the machine does, where wall-clock figures move
//! by 30 %.
//!
//! ```text
//! cargo install gungraun-runner --version 0.20.0   # once; the version of the gungraun crate
//! cargo bench --bench l1_hit_instructions
//! ```
//!
//! Each benchmark answers `HITS` requests in one go: the bare service, and the same
//! service behind the guard with the entry in L1 (a local-only guard: a hit never
//! reaches Redis, see `benches/l1_hit.rs`); and `HITS` gets of a typed value L1 holds
//! (`Values::get_or_fetch`) beside `HITS` gets of `moka::future::Cache` on the same ten
//! keys. Divide by `HITS` for the figure per request; setting up the runtime, the guard
//! and the entry, and tearing them down, is not counted.

// gungraun's macros make undocumented items and a `main` that exits with the runner's
// status.
#![allow(missing_docs, clippy::exit)]

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use gungraun::{library_benchmark, library_benchmark_group, main};
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
use tower::{Layer, Service, ServiceExt};

/// Requests per benchmark.
const HITS: usize = 1000;
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
+ 'static {
    tower::service_fn(|_req: Req| async { Ok(Response::new(Full::new(Bytes::from_static(BODY)))) })
}

/// Answers `HITS` requests with `service` on `runtime`.
fn run<S, B>(runtime: &tokio::runtime::Runtime, service: &S)
where
    S: Service<Req, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    runtime.block_on(async {
        for _ in 0..HITS {
            let response = service.clone().oneshot(request()).await.unwrap();
            black_box(response.into_body().collect().await.unwrap().to_bytes());
        }
    });
}

type Job = Box<dyn FnMut()>;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn bare_service() -> Job {
    let (runtime, service) = (runtime(), bare());
    // Warm the runtime as the guarded one is.
    run(&runtime, &service);
    Box::new(move || run(&runtime, &service))
}

/// A guard without Redis: a hit never leaves the process.
fn local_guard() -> StampedeGuard {
    let keys = KeySpace::builder()
        .env("bench")
        .service("bench")
        .secret(b"bench secret, sixteen bytes or more".to_vec())
        .build()
        .unwrap();
    StampedeGuard::builder(RedisStore::local_only(), keys)
        .build()
        .unwrap()
}

fn guarded_service() -> Job {
    let runtime = runtime();
    let guard = local_guard();
    let layer = guard
        .layer(
            Policy::builder("items")
                .fresh_ttl(Duration::from_secs(3600))
                .build()
                .unwrap(),
        )
        .unwrap();
    let service = layer.layer(bare());
    let first = runtime
        .block_on(service.clone().oneshot(request()))
        .unwrap();
    assert_eq!(first.headers()["x-cache"], "miss");
    run(&runtime, &service);
    let hit = runtime
        .block_on(service.clone().oneshot(request()))
        .unwrap();
    assert_eq!(hit.headers()["x-cache"], "hit");
    Box::new(move || run(&runtime, &service))
}

/// `HITS` gets of values cached in `moka::future::Cache` (the baseline of a typed hit).
fn moka_gets() -> Job {
    let (runtime, moka) = (
        runtime(),
        moka::future::Cache::<String, std::sync::Arc<f64>>::new(100),
    );
    let keys: Vec<String> = (0..10).map(|n| format!("k{n}")).collect();
    runtime.block_on(async {
        for key in &keys {
            moka.insert(key.clone(), std::sync::Arc::new(0.92)).await;
        }
    });
    let get = move || {
        runtime.block_on(async {
            for n in 0..HITS {
                black_box(moka.get(&keys[n % keys.len()]).await.unwrap());
            }
        })
    };
    get();
    Box::new(get)
}

/// `HITS` typed hits (`Values::get_or_fetch` of values L1 holds), on the same keys.
fn typed_value_hits() -> Job {
    let runtime = runtime();
    let guard = local_guard();
    let policy = Policy::builder("rates")
        .fresh_ttl(Duration::from_secs(3600))
        .build()
        .unwrap();
    let rates = guard.values::<f64>(policy).unwrap();
    let keys: Vec<String> = (0..10).map(|n| format!("k{n}")).collect();
    let never = || async { Err::<f64, ()>(()) };
    runtime.block_on(async {
        for key in &keys {
            let value = rates.get_or_fetch(key.as_str(), || async { Ok::<_, ()>(0.92) });
            assert_eq!(*value.await.unwrap(), 0.92);
        }
    });
    let get = move || {
        runtime.block_on(async {
            for n in 0..HITS {
                let key = keys[n % keys.len()].as_str();
                black_box(rates.get_or_fetch(key, never).await.unwrap());
            }
        })
    };
    get();
    Box::new(get)
}

// Hands the job back, so that tearing it down (the runtime, the caches) is not counted.
#[library_benchmark]
#[bench::bare(setup = bare_service, teardown = drop)]
#[bench::guarded_l1_hit(setup = guarded_service, teardown = drop)]
#[bench::moka_get(setup = moka_gets, teardown = drop)]
#[bench::typed_value_hit(setup = typed_value_hits, teardown = drop)]
fn requests(mut job: Job) -> Job {
    job();
    job
}

library_benchmark_group!(name = l1_hit; benchmarks = requests);

main!(library_benchmark_groups = l1_hit);
