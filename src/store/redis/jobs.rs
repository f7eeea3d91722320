//! Async jobs in Redis (DESIGN §8): a job's waiter in its route's fair queue belongs to the
//! fleet (the pseudo-instance [`FLEET`]), not to the instance that accepted it, so it outlives
//! that instance; every instance with the route beats there as the fleet and takes the slots
//! granted to it (each grant goes to exactly one beat). The job's record (its request, state,
//! runner, result) is a hash, `t:j:<id>`, handled by `lua/jobs.lua`.

use std::sync::Arc;
use std::time::Duration;

use redis::Script;

use super::keys::{queue_keys, QueueKeys};
use super::queue::{leave, GRANT_TTL};
use super::script::Call;
use super::{keys, Decided, RedisBackend};
use crate::identity::KeyHash;
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

/// A job's charge in Redis, made before its body is read: its budget's outcome, and its
/// key's slot sets (a plan's `max_in_flight_per_key`) held under the job's id.
#[derive(Debug)]
pub(crate) struct JobCharge {
    pub outcome: crate::budget::Outcome,
    key_slots: Vec<String>,
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

    /// Charges a job (its key's budgets, as a queued request is charged) before its body is
    /// read (DESIGN §8: a refusal is a 429 at once, and no job exists); `Ok(Err(_))` is the
    /// store's refusal, nothing charged. The job then enters its route's queue
    /// ([`Self::enter_charged_job`]), or is given back ([`Self::give_back_job`]).
    ///
    /// With a plan's `max_in_flight_per_key` (`req.key_cap`) the job holds one of its key's
    /// slots from now to its end, under its id, as a request does: for as long as it may wait
    /// (`waits_for`, its `result_ttl`) and then, once it runs, renewed by its runner
    /// ([`Self::job_renew`]); whoever ends it releases it ([`Self::job_release`]).
    pub(crate) async fn charge_job(
        self: &Arc<Self>,
        req: &AdmitRequest,
        id: &str,
        waits_for: Duration,
    ) -> Result<Result<JobCharge, Admission>, StoreError> {
        // As a request's admission: after Redis lost its data, runners register their slots
        // again before this job may take one.
        self.after_data_loss(req).await;
        let start = std::time::Instant::now();
        // It may wait `waits_for` once its units are due (`max_delay`), and until then.
        let key_lease = waits_for + req.longest_hold() + self.lease_ttl;
        let decided = self
            .try_admit_leasing(req, Default::default(), id.to_string(), key_lease)
            .await?
            .0;
        Ok(match decided {
            Decided::KeyAdmitted(outcome, key_slots, _) => Ok(JobCharge { outcome, key_slots }),
            other => Err(self.answer(req, other, start).admission),
        })
    }

    /// Whether route `req.route`'s queue would refuse a job of `req`'s key now (`max_queue`
    /// waiters and no slot for it), asked before the job's body is read so that a full
    /// queue's 503 comes at once (DESIGN §3). `false` when Redis does not answer: the job's
    /// entry decides then.
    pub(crate) async fn job_queue_full(self: &Arc<Self>, req: &AdmitRequest, cap: u32) -> bool {
        let Some(max) = req.fair.max_queue else {
            return false;
        };
        let Ok(rk) = Self::route_keys(&req.route) else {
            return false;
        };
        let mut inv = self.queue_script.call(&rk, "full");
        inv.arg(keys::key_tag(&req.key))
            .arg(cap)
            .arg(req.fair.per_key.unwrap_or(0))
            .arg(max)
            .arg(req.fair.since)
            .arg(GRANT_TTL.as_micros() as u64);
        let full: Result<Vec<i64>, _> = self.call(inv).await;
        full.is_ok_and(|v| v.first() == Some(&1))
    }

    /// Enters a charged job (its record written) in its route's queue as the fleet's waiter
    /// `id`. A full queue gives the charge back; so does an error (the job may have entered:
    /// the caller cancels its record, so that a grant finds it so and passes the slot on).
    pub(crate) async fn enter_charged_job(
        self: &Arc<Self>,
        req: &AdmitRequest,
        cap: u32,
        (id, waits_for): (&str, Duration),
        charge: JobCharge,
    ) -> Result<JobEntered, StoreError> {
        let entered = self
            .enter_admitted_job(req, cap, (id, waits_for), &charge.outcome)
            .await;
        if !matches!(&entered, Ok(JobEntered::Taken(_) | JobEntered::Queued(..))) {
            self.give_back_job(req, id, charge).await;
        }
        entered
    }

    /// A charged job that is not made after all (its body stalled, was too large, or its
    /// record could not be written; its queue refused it): its charge back, then its key's
    /// slot. Each budget's level once the charge is back, when the refund said (and budget
    /// slices are off).
    pub(crate) async fn give_back_job(
        self: &Arc<Self>,
        req: &AdmitRequest,
        id: &str,
        charge: JobCharge,
    ) -> Option<Vec<i64>> {
        let levels = self
            .give_back(req, charge.key_slots, id.to_string(), 0)
            .await;
        // Budget slices' held units are not in the levels.
        levels.filter(|_| !self.slices_on)
    }

    /// `waits_for`: how long the job may wait (its record's `result_ttl`): the route's queue
    /// is kept at least as long, so that a fleet down longer than the queue's idle expiry
    /// still finds its queued jobs when it is back.
    async fn enter_admitted_job(
        self: &Arc<Self>,
        req: &AdmitRequest,
        cap: u32,
        (id, waits_for): (&str, Duration),
        outcome: &crate::budget::Outcome,
    ) -> Result<JobEntered, StoreError> {
        // `max_delay`: its units were reserved ahead (its record says so too): the queue
        // serves it no sooner than they are due, whole milliseconds from now, as its record
        // counts them from its writing (a little earlier), and it may wait `waits_for` after.
        let hold_us = outcome.delay_us().div_ceil(1000) * 1000;
        let rk = Self::route_keys(&req.route)?;
        let mut inv = self.enter_as(&rk, id, req, cap, FLEET, FLEET_ALIVE);
        inv.arg(waits_for.as_micros() as u64 + hold_us).arg(hold_us);
        let entered: Vec<i64> = self.call(inv).await?;
        let standing: Standing = outcome.into();
        Ok(match entered.first().copied() {
            Some(1) => JobEntered::Taken(standing),
            Some(0) => JobEntered::Queued(standing, entered.get(1).copied().unwrap_or(0) as u64),
            _ => {
                let standing = standing.given_back(req.limits(), req.cost);
                JobEntered::Refused(Box::new(Admission::RouteBusy {
                    standing,
                    queued: Duration::ZERO,
                    full: true,
                }))
            }
        })
    }

    /// Wakes `notify` whenever the queue grants a slot to the fleet's jobs (it publishes each
    /// grant on `tollgate:q:jobs`, as it does for an instance's waiters), for as long as the
    /// store lives: the collector then takes it at once instead of at its next round.
    pub(crate) async fn watch_fleet_grants(self: Arc<Self>, notify: Arc<tokio::sync::Notify>) {
        let channel = format!("tollgate:q:{FLEET}");
        let store = Arc::downgrade(&self);
        drop(self);
        super::conn::subscribed(store, channel, move |_, _| notify.notify_one()).await;
    }

    /// Frees the key's slot a job held (`key`), the job never having had its route's.
    pub(crate) async fn job_release_key(&self, key: &KeyHash, id: &str) -> Result<(), StoreError> {
        self.lease_op(&[keys::key_slots_key(key)], id, 0).await
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
        // (Index 2 counts the owed charges that follow the grants, never the fleet's; index 3
        // the charges owed on the route.)
        let ids = reply
            .iter()
            .skip(4)
            .take(n)
            .filter_map(|v| redis::from_redis_value::<String>(v.clone()).ok())
            .collect();
        Ok((ids, waiting))
    }

    /// Renews the job's slot for a whole lease (a grant is confirmed the same way), and its
    /// key's slot if it holds one (`key`); `false` when the route's lapsed.
    pub(crate) async fn job_renew(
        &self,
        route: &str,
        id: &str,
        key: Option<&KeyHash>,
    ) -> Result<bool, StoreError> {
        let rk = Self::route_keys(route)?;
        let mut inv = self.queue_script.call(&rk, "confirm");
        inv.arg(id).arg(self.lease_ttl.as_micros() as u64);
        let v: Vec<i64> = self.call(inv).await?;
        if let Some(key) = key {
            let ttl_us = self.lease_ttl.as_micros() as u64;
            self.lease_op(&[keys::key_slots_key(key)], id, ttl_us)
                .await?;
        }
        Ok(v.first() == Some(&1))
    }

    /// The job this instance now runs holds its route's slot as a request's lease does: it
    /// is registered, so that when Redis loses its data (`lost.rs`) the slot is registered
    /// again before other instances take slots (without it, a restart let a second job run
    /// beside it on a cap of 1: tests/jobs_fleet).
    /// (And its key's slot, `key`, if it holds one.) Registered again, its route lease counts
    /// for `owner`, the job's key, as the queue counted it.
    pub(crate) fn job_hold(
        self: &Arc<Self>,
        route: &str,
        id: &str,
        key: Option<&KeyHash>,
        owner: &KeyHash,
    ) {
        let mut sets = vec![keys::route_slots_key(route)];
        sets.extend(key.map(keys::key_slots_key));
        let held = super::lease::Sets::new(sets, Some(keys::key_tag(owner)));
        crate::store::lock(&self.held)
            .live
            .insert(id.to_string(), held);
        self.watch_for_data_loss();
    }

    /// Frees the job's slot (handing it on), and its key's (`key`) if it holds one.
    pub(crate) async fn job_release(
        &self,
        route: &str,
        id: &str,
        key: Option<&KeyHash>,
    ) -> Result<(), StoreError> {
        crate::store::lock(&self.held).live.remove(id);
        let rk = Self::route_keys(route)?;
        // Sent again on a new connection if Redis closed this one (a release run twice is
        // one); a failure leaves the slot to its lease's end.
        let _: Vec<i64> = self
            .call_repeatable(self.queue_script.release(&rk, id))
            .await?;
        if let Some(key) = key {
            self.lease_op(&[keys::key_slots_key(key)], id, 0).await?;
        }
        Ok(())
    }

    /// Takes a queued job out of its route's queue: 0 left, 1 granted (the caller releases
    /// the slot), 2 no longer there.
    pub(crate) async fn job_leave(&self, route: &str, id: &str) -> Result<i64, StoreError> {
        let rk = Self::route_keys(route)?;
        let v: Vec<i64> = self.call(leave(&self.queue_script, &rk, id)).await?;
        Ok(v.first().copied().unwrap_or(2))
    }

    /// A queued job's place in its route's fair order (1: next; 0: not waiting, granted).
    pub(crate) async fn job_place(&self, route: &str, id: &str) -> Result<u64, StoreError> {
        let rk = Self::route_keys(route)?;
        let mut inv = self.queue_script.call(&rk, "place");
        inv.arg(id);
        let v: Vec<u64> = self.call(inv).await?;
        Ok(v.first().copied().unwrap_or(0))
    }

    /// The ids of the fleet's jobs waiting on `route`, oldest first, at most `most`.
    pub(crate) async fn queued_jobs(
        &self,
        route: &str,
        most: u32,
    ) -> Result<Vec<String>, StoreError> {
        let rk = Self::route_keys(route)?;
        let mut inv = self.queue_script.call(&rk, "jobs");
        inv.arg(most);
        self.call(inv).await
    }

    /// One `lua/jobs.lua` operation on the record of job `id`.
    pub(crate) async fn job_record<T: redis::FromRedisValue>(
        &self,
        id: &str,
        op: &str,
        args: &[&[u8]],
    ) -> Result<T, StoreError> {
        let mut inv = Call::new(&self.job_script.0);
        inv.key(keys::job_key(id)).arg(op);
        for a in args {
            inv.arg(*a);
        }
        self.call(inv).await
    }

    pub(crate) fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// Whether this instance may declare lost a running job whose runner's word for it has
    /// been found lapsed for `ago` (by Redis's clock, from read to read, at most a second
    /// between two: `lua/jobs.lua` `get`). After Redis was silent for longer than `lease_ttl`
    /// (a stall, a failover, the whole fleet cut off), every runner's word has lapsed by
    /// Redis's clock although none stopped: a read must leave the runners
    /// [`Self::runners_recover_within`] to renew (DESIGN §8 loses only a job whose instance
    /// died). So an instance that found Redis silent within that time does not declare; any
    /// instance does once reads have found the lapse that long (also one whose way to Redis
    /// keeps failing now and then; a silence between two reads counts a second at most).
    pub(crate) fn may_find_jobs_lost(&self, ago: Duration) -> bool {
        let recover = self.runners_recover_within();
        ago >= recover || self.breaker.since_silence().is_none_or(|s| s >= recover)
    }

    /// How long after Redis answers again a live runner has renewed its word for its job:
    /// its breaker lets a call through within half a second, its renewal is tried again at
    /// least every quarter of its tick (a third of `lease_ttl`), and a try may wait out
    /// `store.timeout`; with room to spare.
    fn runners_recover_within(&self) -> Duration {
        Duration::from_secs(3) + self.lease_ttl / 4 + self.timeout
    }

    pub(crate) fn instance(&self) -> &str {
        &self.instance
    }
}

/// How long the fleet counts as alive after a submission or a collector's beat: jobs outlive
/// a gap in the fleet's beats (every instance with an async route beats for it five times a
/// second, `fleet::COLLECT_EVERY`).
const FLEET_ALIVE: Duration = Duration::from_secs(30);
