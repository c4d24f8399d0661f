//! A value's key in L1, made without a request on the hit path, is the key its request
//! (the one that carries it through the engine) is keyed with; a key's identity is the
//! same bytes whether it fits inline or not.

use std::sync::Arc;

use super::cache::{Cache, heap_identity};
use super::codec::Postcard;
use crate::cache::Instant;
use crate::{KeySpace, Policy, RedisStore, StampedeGuard};

/// A guard without Redis: keys are made as with one.
fn local_guard() -> StampedeGuard {
    let keys = KeySpace::builder()
        .env("test")
        .service("values")
        .secret("a secret of sixteen bytes or more")
        .build()
        .unwrap();
    StampedeGuard::builder(RedisStore::local_only(), keys)
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_keys_l1_key_is_the_one_its_request_is_keyed_with() {
    let guard = local_guard();
    let long = "k".repeat(300);
    for (n, version) in [0, 3].into_iter().enumerate() {
        for key_host in [true, false] {
            let policy = Policy::builder(format!("rates-{n}-{key_host}"))
                .version(version)
                .key_host(key_host)
                .build()
                .unwrap();
            let cache = Cache::new::<f64>(guard.route(policy).unwrap(), Arc::new(Postcard));
            for key in ["EUR", "", long.as_str()] {
                let keyed = cache.keyed(key).unwrap();
                let request = keyed.request();
                let made = cache.route.keys_for(&request).unwrap();
                assert_eq!(made.local, keyed.local, "{version} {key_host} {key:?}");
                let (found, _) = cache.route.find_l1(&request, Instant::now());
                assert_eq!(found, keyed.local);
            }
            // Another type, another key; another codec, another key.
            let other = Cache::new::<u64>(cache.route.clone(), Arc::new(Postcard));
            assert_ne!(
                other.keyed("EUR").unwrap().local,
                cache.keyed("EUR").unwrap().local
            );
            #[cfg(feature = "json")]
            {
                let json = Cache::new::<f64>(cache.route.clone(), Arc::new(super::codec::Json));
                assert_ne!(
                    json.keyed("EUR").unwrap().local,
                    cache.keyed("EUR").unwrap().local
                );
            }
        }
    }
}

#[test]
fn an_identity_is_the_same_inline_and_on_the_heap() {
    let guard = local_guard();
    let route = guard
        .route(Policy::builder("ids").build().unwrap())
        .unwrap();
    let cache = Cache::new::<f64>(route, Arc::new(Postcard));
    let kind = &cache.keyed(&()).unwrap().identity()[..8]
        .try_into()
        .unwrap();
    // Across the inline buffer's end (64 bytes), and a key with a tuple and a number.
    for len in 0..260 {
        let key = "k".repeat(len);
        let keyed = cache.keyed(&key).unwrap();
        assert_eq!(
            keyed.identity(),
            heap_identity(kind, &key).unwrap(),
            "{len}"
        );
    }
    let keyed = cache.keyed(&("EUR", 7u64)).unwrap();
    assert_eq!(
        keyed.identity(),
        heap_identity(kind, &("EUR", 7u64)).unwrap()
    );
    // A key written through `collect_str` (as `Display` types are), past the buffer's
    // end: postcard says so with an error of its own, and the heap takes it.
    for len in [10, 60] {
        let text = "k".repeat(len);
        let keyed = cache.keyed(&format_args!("{text}")).unwrap();
        let heap = heap_identity(kind, &format_args!("{text}")).unwrap();
        assert_eq!(keyed.identity(), heap, "{len}");
        assert_eq!(keyed.identity(), cache.keyed(&text).unwrap().identity());
    }
    // Longer than `MAX_KEY`: refused, whichever way it was written.
    let long = "k".repeat(super::cache::MAX_KEY + 1);
    assert!(cache.keyed(&long).is_err());
}
