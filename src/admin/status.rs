//! `GET /admin/status`: what the status page shows besides the routes — this instance, its
//! store (health, breaker, fallback), the budgets and plans in force, and the registry keys
//! this instance refused most. Everything is read from memory; nothing asks the store.

use std::sync::OnceLock;
use std::time::Instant;

use prometheus::core::Collector;

use crate::policy::Policy;
use crate::state::Shared;
use crate::telemetry::metrics;

/// How many refused keys the status shows.
pub const TOP_REFUSED: usize = 10;

fn start() -> &'static Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now)
}

/// Notes the start of the process (the admin listener starts with it): `uptime_seconds`.
pub fn started() {
    let _ = start();
}

/// The status document.
pub fn status(shared: &Shared) -> serde_json::Value {
    let running = shared.running();
    let cfg = &running.config;
    let h = shared.store.health();
    let fallback = match (h.degraded, h.on_error) {
        (false, _) => "off",
        (true, Some(crate::config::OnError::Local)) => "local",
        (true, Some(crate::config::OnError::Allow)) => "allow",
        (true, Some(crate::config::OnError::Deny)) => "deny",
        (true, None) => "on",
    };
    let mut plans: Vec<serde_json::Value> = cfg
        .plans
        .values()
        .map(|p| policy_json(p, keys_on(cfg, &p.name)))
        .collect();
    plans.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "config_hash": &cfg.hash,
        "uptime_seconds": start().elapsed().as_secs(),
        "draining": shared.drain.is_draining(),
        "store": {
            "backend": h.backend,
            "ready": h.ready,
            "degraded": h.degraded,
            "breaker": h.breaker_open.map(|open| if open { "open" } else { "closed" }),
            "on_error": h.on_error,
            "fleet_size": h.fleet_size,
            "fallback": fallback,
        },
        "default": policy_json(&cfg.default_policy, keys_on(cfg, &cfg.default_policy.name)),
        "plans": plans,
        "registry_keys": cfg.keys.len(),
        "top_refused_keys": top_refused(TOP_REFUSED),
        "jobs": cfg
            .router
            .routes()
            .filter_map(|r| super::routes::jobs_on(shared, r))
            .collect::<Vec<_>>(),
    })
}

/// Registry keys on the plan named `plan` (`default`: keys without a plan).
fn keys_on(cfg: &crate::config::Config, plan: &str) -> usize {
    cfg.keys.values().filter(|k| k.policy.name == plan).count()
}

fn policy_json(p: &Policy, keys: usize) -> serde_json::Value {
    let budgets: Vec<serde_json::Value> = p
        .budgets
        .iter()
        .map(|b| {
            serde_json::json!({
                "name": b.name,
                "max_cost": b.max_cost,
                "window_seconds": b.window.as_secs_f64(),
            })
        })
        .collect();
    serde_json::json!({
        "name": p.name,
        "budgets": budgets,
        "max_delay_seconds": p.max_delay.as_secs_f64(),
        "max_in_flight_per_key": p.max_in_flight_per_key,
        "weight": p.weight,
        "keys": keys,
    })
}

/// The registry keys with the most refusals on this instance since it started
/// (`tollgate_rejections_by_key_total`), most first, then by id.
fn top_refused(n: usize) -> Vec<serde_json::Value> {
    let mut keys: Vec<(String, u64)> = metrics()
        .rejections_by_key
        .collect()
        .iter()
        .flat_map(|family| family.get_metric())
        .filter_map(|m| {
            let key = m.get_label().iter().find(|l| l.name() == "key")?;
            let refused = m.get_counter().get_value() as u64;
            (refused > 0).then(|| (key.value().to_string(), refused))
        })
        .collect();
    keys.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    keys.truncate(n);
    keys.into_iter()
        .map(|(key, refused)| serde_json::json!({"key": key, "refused": refused}))
        .collect()
}
