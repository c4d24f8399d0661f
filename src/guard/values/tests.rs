//! A value's key in L1, made without a request on the hit path, is the key its request
//! (the one that carries it through the engine) is keyed with.

use std::sync::Arc;

use super::cache::Cache;
use super::codec::Postcard;
use crate::cache::Instant;
use crate::{KeySpace, Policy, RedisStore, StampedeGuard};

#[tokio::test]
async fn a_keys_l1_key_is_the_one_its_request_is_keyed_with() {
    let keys = KeySpace::builder()
        .env("test")
        .service("values")
        .secret("a secret of sixteen bytes or more")
        .build()
        .unwrap();
    let guard = StampedeGuard::builder(RedisStore::local_only(), keys)
        .build()
        .unwrap();
    let long = "k".repeat(300);
    for (n, version) in [0, 3].into_iter().enumerate() {
        for key_host in [true, false] {
            let policy = Policy::builder(format!("rates-{n}-{key_host}"))
                .version(version)
                .key_host(key_host)
                .build()
                .unwrap();
            let cache = Cache {
                route: guard.route(policy).unwrap(),
                codec: Arc::new(Postcard),
            };
            for key in ["EUR", "", long.as_str()] {
                let keyed = cache.keyed::<f64, _>(key).unwrap();
                let request = keyed.request();
                let made = cache.route.keys_for(&request).unwrap();
                assert_eq!(made.local, keyed.local, "{version} {key_host} {key:?}");
                let (found, _) = cache.route.find_l1(&request, Instant::now());
                assert_eq!(found, keyed.local);
            }
            // Another type, another key.
            let other = cache.keyed::<u64, _>("EUR").unwrap();
            assert_ne!(other.local, cache.keyed::<f64, _>("EUR").unwrap().local);
        }
    }
}
