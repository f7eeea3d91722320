//! The settling of a request whose client left while the upstream still worked on it (an
//! HTTP/2 stream reset before the answer's head): its slot follows the upstream's late answer
//! (`front::drain_upstream`), and so does its charge (DESIGN §3: it keeps "its slot (and its
//! charge) until the upstream has answered"; §6: the final charge is what the answer states,
//! or the time it took), as for an HTTP/1 client, whose leaving the gateway does not see
//! until the answer.

use std::sync::Arc;
use std::time::Instant;

use super::ctx::{Ctx, Phase};
use crate::route::stated::Report;
use crate::route::Route;
use crate::state::{Running, Shared};
use crate::store::{AdmitRequest, Charge, Store};

/// What settling the request needs once its late answer's head came.
pub(super) struct LateSettle {
    store: Store,
    req: AdmitRequest,
    charge: Charge,
    route: Arc<Route>,
    running: Arc<Running>,
    /// When the request went to the upstream: its time runs from there.
    sent: Instant,
}

impl LateSettle {
    /// Takes the settling out of `ctx` (whose `logging` then settles nothing, and counts
    /// neither its units nor its stated cost) when its route's charge depends on the answer.
    pub(super) fn take(shared: &Arc<Shared>, ctx: &mut Ctx, sent: Instant) -> Option<LateSettle> {
        let (Phase::Admitted(ticket), Some(route), Some(running), None) =
            (&ctx.phase, &ctx.route, &ctx.running, ctx.settled)
        else {
            return None;
        };
        let f = &route.fidelity;
        if f.cost_from_response.is_none() && f.cost_per_second.is_none() {
            return None;
        }
        let late = LateSettle {
            store: shared.store.clone(),
            req: ticket.req.clone(),
            charge: ticket.charge(),
            route: route.clone(),
            running: running.clone(),
            sent,
        };
        // The admission's charge stands until then (the access line shows it).
        ctx.settled = Some(ticket.req.cost);
        ctx.settles_late = true;
        Some(late)
    }

    /// The header the route's upstream states its cost in.
    pub(super) fn stated_name(&self) -> Option<&http::HeaderName> {
        self.route.fidelity.cost_from_response.as_ref()
    }

    /// Settles on what the late answer said: its stated cost, else its time to the head (to
    /// the end of following it, if no head came), and counts them.
    pub(super) async fn finish(self, learned: crate::front::Learned) {
        let upstream = learned
            .head_at
            .unwrap_or_else(Instant::now)
            .saturating_duration_since(self.sent);
        let report = self.stated_name().map(|name| {
            let mut h = http::HeaderMap::new();
            if let Some(v) = learned.stated {
                h.insert(name.clone(), v);
            }
            Report::read(&h, name, self.route.cost)
        });
        let total = match report {
            Some(Report::Applied(units)) => units,
            _ => self
                .route
                .fidelity
                .final_cost(self.req.cost, Some(upstream)),
        };
        self.store.settle(&self.req, self.charge, total).await;
        let rm = self.running.metrics.get(&self.route);
        if total > 0 {
            rm.cost_units.inc_by(total);
        }
        if let Some(r) = report {
            rm.cost_report(r);
        }
        if learned.head_at.is_some() {
            rm.upstream_duration.observe(upstream.as_secs_f64());
        }
    }
}
