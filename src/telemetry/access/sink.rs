//! Where access-log lines wait for the writer thread: one shared buffer that requests append
//! to and the writer swaps out whole, so a busy gateway pays one lock and a copy per line and
//! one `write(2)` per batch — no message, allocation or wake-up per line.
//!
//! The writer writes at most once per `delay`, or sooner when `batch` bytes wait: a line after
//! a quiet spell goes out at once (as it did through tracing's writer), a busy gateway's lines
//! go out in batches. A request never waits for the writer: past `max_pending` bytes a line is
//! dropped and counted.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// When the writer writes, and how far behind it may fall.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Write as soon as this many bytes wait.
    pub batch: usize,
    /// Write at most this often (unless a batch is full), so also the longest a line waits.
    pub delay: Duration,
    /// Drop lines rather than buffer more than this.
    pub max_pending: usize,
}

pub struct Sink {
    pending: Mutex<Pending>,
    wake: Condvar,
    /// Held while a batch is swapped out and written, so that batches reach the output in
    /// the order they were taken even when `flush` and the writer thread race.
    out: Mutex<Output>,
    dropped: AtomicU64,
    limits: Limits,
}

struct Pending {
    bytes: Vec<u8>,
    /// The writer sleeps on `wake` and wants to hear of a first line or a full batch.
    writer_waiting: bool,
}

struct Output {
    /// The buffer of the previous batch, kept for its capacity.
    spare: Vec<u8>,
    to: Box<dyn Write + Send>,
}

/// A panic elsewhere while a lock was held leaves plain bytes behind: keep using them.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Sink {
    pub fn new(to: Box<dyn Write + Send>, limits: Limits) -> Arc<Sink> {
        Arc::new(Sink {
            pending: Mutex::new(Pending {
                bytes: Vec::with_capacity(limits.batch * 2),
                writer_waiting: false,
            }),
            wake: Condvar::new(),
            out: Mutex::new(Output {
                spare: Vec::with_capacity(limits.batch * 2),
                to,
            }),
            dropped: AtomicU64::new(0),
            limits,
        })
    }

    /// Starts the thread that writes batches out. It runs until the process exits; what it
    /// has not written by then, [`Sink::flush`] writes.
    pub fn spawn_writer(self: &Arc<Self>) -> std::io::Result<()> {
        let sink = self.clone();
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || {
                let mut last_write = None;
                loop {
                    sink.wait_for_batch(last_write);
                    last_write = Some(Instant::now());
                    sink.flush();
                    let dropped = sink.take_dropped();
                    if dropped > 0 {
                        tracing::warn!(
                            dropped,
                            "the access log fell behind its writer; lines were dropped"
                        );
                    }
                }
            })
            .map(drop)
    }

    /// Appends one line (or drops it, if the writer is too far behind). Never blocks on the
    /// writer: the lock is only ever held for a copy or a swap.
    pub fn push(&self, line: &[u8]) {
        let mut p = lock(&self.pending);
        if p.bytes.len() + line.len() > self.limits.max_pending {
            drop(p);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let was_empty = p.bytes.is_empty();
        p.bytes.extend_from_slice(line);
        // One wake-up per write at most, and none while the writer is busy or sure to wake.
        let wake = p.writer_waiting && (was_empty || p.bytes.len() >= self.limits.batch);
        if wake {
            p.writer_waiting = false;
        }
        drop(p);
        if wake {
            self.wake.notify_one();
        }
    }

    /// Writes out everything appended so far, before returning.
    pub fn flush(&self) {
        let mut out = lock(&self.out);
        let Output { spare, to } = &mut *out;
        std::mem::swap(&mut lock(&self.pending).bytes, spare);
        if spare.is_empty() {
            return;
        }
        // A closed stderr has nowhere to report to.
        let _ = to.write_all(spare).and_then(|()| to.flush());
        spare.clear();
        // After a backlog, give the memory back rather than keep megabytes for good.
        if spare.capacity() > self.limits.batch * 4 {
            spare.shrink_to(self.limits.batch * 2);
        }
    }

    /// Lines dropped since the last call.
    pub fn take_dropped(&self) -> u64 {
        self.dropped.swap(0, Ordering::Relaxed)
    }

    /// Returns when there is something to write and either it is `batch` bytes or the last
    /// write was `delay` ago.
    fn wait_for_batch(&self, last_write: Option<Instant>) {
        let mut p = lock(&self.pending);
        while p.bytes.is_empty() {
            p.writer_waiting = true;
            p = self.wake.wait(p).unwrap_or_else(|e| e.into_inner());
        }
        let Some(deadline) = last_write.map(|t| t + self.limits.delay) else {
            p.writer_waiting = false;
            return;
        };
        while p.bytes.len() < self.limits.batch {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            p.writer_waiting = true;
            p = match self.wake.wait_timeout(p, deadline - now) {
                Ok((p, _)) => p,
                Err(e) => e.into_inner().0,
            };
        }
        p.writer_waiting = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An output the test can read.
    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            lock(&self.0).extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Capture {
        fn len(&self) -> usize {
            lock(&self.0).len()
        }
        /// Waits (3 s at most) until `n` bytes were written.
        fn wait_for(&self, n: usize) {
            let start = Instant::now();
            while self.len() < n {
                assert!(
                    start.elapsed() < Duration::from_secs(3),
                    "only {} of {n} bytes written",
                    self.len()
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    const LINE: &[u8] = b"0123456789abcdef0123456789abcde\n"; // 32 bytes

    #[test]
    fn a_line_after_a_quiet_spell_goes_out_at_once_and_a_full_batch_too() {
        let cap = Capture::default();
        let sink = Sink::new(
            Box::new(cap.clone()),
            Limits {
                batch: 1024,
                delay: Duration::from_secs(3600),
                max_pending: 1 << 20,
            },
        );
        sink.spawn_writer().unwrap();
        sink.push(LINE);
        cap.wait_for(LINE.len());
        // 992 bytes: under the batch, and the next write is not due for an hour.
        for _ in 0..31 {
            sink.push(LINE);
        }
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(cap.len(), LINE.len());
        sink.push(LINE);
        cap.wait_for(33 * LINE.len());
        assert_eq!(*lock(&cap.0), LINE.repeat(33));
    }

    #[test]
    fn a_small_batch_goes_out_after_the_delay() {
        let cap = Capture::default();
        let sink = Sink::new(
            Box::new(cap.clone()),
            Limits {
                batch: 1 << 20,
                delay: Duration::from_millis(50),
                max_pending: 1 << 21,
            },
        );
        sink.spawn_writer().unwrap();
        for n in 1..=3 {
            sink.push(LINE);
            sink.push(LINE);
            cap.wait_for(2 * n * LINE.len());
        }
        // And again after a quiet spell (the writer sleeps until the next line).
        std::thread::sleep(Duration::from_millis(100));
        sink.push(LINE);
        cap.wait_for(7 * LINE.len());
        assert_eq!(*lock(&cap.0), LINE.repeat(7));
    }

    #[test]
    fn past_max_pending_lines_are_dropped_and_counted() {
        let cap = Capture::default();
        // No writer thread: it has fallen as far behind as it can.
        let sink = Sink::new(
            Box::new(cap.clone()),
            Limits {
                batch: 64,
                delay: Duration::from_millis(1),
                max_pending: 10 * LINE.len() + 5,
            },
        );
        for _ in 0..25 {
            sink.push(LINE);
        }
        assert_eq!(sink.take_dropped(), 15);
        assert_eq!(sink.take_dropped(), 0);
        // flush (as at exit) writes out what was kept, whole lines only.
        sink.flush();
        assert_eq!(*lock(&cap.0), LINE.repeat(10));
        // And there is room again.
        sink.push(LINE);
        sink.flush();
        assert_eq!(cap.len(), 11 * LINE.len());
        assert_eq!(sink.take_dropped(), 0);
    }

    #[test]
    fn flush_writes_everything_while_the_writer_runs() {
        let cap = Capture::default();
        let sink = Sink::new(
            Box::new(cap.clone()),
            Limits {
                batch: 100,
                delay: Duration::from_millis(1),
                max_pending: 1 << 20,
            },
        );
        sink.spawn_writer().unwrap();
        let mut expected = Vec::new();
        for i in 0..2000u32 {
            let line = format!("line {i}\n");
            sink.push(line.as_bytes());
            expected.extend_from_slice(line.as_bytes());
        }
        sink.flush();
        // Every line, each once, in order, before flush returned.
        assert_eq!(*lock(&cap.0), expected);
    }
}
