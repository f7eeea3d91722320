//! The `on_error` policies' own decisions, while the shared store cannot decide: `local`
//! (this instance's `1/fleet_size` share of every budget and cap), `allow` and `deny`.

use std::time::Duration;

use tokio::time::Instant;

use super::super::memory::{MemoryLease, Unserved};
use super::super::running::{Full, Limits, Place, RunningGuard};
use super::super::{short_key, Admission, AdmitRequest, BudgetView, Extra, Lease, Peek, Standing};
use super::{FallbackStore, SharedStore};
use crate::budget::Limit;
use crate::config::OnError;
use crate::identity::KeyHash;
use crate::telemetry::Queued;

/// When a request the local share can never hold may ask again: the breaker asks the shared
/// store again within this.
const STORE_BACK_WITHIN: Duration = Duration::from_secs(1);

impl<S: SharedStore> FallbackStore<S> {
    /// Decides by `store.on_error` while the shared store cannot, for an admission that began
    /// at `start`: a capped request's wait for a slot is bounded from then, so one that waited
    /// on the shared store (in its queue, before the store failed) does not wait its whole
    /// `queue_timeout` again on the local share. `None`: it waited in the local queue until the
    /// shared store answered again, and is to be decided there.
    /// `scheduled`: the shared store charged the request and held it for its turn, which has
    /// come (`local` takes its units past the share if need be).
    pub(super) async fn fallback(
        &self,
        req: &AdmitRequest,
        start: Instant,
        scheduled: bool,
    ) -> Option<Admission> {
        Some(match self.on_error {
            OnError::Deny => Admission::Unavailable,
            OnError::Local => return self.local_share(req, start, scheduled).await,
            OnError::Allow => {
                // Admit everything; count it locally so the headers still say something true:
                // past the count too (the key is then in debt here, as it will be in the
                // shared store once what was admitted is written back).
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
                    Admission::OverBudget { .. }
                    | Admission::KeyBusy(_)
                    | Admission::RouteBusy { .. } => {
                        self.local.debit(&r, r.cost);
                        Admission::Admitted {
                            standing: self.local_standing(&r),
                            delay_us: 0,
                            lease: Lease::local(MemoryLease::none(), r.limit).counted(None, true),
                            queued: Duration::ZERO,
                        }
                    }
                    // Uncapped here: never held by the store.
                    refused @ (Admission::Unavailable | Admission::NotHeld { .. }) => refused,
                }
            }
        })
    }

    /// What the fallback's budgets are divided by: `fleet_size` for `on_error: local`.
    pub(super) fn local_divisor(&self) -> u32 {
        match self.on_error {
            OnError::Local => self.fleet_size,
            OnError::Allow | OnError::Deny => 1,
        }
    }

    /// `on_error: local`: this instance's `1/fleet_size` share of the budget (in its memory) and
    /// of the caps (counting everything it runs). A capped request is charged when it joins the
    /// route's local waiters (a refusal comes at once) and given back if it leaves unserved;
    /// waiters take their turn in the fair order among this instance's waiters (DESIGN §8).
    async fn local_share(
        &self,
        req: &AdmitRequest,
        start: Instant,
        scheduled: bool,
    ) -> Option<Admission> {
        let share = |cap: u32| Limits::share_of(cap, self.fleet_size);
        let mut r = req.share(self.fleet_size);
        r.key_cap = None;
        r.route_cap = None;
        if scheduled {
            // Its units were due on the shared store's schedule: taken from the share (into
            // debt if need be, written back like any local charge), not decided again.
            self.local.debit(&r, r.cost);
        }
        let (standing, delay_us, lease) = match scheduled {
            true => (
                self.local_standing(&r),
                0,
                Lease::local(MemoryLease::none(), r.limit),
            ),
            false => match self.local.admit(&r).await {
                Admission::Admitted {
                    standing,
                    delay_us,
                    lease,
                    ..
                } => (standing, delay_us, lease),
                // More than this instance's share of a budget can ever hold: it passes once the
                // shared store answers again, which the breaker asks within the second. Its
                // Retry-After says so, as `deny`'s does, not the time the share would take to hold
                // it (two windows at most: never, here).
                Admission::OverBudget { standing, .. } if r.limits().any(|l| !l.holds(r.cost)) => {
                    return Some(Admission::OverBudget {
                        standing,
                        retry_after_us: STORE_BACK_WITHIN.as_micros() as u64,
                    });
                }
                refused => return Some(refused),
            },
        };
        let charged = Unserved {
            store: &self.local,
            req: Some(&r),
        };
        let key_share = req.key_cap.map(share);
        let Some(cap) = req.route_cap else {
            // No route cap: only the key's share, if any, to take.
            return Some(match self.running.try_take(req, None, key_share) {
                Ok(running) => {
                    charged.served();
                    admitted(standing, delay_us, lease, running, Duration::ZERO)
                }
                Err(_) => {
                    drop(charged);
                    Admission::KeyBusy(self.local_standing(&r))
                }
            });
        };
        // The key's share first, kept through the hold and the queue (as memory and Redis take
        // the key's slot with the charge): a key at its share is refused at once.
        let key_slot = match key_share {
            Some(_) => match self.running.try_take(req, None, key_share) {
                Ok(g) => Some(g),
                Err(_) => {
                    drop(charged);
                    return Some(Admission::KeyBusy(self.local_standing(&r)));
                }
            },
            None => None,
        };
        // Held for its `max_delay` turn before it joins the local queue (`crate::hold`); the
        // queue time counts from then.
        let holding = Instant::now();
        if let Err(not) = self.local.holds().before_queue(delay_us).await {
            drop(charged);
            return Some(Admission::NotHeld {
                standing: self.local_standing(&r),
                hold_us: delay_us,
                exiting: not.exiting,
            });
        }
        let start = match delay_us {
            0 => start,
            _ => start + holding.elapsed(),
        };
        let busy = |queued, full| Admission::RouteBusy {
            standing: self.local_standing(&r),
            queued,
            full,
        };
        if let Some(bound) = req.fair.max_queue {
            if self.running.waiting(&req.route) >= share(bound) as usize {
                drop(charged);
                return Some(busy(Duration::ZERO, true));
            }
        }
        let limits = Limits::local(cap, req.fair.per_key, req.fair.since, self.fleet_size);
        let place = self
            .running
            .queue(&req.route, short_key(&req.key), req.fair, limits);
        let running = match self.take_in_turn(req, &place, start).await {
            Turn::Run(g) => g.with(key_slot),
            // Unserved: the local charge is given back as `charged` drops.
            Turn::StoreBack => return None,
            Turn::Refused(Full::Key) => {
                drop(charged);
                return Some(Admission::KeyBusy(self.local_standing(&r)));
            }
            Turn::Refused(Full::Route) => {
                drop(charged);
                return Some(busy(start.elapsed(), false));
            }
        };
        drop(place);
        charged.served();
        // Held already, before the queue: nothing left to hold.
        Some(admitted(standing, 0, lease, running, start.elapsed()))
    }

    /// Waits for `place`'s turn within this instance's share of the route (each freed slot,
    /// and a reload, wakes the waiters), until the queue timeout counted from `start`, or
    /// until the shared store answers again: its queue is the fleet's, and a slot taken here
    /// then would be one more than the cap (DESIGN §4).
    async fn take_in_turn(&self, req: &AdmitRequest, place: &Place, start: Instant) -> Turn {
        let mut queued = None;
        loop {
            let freed = self.running.freed.notified();
            let back = self.back.notified();
            tokio::pin!(freed, back);
            freed.as_mut().enable();
            back.as_mut().enable();
            match self.running.try_take(req, Some(place), None) {
                Ok(g) => return Turn::Run(g),
                Err(Full::Key) => return Turn::Refused(Full::Key),
                Err(Full::Route) => {
                    if !self.degraded() {
                        return Turn::StoreBack;
                    }
                    let waited = start.elapsed();
                    if waited >= req.queue_timeout {
                        return Turn::Refused(Full::Route);
                    }
                    queued.get_or_insert_with(|| Queued::new(&req.route));
                    tokio::select! {
                        _ = freed => {}
                        _ = back => {}
                        _ = tokio::time::sleep(req.queue_timeout - waited) => {}
                    }
                }
            }
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

/// How a local waiter's turn ended.
enum Turn {
    Run(RunningGuard),
    Refused(Full),
    /// The shared store answers again: the request is decided there.
    StoreBack,
}

/// A local admission holding what it runs as (`running`), for the fallback's caps.
fn admitted(
    standing: Standing,
    delay_us: u64,
    lease: Lease,
    running: super::super::running::RunningGuard,
    queued: Duration,
) -> Admission {
    Admission::Admitted {
        standing,
        delay_us,
        lease: lease.counted(Some(running), true),
        queued,
    }
}
