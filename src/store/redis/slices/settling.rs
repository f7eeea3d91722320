//! Holds on their way back to Redis: what a settling carries (and what it charges if Redis
//! lost the hold with its data), and the queue of those still to send.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{HoldId, Place, HOLD_TTL};
use crate::budget::Limit;
use crate::store::lock;
use crate::store::redis::script;

/// A hold handed back: `unspent` of its units were not spent here, the rest are charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::store::redis) struct Settle {
    pub place: Place,
    pub id: HoldId,
    pub unspent: u64,
    /// The hold as granted: its units, Redis `TIME` then and this instance's clock then.
    pub granted: Grant,
}

/// A hold as Redis granted it (all zero: one that spent nothing here, so that it does not
/// matter whether Redis still has it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(in crate::store::redis) struct Grant {
    pub units: u64,
    pub redis_us: u64,
    pub at: Option<Instant>,
}

/// What `settle` charges if Redis lost the hold with its data: `units` (less the unspent)
/// of a hold granted at Redis `TIME` `granted_us`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(in crate::store::redis) struct IfLost {
    pub units: u64,
    pub granted_us: u64,
}

impl Settle {
    /// A hold whose units were none of them spent here (a grant nobody will spend).
    pub(in crate::store::redis) fn unspent(place: Place, id: HoldId, units: u64) -> Settle {
        Settle {
            place,
            id,
            unspent: units,
            granted: Grant::default(),
        }
    }

    /// Its `settle` call at `now` (`id`: its hold's field, `slices::hold_field`).
    pub(in crate::store::redis) fn op<'a>(
        &'a self,
        id: &'a str,
        now: Instant,
    ) -> script::Settle<'a> {
        script::Settle {
            holds: &self.place.holds,
            budgets: &self.place.budgets,
            id,
            unspent: self.unspent,
            if_lost: self.if_lost(now),
        }
    }

    /// What to charge if Redis no longer has the hold: what was spent of it, as long as its
    /// hash could not have expired in Redis meanwhile (a hold no call saw expire counts as
    /// charged at its expiry, and its hash outlives it by two drains of a full bucket); past
    /// that it is not known, and nothing is charged (never twice).
    pub(in crate::store::redis) fn if_lost(&self, now: Instant) -> IfLost {
        if_lost(
            &self.granted,
            self.place.budgets.iter().map(|(_, l)| l),
            now,
        )
    }
}

/// What to charge of a hold granted as `grant` under `limits` if Redis no longer has it
/// (see [`Settle::if_lost`]).
pub(in crate::store::redis) fn if_lost<'a>(
    grant: &Grant,
    limits: impl Iterator<Item = &'a Limit>,
    now: Instant,
) -> IfLost {
    let Some(at) = grant.at else {
        return IfLost::default();
    };
    let drain_us = limits
        .map(|l| (2 * l.capacity).div_ceil(l.rate.max(1)))
        .max()
        .unwrap_or(0);
    if now.saturating_duration_since(at) < HOLD_TTL + Duration::from_micros(drain_us) {
        IfLost {
            units: grant.units,
            granted_us: grant.redis_us,
        }
    } else {
        IfLost::default()
    }
}

/// Settlings to send, with the moment to stop trying each: they stay findable (by their
/// key's requests) until they reached Redis, also while the sweeper is sending them.
#[derive(Debug, Default)]
pub(super) struct Returns {
    queued: Mutex<Vec<(Settle, Instant)>>,
    /// Those the sweeper took and is sending.
    sending: Mutex<Vec<Settle>>,
    /// How many of both: lets a request skip the locks when none is queued.
    len: AtomicUsize,
}

impl Returns {
    pub(super) fn queue(&self, more: impl IntoIterator<Item = (Settle, Instant)>) {
        lock(&self.queued).extend(more);
        self.count();
    }

    fn count(&self) {
        let n = lock(&self.queued).len() + lock(&self.sending).len();
        self.len.store(n, Ordering::Relaxed);
    }

    pub(super) fn pending(&self, holds: impl FnOnce() -> String) -> Vec<Settle> {
        if self.len.load(Ordering::Relaxed) == 0 {
            return vec![];
        }
        let holds = holds();
        let mut out: Vec<Settle> = lock(&self.queued)
            .iter()
            .map(|(s, _)| s)
            .filter(|s| s.place.holds == holds)
            .cloned()
            .collect();
        let sending = lock(&self.sending);
        out.extend(sending.iter().filter(|s| s.place.holds == holds).cloned());
        out
    }

    pub(super) fn settled(&self, s: &Settle) {
        lock(&self.queued).retain(|(r, _)| r.id != s.id);
        lock(&self.sending).retain(|r| r.id != s.id);
        self.count();
    }

    /// Every queued one (those the sweeper is sending are its own to finish).
    pub(super) fn drain(&self) -> Vec<Settle> {
        let out = lock(&self.queued).drain(..).map(|(s, _)| s).collect();
        self.count();
        out
    }

    /// The queued ones still worth sending at `now` (the others are dropped: their holds
    /// expire in Redis and are charged in full, never over budget), for the sweeper.
    pub(super) fn take(&self, now: Instant) -> Vec<(Settle, Instant)> {
        let out = std::mem::take(&mut *lock(&self.queued))
            .into_iter()
            .filter(|(_, deadline)| *deadline > now)
            .collect();
        self.count();
        out
    }

    /// The sweeper is sending `out`.
    pub(super) fn sending(&self, out: &[(Settle, Instant)]) {
        lock(&self.sending).extend(out.iter().map(|(s, _)| s.clone()));
        self.count();
    }

    /// Sent and failed: queued again.
    pub(super) fn retry(&self, again: Vec<(Settle, Instant)>) {
        lock(&self.sending).retain(|s| !again.iter().any(|(a, _)| a.id == s.id));
        self.queue(again);
    }

    pub(super) fn is_empty(&self) -> bool {
        lock(&self.queued).is_empty()
    }
}
