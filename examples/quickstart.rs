//! The README's quick start: a slow `/products/{id}` behind the guard.
use std::time::Duration;

use axum::{Router, extract::Path, routing::get};
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let env = |name: &str, or: &str| std::env::var(name).unwrap_or_else(|_| or.to_owned());
    // Every instance builds the same key space (env, service, secret) to share entries.
    let secret = std::env::var("CACHE_KEY_SECRET").map_err(|_| "set CACHE_KEY_SECRET")?;
    let keys = KeySpace::builder()
        .env("dev")
        .service("shop")
        .secret(secret)
        .build()?;
    let store = RedisStore::builder(env("REDIS_URL", "redis://127.0.0.1:6379")).build()?;
    let guard = StampedeGuard::builder(store, keys).build()?;
    let products = guard.layer(
        Policy::builder("products")
            .fresh_ttl(Duration::from_secs(5)) // a hit for 5 s,
            .grace(Duration::from_secs(60)) // then stale at once while one caller refreshes
            .key_host(false) // one entry whatever the Host: see "key_host" below
            .build()?,
    )?;
    let app = Router::new().route(
        "/products/{id}",
        get(|Path(id): Path<u64>| async move {
            tokio::time::sleep(Duration::from_millis(500)).await; // the slow origin
            format!("product {id}\n")
        })
        .layer(products),
    );
    let listener = tokio::net::TcpListener::bind(env("LISTEN", "127.0.0.1:3000")).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
