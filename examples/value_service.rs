//! The Tower layer of typed values over a plain `tower::service_fn`: a pricing service
//! (a request names a product, the answer is its price, 200 ms upstream), wrapped so that
//! each call is a `get_or_fetch` of the request's product. 100 concurrent calls of one
//! product, then 100 more: one call of the service.
//!
//! ```text
//! cargo run --example value_service     # REDIS_URL, default redis://127.0.0.1:6379;
//!                                       # this process alone when no Redis answers
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
use tower::{Layer, ServiceExt};

/// A request of the pricing service.
#[derive(Clone)]
struct PriceOf {
    product: u64,
    /// Where the call comes from: not part of the key.
    caller: &'static str,
}

/// Its answer.
#[derive(Debug, Serialize, Deserialize)]
struct Price {
    product: u64,
    cents: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let mut store = RedisStore::builder(url.as_str()).build()?;
    if store.ping().await.is_err() {
        println!("No Redis answers at {url}: this process alone (L1 and its own single flight).");
        store = RedisStore::local_only();
    }
    let keys = KeySpace::builder()
        .env("dev")
        .service("shop")
        .secret("an example secret of sixteen bytes or more")
        .build()?;
    let guard = StampedeGuard::builder(store, keys).build()?;
    let prices = guard.values::<Price>(
        Policy::builder("prices")
            .fresh_ttl(Duration::from_secs(30))
            .build()?,
    )?;

    // Any service: here a plain function of the request.
    let calls = Arc::new(AtomicU64::new(0));
    let pricing = tower::service_fn({
        let calls = calls.clone();
        move |request: PriceOf| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok::<_, std::io::Error>(Price {
                    product: request.product,
                    cents: 1999,
                })
            }
        }
    });
    let cached = prices.layer(product_of).layer(pricing);

    for round in ["first", "second"] {
        let callers: Vec<_> = (0..100)
            .map(|_| {
                let call = cached.clone().oneshot(PriceOf {
                    product: 42,
                    caller: "checkout",
                });
                tokio::spawn(call)
            })
            .collect();
        for caller in callers {
            let price = caller.await??;
            assert_eq!(price.cents, 1999);
        }
        println!(
            "{round} 100 calls of product 42: {} call(s) of the pricing service so far",
            calls.load(Ordering::SeqCst)
        );
    }
    Ok(())
}

/// The key of a request: its product alone.
fn product_of(request: &PriceOf) -> u64 {
    let _ = request.caller;
    request.product
}
