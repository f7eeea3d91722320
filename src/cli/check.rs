//! `tollgate check`'s text: the configuration as tables, one per concern, so that an operator
//! sees the costs, budgets, providers and queues the gateway will enforce.

use std::fmt::Write;
use std::time::Duration;

use crate::config::{format_duration, Config};
use crate::route::Route;

/// The route/cost table printed by `tollgate check`.
pub fn route_table(cfg: &Config) -> String {
    let mut out = table(&route_rows(cfg));
    out.push('\n');
    out.push_str(&table(&budget_rows(cfg)));
    if let Some(rows) = provider_rows(cfg) {
        out.push('\n');
        out.push_str(&table(&rows));
    }
    push_queues(&mut out, cfg);
    push_footer(&mut out, cfg);
    out
}

/// One row per route: its cost and in-flight cap.
fn route_rows(cfg: &Config) -> Vec<[String; 4]> {
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
    rows
}

/// One row per budget: a plan with several lists each (`<plan>-<name>`).
fn budget_rows(cfg: &Config) -> Vec<[String; 5]> {
    let mut budgets = vec![[
        "BUDGET".to_string(),
        "MAX_COST".into(),
        "WINDOW".into(),
        "MAX_DELAY".into(),
        "MAX_IN_FLIGHT_PER_KEY".into(),
    ]];
    let mut plans: Vec<_> = cfg.plans.values().collect();
    plans.sort_by(|a, b| a.name.cmp(&b.name));
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
    budgets
}

/// Routes that call a provider: their shared budget and where they forward. `None` when no
/// route does.
fn provider_rows(cfg: &Config) -> Option<Vec<[String; 5]>> {
    let providers: Vec<&Route> = cfg
        .router
        .routes()
        .filter(|r| r.shared().is_some() || r.provider.upstream.is_some())
        .collect();
    if providers.is_empty() {
        return None;
    }
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
    Some(rows)
}

/// Capped routes' queues, their jobs and the plans' weights in them (DESIGN §8); nothing when
/// no route is capped.
fn push_queues(out: &mut String, cfg: &Config) {
    let capped: Vec<&Route> = cfg
        .router
        .routes()
        .filter(|r| r.max_in_flight.is_some())
        .collect();
    if capped.is_empty() {
        return;
    }
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

/// The store, the registry, the identity sources and tracing, one line each.
fn push_footer(out: &mut String, cfg: &Config) {
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
