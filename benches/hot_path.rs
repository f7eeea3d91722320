//! Criterion benchmarks of the per-request hot path and of config loading.
//!
//! `cargo bench --bench hot_path -- --warm-up-time 1 --measurement-time 3`
//!
//! Targets (from the issue): route match over 1,000 patterns ≤ 1 µs; memory budget decision
//! ≤ 1 µs; loading a gateway.yaml of 10,000 endpoints ≤ 1 s. The other groups price the rest of
//! what `request_filter`/`logging` do per request (key hash, headers, metrics), to put next to
//! the end-to-end CPU time per request that bench/run.sh reports.

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use criterion::{criterion_group, BatchSize, Criterion};

use tollgate::budget::{self, Limit, State};
use tollgate::config::{Config, EnvOverrides};
use tollgate::route::{normalize_path, RouteSpec, Router};
use tollgate::store::memory::Clock;
use tollgate::store::{Admission, AdmitRequest, MemoryStore};

/// The endpoint patterns of the benchmarks: `n` of them, no two in conflict.
/// Per 100: 59 exact paths, 30 `{param}` templates, 10 with a METHOD prefix, 1 `{*rest}` tail.
fn patterns(n: usize) -> Vec<String> {
    const METHODS: [&str; 4] = ["GET", "POST", "PUT", "DELETE"];
    (0..n)
        .map(|i| {
            let svc = i / 50;
            match i % 100 {
                99 => format!("/v1/svc{svc}/files{i}/{{*rest}}"),
                k if k % 10 == 9 => {
                    format!("{} /v1/svc{svc}/res{i}/{{id}}/details", METHODS[i % 4])
                }
                k if k % 10 >= 6 => format!("/v1/svc{svc}/res{i}/{{id}}"),
                _ => format!("/v1/svc{svc}/res{i}/action"),
            }
        })
        .collect()
}

fn router(n: usize) -> Router {
    let specs = patterns(n)
        .into_iter()
        .enumerate()
        .map(|(i, pattern)| RouteSpec {
            pattern,
            cost: 1 + (i % 20) as u64,
            max_in_flight: None,
            queue_timeout: Duration::ZERO,
            queue: Default::default(),
            fidelity: Default::default(),
            provider: Default::default(),
            jobs: None,
        })
        .collect();
    match Router::new(specs, 1) {
        Ok(r) => r,
        Err(errs) => panic!("bench patterns rejected: {errs:?}"),
    }
}

/// (label, method, normalized path, expected route) of the routing benchmarks.
const ROUTE_CASES: [(&str, &str, &str, &str); 6] = [
    (
        "exact",
        "GET",
        "/v1/svc10/res500/action",
        "/v1/svc10/res500/action",
    ),
    (
        "template",
        "GET",
        "/v1/svc10/res507/12345",
        "/v1/svc10/res507/{id}",
    ),
    (
        "method_template",
        "DELETE",
        "/v1/svc10/res519/abc/details",
        "DELETE /v1/svc10/res519/{id}/details",
    ),
    (
        "tail",
        "GET",
        "/v1/svc11/files599/a/b/c.txt",
        "/v1/svc11/files599/{*rest}",
    ),
    ("miss_default", "GET", "/nothing/here/at/all", "default"),
    (
        "upper_case_exact",
        "GET",
        "/V1/SVC10/RES500/ACTION",
        "/v1/svc10/res500/action",
    ),
];

/// The dirty path of the issue: a `..`, a `//`, an encoded unreserved character, a trailing `/`.
const DIRTY: &str = "/x/../reports//%67enerate/";

fn bench_route(c: &mut Criterion) {
    let r = router(1_000);
    let mut g = c.benchmark_group("route_1000_patterns");
    for (label, method, path, want) in ROUTE_CASES {
        assert_eq!(&*r.classify(method, path).route.label, want, "{label}");
        g.bench_function(label, |b| {
            b.iter(|| black_box(r.classify(black_box(method), black_box(path)).route.cost))
        });
    }
    // What request_filter does before identifying: normalize, then classify.
    g.bench_function("normalize_then_classify_template", |b| {
        b.iter(|| {
            let p = normalize_path(black_box("/v1/svc10/res507/12345")).unwrap();
            black_box(r.classify("GET", &p).route.cost)
        })
    });
    g.finish();
}

fn bench_normalize(c: &mut Criterion) {
    let mut g = c.benchmark_group("normalize_path");
    assert_eq!(normalize_path(DIRTY).unwrap(), "/reports/generate");
    g.bench_function("clean", |b| {
        b.iter(|| normalize_path(black_box("/reports/generate")))
    });
    g.bench_function("dirty", |b| b.iter(|| normalize_path(black_box(DIRTY))));
    g.finish();
}

fn bench_budget(c: &mut Criterion) {
    let mut g = c.benchmark_group("budget");
    // gateway.yaml's default: 120 units per minute.
    let limit = Limit::new(120, Duration::from_secs(60), Duration::ZERO).unwrap();
    let now = 1u64 << 40;
    let state = Some(State::of(&limit, limit.capacity / 2, now - 1_000_000));
    assert!(budget::decide(&limit, state, now, 20).admitted());
    g.bench_function("decide_admit", |b| {
        b.iter(|| {
            budget::decide(
                black_box(&limit),
                black_box(state),
                black_box(now),
                black_box(20),
            )
        })
    });
    let full = Some(State::of(&limit, limit.capacity, now));
    assert!(!budget::decide(&limit, full, now, 20).admitted());
    g.bench_function("decide_reject", |b| {
        b.iter(|| {
            budget::decide(
                black_box(&limit),
                black_box(full),
                black_box(now),
                black_box(20),
            )
        })
    });
    g.finish();
}

fn admit_request(key: [u8; 32], limit: Limit) -> AdmitRequest {
    AdmitRequest {
        key,
        limit,
        also: vec![],
        cost: 1,
        key_cap: None,
        route: Arc::from("default"),
        route_cap: None,
        queue_timeout: Duration::ZERO,
        fair: Default::default(),
    }
}

/// Polls a future that is expected not to wait (the memory store without caps never awaits).
fn poll_ready<F: Future>(f: F) -> F::Output {
    let mut cx = Context::from_waker(Waker::noop());
    match pin!(f).poll(&mut cx) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("MemoryStore::admit without caps was expected not to wait"),
    }
}

fn bench_memory_store(c: &mut Criterion) {
    let mut g = c.benchmark_group("memory_store_admit");
    // Large enough that nothing is refused however long the benchmark runs.
    let limit = Limit::new(100_000_000, Duration::from_secs(1), Duration::ZERO).unwrap();
    let store = MemoryStore::new(Clock::new(0));
    let one = admit_request(tollgate::identity::hash_key(b"bench-key-0001"), limit);
    assert!(matches!(
        poll_ready(store.admit(&one)),
        Admission::Admitted { .. }
    ));

    // Admit and drop the Admission (the lease's drop takes the shard lock again to give the
    // key's in-flight count back): what one request costs the store, start to end.
    g.bench_function("one_key_poll", |b| {
        b.iter(|| black_box(poll_ready(store.admit(black_box(&one)))))
    });
    let keys: Vec<AdmitRequest> = (0..1_000)
        .map(|i| {
            admit_request(
                tollgate::identity::hash_key(format!("bench-key-{i:04}").as_bytes()),
                limit,
            )
        })
        .collect();
    let mut i = 0;
    g.bench_function("1000_keys_round_robin_poll", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            black_box(poll_ready(store.admit(black_box(&keys[i]))))
        })
    });
    // The same through a current-thread tokio runtime's block_on (adds the runtime's enter/exit).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    g.bench_function("one_key_block_on", |b| {
        b.iter(|| black_box(rt.block_on(store.admit(black_box(&one)))))
    });
    g.finish();
}

/// The rest of what tollgate does per admitted request, outside Pingora.
fn bench_per_request_pieces(c: &mut Criterion) {
    let mut g = c.benchmark_group("per_request");
    g.bench_function("sha256_api_key", |b| {
        b.iter(|| tollgate::identity::hash_key(black_box(b"bench-key-0001-abcdefghijklmnop")))
    });

    let cfg = Config::parse(&gateway_yaml(5), &EnvOverrides::default()).unwrap();
    let limit = cfg.default_policy.limit;
    let outcome: tollgate::store::Standing = (&budget::decide(&limit, None, 1 << 40, 1)).into();
    g.bench_function("rate_limit_headers_6_strings", |b| {
        b.iter(|| {
            tollgate::problem::rate_limit_headers(
                black_box(&cfg.default_policy),
                None,
                black_box(&outcome),
                1,
                1,
            )
        })
    });

    // logging(): the metric updates of one admitted 200, as proxy.rs does them.
    let m = tollgate::telemetry::metrics();
    let label = "GET /api/items/{id}";
    g.bench_function("metrics_of_one_request", |b| {
        b.iter(|| {
            let status: u16 = black_box(200);
            m.in_flight.with_label_values(&[label]).inc();
            m.requests
                .with_label_values(&[label, &status.to_string()])
                .inc();
            m.request_duration
                .with_label_values(&[label])
                .observe(black_box(0.0012));
            m.upstream_duration
                .with_label_values(&[label])
                .observe(black_box(0.0009));
            m.in_flight.with_label_values(&[label]).dec();
            m.cost_units.with_label_values(&[label]).inc_by(1);
        })
    });
    g.bench_function("one_counter_with_label_values", |b| {
        b.iter(|| {
            m.cost_units
                .with_label_values(&[black_box(label)])
                .inc_by(1)
        })
    });
    g.finish();
}

/// A valid gateway.yaml with `n` endpoints.
fn gateway_yaml(n: usize) -> String {
    let mut y = String::with_capacity(64 * n + 1024);
    y.push_str(
        "server:\n  listen: \"127.0.0.1:8080\"\n  threads: 1\nupstream:\n  url: \"http://127.0.0.1:3000\"\n\
         rate_limits:\n  default: {cost: 1, window: 60s, max_cost: 120}\n  endpoints:\n",
    );
    for (i, p) in patterns(n).into_iter().enumerate() {
        match i % 50 {
            0 => y.push_str(&format!(
                "    \"{p}\":\n      cost: 20\n      max_in_flight: 5\n      queue_timeout: 2s\n"
            )),
            k => y.push_str(&format!("    \"{p}\":\n      cost: {}\n", 1 + k % 20)),
        }
    }
    y.push_str("plans:\n  enterprise: {max_cost: 600, window: 60s, max_in_flight_per_key: 10}\n");
    y
}

fn bench_config(c: &mut Criterion) {
    let mut g = c.benchmark_group("config_parse");
    g.sample_size(10);
    for n in [1_000usize, 10_000] {
        let yaml = gateway_yaml(n);
        let cfg = Config::parse(&yaml, &EnvOverrides::default()).unwrap();
        assert_eq!(cfg.router.routes().count(), n + 1);
        g.bench_function(format!("{n}_endpoints"), |b| {
            b.iter_batched(
                || yaml.clone(),
                |y| Config::parse(&y, &EnvOverrides::default()).unwrap(),
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_route,
    bench_normalize,
    bench_budget,
    bench_memory_store,
    bench_per_request_pieces,
    bench_config
);

/// `cargo bench` passes `--bench`; `cargo test --all-targets` does not, and passes libtest
/// flags (`--test-threads`) that criterion would refuse. Under `cargo test` this only checks
/// that the benchmarks' inputs are what they claim to be, without timing anything.
fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        smoke();
        println!("hot_path: inputs checked; run `cargo bench --bench hot_path` for timings");
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}

fn smoke() {
    let r = router(1_000);
    for (method, path, want) in ROUTE_CASES.iter().map(|c| (c.1, c.2, c.3)) {
        assert_eq!(&*r.classify(method, path).route.label, want);
    }
    assert_eq!(normalize_path(DIRTY).unwrap(), "/reports/generate");
    let limit = Limit::new(100_000_000, Duration::from_secs(1), Duration::ZERO).unwrap();
    let store = MemoryStore::new(Clock::new(0));
    let req = admit_request(tollgate::identity::hash_key(b"k"), limit);
    assert!(matches!(
        poll_ready(store.admit(&req)),
        Admission::Admitted { .. }
    ));
    let cfg = Config::parse(&gateway_yaml(1_000), &EnvOverrides::default()).unwrap();
    assert_eq!(cfg.router.routes().count(), 1_001);
}
