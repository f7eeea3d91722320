//! Jobs on a Redis fleet (one node or Sentinel; DESIGN §8): the record in Redis
//! (`store/lua/jobs.lua`), the waiter the fleet's (`store/redis/jobs.rs`), so that a queued
//! job outlives the instance that accepted it and any instance with the route runs it. A job
//! runs at most once: a grant goes to one beat, and a record is claimed `queued → running`
//! once; a runner that stops vouching for its job (it died) leaves it `failed` (`job-lost`,
//! charged) at the next read, and its slot comes back with its lapsed lease.

mod charged;
mod out;
mod record;
mod runner;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::metrics;
use super::run::{expired_result, problem_result, Submission};
use super::{new_id, NewJob, Stored, View};
use crate::identity::KeyHash;
use crate::problem::Problem;
use crate::state::{Running, Shared};
use crate::store::redis::{JobCharge, JobEntered, RedisBackend};
use crate::store::{Admission, AdmitRequest, Store};
use bytes::Bytes;
pub use out::cancel;
use out::{expire_overdue, key_slot};
use record::{field, headers_from, payer, read, text};
use runner::run_claimed;

/// How often an instance takes the slots granted to the fleet's jobs on each async route.
const COLLECT_EVERY: Duration = Duration::from_millis(200);
/// How often an instance looks at each async route's oldest queued jobs for those that have
/// waited `result_ttl` (expired and refunded then, polled or not), and how many it looks at.
const EXPIRE_EVERY: Duration = Duration::from_secs(1);
const EXPIRE_LOOKS_AT: u32 = 10;

fn backend(shared: &Shared) -> Option<&Arc<RedisBackend>> {
    match &shared.store {
        Store::Redis(r) => Some(r.shared()),
        Store::Memory(_) => None,
    }
}

/// Charges a job before its body is read (its key's budgets, and its key's slot under the
/// job's id, `new_id`): the id and the charge; `Err` is the store's refusal, or 503 when Redis
/// did not answer (what a call that may have run charged is given back).
pub(super) async fn charge(
    b: &Arc<RedisBackend>,
    admit: &AdmitRequest,
    waits_for: Duration,
) -> Result<(Arc<str>, JobCharge), Admission> {
    let id = new_id();
    match b.charge_job(admit, &id, waits_for).await {
        Ok(Ok(charge)) => Ok((id, charge)),
        Ok(Err(refused)) => Err(refused),
        Err(e) => {
            // A call that may have run is undone by its id already (`RedisBackend::deliver`):
            // a refund here too gave the key its cost twice.
            tracing::warn!(error = %e, "a job could not be charged");
            Err(Admission::Unavailable)
        }
    }
}

/// Writes a charged job's record and enters it in the route's queue; `Err` is the refusal of
/// its full queue, or 503 when Redis did not answer, the charge given back (no job).
pub(super) async fn submit(
    shared: &Arc<Shared>,
    b: &Arc<RedisBackend>,
    job: NewJob<'_>,
    (admit, id, charge): (AdmitRequest, Arc<str>, JobCharge),
) -> Result<Submission, Admission> {
    let ttl = job.rules.result_ttl;
    let hold = Duration::from_micros(charge.outcome.delay_us());
    if !record::put(
        b,
        &id,
        (&job.route.label, &admit),
        job.who,
        (ttl, hold),
        &job.request,
        &job.origin,
    )
    .await
    {
        b.give_back_job(&admit, &id, charge).await;
        return Err(Admission::Unavailable);
    }
    // A plan's max_in_flight_per_key counts the job from its charge to its end.
    let entered = b
        .enter_charged_job(&admit, job.cap, (&id, ttl), charge)
        .await;
    let (standing, position) = match entered {
        Ok(JobEntered::Taken(s)) => {
            start(shared, b, id.clone(), job.route.label.clone(), None).await;
            (s, 0)
        }
        Ok(JobEntered::Queued(s, p)) => {
            shared.queued_jobs.note(&job.route.label, &job.running);
            (s, p as usize)
        }
        Ok(JobEntered::Refused(a)) => {
            out::withdraw(b, &id).await;
            return Err(*a);
        }
        Err(e) => {
            // Maybe queued: the record is cancelled (a grant then finds it so and passes the
            // slot on); the charge was given back.
            tracing::warn!(error = %e, "a job could not enter its route's queue");
            out::withdraw(b, &id).await;
            return Err(Admission::Unavailable);
        }
    };
    drop(job.running);
    Ok(Submission {
        id,
        standing,
        position,
        hold,
    })
}

/// What a claim of a job whose slot this instance holds found.
enum Claimed {
    /// `queued → running`, this runner's: run it once this is over (`max_delay`).
    Run(Duration),
    /// Cancelled, gone or unreachable: release the slot.
    Not,
    /// It had waited result_ttl: now `expired`, to refund.
    Expired,
    /// It runs, and its runner vouches for it: the slot is that run's (its lease lapsed and
    /// came back through the queue), renewed and released by the runner.
    Running,
}

/// One claim of job `id` as this instance's run, with `token`: a claim sent again with the
/// same token is taken for the same claim (`lua/jobs.lua`); an error: Redis did not answer,
/// and the claim may have run.
async fn claim(
    b: &RedisBackend,
    id: &str,
    token: &str,
) -> Result<Claimed, crate::store::StoreError> {
    let alive = (b.lease_ttl().as_millis() as u64).to_string();
    let args: [&[u8]; 3] = [b.instance().as_bytes(), alive.as_bytes(), token.as_bytes()];
    Ok(
        match b
            .job_record::<Vec<u64>>(id, "claim", &args)
            .await?
            .as_slice()
        {
            [1, wait_ms] => Claimed::Run(Duration::from_millis(*wait_ms)),
            [2] => Claimed::Expired,
            [3] => Claimed::Running,
            _ => Claimed::Not,
        },
    )
}

/// Until when a claim and the claimed job's read are sent again, from `from` (when its slot
/// was confirmed, held for `lease_ttl` from then): half the lease, so that the run's first
/// renewal (a third of the lease from then, or at once when the run starts later) still
/// comes before the slot lapses.
pub(super) fn claim_gives_up(b: &RedisBackend, from: tokio::time::Instant) -> tokio::time::Instant {
    from + b.lease_ttl() / 2
}

/// Runs, refunds or passes on a job whose slot this instance now holds; `retired`: the last
/// config that had its route async, if a reload took the route (or its `async:`) away since.
/// A claim Redis did not answer (it may have run) is sent again with the same token from a
/// task of its own (the collector and the submission go on meanwhile; a drain waits for it),
/// until [`claim_gives_up`]; past that the slot is given up.
async fn start(
    shared: &Arc<Shared>,
    b: &RedisBackend,
    id: Arc<str>,
    label: Arc<str>,
    retired: Option<Arc<Running>>,
) {
    let from = tokio::time::Instant::now();
    let token = out::token();
    let claimed = match claim(b, &id, &token).await {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(job = %id, error = %e, "a job's claim went unanswered: sent again");
            let shared = shared.clone();
            let drain = shared.drain.enter();
            tokio::spawn(async move {
                let _drain = drain;
                let Some(b) = backend(&shared).cloned() else {
                    return;
                };
                let give_up = claim_gives_up(&b, from);
                let claimed = record::sent_again(give_up, || claim(&b, &id, &token))
                    .await
                    .unwrap_or_else(|e| {
                        tracing::warn!(job = %id, error = %e, "a job's claim went unanswered; its slot is given up");
                        Claimed::Not
                    });
                act(&shared, &b, (id, label, retired), claimed, from).await;
            });
            return;
        }
    };
    act(shared, b, (id, label, retired), claimed, from).await;
}

/// Does what a claim found: runs the job (its slot confirmed at `from`), refunds it, leaves
/// it to its runner, or passes its slot on.
async fn act(
    shared: &Arc<Shared>,
    b: &RedisBackend,
    (id, label, retired): (Arc<str>, Arc<str>, Option<Arc<Running>>),
    claimed: Claimed,
    from: tokio::time::Instant,
) {
    match claimed {
        Claimed::Run(wait) => {
            tokio::spawn(run_claimed(
                shared.clone(),
                id,
                label,
                (wait, from),
                retired,
            ));
        }
        Claimed::Expired => out::expired(shared, b, &id, &label).await,
        Claimed::Running => {}
        Claimed::Not => {
            // Cancelled (its key's slot went then) or gone.
            let _ = b.job_release(&label, &id, None).await;
        }
    }
}

/// A job as a poll sees it, with its route; `None`: not this key's, unknown or gone; an
/// error: Redis did not answer (the job may well exist: not a 404).
pub async fn view(
    shared: &Shared,
    id: &str,
    key: &KeyHash,
) -> Result<Option<(Arc<str>, View)>, crate::store::StoreError> {
    let Some(b) = backend(shared) else {
        return Ok(None);
    };
    let Some(r) = read(b, id).await? else {
        return Ok(None);
    };
    if field(&r, "key") != hex::encode(key).as_bytes() {
        return Ok(None);
    }
    let route: Arc<str> = Arc::from(text(&r, "route"));
    if record::uncounted(&r) {
        record::count_lost(&shared.running(), b, id).await;
    }
    if record::overdue(&r) {
        let running = shared.running();
        if let Some(who) = payer(&running, field(&r, "key")) {
            if out::take_out(shared, &running, b, (id, &r), &who, "expire").await? {
                return Ok(Some((route, View::Done(Arc::new(expired_result())))));
            }
        }
    }
    let view = match field(&r, "state") {
        // Its place in the fleet's fair order now (0: granted, about to run).
        b"queued" => View::Queued {
            position: b.job_place(&route, id).await? as usize,
            due_in: due_in(&r),
        },
        b"running" => View::Running { due_in: due_in(&r) },
        b"expired" => View::Done(Arc::new(expired_result())),
        b"done" | b"failed" if field(&r, "lost") == b"1" => View::Done(Arc::new(problem_result(
            Problem::JobLost,
            "the instance running the job stopped; the upstream had it, so the charge stands and it is not run again",
        ))),
        b"done" | b"failed" => View::Done(Arc::new(Stored {
            status: text(&r, "status").parse().unwrap_or(502),
            headers: headers_from(field(&r, "rheaders")),
            body: Bytes::copy_from_slice(field(&r, "rbody")),
        })),
        _ => return Ok(None),
    };
    Ok(Some((route, view)))
}

/// Until a job's reserved units are due (`max_delay`), as its record's read said.
fn due_in(r: &record::Record) -> Duration {
    Duration::from_millis(text(r, "due_in").parse().unwrap_or(0))
}

/// Takes the slots granted to the fleet's jobs, on every async route, for as long as the
/// process runs: each grant goes to one instance's call, which confirms it, claims the job
/// and runs it.
pub fn start_collector(shared: Arc<Shared>) {
    let started = crate::background::spawn("tollgate-jobs".into(), move || async move {
        let Some(b) = backend(&shared) else { return };
        // A grant to the fleet is taken when Redis publishes it; the rounds every
        // COLLECT_EVERY catch one whose message was missed (a reconnect).
        // (Its connection is opened with the first async route: a gateway without one keeps
        // to its one connection per worker thread.)
        let granted = Arc::new(tokio::sync::Notify::new());
        let mut watching = false;
        let mut routes = Collected::default();
        let mut looked = tokio::time::Instant::now();
        let sweeping = Arc::new(AtomicBool::new(false));
        loop {
            tokio::select! {
                _ = tokio::time::sleep(COLLECT_EVERY) => {}
                _ = granted.notified() => {}
            }
            if shared.drain.is_draining() {
                // A draining instance starts no job: the others take the fleet's queue. Its
                // runtime stays: the jobs it started (their claims, the expiry look) run on
                // it until they end, as the drain waits for them, or the process exits.
                std::future::pending::<()>().await;
            }
            routes.follow(&shared.running());
            routes.adopt(shared.queued_jobs.take());
            if !routes.is_empty() && !std::mem::replace(&mut watching, true) {
                tokio::spawn(b.clone().watch_fleet_grants(granted.clone()));
            }
            let expire = looked.elapsed() >= EXPIRE_EVERY;
            if expire {
                looked = tokio::time::Instant::now();
            }
            let mut sweep = Vec::new();
            for (label, retired) in routes.to_collect() {
                let Ok((ids, waiting)) = b.job_grants(&label).await else {
                    continue;
                };
                metrics::fleet_queued(&label, waiting);
                if retired.is_some() {
                    routes.seen(&label, ids.is_empty() && waiting == 0);
                }
                for id in ids {
                    // Confirming the grant: the key's slot, if any, is renewed by the runner.
                    // A grant that lapsed first went back to the queue (a release now would
                    // take the job out of it), and one whose confirm went unanswered lapses
                    // back there: neither is released here.
                    if matches!(b.job_renew(&label, &id, None).await, Ok(true)) {
                        start(&shared, b, Arc::from(id), label.clone(), retired.clone()).await;
                    }
                }
                if expire && waiting > 0 {
                    sweep.push((label, retired.unwrap_or_else(|| shared.running())));
                }
            }
            // After the grants are confirmed (each within its grant's short time), in a task
            // of its own, one at a time: a take-out Redis may have run unanswered is sent
            // again for a while, and the next grants are not kept waiting for it.
            if !sweep.is_empty() && !sweeping.swap(true, Ordering::AcqRel) {
                let (shared, b) = (shared.clone(), b.clone());
                let held = (shared.drain.enter(), Swept(sweeping.clone()));
                tokio::spawn(async move {
                    let _held = held;
                    for (label, under) in sweep {
                        expire_overdue(&shared, &under, &b, &label).await;
                    }
                });
            }
        }
    });
    if let Err(e) = started {
        tracing::error!(error = %e, "cannot start the async jobs' collector");
    }
}

/// Clears the collector's "sweeping" flag when its expiry look ends, however it ends.
struct Swept(Arc<AtomicBool>);

impl Drop for Swept {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The async routes whose fleet queue this instance collects: those of the config in force,
/// and those a reload took away (or took their `async:` from), under the last config that
/// had them async, until their queue is empty: a job accepted under them still runs, under
/// that config (its upstreams, keys and metrics), as it would have (DESIGN §8), as the memory
/// store's do.
#[derive(Default)]
struct Collected {
    /// The config whose async routes `live` are (compared by pointer: a reload replaces it).
    seen: Option<Arc<Running>>,
    live: Vec<Arc<str>>,
    retired: Vec<Retired>,
}

struct Retired {
    label: Arc<str>,
    /// The last config that had the route async.
    under: Arc<Running>,
    /// Since when its queue has been seen empty, nothing granted: a grant whose confirm went
    /// unanswered is neither waiting nor granted until it lapses back into the queue
    /// (`GRANT_TTL`), so the queue counts as empty only when it stays so for [`EMPTY_FOR`].
    empty_since: Option<std::time::Instant>,
}

/// The routes this instance queued fleet jobs on since its collector last looked, each with
/// the config it accepted them under. A reload may take a route (or its `async:`) away before
/// the collector's next round has seen it at all (they come every 200 ms): its jobs were left
/// in the queue, never collected, when no other instance knew the route.
#[derive(Default)]
pub struct Queued(std::sync::Mutex<HashMap<Arc<str>, Arc<Running>>>);

impl Queued {
    fn note(&self, label: &Arc<str>, running: &Arc<Running>) {
        let mut noted = crate::store::lock(&self.0);
        if !noted.get(label).is_some_and(|r| Arc::ptr_eq(r, running)) {
            noted.insert(label.clone(), running.clone());
        }
    }

    fn take(&self) -> HashMap<Arc<str>, Arc<Running>> {
        std::mem::take(&mut *crate::store::lock(&self.0))
    }
}

/// How long a retired route's queue must stay empty before it is no longer collected.
const EMPTY_FOR: Duration = Duration::from_secs(3);

impl Collected {
    /// Takes the config in force: a route that was async and is no longer retires.
    fn follow(&mut self, running: &Arc<Running>) {
        if self.seen.as_ref().is_some_and(|s| Arc::ptr_eq(s, running)) {
            return;
        }
        let router = &running.config.router;
        let is_async = |label: &str| router.by_label(label).is_some_and(|r| r.jobs.is_some());
        if let Some(before) = self.seen.take() {
            for label in &self.live {
                if !is_async(label) && !self.retired.iter().any(|r| &r.label == label) {
                    self.retired.push(Retired {
                        label: label.clone(),
                        under: before.clone(),
                        empty_since: None,
                    });
                }
            }
        }
        self.retired.retain(|r| !is_async(&r.label));
        self.live = router
            .routes()
            .filter(|r| r.jobs.is_some())
            .map(|r| r.label.clone())
            .collect();
        self.seen = Some(running.clone());
    }

    /// Routes this instance queued jobs on ([`Queued`]): one the config in force no longer
    /// has async retires under the config the jobs were accepted under, as if a round had
    /// seen it before the reload.
    fn adopt(&mut self, queued: HashMap<Arc<str>, Arc<Running>>) {
        for (label, under) in queued {
            if !self.live.contains(&label) && !self.retired.iter().any(|r| r.label == label) {
                self.retired.push(Retired {
                    label,
                    under,
                    empty_since: None,
                });
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.live.is_empty() && self.retired.is_empty()
    }

    /// Each route to collect, with the config to run its jobs under if a reload retired it.
    fn to_collect(&self) -> Vec<(Arc<str>, Option<Arc<Running>>)> {
        let live = self.live.iter().map(|l| (l.clone(), None));
        let retired = self
            .retired
            .iter()
            .map(|r| (r.label.clone(), Some(r.under.clone())));
        live.chain(retired).collect()
    }

    /// What a round saw of a retired route's queue: once it has stayed empty for
    /// [`EMPTY_FOR`], no job of it is left to start.
    fn seen(&mut self, label: &str, empty: bool) {
        let now = std::time::Instant::now();
        self.retired.retain_mut(|r| {
            if &*r.label != label {
                return true;
            }
            if !empty {
                r.empty_since = None;
                return true;
            }
            now.duration_since(*r.empty_since.get_or_insert(now)) < EMPTY_FOR
        });
    }
}
