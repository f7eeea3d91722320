//! A waiting request's admission record (DESIGN §4, after Redis lost its data): a capped
//! route's charge is recorded for as long as its request may wait and `ADMISSION_RECORD`
//! more, in the call that charges it (`admit_call`: charge and record are lost together or
//! not at all), so that its refund gives back only a charge Redis still holds (`admit::Once`)
//! and a charge Redis lost is made again, once (`Recharge`).

use super::super::keys;
use super::super::script;
use super::super::slices::Seen;
use super::super::RedisBackend;
use crate::store::{AdmitRequest, StoreError};

/// Until when (Redis time, µs) the admission record of `req`, charged by the call that
/// answered `seen`, surely lives; 0 (not known: refunds are made as with the marker alone)
/// if that answer had no time.
pub(super) fn kept_until(req: &AdmitRequest, seen: &Seen) -> u64 {
    match seen.now_us {
        0 => 0,
        at => script::record_lives_until(at, script::record_kept_for(req.may_wait())),
    }
}

impl RedisBackend {
    /// The charge of waiter `id` of `req` again, if Redis lost it with its data (`Recharge`),
    /// while its record is kept (until `kept_us`, Redis time).
    pub(super) async fn recharge(
        &self,
        req: &AdmitRequest,
        id: &str,
        kept_us: u64,
    ) -> Result<(), StoreError> {
        let budgets = super::super::budget_keys(req);
        let (record, marker) = (
            keys::admission_key(&req.key, id),
            keys::refund_marker(&req.key, id),
        );
        let recharge = script::Recharge {
            budgets: &budgets,
            cost: req.cost,
            record: &record,
            marker: &marker,
            record_ms: script::record_kept_for(req.may_wait()).as_millis() as u64,
            until_us: kept_us,
        };
        self.op(&recharge).await.map(drop)
    }
}
