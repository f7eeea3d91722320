//! `store.on_error`: what a fleet's store decides while the shared store cannot.
//!
//! [`FallbackStore`] wraps any [`SharedStore`] (Redis in production, a failing fake in the unit
//! tests) and this process's [`MemoryStore`]. While the shared store answers, it decides; when
//! it fails, the policy does: `local` = this instance enforces `1/fleet_size` of every budget
//! and cap in memory, `allow` = admit and count, `deny` = 503 (DESIGN §4). This module owns
//! the degraded state and is the one writer of `tollgate_store_degraded`. Its rules:
//!
//! - A capped route's (or key's) local share counts every request this instance runs on it,
//!   however it was admitted: the requests Redis admitted that are still running included.
//! - What the fallback admits is owed to the shared budget (`write_back::Ledger`) and charged there in
//!   full when it answers again: before the key's next shared decision, and by a background
//!   task within a few hundred ms without traffic. The local buckets are kept across outages,
//!   so a flapping store does not grant the local shares afresh each time; over any period a
//!   key gets at most its budget plus one burst of the instances' local shares.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::memory::MemoryStore;
use super::running::{slots_of, Limits, Running};
use super::write_back::{Ledger, Owed};
use super::{Admission, AdmitRequest, BudgetView, Charge, Decision, Extra, Peek, StoreError};
use crate::budget::Limit;
use crate::config::OnError;
use crate::identity::KeyHash;
use crate::telemetry::{metrics, FallbackDecision};

/// Bound on [`FallbackStore::release_all`]: an exit waits no longer for the store.
pub const RELEASE_ALL_WITHIN: Duration = Duration::from_secs(1);
/// How often owed units are sent while the store is unreachable.
const WRITE_BACK_EVERY: Duration = Duration::from_millis(250);
/// How often an exit looks whether the write-back is done (`written_back_by`).
const WRITTEN_BACK_POLL: Duration = Duration::from_millis(50);
/// How often the start-up probe tries a store that was unreachable at start.
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// Longest a request waits for the write-back task to send its key's debt (a send is
/// bounded by `store.timeout`; this only bounds a stuck one).
const SENDING_WAIT: Duration = Duration::from_secs(2);

/// A store every instance of a fleet shares. An `Err` means "could not decide": the caller
/// falls back on its policy.
pub trait SharedStore: Send + Sync + 'static {
    fn admit(
        self: &Arc<Self>,
        req: &AdmitRequest,
    ) -> impl Future<Output = Result<SharedAnswer, StoreError>> + Send;

    /// Gives `req.cost` back to `req.key`'s shared budget; `hold` is the budget slice it was
    /// spent from (0: none, charged to the budget itself).
    fn refund(
        &self,
        req: &AdmitRequest,
        hold: u128,
    ) -> impl Future<Output = Result<Refunded, StoreError>> + Send;

    /// What is left of the key's budgets: the one under `limit`, then each of `also` that is
    /// the key's own (as [`crate::store::memory::MemoryStore::peek`]).
    fn peek(
        &self,
        key: &KeyHash,
        limit: &Limit,
        also: &[Extra],
    ) -> impl Future<Output = Result<Vec<BudgetView>, StoreError>> + Send;

    /// Charges `units` admitted elsewhere to `limit` and every `also`, past the budgets if
    /// need be (a debt); once per `id` (0: no id, every call charges). `tell`: what the
    /// fallback admitted, a debt the fleet may not have seen coming: instances that keep a
    /// refusal of the key made before it are told to forget it (its moment is too early now).
    fn write_back(
        &self,
        key: &KeyHash,
        limit: &Limit,
        also: &[Extra],
        units: u64,
        id: u64,
        tell: bool,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// One cheap round trip: is the store reachable?
    fn probe(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// How long since the store last answered a call: an instance that has not asked it for
    /// a while does not know whether it is still there.
    fn quiet_for(&self) -> Duration {
        Duration::ZERO
    }

    /// Releases every lease this instance holds (on exit).
    fn release_all(self: &Arc<Self>) -> impl Future<Output = ()> + Send;

    /// This instance's held requests (`crate::hold`), set once as the gateway starts.
    fn set_holds(&self, _holds: &crate::hold::Holds) {}

    /// A new config was put in force: nothing decided under the old one may be spent on, and
    /// capped routes' queues take their new caps (none for those that lost theirs).
    fn reloaded(self: &Arc<Self>, _r: &crate::route::Reloaded) {}

    /// Registers a request admitted on the local share that is still running as a lease in
    /// the store: in `route`'s lease set and/or the key's (`adopt`); on the route as
    /// `owner`'s (the request's key), whose share of the route it takes.
    fn adopt(
        self: &Arc<Self>,
        route: Option<&str>,
        key: Option<&KeyHash>,
        owner: &KeyHash,
    ) -> impl Future<Output = Result<Option<crate::store::redis::RedisLease>, StoreError>> + Send
    {
        // A store without leases has nothing to register.
        let _ = (route, key, owner);
        async { Ok(None) }
    }
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

/// Where a refund to the shared store went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refunded {
    /// Back into this instance's budget slice: no round trip, and nothing said of the store.
    Slice,
    /// The store took it: each budget's level afterwards (ticks, in `req.limits()`'s order),
    /// when its reply says and the levels are the whole story (not with budget slices, whose
    /// held units they leave out).
    Store(Option<Vec<i64>>),
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
    running: Arc<Running>,
    owed: Ledger,
    adoptions: Arc<adopt::Adoptions>,
    /// Woken when the shared store answers again: requests waiting in a local queue leave it
    /// for the fleet's (DESIGN §4: the cap is exact again within 2 s).
    back: tokio::sync::Notify,
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
            running: Arc::default(),
            owed: Ledger::default(),
            adoptions: Arc::default(),
            back: tokio::sync::Notify::new(),
        })
    }

    /// The shared store this one falls back from.
    pub fn shared(&self) -> &Arc<S> {
        &self.shared
    }

    /// This instance's held requests (`crate::hold`): the shared store's and the local
    /// share's capped requests wait their `max_delay` turn there before their queue.
    pub fn set_holds(&self, holds: &crate::hold::Holds) {
        self.local.set_holds(holds);
        self.shared.set_holds(holds);
    }

    /// True while decisions are made by `store.on_error` instead of the shared store.
    pub fn degraded(&self) -> bool {
        self.degraded.load(Ordering::Relaxed)
    }

    /// The `store.on_error` policy and `fleet_size` this store runs with (set at start; a
    /// reload does not change them).
    pub fn policy(&self) -> (OnError, u32) {
        (self.on_error, self.fleet_size)
    }

    /// Ready unless the shared store is unreachable and the policy is to refuse everything.
    pub fn ready(&self) -> bool {
        !(self.degraded() && self.on_error == OnError::Deny)
    }

    pub fn publish_gauges(&self) {
        show_degraded(self.degraded());
    }

    fn set_degraded(&self, on: bool, cause: Option<&StoreError>) {
        if self.degraded.swap(on, Ordering::Relaxed) != on {
            show_degraded(on);
            if on {
                let cause = cause.map(|e| e.to_string()).unwrap_or_default();
                tracing::warn!(policy = ?self.on_error, error = %cause, "store unreachable: deciding by store.on_error");
            } else {
                tracing::info!("store reachable again: shared budgets in force");
                self.back.notify_waiters();
            }
        }
    }

    /// Asks the store once now and then, while it is unreachable or no call has gone to it for
    /// a second, every second, on a thread of its own for the store's life: so that `/readyz`
    /// and the degraded gauge reflect a store that is down before any request arrives (at
    /// start, and on an idle instance: DESIGN §5), and the degraded state ends when the store
    /// is back, not when the next request happens to come. One thread, which only reads the
    /// time of the last answer while requests keep the store busy.
    pub fn spawn_probe(self: &Arc<Self>) {
        let store = Arc::downgrade(self);
        let spawned = crate::background::spawn("tollgate-store-probe".into(), move || async move {
            let mut first = true;
            loop {
                let Some(s) = store.upgrade() else { return };
                if first || s.degraded() || s.shared.quiet_for() >= PROBE_EVERY {
                    let mut probed = s.shared.probe().await;
                    if probed.is_err() && !first && !s.degraded() {
                        // An idle instance's check: its connection may have been closed by
                        // the server while unused; one more try on a new one before
                        // deciding the store is gone.
                        probed = s.shared.probe().await;
                    }
                    match probed {
                        Ok(()) => s.set_degraded(false, None),
                        Err(StoreError::BreakerOpen) => {}
                        Err(e) => s.set_degraded(true, Some(&e)),
                    }
                }
                first = false;
                drop(s);
                tokio::time::sleep(PROBE_EVERY).await;
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the store probe");
        }
    }

    pub async fn admit(self: &Arc<Self>, req: &AdmitRequest) -> Admission {
        self.decide(req).await.admission
    }

    pub async fn decide(self: &Arc<Self>, req: &AdmitRequest) -> Decision {
        use crate::hold::HoldClock;
        // A capped request may be held for its turn (on either side) before its queue: that
        // time is not queue time (the proxy keeps the clock; a caller without one gets one).
        if req.route_cap.is_some() && !HoldClock::present() {
            return HoldClock::default().scope(self.decide_held(req)).await;
        }
        self.decide_held(req).await
    }

    async fn decide_held(self: &Arc<Self>, req: &AdmitRequest) -> Decision {
        use crate::hold::HoldClock;
        // Tokio's clock: the wait it bounds is timed by tokio (and a test can pause it).
        let start = tokio::time::Instant::now();
        // Only a capped request is held by a store (read for it alone: the clock is a
        // task-local).
        let held_now = || match req.route_cap {
            Some(_) => HoldClock::now_held(),
            None => Duration::ZERO,
        };
        let held_before = held_now();
        let held = || held_now().saturating_sub(held_before);
        // A request that waited in a local queue until the store answered again is decided
        // there, with what is left of its queue time.
        let mut again: Option<AdmitRequest> = None;
        let mut waited = Duration::ZERO;
        loop {
            let asked = again.as_ref().unwrap_or(req);
            // What this instance admitted locally and still runs is registered first (DESIGN §4).
            let held_before_call = held_now();
            let shared = match self.charge_owed_first(asked).await {
                Ok(()) => match self.adopt_local().await {
                    Ok(()) => self.shared.admit(asked).await,
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            let e = match shared {
                Ok(answer) => return self.decided_shared(req, answer, waited),
                Err(e) => e,
            };
            self.set_degraded(true, Some(&e));
            // Held for its turn on the shared store before it failed: the store charged and
            // scheduled it (that charge goes back), and its turn has come. It goes out on that
            // schedule, as the requests the store scheduled before an outage do (`mirror`):
            // the local share takes its units without deciding again.
            let scheduled = held_now() > held_before_call;
            let Some(mut admission) = self.fallback(req, start + held(), scheduled).await else {
                waited = start.elapsed().saturating_sub(held());
                let mut r = req.clone();
                r.queue_timeout = req.queue_timeout.saturating_sub(waited);
                again = Some(r);
                continue;
            };
            if let Admission::Admitted { lease, .. } = &mut admission {
                // `allow` ignores the caps, but what it runs is registered all the same, so
                // that what the store admits next counts it.
                if self.on_error != OnError::Deny {
                    lease.adopt_with(self.adoptable(req));
                }
            }
            let decision = if let Admission::Admitted { .. } = admission {
                self.owe(req, req.cost);
                FallbackDecision::Admitted
            } else {
                FallbackDecision::Rejected
            };
            metrics()
                .fallback_decisions
                .with_label_values(&[decision.as_str()])
                .inc();
            return Decision {
                admission,
                fallback: true,
                share: self.local_divisor(),
            };
        }
    }

    /// The shared store's decision on `req`, which first `waited` in a local queue.
    fn decided_shared(
        &self,
        req: &AdmitRequest,
        answer: SharedAnswer,
        waited: Duration,
    ) -> Decision {
        if answer.reached {
            self.set_degraded(false, None);
        }
        let admission = match answer.admission {
            Admission::Admitted {
                standing,
                delay_us,
                lease,
                queued,
            } => {
                self.mirror(req, false);
                let slots = slots_of(req);
                let running = (!slots.is_empty()).then(|| self.running.track(slots));
                Admission::Admitted {
                    standing,
                    delay_us,
                    lease: lease.counted(running, false),
                    queued: queued + waited,
                }
            }
            Admission::RouteBusy {
                standing,
                queued,
                full,
            } => Admission::RouteBusy {
                standing,
                queued: queued + waited,
                full,
            },
            refused => refused,
        };
        Decision {
            admission,
            fallback: false,
            share: 1,
        }
    }

    /// Under `on_error: local`, a request the shared store admitted on a budget that can hold
    /// (`max_delay`) is charged to this instance's share of it too (up to what the share
    /// holds itself): when an outage puts the share in force, the requests the store already
    /// scheduled here (held for their turn, going out on its schedule) are in it, and the
    /// share schedules after them. An empty share would schedule as much again beside them
    /// (DESIGN §4: a key, or a provider, gets at most its budget plus one burst of the shares).
    /// `back`: the shared store's charge was given back (a refund), and so is the mirror's.
    fn mirror(&self, req: &AdmitRequest, back: bool) {
        if self.on_error != OnError::Local
            || (req.limit.max_delay == 0 && req.also.iter().all(|e| e.limit.max_delay == 0))
        {
            return;
        }
        self.local.mirror(&req.share(self.fleet_size), back);
    }

    /// Charges `units` more to a request admitted under `charge` (`cost_per_second`), with the
    /// `debit` that write-back uses. A local charge is charged locally and owed to the shared
    /// budget like the admission was; a shared debit that surely did not run is owed too.
    pub async fn charge_extra(self: &Arc<Self>, req: &AdmitRequest, charge: Charge, units: u64) {
        match charge {
            Charge::Shared | Charge::Slice(_) => {
                // Under an id of its own: one that may have run is sent again as it is, and
                // the store charges it once.
                let id = rand::random::<u64>() | 1;
                match self
                    .shared
                    .write_back(&req.key, &req.limit, &req.also, units, id, false)
                    .await
                {
                    Ok(()) => {}
                    Err(e) if e.may_have_run() => {
                        tracing::debug!(error = %e, units, "a charge after the fact may not have reached the store: sent again");
                        let again = Owed {
                            key: req.key,
                            limit: req.limit,
                            also: req.also.clone(),
                            units,
                            id,
                        };
                        if self.owed.add_doubtful(again) {
                            tokio::spawn(self.clone().write_back_loop());
                        }
                    }
                    Err(_) => self.owe(req, units),
                }
            }
            Charge::Local(limit) => {
                // Under the local shares it was admitted under, every budget's.
                self.local.debit(&req.charged_under(limit), units);
                self.owe(req, units);
            }
            Charge::None => self.owe(req, units),
        }
    }

    /// What is left of the key's budgets in the shared store; while it cannot say, the local
    /// share in force under `on_error: local` (`None` under the other policies, which
    /// enforce no budget of their own).
    pub async fn peek(&self, key: &KeyHash, limit: &Limit, also: &[Extra]) -> Option<Peek> {
        match self.shared.peek(key, limit, also).await {
            Ok(views) => {
                self.set_degraded(false, None);
                Some(Peek {
                    views,
                    local_share: None,
                })
            }
            Err(_) => self.local_peek(key, limit, also),
        }
    }

    /// A new config is in force (see [`SharedStore::reloaded`]); its caps' local shares
    /// hold at once for the requests waiting in this instance's local queues too.
    pub fn reloaded(&self, reloaded: &crate::route::Reloaded) {
        self.shared.reloaded(reloaded);
        let since = reloaded.loaded_ms();
        let uncapped = reloaded.released().map(|label| {
            let limits = Limits::local(u32::MAX, None, since, self.fleet_size);
            (label.clone(), limits)
        });
        self.running.reconfigure(
            reloaded
                .router
                .routes()
                .filter_map(|r| {
                    let cap = r.max_in_flight?;
                    let limits = Limits::local(cap, r.queue.per_key, r.loaded_ms, self.fleet_size);
                    Some((r.label.clone(), limits))
                })
                .chain(uncapped),
        );
    }

    /// Waits, until `deadline`, for what the fallback admitted to be written back (the
    /// write-back task sends it as soon as the shared store answers: DESIGN §4's bound of a
    /// key's budget plus one burst holds over an outage an instance exits in, too), and for
    /// the refunds and undos being sent again until the store answers them
    /// ([`super::Resending`]). What is still owed then is dropped, and said so.
    pub async fn written_back_by(&self, deadline: std::time::Instant) {
        while !self.owed.is_empty() || super::Resending::any() {
            if std::time::Instant::now() >= deadline {
                let (keys, units) = self.owed.outstanding();
                tracing::warn!(
                    keys,
                    units,
                    resending = super::Resending::count(),
                    "exiting before the store took what this instance owes it (the fallback's admissions written back; refunds and undos of admissions given up on): those keys' charges stay as they are"
                );
                return;
            }
            tokio::time::sleep(WRITTEN_BACK_POLL).await;
        }
    }

    /// Releases every lease this instance holds in the shared store, within
    /// [`RELEASE_ALL_WITHIN`].
    pub async fn release_all(&self) {
        if tokio::time::timeout(RELEASE_ALL_WITHIN, self.shared.release_all())
            .await
            .is_err()
        {
            tracing::warn!(
                "not every lease could be released before exit; they lapse by lease_ttl"
            );
        }
    }
}

pub(crate) mod adopt;
mod local;
mod owing;
mod refunds;
#[cfg(test)]
mod tests;
