//! Memory of the embedded store with many keys, and eviction of idle ones.
//!
//! `cargo bench --bench memory_keys` (a plain main, not criterion): admits one cost-1 request
//! for each of 1,000,000 distinct API keys, prints the process RSS before and after and per key,
//! then waits until every bucket has refilled and the store's sweep interval (5 s per shard) has
//! passed, touches every shard with fresh keys (a shard sweeps when it is next used), and prints
//! `len()` and RSS again. Finally it admits a second million keys, to show whether the memory
//! the first million left behind is reused. Target: < 200 MB RSS with 1M keys; idle keys evicted.
//!
//! Under `cargo test --all-targets` (no `--bench` argument) it runs a small smoke version.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tollgate::budget::Limit;
use tollgate::identity::hash_key;
use tollgate::store::memory::Clock;
use tollgate::store::{Admission, AdmitRequest, MemoryStore};

/// VmRSS of this process, in KiB.
fn rss_kib() -> u64 {
    status_kib("VmRSS:")
}

/// A `/proc/self/status` figure in KiB (`VmRSS:`, `VmHWM:` = peak RSS).
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Polls a future that does not wait (the memory store without caps never awaits).
fn poll_ready<F: Future>(f: F) -> F::Output {
    let mut cx = Context::from_waker(Waker::noop());
    match pin!(f).poll(&mut cx) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("MemoryStore::admit without caps was expected not to wait"),
    }
}

/// Admits one cost-1 request for each key `prefix-0` .. `prefix-(n-1)`; returns how many were
/// admitted. The Admission (and its lease) is dropped at once, as when a request ends.
fn admit_keys(store: &Arc<MemoryStore>, limit: Limit, prefix: &str, n: usize) -> usize {
    let route: Arc<str> = Arc::from("default");
    let mut admitted = 0;
    for i in 0..n {
        let req = AdmitRequest {
            key: hash_key(format!("{prefix}-{i}").as_bytes()),
            limit,
            also: vec![],
            cost: 1,
            key_cap: None,
            route: route.clone(),
            route_cap: None,
            queue_timeout: Duration::ZERO,
            fair: Default::default(),
        };
        if matches!(poll_ready(store.admit(&req)), Admission::Admitted { .. }) {
            admitted += 1;
        }
    }
    admitted
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let n: usize = if bench { 1_000_000 } else { 10_000 };
    // 1000 units per 100 ms: a cost-1 charge drains in 100 µs, so every bucket is full (idle)
    // again long before the sweep interval ends.
    let limit = Limit::new(1_000, Duration::from_millis(100), Duration::ZERO).unwrap();
    let store = MemoryStore::new(Clock::new(0));

    let before = rss_kib();
    let t = Instant::now();
    let admitted = admit_keys(&store, limit, "key", n);
    let took = t.elapsed();
    let after = rss_kib();
    let held = store.len();
    assert_eq!(admitted, n, "every first request of a key fits its budget");
    println!("memory_keys: MemoryStore with {n} distinct keys (1 admitted request each, 1000 units per 100ms)");
    println!(
        "  insert: {n} keys in {:.2} s ({:.0} ns/key, SHA-256 of the key included); len() = {held}",
        took.as_secs_f64(),
        took.as_nanos() as f64 / n as f64
    );
    println!(
        "  RSS before {:.1} MiB, after {:.1} MiB (peak {:.1} MiB): +{:.1} MiB = {:.0} bytes per key",
        mib(before),
        mib(after),
        mib(status_kib("VmHWM:")),
        mib(after.saturating_sub(before)),
        after.saturating_sub(before) as f64 * 1024.0 / n as f64
    );
    if !bench {
        assert_eq!(held, n);
        println!(
            "memory_keys: smoke run passed; run `cargo bench --bench memory_keys` for figures"
        );
        return;
    }
    println!(
        "  target < 200 MB RSS with 1M keys: {}",
        if after * 1024 < 200_000_000 {
            "met"
        } else {
            "MISSED"
        }
    );

    // Every bucket refilled 100 µs after its charge; a shard sweeps when it is touched at least
    // 5 s after its last sweep. Wait past that, then touch every shard (10,000 fresh keys reach
    // all 64 shards with overwhelming probability).
    let wait = Duration::from_millis(5_500);
    println!(
        "  waiting {:.1} s for the buckets to refill and the sweep interval to pass...",
        wait.as_secs_f64()
    );
    std::thread::sleep(wait);
    let fresh = 10_000;
    let t = Instant::now();
    admit_keys(&store, limit, "touch", fresh);
    let sweep_took = t.elapsed();
    let len_after = store.len();
    let rss_after_sweep = rss_kib();
    println!(
        "  after touching every shard with {fresh} fresh keys ({:.1} ms, sweeps included): len() = {len_after} (was {held}); RSS {:.1} MiB",
        sweep_took.as_secs_f64() * 1e3,
        mib(rss_after_sweep)
    );
    println!(
        "  idle keys evicted: {}",
        if len_after <= fresh { "yes" } else { "NO" }
    );

    // The maps keep their capacity after a sweep: does a second million reuse it?
    let t = Instant::now();
    admit_keys(&store, limit, "second", n);
    let took = t.elapsed();
    println!(
        "  a second {n} fresh keys: {:.2} s; len() = {}; RSS {:.1} MiB (peak {:.1} MiB)",
        took.as_secs_f64(),
        store.len(),
        mib(rss_kib()),
        mib(status_kib("VmHWM:"))
    );
}
