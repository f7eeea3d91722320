//! A job's admission on the memory store (DESIGN §8): the charge of a request joining the
//! route's queue (made before the job's body is read), then a place there that no client
//! connection holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{short_key, Admission, AdmitRequest, Joined, Lease, MemoryStore};
use crate::store::fair::{RouteSlot, Waiting};
use crate::store::Standing;

/// Where an admitted job stands in its route's queue.
#[derive(Debug)]
pub enum JobPlace {
    /// A slot was free: it runs at once.
    Slot(RouteSlot),
    /// It waits; dropping this leaves the queue.
    Waiting(Waiting),
}

impl MemoryStore {
    /// A job's charge (DESIGN §8), made before its body is read, like a request joining the
    /// queue: its budgets and its key's in-flight cap (held by the lease). With `max_delay`,
    /// the units are reserved ahead: the job runs no sooner than the delay.
    // The refusal is returned by value once per refused submission, like `admit`'s answers.
    #[allow(clippy::result_large_err)]
    pub fn charge_job(
        self: &Arc<Self>,
        req: &AdmitRequest,
    ) -> Result<(Standing, Duration, Lease), Admission> {
        match self.charge(req) {
            Admission::Admitted {
                standing,
                delay_us,
                lease,
                ..
            } => Ok((standing, Duration::from_micros(delay_us), lease)),
            refused => Err(refused),
        }
    }

    /// Whether the job's route's queue would refuse it now (`max_queue`), asked before its
    /// body is read.
    pub fn job_queue_full(&self, req: &AdmitRequest) -> bool {
        self.routes.full(&req.route, short_key(&req.key), req.fair)
    }

    /// A charged job's place in its route's queue, which its own task awaits (no
    /// `queue_timeout`: the job decides how long it waits); `None` when the queue is full
    /// (`max_queue`: the caller gives the charge back). Held for its `max_delay` turn, it is
    /// not served before `due` (it waits at its place, keeping no slot idle meanwhile).
    pub fn queue_job(&self, req: &AdmitRequest, cap: u32, due: Instant) -> Option<JobPlace> {
        let key = short_key(&req.key);
        match self
            .routes
            .join_due(&req.route, cap, key, req.fair, Some(due))
        {
            Joined::QueueFull => None,
            Joined::Slot(slot) => Some(JobPlace::Slot(slot)),
            Joined::Waiting(w) => Some(JobPlace::Waiting(w)),
        }
    }
}
