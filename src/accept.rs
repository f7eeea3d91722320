//! Accepting connections when file descriptors may run out (DESIGN §5): the soft
//! `RLIMIT_NOFILE` is raised to the hard limit at start, and a listener whose `accept` fails for
//! lack of descriptors (or memory) backs off — 10 ms, doubling to 1 s — instead of retrying at
//! once: the connection that could not be accepted stays in the backlog, so an immediate retry
//! fails again and spins a core. Each pause is counted in `tollgate_accept_backoff_total`.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

use crate::telemetry::{metrics, Listener};

/// The first pause after an exhausted accept; it doubles up to [`BACKOFF_MAX`].
pub const BACKOFF_MIN: Duration = Duration::from_millis(10);
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Whether `accept` failed because the process or the system is out of a resource that only
/// frees up when connections close (retrying at once cannot succeed).
fn exhausted(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// One listener's back-off state.
#[derive(Debug)]
pub struct Backoff {
    listener: Listener,
    next: Duration,
}

impl Backoff {
    /// `listener` labels the metric.
    pub fn new(listener: Listener) -> Backoff {
        Backoff {
            listener,
            next: BACKOFF_MIN,
        }
    }

    /// The pause after `e`, if it is one to pause after; the next one is twice as long.
    fn pause_after(&mut self, e: &io::Error) -> Option<Duration> {
        if !exhausted(e) {
            // A connection reset before it was accepted, and the like: the next one is fine.
            return None;
        }
        let pause = self.next;
        if pause == BACKOFF_MIN {
            tracing::warn!(listener = self.listener.as_str(), error = %e, "cannot accept connections; backing off until descriptors free up");
        }
        self.next = (self.next * 2).min(BACKOFF_MAX);
        metrics()
            .accept_backoff
            .with_label_values(&[self.listener.as_str()])
            .inc();
        Some(pause)
    }

    fn accepted(&mut self) {
        self.next = BACKOFF_MIN;
    }
}

/// The next connection on `listener`, backing off while descriptors are exhausted.
/// Cancel-safe: dropping the future loses no connection.
pub async fn next(listener: &TcpListener, backoff: &mut Backoff) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(conn) => {
                backoff.accepted();
                return conn;
            }
            Err(e) => match backoff.pause_after(&e) {
                Some(pause) => tokio::time::sleep(pause).await,
                None => {
                    tracing::debug!(listener = backoff.listener.as_str(), error = %e, "accept failed")
                }
            },
        }
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (the default soft limit, often 1024, is
/// far below what `server.max_connections` allows). Returns the limit now in force.
pub fn raise_fd_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct it is given, which lives on this stack.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur >= lim.rlim_max {
        return Ok(lim.rlim_cur);
    }
    let raised = libc::rlimit {
        rlim_cur: lim.rlim_max,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit only reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(raised.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_on_exhaustion_only_doubling_to_a_second() {
        let mut b = Backoff::new(Listener::Proxy);
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        let pauses: Vec<_> = (0..9).map(|_| b.pause_after(&emfile).unwrap()).collect();
        assert_eq!(pauses[0], BACKOFF_MIN);
        assert_eq!(pauses[1], BACKOFF_MIN * 2);
        assert_eq!(pauses[8], BACKOFF_MAX);
        let aborted = io::Error::from_raw_os_error(libc::ECONNABORTED);
        assert_eq!(b.pause_after(&aborted), None);
        b.accepted();
        assert_eq!(b.pause_after(&emfile), Some(BACKOFF_MIN));
    }
}
