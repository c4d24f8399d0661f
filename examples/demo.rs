//! A stampede, three ways.
//!
//! A slow origin (200 ms per call) serves a few hot keys to a crowd of concurrent clients
//! spread over three instances, for several freshness windows, starting cold. The same
//! load runs against the origin unguarded, guarded with L1 only (each instance on its
//! own), and guarded with Redis (the three instances as one fleet), and a table compares
//! origin calls, how requests were served, and latency.
//!
//! ```text
//! cargo run --release --example demo                         # REDIS_URL, default redis://127.0.0.1:6379
//! cargo run --release --example demo -- --chart stampede.svg # and a chart of origin calls per second
//! ```
//!
//! When no Redis answers at `REDIS_URL` and `redis-server` is on `PATH`, the demo starts
//! a throwaway one on a free port for the run (no persistence; stopped at the end, on
//! an error, a panic or Ctrl-C). Without either, the Redis part is skipped (and the demo
//! says how to start one).

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use indicatif::{ProgressBar, ProgressStyle};
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceBuilder, ServiceExt};

#[path = "support/throwaway.rs"]
mod throwaway;
use throwaway::ThrowawayRedis;

const INSTANCES: usize = 3;
const KEYS: usize = 4;
const CLIENTS: usize = 300;
const ORIGIN_TIME: Duration = Duration::from_millis(200);
const FRESH: Duration = Duration::from_secs(1);
const RUN: Duration = Duration::from_secs(5);
const THINK: Duration = Duration::from_millis(10);

type Req = Request<Empty<Bytes>>;
type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;
type Svc = BoxCloneSyncService<Req, Response<Body>, Infallible>;

/// The slow origin, counting its calls.
fn origin(
    calls: Arc<AtomicU64>,
) -> impl tower::Service<Req, Response = Response<Full<Bytes>>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ Sync
+ 'static {
    tower::service_fn(move |request: Req| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::Relaxed) + 1;
            tokio::time::sleep(ORIGIN_TIME).await;
            let body = format!("{} (origin call {n})", request.uri().path());
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
        }
    })
}

#[derive(Default)]
struct Report {
    requests: u64,
    origin_calls: u64,
    hit: u64,
    stale: u64,
    miss: u64,
    errors: u64,
    latencies_ns: Vec<u64>,
    /// Origin calls in each second of the run.
    per_second: Vec<u64>,
}

impl Report {
    fn percentile(&self, p: f64) -> Duration {
        if self.latencies_ns.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies_ns.len() as f64 - 1.0) * p).round() as usize;
        Duration::from_nanos(self.latencies_ns[i])
    }
}

/// Runs the stampede against `instances`.
async fn stampede(label: &str, instances: Vec<Svc>, calls: Arc<AtomicU64>) -> Report {
    let progress = ProgressBar::new(RUN.as_millis() as u64);
    progress.set_style(
        ProgressStyle::with_template("{prefix:>22} [{bar:30}] {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    progress.set_prefix(label.to_owned());
    let report = Arc::new(Mutex::new(Report::default()));
    let requests = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let end = start + RUN;
    // Origin calls per second, counted at each whole second of the run.
    let sampler = tokio::spawn({
        let calls = calls.clone();
        async move {
            let second = Duration::from_secs(1);
            let mut tick =
                tokio::time::interval_at(tokio::time::Instant::from_std(start) + second, second);
            let (mut last, mut per_second) = (0, Vec::new());
            for _ in 0..RUN.as_secs() {
                tick.tick().await;
                let now = calls.load(Ordering::Relaxed);
                per_second.push(now - last);
                last = now;
            }
            per_second
        }
    });
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let service = instances[client % instances.len()].clone();
        let (report, requests) = (report.clone(), requests.clone());
        clients.push(tokio::spawn(async move {
            let mut n = client;
            let mut mine = Report::default();
            while Instant::now() < end {
                n += 1;
                let request = Request::get(format!("/items/{}", n % KEYS))
                    .header("host", "shop.example")
                    .body(Empty::new())
                    .expect("a valid request");
                let sent = Instant::now();
                let response = service.clone().oneshot(request).await.expect("infallible");
                let x_cache = response
                    .headers()
                    .get("x-cache")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("miss")
                    .to_owned();
                let ok = response.status().is_success();
                let _ = response.into_body().collect().await;
                mine.latencies_ns.push(sent.elapsed().as_nanos() as u64);
                mine.requests += 1;
                match (ok, x_cache.as_str()) {
                    (false, _) => mine.errors += 1,
                    (true, "hit") => mine.hit += 1,
                    (true, "stale") => mine.stale += 1,
                    _ => mine.miss += 1,
                }
                requests.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(THINK).await;
            }
            let mut report = report.lock().expect("report lock");
            report.requests += mine.requests;
            report.hit += mine.hit;
            report.stale += mine.stale;
            report.miss += mine.miss;
            report.errors += mine.errors;
            report.latencies_ns.extend(mine.latencies_ns);
        }));
    }
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(100)).await;
        progress.set_position(start.elapsed().as_millis().min(RUN.as_millis()) as u64);
        progress.set_message(format!(
            "{} requests, {} origin calls",
            requests.load(Ordering::Relaxed),
            calls.load(Ordering::Relaxed)
        ));
    }
    for client in clients {
        client.await.expect("a client task");
    }
    progress.finish();
    let mut report = Arc::try_unwrap(report)
        .ok()
        .expect("clients are done")
        .into_inner()
        .expect("report lock");
    report.latencies_ns.sort_unstable();
    report.origin_calls = calls.load(Ordering::Relaxed);
    report.per_second = sampler.await.expect("the sampler task");
    report
}

/// Writes the chart of origin calls per second, one line per run.
fn chart(path: &Path, lines: &[(&str, &[u64])]) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;

    let seconds = RUN.as_secs();
    let top = lines
        .iter()
        .flat_map(|(_, per_second)| per_second.iter().copied())
        .max()
        .unwrap_or(1)
        .max(10) as f64
        * 2.0;
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "Origin calls per second ({CLIENTS} clients, {KEYS} hot keys, fresh {FRESH:?})"
            ),
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0u64..seconds, (0.5f64..top).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("second of the run")
        .y_desc("origin calls (log scale; 0 drawn at the bottom)")
        .draw()?;
    let colors = [RED, BLUE, GREEN, MAGENTA];
    for (i, (name, per_second)) in lines.iter().enumerate() {
        let color = colors[i % colors.len()];
        let points = per_second
            .iter()
            .enumerate()
            .map(|(second, &calls)| (second as u64 + 1, (calls as f64).max(0.5)));
        chart
            .draw_series(LineSeries::new(
                std::iter::once((0, 0.5)).chain(points),
                color.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

/// `--chart FILE.svg`, the only argument.
fn chart_arg() -> Result<Option<PathBuf>, String> {
    let mut args = std::env::args().skip(1);
    let mut chart = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--chart" => {
                chart = Some(PathBuf::from(
                    args.next().ok_or("--chart needs a file name (an .svg)")?,
                ));
            }
            "--help" | "-h" => {
                return Err("usage: demo [--chart FILE.svg]".to_owned());
            }
            other => {
                return Err(format!(
                    "unknown argument {other}\nusage: demo [--chart FILE.svg]"
                ));
            }
        }
    }
    Ok(chart)
}

fn policy() -> Policy {
    Policy::builder("items")
        .fresh_ttl(FRESH)
        .grace(Duration::from_secs(10))
        .stale_if_error(Duration::from_secs(10))
        .lease_ttl(Duration::from_secs(2))
        .refresh_timeout(Duration::from_secs(1))
        .build()
        .expect("a valid policy")
}

async fn guarded(store: RedisStore, keys: &KeySpace, calls: &Arc<AtomicU64>) -> Svc {
    let guard = StampedeGuard::builder(store, keys.clone())
        .build()
        .expect("a valid guard");
    let _ = guard.ready().await;
    let layer = guard.layer(policy()).expect("the policy fits the store");
    BoxCloneSyncService::new(
        ServiceBuilder::new()
            .map_response(|r: Response<stampede_guard::ResponseBody<Full<Bytes>>>| {
                r.map(|body| body.map_err(Into::into).boxed())
            })
            .service(layer.layer(origin(calls.clone()))),
    )
}

fn row(name: &str, cells: Vec<String>) {
    print!("{name:<26}");
    for cell in cells {
        print!("{cell:>22}");
    }
    println!();
}

#[tokio::main]
async fn main() -> ExitCode {
    let chart_to = match chart_arg() {
        Ok(path) => path,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let mut url =
        std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
    // A fresh key space per run, so that each run starts cold.
    let run = format!(
        "{:08x}",
        std::process::id() ^ (Instant::now().elapsed().subsec_nanos())
    );
    let keys = KeySpace::builder()
        .prefix("sg-demo")
        .env("local")
        .service(format!("demo-{run}"))
        .secret(b"demo secret: use a real one from your secret store".to_vec())
        .build()
        .expect("a valid key space");
    println!(
        "{CLIENTS} clients on {INSTANCES} instances, {KEYS} hot keys, an origin that takes \
         {ORIGIN_TIME:?}, fresh for {FRESH:?}, {RUN:?} per run (from a cold start).\n"
    );

    let mut reports = Vec::new();
    let calls = Arc::new(AtomicU64::new(0));
    let bare: Vec<Svc> = (0..INSTANCES)
        .map(|_| {
            BoxCloneSyncService::new(
                ServiceBuilder::new()
                    .map_response(|r: Response<Full<Bytes>>| {
                        r.map(|body| body.map_err(|never| match never {}).boxed())
                    })
                    .service(origin(calls.clone())),
            )
        })
        .collect();
    reports.push(("unguarded", stampede("unguarded", bare, calls).await));

    let calls = Arc::new(AtomicU64::new(0));
    let mut local = Vec::new();
    for _ in 0..INSTANCES {
        local.push(guarded(RedisStore::local_only(), &keys, &calls).await);
    }
    reports.push(("L1 only", stampede("L1 only", local, calls).await));

    let store = RedisStore::builder(url.as_str())
        .build()
        .expect("REDIS_URL");
    let mut redis_up = store.ping().await.is_ok();
    // Kept until the end of `main`: dropping it stops the server.
    let mut _throwaway = None;
    if !redis_up {
        match ThrowawayRedis::start().await {
            Some(Ok(redis)) => {
                println!(
                    "\nNo Redis answers at {url}: started a throwaway redis-server at {} for this run.\n",
                    redis.url
                );
                url = redis.url.clone();
                redis_up = true;
                _throwaway = Some(redis);
            }
            Some(Err(error)) => println!("\nNo Redis answers at {url}, and {error}."),
            None => {}
        }
    }
    if redis_up {
        let calls = Arc::new(AtomicU64::new(0));
        let mut fleet = Vec::new();
        for _ in 0..INSTANCES {
            let store = RedisStore::builder(url.as_str())
                .build()
                .expect("REDIS_URL");
            fleet.push(guarded(store, &keys, &calls).await);
        }
        reports.push(("Redis fleet", stampede("L1 + Redis", fleet, calls).await));
    }

    if let Some(path) = &chart_to {
        let lines: Vec<(&str, &[u64])> = reports
            .iter()
            .map(|(name, r)| {
                let label = match *name {
                    "Redis fleet" => "L1 + Redis",
                    other => other,
                };
                (label, r.per_second.as_slice())
            })
            .collect();
        match chart(path, &lines) {
            Ok(()) => println!("\nchart of origin calls per second: {}", path.display()),
            Err(error) => {
                eprintln!(
                    "the chart could not be written to {}: {error}",
                    path.display()
                );
                return ExitCode::FAILURE;
            }
        }
    }

    println!();
    let names: Vec<String> = reports
        .iter()
        .map(|(name, _)| match *name {
            "Redis fleet" => format!("L1 + Redis ({INSTANCES} inst.)"),
            "L1 only" => format!("L1 only ({INSTANCES} inst.)"),
            other => other.to_owned(),
        })
        .collect();
    row("", names);
    let cell =
        |f: &dyn Fn(&Report) -> String| reports.iter().map(|(_, r)| f(r)).collect::<Vec<_>>();
    row("requests", cell(&|r| r.requests.to_string()));
    row("origin calls", cell(&|r| r.origin_calls.to_string()));
    let windows = (RUN.as_secs_f64() / FRESH.as_secs_f64()).ceil() as u64 + 1;
    row(
        "origin calls/key/window",
        cell(&|r| {
            format!(
                "{:.2}",
                r.origin_calls as f64 / (KEYS as u64 * windows) as f64
            )
        }),
    );
    row("served fresh (hit)", cell(&|r| r.hit.to_string()));
    row("served stale", cell(&|r| r.stale.to_string()));
    row("miss (waited on origin)", cell(&|r| r.miss.to_string()));
    row("errors", cell(&|r| r.errors.to_string()));
    row(
        "latency p50",
        cell(&|r| format!("{:.2?}", r.percentile(0.50))),
    );
    row(
        "latency p99",
        cell(&|r| format!("{:.2?}", r.percentile(0.99))),
    );
    row(
        "latency max",
        cell(&|r| format!("{:.2?}", r.percentile(1.0))),
    );
    println!();
    if redis_up {
        println!(
            "With Redis the {INSTANCES} instances act as one: about one origin call per key per \
             window for the whole fleet, stale responses served at once while it refreshes."
        );
    } else {
        println!(
            "The Redis part was skipped: no Redis answers at {url}. Start one \
             (`redis-server --port 6379`, or `apt-get install redis-server`: the demo starts \
             one of its own when `redis-server` is on PATH) or set REDIS_URL, and run the demo again to see {INSTANCES} instances share one refresh."
        );
    }
    ExitCode::SUCCESS
}
