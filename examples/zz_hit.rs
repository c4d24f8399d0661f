use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use stampede_guard::{KeySpace, Policy, RedisStore, StampedeGuard};
use std::hint::black_box;
use std::time::Duration;
use tower::{Layer, Service, ServiceExt};
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
+ Clone {
    tower::service_fn(|_req: Req| async { Ok(Response::new(Full::new(Bytes::from_static(BODY)))) })
}
#[inline(never)]
fn hits<S, B>(rt: &tokio::runtime::Runtime, service: &S, n: usize)
where
    S: Service<Req, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    rt.block_on(async {
        for _ in 0..n {
            let response = service.clone().oneshot(request()).await.unwrap();
            black_box(response.into_body().collect().await.unwrap().to_bytes());
        }
    });
}
fn main() {
    let n: usize = std::env::args().nth(1).unwrap().parse().unwrap();
    let which = std::env::args().nth(2).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    if std::env::args().nth(3).is_some() {
        stampede_guard::prometheus::install().unwrap();
    }
    let keys = KeySpace::builder()
        .env("bench")
        .service("bench")
        .secret(b"bench secret, sixteen bytes or more".to_vec())
        .build()
        .unwrap();
    let guard = StampedeGuard::builder(RedisStore::local_only(), keys)
        .build()
        .unwrap();
    let layer = guard
        .layer(
            Policy::builder("items")
                .fresh_ttl(Duration::from_secs(3600))
                .build()
                .unwrap(),
        )
        .unwrap();
    if which == "bare" {
        let s = bare();
        hits(&rt, &s, 100);
        hits(&rt, &s, n);
    } else {
        let s = layer.layer(bare());
        hits(&rt, &s, 100);
        hits(&rt, &s, n);
    }
}
