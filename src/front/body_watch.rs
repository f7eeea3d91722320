//! `server.body_timeout` for HTTP/2 request bodies. Pingora times an HTTP/1 body's reads
//! itself (`set_read_timeout`) but has no read timeout for an HTTP/2 stream, so a stream that
//! announced `content-length: 100` and sent one byte held a capped route's slot until
//! `upstream.read_timeout` (issue 23, item 4).
//!
//! While such a body is forwarded, Pingora's proxy loop waits on both the client's next DATA
//! frame and the upstream's answer. A [`BodyWatch`], started when the upstream connection is
//! made and touched by every body chunk, shuts the upstream socket down once the gap reaches
//! `body_timeout`: the proxy loop then fails on the upstream side, and the request is answered
//! as a stalled body (408; charged, the upstream had the request; the slot is freed). The
//! upstream sees its connection end in the middle of a body, so it is not working on it.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

#[derive(Debug)]
struct Clock {
    epoch: Instant,
    /// When the last body chunk arrived, in µs since `epoch`.
    last_us: AtomicU64,
    stalled: AtomicBool,
}

impl Clock {
    fn last(&self) -> u64 {
        self.last_us.load(Ordering::SeqCst)
    }
}

/// Watches the gaps in one request body; stops when dropped.
#[derive(Debug)]
pub struct BodyWatch {
    clock: Arc<Clock>,
    task: tokio::task::JoinHandle<()>,
}

impl BodyWatch {
    /// Starts the watch on the upstream socket `upstream` (a duplicate is kept, so the socket
    /// shut down is always this request's).
    pub fn start(upstream: BorrowedFd<'_>, timeout: Duration) -> std::io::Result<BodyWatch> {
        let socket = std::net::TcpStream::from(upstream.try_clone_to_owned()?);
        let clock = Arc::new(Clock {
            epoch: Instant::now(),
            last_us: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
        });
        let c = clock.clone();
        let task = tokio::spawn(async move {
            loop {
                let last = c.last();
                tokio::time::sleep_until(c.epoch + Duration::from_micros(last) + timeout).await;
                if c.last() == last {
                    c.stalled.store(true, Ordering::SeqCst);
                    let _ = socket.shutdown(std::net::Shutdown::Both);
                    return;
                }
            }
        });
        Ok(BodyWatch { clock, task })
    }

    /// A body chunk arrived: the next gap starts now.
    pub fn touch(&self) {
        let now = self.clock.epoch.elapsed().as_micros() as u64;
        self.clock.last_us.store(now.max(1), Ordering::SeqCst);
    }

    /// The body stalled past the timeout and the upstream connection was shut down.
    pub fn stalled(&self) -> bool {
        self.clock.stalled.load(Ordering::SeqCst)
    }
}

impl Drop for BodyWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsFd;

    #[tokio::test]
    async fn a_gap_past_the_timeout_shuts_the_upstream_down_and_chunks_keep_it_open() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut theirs, _) = listener.accept().unwrap();
        let watch = BodyWatch::start(ours.as_fd(), Duration::from_millis(300)).unwrap();
        for _ in 0..4 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            watch.touch();
        }
        assert!(!watch.stalled(), "chunks 100 ms apart are no stall");
        let start = std::time::Instant::now();
        while !watch.stalled() {
            assert!(start.elapsed() < Duration::from_secs(3));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The upstream sees the connection end.
        theirs
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
        assert_eq!(theirs.read(&mut [0u8; 8]).unwrap(), 0);
    }
}
