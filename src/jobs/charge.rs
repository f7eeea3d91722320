//! A job's charge, made before its body is read. DESIGN §8: a submission is "identified,
//! classified and charged as usual — 429 if its budget refuses, and then no job exists"; as on
//! the synchronous path, the gateway takes the body (and answers `Expect: 100-continue`) only
//! once the budget has admitted the request. A charge whose job is not made after all (its
//! body stalled, broke off or was over `max_request_body`; its queue, the process's bound or
//! the store refused it) is given back: no job existed, and the upstream never had anything.
//! A route's queue already full (`max_queue`) refuses the job here, before its body, as it
//! refuses a request at once; one that fills while the body arrives refuses it after.

use std::sync::Arc;
use std::time::Duration;

use crate::admission::Ticket;
use crate::route::Route;
use crate::state::Shared;
use crate::store::redis::{JobCharge, RedisBackend};
use crate::store::{Admission, AdmitRequest, Standing, Store};

/// A job's charge while its body is read: either made into the job by [`super::submit`], or
/// given back ([`Charged::give_back`]; dropped unused, it is given back in the background).
pub struct Charged {
    standing: Standing,
    held: Option<Held>,
    store: Store,
}

/// What a charge holds, where it was made.
pub(super) enum Held {
    /// The memory store: the charge and the key's slot (`max_in_flight_per_key`) in a ticket;
    /// `max_delay`'s reservation, the least time before the job may run.
    Memory { ticket: Ticket, delay: Duration },
    /// Redis: the key's slot is held under the job's id, which its record will have.
    Redis {
        req: AdmitRequest,
        id: Arc<str>,
        charge: JobCharge,
        backend: Arc<RedisBackend>,
    },
}

impl Held {
    /// Gives the charge back, then the key's slot: the standing with the charge given back.
    pub(super) async fn give_back(self, store: &Store) -> Standing {
        match self {
            Held::Memory { mut ticket, .. } => ticket.refund(store).await,
            Held::Redis {
                req,
                id,
                charge,
                backend,
            } => {
                let admitted = Standing::from(&charge.outcome);
                let levels = backend.give_back_job(&req, &id, charge).await;
                crate::admission::refunded_standing(&admitted, &req, levels, req.cost)
            }
        }
    }
}

impl Charged {
    /// The budget as the charge left it (the rate-limit headers of the job's 202).
    pub fn standing(&self) -> Standing {
        self.standing
    }

    /// The job is not made: its charge and its key's slot go back. The standing with the
    /// charge given back, for the answer's rate-limit headers.
    pub async fn give_back(mut self) -> Standing {
        match self.held.take() {
            Some(held) => held.give_back(&self.store).await,
            None => self.standing,
        }
    }

    /// Whether the job's route's queue is full for it now (`max_queue`): a job it would
    /// refuse is refused before its body is read, as a request is at once (DESIGN §3).
    async fn queue_full(&self, cap: u32) -> bool {
        match (&self.held, &self.store) {
            (Some(Held::Memory { ticket, .. }), Store::Memory(m)) => m.job_queue_full(&ticket.req),
            (Some(Held::Redis { req, backend, .. }), _) => backend.job_queue_full(req, cap).await,
            _ => false,
        }
    }

    /// What the job takes over.
    pub(super) fn into_held(mut self) -> Option<Held> {
        self.held.take()
    }
}

impl Drop for Charged {
    /// The backstop of an exit path that neither made the job nor gave its charge back.
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let store = self.store.clone();
            rt.spawn(async move {
                held.give_back(&store).await;
            });
        }
    }
}

/// Charges a job of `route` on the store in use, as a request joining the route's queue is
/// charged (its budgets, its key's in-flight cap); `Err` is the store's refusal (nothing
/// charged, no job).
pub async fn charge(
    shared: &Arc<Shared>,
    route: &Route,
    admit: AdmitRequest,
) -> Result<Charged, Admission> {
    let Some(rules) = route.jobs else {
        // `check` refuses async on routes without it: not reached.
        return Err(Admission::Unavailable);
    };
    let (standing, held) = match &shared.store {
        Store::Memory(m) => {
            let (standing, delay, lease) = m.charge_job(&admit)?;
            let ticket = Ticket::new(admit, standing, lease);
            (standing, Held::Memory { ticket, delay })
        }
        Store::Redis(r) => {
            let backend = r.shared().clone();
            let (id, charge) = super::fleet::charge(&backend, &admit, rules.result_ttl).await?;
            let standing = Standing::from(&charge.outcome);
            let held = Held::Redis {
                req: admit,
                id,
                charge,
                backend,
            };
            (standing, held)
        }
    };
    let charged = Charged {
        standing,
        held: Some(held),
        store: shared.store.clone(),
    };
    if let Some(cap) = route
        .max_in_flight
        .filter(|_| route.queue.max_queue.is_some())
    {
        if charged.queue_full(cap).await {
            let standing = charged.give_back().await;
            let queued = Duration::ZERO;
            return Err(Admission::RouteBusy {
                standing,
                queued,
                full: true,
            });
        }
    }
    Ok(charged)
}
