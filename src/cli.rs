//! The text behind `tollgate check`, `explain`, `audit` and `demo`.

use std::fmt::Write;
use std::time::Duration;

use crate::config::{format_duration, Config, EnvOverrides};
use crate::decision;
use crate::identity::{self, Unauthenticated};
use crate::sample_api::{self, SampleApi};

/// The route/cost table printed by `tollgate check`.
pub fn route_table(cfg: &Config) -> String {
    let mut rows = vec![[
        "ROUTE".to_string(),
        "COST".into(),
        "MAX_IN_FLIGHT".into(),
        "QUEUE_TIMEOUT".into(),
    ]];
    for r in cfg.router.routes() {
        rows.push([
            r.label.to_string(),
            r.cost.to_string(),
            r.max_in_flight.map(|n| n.to_string()).unwrap_or("-".into()),
            if r.max_in_flight.is_some() {
                format_duration(r.queue_timeout)
            } else {
                "-".into()
            },
        ]);
    }
    let mut out = table(&rows);
    out.push('\n');
    let mut budgets = vec![[
        "BUDGET".to_string(),
        "MAX_COST".into(),
        "WINDOW".into(),
        "MAX_DELAY".into(),
        "MAX_IN_FLIGHT_PER_KEY".into(),
    ]];
    let mut plans: Vec<_> = cfg.plans.values().collect();
    plans.sort_by(|a, b| a.name.cmp(&b.name));
    // One row per budget: a plan with several lists each (`<plan>-<name>`).
    for p in std::iter::once(&cfg.default_policy).chain(plans) {
        for b in &p.budgets {
            budgets.push([
                b.name.clone(),
                b.max_cost.to_string(),
                format_duration(b.window),
                format_duration(p.max_delay),
                p.max_in_flight_per_key
                    .map(|n| n.to_string())
                    .unwrap_or("-".into()),
            ]);
        }
    }
    out.push_str(&table(&budgets));
    // Routes that call a provider: their shared budget and where they forward.
    let providers: Vec<_> = cfg
        .router
        .routes()
        .filter(|r| r.shared().is_some() || r.provider.upstream.is_some())
        .collect();
    if !providers.is_empty() {
        let mut rows = vec![[
            "ROUTE".to_string(),
            "SHARED".into(),
            "MAX_DELAY".into(),
            "UPSTREAM".into(),
            "STRIP_PREFIX".into(),
        ]];
        for r in providers {
            rows.push([
                r.label.to_string(),
                r.shared().map_or("-".into(), |b| {
                    format!("{} per {}", b.max_cost, format_duration(b.window))
                }),
                r.shared().map_or("-".into(), |b| {
                    format_duration(Duration::from_micros(b.limit.max_delay_us()))
                }),
                r.provider
                    .upstream
                    .as_deref()
                    .unwrap_or("upstream")
                    .to_string(),
                r.provider
                    .strip_prefix
                    .as_deref()
                    .unwrap_or("-")
                    .to_string(),
            ]);
        }
        out.push('\n');
        out.push_str(&table(&rows));
    }
    // Capped routes' queues and the plans' weights in them (DESIGN §8).
    let capped: Vec<_> = cfg
        .router
        .routes()
        .filter(|r| r.max_in_flight.is_some())
        .collect();
    if !capped.is_empty() {
        let mut rows = vec![[
            "QUEUED ROUTE".to_string(),
            "MAX_QUEUE".into(),
            "PER_KEY".into(),
        ]];
        for r in capped {
            let or_dash = |n: Option<u32>| n.map_or("-".into(), |n| n.to_string());
            rows.push([
                r.label.to_string(),
                or_dash(r.queue.max_queue),
                or_dash(r.queue.per_key),
            ]);
        }
        out.push('\n');
        out.push_str(&table(&rows));
        if let Some(rows) = crate::jobs::describe::check_rows(&cfg.router) {
            out.push('\n');
            out.push_str(&table(&rows));
        }
        let mut weights: Vec<_> = cfg.plans.values().filter(|p| p.weight != 1).collect();
        weights.sort_by(|a, b| a.name.cmp(&b.name));
        if !weights.is_empty() {
            let mut rows = vec![["PLAN".to_string(), "WEIGHT".into()]];
            rows.extend(
                weights
                    .iter()
                    .map(|p| [p.name.clone(), p.weight.to_string()]),
            );
            out.push('\n');
            out.push_str(&table(&rows));
        }
    }
    let _ = writeln!(
        out,
        "\nstore: {:?}  registry keys: {}  identity: {}",
        cfg.store.backend,
        cfg.keys.len(),
        cfg.raw.identity.sources.join(", ")
    );
    if let Some(t) = &cfg.tracing {
        let _ = writeln!(
            out,
            "tracing: OTLP/HTTP to {}  service: {}  sample_ratio: {}",
            t.traces_url, t.service_name, t.sample_ratio
        );
    }
    out
}

fn table<const N: usize>(rows: &[[String; N]]) -> String {
    let mut widths = [0usize; N];
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            // Padded by hand: a `{:<w$}` width above u16::MAX panics.
            .map(|(i, c)| format!("{c}{}", " ".repeat(widths[i] - c.chars().count())))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    out
}

/// `explain`'s `cost:` lines: the price, and how it is settled after the response.
fn explain_cost(out: &mut String, route: &crate::route::Route) {
    let _ = writeln!(out, "cost:         {}", route.cost);
    if let Some(rate) = route.fidelity.cost_per_second {
        let _ = writeln!(
            out,
            "              then {rate} per second of upstream time, at least {} in total",
            route.cost
        );
    }
    if let Some(name) = &route.fidelity.cost_from_response {
        let bound = route
            .cost
            .saturating_mul(crate::route::stated::BOUND_FACTOR);
        let _ = writeln!(
            out,
            "              settled to what the upstream states in {name} (0 to {bound} units), when it does"
        );
    }
}

/// `tollgate explain`: which route, what cost, which limits. Returns the text and whether the
/// request would be classified at all.
pub fn explain(cfg: &Config, method: &str, path: &str, key: Option<&str>) -> (String, bool) {
    let mut out = String::new();
    // The proxy's own classification, so that explain and the gateway never disagree.
    let classified = match decision::classify(cfg, method, path) {
        Ok(c) => c,
        Err(r) => {
            let _ = writeln!(
                out,
                "{method} {path}: {} {} ({})",
                r.problem.status(),
                r.problem.slug(),
                r.detail
            );
            return (out, false);
        }
    };
    let route = &classified.route;
    let method = classified.forward_method.unwrap_or(method);
    let _ = writeln!(out, "request:      {method} {path}");
    if let Some(t) = &classified.forward_target {
        let _ = writeln!(out, "normalized:   {t}  (what the upstream receives)");
    }
    let _ = writeln!(out, "route:        {}", route.label);
    explain_cost(&mut out, route);
    if route.fidelity.shadow {
        let _ = writeln!(
            out,
            "mode:         shadow (refusals are counted and forwarded, never enforced)"
        );
    }
    if let Some(name) = &route.provider.upstream {
        let _ = writeln!(
            out,
            "upstream:     {name}{}",
            route
                .provider
                .strip_prefix
                .as_deref()
                .map_or(String::new(), |p| format!(" (without the prefix {p})"))
        );
    }
    match route.max_in_flight {
        Some(n) => {
            let _ = writeln!(
                out,
                "in-flight:    at most {n} at once fleet-wide; wait up to {} for a slot, then 503",
                format_duration(route.queue_timeout)
            );
        }
        None => {
            let _ = writeln!(out, "in-flight:    no cap");
        }
    }
    if route.max_in_flight.is_some() {
        let _ = writeln!(
            out,
            "queue:        fair: a freed slot goes to the key running fewest here per its plan's weight; {}; {}",
            route
                .queue
                .max_queue
                .map_or("no bound on waiters".into(), |n| format!(
                    "at most {n} waiting fleet-wide (503 at once beyond)"
                )),
            route.queue.per_key.map_or("no per-key share".into(), |n| format!(
                "a key runs at most {n} at once here (it waits beyond)"
            ))
        );
    }
    if let Some(j) = &route.jobs {
        let _ = writeln!(out, "{}", crate::jobs::describe::explain_line(j));
    }
    let who = identity::identify(cfg, Ok(key.map(str::as_bytes)), Some([127, 0, 0, 1].into()));
    match who {
        Ok(id) => {
            let p = &id.policy;
            let _ = writeln!(
                out,
                "key:          {}",
                match &id.id {
                    Some(i) => format!("registry id {i}"),
                    None if key.is_some() => format!("{} (no registry)", id.log_name()),
                    None => "anonymous (client_ip)".into(),
                }
            );
            // Every budget the request is charged against (all must fit).
            for (i, b) in p.budgets.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{}\"{}\" {} units per {} (max_delay {})",
                    if i == 0 {
                        "budget:       "
                    } else {
                        "and budget:   "
                    },
                    b.name,
                    b.max_cost,
                    format_duration(b.window),
                    format_duration(p.max_delay)
                );
                let _ = writeln!(
                    out,
                    "              = {} such requests in a burst, then one every {:.1} s",
                    b.max_cost / route.cost,
                    b.window.as_secs_f64() * route.cost as f64 / b.max_cost as f64
                );
            }
            if let Some(b) = route.shared() {
                let delay = Duration::from_micros(b.limit.max_delay_us());
                let _ = writeln!(
                    out,
                    "and shared:   \"{}\" {} units per {} for all callers of this route, fleet-wide (held up to {}, then 429)",
                    b.name,
                    b.max_cost,
                    format_duration(b.window),
                    format_duration(delay)
                );
            }
            if let Some(n) = p.max_in_flight_per_key {
                let _ = writeln!(out, "per key:      at most {n} in flight (429 beyond)");
            }
            if route.max_in_flight.is_some() {
                let _ = writeln!(out, "weight:       {} (plan \"{}\")", p.weight, p.name);
            }
        }
        Err(Unauthenticated::Missing) => {
            let _ = writeln!(
                out,
                "key:          none given → 401 unauthenticated (anonymous: reject)"
            );
        }
        Err(Unauthenticated::Unknown) => {
            let _ = writeln!(
                out,
                "key:          not in the registry → 401 unauthenticated"
            );
        }
        Err(Unauthenticated::Conflicting) => {
            let _ = writeln!(out, "key:          conflicting keys → 401 unauthenticated");
        }
    }
    (out, true)
}

/// `tollgate audit`: reads every instance's `/admin/audit`, merges them and compares the
/// fleet's measured upstream time with the costs of `cfg` (or the instances' own). Returns the
/// text and the exit code: 0, 2 when some instance did not answer (it is named), 1 when none
/// did or their reports cannot be merged.
pub fn audit(cfg: Option<&Config>, admins: &[String], json: bool) -> (String, u8) {
    let token = std::env::var("TOLLGATE_ADMIN_TOKEN")
        .ok()
        .filter(|t| !t.is_empty());
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return (format!("tollgate audit: {e}\n"), 1),
    };
    // Concurrently, so that one slow instance costs one timeout, not one per instance.
    let answers: Vec<_> = rt.block_on(async {
        let tasks: Vec<_> = admins
            .iter()
            .map(|a| {
                let (a, token) = (a.clone(), token.clone());
                tokio::spawn(async move { crate::audit::fetch::fetch(&a, token.as_deref()).await })
            })
            .collect();
        let mut answers = vec![];
        for t in tasks {
            answers.push(
                t.await
                    .map_err(|e| e.to_string())
                    .and_then(|r| r.map_err(|e| e.to_string())),
            );
        }
        answers
    });
    let mut reports = vec![];
    let mut failed = vec![];
    for (admin, answer) in admins.iter().zip(answers) {
        match answer {
            Ok(r) => reports.push(r),
            Err(e) => failed.push((admin.clone(), e)),
        }
    }
    let merged = crate::audit::merge(&reports);
    let code = match (&merged, reports.is_empty(), failed.is_empty()) {
        (Err(_), _, _) | (_, true, _) => 1,
        (Ok(_), false, false) => 2,
        (Ok(_), false, true) => 0,
    };
    let report = merged
        .as_ref()
        .ok()
        .filter(|_| !reports.is_empty())
        .map(|m| crate::audit::report(m, cfg));
    if json {
        let instances: Vec<serde_json::Value> = admins
            .iter()
            .map(|a| match failed.iter().find(|(f, _)| f == a) {
                Some((_, e)) => serde_json::json!({"admin": a, "ok": false, "error": e}),
                None => serde_json::json!({"admin": a, "ok": true}),
            })
            .collect();
        let mut v = serde_json::json!({ "instances": instances });
        if let Some(r) = &report {
            v["baseline_seconds"] = serde_json::json!(r.baseline_seconds);
            v["routes"] = serde_json::to_value(&r.routes).unwrap_or_default();
        }
        if let Err(e) = &merged {
            v["error"] = e.to_string().into();
        }
        return (format!("{v:#}\n"), code);
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "instances: {} of {} answered",
        reports.len(),
        admins.len()
    );
    for (admin, e) in &failed {
        let _ = writeln!(
            out,
            "  UNREACHABLE {admin}: {e} (its traffic is not in the figures below)"
        );
    }
    if let Err(e) = &merged {
        let _ = writeln!(out, "cannot merge: {e}");
    }
    if let Some(r) = &report {
        out.push('\n');
        out.push_str(&crate::audit::render_table(r));
    }
    (out, code)
}

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
    let cfg = Config::parse(&text, &EnvOverrides::default()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let store = crate::app::build_store(&cfg, crate::store::memory::Clock::new(0));
    println!(
        r#"
tollgate demo: gateway on http://{listen} → sample API on http://{upstream} (reports take 2 s)
config: {path}    metrics: http://{admin}/metrics
status page: http://{admin}/admin/ (in a browser: routes, slots and who holds them)

Budget: 120 units / 60 s per API key. A CRUD call costs 1, POST /reports/generate costs 20,
and at most 5 reports run at once (a 6th waits up to 1 s for a slot, then gets 503).

  # 8 reports at once: 5 run (200), 3 find no free slot within 1 s (503 route-busy, not charged)
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
