//! Budget slices (`store.slices`, off by default): a busy key spends most of its requests
//! without a round trip.
//!
//! A key whose requests come fast reserves a *slice* of its budget in Redis, in the same
//! atomic `admit` call that admits a request (`slice` extra units, granted only while every
//! budget keeps a `floor` of a quarter of itself), and spends it here. Redis keeps the slice
//! as a *hold* of this instance (the key's `t{…}h` hash, see `lua/store/common.lua`): it counts as
//! charged in every budget of the key and does not drain. What this instance spent of it is
//! charged to the budget's level (and starts draining) only when the hold is settled: by the
//! key's next call to Redis, by the sweeper once the key went idle, on reload and on exit. So
//! no unit drains before it was admitted: the fleet never admits more than its budgets allow,
//! not over any period and not within a burst (`max_cost`), while each unit spent locally
//! drains a little later than on the exact path (the key's headers show up to a slice's worth
//! of drain less). A hold whose instance died is charged in full once it expires; a settling
//! that still comes (an outage outlasted the hold) gives back what was not spent, as far as it
//! has not drained since (Redis keeps the expired hold as a tombstone). Settling is idempotent
//! (a settled hold is gone), so one that may or may not have run is sent again.
//! So that light traffic stays exact and one instance cannot sit on units another needs:
//!
//! - only requests without in-flight caps, route-shared budgets or `max_delay` take part
//!   ([`eligible`]); the others are decided by Redis alone, as before;
//! - a key's first reservation asks for nothing; the size doubles (from the cost) while slices
//!   run out within half their lifetime, halves when one expired unspent, and never passes
//!   `max_cost / (8 × fleet_size)` of any budget; a request that arrives while its key's
//!   reservation is in flight is decided exactly, so an instance holds one slice per key;
//! - a slice is spent for [`LIFETIME`] at most from when it was asked for (Redis keeps the
//!   hold for [`HOLD_TTL`], longer): an outage is seen within that.
//!
//! The headers of a locally spent request are what Redis would show if this instance gave its
//! slice back now: the level Redis stored at the reservation, drained since, plus the units
//! held, minus those this instance has not spent.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::budget::{self, Figure, Figures, Limit, Outcome, State, Verdict, MAX_BUDGETS};
use crate::store::{lock, short_key, AdmitRequest, Bucket, Extra, KeyMap};

/// Longest a slice may be spent after it was asked for.
pub(super) const LIFETIME: Duration = Duration::from_millis(500);
/// How long Redis keeps a hold that is not settled: past every local spend of it, whatever
/// the difference between this instance's clock and Redis `TIME`.
pub(super) const HOLD_TTL: Duration = Duration::from_millis(1500);
/// How often idle keys' expired slices are settled.
pub(super) const SWEEP_EVERY: Duration = Duration::from_millis(100);
/// How long a settling that failed is sent again (the store is unreachable); after that the
/// hold expires in Redis and is charged in full (never over budget).
const SETTLE_FOR: Duration = Duration::from_secs(30);

const SHARDS: usize = 32;

/// A hold's id: this instance's (random) id, then a sequence number; 0 is none.
pub(super) type HoldId = u128;

/// The field of hold `id` in the key's holds (`""` for none).
pub(super) fn hold_field(id: HoldId) -> String {
    if id == 0 {
        String::new()
    } else {
        format!("{id:032x}")
    }
}

/// Where a key's slices live in Redis: its holds, and its budgets (keys and limits).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Place {
    pub holds: String,
    pub budgets: Vec<(String, Limit)>,
}

/// True for a request that slices may serve: none of its budgets is shared with other keys
/// or holds requests (`max_delay`), and it takes no in-flight slot.
pub(super) fn eligible(req: &AdmitRequest) -> bool {
    req.key_cap.is_none()
        && req.route_cap.is_none()
        && req.also.iter().all(|e| matches!(e.bucket, Bucket::Key(_)))
        && req.limits().all(|l| l.max_delay == 0)
}

/// Units that must stay in a budget after a slice is taken from it.
pub(super) fn floor(limit: &Limit) -> u64 {
    limit.max_cost() / 4
}

/// What a request asks of Redis besides its own cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Ask {
    /// Extra units wanted (0: an exact call), to be held as `grant`.
    pub slice: u64,
    pub grant: HoldId,
    /// This instance's last hold of the key (0: none), settled before the decision, with its
    /// units not spent and when it was asked for.
    pub settle: HoldId,
    pub unspent: u64,
    settle_at: Option<Instant>,
    pub settled: Grant,
    /// This call is the key's reservation, which sets the next size (others meanwhile ask
    /// for the size in force).
    asker: bool,
    /// When it was asked: a grant's life here starts then, before Redis's clock saw it.
    at: Option<Instant>,
    /// The entry it was asked of (`Entry::id`, never 0): its answer goes into that entry only.
    entry: u64,
}

/// What an `admit` reply says beyond the decision: the slice granted, and the stored levels
/// and held ticks at Redis `TIME`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Seen {
    pub granted: u64,
    pub now_us: u64,
    pub levels: [u64; MAX_BUDGETS],
    pub held: [u64; MAX_BUDGETS],
}

/// This instance's slices, by key.
#[derive(Debug)]
pub(super) struct Slices {
    shards: Box<[Mutex<KeyMap<Entry>>]>,
    fleet_size: u64,
    /// Hold ids are this (random, per instance) in the high half, a sequence in the low.
    instance: u64,
    next_hold: AtomicU64,
    /// Holds taken out of the table (a reload, a changed budget, a failed call, an idle
    /// key), until they reached Redis.
    returns: Returns,
    sweeping: AtomicBool,
}

impl Slices {
    pub(super) fn new(fleet_size: u32, instance: u64) -> Self {
        Slices {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            fleet_size: fleet_size.max(1) as u64,
            instance,
            next_hold: AtomicU64::new(1),
            returns: Returns::default(),
            sweeping: AtomicBool::new(false),
        }
    }

    fn shard(&self, k: u128) -> std::sync::MutexGuard<'_, KeyMap<Entry>> {
        lock(&self.shards[(k as usize) % SHARDS])
    }

    fn new_hold(&self) -> HoldId {
        ((self.instance as u128) << 64) | self.next_hold.fetch_add(1, Ordering::Relaxed) as u128
    }

    /// Takes `req.cost` from the key's live slice, if it holds that much: the admission's
    /// figures and the hold it was spent from, or `None` (ask Redis).
    pub(super) fn spend(&self, req: &AdmitRequest, now: Instant) -> Option<(Outcome, HoldId)> {
        let mut shard = self.shard(short_key(&req.key));
        let e = shard.get_mut(&short_key(&req.key))?;
        if e.left < req.cost || e.expired(now) || !e.serves(req) {
            return None;
        }
        e.left -= req.cost;
        Some((e.outcome(now), e.hold))
    }

    /// A request spent from `hold` is refunded: its cost goes back into the slice if that is
    /// still the key's live hold here. False: it is not (settled, being settled, or past its
    /// life, when Redis may charge it as expired before the sweeper settles it); refund it in
    /// Redis.
    pub(super) fn unspend(&self, req: &AdmitRequest, hold: HoldId, now: Instant) -> bool {
        let k = short_key(&req.key);
        let mut shard = self.shard(k);
        match shard.get_mut(&k) {
            Some(e) if e.hold == hold && e.serves(req) && !e.expired(now) => {
                e.left = e.left.saturating_add(req.cost);
                true
            }
            _ => false,
        }
    }

    /// What a request going to Redis asks for: the key's next slice (if this request is its
    /// reservation), and the settling of its last one.
    pub(super) fn ask(&self, req: &AdmitRequest, now: Instant) -> Ask {
        let k = short_key(&req.key);
        let mut shard = self.shard(k);
        let stale = shard.get(&k).filter(|e| !e.serves(req)).is_some();
        if stale {
            // The key's budgets changed (a reload): its old slice goes back where it came from.
            if let Some(settle) = shard.remove(&k).and_then(|mut old| old.settle()) {
                self.settle_later(settle);
            }
        }
        let Some(e) = shard.get_mut(&k) else {
            // The key's first reservation asks for nothing: light traffic stays exact.
            // Numbered as holds are: unique in this instance.
            let entry = self.next_hold.fetch_add(1, Ordering::Relaxed);
            shard.insert(k, Entry::first(req, now, entry));
            return Ask {
                asker: true,
                at: Some(now),
                entry,
                ..Ask::default()
            };
        };
        let settle_at = (e.hold != 0).then_some(e.granted_at);
        let (settle, unspent) = (std::mem::take(&mut e.hold), std::mem::take(&mut e.left));
        let settled = std::mem::take(&mut e.grant);
        if e.asking(now) {
            // Another request of the key is reserving: this one is decided exactly, so that
            // this instance never holds more than one slice of a key.
            return Ask {
                settle,
                unspent,
                settle_at,
                settled,
                at: Some(now),
                entry: e.id,
                ..Ask::default()
            };
        }
        e.size = e.next_size(req.cost, unspent, now, self.fleet_size);
        e.reserved = now;
        e.asking = Some(now);
        // A slice smaller than this request's cost would not serve the next like it.
        let slice = if e.size >= req.cost { e.size } else { 0 };
        Ask {
            slice,
            grant: if slice > 0 { self.new_hold() } else { 0 },
            settle,
            unspent,
            settle_at,
            settled,
            asker: true,
            at: Some(now),
            entry: e.id,
        }
    }

    /// Takes in Redis's answer to a call made with `ask`: the slice granted (if any) becomes
    /// spendable, and the levels it reports become the key's mirror. For an admission, its
    /// figures as this instance shows them (its slice counted as handed back). `place` names
    /// the key's holds and budgets in Redis, to settle a grant some day (called at the key's
    /// first).
    pub(super) fn settle(
        &self,
        req: &AdmitRequest,
        ask: Ask,
        seen: &Seen,
        admitted: bool,
        now: Instant,
        place: impl FnOnce() -> Place,
    ) -> Option<Outcome> {
        let k = short_key(&req.key);
        let mut shard = self.shard(k);
        let Some(e) = shard
            .get_mut(&k)
            .filter(|e| e.serves(req) && ask.entry == e.id)
        else {
            // Handed back meanwhile (a reload, a charge beyond it: `retire`): what was granted
            // is never spent here.
            if seen.granted > 0 {
                self.settle_later(Settle::unspent(place(), ask.grant, seen.granted));
            }
            return None;
        };
        e.done_asking(&ask);
        if seen.granted > 0 {
            if e.place.budgets.is_empty() {
                e.place = place();
            }
            // One asker at a time: no other hold is live here. Should one be, it is settled.
            if let Some(old) = e.settle() {
                self.settle_later(old);
            }
            e.hold = ask.grant;
            e.left = seen.granted;
            e.granted_at = ask.at.unwrap_or(now);
            e.grant = Grant {
                units: seen.granted,
                redis_us: seen.now_us,
                at: Some(e.granted_at),
            };
        }
        // Replies may cross: the mirror keeps the latest word of Redis.
        if seen.now_us >= e.redis_at_us {
            e.levels = seen.levels;
            e.held = seen.held;
            e.redis_at_us = seen.now_us;
            e.seen = now;
        }
        admitted.then(|| e.outcome(now))
    }

    /// A call made with `ask` failed, and the next request may reserve again. The hold it
    /// settled is this instance's again if the call surely did not `run` (the breaker was
    /// open, no connection) and the hold is still within its lifetime: Redis still holds it.
    /// Else it is settled again by the sweeper (idempotent: if the call did run, that is a
    /// no-op), and so is the hold the call may have granted.
    pub(super) fn failed(
        &self,
        req: &AdmitRequest,
        ask: Ask,
        run: bool,
        now: Instant,
        place: Place,
    ) {
        let k = short_key(&req.key);
        let live = ask
            .settle_at
            .is_some_and(|t| now.saturating_duration_since(t) < LIFETIME);
        // The hold the call settled, back in the key's entry if it is still this instance's.
        let restored = {
            let mut shard = self.shard(k);
            shard
                .get_mut(&k)
                .filter(|e| e.serves(req) && ask.entry == e.id)
                .is_some_and(|e| {
                    e.done_asking(&ask);
                    if e.place.budgets.is_empty() {
                        e.place = place.clone();
                    }
                    let restore = ask.settle != 0 && !run && live && e.hold == 0;
                    if restore {
                        e.hold = ask.settle;
                        e.left = ask.unspent;
                        e.granted_at = ask.settle_at.unwrap_or(now);
                        e.grant = ask.settled;
                    }
                    restore
                })
        };
        if ask.settle != 0 && !restored {
            self.settle_later(Settle {
                place: place.clone(),
                id: ask.settle,
                unspent: ask.unspent,
                granted: ask.settled,
            });
        }
        if run && ask.slice > 0 {
            self.settle_later(Settle::unspent(place, ask.grant, ask.slice));
        }
    }

    /// A reservation whose request went away before its answer: what it took and what it may
    /// have been granted are settled by the sweeper, as for a call that may have run. The key's
    /// reservation stays in flight (until its lifetime): the dropped call may still be
    /// granting a slice, and another now would hold two.
    pub(super) fn abandoned(&self, req: &AdmitRequest, ask: Ask, now: Instant, place: Place) {
        let ask = Ask {
            asker: false,
            ..ask
        };
        self.failed(req, ask, true, now, place);
    }

    /// Units of the key's slice not spent yet, if it was taken under `limit` (for
    /// `/admin/keys/{id}`: they are held in Redis but still this instance's to spend).
    pub(super) fn unspent(&self, key: &crate::identity::KeyHash, limit: &Limit) -> u64 {
        let k = short_key(key);
        self.shard(k)
            .get(&k)
            .filter(|e| e.limit == *limit)
            .map_or(0, |e| e.left)
    }

    /// The key was charged in Redis beyond what its slice here knows (a stated cost's extra
    /// units, a write-back): the slice is handed back, so that the key's next request is
    /// decided by Redis, which sees the charge (a key in debt is refused at once there).
    pub(super) fn retire(&self, key: &crate::identity::KeyHash) {
        let k = short_key(key);
        let removed = self.shard(k).remove(&k);
        if let Some(s) = removed.and_then(|mut e| e.settle()) {
            self.settle_later(s);
        }
    }

    /// Queues a hold for the sweeper to settle.
    pub(super) fn settle_later(&self, s: Settle) {
        self.returns
            .queue(std::iter::once((s, Instant::now() + SETTLE_FOR)));
    }

    /// The settlings queued for the key whose holds are `holds` (named only if any is
    /// queued): sent before the key's next decision, so that it sees them — above all a
    /// hold Redis lost, whose spent units it then charges.
    pub(super) fn pending(&self, holds: impl FnOnce() -> String) -> Vec<Settle> {
        self.returns.pending(holds)
    }

    /// `s` reached Redis (sent by the sweeper or by a request of its key): it leaves the
    /// queue.
    pub(super) fn settled(&self, s: &Settle) {
        self.returns.settled(s);
    }

    /// Takes every slice out of the table (a reload, an exit): nothing of them is spent any
    /// more; the returned holds are to be settled.
    pub(super) fn hand_back_all(&self) -> Vec<Settle> {
        let mut out = self.returns.drain();
        for shard in self.shards.iter() {
            for (_, mut e) in lock(shard).drain() {
                out.extend(e.settle());
            }
        }
        out
    }

    /// Moves every slice to the settling queue (a reload): the sweeper sends them.
    pub(super) fn retire_all(&self) {
        let deadline = Instant::now() + SETTLE_FOR;
        let all = self.hand_back_all();
        self.returns.queue(all.into_iter().map(|s| (s, deadline)));
    }

    /// One sweep: the slices of keys idle past their lifetime leave the table, and they (and
    /// earlier handed-back holds) are returned to be settled — a spent one too, so that its
    /// units start draining now. Settlings past their deadline are dropped (the hold expires
    /// in Redis and is charged in full: never over budget).
    pub(super) fn sweep(&self, now: Instant) -> Vec<(Settle, Instant)> {
        let mut out = self.returns.take(now);
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            let idle: Vec<u128> = shard
                .iter()
                .filter(|(_, e)| e.expired(now) && !e.asking(now))
                .map(|(k, _)| *k)
                .collect();
            for k in idle {
                if let Some(s) = shard.remove(&k).and_then(|mut e| e.settle()) {
                    out.push((s, now + SETTLE_FOR));
                }
            }
        }
        self.returns.sending(&out);
        out
    }

    /// Settlings that did not reach Redis, for the next sweep.
    pub(super) fn retry(&self, again: Vec<(Settle, Instant)>) {
        self.returns.retry(again);
    }

    /// True when the caller must start the sweeper (none runs).
    pub(super) fn start_sweeping(&self) -> bool {
        // Read first: the common answer ("it runs") then writes no shared cache line.
        !self.sweeping.load(Ordering::Acquire) && !self.sweeping.swap(true, Ordering::AcqRel)
    }

    /// No sweeper can run (no runtime to spawn it on): the next answer tries again.
    pub(super) fn sweeper_gone(&self) {
        self.sweeping.store(false, Ordering::Release);
    }

    /// The sweeper stops when there is nothing left to sweep. False if it must go on: not
    /// empty, or an entry arrived while it was stopping (and it took the job back).
    pub(super) fn stop_sweeping(&self) -> bool {
        if !self.is_empty() {
            return false;
        }
        self.sweeping.store(false, Ordering::Release);
        let arrived = !self.is_empty();
        !(arrived && self.start_sweeping())
    }

    fn is_empty(&self) -> bool {
        self.returns.is_empty() && self.shards.iter().all(|s| lock(s).is_empty())
    }
}

mod entry;
mod settling;
use entry::Entry;
use settling::Returns;
pub(super) use settling::{if_lost, Grant, IfLost, Settle};

#[cfg(test)]
mod tests;
