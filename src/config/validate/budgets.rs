//! The budget sections: `rate_limits` (default and endpoints), `plans` and the key registry.
//! Every cost must fit every budget, so these sections are checked against each other.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::budget::{Limit, MAX_PLAN_BUDGETS};
use crate::config::bounds::{shown, MAX_NAME_CHARS, MAX_PATTERN_CHARS};
use crate::config::duration::format_duration;
use crate::config::error::{key_path, ConfigErrors};
use crate::config::pattern::check_endpoint;
use crate::config::raw::{
    Mode, RawBudget, RawDefault, RawEndpoint, RawKey, RawPlan, RawRateLimits, RawShared,
};
use crate::config::KeyEntry;
use crate::policy::{Budget, Policy, SHARED_BUDGET};
use crate::route::{Fidelity, Provider, QueueRules, RouteSpec, Router};

/// `rate_limits.default`: the budget of every key without a plan.
pub(super) fn default_policy(d: &RawDefault, errs: &mut ConfigErrors) -> Option<Policy> {
    let policy = build_policy(
        "default",
        "rate_limits.default",
        (d.max_cost, d.window.map(|w| w.0), d.budgets.as_deref()),
        d.max_delay.0,
        None,
        errs,
    );
    if d.cost <= 0 {
        errs.push(
            "rate_limits.default.cost",
            format!("must be a positive integer, got {}", d.cost),
        );
    }
    policy
}

/// `plans`: per-customer budgets; a plan without `max_delay` inherits the default's.
pub(super) fn plans(
    raw: &BTreeMap<String, RawPlan>,
    d: &RawDefault,
    errs: &mut ConfigErrors,
) -> HashMap<String, Arc<Policy>> {
    let mut plans = HashMap::new();
    for (name, p) in raw {
        let chars = name.chars().count();
        if chars > MAX_NAME_CHARS {
            errs.push(
                key_path("plans", &shown(name)),
                format!("a plan name is at most {MAX_NAME_CHARS} characters, got {chars}"),
            );
            continue;
        }
        let base = key_path("plans", name);
        // Plan names go into RateLimit headers as structured-field strings.
        if name == "default"
            || name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            errs.push(
                base.clone(),
                "a plan name uses only letters, digits, '-', '_' or '.', and is not \"default\" (that is rate_limits.default)",
            );
        }
        let per_key = concurrency_cap(
            format!("{base}.max_in_flight_per_key"),
            p.max_in_flight_per_key,
            errs,
        );
        let weight = match p.weight {
            None => 1,
            Some(w) if (1..=MAX_WEIGHT).contains(&w) => w as u32,
            Some(w) => {
                errs.push(
                    format!("{base}.weight"),
                    format!("must be a positive integer (at most {MAX_WEIGHT}), got {w}"),
                );
                1
            }
        };
        if let Some(mut policy) = build_policy(
            name,
            &base,
            (p.max_cost, p.window.map(|w| w.0), p.budgets.as_deref()),
            p.max_delay.map(|d| d.0).unwrap_or(d.max_delay.0),
            per_key,
            errs,
        ) {
            policy.weight = weight;
            plans.insert(name.clone(), Arc::new(policy));
        }
    }
    plans
}

/// `rate_limits.endpoints`: the route table. Every cost (the default's too) must fit every
/// budget, or some request could never pass.
pub(super) fn endpoints(
    rl: &RawRateLimits,
    plans: &BTreeMap<String, RawPlan>,
    errs: &mut ConfigErrors,
) -> Option<Router> {
    let d = &rl.default;
    let budgets: Vec<(String, u64)> = budget_caps(
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
    let check_fits = |path: String, cost: i64, errs: &mut ConfigErrors| {
        if cost <= 0 {
            return;
        }
        for (bname, max) in &budgets {
            if cost as u64 > *max {
                errs.push(
                    path.clone(),
                    format!("cost {cost} exceeds {bname}.max_cost {max}: such a request could never pass"),
                );
            }
        }
    };
    check_fits("rate_limits.default.cost".into(), d.cost, errs);

    let mut specs = Vec::new();
    for (pattern, e) in &rl.endpoints {
        let chars = pattern.chars().count();
        if chars > MAX_PATTERN_CHARS {
            errs.push(
                key_path("rate_limits.endpoints", &shown(pattern)),
                format!(
                    "an endpoint pattern is at most {MAX_PATTERN_CHARS} characters, got {chars}"
                ),
            );
            continue;
        }
        let base = key_path("rate_limits.endpoints", pattern);
        let cost = e.cost.unwrap_or(d.cost);
        if cost <= 0 {
            errs.push(
                format!("{base}.cost"),
                format!("must be a positive integer, got {cost}"),
            );
        }
        check_fits(format!("{base}.cost"), cost, errs);
        let max_in_flight = concurrency_cap(format!("{base}.max_in_flight"), e.max_in_flight, errs);
        if e.queue_timeout.is_some() && max_in_flight.is_none() {
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
        let queue = queue_rules(&base, e, max_in_flight, errs);
        let jobs = super::jobs::async_rules(&base, e, max_in_flight, errs);
        if let Some(prefix) = &e.strip_prefix {
            let path = crate::route::split_pattern(pattern).1;
            if !prefix.starts_with('/')
                || prefix.ends_with('/')
                || !path.starts_with(prefix.as_str())
            {
                errs.push(
                    format!("{base}.strip_prefix"),
                    format!("must be a leading part of the path, starting with / and not ending with one, got \"{}\"", shown(prefix)),
                );
            }
        }
        let shared = e
            .shared
            .as_ref()
            .and_then(|s| shared_budget(&format!("{base}.shared"), s, cost, errs));
        if let Err(m) = check_endpoint(pattern) {
            errs.push(base, m.to_string());
            continue;
        }
        let fidelity = Fidelity {
            shadow: e.mode.or(rl.mode).unwrap_or_default() == Mode::Shadow,
            cost_per_second: cost_per_second(&base, e.cost_per_second, errs),
            cost_from_response: cost_from_response(&base, e.cost_from_response.as_deref(), errs),
        };
        specs.push(RouteSpec {
            pattern: pattern.clone(),
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
        });
    }
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

pub(super) type Registry = (HashMap<[u8; 32], KeyEntry>, HashMap<String, [u8; 32]>);

/// `keys`: the registry, by sha256 and by id. Keys without a plan get (a copy of) the default
/// policy; the caller makes them share one.
pub(super) fn keys(
    raw: &[RawKey],
    default_policy: Option<&Policy>,
    plans: &HashMap<String, Arc<Policy>>,
    errs: &mut ConfigErrors,
) -> Registry {
    let mut keys = HashMap::new();
    let mut key_ids = HashMap::new();
    for (i, k) in raw.iter().enumerate() {
        let base = format!("keys[{i}]");
        let chars = k.id.chars().count();
        if chars > MAX_NAME_CHARS {
            errs.push(
                format!("{base}.id"),
                format!("a key id is at most {MAX_NAME_CHARS} characters, got {chars}"),
            );
        } else if k.id.is_empty()
            || !k
                .id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            errs.push(
                format!("{base}.id"),
                format!(
                    "must be non-empty and use only letters, digits, '-', '_' or '.', got \"{}\"",
                    k.id
                ),
            );
        }
        let hash = match hex::decode(k.sha256.trim()) {
            Ok(b) if b.len() == 32 => {
                let mut h = [0u8; 32];
                h.copy_from_slice(&b);
                Some(h)
            }
            _ => {
                errs.push(
                    format!("{base}.sha256"),
                    "must be the 64 hex digits of the key's sha256 (raw keys never go in the config)",
                );
                None
            }
        };
        let policy = match &k.plan {
            None => default_policy.cloned().map(Arc::new),
            Some(p) => match plans.get(p) {
                Some(pol) => Some(pol.clone()),
                None => {
                    errs.push(
                        format!("{base}.plan"),
                        format!("unknown plan \"{}\"", shown(p)),
                    );
                    None
                }
            },
        };
        if let (Some(hash), Some(policy)) = (hash, policy) {
            if keys.contains_key(&hash) {
                errs.push(format!("{base}.sha256"), "duplicate key");
            }
            if key_ids.insert(k.id.clone(), hash).is_some() {
                errs.push(format!("{base}.id"), format!("duplicate id \"{}\"", k.id));
            }
            keys.insert(
                hash,
                KeyEntry {
                    id: Arc::from(k.id.as_str()),
                    policy,
                },
            );
        }
    }
    (keys, key_ids)
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

/// An optional in-flight cap: a positive integer up to a million.
/// Most a plan's `weight` may be.
const MAX_WEIGHT: i64 = 1000;
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
        if set && max_in_flight.is_none() {
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

fn concurrency_cap(path: String, value: Option<i64>, errs: &mut ConfigErrors) -> Option<u32> {
    match value {
        Some(n) if (1..=1_000_000).contains(&n) => Some(n as u32),
        Some(n) => {
            errs.push(
                path,
                format!("must be a positive integer (at most 1000000), got {n}"),
            );
            None
        }
        None => None,
    }
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

/// Every budget's path and `max_cost` (positive ones only), for the "cost fits" check.
fn budget_caps(
    base: String,
    max_cost: Option<i64>,
    budgets: Option<&[RawBudget]>,
) -> Vec<(String, u64)> {
    let mut out = vec![];
    if let Some(m) = max_cost.filter(|m| *m > 0) {
        out.push((base.clone(), m as u64));
    }
    for (i, b) in budgets.unwrap_or_default().iter().enumerate() {
        if b.max_cost > 0 {
            out.push((format!("{base}.budgets[{i}]"), b.max_cost as u64));
        }
    }
    out
}

/// A policy from either `max_cost` + `window` (one budget) or `budgets:` (several, all of
/// which must fit), never both.
fn build_policy(
    name: &str,
    base: &str,
    (max_cost, window, budgets): (Option<i64>, Option<Duration>, Option<&[RawBudget]>),
    max_delay: Duration,
    max_in_flight_per_key: Option<u32>,
    errs: &mut ConfigErrors,
) -> Option<Policy> {
    let mut ok = true;
    let mut each = vec![];
    match (budgets, max_cost, window) {
        (Some(list), None, None) => {
            if list.is_empty() || list.len() > MAX_PLAN_BUDGETS {
                errs.push(
                    format!("{base}.budgets"),
                    format!("lists 1 to {MAX_PLAN_BUDGETS} budgets, got {}", list.len()),
                );
                ok = false;
            }
            let mut seen = HashSet::new();
            for (i, b) in list.iter().enumerate() {
                let path = format!("{base}.budgets[{i}]");
                // Budget names go into RateLimit headers and Redis keys.
                if b.name.is_empty()
                    || b.name.chars().count() > MAX_NAME_CHARS
                    || !b
                        .name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                {
                    errs.push(
                        format!("{path}.name"),
                        format!("a budget name uses 1 to {MAX_NAME_CHARS} letters, digits, '-', '_' or '.'"),
                    );
                    ok = false;
                } else if !seen.insert(b.name.as_str()) {
                    errs.push(
                        format!("{path}.name"),
                        format!("duplicate budget name \"{}\"", b.name),
                    );
                    ok = false;
                }
                each.push((Some(b.name.clone()), path, b.max_cost, b.window.0));
            }
        }
        (None, Some(m), Some(w)) => each.push((None, base.to_string(), m, w)),
        (Some(_), _, _) => {
            errs.push(
                format!("{base}.budgets"),
                "replaces max_cost and window: give either budgets or max_cost and window",
            );
            return None;
        }
        (None, m, w) => {
            if m.is_none() {
                errs.push(format!("{base}.max_cost"), "is required (or budgets)");
            }
            if w.is_none() {
                errs.push(format!("{base}.window"), "is required (or budgets)");
            }
            return None;
        }
    }
    let mut built = vec![];
    for (inner, path, max_cost, window) in each {
        if max_cost <= 0 {
            errs.push(
                format!("{path}.max_cost"),
                format!("must be a positive integer, got {max_cost}"),
            );
            ok = false;
            continue;
        }
        if window.is_zero() {
            errs.push(format!("{path}.window"), "must be greater than 0");
            ok = false;
            continue;
        }
        match Limit::new(max_cost as u64, window, max_delay) {
            Ok(limit) => built.push((inner, max_cost as u64, window, limit)),
            Err(m) => {
                errs.push(format!("{path}.max_cost"), m.to_string());
                ok = false;
            }
        }
    }
    if !ok {
        return None;
    }
    Policy::new(name, built, max_delay, max_in_flight_per_key)
}
