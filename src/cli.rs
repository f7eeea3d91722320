//! The text behind `tollgate check`, `explain`, `audit` and `demo`.

mod audit;
mod check;
mod explain;

use std::time::Duration;

use crate::config::{Config, EnvOverrides};
use crate::sample_api::{self, SampleApi};

pub use audit::audit;
pub use check::route_table;
pub use explain::explain;

const DEMO_CONFIG: &str = r#"# tollgate demo: the incident write-up's budget in front of the built-in sample API.
server:
  listen: "{listen}"
  admin_listen: "{admin}"
  threads: 2
  grace_period: 1s
upstream:
  url: "http://{upstream}"
store:
  backend: memory
rate_limits:
  default:
    cost: 1
    window: 60s
    max_cost: 120
  endpoints:
    /reports/generate:
      cost: 20
      max_in_flight: 5
      queue_timeout: 1s              # shorter than a report (2 s), so a full route answers 503
      async: {}                      # Prefer: respond-async makes a report a job (202, then poll)
    "GET /items/{id}":
      cost: 1
    /analytics/query:
      cost: 10                       # admitted at 10, then settled to what the API states:
      cost_from_response: X-Actual-Cost   # the sample API says 1 unit per 1000 rows scanned
"#;

fn demo_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?)
}

/// Serves the sample API on a thread of its own.
fn spawn_sample_api(addr: &str, report_time: Duration) -> anyhow::Result<()> {
    let std_listener = std::net::TcpListener::bind(addr)
        .map_err(|e| anyhow::anyhow!("sample API on {addr}: {e}"))?;
    std_listener.set_nonblocking(true)?;
    let rt = demo_runtime()?;
    std::thread::spawn(move || {
        rt.block_on(async move {
            if let Ok(l) = tokio::net::TcpListener::from_std(std_listener) {
                sample_api::serve(l, SampleApi::new(report_time)).await;
            }
        })
    });
    Ok(())
}

pub fn demo_upstream(listen: &str, report_time: Duration) -> anyhow::Result<()> {
    let std_listener = std::net::TcpListener::bind(listen)?;
    std_listener.set_nonblocking(true)?;
    tracing::info!(listen, "sample API serving");
    demo_runtime()?.block_on(async move {
        let l = tokio::net::TcpListener::from_std(std_listener)?;
        sample_api::serve(l, SampleApi::new(report_time)).await;
        Ok(())
    })
}

pub fn demo(listen: &str, admin: &str, upstream: &str) -> anyhow::Result<()> {
    spawn_sample_api(upstream, Duration::from_secs(2))?;
    let text = DEMO_CONFIG
        .replace("{listen}", listen)
        .replace("{admin}", admin)
        .replace("{upstream}", upstream);
    let path = std::env::temp_dir().join(format!("tollgate-demo-{}.yaml", std::process::id()));
    std::fs::write(&path, &text)?;
    // Gone when the demo exits (Ctrl-C, SIGTERM), as a pid file is.
    crate::pid_file::remove_at_exit(&path);
    let cfg = Config::parse(&text, &EnvOverrides::default()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let store = crate::app::build_store(&cfg, crate::store::memory::Clock::new(0));
    println!(
        r#"
tollgate demo: gateway on http://{listen} → sample API on http://{upstream} (reports take 2 s)
config: {path}    metrics: http://{admin}/metrics
status page: http://{admin}/admin/ (in a browser: routes, slots and who holds them)

Budget: 120 units / 60 s per API key. A CRUD call costs 1, POST /reports/generate costs 20,
and at most 5 reports run at once (a 6th waits up to 1 s for a slot, then gets 503).

  # 8 reports at once: each is charged 20 when it joins, so the budget takes 6 and 2 get 429 at
  # once; 5 run (200), the 6th finds no free slot within 1 s (503 route-busy, its 20 given back)
  for i in $(seq 8); do curl -s -o /dev/null -w '%{{http_code}}\n' -X POST -H 'X-API-Key: demo-key' http://{listen}/reports/generate & done; wait

  # right away again: 100 units are spent, so 1 more report fits; the rest get 429 quota-exceeded
  for i in $(seq 8); do curl -s -o /dev/null -w '%{{http_code}}\n' -X POST -H 'X-API-Key: demo-key' http://{listen}/reports/generate & done; wait

  # the 429 itself: Retry-After, rate-limit headers and problem JSON
  curl -i -X POST -H 'X-API-Key: demo-key' http://{listen}/reports/generate

  # a report as a job: 202 with its Location at once; poll it (free) until the report is there
  curl -si -X POST -H 'X-API-Key: job-key' -H 'Prefer: respond-async' http://{listen}/reports/generate | grep -i -E '^(HTTP|location|retry-after)'
  curl -si -H 'X-API-Key: job-key' http://{listen}/_tollgate/jobs/<id from Location>

  # another key is unaffected: a CRUD call costs 1 of its own 120
  curl -i -H 'X-API-Key: other-key' http://{listen}/items/42

  # a query is admitted at its cost of 10 and settled to what the API states it cost
  # (1 unit per 1000 rows: 50 here); the next response shows the 50 gone
  curl -s -o /dev/null -H 'X-API-Key: third-key' 'http://{listen}/analytics/query?rows=50000'
  curl -si -H 'X-API-Key: third-key' http://{listen}/items/1 | grep -i '^x-ratelimit-remaining'

Ctrl-C to stop.
"#,
        path = path.display()
    );
    crate::app::run_with(cfg, path, EnvOverrides::default(), store, false)
}

#[cfg(test)]
mod tests;
