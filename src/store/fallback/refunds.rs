//! Giving a charge back where it was made: in memory, from the debt not written back yet,
//! or in the shared store — after its key's write-back when that is on its way, and again
//! later while the store is away.

use std::sync::Arc;
use std::time::Duration;

use super::super::{AdmitRequest, Charge};
use super::{FallbackStore, Refunded, SharedStore, WRITE_BACK_EVERY};

/// How often, and for how long, a shared refund that did not run is sent again.
pub(super) const REFUND_RETRY_EVERY: Duration = Duration::from_millis(500);
const REFUND_RETRY_BACKED_OFF: Duration = Duration::from_secs(2);
const REFUND_RETRY_FOR: Duration = Duration::from_secs(30);
const REFUND_RETRY_AT_MOST: Duration = Duration::from_secs(3600);

impl<S: SharedStore> FallbackStore<S> {
    /// Gives back a charge where it was made: in the shared store, or in this instance's
    /// memory with the limit it was charged under (and then also out of what is owed to the
    /// shared budget). A shared refund that surely did not run (no connection, the breaker
    /// open) is sent again in the background; one that might have run is not (it would give
    /// back twice); it never lands in the local store, which did not charge.
    ///
    /// The levels of the budgets the charge was made in, once it is back (ticks; for a `Local`
    /// charge, the instance's share's), when the store that made it says.
    pub async fn refund(self: &Arc<Self>, req: &AdmitRequest, charge: Charge) -> Option<Vec<i64>> {
        match charge {
            Charge::None | Charge::Local(_) => {
                let levels = match charge {
                    Charge::Local(limit) => self.local.refund(&req.charged_under(limit)),
                    _ => None,
                };
                if self.owed.forgive(req) {
                    // Not written back yet: forgotten from the debt.
                } else if self.owed.owes(req) {
                    // Its write-back is on its way (being sent, or sent in doubt and sent
                    // again as it was): given back once it has landed, or the store would
                    // give back units it does not have yet, and the refund would be lost.
                    self.refund_after_write_back(req.clone());
                } else {
                    // Written back: the shared budget has it, give it back there (again
                    // later if the store is away).
                    let _ = self.refund_shared(req, 0).await;
                }
                levels
            }
            Charge::Shared => {
                self.mirror(req, true);
                self.refund_shared(req, 0).await
            }
            Charge::Slice(hold) => {
                self.mirror(req, true);
                self.refund_shared(req, hold).await
            }
        }
    }

    /// A refund to the shared store (from the slice `hold`, 0: none), sent again in the
    /// background if it surely did not run. The budgets' levels when the store gave them.
    async fn refund_shared(&self, req: &AdmitRequest, hold: u128) -> Option<Vec<i64>> {
        match self.shared.refund(req, hold).await {
            Ok(Refunded::Store(levels)) => {
                self.set_degraded(false, None);
                levels
            }
            Ok(Refunded::Slice) => None,
            Err(e) if !e.may_have_run() => {
                self.refund_later(req.clone(), hold);
                None
            }
            Err(_) => None,
        }
    }

    /// Gives back, in the shared store, a local charge whose key's write-back is on its way,
    /// once it has landed (nothing of the key owed any more), within [`REFUND_RETRY_AT_MOST`];
    /// sent again later if the store is away then.
    fn refund_after_write_back(self: &Arc<Self>, req: AdmitRequest) {
        let store = self.clone();
        tokio::spawn(crate::store::Resending::counted(async move {
            let give_up = tokio::time::Instant::now() + REFUND_RETRY_AT_MOST;
            while store.owed.owes(&req) {
                if tokio::time::Instant::now() >= give_up {
                    tracing::warn!("a refund waited in vain for its key's write-back; the key stays charged for it");
                    return;
                }
                tokio::time::sleep(WRITE_BACK_EVERY).await;
            }
            store.refund_shared(&req, 0).await;
        }));
    }

    /// Sends a shared refund that did not run again, every [`REFUND_RETRY_EVERY`] backing off
    /// to [`REFUND_RETRY_BACKED_OFF`], while the store stays unreachable: until the charge
    /// would have drained from every budget anyway (a refund then gives nothing back), for
    /// [`REFUND_RETRY_FOR`] at least and [`REFUND_RETRY_AT_MOST`] at most.
    fn refund_later(&self, req: AdmitRequest, hold: u128) {
        let shared = self.shared.clone();
        let retry_for = crate::budget::drain_time(req.limits(), req.cost)
            .max(REFUND_RETRY_FOR)
            .min(REFUND_RETRY_AT_MOST);
        tokio::spawn(crate::store::Resending::counted(async move {
            // Tokio's clock, as the sleeps' (a test can pause it).
            let give_up = tokio::time::Instant::now() + retry_for;
            let mut every = REFUND_RETRY_EVERY;
            while tokio::time::Instant::now() < give_up {
                tokio::time::sleep(every).await;
                every = (every * 2).min(REFUND_RETRY_BACKED_OFF);
                match shared.refund(&req, hold).await {
                    Err(e) if !e.may_have_run() => continue,
                    _ => return,
                }
            }
            tracing::warn!(
                "a refund could not reach the store in time; the key stays charged for it"
            );
        }));
    }
}
