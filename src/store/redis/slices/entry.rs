//! One key's entry in the slice table.

use std::time::Instant;

use super::*;

/// One key's slice (possibly spent) and what the next one should be.
#[derive(Debug)]
pub(super) struct Entry {
    /// The budget set the slice was taken from: a reload that changes it never spends it.
    pub(super) limit: Limit,
    pub(super) also: Vec<Extra>,
    /// Where its holds and budgets are in Redis (named at the key's first grant: a key that
    /// never gets one costs no more than its entry).
    pub(super) place: Place,
    /// The hold in Redis not settled yet (0: none), its units not spent, and the grant.
    pub(super) hold: HoldId,
    pub(super) left: u64,
    pub(super) grant: Grant,
    /// The last levels and held ticks Redis reported for these budgets, at its `TIME`, seen
    /// here at `seen`.
    pub(super) levels: [u64; MAX_BUDGETS],
    pub(super) held: [u64; MAX_BUDGETS],
    pub(super) redis_at_us: u64,
    pub(super) seen: Instant,
    /// When the last reservation was asked for (what sizes the next one).
    pub(super) reserved: Instant,
    /// When the hold was asked for: its lifetime starts there, and nothing (a failed call
    /// handing it back, a new ask) moves it.
    pub(super) granted_at: Instant,
    /// Size of the last slice asked.
    pub(super) size: u64,
    /// A reservation is in flight since then.
    pub(super) asking: Option<Instant>,
    /// Its number: a reservation asked of an entry since taken out of the table
    /// (`Slices::retire`, a reload) never grants into its successor.
    pub(super) id: u64,
}

impl Entry {
    /// A key's entry at its first reservation, which asks for no slice: light traffic stays
    /// exact.
    pub(super) fn first(req: &AdmitRequest, now: Instant, id: u64) -> Entry {
        Entry {
            limit: req.limit,
            also: req.also.clone(),
            place: Place::default(),
            hold: 0,
            left: 0,
            grant: Grant::default(),
            levels: [0; MAX_BUDGETS],
            held: [0; MAX_BUDGETS],
            redis_at_us: 0,
            seen: now,
            reserved: now,
            granted_at: now,
            size: 0,
            asking: Some(now),
            id,
        }
    }

    /// The next slice's size: halved when the last went partly unspent over its whole
    /// lifetime, doubled (from one request's `cost`) when the key asks again within half of
    /// it, and at most an eighth of the smallest budget's share of the fleet.
    pub(super) fn next_size(&self, cost: u64, unspent: u64, now: Instant, fleet: u64) -> u64 {
        let age = now.saturating_duration_since(self.reserved);
        let size = if age >= LIFETIME && unspent > 0 {
            self.size / 2
        } else if age < LIFETIME / 2 {
            if self.size == 0 {
                cost
            } else {
                self.size.saturating_mul(2)
            }
        } else {
            self.size
        };
        let cap = self
            .limits()
            .map(|l| l.max_cost() / (8 * fleet))
            .min()
            .unwrap_or(0);
        size.min(cap)
    }

    pub(super) fn serves(&self, req: &AdmitRequest) -> bool {
        self.limit == req.limit && self.also == req.also
    }

    pub(super) fn limits(&self) -> impl Iterator<Item = &Limit> {
        std::iter::once(&self.limit).chain(self.also.iter().map(|e| &e.limit))
    }

    /// The budgets as Redis would show them at `now` if the slice were handed back unspent
    /// as it is.
    pub(super) fn outcome(&self, now: Instant) -> Outcome {
        let elapsed = now.saturating_duration_since(self.seen).as_micros() as u64;
        let at = self.redis_at_us.saturating_add(elapsed);
        let mut each = Figures::default();
        for (i, l) in self.limits().enumerate() {
            let state = State::of(l, self.levels[i], self.redis_at_us);
            let level = (budget::level_at(l, Some(state), at) + self.held[i])
                .saturating_sub(self.left.saturating_mul(l.per_unit));
            each.push(Figure {
                remaining: l.remaining(level),
                reset_us: l.reset_us(level),
            });
        }
        // The tightest budget speaks for all, as in Redis.
        let figs = each.as_slice();
        let tightest = crate::budget::tightest(figs.iter().map(|f| (f.remaining, f.reset_us)));
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

    pub(super) fn settle(&mut self) -> Option<Settle> {
        let id = std::mem::take(&mut self.hold);
        let unspent = std::mem::take(&mut self.left);
        let granted = std::mem::take(&mut self.grant);
        (id != 0).then(|| Settle {
            place: self.place.clone(),
            id,
            unspent,
            granted,
        })
    }

    /// `ask`, this entry's reservation, has its answer (an entry that replaced the one it
    /// was asked of keeps its own).
    pub(super) fn done_asking(&mut self, ask: &Ask) {
        if ask.asker && self.asking == ask.at {
            self.asking = None;
        }
    }

    pub(super) fn expired(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.granted_at) >= LIFETIME
    }

    pub(super) fn asking(&self, now: Instant) -> bool {
        // A reservation whose request went away never settles: it stops counting after a
        // lifetime (any real call has timed out by then).
        self.asking
            .is_some_and(|t| now.saturating_duration_since(t) < LIFETIME)
    }
}
