//! `GET /admin/routes`: every route's cost and this instance's last minute (requests
//! admitted and refused), and each capped route's cap, slots running and waiters queued
//! (fleet-wide on Redis, this process's on the memory store) with the keys holding and
//! awaiting them by registry id (`key:<8 hex>` outside the registry).
//!
//! An async route (DESIGN §8) also gives its jobs in this process (`jobs: {queued, running}`),
//! and `jobs` at the top lists those routes.

use hyper::StatusCode;

use super::{json, Resp};
use crate::state::Shared;
use crate::telemetry::recent;

/// The answer; 503 when the store cannot say who holds a capped route's slots.
pub async fn routes(shared: &Shared) -> Resp {
    let running = shared.running();
    let cfg = &running.config;
    let name = |k: &crate::store::fair::KeyRef| {
        cfg.keys
            .iter()
            .find(|(hash, _)| k.is(hash))
            .map_or_else(|| k.log_name(), |(_, e)| e.id.to_string())
    };
    let mut out = vec![];
    let mut jobs = vec![];
    for r in cfg.router.routes() {
        let last = running.metrics.get(r).recent();
        let mut v = serde_json::json!({
            "route": &*r.label,
            "cost": r.cost,
            "last_minute": {"admitted": last.admitted, "refused": last.refused},
        });
        if let Some(cap) = r.max_in_flight {
            let q = match shared.store.route_queue(&r.label).await {
                Ok(q) => q,
                Err(e) => {
                    return json(
                        StatusCode::SERVICE_UNAVAILABLE,
                        serde_json::json!({"error": format!("store unavailable: {e}")}),
                    )
                }
            };
            let mut keys: Vec<serde_json::Value> = q
                .keys
                .iter()
                .map(|k| serde_json::json!({"key": name(&k.key), "running": k.running, "waiting": k.waiting}))
                .collect();
            keys.sort_by(|a, b| a["key"].as_str().cmp(&b["key"].as_str()));
            v["cap"] = cap.into();
            v["running"] = q.running.into();
            v["queued"] = q.queued.into();
            v["max_queue"] = r.queue.max_queue.into();
            v["max_in_flight_per_key"] = r.queue.per_key.into();
            v["queue_timeout_seconds"] = r.queue_timeout.as_secs_f64().into();
            v["keys"] = keys.into();
        }
        // This process's board; on Redis the fleet's queued jobs (as this instance last saw
        // them) and the jobs this instance runs.
        if let Some(j) = jobs_on(shared, r) {
            v["jobs"] = serde_json::json!({"queued": j["queued"], "running": j["running"]});
            jobs.push(j);
        }
        out.push(v);
    }
    json(
        StatusCode::OK,
        serde_json::json!({
            "routes": out,
            "last_minute_seconds": recent::SECONDS,
            "jobs": jobs,
        }),
    )
}

/// An async route's jobs, `{route, queued, running}`: this process's board; on Redis the
/// fleet's queued jobs (as this instance last saw them) and the jobs this instance runs.
/// `None` for a route without `async`.
pub(super) fn jobs_on(shared: &Shared, r: &crate::route::Route) -> Option<serde_json::Value> {
    r.jobs.as_ref()?;
    let (queued, running) = match shared.store {
        crate::store::Store::Memory(_) => crate::jobs::board().counts(&r.label),
        crate::store::Store::Redis(_) => crate::jobs::gauge_counts(&r.label),
    };
    Some(serde_json::json!({"route": &*r.label, "queued": queued, "running": running}))
}
