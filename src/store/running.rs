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

use std::collections::HashMap;
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
    /// The key's local share of the route (`max_in_flight_per_key` / fleet), if any.
    share: Option<u32>,
}

impl Inner {
    fn count(&self, s: &Slot) -> u32 {
        self.counts.get(s).copied().unwrap_or(0)
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
        // Per key: slots handed out in this pass, and when the last was.
        let mut given: HashMap<u128, (u32, u64)> = HashMap::new();
        let mut handed: Vec<u64> = Vec::new();
        let mut now = self.seq;
        for _ in 0..free {
            // (running, weight, waiting since, the waiter's seq, its key)
            let mut best: Option<(u64, u64, u64, u64, u128)> = None;
            let mut seen: Vec<u128> = Vec::new();
            for t in turns {
                // Only a key's oldest waiter still waiting competes.
                if handed.contains(&t.seq) || seen.contains(&t.key) {
                    continue;
                }
                seen.push(t.key);
                let (extra, last_given) = given.get(&t.key).copied().unwrap_or_default();
                let running = self.count(&Slot::RouteKey(route.clone(), t.key)) + extra;
                if t.share.is_some_and(|share| running >= share) {
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
            handed.push(next);
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
        let mut key = None;
        if let Some(turns) = inner.waiting.get_mut(&self.route) {
            key = turns.iter().find(|t| t.seq == self.seq).map(|t| t.key);
            turns.retain(|t| t.seq != self.seq);
            if turns.is_empty() {
                inner.waiting.remove(&self.route);
            }
        }
        if let Some(key) = key.filter(|k| !inner.waits(&self.route, *k)) {
            inner.turns.remove(&(self.route.clone(), key));
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

    /// Joins the waiters of `route` for its local share (`fair.per_key` already divided).
    pub(crate) fn queue(self: &Arc<Self>, route: &Arc<str>, key: u128, fair: Fair) -> Place {
        let mut inner = lock(&self.inner);
        inner.seq += 1;
        let seq = inner.seq;
        inner.waiting.entry(route.clone()).or_default().push(Turn {
            seq,
            key,
            weight: fair.weight,
            share: fair.per_key,
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

    /// Counts a request if the route has room within `route_share` and it is `place`'s turn,
    /// and its key is below `key_share` (its plan's cap); else says which is full.
    pub(crate) fn try_take(
        self: &Arc<Self>,
        req: &AdmitRequest,
        place: Option<&Place>,
        route_share: u32,
        key_share: Option<u32>,
    ) -> Result<RunningGuard, Full> {
        let mut inner = lock(&self.inner);
        let key = short_key(&req.key);
        let mut slots = vec![];
        if let Some(place) = place {
            let route = &place.route;
            let free = route_share.saturating_sub(inner.count(&Slot::Route(route.clone())));
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
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::budget::Limit;

    fn req(route: &Arc<str>, key: u8) -> AdmitRequest {
        AdmitRequest {
            key: [key; 32],
            limit: Limit::new(120, Duration::from_secs(3600), Duration::ZERO).unwrap(),
            also: vec![],
            cost: 1,
            key_cap: None,
            route: route.clone(),
            route_cap: Some(1),
            queue_timeout: Duration::ZERO,
            fair: Default::default(),
        }
    }

    fn fair(weight: u32, per_key: Option<u32>) -> Fair {
        Fair {
            weight,
            per_key,
            ..Fair::default()
        }
    }

    #[test]
    fn the_key_running_fewest_goes_first_then_the_oldest() {
        let running = Arc::new(Running::default());
        let route: Arc<str> = "/r".into();
        let (a, b) = (req(&route, 1), req(&route, 2));
        let ka = short_key(&a.key);
        let kb = short_key(&b.key);
        // a runs one already; two of a's wait, then one of b's.
        let held = running.track(slots_of(&a));
        let a1 = running.queue(&route, ka, fair(1, None));
        let a2 = running.queue(&route, ka, fair(1, None));
        let b1 = running.queue(&route, kb, fair(1, None));
        assert_eq!(running.waiting("/r"), 3);
        // Room for one more (share 2): b's turn, though it came last.
        assert_eq!(
            running.try_take(&a, Some(&a1), 2, None).err(),
            Some(Full::Route)
        );
        let gb = running.try_take(&b, Some(&b1), 2, None).unwrap();
        drop(b1);
        // Full at 2.
        assert_eq!(
            running.try_take(&a, Some(&a1), 2, None).err(),
            Some(Full::Route)
        );
        drop(held);
        // a's own requests in arrival order.
        assert_eq!(
            running.try_take(&a, Some(&a2), 2, None).err(),
            Some(Full::Route)
        );
        let ga = running.try_take(&a, Some(&a1), 2, None).unwrap();
        drop((a1, ga, gb));
        assert!(running.try_take(&a, Some(&a2), 2, None).is_ok());
    }

    #[test]
    fn with_one_slot_equals_take_turns() {
        let running = Arc::new(Running::default());
        let route: Arc<str> = "/r".into();
        let (a, b, c) = (req(&route, 1), req(&route, 2), req(&route, 3));
        let (ka, kb, kc) = (short_key(&a.key), short_key(&b.key), short_key(&c.key));
        // a holds the only slot; two of a's wait, then two of b's, then one of c's.
        let held = running.track(slots_of(&a));
        let a1 = running.queue(&route, ka, fair(1, None));
        let _a2 = running.queue(&route, ka, fair(1, None));
        let b1 = running.queue(&route, kb, fair(1, None));
        let _b2 = running.queue(&route, kb, fair(1, None));
        let c1 = running.queue(&route, kc, fair(1, None));
        drop(held);
        // a freed it: b's turn (waiting since before c).
        let full = Some(Full::Route);
        assert_eq!(running.try_take(&a, Some(&a1), 1, None).err(), full);
        assert_eq!(running.try_take(&c, Some(&c1), 1, None).err(), full);
        let gb = running.try_take(&b, Some(&b1), 1, None).unwrap();
        drop((b1, gb));
        // b freed it: c's turn (waiting since before a last freed a slot), not a's head.
        assert_eq!(running.try_take(&a, Some(&a1), 1, None).err(), full);
        let gc = running.try_take(&c, Some(&c1), 1, None).unwrap();
        drop((c1, gc));
        assert!(running.try_take(&a, Some(&a1), 1, None).is_ok());
    }

    #[test]
    fn weights_and_shares_decide_whose_turn_it_is() {
        let running = Arc::new(Running::default());
        let route: Arc<str> = "/r".into();
        let (a, b) = (req(&route, 1), req(&route, 2));
        let (ka, kb) = (short_key(&a.key), short_key(&b.key));
        // a (weight 2) runs 1, b (weight 1) runs 1: a's 1/2 beats b's 1/1.
        let _ra = running.track(slots_of(&a));
        let _rb = running.track(slots_of(&b));
        let b1 = running.queue(&route, kb, fair(1, None));
        let a1 = running.queue(&route, ka, fair(2, None));
        assert_eq!(
            running.try_take(&b, Some(&b1), 3, None).err(),
            Some(Full::Route)
        );
        let _ga = running.try_take(&a, Some(&a1), 3, None).unwrap();
        drop(a1);
        // A key at its share of the route waits and lets the others by.
        let a2 = running.queue(&route, ka, fair(2, Some(2)));
        assert_eq!(
            running.try_take(&a, Some(&a2), 9, None).err(),
            Some(Full::Route)
        );
        assert!(running.try_take(&b, Some(&b1), 9, None).is_ok());
        // The key's own cap refuses.
        let _one = running.try_take(&b, None, 9, Some(1)).unwrap();
        assert_eq!(
            running.try_take(&b, None, 9, Some(1)).err(),
            Some(Full::Key)
        );
    }

    #[test]
    fn free_slots_go_to_as_many_waiters_in_turn() {
        // Three keys join at once before any takes its turn (a request that cannot wait,
        // `queue_timeout: 0`, checks once): with two slots free the first two in turn take
        // one each, whichever of them checks first; the third waits.
        let running = Arc::new(Running::default());
        let route: Arc<str> = "/r".into();
        let (a, b, c) = (req(&route, 1), req(&route, 2), req(&route, 3));
        let pa = running.queue(&route, short_key(&a.key), fair(1, None));
        let pb = running.queue(&route, short_key(&b.key), fair(1, None));
        let pc = running.queue(&route, short_key(&c.key), fair(1, None));
        let full = Some(Full::Route);
        assert_eq!(running.try_take(&c, Some(&pc), 2, None).err(), full);
        let gb = running.try_take(&b, Some(&pb), 2, None).unwrap();
        drop(pb);
        assert_eq!(running.try_take(&c, Some(&pc), 2, None).err(), full);
        let ga = running.try_take(&a, Some(&pa), 2, None).unwrap();
        drop(pa);
        assert_eq!(running.try_take(&c, Some(&pc), 2, None).err(), full);
        drop(gb);
        let gc = running.try_take(&c, Some(&pc), 2, None).unwrap();
        drop((pc, ga));
        // c runs 1 of 4: three free. In turn: a1, b1 (none running, a1 first), then b2 —
        // not a2, a being at its share of 1 once a1 runs.
        let a1 = running.queue(&route, short_key(&a.key), fair(1, Some(1)));
        let a2 = running.queue(&route, short_key(&a.key), fair(1, Some(1)));
        let b1 = running.queue(&route, short_key(&b.key), fair(1, None));
        let b2 = running.queue(&route, short_key(&b.key), fair(1, None));
        assert_eq!(running.try_take(&a, Some(&a2), 4, None).err(), full);
        let gb2 = running.try_take(&b, Some(&b2), 4, None).unwrap();
        drop(b2);
        assert_eq!(running.try_take(&a, Some(&a2), 4, None).err(), full);
        let ga1 = running.try_take(&a, Some(&a1), 4, None).unwrap();
        drop(a1);
        let gb1 = running.try_take(&b, Some(&b1), 4, None).unwrap();
        drop(b1);
        // Full at 4; a2 waits for a slot and for a's share.
        assert_eq!(running.try_take(&a, Some(&a2), 5, None).err(), full);
        drop(gc);
        assert_eq!(running.try_take(&a, Some(&a2), 4, None).err(), full);
        drop(ga1);
        assert!(running.try_take(&a, Some(&a2), 4, None).is_ok());
        drop((gb1, gb2));
    }
}
