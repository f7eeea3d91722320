//! What the rate-limit headers describe: the budgets as a decision left them.

use std::time::Duration;

use crate::budget::{Figure, Figures, Limit, Outcome};

/// The budget as a decision left it: what the rate-limit headers describe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Standing {
    /// Whole units left (`RateLimit: r=`); of the decisive budget when there are several.
    pub remaining: u64,
    /// µs until the bucket is full again (`RateLimit: t=`).
    pub reset_us: u64,
    /// Every budget's figures when the request was decided on several; empty for one.
    pub each: Figures,
}

impl Standing {
    /// What `X-RateLimit-*` and a problem's `remaining` show, with its budget's index: the
    /// tightest budget's figures when there are several (a refusal's too: DESIGN §1, the
    /// refusing budget sets only `Retry-After`), else the one's.
    pub fn shown(&self) -> (usize, Figure) {
        match self.each.as_slice() {
            several @ [_, _, ..] => {
                let i = crate::budget::tightest(several.iter().map(|f| (f.remaining, f.reset_us)));
                (i, several[i])
            }
            _ => (
                0,
                Figure {
                    remaining: self.remaining,
                    reset_us: self.reset_us,
                },
            ),
        }
    }

    /// The standing of a decision on `figures` (one per budget, in order) that admitted or
    /// charged nothing: the tightest budget decides (`budget::tightest`), as in an admission
    /// (`budget::decide_all`); `each` is kept only for several budgets.
    pub(super) fn tightest(figures: &[Figure]) -> Option<Standing> {
        let i = crate::budget::tightest(figures.iter().map(|f| (f.remaining, f.reset_us)));
        let t = figures.get(i)?;
        let mut each = Figures::default();
        if figures.len() > 1 {
            figures.iter().for_each(|f| each.push(*f));
            each.decisive = i as u8;
        }
        Some(Standing {
            remaining: t.remaining,
            reset_us: t.reset_us,
            each,
        })
    }

    /// The standing of budgets `limits` (in their order) at `levels` (ticks, as a store's
    /// script reads them), which charged nothing: `None` unless there is one level per limit.
    pub fn of_levels<'a>(
        limits: impl Iterator<Item = &'a Limit>,
        levels: &[i64],
    ) -> Option<Standing> {
        let limits: Vec<&Limit> = limits.collect();
        if limits.len() != levels.len() {
            return None;
        }
        let figures: Vec<Figure> = limits
            .iter()
            .zip(levels)
            .map(|(l, level)| {
                let level = u64::try_from(*level).unwrap_or(0);
                Figure {
                    remaining: l.remaining(level),
                    reset_us: l.reset_us(level),
                }
            })
            .collect();
        Standing::tightest(&figures)
    }

    /// The figures `elapsed` after the decision: every bucket drained that much longer (`t`
    /// shorter by it). Units left are not raised: what the headers say stays a bound.
    pub fn later(&self, elapsed: Duration) -> Standing {
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        Standing {
            remaining: self.remaining,
            reset_us: self.reset_us.saturating_sub(us),
            each: self.each.later(us),
        }
    }

    /// The standing once `cost` units went back into `limits`, the budgets it was decided on
    /// in their order (a refund): each budget's figures as [`Limit::given_back`] has them, and
    /// the decisive one the tightest again.
    pub fn given_back<'a>(&self, limits: impl Iterator<Item = &'a Limit>, cost: u64) -> Standing {
        let own = [Figure {
            remaining: self.remaining,
            reset_us: self.reset_us,
        }];
        let figures = match self.each.as_slice() {
            [] => &own[..],
            several => several,
        };
        let back: Vec<Figure> = figures
            .iter()
            .zip(limits)
            .map(|(f, l)| l.given_back(*f, cost))
            .collect();
        if back.len() != figures.len() {
            return *self;
        }
        Standing::tightest(&back).unwrap_or(*self)
    }
}

impl From<&Outcome> for Standing {
    fn from(o: &Outcome) -> Standing {
        Standing {
            remaining: o.remaining,
            reset_us: o.reset_us,
            each: o.each,
        }
    }
}
