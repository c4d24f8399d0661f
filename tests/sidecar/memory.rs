//! What one answer can make the sidecar hold, read from its `/proc` (its peak resident
//! memory): an answer without a declared length, on a route that stores, is held whole
//! only up to `--max-body`, then as a window its client reads in step with the origin;
//! once its client is gone, the origin's connection is closed.

use super::*;
use support::chunked::{self, memory, read_checked, read_paced, reset_peak};

const MIB: u64 = 1024 * 1024;

/// The sidecar in front of the chunked origin, on its own Redis (the route stores),
/// with `args`.
async fn sidecar_before_chunked(args: &[&str]) -> (Sidecar, RedisServer, chunked::Calls) {
    let (origin, calls) = chunked::origin().await;
    let redis = RedisServer::start();
    let upstream = format!("http://{origin}");
    let redis_url = redis.url();
    let mut all = vec![
        "--upstream",
        &upstream,
        "--redis",
        &redis_url,
        "--metrics",
        "127.0.0.1:0",
    ];
    all.extend_from_slice(args);
    let sidecar = Sidecar::start(&all);
    // What it holds once it served a request.
    let warm = fetch(sidecar.listen, "/warm/1", &[]).await;
    assert_eq!(warm.status, StatusCode::OK);
    (sidecar, redis, calls)
}

/// The sidecar's resident memory now, its peak reset, and a connection that asked it for
/// `path` (HTTP/1.1, kept alive).
async fn measured_request(sidecar: &Sidecar, path: &str) -> (u64, TcpStream) {
    let pid = sidecar.pid();
    let (before, _) = memory(&pid);
    reset_peak(&pid);
    let mut stream = TcpStream::connect(sidecar.listen).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: shop.example\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    (before, stream)
}

/// A 1.5 GiB answer without a declared length, on a route that stores, read as fast as
/// a client can for a second, then let go: the sidecar's peak resident memory grows by
/// at most 128 MiB (it held 1,037 MiB and kept reading the origin after its client
/// left), and the origin's connection is closed within 3 s of the client leaving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_answer_without_a_length_is_held_as_a_window_and_let_go_with_its_client() {
    let (sidecar, _redis, calls) = sidecar_before_chunked(&[]).await;
    let pid = sidecar.pid();
    let (before, mut stream) = measured_request(&sidecar, "/chunked/1536").await;
    let (read, ended) = read_checked(&mut stream, Duration::from_secs(1)).await;
    assert!(!ended, "1.5 GiB in a second: {read} bytes");
    drop(stream);
    let left = Instant::now();
    let let_go = eventually(HANG, || async {
        calls.get().last().is_some_and(|call| call.let_go.is_some())
    });
    assert!(
        let_go.await,
        "the origin's body was never let go: {:?}",
        calls.get()
    );
    let call = calls.get().last().cloned().unwrap();
    let after_leaving = call.let_go.unwrap().saturating_duration_since(left);
    let (_, peak) = memory(&pid);
    let grown = peak.saturating_sub(before);
    eprintln!(
        "a 1.5 GiB chunked answer, read for 1 s ({} MiB) then let go: the origin gave {} \
         MiB and was let go {after_leaving:?} after the client; the sidecar's peak grew by \
         {:.1} MiB",
        read / MIB,
        call.sent / MIB,
        grown as f64 / MIB as f64
    );
    assert!(read > 0, "the client got nothing");
    assert!(
        after_leaving < Duration::from_secs(3),
        "the origin was let go {after_leaving:?} after its only client left"
    );
    assert!(call.sent < 1536 * MIB, "the origin's whole body was read");
    assert!(
        grown <= 128 * MIB,
        "the sidecar's peak grew by {grown} bytes for one client"
    );
    let deserted = counter(&sidecar, "stampede_guard_fill_streams_total", "deserted");
    assert_eq!(deserted.await, 1);
}

/// One fast reader of a 256 MiB answer without a declared length, on a route that
/// stores: every byte, in order, and the sidecar's peak resident memory grows by at
/// most 128 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_fast_reader_of_a_256_mib_answer_without_a_length_gets_every_byte() {
    let (sidecar, _redis, calls) = sidecar_before_chunked(&[]).await;
    let pid = sidecar.pid();
    let (before, mut stream) = measured_request(&sidecar, "/chunked/256").await;
    let (read, ended) = read_checked(&mut stream, Duration::from_secs(240)).await;
    let (_, peak) = memory(&pid);
    let grown = peak.saturating_sub(before);
    eprintln!(
        "one reader of a 256 MiB chunked answer: {} MiB, the sidecar's peak grew by {:.1} MiB",
        read / MIB,
        grown as f64 / MIB as f64
    );
    assert!(ended, "the body did not end: {read} bytes came");
    assert_eq!(read, 256 * MIB);
    assert_eq!(calls.get().len(), 2, "the warm-up and this one");
    assert!(
        grown <= 128 * MIB,
        "the sidecar's peak grew by {grown} bytes for one reader"
    );
}

/// 16 slow clients (256 KiB/s), each on its own cold key of a 60 MiB answer without a
/// declared length, on a route that stores (so that each fill holds its body whole up to
/// `--max-body`, 16 MiB: 256 MiB in all), with `--fill-memory 32MiB`: the sidecar's peak
/// resident memory grows by at most the fill memory and 64 MiB; each client gets its
/// bytes in order; the fills turned away are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_of_large_answers_hold_at_most_the_fill_memory() {
    const CLIENTS: usize = 16;
    let (sidecar, _redis, _calls) = sidecar_before_chunked(&["--fill-memory", "32MiB"]).await;
    let pid = sidecar.pid();
    let (before, _) = memory(&pid);
    reset_peak(&pid);
    let clients = (0..CLIENTS).map(|n| {
        let listen = sidecar.listen;
        tokio::spawn(async move {
            let mut stream = TcpStream::connect(listen).await.unwrap();
            let request = format!("GET /slow/{n}/60 HTTP/1.1\r\nHost: shop.example\r\n\r\n");
            stream.write_all(request.as_bytes()).await.unwrap();
            read_paced(&mut stream, Duration::from_secs(8), 256 * 1024).await
        })
    });
    let read = futures_util::future::join_all(clients).await;
    let (_, peak) = memory(&pid);
    let grown = peak.saturating_sub(before);
    let over = counter(&sidecar, "stampede_guard_fill_streams_total", "over_memory").await;
    eprintln!(
        "{CLIENTS} clients at 256 KiB/s of 60 MiB answers, --fill-memory 32MiB: the \
         sidecar's peak grew by {:.1} MiB; {over} fills over the fill memory",
        grown as f64 / MIB as f64
    );
    // (Every byte each got was checked, in order, as it came.)
    for (n, read) in read.into_iter().enumerate() {
        let (bytes, _) = read.unwrap();
        assert!(bytes > 0, "client {n} got nothing");
    }
    assert!(over > 0, "no fill was turned away");
    assert!(
        grown <= 32 * MIB + 64 * MIB,
        "the sidecar's peak grew by {grown} bytes"
    );
}

/// A sidecar whose callers waited for another sidecar's fill of a 32 MiB entry (too
/// large for its L1) reads it from Redis part by part as it answers them, not whole
/// first: its peak resident memory grows by at most 16 MiB (the look at what the other
/// wrote read all of it, up to 64 MiB per look).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_another_sidecars_fill_reads_a_large_entry_in_parts() {
    let (origin, calls) = chunked::origin().await;
    let redis = RedisServer::start();
    let upstream = format!("http://{origin}");
    let args = [
        "--upstream",
        upstream.as_str(),
        "--redis",
        &redis.url(),
        "--max-body",
        "64MiB",
        "--cold-wait",
        "20s",
    ];
    let (filler, waiter) = (Sidecar::start(&args), Sidecar::start(&args));
    let warm = fetch(waiter.listen, "/warm/1", &[]).await;
    assert_eq!(warm.status, StatusCode::OK);
    let pid = waiter.pid();
    let (before, _) = memory(&pid);
    reset_peak(&pid);
    let path = "/sized/32768";
    let filling = tokio::spawn(support::chunked::fetch_checked(filler.listen, path, HANG));
    // The filler holds the key's lease: the waiter's caller waits for its entry.
    let leased = eventually(HANG, || async { calls.get().len() == 2 });
    assert!(leased.await, "the filler did not call the origin");
    let waited = support::chunked::fetch_checked(waiter.listen, path, HANG).await;
    let filled = filling.await.unwrap();
    let (_, peak) = memory(&pid);
    let grown = peak.saturating_sub(before);
    eprintln!(
        "a wait for another sidecar's 32 MiB fill: {waited:?}; the waiter's peak grew by \
         {:.1} MiB",
        grown as f64 / MIB as f64
    );
    assert!(filled.whole && waited.whole, "{filled:?} {waited:?}");
    assert_eq!(waited.body, 32 * MIB);
    assert_eq!(calls.get().len(), 2, "the warm-up and one fill");
    assert!(grown <= 16 * MIB, "the waiter's peak grew by {grown} bytes");
}
