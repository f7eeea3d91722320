//! An eligible request's way through its key's budget slice (`slices`), and the sweeper
//! that settles idle keys' slices: the Redis side of the slice table.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::slices::{self, Place, Settle};
use super::{budget_keys, keys, Decided, RedisBackend};
use crate::store::fallback::SharedAnswer;
use crate::store::{Admission, AdmitRequest, Lease, StoreError};

impl RedisBackend {
    /// An eligible request's way through its key's slice: spent here when the slice holds
    /// its cost (and Redis is not known to be down), else one `admit` call that also
    /// reserves the next slice. `None`: not eligible, decide it exactly.
    pub(super) async fn admit_sliced(
        self: &Arc<Self>,
        req: &AdmitRequest,
    ) -> Option<Result<SharedAnswer, StoreError>> {
        if !self.slices_on || !slices::eligible(req) {
            return None;
        }
        // While the breaker is open, what Redis granted earlier is not spent: an outage
        // is an outage for slices too.
        if self.breaker.closed() {
            if let Some((o, hold)) = self.slices.spend(req, Instant::now()) {
                return Some(Ok(SharedAnswer {
                    admission: Admission::admitted(&o, Lease::sliced(hold), Duration::ZERO),
                    // A local word, not Redis's: it says nothing of Redis being reachable.
                    reached: false,
                }));
            }
        }
        let ask = self.slices.ask(req, Instant::now());
        let guard = AskGuard {
            store: self,
            req,
            ask,
        };
        let start = Instant::now();
        let answer = self.try_admit(req, ask).await;
        std::mem::forget(guard);
        let (decided, seen) = match answer {
            Ok(r) => r,
            Err(e) => {
                self.slices
                    .failed(req, ask, e.may_have_run(), Instant::now(), place(req));
                // The key's entry is the sweeper's to remove.
                self.keep_sweeping();
                return Some(Err(e));
            }
        };
        let admitted = matches!(decided, Decided::Admitted(..));
        let mine = self
            .slices
            .settle(req, ask, &seen, admitted, Instant::now(), || place(req));
        // After the answer: it may have left a grant to settle, and the key's entry.
        self.keep_sweeping();
        let admission = match decided {
            Decided::Admitted(outcome, lease) => {
                self.deny.forget(&req.key);
                Admission::admitted(mine.as_ref().unwrap_or(&outcome), lease, Duration::ZERO)
            }
            // Not for a request without slots (a capped one never takes a slice).
            Decided::KeyAdmitted(outcome, ..) => {
                Admission::admitted(&outcome, Lease::shared(None), Duration::ZERO)
            }
            Decided::OverBudget(o) => {
                self.deny.insert(req, &o, start);
                Admission::over_budget(&o)
            }
            // Not for a request without slots; answered as Redis said all the same.
            Decided::KeyBusy(o) => Admission::KeyBusy(o),
            Decided::RouteBusy(standing) => Admission::RouteBusy {
                standing,
                queued: Duration::ZERO,
                full: false,
            },
        };
        Some(Ok(SharedAnswer {
            admission,
            reached: true,
        }))
    }

    /// Starts the slice sweeper unless it runs.
    fn keep_sweeping(self: &Arc<Self>) {
        if self.slices.start_sweeping() {
            match tokio::runtime::Handle::try_current() {
                Ok(h) => {
                    h.spawn(self.clone().sweep_slices());
                }
                Err(_) => self.slices.sweeper_gone(),
            }
        }
    }

    /// Every [`slices::SWEEP_EVERY`]: settles idle keys' expired slices (and slices handed
    /// back), until no slice is left. A settling that failed is sent again, whether it ran or
    /// not: settling twice is settling once.
    async fn sweep_slices(self: Arc<Self>) {
        loop {
            tokio::time::sleep(slices::SWEEP_EVERY).await;
            let mut again = vec![];
            for (s, deadline) in self.slices.sweep(Instant::now()) {
                match self.settle(&s).await {
                    Ok(_) => self.slices.settled(&s),
                    Err(_) => again.push((s, deadline)),
                }
            }
            self.slices.retry(again);
            if self.slices.stop_sweeping() {
                return;
            }
        }
    }

    /// Hands `s` back to Redis (`settle`), under the breaker.
    pub(super) async fn settle(&self, s: &Settle) -> Result<i64, StoreError> {
        let id = slices::hold_field(s.id);
        self.op(&s.op(&id, Instant::now())).await
    }

    /// Sends the settlings queued for `req`'s key (a failed call's, an idle slice's) before
    /// its next decision in Redis, which must see them: a hold Redis lost with its data is
    /// charged by its settling, and one still being sent by the sweeper is sent again
    /// (settling twice is settling once). One that fails stays queued, and the key is not
    /// decided in Redis now (the fallback decides).
    pub(super) async fn settle_pending(&self, req: &AdmitRequest) -> Result<(), StoreError> {
        for s in self.slices.pending(|| keys::holds_key(&req.key)) {
            self.settle(&s).await?;
            self.slices.settled(&s);
        }
        Ok(())
    }

    /// A settling to send, by the sweeper (a late admission's grant that nobody will spend).
    pub(super) fn settle_later(self: &Arc<Self>, s: slices::Settle) {
        self.slices.settle_later(s);
        self.keep_sweeping();
    }

    /// A new config is in force: no slice of the old one is spent any more, and every one is
    /// settled by the sweeper.
    pub(super) fn retire_slices(self: &Arc<Self>) {
        self.slices.retire_all();
        self.keep_sweeping();
    }
}

/// Where `req`'s key keeps its slices in Redis.
pub(super) fn place(req: &AdmitRequest) -> Place {
    Place {
        holds: keys::holds_key(&req.key),
        budgets: budget_keys(req),
    }
}

/// A reservation whose request went away before its answer (its future dropped): the hold
/// it settles and the one it may have been granted are settled by the sweeper (a no-op for
/// what did run).
struct AskGuard<'a> {
    store: &'a Arc<RedisBackend>,
    req: &'a AdmitRequest,
    ask: slices::Ask,
}

impl Drop for AskGuard<'_> {
    fn drop(&mut self) {
        let req = self.req;
        self.store
            .slices
            .abandoned(req, self.ask, Instant::now(), place(req));
        self.store.keep_sweeping();
    }
}
