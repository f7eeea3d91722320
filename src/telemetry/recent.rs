//! A route's admitted and refused requests over the last minute, this instance, for
//! `/admin/routes` and the status page: a ring of 60 one-second slots.
//!
//! Each slot is one `AtomicU64` holding its second and both counts, so a request is counted
//! by a compare-and-swap on one word (no lock, nothing the request path waits on) and a slot
//! from a minute ago is reset by the first request of its new second, in the same swap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// Seconds the ring covers.
pub const SECONDS: u64 = 60;

/// Bits of a slot: the second (mod 2^24, which only has to tell apart the 60 seconds a slot
/// can hold), then the admitted and the refused count (saturating at 2^20 - 1 a second).
const SECOND_BITS: u32 = 24;
const COUNT_BITS: u32 = 20;
const COUNT_MAX: u64 = (1 << COUNT_BITS) - 1;
const SECOND_MASK: u64 = (1 << SECOND_BITS) - 1;

/// What the ring adds up to: requests admitted (forwarded upstream) and refused by the
/// gateway in the last [`SECONDS`] seconds, the current one included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    pub admitted: u64,
    pub refused: u64,
}

/// The ring. A route gets one with its first counted request (see `RouteMetrics::recent`).
#[derive(Debug)]
pub struct LastMinute {
    slots: [AtomicU64; SECONDS as usize],
}

impl Default for LastMinute {
    fn default() -> Self {
        LastMinute {
            slots: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

fn start() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// The ring's clock: whole seconds since the process's first call (monotonic, so a wall
/// clock step neither loses nor doubles a minute).
pub fn now_second() -> u64 {
    start().elapsed().as_secs()
}

/// The second of `at` on the ring's clock, for a caller that has read the time anyway (an
/// instant before the clock's start is its second 0).
pub fn second_of(at: Instant) -> u64 {
    at.saturating_duration_since(start()).as_secs()
}

fn pack(second: u64, admitted: u64, refused: u64) -> u64 {
    ((second & SECOND_MASK) << (2 * COUNT_BITS)) | (admitted << COUNT_BITS) | refused
}

fn unpack(word: u64) -> (u64, u64, u64) {
    (
        word >> (2 * COUNT_BITS),
        (word >> COUNT_BITS) & COUNT_MAX,
        word & COUNT_MAX,
    )
}

impl LastMinute {
    /// Counts one request in second `now` (from [`now_second`]).
    pub fn count(&self, now: u64, admitted: bool) {
        let slot = &self.slots[(now % SECONDS) as usize];
        let mut word = slot.load(Ordering::Relaxed);
        loop {
            let (second, a, r) = unpack(word);
            let (a, r) = if second == now & SECOND_MASK {
                (a, r)
            } else {
                (0, 0)
            };
            let next = if admitted {
                pack(now, (a + 1).min(COUNT_MAX), r)
            } else {
                pack(now, a, (r + 1).min(COUNT_MAX))
            };
            match slot.compare_exchange_weak(word, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(seen) => word = seen,
            }
        }
    }

    /// The counts of the [`SECONDS`] seconds up to and including `now`.
    pub fn sum(&self, now: u64) -> Counts {
        let mut out = Counts::default();
        for back in 0..SECONDS.min(now + 1) {
            let second = now - back;
            let (s, a, r) = unpack(self.slots[(second % SECONDS) as usize].load(Ordering::Relaxed));
            if s == second & SECOND_MASK {
                out.admitted += a;
                out.refused += r;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_last_sixty_seconds_only() {
        let ring = LastMinute::default();
        ring.count(100, true);
        ring.count(100, true);
        ring.count(100, false);
        ring.count(130, false);
        assert_eq!(
            ring.sum(130),
            Counts {
                admitted: 2,
                refused: 2
            }
        );
        // Second 100 is out of the window at 160; 130 is still in.
        assert_eq!(
            ring.sum(160),
            Counts {
                admitted: 0,
                refused: 1
            }
        );
        // 160 reuses 100's slot: the old counts are gone, not added to.
        ring.count(160, true);
        assert_eq!(
            ring.sum(160),
            Counts {
                admitted: 1,
                refused: 1
            }
        );
        assert_eq!(ring.sum(300), Counts::default());
    }

    #[test]
    fn early_seconds_and_the_second_wrapping() {
        let ring = LastMinute::default();
        ring.count(0, true);
        assert_eq!(ring.sum(0).admitted, 1);
        let wrap = SECOND_MASK; // the last second before the packed second wraps to 0
        ring.count(wrap, false);
        ring.count(wrap + 1, false);
        assert_eq!(ring.sum(wrap + 1).refused, 2);
    }

    #[test]
    fn concurrent_counts_are_all_kept() {
        let ring = std::sync::Arc::new(LastMinute::default());
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let ring = ring.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        ring.count(7, i % 2 == 0);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(
            ring.sum(7),
            Counts {
                admitted: 20_000,
                refused: 20_000
            }
        );
    }
}
