//! What a finished request leaves in the metrics: one call from `logging`, after the slots
//! were released and the charge settled.

use std::time::Duration;

use super::ctx::{Ctx, Phase};
use crate::telemetry::{metrics, RouteMetrics};

/// The request's metrics, once it is finished (and settled).
pub(super) fn finished(rm: &RouteMetrics, ctx: &Ctx, status: u16, elapsed: Duration, charged: u64) {
    rm.request(status);
    rm.request_duration.observe(elapsed.as_secs_f64());
    if ctx.was_forwarded() {
        // The latency SLO: refusals are fast and would flatter the requests that were served.
        rm.admitted_duration.observe(elapsed.as_secs_f64());
        rm.overhead.observe(ctx.overhead().as_secs_f64());
    }
    if let Some(u) = ctx.timing.upstream {
        rm.upstream_duration.observe(u.as_secs_f64());
    }
    // A job's units are counted when it ends (the charge may be refunded or settled).
    if charged > 0 && !matches!(ctx.phase, Phase::Job { .. }) {
        rm.cost_units.inc_by(charged);
    }
    // Counted once settled: what the report made of the charge is in the store by now.
    if let Some(report) = ctx.report {
        rm.cost_report(report);
    }
    if let Phase::Refused {
        reason: Some(reason),
        ..
    } = ctx.phase
    {
        rm.rejection(reason);
        rm.count_recent(false, ctx.start + elapsed);
        if let Some(who) = &ctx.identity {
            if let Some(id) = who.id.as_deref() {
                metrics().rejections_by_key.with_label_values(&[id]).inc();
            }
            metrics()
                .rejections_by_plan
                .with_label_values(&[&who.policy.name])
                .inc();
        }
    }
}
