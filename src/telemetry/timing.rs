//! Where a request's time went: what the access log, the histograms and its trace show.

use std::time::{Duration, Instant};

/// Where the time went, for the access log and the histograms.
#[derive(Debug, Default, Clone, Copy)]
pub struct Timing {
    /// When the store was asked for its decision (the trace's child spans start there).
    pub asked: Option<Instant>,
    /// The store's decision, without waiting for a slot.
    pub store: Duration,
    /// Waiting for a route slot.
    pub queued: Duration,
    /// Held by `max_delay` before forwarding.
    pub hold: Duration,
    pub upstream_start: Option<Instant>,
    pub upstream: Option<Duration>,
}

impl Timing {
    /// Marks the end of the upstream part (the first time only).
    pub fn upstream_done(&mut self) {
        if self.upstream.is_none() {
            self.upstream = self.upstream_start.map(|s| s.elapsed());
        }
    }
}
