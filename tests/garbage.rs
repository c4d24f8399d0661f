//! Garbage in Redis is a miss, never a panic: each kind of garbage, written by hand into
//! each field of an entry and of a lease (and the keys beside them), and the request for
//! that key is answered `200`, again and again, with no panic anywhere in the process
//! (fill tasks included: a panic hook counts every one).

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use redis::AsyncCommands;
use stampede_guard::Policy;
use stampede_guard::fuzzing::CachedResponse;
use stampede_guard::lease::FencingToken;
use stampede_guard::metrics::Event;
use support::RedisServer;
use support::app::{self, policy};
use support::web::{Origin, get, instance, ready_guard, send};

/// Panics anywhere in this test binary's process.
static PANICS: AtomicU64 = AtomicU64::new(0);

/// Numbers that no token of ours can be, and things that are not numbers.
const NOT_TOKENS: &[&str] = &[
    "1e300",
    "inf",
    "-inf",
    "nan",
    "-1",
    "1.5",
    "0x10",
    "abc",
    "",
    " 5",
    "99999999999999999999999",
    "9007199254740993",
    "18446744073709551615",
];

/// A valid entry's encoding, with `body`.
fn encoded(body: &'static str) -> Vec<u8> {
    CachedResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from_static(body.as_bytes()),
        fresh_for: Duration::from_secs(60),
        grace: Duration::ZERO,
        keep: Duration::from_secs(60),
        token: FencingToken::new(5),
    }
    .encode()
}

/// One way of planting garbage: Redis commands, given the key's names.
struct Case {
    what: String,
    plant: Vec<Vec<Vec<u8>>>,
}

/// The names a case plants at: the entry, its invalidation token, its response's fence
/// counter, its lease and the lease's fence counter.
struct Names {
    entry: String,
    inval: String,
    fence: String,
    lease: String,
    lease_fence: String,
    vary: String,
}

fn cmd(parts: &[&[u8]]) -> Vec<Vec<u8>> {
    parts.iter().map(|p| p.to_vec()).collect()
}

fn cases(n: &Names) -> Vec<Case> {
    let valid = encoded("planted");
    let mut truncated = valid.clone();
    truncated.truncate(valid.len() - 3);
    let mut other_version = valid.clone();
    other_version[2] = 99;
    let e = n.entry.as_bytes();
    let mut cases = Vec::new();
    let mut case = |what: String, plant: Vec<Vec<Vec<u8>>>| cases.push(Case { what, plant });
    // Each field of the entry hash, beside valid others; with and without a TTL.
    for t in NOT_TOKENS {
        for ttl in [true, false] {
            let mut plant = vec![cmd(&[b"HSET", e, b"t", t.as_bytes(), b"d", &valid])];
            if ttl {
                plant.push(cmd(&[b"PEXPIRE", e, b"60000"]));
            }
            case(format!("entry t = {t:?}, ttl {ttl}"), plant);
        }
    }
    for (what, d) in [
        ("garbage", b"garbage".to_vec()),
        ("empty", Vec::new()),
        ("truncated", truncated.clone()),
        ("another version", other_version.clone()),
    ] {
        case(
            format!("entry d {what}"),
            vec![
                cmd(&[b"HSET", e, b"t", b"5", b"d", &d]),
                cmd(&[b"PEXPIRE", e, b"60000"]),
            ],
        );
        case(
            format!("entry m {what}"),
            vec![
                cmd(&[b"HSET", e, b"t", b"5", b"d", &valid, b"m", &d]),
                cmd(&[b"PEXPIRE", e, b"60000"]),
            ],
        );
    }
    case(
        "entry x beside data".to_owned(),
        vec![cmd(&[b"HSET", e, b"t", b"5", b"d", &valid, b"x", b"yes"])],
    );
    case(
        "entry without t".to_owned(),
        vec![cmd(&[b"HSET", e, b"d", &valid])],
    );
    // The entry key, and every key beside it, of another type than ours.
    for (name, key) in [
        ("entry", &n.entry),
        ("invalidation token", &n.inval),
        ("fence counter", &n.fence),
        ("lease", &n.lease),
        ("lease fence counter", &n.lease_fence),
        ("vary record", &n.vary),
    ] {
        let k = key.as_bytes();
        case(format!("{name} a list"), vec![cmd(&[b"RPUSH", k, b"x"])]);
        case(format!("{name} a set"), vec![cmd(&[b"SADD", k, b"x"])]);
        if name != "entry" {
            case(
                format!("{name} a hash"),
                vec![cmd(&[b"HSET", k, b"t", b"1e300"])],
            );
        }
    }
    // Every string key beside the entry holding what no token can be, with and without
    // a TTL.
    for (name, key) in [
        ("invalidation token", &n.inval),
        ("fence counter", &n.fence),
        ("lease fence counter", &n.lease_fence),
        ("lease", &n.lease),
    ] {
        for t in NOT_TOKENS {
            let k = key.as_bytes();
            case(
                format!("{name} = {t:?}"),
                vec![cmd(&[b"SET", k, t.as_bytes()])],
            );
            case(
                format!("{name} = {t:?}, ttl"),
                vec![cmd(&[b"SET", k, t.as_bytes(), b"PX", b"200"])],
            );
        }
    }
    // The record of names the response varies on: what no list of header names is.
    let many: Vec<String> = (0..40).map(|i| format!("x-h{i}")).collect();
    for names in [
        "not a name".to_owned(),
        String::new(),
        ",,,".to_owned(),
        many.join(","),
        "accept,\u{7f}".to_owned(),
    ] {
        let k = n.vary.as_bytes();
        case(
            format!("vary record = {names:?}"),
            vec![cmd(&[b"SET", k, names.as_bytes()])],
        );
    }
    case(
        "vary record of bytes that are not text".to_owned(),
        vec![cmd(&[b"SET", n.vary.as_bytes(), &[0xff, 0xfe, b',']])],
    );
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_in_any_field_is_answered_and_never_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        previous(info);
    }));
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let policy = Policy::builder("items")
        .fresh_ttl(Duration::from_secs(60))
        .cold_wait(Duration::from_millis(300))
        .build()
        .unwrap();
    let i = instance(ready_guard(&server).await, policy, origin.service()).await;
    let mut conn = server.conn().await;
    let names = |path: &str| {
        let keys = i.layer.cache_keys(&get(path)).unwrap();
        Names {
            entry: keys.entry().to_owned(),
            inval: keys.invalidated_key(),
            fence: keys.primary_fence_key(),
            lease: keys.lease().key().to_owned(),
            lease_fence: keys.lease().fence_key().to_owned(),
            vary: keys.vary_key(),
        }
    };
    let count = cases(&names("/items/0")).len();
    for n in 0..count {
        let path = format!("/items/{n}");
        let case = cases(&names(&path)).remove(n);
        for command in &case.plant {
            let mut planted = redis::cmd(std::str::from_utf8(&command[0]).unwrap());
            for arg in &command[1..] {
                planted.arg(arg.as_slice());
            }
            let _: redis::Value = planted.query_async(&mut conn).await.unwrap();
        }
        for attempt in 0..3 {
            let got = send(&i.service, get(&path)).await;
            assert_eq!(
                got.status,
                StatusCode::OK,
                "{} (request {attempt}): {}",
                case.what,
                got.body
            );
            assert!(
                got.body == "planted" || got.body.starts_with('v'),
                "{}: {}",
                case.what,
                got.body
            );
        }
        assert_eq!(
            PANICS.load(Ordering::SeqCst),
            0,
            "a panic, at {}",
            case.what
        );
    }
    eprintln!("{count} kinds of garbage, each answered 200 three times, no panic");
}

#[tokio::test]
async fn garbage_at_an_entry_key_is_a_counted_miss() {
    let server = RedisServer::start();
    let origin = Origin::versions(Duration::ZERO);
    let i = app::instance(&server, policy("items").build().unwrap(), origin.service()).await;
    let valid = stampede_guard::fuzzing::CachedResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from_static(b"planted"),
        fresh_for: Duration::from_secs(60),
        grace: Duration::ZERO,
        keep: Duration::from_secs(60),
        token: stampede_guard::lease::FencingToken::new(1),
    }
    .encode();
    let mut truncated = valid.clone();
    truncated.truncate(valid.len() - 3);
    let mut other_version = valid.clone();
    other_version[2] = 99;
    let mut conn = server.conn().await;
    let cases: Vec<(&str, Box<dyn Fn(&str) -> redis::Cmd>)> = vec![
        (
            "a string",
            Box::new(|k| redis::cmd("SET").arg(k).arg("garbage").clone()),
        ),
        (
            "a list",
            Box::new(|k| redis::cmd("RPUSH").arg(k).arg("x").clone()),
        ),
        (
            "a hash without data",
            Box::new(|k| redis::cmd("HSET").arg(k).arg("t").arg("5").clone()),
        ),
        (
            "garbage data",
            Box::new(|k| {
                redis::cmd("HSET")
                    .arg(k)
                    .arg("t")
                    .arg("5")
                    .arg("d")
                    .arg("garbage")
                    .clone()
            }),
        ),
        (
            "truncated",
            Box::new({
                let t = truncated.clone();
                move |k| {
                    redis::cmd("HSET")
                        .arg(k)
                        .arg("t")
                        .arg("5")
                        .arg("d")
                        .arg(t.clone())
                        .clone()
                }
            }),
        ),
        (
            "another version",
            Box::new({
                let t = other_version.clone();
                move |k| {
                    redis::cmd("HSET")
                        .arg(k)
                        .arg("t")
                        .arg("5")
                        .arg("d")
                        .arg(t.clone())
                        .clone()
                }
            }),
        ),
    ];
    for (n, (what, plant)) in cases.iter().enumerate() {
        let path = format!("/items/{n}");
        let keys = i.layer.cache_keys(&get(&path)).unwrap();
        let _: () = plant(keys.entry()).query_async(&mut conn).await.unwrap();
        let before = i.layer.stats().get(Event::DecodeFailure);
        let got = send(&i.service, get(&path)).await;
        assert_eq!(got.status, StatusCode::OK, "{what}");
        assert_eq!(got.x_cache(), "miss", "{what}");
        assert!(got.body.starts_with('v'), "{what}: {}", got.body);
        assert_eq!(
            i.layer.stats().get(Event::DecodeFailure),
            before + 1,
            "{what}"
        );
        // The fill replaced the garbage with a valid entry.
        let data: Vec<u8> = conn.hget(keys.entry(), "d").await.unwrap();
        assert_eq!(
            stampede_guard::fuzzing::decode(&data).unwrap().body,
            got.body,
            "{what}"
        );
    }
    assert_eq!(origin.calls(), cases.len() as u64);
}

/// The length of the large body: four parts of 512 KiB and 10 bytes more.
const PARTED: usize = 4 * 512 * 1024 + 10;

/// A body kept in parts beside its entry: a part that is missing, short, long, of
/// another fill (its generation) or out of place, or garbage, makes the read a miss and
/// a refill (one more origin call, its whole body), never a panic and never a wrong
/// byte; for a read of the whole body, and for a range (read part by part). Each read
/// is made by a new instance (nothing in its L1), from Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_in_parts_that_is_not_whole_is_a_miss_and_a_refill() {
    let server = RedisServer::start();
    // Call n answers PARTED bytes of n.
    let origin = Origin::new(Duration::ZERO, |n, _| {
        http::Response::new(support::web::full(vec![n as u8; PARTED]))
    });
    let policy = || policy("items").max_body(4 << 20).build().unwrap();
    let first = app::instance(&server, policy(), origin.service()).await;
    let got = send(&first.service, get("/items/1")).await;
    assert_eq!((got.x_cache(), got.body.len()), ("miss", PARTED));
    let keys = first.layer.cache_keys(&get("/items/1")).unwrap();
    let mut conn = server.conn().await;
    // What the entry names: its generation and 5 parts, each a key of its own.
    let part_key =
        |generation: &str, index: u32| format!("{}:p:{generation}:{index}", keys.entry());
    let generation = |mut conn: redis::aio::MultiplexedConnection| {
        let entry = keys.entry().to_owned();
        async move {
            let (generation, parts): (String, u32) = redis::cmd("HMGET")
                .arg(&entry)
                .arg("g")
                .arg("p")
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(parts, 5);
            generation
        }
    };
    let read = || async {
        let i = app::instance(&server, policy(), origin.service()).await;
        send(&i.service, get("/items/1")).await
    };
    // A range is read part by part, only the parts it spans: the parts are checked
    // first all the same.
    let read_range = || async {
        let i = app::instance(&server, policy(), origin.service()).await;
        let mut request = get("/items/1");
        let range = http::HeaderValue::from_static("bytes=1000-1099");
        request.headers_mut().insert("range", range);
        send(&i.service, request).await
    };
    // Whole: another instance reads it from Redis, with no origin call.
    let got = read().await;
    assert_eq!((got.x_cache(), got.body.len()), ("hit", PARTED));
    assert!(got.body.bytes().all(|b| b == 1));
    assert_eq!(origin.calls(), 1);
    type Plant = Box<dyn Fn(&str, &str, Vec<u8>) -> redis::Cmd>;
    let cases: Vec<(&str, u32, Plant)> = vec![
        (
            "missing",
            3,
            Box::new(|key, _, _| redis::cmd("DEL").arg(key).clone()),
        ),
        (
            "short",
            1,
            Box::new(|key, _, mut part| {
                part.truncate(part.len() - 1);
                redis::cmd("SET").arg(key).arg(part).clone()
            }),
        ),
        (
            "long",
            4,
            Box::new(|key, _, mut part| {
                part.push(0);
                redis::cmd("SET").arg(key).arg(part).clone()
            }),
        ),
        (
            "of another generation",
            0,
            Box::new(|key, _, mut part| {
                part[2] ^= 1;
                redis::cmd("SET").arg(key).arg(part).clone()
            }),
        ),
        (
            "out of place",
            2,
            Box::new(|key, generation, _| {
                // Part 1's bytes at part 2's key.
                let one = format!("{}1", &key[..key.len() - 1]);
                let _ = generation;
                redis::cmd("COPY").arg(one).arg(key).arg("REPLACE").clone()
            }),
        ),
        (
            "garbage",
            2,
            Box::new(|key, _, _| redis::cmd("SET").arg(key).arg("garbage").clone()),
        ),
        (
            "of another type",
            0,
            Box::new(|key, _, _| redis::cmd("DEL").arg(key).clone()),
        ),
    ];
    for (case, (what, index, plant)) in cases.into_iter().enumerate() {
        let generation = generation(conn.clone()).await;
        let key = part_key(&generation, index);
        let part: Vec<u8> = conn.get(&key).await.unwrap();
        let calls = origin.calls();
        let _: () = plant(&key, &generation, part)
            .query_async(&mut conn)
            .await
            .unwrap();
        if what == "of another type" {
            let _: () = conn.rpush(&key, "x").await.unwrap();
        }
        let ranged = case % 2 == 1;
        let got = if ranged {
            read_range().await
        } else {
            read().await
        };
        assert_eq!(got.x_cache(), "miss", "{what}");
        assert_eq!(origin.calls(), calls + 1, "{what}: refilled once");
        let n = (calls + 1) as u8;
        // (The range of a fill that streams an answer of no declared length is
        // answered whole, as a server may.)
        let len = if got.status == StatusCode::PARTIAL_CONTENT {
            100
        } else {
            PARTED
        };
        assert_eq!(got.body.len(), len, "{what}");
        assert!(got.body.bytes().all(|b| b == n), "{what}: a wrong byte");
        // And whole again for the next reader.
        let got = read().await;
        assert_eq!((got.x_cache(), got.body.len()), ("hit", PARTED), "{what}");
    }
    // An invalidation takes the parts with the entry.
    let generation = generation(conn.clone()).await;
    first.layer.invalidate(&get("/items/1")).await.unwrap();
    for index in 0..5 {
        let exists: bool = conn.exists(part_key(&generation, index)).await.unwrap();
        assert!(!exists, "part {index} outlived its invalidated entry");
    }
    assert_eq!(PANICS.load(Ordering::SeqCst), 0);
}
