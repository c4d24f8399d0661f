//! Typed values on two instances: an exchange rate, `async fn rate(currency) -> f64`
//! (300 ms upstream), behind `Values::get_or_fetch`, phase by phase:
//!
//! * **cold**: 200 callers at once over both instances, nothing cached;
//! * **stale**: past freshness, the upstream's rate changed: every caller gets the stale
//!   rate at once while one refresh for the fleet fetches the new one;
//! * **invalidated**: one instance invalidates the rate: the next callers, on both,
//!   share one fetch;
//! * **redis-down**: Redis unreachable (the example's link to it cut), past freshness:
//!   no error, one refresh per instance.
//!
//! It prints each phase's fetches and latencies, then one line:
//! `fetches: cold=N stale=N invalidated=N redis-down=N`.
//!
//! ```text
//! cargo run --release --example values       # REDIS_URL, default redis://127.0.0.1:6379
//! ```
//!
//! When no Redis answers at `REDIS_URL` and `redis-server` is on `PATH`, it starts a
//! throwaway one for the run, as the demo does. The instances reach Redis through a relay
//! of the example's own, which the last phase shuts.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard, Values};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

#[path = "support/throwaway.rs"]
mod throwaway;
use throwaway::ThrowawayRedis;

const CALLERS: usize = 200;
const UPSTREAM: Duration = Duration::from_millis(300);
const FRESH: Duration = Duration::from_secs(1);

/// The upstream: the rate it gives now, and how many times it was asked.
#[derive(Clone, Default)]
struct Upstream {
    per_usd: Arc<std::sync::Mutex<f64>>,
    fetches: Arc<AtomicU64>,
}

impl Upstream {
    /// `async fn rate(currency) -> f64`, 300 ms.
    async fn rate(self, _currency: String) -> Result<f64, std::io::Error> {
        self.fetches.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(UPSTREAM).await;
        Ok(*self.per_usd.lock().unwrap())
    }
}

/// What one phase came to.
struct Phase {
    name: &'static str,
    fetches: u64,
    errors: usize,
    latencies: Vec<Duration>,
    rates: (f64, f64),
}

/// `CALLERS` callers at once over the two instances, each asking for EUR.
async fn crowd(
    name: &'static str,
    fleet: &[Values<f64>; 2],
    upstream: &Upstream,
    before: u64,
) -> Phase {
    let callers: Vec<_> = (0..CALLERS)
        .map(|n| {
            let (rates, upstream) = (fleet[n % 2].clone(), upstream.clone());
            tokio::spawn(async move {
                let began = Instant::now();
                let got = rates
                    .get_or_fetch("EUR", move || upstream.rate("EUR".to_owned()))
                    .await;
                (began.elapsed(), got.map(|rate| *rate))
            })
        })
        .collect();
    let mut phase = Phase {
        name,
        fetches: 0,
        errors: 0,
        latencies: Vec::new(),
        rates: (f64::MAX, f64::MIN),
    };
    for caller in callers {
        let (took, got) = caller.await.expect("a caller");
        phase.latencies.push(took);
        match got {
            Ok(rate) => phase.rates = (phase.rates.0.min(rate), phase.rates.1.max(rate)),
            Err(_) => phase.errors += 1,
        }
    }
    phase.latencies.sort_unstable();
    phase.fetches = upstream.fetches.load(Ordering::SeqCst) - before;
    phase
}

/// Waits until both instances give `rate` (their refreshes ran), at most 10 s.
async fn settled(fleet: &[Values<f64>; 2], upstream: &Upstream, rate: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    for rates in fleet {
        while Instant::now() < deadline {
            let upstream = upstream.clone();
            let got = rates.get_or_fetch("EUR", move || upstream.rate("EUR".to_owned()));
            if got.await.is_ok_and(|got| *got == rate) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A TCP relay to Redis at `to`, until `cut` says so: then every connection through
/// it is closed and new ones are refused, as if Redis had stopped.
async fn relay(to: String, mut cut: watch::Receiver<bool>) -> std::io::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        loop {
            let (mut client, _) = tokio::select! {
                accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => return },
                _ = cut.changed() => return,
            };
            let (to, mut cut) = (to.clone(), cut.clone());
            tokio::spawn(async move {
                let Ok(mut redis) = TcpStream::connect(&to).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut client, &mut redis) => {}
                    _ = cut.wait_for(|cut| *cut) => {}
                }
            });
        }
    });
    Ok(port)
}

/// `url` (`redis://[user:password@]host:port[/db]`) with its host and port replaced by
/// `127.0.0.1:port`; and its host and port.
fn relayed(url: &str, port: u16) -> Option<(String, String)> {
    let rest = url.strip_prefix("redis://")?;
    let (auth, rest) = rest.rsplit_once('@').map_or(("", rest), |(a, r)| (a, r));
    let (host, db) = rest.split_once('/').map_or((rest, ""), |(h, d)| (h, d));
    let at = if auth.is_empty() {
        String::new()
    } else {
        format!("{auth}@")
    };
    let db = if db.is_empty() {
        String::new()
    } else {
        format!("/{db}")
    };
    Some((format!("redis://{at}127.0.0.1:{port}{db}"), host.to_owned()))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let mut _throwaway = None;
    if RedisStore::builder(url.as_str())
        .build()?
        .ping()
        .await
        .is_err()
    {
        match ThrowawayRedis::start().await {
            Some(Ok(redis)) => {
                println!(
                    "No Redis answers at {url}: started a throwaway redis-server at {}.",
                    redis.url
                );
                url = redis.url.clone();
                _throwaway = Some(redis);
            }
            Some(Err(error)) => return Err(format!("no Redis at {url}, and {error}").into()),
            None => {
                return Err(
                    format!("no Redis answers at {url}: start one, or set REDIS_URL").into(),
                );
            }
        }
    }
    let (cut, cut_rx) = watch::channel(false);
    let (_, target) = relayed(&url, 0).ok_or("REDIS_URL is not a redis:// URL")?;
    let port = relay(target, cut_rx).await?;
    let (through, _) = relayed(&url, port).ok_or("REDIS_URL is not a redis:// URL")?;
    // One key space for the fleet; a fresh one each run (its secret), so that the run
    // starts cold whatever the Redis holds.
    let secret: Vec<u8> = (0..32).map(|_| fastrand::u8(..)).collect();
    let mut fleet = Vec::new();
    for _ in 0..2 {
        let keys = KeySpace::builder()
            .env("demo")
            .service("fx")
            .secret(secret.clone())
            .build()?;
        let store = RedisStore::builder(through.as_str()).build()?;
        let guard = StampedeGuard::builder(store, keys).build()?;
        guard.ready().await?;
        let policy = Policy::builder("rates")
            .fresh_ttl(FRESH)
            .grace(Duration::from_secs(60));
        fleet.push(guard.values::<f64>(policy.build()?)?);
    }
    let fleet: [Values<f64>; 2] = fleet.try_into().map_err(|_| "two instances")?;
    let upstream = Upstream::default();
    *upstream.per_usd.lock().unwrap() = 0.92;
    let fetched = |upstream: &Upstream| upstream.fetches.load(Ordering::SeqCst);

    let mut phases = Vec::new();
    phases.push(crowd("cold", &fleet, &upstream, 0).await);

    tokio::time::sleep(FRESH + Duration::from_millis(200)).await;
    *upstream.per_usd.lock().unwrap() = 0.93;
    let before = fetched(&upstream);
    let mut stale = crowd("stale", &fleet, &upstream, before).await;
    settled(&fleet, &upstream, 0.93).await;
    stale.fetches = fetched(&upstream) - before;
    phases.push(stale);

    *upstream.per_usd.lock().unwrap() = 0.94;
    fleet[0].invalidate("EUR").await?;
    // (The invalidation reaches the other instance's L1 through its notice.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = fetched(&upstream);
    phases.push(crowd("invalidated", &fleet, &upstream, before).await);

    cut.send_replace(true);
    tokio::time::sleep(FRESH + Duration::from_millis(200)).await;
    *upstream.per_usd.lock().unwrap() = 0.95;
    let before = fetched(&upstream);
    let mut down = crowd("redis-down", &fleet, &upstream, before).await;
    settled(&fleet, &upstream, 0.95).await;
    down.fetches = fetched(&upstream) - before;
    phases.push(down);

    println!("{CALLERS} callers a phase over two instances; the upstream takes {UPSTREAM:?}\n");
    println!(
        "{:<12} {:>8} {:>7} {:>10} {:>10} {:>10}  rates given",
        "phase", "fetches", "errors", "p50", "p99", "max"
    );
    for phase in &phases {
        let at = |q: f64| phase.latencies[((phase.latencies.len() - 1) as f64 * q) as usize];
        println!(
            "{:<12} {:>8} {:>7} {:>10.1?} {:>10.1?} {:>10.1?}  {:.2} to {:.2}",
            phase.name,
            phase.fetches,
            phase.errors,
            at(0.5),
            at(0.99),
            at(1.0),
            phase.rates.0,
            phase.rates.1
        );
    }
    let count = |name: &str| {
        phases
            .iter()
            .find(|p| p.name == name)
            .map_or(0, |p| p.fetches)
    };
    println!(
        "\nfetches: cold={} stale={} invalidated={} redis-down={}",
        count("cold"),
        count("stale"),
        count("invalidated"),
        count("redis-down")
    );
    Ok(())
}
