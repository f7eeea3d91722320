//! Graceful drain: a signal that the process is draining, and completion by drop.
//!
//! Every request holds a [`DrainGuard`] from the moment the gateway first sees it until its
//! `logging` phase is over; the guard's drop is what counts it out, on every path. A drain is
//! over when nothing has been in flight for a quiet period, or when the grace period ends —
//! whichever comes first. No polling: the waiter sleeps on a condition variable that each
//! finished request signals.

use std::os::fd::{AsRawFd, OwnedFd};
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

/// The requests in flight, and the upstream sockets of those that reached an upstream.
#[derive(Debug, Default)]
struct Active {
    count: usize,
    /// A duplicate of each such request's upstream socket ([`DrainGuard::follow_socket`]):
    /// what an exit past the grace period shuts down to cut the request off
    /// ([`Drain::cut_off`]), and what tells whether an upstream that closed had the request.
    sockets: slab::Slab<OwnedFd>,
}

#[derive(Debug, Default)]
pub struct Drain {
    active: Mutex<Active>,
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
    /// When the requests still running were cut off: their upstream sockets shut down, so
    /// that each fails, is answered and logged (`Drain::cut_off`).
    cut_at: std::sync::OnceLock<Instant>,
}

/// Held by one request while the gateway works on it, with its upstream socket's duplicate
/// once it has one.
#[derive(Debug)]
pub struct DrainGuard {
    drain: Arc<Drain>,
    socket: Option<usize>,
}

impl Drop for DrainGuard {
    fn drop(&mut self) {
        let mut a = crate::store::lock(&self.drain.active);
        a.count = a.count.saturating_sub(1);
        let socket = self.socket.and_then(|k| a.sockets.try_remove(k));
        if a.count == 0 {
            self.drain.changed.notify_all();
        }
        drop(a);
        // Closed outside the lock (the last owner's close sends the FIN).
        drop(socket);
    }
}

impl DrainGuard {
    /// Keeps `fd`, a duplicate of the request's upstream socket, until the request ends (in
    /// place of the one of an attempt before it). A request that reaches its upstream after
    /// the cut is cut off at once.
    pub fn follow_socket(&mut self, fd: OwnedFd) {
        let mut a = crate::store::lock(&self.drain.active);
        let before = self.socket.take().and_then(|k| a.sockets.try_remove(k));
        if self.drain.is_cut_off() {
            shut(&fd);
        }
        self.socket = Some(a.sockets.insert(fd));
        drop(a);
        drop(before);
    }

    /// Lets the request's upstream socket go: its attempt failed (Pingora closed its own
    /// descriptor: the duplicate must not keep the connection open while the request is
    /// answered), or no duplicate could be made for a new attempt (the last one's must not
    /// stand for it).
    pub fn let_go_socket(&mut self) {
        let Some(k) = self.socket.take() else {
            return;
        };
        let mut a = crate::store::lock(&self.drain.active);
        let socket = a.sockets.try_remove(k);
        drop(a);
        drop(socket);
    }

    /// The TCP state of the request's upstream socket, when it has one.
    pub fn socket_tcp_info(&self) -> Option<pingora::protocols::l4::ext::TCP_INFO> {
        let a = crate::store::lock(&self.drain.active);
        let fd = a.sockets.get(self.socket?)?;
        pingora::protocols::l4::ext::get_tcp_info(fd.as_raw_fd()).ok()
    }
}

/// Shuts a socket down both ways: whoever reads or writes it next fails.
fn shut(fd: &OwnedFd) {
    // SAFETY: `fd` is an open socket this process owns; shutdown(2) neither frees nor
    // invalidates it.
    unsafe {
        libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR);
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
        crate::store::lock(&self.active).count += 1;
        DrainGuard {
            drain: self.clone(),
            socket: None,
        }
    }

    pub fn active(&self) -> usize {
        crate::store::lock(&self.active).count
    }

    /// Cuts off the requests still running as the instance exits past its grace period (at
    /// SIGINT, at once): each one's upstream socket is shut down, so that it fails, is
    /// answered (502, charged: the upstream had it) and logged, as every request is, instead
    /// of ending with the process unlogged. Returns how many sockets were shut.
    pub fn cut_off(&self) -> usize {
        let a = crate::store::lock(&self.active);
        // Set under the lock: a socket followed from now on is shut as it is followed.
        let _ = self.cut_at.set(Instant::now());
        for (_, fd) in a.sockets.iter() {
            shut(fd);
        }
        a.sockets.len()
    }

    /// Whether the requests still running have been cut off ([`Drain::cut_off`]).
    pub fn is_cut_off(&self) -> bool {
        self.cut_at.get().is_some()
    }

    /// When the requests still running were cut off, if they were: a request sent upstream
    /// before then had been received; one sent after it (its socket shut as it connected)
    /// never reached the upstream.
    pub fn cut_at(&self) -> Option<Instant> {
        self.cut_at.get().copied()
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
            while n.count > 0 {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Drained::GraceOver { active: n.count };
                }
                n = match self.changed.wait_timeout(n, left) {
                    Ok((g, _)) => g,
                    Err(p) => p.into_inner().0,
                };
            }
            // Then for it to stay there for `quiet`.
            let quiet_until = Instant::now() + quiet;
            while n.count == 0 {
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

    /// The cut shuts down every followed socket (its peer reads the end), one followed after
    /// it at once, and a request's socket is let go with its guard.
    #[test]
    fn a_cut_shuts_the_followed_sockets_down() {
        use std::io::Read;
        use std::os::unix::net::UnixStream;
        let d = Drain::new();
        let (mut g1, mut g2, mut g3) = (d.enter(), d.enter(), d.enter());
        let (a, mut a_peer) = UnixStream::pair().unwrap();
        let (b, b_peer) = UnixStream::pair().unwrap();
        let (c, mut c_peer) = UnixStream::pair().unwrap();
        g1.follow_socket(OwnedFd::from(a));
        g2.follow_socket(OwnedFd::from(b));
        // Let go with its guard: not shut, and no longer counted.
        drop(g2);
        b_peer.set_nonblocking(true).unwrap();
        let unread = (&b_peer).read(&mut [0u8; 1]);
        assert!(
            matches!(unread, Ok(0)),
            "closed once its guard went: {unread:?}"
        );
        assert!(!d.is_cut_off() && d.cut_at().is_none());
        let before = Instant::now();
        assert_eq!(d.cut_off(), 1);
        assert!(d.is_cut_off() && d.cut_at().is_some_and(|at| at >= before));
        assert_eq!(a_peer.read(&mut [0u8; 1]).unwrap(), 0);
        // Reached its upstream after the cut: shut at once.
        g3.follow_socket(OwnedFd::from(c));
        assert_eq!(c_peer.read(&mut [0u8; 1]).unwrap(), 0);
        drop((g1, g3));
        assert_eq!(d.active(), 0);
    }
}
