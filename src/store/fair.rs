//! A capped route's fair queue, in this process (DESIGN §8): the memory store's, and so the
//! `local` fallback's among this instance's waiters.
//!
//! While the route is full, waiters queue per key (each key's in arrival order). A freed slot
//! goes, in the same step as the release, to the head of the key with the fewest requests
//! running on the route divided by its plan's `weight`; among equals, to the key that has
//! waited longest: since its oldest waiter came, or since one of its requests last got or
//! freed a slot, whichever is later (with one slot every key runs nothing at a release, and
//! by its oldest waiter alone a key's backlog would keep the slot). Equals so take turns. A
//! key at the endpoint's `max_in_flight_per_key` waits even while slots are free. One key's
//! 60 queued reports thus delay another key's single report by at most one release.
//!
//! A job held for its `max_delay` turn waits at its place but is not served before its units
//! are due: a slot freed meanwhile goes to the next key whose first waiter may run (DESIGN §8:
//! a request waiting for its units keeps no slot idle; the job's key's later requests wait
//! behind it, in arrival order), and the queue looks again at the due time.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::store::lock;

/// How one request queues: its plan's weight and the route's per-key share and queue bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fair {
    /// The key's plan's `weight` (at least 1).
    pub weight: u32,
    /// The endpoint's `max_in_flight_per_key`.
    pub per_key: Option<u32>,
    /// The endpoint's `max_queue`.
    pub max_queue: Option<u32>,
    /// When the config these figures come from was loaded (`Route::loaded_ms`): a queue takes
    /// a cap and share no older than those it has.
    pub since: u64,
}

impl Default for Fair {
    fn default() -> Self {
        Fair {
            weight: 1,
            per_key: None,
            max_queue: None,
            since: 0,
        }
    }
}

#[derive(Debug)]
struct Waiter {
    seq: u64,
    tx: oneshot::Sender<()>,
    /// Not served before then (a job's `max_delay` turn).
    due: Option<Instant>,
}

#[derive(Debug, Default)]
struct KeyState {
    running: u32,
    weight: u32,
    waiting: VecDeque<Waiter>,
    /// When (in the queue's sequence) one of its requests last got or freed a slot.
    turn: u64,
}

impl KeyState {
    /// Since when it has waited, in the queue's sequence (see the module's doc).
    fn waiting_since(&self) -> u64 {
        self.waiting
            .front()
            .map_or(u64::MAX, |w| w.seq.max(self.turn))
    }
}

/// One route's slots and waiters.
#[derive(Debug)]
pub struct FairQueue {
    cap: u32,
    per_key: Option<u32>,
    /// When the config `cap` and `per_key` come from was loaded (`Fair::since`).
    since: u64,
    running: u32,
    queued: usize,
    seq: u64,
    keys: HashMap<u128, KeyState, foldhash::fast::RandomState>,
}

/// What joining the route gave.
#[derive(Debug)]
pub enum Joined {
    /// A slot at once.
    Slot(RouteSlot),
    /// A place in the queue: await its grant.
    Waiting(Waiting),
    /// The queue already holds `max_queue` waiters.
    QueueFull,
}

/// A slot taken on a route; freeing it hands it to the next waiter.
#[derive(Debug)]
pub struct RouteSlot {
    queue: Arc<Mutex<FairQueue>>,
    key: u128,
}

impl Drop for RouteSlot {
    fn drop(&mut self) {
        lock(&self.queue).release(self.key);
    }
}

/// A request waiting for a slot. Dropped before its grant, it leaves the queue; granted as it
/// was dropped, the slot goes on to the next waiter.
#[derive(Debug)]
pub struct Waiting {
    queue: Arc<Mutex<FairQueue>>,
    key: u128,
    seq: u64,
    rx: Option<oneshot::Receiver<()>>,
}

impl Waiting {
    /// Waits for the slot (cancel-safe: dropping this future leaves the queue).
    pub async fn granted(mut self) -> RouteSlot {
        if let Some(rx) = self.rx.as_mut() {
            // The sender lives in the queue until it grants; it is only dropped with the queue
            // itself, which this waiter holds.
            let _ = rx.await;
        }
        self.rx = None;
        RouteSlot {
            queue: self.queue.clone(),
            key: self.key,
        }
    }
}

impl Waiting {
    /// A handle on where this waiter stands, for a job's status (DESIGN §8's `position`).
    pub fn place(&self) -> Place {
        Place {
            queue: Arc::downgrade(&self.queue),
            seq: self.seq,
        }
    }
}

/// Where a waiter stands in its route's queue, while it waits.
#[derive(Debug)]
pub struct Place {
    queue: std::sync::Weak<Mutex<FairQueue>>,
    seq: u64,
}

impl Place {
    /// 1 + the waiters the fair order serves before this one ([`FairQueue::place`]); `None`
    /// once it no longer waits.
    pub fn position(&self) -> Option<usize> {
        let queue = self.queue.upgrade()?;
        let q = lock(&queue);
        q.place(self.seq)
    }
}

/// Past this many waiters a place is not worked out ([`FairQueue::place`]).
const PLACE_WAITERS: usize = 10_000;
/// Nor past this many steps of its simulation, each comparing every key that waits.
const PLACE_WORK: usize = 200_000;

/// Which of two keys' head waiters the fair queue serves first, each given as (requests it
/// runs on the route, its weight, since when it has waited): fewest running per weight (the
/// ratios compared by cross-multiplication, exactly), then the longest waiting.
fn serve_order(a: (u32, u32, u64), b: (u32, u32, u64)) -> std::cmp::Ordering {
    let (ra, rb) = (
        u64::from(a.0) * u64::from(b.1),
        u64::from(b.0) * u64::from(a.1),
    );
    ra.cmp(&rb).then_with(|| a.2.cmp(&b.2))
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        let mut q = lock(&self.queue);
        if !q.leave(self.key, self.seq) && rx.try_recv().is_ok() {
            // Granted while it gave up: pass the slot on.
            q.release(self.key);
        }
    }
}

impl FairQueue {
    fn new(cap: u32, per_key: Option<u32>, since: u64) -> FairQueue {
        FairQueue {
            cap,
            per_key,
            since,
            running: 0,
            queued: 0,
            seq: 0,
            keys: HashMap::default(),
        }
    }

    /// Requests running on the route, and waiting for it.
    pub fn counts(&self) -> (u32, usize) {
        (self.running, self.queued)
    }

    fn eligible(&self, k: &KeyState) -> bool {
        self.per_key.is_none_or(|share| k.running < share)
    }

    /// The key whose head waiter is served next: fewest running per weight, then the one
    /// that has waited longest ([`KeyState::waiting_since`]); a head not yet due (at `now`)
    /// is passed over.
    fn next_key(&self, now: Instant) -> Option<u128> {
        let due = |k: &KeyState| {
            k.waiting
                .front()
                .is_some_and(|w| w.due.is_none_or(|d| d <= now))
        };
        self.keys
            .iter()
            .filter(|(_, k)| due(k) && self.eligible(k))
            .min_by(|(_, a), (_, b)| {
                serve_order(
                    (a.running, a.weight, a.waiting_since()),
                    (b.running, b.weight, b.waiting_since()),
                )
            })
            .map(|(key, _)| *key)
    }

    /// 1 + how many waiters the queue serves before waiter `seq` if slots free one at a
    /// time and nothing else changes (nobody comes or leaves, no running request ends): its
    /// place in the fair order, as a job's `position` shows it (DESIGN §8). A key at its
    /// per-key share is passed over while any other may be served; once none may, the order
    /// goes on as if the blocked keys' own requests ended. `None`: not waiting. Past
    /// [`PLACE_WAITERS`] waiters or [`PLACE_WORK`] steps × keys, the queue's length stands for
    /// it (an upper bound): a poll never holds the queue's lock for long.
    fn place(&self, seq: u64) -> Option<usize> {
        struct Sim<'a> {
            running: u32,
            weight: u32,
            turn: u64,
            waiting: &'a VecDeque<Waiter>,
            served: usize,
        }
        impl Sim<'_> {
            fn head(&self) -> Option<u64> {
                self.waiting.get(self.served).map(|w| w.seq)
            }
            fn rank(&self) -> (u32, u32, u64) {
                let since = self.head().map_or(u64::MAX, |s| s.max(self.turn));
                (self.running, self.weight, since)
            }
        }
        let mut sims: Vec<Sim> = self
            .keys
            .values()
            .filter(|k| !k.waiting.is_empty())
            .map(|k| Sim {
                running: k.running,
                weight: k.weight.max(1),
                turn: k.turn,
                waiting: &k.waiting,
                served: 0,
            })
            .collect();
        if !sims.iter().any(|s| s.waiting.iter().any(|w| w.seq == seq)) {
            return None;
        }
        if self.queued > PLACE_WAITERS {
            return Some(self.queued);
        }
        let share = self.per_key;
        let mut clock = self.seq;
        let mut work = 0;
        for position in 1.. {
            work += sims.len();
            if work > PLACE_WORK {
                return Some(self.queued);
            }
            let best = |eligible: &dyn Fn(&Sim) -> bool| {
                (0..sims.len())
                    .filter(|&i| sims[i].head().is_some() && eligible(&sims[i]))
                    .min_by(|&a, &b| serve_order(sims[a].rank(), sims[b].rank()))
            };
            let next = best(&|s| share.is_none_or(|share| s.running < share))
                .or_else(|| best(&|_| true))?;
            let s = &mut sims[next];
            if s.head() == Some(seq) {
                return Some(position);
            }
            s.served += 1;
            s.running += 1;
            clock += 1;
            s.turn = clock;
        }
        None
    }

    /// Gives free slots to waiters, best first; a waiter whose receiver is gone is skipped.
    fn grant(&mut self) {
        if self.queued == 0 {
            return;
        }
        let now = Instant::now();
        while self.running < self.cap {
            let Some(key) = self.next_key(now) else {
                return;
            };
            let Some(k) = self.keys.get_mut(&key) else {
                return;
            };
            let Some(w) = k.waiting.pop_front() else {
                return;
            };
            self.queued -= 1;
            if w.tx.send(()).is_ok() {
                k.running += 1;
                self.running += 1;
                self.seq += 1;
                k.turn = self.seq;
            }
        }
    }

    /// The route's cap and per-key share from now on, unless they come from a config loaded
    /// before the one in force here (`since`); new slots go to the waiters at once.
    fn set_limits(&mut self, cap: u32, per_key: Option<u32>, since: u64) {
        if since < self.since {
            return;
        }
        self.since = since;
        if (self.cap, self.per_key) != (cap, per_key) {
            self.cap = cap;
            self.per_key = per_key;
            self.grant();
        }
    }

    /// Whether `key` may take a free slot now: one is free, the key runs fewer than its
    /// share, and none of its own earlier requests waits ahead of it.
    fn takes(&self, key: u128) -> bool {
        let (running, none_waiting) = self
            .keys
            .get(&key)
            .map_or((0, true), |k| (k.running, k.waiting.is_empty()));
        self.running < self.cap && self.per_key.is_none_or(|share| running < share) && none_waiting
    }

    /// Whether a join of `key` now would be [`Joined::QueueFull`].
    fn full(&self, key: u128, fair: Fair) -> bool {
        fair.max_queue.is_some_and(|m| self.queued >= m as usize) && !self.takes(key)
    }

    /// `due`: not served before then (a job held for its `max_delay` turn): it waits at its
    /// place meanwhile, and the queue grants again at that time.
    fn join(this: &Arc<Mutex<FairQueue>>, key: u128, fair: Fair, due: Option<Instant>) -> Joined {
        let due = due.filter(|&d| d > Instant::now());
        let mut q = lock(this);
        // A held waiter now due is served before a newcomer takes the free slot (its timer
        // may not have fired yet).
        q.grant();
        let weight = fair.weight.max(1);
        if due.is_none() && q.takes(key) {
            let k = q.keys.entry(key).or_default();
            k.weight = weight;
            k.running += 1;
            q.running += 1;
            return Joined::Slot(RouteSlot {
                queue: this.clone(),
                key,
            });
        }
        // A held waiter queues even beside a free slot: `max_queue` bounds it all the same.
        let bounded = due.is_some() && fair.max_queue.is_some_and(|m| q.queued >= m as usize);
        if bounded || q.full(key, fair) {
            return Joined::QueueFull;
        }
        q.seq += 1;
        let seq = q.seq;
        let (tx, rx) = oneshot::channel();
        let k = q.keys.entry(key).or_default();
        k.weight = weight;
        k.waiting.push_back(Waiter { seq, tx, due });
        q.queued += 1;
        if let Some(due) = due {
            let queue = Arc::downgrade(this);
            tokio::spawn(async move {
                tokio::time::sleep_until(due.into()).await;
                if let Some(queue) = queue.upgrade() {
                    lock(&queue).grant();
                }
            });
        }
        Joined::Waiting(Waiting {
            queue: this.clone(),
            key,
            seq,
            rx: Some(rx),
        })
    }

    /// Takes waiter `seq` of `key` out of the queue; `false` if it is no longer there (granted).
    fn leave(&mut self, key: u128, seq: u64) -> bool {
        let Some(k) = self.keys.get_mut(&key) else {
            return false;
        };
        let Some(pos) = k.waiting.iter().position(|w| w.seq == seq) else {
            return false;
        };
        k.waiting.remove(pos);
        self.queued -= 1;
        self.forget_if_idle(key);
        // A key that left may have been the one holding back others (a per-key share).
        self.grant();
        true
    }

    fn release(&mut self, key: u128) {
        if let Some(k) = self.keys.get_mut(&key) {
            k.running = k.running.saturating_sub(1);
            self.seq += 1;
            k.turn = self.seq;
        }
        self.running = self.running.saturating_sub(1);
        self.forget_if_idle(key);
        self.grant();
    }

    fn forget_if_idle(&mut self, key: u128) {
        if self
            .keys
            .get(&key)
            .is_some_and(|k| k.running == 0 && k.waiting.is_empty())
        {
            self.keys.remove(&key);
        }
    }

    /// The keys running on the route and waiting for it, with their counts.
    fn holders(&self) -> Vec<KeyView> {
        self.keys
            .iter()
            .map(|(key, k)| KeyView {
                key: KeyRef::Short(*key),
                running: k.running,
                waiting: k.waiting.len(),
            })
            .collect()
    }
}

/// Every capped route's queue in this process, by route label.
#[derive(Debug, Default)]
pub struct RouteQueues {
    routes: Mutex<HashMap<Arc<str>, Arc<Mutex<FairQueue>>>>,
}

impl RouteQueues {
    /// Joins `route`'s queue, capped at `cap`. A reload that changes the cap or the per-key
    /// share changes them in place: the requests running and waiting count against the new
    /// figures (a larger cap hands its new slots to the waiters at once).
    pub fn join(&self, route: &Arc<str>, cap: u32, key: u128, fair: Fair) -> Joined {
        self.join_due(route, cap, key, fair, None)
    }

    /// As [`Self::join`], for a waiter not to be served before `due` (a job held for its
    /// `max_delay` turn): it never takes a free slot ahead of that.
    pub fn join_due(
        &self,
        route: &Arc<str>,
        cap: u32,
        key: u128,
        fair: Fair,
        due: Option<Instant>,
    ) -> Joined {
        let queue = lock(&self.routes)
            .entry(route.clone())
            .or_insert_with(|| Arc::new(Mutex::new(FairQueue::new(cap, fair.per_key, fair.since))))
            .clone();
        lock(&queue).set_limits(cap, fair.per_key, fair.since);
        FairQueue::join(&queue, key, fair, due)
    }

    /// A reload changed `route`'s cap or per-key share: in force at once for the requests
    /// running and waiting, not only from its next request (a larger figure hands its new
    /// slots to the waiters now; a smaller one holds them until fewer run).
    pub fn reconfigure(&self, route: &str, cap: u32, per_key: Option<u32>, since: u64) {
        let queue = lock(&self.routes).get(route).cloned();
        if let Some(queue) = queue {
            lock(&queue).set_limits(cap, per_key, since);
        }
    }

    /// Whether `route`'s queue would refuse `key` now ([`Joined::QueueFull`]): a job asks
    /// before its body is read.
    pub fn full(&self, route: &str, key: u128, fair: Fair) -> bool {
        lock(&self.routes)
            .get(route)
            .is_some_and(|q| lock(q).full(key, fair))
    }

    /// Running and waiting on `route` in this process.
    pub fn counts(&self, route: &str) -> (u32, usize) {
        lock(&self.routes)
            .get(route)
            .map_or((0, 0), |q| lock(q).counts())
    }

    /// Every route's queue in this process, as it stands.
    pub fn snapshot(&self) -> Vec<QueueView> {
        lock(&self.routes)
            .iter()
            .map(|(label, q)| {
                let q = lock(q);
                let (running, queued) = q.counts();
                QueueView {
                    route: label.clone(),
                    running,
                    queued,
                    keys: q.holders(),
                }
            })
            .collect()
    }
}

/// One route's queue as it stands.
#[derive(Debug, Clone)]
pub struct QueueView {
    pub route: Arc<str>,
    pub running: u32,
    pub queued: usize,
    /// The keys running on the route or waiting for it.
    pub keys: Vec<KeyView>,
}

/// A key on a route: how many of its requests run, and how many wait.
#[derive(Debug, Clone)]
pub struct KeyView {
    pub key: KeyRef,
    pub running: u32,
    pub waiting: usize,
}

/// A key as a store names it: the memory store by its short key, Redis by its tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyRef {
    Short(u128),
    Tag(String),
}

impl KeyRef {
    /// Whether this is the key of hash `hash`.
    pub fn is(&self, hash: &crate::identity::KeyHash) -> bool {
        match self {
            KeyRef::Short(k) => *k == crate::store::short_key(hash),
            KeyRef::Tag(t) => *t == crate::store::redis::key_tag(hash),
        }
    }

    /// `key:<8 hex>` of the key's hash, as the access log names a key outside the registry.
    pub fn log_name(&self) -> String {
        let first4 = match self {
            KeyRef::Short(k) => k.to_le_bytes()[..4].to_vec(),
            KeyRef::Tag(t) => {
                use base64::Engine;
                base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(&t[..t.len().min(8)])
                    .unwrap_or_default()
            }
        };
        format!("key:{}", hex::encode(&first4[..first4.len().min(4)]))
    }
}

#[cfg(test)]
mod tests;
