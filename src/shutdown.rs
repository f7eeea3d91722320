//! Graceful drain: a signal that the process is draining, and completion by drop.
//!
//! Every request holds a [`DrainGuard`] from the moment the gateway first sees it until its
//! `logging` phase is over; the guard's drop is what counts it out, on every path. A drain is
//! over when nothing has been in flight for a quiet period, or when the grace period ends —
//! whichever comes first. No polling: the waiter sleeps on a condition variable that each
//! finished request signals.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How the drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// Nothing in flight for the quiet period.
    Idle,
    /// The grace period ended with this many requests still running.
    GraceOver { active: usize },
}

#[derive(Debug, Default)]
pub struct Drain {
    active: Mutex<usize>,
    changed: Condvar,
    draining: AtomicBool,
    /// While exiting, by when the requests held for their `max_delay` turn must be gone: a
    /// turn later than that is never reached here, so its request gives its reservation back
    /// at once and is refused (it may go to another instance), instead of holding the shared
    /// schedule — the fleet's — until the process ends with it. Requests still waiting for a
    /// slot, and queued jobs, leave at that moment ([`Drain::grace_over`]).
    held_until: tokio::sync::watch::Sender<Option<Instant>>,
    /// Requests waiting for a capped route's decision (queued for a slot, or held before the
    /// queue), and those answered because the instance exits, until their log line: the exit
    /// waits for them to be answered (`app::give_back_held`).
    waiting: AtomicUsize,
}

/// Held by one request while the gateway works on it.
#[derive(Debug)]
pub struct DrainGuard(Arc<Drain>);

impl Drop for DrainGuard {
    fn drop(&mut self) {
        let mut n = crate::store::lock(&self.0.active);
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.0.changed.notify_all();
        }
    }
}

/// Counts one request in [`Drain::waiting`] while it lives.
#[derive(Debug)]
pub struct Waiting(Arc<Drain>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drain {
    pub fn new() -> Arc<Drain> {
        Arc::default()
    }

    /// Counts a request in; it is counted out when the guard drops.
    pub fn enter(self: &Arc<Self>) -> DrainGuard {
        *crate::store::lock(&self.active) += 1;
        DrainGuard(self.clone())
    }

    pub fn active(&self) -> usize {
        *crate::store::lock(&self.active)
    }

    /// Marks the process as draining (`/readyz` answers 503 from now on).
    pub fn start(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Requests held for a `max_delay` turn later than `by` give their reservations back now
    /// (the grace period's end; `Instant::now()` when it is over).
    pub fn give_back_held_past(&self, by: Instant) {
        self.held_until.send_replace(Some(by));
    }

    /// Resolves once the process is exiting before `turn`: a request held until then gives
    /// its reservation back instead (never, while the process is not exiting).
    pub async fn exits_before(&self, turn: Instant) {
        let mut rx = self.held_until.subscribe();
        if rx
            .wait_for(|by| by.is_some_and(|by| turn > by))
            .await
            .is_err()
        {
            std::future::pending::<()>().await;
        }
    }

    /// Resolves once the instance is past its grace period (at SIGINT, at once): a request
    /// still waiting for a slot then leaves the queue (its charge goes back) and is answered,
    /// instead of being cut off by the exit (never, while the process is not exiting).
    pub async fn grace_over(&self) {
        let mut rx = self.held_until.subscribe();
        loop {
            let by = rx.wait_for(Option::is_some).await.map(|by| *by);
            let Ok(Some(by)) = by else {
                return std::future::pending().await;
            };
            tokio::select! {
                _ = tokio::time::sleep_until(by.into()) => return,
                // An earlier end (the grace period cut short by SIGINT): looked at again.
                changed = rx.changed() => if changed.is_err() {
                    return std::future::pending().await;
                },
            }
        }
    }

    /// Counts a request waiting for a capped route's decision until the guard drops.
    pub fn waiting(self: &Arc<Self>) -> Waiting {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Waiting(self.clone())
    }

    /// How many requests [`Drain::waiting`] counts now.
    pub fn waiting_now(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Blocks until nothing has been in flight for `quiet` — a request still arriving on a
    /// connection accepted before the signal gets that long to show up — or until `grace` has
    /// passed since the call.
    pub fn wait(&self, quiet: Duration, grace: Duration) -> Drained {
        let deadline = Instant::now() + grace;
        let mut n = crate::store::lock(&self.active);
        loop {
            // Wait for the count to reach zero.
            while *n > 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Drained::GraceOver { active: *n };
                }
                n = match self.changed.wait_timeout(n, left) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
            // Then for it to stay there for `quiet`.
            let quiet_until = Instant::now() + quiet;
            while *n == 0 {
                let now = Instant::now();
                if now >= quiet_until {
                    return Drained::Idle;
                }
                if now >= deadline {
                    return Drained::GraceOver { active: 0 };
                }
                let left = quiet_until.min(deadline) - now;
                n = match self.changed.wait_timeout(n, left) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_after_the_last_guard_and_a_quiet_period() {
        let d = Drain::new();
        let g = d.enter();
        assert_eq!(d.active(), 1);
        let d2 = d.clone();
        let start = Instant::now();
        let t =
            std::thread::spawn(move || d2.wait(Duration::from_millis(50), Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(100));
        drop(g);
        let how = t.join().unwrap();
        let took = start.elapsed();
        assert_eq!(how, Drained::Idle);
        assert!(took >= Duration::from_millis(150), "{took:?}");
        assert_eq!(d.active(), 0);
    }

    #[test]
    fn a_request_arriving_in_the_quiet_period_is_waited_for() {
        let d = Drain::new();
        let d2 = d.clone();
        let t =
            std::thread::spawn(move || d2.wait(Duration::from_millis(200), Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(50));
        let g = d.enter();
        std::thread::sleep(Duration::from_millis(300));
        assert!(!t.is_finished(), "drained while a request was in flight");
        drop(g);
        assert_eq!(t.join().unwrap(), Drained::Idle);
    }

    /// A waiting request leaves at the grace period's end, or at once when SIGINT cuts it
    /// short; never while the process is not exiting.
    #[tokio::test(start_paused = true)]
    async fn waiters_leave_when_the_grace_period_is_over() {
        let d = Drain::new();
        let over = tokio::time::timeout(Duration::from_secs(3600), d.grace_over());
        assert!(over.await.is_err(), "left while not exiting");

        let t = tokio::time::Instant::now();
        d.give_back_held_past(t.into_std() + Duration::from_secs(10));
        d.grace_over().await;
        assert_eq!(t.elapsed(), Duration::from_secs(10));

        let d = Drain::new();
        d.give_back_held_past(Instant::now() + Duration::from_secs(10));
        let t = tokio::time::Instant::now();
        let (d2, w) = (d.clone(), d.waiting());
        assert_eq!(d.waiting_now(), 1);
        let waiter = tokio::spawn(async move {
            d2.grace_over().await;
            drop(w);
        });
        tokio::time::sleep(Duration::from_secs(2)).await;
        d.give_back_held_past(Instant::now());
        waiter.await.unwrap();
        assert_eq!(t.elapsed(), Duration::from_secs(2));
        assert_eq!(d.waiting_now(), 0);
    }

    #[test]
    fn grace_period_ends_the_wait() {
        let d = Drain::new();
        let _g = d.enter();
        let start = Instant::now();
        let how = d.wait(Duration::from_millis(10), Duration::from_millis(100));
        assert_eq!(how, Drained::GraceOver { active: 1 });
        assert!(start.elapsed() < Duration::from_secs(2));
        assert!(!d.is_draining());
        d.start();
        assert!(d.is_draining());
    }
}
