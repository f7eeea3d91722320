//! `store.on_error`: what a fleet's store decides while the shared store cannot.
//!
//! [`FallbackStore`] wraps any [`SharedStore`] (Redis in production, a failing fake in the unit
//! tests) and this process's [`MemoryStore`]. While the shared store answers, it decides; when
//! it fails, the policy does: `local` = this instance enforces `1/fleet_size` of every budget
//! and cap in memory, `allow` = admit and count, `deny` = 503. This module owns the degraded
//! state and is the one writer of `tollgate_store_degraded`.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::memory::MemoryStore;
use super::{Admission, AdmitRequest, BudgetView, Charge, Lease, StoreError};
use crate::budget::{Limit, Outcome, Verdict};
use crate::config::OnError;
use crate::identity::KeyHash;
use crate::telemetry::metrics;

/// A store every instance of a fleet shares. An `Err` means "could not decide": the caller
/// falls back on its policy.
pub trait SharedStore: Send + Sync + 'static {
    fn admit(
        self: &Arc<Self>,
        req: &AdmitRequest,
    ) -> impl Future<Output = Result<SharedAnswer, StoreError>> + Send;

    /// Gives `req.cost` back to `req.key`'s shared budget.
    fn refund(&self, req: &AdmitRequest) -> impl Future<Output = Result<(), StoreError>> + Send;

    fn peek(
        &self,
        key: &KeyHash,
        limit: &Limit,
    ) -> impl Future<Output = Result<BudgetView, StoreError>> + Send;
}

/// A shared store's decision.
#[derive(Debug)]
pub struct SharedAnswer {
    /// Never [`Admission::Unavailable`]: a store that cannot decide answers `Err`.
    pub admission: Admission,
    /// False when the answer came from a local cache of the store's earlier word (so it says
    /// nothing about whether the store is reachable now).
    pub reached: bool,
}

/// Writes `tollgate_store_degraded`; nothing else does.
pub(crate) fn show_degraded(on: bool) {
    metrics().store_degraded.set(on as i64);
}

pub struct FallbackStore<S> {
    shared: Arc<S>,
    local: Arc<MemoryStore>,
    on_error: OnError,
    fleet_size: u32,
    degraded: AtomicBool,
}

impl<S> std::fmt::Debug for FallbackStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FallbackStore")
            .field("on_error", &self.on_error)
            .field("degraded", &self.degraded)
            .finish_non_exhaustive()
    }
}

impl<S: SharedStore> FallbackStore<S> {
    /// `shared` decides; `local` (this process's memory) holds the fallback's shares.
    pub fn over(
        shared: Arc<S>,
        local: Arc<MemoryStore>,
        on_error: OnError,
        fleet_size: u32,
    ) -> Arc<Self> {
        Arc::new(FallbackStore {
            shared,
            local,
            on_error,
            fleet_size: fleet_size.max(1),
            degraded: AtomicBool::new(false),
        })
    }

    /// True while decisions are made by `store.on_error` instead of the shared store.
    pub fn degraded(&self) -> bool {
        self.degraded.load(Ordering::Relaxed)
    }

    /// Ready unless the shared store is unreachable and the policy is to refuse everything.
    pub fn ready(&self) -> bool {
        !(self.degraded() && self.on_error == OnError::Deny)
    }

    pub fn publish_gauges(&self) {
        show_degraded(self.degraded());
    }

    fn set_degraded(&self, on: bool) {
        if self.degraded.swap(on, Ordering::Relaxed) != on {
            show_degraded(on);
            if on {
                tracing::warn!(policy = ?self.on_error, "store unreachable: deciding by store.on_error");
            } else {
                tracing::info!("store reachable again: shared budgets in force");
            }
        }
    }

    pub async fn admit(&self, req: &AdmitRequest) -> Admission {
        match self.shared.admit(req).await {
            Ok(answer) => {
                if answer.reached {
                    self.set_degraded(false);
                }
                answer.admission
            }
            Err(_) => self.fallback(req).await,
        }
    }

    /// Decides by `store.on_error` while the shared store cannot.
    async fn fallback(&self, req: &AdmitRequest) -> Admission {
        self.set_degraded(true);
        match self.on_error {
            OnError::Deny => Admission::Unavailable,
            OnError::Local => {
                // Each of fleet_size instances enforces its share of every budget and cap.
                let n = self.fleet_size;
                let share = |cap: u32| (cap / n).max(1);
                let mut r = req.clone();
                r.limit = req.limit.fraction(n);
                r.key_cap = req.key_cap.map(share);
                r.route_cap = req.route_cap.map(share);
                self.local.admit(&r).await
            }
            OnError::Allow => {
                // Admit everything; count it locally so the headers still say something true.
                let mut r = req.clone();
                r.key_cap = None;
                r.route_cap = None;
                match self.local.admit(&r).await {
                    a @ Admission::Admitted { .. } => a,
                    Admission::OverBudget(o)
                    | Admission::KeyBusy(o)
                    | Admission::RouteBusy { outcome: o, .. } => Admission::Admitted {
                        outcome: Outcome {
                            verdict: Verdict::Admit { delay_us: 0 },
                            ..o
                        },
                        lease: Lease::default(),
                        queued: Duration::ZERO,
                    },
                    Admission::Unavailable => Admission::Unavailable,
                }
            }
        }
    }

    /// Gives back a charge where it was made: in the shared store, or in this instance's
    /// memory with the limit it was charged under. A failed shared refund is not retried (it
    /// might have run) and never lands in the local store, which did not charge.
    pub async fn refund(&self, req: &AdmitRequest, charge: Charge) {
        match charge {
            Charge::None => {}
            Charge::Local(limit) => self.local.refund(&AdmitRequest {
                limit,
                ..req.clone()
            }),
            Charge::Shared => {
                if self.shared.refund(req).await.is_ok() {
                    self.set_degraded(false);
                }
            }
        }
    }

    pub async fn peek(&self, key: &KeyHash, limit: &Limit) -> Option<BudgetView> {
        let view = self.shared.peek(key, limit).await.ok()?;
        self.set_degraded(false);
        Some(view)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::Clock;
    use std::sync::atomic::AtomicU32;

    /// A shared store that fails while `down` is set, and otherwise admits everything.
    #[derive(Default)]
    struct Fake {
        down: AtomicBool,
        calls: AtomicU32,
    }

    impl SharedStore for Fake {
        async fn admit(self: &Arc<Self>, req: &AdmitRequest) -> Result<SharedAnswer, StoreError> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if self.down.load(Ordering::Relaxed) {
                return Err(StoreError::Timeout);
            }
            Ok(SharedAnswer {
                admission: Admission::Admitted {
                    outcome: Outcome {
                        verdict: Verdict::Admit { delay_us: 0 },
                        state: None,
                        remaining: req.limit.max_cost(),
                        reset_us: 0,
                    },
                    lease: Lease::shared(None),
                    queued: Duration::ZERO,
                },
                reached: true,
            })
        }

        async fn refund(&self, _req: &AdmitRequest) -> Result<(), StoreError> {
            Ok(())
        }

        async fn peek(&self, _key: &KeyHash, limit: &Limit) -> Result<BudgetView, StoreError> {
            if self.down.load(Ordering::Relaxed) {
                return Err(StoreError::BreakerOpen);
            }
            Ok(BudgetView::at(limit, 0))
        }
    }

    fn store(on_error: OnError, fleet_size: u32) -> (Arc<Fake>, Arc<FallbackStore<Fake>>) {
        let fake = Arc::new(Fake::default());
        fake.down.store(true, Ordering::Relaxed);
        let s = FallbackStore::over(
            fake.clone(),
            MemoryStore::new(Clock::new(0)),
            on_error,
            fleet_size,
        );
        (fake, s)
    }

    fn req(cost: u64, route_cap: Option<u32>) -> AdmitRequest {
        AdmitRequest {
            key: [3; 32],
            limit: Limit::new(120, Duration::from_secs(3600), Duration::ZERO).unwrap(),
            cost,
            key_cap: None,
            route: Arc::from("/r"),
            route_cap,
            queue_timeout: Duration::ZERO,
        }
    }

    fn admitted(a: &Admission) -> bool {
        matches!(a, Admission::Admitted { .. })
    }

    #[tokio::test]
    async fn deny_refuses_and_is_not_ready() {
        let (fake, s) = store(OnError::Deny, 1);
        assert!(s.ready() && !s.degraded());
        assert!(matches!(
            s.admit(&req(1, None)).await,
            Admission::Unavailable
        ));
        assert!(s.degraded() && !s.ready());
        fake.down.store(false, Ordering::Relaxed);
        assert!(admitted(&s.admit(&req(1, None)).await));
        assert!(!s.degraded() && s.ready(), "back on the shared store");
    }

    #[tokio::test]
    async fn local_enforces_the_share_of_budget_and_cap() {
        let (_fake, s) = store(OnError::Local, 3);
        // 120/3 = 40 units: two requests of 20.
        let r = req(20, None);
        let mut held = vec![];
        for _ in 0..2 {
            let a = s.admit(&r).await;
            assert!(admitted(&a), "{a:?}");
            held.push(a);
        }
        assert!(matches!(s.admit(&r).await, Admission::OverBudget(_)));
        assert!(s.degraded() && s.ready());
        // A cap of 6 over 3 instances: 2 here.
        let capped = AdmitRequest {
            key: [4; 32],
            ..req(1, Some(6))
        };
        let a = s.admit(&capped).await;
        let b = s.admit(&capped).await;
        assert!(admitted(&a) && admitted(&b));
        assert!(matches!(
            s.admit(&capped).await,
            Admission::RouteBusy { .. }
        ));
        let Admission::Admitted { lease, .. } = a else {
            unreachable!()
        };
        assert_eq!(lease.charge(), Charge::Local(capped.limit.fraction(3)));
    }

    #[tokio::test]
    async fn allow_admits_past_the_count_uncharged() {
        let (_fake, s) = store(OnError::Allow, 1);
        let r = req(60, Some(1));
        let mut charges = vec![];
        for _ in 0..4 {
            let Admission::Admitted { lease, .. } = s.admit(&r).await else {
                panic!("allow admits")
            };
            charges.push(lease.charge());
        }
        let local = Charge::Local(r.limit);
        assert_eq!(charges, [local, local, Charge::None, Charge::None]);
    }

    #[tokio::test]
    async fn a_refund_goes_back_where_it_was_charged() {
        let (fake, s) = store(OnError::Local, 1);
        let r = req(120, None);
        let Admission::Admitted { lease, .. } = s.admit(&r).await else {
            panic!()
        };
        assert!(matches!(s.admit(&r).await, Admission::OverBudget(_)));
        s.refund(&r, lease.charge()).await;
        assert!(admitted(&s.admit(&r).await), "the local share got it back");
        assert!(s.peek(&r.key, &r.limit).await.is_none(), "no shared view");
        fake.down.store(false, Ordering::Relaxed);
        assert!(s.peek(&r.key, &r.limit).await.is_some());
        assert!(!s.degraded());
    }
}
