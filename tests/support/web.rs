//! An HTTP side for the guard tests: a counting origin that can be held or hung on
//! command, guarded instances, and a client.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use stampede_guard::metrics::Event;
use stampede_guard::{Guard, GuardLayer, KeySpace, Policy, ResponseBody, StampedeGuard};
use tokio::sync::Notify;
use tower::{Layer, Service, ServiceExt};

pub(crate) type Body = BoxBody<Bytes, Infallible>;
pub(crate) type Req = Request<Empty<Bytes>>;

pub(crate) fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into()).boxed()
}

/// What the origin answers; `n` is its call number, from 1.
pub(crate) type Answer = Arc<dyn Fn(u64, &Req) -> Response<Body> + Send + Sync>;

/// A counting origin. Each call can be held at a gate until the test opens it.
#[derive(Clone)]
pub(crate) struct Origin {
    pub(crate) calls: Arc<AtomicU64>,
    pub(crate) delay: Duration,
    pub(crate) answer: Answer,
    /// Calls numbered in `held` wait for `gate` before they answer.
    pub(crate) held: Arc<std::sync::Mutex<Vec<u64>>>,
    pub(crate) gate: Arc<Notify>,
    /// Woken when a call starts.
    pub(crate) started: Arc<Notify>,
    /// Calls numbered from this one on (if not zero) wait for `gate` too.
    pub(crate) held_from: Arc<AtomicU64>,
    /// Calls numbered in `hung` never answer.
    pub(crate) hung: Arc<std::sync::Mutex<Vec<u64>>>,
    /// When each call started, and for which path.
    pub(crate) log: Arc<std::sync::Mutex<Vec<(std::time::Instant, String)>>>,
    /// The sequence number (see `Seq`) at which each call returned.
    pub(crate) returned: Arc<std::sync::Mutex<Vec<u64>>>,
    pub(crate) seq: Seq,
    /// Calls in progress, and the most there ever were at once.
    pub(crate) in_flight: Arc<AtomicU64>,
    pub(crate) peak: Arc<AtomicU64>,
}

/// One counter for ordering events of the origin and of the clients.
#[derive(Clone, Default)]
pub(crate) struct Seq(Arc<AtomicU64>);

impl Seq {
    pub(crate) fn next(&self) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst)
    }
}

impl Origin {
    pub(crate) fn new(
        delay: Duration,
        answer: impl Fn(u64, &Req) -> Response<Body> + Send + Sync + 'static,
    ) -> Self {
        Self {
            calls: Arc::default(),
            delay,
            answer: Arc::new(answer),
            held: Arc::default(),
            held_from: Arc::default(),
            gate: Arc::new(Notify::new()),
            started: Arc::new(Notify::new()),
            hung: Arc::default(),
            log: Arc::default(),
            returned: Arc::default(),
            seq: Seq::default(),
            in_flight: Arc::default(),
            peak: Arc::default(),
        }
    }

    /// How many calls started before `at`.
    pub(crate) fn calls_started_before(&self, at: std::time::Instant) -> u64 {
        let log = self.log.lock().unwrap();
        log.iter().filter(|(started, _)| *started < at).count() as u64
    }

    /// Calls in progress now.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// The most calls that were ever in progress at once.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }

    /// Answers `v{n}` with status 200.
    pub(crate) fn versions(delay: Duration) -> Self {
        Self::new(delay, |n, _| Response::new(full(format!("v{n}"))))
    }

    pub(crate) fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    pub(crate) fn hold(&self, call: u64) {
        self.held.lock().unwrap().push(call);
    }

    /// Call `call` never answers.
    pub(crate) fn hang(&self, call: u64) {
        self.hung.lock().unwrap().push(call);
    }

    /// Calls numbered `call` and after wait at the gate.
    pub(crate) fn hold_from(&self, call: u64) {
        self.held_from.store(call, Ordering::SeqCst);
    }

    pub(crate) fn open(&self) {
        self.held.lock().unwrap().clear();
        self.held_from.store(0, Ordering::SeqCst);
        self.gate.notify_waiters();
    }

    pub(crate) fn service(
        &self,
    ) -> impl Service<Req, Response = Response<Body>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + Sync
    + 'static
    + use<> {
        let origin = self.clone();
        tower::service_fn(move |request: Req| {
            let origin = origin.clone();
            async move {
                let n = origin.calls.fetch_add(1, Ordering::SeqCst) + 1;
                let now = origin.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                origin.peak.fetch_max(now, Ordering::SeqCst);
                // Counted out however the call ends (a dropped call included).
                struct Out(Arc<AtomicU64>);
                impl Drop for Out {
                    fn drop(&mut self) {
                        self.0.fetch_sub(1, Ordering::SeqCst);
                    }
                }
                let _out = Out(origin.in_flight.clone());
                origin
                    .log
                    .lock()
                    .unwrap()
                    .push((std::time::Instant::now(), request.uri().path().to_owned()));
                origin.started.notify_waiters();
                if origin.hung.lock().unwrap().contains(&n) {
                    std::future::pending::<()>().await;
                }
                let gated = || {
                    let from = origin.held_from.load(Ordering::SeqCst);
                    origin.held.lock().unwrap().contains(&n) || (from != 0 && n >= from)
                };
                if gated() {
                    let opened = origin.gate.notified();
                    // Re-check: the gate may have opened before `notified` was created.
                    if gated() {
                        opened.await;
                    }
                }
                if !origin.delay.is_zero() {
                    tokio::time::sleep(origin.delay).await;
                }
                let response = (origin.answer)(n, &request);
                origin.returned.lock().unwrap().push(origin.seq.next());
                Ok::<_, Infallible>(response)
            }
        })
    }
}

pub(crate) fn keys() -> KeySpace {
    KeySpace::builder()
        .env("test")
        .service("catalog")
        .secret(b"a test secret of more than sixteen bytes".to_vec())
        .build()
        .unwrap()
}

/// An instance: its own guard (own L1), one route.
pub(crate) struct Instance<S> {
    pub(crate) guard: StampedeGuard,
    pub(crate) layer: GuardLayer,
    pub(crate) service: Guard<S>,
}

pub(crate) async fn instance<S>(guard: StampedeGuard, policy: Policy, origin: S) -> Instance<S> {
    super::within(
        super::HANG,
        guard.ready(),
        "the guard's readiness (notice subscription)",
    )
    .await
    .expect("redis up for the test");
    let layer = guard.layer(policy).unwrap();
    let service = layer.layer(origin);
    Instance {
        guard,
        layer,
        service,
    }
}

pub(crate) fn get(path: &str) -> Req {
    Request::get(path)
        .header("host", "shop.example")
        .body(Empty::new())
        .unwrap()
}

pub(crate) struct Got {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: String,
    /// The body's bytes, as they came.
    pub(crate) raw: Bytes,
}

impl Got {
    /// A response's status and headers, with its body read whole.
    pub(crate) fn new(parts: http::response::Parts, body: Bytes) -> Self {
        Got {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
            raw: body,
        }
    }

    pub(crate) fn x_cache(&self) -> &str {
        self.headers
            .get("x-cache")
            .map_or("", |v| v.to_str().unwrap())
    }
}

/// Sends `request` through the guard and reads the response whole, within
/// [`HANG`](super::HANG): a request that hangs fails the test, naming the request.
pub(crate) async fn send<S: Clone>(service: &Guard<S>, request: Req) -> Got
where
    Guard<S>: Service<Req, Response = Response<ResponseBody<Body>>, Error = Infallible>,
{
    // Named only if it hangs: no formatting on the path the benches measure.
    let what = RequestName(request.method().clone(), request.uri().clone());
    let exchange = async {
        let response = service.clone().oneshot(request).await.unwrap();
        let (parts, body) = response.into_parts();
        Got::new(parts, body.collect().await.unwrap().to_bytes())
    };
    super::within(super::HANG, exchange, what).await
}

struct RequestName(http::Method, http::Uri);

impl std::fmt::Display for RequestName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.0, self.1)
    }
}

pub(crate) fn total(instances: &[&GuardLayer], event: Event) -> u64 {
    instances.iter().map(|l| l.stats().get(event)).sum()
}

/// Awaits spawned request tasks, all within `within`; panics with `what` if they are
/// not all done by then.
pub(crate) async fn all_within<T: Send + 'static>(
    tasks: Vec<tokio::task::JoinHandle<T>>,
    within: Duration,
    what: &str,
) -> Vec<T> {
    let deadline = tokio::time::Instant::now() + within;
    let mut out = Vec::with_capacity(tasks.len());
    for task in tasks {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        out.push(super::joined(task, left, what).await);
    }
    out
}

/// Load on a fleet until `stop`: `workers` tasks, each sending `/items/{n}` for `n` in
/// `0..keys` in turn (worker `w` to instance `(n + w) % fleet.len()`), two milliseconds
/// apart per round (hits answer without waiting: the pause leaves the runtime's threads
/// to refreshes), asserting that every answer is a success. Each task returns how many
/// requests it sent.
pub(crate) fn load<S>(
    fleet: &Arc<Vec<Instance<S>>>,
    keys: usize,
    workers: usize,
    stop: &Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<u64>>
where
    S: Clone + Send + Sync + 'static,
    Guard<S>:
        Service<Req, Response = Response<ResponseBody<Body>>, Error = Infallible> + Send + Sync,
    <Guard<S> as Service<Req>>::Future: Send,
{
    (0..workers)
        .map(|w| {
            let (fleet, stop) = (fleet.clone(), stop.clone());
            tokio::spawn(async move {
                let mut answered = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for n in 0..keys {
                        let i = (n + w) % fleet.len();
                        let got = send(&fleet[i].service, get(&format!("/items/{n}"))).await;
                        assert!(
                            got.status.is_success(),
                            "instance {i}, /items/{n}: {} ({})",
                            got.status,
                            got.x_cache()
                        );
                        answered += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                answered
            })
        })
        .collect()
}

/// A guard on `server` with the test key space, ready (its notice subscription up).
pub(crate) async fn ready_guard(server: &super::RedisServer) -> StampedeGuard {
    let store = stampede_guard::RedisStore::builder(server.url())
        .build()
        .unwrap();
    let guard = StampedeGuard::builder(store, keys()).build().unwrap();
    super::within(super::HANG, guard.ready(), "the guard's readiness")
        .await
        .unwrap();
    guard
}
