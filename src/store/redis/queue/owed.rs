//! A waiting request's charge, kept beside its waiter in the route's queue (`c:<id>` in
//! `lua/queue.lua`): should its instance die (SIGKILL, a crash, a stall past its alive time),
//! its dropped waiters' charges are owed, and once due (5 s later: time for an instance that
//! only stalled, or that a failover made look dead, to come back for them) a beat hands them
//! to an instance that gives them back (DESIGN §8: a waiter that leaves unserved is refunded)
//! and then says so (`paid`; until then they are handed out again every 30 s). Each refund
//! is made once by the waiter's marker (`keys::refund_marker`), whoever sends it and however
//! often: the instance handed it, or the waiter's own should it come back after all (refused
//! on its way back into the queue, it leaves unserved and refunds by the same marker). Like
//! the waiter's own refund, it carries the charge's admission record and how long that surely
//! lives: before then, a charge Redis lost with the key's data (on Cluster, the key's node
//! restarted empty while the route's kept its queue) is not given back (`refund.lua`).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::super::admit::Once;
use super::super::keys::QueueKeys;
use super::super::RedisBackend;
use crate::budget::Limit;
use crate::store::AdmitRequest;

/// What gives a charge back, as the queue keeps it (JSON, no line breaks: the queue's list of
/// owed charges is one per line).
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(super) struct Charge {
    /// The refund's marker, in the key's slot.
    m: String,
    /// The units charged to each budget.
    c: u64,
    /// Each budget: its Redis key and its limit (per_unit, rate, capacity, max_delay).
    b: Vec<(String, u64, u64, u64, u64)>,
    /// The charge's admission record and until when (Redis time, µs) it surely lives
    /// (`record::kept_until`): the refund then gives back only a charge Redis still holds, as
    /// the waiter's own would (`Once`). Absent if not known (and from older instances).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    r: Option<(String, u64)>,
}

impl Charge {
    /// Waiter `id`'s charge for `req`, its record living until `kept_us` (0: not known), as
    /// `enter` stores it.
    pub(super) fn of(req: &AdmitRequest, id: &str, kept_us: u64) -> String {
        let Once { marker, record } = Once::kept(req, id, kept_us);
        let charge = Charge {
            m: marker,
            r: record,
            c: req.cost,
            b: super::super::budget_keys(req)
                .into_iter()
                .map(|(k, l)| (k, l.per_unit, l.rate, l.capacity, l.max_delay))
                .collect(),
        };
        serde_json::to_string(&charge).unwrap_or_default()
    }

    fn parse(s: &str) -> Option<Charge> {
        serde_json::from_str(s).ok()
    }

    fn budgets(&self) -> Vec<(String, Limit)> {
        self.b
            .iter()
            .map(|(k, per_unit, rate, capacity, max_delay)| {
                let limit = Limit {
                    per_unit: *per_unit,
                    rate: *rate,
                    capacity: *capacity,
                    max_delay: *max_delay,
                };
                (k.clone(), limit)
            })
            .collect()
    }
}

/// How long a dropped waiter's id is refused by the queue: for as long as its instance could
/// still send it back in (its `queue_timeout`), and the resend horizon of a call after that.
pub(super) fn refused_for(req: &AdmitRequest) -> Duration {
    req.queue_timeout + super::GIVEN_UP_FOR
}

impl RedisBackend {
    /// Gives back the charges a beat handed out on route `keys` (waiter id, charge: its dead
    /// instances' waiters'), one after another on a task of their own, then tells the queue
    /// they are paid. A refund that fails is sent again until it is made (once, by its
    /// marker); one not said paid is handed out again.
    pub(super) fn refund_owed(self: &Arc<Self>, keys: &QueueKeys, owed: Vec<(String, String)>) {
        if owed.is_empty() {
            return;
        }
        tracing::info!(
            waiters = owed.len(),
            "giving back the charges of waiters dropped with a dead instance"
        );
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, keys) = (self.clone(), keys.clone());
        rt.spawn(async move {
            let mut paid = store.queue_script.call(&keys, "paid");
            for (id, charge) in owed {
                match Charge::parse(&charge) {
                    Some(charge) => {
                        let budgets = charge.budgets();
                        let once = Once {
                            marker: charge.m,
                            record: charge.r,
                        };
                        store.undo_charge(budgets, charge.c, Some(once)).await;
                    }
                    None => tracing::warn!(
                        "a dead instance's waiter's charge could not be read; not refunded"
                    ),
                }
                paid.arg(id);
            }
            if let Err(e) = store.call::<redis::Value>(paid).await {
                tracing::debug!(error = %e, "owed charges given back, not said paid: handed out again later (refunded once)");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_charge_reads_back_as_written_on_one_line() {
        let limit = Limit {
            per_unit: 7,
            rate: 3,
            capacity: 21_000,
            max_delay: 5,
        };
        let charge = Charge {
            m: "t{ab}a1:r".into(),
            c: 20,
            b: vec![
                ("t{ab}b".into(), 7, 3, 21_000, 5),
                ("t:s{x y\n}".into(), 1, 1, 1, 0),
            ],
            r: Some(("t{ab}a1".into(), 1_700_000_000_000_000)),
        };
        let text = serde_json::to_string(&charge).unwrap();
        assert!(!text.contains('\n'), "{text}");
        let read = Charge::parse(&text).unwrap();
        assert_eq!(read, charge);
        assert_eq!(read.budgets()[0], ("t{ab}b".to_string(), limit));
        assert!(Charge::parse("not json").is_none());
        // As an instance that knew no record wrote it: refunded by the marker alone.
        let old = r#"{"m":"t{ab}a1:r","c":20,"b":[["t{ab}b",7,3,21000,5]]}"#;
        assert_eq!(Charge::parse(old).unwrap().r, None);
    }
}
