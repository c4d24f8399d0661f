//! A caching sidecar: the layer in front of any HTTP origin.
//!
//! ```text
//! cargo run --release --features prometheus --example proxy -- \
//!     --listen 127.0.0.1:8080 --upstream http://127.0.0.1:9000 \
//!     [--redis redis://127.0.0.1:6379] [--fresh 1s] [--grace 10s] [--lease 5s] \
//!     [--cold-wait 2s] [--metrics 127.0.0.1:9100]
//! ```
//!
//! Without `--redis` it runs on its local cache only. Several proxies pointed at one
//! Redis act as one fleet: one origin call per key per freshness window among all of
//! them. The key is the path and query (the Host of the proxy is not part of it: every
//! proxy fronts the same upstream). `--metrics` serves Prometheus metrics there.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, Uri};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
use tower::ServiceBuilder;

type Body = BoxBody<Bytes, hyper::Error>;

struct Args {
    listen: SocketAddr,
    upstream: Uri,
    redis: Option<String>,
    fresh: Duration,
    grace: Duration,
    lease: Duration,
    cold_wait: Duration,
    metrics: Option<SocketAddr>,
}

fn duration(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("not a duration: {text}"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" | "" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("not a duration: {text} (use ms, s or m)")),
    }
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        listen: "127.0.0.1:8080".parse().expect("an address"),
        upstream: Uri::from_static("http://127.0.0.1:9000"),
        redis: None,
        fresh: Duration::from_secs(1),
        grace: Duration::from_secs(10),
        lease: Duration::from_secs(5),
        cold_wait: Duration::from_secs(2),
        metrics: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => args.listen = value.parse().map_err(|e| format!("--listen: {e}"))?,
            "--upstream" => {
                args.upstream = value.parse().map_err(|e| format!("--upstream: {e}"))?
            }
            "--redis" => args.redis = Some(value),
            "--fresh" => args.fresh = duration(&value)?,
            "--grace" => args.grace = duration(&value)?,
            "--lease" => args.lease = duration(&value)?,
            "--cold-wait" => args.cold_wait = duration(&value)?,
            "--metrics" => {
                args.metrics = Some(value.parse().map_err(|e| format!("--metrics: {e}"))?)
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if args.upstream.authority().is_none() {
        return Err("--upstream must be an absolute http:// URL".to_owned());
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse() {
        Ok(args) => args,
        Err(error) => {
            eprintln!("{error}\nsee the top of examples/proxy.rs for the flags");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{error}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(addr) = args.metrics {
        // Before the guard: counters are registered when its layer is made.
        stampede_guard::prometheus::install_with_listener(addr)?;
        println!("metrics on http://{addr}/metrics");
    }
    let keys = KeySpace::builder()
        .env("sidecar")
        .service("proxy")
        .secret(
            std::env::var("STAMPEDE_GUARD_SECRET")
                .unwrap_or_else(|_| "set STAMPEDE_GUARD_SECRET in production".to_owned()),
        )
        .build()?;
    let store = match &args.redis {
        Some(url) => RedisStore::builder(url.as_str()).build()?,
        None => RedisStore::local_only(),
    };
    let guard = StampedeGuard::builder(store, keys).build()?;
    if let Err(error) = guard.ready().await {
        println!("Redis does not answer ({error}): serving from the local cache until it does.");
    }
    let policy = Policy::builder("proxy")
        .fresh_ttl(args.fresh)
        .grace(args.grace)
        .lease_ttl(args.lease)
        .refresh_timeout(args.lease)
        .cold_wait(args.cold_wait)
        .error_backoff(args.lease.min(Duration::from_secs(1)))
        .key_host(false)
        .build()?;
    let layer = guard.layer(policy)?;

    let client: Client<_, Body> = Client::builder(TokioExecutor::new()).build_http();
    let upstream = args.upstream.clone();
    let origin = tower::service_fn(move |mut request: Request<Body>| {
        let (client, upstream) = (client.clone(), upstream.clone());
        async move {
            let path = request
                .uri()
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .to_owned();
            let mut uri = Uri::builder().path_and_query(path);
            if let Some(scheme) = upstream.scheme() {
                uri = uri.scheme(scheme.clone());
            }
            if let Some(authority) = upstream.authority() {
                uri = uri.authority(authority.clone());
                if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
                    request.headers_mut().insert(http::header::HOST, host);
                }
            }
            *request.uri_mut() = uri.build().expect("a valid upstream URI");
            match client.request(request).await {
                Ok(response) => Ok::<_, std::convert::Infallible>(response.map(BodyExt::boxed)),
                Err(error) => {
                    eprintln!("upstream: {error}");
                    let mut response = Response::new(
                        Full::new(Bytes::from_static(b"bad gateway\n"))
                            .map_err(|never| match never {})
                            .boxed(),
                    );
                    *response.status_mut() = StatusCode::BAD_GATEWAY;
                    Ok(response)
                }
            }
        }
    });
    let service = ServiceBuilder::new()
        .map_request(|request: Request<Incoming>| request.map(BodyExt::boxed))
        .layer(layer)
        .service(origin);

    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    println!(
        "caching {} on http://{} ({})",
        args.upstream,
        args.listen,
        if args.redis.is_some() {
            "L1 + Redis"
        } else {
            "L1 only"
        }
    );
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
