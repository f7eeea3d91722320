//! The `on_error` policies' own decisions, while the shared store cannot decide: `local`
//! (this instance's `1/fleet_size` share of every budget and cap), `allow` and `deny`.

use std::time::{Duration, Instant};

use super::super::running::Slot;
use super::super::{short_key, Admission, AdmitRequest, BudgetView, Extra, Lease, Peek, Standing};
use super::{FallbackStore, SharedStore};
use crate::budget::Limit;
use crate::config::OnError;
use crate::identity::KeyHash;

impl<S: SharedStore> FallbackStore<S> {
    /// Decides by `store.on_error` while the shared store cannot.
    pub(super) async fn fallback(&self, req: &AdmitRequest) -> Admission {
        match self.on_error {
            OnError::Deny => Admission::Unavailable,
            OnError::Local => self.local_share(req).await,
            OnError::Allow => {
                // Admit everything; count it locally so the headers still say something true.
                let mut r = req.clone();
                r.key_cap = None;
                r.route_cap = None;
                match self.local.admit(&r).await {
                    Admission::Admitted {
                        standing,
                        delay_us,
                        lease,
                        queued,
                    } => Admission::Admitted {
                        standing,
                        delay_us,
                        lease: lease.counted(None, true),
                        queued,
                    },
                    Admission::OverBudget { standing, .. }
                    | Admission::KeyBusy(standing)
                    | Admission::RouteBusy { standing, .. } => Admission::Admitted {
                        standing,
                        delay_us: 0,
                        lease: Lease::default().counted(None, true),
                        queued: Duration::ZERO,
                    },
                    Admission::Unavailable => Admission::Unavailable,
                }
            }
        }
    }

    /// What the fallback's budgets are divided by: `fleet_size` for `on_error: local`.
    pub(super) fn local_divisor(&self) -> u32 {
        match self.on_error {
            OnError::Local => self.fleet_size,
            OnError::Allow | OnError::Deny => 1,
        }
    }

    /// `on_error: local`: this instance's `1/fleet_size` of the budget (in its memory) and of
    /// the caps (counting everything it runs).
    async fn local_share(&self, req: &AdmitRequest) -> Admission {
        let n = self.fleet_size;
        let share = |cap: u32| (cap / n).max(1);
        let mut r = req.share(n);
        r.key_cap = None;
        r.route_cap = None;
        // Refuse what the budget would refuse anyway before queueing for a slot.
        if let Some(refusal) = self.local.preview(&r) {
            return refusal;
        }
        let mut wanted = vec![];
        if let Some(cap) = req.route_cap {
            wanted.push((Slot::Route(req.route.clone()), share(cap)));
        }
        if let Some(cap) = req.key_cap {
            wanted.push((Slot::Key(short_key(&req.key)), share(cap)));
        }
        let start = Instant::now();
        let running = loop {
            let freed = self.running.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match self.running.try_take(&wanted) {
                Ok(g) => break g,
                Err(Slot::Key(_)) => return Admission::KeyBusy(self.local_standing(&r)),
                Err(Slot::Route(_)) => {
                    let waited = start.elapsed();
                    if waited >= req.queue_timeout {
                        return Admission::RouteBusy {
                            standing: self.local_standing(&r),
                            queued: waited,
                        };
                    }
                    let _ = tokio::time::timeout(req.queue_timeout - waited, freed).await;
                }
            }
        };
        // The budget may have moved while we queued: decide again, now for real.
        match self.local.admit(&r).await {
            Admission::Admitted {
                standing,
                delay_us,
                lease,
                ..
            } => Admission::Admitted {
                standing,
                delay_us,
                lease: lease.counted(Some(running), true),
                queued: start.elapsed(),
            },
            refused => refused,
        }
    }

    /// The local shares' figures for a refusal that charged nothing: every budget's, the
    /// tightest at the top.
    fn local_standing(&self, r: &AdmitRequest) -> Standing {
        (&self.local.standing(r)).into()
    }

    /// The key's figures under `on_error: local`: this instance's share of each budget.
    pub(super) fn local_peek(&self, key: &KeyHash, limit: &Limit, also: &[Extra]) -> Option<Peek> {
        if self.on_error != OnError::Local {
            return None;
        }
        let n = self.fleet_size;
        let also: Vec<Extra> = also.iter().map(|e| e.fraction(n)).collect();
        let views: Vec<BudgetView> = self.local.peek(key, &limit.fraction(n), &also);
        Some(Peek {
            views,
            local_share: Some(n),
        })
    }
}
