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

/// How a store's hold ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Held {
    /// The request's units are due: it goes on.
    Due,
    /// [`MAX_HELD`] requests are held already: refused (429, `Retry-After`).
    Full,
    /// The instance exits before its turn: refused (503), its reservation given back.
    Exiting,
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

    /// Holds a request (in a store, before its route's queue) for `delay`, until its units
    /// are due. Cancel-safe: a dropped hold gives its permit back.
    pub async fn hold(&self, delay: Duration) -> Held {
        let Some(_permit) = self.try_permit() else {
            return Held::Full;
        };
        let due = Instant::now() + delay;
        tokio::select! {
            _ = tokio::time::sleep(delay) => Held::Due,
            _ = self.drain.exits_before(due) => Held::Exiting,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_hold_ends_when_due_past_the_bound_or_when_the_instance_exits_first() {
        let holds = Holds::new(1, Drain::new());
        let t = Instant::now();
        assert_eq!(holds.hold(Duration::from_millis(50)).await, Held::Due);
        assert!(t.elapsed() >= Duration::from_millis(50));
        // The bound: one held, the next refused at once.
        let taken = holds.try_permit().unwrap();
        assert_eq!(holds.hold(Duration::from_secs(60)).await, Held::Full);
        drop(taken);
        // The instance exits in 20 ms, before the turn: given back then, not at the turn.
        let exiting = holds.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            exiting
                .drain()
                .give_back_held_past(Instant::now() + Duration::from_secs(1));
        });
        let t = Instant::now();
        assert_eq!(holds.hold(Duration::from_secs(60)).await, Held::Exiting);
        assert!(t.elapsed() < Duration::from_secs(10));
        // A turn before the exit's deadline is still held to its end.
        assert_eq!(holds.hold(Duration::from_millis(10)).await, Held::Due);
        // A cancelled hold gives its permit back.
        let _ = tokio::time::timeout(
            Duration::from_millis(5),
            holds.hold(Duration::from_secs(60)),
        )
        .await;
        assert!(holds.try_permit().is_some());
    }
}
