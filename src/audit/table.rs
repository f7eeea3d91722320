//! The table `tollgate audit` prints.

use std::fmt::Write;

use super::{Finding, Report, FLAG_FACTOR, MIN_SAMPLES};

const COLUMNS: usize = 10;

fn secs(v: Option<f64>) -> String {
    match v {
        Some(s) if s < 1.0 => format!("{:.0}ms", s * 1e3),
        Some(s) => format!("{s:.2}s"),
        None => "-".into(),
    }
}

/// The table `tollgate audit` prints.
pub fn render_table(r: &Report) -> String {
    let mut rows = vec![[
        "ROUTE".to_string(),
        "REQUESTS".into(),
        "P50".into(),
        "P95".into(),
        "MEAN".into(),
        "COST".into(),
        "IMPLIED".into(),
        "STATED".into(),
        "FLAG".into(),
        "WORST CASE PER KEY (backend-s/min)".into(),
    ]];
    rows.extend(r.routes.iter().map(row));
    let mut out = String::new();
    let mut widths = [0usize; COLUMNS];
    for row in &rows {
        for (i, c) in row.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    for row in &rows {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c}{}", " ".repeat(widths[i] - c.chars().count())))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    let _ = match r.baseline_seconds {
        Some(b) => writeln!(
            out,
            "\none cost unit = {} of upstream time (median mean of the cost-1 routes)",
            secs(Some(b))
        ),
        None => writeln!(
            out,
            "\nno cost-1 route has {MIN_SAMPLES}+ requests: implied costs need that baseline"
        ),
    };
    out
}

/// One route's line.
fn row(f: &Finding) -> [String; COLUMNS] {
    let cost = match f.cost_per_second {
        Some(rate) => format!("{}+{rate}/s", f.cost),
        None => f.cost.to_string(),
    };
    let (implied, mut flag, worst) = if f.too_little_traffic {
        (
            "-".to_string(),
            format!(
                "too little traffic ({} < {MIN_SAMPLES})",
                f.upstream_requests
            ),
            "-".to_string(),
        )
    } else {
        let implied = f
            .implied_cost
            .map(|i| format!("{i:.1}"))
            .unwrap_or("no cost-1 baseline".into());
        let flag = match f.flag {
            Some(flag) => format!("!! {flag} (>{FLAG_FACTOR}x)"),
            None => "ok".into(),
        };
        let worst = f
            .worst_case
            .iter()
            .map(|w| format!("{}={:.1}", w.plan, w.backend_seconds_per_minute))
            .collect::<Vec<_>>()
            .join(" ");
        (implied, flag, worst)
    };
    if let Some((s, mean)) = f
        .stated
        .as_ref()
        .and_then(|s| Some((s.flag?, s.mean_cost?)))
    {
        let stated = format!("!! {s} vs stated {mean:.1} (>{FLAG_FACTOR}x)");
        flag = if flag == "ok" {
            stated
        } else {
            format!("{flag}; {stated}")
        };
    }
    let mut route = f.route.clone();
    if f.mode == "shadow" {
        route.push_str(" (shadow)");
    }
    [
        route,
        f.requests.to_string(),
        secs(f.p50_seconds),
        secs(f.p95_seconds),
        secs(f.mean_seconds),
        cost,
        implied,
        f.stated.as_ref().map_or("-".into(), |s| s.cell()),
        flag,
        worst,
    ]
}
