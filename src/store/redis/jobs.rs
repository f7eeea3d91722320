//! Async jobs in Redis (DESIGN §8): a job's waiter in its route's fair queue belongs to the
//! fleet (the pseudo-instance [`FLEET`]), not to the instance that accepted it, so it outlives
//! that instance; every instance with the route beats there as the fleet and takes the slots
//! granted to it (each grant goes to exactly one beat). The job's record (its request, state,
//! runner, result) is a hash, `t:j:<id>`, handled by `lua/jobs.lua`.

use std::sync::Arc;
use std::time::Duration;

use redis::Script;

use super::queue::{leave, queue_keys, QueueKeys, GRANT_TTL};
use super::{keys, Decided, RedisBackend};
use crate::store::{Admission, AdmitRequest, Standing, StoreError};

/// The instance a job's waiter belongs to: the fleet.
pub(crate) const FLEET: &str = "jobs";

/// How a job's submission went on Redis.
#[derive(Debug)]
pub(crate) enum JobEntered {
    /// Charged; a slot was free and is held under the job's id: run it now.
    Taken(Standing),
    /// Charged; waiting in the queue at this position.
    Queued(Standing, u64),
    /// Not charged (or charged and given back): the answer to send.
    Refused(Box<Admission>),
}

/// `lua/jobs.lua`.
pub(crate) struct JobScript(Script);

impl JobScript {
    pub fn new() -> Self {
        JobScript(Script::new(include_str!("../lua/jobs.lua")))
    }
}

impl RedisBackend {
    fn route_keys(route: &str) -> Result<QueueKeys, StoreError> {
        queue_keys(&keys::route_slots_key(route))
            .ok_or_else(|| StoreError::Reply("route lease key".into()))
    }

    /// Charges a job (its key's budgets, as a queued request is charged) and enters it in its
    /// route's queue as the fleet's waiter `id`. A full queue gives the charge back.
    pub(crate) async fn enter_job(
        self: &Arc<Self>,
        req: &AdmitRequest,
        cap: u32,
        id: &str,
    ) -> Result<JobEntered, StoreError> {
        // As a request's admission: after Redis lost its data, runners register their slots
        // again before this job may take one.
        self.after_data_loss(req).await;
        let start = std::time::Instant::now();
        let outcome = match self.try_admit(req, Default::default()).await?.0 {
            Decided::KeyAdmitted(o, _, _) => o,
            other => {
                return Ok(JobEntered::Refused(Box::new(
                    self.answer(req, other, start).admission,
                )))
            }
        };
        if let crate::budget::Verdict::Admit { delay_us } = outcome.verdict {
            if delay_us > 0 {
                // `max_delay`: its units were reserved ahead; it runs no sooner than they are due.
                let ms = delay_us.div_ceil(1000).to_string();
                self.job_record::<i64>(id, "delay", &[ms.as_bytes()])
                    .await?;
            }
        }
        let rk = Self::route_keys(&req.route)?;
        let inv = self.enter_as(&rk, id, req, cap, FLEET, FLEET_ALIVE);
        let entered: Vec<i64> = self.call(inv).await?;
        let standing: Standing = (&outcome).into();
        Ok(match entered.first().copied() {
            Some(1) => JobEntered::Taken(standing),
            Some(0) => JobEntered::Queued(standing, entered.get(1).copied().unwrap_or(0) as u64),
            _ => {
                let mut standing = standing;
                standing.remaining = standing.remaining.saturating_add(req.cost);
                JobEntered::Refused(Box::new(Admission::RouteBusy {
                    standing,
                    queued: Duration::ZERO,
                }))
            }
        })
    }

    /// Beats on `route` as the fleet: the job ids granted a slot there since the last beat
    /// (this caller now owns them: confirm each, or release it), and how many jobs still wait.
    pub(crate) async fn job_grants(&self, route: &str) -> Result<(Vec<String>, u64), StoreError> {
        let rk = Self::route_keys(route)?;
        let mut inv = self.queue_script.call(&rk, "beat");
        // (`below` 0: job ids are not this instance's to reconcile.)
        inv.arg(FLEET)
            .arg(FLEET_ALIVE.as_micros() as u64)
            .arg(GRANT_TTL.as_micros() as u64)
            .arg(0)
            .arg(0);
        let reply: Vec<redis::Value> = self.call(inv).await?;
        let int = |i: usize| {
            reply
                .get(i)
                .and_then(|v| redis::from_redis_value::<u64>(v.clone()).ok())
                .unwrap_or(0)
        };
        let (waiting, n) = (int(0), int(1) as usize);
        let ids = reply
            .iter()
            .skip(2)
            .take(n)
            .filter_map(|v| redis::from_redis_value::<String>(v.clone()).ok())
            .collect();
        Ok((ids, waiting))
    }

    /// Renews the job's slot for a whole lease (a grant is confirmed the same way); `false`
    /// when it lapsed.
    pub(crate) async fn job_renew(&self, route: &str, id: &str) -> Result<bool, StoreError> {
        let rk = Self::route_keys(route)?;
        let mut inv = self.queue_script.call(&rk, "confirm");
        inv.arg(id).arg(self.lease_ttl.as_micros() as u64);
        let v: Vec<i64> = self.call(inv).await?;
        Ok(v.first() == Some(&1))
    }

    /// The job this instance now runs holds its route's slot as a request's lease does: it
    /// is registered, so that when Redis loses its data (`lost.rs`) the slot is registered
    /// again before other instances take slots (without it, a restart let a second job run
    /// beside it on a cap of 1: tests/jobs_fleet).
    pub(crate) fn job_hold(self: &Arc<Self>, route: &str, id: &str) {
        crate::store::lock(&self.held)
            .live
            .insert(id.to_string(), vec![keys::route_slots_key(route)]);
        self.watch_for_data_loss();
    }

    /// Frees the job's slot (handing it on).
    pub(crate) async fn job_release(&self, route: &str, id: &str) -> Result<(), StoreError> {
        crate::store::lock(&self.held).live.remove(id);
        let rk = Self::route_keys(route)?;
        let _: Vec<i64> = self.call(self.queue_script.release(&rk, id)).await?;
        Ok(())
    }

    /// Takes a queued job out of its route's queue: 0 left, 1 granted (the caller releases
    /// the slot), 2 no longer there.
    pub(crate) async fn job_leave(&self, route: &str, id: &str) -> Result<i64, StoreError> {
        let rk = Self::route_keys(route)?;
        let v: Vec<i64> = self.call(leave(&self.queue_script, &rk, id)).await?;
        Ok(v.first().copied().unwrap_or(2))
    }

    /// One `lua/jobs.lua` operation on the record of job `id`.
    pub(crate) async fn job_record<T: redis::FromRedisValue>(
        &self,
        id: &str,
        op: &str,
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let mut inv = self.job_script.0.prepare_invoke();
        inv.key(keys::job_key(id)).arg(op);
        for a in args {
            inv.arg(*a);
        }
        self.call(inv).await
    }

    pub(crate) fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    pub(crate) fn instance(&self) -> &str {
        &self.instance
    }
}

/// How long the fleet counts as alive after a beat: jobs outlive a gap in the fleet's beats
/// (every instance with an async route beats for it twice a second).
const FLEET_ALIVE: Duration = Duration::from_secs(30);
