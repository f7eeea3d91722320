//! Budget slices (`store.slices`, off by default): a busy key spends most of its requests
//! without a round trip.
//!
//! A key whose requests come fast reserves a *slice* of its budget in Redis, in the same
//! atomic `admit` call that admits a request (`slice` extra units, granted only while every
//! budget keeps a `floor` of a quarter of itself), and spends it here. Every unit admitted
//! here was charged in Redis first, so over any period the fleet admits no more than its
//! budgets allow from the level Redis had at its start. Within a burst it can admit more than
//! `max_cost`: Redis drains a held slice at the refill rate as if it had been spent, so a key
//! that bursts while slices are held gets its full bucket plus what is held — at most one
//! slice per key and instance (the cap below), `max_cost / 8` across the fleet. That is the
//! price of the option, and why it is off by default. What a slice did not spend goes back (`give_back` on the key's next reservation, or the `refund`
//! op from the sweeper once the key went idle). So that light traffic stays exact and one
//! instance cannot sit on units another needs:
//!
//! - only requests without in-flight caps, route-shared budgets or `max_delay` take part
//!   ([`eligible`]); the others are decided by Redis alone, as before;
//! - a key's first reservation asks for nothing; the size doubles (from the cost) while slices
//!   run out within half their lifetime, halves when one expired unspent, and never passes
//!   `max_cost / (8 × fleet_size)` of any budget; a request that arrives while its key's
//!   reservation is in flight is decided exactly, so an instance holds one slice per key;
//! - a slice lives [`LIFETIME`] at most: an outage is seen within that, and a reload or an exit
//!   hands every slice back.
//!
//! The headers of a locally spent request are what Redis would show if this instance gave its
//! slice back now: the level Redis stored at the reservation, drained since, minus the units
//! still held. On a single instance that is exactly the exact path's sequence.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::budget::{self, Figure, Figures, Limit, Outcome, State, Verdict, MAX_BUDGETS};
use crate::store::{lock, short_key, AdmitRequest, Bucket, Extra, KeyMap};

/// Longest a slice may be spent after it was granted.
pub(super) const LIFETIME: Duration = Duration::from_millis(500);
/// How often idle keys' expired slices are given back.
pub(super) const SWEEP_EVERY: Duration = Duration::from_millis(100);
/// How long a give-back that surely did not run is sent again (the store is unreachable).
const GIVE_BACK_FOR: Duration = Duration::from_secs(30);

const SHARDS: usize = 32;

/// Budgets (Redis keys and limits) and the units to give back to each.
pub(super) type GiveBack = (Vec<(String, Limit)>, u64);

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
    /// Extra units wanted (0: an exact call).
    pub slice: u64,
    /// Unspent units of this instance's last slice, returned before the decision.
    pub give_back: u64,
    /// This call is the key's reservation, which sets the next size (others meanwhile ask
    /// for the size in force).
    asker: bool,
}

/// What an `admit` reply says beyond the decision: the slice granted, and the stored levels
/// at Redis `TIME`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Seen {
    pub granted: u64,
    pub now_us: u64,
    pub levels: [u64; MAX_BUDGETS],
}

/// One key's slice (possibly spent) and what the next one should be.
#[derive(Debug)]
struct Entry {
    /// The budget set the slice was taken from: a reload that changes it never spends it.
    limit: Limit,
    also: Vec<Extra>,
    /// Their Redis keys, to give units back (named at the key's first grant: a key that never
    /// gets one costs no more than its entry).
    keys: Vec<(String, Limit)>,
    left: u64,
    /// The last levels Redis reported for these budgets, at its `TIME`, seen here at `seen`.
    levels: [u64; MAX_BUDGETS],
    redis_at_us: u64,
    seen: Instant,
    /// When the last reservation was asked for (what sizes the next one).
    reserved: Instant,
    /// When the units in `left` were granted: their lifetime starts there, and nothing (a
    /// failed call handing them back, a new ask) moves it.
    granted_at: Instant,
    /// Size of the last slice asked.
    size: u64,
    /// A reservation is in flight since then.
    asking: Option<Instant>,
}

impl Entry {
    fn serves(&self, req: &AdmitRequest) -> bool {
        self.limit == req.limit && self.also == req.also
    }

    fn limits(&self) -> impl Iterator<Item = &Limit> {
        std::iter::once(&self.limit).chain(self.also.iter().map(|e| &e.limit))
    }

    /// The budgets as Redis would show them at `now` if the slice were given back.
    fn outcome(&self, now: Instant) -> Outcome {
        let elapsed = now.saturating_duration_since(self.seen).as_micros() as u64;
        let at = self.redis_at_us.saturating_add(elapsed);
        let mut each = Figures::default();
        for (i, l) in self.limits().enumerate() {
            let state = State {
                level: self.levels[i],
                at_us: self.redis_at_us,
                rate: l.rate,
            };
            let level = budget::level_at(l, Some(state), at)
                .saturating_sub(self.left.saturating_mul(l.per_unit));
            each.push(Figure {
                remaining: l.remaining(level),
                reset_us: l.reset_us(level),
            });
        }
        // The tightest budget speaks for all (fewest left, the first of equals), as in Redis.
        let figs = each.as_slice();
        let mut tightest = 0;
        for (i, f) in figs.iter().enumerate() {
            if f.remaining < figs[tightest].remaining {
                tightest = i;
            }
        }
        let Figure {
            remaining,
            reset_us,
        } = figs[tightest];
        each.decisive = tightest as u8;
        Outcome {
            verdict: Verdict::Admit { delay_us: 0 },
            state: None,
            remaining,
            reset_us,
            each: if self.also.is_empty() {
                Figures::default()
            } else {
                each
            },
        }
    }

    fn expired(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.granted_at) >= LIFETIME
    }

    fn asking(&self, now: Instant) -> bool {
        // A reservation whose request went away never settles: it stops counting after a
        // lifetime (any real call has timed out by then).
        self.asking
            .is_some_and(|t| now.saturating_duration_since(t) < LIFETIME)
    }
}

/// This instance's slices, by key.
#[derive(Debug)]
pub(super) struct Slices {
    shards: Box<[Mutex<KeyMap<Entry>>]>,
    fleet_size: u64,
    /// Give-backs of slices taken out of the table (a reload, a changed budget), with the
    /// moment to stop trying.
    returns: Mutex<Vec<(GiveBack, Instant)>>,
    sweeping: AtomicBool,
}

impl Slices {
    pub(super) fn new(fleet_size: u32) -> Self {
        Slices {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            fleet_size: fleet_size.max(1) as u64,
            returns: Mutex::default(),
            sweeping: AtomicBool::new(false),
        }
    }

    fn shard(&self, k: u128) -> std::sync::MutexGuard<'_, KeyMap<Entry>> {
        lock(&self.shards[(k as usize) % SHARDS])
    }

    /// Takes `req.cost` from the key's live slice, if it holds that much: the admission's
    /// figures, or `None` (ask Redis).
    pub(super) fn spend(&self, req: &AdmitRequest, now: Instant) -> Option<Outcome> {
        let mut shard = self.shard(short_key(&req.key));
        let e = shard.get_mut(&short_key(&req.key))?;
        if e.left < req.cost || e.expired(now) || !e.serves(req) {
            return None;
        }
        e.left -= req.cost;
        Some(e.outcome(now))
    }

    /// What a request going to Redis asks for: the key's next slice (if this request is its
    /// reservation) and the unspent rest of its last one.
    pub(super) fn ask(&self, req: &AdmitRequest, now: Instant) -> Ask {
        let k = short_key(&req.key);
        let mut shard = self.shard(k);
        let stale = shard.get(&k).filter(|e| !e.serves(req)).is_some();
        if stale {
            // The key's budgets changed (a reload): its old slice goes back where it came from.
            if let Some(old) = shard.remove(&k) {
                self.give_back_later(old);
            }
        }
        let Some(e) = shard.get_mut(&k) else {
            // The key's first reservation asks for nothing: light traffic stays exact.
            shard.insert(
                k,
                Entry {
                    limit: req.limit,
                    also: req.also.clone(),
                    keys: Vec::new(),
                    left: 0,
                    levels: [0; MAX_BUDGETS],
                    redis_at_us: 0,
                    seen: now,
                    reserved: now,
                    granted_at: now,
                    size: 0,
                    asking: Some(now),
                },
            );
            return Ask {
                slice: 0,
                give_back: 0,
                asker: true,
            };
        };
        let give_back = std::mem::take(&mut e.left);
        if e.asking(now) {
            // Another request of the key is reserving: this one is decided exactly, so that
            // this instance never holds more than one slice of a key (at most the cap below:
            // what a burst can exceed the budget by while slices are held).
            return Ask {
                slice: 0,
                give_back,
                asker: false,
            };
        }
        let age = now.saturating_duration_since(e.reserved);
        let size = if age >= LIFETIME && give_back > 0 {
            e.size / 2
        } else if age < LIFETIME / 2 {
            if e.size == 0 {
                req.cost
            } else {
                e.size.saturating_mul(2)
            }
        } else {
            e.size
        };
        let cap = e
            .limits()
            .map(|l| l.max_cost() / (8 * self.fleet_size))
            .min()
            .unwrap_or(0);
        e.size = size.min(cap);
        e.reserved = now;
        e.asking = Some(now);
        Ask {
            // A slice smaller than this request's cost would not serve the next like it.
            slice: if e.size >= req.cost { e.size } else { 0 },
            give_back,
            asker: true,
        }
    }

    /// Takes in Redis's answer to a call made with `ask`: the slice granted (if any) becomes
    /// spendable, and the levels it reports become the key's mirror. For an admission, its
    /// figures as this instance shows them (its slice counted as given back). `keys` names
    /// the budgets in Redis, to give a grant back some day (called at the key's first).
    pub(super) fn settle(
        &self,
        req: &AdmitRequest,
        ask: Ask,
        seen: &Seen,
        admitted: bool,
        now: Instant,
        keys: impl FnOnce() -> Vec<(String, Limit)>,
    ) -> Option<Outcome> {
        let k = short_key(&req.key);
        let mut shard = self.shard(k);
        let Some(e) = shard.get_mut(&k).filter(|e| e.serves(req)) else {
            // Handed back meanwhile (a reload): what was granted is never spent here.
            if seen.granted > 0 {
                lock(&self.returns).push(((keys(), seen.granted), now + GIVE_BACK_FOR));
            }
            return None;
        };
        if ask.asker {
            e.asking = None;
        }
        if seen.granted > 0 && e.keys.is_empty() {
            e.keys = keys();
        }
        if seen.granted > 0 {
            // Units left over from before (a failed call's give-back kept) go with this
            // grant's lifetime only if they are still live; else they go back.
            if e.expired(now) && e.left > 0 {
                let stale = std::mem::take(&mut e.left);
                lock(&self.returns).push(((e.keys.clone(), stale), now + GIVE_BACK_FOR));
            }
            e.granted_at = now;
        }
        e.left = e.left.saturating_add(seen.granted);
        // Replies may cross: the mirror keeps the latest word of Redis.
        if seen.now_us >= e.redis_at_us {
            e.levels = seen.levels;
            e.redis_at_us = seen.now_us;
            e.seen = now;
        }
        admitted.then(|| e.outcome(now))
    }

    /// A call made with `ask` failed, and the next request may reserve again. What it gave
    /// back is this instance's again if the call surely did not `run` (the breaker was open,
    /// no connection): Redis still holds those units for it. If it may have run, they count
    /// as given (keeping them could spend them twice).
    pub(super) fn failed(&self, req: &AdmitRequest, ask: Ask, run: bool, now: Instant) {
        let k = short_key(&req.key);
        let mut shard = self.shard(k);
        let Some(e) = shard.get_mut(&k).filter(|e| e.serves(req)) else {
            return;
        };
        if ask.asker {
            e.asking = None;
        }
        if !run && ask.give_back > 0 {
            // Redis still holds them for this instance; spent only within their own lifetime,
            // else given back by the sweeper.
            if e.expired(now) {
                lock(&self.returns).push(((e.keys.clone(), ask.give_back), now + GIVE_BACK_FOR));
            } else {
                e.left = e.left.saturating_add(ask.give_back);
            }
        }
    }

    /// Units of the key's slice not spent yet, if it was taken under `limit` (for
    /// `/admin/keys/{id}`: they are charged in Redis but still this instance's to spend).
    pub(super) fn unspent(&self, key: &crate::identity::KeyHash, limit: &Limit) -> u64 {
        let k = short_key(key);
        self.shard(k)
            .get(&k)
            .filter(|e| e.limit == *limit)
            .map_or(0, |e| e.left)
    }

    fn give_back_later(&self, e: Entry) {
        if e.left > 0 {
            lock(&self.returns).push(((e.keys, e.left), Instant::now() + GIVE_BACK_FOR));
        }
    }

    /// Takes every slice out of the table (a reload, an exit): nothing of them is spent any
    /// more; the returned units are to be given back.
    pub(super) fn hand_back_all(&self) -> Vec<GiveBack> {
        let mut out: Vec<GiveBack> = lock(&self.returns).drain(..).map(|(g, _)| g).collect();
        for shard in self.shards.iter() {
            for (_, e) in lock(shard).drain() {
                if e.left > 0 {
                    out.push((e.keys, e.left));
                }
            }
        }
        out
    }

    /// Moves every slice to the give-back queue (a reload): the sweeper sends them.
    pub(super) fn retire_all(&self) {
        let deadline = Instant::now() + GIVE_BACK_FOR;
        let all = self.hand_back_all();
        lock(&self.returns).extend(all.into_iter().map(|g| (g, deadline)));
    }

    /// One sweep: the slices of keys idle past their lifetime leave the table, and what they
    /// (and earlier handed-back slices) did not spend is returned to be given back. Give-backs
    /// past their deadline are dropped (the key stays charged for them: never over budget).
    pub(super) fn sweep(&self, now: Instant) -> Vec<(GiveBack, Instant)> {
        let mut out: Vec<(GiveBack, Instant)> = std::mem::take(&mut *lock(&self.returns))
            .into_iter()
            .filter(|(_, deadline)| *deadline > now)
            .collect();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            let idle: Vec<u128> = shard
                .iter()
                .filter(|(_, e)| e.expired(now) && !e.asking(now))
                .map(|(k, _)| *k)
                .collect();
            for k in idle {
                if let Some(e) = shard.remove(&k) {
                    if e.left > 0 {
                        out.push(((e.keys, e.left), now + GIVE_BACK_FOR));
                    }
                }
            }
        }
        out
    }

    /// Give-backs that did not reach Redis, for the next sweep.
    pub(super) fn retry(&self, again: Vec<(GiveBack, Instant)>) {
        lock(&self.returns).extend(again);
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
        lock(&self.returns).is_empty() && self.shards.iter().all(|s| lock(s).is_empty())
    }
}

#[cfg(test)]
mod tests;
