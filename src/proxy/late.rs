//! The settling of a request the gateway stopped waiting for while the upstream still worked
//! on it — a 504 at `read_timeout`, or an HTTP/2 stream reset before the answer's head: its
//! slot follows the upstream's late answer (`front::drain_upstream`), and so does its charge
//! (DESIGN §3: it keeps "its slot (and its charge) until the upstream has answered"; §6: the
//! final charge is what the answer states, or the time it took — "a query that ran 30 s pays
//! for 30 s"), as for an HTTP/1 client that left, whose leaving the gateway does not see until
//! the answer, and as for a job.

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
    /// The upstream's time when the gateway stopped waiting: what is billed when the late
    /// answer tells nothing (no head seen before `abandon_timeout`).
    stopped: std::time::Duration,
}

impl LateSettle {
    /// Takes the settling out of `ctx` (whose `logging` then settles nothing, and counts
    /// neither its units, its stated cost nor its upstream time) when its route's charge
    /// depends on the answer.
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
            stopped: sent.elapsed(),
        };
        // The admission's charge stands in the store until then; the access line, written
        // now, shows the charge as it would stand without the late answer (its time so far).
        ctx.settled = Some(late.at_stop());
        ctx.settles_late = true;
        Some(late)
    }

    /// The final charge as when the gateway stopped waiting.
    fn at_stop(&self) -> u64 {
        (self.route.fidelity).final_cost(self.req.cost, Some(self.stopped))
    }

    /// The header the route's upstream states its cost in.
    pub(super) fn stated_name(&self) -> Option<&http::HeaderName> {
        self.route.fidelity.cost_from_response.as_ref()
    }

    /// Settles on what the late answer said, as for a client that stayed: its stated cost,
    /// else its time to the head. A late answer that never came (the upstream closed without
    /// one, or `abandon_timeout` came first) is billed its time until then: the upstream was
    /// at work that long, as far as anyone can tell, and held its slot (DESIGN §6: "a query
    /// that ran 30 s pays for 30 s"). One Pingora had read part of settles as when the
    /// gateway stopped waiting. Counts them, and the upstream time billed (the audit's).
    pub(super) async fn finish(self, learned: crate::front::Learned) {
        let head = learned
            .head_at
            .map(|at| at.saturating_duration_since(self.sent));
        let (total, report, upstream) = match head {
            Some(t) => {
                let report = self.stated_name().map(|name| {
                    let mut h = http::HeaderMap::new();
                    for v in learned.stated {
                        h.append(name.clone(), v);
                    }
                    Report::read(&h, name, self.route.cost)
                });
                let total = self.route.fidelity.charge(self.req.cost, Some(t), report);
                (total, report, t)
            }
            None => match learned.ended_headless_at {
                Some(at) => {
                    let ran = at.saturating_duration_since(self.sent).max(self.stopped);
                    let total = (self.route.fidelity).final_cost(self.req.cost, Some(ran));
                    (total, None, ran)
                }
                None => (self.at_stop(), None, self.stopped),
            },
        };
        self.store.settle(&self.req, self.charge, total).await;
        let rm = self.running.metrics.get(&self.route);
        if total > 0 {
            rm.cost_units.inc_by(total);
        }
        if let Some(r) = report {
            rm.cost_report(r);
        }
        rm.upstream_duration.observe(upstream.as_secs_f64());
    }
}
