//! The circuit breaker: stops a request from waiting on a Redis that is not answering.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Consecutive failures that open the breaker.
pub(super) const BREAKER_THRESHOLD: u32 = 3;
/// How long an open breaker waits before letting one probe through.
pub(super) const BREAKER_OPEN_FOR: Duration = Duration::from_millis(500);

/// A run of failed calls with no answer between them (or one call's wait for its answer)
/// this long is a silence of the store: long enough that others' calls failed too, and
/// renewals with them ([`Breaker::since_silence`]).
pub(super) const SILENCE: Duration = Duration::from_millis(500);

/// Closed → (3 failures) → open for 500 ms → one probe → closed or open again.
///
/// The probe is whoever moves `open_until_us` forward first; there is no "probing" flag, so a
/// probe whose future is dropped mid-call (an aborted renewal, a client gone) only delays the
/// next probe by 500 ms instead of leaving the breaker open for good.
#[derive(Debug)]
pub(super) struct Breaker {
    failures: AtomicU32,
    /// 0 when closed; otherwise when the next probe may go (µs since `epoch`).
    open_until_us: AtomicU64,
    /// When a call last succeeded (µs since `epoch`; 0: none yet).
    last_ok_us: AtomicU64,
    /// When the first failure of the current run of them was counted (µs since `epoch`).
    failing_since_us: AtomicU64,
    /// When the first of the failed calls since the last answer failed, counted or not (the
    /// probe's too; µs since `epoch`; 0: a call was answered since the last failure).
    unanswered_since_us: AtomicU64,
    /// When the last silence ended (µs since `epoch`; 0: none yet): see [`Breaker::since_silence`].
    silence_ended_us: AtomicU64,
    epoch: Instant,
}

impl Breaker {
    pub(super) fn new() -> Self {
        Breaker {
            failures: AtomicU32::new(0),
            open_until_us: AtomicU64::new(0),
            last_ok_us: AtomicU64::new(0),
            failing_since_us: AtomicU64::new(0),
            unanswered_since_us: AtomicU64::new(0),
            silence_ended_us: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64 + 1
    }

    pub(super) fn allow(&self) -> bool {
        let until = self.open_until_us.load(Ordering::Acquire);
        if until == 0 {
            return true;
        }
        let now = self.now_us();
        if now < until {
            return false;
        }
        // One probe per period: the caller that pushes the next probe time forward.
        self.open_until_us
            .compare_exchange(
                until,
                now + BREAKER_OPEN_FOR.as_micros() as u64,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// True while the breaker is closed (no recent run of failures); asks nothing of it, unlike
    /// [`Breaker::allow`], which may hand out the probe.
    pub(super) fn closed(&self) -> bool {
        self.open_until_us.load(Ordering::Acquire) == 0
    }

    /// A call answered at `at` (an instant its caller read anyway: no clock read here). When
    /// it closed an open breaker: how long calls had been failing before it (from the first
    /// failure counted: an instance idle before the outage did not find Redis silent then).
    pub(super) fn success(&self, at: Instant) -> Option<Duration> {
        self.failures.store(0, Ordering::Release);
        let us = at.saturating_duration_since(self.epoch).as_micros() as u64 + 1;
        self.last_ok_us.store(us, Ordering::Relaxed);
        // A load first: the common answer, after another answer, writes nothing more.
        if self.unanswered_since_us.load(Ordering::Relaxed) != 0 {
            let since = self.unanswered_since_us.swap(0, Ordering::Relaxed);
            if since != 0 && us.saturating_sub(since) >= SILENCE.as_micros() as u64 {
                self.silence_ended_us.fetch_max(us, Ordering::Relaxed);
            }
        }
        // A load first: the common answer, on a closed breaker, writes nothing more.
        let closed_now = self.open_until_us.load(Ordering::Acquire) != 0
            && self.open_until_us.swap(0, Ordering::AcqRel) != 0;
        closed_now.then(|| {
            let since = self.failing_since_us.load(Ordering::Relaxed);
            Duration::from_micros(us.saturating_sub(since))
        })
    }

    /// How long since a call last succeeded (since the breaker was made, if none has).
    pub(super) fn quiet_for(&self) -> Duration {
        let last = self.last_ok_us.load(Ordering::Relaxed);
        Duration::from_micros(self.now_us().saturating_sub(last))
    }

    /// Notes that a call failed (the store did not answer it, or refused it), whether or
    /// not it counts towards opening the breaker.
    pub(super) fn failed(&self) {
        let _ = self.unanswered_since_us.compare_exchange(
            0,
            self.now_us(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    /// Notes that a call answered at `at` took `took`: one that took [`SILENCE`] or more
    /// was answered after a silence (one whose `store.timeout` is longer than it).
    pub(super) fn answered_slowly(&self, at: Instant, took: Duration) {
        if took >= SILENCE {
            let us = at.saturating_duration_since(self.epoch).as_micros() as u64 + 1;
            self.silence_ended_us.fetch_max(us, Ordering::Relaxed);
        }
    }

    /// How long since the store was last silent for this instance: calls failed, and none
    /// was answered, for [`SILENCE`] or more (or one call took that long); zero while such a
    /// run of failures goes on, `None` if there has been none. A lone failure that the next
    /// call's answer follows at once is not a silence.
    pub(super) fn since_silence(&self) -> Option<Duration> {
        let now = self.now_us();
        let unanswered = self.unanswered_since_us.load(Ordering::Relaxed);
        if unanswered != 0 && now.saturating_sub(unanswered) >= SILENCE.as_micros() as u64 {
            return Some(Duration::ZERO);
        }
        let ended = self.silence_ended_us.load(Ordering::Relaxed);
        (ended != 0).then(|| Duration::from_micros(now.saturating_sub(ended)))
    }

    /// Counts a failure; true when this one opened a closed breaker.
    pub(super) fn failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n == 1 {
            self.failing_since_us
                .store(self.now_us(), Ordering::Relaxed);
        }
        if n >= BREAKER_THRESHOLD {
            let was = self.open_until_us.swap(
                self.now_us() + BREAKER_OPEN_FOR.as_micros() as u64,
                Ordering::AcqRel,
            );
            return was == 0;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaker_opens_after_failures_and_probes() {
        let b = Breaker::new();
        for _ in 0..BREAKER_THRESHOLD {
            assert!(b.allow());
            b.failure();
        }
        assert!(!b.allow(), "open");
        std::thread::sleep(BREAKER_OPEN_FOR + Duration::from_millis(20));
        assert!(b.allow(), "one probe");
        assert!(!b.allow(), "only one");
        // The probe's future was dropped: neither success nor failure is reported. The breaker
        // still lets the next probe through one period later.
        std::thread::sleep(BREAKER_OPEN_FOR + Duration::from_millis(20));
        assert!(b.allow(), "next probe after a lost one");
        assert!(!b.failure(), "already open: not a new opening");
        assert!(!b.allow(), "probe failed: open again");
        std::thread::sleep(BREAKER_OPEN_FOR + Duration::from_millis(20));
        assert!(b.allow());
        // The probe's answer closes it, and says how long calls had been failing: since the
        // first failure, three periods of 500 ms at least.
        let failing = b.success(Instant::now()).expect("it closed the breaker");
        assert!(failing >= BREAKER_OPEN_FOR * 3, "{failing:?}");
        assert!(b.allow() && b.allow(), "closed");
        assert_eq!(b.success(Instant::now()), None, "closed already");
    }

    /// A silence is a run of failures unanswered for `SILENCE`, or one slow answer; a lone
    /// failure that an answer follows at once is not one.
    #[test]
    fn a_silence_is_a_run_of_failures_not_a_lone_one() {
        let b = Breaker::new();
        assert_eq!(b.since_silence(), None, "none failed");
        b.failed();
        assert!(!b.failure(), "noting a failure opens nothing");
        b.success(Instant::now());
        assert_eq!(b.since_silence(), None, "a lone failure answered at once");
        b.answered_slowly(Instant::now(), SILENCE - Duration::from_millis(1));
        assert_eq!(b.since_silence(), None, "a call answered within SILENCE");
        b.answered_slowly(Instant::now(), SILENCE);
        assert!(b.since_silence().is_some(), "a call that waited SILENCE");

        let b = Breaker::new();
        b.failed();
        std::thread::sleep(SILENCE);
        b.failed();
        assert_eq!(b.since_silence(), Some(Duration::ZERO), "going on");
        b.success(Instant::now());
        let since = b.since_silence().expect("it ended");
        assert!(since < Duration::from_millis(100), "{since:?}");
    }

    /// How long the store has been quiet counts from the last success (no answer yet: from
    /// the breaker's making).
    #[test]
    fn quiet_for_counts_from_the_last_answer() {
        let b = Breaker::new();
        let made = b.epoch;
        // (Whole microseconds, the clock's 1 µs offset included.)
        assert!(b.quiet_for() <= made.elapsed() + Duration::from_micros(1));
        // An answer stamped an hour from now: no time has passed since it.
        b.success(made + Duration::from_secs(3600));
        assert_eq!(b.quiet_for(), Duration::ZERO);
        // One stamped when the breaker was made: all the time since, and no more.
        std::thread::sleep(Duration::from_millis(2));
        b.success(made);
        let quiet = b.quiet_for();
        assert!(
            quiet >= Duration::from_millis(2) && quiet <= made.elapsed(),
            "{quiet:?}"
        );
    }
}
