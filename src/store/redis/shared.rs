//! [`RedisBackend`] as the fallback's [`SharedStore`]: the questions `store::fallback` asks
//! of the shared store (admit, refund, peek, write-back, probe, release all).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::guard::Guard;
use super::lease::Sets;
use super::script::{Debit, Peek, Refund, Unspend};
use super::slices::{self, Ask};
use super::{budget_keys, keys, RedisBackend, RedisLease};
use crate::budget::Limit;
use crate::identity::KeyHash;
use crate::store::fallback::{Refunded, SharedAnswer, SharedStore};
use crate::store::{Admission, AdmitRequest, Bucket, BudgetView, Extra, StoreError};

/// The key the breaker's probe names (never written): on Cluster, it routes the probe to a
/// primary (that slot's).
const PROBE_KEY: &str = "t:probe";

impl SharedStore for RedisBackend {
    fn set_holds(&self, holds: &crate::hold::Holds) {
        let _ = self.holds.set(holds.clone());
    }

    /// Decides one request; a capped one waits in its route's fair queue (`queue`) up to
    /// `queue_timeout`.
    async fn admit(self: &Arc<Self>, req: &AdmitRequest) -> Result<SharedAnswer, StoreError> {
        if req.route_cap.is_none() {
            // A capped route's request waits in `admit_capped`, within its queue time.
            self.after_data_loss(req).await;
        }
        if let Some(o) = self.deny.check(req) {
            return Ok(SharedAnswer {
                admission: Admission::over_budget(&o),
                reached: false,
            });
        }
        if self.slices_on {
            self.settle_pending(req).await?;
        }
        if let Some(answer) = self.admit_sliced(req).await {
            return answer;
        }
        match req.route_cap {
            // Boxed: the queued path's state would make every request's future larger.
            Some(cap) => Box::pin(self.admit_capped(req, cap)).await,
            None => {
                let start = Instant::now();
                let decided = self.try_admit(req, Ask::default()).await?.0;
                Ok(self.answer(req, decided, start))
            }
        }
    }

    /// A failed refund is not retried: it might have run. One spent from this instance's
    /// slice goes back into it while that is still the key's live hold here (no round trip);
    /// else to the hold in Redis if that is not settled yet, or to the budget.
    async fn refund(&self, req: &AdmitRequest, hold: u128) -> Result<Refunded, StoreError> {
        self.deny.forget(&req.key);
        if hold != 0 && self.slices.unspend(req, hold, Instant::now()) {
            return Ok(Refunded::Slice);
        }
        let budgets = budget_keys(req);
        if hold == 0 {
            let refund = Refund {
                budgets: &budgets,
                cost: req.cost,
                once: None,
                record: None,
            };
            let levels = self.op(&refund).await?;
            return Ok(Refunded::Store((!self.slices_on).then_some(levels)));
        }
        let (holds, id) = (keys::holds_key(&req.key), slices::hold_field(hold));
        let unspend = Unspend {
            holds: &holds,
            budgets: &budgets,
            id: &id,
            cost: req.cost,
        };
        self.op(&unspend).await.map(|_| Refunded::Store(None))
    }

    async fn peek(
        &self,
        key: &KeyHash,
        limit: &Limit,
        also: &[Extra],
    ) -> Result<Vec<BudgetView>, StoreError> {
        let (k, holds) = keys::budget_and_holds_keys(key);
        let named = also.iter().filter_map(|e| match &e.bucket {
            Bucket::Key(name) => Some((keys::named_budget_key(key, name), e.limit)),
            Bucket::Route(_) => None,
        });
        let budgets: Vec<(String, Limit)> = std::iter::once((k, *limit)).chain(named).collect();
        let peek = Peek {
            holds: &holds,
            budgets: &budgets,
        };
        let levels = self.op_repeatable(&peek).await?;
        if levels.len() != budgets.len() {
            return Err(StoreError::Reply(format!(
                "peek: {} levels for {} budgets",
                levels.len(),
                budgets.len()
            )));
        }
        // What this instance holds of the key's slice is not spent yet: shown as Redis will
        // have it back. A hold counts in every budget of the key, a route's shared one aside.
        // Read after the call: a slice granted or settled in between shows as up to one slice
        // more or less (the view is for people, not decisions).
        let held = self.slices.unspent(key, limit);
        Ok(budgets
            .iter()
            .zip(levels)
            .map(|((_, l), level)| {
                let level = (level.max(0) as u64).saturating_sub(held.saturating_mul(l.per_unit));
                BudgetView::at(l, level)
            })
            .collect())
    }

    async fn write_back(
        &self,
        key: &KeyHash,
        limit: &Limit,
        also: &[Extra],
        units: u64,
        id: u64,
        tell: bool,
    ) -> Result<(), StoreError> {
        self.deny.forget(key);
        // Before the charge: no unit of it is spent from the key's slice meanwhile (whose
        // settling the key's next call sends first).
        self.slices.retire(key);
        let budgets = budget_keys(&AdmitRequest {
            key: *key,
            limit: *limit,
            also: also.to_vec(),
            cost: units,
            key_cap: None,
            route: Arc::from(""),
            route_cap: None,
            queue_timeout: Duration::ZERO,
            fair: Default::default(),
        });
        // The id's marker is left to lapse, never deleted on the answer: another send of the
        // same id may still be on its way (a partition delivers late, in any order).
        let debit = Debit {
            budgets: &budgets,
            cost: units,
            id,
            tell,
        };
        self.op(&debit).await?;
        Ok(())
    }

    /// Whether Redis would run tollgate's scripts: a flagged script that may write (Redis 7
    /// refuses it when out of memory under `noeviction`, and on a replica, as it refuses the
    /// charging scripts). A `PING` would pass there, and end the degraded state while every
    /// request still fails.
    async fn probe(&self) -> Result<(), StoreError> {
        let res = self
            .guarded(Guard::Probe, |mut conn| async move {
                // With a key: on Cluster a script without one goes to any node, a replica
                // too, which refuses it (READONLY) although every primary would run it.
                let mut cmd = redis::cmd("EVAL");
                cmd.arg("#!lua\nreturn 1").arg(1).arg(PROBE_KEY);
                Ok(cmd.query_async::<i64>(&mut conn).await.map(drop)?)
            })
            .await;
        // A connection that failed is made again for the next probe (the probe thread keeps
        // its own one otherwise: it asks every second while the instance is idle).
        if res.is_err() {
            self.conns.forget();
        }
        res
    }

    fn quiet_for(&self) -> Duration {
        self.breaker.quiet_for()
    }

    async fn release_all(self: &Arc<Self>) {
        self.release_everything().await;
    }

    /// A lease of a new id in the key's and the route's lease sets (in the route's queue as
    /// `owner`'s, as an admission there counts), held (and named by this instance's beats)
    /// from before it is written, and renewed like any other.
    async fn adopt(
        self: &Arc<Self>,
        route: Option<&str>,
        key: Option<&KeyHash>,
        owner: &KeyHash,
    ) -> Result<Option<RedisLease>, StoreError> {
        let sets: Vec<String> = key
            .map(keys::key_slots_key)
            .into_iter()
            .chain(route.map(keys::route_slots_key))
            .collect();
        let id = self.next_lease_id();
        let held = Sets::new(sets.clone(), Some(keys::key_tag(owner)));
        let lease = RedisLease::hold(self, sets, held.key.clone(), id.clone());
        // On failure the lease drops, and its release (of nothing, or of what did run) goes.
        self.renew(&held, &id, Guard::Breaker).await?;
        if let Some(q) = route.and_then(|r| keys::queue_keys(&keys::route_slots_key(r))) {
            self.beat_on(&q);
        }
        Ok(Some(lease))
    }

    fn reloaded(self: &Arc<Self>, r: &crate::route::Reloaded) {
        self.retire_slices();
        self.reconfigure_queues(r);
    }
}
