//! Redis's side of the budget slices, transcribed from `lua/store/` (`admit`, `settle`) for the unit tests:
//! what `admit`, `settle` and `unspend` do to a key's budgets and holds.

use super::super::*;

/// Redis's side of the slices, transcribed from the Lua: a key's budgets and its holds
/// (units, expiry µs, and for a tombstone of one that expired unsettled, the units its
/// expiry charged).
#[derive(Debug, Clone)]
pub(super) struct Model {
    pub(super) budgets: Vec<(Limit, Option<State>)>,
    holds: std::collections::HashMap<HoldId, (u64, u64, Option<u64>)>,
}

impl Model {
    pub(super) fn new(limits: &[Limit]) -> Self {
        Model {
            budgets: limits.iter().map(|l| (*l, None)).collect(),
            holds: Default::default(),
        }
    }

    /// `take_holds`: live units, and charges what the settled hold spent and expired ones
    /// (buried: a settling that comes later gives back what was not spent, as far as the
    /// expiry's charge has not drained since).
    fn take_holds(&mut self, settle: HoldId, unspent: u64, now_us: u64) -> u64 {
        const TOMBSTONE_US: u64 = 60_000_000;
        let mut live = 0;
        let mut charge = 0;
        // (units given back, units the expiry charged, when)
        let mut late = None;
        self.holds.retain(|id, (units, exp, charged)| {
            if *id == settle {
                charge += *units - unspent.min(*units);
                if let Some(c) = *charged {
                    late = Some((c.min(unspent), c, *exp - TOMBSTONE_US));
                }
                // An empty hold stays until its end (a lost one's tombstone, in the Lua).
                *units == 0 && charged.is_none()
            } else if *exp <= now_us {
                charge += *units;
                if *units > 0 {
                    *charged = Some(*units);
                    *units = 0;
                    *exp = now_us + TOMBSTONE_US;
                    true
                } else {
                    false
                }
            } else {
                live += *units;
                true
            }
        });
        if charge > 0 || late.is_some() {
            for (l, s) in self.budgets.iter_mut() {
                let mut level = budget::level_at(l, *s, now_us) + charge * l.per_unit;
                if let Some((back, charged, at)) = late {
                    let left = (charged * l.per_unit).saturating_sub(l.rate * (now_us - at));
                    level = level.saturating_sub((back * l.per_unit).min(left));
                }
                *s = Some(State::of(l, level, now_us));
            }
        }
        live
    }

    /// `settle`.
    pub(super) fn settle(&mut self, s: &Settle, now_us: u64) {
        self.take_holds(s.id, s.unspent, now_us);
    }

    /// `unspend`: out of the hold while it is there, else out of the budgets.
    pub(super) fn unspend(&mut self, id: HoldId, cost: u64, now_us: u64) {
        if let Some((units, _, _)) = self.holds.get_mut(&id).filter(|h| h.0 > 0) {
            *units = units.saturating_sub(cost);
            return;
        }
        for (l, s) in self.budgets.iter_mut() {
            *s = Some(State::of(
                l,
                budget::level_at(l, *s, now_us).saturating_sub(cost * l.per_unit),
                now_us,
            ));
        }
    }

    /// Units charged or held: what another instance is told is gone.
    pub(super) fn taken(&self, now_us: u64) -> u64 {
        let (l, s) = self.budgets[0];
        let held: u64 = self.holds.values().map(|(u, _, _)| u).sum();
        (budget::level_at(&l, s, now_us) + held * l.per_unit).div_ceil(l.per_unit)
    }

    /// `admit` of one request with its ask: whether it admitted, and what the reply says.
    pub(super) fn admit(&mut self, now_us: u64, cost: u64, ask: Ask) -> (bool, Seen) {
        let live = self.take_holds(ask.settle, ask.unspent, now_us);
        let levels: Vec<u64> = self
            .budgets
            .iter()
            .map(|(l, s)| budget::level_at(l, *s, now_us))
            .collect();
        let mut seen = Seen {
            now_us,
            ..Seen::default()
        };
        let fits = self
            .budgets
            .iter()
            .zip(&levels)
            .all(|((l, _), lv)| lv + (live + cost) * l.per_unit <= l.capacity);
        if !fits {
            for (i, ((l, _), lv)) in self.budgets.iter().zip(&levels).enumerate() {
                seen.levels[i] = *lv;
                seen.held[i] = live * l.per_unit;
            }
            return (false, seen);
        }
        let grant = ask.slice > 0
            && ask.grant != 0
            && self.budgets.iter().zip(&levels).all(|((l, _), lv)| {
                lv + (live + cost + ask.slice + floor(l)) * l.per_unit <= l.capacity
            });
        seen.granted = if grant { ask.slice } else { 0 };
        if grant {
            self.holds.insert(
                ask.grant,
                (ask.slice, now_us + HOLD_TTL.as_micros() as u64, None),
            );
        }
        for (i, ((l, s), lv)) in self.budgets.iter_mut().zip(&levels).enumerate() {
            let next = lv + cost * l.per_unit;
            *s = Some(State::of(l, next, now_us));
            seen.levels[i] = next;
            seen.held[i] = (live + seen.granted) * l.per_unit;
        }
        (true, seen)
    }
}
