//! The budget decision: GCRA in exact integer arithmetic.
//!
//! This is the one place the arithmetic lives. The memory store calls [`decide`]; the Redis
//! store's Lua script (`store/admit.lua`) is a line-by-line transcription of it, and tests drive
//! both with the same sequence to prove they agree.
//!
//! A budget of `max_cost` units per `window` is a bucket that drains at `max_cost / window`
//! units per µs. That rate is rarely a whole number, so time is measured in *ticks*: with
//! `window_us / max_cost = p / q` in lowest terms, one unit of cost adds `p` ticks to the
//! bucket's level and the level drains by `q` ticks per µs. Every quantity is then an integer:
//! no rounding drift at `1e8` units/s, and none at `1` unit/h. The bucket is full (no room) at
//! `capacity = window_us * q` ticks. A decision's levels stay below 2^52 (checked at config
//! load) so the Lua script, whose numbers are doubles, computes exactly the same integers. A
//! debt (a charge after the fact, a fallback's write-back) may go past that: it is kept, to
//! within a double's precision in Lua.

use std::time::Duration;

/// Largest level the arithmetic may reach; doubles are exact integers below 2^53.
const MAX_TICKS: u128 = 1 << 51;

/// GCRA parameters of one budget, derived from `max_cost`, `window` and `max_delay`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Ticks added per unit of cost (`p`).
    pub per_unit: u64,
    /// Ticks drained per µs (`q`).
    pub rate: u64,
    /// Level at which the bucket has no room left: `window_us * q` = `max_cost * p`.
    pub capacity: u64,
    /// How far past `capacity` a request may reserve and wait: `max_delay_us * q`.
    pub max_delay: u64,
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// A budget that GCRA cannot keep exactly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error("max_cost and window must be positive")]
    NotPositive,
    #[error("{max_cost} per {window_us}µs cannot be represented exactly (window / max_cost must reduce to a simpler fraction; try a rounder max_cost or window)")]
    NotRepresentable { max_cost: u128, window_us: u128 },
}

impl Limit {
    pub fn new(max_cost: u64, window: Duration, max_delay: Duration) -> Result<Limit, LimitError> {
        let window_us = window.as_micros();
        let max_cost = max_cost as u128;
        if max_cost == 0 || window_us == 0 {
            return Err(LimitError::NotPositive);
        }
        let g = gcd(window_us, max_cost);
        let (p, q) = (window_us / g, max_cost / g);
        let capacity = window_us * q;
        let delay = max_delay.as_micros() * q;
        if capacity + delay > MAX_TICKS {
            return Err(LimitError::NotRepresentable {
                max_cost,
                window_us,
            });
        }
        Ok(Limit {
            per_unit: p as u64,
            rate: q as u64,
            capacity: capacity as u64,
            max_delay: delay as u64,
        })
    }

    /// The same window with `1/n` of the budget: what one of `n` instances may spend on its
    /// own while the shared store is unreachable (`on_error: local`).
    pub fn fraction(&self, n: u32) -> Limit {
        Limit {
            per_unit: self.per_unit.saturating_mul(n.max(1) as u64),
            ..*self
        }
    }

    /// `max_delay` in µs (for display).
    pub fn max_delay_us(&self) -> u64 {
        self.max_delay / self.rate.max(1)
    }

    /// Whether a request of `cost` units can ever pass: it fits an empty bucket (held up to
    /// `max_delay`).
    pub fn holds(&self, cost: u64) -> bool {
        cost.saturating_mul(self.per_unit) <= self.capacity.saturating_add(self.max_delay)
    }

    /// Units that fit an empty bucket.
    pub fn max_cost(&self) -> u64 {
        self.capacity / self.per_unit
    }

    /// Whole units left at `level` (`RateLimit: r=`).
    pub fn remaining(&self, level: u64) -> u64 {
        self.capacity.saturating_sub(level) / self.per_unit
    }

    /// µs until a bucket at `level` is empty again (`RateLimit: t=`, and the Redis key's TTL).
    pub fn reset_us(&self, level: u64) -> u64 {
        div_ceil(level, self.rate)
    }

    /// A decision's figures once `cost` units went back into this bucket (a refund), as of
    /// that decision. Units left: `cost` more, up to `max_cost`, exact for a bucket that was not
    /// past its capacity; past it (a `max_delay` reservation, a debt) they come from the
    /// highest level `f.reset_us` allows, so never more than are left (at most one unit fewer
    /// below 1,000,000 units a second). Full again sooner by `cost`'s share of the window:
    /// within 1 µs (the figures round the level to whole µs), and 0 when the refund empties
    /// the bucket.
    pub fn given_back(&self, f: Figure, cost: u64) -> Figure {
        let back = cost.saturating_mul(self.per_unit);
        // The level is within one µs of draining of `reset_us`: the highest and the lowest
        // level with that reset.
        let highest = f.reset_us.saturating_mul(self.rate);
        let lowest = f
            .reset_us
            .saturating_sub(1)
            .saturating_mul(self.rate)
            .saturating_add(u64::from(f.reset_us > 0));
        let remaining = if f.remaining > 0 {
            f.remaining.saturating_add(cost).min(self.max_cost())
        } else {
            self.remaining(highest.saturating_sub(back))
        };
        Figure {
            remaining,
            reset_us: self.reset_us(lowest.saturating_sub(back)),
        }
    }
}

/// A bucket's stored state: its level (ticks) at a time (µs), and the ticks per unit and drain
/// rate that level was measured in, so a reload that changes the budget converts instead of
/// forgetting: the units spent are carried into the new budget (see [`level_at`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct State {
    pub level: u64,
    pub at_us: u64,
    pub rate: u64,
    /// Ticks per unit of the level; 0 for a state stored before tollgate kept it (a Redis
    /// value `level:at_us:rate`), which converts by its drain rate.
    pub per_unit: u64,
}

impl State {
    /// `level` ticks of `limit` at `at_us`.
    pub fn of(limit: &Limit, level: u64, at_us: u64) -> State {
        State {
            level,
            at_us,
            rate: limit.rate,
            per_unit: limit.per_unit,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Charged. Forward after `delay_us` (non-zero only with `max_delay`).
    Admit { delay_us: u64 },
    /// Not charged. The earliest a retry could be admitted is in `retry_after_us`.
    Reject { retry_after_us: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub verdict: Verdict,
    /// The state to store; `None` when nothing is to be written (a rejection, or a decision on
    /// several budgets: [`Joint::states`] has theirs).
    pub state: Option<State>,
    /// Whole units left after this decision (`RateLimit: r=`); of the decisive budget when
    /// there are several.
    pub remaining: u64,
    /// µs until the bucket is empty again (`RateLimit: t=` rounds it up to seconds).
    pub reset_us: u64,
    /// Every budget's figures when the request was decided on several; empty for one.
    pub each: Figures,
}

/// Most budgets one request is charged against: its plan's (at most [`MAX_PLAN_BUDGETS`])
/// and its route's shared budget. Fixed, so that an [`Outcome`] stays `Copy` and allocation-free.
pub const MAX_BUDGETS: usize = 5;
/// Most budgets a plan (or `rate_limits.default`) may list.
pub const MAX_PLAN_BUDGETS: usize = MAX_BUDGETS - 1;

/// One budget's figures after a decision (`RateLimit: r=…;t=…`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Figure {
    pub remaining: u64,
    pub reset_us: u64,
}

/// Every budget's figures of a decision on several, in the order they were given, and which
/// one decided: the one that refused, or (admitted) the tightest, with the fewest units left.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Figures {
    len: u8,
    each: [Figure; MAX_BUDGETS],
    /// Index of the budget the outcome's own `remaining`/`reset_us`/verdict describe.
    pub decisive: u8,
}

/// Which of several budgets' figures speak for all (`X-RateLimit-*`, and `r`/`t` of an
/// outcome): the tightest, with the fewest units left; of equals, the one full again last (its
/// reset is when every one of them is); then the first. `(remaining, reset_us)` each, in
/// order; 0 for none. The Lua script's `reply` transcribes it; keep the two in step.
pub fn tightest(figures: impl IntoIterator<Item = (u64, u64)>) -> usize {
    let mut best: Option<(usize, (u64, u64))> = None;
    for (i, (remaining, reset_us)) in figures.into_iter().enumerate() {
        if best.is_none_or(|(_, (r, t))| remaining < r || (remaining == r && reset_us > t)) {
            best = Some((i, (remaining, reset_us)));
        }
    }
    best.map_or(0, |(i, _)| i)
}

impl Figures {
    pub fn as_slice(&self) -> &[Figure] {
        &self.each[..self.len as usize]
    }

    /// Each budget's figures `us` later: `reset_us` that much shorter.
    pub fn later(&self, us: u64) -> Figures {
        let mut later = *self;
        for f in &mut later.each[..self.len as usize] {
            f.reset_us = f.reset_us.saturating_sub(us);
        }
        later
    }

    /// Adds one budget's figures; past [`MAX_BUDGETS`] they are dropped (the config refuses more).
    pub fn push(&mut self, f: Figure) {
        if let Some(slot) = self.each.get_mut(self.len as usize) {
            *slot = f;
            self.len += 1;
        }
    }
}

impl Outcome {
    pub fn admitted(&self) -> bool {
        matches!(self.verdict, Verdict::Admit { .. })
    }

    /// How long an admitted request waits for its reserved units (`max_delay`); 0 refused.
    pub fn delay_us(&self) -> u64 {
        match self.verdict {
            Verdict::Admit { delay_us } => delay_us,
            Verdict::Reject { .. } => 0,
        }
    }
}

fn div_ceil(a: u64, b: u64) -> u64 {
    a.div_ceil(b.max(1))
}

/// The level of `state` at `now_us`, in `limit`'s ticks. A clock that went backwards (another
/// instance's, or a failover to a Redis with a slower clock) drains nothing rather than panicking.
///
/// A state stored under another budget (a reload changed `max_cost` or `window`) carries the
/// units it holds into this one: a key that spent 120 of 120 a minute ago has spent 120 of the
/// new budget too, whether that is 120 an hour (no room until they drain, at the new rate) or
/// 240 a minute (120 left). Keeping the time until empty instead (what a stored GCRA arrival
/// time does) would give a key that just spent 120 a minute 118 more once the window became an
/// hour. A state without its ticks per unit (stored before they were kept) keeps its time
/// until empty.
pub fn level_at(limit: &Limit, state: Option<State>, now_us: u64) -> u64 {
    let Some(s) = state else { return 0 };
    let mut level = s.level;
    if s.per_unit != 0 {
        if s.per_unit != limit.per_unit {
            level = ((level as u128 * limit.per_unit as u128).div_ceil(s.per_unit as u128))
                .min(MAX_TICKS * 2) as u64;
        }
    } else if s.rate != limit.rate && s.rate != 0 {
        // Same time-until-empty, in the new rate's ticks.
        level = ((level as u128 * limit.rate as u128).div_ceil(s.rate as u128)).min(MAX_TICKS * 2)
            as u64;
    }
    let elapsed = now_us.saturating_sub(s.at_us);
    let drained = (elapsed as u128 * limit.rate as u128).min(level as u128) as u64;
    level - drained
}

/// Decides whether a request of `cost` units fits, and what the bucket looks like afterwards.
pub fn decide(limit: &Limit, state: Option<State>, now_us: u64, cost: u64) -> Outcome {
    let level = level_at(limit, state, now_us);
    let need = cost.saturating_mul(limit.per_unit);
    let next = level.saturating_add(need);
    if next <= limit.capacity + limit.max_delay {
        let delay_us = div_ceil(next.saturating_sub(limit.capacity), limit.rate);
        Outcome {
            verdict: Verdict::Admit { delay_us },
            state: Some(State::of(limit, next, now_us)),
            remaining: limit.remaining(next),
            reset_us: limit.reset_us(next),
            each: Figures::default(),
        }
    } else {
        let retry_after_us = div_ceil(next - limit.capacity - limit.max_delay, limit.rate);
        Outcome {
            verdict: Verdict::Reject { retry_after_us },
            state: None,
            remaining: limit.remaining(level),
            reset_us: limit.reset_us(level),
            each: Figures::default(),
        }
    }
}

/// A decision on several budgets at once, and the states to store when it admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Joint {
    pub outcome: Outcome,
    /// Per budget, in order: the state to store; all `None` when refused (nothing is written).
    pub states: [Option<State>; MAX_BUDGETS],
}

/// Decides a request of `cost` units against every budget in `budgets` (limit and stored
/// state), all or nothing: it is admitted only if each admits it, and then charged to each.
///
/// - Refused: by the budget whose retry is furthest (the first of equals) — the request fits
///   all of them only then; every budget's figures are its level now (nothing was charged).
/// - Admitted: held for the longest of the delays; the outcome's own figures are the tightest
///   budget's ([`tightest`]), which `X-RateLimit-*` describe.
///
/// With one budget this is exactly [`decide`] (and `each` stays empty). The Lua script's
/// `admit` transcribes it; keep the two in step.
pub fn decide_all(budgets: &[(Limit, Option<State>)], now_us: u64, cost: u64) -> Joint {
    let mut states = [None; MAX_BUDGETS];
    let budgets = &budgets[..budgets.len().min(MAX_BUDGETS)];
    if let [(limit, state)] = budgets {
        let outcome = decide(limit, *state, now_us, cost);
        states[0] = outcome.state;
        return Joint { outcome, states };
    }
    let outs: Vec<Outcome> = budgets
        .iter()
        .map(|(l, s)| decide(l, *s, now_us, cost))
        .collect();
    let mut refused: Option<(usize, u64)> = None;
    for (i, o) in outs.iter().enumerate() {
        if let Verdict::Reject { retry_after_us } = o.verdict {
            if refused.is_none_or(|(_, r)| retry_after_us > r) {
                refused = Some((i, retry_after_us));
            }
        }
    }
    let mut each = Figures::default();
    if let Some((i, _)) = refused {
        for (o, (l, s)) in outs.iter().zip(budgets) {
            let u = uncharged(l, *s, now_us, o.verdict);
            each.push(Figure {
                remaining: u.remaining,
                reset_us: u.reset_us,
            });
        }
        each.decisive = i as u8;
        let f = each.as_slice()[i];
        let outcome = Outcome {
            verdict: outs[i].verdict,
            state: None,
            remaining: f.remaining,
            reset_us: f.reset_us,
            each,
        };
        return Joint { outcome, states };
    }
    let tightest = tightest(outs.iter().map(|o| (o.remaining, o.reset_us)));
    let mut delay_us = 0;
    for (i, o) in outs.iter().enumerate() {
        if let Verdict::Admit { delay_us: d } = o.verdict {
            delay_us = delay_us.max(d);
        }
        states[i] = o.state;
        each.push(Figure {
            remaining: o.remaining,
            reset_us: o.reset_us,
        });
    }
    each.decisive = tightest as u8;
    let outcome = Outcome {
        verdict: Verdict::Admit { delay_us },
        state: None,
        remaining: outs[tightest].remaining,
        reset_us: outs[tightest].reset_us,
        each,
    };
    Joint { outcome, states }
}

/// The bucket as it stands, for answers that charge nothing (a busy slot): same verdict,
/// but `remaining`/`reset_us` describe the current level, not the level after a charge.
pub fn uncharged(limit: &Limit, state: Option<State>, now_us: u64, verdict: Verdict) -> Outcome {
    let level = level_at(limit, state, now_us);
    Outcome {
        verdict,
        state: None,
        remaining: limit.remaining(level),
        reset_us: limit.reset_us(level),
        each: Figures::default(),
    }
}

/// Gives `cost` units back (the upstream never saw the request). Returns the state to store.
pub fn refund(limit: &Limit, state: Option<State>, now_us: u64, cost: u64) -> Option<State> {
    let level = level_at(limit, state, now_us);
    state.map(|_| {
        State::of(
            limit,
            level.saturating_sub(cost.saturating_mul(limit.per_unit)),
            now_us,
        )
    })
}

/// Charges `cost` units without asking whether they fit (units already spent: a fallback
/// admission, or the measured time of a `cost_per_second` route), so the level may pass
/// `capacity`: the key is then in debt and waits it out, all of it (a stated cost may be 100
/// times a route's, so the level may pass the 2^51 ticks a decision stays below). The Lua
/// `debit` transcribes it.
pub fn debit(limit: &Limit, state: Option<State>, now_us: u64, cost: u64) -> State {
    let level = level_at(limit, state, now_us);
    State::of(
        limit,
        level.saturating_add(cost.saturating_mul(limit.per_unit)),
        now_us,
    )
}

/// How long `cost` units take to drain from the slowest of `limits`: a refund of them later
/// than that gives nothing back (what retries of a refund are bounded by).
pub fn drain_time<'a>(limits: impl IntoIterator<Item = &'a Limit>, cost: u64) -> Duration {
    let us = limits
        .into_iter()
        .map(|l| l.reset_us(cost.saturating_mul(l.per_unit)))
        .max()
        .unwrap_or(0);
    Duration::from_micros(us)
}

/// Seconds for `Retry-After`: rounded up, never 0.
pub fn retry_after_secs(us: u64) -> u64 {
    us.div_ceil(1_000_000).max(1)
}

/// Seconds for `RateLimit: t=` / `X-RateLimit-Reset`: rounded up.
pub fn reset_secs(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

#[cfg(test)]
mod tests;
