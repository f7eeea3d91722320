//! The embedded store: budgets and slots in this process's memory.
//!
//! Right for one instance, and the fallback each instance uses (with `1/fleet_size` of every
//! budget and cap) while Redis is unreachable under `on_error: local`. Budgets sit in sharded
//! maps behind short std mutexes (never held across an await); route slots are tokio semaphores,
//! which queue waiters first-in first-out and wake them without polling.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{lock, short_key, Admission, AdmitRequest, BudgetView, Lease};
use crate::budget::{self, Limit, State};
use crate::identity::KeyHash;

const SHARDS: usize = 64;
/// How often a shard drops the keys whose bucket has emptied.
const SWEEP_EVERY_US: u64 = 5_000_000;

/// Monotonic microseconds for the memory store.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    anchor: Instant,
    /// Added to every reading. Lets tests give one instance a skewed clock.
    offset_us: i64,
}

impl Clock {
    pub fn new(offset_us: i64) -> Self {
        Clock {
            anchor: Instant::now(),
            offset_us,
        }
    }

    pub fn now_us(&self) -> u64 {
        // Start far from zero so a negative offset never underflows.
        let base = 1u64 << 40;
        let t = base + self.anchor.elapsed().as_micros() as u64;
        t.saturating_add_signed(self.offset_us)
    }
}

#[derive(Debug, Default)]
struct Entry {
    state: Option<State>,
    in_flight: u32,
}

#[derive(Debug, Default)]
struct Shard {
    entries: HashMap<u128, Entry>,
    last_sweep_us: u64,
}

impl Shard {
    fn sweep(&mut self, now_us: u64) {
        if now_us.saturating_sub(self.last_sweep_us) < SWEEP_EVERY_US {
            return;
        }
        self.last_sweep_us = now_us;
        self.entries.retain(|_, e| {
            e.in_flight > 0
                || e.state.is_some_and(|s| {
                    (now_us.saturating_sub(s.at_us) as u128) * (s.rate as u128) < s.level as u128
                })
        });
        // After a burst of keys has gone idle, give the table's memory back (retain keeps it).
        let len = self.entries.len();
        if self.entries.capacity() > 4 * len.max(1024) {
            self.entries.shrink_to(2 * len);
        }
    }
}

#[derive(Debug)]
struct RouteSlots {
    cap: u32,
    sem: Arc<Semaphore>,
}

pub struct MemoryStore {
    clock: Clock,
    shards: Box<[Mutex<Shard>]>,
    routes: Mutex<HashMap<Arc<str>, RouteSlots>>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

/// The slots a memory-store request holds; freed on drop.
#[derive(Debug)]
pub struct MemoryLease {
    store: Arc<MemoryStore>,
    key: u128,
    _route: Option<OwnedSemaphorePermit>,
}

impl Drop for MemoryLease {
    fn drop(&mut self) {
        let mut shard = self.store.shard(self.key);
        if let Some(e) = shard.entries.get_mut(&self.key) {
            e.in_flight = e.in_flight.saturating_sub(1);
        }
    }
}

impl MemoryStore {
    pub fn new(clock: Clock) -> Arc<Self> {
        Arc::new(MemoryStore {
            clock,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            routes: Mutex::default(),
        })
    }

    pub fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    fn shard(&self, key: u128) -> MutexGuard<'_, Shard> {
        lock(&self.shards[(key as usize) % SHARDS])
    }

    /// Number of keys held (for tests and the memory benchmark).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).entries.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn route_sem(&self, label: &Arc<str>, cap: u32) -> Arc<Semaphore> {
        let mut routes = lock(&self.routes);
        match routes.get(label) {
            Some(r) if r.cap == cap => r.sem.clone(),
            _ => {
                // New route, or a reload changed its cap: requests in flight keep their permits
                // on the old semaphore; new ones use the new one.
                let sem = Arc::new(Semaphore::new(cap as usize));
                routes.insert(
                    label.clone(),
                    RouteSlots {
                        cap,
                        sem: sem.clone(),
                    },
                );
                sem
            }
        }
    }

    /// Decides and, when admitted, charges and takes the key slot; all under one shard lock.
    fn charge(
        self: &Arc<Self>,
        req: &AdmitRequest,
        route: Option<OwnedSemaphorePermit>,
        queued: Duration,
    ) -> Admission {
        let now = self.clock.now_us();
        let key = short_key(&req.key);
        let mut shard = self.shard(key);
        shard.sweep(now);
        let entry = shard.entries.entry(key).or_default();
        let outcome = budget::decide(&req.limit, entry.state, now, req.cost);
        if !outcome.admitted() {
            return Admission::OverBudget(outcome);
        }
        if req.key_cap.is_some_and(|cap| entry.in_flight >= cap) {
            return Admission::KeyBusy(budget::uncharged(
                &req.limit,
                entry.state,
                now,
                outcome.verdict,
            ));
        }
        entry.state = outcome.state;
        entry.in_flight += 1;
        drop(shard);
        Admission::Admitted {
            outcome,
            lease: Lease::local(
                MemoryLease {
                    store: self.clone(),
                    key,
                    _route: route,
                },
                req.limit,
            ),
            queued,
        }
    }

    /// What the decision would be, without writing anything.
    pub(crate) fn preview(&self, req: &AdmitRequest) -> Option<Admission> {
        let now = self.clock.now_us();
        let key = short_key(&req.key);
        let shard = self.shard(key);
        let entry = shard.entries.get(&key);
        let state = entry.and_then(|e| e.state);
        let outcome = budget::decide(&req.limit, state, now, req.cost);
        if !outcome.admitted() {
            return Some(Admission::OverBudget(outcome));
        }
        if req
            .key_cap
            .is_some_and(|cap| entry.is_some_and(|e| e.in_flight >= cap))
        {
            return Some(Admission::KeyBusy(budget::uncharged(
                &req.limit,
                state,
                now,
                outcome.verdict,
            )));
        }
        None
    }

    pub async fn admit(self: &Arc<Self>, req: &AdmitRequest) -> Admission {
        let Some(cap) = req.route_cap else {
            return self.charge(req, None, Duration::ZERO);
        };
        // Refuse what the budget or key cap would refuse anyway before queueing for a slot.
        if let Some(refusal) = self.preview(req) {
            return refusal;
        }
        let sem = self.route_sem(&req.route, cap);
        let start = Instant::now();
        let permit = match sem.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => match tokio::time::timeout(req.queue_timeout, sem.acquire_owned()).await {
                Ok(Ok(p)) => p,
                _ => {
                    let now = self.clock.now_us();
                    let key = short_key(&req.key);
                    let state = self.shard(key).entries.get(&key).and_then(|e| e.state);
                    let verdict = budget::decide(&req.limit, state, now, req.cost).verdict;
                    return Admission::RouteBusy {
                        outcome: budget::uncharged(&req.limit, state, now, verdict),
                        queued: start.elapsed(),
                    };
                }
            },
        };
        // The budget may have moved while we queued: decide again, now for real.
        self.charge(req, Some(permit), start.elapsed())
    }

    pub fn refund(&self, req: &AdmitRequest) {
        let now = self.clock.now_us();
        let key = short_key(&req.key);
        let mut shard = self.shard(key);
        if let Some(e) = shard.entries.get_mut(&key) {
            e.state = budget::refund(&req.limit, e.state, now, req.cost);
        }
    }

    /// Charges `units` that were already spent, past the budget if need be (a debt).
    pub fn debit(&self, key: &KeyHash, limit: &Limit, units: u64) {
        let now = self.clock.now_us();
        let k = short_key(key);
        let mut shard = self.shard(k);
        let entry = shard.entries.entry(k).or_default();
        entry.state = Some(budget::debit(limit, entry.state, now, units));
    }

    pub fn peek(&self, key: &KeyHash, limit: &Limit) -> BudgetView {
        let now = self.clock.now_us();
        let k = short_key(key);
        let state = self.shard(k).entries.get(&k).and_then(|e| e.state);
        BudgetView::at(limit, budget::level_at(limit, state, now))
    }

    /// In-flight count on a route's slots in this process (for tests).
    pub fn route_in_flight(&self, label: &str) -> u32 {
        lock(&self.routes)
            .get(label)
            .map(|r| r.cap - r.sem.available_permits() as u32)
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Verdict;

    fn req(cost: u64, key_cap: Option<u32>, route_cap: Option<u32>, queue_ms: u64) -> AdmitRequest {
        AdmitRequest {
            key: [7; 32],
            limit: Limit::new(120, Duration::from_secs(60), Duration::ZERO).unwrap(),
            cost,
            key_cap,
            route: Arc::from("/reports/generate"),
            route_cap,
            queue_timeout: Duration::from_millis(queue_ms),
        }
    }

    #[tokio::test]
    async fn charges_and_refuses_without_writing() {
        let s = MemoryStore::new(Clock::new(0));
        let r = req(20, None, None, 0);
        let mut leases = vec![];
        for want in [100, 80, 60, 40, 20, 0] {
            match s.admit(&r).await {
                Admission::Admitted { outcome, lease, .. } => {
                    assert_eq!(outcome.remaining, want);
                    leases.push(lease);
                }
                other => panic!("{other:?}"),
            }
        }
        for _ in 0..10 {
            match s.admit(&r).await {
                Admission::OverBudget(o) => {
                    assert!(matches!(o.verdict, Verdict::Reject { .. }))
                }
                other => panic!("{other:?}"),
            }
        }
        s.refund(&r);
        assert!(matches!(s.admit(&r).await, Admission::Admitted { .. }));
    }

    #[tokio::test]
    async fn key_cap_and_release_on_drop() {
        let s = MemoryStore::new(Clock::new(0));
        let r = req(1, Some(2), None, 0);
        let a = s.admit(&r).await;
        let b = s.admit(&r).await;
        assert!(matches!(s.admit(&r).await, Admission::KeyBusy(_)));
        drop(a);
        assert!(matches!(s.admit(&r).await, Admission::Admitted { .. }));
        drop(b);
    }

    #[tokio::test]
    async fn route_cap_queues_fifo_then_503() {
        let s = MemoryStore::new(Clock::new(0));
        let r = req(1, None, Some(1), 200);
        let Admission::Admitted { lease, .. } = s.admit(&r).await else {
            panic!()
        };
        assert_eq!(s.route_in_flight("/reports/generate"), 1);
        // A waiter gets the slot as soon as it is released.
        let s2 = s.clone();
        let r2 = r.clone();
        let waiter = tokio::spawn(async move { s2.admit(&r2).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        lease.release().await;
        let Admission::Admitted { queued, lease, .. } = waiter.await.unwrap() else {
            panic!()
        };
        assert!(queued >= Duration::from_millis(40), "{queued:?}");
        // Nobody releases now: after 200 ms, route-busy, and nothing charged.
        let before = s.peek(&r.key, &r.limit);
        assert!(matches!(s.admit(&r).await, Admission::RouteBusy { .. }));
        assert_eq!(s.peek(&r.key, &r.limit).remaining, before.remaining);
        drop(lease);
        assert_eq!(s.route_in_flight("/reports/generate"), 0);
    }

    #[tokio::test]
    async fn idle_keys_are_evicted() {
        let s = MemoryStore::new(Clock::new(0));
        let mut r = req(1, None, None, 0);
        r.limit = Limit::new(1000, Duration::from_millis(1), Duration::ZERO).unwrap();
        for i in 0..100u8 {
            r.key = [i; 32];
            drop(s.admit(&r).await);
        }
        assert_eq!(s.len(), 100);
        for sh in s.shards.iter() {
            lock(sh).last_sweep_us = 0;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        for sh in s.shards.iter() {
            lock(sh).sweep(s.now_us() + SWEEP_EVERY_US);
        }
        assert_eq!(s.len(), 0);
    }
}
