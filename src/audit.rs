//! Are the costs true? (DESIGN §6.) Each instance reports what its routes really cost the
//! backend — upstream time from `tollgate_upstream_duration_seconds`, whose fixed buckets keep
//! memory bounded per route — as `GET /admin/audit`; `tollgate audit` merges a fleet's reports
//! and compares them with the configured costs.
//!
//! Merging is exact where it can be: counts, sums and bucket counts add; percentiles are read
//! from the merged buckets, never averaged across instances. The comparison: a route's
//! *implied cost* is its mean upstream time relative to the median mean of the cost-1 routes,
//! flagged when it is more than 2× off the configured cost; and the *worst case* is the
//! backend time one key can legally impose by spending its whole plan on the route. Routes
//! whose upstream states its costs (`cost_from_response`) are compared with those as well.

pub mod fetch;
mod stated;
mod table;

pub use stated::{Stated, StatedFinding};
pub use table::render_table;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::Config;
use crate::policy::Policy;
use crate::state::Running;
use crate::telemetry::metrics;

/// Below this many upstream samples a route's figures are not trusted: the report says so
/// instead of guessing.
pub const MIN_SAMPLES: u64 = 20;
/// Configured and implied cost further apart than this factor (either way) are flagged.
pub const FLAG_FACTOR: f64 = 2.0;

/// Upstream time of one route: a Prometheus histogram's count, sum and cumulative buckets
/// (the `+Inf` bucket is `count`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    pub count: u64,
    pub sum: f64,
    pub buckets: Vec<Bucket>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    /// Upper bound in seconds.
    pub le: f64,
    /// Samples at or below `le`.
    pub count: u64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MergeError {
    #[error("route {route}: instances use different histogram buckets (different tollgate versions?); cannot merge them exactly")]
    Buckets { route: String },
}

impl Histogram {
    fn of(h: &prometheus::Histogram) -> Histogram {
        use prometheus::core::Collector;
        let families = h.collect();
        let Some(m) = families.first().and_then(|f| f.get_metric().first()) else {
            return Histogram::default();
        };
        let h = m.get_histogram();
        Histogram {
            count: h.get_sample_count(),
            sum: h.get_sample_sum(),
            buckets: h
                .get_bucket()
                .iter()
                .filter(|b| b.upper_bound().is_finite())
                .map(|b| Bucket {
                    le: b.upper_bound(),
                    count: b.cumulative_count(),
                })
                .collect(),
        }
    }

    /// Adds `other` in; false (and nothing added) when its buckets are not the same.
    pub fn merge(&mut self, other: &Histogram) -> bool {
        if self.count == 0 && self.buckets.is_empty() {
            *self = other.clone();
            return true;
        }
        let same = self.buckets.len() == other.buckets.len()
            && self
                .buckets
                .iter()
                .zip(&other.buckets)
                .all(|(a, b)| a.le == b.le);
        if !same {
            return false;
        }
        self.count += other.count;
        self.sum += other.sum;
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            a.count += b.count;
        }
        true
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }

    /// The `q`-quantile as Prometheus' `histogram_quantile` computes it: linear within the
    /// bucket the rank falls in; past the last finite bucket, that bucket's bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let rank = q * self.count as f64;
        let (mut lower, mut below) = (0.0, 0u64);
        for b in &self.buckets {
            if b.count as f64 >= rank {
                let inside = (b.count - below) as f64;
                if inside == 0.0 {
                    return Some(b.le);
                }
                return Some(lower + (b.le - lower) * (rank - below as f64) / inside);
            }
            (lower, below) = (b.le, b.count);
        }
        Some(lower)
    }
}

/// One route as one instance (or a merged fleet) saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteAudit {
    pub route: String,
    /// Requests answered (any status), this instance.
    pub requests: u64,
    /// The configured cost and time price.
    pub cost: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_per_second: Option<f64>,
    /// `enforce` or `shadow`.
    pub mode: String,
    pub upstream: Histogram,
    /// Read from `upstream`; for people reading one instance's report.
    pub p50_seconds: Option<f64>,
    pub p95_seconds: Option<f64>,
    pub mean_seconds: Option<f64>,
    /// `cost_from_response` routes: the costs their upstream stated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stated: Option<Stated>,
}

impl RouteAudit {
    /// A route no instance measured (one an audited file adds): its configured prices only.
    fn unmeasured(r: &crate::route::Route) -> RouteAudit {
        RouteAudit {
            route: r.label.to_string(),
            requests: 0,
            cost: r.cost,
            cost_per_second: r.fidelity.cost_per_second,
            mode: mode_name(r.fidelity.shadow),
            upstream: Histogram::default(),
            p50_seconds: None,
            p95_seconds: None,
            mean_seconds: None,
            stated: None,
        }
    }
}

/// A plan's budgets (the default budget is the plan `default`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanAudit {
    pub name: String,
    pub budgets: Vec<BudgetAudit>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetAudit {
    pub name: String,
    pub max_cost: u64,
    pub window_seconds: f64,
}

/// `GET /admin/audit`: one instance's view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstanceAudit {
    pub version: String,
    pub config_hash: String,
    /// Which process answered (random, per process): an instance named twice to `tollgate
    /// audit` (by another address, say) is counted once. Empty from older instances.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
    pub routes: Vec<RouteAudit>,
    pub plans: Vec<PlanAudit>,
}

impl InstanceAudit {
    /// What the audit compares against, as this instance has it: each route's cost, time
    /// price and mode, and the plans' budgets (not its ports, its store or its comments, which
    /// the config's hash covers too).
    pub fn prices(&self) -> String {
        let routes: Vec<_> = (self.routes.iter())
            .map(|r| (&r.route, r.cost, r.cost_per_second, &r.mode))
            .collect();
        serde_json::to_string(&(routes, &self.plans)).unwrap_or_default()
    }
}

/// The budgets a key of `policy` must fit, every one of them, for the worst case (the
/// tightest one binds); named as the rate-limit headers name them.
fn budgets_of(p: &Policy) -> Vec<BudgetAudit> {
    p.budgets
        .iter()
        .map(|b| BudgetAudit {
            name: b.name.clone(),
            max_cost: b.max_cost,
            window_seconds: b.window.as_secs_f64(),
        })
        .collect()
}

/// Every plan of `cfg`, `default` first.
pub fn plans_of(cfg: &Config) -> Vec<PlanAudit> {
    let mut plans: Vec<&Policy> = cfg.plans.values().map(|p| &**p).collect();
    plans.sort_by(|a, b| a.name.cmp(&b.name));
    std::iter::once(&*cfg.default_policy)
        .chain(plans)
        .map(|p| PlanAudit {
            name: p.name.clone(),
            budgets: budgets_of(p),
        })
        .collect()
}

fn mode_name(shadow: bool) -> String {
    if shadow { "shadow" } else { "enforce" }.into()
}

/// Requests answered per route, from `tollgate_requests_total{route,status}`.
fn requests_by_route() -> BTreeMap<String, u64> {
    use prometheus::core::Collector;
    let mut out = BTreeMap::new();
    for family in metrics().requests.collect() {
        for m in family.get_metric() {
            let route = m.get_label().iter().find(|l| l.name() == "route");
            if let Some(route) = route {
                *out.entry(route.value().to_string()).or_default() +=
                    m.get_counter().get_value() as u64;
            }
        }
    }
    out
}

/// This process's id in its audit reports: random, made once.
fn process_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| format!("{:016x}", rand::random::<u64>()))
}

/// This instance's report, from the series of the config it runs.
pub fn snapshot(running: &Running) -> InstanceAudit {
    let requests = requests_by_route();
    let routes = running
        .config
        .router
        .routes()
        .map(|r| {
            let upstream = Histogram::of(&running.metrics.get(r).upstream_duration);
            RouteAudit {
                route: r.label.to_string(),
                requests: requests.get(&*r.label).copied().unwrap_or(0),
                cost: r.cost,
                cost_per_second: r.fidelity.cost_per_second,
                mode: mode_name(r.fidelity.shadow),
                p50_seconds: upstream.quantile(0.5),
                p95_seconds: upstream.quantile(0.95),
                mean_seconds: upstream.mean(),
                upstream,
                stated: r.fidelity.cost_from_response.as_ref().map(|h| {
                    let (reports, sum) = running.metrics.get(r).stated.read();
                    Stated {
                        header: h.to_string(),
                        reports,
                        sum,
                    }
                }),
            }
        })
        .collect();
    InstanceAudit {
        version: env!("CARGO_PKG_VERSION").into(),
        config_hash: running.config.hash.clone(),
        instance: process_id().to_string(),
        routes,
        plans: plans_of(&running.config),
    }
}

/// Adds the instances' reports up, route by route (first seen order). Configured values
/// (cost, mode, plans) are the first instance's.
pub fn merge(instances: &[InstanceAudit]) -> Result<InstanceAudit, MergeError> {
    let mut order: Vec<String> = vec![];
    let mut routes: BTreeMap<String, RouteAudit> = BTreeMap::new();
    for inst in instances {
        for r in &inst.routes {
            match routes.get_mut(&r.route) {
                None => {
                    order.push(r.route.clone());
                    routes.insert(r.route.clone(), r.clone());
                }
                Some(m) => {
                    m.requests += r.requests;
                    match (&mut m.stated, &r.stated) {
                        (Some(a), Some(b)) => a.merge(b),
                        (a @ None, Some(b)) => *a = Some(b.clone()),
                        _ => {}
                    }
                    if !m.upstream.merge(&r.upstream) {
                        return Err(MergeError::Buckets {
                            route: r.route.clone(),
                        });
                    }
                }
            }
        }
    }
    let routes = order
        .into_iter()
        .filter_map(|name| routes.remove(&name))
        .map(|mut r| {
            r.p50_seconds = r.upstream.quantile(0.5);
            r.p95_seconds = r.upstream.quantile(0.95);
            r.mean_seconds = r.upstream.mean();
            r
        })
        .collect();
    let first = instances.first();
    Ok(InstanceAudit {
        version: first.map(|i| i.version.clone()).unwrap_or_default(),
        config_hash: first.map(|i| i.config_hash.clone()).unwrap_or_default(),
        instance: String::new(),
        routes,
        plans: first.map(|i| i.plans.clone()).unwrap_or_default(),
    })
}

/// Configured price against measured time, for one route.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub route: String,
    pub requests: u64,
    pub upstream_requests: u64,
    pub p50_seconds: Option<f64>,
    pub p95_seconds: Option<f64>,
    pub mean_seconds: Option<f64>,
    pub cost: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_per_second: Option<f64>,
    pub mode: String,
    /// Mean upstream time over the cost-1 routes' median mean; `None` without enough traffic
    /// here or on the cost-1 routes.
    pub implied_cost: Option<f64>,
    /// `under-priced` (implied > 2× configured) or `over-priced` (< ½).
    pub flag: Option<&'static str>,
    /// Fewer than [`MIN_SAMPLES`] upstream samples: no figures are guessed.
    pub too_little_traffic: bool,
    /// Per plan: backend-seconds per minute one key can impose by spending its whole plan here.
    pub worst_case: Vec<WorstCase>,
    /// `cost_from_response` routes: the mean stated cost beside the configured one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stated: Option<StatedFinding>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorstCase {
    pub plan: String,
    /// The binding budget: the one with the lowest sustained rate.
    pub budget: String,
    pub backend_seconds_per_minute: f64,
}

/// The full audit, worst route first.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// The median mean upstream time of the cost-1 routes: what one unit of cost buys.
    pub baseline_seconds: Option<f64>,
    pub routes: Vec<Finding>,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// What one request of a route is charged on average: its cost, or its measured time at
/// `cost_per_second` when that is more.
fn effective_cost(cost: u64, cost_per_second: Option<f64>, mean: f64) -> f64 {
    match cost_per_second {
        Some(rate) => (cost as f64).max((mean * rate).ceil()),
        None => cost as f64,
    }
}

/// How a configured (or effective) cost compares with the cost the evidence implies:
/// `under-priced` above twice it, `over-priced` below half of it.
pub(crate) fn price_flag(configured: f64, evidence: f64) -> Option<&'static str> {
    if evidence > configured * FLAG_FACTOR {
        Some("under-priced")
    } else if evidence * FLAG_FACTOR < configured {
        Some("over-priced")
    } else {
        None
    }
}

/// Backend-seconds per minute one key can impose on a route of `cost` whose requests take
/// `mean` seconds: `max_cost / cost × 60 / window × mean`, the tightest budget binding.
fn worst_case(plan: &PlanAudit, cost: f64, mean: f64) -> Option<WorstCase> {
    plan.budgets
        .iter()
        .map(|b| WorstCase {
            plan: plan.name.clone(),
            budget: b.name.clone(),
            backend_seconds_per_minute: b.max_cost as f64 / cost * 60.0 / b.window_seconds * mean,
        })
        .min_by(|a, b| {
            a.backend_seconds_per_minute
                .total_cmp(&b.backend_seconds_per_minute)
        })
}

/// Compares a merged fleet's measurements with the costs and plans in force. With `cfg` (the
/// file being audited, maybe an edited one) its routes, costs and plans are used (a route it
/// adds has no measurements yet; one it removed is left out); else the instances'.
pub fn report(fleet: &InstanceAudit, cfg: Option<&Config>) -> Report {
    let plans = cfg.map(plans_of).unwrap_or_else(|| fleet.plans.clone());
    let filed: Vec<RouteAudit>;
    let measured = match cfg {
        Some(c) => {
            filed = c
                .router
                .routes()
                .map(|x| {
                    let seen = fleet.routes.iter().find(|r| r.route == *x.label);
                    seen.cloned().unwrap_or_else(|| RouteAudit::unmeasured(x))
                })
                .collect();
            &filed
        }
        None => &fleet.routes,
    };
    let priced = |r: &RouteAudit| -> (u64, Option<f64>, String) {
        let configured = cfg.and_then(|c| c.router.routes().find(|x| *x.label == r.route));
        match configured {
            Some(x) => (
                x.cost,
                x.fidelity.cost_per_second,
                mode_name(x.fidelity.shadow),
            ),
            None => (r.cost, r.cost_per_second, r.mode.clone()),
        }
    };
    let enough = |r: &RouteAudit| r.upstream.count >= MIN_SAMPLES;
    let baseline = median(
        measured
            .iter()
            .filter(|r| enough(r) && priced(r).0 == 1 && priced(r).1.is_none())
            .filter_map(|r| r.upstream.mean())
            .collect(),
    );
    let mut routes: Vec<Finding> = measured
        .iter()
        .map(|r| {
            let (cost, cost_per_second, mode) = priced(r);
            let mean = r.upstream.mean().filter(|_| enough(r));
            let implied = mean
                .zip(baseline)
                .filter(|(_, b)| *b > 0.0)
                .map(|(m, b)| m / b);
            let effective = mean.map(|m| effective_cost(cost, cost_per_second, m));
            let flag = implied.zip(effective).and_then(|(i, c)| price_flag(c, i));
            // DESIGN §6's formula, on the configured cost (whatever a time-priced route bills
            // after the fact).
            let worst_case = match mean {
                Some(m) => plans
                    .iter()
                    .filter_map(|p| worst_case(p, cost as f64, m))
                    .collect(),
                None => vec![],
            };
            Finding {
                route: r.route.clone(),
                requests: r.requests,
                upstream_requests: r.upstream.count,
                p50_seconds: r.upstream.quantile(0.5).filter(|_| enough(r)),
                p95_seconds: r.upstream.quantile(0.95).filter(|_| enough(r)),
                mean_seconds: mean,
                cost,
                cost_per_second,
                mode,
                implied_cost: implied,
                flag,
                too_little_traffic: !enough(r),
                worst_case,
                stated: r.stated.as_ref().map(|s| StatedFinding::of(s, cost)),
            }
        })
        .collect();
    let worst = |f: &Finding| {
        f.worst_case
            .iter()
            .map(|w| w.backend_seconds_per_minute)
            .fold(f64::NEG_INFINITY, f64::max)
    };
    // Worst first; routes without figures last, busiest first among them.
    routes.sort_by(|a, b| {
        worst(b)
            .total_cmp(&worst(a))
            .then(b.requests.cmp(&a.requests))
    });
    Report {
        baseline_seconds: baseline,
        routes,
    }
}

/// `GET /admin/audit`: this instance's view ([`snapshot`], which `tollgate audit` reads and
/// adds up) with, per route, what the audit finds on this instance's figures alone (DESIGN
/// §6): `implied_cost`, `flag`, `too_little_traffic` and `worst_case`; and the
/// `baseline_seconds` they are measured against.
pub fn instance_view(running: &Running) -> serde_json::Result<serde_json::Value> {
    let snap = snapshot(running);
    let found = report(&snap, None);
    let by_route: std::collections::HashMap<&str, &Finding> =
        found.routes.iter().map(|f| (f.route.as_str(), f)).collect();
    let mut v = serde_json::to_value(&snap)?;
    if let Some(routes) = v["routes"].as_array_mut() {
        for r in routes {
            let Some(f) = r["route"].as_str().and_then(|l| by_route.get(l).copied()) else {
                continue;
            };
            r["implied_cost"] = serde_json::to_value(f.implied_cost)?;
            r["flag"] = serde_json::to_value(f.flag)?;
            r["too_little_traffic"] = f.too_little_traffic.into();
            r["worst_case"] = serde_json::to_value(&f.worst_case)?;
        }
    }
    v["baseline_seconds"] = serde_json::to_value(found.baseline_seconds)?;
    Ok(v)
}

#[cfg(test)]
mod tests;
