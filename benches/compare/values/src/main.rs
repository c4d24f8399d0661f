//! Typed values side by side, on one Redis of its own: stampede-guard's `Values`,
//! amalgam-cache (a FusionCache port: L1, Redis, a backplane and a distributed locker)
//! and cachekit-rs (L1, Redis and a fill lock whose waiters poll), each as two
//! instances of a service:
//!
//! * **a cold key, 200 callers at once** (100 on each instance), a fetch of 300 ms:
//!   how many fetches, and the slowest caller's wait;
//! * **a hit**: a value every instance holds, asked for 200 000 times over 1000 keys on
//!   one thread; the time per call, beside `moka::future::Cache::get` on the same keys.
//!
//! ```text
//! cargo run --release --manifest-path benches/compare/values/Cargo.toml
//! ```
//!
//! Needs `redis-server` on `PATH`. Wall-clock figures move 30 % between runs here:
//! read the ratios, each measured beside its baseline in the same run.

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CALLERS: usize = 200;
const FETCH: Duration = Duration::from_millis(300);
const KEYS: usize = 1000;
const CALLS: usize = 200_000;

/// A counted fetch, of 300 ms for the crowd (an instant one fills the hits' keys).
async fn fetch(fetches: Arc<AtomicU64>) -> Result<f64, Infallible> {
    if fetches.fetch_add(1, Ordering::SeqCst) < u64::MAX / 2 {
        tokio::time::sleep(FETCH).await;
    }
    Ok(0.92)
}

/// A counter whose fetches are instant.
fn instant() -> Arc<AtomicU64> {
    Arc::new(AtomicU64::new(u64::MAX / 2))
}

/// A `redis-server` of the run's own, on a free port; killed when dropped.
struct Redis(std::process::Child, u16);

impl Redis {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Self(child, port);
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("redis-server did not start");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.1)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One library's two instances, as the crowd and the hits use them.
trait Fleet: Clone + Send + Sync + 'static {
    fn get(
        &self,
        instance: usize,
        key: String,
        fetches: Arc<AtomicU64>,
    ) -> impl Future<Output = f64> + Send;
}

#[derive(Clone)]
struct Guard([stampede_guard::Values<f64>; 2]);

impl Fleet for Guard {
    async fn get(&self, instance: usize, key: String, fetches: Arc<AtomicU64>) -> f64 {
        let got = self.0[instance]
            .get_or_fetch(&key, move || fetch(fetches))
            .await;
        *got.expect("a value")
    }
}

async fn guard(url: &str) -> Guard {
    use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
    let mut fleet = Vec::new();
    for _ in 0..2 {
        let keys = KeySpace::builder()
            .env("compare")
            .service("values")
            .secret("a secret of sixteen bytes or more")
            .build()
            .unwrap();
        let guard = StampedeGuard::builder(RedisStore::builder(url).build().unwrap(), keys)
            .build()
            .unwrap();
        guard.ready().await.unwrap();
        let policy = Policy::builder("rates")
            .fresh_ttl(Duration::from_secs(60))
            .build()
            .unwrap();
        fleet.push(guard.values::<f64>(policy).unwrap());
    }
    Guard(fleet.try_into().unwrap())
}

#[derive(Clone)]
struct Amalgam([amalgam::Cache<f64>; 2]);

impl Fleet for Amalgam {
    async fn get(&self, instance: usize, key: String, fetches: Arc<AtomicU64>) -> f64 {
        let source = amalgam::source::factory(move |_context| fetch(fetches));
        self.0[instance]
            .get_or_set(key, source)
            .await
            .expect("a value")
    }
}

async fn amalgam(url: &str) -> Amalgam {
    use amalgam::provider::{
        Backplane, DistributedCache, DistributedLocker, DistributedSerializer, JsonSerializer,
        RedisBackplane, RedisDistributedCache, RedisDistributedLocker,
    };
    let mut fleet = Vec::new();
    for _ in 0..2 {
        let distributed = RedisDistributedCache::connect(url).await.unwrap();
        let backplane = RedisBackplane::connect(url).await.unwrap();
        let locker = RedisDistributedLocker::connect(url).await.unwrap();
        let cache = amalgam::Cache::builder()
            .distributed(Arc::new(distributed) as Arc<dyn DistributedCache>)
            .serializer(Arc::new(JsonSerializer) as Arc<dyn DistributedSerializer<f64>>)
            .backplane(Arc::new(backplane) as Arc<dyn Backplane>)
            .distributed_locker(Arc::new(locker) as Arc<dyn DistributedLocker>)
            .default_options(amalgam::EntryOptions::new(Duration::from_secs(60)))
            .try_build_ready()
            .await
            .unwrap();
        fleet.push(cache);
    }
    Amalgam(fleet.try_into().unwrap_or_else(|_| unreachable!()))
}

#[derive(Clone)]
struct Cachekit([cachekit::CacheKit; 2]);

impl Fleet for Cachekit {
    /// Its documented single-flight steps: the cache, else the fill lock (its waiters
    /// poll for the value), the fetch, the write, the release.
    async fn get(&self, instance: usize, key: String, fetches: Arc<AtomicU64>) -> f64 {
        let cache = &self.0[instance];
        if let Some(value) = cache.get::<f64>(&key).await.expect("a read") {
            return value;
        }
        let mut flight = cache.single_flight(&key).await;
        while flight.wait_for_fill().await {
            if let Some(value) = cache.get::<f64>(&key).await.expect("a read") {
                flight.release().await;
                return value;
            }
        }
        let value = fetch(fetches).await.unwrap();
        cache
            .set_with_ttl(&key, &value, Duration::from_secs(60))
            .await
            .expect("a write");
        flight.release().await;
        value
    }
}

async fn cachekit(url: &str) -> Cachekit {
    let mut fleet = Vec::new();
    for _ in 0..2 {
        let cache = cachekit::CacheKit::production(url)
            .await
            .unwrap()
            .default_ttl(Duration::from_secs(60))
            .build()
            .unwrap();
        fleet.push(cache);
    }
    Cachekit(fleet.try_into().unwrap_or_else(|_| unreachable!()))
}

/// 200 callers at once of a cold key: the fetches, and the slowest caller's wait.
async fn crowd(fleet: &impl Fleet, key: &str) -> (u64, Duration) {
    let fetches = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let callers: Vec<_> = (0..CALLERS)
        .map(|n| {
            let (fleet, key, fetches) = (fleet.clone(), key.to_owned(), fetches.clone());
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let began = Instant::now();
                black_box(fleet.get(n % 2, key, fetches).await);
                began.elapsed()
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for caller in callers {
        slowest = slowest.max(caller.await.unwrap());
    }
    (fetches.load(Ordering::SeqCst), slowest)
}

/// The time per hit, on one instance, of values it holds: and of moka's future cache
/// on the same keys, measured in turns (the median of five rounds of each).
async fn hits(fleet: &impl Fleet, prefix: &str) -> (Duration, Duration) {
    let names: Vec<String> = (0..KEYS).map(|n| format!("{prefix}-{n}")).collect();
    let moka: moka::future::Cache<String, Arc<f64>> = moka::future::Cache::new(10_000);
    let never = instant();
    for name in &names {
        fleet.get(0, name.clone(), never.clone()).await;
        moka.insert(name.clone(), Arc::new(0.92)).await;
    }
    let (mut theirs, mut baseline) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let began = Instant::now();
        for n in 0..CALLS {
            black_box(fleet.get(0, names[n % KEYS].clone(), never.clone()).await);
        }
        theirs.push(began.elapsed() / CALLS as u32);
        let began = Instant::now();
        for n in 0..CALLS {
            // (A key cloned as for the others, whose API takes it by value.)
            let name = names[n % KEYS].clone();
            black_box(moka.get(&name).await);
        }
        baseline.push(began.elapsed() / CALLS as u32);
    }
    theirs.sort_unstable();
    baseline.sort_unstable();
    (theirs[2], baseline[2])
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let redis = Redis::start().await;
    let url = redis.url();
    println!(
        "{CALLERS} callers of a cold key over two instances (a fetch takes {FETCH:?}), then hits\n"
    );
    println!(
        "{:<16} {:>8} {:>14} {:>12} {:>12} {:>8}",
        "library", "fetches", "slowest wait", "hit", "moka get", "ratio"
    );
    async fn row(name: &str, fleet: impl Fleet) {
        let (fetches, slowest) = crowd(&fleet, &format!("{name}-EUR")).await;
        let (hit, moka) = hits(&fleet, name).await;
        println!(
            "{name:<16} {fetches:>8} {:>14.1?} {:>12.1?} {:>12.1?} {:>7.2}x",
            slowest,
            hit,
            moka,
            hit.as_secs_f64() / moka.as_secs_f64()
        );
    }
    row("stampede-guard", guard(&url).await).await;
    row("amalgam-cache", amalgam(&url).await).await;
    row("cachekit-rs", cachekit(&url).await).await;
}
