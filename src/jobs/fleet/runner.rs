//! Running a job this instance claimed: the request sent as the synchronous path sends it,
//! its slot and record renewed meanwhile, the result written back, the charge settled.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::metrics::{self, InState, JobResult, JobState};
use super::super::run::problem_result;
use super::super::send::{self, Sent};
use super::super::Stored;
use super::backend;
use super::record::{self, claimed, client_of, headers_json, text, wait_of};
use crate::admission::InFlight;
use crate::problem::Problem;
use crate::route::stated::Report;
use crate::route::Route;
use crate::state::{Running, Shared};
use crate::store::redis::RedisBackend;
use crate::store::{AdmitRequest, Charge};
use crate::telemetry::access;

/// Runs a claimed job whose slot this instance holds (confirmed at `from`), once `wait` is
/// over (`max_delay`), renewing both while it runs; `retired`: the last config that had its
/// route async, if a reload took it away since: the job runs under it.
pub(super) async fn run_claimed(
    shared: Arc<Shared>,
    id: Arc<str>,
    label: Arc<str>,
    (wait, from): (Duration, tokio::time::Instant),
    retired: Option<Arc<Running>>,
) {
    let Some(b) = backend(&shared).cloned() else {
        return;
    };
    // Claimed: a drain waits for it from here, its record's read included.
    let _drain = shared.drain.enter();
    let running = retired.unwrap_or_else(|| shared.running());
    let give_up = super::claim_gives_up(&b, from);
    let Some((r, route, who, request)) = claimed(&b, &running, &id, &label, give_up).await else {
        let _ = b.job_release(&label, &id, None).await;
        return;
    };
    // Its wait from its submission to its claim: held for its `max_delay` turn (the queue
    // served it no sooner), then queued for a slot.
    let (waited, held, queued) = wait_of(&r);
    let begun = Instant::now();
    let key = super::key_slot(&who).copied();
    // Settled as it was charged, whatever a reload changed since.
    let Some(admit) = super::charged::admit_of(&r, Some(&route), &who) else {
        let _ = b.job_release(&label, &id, None).await;
        return;
    };
    let _state = InState::new(&label, JobState::Running);
    let rm = running.metrics.get(&route);
    let in_flight = InFlight::new(&rm.in_flight);
    b.job_hold(&label, &id, key.as_ref(), &admit.key);
    let renew = keep_alive(b.clone(), id.clone(), label.clone(), key, from);
    // `max_delay`: what is left of its hold (the queue served it once it was due: clocks'
    // rounding at most), waited out all the same: it is sent no sooner.
    tokio::time::sleep(wait).await;
    let max = route.jobs.map_or(16 << 20, |j| j.max_response_body);
    let started = Instant::now();
    let sent = send::send(
        &running,
        shared.tracing.as_ref(),
        &route,
        &id,
        &request,
        max,
        queued,
    )
    .await;
    let Settled {
        state,
        stored,
        mut cost,
        upstream_status,
        upstream,
        report,
        follow,
    } = settle(&shared, &route, &admit, sent, started).await;
    // The slot follows a late answer from now on, while the result is written (readable
    // meanwhile): its time is the upstream's, not that of writes Redis is slow to take.
    let followed = async {
        match follow {
            Some(f) => Some(
                f.until_done(&route, started, upstream.unwrap_or_default())
                    .await,
            ),
            None => None,
        }
    };
    let (mine, told) = tokio::join!(
        write_result(&b, &id, state, &stored, WRITE_FOR_AT_MOST),
        followed
    );
    // A timed-out job's upstream time is observed as it is billed, once its late answer came.
    if let (Some(u), None) = (upstream, &told) {
        rm.upstream_duration.observe(u.as_secs_f64());
    }
    if let Some(r) = report {
        rm.cost_report(r);
    }
    if let Some(told) = told {
        cost = route
            .fidelity
            .charge(admit.cost, Some(told.upstream), told.report);
        shared.store.settle(&admit, Charge::Shared, cost).await;
        rm.upstream_duration.observe(told.upstream.as_secs_f64());
        if let Some(r) = told.report {
            rm.cost_report(r);
        }
    }
    renew.abort();
    // A renewal still on its way would make the key's lease again after the release.
    let _ = renew.await;
    let _ = b.job_release(&label, &id, key.as_ref()).await;
    drop(in_flight);
    if cost > 0 {
        rm.cost_units.inc_by(cost);
    }
    if !mine {
        // Found lost meanwhile: its end is counted once, here if no reader took it.
        record::count_lost(&shared.running(), &b, &id).await;
        return;
    }
    metrics::ended(&label, state);
    if access::enabled() {
        let key = who.log_name();
        let rid = text(&r, "rid");
        let trace = crate::jobs::send::trace_of(shared.tracing.is_some(), &request.header.headers);
        access::write(&access::AccessRecord {
            method: request.header.method.as_str(),
            route: &label,
            key: &key,
            cost,
            decision: state.verdict(),
            status: stored.status,
            // From its submission, as on the memory store: its wait, then its run.
            latency_ms: access::millis(waited + begun.elapsed()),
            upstream_ms: upstream.map(access::millis),
            store_ms: 0.0,
            queue_ms: access::millis(queued),
            hold_ms: access::millis(held + wait),
            upstream_status,
            request_id: (!rid.is_empty()).then_some(rid.as_str()),
            trace_id: trace.as_ref().map(|t| t.as_str()),
            fallback: false,
            shadow: None,
            client: client_of(&r),
            error: None,
            job: Some(&id),
        });
    }
}

/// Renews the job's slot and its runner's word for it every third of lease_ttl (the first
/// time a third of it after `from`, when its slot was confirmed), until aborted.
fn keep_alive(
    b: Arc<RedisBackend>,
    id: Arc<str>,
    label: Arc<str>,
    key: Option<crate::identity::KeyHash>,
    from: tokio::time::Instant,
) -> tokio::task::JoinHandle<()> {
    let every = b.lease_ttl() / 3;
    let alive = (b.lease_ttl().as_millis() as u64).to_string();
    tokio::spawn(async move {
        let mut wait = (from + every).saturating_duration_since(tokio::time::Instant::now());
        let mut retrying = false;
        loop {
            tokio::time::sleep(wait).await;
            let slot = b.job_renew(&label, &id, key.as_ref()).await.is_ok();
            let args: [&[u8]; 1] = [alive.as_bytes()];
            let record = b.job_record::<i64>(&id, "renew", &args).await.is_ok();
            // A renewal that failed (a stall, the breaker still open after one) is sent again
            // soon, not a third of the lease later: two missed in a row let the lease lapse,
            // and the next read declared the running job lost. Backed off (doubling up to a
            // quarter of the tick, so that several tries still fit in what is left of the
            // lease; each job at its own moment), so that many jobs do not press a Redis that
            // answers only some calls.
            wait = if slot && record {
                every
            } else if !retrying {
                RENEW_AGAIN_AFTER
                    .mul_f64(1.0 + rand::random::<f64>())
                    .min(every / 4)
            } else {
                (wait * 2).min(every / 4)
            };
            retrying = !(slot && record);
        }
    })
}

/// When a renewal that failed is sent again.
const RENEW_AGAIN_AFTER: Duration = Duration::from_millis(100);

/// When a result that could not be written is sent again: after this, doubling up to
/// [`WRITE_AGAIN_AT_MOST`] (a write that fails for as long as the store does not count
/// against its breaker more than it must).
const WRITE_AGAIN_AFTER: Duration = Duration::from_millis(250);
const WRITE_AGAIN_AT_MOST: Duration = Duration::from_secs(2);
/// How seldom a result is sent again once it has been tried for two leases.
const WRITE_AGAIN_AT_MOST_LATER: Duration = Duration::from_secs(10);
/// How long a result is sent again while the store does not answer (a SIGTERM's drain waits
/// for it up to `grace_period`).
const WRITE_FOR_AT_MOST: Duration = Duration::from_secs(300);

/// Writes the job's end into its record (kept result_ttl from now); a record no longer this
/// run's (declared lost meanwhile) keeps what it says. A write the store did not answer is
/// sent again (the runner goes on vouching for the job, and holding its slot, meanwhile) for
/// up to `within` ([`WRITE_FOR_AT_MOST`]): an outage must not lose the upstream's answer and
/// end the job `job-lost` (a resend of a write that did run is recognised, `lua/jobs.lua`;
/// the runner's renewals, sent again as well, reach Redis with it, and a read after a
/// silence leaves them time to: `RedisBackend::may_find_jobs_lost`). False when the record
/// was not this run's, or the write never went through: the instance that finds the job
/// lost counts its end and writes its last line (`record::ended_unrun`).
async fn write_result(
    b: &RedisBackend,
    id: &str,
    state: JobResult,
    stored: &Stored,
    within: Duration,
) -> bool {
    let rheaders = headers_json(&stored.headers.iter().cloned().collect());
    let status = stored.status.to_string();
    let fields: [&[u8]; 7] = [
        state.as_str().as_bytes(),
        b"status",
        status.as_bytes(),
        b"rheaders",
        &rheaders,
        b"rbody",
        &stored.body,
    ];
    let began = Instant::now();
    let give_up = began + within;
    let mut again = WRITE_AGAIN_AFTER;
    loop {
        match b.job_record::<i64>(id, "finish", &fields).await {
            Ok(n) => return n != 0,
            Err(e) if Instant::now() + again < give_up => {
                tracing::debug!(job = id, error = %e, "a job's result could not be written yet: sent again");
                tokio::time::sleep(again).await;
                // Each try sends the whole result again: seldom, once the outage is long.
                let most = if began.elapsed() < b.lease_ttl() * 2 {
                    WRITE_AGAIN_AT_MOST
                } else {
                    WRITE_AGAIN_AT_MOST_LATER
                };
                again = (again * 2).min(most);
            }
            Err(e) => {
                tracing::warn!(job = id, error = %e, "a job's result could not be written; the job ends lost");
                return false;
            }
        }
    }
}

/// A job's end: its state, result, charge, what the upstream answered and took, and a late
/// answer to follow.
struct Settled {
    state: JobResult,
    stored: Stored,
    cost: u64,
    upstream_status: Option<u16>,
    /// Until the answer's head (or its end, for an answer over `max_response_body`).
    upstream: Option<Duration>,
    /// What became of the cost the upstream stated (`cost_from_response`).
    report: Option<Report>,
    follow: Option<Box<send::Follow>>,
}

impl Settled {
    fn failed(stored: Stored, cost: u64, upstream: Option<Duration>) -> Settled {
        Settled {
            state: JobResult::Failed,
            stored,
            cost,
            upstream_status: None,
            upstream,
            report: None,
            follow: None,
        }
    }
}

/// The job's result, state and final charge, the charge settled as DESIGN §3 says.
async fn settle(
    shared: &Shared,
    route: &Route,
    admit: &AdmitRequest,
    sent: Sent,
    started: Instant,
) -> Settled {
    let store = &shared.store;
    let billed = |upstream: Duration| route.fidelity.final_cost(admit.cost, Some(upstream));
    match sent {
        Sent::Answer {
            stored,
            upstream,
            report,
        } => {
            let total = route.fidelity.charge(admit.cost, Some(upstream), report);
            store.settle(admit, Charge::Shared, total).await;
            let status = stored.status;
            Settled {
                state: JobResult::Done,
                stored,
                cost: total,
                upstream_status: Some(status),
                upstream: Some(upstream),
                report,
                follow: None,
            }
        }
        Sent::Unreachable(_) => {
            store.refund(admit, Charge::Shared).await;
            let p = problem_result(
                Problem::BadGateway,
                "the upstream could not be reached; the job's charge was refunded",
            );
            Settled::failed(p, 0, None)
        }
        Sent::TimedOut(follow) => {
            // Charged; settled (for measured time) once the late answer has been followed.
            // Its upstream time is a synchronous 504's: until the timeout.
            let p = problem_result(Problem::GatewayTimeout, "the upstream did not answer within read_timeout; it had the request, so the charge stands");
            Settled {
                follow: Some(follow),
                ..Settled::failed(p, admit.cost, Some(started.elapsed()))
            }
        }
        Sent::TooLarge { upstream } => {
            let total = billed(upstream);
            store.settle(admit, Charge::Shared, total).await;
            let p = problem_result(Problem::JobResponseTooLarge, "the upstream's answer is larger than async.max_response_body; it did the work, so the charge stands");
            Settled::failed(p, total, Some(upstream))
        }
        Sent::Broken { upstream, .. } => {
            let total = billed(upstream);
            store.settle(admit, Charge::Shared, total).await;
            let p = problem_result(Problem::BadGateway, crate::jobs::send::BROKEN);
            Settled::failed(p, total, Some(upstream))
        }
    }
}
