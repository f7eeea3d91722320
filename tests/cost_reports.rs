//! Settling a request's charge after the response (DESIGN §6): a route's shared (provider)
//! budget, which counts calls, is never settled by measured time.
//!
//! Every budget here refills one unit in ≥ 36 s, so nothing a test waits for moves a figure.

mod common;

use std::time::Duration;

use common::*;

fn redis_store(redis: &Redis, extra: &str) -> String {
    format!(
        "store:\n  backend: redis\n  url: \"{}\"\n  timeout: 200ms\n{extra}",
        redis.url()
    )
}

/// Each member of a `RateLimit` header: name and `r`.
fn members(r: &reqwest::Response) -> Vec<(String, u64)> {
    let v = header(r, "ratelimit").unwrap_or_default();
    v.split(", ")
        .filter_map(|m| {
            let (name, rest) = m.split_once(';')?;
            let r = rest.split(';').find_map(|p| p.strip_prefix("r="))?;
            Some((name.trim_matches('"').to_string(), r.parse().ok()?))
        })
        .collect()
}

/// A route's shared budget counts calls: measured time settles only the key's own budget.
async fn shared_budget_counts_calls(store: &str) {
    let up = Upstream::start(Duration::ZERO);
    let gw = Gateway::start(
        &up,
        &format!(
            r#"{store}rate_limits:
  default: {{ cost: 1, window: 1h, max_cost: 100 }}
  endpoints:
    /p:
      cost: 1
      cost_per_second: 4
      shared: {{ max_cost: 50, window: 1h }}
"#
        ),
    );
    let c = client();
    let both =
        |key: u64, shared: u64| vec![("default".to_string(), key), ("shared".into(), shared)];
    // ~1.3 s at 4/s: the key pays 6, the provider's budget 1.
    let r = get(&c, gw.url("/p?delay_ms=1300"), "p-key").await;
    assert_eq!(members(&r), both(99, 49));
    assert_metric(&gw, "tollgate_cost_units_total{route=\"/p\"}", 6.0).await;
    let r = get(&c, gw.url("/p"), "p-key").await;
    assert_eq!(members(&r), both(93, 48), "{store}");
    assert_metric(&gw, "tollgate_cost_units_total{route=\"/p\"}", 7.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_charges_leave_the_shared_budget_alone_on_the_memory_store() {
    shared_budget_counts_calls("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_charges_leave_the_shared_budget_alone_on_redis() {
    let redis = Redis::start();
    shared_budget_counts_calls(&redis_store(&redis, "")).await;
}
