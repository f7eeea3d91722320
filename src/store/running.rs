//! Requests this instance is running, per capped route and key, however they were admitted:
//! what the fallback's local share counts against (DESIGN §4: one instance never runs more
//! than its share, requests Redis admitted that are still running included).
//!
//! Requests that wait for a route's local share take their turn in the fair order of DESIGN §8
//! among this instance's waiters: the waiter whose key runs the fewest requests on the route
//! (per its plan's weight) goes first, among equals the one that has waited longest (since its
//! oldest waiter came, or since one of its requests last got or freed a slot, whichever is
//! later, as in `fair`), a key's own requests in arrival order. Every release wakes the waiters;
//! as many as there are free slots, in that order, take one; the others wait on.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::fair::Fair;
use super::{lock, short_key, AdmitRequest};

/// What a request counts against while it runs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Slot {
    Route(Arc<str>),
    Key(u128),
    /// A key's requests on one capped route (the fair order's "running").
    RouteKey(Arc<str>, u128),
}

/// Requests this instance runs, per capped route and per capped key, however admitted, and
/// the requests waiting for a route's local share.
#[derive(Debug, Default)]
pub(crate) struct Running {
    inner: Mutex<Inner>,
    pub(crate) freed: Notify,
}

#[derive(Debug, Default)]
struct Inner {
    counts: HashMap<Slot, u32>,
    /// Per capped route, this instance's share of it as the newest config has it.
    limits: HashMap<Arc<str>, Limits>,
    /// Per route, its waiters in arrival order.
    waiting: HashMap<Arc<str>, Vec<Turn>>,
    /// When (in `seq`) a request of a key on a route last got or freed a slot, kept while
    /// the key has waiters there.
    turns: HashMap<(Arc<str>, u128), u64>,
    seq: u64,
}

#[derive(Debug, Clone, Copy)]
struct Turn {
    seq: u64,
    key: u128,
    weight: u32,
}

/// A capped route's local share (its `max_in_flight` / fleet), and each key's
/// (`max_in_flight_per_key` / fleet), from the config loaded at `since` (`Route::loaded_ms`).
/// Every waiter takes its turn within the newest a request or a reload brought: a reload's
/// cap holds at once for the requests already waiting, as in the fleet's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) share: u32,
    pub(crate) per_key: Option<u32>,
    pub(crate) since: u64,
}

impl Limits {
    /// One instance's share of a cap of `cap` among `fleet` instances: at least 1.
    pub(crate) fn share_of(cap: u32, fleet: u32) -> u32 {
        (cap / fleet.max(1)).max(1)
    }

    /// One of `fleet` instances' shares of a route's `max_in_flight` (`cap`) and
    /// `max_in_flight_per_key`, from the config loaded at `since`.
    pub(crate) fn local(cap: u32, per_key: Option<u32>, since: u64, fleet: u32) -> Limits {
        Limits {
            share: Self::share_of(cap, fleet),
            per_key: per_key.map(|k| Self::share_of(k, fleet)),
            since,
        }
    }
}

impl Inner {
    fn count(&self, s: &Slot) -> u32 {
        self.counts.get(s).copied().unwrap_or(0)
    }

    /// `route`'s share becomes `l` unless a newer config's is in force.
    fn set_limits(&mut self, route: &Arc<str>, l: Limits) {
        match self.limits.get_mut(route) {
            Some(old) if old.since > l.since => {}
            Some(old) => *old = l,
            None => {
                self.limits.insert(route.clone(), l);
            }
        }
    }

    /// Whether the waiter `seq` on `route` is among those `free` slots would go to now,
    /// handed out one at a time in turn: fewest running per weight (cross-multiplied, exact),
    /// then the key that has waited longest; a key's own waiters in arrival order. Each slot
    /// handed out counts for its key, which then waits behind the keys that waited as long
    /// (as `turn` does for a slot taken). So two free slots let the first two in turn take one
    /// each, whichever checks first: a request that cannot wait (`queue_timeout: 0`) is not
    /// refused only because another, also in turn, joined a moment before it.
    fn in_turn(&self, route: &Arc<str>, seq: u64, free: u32) -> bool {
        let Some(turns) = self.waiting.get(route) else {
            return false;
        };
        let per_key = self.limits.get(route).and_then(|l| l.per_key);
        // Per key: slots handed out in this pass, and when the last was.
        let mut given: HashMap<u128, (u32, u64)> = HashMap::new();
        let mut handed: HashSet<u64> = HashSet::new();
        let mut seen: HashSet<u128> = HashSet::new();
        let mut now = self.seq;
        // Never more passes than waiters: each hands a slot to one.
        for _ in 0..free.min(u32::try_from(turns.len()).unwrap_or(u32::MAX)) {
            // (running, weight, waiting since, the waiter's seq, its key)
            let mut best: Option<(u64, u64, u64, u64, u128)> = None;
            seen.clear();
            for t in turns {
                // Only a key's oldest waiter still waiting competes.
                if handed.contains(&t.seq) || !seen.insert(t.key) {
                    continue;
                }
                let (extra, last_given) = given.get(&t.key).copied().unwrap_or_default();
                let running = self.count(&Slot::RouteKey(route.clone(), t.key)) + extra;
                if per_key.is_some_and(|share| running >= share) {
                    continue;
                }
                let running = u64::from(running);
                let weight = u64::from(t.weight.max(1));
                let last = self.turns.get(&(route.clone(), t.key)).copied();
                let since = t.seq.max(last.unwrap_or(0)).max(last_given);
                let better = best.is_none_or(|(r, w, s, _, _)| {
                    let (a, b) = (running * w, r * weight);
                    a < b || (a == b && since < s)
                });
                if better {
                    best = Some((running, weight, since, t.seq, t.key));
                }
            }
            let Some((_, _, _, next, key)) = best else {
                return false;
            };
            if next == seq {
                return true;
            }
            handed.insert(next);
            now += 1;
            let g = given.entry(key).or_default();
            *g = (g.0 + 1, now);
        }
        false
    }

    /// Whether `key` has a waiter on `route`.
    fn waits(&self, route: &Arc<str>, key: u128) -> bool {
        self.waiting
            .get(route)
            .is_some_and(|ts| ts.iter().any(|t| t.key == key))
    }

    /// A request of `key` on `route` got or freed a slot: noted while the key has waiters
    /// there (one without waiters is behind every waiter when it queues again).
    fn turn(&mut self, route: &Arc<str>, key: u128) {
        if self.waits(route, key) {
            self.seq += 1;
            self.turns.insert((route.clone(), key), self.seq);
        } else {
            self.turns.remove(&(route.clone(), key));
        }
    }

    /// Takes the waiter `seq` off `route`'s waiters; its key, if it was still there.
    fn leave(&mut self, route: &Arc<str>, seq: u64) -> Option<u128> {
        let turns = self.waiting.get_mut(route)?;
        let key = turns.iter().find(|t| t.seq == seq).map(|t| t.key);
        turns.retain(|t| t.seq != seq);
        if turns.is_empty() {
            self.waiting.remove(route);
        }
        key
    }

    fn take(&mut self, slots: &[Slot]) {
        for s in slots {
            *self.counts.entry(s.clone()).or_default() += 1;
        }
    }
}

/// Counts one request in [`Running`] until dropped (it lives in the request's [`Lease`]).
pub(crate) struct RunningGuard {
    running: Arc<Running>,
    slots: Vec<Slot>,
}

impl std::fmt::Debug for RunningGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningGuard")
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl RunningGuard {
    /// This guard holding `other`'s slots too (released together).
    pub(crate) fn with(mut self, other: Option<RunningGuard>) -> RunningGuard {
        if let Some(mut other) = other {
            self.slots.append(&mut other.slots);
        }
        self
    }
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        let mut inner = lock(&self.running.inner);
        for s in &self.slots {
            if let Slot::RouteKey(route, key) = s {
                inner.turn(route, *key);
            }
            if let Some(n) = inner.counts.get_mut(s) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    inner.counts.remove(s);
                }
            }
        }
        drop(inner);
        self.running.freed.notify_waiters();
    }
}

/// A request's place among the waiters of a route's local share; dropping it leaves.
pub(crate) struct Place {
    running: Arc<Running>,
    route: Arc<str>,
    seq: u64,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut inner = lock(&self.running.inner);
        if let Some(key) = inner.leave(&self.route, self.seq) {
            if !inner.waits(&self.route, key) {
                inner.turns.remove(&(self.route.clone(), key));
            }
        }
        drop(inner);
        // The next waiter's turn may have come (this one was ahead of it).
        self.running.freed.notify_waiters();
    }
}

/// Why [`Running::try_take`] could not count a request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Full {
    /// The route's share is full, or another waiter's turn comes first: wait.
    Route,
    /// The key's own cap (its plan's `max_in_flight_per_key`) is full: refuse.
    Key,
}

impl Running {
    /// Counts a request the shared store admitted.
    pub(crate) fn track(self: &Arc<Self>, slots: Vec<Slot>) -> RunningGuard {
        lock(&self.inner).take(&slots);
        RunningGuard {
            running: self.clone(),
            slots,
        }
    }

    /// Joins the waiters of `route` for its local share, `limits` as the request's config
    /// has them (taken unless a newer config's are in force).
    pub(crate) fn queue(
        self: &Arc<Self>,
        route: &Arc<str>,
        key: u128,
        fair: Fair,
        limits: Limits,
    ) -> Place {
        let mut inner = lock(&self.inner);
        inner.set_limits(route, limits);
        inner.seq += 1;
        let seq = inner.seq;
        inner.waiting.entry(route.clone()).or_default().push(Turn {
            seq,
            key,
            weight: fair.weight,
        });
        Place {
            running: self.clone(),
            route: route.clone(),
            seq,
        }
    }

    /// Waiters on `route` in this instance.
    pub(crate) fn waiting(&self, route: &str) -> usize {
        lock(&self.inner).waiting.get(route).map_or(0, Vec::len)
    }

    /// A reload is in force: each capped route's share becomes the new config's, for the
    /// requests already waiting too (a larger one hands its new slots to them at once).
    pub(crate) fn reconfigure(&self, routes: impl IntoIterator<Item = (Arc<str>, Limits)>) {
        let mut inner = lock(&self.inner);
        for (route, l) in routes {
            inner.set_limits(&route, l);
        }
        drop(inner);
        self.freed.notify_waiters();
    }

    /// Counts a request if the route has room within its share and it is `place`'s turn, and
    /// its key is below `key_share` (its plan's cap); else says which is full.
    pub(crate) fn try_take(
        self: &Arc<Self>,
        req: &AdmitRequest,
        place: Option<&Place>,
        key_share: Option<u32>,
    ) -> Result<RunningGuard, Full> {
        let mut inner = lock(&self.inner);
        let key = short_key(&req.key);
        let mut slots = vec![];
        if let Some(place) = place {
            let route = &place.route;
            let share = inner.limits.get(route).map_or(0, |l| l.share);
            let free = share.saturating_sub(inner.count(&Slot::Route(route.clone())));
            if !inner.in_turn(route, place.seq, free) {
                return Err(Full::Route);
            }
            slots.push(Slot::Route(route.clone()));
            slots.push(Slot::RouteKey(route.clone(), key));
        }
        if let Some(share) = key_share {
            if inner.count(&Slot::Key(key)) >= share {
                return Err(Full::Key);
            }
            slots.push(Slot::Key(key));
        }
        inner.take(&slots);
        if let Some(place) = place {
            // Served: no longer a waiter (its `Place` has nothing left to remove), so that a
            // waiter checking before the place is dropped does not count it for a slot again.
            inner.leave(&place.route, place.seq);
            inner.turn(&place.route, key);
        }
        Ok(RunningGuard {
            running: self.clone(),
            slots,
        })
    }
}

pub(crate) fn slots_of(req: &AdmitRequest) -> Vec<Slot> {
    let mut slots = vec![];
    if req.route_cap.is_some() {
        slots.push(Slot::Route(req.route.clone()));
        slots.push(Slot::RouteKey(req.route.clone(), short_key(&req.key)));
    }
    if req.key_cap.is_some() {
        slots.push(Slot::Key(short_key(&req.key)));
    }
    slots
}

#[cfg(test)]
mod tests;
