//! The embedded store: budgets and slots in this process's memory.
//!
//! Right for one instance, and the fallback each instance uses (with `1/fleet_size` of every
//! budget and cap) while Redis is unreachable under `on_error: local`. Budgets sit in sharded
//! maps behind short std mutexes (never held across an await); route slots are fair queues
//! (`store::fair`), which hand a freed slot to the next waiter in the release itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::fair::{Joined, RouteQueues, RouteSlot};
use super::{lock, short_key, Admission, AdmitRequest, Bucket, BudgetView, Extra, Lease};
use crate::budget::{self, Limit, State, MAX_BUDGETS};
use crate::identity::KeyHash;
use crate::telemetry::Queued;

const SHARDS: usize = 64;
/// How often a shard drops the keys whose bucket has emptied.
const SWEEP_EVERY_US: u64 = 5_000_000;

/// Monotonic microseconds for the memory store.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    anchor: Instant,
    /// Added to every reading. Lets tests give one instance a skewed clock.
    offset_us: i64,
    /// A clock that reads what its owner set, and nothing else: tests that compare the memory
    /// store with Redis give it the instant Redis decided at.
    manual: Option<&'static AtomicU64>,
}

impl Clock {
    pub fn new(offset_us: i64) -> Self {
        Clock {
            anchor: Instant::now(),
            offset_us,
            manual: None,
        }
    }

    /// A clock that stands still at whatever `now` holds.
    pub fn manual(now: &'static AtomicU64) -> Self {
        Clock {
            manual: Some(now),
            ..Clock::new(0)
        }
    }

    pub fn now_us(&self) -> u64 {
        if let Some(now) = self.manual {
            return now.load(Ordering::Relaxed);
        }
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
    entries: super::KeyMap<Entry>,
    /// The further budgets of keys whose plan has several (`Bucket::Key`), by key and name:
    /// a map of their own, so that keys with one budget pay nothing for them.
    named: HashMap<(u128, Arc<str>), State, foldhash::fast::RandomState>,
    last_sweep_us: u64,
}

/// Whether a stored bucket still holds anything at `now_us`.
fn live(s: &State, now_us: u64) -> bool {
    (now_us.saturating_sub(s.at_us) as u128) * (s.rate as u128) < s.level as u128
}

/// A request's budgets with their states, on the stack: the request path allocates nothing
/// for them.
struct Budgets {
    each: [(Limit, Option<State>); MAX_BUDGETS],
    len: usize,
}

impl std::ops::Deref for Budgets {
    type Target = [(Limit, Option<State>)];

    fn deref(&self) -> &Self::Target {
        &self.each[..self.len]
    }
}

/// Routes' `shared` budgets, by route label.
type SharedBudgets = HashMap<Arc<str>, State>;

/// One request's budgets, locked: its key's shard and, when it has a shared budget, the
/// routes' budgets (always in that order, so two requests never wait on each other crosswise).
struct Locked<'a> {
    shard: MutexGuard<'a, Shard>,
    shared: Option<MutexGuard<'a, SharedBudgets>>,
    key: u128,
}

impl Locked<'_> {
    /// Every budget of `req` with its stored state, the key's first one first.
    fn budgets(&self, req: &AdmitRequest) -> Budgets {
        let key = self.key;
        let first = self.shard.entries.get(&key).and_then(|e| e.state);
        let mut b = Budgets {
            each: [(req.limit, first); MAX_BUDGETS],
            len: 1,
        };
        for e in req.also.iter().take(MAX_BUDGETS - 1) {
            let state = match &e.bucket {
                Bucket::Key(name) => self.shard.named.get(&(key, name.clone())).copied(),
                Bucket::Route(label) => self.shared.as_ref().and_then(|m| m.get(label).copied()),
            };
            b.each[b.len] = (e.limit, state);
            b.len += 1;
        }
        b
    }

    /// Stores again, in the new budget's units, each state a reload left in another's (what
    /// the key spent is carried, `budget::level_at`): a refusal writes nothing else, and the
    /// sweep judges a state by the rate it was stored with.
    fn convert(&mut self, req: &AdmitRequest, budgets: &Budgets, now: u64) {
        let stale = |(l, s): &(Limit, Option<State>)| s.is_some_and(|s| s.per_unit != l.per_unit);
        if !budgets.iter().any(stale) {
            return;
        }
        let states: Vec<Option<State>> = budgets
            .iter()
            .map(|b @ (l, s)| {
                if !stale(b) {
                    return *s;
                }
                let level = budget::level_at(l, *s, now);
                (level > 0).then(|| State::of(l, level, now))
            })
            .collect();
        self.put(req, &states);
    }

    /// Stores what [`budget::decide_all`] (or a refund) computed for `req`'s budgets.
    fn put(&mut self, req: &AdmitRequest, states: &[Option<State>]) {
        let key = self.key;
        let entry = self.shard.entries.entry(key).or_default();
        if let Some(s) = states.first() {
            entry.state = *s;
        }
        for (e, s) in req.also.iter().zip(states.iter().skip(1)) {
            match (&e.bucket, s) {
                (Bucket::Key(name), Some(s)) => {
                    self.shard.named.insert((key, name.clone()), *s);
                }
                (Bucket::Key(name), None) => {
                    self.shard.named.remove(&(key, name.clone()));
                }
                (Bucket::Route(label), s) => {
                    if let Some(m) = self.shared.as_mut() {
                        match s {
                            Some(s) => m.insert(label.clone(), *s),
                            None => m.remove(label),
                        };
                    }
                }
            }
        }
    }
}

impl Shard {
    fn sweep(&mut self, now_us: u64) {
        if now_us.saturating_sub(self.last_sweep_us) < SWEEP_EVERY_US {
            return;
        }
        self.last_sweep_us = now_us;
        self.entries
            .retain(|_, e| e.in_flight > 0 || e.state.is_some_and(|s| live(&s, now_us)));
        self.named.retain(|_, s| live(s, now_us));
        // After a burst of keys has gone idle, give the table's memory back (retain keeps it).
        let len = self.entries.len();
        if self.entries.capacity() > 4 * len.max(1024) {
            self.entries.shrink_to(2 * len);
        }
    }
}

pub struct MemoryStore {
    clock: Clock,
    shards: Box<[Mutex<Shard>]>,
    shared: Mutex<SharedBudgets>,
    routes: RouteQueues,
    /// This instance's held requests (`crate::hold`): a capped request waits its `max_delay`
    /// turn there before it joins its route's queue.
    holds: std::sync::OnceLock<crate::hold::Holds>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

/// The slots a memory-store request holds; freed on drop.
#[derive(Debug)]
pub struct MemoryLease {
    /// The key's slot, counted only when its plan caps the key's requests in flight (so an
    /// uncapped request takes no second lock to give it back). A reload that adds a cap
    /// counts from then on: the requests already running are not in the count.
    key_slot: Option<(Arc<MemoryStore>, u128)>,
    /// The route slot; freeing it hands it to the route's next waiter.
    route: Option<RouteSlot>,
}

impl MemoryLease {
    /// No slot: a charge in this process alone (`on_error: allow` past the count).
    pub(crate) fn none() -> MemoryLease {
        MemoryLease {
            key_slot: None,
            route: None,
        }
    }

    pub(crate) fn attach_route(&mut self, slot: RouteSlot) {
        self.route = Some(slot);
    }
}

impl Drop for MemoryLease {
    fn drop(&mut self) {
        if let Some((store, key)) = &self.key_slot {
            let mut shard = store.shard(*key);
            if let Some(e) = shard.entries.get_mut(key) {
                e.in_flight = e.in_flight.saturating_sub(1);
            }
        }
    }
}

impl MemoryStore {
    pub fn new(clock: Clock) -> Arc<Self> {
        Arc::new(MemoryStore {
            clock,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            shared: Mutex::default(),
            routes: RouteQueues::default(),
            holds: Default::default(),
        })
    }

    /// Set once, as the gateway starts; a store no gateway runs holds under the default.
    pub fn set_holds(&self, holds: &crate::hold::Holds) {
        let _ = self.holds.set(holds.clone());
    }

    pub(super) fn holds(&self) -> &crate::hold::Holds {
        self.holds.get_or_init(Default::default)
    }

    pub fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    fn shard(&self, key: u128) -> MutexGuard<'_, Shard> {
        lock(&self.shards[(key as usize) % SHARDS])
    }

    fn lock_budgets(&self, req: &AdmitRequest) -> Locked<'_> {
        let key = short_key(&req.key);
        let shard = self.shard(key);
        let shared = req
            .also
            .iter()
            .any(|e| matches!(e.bucket, Bucket::Route(_)))
            .then(|| lock(&self.shared));
        Locked { shard, shared, key }
    }

    /// Number of keys held (for tests and the memory benchmark).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).entries.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Decides and, when admitted, charges every budget and takes the key slot; all under one
    /// shard lock.
    fn charge(self: &Arc<Self>, req: &AdmitRequest) -> Admission {
        let now = self.clock.now_us();
        let mut locked = self.lock_budgets(req);
        let key = locked.key;
        locked.shard.sweep(now);
        let budgets = locked.budgets(req);
        let joint = budget::decide_all(&budgets, now, req.cost);
        if !joint.outcome.admitted() {
            locked.convert(req, &budgets, now);
            return Admission::over_budget(&joint.outcome);
        }
        let in_flight = locked.shard.entries.get(&key).map_or(0, |e| e.in_flight);
        if req.key_cap.is_some_and(|cap| in_flight >= cap) {
            return Admission::KeyBusy((&uncharged(&budgets, now, joint.outcome)).into());
        }
        locked.put(req, &joint.states[..budgets.len()]);
        let key_slot = req.key_cap.map(|_| {
            if let Some(e) = locked.shard.entries.get_mut(&key) {
                e.in_flight += 1;
            }
            (self.clone(), key)
        });
        drop(locked);
        let lease = Lease::local(
            MemoryLease {
                key_slot,
                route: None,
            },
            req.limit,
        );
        Admission::admitted(&joint.outcome, lease, Duration::ZERO)
    }

    /// The figures of every budget as they stand, for a refusal that charged nothing.
    pub fn standing(&self, req: &AdmitRequest) -> budget::Outcome {
        let now = self.clock.now_us();
        let budgets = self.lock_budgets(req).budgets(req);
        let verdict = budget::decide_all(&budgets, now, req.cost).outcome;
        uncharged(&budgets, now, verdict)
    }

    pub async fn admit(self: &Arc<Self>, req: &AdmitRequest) -> Admission {
        match req.route_cap {
            None => self.charge(req),
            // Boxed: the queued path's state would make every request's future larger.
            Some(cap) => Box::pin(self.admit_capped(req, cap)).await,
        }
    }

    /// A reload is in force: every capped route's queue takes its new cap and per-key share
    /// at once (`RouteQueues::reconfigure`); one whose cap the reload took away, no cap.
    pub fn reconfigure(&self, reloaded: &crate::route::Reloaded) {
        for r in reloaded.router.routes() {
            if let Some(cap) = r.max_in_flight {
                self.routes
                    .reconfigure(&r.label, cap, r.queue.per_key, r.loaded_ms);
            }
        }
        for label in reloaded.released() {
            self.routes
                .reconfigure(label, u32::MAX, None, reloaded.loaded_ms());
        }
    }

    async fn admit_capped(self: &Arc<Self>, req: &AdmitRequest, cap: u32) -> Admission {
        // Charged on joining the route's queue (DESIGN §8): the budgets and the key's cap
        // decide first, so a refusal comes at once, never after waiting.
        let (standing, delay_us, mut lease) = match self.charge(req) {
            Admission::Admitted {
                standing,
                delay_us,
                lease,
                ..
            } => (standing, delay_us, lease),
            refused => return refused,
        };
        // Given back if the request leaves the queue unserved, also when this future is
        // dropped (the client left while it waited or was held).
        let charged = Unserved {
            store: self,
            req: Some(req),
        };
        if let Err(not) = self.holds().before_queue(delay_us).await {
            drop(charged);
            return Admission::NotHeld {
                standing: (&self.standing(req)).into(),
                hold_us: delay_us,
                exiting: not.exiting,
            };
        }
        // Its queue time counts from here.
        let start = Instant::now();
        let (slot, full) = match self
            .routes
            .join(&req.route, cap, short_key(&req.key), req.fair)
        {
            Joined::Slot(slot) => (Some(slot), false),
            Joined::QueueFull => (None, true),
            Joined::Waiting(w) => {
                let _queued = Queued::new(&req.route);
                let granted = tokio::time::timeout(req.queue_timeout, w.granted()).await;
                (granted.ok(), false)
            }
        };
        let Some(slot) = slot else {
            drop(charged);
            drop(lease);
            return Admission::RouteBusy {
                standing: (&self.standing(req)).into(),
                queued: start.elapsed(),
                full,
            };
        };
        charged.served();
        lease.attach_route(slot);
        // Held already, before the queue: nothing left to hold.
        Admission::Admitted {
            standing,
            delay_us: 0,
            lease,
            queued: start.elapsed(),
        }
    }

    /// Gives `req.cost` back to every budget of `req`: each one's level afterwards (ticks, in
    /// `req.limits()`'s order), what the key's other requests spent meanwhile included; `None`
    /// when the key has no budgets here (nothing to give back).
    pub fn refund(&self, req: &AdmitRequest) -> Option<Vec<i64>> {
        let now = self.clock.now_us();
        let mut locked = self.lock_budgets(req);
        if !locked.shard.entries.contains_key(&locked.key) {
            return None;
        }
        let budgets = locked.budgets(req);
        let states: Vec<Option<State>> = budgets
            .iter()
            .map(|(limit, state)| budget::refund(limit, *state, now, req.cost))
            .collect();
        let levels = budgets
            .iter()
            .zip(&states)
            .map(|((limit, _), state)| {
                i64::try_from(budget::level_at(limit, *state, now)).unwrap_or(i64::MAX)
            })
            .collect();
        locked.put(req, &states);
        Some(levels)
    }

    /// Charges `units` that were already spent to each of the request's budgets, past them if
    /// need be (a debt).
    pub fn debit(&self, req: &AdmitRequest, units: u64) {
        let now = self.clock.now_us();
        let mut locked = self.lock_budgets(req);
        let states: Vec<Option<State>> = locked
            .budgets(req)
            .iter()
            .map(|(limit, state)| Some(budget::debit(limit, *state, now, units)))
            .collect();
        locked.put(req, &states);
    }

    /// Charges `req.cost` to each of its budgets that can hold (`max_delay`), up to the most
    /// such a budget holds itself (`capacity + max_delay`); the others are left as they are.
    /// This is a shared store's admission mirrored in this instance's local share
    /// (`store::fallback`): once the share is in force it schedules after what the shared
    /// store already scheduled here, not beside it.
    /// `back`: the shared store gave the charge back (the request was refunded), and so does
    /// the mirror.
    pub fn mirror(&self, req: &AdmitRequest, back: bool) {
        let now = self.clock.now_us();
        let mut locked = self.lock_budgets(req);
        // Outside an outage nothing else sweeps this store.
        locked.shard.sweep(now);
        let states: Vec<Option<State>> = locked
            .budgets(req)
            .iter()
            .map(|(limit, state)| {
                if limit.max_delay == 0 {
                    return *state;
                }
                let level = budget::level_at(limit, *state, now);
                let units = req.cost.saturating_mul(limit.per_unit);
                let level = if back {
                    level.saturating_sub(units)
                } else {
                    // Never below a level already past it (a debt from an outage's charges).
                    level
                        .saturating_add(units)
                        .min(limit.capacity.saturating_add(limit.max_delay))
                        .max(level)
                };
                (level > 0).then(|| State::of(limit, level, now))
            })
            .collect();
        locked.put(req, &states);
    }

    /// What is left of the key's budget under `limit` and of each of its further budgets in
    /// `also` (a route's shared budget there is not the key's, and is left out), in order.
    pub fn peek(&self, key: &KeyHash, limit: &Limit, also: &[Extra]) -> Vec<BudgetView> {
        let now = self.clock.now_us();
        let k = short_key(key);
        let shard = self.shard(k);
        let first = shard.entries.get(&k).and_then(|e| e.state);
        let named = also.iter().filter_map(|e| match &e.bucket {
            Bucket::Key(name) => Some((e.limit, shard.named.get(&(k, name.clone())).copied())),
            Bucket::Route(_) => None,
        });
        std::iter::once((*limit, first))
            .chain(named)
            .map(|(l, state)| BudgetView::at(&l, budget::level_at(&l, state, now)))
            .collect()
    }

    /// Requests running on and waiting for each capped route in this process.
    pub fn queues(&self) -> &RouteQueues {
        &self.routes
    }

    /// In-flight count on a route's slots in this process (for tests).
    pub fn route_in_flight(&self, label: &str) -> u32 {
        self.routes.counts(label).0
    }
}

/// The charge of a request queued for a route slot: given back unless it was served (also
/// when the request's future is dropped: the client left while it waited). The `local`
/// fallback's waiters use it too.
pub(crate) struct Unserved<'a> {
    pub(crate) store: &'a MemoryStore,
    pub(crate) req: Option<&'a AdmitRequest>,
}

impl Unserved<'_> {
    pub(crate) fn served(mut self) {
        self.req = None;
    }
}

impl Drop for Unserved<'_> {
    fn drop(&mut self) {
        if let Some(req) = self.req {
            self.store.refund(req);
        }
    }
}

/// `decided` as a refusal that charged nothing: the same verdict, with every budget's figures
/// as they stand (not after the charge).
fn uncharged(
    budgets: &[(Limit, Option<State>)],
    now: u64,
    decided: budget::Outcome,
) -> budget::Outcome {
    let verdict = decided.verdict;
    if let [(limit, state)] = budgets {
        return budget::uncharged(limit, *state, now, verdict);
    }
    let mut each = budget::Figures::default();
    for (limit, state) in budgets {
        let u = budget::uncharged(limit, *state, now, verdict);
        each.push(budget::Figure {
            remaining: u.remaining,
            reset_us: u.reset_us,
        });
    }
    // The tightest now, which is the one `X-RateLimit-*` describe.
    let figs = each.as_slice();
    let tightest = budget::tightest(figs.iter().map(|f| (f.remaining, f.reset_us)));
    let f = figs.get(tightest).copied().unwrap_or_default();
    each.decisive = tightest as u8;
    budget::Outcome {
        verdict,
        state: None,
        remaining: f.remaining,
        reset_us: f.reset_us,
        each,
    }
}

mod jobs;
pub use jobs::JobPlace;
#[cfg(test)]
mod tests;
