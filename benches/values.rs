//! A typed L1 hit (`Values::get_or_fetch` of a value L1 holds) against
//! `moka::future::Cache::get` on the same keys, in the same run: the ratio of their
//! times per call (wall-clock figures move 30 % between runs here; the ratio of two
//! measured side by side far less).
//!
//! ```text
//! cargo bench --bench values
//! ```
//!
//! One thread; 1000 keys of a few bytes (`"k0"` to `"k999"`), each value an `f64`; each
//! round times 200 000 calls of each, taking turns; the median round is reported.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};

const KEYS: usize = 1000;
const CALLS: usize = 200_000;
const ROUNDS: usize = 7;

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let keys = KeySpace::builder()
            .env("bench")
            .service("values")
            .secret("a secret of sixteen bytes or more")
            .build()
            .unwrap();
        let guard = StampedeGuard::builder(RedisStore::local_only(), keys)
            .build()
            .unwrap();
        let policy = Policy::builder("rates")
            .fresh_ttl(Duration::from_secs(3600))
            .build()
            .unwrap();
        let rates = guard.values::<f64>(policy).unwrap();
        let moka: moka::future::Cache<String, Arc<f64>> = moka::future::Cache::new(10_000);
        let names: Vec<String> = (0..KEYS).map(|n| format!("k{n}")).collect();
        for (n, name) in names.iter().enumerate() {
            let value = n as f64;
            let got = rates
                .get_or_fetch(name.as_str(), move || async move { Ok::<_, ()>(value) })
                .await
                .unwrap();
            assert_eq!(*got, value);
            moka.insert(name.clone(), Arc::new(value)).await;
        }
        let never = || async { Err::<f64, ()>(()) };
        let (mut typed, mut plain) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            let began = Instant::now();
            for n in 0..CALLS {
                let name = names[n % KEYS].as_str();
                black_box(rates.get_or_fetch(name, never).await.unwrap());
            }
            typed.push(began.elapsed() / CALLS as u32);
            let began = Instant::now();
            for n in 0..CALLS {
                black_box(moka.get(&names[n % KEYS]).await.unwrap());
            }
            plain.push(began.elapsed() / CALLS as u32);
        }
        typed.sort_unstable();
        plain.sort_unstable();
        let (typed, plain) = (typed[ROUNDS / 2], plain[ROUNDS / 2]);
        println!("per call, the median of {ROUNDS} rounds of {CALLS} calls over {KEYS} keys:");
        println!("  moka::future::Cache::get        {plain:>10.1?}");
        println!("  Values::get_or_fetch, an L1 hit {typed:>10.1?}");
        println!(
            "  ratio                           {:>9.2}x  (the issue's bound: 1.5x)",
            typed.as_secs_f64() / plain.as_secs_f64()
        );
    });
}
