//! The charging call to Redis and what undoes it: the admitting script runs in a task of its
//! own (so a timed-out charge is refunded, never retried), its reply has a drop guard (so a
//! request that goes away unread gives it back), and on Redis Cluster a capped route's
//! second call (the route's slot) undoes the first when it refuses or fails.

use std::sync::Arc;
use std::time::Instant;

use super::conn::Conn;
use super::guard::Guard;
use super::script::{self, AdmitCall, AdmitCode, Op, Refund, Undo, UNDO_FOR};
use super::slices::{Place, Settle};
use super::{
    RedisBackend, LATE_REPLY_WAIT, REFUND_RETRY_AT_MOST, REFUND_RETRY_BACKED_OFF,
    REFUND_RETRY_EVERY,
};
use crate::budget::Limit;
use crate::store::{Resending, StoreError};

impl RedisBackend {
    /// The charging call. It runs in a task of its own (see [`PendingReply`] for a request
    /// that goes away while waiting for it): when it outlives `store.timeout` the
    /// request goes on without it (by `on_error`), and the task, if Redis admitted the request
    /// after all, gives the units and the slots back. So a timed-out request is never charged
    /// by Redis, and never charged twice (DESIGN §3); and it is never retried.
    pub(super) async fn call_admit(
        self: &Arc<Self>,
        c: AdmitCall,
    ) -> Result<(Vec<i64>, AdmitCall), StoreError> {
        let store = self.clone();
        self.guarded(Guard::Charge, |conn| async move {
            // Given up at the timeout (this future dropped), the reply is the task's or the
            // guard's to undo.
            let mut pending = store.spawn_admit(c, conn);
            match (&mut pending.rx).await {
                Ok((Ok(v), c)) => Ok((v, c)),
                Ok((Err(e), _)) => Err(e),
                Err(_) => Err(StoreError::Timeout),
            }
        })
        .await
    }

    /// Sends admission `c` in a task of its own, which undoes it if nobody takes its reply:
    /// at once when this thread has fewer than `batch::MAX_IN_FLIGHT` calls in flight, else
    /// with the others that gather behind them, in one batch (group commit, `batch`; one node
    /// only).
    fn spawn_admit(self: &Arc<Self>, c: AdmitCall, mut conn: Conn) -> PendingReply {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let store = self.clone();
        if matches!(conn, Conn::Node(_)) {
            let lane = self.lanes.get_or_default().clone();
            if let Some(first) = lane.enter(c, tx) {
                tokio::spawn(store.run_lane(lane, first, conn));
            }
        } else {
            tokio::spawn(async move {
                let reply = store.run_admit(&c, &mut conn).await;
                store.deliver(c, tx, reply);
            });
        }
        PendingReply {
            rx,
            store: self.clone(),
        }
    }

    /// Hands admission `c`'s reply to its request. What nobody will hold is undone: a call
    /// that failed but may have run (the request falls back on `store.on_error`) by its id,
    /// whether it ran or runs later; an admission whose request stopped waiting, at once.
    pub(super) fn deliver(
        self: &Arc<Self>,
        c: AdmitCall,
        tx: Sent,
        reply: Result<Vec<i64>, StoreError>,
    ) {
        if let Err(e) = &reply {
            if e.may_have_run() {
                self.undo_later(&c);
            }
        }
        if let Err((Ok(v), c)) = tx.send((reply, c)) {
            if admitted(&v) {
                tracing::warn!("a timed-out admission reached Redis after all; refunding it");
                let store = self.clone();
                tokio::spawn(Resending::counted(async move {
                    store.undo_admission(&c, granted(&v)).await
                }));
            }
        }
    }

    /// One admission in Redis: one round trip (the key's budgets and lease set share a slot;
    /// a capped route's slot is taken in its queue afterwards).
    pub(super) async fn run_admit(
        self: &Arc<Self>,
        c: &AdmitCall,
        conn: &mut Conn,
    ) -> Result<Vec<i64>, StoreError> {
        let call = c.invocation();
        let sent = script::invoke::<script::Packed>(&call, conn).await;
        let sent = self.resent_if_dropped(sent, &call, conn).await;
        Ok(sent?.one()?)
    }

    /// An admitting call's result, sent once more on a new connection when `conn` turned out
    /// closed by the server (a restart or `CLIENT KILL` its watch had not seen yet). Safe for
    /// admissions only: Redis decides each once by its id (its record), however often it is
    /// sent. When the resend fails too, the first failure is kept if that call may have run
    /// (the second may only have been refused): its admission is then undone by its id.
    pub(super) async fn resent_if_dropped(
        &self,
        sent: redis::RedisResult<script::Packed>,
        call: &script::Call<'_>,
        conn: &mut Conn,
    ) -> redis::RedisResult<script::Packed> {
        let first = match sent {
            Err(e) if e.is_connection_dropped() => e,
            sent => return sent,
        };
        self.conns.forget();
        let Ok(fresh) = self.conns.get().await else {
            return Err(first);
        };
        *conn = fresh;
        script::after_resend(first, script::invoke::<script::Packed>(call, conn).await)
    }

    /// Refunds and releases an admission that its request cannot use: the request had
    /// already given up on it. A budget slice that came with it (`granted` units) is settled
    /// unspent, by the sweeper: nobody will spend it.
    pub(super) async fn undo_admission(self: &Arc<Self>, c: &AdmitCall, granted: u64) {
        if granted > 0 {
            let place = Place {
                holds: c.holds.clone(),
                budgets: c.budgets(),
            };
            self.settle_later(Settle::unspent(place, c.grant, granted));
        }
        // The charge and the key's lease, by the admission's id: once, however often sent.
        if !self.undo_now(c).await {
            self.undo_later(c);
        }
        // Known to have been admitted: its leases go whatever the record says (the undo
        // released the key's, once; releasing is idempotent, and one that fails is
        // remembered and sent again).
        let slots = c.slot_keys();
        if !slots.is_empty() {
            self.release_keys(slots, c.lease_id.clone()).await;
        }
    }

    /// One `undo` of admission `c` (its charge and key lease back, its id tombstoned),
    /// bypassing the breaker: true if Redis answered it.
    async fn undo_now(&self, c: &AdmitCall) -> bool {
        let undone = self.op_bypassing(&Undo(c), LATE_REPLY_WAIT).await;
        match undone {
            Ok(n) => {
                if n == 1 {
                    tracing::info!("an admission given up on had reached Redis: undone by its id");
                }
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "undo of an admission not answered; sent again");
                // The next attempt connects anew (to the node that took over, say).
                self.conns.forget();
                false
            }
        }
    }

    /// Sends `undo` of admission `c` until Redis answers it (it is idempotent, so any failure,
    /// a timeout included, is simply sent again), for [`UNDO_FOR`]: the admission's record
    /// outlives that, its tombstone much longer.
    pub(super) fn undo_later(self: &Arc<Self>, c: &AdmitCall) {
        let (store, c) = (self.clone(), c.clone());
        let give_up = Instant::now() + UNDO_FOR;
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(Resending::counted(async move {
            while Instant::now() < give_up {
                if store.undo_now(&c).await {
                    return;
                }
                tokio::time::sleep(REFUND_RETRY_EVERY).await;
            }
            tracing::warn!("an admission given up on could not be undone in time; the key may be charged for it twice");
        }));
    }

    /// Gives back a charge that its request will not use, surely: a refund that did not run
    /// (or whose node is dying) is sent again until it does. With `once` (a marker key in the
    /// budgets' slot, `keys::refund_marker`), it is made once however often it is sent, so one
    /// that timed out (it may have run) is sent again too. Each budget's level afterwards,
    /// when the first send answered.
    pub(super) async fn undo_charge(
        self: &Arc<Self>,
        budgets: Vec<(String, Limit)>,
        cost: u64,
        once: Option<Once>,
    ) -> Option<Vec<i64>> {
        self.undo_charge_by(budgets, cost, once, None).await
    }

    /// [`RedisBackend::undo_charge`] of a charge that drains only by `drains_by` (a charge
    /// into a bucket its reservations keep deep drains when the bucket is empty again, not
    /// `cost`'s drain time from now): sent again until then.
    pub(super) async fn undo_charge_by(
        self: &Arc<Self>,
        budgets: Vec<(String, Limit)>,
        cost: u64,
        once: Option<Once>,
        drains_by: Option<Instant>,
    ) -> Option<Vec<i64>> {
        let refund = Once::refund(&once, &budgets, cost);
        let refunded = self.op_bypassing(&refund, LATE_REPLY_WAIT).await;
        match refunded {
            Ok(levels) => return Some(levels),
            Err(e) if refund_again(&e) || once.is_some() => {
                self.retry_refund(budgets, cost, once, drains_by)
            }
            Err(e) => may_have_run(&e),
        }
        None
    }

    /// Sends a refund that Redis refused unrun (or, made once, any that failed) again, every
    /// 200 ms at first and every 2 s after a few tries, until the charge would have drained
    /// from every budget anyway (a refund then gives nothing back), for a lease's time at
    /// least and an hour at most: a topology change is over within that, and an outage's
    /// refunds reach Redis when it is back (DESIGN §4: never dropped).
    fn retry_refund(
        self: &Arc<Self>,
        budgets: Vec<(String, Limit)>,
        cost: u64,
        once: Option<Once>,
        drains_by: Option<Instant>,
    ) {
        let store = self.clone();
        let now = Instant::now();
        let drained = crate::budget::drain_time(budgets.iter().map(|(_, l)| l), cost);
        let give_up = (now + drained.max(self.lease_ttl))
            .max(drains_by.unwrap_or(now))
            .min(now + REFUND_RETRY_AT_MOST);
        tokio::spawn(Resending::counted(async move {
            let mut every = REFUND_RETRY_EVERY;
            while Instant::now() < give_up {
                tokio::time::sleep(every).await;
                every = (every * 2).min(REFUND_RETRY_BACKED_OFF);
                let refund = Once::refund(&once, &budgets, cost);
                match store.op(&refund).await {
                    Ok(_) => return,
                    Err(e) if refund_again(&e) || once.is_some() => continue,
                    Err(e) => return may_have_run(&e),
                }
            }
            tracing::warn!(
                "an admission could not be refunded before its charge drained; the key stays charged for it"
            );
        }));
    }
}

/// What makes a refund of an admission's charge once however often it is sent: its marker
/// (`keys::refund_marker`), and, for a charge whose record is known to live until a time
/// (Redis's, µs: a capped route's, `queue::record::kept_until`), that record. Run before then, the refund
/// is made only if the record is there: Redis still holds the charge. A record missing then
/// went with Redis's data (a restart without persistence, an empty replica promoted), and
/// the charge with it: giving it back would cancel what was charged since (the fallback's
/// write-back of what ran while Redis was away). Run later, as with the marker alone.
pub(super) struct Once {
    pub marker: String,
    pub record: Option<(String, u64)>,
}

impl Once {
    /// Admission `id`'s of `req`, its record kept until `kept_us` (Redis time; 0: not known
    /// to be kept).
    pub fn kept(req: &crate::store::AdmitRequest, id: &str, kept_us: u64) -> Once {
        Once {
            marker: super::keys::refund_marker(&req.key, id),
            record: (kept_us > 0).then(|| (super::keys::admission_key(&req.key, id), kept_us)),
        }
    }

    /// The refund of `cost` to `budgets`, made once by `once`, as sent now.
    fn refund<'a>(once: &'a Option<Once>, budgets: &'a [(String, Limit)], cost: u64) -> Refund<'a> {
        let record = once.as_ref().and_then(|o| o.record.as_ref());
        Refund {
            budgets,
            cost,
            once: once.as_ref().map(|o| o.marker.as_str()),
            record: record.map(|(r, until_us)| (r.as_str(), *until_us)),
        }
    }
}

/// A refund whose call may have run (it timed out) is not sent again: it could give the
/// units back twice. It most likely ran once the store answered again.
fn may_have_run(e: &StoreError) {
    tracing::warn!(error = %e, "a refund may not have reached the store; not sent again (it could give the units back twice)");
}

/// Whether a refund of an undone admission that failed is sent again (one made once by its
/// marker is sent again whatever failed). Yes when it did not run (no connection, CLUSTERDOWN
/// while a failover is under way), and also when its connection broke: the node is dying, and
/// its charge may live on in the replica that takes over. A refund sent twice gives a key one
/// cost too many (the rare case: it ran just before the node died), one never sent charges it
/// twice for one request: the first is the lesser harm. Not after a timeout: a live, slow
/// node will run it.
fn refund_again(e: &StoreError) -> bool {
    !matches!(e, StoreError::Timeout) && (!e.may_have_run() || e.transient())
}

/// The units of a budget slice an `admit` reply granted (0 if none, or malformed).
fn granted(reply: &[i64]) -> u64 {
    reply.get(4).map_or(0, |g| (*g).max(0) as u64)
}

type AdmitReply = (Result<Vec<i64>, StoreError>, AdmitCall);

/// Where an admission's reply goes: its request's [`PendingReply`].
pub(super) type Sent = tokio::sync::oneshot::Sender<AdmitReply>;

/// Whether an `admit` reply admitted (and so charged).
fn admitted(reply: &[i64]) -> bool {
    reply.first().copied().and_then(AdmitCode::from_reply) == Some(AdmitCode::Admitted)
}

/// The request's end of the admitting call's reply. A request that goes away while waiting
/// for it (a client that left a queue: its future is dropped) leaves an admission that Redis
/// made and nobody will hold: dropped unread, the reply is taken and the admission undone, as
/// one that came after `store.timeout` is by the task.
struct PendingReply {
    rx: tokio::sync::oneshot::Receiver<AdmitReply>,
    store: Arc<RedisBackend>,
}

impl Drop for PendingReply {
    fn drop(&mut self) {
        self.rx.close();
        if let Ok((Ok(v), c)) = self.rx.try_recv() {
            if admitted(&v) {
                // Dropped outside a runtime only when the process is going away: the lease
                // then lapses after lease_ttl.
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    let store = self.store.clone();
                    rt.spawn(Resending::counted(async move {
                        store.undo_admission(&c, granted(&v)).await
                    }));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
