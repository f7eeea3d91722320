//! `rate_limits.endpoints`: the route table. Every cost (the default's too) must fit every
//! budget, or some request could never pass; each endpoint's cap, queue, fidelity and
//! provider are checked with it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::budgets::{budget_caps, concurrency_cap};
use crate::budget::Limit;
use crate::config::bounds::{shown, MAX_PATTERN_CHARS};
use crate::config::duration::format_duration;
use crate::config::error::{key_path, ConfigErrors};
use crate::config::pattern::check_endpoint;
use crate::config::raw::{Mode, RawEndpoint, RawPlan, RawRateLimits, RawShared};
use crate::policy::{Budget, SHARED_BUDGET};
use crate::route::{Fidelity, Provider, QueueRules, RouteSpec, Router};

/// Every budget's path and `max_cost`: the default's, then each plan's.
type Caps = Vec<(String, u64)>;

/// `rate_limits.endpoints`: the route table. Every cost (the default's too) must fit every
/// budget, or some request could never pass.
pub(super) fn endpoints(
    rl: &RawRateLimits,
    plans: &BTreeMap<String, RawPlan>,
    errs: &mut ConfigErrors,
) -> Option<Router> {
    let d = &rl.default;
    let budgets: Caps = budget_caps(
        "rate_limits.default".to_string(),
        d.max_cost,
        d.budgets.as_deref(),
    )
    .into_iter()
    .chain(
        plans
            .iter()
            .flat_map(|(n, p)| budget_caps(key_path("plans", n), p.max_cost, p.budgets.as_deref())),
    )
    .collect();
    check_fits(&budgets, "rate_limits.default.cost".into(), d.cost, errs);
    let specs: Vec<RouteSpec> = rl
        .endpoints
        .iter()
        .filter_map(|(pattern, e)| endpoint(rl, &budgets, pattern, e, errs))
        .collect();
    let default_fidelity = Fidelity {
        shadow: rl.mode == Some(Mode::Shadow),
        cost_per_second: None,
        cost_from_response: None,
    };
    let suffixes = match_suffixes(&rl.match_suffixes, errs);
    match Router::with_default(specs, d.cost.max(1) as u64, default_fidelity) {
        Ok(r) => Some(r.with_suffixes(&suffixes)),
        Err(route_errs) => {
            for (pattern, m) in route_errs {
                errs.push(key_path("rate_limits.endpoints", &pattern), m);
            }
            None
        }
    }
}

/// A positive `cost` must fit every budget.
fn check_fits(budgets: &Caps, path: String, cost: i64, errs: &mut ConfigErrors) {
    if cost <= 0 {
        return;
    }
    for (bname, max) in budgets {
        if cost as u64 > *max {
            errs.push(
                path.clone(),
                format!(
                    "cost {cost} exceeds {bname}.max_cost {max}: such a request could never pass"
                ),
            );
        }
    }
}

/// One endpoint's route, or `None` when its pattern cannot be one (every other field is
/// checked either way, so that one run reports all the errors).
fn endpoint(
    rl: &RawRateLimits,
    budgets: &Caps,
    pattern: &str,
    e: &RawEndpoint,
    errs: &mut ConfigErrors,
) -> Option<RouteSpec> {
    let chars = pattern.chars().count();
    if chars > MAX_PATTERN_CHARS {
        errs.push(
            key_path("rate_limits.endpoints", &shown(pattern)),
            format!("an endpoint pattern is at most {MAX_PATTERN_CHARS} characters, got {chars}"),
        );
        return None;
    }
    let base = key_path("rate_limits.endpoints", pattern);
    let cost = e.cost.unwrap_or(rl.default.cost);
    if cost <= 0 {
        errs.push(
            format!("{base}.cost"),
            format!("must be a positive integer, got {cost}"),
        );
    }
    check_fits(budgets, format!("{base}.cost"), cost, errs);
    let max_in_flight = concurrency_cap(format!("{base}.max_in_flight"), e.max_in_flight, errs);
    check_queue_timeout(&base, e, max_in_flight, errs);
    let queue = queue_rules(&base, e, max_in_flight, errs);
    let jobs = super::jobs::async_rules(&base, e, max_in_flight, errs);
    check_strip_prefix(&base, pattern, e, errs);
    let shared = e
        .shared
        .as_ref()
        .and_then(|s| shared_budget(&format!("{base}.shared"), s, cost, errs));
    if let Err(m) = check_endpoint(pattern) {
        errs.push(base, m.to_string());
        return None;
    }
    let fidelity = Fidelity {
        shadow: e.mode.or(rl.mode).unwrap_or_default() == Mode::Shadow,
        cost_per_second: cost_per_second(&base, e.cost_per_second, errs),
        cost_from_response: cost_from_response(&base, e.cost_from_response.as_deref(), errs),
    };
    Some(RouteSpec {
        pattern: pattern.to_string(),
        cost: cost.max(1) as u64,
        max_in_flight,
        queue_timeout: e.queue_timeout.map(|d| d.0).unwrap_or_default(),
        queue,
        fidelity,
        provider: Provider {
            shared,
            upstream: e.upstream.as_deref().map(Arc::from),
            strip_prefix: e.strip_prefix.as_deref().map(Arc::from),
        },
        jobs,
    })
}

/// `queue_timeout`: only with `max_in_flight`, and at most [`MAX_QUEUE_TIMEOUT`].
fn check_queue_timeout(
    base: &str,
    e: &RawEndpoint,
    max_in_flight: Option<u32>,
    errs: &mut ConfigErrors,
) {
    // Written without max_in_flight (an invalid one is reported as such, not again here).
    if e.queue_timeout.is_some() && max_in_flight.is_none() && e.max_in_flight.is_none() {
        errs.push(
            format!("{base}.queue_timeout"),
            "only applies together with max_in_flight",
        );
    }
    if let Some(t) = e.queue_timeout {
        if t.0 > MAX_QUEUE_TIMEOUT {
            errs.push(
                format!("{base}.queue_timeout"),
                format!("must be at most 1h, got {}", format_duration(t.0)),
            );
        }
    }
}

/// `strip_prefix`: whole leading segments of the endpoint's path, without a template (a part
/// of a segment, or a `{name}`, is a prefix no request's path has: it would never apply).
fn check_strip_prefix(base: &str, pattern: &str, e: &RawEndpoint, errs: &mut ConfigErrors) {
    if let Some(prefix) = &e.strip_prefix {
        let path = crate::route::split_pattern(pattern).1;
        let leads = path
            .strip_prefix(prefix.as_str())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
        if !prefix.starts_with('/') || prefix.ends_with('/') || prefix.contains('{') || !leads {
            errs.push(
                format!("{base}.strip_prefix"),
                format!("must be a leading part of the path (whole segments, no template), starting with / and not ending with one, got \"{}\"", shown(prefix)),
            );
        }
    }
}

/// `rate_limits.match_suffixes`: each a `.` and then letters, digits, `-`, `_` or more dots
/// (what a path segment can end in without escapes), at most 16 characters.
fn match_suffixes(raw: &[String], errs: &mut ConfigErrors) -> Vec<String> {
    let mut ok = Vec::new();
    for (i, s) in raw.iter().enumerate() {
        let rest = s.strip_prefix('.').unwrap_or("");
        let fits = rest.bytes().any(|b| b != b'.')
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && s.len() <= 16;
        if fits {
            ok.push(s.clone());
        } else {
            errs.push(
                format!("rate_limits.match_suffixes[{i}]"),
                format!(
                    "must be '.' then letters, digits, '-', '_' or '.', at most 16 characters (e.g. \".json\"), got \"{}\"",
                    shown(s)
                ),
            );
        }
    }
    ok
}

/// Far above any real price of a second; bounded so that a time charge (`seconds × rate`)
/// stays a plain integer of units however long a request runs.
const MAX_COST_PER_SECOND: f64 = 1_000_000.0;

/// `cost_per_second`: a positive number of units per second of upstream time.
fn cost_per_second(base: &str, value: Option<f64>, errs: &mut ConfigErrors) -> Option<f64> {
    let v = value?;
    if v.is_finite() && v > 0.0 && v <= MAX_COST_PER_SECOND {
        return Some(v);
    }
    errs.push(
        format!("{base}.cost_per_second"),
        format!("must be a positive number of units per second (at most {MAX_COST_PER_SECOND}), got {v}"),
    );
    None
}

/// Headers that frame the response or the connection: stripping one would break the answer.
const FRAMING_HEADERS: &[&str] = &[
    "connection",
    "content-length",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// `cost_from_response`: the name of the response header the upstream states the cost in.
fn cost_from_response(
    base: &str,
    value: Option<&str>,
    errs: &mut ConfigErrors,
) -> Option<http::HeaderName> {
    let v = value?;
    let path = format!("{base}.cost_from_response");
    match http::HeaderName::from_bytes(v.as_bytes()) {
        Ok(name) if FRAMING_HEADERS.contains(&name.as_str()) => errs.push(
            path,
            format!(
                "must not be a header that frames or routes the response, got \"{}\"",
                shown(v)
            ),
        ),
        Ok(name) => return Some(name),
        Err(_) => errs.push(
            path,
            format!("must be a valid HTTP header name, got \"{}\"", shown(v)),
        ),
    }
    None
}

/// Longest `queue_timeout` (DESIGN §8).
const MAX_QUEUE_TIMEOUT: Duration = Duration::from_secs(3600);

/// An endpoint's `max_queue` and `max_in_flight_per_key`: both only with `max_in_flight`, and
/// a key's share at most the cap.
fn queue_rules(
    base: &str,
    e: &RawEndpoint,
    max_in_flight: Option<u32>,
    errs: &mut ConfigErrors,
) -> QueueRules {
    let max_queue = concurrency_cap(format!("{base}.max_queue"), e.max_queue, errs);
    let per_key = concurrency_cap(
        format!("{base}.max_in_flight_per_key"),
        e.max_in_flight_per_key,
        errs,
    );
    for (field, set) in [
        ("max_queue", max_queue.is_some()),
        ("max_in_flight_per_key", per_key.is_some()),
    ] {
        if set && max_in_flight.is_none() && e.max_in_flight.is_none() {
            errs.push(
                format!("{base}.{field}"),
                "only applies together with max_in_flight",
            );
        }
    }
    if let (Some(share), Some(cap)) = (per_key, max_in_flight) {
        if share > cap {
            errs.push(
                format!("{base}.max_in_flight_per_key"),
                format!("must be at most max_in_flight ({cap}), got {share}"),
            );
        }
    }
    QueueRules { max_queue, per_key }
}

/// An endpoint's `shared` budget (named `shared` in the headers); its route's cost must fit.
fn shared_budget(path: &str, s: &RawShared, cost: i64, errs: &mut ConfigErrors) -> Option<Budget> {
    if s.max_cost <= 0 {
        errs.push(
            format!("{path}.max_cost"),
            format!("must be a positive integer, got {}", s.max_cost),
        );
        return None;
    }
    if s.window.0.is_zero() {
        errs.push(format!("{path}.window"), "must be greater than 0");
        return None;
    }
    if cost > s.max_cost {
        errs.push(
            format!("{path}.max_cost"),
            format!("the route's cost {cost} exceeds it: such a request could never pass"),
        );
    }
    match Limit::new(s.max_cost as u64, s.window.0, s.max_delay.0) {
        Ok(limit) => Some(Budget::new(
            SHARED_BUDGET,
            s.max_cost as u64,
            s.window.0,
            limit,
        )),
        Err(m) => {
            errs.push(format!("{path}.max_cost"), m.to_string());
            None
        }
    }
}
