//! Where budgets and in-flight slots live.
//!
//! [`Store`] is the gateway's one question — "may this request go, and on what terms?" — with
//! two answers: [`MemoryStore`] for a single instance, and [`RedisStore`] for a fleet that must
//! share one budget. Both run the same GCRA arithmetic (`crate::budget`) and hand back a
//! [`Lease`] whose release (explicit, or on drop) frees the request's in-flight slots.
//!
//! - `memory`: the embedded store (also each instance's fallback share);
//! - `redis/`: the shared store ([`redis::RedisBackend`]), split by job: connections,
//!   breaker, deny cache, key layout, script calls, leases;
//! - `fallback`: `store.on_error` over any [`SharedStore`]; [`RedisStore`] is
//!   `FallbackStore<RedisBackend>`. With it: `running` (what the local share counts) and
//!   `write_back` (what the fallback admitted, owed to the shared budget);
//! - `settle`: a charge made final after the response (`cost_per_second`, `cost_from_response`).

pub mod fair;
pub mod fallback;
pub mod health;
mod lease;
pub mod memory;
pub mod redis;
mod running;
mod settle;
mod standing;
mod write_back;

use std::sync::Arc;
use std::time::Duration;

use crate::budget::{Figure, Limit, Outcome, Verdict};
use crate::{identity::KeyHash, telemetry::StoreCall};

pub use fallback::{FallbackStore, SharedAnswer, SharedStore};
pub use lease::{Charge, Lease};
pub use memory::MemoryStore;
pub use redis::RedisStore;
pub use standing::Standing;

/// 128 bits of a key's SHA-256: as collision-free as the whole for any real key count, and
/// half the memory per entry in the maps keyed by it.
pub(crate) fn short_key(key: &KeyHash) -> u128 {
    let mut b = [0u8; 16];
    b.copy_from_slice(&key[..16]);
    u128::from_le_bytes(b)
}

/// A map keyed by [`short_key`]s. Its keys are SHA-256 output, which no client chooses, so a
/// fast (per-process seeded) hasher is enough; std's SipHash was the largest single cost of a
/// memory-store decision.
pub(crate) type KeyMap<V> = std::collections::HashMap<u128, V, foldhash::fast::RandomState>;

/// Calls to the shared store sent again in the background until it answers them (the refund
/// of a charge that did not run, the undo of an admission a request gave up on): an exit waits
/// for them, within its grace period (`FallbackStore::written_back_by`). One is counted while
/// its guard lives.
pub(crate) struct Resending(());

static RESENDING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Resending {
    /// `work`, counted from now until it ends (or is dropped): spawn what this returns.
    pub(crate) fn counted<F: std::future::Future>(
        work: F,
    ) -> impl std::future::Future<Output = F::Output> {
        RESENDING.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let guard = Resending(());
        async move {
            let _guard = guard;
            work.await
        }
    }

    pub(crate) fn count() -> usize {
        RESENDING.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn any() -> bool {
        Resending::count() > 0
    }
}

impl Drop for Resending {
    fn drop(&mut self) {
        RESENDING.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Locks one of the stores' short, never-awaited mutexes. A panic while one was held cannot
/// have left its map inconsistent, so a poisoned lock is simply taken.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why the shared store could not decide. `transient` errors (a timeout, a dropped
/// connection) are expected to pass by themselves; the others (a wrong password, an
/// out-of-memory Redis, an unusable URL) need an operator, so their cause is logged.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store call timed out")]
    Timeout,
    #[error("no connection to the store within the connect timeout")]
    ConnectTimeout,
    /// Connecting failed: refused, a wrong password (WRONGPASS/NOAUTH), a TLS error.
    #[error("cannot connect to the store: {0}")]
    Connect(#[source] ::redis::RedisError),
    #[error("circuit breaker open")]
    BreakerOpen,
    /// The Sentinels are replacing the primary: nothing is sent until they name the new one.
    #[error("the primary is being failed over")]
    FailingOver,
    #[error("store.url is not usable: {0}")]
    Config(redis::UnusableUrl),
    #[error("unexpected script reply {0}")]
    Reply(String),
    #[error("{source}")]
    Redis {
        source: ::redis::RedisError,
        transient: bool,
    },
}

impl From<::redis::RedisError> for StoreError {
    fn from(e: ::redis::RedisError) -> Self {
        if e.is_timeout() {
            return StoreError::Timeout;
        }
        let transient = e.is_connection_dropped() || e.is_connection_refusal();
        StoreError::Redis {
            source: e,
            transient,
        }
    }
}

impl StoreError {
    pub fn transient(&self) -> bool {
        match self {
            StoreError::Timeout
            | StoreError::ConnectTimeout
            | StoreError::BreakerOpen
            | StoreError::FailingOver => true,
            StoreError::Config(_) | StoreError::Reply(_) => false,
            StoreError::Connect(e) => {
                e.is_timeout() || e.is_connection_refusal() || e.is_connection_dropped()
            }
            StoreError::Redis { transient, .. } => *transient,
        }
    }

    /// False when the call surely wrote nothing (so sending it again cannot apply it twice):
    /// the breaker was open, there was no connection to send it on, or Redis answered it
    /// with an error. An error reply is not a timeout: Redis refused the script before
    /// running it (CLUSTERDOWN, MOVED, READONLY, OOM under `noeviction`: every script is a
    /// flagged one, which Redis checks first), or it stopped at a check, which every
    /// operation makes before its first write. Only a call whose answer never came (a
    /// timeout, a connection that broke) may have run.
    pub fn may_have_run(&self) -> bool {
        match self {
            StoreError::BreakerOpen
            | StoreError::ConnectTimeout
            | StoreError::Connect(_)
            | StoreError::Config(_)
            | StoreError::FailingOver => false,
            StoreError::Redis { source, .. } => redis::may_have_run(source),
            StoreError::Timeout | StoreError::Reply(_) => true,
        }
    }

    /// The `result` label of `tollgate_store_calls_total`.
    pub(crate) fn metric_label(&self) -> StoreCall {
        match self {
            StoreError::Timeout | StoreError::ConnectTimeout => StoreCall::Timeout,
            StoreError::Connect(e) if e.is_timeout() => StoreCall::Timeout,
            StoreError::BreakerOpen => StoreCall::BreakerOpen,
            _ => StoreCall::Error,
        }
    }
}

/// Everything a store needs to decide one request.
#[derive(Debug, Clone)]
pub struct AdmitRequest {
    pub key: KeyHash,
    /// The key's (first) budget.
    pub limit: Limit,
    /// Further budgets the request must fit as well, all or none (DESIGN §1): the other
    /// budgets of the key's plan. Empty for a plan of one budget (no allocation then).
    pub also: Vec<Extra>,
    pub cost: u64,
    /// `max_in_flight_per_key` of the key's plan.
    pub key_cap: Option<u32>,
    /// The route's label (its identity across reloads) and fleet-wide cap.
    pub route: Arc<str>,
    pub route_cap: Option<u32>,
    pub queue_timeout: Duration,
    /// How the request queues for the route's slots: its plan's weight, the route's per-key
    /// share and queue bound.
    pub fair: fair::Fair,
}

// A plan's further budgets are the policy's to define; the store keeps their state.
pub use crate::policy::{Bucket, Extra};

impl AdmitRequest {
    /// Every budget the request is charged against, the key's first one first.
    pub fn limits(&self) -> impl Iterator<Item = &Limit> {
        std::iter::once(&self.limit).chain(self.also.iter().map(|e| &e.limit))
    }

    /// How long a capped request may wait before it runs: held for its `max_delay` turn (at
    /// most the longest of its budgets'), then queued for up to `queue_timeout`.
    pub(crate) fn may_wait(&self) -> Duration {
        self.queue_timeout.saturating_add(self.longest_hold())
    }

    /// The longest it may be held for its `max_delay` turn: its budgets' longest.
    pub(crate) fn longest_hold(&self) -> Duration {
        let hold = self.limits().map(Limit::max_delay_us).max().unwrap_or(0);
        Duration::from_micros(hold)
    }

    /// The same request against `1/n` of every budget: one instance's `on_error: local` share.
    pub(crate) fn share(&self, n: u32) -> AdmitRequest {
        AdmitRequest {
            limit: self.limit.fraction(n),
            also: self.also.iter().map(|e| e.fraction(n)).collect(),
            ..self.clone()
        }
    }

    /// The request as it was charged under `limit` (a [`Charge::Local`]): the local share's
    /// divisor is read off the first budget, and applied to the others too.
    pub(crate) fn charged_under(&self, limit: Limit) -> AdmitRequest {
        if limit == self.limit {
            return self.clone();
        }
        let n = (limit.per_unit / self.limit.per_unit.max(1)).max(1);
        AdmitRequest {
            limit,
            ..self.share(u32::try_from(n).unwrap_or(u32::MAX))
        }
    }
}

/// A store's answer. Each variant carries only what is true of it: a delay only when
/// admitted, a retry time only when over budget.
#[derive(Debug)]
pub enum Admission {
    /// Charged; forward the request after `delay_us` (`max_delay`; usually 0). Dropping the
    /// lease frees the in-flight slots.
    Admitted {
        standing: Standing,
        delay_us: u64,
        lease: Lease,
        /// How long the request waited for a route slot.
        queued: Duration,
    },
    /// Over budget: 429 `quota-exceeded`, retry in `retry_after_us`. Nothing was charged.
    OverBudget {
        standing: Standing,
        retry_after_us: u64,
    },
    /// The key's in-flight cap is full: 429 `concurrency-limit`. Nothing was charged.
    KeyBusy(Standing),
    /// The route's cap stayed full for `queue_timeout`: 503 `route-busy`. Nothing was charged.
    RouteBusy {
        standing: Standing,
        queued: Duration,
        /// Its queue held `max_queue` waiters: refused at once, without a wait.
        full: bool,
    },
    /// A capped request to be held for its `max_delay` turn before it joins the route's
    /// queue, that could not be: [`crate::hold::MAX_HELD`] are held already (429, retry in
    /// `hold_us`), or the instance exits before its turn (503 `route-busy`). Nothing was
    /// charged (its reservation was given back).
    NotHeld {
        standing: Standing,
        hold_us: u64,
        exiting: bool,
    },
    /// The store failed and `on_error: deny`: 503 `store-unavailable`.
    Unavailable,
}

impl Admission {
    /// The answer of a budget decision that charged (`verdict` Admit).
    pub(crate) fn admitted(o: &Outcome, lease: Lease, queued: Duration) -> Admission {
        Admission::Admitted {
            standing: o.into(),
            delay_us: o.delay_us(),
            lease,
            queued,
        }
    }

    /// The answer of a budget decision that refused (`verdict` Reject).
    pub(crate) fn over_budget(o: &Outcome) -> Admission {
        let retry_after_us = match o.verdict {
            Verdict::Reject { retry_after_us } => retry_after_us,
            Verdict::Admit { .. } => 0,
        };
        Admission::OverBudget {
            standing: o.into(),
            retry_after_us,
        }
    }
}

/// A budget as seen from outside, for `/admin/keys/{id}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetView {
    pub remaining: u64,
    pub reset_us: u64,
}

impl BudgetView {
    pub fn at(limit: &Limit, level: u64) -> BudgetView {
        BudgetView {
            remaining: limit.remaining(level),
            reset_us: limit.reset_us(level),
        }
    }
}

/// A key's budgets as `/admin/keys/{id}` shows them: the figures, and of which budgets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peek {
    /// Each budget's, in the order asked.
    pub views: Vec<BudgetView>,
    /// `Some(n)`: this instance's `1/n` share on the `local` fallback (the shared store cannot
    /// say); `None`: the store's own figures.
    pub local_share: Option<u32>,
}

impl Peek {
    /// The figures as the rate-limit headers describe them, for an answer that charged
    /// nothing without asking the store to decide.
    pub fn standing(&self) -> Option<Standing> {
        let figures: Vec<Figure> = self
            .views
            .iter()
            .map(|v| Figure {
                remaining: v.remaining,
                reset_us: v.reset_us,
            })
            .collect();
        Standing::tightest(&figures)
    }
}

/// The store the gateway runs on; lives across config reloads so budgets do too.
#[derive(Clone)]
pub enum Store {
    Memory(Arc<MemoryStore>),
    Redis(Arc<RedisStore>),
}

/// A store's answer, and whether `store.on_error` gave it (the shared store was unreachable).
#[derive(Debug)]
pub struct Decision {
    pub admission: Admission,
    pub fallback: bool,
    /// The admission's figures are of `1/share` of every budget: the instance's share on
    /// the `local` fallback (`fleet_size`), else 1.
    pub share: u32,
}

impl Store {
    pub async fn admit(&self, req: &AdmitRequest) -> Admission {
        self.decide(req).await.admission
    }

    /// [`Store::admit`], saying also whether the decision was a fallback one (for the
    /// access log).
    pub async fn decide(&self, req: &AdmitRequest) -> Decision {
        match self {
            Store::Memory(m) => Decision {
                admission: m.admit(req).await,
                fallback: false,
                share: 1,
            },
            // Boxed: the shared store's future is ~4 KB, and every request phase's future
            // (which Pingora boxes and so copies whole) would carry it inline, memory store
            // or not. One allocation per round trip costs less.
            Store::Redis(r) => Box::pin(r.decide(req)).await,
        }
    }

    /// For the exit path: waits until `deadline` for what the `local` fallback admitted to be
    /// written back to the shared store (see [`fallback::FallbackStore::written_back_by`]).
    pub async fn written_back_by(&self, deadline: std::time::Instant) {
        if let Store::Redis(r) = self {
            r.written_back_by(deadline).await;
        }
    }

    /// Releases every in-flight lease this instance holds in the shared store; for the exit
    /// path. Takes at most [`fallback::RELEASE_ALL_WITHIN`].
    pub async fn release_all(&self) {
        match self {
            Store::Memory(_) => {}
            Store::Redis(r) => Box::pin(r.release_all()).await,
        }
    }

    /// A new config was put in force: a capped route's queue takes its new cap and per-key
    /// share at once, for the requests already waiting, and one whose cap the reload took
    /// away lets its waiters go; the Redis store hands back the budget slices it holds (they
    /// were reserved under the old budgets).
    pub fn reloaded(&self, r: &crate::route::Reloaded) {
        match self {
            Store::Memory(m) => m.reconfigure(r),
            Store::Redis(s) => s.reloaded(r),
        }
    }

    /// Gives a charge back (the upstream never handled the request), where it was made: the
    /// levels of the budgets it was made in afterwards (ticks, in the order of the limits it
    /// was charged under), when that store says ([`Standing::of_levels`]).
    pub async fn refund(&self, req: &AdmitRequest, charge: Charge) -> Option<Vec<i64>> {
        match (self, charge) {
            (_, Charge::None) => None,
            (Store::Memory(m), Charge::Local(limit)) => m.refund(&req.charged_under(limit)),
            (Store::Memory(_), Charge::Shared | Charge::Slice(_)) => None,
            (Store::Redis(r), charge) => Box::pin(r.refund(req, charge)).await,
        }
    }

    /// What is left of the key's budgets, the one under `limit` first, then each of `also`
    /// that is the key's own; while the shared store cannot say, the `local` fallback's
    /// share, or `None` under the other policies.
    /// Capped route `route`'s slots and waiters: fleet-wide from Redis, this process's on the
    /// memory store.
    pub async fn route_queue(&self, route: &str) -> Result<fair::QueueView, StoreError> {
        match self {
            Store::Memory(m) => Ok(m
                .queues()
                .snapshot()
                .into_iter()
                .find(|q| &*q.route == route)
                .unwrap_or(fair::QueueView {
                    route: Arc::from(route),
                    running: 0,
                    queued: 0,
                    keys: vec![],
                })),
            Store::Redis(r) => r.shared().route_queue(route).await,
        }
    }

    pub async fn peek(&self, key: &KeyHash, limit: &Limit, also: &[Extra]) -> Option<Peek> {
        match self {
            Store::Memory(m) => Some(Peek {
                views: m.peek(key, limit, also),
                local_share: None,
            }),
            Store::Redis(r) => r.peek(key, limit, also).await,
        }
    }

    /// This instance's held requests: a capped route's request held for its `max_delay` turn
    /// waits there, before it joins the route's queue (set once, as the gateway starts).
    pub fn set_holds(&self, holds: &crate::hold::Holds) {
        match self {
            Store::Memory(m) => m.set_holds(holds),
            Store::Redis(r) => r.set_holds(holds),
        }
    }

    /// True while decisions are made by the `on_error` policy instead of the shared store.
    pub fn degraded(&self) -> bool {
        match self {
            Store::Memory(_) => false,
            Store::Redis(r) => r.degraded(),
        }
    }

    /// Copies the store's health into the `tollgate_store_degraded` gauge.
    pub fn publish_gauges(&self) {
        match self {
            Store::Memory(_) => fallback::show_degraded(false),
            Store::Redis(r) => r.publish_gauges(),
        }
    }

    /// True when the store can decide requests (directly or by its fallback policy).
    pub fn ready(&self) -> bool {
        match self {
            Store::Memory(_) => true,
            Store::Redis(r) => r.ready(),
        }
    }
}

#[cfg(test)]
mod tests;
