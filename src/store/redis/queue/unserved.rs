//! A capped request between its charge and its slot (`Unserved`), and the ids that say what
//! this instance has in a route's queue (`PendingId`, `HeldId`).

use std::sync::Arc;
use std::time::Duration;

use super::super::admit::Once;
use super::super::guard::Guard;
use super::super::keys::{self, QueueKeys};
use super::super::{RedisBackend, RedisLease};
use super::Owed;
use crate::store::{lock, AdmitRequest, Lease};

/// A charged request that has not (yet) got its route slot: dropped before it is served, it
/// leaves the queue (releasing a slot granted meanwhile) and gives its charge back.
pub(super) struct Unserved {
    pub(super) store: Arc<RedisBackend>,
    pub(super) req: Option<AdmitRequest>,
    pub(super) keys: QueueKeys,
    pub(super) key_slots: Vec<String>,
    pub(super) id: String,
    pub(super) waiting: bool,
    /// The route may hold a waiter or a lease of this id (an `enter` was sent).
    pub(super) in_route: bool,
    /// Its charge is in `Waiters::owed` (it has waited in the queue).
    pub(super) owed: bool,
    /// Its charge as the queue keeps it beside its waiter (`owed::Charge`), for whoever drops
    /// it should this instance die.
    pub(super) charge: String,
    /// Until when (Redis time, µs) its charge's admission record surely lives
    /// (`record::kept_until`; 0: not known).
    pub(super) record_kept: u64,
    /// How long it has waited for a grant: its queue time. Its calls to Redis are the
    /// store's time, not the queue's (`Timing::store`, the access log's `store_ms`).
    pub(super) waited: Duration,
    /// Renews its key's lease (`max_in_flight_per_key`), taken with the charge, while it is
    /// held for its turn and while it waits: either may outlast `lease_ttl`.
    pub(super) renew_key: Option<tokio::task::AbortHandle>,
    /// When its charge has drained from every budget (they are full again): its refund is
    /// sent until then, however long Redis is away (a held request's charge sits on top of
    /// the reservations before it).
    pub(super) drains_by: std::time::Instant,
    /// Dropped after the rest: unregistered only once the lease is held or given up.
    pub(super) _pending: PendingId,
}

/// An admission id this instance may have in a route's queue: registered (`Waiters::pending`)
/// from before its first call until it is given up, or held as a lease (`Held::live`).
pub(super) struct PendingId {
    pub(super) store: Arc<RedisBackend>,
    pub(super) id: String,
}

impl PendingId {
    /// A new id, registered under the same lock a beat reads the ids and the id counter under.
    pub(super) fn new(store: &Arc<RedisBackend>, route_set: &str) -> Self {
        let mut w = lock(&store.waiters);
        let id = store.next_lease_id();
        w.pending.insert(id.clone(), route_set.to_string());
        PendingId {
            store: store.clone(),
            id,
        }
    }
}

/// A pending id held for its `max_delay` turn (`Waiters::holding`) while this lives.
pub(super) struct HeldId {
    pub(super) store: Arc<RedisBackend>,
    pub(super) id: String,
}

impl HeldId {
    pub(super) fn new(store: &Arc<RedisBackend>, id: &str) -> Self {
        lock(&store.waiters).holding.insert(id.to_string());
        HeldId {
            store: store.clone(),
            id: id.to_string(),
        }
    }
}

impl Drop for HeldId {
    fn drop(&mut self) {
        lock(&self.store.waiters).holding.remove(&self.id);
    }
}

impl Drop for PendingId {
    fn drop(&mut self) {
        lock(&self.store.waiters).pending.remove(&self.id);
    }
}

impl Unserved {
    /// The request holds its slot: its leases are held as one (and registered as held before
    /// the id stops being pending, so that no beat in between finds it unnamed).
    pub(super) fn served(mut self) -> Lease {
        // The key its route lease counts for, should a renewal have to make it again.
        let key = self.req.take().map(|r| keys::key_tag(&r.key));
        self.forget_waiter();
        self.stop_renewing();
        let mut held = std::mem::take(&mut self.key_slots);
        held.push(self.keys[0].clone());
        let lease = RedisLease::hold(&self.store, held, key, self.id.clone());
        self.store.beat_on(&self.keys);
        Lease::shared(Some(lease))
    }

    /// Its charge is owed back should the instance exit while it waits.
    pub(super) fn owe(&mut self) {
        let Some(req) = &self.req else { return };
        if !std::mem::replace(&mut self.owed, true) {
            let owed = Owed {
                req: req.clone(),
                keys: self.keys.clone(),
                key_slots: self.key_slots.clone(),
                record_kept: self.record_kept,
            };
            lock(&self.store.waiters).owed.insert(self.id.clone(), owed);
        }
    }

    /// Whether its charge is still its own: not given back by the exiting instance (which
    /// takes every owed charge at once). `take`: keep it from here on (it is served).
    pub(super) fn charge_kept(&mut self, take: bool) -> bool {
        if !self.owed {
            return true;
        }
        let mut w = lock(&self.store.waiters);
        if !take {
            return w.owed.contains_key(&self.id);
        }
        let kept = w.owed.remove(&self.id).is_some();
        self.owed = !kept;
        kept
    }

    pub(super) fn stop_renewing(&mut self) {
        if let Some(r) = self.renew_key.take() {
            r.abort();
        }
    }

    pub(super) fn forget_waiter(&mut self) {
        if std::mem::take(&mut self.waiting) {
            let mut w = lock(&self.store.waiters);
            w.waiting.remove(&self.id);
            if let Some(b) = w.routes.get_mut(&self.keys[0]) {
                b.waiting = b.waiting.saturating_sub(1);
            }
        }
    }
}

impl Unserved {
    /// Leaves the queue and gives the charge back, on a task of its own (so that it is done
    /// even if the caller goes away); the task answers with each budget's level once the
    /// charge is back, when it was given back here and then.
    pub(super) fn leave(&mut self) -> Option<tokio::sync::oneshot::Receiver<Vec<i64>>> {
        self.forget_waiter();
        self.stop_renewing();
        let req = self.req.take()?;
        // Not if the exiting instance took it out of the queue and gave its charge back first
        // (its key's slot with it); the route may still hold it, had it entered again since.
        let refund = self.charge_kept(true);
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let (store, keys, id) = (self.store.clone(), self.keys.clone(), self.id.clone());
        let (key_slots, in_route) = (std::mem::take(&mut self.key_slots), self.in_route);
        let record_until = self.record_kept;
        let drains_by = self.drains_by;
        let (tx, rx) = tokio::sync::oneshot::channel();
        // Counted: an exiting instance waits for it (`FallbackStore::written_back_by`).
        rt.spawn(crate::store::Resending::counted(async move {
            if in_route {
                store.leave_queue(&keys, &id, Guard::Breaker).await;
            }
            if refund {
                // The levels as soon as the refund answers; the key's slot after. Not if
                // Redis lost the charge with its data (`Once`): the request may have run on
                // the fallback meanwhile, charged there and written back.
                let once = Once::kept(&req, &id, record_until);
                let budgets = super::super::budget_keys(&req);
                let refunded = store.undo_charge_by(budgets, req.cost, Some(once), Some(drains_by));
                if let Some(levels) = refunded.await {
                    let _ = tx.send(levels);
                }
                store.release_keys(key_slots, id).await;
            }
        }));
        Some(rx)
    }
}

impl Drop for Unserved {
    fn drop(&mut self) {
        let _ = self.leave();
    }
}
