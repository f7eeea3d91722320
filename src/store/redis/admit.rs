//! The charging call to Redis and what undoes it: the admitting script runs in a task of its
//! own (so a timed-out charge is refunded, never retried), its reply has a drop guard (so a
//! request that goes away unread gives it back), and on Redis Cluster a capped route's
//! second call (the route's slot) undoes the first when it refuses or fails.

use std::sync::Arc;
use std::time::Instant;

use super::conn::Conn;
use super::script::{self, AdmitCall, AdmitCode, StoreScript};
use super::slices::{Place, Settle};
use super::{RedisBackend, LATE_REPLY_WAIT, REFUND_RETRY_EVERY};
use crate::budget::Limit;
use crate::store::StoreError;

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
        if !self.breaker.allow() {
            let res = Err(StoreError::BreakerOpen);
            self.record(Instant::now(), &res);
            return res;
        }
        let start = Instant::now();
        let mut conn = match self.conns.get().await {
            Ok(conn) => conn,
            Err(e) => {
                let res = Err(e);
                self.record(start, &res);
                return res;
            }
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut rx = PendingReply {
            rx,
            store: self.clone(),
        };
        let store = self.clone();
        tokio::spawn(async move {
            let reply = store.run_admit(&c, &mut conn).await;
            if let Err((Ok(v), c)) = tx.send((reply, c)) {
                // The request stopped waiting: undo what Redis did for it.
                if v.first().copied().and_then(AdmitCode::from_reply) == Some(AdmitCode::Admitted) {
                    tracing::warn!("a timed-out admission reached Redis after all; refunding it");
                    store.undo_admission(&c, granted(&v)).await;
                }
            }
        });
        let remaining = self.timeout.saturating_sub(start.elapsed());
        let reply = match tokio::time::timeout(remaining, &mut rx.rx).await {
            Ok(r) => r.ok(),
            Err(_) => {
                // A reply that arrived just now is still ours; after close(), the task keeps it.
                rx.rx.close();
                rx.rx.try_recv().ok()
            }
        };
        let res = match reply {
            None => Err(StoreError::Timeout),
            Some((Err(e), _)) => Err(e.into()),
            Some((Ok(v), c)) => Ok((v, c)),
        };
        self.record(start, &res);
        res
    }

    /// One admission in Redis: one round trip (a capped route's slot is then taken in its
    /// fair queue, `super::queue`).
    async fn run_admit(
        self: &Arc<Self>,
        c: &AdmitCall,
        conn: &mut Conn,
    ) -> Result<Vec<i64>, redis::RedisError> {
        script::invoke(&self.script.admit(c), conn).await
    }

    /// Refunds and releases an admission that its request cannot use: the request had
    /// already given up on it. A budget slice that came with it (`granted` units) is settled
    /// unspent, by the sweeper: nobody will spend it.
    async fn undo_admission(self: &Arc<Self>, c: &AdmitCall, granted: u64) {
        if granted > 0 {
            let place = Place {
                holds: c.holds.clone(),
                budgets: StoreScript::budgets_of(c),
            };
            self.settle_later(Settle::unspent(place, c.grant, granted));
        }
        self.undo_charge(StoreScript::budgets_of(c), c.cost).await;
        let slots = c.slot_keys();
        if !slots.is_empty() {
            // Releasing is idempotent: one that fails is remembered and sent again.
            self.release_keys(slots, c.lease_id.clone()).await;
        }
    }

    /// Gives back a charge that its request will not use, surely: a refund that did not run
    /// (or whose node is dying) is sent again until it does.
    pub(super) async fn undo_charge(self: &Arc<Self>, budgets: Vec<(String, Limit)>, cost: u64) {
        let refunded = async {
            let mut conn = self.conns.get().await?;
            let refund = self.script.refund(&budgets, cost);
            match tokio::time::timeout(LATE_REPLY_WAIT, script::invoke::<i64>(&refund, &mut conn))
                .await
            {
                Err(_) => Err(StoreError::Timeout),
                Ok(r) => Ok(r?),
            }
        }
        .await;
        match refunded {
            Ok(_) => {}
            Err(e) if refund_again(&e) => self.retry_refund(budgets, cost),
            Err(e) => {
                tracing::warn!(error = %e, "an admission could not be refunded; the key stays charged for it");
            }
        }
    }

    /// Sends a refund that Redis refused unrun again every 200 ms, for as long as a lease
    /// lives: the topology change that refused it is over by then, or it is an outage.
    fn retry_refund(self: &Arc<Self>, budgets: Vec<(String, Limit)>, cost: u64) {
        let store = self.clone();
        let give_up = Instant::now() + self.lease_ttl;
        tokio::spawn(async move {
            while Instant::now() < give_up {
                tokio::time::sleep(REFUND_RETRY_EVERY).await;
                match store.call::<i64>(store.script.refund(&budgets, cost)).await {
                    Ok(_) => return,
                    Err(e) if refund_again(&e) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "an admission could not be refunded; the key stays charged for it");
                        return;
                    }
                }
            }
            tracing::warn!(
                "an admission could not be refunded in time; the key stays charged for it"
            );
        });
    }
}

/// Whether a refund of an undone admission that failed is sent again. Yes when it did not run
/// (no connection, CLUSTERDOWN while a failover is under way), and also when its connection
/// broke: the node is dying, and its charge may live on in the replica that takes over. A
/// refund sent twice gives a key one cost too many (the rare case: it ran just before the
/// node died), one never sent charges it twice for one request: the first is the lesser harm.
/// Not after a timeout: a live, slow node will run it.
fn refund_again(e: &StoreError) -> bool {
    !matches!(e, StoreError::Timeout) && (!e.may_have_run() || e.transient())
}

/// The units of a budget slice an `admit` reply granted (0 if none, or malformed).
fn granted(reply: &[i64]) -> u64 {
    reply.get(4).map_or(0, |g| (*g).max(0) as u64)
}

type AdmitReply = (Result<Vec<i64>, redis::RedisError>, AdmitCall);

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
            if v.first().copied().and_then(AdmitCode::from_reply) == Some(AdmitCode::Admitted) {
                // Dropped outside a runtime only when the process is going away: the lease
                // then lapses after lease_ttl.
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    let store = self.store.clone();
                    rt.spawn(async move { store.undo_admission(&c, granted(&v)).await });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
