//! The life of one admission, after the store said yes: charged → (held by `max_delay`) →
//! with the upstream → released, refunded, or settled on its final cost.
//!
//! A [`Ticket`] owns what an admission holds: its charge (where it was made: the shared store,
//! this instance's memory, a budget slice), its slot leases and its place in
//! `tollgate_in_flight{route}`. Every slot release and every refund of an admitted request
//! goes through one — the request path (`proxy::ctx`) and the memory store's jobs alike — and
//! dropping one is the backstop of every exit path: its gauge counts out and its leases
//! release themselves (a Redis lease from its drop guard, in the background).
//!
//! The charge is decided elsewhere: the price in `decision::admit_request` (the route's
//! `cost`), whether it fits in the store (`store::Store::decide`).

use prometheus::IntGauge;

use crate::store::{AdmitRequest, Charge, Lease, Standing, Store};

/// Counts a request in `tollgate_in_flight{route}` for as long as it lives.
pub struct InFlight(IntGauge);

impl InFlight {
    pub fn new(gauge: &IntGauge) -> InFlight {
        gauge.inc();
        InFlight(gauge.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// An admitted request's charge and what it holds.
pub struct Ticket {
    /// What it was charged under.
    pub req: AdmitRequest,
    /// The budget's standing after its charge (the rate-limit headers).
    pub outcome: Standing,
    lease: Lease,
    /// Where it was charged (kept after its slots are released), so that a refund or a
    /// settlement goes to the same place.
    charge: Charge,
    /// `None` until it counts as in flight, and once its slots went with an [`UpstreamSlot`].
    in_flight: Option<InFlight>,
    /// Its charge went back: never twice.
    refunded: bool,
}

impl Ticket {
    pub fn new(req: AdmitRequest, outcome: Standing, lease: Lease) -> Ticket {
        Ticket {
            req,
            outcome,
            charge: lease.charge(),
            lease,
            in_flight: None,
            refunded: false,
        }
    }

    /// From now on it counts in `gauge` (`tollgate_in_flight{route}`) until it is done.
    pub fn in_flight(mut self, gauge: &IntGauge) -> Ticket {
        self.in_flight = Some(InFlight::new(gauge));
        self
    }

    pub fn charge(&self) -> Charge {
        self.charge
    }

    /// The upstream never had it (or it never left the gateway): the charge goes back (once),
    /// then its slots. The standing with the charge given back, for the answer's headers: the
    /// budgets as the refund left them (what the key's other requests spent meanwhile
    /// included) when the store says, else the admission's figures with the charge given back.
    pub async fn refund(&mut self, store: &Store) -> Standing {
        let mut levels = None;
        if !std::mem::replace(&mut self.refunded, true) {
            levels = store.refund(&self.req, self.charge).await;
        }
        self.release().await;
        let cost = self.req.cost;
        match self.charge {
            // Nothing was charged: nothing comes back.
            Charge::None => self.outcome,
            Charge::Shared | Charge::Slice(_) => {
                refunded_standing(&self.outcome, &self.req, levels, cost)
            }
            // The memory store's budgets, or one instance's share of each under `on_error:
            // local`.
            Charge::Local(l) => {
                let under = self.req.charged_under(l);
                refunded_standing(&self.outcome, &under, levels, cost)
            }
        }
    }

    /// Frees its slots now; it stays charged (dropping the ticket would too, without
    /// waiting).
    pub async fn release(&mut self) {
        std::mem::take(&mut self.lease).release().await;
    }

    /// Makes its charge `total` units where it was charged (into debt, or refunding the
    /// difference): `cost_from_response`, `cost_per_second`.
    pub async fn settle(&self, store: &Store, total: u64) {
        store.settle(&self.req, self.charge, total).await;
    }

    /// Its slots, to be released once the upstream is done with the request whose client
    /// left (`front::drain_upstream`); the ticket stays charged.
    pub fn detach_for_upstream(&mut self) -> UpstreamSlot {
        UpstreamSlot {
            lease: std::mem::take(&mut self.lease),
            _in_flight: self.in_flight.take(),
        }
    }

    /// A memory-store job's route slot, granted after it was charged.
    pub fn attach_route(&mut self, slot: crate::store::fair::RouteSlot) {
        self.lease.attach_route(slot);
    }
}

/// The standing of the budgets `charged` was charged under once a charge of `cost` went back:
/// at `levels` (ticks, as the refund left them) when known, else `admitted` (the admission's
/// figures) with the cost given back.
pub fn refunded_standing(
    admitted: &Standing,
    charged: &AdmitRequest,
    levels: Option<Vec<i64>>,
    cost: u64,
) -> Standing {
    levels
        .and_then(|levels| Standing::of_levels(charged.limits(), &levels))
        .unwrap_or_else(|| admitted.given_back(charged.limits(), cost))
}

/// The slots of an admitted request whose client went away, held until the upstream is done.
pub struct UpstreamSlot {
    lease: Lease,
    _in_flight: Option<InFlight>,
}

impl UpstreamSlot {
    pub async fn release(self) {
        self.lease.release().await;
    }
}
