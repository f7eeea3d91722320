//! A waiting request's admission record (DESIGN §4, after Redis lost its data): kept while the
//! request may wait (`keep.lua`), so that its refund gives back only a charge Redis still holds
//! (`admit::Once`) and a charge Redis lost is made again, once (`Recharge`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::super::keys;
use super::super::script;
use super::super::RedisBackend;
use super::Unserved;
use crate::store::{AdmitRequest, StoreError};

impl RedisBackend {
    /// Keeps a waiting request's admission record for as long as it may wait and
    /// `ADMISSION_RECORD` more (on a task of its own: the wait goes on meanwhile; sent again
    /// twice, 200 ms apart, if it fails), so that its refund and its charge made again can
    /// tell whether Redis lost the charge (`Once`, `recharge`). Not known to be kept until
    /// this answers, or if it fails: refunds are then made as with the marker alone.
    pub(super) fn keep_record(self: &Arc<Self>, req: &AdmitRequest, u: &Unserved) {
        if u.record_kept.load(Ordering::Acquire) != 0 {
            return;
        }
        let (store, kept) = (self.clone(), u.record_kept.clone());
        let record = keys::admission_key(&req.key, &u.id);
        let kept_for = script::record_kept_for(req.queue_timeout);
        tokio::spawn(async move {
            let keep = script::KeepRecord {
                record: &record,
                ms: kept_for.as_millis() as u64,
            };
            for attempt in 0..3 {
                if attempt > 0 {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                // 0: the record was not there (nothing is known of it).
                let Ok(at) = store.op(&keep).await else {
                    continue;
                };
                if let Ok(at @ 1..) = u64::try_from(at) {
                    let until = script::record_lives_until(at, kept_for);
                    let _ = kept.compare_exchange(0, until, Ordering::AcqRel, Ordering::Acquire);
                }
                return;
            }
        });
    }

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
            record_ms: script::record_kept_for(req.queue_timeout).as_millis() as u64,
            until_us: kept_us,
        };
        self.op(&recharge).await.map(drop)
    }
}
