//! Requests held for their `max_delay` turn (DESIGN §4): at most [`MAX_HELD`] at once in this
//! instance, and none past the moment it exits. The proxy holds an admitted request before it
//! forwards it; a store holds a capped route's request before it joins the route's queue, so
//! that a request waiting for its units never keeps a slot idle (DESIGN §8). Both draw on the
//! same permits.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::shutdown::Drain;

/// Most requests one instance holds at once for `max_delay` (waiting their turn on a budget):
/// past it, a request that would be held is refused with `Retry-After` instead, so a queue of
/// callers never grows this process's memory without bound.
pub const MAX_HELD: usize = 1024;

/// This instance's held requests: their permits and the drain that ends them at exit.
#[derive(Clone)]
pub struct Holds {
    permits: Arc<Semaphore>,
    total: usize,
    drain: Arc<Drain>,
}

/// A store's hold that could not be (its charge is to be given back).
#[derive(Debug)]
pub struct NotHeld {
    /// The instance exits before the turn (503); else [`MAX_HELD`] are held already (429).
    pub exiting: bool,
    /// The exiting request's permit: kept until its charge is back, so that the exit waits
    /// for that (`app::give_back_held` waits while requests are held).
    pub permit: Option<OwnedSemaphorePermit>,
}

impl Default for Holds {
    /// [`MAX_HELD`] permits and a drain that never starts (a store no gateway runs).
    fn default() -> Self {
        Holds::new(MAX_HELD, Drain::new())
    }
}

impl std::fmt::Debug for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holds")
            .field("available", &self.permits.available_permits())
            .finish_non_exhaustive()
    }
}

impl Holds {
    pub fn new(permits: usize, drain: Arc<Drain>) -> Holds {
        Holds {
            permits: Arc::new(Semaphore::new(permits)),
            total: permits,
            drain,
        }
    }

    /// A permit to hold one request, if fewer than the bound are held.
    pub fn try_permit(&self) -> Option<OwnedSemaphorePermit> {
        self.permits.clone().try_acquire_owned().ok()
    }

    /// How many requests are held now.
    pub fn held(&self) -> usize {
        self.total.saturating_sub(self.permits.available_permits())
    }

    pub fn drain(&self) -> &Arc<Drain> {
        &self.drain
    }

    /// Holds a charged capped request until its units are due (`delay_us`, its `max_delay`
    /// turn), before it joins the route's queue (DESIGN §8: a request waiting for its units
    /// keeps no slot idle). Cancel-safe: a dropped hold gives its permit back. The time held is
    /// told to the task's [`HoldClock`], if it has one, however the hold ends.
    pub async fn before_queue(&self, delay_us: u64) -> Result<(), NotHeld> {
        if delay_us == 0 || HoldClock::never_holds() {
            return Ok(());
        }
        let Some(permit) = self.try_permit() else {
            return Err(NotHeld {
                exiting: false,
                permit: None,
            });
        };
        let delay = Duration::from_micros(delay_us);
        let _timed = Timed::begin();
        let due = Instant::now() + delay;
        tokio::select! {
            _ = tokio::time::sleep(delay) => Ok(()),
            _ = self.drain.exits_before(due) => Err(NotHeld {
                exiting: true,
                permit: Some(permit),
            }),
        }
    }
}

tokio::task_local! {
    /// The clock of the request the task decides, if its caller keeps one.
    static CLOCK: HoldClock;
}

/// How long a store held a request for its turn (`Holds::before_queue`), for its caller to
/// tell hold time from queue time: on an admission, on a refusal, and when the decision was
/// dropped mid-hold (the client left). Set for the decision's future with [`HoldClock::scope`].
#[derive(Clone, Default, Debug)]
pub struct HoldClock(Arc<std::sync::Mutex<Clock>>);

#[derive(Default, Debug)]
struct Clock {
    total: Duration,
    since: Option<Instant>,
    /// A shadow route's request: not held at all (shadow mode adds no latency).
    never: bool,
}

impl HoldClock {
    /// The clock of a request that is never held (a shadow route's: what enforcement would
    /// hold for its turn goes on at once).
    pub fn never() -> HoldClock {
        let c = HoldClock::default();
        crate::store::lock(&c.0).never = true;
        c
    }

    /// Whether the task's request is never held.
    fn never_holds() -> bool {
        CLOCK
            .try_with(|c| crate::store::lock(&c.0).never)
            .unwrap_or(false)
    }

    /// Runs `f` with this clock as its task's.
    pub async fn scope<F: std::future::Future>(&self, f: F) -> F::Output {
        CLOCK.scope(self.clone(), f).await
    }

    /// The time held so far (a hold still on counted to now).
    pub fn held(&self) -> Duration {
        let c = crate::store::lock(&self.0);
        c.total + c.since.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// The task's clock's time held so far; zero without one.
    pub fn now_held() -> Duration {
        CLOCK.try_with(HoldClock::held).unwrap_or_default()
    }

    /// Whether the task has a clock.
    pub fn present() -> bool {
        CLOCK.try_with(|_| ()).is_ok()
    }
}

/// A hold in progress on the task's clock; ended (added to its total) when dropped.
struct Timed(Option<HoldClock>);

impl Timed {
    fn begin() -> Timed {
        let clock = CLOCK.try_with(HoldClock::clone).ok();
        if let Some(c) = &clock {
            crate::store::lock(&c.0).since = Some(Instant::now());
        }
        Timed(clock)
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        if let Some(c) = &self.0 {
            let mut c = crate::store::lock(&c.0);
            if let Some(t) = c.since.take() {
                c.total += t.elapsed();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_hold_ends_when_due_past_the_bound_or_when_the_instance_exits_first() {
        let holds = Holds::new(1, Drain::new());
        let clock = HoldClock::default();
        let t = Instant::now();
        assert!(clock.scope(holds.before_queue(50_000)).await.is_ok());
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert!(clock.held() >= Duration::from_millis(50) && clock.held() <= t.elapsed());
        // Nothing to hold: at once, no permit taken.
        assert!(holds.before_queue(0).await.is_ok());
        // The bound: one held, the next refused at once.
        let taken = holds.try_permit().unwrap();
        let full = holds.before_queue(60_000_000).await.unwrap_err();
        assert!(!full.exiting && full.permit.is_none());
        drop(taken);
        // The instance exits in 20 ms, before the turn: given back then, not at the turn, its
        // permit kept by the caller until it lets go.
        let exiting = holds.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            exiting
                .drain()
                .give_back_held_past(Instant::now() + Duration::from_secs(1));
        });
        let t = Instant::now();
        let gone = holds.before_queue(60_000_000).await.unwrap_err();
        assert!(gone.exiting && t.elapsed() < Duration::from_secs(10));
        assert_eq!(holds.held(), 1);
        drop(gone);
        assert_eq!(holds.held(), 0);
        // A turn before the exit's deadline is still held to its end.
        assert!(holds.before_queue(10_000).await.is_ok());
        // A cancelled hold gives its permit back, and its clock counts the time it held (an
        // instance not exiting).
        let holds = Holds::new(1, Drain::new());
        let clock = HoldClock::default();
        let cut = tokio::time::timeout(
            Duration::from_millis(30),
            clock.scope(holds.before_queue(60_000_000)),
        );
        assert!(cut.await.is_err());
        assert!(holds.try_permit().is_some());
        let held = clock.held();
        assert!(
            held >= Duration::from_millis(30) && held < Duration::from_secs(10),
            "{held:?}"
        );
        assert_eq!(clock.held(), held, "the hold ended with its future");
    }
}
