//! The budget sections: `rate_limits` (default and endpoints), `plans` and the key registry.
//! Every cost must fit every budget, so these sections are checked against each other.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::budget::{Limit, MAX_PLAN_BUDGETS};
use crate::config::bounds::{shown, MAX_NAME_CHARS};
use crate::config::error::{key_path, ConfigErrors};
use crate::config::raw::{RawBudget, RawDefault, RawKey, RawPlan};
use crate::config::KeyEntry;
use crate::policy::Policy;

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
        // Plan names go into RateLimit headers as structured-field strings, beside a route's
        // shared budget (named `shared` there).
        if name == "default"
            || name == crate::policy::SHARED_BUDGET
            || name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            errs.push(
                base.clone(),
                "a plan name uses only letters, digits, '-', '_' or '.', and is not \"default\" (that is rate_limits.default) nor \"shared\" (a route's shared budget has that name in the RateLimit headers)",
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

pub(super) type Registry = (HashMap<[u8; 32], KeyEntry>, HashMap<String, [u8; 32]>);

/// `keys`: the registry, by sha256 and by id. Keys without a plan get (a copy of) the default
/// policy; the caller makes them share one. `declared`: the file's plans, the valid ones of
/// which are `plans` (a key on a plan that is there but wrong is not said to name an unknown
/// one: the plan's own errors are reported).
pub(super) fn keys(
    raw: &[RawKey],
    default_policy: Option<&Policy>,
    (plans, declared): (&HashMap<String, Arc<Policy>>, &BTreeMap<String, RawPlan>),
    errs: &mut ConfigErrors,
) -> Registry {
    let mut keys = HashMap::new();
    let mut key_ids = HashMap::new();
    // Every entry's hash and id, whether or not the entry is valid otherwise: a duplicate is
    // reported beside an unknown plan, not only once that is fixed.
    let (mut hashes, mut ids) = (HashSet::new(), HashSet::new());
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
                None if declared.contains_key(p) => None,
                None => {
                    errs.push(
                        format!("{base}.plan"),
                        format!("unknown plan \"{}\"", shown(p)),
                    );
                    None
                }
            },
        };
        if hash.is_some_and(|h| !hashes.insert(h)) {
            errs.push(format!("{base}.sha256"), "duplicate key");
        }
        if !ids.insert(k.id.as_str()) {
            errs.push(format!("{base}.id"), format!("duplicate id \"{}\"", k.id));
        }
        if let (Some(hash), Some(policy)) = (hash, policy) {
            key_ids.insert(k.id.clone(), hash);
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

/// Most a plan's `weight` may be.
const MAX_WEIGHT: i64 = 1000;
/// An optional in-flight cap: a positive integer up to a million.
pub(super) fn concurrency_cap(
    path: String,
    value: Option<i64>,
    errs: &mut ConfigErrors,
) -> Option<u32> {
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

/// Every budget's path and `max_cost` (positive ones only), for the "cost fits" check.
pub(super) fn budget_caps(
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
    let (each, named_ok) = match (budgets, max_cost, window) {
        (Some(list), None, None) => named_budgets(base, list, errs),
        (None, Some(m), Some(w)) => (vec![(None, base.to_string(), m, w)], true),
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
    };
    let (built, limits_ok) = limits(each, max_delay, errs);
    if !(named_ok && limits_ok) {
        return None;
    }
    Policy::new(name, built, max_delay, max_in_flight_per_key)
}

/// A budget as written: its name (of `budgets:`), path, `max_cost` and `window`.
type Written = (Option<String>, String, i64, Duration);
/// A budget checked: its name, `max_cost`, `window` and limit.
type Checked = (Option<String>, u64, Duration, Limit);

/// `budgets:`: 1 to [`MAX_PLAN_BUDGETS`] of them, each named uniquely; `false` when some
/// is not.
fn named_budgets(base: &str, list: &[RawBudget], errs: &mut ConfigErrors) -> (Vec<Written>, bool) {
    let mut ok = true;
    let mut each = vec![];
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
                format!(
                    "a budget name uses 1 to {MAX_NAME_CHARS} letters, digits, '-', '_' or '.'"
                ),
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
    (each, ok)
}

/// Each budget's limit: a positive `max_cost` over a non-zero `window`; `false` when some
/// budget has none.
fn limits(
    each: Vec<Written>,
    max_delay: Duration,
    errs: &mut ConfigErrors,
) -> (Vec<Checked>, bool) {
    let mut ok = true;
    let mut built = vec![];
    for (inner, path, max_cost, window) in each {
        // Both checked, so that a budget wrong in both ways says so at once.
        let mut fits = true;
        if max_cost <= 0 {
            errs.push(
                format!("{path}.max_cost"),
                format!("must be a positive integer, got {max_cost}"),
            );
            fits = false;
        }
        if window.is_zero() {
            errs.push(format!("{path}.window"), "must be greater than 0");
            fits = false;
        }
        if !fits {
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
    (built, ok)
}
