//! A job's admission on the memory store (DESIGN §8): the charge of a request joining the
//! route's queue, and a place there that no client connection holds.

use std::sync::Arc;
use std::time::Duration;

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
    /// A job's admission (DESIGN §8): charged now, like a request joining the queue, then a
    /// place in the route's queue that the job's own task awaits (no `queue_timeout`: the job
    /// decides how long it waits). A full queue (`max_queue`) gives the charge back at once.
    /// With `max_delay`, the units are reserved ahead: the job runs no sooner than the delay.
    // The refusal is returned by value once per refused submission, like `admit`'s answers.
    #[allow(clippy::result_large_err)]
    pub fn admit_job(
        self: &Arc<Self>,
        req: &AdmitRequest,
        cap: u32,
    ) -> Result<(Standing, Duration, Lease, JobPlace), Admission> {
        let (standing, delay, lease) = match self.charge(req) {
            Admission::Admitted {
                standing,
                delay_us,
                lease,
                ..
            } => (standing, Duration::from_micros(delay_us), lease),
            refused => return Err(refused),
        };
        match self
            .routes
            .join(&req.route, cap, short_key(&req.key), req.fair)
        {
            Joined::QueueFull => {
                drop(lease);
                self.refund(req);
                Err(Admission::RouteBusy {
                    standing: (&self.standing(req)).into(),
                    queued: Duration::ZERO,
                })
            }
            Joined::Slot(slot) => Ok((standing, delay, lease, JobPlace::Slot(slot))),
            Joined::Waiting(w) => Ok((standing, delay, lease, JobPlace::Waiting(w))),
        }
    }
}
