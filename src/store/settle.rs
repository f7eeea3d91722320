//! Settling an admitted request's charge after the fact (DESIGN §6): `cost_per_second` bills
//! measured upstream time, `cost_from_response` the cost the upstream states. Either way the
//! request was admitted at its route's `cost` and its final charge is another number; the
//! difference is charged where the admission was (debt allowed) or refunded there, through
//! the same calls the fallback's write-back and the refunds of unanswered requests use.
//!
//! Only the key's own budgets are settled. A route's `shared` budget is a provider's cap on
//! *calls*: what one call cost the backend does not change how many calls were made.

use super::{AdmitRequest, Bucket, Charge, Store};

impl AdmitRequest {
    /// `units` of this request, against the key's own budgets only (a route's shared budget
    /// left out): what a settling charges or gives back.
    pub(crate) fn settling(&self, units: u64) -> AdmitRequest {
        AdmitRequest {
            also: self
                .also
                .iter()
                .filter(|e| matches!(e.bucket, Bucket::Key(_)))
                .cloned()
                .collect(),
            cost: units,
            ..self.clone()
        }
    }
}

impl Store {
    /// Makes `total` the final charge of a request admitted (under `charge`) at `req.cost`:
    /// the extra is charged even into debt, a smaller total is refunded down to it. One
    /// store call at most; none when the totals agree.
    pub async fn settle(&self, req: &AdmitRequest, charge: Charge, total: u64) {
        if total > req.cost {
            let extra = total - req.cost;
            self.charge_extra(&req.settling(extra), charge, extra).await;
        } else if total < req.cost {
            self.refund(&req.settling(req.cost - total), charge).await;
        }
    }

    /// Charges `units` more to an admitted request, after the fact and even into debt, where
    /// its admission was charged: one store call.
    async fn charge_extra(&self, req: &AdmitRequest, charge: Charge, units: u64) {
        if units == 0 {
            return;
        }
        match (self, charge) {
            (Store::Memory(m), Charge::Local(limit)) => m.debit(&req.charged_under(limit), units),
            (Store::Memory(_), _) => {}
            (Store::Redis(r), charge) => Box::pin(r.charge_extra(req, charge, units)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::budget::Limit;
    use crate::store::Extra;

    #[test]
    fn settling_leaves_the_shared_budget_out() {
        let limit = Limit::new(10, Duration::from_secs(10), Duration::ZERO).unwrap();
        let day = Extra {
            bucket: Bucket::Key(Arc::from("day")),
            limit,
        };
        let shared = Extra {
            bucket: Bucket::Route(Arc::from("/p")),
            limit,
        };
        let req = AdmitRequest {
            key: [1; 32],
            limit,
            also: vec![day.clone(), shared],
            cost: 3,
            key_cap: None,
            route: Arc::from("/p"),
            route_cap: None,
            queue_timeout: Duration::ZERO,
            fair: Default::default(),
        };
        let s = req.settling(5);
        assert_eq!((s.cost, s.also), (5, vec![day]));
    }

    fn size_of_future<F: std::future::Future>(_: &F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Like every store future on the request path (see `store::tests`), behind a pointer.
    #[test]
    fn settle_futures_stay_small() {
        let store = Store::Memory(crate::store::MemoryStore::new(
            crate::store::memory::Clock::new(0),
        ));
        let limit = Limit::new(10, Duration::from_secs(1), Duration::ZERO).unwrap();
        let req = AdmitRequest {
            key: [0; 32],
            limit,
            also: vec![],
            cost: 1,
            key_cap: None,
            route: Arc::from("/"),
            route_cap: None,
            queue_timeout: Duration::ZERO,
            fair: Default::default(),
        };
        assert!(size_of_future(&store.settle(&req, Charge::None, 2)) <= 512);
    }
}
